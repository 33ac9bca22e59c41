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
"""

from __future__ import annotations

import functools
import struct
import sys
from collections.abc import Sequence
from typing import Any

from google.protobuf.descriptor import Descriptor
from google.protobuf.message import Message

from index.types import Chunk, meta_text
from sidecar.gen import retrieval_pb2 as pb
from sidecar.turn.hits import Hit

# A few thousand chunks' messages: the hits of the calls of a busy minute. Per process.
CACHE_BYTES = 8 << 20
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


# An entry's objects beside its strings: the key, the tuples, the Chunk and the bytes' headers.
_ENTRY_BYTES = 400


def _held_bytes(chunk: Chunk, encoded: bytes) -> int:
    """What keeping ``encoded`` and ``chunk`` holds, in bytes: the encoding, and the chunk's two
    long strings as Python keeps them (its other fields are in the encoding's count, once)."""
    return len(encoded) + sys.getsizeof(chunk.text) + sys.getsizeof(chunk.embed_text) + _ENTRY_BYTES


class ChunkMessages:
    """Fills a response's repeated ``Chunk`` field from hits, from encodings kept."""

    def __init__(self, max_bytes: int = CACHE_BYTES) -> None:
        self.max_bytes = max_bytes
        self._cache: dict[tuple[str, str], tuple[Chunk, bytes]] = {}
        self._seen: set[int] = set()
        self._bytes = 0

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

    def _encode(self, key: tuple[str, str], hit: Hit) -> bytes:
        """The hit's chunk encoded, and kept when it was encoded before."""
        encoded = _encoded(hit.knowledge_base, hit.chunk)
        held = _held_bytes(hit.chunk, encoded)
        if self._seen_before(key) and held <= self.max_bytes:
            if self._bytes + held > self.max_bytes:
                self._cache = {}
                self._bytes = 0
            self._cache[key] = (hit.chunk, encoded)
            self._bytes += held
        return encoded

    def _seen_before(self, key: tuple[str, str]) -> bool:
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
