"""A second recogniser: both sides of a call transcribed, built apart from ``bench.spoken``.

``bench.spoken`` hears names by a Metaphone-like code close to the engine's own sound key
(``sidecar.turn.sounds``), hears the agent as written and a name alike through a call, so it may
share the engine's assumptions. This one draws its errors another way, from what recognisers do
that ``bench.spoken`` does not, seeded per dialogue and turn (``SEED``; a set is the same on
every run and machine). ``--spoken voxrecall-asr-1`` (``quality_conversations``) measures DSTC11
through it; another seed under ``PREFIX`` draws it again, ``redraw`` harsher or kinder, or with
the agent as written. Its only word lists are English function words, fillers and number
words; its vocabulary is the set's own turns. Examples below are from DSTC11's vocabulary.

What every turn, the agent's as the caller's (a call recorded and transcribed on both sides),
goes through (``Recogniser.transcribe``), in order:

1. **Numbers said as people say them**: times as "half past five", "quarter to six" or "five
   thirty" (24-hour times said on the 12-hour clock: "17:00" -> "five o'clock"), prices without
   their unit ("£12.50" -> "twelve fifty"), phone numbers and five or more digits with "oh" for
   zero and "double" for a repeated digit ("01223" -> "oh one double two three"), codes spelled
   (``bench.spoken.spell``), other numbers as words.
2. **Lower case, no punctuation** (``bench.spoken.written_words``): the agent's question mark too.
3. **Rare words heard worst**: a content word (not a function word, number word or filler) is
   misheard with ``min(MAX_ERROR, RARE_ERROR / sqrt(count))``, its count in the set's turns
   (a word said once 0.5, 25 times 0.12, 400 times 0.03). A word misheard as a sound-alike or
   split stays so for that speaker through the call, but the two sides of a call are heard
   apart (the agent heard saying "belfry", the caller "delivery"); the other forms are drawn
   afresh at each mention. Misheard, a word becomes one drawn among what applies:
   * **a coarse sound-alike**: the most common other vocabulary word of about its length whose
     consonants fall in the same manner classes (``coarse``: stops, fricatives, nasals,
     liquids, glides; place and voicing lost: "belfry" -> "delivery", "thong" -> "find");
   * **split in two at a syllable**, each half the coarse sound-alike of its letters, or as
     written when none is ("belfry" -> "table sorry", "cityroomz" -> "two rooms");
   * **run into a neighbouring short word** ("at lovell" -> "atlovell", "the gonville" ->
     "thegonville"): a recogniser's word boundary in the wrong place;
   * **a first syllable, then again** (a restart around the word: "the lo the lovell" ->
     "the low the lovell");
   * **spelled after it** (``SPELL_SHARE`` of misheard names of 5+ letters, a name being a word
     written capitalised mid-sentence: "lovell l o v e l l", as callers spell a name).
4. **Short function words dropped** (``DROP_RATE`` each: "a", "the", "of", "to", "is"...).
5. **Cut off**: ``CUT_RATE`` of turns of 6+ words end early, after 60-90% of their words (the
   caller talked over, the recogniser's end-of-turn early).
6. **Fillers and openers**: ``FILLER_RATE`` of turns open with one ("yeah so", "okay um", "hmm",
   "so", "right"), ``FILLER_RATE / 2`` have a filler inside ("er", "you know", "like").
"""

from __future__ import annotations

import math
import random
import re
from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import replace

from bench import spoken
from bench.conversations import ConversationSet, Dialogue, Said
from sidecar.turn.engine import Speaker

PREFIX = "voxrecall-asr-"
SEED = f"{PREFIX}1"  # another seed under PREFIX draws another, equally valid, set
RARE_ERROR = 0.6  # a content word said once is misheard with this (clamped), n times / sqrt(n)
MAX_ERROR = 0.5
MIN_ERROR = 0.02
DROP_RATE = 0.08  # a short function word's chance of not being heard
CUT_RATE = 0.08  # a turn's chance of being cut off (6+ words)
CUT_KEPT = (0.6, 0.9)  # the share of its words a cut turn keeps
MIN_CUT_WORDS = 6
FILLER_RATE = 0.3
SIDES = "both"  # "caller": the agent's turns as written (``redraw``), to tell what each side costs
SPELL_SHARE = 0.15  # a misheard name of 5+ letters is spelled after it this often instead
MIN_SPELL_LETTERS = 5
COMMON_COUNT = 3  # a sound-alike is drawn from words seen at least this often
MIN_WORD_LETTERS = 3  # shorter words ("it", "we") are heard right or dropped, never misheard
MIN_PIECE_LETTERS = 2
MIN_KEY_CLASSES = 2  # a coarse key of one class ("S" of "pot", "book", "get") is too many words
OPENERS = ("yeah so", "okay um", "hmm", "so", "right", "uh", "okay so")
INSIDE = ("er", "you know", "like", "uh", "i mean")
FILLER_WORDS = frozenset(w for f in (*OPENERS, *INSIDE) for w in f.split())
# English function words (not tuned to any set): never misheard; the short ones may be dropped.
FUNCTION_WORDS = frozenset(
    """a an the of to in on at for by with from as is are was were be been am do does did have
    has had i you he she it we they me him her us them my your our their its this that these
    those there here what which who whom whose when where why how and or but if so not no yes
    can could will would shall should may might must just also very too than then there's it's
    i'm i'd i'll you're we're they're don't doesn't can't won't isn't aren't any some all""".split()
)
DROPPABLE = frozenset(  # a negation dropped turns the turn about; recognisers keep stress
    w for w in FUNCTION_WORDS if len(w) <= 3 and "'" not in w and w not in {"no", "not"}
)
# Consonants by manner of articulation: coarser than a sound key (place and voicing lost).
_COARSE = str.maketrans(
    "pbtdkgqcfvszxjlrmnwhy",
    "SSSSSSSSFFFFFFLLNNWWW",
)


def coarse(word: str) -> str:
    """The word's consonants by manner ("lovell" -> "LFL", "level" -> "LFL"), "th" "sh" "ch"
    "ph" as one fricative, doubled letters and vowels dropped, a final silent "e" too."""
    w = re.sub(r"[^a-z]", "", word.lower())
    w = re.sub(r"(th|sh|ch|ph|gh)", "f", w)
    key = re.sub(r"[aeiou]", "", w).translate(_COARSE)
    return re.sub(r"(.)\1+", r"\1", key)


def _pieces(word: str) -> tuple[str, str] | None:
    """The word cut at the syllable nearest its middle ("alexander" -> "alex", "ander"), a
    consonant cluster shared between the halves ("milton" -> "mil", "ton")."""
    parts = spoken.syllables(word)
    if len(parts) < 2:
        return None
    cut = max(range(1, len(parts)), key=lambda i: -abs(len("".join(parts[:i])) - len(word) / 2))
    left, right = "".join(parts[:cut]), "".join(parts[cut:])
    if re.match(r"[^aeiouy]{2}", right):  # a cluster is shared: "mil" "ton", not "mi" "lton"
        left, right = left + right[0], right[1:]
    if min(len(left), len(right)) < MIN_PIECE_LETTERS:
        return None
    return left, right


# -- numbers ------------------------------------------------------------------------------------


def clock_words(hour: int, minute: int) -> str:
    """A time as people say it: "half past five", "quarter to six", "five thirty"."""
    hour = hour % 12 or 12
    nxt = hour % 12 + 1
    if minute == 0:
        return f"{spoken.number_words(hour)} o'clock"
    if minute == 30:
        return f"half past {spoken.number_words(hour)}"
    if minute == 15:
        return f"quarter past {spoken.number_words(hour)}"
    if minute == 45:
        return f"quarter to {spoken.number_words(nxt)}"
    tail = f"oh {spoken.number_words(minute)}" if minute < 10 else spoken.number_words(minute)
    return f"{spoken.number_words(hour)} {tail}"


def phone_words(digits: str) -> str:
    """Digits read out as callers read them: "0" as "oh", a repeated digit as "double"."""
    said: list[str] = []
    digits = re.sub(r"\D", "", digits)
    i = 0
    while i < len(digits):
        d = "oh" if digits[i] == "0" else spoken.number_words(int(digits[i]))
        if i + 1 < len(digits) and digits[i + 1] == digits[i]:
            said.append(f"double {d}")
            i += 2
        else:
            said.append(d)
            i += 1
    return " ".join(said)


def _time(m: re.Match[str]) -> str:
    return f" {clock_words(int(m['h']), int(m['m'] or 0))} "


def _price(m: re.Match[str]) -> str:
    units = spoken.number_words(int(m["units"].replace(",", "")))
    cents = int(m["cents"] or 0)
    return f" {units} {spoken.number_words(cents)} " if cents else f" {units} "


_NUMBERS: tuple[tuple[re.Pattern[str], Callable[[re.Match[str]], str]], ...] = (
    (re.compile(r"[£$€]\s?(?P<units>\d[\d,]*)(?:\.(?P<cents>\d{2}))?"), _price),
    (re.compile(r"\b(?P<h>\d{1,2}):(?P<m>\d{2})\s*(?:[ap]\.?m\.?\b)?", re.I), _time),
    (re.compile(r"\b(?P<h>\d{1,2})(?P<m>)\s*[ap]\.?m\.?(?!\w)", re.I), _time),
    (re.compile(r"\b\d(?:[\d -]*\d){4,}\b"), lambda m: f" {phone_words(m[0])} "),
)


def numbers_said(text: str) -> str:
    """Every digit of ``text`` as a caller says it (rule 1); what is left as ``bench.spoken``."""
    for pattern, said_as in _NUMBERS:
        text = pattern.sub(said_as, text)
    return spoken.numbers_spoken(text)


# -- the recogniser -----------------------------------------------------------------------------


class Recogniser:
    """Transcribes the turns of a call on both sides (the module docstring), with the words of
    the whole set as its vocabulary."""

    def __init__(self, texts: Iterable[str]) -> None:
        said = [spoken.words_of(numbers_said(t)) for t in texts]
        self.counts: Counter[str] = Counter(w for ws in said for w in ws)
        self.by_coarse: dict[str, list[str]] = {}
        common = [w for w, c in self.counts.items() if c >= COMMON_COUNT and len(w) > 2]
        for w in sorted(common, key=lambda w: (-self.counts[w], w)):
            if w.isalpha() and w not in FUNCTION_WORDS:
                self.by_coarse.setdefault(coarse(w), []).append(w)

    def transcribe(self, text: str, rng: random.Random, heard: dict[str, str] | None = None) -> str:
        """``text`` as recognised; ``heard`` holds how this speaker's words were heard so far in
        the call (filled here)."""
        heard = {} if heard is None else heard
        out: list[str] = []
        for w, named in spoken.written_words(numbers_said(text)):
            if w in DROPPABLE and rng.random() < DROP_RATE:
                continue
            out.extend(self._hear(w, named, out, rng, heard))
        return " ".join(self._disfluent(self._cut(out, rng), rng))

    def error_rate(self, word: str) -> float:
        """Rule 3: a rare word is heard worst; function, number and short words never misheard."""
        if (
            len(word) < MIN_WORD_LETTERS
            or not word.isalpha()
            or word in FUNCTION_WORDS
            or word in spoken.NUMBER_WORDS
            or word in FILLER_WORDS
        ):
            return 0.0
        count = max(self.counts[word], 1)
        return max(MIN_ERROR, min(MAX_ERROR, RARE_ERROR / math.sqrt(count)))

    def sound_alike(self, word: str) -> str | None:
        """The most common other vocabulary word of the same coarse key and about its length;
        none for a key of one class (a syllable such as "so" would be heard as any word)."""
        key = coarse(word)
        if len(key) < MIN_KEY_CLASSES:
            return None
        for other in self.by_coarse.get(key, ()):
            if other != word and abs(len(other) - len(word)) <= 2:
                return other
        return None

    def split(self, word: str) -> str | None:
        """The word heard as two: each half its sound-alike, or as written."""
        pieces = _pieces(word)
        if pieces is None:
            return None
        return " ".join(self.sound_alike(p) or p for p in pieces)

    def _hear(
        self, word: str, named: bool, before: list[str], rng: random.Random, heard: dict[str, str]
    ) -> list[str]:
        if word in heard:
            return heard[word].split()
        if rng.random() >= self.error_rate(word):
            return [word]
        way = self._misheard(word, named, before, rng)
        if way is None:
            return [word]
        kind, said = way
        if kind == "kept":
            heard[word] = said
        if kind == "joined":
            before.pop()  # the short word before is heard as part of this one
        return said.split()

    def _misheard(
        self, word: str, named: bool, before: list[str], rng: random.Random
    ) -> tuple[str, str] | None:
        """One way the word is misheard: ("kept", heard) when the speaker is heard so through
        the call, ("once", heard) or ("joined", heard: the word before run into it) for what
        depends on this turn."""
        if named and len(word) >= MIN_SPELL_LETTERS and rng.random() < SPELL_SHARE:
            return "once", f"{word} {' '.join(word)}"
        ways: list[tuple[str, str]] = []
        alike = self.sound_alike(word)
        if alike:
            ways.append(("kept", alike))
        halves = self.split(word)
        if halves:
            ways.append(("kept", halves))
        if before and before[-1] in DROPPABLE:
            ways.append(("joined", f"{before[-1]}{word}"))
        parts = spoken.syllables(word)
        if len(parts) >= 2 and before:
            first = self.sound_alike(parts[0]) or parts[0]
            ways.append(("once", f"{first} {before[-1]} {word}"))
        return rng.choice(ways) if ways else None

    def _cut(self, words: list[str], rng: random.Random) -> list[str]:
        if len(words) >= MIN_CUT_WORDS and rng.random() < CUT_RATE:
            return words[: max(3, round(len(words) * rng.uniform(*CUT_KEPT)))]
        return words

    def _disfluent(self, words: list[str], rng: random.Random) -> list[str]:
        if not words:
            return words
        if rng.random() < FILLER_RATE:
            words = [*rng.choice(OPENERS).split(), *words]
        if rng.random() < FILLER_RATE / 2:
            at = rng.randrange(len(words))
            words = [*words[:at], *rng.choice(INSIDE).split(), *words[at:]]
        return words


def redraw(spec: str) -> None:
    """Another draw: ``SEED[,RARE_ERROR[,SIDES]]``, the seed under ``PREFIX``, a harsher or
    kinder recogniser (``RARE_ERROR``, 0-1), and ``SIDES`` "both" or "caller" (the agent's
    turns as written, as ``bench.spoken`` has them: to tell what hearing the agent costs)."""
    global SEED, RARE_ERROR, SIDES
    seed, *rest = spec.split(",")
    valid = (
        seed.startswith(PREFIX)
        and len(rest) <= 2
        and (not rest or 0.0 <= float(rest[0]) <= 1.0)
        and (len(rest) < 2 or rest[1] in ("both", "caller"))
    )
    if not valid:
        raise ValueError(
            f"the second recogniser takes {PREFIX}NAME[,RARE_ERROR[,both|caller]]: {spec!r}"
        )
    SEED = seed
    RARE_ERROR = float(rest[0]) if rest else RARE_ERROR
    SIDES = rest[1] if len(rest) > 1 else SIDES


def transcribed(recogniser: Recogniser, d: Dialogue) -> Dialogue:
    """Every turn of the dialogue recognised, each speaker's words heard alike through it."""
    heard: dict[str, dict[str, str]] = {}
    turns = tuple(
        Said(
            t.speaker,
            recogniser.transcribe(
                t.text, spoken.turn_rng(d.dialogue_id, i, SEED), heard.setdefault(t.speaker, {})
            ),
            t.qid,
        )
        if SIDES == "both" or t.speaker == Speaker.USER
        else t
        for i, t in enumerate(d.turns)
    )
    return Dialogue(d.dialogue_id, turns)


def recognised(cs: ConversationSet) -> ConversationSet:
    """``cs`` with both sides of every dialogue recognised; the base unchanged."""
    recogniser = Recogniser(dict.fromkeys(t.text for d in cs.dialogues for t in d.turns))
    dialogues = [transcribed(recogniser, d) for d in cs.dialogues]
    notes = f"{cs.notes}; {SIDES} recognised ({SEED}, rare error {RARE_ERROR})"
    return replace(cs, name=f"{cs.name}-spoken", dialogues=dialogues, notes=notes)
