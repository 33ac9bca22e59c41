"""Metadata and path filters: the per-snapshot index that serves them, and search through it.

    filters.json   {"fields": {FIELD: {VALUE: [label, ...]}}}   labels ascending, one file
                   per snapshot, written only for a base that declares ``filterable`` fields

A filter (``MetadataFilter``) passes a chunk when its field, or any element of a list-valued
field, equals one of ``any_of``; several filters all apply. Path patterns (``source_paths``)
pass a chunk whose page path is under a prefix ending in ``/``, matches a glob (``*``, ``?``,
``[``), or equals the pattern. ``FilterIndex`` is built with the snapshot when it loads (off the
event loop) and swapped with it; it turns a request's filters into an ``Allowed`` mask, cached
within a byte bound, and ``search`` finds the top k among the allowed chunks:

    small value partitions cover it       exact search over those values' copies of the vectors
    a few hundred chunks allowed          exact search over the allowed vectors, read from the
                                          hnswlib file memory-mapped (``hnsw_file.vector_rows``)
    otherwise                             over-fetch from the shared graph, drop the rest

Each way ends in exact search over the allowed chunks when too few survived, so a filter never
loses a result the graph missed (``python -m bench.metadata_filter`` measures them).
"""

from __future__ import annotations

import bisect
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from fnmatch import translate

import hnswlib
import numpy as np
import numpy.typing as npt
import orjson
from cachetools import LRUCache

from index.chunker import MAX_META_STRINGS
from index.hnsw_file import knn
from index.tables import ChunkTable
from index.types import Chunk, MetadataFilter, meta_values

FILTERS = "filters.json"
_JSON_ESCAPE = 6  # the most JSON bytes one byte of a string is written as ("\u0001")
_VALUE_JSON = 6  # a value's '"":[' and '],' around its labels
_FIELDS_SLACK = 64 * 1024  # '{"fields":{}}' and the filterable fields' names
# A filter letting through at least this share of chunks is served by over-fetching from the
# shared graph (about 1 / share x k candidates suffice); below it, by exact search.
OVERFETCH_MIN_SHARE = 0.5
OVERFETCH_FACTOR = 3  # candidates fetched per expected survivor, for the luck of the draw
# The copies together hold at most this many times the snapshot's vectors (list-valued fields
# put a chunk under several values); the values with the fewest chunks are copied first.
PARTITION_COPIES = 2.0
# Exact search's cost grows with the rows it reads, the graph's with the candidates fetched. On
# 20,000 x 384 (bench.metadata_filter): a partition (a contiguous copy) of 1,974 rows 0.13 ms,
# of 6,667 rows 1.6 ms; rows gathered from the memory-mapped file ~1 us each (217: 0.08 ms,
# 3,357: 3.5 ms); fetching 189 candidates from the graph 0.38 ms, 10 of them 0.15 ms. So
# partitions are kept and searched up to EXACT_MAX_ROWS, the file read up to GATHER_MAX_ROWS,
# and the graph serves the rest.
EXACT_MAX_ROWS = 4096
GATHER_MAX_ROWS = 256
# What the masks of recent filters may hold, in bytes (one byte per chunk each): a caller's
# filters repeat from turn to turn, and a mask over 100k chunks takes ~0.1 ms to build.
MASK_CACHE_BYTES = 16 * 1024 * 1024
_STR_BYTES = 49  # a Python ASCII str's header (sys.getsizeof("") in 3.11)
GLOB_CHARS = frozenset("*?[")

Ranked = list[tuple[int, float]]
Mask = npt.NDArray[np.bool_]
Labels = npt.NDArray[np.int64]


@dataclass(frozen=True, slots=True)
class Partition:
    """One value's chunks in a brute-force hnswlib index (exact, the graph's labels)."""

    index: hnswlib.BFIndex
    size: int


@dataclass(frozen=True, slots=True)
class Allowed:
    """The chunks one request may reach: a read-only mask, its count, and the value
    partitions that together hold every allowed chunk (empty when none do)."""

    mask: Mask
    count: int
    partitions: tuple[Partition, ...] = ()


class FilterIndex:
    """A snapshot's filterable fields (value -> labels) and its pages (path -> labels)."""

    def __init__(
        self,
        fields: Mapping[str, Mapping[str, Labels]],
        chunks: Sequence[Chunk],
        partitions: Mapping[tuple[str, str], Partition] | None = None,
        vectors: tuple[npt.NDArray[np.float32], Labels] | None = None,
    ) -> None:
        """``vectors``: the snapshot's vectors and each label's row in them, for exact search
        (``hnsw_file.vector_rows``); without them it reads hnswlib's, slowly."""
        self.fields = fields
        self.n = len(chunks)
        self.partitions = dict(partitions or {})
        self.vectors = vectors
        self.paths, self._by_path, self._path_ends = _pages_by_path(chunks)
        size = max(8, MASK_CACHE_BYTES // max(1, self.n))
        self._masks: LRUCache[object, Mask] = LRUCache(maxsize=size)

    @classmethod
    def empty(cls, chunks: Sequence[Chunk] = ()) -> FilterIndex:
        return cls({}, chunks)

    @property
    def nbytes(self) -> int:
        """What it holds beyond the snapshot's files, at most (``memory_budget_mb`` evicts by
        it): the fields' labels, the pages' labels and sorted paths (each a string), each
        label's row in the mapped vectors and the value partitions' copies of their vectors
        (the masks it caches as calls come, up to MASK_CACHE_BYTES, are not: a bound that
        would price each of a thousand small bases at 16 MB)."""
        fields = sum(int(a.nbytes) for values in self.fields.values() for a in values.values())
        paths = len(self.paths) * (_STR_BYTES + 8) + sum(map(len, self.paths))
        pages = int(self._by_path.nbytes + self._path_ends.nbytes) + paths
        rows, width = 0, 0  # partitions are built from the vectors: none without them
        if self.vectors is not None:
            rows, width = int(self.vectors[1].nbytes), int(self.vectors[0].shape[1]) * 4
        copies = sum(p.size for p in self.partitions.values()) * width
        return fields + pages + rows + copies

    def values(self, field: str) -> tuple[str, ...]:
        """The values ``field`` takes in this snapshot, sorted (empty when not filterable)."""
        return tuple(sorted(self.fields.get(field, {})))

    def page_labels(self, source_path: str) -> Labels:
        """The labels of the chunks of pages at ``source_path`` (of any source)."""
        i = bisect.bisect_left(self.paths, source_path)
        if i < len(self.paths) and self.paths[i] == source_path:
            return self._path_labels(i)
        return np.zeros(0, dtype=np.int64)

    def _path_labels(self, i: int) -> Labels:
        """The labels of the chunks at ``paths[i]``, in label order (a read-only view)."""
        return self._by_path[self._path_ends[i] : self._path_ends[i + 1]]

    def unknown(self, filters: Iterable[MetadataFilter]) -> list[str]:
        """The fields of ``filters`` this snapshot has no index for."""
        return sorted({f.field for f in filters if f.field not in self.fields})

    def allowed(
        self,
        filters: Sequence[MetadataFilter],
        source_paths: Sequence[str],
        sources: Mask | None = None,
    ) -> Allowed | None:
        """What ``filters``, ``source_paths`` and a source mask let through; None for no
        filter at all. Fields must be known (``unknown``)."""
        if not filters and not source_paths:
            return None
        mask = np.ones(self.n, dtype=np.bool_)
        for f in filters:
            mask &= self._filter_mask(f)
        if source_paths:
            mask &= self._paths_mask(tuple(source_paths))
        if sources is not None:
            mask &= sources
        mask.setflags(write=False)
        count = int(np.count_nonzero(mask))
        return Allowed(mask, count, self._covering(filters, count))

    def _filter_mask(self, f: MetadataFilter) -> Mask:
        key = ("field", f.field, frozenset(f.any_of))
        mask = self._masks.get(key)
        if mask is None:
            mask = np.zeros(self.n, dtype=np.bool_)
            values = self.fields[f.field]
            for value in f.any_of:
                labels = values.get(value)
                if labels is not None:
                    mask[labels] = True
            mask.setflags(write=False)
            self._masks[key] = mask
        return mask

    def _paths_mask(self, patterns: tuple[str, ...]) -> Mask:
        key = ("paths", frozenset(patterns))
        mask = self._masks.get(key)
        if mask is None:
            mask = np.zeros(self.n, dtype=np.bool_)
            for i in sorted({i for p in patterns for i in self._matching_pages(p)}):
                mask[self._path_labels(i)] = True
            mask.setflags(write=False)
            self._masks[key] = mask
        return mask

    def _matching_pages(self, pattern: str) -> Iterable[int]:
        """Indexes into ``paths`` of the pages a pattern names: a glob, a prefix ending in
        ``/``, or one page's path."""
        if GLOB_CHARS & set(pattern):
            regex = re.compile(translate(pattern))
            return (i for i, path in enumerate(self.paths) if regex.match(path))
        start = bisect.bisect_left(self.paths, pattern)
        if not pattern.endswith("/"):
            found = start < len(self.paths) and self.paths[start] == pattern
            return (start,) if found else ()
        end = start
        while end < len(self.paths) and self.paths[end].startswith(pattern):
            end += 1
        return range(start, end)

    def _covering(self, filters: Sequence[MetadataFilter], count: int) -> tuple[Partition, ...]:
        """The value partitions of the filter with the fewest chunks whose every value has
        one, when searching them beats the shared graph."""
        if not count or count / max(1, self.n) >= OVERFETCH_MIN_SHARE:
            return ()
        best: tuple[Partition, ...] = ()
        best_rows = self.n + 1
        for f in filters:
            known = [v for v in dict.fromkeys(f.any_of) if v in self.fields[f.field]]
            parts = [self.partitions.get((f.field, v)) for v in known]
            if not parts or any(p is None for p in parts):
                continue
            rows = sum(p.size for p in parts if p is not None)
            if rows < best_rows and rows <= EXACT_MAX_ROWS:
                best, best_rows = tuple(p for p in parts if p is not None), rows
        return best


# -- building and reading the file ------------------------------------------------------------


def build_filters(chunks: Sequence[Chunk], filterable: Sequence[str]) -> bytes:
    """``filters.json`` for ``chunks``: every value of every filterable field, with the labels
    of the chunks holding it (a chunk lacking the field holds no value of it)."""
    fields: dict[str, dict[str, list[int]]] = {name: {} for name in filterable}
    for label, chunk in enumerate(chunks):
        for name in filterable:
            value = chunk.metadata.get(name)
            if value is None:
                continue
            for item in meta_values(value):
                labels = fields[name].setdefault(item, [])
                if not labels or labels[-1] != label:
                    labels.append(label)
    return orjson.dumps({"fields": fields}, option=orjson.OPT_SORT_KEYS)


def max_filters_bytes(chunks: int, chunks_bytes: int) -> int:
    """The most bytes a build writes to ``filters.json`` for a snapshot of ``chunks`` chunks
    whose ``chunks.bin`` is ``chunks_bytes``: every value is a metadata string that file holds
    (at most 6 bytes of JSON per byte, a control character's ``\\u00XX``), and each chunk is
    among the labels of at most MAX_META_STRINGS values (a label's digits, its comma, and a
    value's quotes and brackets each); a field's name is a config key (the slack). A larger file
    was not written by a build: refused before it is read or parsed (s12's F6: 15.6 MB took
    13 s and 371 MB to load)."""
    per_label = len(str(max(chunks, 1))) + 1 + _VALUE_JSON
    return _JSON_ESCAPE * chunks_bytes + chunks * MAX_META_STRINGS * per_label + _FIELDS_SLACK


def read_filters(data: bytes, chunks: Sequence[Chunk], where: str) -> dict[str, dict[str, Labels]]:
    """The fields of a ``filters.json``, each label list checked (ascending, within the
    snapshot), the values and labels counted before any is converted (``_check_counts``);
    ValueError naming what is wrong."""
    try:
        raw = orjson.loads(data)
    except orjson.JSONDecodeError as exc:
        raise ValueError(f"{where}: not JSON: {exc}") from exc
    fields = raw.get("fields") if type(raw) is dict else None
    if type(fields) is not dict:
        raise ValueError(f"{where}: no 'fields' object")
    _check_counts(fields, len(chunks), where)
    out: dict[str, dict[str, Labels]] = {}
    for name, values in fields.items():
        if type(values) is not dict:
            raise ValueError(f"{where}: field {name!r} is not an object of values")
        out[name] = {
            v: _labels(labels, len(chunks), f"{where}: {name}={v!r}")
            for v, labels in values.items()
        }
    return out


def _check_counts(fields: dict[str, object], n: int, where: str) -> None:
    """At most ``n`` x MAX_META_STRINGS values and as many labels in all: a build writes one
    label per string of a chunk's metadata, each string one value at most (``build_filters``).
    Counted on the parsed lists, before one numpy array is made of them."""
    cap = n * MAX_META_STRINGS
    values = labels = 0
    for name, field in fields.items():
        if type(field) is not dict:
            raise ValueError(f"{where}: field {name!r} is not an object of values")
        values += len(field)
        labels += sum(len(v) for v in field.values() if type(v) is list)
        if values > cap or labels > cap:
            raise ValueError(
                f"{where}: {values} values and {labels} labels by field {name!r}, over "
                f"{cap} ({n} chunks x {MAX_META_STRINGS} metadata strings)"
            )


def _labels(raw: object, n: int, where: str) -> Labels:
    if type(raw) is not list or not raw:
        raise ValueError(f"{where}: not a non-empty list of labels")
    labels = np.asarray(raw)
    if labels.dtype.kind != "i" or labels.ndim != 1:
        raise ValueError(f"{where}: labels are not integers")
    if labels[0] < 0 or labels[-1] >= n or np.any(np.diff(labels) <= 0):
        raise ValueError(f"{where}: labels are not ascending within 0..{n - 1}")
    return labels.astype(np.int64)


def build_partitions(
    vectors: tuple[npt.NDArray[np.float32], Labels],
    fields: Mapping[str, Mapping[str, Labels]],
    n: int,
) -> dict[tuple[str, str], Partition]:
    """Exact-search copies of the selective values' vectors (at most EXACT_MAX_ROWS each),
    fewest chunks first, within PARTITION_COPIES times the snapshot's vectors."""
    table, rows = vectors
    wanted = sorted(
        (labels.size, name, value)
        for name, values in fields.items()
        for value, labels in values.items()
        if labels.size <= EXACT_MAX_ROWS and labels.size < n * OVERFETCH_MIN_SHARE
    )
    out: dict[tuple[str, str], Partition] = {}
    budget = int(n * PARTITION_COPIES)
    for size, name, value in wanted:
        if size > budget:
            break
        budget -= size
        labels = fields[name][value]
        copy = np.ascontiguousarray(table[rows[labels]], dtype=np.float32)
        brute = hnswlib.BFIndex(space="ip", dim=copy.shape[1])
        brute.init_index(max_elements=size)
        brute.add_items(copy, labels)
        out[(name, value)] = Partition(index=brute, size=size)
    return out


# -- search -----------------------------------------------------------------------------------


def search(
    index: hnswlib.Index, filters: FilterIndex, vector: npt.NDArray[np.float32], k: int,
    allowed: Allowed,
) -> Ranked:  # fmt: skip
    """The top k allowed chunks by cosine, best first (see the module docstring)."""
    n = filters.n
    if allowed.count == 0 or k <= 0 or n == 0:
        return []
    want = min(k, allowed.count)
    hits: Ranked = []
    if allowed.partitions:
        hits = _from_partitions(vector, k, allowed)
    elif allowed.count > GATHER_MAX_ROWS:
        fetch = min(n, int(k * n / allowed.count * OVERFETCH_FACTOR) + k)
        hits = [(label, s) for label, s in _knn(index, vector, fetch) if allowed.mask[label]]
    if len(hits) >= want:
        return hits[:k]
    return _exact(index, filters, vector, k, np.flatnonzero(allowed.mask).astype(np.int64))


def _knn(index: hnswlib.Index, vector: npt.NDArray[np.float32], k: int) -> Ranked:
    labels, distances = knn(index, vector.reshape(1, -1), k, "the snapshot's graph")
    return [(int(label), 1.0 - float(d)) for label, d in zip(labels[0], distances[0], strict=True)]


def _from_partitions(vector: npt.NDArray[np.float32], k: int, allowed: Allowed) -> Ranked:
    """Each covering partition searched exactly, deep enough for the share of its rows the
    other conditions let through; allowed chunks only, each once."""
    rows = sum(p.size for p in allowed.partitions)
    depth = int(k * rows / allowed.count * OVERFETCH_FACTOR) + k
    query = vector.reshape(1, -1)
    found: dict[int, float] = {}
    for part in allowed.partitions:
        labels, distances = part.index.knn_query(query, k=min(depth, part.size), num_threads=1)
        for label, d in zip(labels[0], distances[0], strict=True):
            if allowed.mask[label]:
                found[int(label)] = 1.0 - float(d)
    return sorted(found.items(), key=lambda hit: (-hit[1], hit[0]))


def _exact(
    index: hnswlib.Index,
    filters: FilterIndex,
    vector: npt.NDArray[np.float32],
    k: int,
    labels: Labels,
) -> Ranked:
    if filters.vectors is not None:
        table, rows = filters.vectors
        vectors = np.asarray(table[rows[labels]], dtype=np.float32)
    else:
        vectors = np.asarray(index.get_items(labels, return_type="numpy"), dtype=np.float32)
    scores = np.einsum("ij,j->i", vectors, vector.ravel())  # one thread, unlike a BLAS product
    keep = np.argpartition(-scores, k - 1)[:k] if scores.size > k else np.arange(scores.size)
    order = keep[np.argsort(-scores[keep], kind="stable")]
    return [(int(labels[i]), float(scores[i])) for i in order]


def _pages_by_path(chunks: Sequence[Chunk]) -> tuple[list[str], Labels, Labels]:
    """The source paths, sorted; every label grouped by its path (in label order within one);
    and where each path's group ends. A mapped table's from its runs of chunks of one page
    (``ChunkTable.page_runs``): a path read a page, not a chunk."""
    if isinstance(chunks, ChunkTable):
        bounds, keys = chunks.page_runs()
        run_paths = [path for _, path in keys]
    else:
        bounds = np.arange(len(chunks) + 1, dtype=np.int64)
        run_paths = [chunk.source_path for chunk in chunks]
    paths = sorted(set(run_paths))
    position = {path: i for i, path in enumerate(paths)}
    run_ids = np.fromiter(map(position.__getitem__, run_paths), np.int64, len(run_paths))
    of_label = np.repeat(run_ids, np.diff(bounds))
    by_path = np.argsort(of_label, kind="stable")
    ends = np.zeros(len(paths) + 1, dtype=np.int64)
    np.cumsum(np.bincount(of_label, minlength=len(paths)), out=ends[1:])
    by_path.setflags(write=False)
    return paths, by_path, ends
