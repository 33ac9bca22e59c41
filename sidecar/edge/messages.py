"""Chunk messages encoded once and merged into each response (issue 19, 5).

Building a ``pb.Chunk`` field by field (nine fields, a list, a map) cost more per hit than the
search that found it, and copying a kept message into each response (one ``add`` and one
``CopyFrom`` a hit, from Python) still cost a few microseconds a call. The hits of calls repeat
(the same question, a follow-up, the next caller with the same problem), so a chunk's message is
kept serialized, without its score: a response's hits are then one byte string (each hit's
field tag, its kept bytes and its score's four bytes, appended after the rest of the chunk, which
protobuf allows) merged into the response by one C-level parse. A chunk's bytes are kept the
second time they are encoded: a hit of varied questions mostly comes once, and keeping those
would only push out the ones that come again.

The cache is keyed by base and chunk id and holds the chunk it was built from: a hit whose chunk
differs (a new snapshot changed a chunk's url or metadata under the same id) is encoded anew.
Bounded in bytes: each entry counts its encoding and the chunk it holds (its strings as Python
keeps them, the embedded text beside the text, and a fixed cost for the objects); full, it
starts over.

A plain Search's hits come as labels into a mapped chunk table (``TableHits``): over a large base
with varied questions nearly every hit is new, and decoding its chunk (strings, a tuple, a dict)
to build a ``pb.Chunk`` cost ~3x writing its field from the table's UTF-8 bytes straight away
(``table_encoded``: the bytes protobuf writes, a key, a length and the string each; ``python
-m bench.hits_written``). Those encodings are kept too, on a second sighting, per table (a weak
reference: a snapshot let go takes its encodings along), within the same bound.

A base whose answers fit in ``ANSWERS_MAX_BYTES`` has every chunk's encoding written once, when
its snapshot is loaded (``Answers``, on the loader's thread, counted in the base's memory): a
plain Search over it then encodes nothing, whether its hits are new or not (none under a
memory budget, whose bytes are the bases'). Over a base of
20,000 chunks and varied questions, writing ten hits from the table cost ~40 us a call against
~4 us read from the answers (``python -m bench.search_parts``).
"""

from __future__ import annotations

import functools
import struct
import sys
import weakref
from array import array
from collections.abc import Sequence
from typing import Any

from google.protobuf.descriptor import Descriptor
from google.protobuf.message import Message

from index.tables import FIXED, STRING_VALUE, ChunkTable, Utf8Chunk
from index.types import META_JOIN, Chunk, meta_text
from sidecar.gen import retrieval_pb2 as pb
from sidecar.turn.hits import Hit, TableHits

# A few thousand chunks' messages: the hits of the calls of a busy minute. Per process.
CACHE_BYTES = 8 << 20
# A base's answers written at load at most (``Answers``): ~100,000 chunks of a few sentences; a
# larger base's hits are written as they come. Per base and per worker process (the mapped
# files' pages are shared between workers, these are each worker's own), counted in the base's
# memory; none under [sidecar] memory_budget_mb, whose bytes are the bases'.
ANSWERS_MAX_BYTES = 32 << 20
# Chunks whose message was encoded once, remembered so that the second encoding keeps it: ~70
# bytes each in a set, so ~5 MiB at most. Per process.
MAX_SEEN = 1 << 16
# ``Chunk.score`` (field 8, a float: wire type 5, four little-endian bytes) as it follows a kept
# encoding; every kept encoding's length counts these five bytes.
_SCORE_TAG = b"\x45"
_SCORE_BYTES = 5
_float32 = struct.Struct("<f").pack


def chunk_message(knowledge_base: str, chunk: Chunk, score: float = 0.0) -> pb.Chunk:
    return pb.Chunk(**_fields(knowledge_base, chunk), score=score)


def _fields(knowledge_base: str, chunk: Chunk) -> dict[str, Any]:
    """A ``pb.Chunk``'s fields but its score."""
    return {
        "chunk_id": chunk.chunk_id,
        "knowledge_base": knowledge_base,
        "source": chunk.source,
        "source_path": chunk.source_path,
        "title": chunk.title,
        "breadcrumbs": chunk.breadcrumbs,
        "text": chunk.text,
        "url": chunk.url,
        "metadata": {key: meta_text(value) for key, value in chunk.metadata.items()},
    }


def varint(value: int) -> bytes:
    """``value`` (>= 0) as protobuf's base-128 varint."""
    out = bytearray()
    while value > 0x7F:
        out.append(0x80 | (value & 0x7F))
        value >>= 7
    out.append(value)
    return bytes(out)


@functools.cache
def field_key(descriptor: Descriptor, name: str, wire_type: int = 2) -> bytes:
    """The key (tag) of ``descriptor``'s field ``name`` as it precedes the field's value: its
    number and ``wire_type`` (2, length-delimited, for a message or a string)."""
    return varint(descriptor.fields_by_name[name].number << 3 | wire_type)


def _encoded(knowledge_base: str, chunk: Chunk) -> bytes:
    """A chunk's message but its score, as a length-delimited field's length and body, the
    length counting the score that follows it in a response."""
    data = pb.Chunk(**_fields(knowledge_base, chunk)).SerializeToString()
    return varint(len(data) + _SCORE_BYTES) + data + _SCORE_TAG


_CHUNK = pb.Chunk.DESCRIPTOR
# the keys of ``pb.Chunk``'s string fields, in the order a Utf8Chunk holds its fixed strings
# (id, path, title, text, embed text, url; the embedded text is not sent)
_ID, _PATH, _TITLE, _TEXT, _URL = (
    field_key(_CHUNK, name) for name in ("chunk_id", "source_path", "title", "text", "url")
)
_KB, _SOURCE = field_key(_CHUNK, "knowledge_base"), field_key(_CHUNK, "source")
_CRUMB, _ENTRY = field_key(_CHUNK, "breadcrumbs"), field_key(_CHUNK, "metadata")
_ENTRY_KEY, _ENTRY_VALUE = b"\x0a", b"\x12"  # a map entry's key (1) and value (2), both strings
_LIST_JOIN = META_JOIN.encode()  # meta_text's separator of a list's strings


def table_encoded(knowledge_base: str, blob: memoryview, chunk: Utf8Chunk) -> bytes:
    """What ``_encoded`` makes of the chunk whose strings are ``chunk`` in ``blob``, written
    from their bytes: the fields in ``pb.Chunk``'s order, an empty string left out as protobuf
    leaves it (a breadcrumb, and a map entry's key and value, are written whatever they hold),
    the metadata entries in the table's order (a map's order is no part of its value; protobuf
    writes its own, in hash order) and a key met again replacing its value, as a dict does.
    Straight-line, one list joined once: it runs for nearly every hit of a large base."""
    source, e, crumbs, meta_n = chunk
    a, b, c, d, t, u, v = e[: FIXED + 1]  # id, path, title, text, embed text, url: their starts
    parts: list[bytes | memoryview] = [_ID, _length(b - a), blob[a:b]] if b > a else []
    parts += (string_field(_KB, knowledge_base), string_field(_SOURCE, source))
    if c > b:
        parts += (_PATH, _length(c - b), blob[b:c])
    if d > c:
        parts += (_TITLE, _length(d - c), blob[c:d])
    for k in range(FIXED, FIXED + crumbs):
        parts += (_CRUMB, _length(e[k + 1] - e[k]), blob[e[k] : e[k + 1]])
    if t > d:
        parts += (_TEXT, _length(t - d), blob[d:t])
    if v > u:
        parts += (_URL, _length(v - u), blob[u:v])
    if meta_n:
        _put_metadata(parts, blob, e, FIXED + crumbs, meta_n)
    body = b"".join(parts)
    return b"".join((_length(len(body) + _SCORE_BYTES), body, _SCORE_TAG))


class Answers:
    """Every chunk of one table encoded for one base, as ``table_encoded`` writes a hit (its
    length, its fields, the score's key), end to end in one buffer: a hit's piece is one slice.
    Written once, off the event loop, when its snapshot loads (``of``)."""

    __slots__ = ("_data", "_starts", "knowledge_base", "nbytes")

    def __init__(self, knowledge_base: str, data: bytearray, starts: array[int]) -> None:
        self.knowledge_base = knowledge_base
        self._data = memoryview(data)
        self._starts = starts
        self.nbytes = sys.getsizeof(data) + sys.getsizeof(starts)  # as allocated

    @classmethod
    def of(
        cls, knowledge_base: str, table: ChunkTable, cap: int = ANSWERS_MAX_BYTES
    ) -> Answers | None:
        """``table``'s answers for ``knowledge_base``, or None when they would be over ``cap``
        bytes: a table whose strings pass twice the cap is not tried (a chunk's answer holds
        its strings but the embedded text, about half of them), one passing it as it is
        written stops there."""
        if table.blob.nbytes > 2 * cap:
            return None
        data = bytearray()
        starts = array("q", [0])
        blob = table.blob
        for label in range(len(table)):
            raw = table.utf8(label)
            data += (
                _encoded(knowledge_base, table[label])
                if raw is None
                else table_encoded(knowledge_base, blob, raw)
            )
            if len(data) > cap:
                return None
            starts.append(len(data))
        return cls(knowledge_base, data, starts)

    def piece(self, label: int) -> memoryview:
        """Chunk ``label``'s answer, as ``table_encoded`` writes it."""
        starts = self._starts
        return self._data[starts[label] : starts[label + 1]]


def _put_metadata(
    parts: list[bytes | memoryview], blob: memoryview, e: list[int], at: int, meta_n: list[int]
) -> None:
    """The map entries of a chunk's metadata, whose strings start at its string ``at``; a
    list's strings joined as ``meta_text`` joins them."""
    entries: dict[bytes, bytes] = {}
    for n in meta_n:
        width = 1 if n == STRING_VALUE else n
        values = [blob[e[k] : e[k + 1]] for k in range(at + 1, at + 1 + width)]
        entries[bytes(blob[e[at] : e[at + 1]])] = _LIST_JOIN.join(values)
        at += 1 + width
    for key, value in entries.items():
        entry = _ENTRY_KEY + _length(len(key)) + key + _ENTRY_VALUE + _length(len(value)) + value
        parts += (_ENTRY, _length(len(entry)), entry)


# The varints of the lengths below this (every one of one or two bytes), kept: a chunk's
# fields and encodings are mostly this short, and a two-byte varint made per call cost ~0.18 us
# more than one read here, 2-3 a hit. ~0.7 MB a process.
_SHORT = 1 << 14
_LENGTHS = tuple(varint(n) for n in range(_SHORT))


def _length(n: int) -> bytes:
    return _LENGTHS[n] if n < _SHORT else varint(n)


def utf8_field(key: bytes, text: str) -> bytes:
    """A string field as ``string_field`` writes it, not kept: for words new on most calls (a
    turn's query), which would only push the kept ones out."""
    if not text:
        return b""
    data = text.encode("utf-8")
    return key + _length(len(data)) + data


# A base's snapshot versions, policy words and sources' names: a handful per base, the same on
# every call.
_KEPT_STRINGS = 256


@functools.lru_cache(maxsize=_KEPT_STRINGS)
def string_field(key: bytes, text: str) -> bytes:
    """A string field: its key, its length and its UTF-8 bytes (nothing for an empty string,
    the default); kept, since the same few come on every call."""
    if not text:
        return b""
    data = text.encode("utf-8")
    return key + varint(len(data)) + data


# A table's entry beside its encoding: the key and its tuple, the bytes' header, the dict's slot.
_TABLE_ENTRY_BYTES = 200
# An entry's objects beside its strings: the key, the tuples, the Chunk and the bytes' headers.
_ENTRY_BYTES = 400


def _held_bytes(chunk: Chunk, encoded: bytes) -> int:
    """What keeping ``encoded`` and ``chunk`` holds, in bytes: the encoding, and the chunk's two
    long strings as Python keeps them (its other fields are in the encoding's count, once)."""
    return len(encoded) + sys.getsizeof(chunk.text) + sys.getsizeof(chunk.embed_text) + _ENTRY_BYTES


class _Kept(dict[int, bytes]):
    """One chunk table's kept encodings for one base, by label, and the bytes they hold
    (``held``): counted with the table, so a table let go takes its count with it."""

    __slots__ = ("held",)

    def __init__(self) -> None:
        super().__init__()
        self.held = 0


class ChunkMessages:
    """Fills a response's repeated ``Chunk`` field from hits, from encodings kept."""

    def __init__(self, max_bytes: int = CACHE_BYTES) -> None:
        self.max_bytes = max_bytes
        self._cache: dict[tuple[str, str], tuple[Chunk, bytes]] = {}
        # a plain Search's encodings (``table_pieces``), by table, then base, then label
        self._tables: weakref.WeakKeyDictionary[ChunkTable, dict[str, _Kept]] = (
            weakref.WeakKeyDictionary()
        )
        self._seen: set[int] = set()
        self._bytes = 0  # what ``_cache`` holds (each table's encodings count in its ``_Kept``)

    @property
    def held_bytes(self) -> int:
        """What the kept encodings hold: the chunks' and those of the tables still alive (a
        table let go takes its encodings, and their count, with it)."""
        return self._bytes + sum(kept.held for kept in self._table_kepts())

    def _table_kepts(self) -> list[_Kept]:
        """The kept encodings of every table still alive, each base's apart."""
        return [kept for bases in list(self._tables.values()) for kept in bases.values()]

    def fill(self, message: Message, name: str, hits: Sequence[Hit]) -> None:
        """Append one ``Chunk`` per hit, with its score, to ``message``'s repeated field
        ``name``, in one merge."""
        if not hits:
            return
        parts: list[bytes] = []
        self.pieces(parts, field_key(message.DESCRIPTOR, name), hits)
        message.MergeFromString(b"".join(parts))

    def pieces(self, parts: list[bytes], key: bytes, hits: Sequence[Hit]) -> None:
        """Append to ``parts`` each hit as a ``Chunk`` field of key ``key``: the key, the
        chunk's kept encoding and its score."""
        cache = self._cache
        for hit in hits:
            chunk = hit.chunk
            entry = cache.get((hit.knowledge_base, chunk.chunk_id))
            if entry is not None and (entry[0] is chunk or entry[0] == chunk):
                encoded = entry[1]
            else:
                encoded = self._encode((hit.knowledge_base, chunk.chunk_id), hit)
            parts += (key, encoded, _float32(hit.score))

    def table_pieces(self, parts: list[bytes], key: bytes, hits: TableHits) -> None:
        """As ``pieces``, for hits read from a chunk table: each chunk's encoding kept, or
        written from the table's bytes (``table_encoded``: no Chunk built), or, for a chunk the
        table says must be decoded (a string over its cap, bytes not UTF-8), encoded from it.
        A plain Search's loop: kept by label, a base's apart (no key made a hit)."""
        kb, table = hits.knowledge_base, hits.table
        answers = hits.answers
        if answers is not None and answers.knowledge_base == kb:  # written at load
            piece = answers.piece
            for label, score in hits.found:
                parts += (key, piece(label), _float32(score))
            return
        kept = self._kept(table, kb)
        get = kept.get
        for label, score in hits.found:
            encoded = get(label)
            if encoded is None:
                encoded = self._table_encode(kept, kb, table, label)
            parts += (key, encoded, _float32(score))

    def _kept(self, table: ChunkTable, kb: str) -> _Kept:
        """The encodings kept of ``table``'s chunks for ``kb`` (its own dict from the table's
        first answer, for as long as the table lives)."""
        bases = self._tables.get(table)
        if bases is None:
            bases = self._tables[table] = {}
        kept = bases.get(kb)
        if kept is None:
            kept = bases[kb] = _Kept()
        return kept

    def _table_encode(self, kept: _Kept, kb: str, table: ChunkTable, label: int) -> bytes:
        """Chunk ``label`` of ``table`` encoded, and kept in ``kept`` (the table's) when it was
        encoded before."""
        raw = table.utf8(label)
        encoded = _encoded(kb, table[label]) if raw is None else table_encoded(kb, table.blob, raw)
        held = len(encoded) + _TABLE_ENTRY_BYTES
        if self._seen_before((kb, id(table), label)) and held <= self.max_bytes:
            self._make_room(held)
            kept[label] = encoded
            kept.held += held
        return encoded

    def _make_room(self, held: int) -> None:
        """Start over (both caches) when ``held`` more bytes would pass the bound. The tables'
        dicts are emptied, not replaced: a call writing hits holds its table's."""
        if self.held_bytes + held > self.max_bytes:
            self._cache = {}
            for kept in self._table_kepts():
                kept.clear()
                kept.held = 0
            self._bytes = 0

    def _encode(self, key: tuple[str, str], hit: Hit) -> bytes:
        """The hit's chunk encoded, and kept when it was encoded before."""
        encoded = _encoded(hit.knowledge_base, hit.chunk)
        held = _held_bytes(hit.chunk, encoded)
        if self._seen_before(key) and held <= self.max_bytes:
            self._make_room(held)
            self._cache[key] = (hit.chunk, encoded)
            self._bytes += held
        return encoded

    def _seen_before(self, key: tuple[str | int, ...]) -> bool:
        """Whether ``key`` was encoded since the last start-over (kept as its hash: a collision
        only keeps an encoding one time early); records it."""
        h = hash(key)
        if h in self._seen:
            return True
        if len(self._seen) >= MAX_SEEN:
            self._seen = set()
        self._seen.add(h)
        return False


# Each hit's message encoded once per process and merged into (or written out as) responses.
MESSAGES = ChunkMessages()
