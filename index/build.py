"""An index build: sources -> pages -> chunks -> vectors -> a published snapshot.

Vectors of chunks whose embedded text is unchanged are taken from the previous published
snapshot of the same embedder, so re-indexing an unchanged base embeds nothing and editing one
page re-embeds only that page's changed chunks. Nothing is published when nothing changed.
"""

from __future__ import annotations

import dataclasses
import hashlib
import logging
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt
import orjson

from index import enrich
from index.chunker import ChunkOptions, PageOverLimit, bounded, chunk_page
from index.config import BuildConfig, KnowledgeBaseConfig, LlmConfig, SourceConfig
from index.curation import APPROVED_FILES, approved_sources, load_approved_files
from index.embedders.base import Embedder, EmbedderInfo, Vectors
from index.errors import (
    ConfigError,
    CorruptSnapshot,
    EmptyBuild,
    SnapshotError,
    SnapshotNotFound,
    VoxrecallError,
    one_line,
)
from index.llm import LlmUsage, ModelCaller
from index.progress import EmbedProgress
from index.snapshot import (
    LoadedSnapshot,
    Manifest,
    load_snapshot,
    page_key,
    read_manifest,
    write_snapshot,
)
from index.sources import PageBytes, SkippedPage, sound_pages
from index.sources.image import image_batches, image_limit, load_images
from index.sources.registry import LoadContext, load_source
from index.store import LocalStore, new_version_id
from index.summaries import SUMMARY_TEXTS, read_summary_texts
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
    llm: LlmUsage = field(default_factory=LlmUsage)  # [index.llm] calls of this build

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
            "llm": self.llm.as_dict(),
            # pages kept as they were and chunks given the heading view: what the model failed
            "enrichment_failures": list(self.llm.failed),
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


@dataclass(frozen=True, slots=True)
class Reuse:
    """What a build takes from the published snapshot, read once: the vectors of its chunks and
    of its summaries, each keyed by ``text_key`` of the text embedded, and its chunk ids."""

    vectors: dict[str, Vectors] = field(default_factory=dict)
    chunk_ids: frozenset[str] = frozenset()
    summaries: dict[str, Vectors] = field(default_factory=dict)


def previous_vectors(
    store: LocalStore, kb: str, info: EmbedderInfo, *, summaries: bool = False
) -> Reuse:
    """The published snapshot's vectors (and with ``summaries`` its summary vectors)."""
    try:
        folder = store.latest_dir(kb)
        snap = load_snapshot(folder, expected=info)
    except SnapshotNotFound:
        log.info("%s: no snapshot published yet: every chunk is embedded", kb)
        return Reuse()
    except VoxrecallError as exc:
        log.info("%s: the published snapshot's vectors cannot be reused (%s)", kb, exc)
        return Reuse()
    if not snap.chunks:
        return Reuse()
    stored = np.asarray(snap.index.get_items(np.arange(len(snap.chunks))), dtype=np.float32)
    sound = _sound_rows(stored, kb)
    return Reuse(
        vectors={
            text_key(info, c.embed_text): stored[i] for i, c in enumerate(snap.chunks) if sound[i]
        },
        chunk_ids=frozenset(c.chunk_id for c in snap.chunks),
        summaries=_summary_vectors(snap, info) if summaries else {},
    )


def _summary_vectors(snap: LoadedSnapshot, info: EmbedderInfo) -> dict[str, Vectors]:
    """``snap``'s summary vectors by ``text_key`` of their text: none when it has no summaries
    or its texts cannot be read (each is embedded again)."""
    if snap.summaries is None:
        return {}
    try:
        texts = read_summary_texts(snap.folder / SUMMARY_TEXTS, len(snap.chunks))
    except CorruptSnapshot as exc:
        log.info("%s: the published summaries cannot be reused (%s)", snap.folder, exc)
        return {}
    stored = np.asarray(snap.summaries.index.get_items(np.arange(len(texts))), dtype=np.float32)
    sound = _sound_rows(stored, str(snap.folder))
    return {text_key(info, t): stored[i] for i, t in enumerate(texts) if sound[i]}


def _sound_rows(stored: Vectors, where: str) -> npt.NDArray[np.bool_]:
    """Which published vectors are worth reusing: those with a direction. A snapshot published
    before its embedder's answers were checked may hold rows of zeros; reused, they would stay
    for good (a row that is not finite cannot be here: the load refuses its graph)."""
    sound = np.asarray(stored.any(axis=1), dtype=np.bool_)
    if not sound.all():
        log.warning("%s: %d published vectors are all zero: embedded again", where, (~sound).sum())
    return sound


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
    """Vectors for every chunk's ``embed_text``, reusing cached ones (``embed_texts``)."""
    texts = [c.embed_text for c in chunks]
    return embed_texts(embedder, texts, cache, batch_size, max_concurrency, progress)


def embed_texts(
    embedder: Embedder,
    texts: Sequence[str],
    cache: dict[str, Vectors],
    batch_size: int,
    max_concurrency: int = 1,
    progress: Callable[[int, int], None] = _quiet,
) -> tuple[Vectors, int]:
    """Vectors for every text, reusing those in ``cache`` (keyed by ``text_key``); returns
    (vectors, number embedded).

    Texts go to ``embedder.embed_batch`` ``batch_size * max_concurrency`` at a time: a remote
    embedder splits each slice into concurrent requests itself; ``progress(done, total)`` is
    called with 0 before the first slice and after each (it may raise to abandon the build).
    """
    info = embedder.info
    keys = [text_key(info, text) for text in texts]
    vectors = np.zeros((len(texts), info.dimension), dtype=np.float32)
    todo = [i for i, key in enumerate(keys) if key not in cache]
    for i, key in enumerate(keys):
        if key in cache:
            vectors[i] = cache[key]
    step = max(1, batch_size * max_concurrency)
    if todo:
        progress(0, len(todo))
    for start in range(0, len(todo), step):
        rows = todo[start : start + step]
        vectors[rows] = embedder.embed_batch([texts[i] for i in rows])
        progress(start + len(rows), len(todo))
    return vectors, len(todo)


def collect_pages(
    kb: KnowledgeBaseConfig, context: LoadContext, caller: ModelCaller | None = None
) -> tuple[list[Page], list[SkippedPage]]:
    """Every page of every source of a base, and the pages skipped (path prefixed with the
    source's name when the base has several sources), a page that is not text among them
    (``index.sources.sound_pages``). Images go to ``caller``'s model, only
    from ``approved = true`` sources (index/sources/image.py). Raises BaseTooLarge once the
    pages pass the base's ``max_text_bytes`` (``context.budget``)."""
    pages: list[Page] = []
    skipped: list[SkippedPage] = []
    budget = context.budget or PageBytes(kb.name, kb.max_text_bytes)
    context = dataclasses.replace(context, budget=budget)
    for source in kb.sources:
        if source.type == "image":
            got, missed = _image_pages(source, caller)
            budget.take(*got)
        elif source.type == APPROVED_FILES:
            got, missed = load_approved_files(source, budget)
        else:
            got, missed = load_source(source, context)
        got, unsound = sound_pages(got)
        missed = [*missed, *unsound]
        if len(kb.sources) > 1:
            missed = [SkippedPage(f"{source.name}:{s.path}", s.reason) for s in missed]
        pages.extend(got)
        skipped.extend(missed)
    return pages, skipped


def _image_pages(
    source: SourceConfig, caller: ModelCaller | None
) -> tuple[list[Page], list[SkippedPage]]:
    if caller is None:  # parse_config refuses an image source without [index.llm]
        raise SnapshotError(f"source {source.name!r}: type image needs [index.llm]")
    pages: list[Page] = []
    skipped: list[SkippedPage] = []
    limit = image_limit(source, caller.config.max_image_bytes)
    for images, missed in image_batches(load_images(source, limit)):
        got, failed = enrich.describe_images(source, images, caller)
        pages.extend(got)
        skipped.extend((*missed, *failed))
    return pages, skipped


def chunk_pages(
    pages: Sequence[Page], options: ChunkOptions, *, several: bool = False
) -> tuple[list[Page], list[Chunk], list[SkippedPage]]:
    """The pages the chunker takes, their chunks, and the pages it refuses (``PageOverLimit``:
    too many headings or chunks, a path over 4 KiB), skipped with the reason as a source skips
    a page (the path prefixed with the source's name when the base has ``several`` sources)."""
    kept: list[Page] = []
    chunks: list[Chunk] = []
    refused: list[SkippedPage] = []
    for page in pages:
        try:
            got = chunk_page(page, options)
        except PageOverLimit as exc:
            path = f"{page.source}:{page.source_path}" if several else page.source_path
            refused.append(SkippedPage(path, str(exc)))
            continue
        kept.append(page)
        chunks.extend(got)
        if got and got[0].metadata is not page.metadata:
            _log_metadata_cut(page, got[0].metadata)
    return kept, chunks, refused


def _log_metadata_cut(page: Page, kept: Mapping[str, object]) -> None:
    """Say which page's metadata the chunker cut to the reader's caps (MAX_META_STRINGS,
    MAX_META_BYTES, a string at MAX_FIELD_BYTES): its chunks, and so its filters, lack the
    fields left out, and the build would otherwise say nothing of it (s12's F7)."""
    lost = [k for k in page.metadata if k not in kept]
    log.warning(
        "%s: metadata cut to what a snapshot keeps of it (%d of %d fields kept%s)",
        page.source_path,
        len(kept),
        len(page.metadata),
        f"; left out: {', '.join(repr(bounded(k, 64)) for k in lost[:8])}" if lost else "",
    )


def needs_model(kb: KnowledgeBaseConfig) -> bool:
    """Whether a build of ``kb`` calls [index.llm]: clean-up, model summaries or images."""
    return any(s.options.get("clean") or s.type == "image" for s in kb.sources) or (
        kb.summaries and kb.summary_text == "model"
    )


def model_caller(llm: LlmConfig | None, kb: KnowledgeBaseConfig) -> ModelCaller | None:
    return ModelCaller(llm) if llm is not None and needs_model(kb) else None


def with_sources(config: BuildConfig, kb: KnowledgeBaseConfig) -> KnowledgeBaseConfig:
    """``kb`` with its approved curated sources added; ConfigError when it then has none: a
    base a config only serves needs no source, a build does."""
    kb = dataclasses.replace(kb, sources=kb.sources + approved_sources(config.index.registry, kb))
    if not kb.sources:
        raise ConfigError(
            f"knowledge base {kb.name!r} has no [[knowledge_base.source]] (nor an approved "
            "`voxrecall source`): give it one to build it; a config that only serves it needs none"
        )
    return kb


def build_knowledge_base(
    config: BuildConfig,
    kb: KnowledgeBaseConfig,
    embedder: Embedder,
    *,
    progress: Callable[[int, int], None] | None = None,
    now: float | None = None,
    caller: ModelCaller | None = None,
) -> BuildSummary:
    """Build one base and publish it if anything changed.

    ``now`` is the time sources count from (when a URL is due for a re-crawl); default: now.
    ``progress(done, total)`` follows the embedding (default: ``EmbedProgress``, a bar on a
    terminal, a log line every ``PROGRESS_EVERY_S`` elsewhere); an exception it raises abandons
    the build before anything is written (``voxrecall index watch`` stops this way on SIGTERM).

    ``caller`` asks [index.llm] (default: one made from the config when the base needs it); its
    every call is made before anything is written, so ``SpendCapReached`` publishes nothing.
    """
    store = LocalStore(config.index.store)
    summary = BuildSummary(knowledge_base=kb.name)
    kb = with_sources(config, kb)
    caller = caller or model_caller(config.index.llm, kb)
    if caller is not None:
        summary.llm = caller.usage
    prepared = _prepare(config, kb, caller, summary, time.time() if now is None else now)
    with _phase(summary, "reuse"):
        reuse = previous_vectors(store, kb.name, embedder.info, summaries=kb.summaries)
    with _phase(summary, "embed"):
        vectors, summary.embedded = embed_chunks(
            embedder,
            prepared.chunks,
            reuse.vectors,
            config.embedder.batch_size,
            config.embedder.max_concurrency,
            progress or EmbedProgress(kb.name, len(prepared.pages), len(prepared.chunks)),
        )
    summary.reused = len(prepared.chunks) - summary.embedded
    summary.removed = len(reuse.chunk_ids - {c.chunk_id for c in prepared.chunks})

    content_hash = prepared.content_hash(embedder.info, kb.filterable)
    published = store.latest(kb.name)
    manifest = _published_manifest(store, kb.name) if published is not None else None
    if manifest is not None and manifest.extra.get("content_hash") == content_hash:
        if not summary.embedded:
            summary.version = published or ""
            log.info("%s unchanged: still %s", kb.name, published)
            return summary
    elif manifest is not None and manifest.chunks and not prepared.chunks:
        raise EmptyBuild(_emptied(kb.name, manifest.version, summary.skipped_pages))

    version = new_version_id(content_hash)
    if published is not None and version <= published:
        raise SnapshotError(f"clock went backwards: new version {version} <= published {published}")
    writers = _extra_writers(config, kb, embedder, prepared, reuse, summary, progress)
    staging = store.staging_dir(kb.name)
    with _phase(summary, "write"):
        write_snapshot(
            staging,
            knowledge_base=kb.name,
            version=version,
            embedder=embedder.info,
            chunks=prepared.chunks,
            vectors=vectors,
            pages={page_key(p.source, p.source_path): p.text for p in prepared.pages},
            page_count=len(prepared.pages),
            hnsw_m=kb.hnsw.m,
            hnsw_ef_construction=kb.hnsw.ef_construction,
            target_recall=kb.hnsw.target_recall,
            sources=[s.name for s in kb.sources],
            extra={"content_hash": content_hash}
            | ({"summaries": kb.summary_text} if kb.summaries else {}),
            more_files=(lambda folder: [n for w in writers for n in w(folder)])
            if writers
            else None,
            filterable=kb.filterable,
        )
        store.publish(kb.name, staging, version, keep=config.index.keep_versions)
    summary.version = version
    summary.published = True
    return summary


def _emptied(name: str, published: str, skipped: list[dict[str, str]]) -> str:
    """Why a build of no chunks is not published over ``published`` (``EmptyBuild``)."""
    if skipped:
        shown = "; ".join(f"{one_line(s['path'])}: {one_line(s['reason'])}" for s in skipped[:3])
        more = "; ..." if len(skipped) > 3 else ""
        found = f"every page was skipped ({len(skipped):,}: {shown}{more})"
    else:
        found = "its sources gave no chunk (an empty folder or export, a volume not mounted?)"
    return (
        f"{name}: {found}, so nothing is published over {published}, which keeps serving; "
        "fix the sources, or delete the base's folder in the store to empty it"
    )


@dataclass(frozen=True, slots=True)
class _Prepared:
    """What a build embeds and writes: its pages and chunks, with the model's outputs."""

    pages: list[Page]
    chunks: list[Chunk]
    originals: dict[str, str]  # a cleaned page's text as its source gave it, by page key
    summary_texts: list[str]

    def content_hash(self, info: EmbedderInfo, filterable: tuple[str, ...]) -> str:
        """What decides whether a build publishes: every text embedded, under its embedder."""
        content = hashlib.sha256(info.name.encode())
        for chunk in self.chunks:
            content.update(text_key(info, chunk.embed_text).encode())
            content.update(chunk.chunk_id.encode())
        for text in self.summary_texts:
            content.update(b"s" + text_key(info, text).encode())
        for key in sorted(self.originals):
            content.update(b"o" + key.encode())
        # a filter must see a changed plan_scope at once: the filterable values count as content
        if filterable:
            filtered = [_filtered(c, filterable) for c in self.chunks]
            content.update(orjson.dumps([filterable, filtered]))
        return content.hexdigest()


def _prepare(
    config: BuildConfig,
    kb: KnowledgeBaseConfig,
    caller: ModelCaller | None,
    summary: BuildSummary,
    now: float,
) -> _Prepared:
    """Sources -> pages (cleaned by the model when asked) -> chunks (and their summaries)."""
    with _phase(summary, "load"):
        pages, skipped = collect_pages(
            kb, LoadContext(kb.name, config.index.cache_dir, now), caller
        )
    originals: dict[str, str] = {}
    if caller is not None and config.index.llm is not None:
        with _phase(summary, "clean"):
            pages, originals = enrich.clean_pages(pages, kb, config.index.llm, caller)
    options = ChunkOptions(
        target_tokens=kb.chunking.target_tokens,
        overlap_tokens=kb.chunking.overlap_tokens,
        heading_levels=kb.chunking.heading_levels,
    )
    with _phase(summary, "chunk"):
        pages, chunks, refused = chunk_pages(pages, options, several=len(kb.sources) > 1)
    if refused and originals:  # a refused page is in no table: its original goes with it
        served = {page_key(p.source, p.source_path) for p in pages}
        originals = {key: text for key, text in originals.items() if key in served}
    summary.pages = len(pages)
    summary.skipped_pages = [{"path": s.path, "reason": s.reason} for s in skipped + refused]
    summary.chunks = len(chunks)
    summary_texts: list[str] = []
    if kb.summaries:
        with _phase(summary, "summaries"):
            summary_texts = enrich.summary_texts(chunks, kb, caller)
    return _Prepared(pages, chunks, originals, summary_texts)


def _extra_writers(
    config: BuildConfig,
    kb: KnowledgeBaseConfig,
    embedder: Embedder,
    prepared: _Prepared,
    reuse: Reuse,
    summary: BuildSummary,
    progress: Callable[[int, int], None] | None,
) -> list[Callable[[Path], list[str]]]:
    """The writers of a snapshot's optional files: summaries (embedded here) and originals."""
    writers = []
    if kb.summaries:
        with _phase(summary, "embed summaries"):
            summary_vectors, _ = embed_texts(
                embedder,
                prepared.summary_texts,
                reuse.summaries,
                config.embedder.batch_size,
                config.embedder.max_concurrency,
                progress or _quiet,  # a watch's progress may raise to abandon the build
            )
        writers.append(
            enrich.summary_writer(
                prepared.summary_texts, summary_vectors, kb.hnsw.m, kb.hnsw.ef_construction
            )
        )
    if prepared.originals:
        writers.append(enrich.originals_writer(prepared.originals))
    return writers


def _filtered(chunk: Chunk, filterable: tuple[str, ...]) -> list[object]:
    return [chunk.metadata.get(name) for name in filterable]


def _published_manifest(store: LocalStore, kb: str) -> Manifest | None:
    """The published version's manifest, None when it cannot be read (a build then publishes)."""
    try:
        return read_manifest(store.latest_dir(kb))
    except VoxrecallError:
        return None
