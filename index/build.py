"""An index build: sources -> pages -> chunks -> vectors -> a published snapshot.

Vectors of chunks whose embedded text is unchanged are taken from the previous published
snapshot of the same embedder, so re-indexing an unchanged base embeds nothing and editing one
page re-embeds only that page's changed chunks. Nothing is published when nothing changed.
"""

from __future__ import annotations

import hashlib
import logging
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import orjson

from index.chunker import ChunkOptions, chunk_page
from index.config import Config, KnowledgeBaseConfig
from index.embedders.base import Embedder, EmbedderInfo, Vectors
from index.errors import SnapshotError, SnapshotNotFound, VoxrecallError
from index.progress import EmbedProgress
from index.snapshot import load_snapshot, page_key, read_manifest, write_snapshot
from index.sources import SkippedPage
from index.sources.registry import LoadContext, load_source
from index.store import LocalStore, new_version_id
from index.types import Chunk, Page

log = logging.getLogger("voxrecall.index")


@dataclass(slots=True)
class BuildSummary:
    knowledge_base: str
    version: str = ""
    published: bool = False
    pages: int = 0
    chunks: int = 0
    embedded: int = 0
    reused: int = 0
    removed: int = 0
    skipped_pages: list[dict[str, str]] = field(default_factory=list)
    seconds: dict[str, float] = field(default_factory=dict)

    def as_dict(self) -> dict[str, Any]:
        return {
            "knowledge_base": self.knowledge_base,
            "version": self.version,
            "published": self.published,
            "pages": self.pages,
            "chunks": self.chunks,
            "embedded": self.embedded,
            "reused": self.reused,
            "removed": self.removed,
            "skipped_pages": self.skipped_pages,
            "seconds": {k: round(v, 3) for k, v in self.seconds.items()},
        }


@contextmanager
def _phase(summary: BuildSummary, name: str) -> Iterator[None]:
    start = time.perf_counter()
    try:
        yield
    finally:
        summary.seconds[name] = summary.seconds.get(name, 0.0) + time.perf_counter() - start


def text_key(info: EmbedderInfo, text: str) -> str:
    """The embedding cache key: (embedder, dimension, hash of the embedded text)."""
    return hashlib.sha256(f"{info.name}\x00{info.dimension}\x00{text}".encode()).hexdigest()


def previous_vectors(
    store: LocalStore, kb: str, info: EmbedderInfo
) -> tuple[dict[str, Vectors], set[str]]:
    """Vectors of the published snapshot keyed by ``text_key``, and its chunk ids."""
    try:
        folder = store.latest_dir(kb)
        snap = load_snapshot(folder, expected=info)
    except SnapshotNotFound:
        log.info("%s: no snapshot published yet: every chunk is embedded", kb)
        return {}, set()
    except VoxrecallError as exc:
        log.info("%s: the published snapshot's vectors cannot be reused (%s)", kb, exc)
        return {}, set()
    if not snap.chunks:
        return {}, set()
    stored = np.asarray(snap.index.get_items(np.arange(len(snap.chunks))), dtype=np.float32)
    cache = {text_key(info, c.embed_text): stored[i] for i, c in enumerate(snap.chunks)}
    return cache, {c.chunk_id for c in snap.chunks}


def _quiet(done: int, total: int) -> None:
    """No progress shown."""


def embed_chunks(
    embedder: Embedder,
    chunks: list[Chunk],
    cache: dict[str, Vectors],
    batch_size: int,
    max_concurrency: int = 1,
    progress: Callable[[int, int], None] = _quiet,
) -> tuple[Vectors, int]:
    """Vectors for every chunk, reusing cached ones; returns (vectors, number embedded).

    Texts go to ``embedder.embed_batch`` ``batch_size * max_concurrency`` at a time: a remote
    embedder splits each slice into concurrent requests itself; ``progress(done, total)`` is
    called with 0 before the first slice and after each (it may raise to abandon the build).
    """
    info = embedder.info
    keys = [text_key(info, c.embed_text) for c in chunks]
    vectors = np.zeros((len(chunks), info.dimension), dtype=np.float32)
    todo = [i for i, key in enumerate(keys) if key not in cache]
    for i, key in enumerate(keys):
        if key in cache:
            vectors[i] = cache[key]
    step = max(1, batch_size * max_concurrency)
    if todo:
        progress(0, len(todo))
    for start in range(0, len(todo), step):
        rows = todo[start : start + step]
        vectors[rows] = embedder.embed_batch([chunks[i].embed_text for i in rows])
        progress(start + len(rows), len(todo))
    return vectors, len(todo)


def collect_pages(
    kb: KnowledgeBaseConfig, context: LoadContext
) -> tuple[list[Page], list[SkippedPage]]:
    """Every page of every source of a base, and the pages skipped (path prefixed with the
    source's name when the base has several sources)."""
    pages: list[Page] = []
    skipped: list[SkippedPage] = []
    for source in kb.sources:
        got, missed = load_source(source, context)
        if len(kb.sources) > 1:
            missed = [SkippedPage(f"{source.name}:{s.path}", s.reason) for s in missed]
        pages.extend(got)
        skipped.extend(missed)
    return pages, skipped


def build_knowledge_base(
    config: Config,
    kb: KnowledgeBaseConfig,
    embedder: Embedder,
    *,
    progress: Callable[[int, int], None] | None = None,
    now: float | None = None,
) -> BuildSummary:
    """Build one base and publish it if anything changed.

    ``now`` is the time sources count from (when a URL is due for a re-crawl); default: now.
    ``progress(done, total)`` follows the embedding (default: ``EmbedProgress``, a bar on a
    terminal, a log line every ``PROGRESS_EVERY_S`` elsewhere); an exception it raises abandons
    the build before anything is written (``voxrecall index watch`` stops this way on SIGTERM).
    """
    store = LocalStore(config.index.store)
    summary = BuildSummary(knowledge_base=kb.name)
    with _phase(summary, "load"):
        context = LoadContext(kb.name, config.index.cache_dir, time.time() if now is None else now)
        pages, skipped = collect_pages(kb, context)
    summary.pages = len(pages)
    summary.skipped_pages = [{"path": s.path, "reason": s.reason} for s in skipped]
    options = ChunkOptions(
        target_tokens=kb.chunking.target_tokens,
        overlap_tokens=kb.chunking.overlap_tokens,
        heading_levels=kb.chunking.heading_levels,
    )
    with _phase(summary, "chunk"):
        chunks = [chunk for page in pages for chunk in chunk_page(page, options)]
    summary.chunks = len(chunks)
    with _phase(summary, "reuse"):
        cache, previous_ids = previous_vectors(store, kb.name, embedder.info)
    with _phase(summary, "embed"):
        vectors, summary.embedded = embed_chunks(
            embedder,
            chunks,
            cache,
            config.embedder.batch_size,
            config.embedder.max_concurrency,
            progress or EmbedProgress(kb.name, len(pages), len(chunks)),
        )
    summary.reused = len(chunks) - summary.embedded
    summary.removed = len(previous_ids - {c.chunk_id for c in chunks})

    content = hashlib.sha256(embedder.info.name.encode())
    for chunk in chunks:
        content.update(text_key(embedder.info, chunk.embed_text).encode())
        content.update(chunk.chunk_id.encode())
    # a filter must see a changed plan_scope at once: the filterable values count as content
    if kb.filterable:
        filtered = [_filtered(c, kb.filterable) for c in chunks]
        content.update(orjson.dumps([kb.filterable, filtered]))
    content_hash = content.hexdigest()
    published = store.latest(kb.name)
    if (
        published is not None
        and _content_hash(store, kb.name) == content_hash
        and not summary.embedded
    ):
        summary.version = published
        log.info("%s unchanged: still %s", kb.name, published)
        return summary

    version = new_version_id(content_hash)
    if published is not None and version <= published:
        raise SnapshotError(f"clock went backwards: new version {version} <= published {published}")
    staging = store.staging_dir(kb.name)
    with _phase(summary, "write"):
        write_snapshot(
            staging,
            knowledge_base=kb.name,
            version=version,
            embedder=embedder.info,
            chunks=chunks,
            vectors=vectors,
            pages={page_key(p.source, p.source_path): p.text for p in pages},
            page_count=len(pages),
            hnsw_m=kb.hnsw.m,
            hnsw_ef_construction=kb.hnsw.ef_construction,
            target_recall=kb.hnsw.target_recall,
            sources=[s.name for s in kb.sources],
            extra={"content_hash": content_hash},
            filterable=kb.filterable,
        )
        store.publish(kb.name, staging, version, keep=config.index.keep_versions)
    summary.version = version
    summary.published = True
    return summary


def _filtered(chunk: Chunk, filterable: tuple[str, ...]) -> list[object]:
    return [chunk.metadata.get(name) for name in filterable]


def _content_hash(store: LocalStore, kb: str) -> str | None:
    try:
        manifest = read_manifest(store.latest_dir(kb))
    except VoxrecallError:
        return None
    value = manifest.extra.get("content_hash")
    return str(value) if value is not None else None
