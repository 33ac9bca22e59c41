"""The snapshot format: one immutable folder per knowledge base and version.

    <version>/
      manifest.json   format version, base, version id, created-at, embedder, hnsw parameters,
                      counts and the sha256 of every other file; written last
      vectors.hnsw    hnswlib index (inner product on unit vectors = cosine); label i = chunk i
      chunks.bin      the chunks in label order, and each one's source (index/tables.py)
      pages.bin       page key -> whole page text, for reading a page later (index/tables.py)
      lexical.bin     the BM25 index over the chunks' embedded text, for fallback and hybrid
      entities.bin    every chunk's entity and the entities' names rated as the follow-ups
                      match them (``index/entities.py``); format 5 on
      gazetteer.bin   the follow-ups' matching tables of entities.bin's keys (prefixes,
                      one-edit variants: ``index/key_tables.py``); optional (a snapshot
                      without one has them built at load), verified when the manifest lists it
      filters.json    value -> chunk labels of each filterable metadata field
                      (``index/filters.py``); only for a base with ``filterable`` fields, and
                      verified when the manifest lists it

``chunks.bin``, ``pages.bin``, ``lexical.bin``, ``entities.bin`` and ``gazetteer.bin`` are arrays files
(``index/mapped.py``): a loader memory-maps them and reads them in place, so loading costs what
hnswlib's graph costs and worker processes share those pages through the page cache. A format-4
snapshot (no ``entities.bin``) is still read: the sidecar rates its names at load, as before.

A folder is written once and never modified. ``verify`` checks everything the manifest claims
before a reader trusts the folder; ``load`` then checks each file's layout and maps it. A store's
``fetch`` hashes every file and checks the hnswlib graphs (``verify_fetched``) once, recorded, so
the load of what it fetched (``fetched=True``) hashes nothing and checks each graph's header and
size only (``check_hnsw_head``).
"""

from __future__ import annotations

import errno
import hashlib
import math
import os
import re
import stat
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import hnswlib
import numpy as np
import numpy.typing as npt
import orjson

from index.config import MAX_EF_SEARCH, HnswConfig
from index.embedders.base import EmbedderInfo, Vectors
from index.entities import ENTITIES_KIND, EntityTable
from index.errors import CorruptSnapshot, IncompatibleSnapshot, SnapshotError, unreadable
from index.filters import FILTERS, FilterIndex, build_filters, max_filters_bytes, read_filters
from index.filters import build_partitions as build_value_partitions
from index.hnsw_file import MAX_M, check_hnsw_file, check_hnsw_head, knn, vector_rows
from index.json_count import json_containers
from index.key_tables import GAZETTEER_KIND, TABLES, KeyTables, tables_rules
from index.lexical import LexicalIndex
from index.mapped import ArraysFile, Parts
from index.summaries import SUMMARY_VECTORS, SummaryIndex, has_summaries, load_summary_index
from index.tables import ChunkTable, PageTable
from index.types import Chunk, Page

# 2: chunks stored as JSON lines; 3: the manifest records every file's size; 4: chunks, pages and
# the lexical index are memory-mapped arrays files, read in place; 5: entities.bin, the
# follow-ups' names rated at build time
FORMAT_VERSION = 5
# Formats this voxrecall reads: a format-4 snapshot lacks only entities.bin, which the sidecar
# makes up for at load (seconds at 100k chunks).
READABLE_FORMATS = (4, FORMAT_VERSION)
# A floor for the query-time ef: below it real-query recall drops fast (SciFact: 0.88 at ef 10,
# 0.98 at 32) while an hnswlib query at ef 32 still takes well under a millisecond.
MIN_EF = 32
MANIFEST = "manifest.json"
VECTORS = "vectors.hnsw"
CHUNKS = "chunks.bin"
PAGES = "pages.bin"
LEXICAL = "lexical.bin"
ENTITIES = "entities.bin"
GAZETTEER = "gazetteer.bin"
DATA_FILES = (VECTORS, CHUNKS, PAGES, LEXICAL, ENTITIES, GAZETTEER)  # what a build writes
# Written by every build now, optional to a reader: a format-5 snapshot written before has the
# gazetteer's tables built at load from entities.bin's keys.
OPTIONAL_FILES = (GAZETTEER,)
MAX_DIM = 65_536  # the widest embedding models give a few thousand dimensions
# A build's manifest is about 1.2 KiB, its sources' names at most a quarter of this
# (index.config.MAX_SOURCE_NAMES_BYTES: a thousand sources of 40-character names are ~45 KiB).
# orjson parses it holding the GIL, in a worker thread but the event loop's too: 4 MiB of
# numbers under the container count held it 20-40 ms, this much holds it 1-3 ms.
MAX_MANIFEST_BYTES = 256 << 10
# A manifest's JSON objects and arrays at most, counted as the bytes "[" and "{" (brackets in
# strings too) before the parse: a build's holds about ten. Each is a Python object orjson
# builds holding the GIL, in a worker thread but the event loop's too: a store's manifest of
# 4 MiB of "[]," held the loop ~0.5 s.
MAX_MANIFEST_CONTAINERS = 16_384
# A file a build adds beside DATA_FILES (summaries, originals): listed in the manifest and checked
# like the others; one plain name inside the folder.
_EXTRA_FILE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")
T = TypeVar("T")
# What an hnswlib index takes beyond its elements, whatever its size: 65,536 label-operation
# mutexes of 40 bytes (hnswlib 0.8), measured at 2.5 MiB per index. A budget of many small bases
# that left it out was passed three times over.
HNSW_INDEX_BYTES = 65_536 * 40


@dataclass(frozen=True, slots=True)
class HnswParams:
    m: int
    ef_construction: int
    ef: int  # query-time ef chosen by measured recall; hnswlib forgets it on load
    measured_recall_at_10: float


@dataclass(frozen=True, slots=True)
class Manifest:
    format_version: int
    knowledge_base: str
    version: str
    created_at: float
    embedder: EmbedderInfo
    hnsw: HnswParams
    pages: int
    chunks: int
    files: Mapping[str, str]  # name -> sha256
    sizes: Mapping[str, int]  # name -> bytes: what a download is capped at
    sources: tuple[str, ...] = ()
    extra: Mapping[str, Any] = field(default_factory=dict)

    def to_json(self) -> bytes:
        return orjson.dumps(
            {
                "format_version": self.format_version,
                "knowledge_base": self.knowledge_base,
                "version": self.version,
                "created_at": self.created_at,
                "embedder": {"name": self.embedder.name, "dimension": self.embedder.dimension},
                "hnsw": {
                    "space": "ip",
                    "m": self.hnsw.m,
                    "ef_construction": self.hnsw.ef_construction,
                    "ef": self.hnsw.ef,
                    "measured_recall_at_10": self.hnsw.measured_recall_at_10,
                },
                "counts": {"pages": self.pages, "chunks": self.chunks},
                "files": dict(self.files),
                "sizes": dict(self.sizes),
                "sources": list(self.sources),
                "extra": dict(self.extra),
            },
            option=orjson.OPT_INDENT_2 | orjson.OPT_SORT_KEYS,
        )

    @classmethod
    def from_json(cls, data: bytes, where: str) -> Manifest:
        """Parse and type-check a manifest: every field the sidecar reads, CorruptSnapshot if not
        (one of more than ``MAX_MANIFEST_CONTAINERS`` objects and arrays is not parsed)."""
        containers = json_containers(data)
        if containers > MAX_MANIFEST_CONTAINERS:
            raise CorruptSnapshot(
                f"{where}: the manifest holds {containers} JSON objects and arrays; a snapshot's "
                f"holds a few, at most {MAX_MANIFEST_CONTAINERS}"
            )
        try:
            raw = orjson.loads(data)
        except orjson.JSONDecodeError as exc:
            raise CorruptSnapshot(f"{where}: unreadable manifest: {exc}") from exc
        m = _Fields(raw, f"{where}: manifest")
        embedder, hnsw, counts = m.table("embedder"), m.table("hnsw"), m.table("counts")
        files = m.mapping("files", str)
        # format 2 recorded no sizes: read it, so that verify_snapshot says "incompatible"
        sizes = m.mapping("sizes", int, optional=m.raw.get("format_version") == 2)
        if any(size < 0 for size in sizes.values()):
            raise CorruptSnapshot(f"{where}: manifest: a file size is negative")
        return cls(
            format_version=m.integer("format_version", 0, 1 << 16),
            knowledge_base=m.text("knowledge_base"),
            version=m.text("version"),
            created_at=m.number("created_at"),
            embedder=EmbedderInfo(
                name=embedder.text("name"), dimension=embedder.integer("dimension", 1, MAX_DIM)
            ),
            hnsw=HnswParams(
                m=hnsw.integer("m", 2, MAX_M),
                ef_construction=hnsw.integer("ef_construction", 1, 1 << 20),
                ef=hnsw.integer("ef", 1, MAX_EF_SEARCH),
                measured_recall_at_10=hnsw.number("measured_recall_at_10"),
            ),
            pages=counts.integer("pages", 0, 1 << 40),
            chunks=counts.integer("chunks", 0, 1 << 32),
            files=files,
            sizes=sizes,
            sources=tuple(m.sequence("sources", str, optional=True)),
            extra=m.mapping("extra", object, optional=True),
        )


class _Fields:
    """Typed reads of one JSON object of a manifest: a wrong type or a missing key is
    CorruptSnapshot naming the key (``int(...)`` would take ``True`` or ``"7"``)."""

    def __init__(self, raw: object, where: str) -> None:
        if type(raw) is not dict:
            raise CorruptSnapshot(f"{where} is not a JSON object")
        self.raw: dict[str, object] = raw
        self.where = where

    def _get(self, key: str, kind: type | tuple[type, ...]) -> Any:
        value = self.raw.get(key)
        if type(value) not in (kind if isinstance(kind, tuple) else (kind,)):
            raise CorruptSnapshot(f"{self.where}: {key!r} is missing or not {_kind_name(kind)}")
        return value

    def table(self, key: str) -> _Fields:
        return _Fields(self._get(key, dict), f"{self.where}.{key}")

    def text(self, key: str) -> str:
        value: str = self._get(key, str)
        return value

    def number(self, key: str) -> float:
        value = float(self._get(key, (int, float)))
        if not math.isfinite(value):
            raise CorruptSnapshot(f"{self.where}: {key!r} is not a finite number")
        return value

    def integer(self, key: str, low: int, high: int) -> int:
        value: int = self._get(key, int)
        if not low <= value <= high:
            raise CorruptSnapshot(f"{self.where}: {key!r} = {value} is outside {low}..{high}")
        return value

    def mapping(self, key: str, kind: type, *, optional: bool = False) -> dict[str, Any]:
        if optional and key not in self.raw:
            return {}
        value: dict[str, Any] = self._get(key, dict)
        if kind is not object and any(type(v) is not kind for v in value.values()):
            raise CorruptSnapshot(f"{self.where}: a value of {key!r} is not {_kind_name(kind)}")
        return value

    def sequence(self, key: str, kind: type, *, optional: bool = False) -> list[Any]:
        if optional and key not in self.raw:
            return []
        value: list[Any] = self._get(key, list)
        if any(type(v) is not kind for v in value):
            raise CorruptSnapshot(f"{self.where}: an item of {key!r} is not {_kind_name(kind)}")
        return value


_KIND_NAMES: dict[type, str] = {dict: "an object", list: "a list", str: "a string"}


def _kind_name(kind: type | tuple[type, ...]) -> str:
    kinds = kind if isinstance(kind, tuple) else (kind,)
    return " or ".join(_KIND_NAMES.get(k, k.__name__) for k in kinds)


def page_key(source: str, source_path: str) -> str:
    """How ``pages.bin`` names a page: two sources may each hold a page at the same path."""
    return f"{source}:{source_path}"


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def write_atomic(path: Path, data: bytes | Parts, mode: int | None = None) -> None:
    """Write a file so that a reader sees the old content or the new, never a part: temp, fsync, rename.
    ``data`` is the bytes, or the pieces ``arrays_parts`` gives, written one after the other.
    ``mode`` (e.g. 0o644) is set before the rename, whatever the umask."""
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    with tmp.open("wb") as f:
        if isinstance(data, bytes):
            f.write(data)
        else:
            f.writelines(data)
        f.flush()
        os.fsync(f.fileno())
    if mode is not None:
        tmp.chmod(mode)
    os.replace(tmp, path)


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_pages_snapshot(
    folder: Path,
    *,
    knowledge_base: str,
    version: str,
    embedder: EmbedderInfo,
    pages: Sequence[Page],
    chunks: Sequence[Chunk],
    vectors: Vectors,
    sources: Sequence[str] = (),
) -> Manifest:
    """``write_snapshot`` of chunked ``pages`` with the default ``[knowledge_base.hnsw]``: what
    the tests' and the benchmarks' own small bases are (a real build goes through
    ``index.build``)."""
    hnsw = HnswConfig()
    return write_snapshot(
        folder,
        knowledge_base=knowledge_base,
        version=version,
        embedder=embedder,
        chunks=chunks,
        vectors=vectors,
        pages={page_key(p.source, p.source_path): p.text for p in pages},
        page_count=len(pages),
        hnsw_m=hnsw.m,
        hnsw_ef_construction=hnsw.ef_construction,
        target_recall=hnsw.target_recall,
        sources=sources or sorted({p.source for p in pages}),
    )


def build_hnsw(vectors: Vectors, m: int, ef_construction: int) -> hnswlib.Index:
    """An inner-product index over unit vectors, labels 0..n-1, built on every core."""
    n, dim = vectors.shape
    index = hnswlib.Index(space="ip", dim=dim)
    index.init_index(max_elements=max(n, 1), M=m, ef_construction=ef_construction, random_seed=42)
    if n:
        index.add_items(vectors, np.arange(n), num_threads=os.cpu_count() or 1)
    return index


def choose_ef(
    index: hnswlib.Index, vectors: Vectors, target_recall: float, sample: int = 200, k: int = 10
) -> tuple[int, float]:
    """The smallest ef (at least ``MIN_EF``) whose recall@k against exact search reaches the target.

    Calibration queries are a seeded sample of the snapshot's own vectors pushed about 45 degrees
    away (cosine ~0.7), as far as a caller's question usually is from the chunk that answers it.
    Nearer queries overstate recall: with a small perturbation SciFact calibrated to ef 10 at an
    estimated 0.98 while its real queries got 0.88.
    """
    n = vectors.shape[0]
    if n == 0:
        return MIN_EF, 1.0
    k = min(k, n)
    rng = np.random.default_rng(7)
    rows = rng.choice(n, size=min(sample, n), replace=False)
    dim = vectors.shape[1]
    noise = rng.normal(0, 1.0 / np.sqrt(dim), size=(len(rows), dim)).astype(np.float32)
    queries = vectors[rows] + noise
    queries /= np.linalg.norm(queries, axis=1, keepdims=True)
    exact = _exact_top(queries, vectors, k)
    recall = 0.0
    for ef in (MIN_EF, 48, 64, 96, 128, 192, 256, 384, 512):
        index.set_ef(max(ef, k))
        labels, _ = index.knn_query(queries, k=k)
        recall = float(
            np.mean([len(set(a) & set(b)) / k for a, b in zip(labels, exact, strict=True)])
        )
        if recall >= target_recall:
            return max(ef, k), recall
    return max(ef, k), recall


EXACT_BLOCK_BYTES = 64 << 20  # what ``_exact_top`` holds of scores and their order at once


def _exact_top(queries: Vectors, vectors: Vectors, k: int) -> npt.NDArray[np.int64]:
    """Each query's ``k`` nearest rows of ``vectors`` by exact inner product, a block of queries
    at a time: 200 queries' scores and sort order over 1M chunks at once were 2.4 GB. A block's
    product is not bit for bit the whole one's (BLAS splits the sums by the matrix's shape: up
    to 4e-7 apart at 60,000 x 384), so a near-tie among a query's neighbours may order the
    other way than at another block size."""
    # a float32 score and an int64 position a row: the scores are negated in place, so the
    # block's scores and their order are all it holds (measured: 12 bytes a row, tracemalloc)
    per_query = max(1, vectors.shape[0]) * 12
    step = max(1, EXACT_BLOCK_BYTES // per_query)
    blocks = [_block_top(queries[i : i + step], vectors, k) for i in range(0, len(queries), step)]
    return np.concatenate(blocks) if blocks else np.zeros((0, k), dtype=np.int64)


def _block_top(queries: Vectors, vectors: Vectors, k: int) -> npt.NDArray[np.int64]:
    scores = queries @ vectors.T
    np.negative(scores, out=scores)  # nearest first, without a second block of scores
    # a copy of the first k: a view would keep the block's whole order
    return np.argsort(scores, axis=1)[:, :k].copy()


def write_snapshot(
    folder: Path,
    *,
    knowledge_base: str,
    version: str,
    embedder: EmbedderInfo,
    chunks: Sequence[Chunk],
    vectors: Vectors,
    pages: Mapping[str, str],
    page_count: int,
    hnsw_m: int,
    hnsw_ef_construction: int,
    target_recall: float,
    sources: Sequence[str] = (),
    extra: Mapping[str, Any] | None = None,
    more_files: Callable[[Path], Sequence[str]] | None = None,
    filterable: Sequence[str] = (),
) -> Manifest:
    """Write a complete snapshot into an empty folder; the manifest is written last.

    ``more_files(folder)`` writes optional files beside the data files (index/enrich.py: the
    summary vectors, the pages' original texts) and returns their names, which the manifest
    lists and checksums like the rest. ``filterable`` names the metadata fields to index for
    filters (``index/filters.py``)."""
    if vectors.shape != (len(chunks), embedder.dimension):
        raise SnapshotError(
            f"vectors shape {vectors.shape} does not match {len(chunks)} chunks x {embedder.dimension}"
        )
    folder.mkdir(parents=True, exist_ok=True)
    index = build_hnsw(vectors, hnsw_m, hnsw_ef_construction)
    ef, recall = choose_ef(index, vectors, target_recall)
    index.save_index(str(folder / VECTORS))
    write_atomic(folder / CHUNKS, ChunkTable.parts(chunks))
    write_atomic(folder / PAGES, PageTable.parts(pages))
    lexical = LexicalIndex.build(c.embed_text for c in chunks)
    write_atomic(folder / LEXICAL, lexical.to_parts())
    entities = EntityTable.dump(lexical, chunks)
    write_atomic(folder / ENTITIES, entities)
    write_atomic(folder / GAZETTEER, gazetteer_tables(entities, len(chunks)))
    names = [*DATA_FILES, *(more_files(folder) if more_files else ())]
    if filterable:
        write_atomic(folder / FILTERS, build_filters(chunks, filterable))
        names.append(FILTERS)
    manifest = Manifest(
        format_version=FORMAT_VERSION,
        knowledge_base=knowledge_base,
        version=version,
        created_at=time.time(),
        embedder=embedder,
        hnsw=HnswParams(
            m=hnsw_m, ef_construction=hnsw_ef_construction, ef=ef, measured_recall_at_10=recall
        ),
        pages=page_count,
        chunks=len(chunks),
        files={name: sha256_file(folder / name) for name in names},
        sizes={name: (folder / name).stat().st_size for name in names},
        sources=tuple(sources),
        extra=dict(extra or {}),
    )
    write_atomic(folder / MANIFEST, manifest.to_json())
    fsync_dir(folder)
    return manifest


def gazetteer_tables(entities: bytes, count: int) -> bytes:
    """The bytes of ``gazetteer.bin``: the matching tables of the keys of ``entities`` (the
    bytes of ``entities.bin``), naming its sha256."""
    table = EntityTable.read(ArraysFile(entities, ENTITIES_KIND), count)
    return KeyTables.build(table.rated_keys()).dump(hashlib.sha256(entities).hexdigest())


def read_small(path: Path, cap: int, what: str) -> bytes:
    """A small file of a store (a manifest, a pointer) read whole, at most ``cap`` bytes: one
    that is not a regular file (a FIFO would block the read for ever, a device never end it) or
    is larger is CorruptSnapshot naming it, and no more than ``cap + 1`` bytes are read.
    FileNotFoundError goes on up."""
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)  # a FIFO with no writer: no wait to open
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise CorruptSnapshot(f"{path}: {what} is not a regular file")
        with os.fdopen(fd, "rb", closefd=False) as f:
            data = f.read(cap + 1)
    finally:
        os.close(fd)
    if len(data) > cap:
        raise CorruptSnapshot(f"{path}: {what} is over {cap} bytes, not one")
    return data


def read_manifest(folder: Path) -> Manifest:
    try:
        data = read_small(folder / MANIFEST, MAX_MANIFEST_BYTES, "the manifest")
    except OSError as exc:
        raise unreadable(f"{folder}: no readable {MANIFEST} ({exc.strerror})", exc) from exc
    return Manifest.from_json(data, str(folder))


def data_files(format_version: int) -> tuple[str, ...]:
    """The files every snapshot of this format holds (OPTIONAL_FILES are checked where its
    manifest lists them)."""
    absent = (*OPTIONAL_FILES, *((ENTITIES,) if format_version < 5 else ()))  # 4: no entities.bin
    return tuple(name for name in DATA_FILES if name not in absent)


def verify_snapshot(
    folder: Path, expected: EmbedderInfo | None = None, *, checksums: bool = True
) -> Manifest:
    """Check everything the manifest claims; raise CorruptSnapshot or IncompatibleSnapshot.

    ``checksums=False`` skips hashing the files (every other check stays): only for a folder
    that ``SnapshotStore.fetch`` has just returned, whose files it checked, since hashing takes
    seconds for a large snapshot.
    """
    manifest = read_manifest(folder)
    if manifest.format_version not in READABLE_FORMATS:
        raise IncompatibleSnapshot(
            f"{folder}: format version {manifest.format_version}, this voxrecall reads "
            f"{' and '.join(map(str, READABLE_FORMATS))} (chunks, pages and the lexical index "
            "memory-mapped, not parsed); rebuild the base with `voxrecall index build`"
        )
    if expected is not None and manifest.embedder != expected:
        raise IncompatibleSnapshot(
            f"{folder}: built with embedder {manifest.embedder.name} ({manifest.embedder.dimension}-d), "
            f"but this sidecar embeds queries with {expected.name} ({expected.dimension}-d); "
            "rebuild the snapshot with the same [embedder] or change the sidecar's"
        )
    required = data_files(manifest.format_version)
    extra_files = sorted(set(manifest.files) - set(required))
    for name in extra_files:
        if not _EXTRA_FILE.fullmatch(name):
            raise CorruptSnapshot(f"{folder}: manifest lists {name[:80]!r}, not a file name")
    for name in (*required, *extra_files):
        want = manifest.files.get(name)
        path = folder / name
        if want is None:
            raise CorruptSnapshot(f"{folder}: manifest lists no checksum for {name}")
        if not path.is_file():
            raise CorruptSnapshot(f"{folder}: {name} is missing")
        size, listed = path.stat().st_size, manifest.sizes.get(name)
        if size != listed:
            raise CorruptSnapshot(f"{folder}: {name} is {size} bytes, the manifest says {listed}")
        got = sha256_file(path) if checksums else want
        if got != want:
            raise CorruptSnapshot(f"{folder}: {name} sha256 {got[:12]} != manifest {want[:12]}")
    return manifest


def graph_files(manifest: Manifest) -> tuple[str, ...]:
    """The snapshot's hnswlib graphs (none when it has no chunks: nothing loads them)."""
    if not manifest.chunks:
        return ()
    return (VECTORS, SUMMARY_VECTORS) if has_summaries(manifest.files) else (VECTORS,)


def check_graphs(folder: Path, manifest: Manifest) -> None:
    """Every hnswlib graph of the snapshot checked (``check_hnsw_file``; CorruptSnapshot)."""
    dim, count, m = manifest.embedder.dimension, manifest.chunks, manifest.hnsw.m
    for name in graph_files(manifest):
        try:
            check_hnsw_file(folder / name, count=count, dimension=dim, m=m)
        except OSError as exc:
            raise unreadable(f"{folder}: cannot read {name}: {exc}", exc) from exc


def verify_fetched(folder: Path) -> Manifest:
    """What a store's ``fetch`` proves of a folder, once: ``verify_snapshot`` with every
    file's sha256, then the layout of its hnswlib graphs (``check_graphs``), read while the
    hashing has just brought them into the page cache. The store records both by each file's
    size, mtime, ctime, inode and device (``index.store.Verified``), so a load (``load_snapshot(..., fetched=True)``), the next start or
    another worker read neither again, and a changed file is verified anew."""
    manifest = verify_snapshot(folder)
    check_graphs(folder, manifest)
    return manifest


# Exact search over a partition costs rows x dimension multiply-adds: 20,000 x 384 is ~1-2 ms on
# one thread, about what an hnswlib query over a few hundred thousand vectors costs.
PARTITION_MAX_ROWS = 20_000
# A filter letting through at least this share of chunks is served by over-fetching from the
# shared graph (about 1 / share x k candidates suffice); below it, exact search over partitions.
OVERFETCH_MIN_SHARE = 0.5
OVERFETCH_FACTOR = 3  # candidates fetched per expected survivor, for the luck of the draw


@dataclass(frozen=True, slots=True)
class Partition:
    """One source's chunks in a brute-force hnswlib index (exact, same labels as the graph).

    hnswlib's brute force runs on the calling thread; a numpy product of this size would hand
    the work to OpenBLAS's thread pool, which on a busy machine was measured at 10-20 ms a query
    instead of 0.05.
    """

    index: hnswlib.BFIndex
    size: int


class _GraphOf:
    """A snapshot's graph file named in an error, the path made only when one is raised."""

    __slots__ = ("folder",)

    def __init__(self, folder: Path) -> None:
        self.folder = folder

    def __str__(self) -> str:
        return str(self.folder / VECTORS)


@dataclass(slots=True, eq=False)  # identity: one loaded folder is one snapshot
class LoadedSnapshot:
    """A verified snapshot in memory, immutable once built; what one sidecar request reads.

    With more than one source, ``partitions`` holds an exact-search copy of each source's vectors
    (sources of at most PARTITION_MAX_ROWS chunks), so that a selective source filter never goes
    through hnswlib's ``filter=`` callable, which takes the GIL for every candidate and was
    measured 15-80x slower (``python -m bench.source_filter``). The cost is one more copy of
    those vectors in memory.
    """

    folder: Path
    manifest: Manifest
    index: hnswlib.Index
    chunks: Sequence[Chunk]  # a ChunkTable: each chunk decoded from the mapped file when read
    pages: Mapping[str, str]  # a PageTable
    lexical: LexicalIndex
    source_of: npt.NDArray[np.int32]  # chunk label -> index into source_names
    source_names: tuple[str, ...]
    partitions: Mapping[int, Partition] = field(default_factory=dict)  # source index -> copy
    summaries: SummaryIndex | None = None  # the second view (index/summaries.py), when built
    entities: EntityTable | None = None  # entities.bin (None: format 4, rated at load)
    key_tables: KeyTables | None = None  # gazetteer.bin mapped (None: built at load)
    filters: FilterIndex = field(default_factory=FilterIndex.empty)  # metadata and paths
    # What serving it may take in memory: the graph file as hnswlib holds it and hnswlib's own
    # fixed cost, the partitions' copies, the mapped files in full (as if every page of them
    # were read), the decoded chunks kept and the filter index (``_memory_bytes``).
    memory_bytes: int = 0
    graph: _GraphOf = field(init=False, repr=False)  # the graph file, as an error names it

    def __post_init__(self) -> None:
        self.graph = _GraphOf(self.folder)  # once, not on every search

    @property
    def version(self) -> str:
        return self.manifest.version

    def source_ids(self, sources: Sequence[str]) -> list[int]:
        """Indexes into ``source_names`` of the given names (unknown names match nothing)."""
        wanted = set(sources)
        return [i for i, name in enumerate(self.source_names) if name in wanted]

    def search_dense(
        self, vector: Vectors, k: int, sources: Sequence[str] = ()
    ) -> list[tuple[int, float]]:
        """Top-k chunk labels by cosine similarity, best first, optionally only from ``sources``.

        A filter letting most chunks through over-fetches from the shared graph and drops the
        rest; a selective one searches the allowed sources' partitions exactly. Either way, when
        too few survive, the allowed chunks are searched exactly.
        """
        n = len(self.chunks)
        if n == 0 or k <= 0:
            return []
        if not sources:
            return self._knn(vector, min(k, n))
        ids = self.source_ids(sources)
        if len(ids) == len(self.source_names):
            return self._knn(vector, min(k, n))
        allowed = int(np.isin(self.source_of, ids).sum()) if ids else 0
        return self.search_sources(
            vector, k, ids, allowed, lambda: np.flatnonzero(np.isin(self.source_of, ids))
        )

    def nearest(self, vector: Vectors, k: int, min_score: float) -> list[tuple[int, float]]:
        """``search_dense`` of every source, only the chunks with a cosine of ``min_score`` or
        more: the graph's answer read in one pass (a plain Search's)."""
        k = min(k, len(self.chunks))
        if k <= 0:
            return []
        return [(label, score) for label, score in self._knn(vector, k) if score >= min_score]

    def search_sources(
        self,
        vector: Vectors,
        k: int,
        ids: Sequence[int],
        allowed: int,
        labels: Callable[[], npt.NDArray[np.int64]],
    ) -> list[tuple[int, float]]:
        """``search_dense`` of the sources ``ids`` (some, not all), which hold ``allowed``
        chunks; ``labels()`` gives theirs, ascending, when exact search needs them. A searcher
        passes what it counted once (``sidecar.snapshots.searcher.Sources``), not a scan of the base."""
        n = len(self.chunks)
        if allowed == 0 or n == 0 or k <= 0:
            return []
        if allowed / n < OVERFETCH_MIN_SHARE and all(i in self.partitions for i in ids):
            return self._exact_partitions(vector, k, ids)
        fetch = min(n, int(k * n / allowed * OVERFETCH_FACTOR) + k)
        wanted = set(ids)
        hits = [
            (label, score)
            for label, score in self._knn(vector, fetch)
            if int(self.source_of[label]) in wanted
        ]
        if len(hits) >= min(k, allowed):
            return hits[:k]
        return self._exact(vector, k, labels())

    def _knn(self, vector: Vectors, k: int) -> list[tuple[int, float]]:
        labels, distances = knn(self.index, vector.reshape(1, -1), k, self.graph)
        pairs = zip(labels[0].tolist(), distances[0].tolist(), strict=True)
        return [(label, 1.0 - d) for label, d in pairs]

    def _exact_partitions(
        self, vector: Vectors, k: int, ids: Sequence[int]
    ) -> list[tuple[int, float]]:
        best: list[tuple[int, float]] = []
        query = vector.reshape(1, -1)
        for i in ids:
            part = self.partitions[i]
            labels, distances = part.index.knn_query(query, k=min(k, part.size), num_threads=1)
            best.extend(
                (int(label), 1.0 - float(d))
                for label, d in zip(labels[0], distances[0], strict=True)
            )
        best.sort(key=lambda hit: (-hit[1], hit[0]))
        return best[:k]

    def _exact(
        self, vector: Vectors, k: int, labels: npt.NDArray[np.int64]
    ) -> list[tuple[int, float]]:
        vectors = np.asarray(self.index.get_items(labels, return_type="numpy"), dtype=np.float32)
        scores = np.einsum("ij,j->i", vectors, vector)  # one thread, unlike a BLAS product
        return _top(scores, labels, k)


def _top(
    scores: npt.NDArray[np.float32], labels: npt.NDArray[np.int64], k: int
) -> list[tuple[int, float]]:
    """The k best (label, score) pairs of one exact scoring, best first."""
    keep = np.argpartition(-scores, k - 1)[:k] if scores.size > k else np.arange(scores.size)
    order = keep[np.argsort(-scores[keep], kind="stable")]
    return [(int(labels[i]), float(scores[i])) for i in order]


def build_partitions(
    index: hnswlib.Index, source_of: npt.NDArray[np.int32], sources: int
) -> dict[int, Partition]:
    """Exact-search copies of each source's vectors, for snapshots with more than one source."""
    if sources < 2:
        return {}
    out: dict[int, Partition] = {}
    for i in range(sources):
        labels = np.flatnonzero(source_of == i).astype(np.int64)
        if 0 < labels.size <= PARTITION_MAX_ROWS:
            vectors = np.asarray(index.get_items(labels, return_type="numpy"), dtype=np.float32)
            brute = hnswlib.BFIndex(space="ip", dim=vectors.shape[1])
            brute.init_index(max_elements=labels.size)
            brute.add_items(vectors, labels)
            out[i] = Partition(index=brute, size=int(labels.size))
    return out


def read_table(path: Path, open_: Callable[[Path], T]) -> T:
    """Map one arrays file of the snapshot; CorruptSnapshot naming it when its layout is wrong."""
    try:
        return open_(path)
    except ValueError as exc:
        raise CorruptSnapshot(f"{path}: {exc}") from exc
    except MemoryError as exc:  # its sizes are checked against its keys first: a last guard
        raise CorruptSnapshot(f"{path}: too large to read into memory") from exc


def read_hnsw(path: Path, manifest: Manifest, ef: int, *, checked: bool = False) -> hnswlib.Index:
    """The hnswlib index, after ``check_hnsw_file`` has made sure hnswlib can read it safely
    (``checked``: the store's fetch did, ``verify_fetched``)."""
    dim, count = manifest.embedder.dimension, manifest.chunks
    index = hnswlib.Index(space="ip", dim=dim)
    if not count:
        return index
    check = check_hnsw_head if checked else check_hnsw_file
    check(path, count=count, dimension=dim, m=manifest.hnsw.m)
    try:
        index.load_index(str(path), max_elements=count)
    except (RuntimeError, MemoryError) as exc:
        _out_of_descriptors(path)
        raise CorruptSnapshot(f"{path}: hnswlib cannot load it: {exc}") from exc
    index.set_ef(ef)  # hnswlib resets ef to 10 on load
    return index


def _out_of_descriptors(path: Path) -> None:
    """Raise ``unreadable``'s StoreUnavailable if ``path`` cannot be opened now for want of
    descriptors: hnswlib says only "Cannot open file", and a good graph it could not open in a
    flood of connections must be tried again, not refused as corrupt until a new version."""
    try:
        os.close(os.open(path, os.O_RDONLY))
    except OSError as exc:
        if exc.errno in (errno.EMFILE, errno.ENFILE):
            raise unreadable(f"{path}: unreadable ({exc.strerror})", exc) from exc


def load_snapshot(
    folder: Path,
    expected: EmbedderInfo | None = None,
    *,
    checksums: bool = True,
    ef_search: int = 0,
    fetched: bool = False,
) -> LoadedSnapshot:
    """Verify, then load a snapshot; blocking (seconds for large ones): call it off the event loop.

    Every file is checked before it is trusted (a checksum proves a file is the one published,
    not that it is well-formed): the manifest's fields by type; the mapped files' headers, array
    extents and offsets (monotonic, within their tables, counts that agree), the lexical
    postings' doc ids; and the hnswlib file's layout and graph. Texts are read in place when
    asked for, decoded with replacement, so no byte of them can fail a call. Anything wrong is
    CorruptSnapshot (or IncompatibleSnapshot), never another exception or a crash.

    ``ef_search`` replaces the query-time ef the build chose (0 keeps it).

    ``checksums=False``: the files' sha256 were checked by ``SnapshotStore.fetch`` (see
    ``verify_snapshot``). ``fetched=True``: the folder is what ``SnapshotStore.fetch`` returned,
    which checked the sha256 and the hnswlib graphs' layout (``verify_fetched``): neither is
    read again (a graph's check took a third of hnswlib's own load), but each graph's header
    and size are (``check_hnsw_head``, microseconds: a file changed under its record since).
    """
    manifest = verify_snapshot(folder, expected, checksums=checksums and not fetched)
    try:
        chunks = read_table(folder / CHUNKS, ChunkTable.open)
        pages = read_table(folder / PAGES, PageTable.open)
        lexical = read_table(folder / LEXICAL, LexicalIndex.open)
        if len(chunks) != manifest.chunks or len(lexical) != len(chunks):
            raise CorruptSnapshot(
                f"{folder}: counts disagree: chunks {len(chunks)}, lexical {len(lexical)}, "
                f"manifest {manifest.chunks}"
            )
        entities = _entities(folder, manifest)
        key_tables = _key_tables(folder, manifest, entities)
        ef = ef_search or manifest.hnsw.ef
        index = read_hnsw(folder / VECTORS, manifest, ef, checked=fetched)
        summaries = _summaries(folder, manifest, ef, checked=fetched)
    except OSError as exc:
        raise unreadable(f"{folder}: cannot read: {exc}", exc) from exc
    names, source_of = chunks.source_names, chunks.source_of
    try:
        partitions = build_partitions(index, source_of, len(names))
        filters = load_filters(folder, manifest, chunks)
    except (RuntimeError, ValueError) as exc:
        raise CorruptSnapshot(f"{folder}: cannot read vectors back: {exc}") from exc
    return LoadedSnapshot(
        folder=folder,
        manifest=manifest,
        index=index,
        chunks=chunks,
        pages=pages,
        lexical=lexical,
        source_of=source_of,
        source_names=names,
        partitions=partitions,
        summaries=summaries,
        entities=entities,
        key_tables=key_tables,
        filters=filters,
        memory_bytes=_memory_bytes(manifest, partitions, chunks, filters),
    )


def _memory_bytes(
    manifest: Manifest,
    partitions: Mapping[int, Partition],
    chunks: ChunkTable,
    filters: FilterIndex,
) -> int:
    """``LoadedSnapshot.memory_bytes``: the files (mapped, as if every page were read; the graph
    as hnswlib holds it) and hnswlib's fixed cost, the source partitions' copies of their
    vectors, the decoded chunks kept and the filter index (its pages' paths and labels)."""
    copies = sum(p.size for p in partitions.values()) * 4 * manifest.embedder.dimension
    kept = chunks.cache_bytes + filters.nbytes
    return sum(manifest.sizes.values()) + HNSW_INDEX_BYTES + copies + kept


def _entities(folder: Path, manifest: Manifest) -> EntityTable | None:
    """``entities.bin`` mapped and checked, when the snapshot has one (format 5 on)."""
    if ENTITIES not in manifest.files:
        return None
    return read_table(folder / ENTITIES, lambda path: EntityTable.open(path, manifest.chunks))


def _key_tables(folder: Path, manifest: Manifest, entities: EntityTable | None) -> KeyTables | None:
    """``gazetteer.bin`` mapped and checked against the keys of ``entities.bin``, when the
    snapshot has both (None when it has no tables, or tables of other rules: built at load)."""
    if GAZETTEER not in manifest.files or entities is None:
        return None
    path = folder / GAZETTEER
    file = read_table(path, lambda p: ArraysFile.open(p, GAZETTEER_KIND))
    if read_table(path, lambda _: tables_rules(file)) != TABLES:
        return None
    if file.header.get("entities") != manifest.files.get(ENTITIES):
        raise CorruptSnapshot(f"{path}: the tables of another entities.bin than this snapshot's")
    return read_table(path, lambda _: KeyTables.read(file, entities.rated_keys()))


def _summaries(folder: Path, manifest: Manifest, ef: int, checked: bool) -> SummaryIndex | None:
    if not has_summaries(manifest.files):
        return None
    return load_summary_index(
        folder,
        count=manifest.chunks,
        dimension=manifest.embedder.dimension,
        m=manifest.hnsw.m,
        ef=ef,
        view=str(manifest.extra.get("summaries", "")),
        checked=checked,
    )


def load_filters(folder: Path, manifest: Manifest, chunks: Sequence[Chunk]) -> FilterIndex:
    """The filter index: the fields of ``filters.json`` when the manifest lists one (a
    snapshot built before filters, or without ``filterable``, has none) and the pages. Its
    size is checked once, as it is read (``read_small``: the manifest's size is the file's,
    ``verify_snapshot``), against what a build writes (``max_filters_bytes``)."""
    if FILTERS not in manifest.files:
        return FilterIndex.empty(chunks)
    path = folder / FILTERS
    cap = max_filters_bytes(len(chunks), manifest.sizes.get(CHUNKS, 0))
    what = f"the filters of {len(chunks)} chunks"  # "... is over CAP bytes, not one"
    try:
        fields = read_filters(read_small(path, cap, what), chunks, str(path))
    except OSError as exc:
        raise unreadable(f"{folder}: cannot read {FILTERS}: {exc}", exc) from exc
    except ValueError as exc:
        raise CorruptSnapshot(str(exc)) from exc
    if not chunks:
        return FilterIndex(fields, chunks)
    dim = manifest.embedder.dimension
    vectors = vector_rows(folder / VECTORS, count=len(chunks), dimension=dim)
    partitions = build_value_partitions(vectors, fields, len(chunks))
    return FilterIndex(fields, chunks, partitions, vectors)
