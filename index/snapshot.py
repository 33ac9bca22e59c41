"""The snapshot format: one immutable folder per knowledge base and version.

    <version>/
      manifest.json   format version, base, version id, created-at, embedder, hnsw parameters,
                      counts and the sha256 of every other file; written last
      vectors.hnsw    hnswlib index (inner product on unit vectors = cosine); label i = chunk i
      chunks.json     the chunks in label order (what a search returns)
      pages.json      source_path -> whole page text, for reading a page later
      lexical.bin     the BM25 index over the chunks' embedded text, for fallback and hybrid

A folder is written once and never modified. ``verify`` checks everything the manifest claims
before a reader trusts the folder; ``load`` then builds the in-memory form a sidecar serves from.
"""

from __future__ import annotations

import hashlib
import os
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import hnswlib
import numpy as np
import numpy.typing as npt
import orjson

from index.embedders.base import EmbedderInfo, Vectors
from index.errors import CorruptSnapshot, IncompatibleSnapshot, SnapshotError
from index.lexical import LexicalIndex
from index.types import Chunk

FORMAT_VERSION = 1
MANIFEST = "manifest.json"
VECTORS = "vectors.hnsw"
CHUNKS = "chunks.json"
PAGES = "pages.json"
LEXICAL = "lexical.bin"
DATA_FILES = (VECTORS, CHUNKS, PAGES, LEXICAL)


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
                "sources": list(self.sources),
                "extra": dict(self.extra),
            },
            option=orjson.OPT_INDENT_2 | orjson.OPT_SORT_KEYS,
        )

    @classmethod
    def from_json(cls, data: bytes, where: str) -> Manifest:
        try:
            raw = orjson.loads(data)
            return cls(
                format_version=int(raw["format_version"]),
                knowledge_base=str(raw["knowledge_base"]),
                version=str(raw["version"]),
                created_at=float(raw["created_at"]),
                embedder=EmbedderInfo(
                    name=str(raw["embedder"]["name"]), dimension=int(raw["embedder"]["dimension"])
                ),
                hnsw=HnswParams(
                    m=int(raw["hnsw"]["m"]),
                    ef_construction=int(raw["hnsw"]["ef_construction"]),
                    ef=int(raw["hnsw"]["ef"]),
                    measured_recall_at_10=float(raw["hnsw"]["measured_recall_at_10"]),
                ),
                pages=int(raw["counts"]["pages"]),
                chunks=int(raw["counts"]["chunks"]),
                files={str(k): str(v) for k, v in raw["files"].items()},
                sources=tuple(raw.get("sources", ())),
                extra=dict(raw.get("extra", {})),
            )
        except (orjson.JSONDecodeError, KeyError, TypeError, ValueError) as exc:
            raise CorruptSnapshot(f"{where}: unreadable manifest: {exc}") from exc


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def write_atomic(path: Path, data: bytes) -> None:
    """Write a file so that a reader sees the old content or the new, never a part: temp, fsync, rename."""
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    with tmp.open("wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def chunk_to_dict(chunk: Chunk) -> dict[str, Any]:
    return {
        "id": chunk.chunk_id,
        "source": chunk.source,
        "path": chunk.source_path,
        "title": chunk.title,
        "crumbs": list(chunk.breadcrumbs),
        "text": chunk.text,
        "embed": chunk.embed_text,
        "url": chunk.url,
        "meta": dict(chunk.metadata),
    }


def chunk_from_dict(raw: Mapping[str, Any]) -> Chunk:
    return Chunk(
        chunk_id=raw["id"],
        source=raw["source"],
        source_path=raw["path"],
        title=raw["title"],
        breadcrumbs=tuple(raw["crumbs"]),
        text=raw["text"],
        embed_text=raw["embed"],
        url=raw["url"],
        metadata=raw["meta"],
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
    """The smallest ef whose recall@k against exact search reaches the target.

    Queries are a seeded sample of the snapshot's own vectors, slightly perturbed so that each is
    not trivially its own nearest neighbour.
    """
    n = vectors.shape[0]
    if n == 0:
        return 10, 1.0
    k = min(k, n)
    rng = np.random.default_rng(7)
    rows = rng.choice(n, size=min(sample, n), replace=False)
    queries = vectors[rows] + rng.normal(0, 0.02, size=(len(rows), vectors.shape[1])).astype(
        np.float32
    )
    queries /= np.linalg.norm(queries, axis=1, keepdims=True)
    exact = np.argsort(-(queries @ vectors.T), axis=1)[:, :k]
    recall = 0.0
    for ef in (10, 16, 24, 32, 48, 64, 96, 128, 192, 256, 384, 512):
        index.set_ef(max(ef, k))
        labels, _ = index.knn_query(queries, k=k)
        recall = float(
            np.mean([len(set(a) & set(b)) / k for a, b in zip(labels, exact, strict=True)])
        )
        if recall >= target_recall:
            return max(ef, k), recall
    return max(ef, k), recall


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
) -> Manifest:
    """Write a complete snapshot into an empty folder; the manifest is written last."""
    if vectors.shape != (len(chunks), embedder.dimension):
        raise SnapshotError(
            f"vectors shape {vectors.shape} does not match {len(chunks)} chunks x {embedder.dimension}"
        )
    folder.mkdir(parents=True, exist_ok=True)
    index = build_hnsw(vectors, hnsw_m, hnsw_ef_construction)
    ef, recall = choose_ef(index, vectors, target_recall)
    index.save_index(str(folder / VECTORS))
    write_atomic(folder / CHUNKS, orjson.dumps([chunk_to_dict(c) for c in chunks]))
    write_atomic(folder / PAGES, orjson.dumps(dict(pages)))
    lexical = LexicalIndex.build([c.embed_text for c in chunks])
    write_atomic(folder / LEXICAL, lexical.to_bytes())
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
        files={name: sha256_file(folder / name) for name in DATA_FILES},
        sources=tuple(sources),
        extra=dict(extra or {}),
    )
    write_atomic(folder / MANIFEST, manifest.to_json())
    fsync_dir(folder)
    return manifest


def read_manifest(folder: Path) -> Manifest:
    try:
        data = (folder / MANIFEST).read_bytes()
    except OSError as exc:
        raise CorruptSnapshot(f"{folder}: no readable {MANIFEST} ({exc.strerror})") from exc
    return Manifest.from_json(data, str(folder))


def verify_snapshot(folder: Path, expected: EmbedderInfo | None = None) -> Manifest:
    """Check everything the manifest claims; raise CorruptSnapshot or IncompatibleSnapshot."""
    manifest = read_manifest(folder)
    if manifest.format_version != FORMAT_VERSION:
        raise IncompatibleSnapshot(
            f"{folder}: format version {manifest.format_version}, this voxrecall reads {FORMAT_VERSION}"
        )
    if expected is not None and manifest.embedder != expected:
        raise IncompatibleSnapshot(
            f"{folder}: built with embedder {manifest.embedder.name} ({manifest.embedder.dimension}-d), "
            f"but this sidecar embeds queries with {expected.name} ({expected.dimension}-d); "
            "rebuild the snapshot with the same [embedder] or change the sidecar's"
        )
    for name in DATA_FILES:
        want = manifest.files.get(name)
        path = folder / name
        if want is None:
            raise CorruptSnapshot(f"{folder}: manifest lists no checksum for {name}")
        if not path.is_file():
            raise CorruptSnapshot(f"{folder}: {name} is missing")
        got = sha256_file(path)
        if got != want:
            raise CorruptSnapshot(f"{folder}: {name} sha256 {got[:12]} != manifest {want[:12]}")
    return manifest


@dataclass(slots=True)
class LoadedSnapshot:
    """A verified snapshot in memory, immutable once built; what one sidecar request reads."""

    folder: Path
    manifest: Manifest
    index: hnswlib.Index
    chunks: tuple[Chunk, ...]
    pages: Mapping[str, str]
    lexical: LexicalIndex
    source_of: npt.NDArray[np.int32]  # chunk label -> index into source_names
    source_names: tuple[str, ...]

    @property
    def version(self) -> str:
        return self.manifest.version

    def source_mask(self, sources: Sequence[str]) -> npt.NDArray[np.bool_] | None:
        """A boolean mask of chunks in the given sources, or None for no filter."""
        if not sources:
            return None
        wanted = [i for i, name in enumerate(self.source_names) if name in set(sources)]
        return np.isin(self.source_of, np.asarray(wanted, dtype=np.int32))

    def search_dense(
        self, vector: Vectors, k: int, mask: npt.NDArray[np.bool_] | None = None
    ) -> list[tuple[int, float]]:
        """Top-k chunk labels by cosine similarity, optionally only among ``mask``.

        A selective filter is not handed to hnswlib's ``filter=`` callable (it takes the GIL per
        candidate: ~15x slower at 10% selectivity); we over-fetch and post-filter, and fall back
        to exact search over the allowed subset when too few survive.
        """
        n = len(self.chunks)
        if n == 0:
            return []
        query = vector.reshape(1, -1)
        if mask is None:
            k = min(k, n)
            labels, distances = self.index.knn_query(query, k=k)
            return [
                (int(label), 1.0 - float(d))
                for label, d in zip(labels[0], distances[0], strict=True)
            ]
        allowed = np.flatnonzero(mask)
        if allowed.size == 0:
            return []
        fetch = min(n, max(k * 8, int(k * n / allowed.size) + k))
        if fetch < n // 2:
            labels, distances = self.index.knn_query(query, k=fetch)
            hits = [
                (int(label), 1.0 - float(d))
                for label, d in zip(labels[0], distances[0], strict=True)
                if mask[label]
            ]
            if len(hits) >= min(k, allowed.size):
                return hits[:k]
        vectors = np.asarray(self.index.get_items(allowed), dtype=np.float32)
        scores = vectors @ query[0]
        top = np.argsort(-scores)[:k]
        return [(int(allowed[i]), float(scores[i])) for i in top]


def load_snapshot(folder: Path, expected: EmbedderInfo | None = None) -> LoadedSnapshot:
    """Verify, then load a snapshot; blocking (seconds for large ones): call it off the event loop."""
    manifest = verify_snapshot(folder, expected)
    try:
        chunks = tuple(chunk_from_dict(raw) for raw in orjson.loads((folder / CHUNKS).read_bytes()))
        pages = orjson.loads((folder / PAGES).read_bytes())
        lexical = LexicalIndex.from_bytes((folder / LEXICAL).read_bytes())
        index = hnswlib.Index(space="ip", dim=manifest.embedder.dimension)
        if chunks:
            index.load_index(str(folder / VECTORS), max_elements=len(chunks))
            index.set_ef(manifest.hnsw.ef)  # hnswlib resets ef to 10 on load
    except (OSError, RuntimeError, ValueError, KeyError, orjson.JSONDecodeError) as exc:
        raise CorruptSnapshot(f"{folder}: cannot load: {exc}") from exc
    count = index.get_current_count() if chunks else 0
    if count != len(chunks) or len(chunks) != manifest.chunks or len(lexical) != len(chunks):
        raise CorruptSnapshot(
            f"{folder}: counts disagree: hnsw {count}, chunks {len(chunks)}, "
            f"lexical {len(lexical)}, manifest {manifest.chunks}"
        )
    names = tuple(sorted({c.source for c in chunks}))
    position = {name: i for i, name in enumerate(names)}
    source_of = np.fromiter((position[c.source] for c in chunks), dtype=np.int32, count=len(chunks))
    return LoadedSnapshot(
        folder=folder,
        manifest=manifest,
        index=index,
        chunks=chunks,
        pages=pages,
        lexical=lexical,
        source_of=source_of,
        source_names=names,
    )
