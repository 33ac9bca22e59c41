"""Chunk messages built once and copied into each response (issue 19, 5).

Building a ``pb.Chunk`` field by field (nine fields, a list, a map) cost more per hit than the
search that found it. The hits of calls repeat (the same question, a follow-up, the next caller
with the same problem), so a chunk's message built a second time is kept, without its score, and
later responses take copies of it (one C-level copy each) and set the scores on them. A message
built the first time is built in place in the response: keeping a copy of every hit cost more
than the cache saved on varied questions, whose hits mostly come once.

The cache is keyed by base and chunk id and holds the chunk it was built from: a hit whose chunk
differs (a new snapshot changed a chunk's url or metadata under the same id) builds its message
anew. Bounded in bytes (the messages' serialized size); full, it starts over.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from index.types import Chunk, meta_text
from sidecar.gen import retrieval_pb2 as pb
from sidecar.turn.hits import Hit

# A few thousand chunks' messages: the hits of the calls of a busy minute. Per process.
CACHE_BYTES = 8 << 20
# Chunks whose message was built once, remembered so that the second build keeps it: ~70 bytes
# each in a set, so ~5 MiB at most. Per process.
MAX_SEEN = 1 << 16


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


class ChunkMessages:
    """Fills a response's repeated ``Chunk`` field from hits, from messages built once."""

    def __init__(self, max_bytes: int = CACHE_BYTES) -> None:
        self.max_bytes = max_bytes
        self._cache: dict[tuple[str, str], tuple[Chunk, pb.Chunk]] = {}
        self._seen: set[int] = set()
        self._bytes = 0

    def fill(self, field: Any, hits: Sequence[Hit]) -> None:
        """Append one message per hit to ``field`` (a repeated ``pb.Chunk`` field): a copy of
        the one built before, or one built in place; a chunk's message is kept the second time
        it is built (a chunk seen once costs no copy: most hits of varied questions are)."""
        for hit in hits:
            key = (hit.knowledge_base, hit.chunk.chunk_id)
            entry = self._cache.get(key)
            if entry is not None and (entry[0] is hit.chunk or entry[0] == hit.chunk):
                message = field.add()
                message.CopyFrom(entry[1])
            elif self._seen_before(key):
                message = self._built(field, key, hit)
            else:
                message = field.add(**_fields(hit.knowledge_base, hit.chunk))
            message.score = hit.score

    def _seen_before(self, key: tuple[str, str]) -> bool:
        """Whether ``key`` was built since the last start-over (kept as its hash: a collision
        only keeps a message one build early); records it."""
        h = hash(key)
        if h in self._seen:
            return True
        if len(self._seen) >= MAX_SEEN:
            self._seen = set()
        self._seen.add(h)
        return False

    def _built(self, field: Any, key: tuple[str, str], hit: Hit) -> pb.Chunk:
        """Build the hit's message in ``field`` (no copy on the way in, unlike a message built
        apart and appended) and keep a copy of it."""
        message: pb.Chunk = field.add(**_fields(hit.knowledge_base, hit.chunk))
        kept = pb.Chunk()
        kept.CopyFrom(message)
        size = kept.ByteSize()
        if self._bytes + size > self.max_bytes:
            self._cache = {}
            self._bytes = 0
        self._cache[key] = (hit.chunk, kept)
        self._bytes += size
        return message
