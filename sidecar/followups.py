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
import unicodedata
from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

from cachetools import LRUCache

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
    """.split()
)

REFERRING_EN = frozenset(
    """
    it its it's they their theirs them there that that's this these those he she his her him
    one ones same also else too place hotel restaurant
    """.split()
)

SHORT_TURN = 5  # words; a turn this short rarely names its own topic
MAX_NAME_TOKENS = 8  # longer "names" are sentences (an FAQ's question), never said as a name
MIN_ALIAS_CHARS = 4  # a shorter partial name ("j", "hk") matches ordinary words
GENERIC_SHARE = 0.01  # a word in this share of names (and at least 3) is a kind, not a name
MAX_FOLDED = 2  # "Gonville Hotel, Lensfield Hotel: which one is quieter?"; more is noise
FUZZY_MIN_CHARS = 6  # one edit from a shorter key is an ordinary word ("cote" -> "note")
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
    and, for keys of six letters or more, within one edit that keeps the first letter ("Goonville",
    "cityroomz"). A partial name shared by two entities matches neither; a one-word partial name
    that ``is_common`` calls an ordinary word ("worth" of "WORTH HOUSE") is not used.
    """

    def __init__(
        self,
        names: Iterable[str],
        function_words: frozenset[str],
        is_common: Callable[[str, str], bool] | None = None,
    ) -> None:
        named = {n: tokens(n) for n in dict.fromkeys(n.strip() for n in names) if n}
        named = {n: t for n, t in named.items() if 0 < len(t) <= MAX_NAME_TOKENS}
        df = Counter(tok for toks in named.values() for tok in set(toks))
        generic = max(3, int(len(named) * GENERIC_SHARE))
        full: dict[str, str] = {}
        partial: dict[str, set[str]] = {}
        for name, toks in named.items():
            if toks[0] == "the" and len(toks) > 1:
                toks = toks[1:]
            full.setdefault("".join(toks), name)
            core = [t for t in toks if t not in function_words and df[t] < generic]
            key = "".join(core)
            if not core or len(key) < MIN_ALIAS_CHARS or key in full:
                continue
            if len(core) == 1 and is_common is not None and is_common(key, name):
                continue
            partial.setdefault(key, set()).add(name)
        keys: dict[str, str | None] = {
            key: next(iter(owners)) if len(owners) == 1 else None
            for key, owners in partial.items()
        }
        keys.update(full)
        self._keys = keys
        self._long = {k: n for k, n in keys.items() if len(k) >= FUZZY_MIN_CHARS}
        self._near: dict[str, str | None] = {}
        for key, name in self._long.items():
            if name is not None:
                for variant in _deletions(key):
                    self._near[variant] = name if self._near.get(variant, name) == name else None
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
                return n, self._keys[key]
        for n in range(min(longest, FUZZY_MAX_TOKENS), 0, -1):
            name = self._near_match("".join(toks[i : i + n]))
            if name is not None:
                return n, name
        return 1, None

    def _near_match(self, key: str) -> str | None:
        """The one name within one edit of ``key`` (first letter kept), if there is one."""
        if len(key) < FUZZY_MIN_CHARS or not self._near:
            return None
        found = {self._near.get(key)}
        for variant in _deletions(key):
            found.add(self._long.get(variant))
            found.add(self._near.get(variant))
        found.discard(None)
        return found.pop() if len(found) == 1 else None


def _deletions(key: str) -> set[str]:
    """``key`` with one letter dropped, never the first: one edit that keeps the initial."""
    return {key[:i] + key[i + 1 :] for i in range(1, len(key))}


_EMPTY = Gazetteer((), FUNCTION_WORDS_EN)
_gazetteers: LRUCache[tuple[str, str], Gazetteer] = LRUCache(maxsize=GAZETTEERS_KEPT)


def gazetteer(snapshot: LoadedSnapshot) -> Gazetteer:
    """The snapshot's gazetteer, built on first use and kept per snapshot version.

    Building reads every chunk once and asks the lexical index about the one-word partial names
    (about 30 ms for 10,000 chunks); the refresher's warm-up can call this so no turn pays it.
    """
    key = (str(snapshot.folder), snapshot.version)
    gaz = _gazetteers.get(key)
    if gaz is None:
        entity_of = [chunk_entity(c) for c in snapshot.chunks]

        def is_common(word: str, name: str) -> bool:
            found = snapshot.lexical.search(word, len(entity_of))
            return sum(entity_of[d] != name for d, _ in found) >= COMMON_ELSEWHERE

        gaz = Gazetteer(entity_of, FUNCTION_WORDS_EN, is_common)
        _gazetteers[key] = gaz
    return gaz


@dataclass(frozen=True, slots=True)
class FollowupPolicy:
    """How follow-ups are resolved; ``fold`` is "always" or "referring" (only turns that refer back)."""

    enabled: bool = True
    fold: str = "always"


def refers_back(text: str) -> bool:
    toks = words(text)
    return len(toks) <= SHORT_TURN or any(t in REFERRING_EN for t in toks)


def rewrite(
    session: Session,
    text: str,
    gazetteer: Gazetteer = _EMPTY,
    policy: FollowupPolicy = FollowupPolicy(),
) -> str:
    """The query to search for this user turn, given the session so far."""
    if not policy.enabled:
        return text
    _track(session, gazetteer)
    named = gazetteer.mentions(text)
    if named:
        session.entities = tuple(named[:MAX_FOLDED])
        return text
    refers = refers_back(text)
    if session.entities and (refers or policy.fold == "always"):
        return f"{', '.join(session.entities)}: {text}"
    if not refers:
        session.subject = _content(text)
        return text
    topic = session.topic or session.subject
    if not topic or topic.lower() in text.lower():
        return text
    return f"{topic}: {text}"


def _track(session: Session, gazetteer: Gazetteer) -> None:
    """Take the newest entity mention among the turns recorded since the last scan."""
    new = min(session.turn_count - session.scanned, len(session.turns))
    session.scanned = session.turn_count
    for _, said in list(session.turns)[len(session.turns) - new :][::-1]:
        named = gazetteer.mentions(said)
        if named:
            session.entities = tuple(named[:MAX_FOLDED])
            return


def _content(text: str) -> str:
    """A self-contained turn's subject: its words less function words ("throat cancer")."""
    return " ".join(w for w in words(text) if w not in FUNCTION_WORDS_EN)
