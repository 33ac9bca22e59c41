"""``Hit``: a chunk as one search returned it, with the base it came from and its score.

The engine makes hits; sessions retain them, the servicer, the knowledge functions and the
webhooks answer with them. They live here, apart from all of those, so each imports only this.
"""

from __future__ import annotations

from dataclasses import dataclass

from index.types import Chunk


@dataclass(slots=True)
class Hit:
    """A chunk as one search returned it. Never changed once made; not frozen because a search
    makes one per result on every call, and a frozen class's ``__init__`` (each field set
    through ``object.__setattr__``) costs a few times a plain slotted one's."""

    knowledge_base: str
    chunk: Chunk
    score: float
