"""Names as a recogniser hears them: a page named in words that sound like its name.

A recogniser that does not know a name writes what it heard: "goal drive" for Google Drive,
"azon s three" for Amazon S3, "misoft onedrive" for Microsoft OneDrive. The gazetteer's keys
match a name said as written or one edit away (``sidecar.turn.followups.Gazetteer``); these
are further. Each name word gets a sound key (``sound_key``: its consonants, like sounds
merged, vowels dropped, a number said as a word written as its digits), and a name is heard
where a run of the turn's words (fillers skipped, a name word heard as one word or as two)
gives the keys of all the name's words in order, each equal to the word's own key or to it
less one or two of its letters (a syllable the recogniser dropped). Only where the name is
distinctive: its words' keys hold at least ``MIN_KEY_LETTERS`` letters, and the run sounds
like no other name ("koral bay" of "Coral Bay" and "Koral Bay" is neither's). A name said
as written is the gazetteer's to rate, so a run heard here has a word said otherwise.

A name heard is a weak naming (``HEARD_CONFIDENCE``, below the gazetteer's weakest): it never
changes how a turn is searched but in two cases (``sidecar.turn.followups.heard``). A turn that
says nothing but the name (``Heard.only``: "tell me about smb saves" of "SMB / CIFS"; the base's
shared words, heard loosely, aside: "way needs tenal" of "Windows Terminal") is searched as said
with it as its topic, as a weak name said alone is. Otherwise it is a candidate the turn's own
search may confirm (``sidecar.turn.followups.confirmed``: the turn alone's top results all that
page's), so that a short turn naming a page misheard is answered as said instead of being
folded with the page before. Ordinary speech that sounds like a name ("my goal drive") rarely
finds only that page.

The tables are built at load from the snapshot's names (``SoundNames.of``), for bases of at
most ``MAX_NAMES`` names (a larger base's sidecar hears no name), of words a caller says (a key
of at most ``MAX_KEY_LETTERS`` letters), within ``MAX_TABLE_BYTES``: a snapshot's names are its
builder's, so what they cost at load is bounded whatever they are.
"""

from __future__ import annotations

import logging
import re
import sys
from collections.abc import Callable, Iterable, Sequence
from collections.abc import Set as AbstractSet
from dataclasses import dataclass
from itertools import combinations

from index.entities import tokens
from sidecar.turn.sessions import Mention

log = logging.getLogger(__name__)

# A name heard is weaker than any the gazetteer matches (index.entities.WEAK_CONFIDENCE, 0.25):
# it is never the turn's topic until the turn's own search confirms it.
HEARD_CONFIDENCE = 0.2
# The names' words' keys together hold at least this many letters: a shorter name ("Box",
# "S3") sounds like too much ordinary speech.
MIN_KEY_LETTERS = 4
MAX_NAME_WORDS = 4  # a longer name is not said whole as a name, and a run costs more to follow
# A word key of this many letters may be heard with one letter dropped ("azon" for "amazon"),
# of DROP_TWO or more with two (a syllable: "misoft" for "microsoft"); a shorter key only as it
# is (a key of two letters left is too many ordinary words').
DROP_ONE = 4
DROP_TWO = 6
# A name word heard as at most this many said words ("s three" for "s3", "goo gull" for
# "google").
WORD_PIECES = 2
# Names whose sound tables are built; above it no name is heard. Each name's words with their
# drop variants take 0.65-1.6 KB (``SoundNames.nbytes``: 4 MiB at 2,000 names), and a turn's
# lookup grows with the names sharing its words' keys (~20 us a DSTC11 turn at 143 names, ~64 at
# 2,000, ~600 at 20,000): a base of more names than this is one a caller does not name by ear.
MAX_NAMES = 2_000
# A word's drop variants grow with the square of its key's letters (a hostile name of one
# 800-letter word took 347 MB and 32 s): a name word whose key holds more letters than this is
# not one said by ear (the longest in the doc sets' and DSTC11's names hold 11: "oracle object
# storage"'s one-word form; 13 and 15 are identifiers, "readconsoleinputstream"), and neither
# is its name. A shared word of more is heard only as it is.
MAX_KEY_LETTERS = 12
# The tables' bytes (``SoundNames.nbytes``) at most: names past it are not heard. Real names
# take 0.65-1.6 KB each (MAX_NAMES of them ~4 MiB); a name of MAX_NAME_WORDS words of
# MAX_KEY_LETTERS letters, each with 67 drop variants, up to ~85 KB.
MAX_TABLE_BYTES = 16 << 20
# Content words a run must hold to be a turn's only naming (``Heard.only``): in DSTC11's user
# turns against rclone's names, most runs heard were one ordinary word ("great", "price",
# "clean", "star"); a name a recogniser misheard is said in two or more ("goal drive").
ONLY_WORDS = 2
KEYS_KEPT = 4096  # said words whose sound key a table remembers (a conversation's words recur)

# English number words a recogniser writes for a name's digits ("s three" for "S3").
NUMBER_DIGITS = {
    w: str(i)
    for i, w in enumerate(
        "zero one two three four five six seven eight nine ten eleven twelve".split()
    )
}
# Letters that sound alike, merged (a Soundex-like grouping: voiced and voiceless pairs, the
# spellings of one sound); vowels (a first one kept as "a"), "h", "w" and "y" are dropped.
_SPELLINGS = tuple(
    (re.compile(pattern), said)
    for pattern, said in (
        ("ph", "f"), ("ck", "k"), ("c(?=[eiy])", "s"), ("[cgq]", "k"), ("x", "ks"), ("z", "s"),
        ("d", "t"), ("b", "p"), ("v", "f"), ("j", "k"),
    )
)  # fmt: skip
_LATER = re.compile(r"[aeiouhwy]")
_DOUBLE = re.compile(r"(.)\1+")
_VOWEL = frozenset("aeiouy")
_NONE: frozenset[str] = frozenset()


def sound_key(word: str) -> str:
    """A word's sound key: "google" and "goal" "kl", "microsoft" "mkrsft", "amazon" "amsn",
    "three" "3". A word starting with a vowel keeps an "a" for it."""
    digits = NUMBER_DIGITS.get(word)
    if digits is not None:
        return digits
    head = "a" if word[:1] in _VOWEL else ""
    w = word
    for pattern, said in _SPELLINGS:
        w = pattern.sub(said, w)
    return _DOUBLE.sub(r"\1", head + _LATER.sub("", w))


def _joined(first: str, then: str) -> str:
    """The sound key of two words said as one ("appear ansi" as "appearance": "aprns"): the
    second's vowel mark is inside the word now, and a letter at the seam is said once."""
    if not first:
        return then
    then = then[1:] if then[:1] == "a" else then  # "a" in a key only ever marks a first vowel
    return first + (then[1:] if then[:1] == first[-1:] else then)


def _loosely(words: Iterable[str]) -> frozenset[str]:
    """What the base's shared words may be heard as: each word's key less up to two letters,
    its first kept ("tenal" of "terminal"). Looser than a name word's drops: they only tell
    that a caller said the product's name before a page's (``Heard.only``), never which page."""
    heard: set[str] = set()
    for word in words:
        key = sound_key(word)
        heard.add(key)
        if len(key) > MAX_KEY_LETTERS:
            continue
        rest = range(1, len(key))
        for n in (1, 2):
            if len(key) - n >= DROP_ONE - 1:
                heard.update(
                    "".join(c for i, c in enumerate(key) if i not in cut)
                    for cut in combinations(rest, n)
                )
    return frozenset(heard)


def _dropped(key: str) -> set[str]:
    """The key less one letter (keys of DROP_ONE letters or more) or two (DROP_TWO), its first
    letter kept: a syllable the recogniser dropped."""
    if len(key) < DROP_ONE:
        return set()
    most = 2 if len(key) >= DROP_TWO else 1
    rest = range(1, len(key))
    return {
        "".join(c for i, c in enumerate(key) if i not in cut)
        for n in range(1, most + 1)
        for cut in combinations(rest, n)
    }


def _heard_by_ear(keys: Sequence[str]) -> bool:
    """Whether a name of these word keys is one a caller says and a recogniser mishears: of
    MAX_NAME_WORDS words or fewer, each of MAX_KEY_LETTERS letters or fewer, MIN_KEY_LETTERS in
    all."""
    return (
        0 < len(keys) <= MAX_NAME_WORDS
        and max(map(len, keys)) <= MAX_KEY_LETTERS
        and sum(map(len, keys)) >= MIN_KEY_LETTERS
    )


# The most one key takes in the tables as ``_table_bytes`` counts them, beyond its letters: a
# str's header, the set of name keys it may be heard as, and its dict slot (keys many names'
# words share take less: real names take half this estimate).
_KEY_BYTES = sys.getsizeof("") + sys.getsizeof(set()) + 40


def _table_cost(keys: Sequence[str]) -> int:
    """About what a name's words add to the tables: each key and each of its drop variants."""
    return sum((1 + _variants(len(key))) * (_KEY_BYTES + len(key)) for key in keys)


def _variants(letters: int) -> int:
    """How many drop variants ``_dropped`` makes of a key of ``letters`` letters."""
    rest = letters - 1
    if letters < DROP_ONE:
        return 0
    return rest + (rest * (rest - 1) // 2 if letters >= DROP_TWO else 0)


@dataclass(frozen=True, slots=True)
class Heard:
    """A turn's words as heard (``said``: fillers aside) and each run of them heard as one name
    (``runs``: (start, end) -> the name), worked out once per turn."""

    said: list[str]
    runs: dict[tuple[int, int], str]
    keys: list[str]  # the said words' sound keys
    shared: frozenset[str] = frozenset()  # what the base's shared words may be heard as

    def mentions(self) -> tuple[Mention, ...]:
        """Each name heard, once, a weak naming (HEARD_CONFIDENCE)."""
        return tuple(Mention(name, HEARD_CONFIDENCE) for name in dict.fromkeys(self.runs.values()))

    def only(self, content: Callable[[Sequence[str]], list[str]]) -> Mention | None:
        """The one name the turn's ``content`` words are all heard as, in one run of at least
        ONLY_WORDS of them ("tell me about smb saves" of "SMB / CIFS"), if any: the words then
        have no ordinary reading to fall back on, as a weak name said alone has none
        (``followups.only_names``). One word is not enough: an ordinary word one letter off a
        name word ("price?" of "premiumize.me", "great" of "Crypt") is what a follow-up says."""
        if len(self.runs) != 1:
            return None
        (start, end), name = next(iter(self.runs.items()))
        if len(content(self.said[start:end])) < ONLY_WORDS:
            return None
        rest = [*self._unshared(0, start), *self._unshared(end, len(self.said))]
        return None if content(rest) else Mention(name, HEARD_CONFIDENCE)

    def _unshared(self, start: int, end: int) -> list[str]:
        """The said words from ``start`` to ``end`` but those heard as the base's shared words
        ("way needs tenal" of "Windows Terminal", which every page's name holds and a caller
        says before the name: it adds nothing to the name)."""
        kept: list[str] = []
        i = start
        while i < end:
            n = next((n for n in (2, 1) if i + n <= end and self._shared_at(i, n)), 0)
            kept.extend(self.said[i : i + 1] if not n else ())
            i += n or 1
        return kept

    def _shared_at(self, i: int, n: int) -> bool:
        joined = ""
        for key in self.keys[i : i + n]:
            joined = _joined(joined, key)
        return joined in self.shared


class SoundNames:
    """The snapshot's names as sequences of word sound keys, looked up by their first word's
    keys (its own and its drop variants)."""

    def __init__(
        self,
        names: dict[str, tuple[str, ...]],
        skipped: frozenset[str],
        unnamed: frozenset[str],
        shared: frozenset[str] = frozenset(),
    ) -> None:
        self._names = names  # name -> its words (less function and shared words)
        self._keys = {name: tuple(sound_key(w) for w in ws) for name, ws in names.items()}
        self._heard: dict[str, set[str]] = {}  # a key said -> the keys of name words it may be
        self._first: dict[str, list[str]] = {}  # a name word's key -> the names it starts
        for name, keys in self._keys.items():
            self._first.setdefault(keys[0], []).append(name)
            for key in keys:
                for said in (key, *_dropped(key)):
                    self._heard.setdefault(said, set()).add(key)
        self._skipped = skipped  # fillers: never part of a name, never break one
        self._unnamed = unnamed  # function words: no name starts with one
        self._shared = shared  # what the base's shared words may be heard as (``Heard.only``)
        self._kept: dict[str, str] = {}
        # each name word as written: heard as itself only
        self._written = {w: frozenset({sound_key(w)}) for ws in names.values() for w in ws}
        self.nbytes = self._table_bytes()  # counted in the searcher's memory (``held_bytes``)

    def _table_bytes(self) -> int:
        """What the tables hold, as Python counts it: the dicts, their keys, lists and sets (the
        word-key cache, KEYS_KEPT short strings, aside, as the gazetteer's own caches are)."""
        size = sys.getsizeof
        tables = (self._names, self._keys, self._heard, self._first, self._written)
        total = sum(size(table) for table in tables)
        total += sum(
            size(name) + size(ws) + size(self._keys[name]) for name, ws in self._names.items()
        )
        total += sum(size(said) + size(keys) for said, keys in self._heard.items())
        total += sum(size(names) for names in self._first.values())
        return total + sum(size(word) + size(keys) for word, keys in self._written.items())

    @classmethod
    def of(
        cls, names: Iterable[str], function_words: frozenset[str], shared: frozenset[str],
        skipped: frozenset[str], count: int,
    ) -> SoundNames:  # fmt: skip
        """The tables of ``names`` (``count`` of them; none above MAX_NAMES): each name's words
        less ``function_words`` and the ``shared`` words most names hold (they tell no page
        apart, and a caller leaves them out), of MAX_NAME_WORDS or fewer, whose keys hold
        MIN_KEY_LETTERS letters."""
        kept: dict[str, tuple[str, ...]] = {}
        if count > MAX_NAMES:
            return cls(kept, skipped, function_words)
        costed = []
        for name in names:
            ws = tuple(w for w in tokens(name) if w not in function_words and w not in shared)
            keys = [sound_key(w) for w in ws]
            if _heard_by_ear(keys):
                costed.append((_table_cost(keys), name, ws))
        spent = 0
        for cost, name, ws in sorted(costed):  # the cheapest first, whatever the names' order
            spent += cost
            if spent > MAX_TABLE_BYTES:
                log.warning(
                    "%d of %d names are not heard by their sound: their tables would pass %d MiB",
                    len(costed) - len(kept), len(costed), MAX_TABLE_BYTES >> 20,
                )  # fmt: skip
                break
            kept[name] = ws
        return cls(kept, skipped, function_words, _loosely(shared))

    def __len__(self) -> int:
        return len(self._names)

    def find(self, toks: Sequence[str]) -> Heard:
        """The runs of ``toks`` that sound like a name (``Heard``), none said as written (the
        gazetteer's) or sounding like another name too."""
        return Heard(*self._runs(toks), self._shared)

    def _runs(self, toks: Sequence[str]) -> tuple[list[str], dict[tuple[int, int], str], list[str]]:
        """The said words (fillers aside) and each run of them heard as one name: (start, end)
        -> the name."""
        if not self._names:
            return [], {}, []
        kept, skipped = self._kept, self._skipped
        said = [t for t in toks if t not in skipped]
        keys = [kept.get(t) or self._key(t) for t in said]
        found: dict[tuple[int, int], str] = {}
        for i, word in enumerate(said):
            if word in self._unnamed:
                continue  # most words: no name's word is heard from here
            starting = self._starting(said, keys, i)
            if not starting:
                continue
            heard = [(name, run) for name in starting for run in self._follows(said, keys, i, name)]
            if len(heard) == 1 and heard[0][1][1]:  # one name, said otherwise than written
                found[(i, heard[0][1][0])] = heard[0][0]
        return said, found, keys

    def _key(self, word: str) -> str:
        """``sound_key``, remembered for the KEYS_KEPT words last asked about."""
        if len(self._kept) >= KEYS_KEPT:
            self._kept = {}  # a new dict: another thread may be reading the old one
        found = self._kept[word] = sound_key(word)
        return found

    def _starting(self, said: Sequence[str], keys: Sequence[str], i: int) -> set[str]:
        """The names whose first word the words from ``i`` may be heard as."""
        names: set[str] = set()
        joined = ""
        for n in range(min(WORD_PIECES, len(keys) - i)):
            joined = _joined(joined, keys[i + n])
            for key in self._may_be(said, i, n + 1, joined):
                names.update(self._first.get(key, ()))
        return names

    def _follows(
        self, said: Sequence[str], keys: Sequence[str], i: int, name: str
    ) -> list[tuple[int, bool]]:
        """Whether the words from ``i`` are heard as all of ``name``'s words in order: [] if
        not, else [(where the run ends, whether any word of it is said otherwise than
        written)]."""
        otherwise = False
        for word, key in zip(self._names[name], self._keys[name], strict=True):
            n = self._heard_as(said, keys, i, key)
            if not n:
                return []
            otherwise = otherwise or said[i : i + n] != [word]
            i += n
        return [(i, otherwise)]

    def _heard_as(self, said: Sequence[str], keys: Sequence[str], i: int, key: str) -> int:
        """How many words from ``i`` are heard as a name word of ``key`` (0: none)."""
        joined = ""
        for n in range(1, min(WORD_PIECES, len(keys) - i) + 1):
            joined = _joined(joined, keys[i + n - 1])
            if key in self._may_be(said, i, n, joined):
                return n
        return 0

    def _may_be(self, said: Sequence[str], i: int, n: int, joined: str) -> AbstractSet[str]:
        """The keys of the name words that ``n`` words from ``i`` (their keys ``joined``) may be
        heard as: a word that is a name's word as written is that word ("onedrive" is not
        OpenDrive with a letter dropped)."""
        if n == 1:
            own = self._written.get(said[i])
            if own is not None:
                return own
        return self._heard.get(joined, _NONE)
