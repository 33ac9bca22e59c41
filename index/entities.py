"""The entities of a snapshot and their rated names: what the sidecar's follow-ups match turns by.

A chunk's entity is what it is about (``chunk_entity``: its source's context, or its page title).
At build time every chunk's entity is read once, and each entity name is turned into the keys a
turn can name it by (its words joined; its distinctive words alone; the words it does not
share with most names, ``_unshared_keys``), each rated by the
snapshot's own statistics (``EntityStats``: the share of the chunks holding the key's words that
are the entity's own). ``entities.bin`` (kind ``voxrecall.entities``, snapshot format 5) stores
the result, so that a sidecar's load reads the keys instead of scanning every chunk and the
lexical postings (about 3 s of a 7 s load at 100k chunks):

    n_blob, n_offsets   the distinct entity names, in order of first chunk
    entity_of           <i4 per chunk: its entity, an index into the names
    g_blob, g_offsets   the names that own a key (a name as matched: stripped)
    k_blob, k_offsets   the keys ([a-z0-9]+, at most MAX_KEY_CHARS)
    key_owner           <i4 per key: its owner, an index into the g_ names; -1 when two
                        names share it (it then matches neither)
    key_sure            <f8 per key: its confidence, 0 to 1
    key_partial         |u1 per key: 1 for a partial name (an address like "12 Bridge
                        Street" does not match it)

    header              count (chunks), rules (RULES), names (how many names were read), span
                        (the most tokens of a name), shared (the words most names hold)

The gazetteer's matching tables of these keys (prefixes, one-edit variants: ``index.key_tables``)
are written beside it (``gazetteer.bin``) and mapped by the sidecar, or built from the keys at
load for a snapshot without them; a snapshot of format 4, or one built with other rules
(``RULES``), is rated at load from its chunks as before. The reader checks every array and
bounds what the keys' tables would take in memory (``MAX_GAZETTEER_BYTES``), so a hostile file
is a ``ValueError``, never a blow-up.

The name tokenizer (``tokens``) is here, for the indexer and the sidecar alike: a name's keys
are matched against a turn's tokens, so both must be made by the same function.
"""

from __future__ import annotations

import itertools
import re
import unicodedata
from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final

import numpy as np
import numpy.typing as npt

from index.key_tables import RatedKeys, tables_bytes
from index.lexical import LexicalIndex
from index.mapped import ArraysFile, StringTable, dump_arrays
from index.tables import MAX_EMBED_BYTES, ChunkTable, _bounded
from index.types import Chunk

ENTITIES_KIND: Final = "voxrecall.entities"
# The naming and rating rules' version: a snapshot rated by other rules is rated again at load.
# Bump it with any change to FUNCTION_WORDS_EN, the constants below or the functions that rate.
RULES: Final = 2

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

MAX_NAME_TOKENS = 8  # longer "names" are sentences (an FAQ's question), never said as a name
# A name whose words joined are longer is not matched either (no one says a 160-letter name),
# and it bounds what a key costs the sidecar: every prefix of every key is kept in memory.
MAX_KEY_CHARS = 160
MAX_CORE_HOLDERS = 64  # names read to tell whether another name holds a key's words too
MIN_ALIAS_CHARS = 4  # a shorter partial name ("j", "hk") matches ordinary words
GENERIC_SHARE = 0.01  # a word in this share of names (and at least 3) is a kind, not a name
COMMON_ELSEWHERE = 2  # chunks of other entities using a word that make it an ordinary word
# A page named by one word that other pages' chunks also use ("Selection", a docs page; "pCloud",
# which every overview lists) is at most this sure, a weak match: it is taken as the turn's topic
# only when the turn's own search confirms it (``sidecar.turn.followups.confirmed``).
WEAK_CONFIDENCE = 0.25
# A word in at least this share of the names (and in two) is the base's shared name ("Windows
# Terminal", which every page's title starts with): it says little about which page is meant.
SHARED_NAME_SHARE = 0.5
# What the sidecar's matching tables of the keys may take in memory, mapped or built at load
# (``index.key_tables.tables_bytes``, at most: every prefix distinct, a hashed variant per letter
# of each long key): ~130 MB for a 1M-chunk base of 125k names; a file claiming more is refused.
MAX_GAZETTEER_BYTES = 1 << 30
_MAX_SHARED = 2 * MAX_NAME_TOKENS  # each shared word is in half the names: at most this many

_TOKEN = re.compile(r"[a-z0-9]+")


def tokens(text: str) -> list[str]:
    """Lower-case word tokens with accents, apostrophes and '&' normalised for name matching."""
    text = text.lower()
    if not text.isascii():
        text = unicodedata.normalize("NFKD", text)
        text = "".join(c for c in text if not unicodedata.combining(c))
    text = text.replace("&", " and ").replace("'", "").replace("’", "")
    return _TOKEN.findall(text)


def chunk_entity(chunk: Chunk) -> str:
    """What a chunk is about: its source's context (jsonl ``context_fields``) or its page title."""
    head, sep, _ = chunk.embed_text.partition("\n\n")
    return entity_about(head if sep else "", chunk.breadcrumbs, chunk.title)


def entity_about(head: str, breadcrumbs: Sequence[str], title: str) -> str:
    """``chunk_entity`` from a chunk's parts: ``head`` is its embed text before the chunker's
    blank line ("" when none), a context when it is not the heading path."""
    if head and head != " > ".join(breadcrumbs):
        return head
    return title


def chunk_entities(chunks: Sequence[Chunk]) -> tuple[list[str], list[str]]:
    """Every chunk's id and entity (``chunk_entity``), in label order; a mapped table's are read
    from its heads, without decoding the chunks' texts."""
    if isinstance(chunks, ChunkTable):
        heads = list(chunks.heads())
        ids = [h[0] for h in heads]
        return ids, [entity_about(head, crumbs, title) for _, title, crumbs, head in heads]
    return [c.chunk_id for c in chunks], [chunk_entity(c) for c in chunks]


Confidence = Callable[[Sequence[str], str], float]


@dataclass(frozen=True, slots=True)
class Rated:
    """The keys a gazetteer matches, rated: ``keys`` key -> the one name it names (None: two
    names share it, so it names neither), ``sure`` the confidence of each owned key, ``partial``
    the keys that are partial names, ``size`` the names read, ``span`` the most tokens of a
    name, ``shared`` the words most names hold."""

    keys: dict[str, str | None]
    sure: dict[str, float]
    partial: frozenset[str]
    size: int
    span: int
    shared: frozenset[str]


def rate(
    names: Iterable[str],
    function_words: frozenset[str],
    is_common: Callable[[str, str], bool] | None = None,
    confidence: Confidence | None = None,
) -> Rated:
    """The keys of ``names``: each name's words joined, its distinctive words alone (the
    words left after dropping function words and words shared by many names, like "hotel"),
    and its words less those most names hold (``_unshared_keys``). A
    partial key shared by two names names neither; a one-word key that ``is_common`` calls an
    ordinary word is dropped (a partial name) or made weak (a whole name: "Selection").
    ``confidence`` (words, name) rates every key; without it every key is sure."""
    named = {n: tokens(n) for n in dict.fromkeys(n.strip() for n in names) if n}
    named = {n: t for n, t in named.items() if _nameable(t)}
    stripped = {n: t[1:] if t[0] == "the" and len(t) > 1 else t for n, t in named.items()}
    full: dict[str, str] = {}
    for name, toks in stripped.items():
        full.setdefault("".join(toks), name)
    shared = _shared_words(named.values(), function_words)
    partial, one_word = _partial_keys(stripped, function_words, full)
    _unshared_keys(partial, stripped, function_words, shared, full)
    keys: dict[str, str | None] = {
        key: next(iter(owners)) if len(owners) == 1 else None for key, owners in partial.items()
    }
    keys.update(full)
    one_word |= {key for key, name in full.items() if len(stripped[name]) == 1}
    common = _drop_common(keys, one_word, full, is_common)
    sure = _rate(keys, stripped, function_words, confidence)
    for key in common:  # "Selection", "pCloud": only the turn's own search can confirm them
        sure[key] = min(sure.get(key, 1.0), WEAK_CONFIDENCE)
    return Rated(
        keys=keys,
        sure=sure,
        partial=frozenset(k for k in partial if k in keys),
        size=len(named),
        span=max((len(t) for t in named.values()), default=0),
        shared=shared,
    )


def _nameable(toks: list[str]) -> bool:
    return 0 < len(toks) <= MAX_NAME_TOKENS and sum(map(len, toks)) <= MAX_KEY_CHARS


def _drop_common(
    keys: dict[str, str | None],
    one_word: set[str],
    full: dict[str, str],
    is_common: Callable[[str, str], bool] | None,
) -> set[str]:
    """Drop the one-word partial keys ``is_common`` calls ordinary words; return the whole
    one-word names it calls so (kept, but weak)."""
    common: set[str] = set()
    if is_common is None:
        return common
    for key in one_word:
        owner = keys[key]
        if owner is not None and is_common(key, owner):
            if key in full:
                common.add(key)
            else:
                del keys[key]
    return common


def _shared_words(named: Iterable[list[str]], function_words: frozenset[str]) -> frozenset[str]:
    """The content words at least SHARED_NAME_SHARE of the names (and two) hold."""
    names = list(named)
    df = Counter(tok for toks in names for tok in set(toks) if tok not in function_words)
    least = max(2.0, len(names) * SHARED_NAME_SHARE)
    return frozenset(tok for tok, n in df.items() if n >= least)


def _partial_keys(
    stripped: dict[str, list[str]], function_words: frozenset[str], full: dict[str, str]
) -> tuple[dict[str, set[str]], set[str]]:
    """Each name's distinctive words joined (key -> the names having it), and the one-word keys."""
    df = Counter(tok for toks in stripped.values() for tok in set(toks))
    generic = max(3, int(len(stripped) * GENERIC_SHARE))
    partial: dict[str, set[str]] = {}
    one_word: set[str] = set()
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
    return partial, one_word


def _unshared_keys(
    partial: dict[str, set[str]],
    stripped: dict[str, list[str]],
    function_words: frozenset[str],
    shared: frozenset[str],
    full: dict[str, str],
) -> None:
    """Add to ``partial`` each name's words of two or more less its function words and the
    ``shared`` words (those most names hold, ``_shared_words``), for the names holding one of
    those (a base with none, or a name with none, gets no key here): "interaction settings" of
    "Windows Terminal Interaction Settings" in a base where most titles start "Windows
    Terminal". A recogniser mishears the shared words as readily as any ("windows tenal
    interaction settings"), and they tell no page from another; the rest, said together, name
    the page where no other name holds them all (a key two names have names neither). The
    distinctive keys (``_partial_keys``) miss it where each of those words is in other names
    too ("settings", "profile"), or where the one word left is an ordinary word."""
    if not shared:
        return
    holding = _names_holding(stripped)
    for toks in stripped.values():
        if shared.isdisjoint(toks):
            continue
        core = [t for t in toks if t not in function_words and t not in shared]
        key = "".join(core)
        if len(core) > 1 and len(key) >= MIN_ALIAS_CHARS and key not in full:
            partial.setdefault(key, set()).update(_holders(holding, core))


def _names_holding(stripped: dict[str, list[str]]) -> dict[str, set[str]]:
    """Each word's names, of every name (those holding no shared word too)."""
    holding: dict[str, set[str]] = {}
    for name, toks in stripped.items():
        for tok in toks:
            holding.setdefault(tok, set()).add(name)
    return holding


def _holders(holding: dict[str, set[str]], core: list[str]) -> set[str]:
    """The names holding every word of ``core``, from the rarest word's up (a key two names
    hold names neither: "getting started" of three products' "Getting Started" pages). Where
    the rarest word is in more than MAX_CORE_HOLDERS names, two of them stand for the holders: the
    work per name is bounded, and such a key names no page even where one name alone holds all
    its words (a key lost, never a wrong page named)."""
    sets = sorted((holding[tok] for tok in core), key=len)
    if len(sets[0]) > MAX_CORE_HOLDERS:
        return set(itertools.islice(sets[0], 2))
    found = set(sets[0])
    for other in sets[1:]:
        found &= other
    return found


def _rate(
    keys: dict[str, str | None],
    stripped: dict[str, list[str]],
    function_words: frozenset[str],
    confidence: Confidence | None,
) -> dict[str, float]:
    """Each usable key's confidence: ``confidence`` of its content words for its one owner."""
    if confidence is None:
        return {}
    sure: dict[str, float] = {}
    for key, name in keys.items():
        if name is None:
            continue
        toks = stripped[name] if key == "".join(stripped[name]) else _core_of(key, stripped[name])
        content = [t for t in toks if t not in function_words] or toks
        sure[key] = confidence(content, name)
    return sure


def _core_of(key: str, toks: list[str]) -> list[str]:
    """The name's words that make up the partial key ``key`` (a run of its words, in order)."""
    out: list[str] = []
    rest = key
    for tok in toks:
        if rest.startswith(tok):
            out.append(tok)
            rest = rest[len(tok) :]
    return out


class EntityStats:
    """What the snapshot says about the words of its entities' names (``entity_of[i]`` is chunk
    ``i``'s entity; the lexical index's doc ``i`` is chunk ``i``). The chunks holding a word are
    read from the lexical index's postings (a search would score every chunk: quadratic)."""

    def __init__(self, lexical: LexicalIndex, entity_of: Sequence[str]) -> None:
        self._lexical = lexical
        self._ids: dict[str, int] = {}
        self.entity_ids = np.fromiter(
            (self._ids.setdefault(name, len(self._ids)) for name in entity_of),
            dtype=np.int32,
            count=len(entity_of),
        )
        self.names = list(self._ids)  # each entity once, in order of first chunk
        self._words_of = [frozenset(tokens(name)) for name in self.names]
        self._named_with: dict[str, list[int]] = {}  # word -> the entities whose name has it
        for entity, name_words in enumerate(self._words_of):
            for word in name_words:
                self._named_with.setdefault(word, []).append(entity)
        # the chunks holding each word of a name, read in one pass over the postings
        words = list(self._named_with)
        self._postings: dict[str, np.ndarray] = dict(
            zip(words, lexical.postings(words), strict=True)
        )

    def is_common(self, word: str, name: str) -> bool:
        """Whether ``word`` (of the name ``name``) is an ordinary word: at least COMMON_ELSEWHERE
        chunks of other entities use it. A one-word name is not made common by longer names that
        contain it ("NANDOS" and "NANDOS CITY CENTRE"); a partial name is, by anything else."""
        owner = self._ids.get(name, -1)  # -1: a name no chunk gives as is (stripped)
        name_words = self._words_of[owner] if owner >= 0 else frozenset(tokens(name))
        others = self.entity_ids[self._docs(word)]
        others = others[others != owner]
        if name_words - {"the"} == {word}:
            others = others[~np.isin(others, self._named_with.get(word, []))]
        return bool(others.size >= COMMON_ELSEWHERE)

    def confidence(self, name_words: Sequence[str], name: str) -> float:
        """The share of the chunks holding all of ``name_words`` that are ``name``'s own (1 when
        no chunk holds them: nothing else competes for the words)."""
        docs: np.ndarray | None = None
        for word in sorted(set(name_words), key=lambda w: len(self._docs(w))):
            found = self._docs(word)
            if not len(found):
                continue  # a stopword or a word no chunk uses: it tells nothing apart
            docs = found if docs is None else _intersect(docs, found)
            if not len(docs):
                break
        if docs is None or not len(docs):
            return 1.0
        owners = self.entity_ids[docs]
        own = int(np.count_nonzero(owners == self._ids.get(name, -1)))
        return (own + 1.0) / (len(docs) + 1.0)

    def rated(self) -> Rated:
        """The keys of these entities' names, rated by these statistics."""
        return rate(self.names, FUNCTION_WORDS_EN, self.is_common, self.confidence)

    def _docs(self, word: str) -> np.ndarray:
        found = self._postings.get(word)
        if found is None:
            found = np.unique(self._lexical.matching(word))
            self._postings[word] = found
        return found


def _intersect(small: np.ndarray, large: np.ndarray) -> np.ndarray:
    """The common items of two sorted arrays of unique ids, ``small`` the shorter, in time
    linear in ``small`` (``np.intersect1d`` sorts both: one name against a word every chunk
    holds, 12,500 times at 100k chunks, took most of a snapshot's load)."""
    if not len(large):
        return large
    at = np.minimum(np.searchsorted(large, small), len(large) - 1)
    common: np.ndarray = small[large[at] == small]
    return common


def common_words(lexical: LexicalIndex, entity_of: Sequence[str]) -> Callable[[str, str], bool]:
    """A gazetteer's ``is_common`` (``EntityStats.is_common``)."""
    return EntityStats(lexical, entity_of).is_common


@dataclass(frozen=True, slots=True)
class EntityTable:
    """``entities.bin`` read: the chunks' entities (``names``, ``entity_of``) and the rated keys
    (``rated_keys()``, the arrays a gazetteer's tables index)."""

    names: StringTable
    entity_of: npt.NDArray[np.int32]
    owners: StringTable
    keys: StringTable
    key_owner: npt.NDArray[np.int32]
    key_sure: npt.NDArray[np.float64]
    key_partial: npt.NDArray[np.uint8]
    rules: int
    size: int
    span: int
    shared: frozenset[str]

    @staticmethod
    def dump(lexical: LexicalIndex, chunks: Sequence[Chunk]) -> bytes:
        """The bytes of ``entities.bin`` for these chunks and their lexical index: every chunk's
        entity read and every name rated (a pass over the chunks and the postings)."""
        stats = EntityStats(lexical, chunk_entities(chunks)[1])
        rated = stats.rated()
        arrays: dict[str, npt.NDArray[Any]] = {
            **StringTable.of(stats.names).arrays("n_"),
            "entity_of": stats.entity_ids,
            **RatedKeys.of(rated.keys, rated.sure, rated.partial).arrays(),
        }
        return dump_arrays(
            ENTITIES_KIND, arrays, count=len(chunks), rules=RULES, names=rated.size,
            span=rated.span, shared=sorted(rated.shared),
        )  # fmt: skip

    @classmethod
    def open(cls, path: Path, count: int) -> EntityTable:
        """Map and check ``entities.bin`` of a snapshot of ``count`` chunks; ValueError naming
        what is wrong."""
        return cls.read(ArraysFile.open(path, ENTITIES_KIND), count)

    @classmethod
    def read(cls, file: ArraysFile, count: int) -> EntityTable:
        held = file.integer("count", 0, 1 << 32)
        if held != count:
            raise ValueError(f"it holds the entities of {held} chunks, not {count}")
        names, owners = StringTable.read(file, "n_"), StringTable.read(file, "g_")
        entity_of = file.array("entity_of", "<i4")
        if entity_of.size != count or (count and int(entity_of.min()) < 0):
            raise ValueError(f"entity_of does not hold {count} entities of its names")
        if count and int(entity_of.max()) >= len(names):
            raise ValueError("a chunk's entity is outside the names")
        keys = StringTable.read(file, "k_")
        _check_keys(file, keys)
        key_owner = file.array("key_owner", "<i4")
        key_sure = file.array("key_sure", "<f8")
        key_partial = file.array("key_partial", "|u1")
        _check_per_key(len(keys), len(owners), key_owner, key_sure, key_partial)
        return cls(
            names=names,
            entity_of=entity_of,
            owners=owners,
            keys=keys,
            key_owner=key_owner,
            key_sure=key_sure,
            key_partial=key_partial,
            rules=file.integer("rules", 0, 1 << 16),
            size=file.integer("names", 0, 1 << 40),
            span=file.integer("span", 0, MAX_NAME_TOKENS),
            shared=_shared_of(file.header.get("shared")),
        )

    def rated_keys(self) -> RatedKeys:
        """The rated keys, as the arrays a gazetteer's tables index (``index.key_tables``)."""
        return RatedKeys(self.keys, self.key_owner, self.key_sure, self.key_partial, self.owners)

    def entity(self, label: int) -> str:
        """Chunk ``label``'s entity."""
        return _bounded(self.names[int(self.entity_of[label])], MAX_EMBED_BYTES)


def _check_keys(file: ArraysFile, keys: StringTable) -> None:
    """Every key is 1 to MAX_KEY_CHARS of [a-z0-9] (what ``tokens`` makes), and what they would
    take in memory as a gazetteer's tables is within MAX_GAZETTEER_BYTES."""
    blob = np.frombuffer(file.blob("k_blob"), dtype=np.uint8)
    digit = (blob >= ord("0")) & (blob <= ord("9"))
    if blob.size and not bool(np.all(digit | ((blob >= ord("a")) & (blob <= ord("z"))))):
        raise ValueError("a key holds other characters than a-z and 0-9")
    offsets = file.array("k_offsets", "<u8").astype(np.int64)
    lengths: npt.NDArray[np.int64] = offsets[1:] - offsets[:-1]
    if lengths.size and (int(lengths.min()) < 1 or int(lengths.max()) > MAX_KEY_CHARS):
        raise ValueError(f"a key is empty or longer than {MAX_KEY_CHARS} characters")
    if gazetteer_bytes(lengths) > MAX_GAZETTEER_BYTES:
        raise ValueError(f"its keys would take more than {MAX_GAZETTEER_BYTES} bytes in memory")


def gazetteer_bytes(lengths: npt.NDArray[np.int64]) -> int:
    """What a gazetteer's tables take for keys of these lengths, at most (the tables' own
    bytes: ``index.key_tables.tables_bytes``)."""
    return tables_bytes(lengths)


def _check_per_key(
    keys: int,
    owners: int,
    key_owner: npt.NDArray[np.int32],
    key_sure: npt.NDArray[np.float64],
    key_partial: npt.NDArray[np.uint8],
) -> None:
    if (key_owner.size, key_sure.size, key_partial.size) != (keys, keys, keys):
        raise ValueError(f"the per-key arrays do not all hold {keys} keys")
    if keys and (int(key_owner.min()) < -1 or int(key_owner.max()) >= owners):
        raise ValueError("a key's owner is outside the names")
    if keys and not bool(np.all((key_sure >= 0.0) & (key_sure <= 1.0))):
        raise ValueError("a key's confidence is not a number from 0 to 1")
    if keys and int(key_partial.max()) > 1:
        raise ValueError("a key's partial flag is not 0 or 1")


def _shared_of(value: object) -> frozenset[str]:
    if (
        type(value) is not list
        or len(value) > _MAX_SHARED
        or any(
            type(w) is not str or not _TOKEN.fullmatch(w) or len(w) > MAX_KEY_CHARS for w in value
        )
    ):
        raise ValueError("the header's shared words are not a short list of words")
    return frozenset(value)
