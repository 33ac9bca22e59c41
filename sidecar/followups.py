"""Follow-up handling: fold what a turn refers back to into the query, with no LLM.

"Are their bathrooms clean?" alone retrieves every hotel's bathrooms; the session knows whose.
The snapshot knows its entities (the distinct titles and contexts of its chunks: a jsonl base's
hotels and restaurants, a Markdown base's pages). Each user turn is scanned for them, and so are
the turns recorded since the last one (user and agent, newest first); the newest mention becomes
the session's current entity. A turn that names none is searched as "entity: turn". With no
entity known, a turn that refers back gets the title of what was last retrieved, or else the
subject of the caller's last self-contained turn. ``TurnResponse.query`` shows the result.
"""

from __future__ import annotations

import re
import threading
import unicodedata
from collections import Counter
from collections.abc import Callable, Iterable, Sequence

import numpy as np
from cachetools import LRUCache

from index.config import FollowupConfig
from index.lexical import LexicalIndex
from index.snapshot import LoadedSnapshot
from index.types import Chunk
from sidecar.sessions import Session
from sidecar.skip import words

FUNCTION_WORDS_EN = frozenset(
    """
    a an the and or of by from at in on for to with near off into onto over under via de la le
    i me my we our you your it its they them their he him his she her this that these those
    is are was were be been being am do does did have has had can could will would shall should
    may might must what which who whom whose when where why how
    there here not no yes any some all each every either neither both one ones
    s about than then so if as also too just only very
    tell know explain describe please want need like give get show find
    """.split()
)

STREETS_EN = frozenset("street st road rd lane avenue ave way drive square".split())

REFERRING_EN = frozenset(
    """
    it its it's they their theirs them there that that's this these those he she his her him
    one ones same also else too place
    """.split()
)

USER = "user"  # sidecar.engine.Speaker.USER; the engine imports this module, not the reverse
SHORT_TURN = 5  # words; a turn this short rarely names its own topic
MAX_NAME_TOKENS = 8  # longer "names" are sentences (an FAQ's question), never said as a name
MIN_ALIAS_CHARS = 4  # a shorter partial name ("j", "hk") matches ordinary words
GENERIC_SHARE = 0.01  # a word in this share of names (and at least 3) is a kind, not a name
FUZZY_MIN_CHARS = 7  # one edit from a shorter name is often a word ("lovell" -> "lovely")
FUZZY_MAX_TOKENS = 3  # misspelt names are short; longer spans only cost time
COMMON_ELSEWHERE = 2  # chunks of other entities using a word that make it an ordinary word
GAZETTEERS_KEPT = 8  # one per loaded snapshot version; a swap leaves the old one to expire


def tokens(text: str) -> list[str]:
    """Lower-case word tokens with accents, apostrophes and '&' normalised for name matching."""
    text = unicodedata.normalize("NFKD", text.lower())
    text = "".join(c for c in text if not unicodedata.combining(c))
    text = text.replace("&", " and ").replace("'", "").replace("’", "")
    return re.findall(r"[a-z0-9]+", text)


def chunk_entity(chunk: Chunk) -> str:
    """What a chunk is about: its source's context (jsonl ``context_fields``) or its page title."""
    prefix, sep, _ = chunk.embed_text.partition("\n\n")
    if sep and prefix and prefix != " > ".join(chunk.breadcrumbs):
        return prefix
    return chunk.title


class Gazetteer:
    """The entity names of one snapshot, found in text by full or distinctive partial name.

    A name is matched by its words joined without spaces ("A and B Guesthouse" matches "A AND B
    GUEST HOUSE"), by its distinctive words alone ("the Lensfield" matches "THE LENSFIELD HOTEL":
    the words left after dropping function words and words shared by many names, like "hotel"),
    and, for keys of seven letters or more, within one edit that keeps the first letter ("Goonville",
    "cityroomz"). A partial name shared by two entities matches neither; a one-word name or
    partial name that ``is_common`` calls an ordinary word ("worth" of "WORTH HOUSE", a docs page
    titled "Selection") is not used.
    """

    def __init__(
        self,
        names: Iterable[str],
        function_words: frozenset[str],
        is_common: Callable[[str, str], bool] | None = None,
        streets: frozenset[str] = frozenset(),
    ) -> None:
        named = {n: tokens(n) for n in dict.fromkeys(n.strip() for n in names) if n}
        named = {n: t for n, t in named.items() if 0 < len(t) <= MAX_NAME_TOKENS}
        df = Counter(tok for toks in named.values() for tok in set(toks))
        generic = max(3, int(len(named) * GENERIC_SHARE))
        stripped = {n: t[1:] if t[0] == "the" and len(t) > 1 else t for n, t in named.items()}
        full: dict[str, str] = {}
        for name, toks in stripped.items():
            full.setdefault("".join(toks), name)
        one_word = {key for key, name in full.items() if len(stripped[name]) == 1}
        partial: dict[str, set[str]] = {}
        for name, toks in stripped.items():
            # two cuts: a small base never sees "hotel" in three names, a large one sees "royal"
            # in two that differ by the rest ("ROYAL SPICE", "ROYAL STANDARD")
            for shared in sorted({2, generic}):
                core = [t for t in toks if t not in function_words and df[t] < shared]
                key = "".join(core)
                if core and len(key) >= MIN_ALIAS_CHARS and key not in full:
                    partial.setdefault(key, set()).add(name)
                    if len(core) == 1:
                        one_word.add(key)
        keys: dict[str, str | None] = {
            key: next(iter(owners)) if len(owners) == 1 else None for key, owners in partial.items()
        }
        keys.update(full)
        self._partial = frozenset(partial)
        if is_common is not None:
            for key in one_word:
                owner = keys[key]
                if owner is not None and is_common(key, owner):
                    del keys[key]
        self._keys = keys
        self._streets = streets
        self._long = {k: n for k, n in keys.items() if n is not None and len(k) >= FUZZY_MIN_CHARS}
        self._near: dict[str, set[str]] = {}
        for key in self._long:
            for variant in _deletions(key):
                self._near.setdefault(variant, set()).add(key)
        self._span = max((len(t) for t in named.values()), default=0)
        self.size = len(named)

    def mentions(self, text: str) -> list[str]:
        """The entity names a text mentions, in order of first mention."""
        toks = tokens(text)
        found: list[str] = []
        i = 0
        while i < len(toks):
            span, name = self._match(toks, i)
            if name is not None and name not in found:
                found.append(name)
            i += span
        return found

    def _match(self, toks: list[str], i: int) -> tuple[int, str | None]:
        longest = min(self._span, len(toks) - i)
        for n in range(longest, 0, -1):
            key = "".join(toks[i : i + n])
            if key in self._keys:
                if key in self._partial and i + n < len(toks) and toks[i + n] in self._streets:
                    return n, None  # "12 Bridge Street" is an address, not Bridge Guest House
                return n, self._keys[key]
        for n in range(min(longest, FUZZY_MAX_TOKENS), 0, -1):
            name = self._near_match("".join(toks[i : i + n]))
            if name is not None:
                return n, name
        return 1, None

    def _near_match(self, key: str) -> str | None:
        """The one name within one edit of ``key`` (first letter kept), if there is one."""
        if len(key) < FUZZY_MIN_CHARS or not self._long:
            return None
        candidates = set(self._near.get(key, ()))
        for variant in _deletions(key):
            if variant in self._long:
                candidates.add(variant)
            candidates.update(self._near.get(variant, ()))
        names = {self._long[c] for c in candidates if _one_edit(key, c)}
        return names.pop() if len(names) == 1 else None


def _one_edit(a: str, b: str) -> bool:
    """Whether ``a`` and ``b`` differ by one insertion, deletion, substitution or swap."""
    if a == b:
        return False
    if len(a) > len(b):
        a, b = b, a
    i = next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), len(a))
    if len(a) != len(b):
        return len(b) - len(a) == 1 and a[i:] == b[i + 1 :]
    if a[i + 1 :] == b[i + 1 :]:
        return True
    return i + 1 < len(a) and a[i] == b[i + 1] and a[i + 1] == b[i] and a[i + 2 :] == b[i + 2 :]


def _deletions(key: str) -> set[str]:
    """``key`` with one letter dropped, never the first: one edit that keeps the initial."""
    return {key[:i] + key[i + 1 :] for i in range(1, len(key))}


_EMPTY = Gazetteer((), FUNCTION_WORDS_EN)
_DEFAULTS = FollowupConfig()
_gazetteers: LRUCache[tuple[str, str], Gazetteer] = LRUCache(maxsize=GAZETTEERS_KEPT)
_gazetteers_lock = threading.Lock()  # a warm-up thread may build while the loop reads


def gazetteer(snapshot: LoadedSnapshot) -> Gazetteer:
    """The snapshot's gazetteer, built on first use and kept per snapshot version.

    Building reads every chunk once and looks up the one-word names in the lexical index's
    postings, in time linear in the chunks (0.7 s for 100k chunks and 12,500 names, 9 s for
    1M); thread-safe, so the refresher's warm-up can build it off the loop.
    """
    key = (str(snapshot.folder), snapshot.version)
    with _gazetteers_lock:
        gaz = _gazetteers.get(key)
    if gaz is None:
        entity_of = [chunk_entity(c) for c in snapshot.chunks]
        is_common = common_words(snapshot.lexical, entity_of)
        gaz = Gazetteer(entity_of, FUNCTION_WORDS_EN, is_common, STREETS_EN)
        with _gazetteers_lock:
            _gazetteers[key] = gaz
    return gaz


def common_words(lexical: LexicalIndex, entity_of: Sequence[str]) -> Callable[[str, str], bool]:
    """A Gazetteer's ``is_common``: whether ``word`` (of the name ``name``) is an ordinary word.

    It is when at least COMMON_ELSEWHERE chunks of other entities use it (``entity_of[i]`` is
    chunk ``i``'s entity; the lexical index's doc ``i`` is chunk ``i``). A one-word name is not
    made common by longer names that contain it ("NANDOS" and "NANDOS CITY CENTRE"); a partial
    name is, by anything else that uses the word. The chunks using a word are the ones a BM25
    search for it matches, read from the postings rather than searched for: a search scores every
    chunk, which made building the gazetteer quadratic in the chunks.
    """
    ids: dict[str, int] = {}
    entity_ids = np.fromiter(
        (ids.setdefault(name, len(ids)) for name in entity_of), dtype=np.int64, count=len(entity_of)
    )
    words_of = [frozenset(tokens(name)) for name in ids]
    named_with: dict[str, list[int]] = {}  # word -> the entities whose name has it
    for entity, name_words in enumerate(words_of):
        for word in name_words:
            named_with.setdefault(word, []).append(entity)

    def is_common(word: str, name: str) -> bool:
        owner = ids.get(name, -1)  # -1: a name no chunk gives as is (stripped), so no chunk's own
        name_words = words_of[owner] if owner >= 0 else frozenset(tokens(name))
        others = entity_ids[lexical.matching(word)]
        others = others[others != owner]
        if name_words - {"the"} == {word}:
            others = others[~np.isin(others, named_with.get(word, []))]
        return bool(others.size >= COMMON_ELSEWHERE)

    return is_common


def refers_back(text: str) -> bool:
    """Whether a turn leans on the conversation: a pronoun, "the place", or a few words only."""
    toks = words(text)
    return len(toks) <= SHORT_TURN or any(t in REFERRING_EN for t in toks)


def _self_contained(text: str) -> str:
    """A turn's content words when it has no pronoun to resolve ("throat cancer"), else ""."""
    toks = words(text)
    if any(t in REFERRING_EN for t in toks):
        return ""
    return " ".join(t for t in toks if t not in FUNCTION_WORDS_EN)


def rewrite(
    session: Session,
    text: str,
    gazetteer: Gazetteer = _EMPTY,
    config: FollowupConfig = _DEFAULTS,
) -> str:
    """The query to search for this user turn, given the session so far.

    Records nothing about ``text`` itself (an interim transcript may be planned and dropped):
    once the engine records the turn, the next call finds the entity it named.
    """
    if not config.enabled:
        return text
    _track(session, gazetteer)
    if gazetteer.mentions(text):
        return text
    refers = refers_back(text)
    if session.entity and (refers or config.fold == "always"):
        return f"{session.entity}: {text}"
    if not refers:
        return text
    topic = session.topic or _subject(session)
    if not topic or topic.lower() in text.lower():
        return text
    return f"{topic}: {text}"


def _track(session: Session, gazetteer: Gazetteer) -> None:
    """Take the newest entity mention among the turns recorded since the last scan.

    When one turn names several ("Gonville or the Lensfield?"), the first is taken: on DSTC11
    that retrieved better than the last, or than folding in both.
    """
    new = min(session.turn_count - session.scanned, len(session.turns))
    session.scanned = session.turn_count
    for _, said in list(session.turns)[len(session.turns) - new :][::-1]:
        named = gazetteer.mentions(said)
        if named:
            session.entity = named[0]
            return


def _subject(session: Session) -> str:
    """The content words of the caller's newest self-contained turn ("throat cancer")."""
    for speaker, said in reversed(session.turns):
        subject = _self_contained(said) if speaker == USER else ""
        if subject:
            return subject
    return ""
