"""A searcher: everything a query needs of one snapshot, built before the snapshot is served.

    searcher = Searcher.build(snapshot)   # blocking (about a second at 100k chunks): off the loop
    holder.publish(searcher)              # the swap: one reference, the snapshot inside it

Lucene's ``IndexSearcher`` per reader. The refresher builds one per loaded snapshot in its
warm-up, on a worker thread as the load itself, and the holder publishes it as one reference;
a request reads it once and keeps it to the end, so a swap never changes anything under a
running call, and nothing per snapshot is built on the event loop or kept in a module-level
cache. It holds, beside the snapshot (vectors, graph, chunks, pages, filter index):

    vectors     the graph file's vectors, memory-mapped (``hnsw_file.vector_rows``): hybrid
                ranking scores a candidate the graph did not return from these, where hnswlib's
                ``get_items`` took ~0.2 ms a vector
    bm25        the lexical index with buffers of its own (``index.lexical.Bm25``): a query
                scores only the documents its terms match
    sources     each source's chunk labels and count, for source filters (``Sources``)
    gazetteer   the follow-ups' entity names (``followups.gazetteer``)
    pages       page -> its first chunk, for ``ReadPage``'s title and URL

Immutable once built (the BM25 buffers are scratch space, zero between queries).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from index.filters import FilterIndex, Mask
from index.hnsw_file import vector_rows
from index.lexical import Bm25
from index.mapped import let_go
from index.snapshot import VECTORS, LoadedSnapshot
from index.tables import ChunkTable
from index.types import Chunk
from sidecar.edge.messages import Answers
from sidecar.turn import followups

Labels = npt.NDArray[np.int64]
VectorRows = tuple[npt.NDArray[np.float32], Labels]  # vectors, and each label's row in them


@dataclass(frozen=True, slots=True)
class Sources:
    """Which chunks each source holds, counted once: a source filter reads these rather than
    scan the base (``np.isin`` over every chunk) per query. 8 bytes a chunk in all, whatever
    the number of sources (a mask per source would take a byte a chunk per source)."""

    names: tuple[str, ...]
    source_of: npt.NDArray[np.int32]  # chunk label -> index into names
    labels: tuple[Labels, ...]  # per source, ascending
    n: int

    @classmethod
    def of(cls, snapshot: LoadedSnapshot) -> Sources:
        names, source_of = snapshot.source_names, snapshot.source_of
        if len(names) < 2:  # a filter either keeps everything or nothing: no labels needed
            return cls(names, source_of, (), len(snapshot.chunks))
        order = np.argsort(source_of, kind="stable").astype(np.int64)
        ends = np.cumsum(np.bincount(source_of, minlength=len(names)))
        labels = tuple(np.split(order, ends[:-1]))
        return cls(names, source_of, labels, len(snapshot.chunks))

    def ids(self, sources: Sequence[str]) -> tuple[int, ...] | None:
        """The indexes of ``sources`` in ``names`` (unknown names match nothing); None when
        they filter nothing out (none given, or every source)."""
        if not sources:
            return None
        wanted = set(sources)
        ids = tuple(i for i, name in enumerate(self.names) if name in wanted)
        return None if len(ids) == len(self.names) else ids

    def count(self, ids: Sequence[int]) -> int:
        if len(self.names) < 2:
            return self.n if ids else 0
        return sum(int(self.labels[i].size) for i in ids)

    def labels_of(self, ids: Sequence[int]) -> Labels:
        """The chunks of the sources ``ids``, ascending."""
        if len(self.names) < 2:
            return np.arange(self.n if ids else 0, dtype=np.int64)
        if len(ids) == 1:
            return self.labels[ids[0]]
        return np.sort(np.concatenate([self.labels[i] for i in ids]))

    def among(self, ids: Sequence[int], labels: npt.NDArray[np.integer]) -> Mask:
        """Which of ``labels`` (a few candidates) are in the sources ``ids``."""
        return np.isin(self.source_of[labels], np.asarray(ids, dtype=np.int32))

    def mask(self, ids: Sequence[int]) -> Mask:
        """A mask over every chunk: for a call with metadata filters too, whose mask it joins."""
        mask = np.zeros(self.n, dtype=np.bool_)
        mask[self.labels_of(ids)] = True
        mask.setflags(write=False)
        return mask

    @property
    def nbytes(self) -> int:
        return sum(int(labels.nbytes) for labels in self.labels)


@dataclass(frozen=True, slots=True, eq=False)
class Searcher:
    """One snapshot and everything built from it for queries; see the module docstring."""

    snapshot: LoadedSnapshot
    vectors: VectorRows
    bm25: Bm25
    sources: Sources
    gazetteer: followups.Gazetteer
    pages: Pages  # (source, source_path) -> the page's first chunk
    held_bytes: int  # the gazetteer's tables built at load (the pages are the filter index's)
    # every chunk's answer, written at load for a base that fits (sidecar/edge/messages.py)
    answers: Answers | None = None

    @classmethod
    def build(cls, snapshot: LoadedSnapshot, *, answers: bool = True) -> Searcher:
        """Build everything; blocking (it reads every chunk once): call it off the event loop.
        ``answers``: write the base's answers too (``_answers``); a sidecar with a memory budget
        does not, so that its budget holds bases rather than a cache of their answers."""
        gazetteer = followups.gazetteer(snapshot)
        pages = page_index(snapshot.chunks, snapshot.filters)
        searcher = cls(
            snapshot=snapshot,
            vectors=_vector_rows(snapshot),
            bm25=Bm25(snapshot.lexical),
            sources=Sources.of(snapshot),
            gazetteer=gazetteer,
            pages=pages,
            held_bytes=gazetteer.built_bytes,
            answers=_answers(snapshot) if answers else None,
        )
        _let_go(snapshot)
        return searcher

    @property
    def version(self) -> str:
        return self.snapshot.version

    @property
    def chunks(self) -> Sequence[Chunk]:
        return self.snapshot.chunks

    @property
    def memory_bytes(self) -> int:
        """The snapshot's bytes (``LoadedSnapshot.memory_bytes``) and what was built here: the
        arrays, and the Python objects (what ``memory_budget_mb`` evicts by)."""
        rows = 0 if self.vectors is self.snapshot.filters.vectors else self.vectors[1].nbytes
        built = rows + self.bm25.nbytes + self.sources.nbytes + self.held_bytes
        if self.answers is not None:
            built += self.answers.nbytes
        return self.snapshot.memory_bytes + built

    def vectors_of(
        self, labels: Sequence[int] | npt.NDArray[np.integer]
    ) -> npt.NDArray[np.float32]:
        """The stored (unit) vectors of ``labels``, read from the mapped graph file."""
        table, rows = self.vectors
        return np.asarray(table[rows[np.asarray(labels, dtype=np.int64)]], dtype=np.float32)


def _answers(snapshot: LoadedSnapshot) -> Answers | None:
    """Every chunk's answer, written before ``_let_go`` lets the pages read go (a table's
    chunks only: a snapshot of Chunk objects is a test's)."""
    chunks = snapshot.chunks
    if not isinstance(chunks, ChunkTable):
        return None
    return Answers.of(snapshot.manifest.knowledge_base, chunks)


def _let_go(snapshot: LoadedSnapshot) -> None:
    """The load and the build above read every chunk's path and head and every posting, and
    checked every array of the entities and the gazetteer's tables: the process lets those
    pages of the mapped files go, and keeps what calls read."""
    if isinstance(snapshot.chunks, ChunkTable):
        snapshot.chunks.let_go()
    snapshot.lexical.let_go()
    if snapshot.entities is not None:
        let_go(snapshot.entities.entity_of)
    if snapshot.key_tables is not None:
        let_go(snapshot.key_tables.prefixes.hashes)


def _vector_rows(snapshot: LoadedSnapshot) -> VectorRows:
    """The filter index's mapped vectors when it has them, else the graph file mapped here."""
    if snapshot.filters.vectors is not None:
        return snapshot.filters.vectors
    count = len(snapshot.chunks)
    if not count:
        return np.zeros((0, snapshot.manifest.embedder.dimension), np.float32), np.zeros(
            0, np.int64
        )
    return vector_rows(
        snapshot.folder / VECTORS, count=count, dimension=snapshot.manifest.embedder.dimension
    )


class Pages(Mapping[tuple[str, str], int]):
    """(source, source_path) -> the label of the page's first chunk, read from the filter
    index's pages (each path's chunks in label order, the paths sorted: ``FilterIndex``), so
    that no process holds a dict of every page beside them (125k pages at 1M chunks: 13 MB of
    dict and key tuples a worker)."""

    __slots__ = ("_filters", "_names", "_source_of")

    def __init__(
        self, filters: FilterIndex, names: Sequence[str], source_of: npt.NDArray[np.int32]
    ) -> None:
        self._filters, self._names, self._source_of = filters, tuple(names), source_of

    def __getitem__(self, key: tuple[str, str]) -> int:
        source, path = key
        labels = self._filters.page_labels(path)
        if source not in self._names or not labels.size:
            raise KeyError(key)
        mine = labels[self._source_of[labels] == self._names.index(source)]
        if not mine.size:
            raise KeyError(key)
        return int(mine[0])

    def __iter__(self) -> Iterator[tuple[str, str]]:
        for path in self._filters.paths:
            sources = self._source_of[self._filters.page_labels(path)].tolist()
            for i in dict.fromkeys(sources):
                yield self._names[i], path

    def __len__(self) -> int:
        return sum(1 for _ in self)


def page_index(chunks: Sequence[Chunk], filters: FilterIndex | None = None) -> Pages:
    """The pages of ``chunks``, by the filter index of them (``filters``, or one made here)."""
    if isinstance(chunks, ChunkTable):
        names, source_of = chunks.source_names, chunks.source_of
    else:
        names = tuple(dict.fromkeys(chunk.source for chunk in chunks))
        at = {name: i for i, name in enumerate(names)}
        source_of = np.asarray([at[chunk.source] for chunk in chunks], dtype=np.int32)
    return Pages(FilterIndex.empty(chunks) if filters is None else filters, names, source_of)
