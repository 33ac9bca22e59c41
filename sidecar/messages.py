"""Chunk messages built once and copied into each response (issue 19, 5).

Building a ``pb.Chunk`` field by field (nine fields, a list, a map) cost more per hit than the
search that found it. The hits of calls repeat (the same question, a follow-up, the next caller
with the same problem), so each chunk's message is built once, without its score, and a response
takes copies of the built messages (one C-level copy each) and sets the scores on them.

The cache is keyed by base and chunk id and holds the chunk it was built from: a hit whose chunk
differs (a new snapshot changed a chunk's url or metadata under the same id) builds its message
anew. Bounded in bytes (the messages' serialized size); full, it starts over.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from index.types import Chunk, meta_text
from sidecar.gen import retrieval_pb2 as pb
from sidecar.sessions import Hit

# A few thousand chunks' messages: the hits of the calls of a busy minute. Per process.
CACHE_BYTES = 8 << 20


def chunk_message(knowledge_base: str, chunk: Chunk, score: float = 0.0) -> pb.Chunk:
    return pb.Chunk(
        chunk_id=chunk.chunk_id,
        knowledge_base=knowledge_base,
        source=chunk.source,
        source_path=chunk.source_path,
        title=chunk.title,
        breadcrumbs=list(chunk.breadcrumbs),
        text=chunk.text,
        score=score,
        url=chunk.url,
        metadata={key: meta_text(value) for key, value in chunk.metadata.items()},
    )


class ChunkMessages:
    """Fills a response's repeated ``Chunk`` field from hits, from messages built once."""

    def __init__(self, max_bytes: int = CACHE_BYTES) -> None:
        self.max_bytes = max_bytes
        self._cache: dict[tuple[str, str], tuple[Chunk, pb.Chunk]] = {}
        self._bytes = 0

    def fill(self, field: Any, hits: Sequence[Hit]) -> None:
        """Append one message per hit to ``field`` (a repeated ``pb.Chunk`` field)."""
        if not hits:
            return
        field.extend([self._built(hit) for hit in hits])
        for message, hit in zip(field[len(field) - len(hits) :], hits, strict=True):
            message.score = hit.score

    def _built(self, hit: Hit) -> pb.Chunk:
        key = (hit.knowledge_base, hit.chunk.chunk_id)
        entry = self._cache.get(key)
        if entry is not None and (entry[0] is hit.chunk or entry[0] == hit.chunk):
            return entry[1]
        message = chunk_message(hit.knowledge_base, hit.chunk)
        size = message.ByteSize()
        if self._bytes + size > self.max_bytes:
            self._cache = {}
            self._bytes = 0
        self._cache[key] = (hit.chunk, message)
        self._bytes += size
        return message
