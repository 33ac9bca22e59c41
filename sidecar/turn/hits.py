"""``Hit``: a chunk as one search returned it, with the base it came from and its score.

The engine makes hits; sessions retain them, the servicer, the knowledge functions and the
webhooks answer with them. They live here, apart from all of those, so each imports only this.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any, overload

from index.tables import ChunkTable
from index.types import Chunk


@dataclass(slots=True)
class Hit:
    """A chunk as one search returned it. Never changed once made; not frozen because a search
    makes one per result on every call, and a frozen class's ``__init__`` (each field set
    through ``object.__setattr__``) costs a few times a plain slotted one's."""

    knowledge_base: str
    chunk: Chunk
    score: float


# A candidate as a turn ranks it: its chunk and score, a tuple (made in a fraction of a
# ``Hit``'s time); the engine makes ``Hit``s only for the candidates that answer.
Scored = tuple[Chunk, float]


class TableHits(Sequence[Hit]):
    """A plain Search's hits as the graph found them: labels into a base's chunk table, with
    their scores. The servicer writes the answer from the table's bytes (sidecar/edge/wire.py),
    so nothing is decoded for it; a ``Hit`` (its chunk decoded) is made for the first reader
    that asks for one (a session retaining them, the webhooks), then kept."""

    __slots__ = ("_hits", "answers", "found", "knowledge_base", "table")

    def __init__(
        self,
        knowledge_base: str,
        table: ChunkTable,
        found: list[tuple[int, float]],
        answers: Any = None,
    ):
        self.knowledge_base = knowledge_base
        self.table = table
        self.found = found
        self.answers = answers  # the table's answers written at load (sidecar/edge/messages.py)
        self._hits: list[Hit] | None = None

    def __len__(self) -> int:
        return len(self.found)

    @overload
    def __getitem__(self, i: int) -> Hit: ...
    @overload
    def __getitem__(self, i: slice) -> list[Hit]: ...
    def __getitem__(self, i: int | slice) -> Hit | list[Hit]:
        return self._made()[i]

    def __iter__(self) -> Iterator[Hit]:
        return iter(self._made())

    def __eq__(self, other: object) -> bool:
        """Equal to any sequence of the same hits, as the list of them it stands for is."""
        if not isinstance(other, Sequence) or isinstance(other, str | bytes):
            return NotImplemented
        return self._made() == list(other)

    __hash__ = None  # type: ignore[assignment]  # a list's equality, a list's (absent) hash

    def __repr__(self) -> str:
        return f"TableHits({self._made()!r})"

    def __reduce__(self) -> tuple[type[list[Hit]], tuple[list[Hit]]]:
        """Pickled (and deep-copied) as the list of its hits: the table, a snapshot's mapped
        files, is no part of the value."""
        return list, (self._made(),)

    def _made(self) -> list[Hit]:
        if self._hits is None:
            kb, table = self.knowledge_base, self.table
            self._hits = [Hit(kb, table[label], score) for label, score in self.found]
        return self._hits
