"""A searcher per snapshot (issue 18, 1): what a call reads of a base (the gazetteer, the page
index, the BM25 buffers, the source labels, the mapped vectors) is built with the base's
searcher before it is served, never on the event loop; a call keeps the searcher it started
with across a swap.

Real parts: a real sidecar on port 0, real snapshots of the real model's vectors in a local
store, 20 small bases of them; eagerly loaded, and lazily under a memory budget.
"""

from __future__ import annotations

import asyncio
import json
import platform
import threading
import tracemalloc
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import pytest

from index.embedders.base import Embedder, EmbedderInfo, HashEmbedder, Vectors
from index.lexical import Bm25, LexicalIndex
from index.snapshot import (
    CHUNKS,
    GAZETTEER,
    HNSW_INDEX_BYTES,
    LEXICAL,
    MANIFEST,
    load_snapshot,
    write_snapshot,
)
from index.store import LocalStore
from index.types import Chunk
from sidecar.edge.server import create_server
from sidecar.gen import retrieval_pb2 as pb
from sidecar.gen import retrieval_pb2_grpc as pb_grpc
from sidecar.snapshots import refresh, searcher
from sidecar.snapshots.searcher import Searcher
from sidecar.turn import followups
from tests.bases_kit import LOAD_WAIT_S, config, kb_name, retried
from tests.snapshot_kit import KB, TOPICS, resident_kb, version_id, write_version

BASES = 20
BUDGET_MB = 10  # lazy: a few of the small bases fit, so the others are evicted and load again


def topic(i: int) -> str:
    return sorted(TOPICS)[i % len(TOPICS)]


@pytest.fixture(scope="module")
def store(tmp_path_factory: pytest.TempPathFactory, local_embedder: Embedder) -> Path:
    root = tmp_path_factory.mktemp("searchers") / "store"
    for i in range(BASES):
        write_version(root, version_id(1), local_embedder, topic(i), kb=kb_name(i))
    return root


class Builds:
    """The thread each per-snapshot build ran on, by what was built."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, int]] = []

    def spy(self, what: str, build: Callable[..., Any]) -> Callable[..., Any]:
        def spied(*args: Any, **kwargs: Any) -> Any:
            self.calls.append((what, threading.get_ident()))
            return build(*args, **kwargs)

        return spied

    def counts(self) -> Counter[str]:
        return Counter(what for what, _ in self.calls)

    def on(self, thread: int) -> list[str]:
        return [what for what, ident in self.calls if ident == thread]


@pytest.fixture
def builds(monkeypatch: pytest.MonkeyPatch) -> Builds:
    spies = Builds()
    build = Searcher.build.__func__  # type: ignore[attr-defined]
    monkeypatch.setattr(Searcher, "build", classmethod(spies.spy("searcher", build)))
    monkeypatch.setattr(followups, "gazetteer", spies.spy("gazetteer", followups.gazetteer))
    monkeypatch.setattr(searcher, "page_index", spies.spy("page index", searcher.page_index))
    monkeypatch.setattr(searcher, "Bm25", spies.spy("bm25", searcher.Bm25))
    monkeypatch.setattr(searcher, "vector_rows", spies.spy("vectors", searcher.vector_rows))
    monkeypatch.setattr(searcher.Sources, "of", spies.spy("sources", searcher.Sources.of))
    monkeypatch.setattr(searcher, "_answers", spies.spy("answers", searcher._answers))
    return spies


@pytest.mark.parametrize("lazy", [False, True], ids=["loaded", "lazy"])
async def test_turns_over_20_bases_build_nothing_on_the_event_loop(
    store: Path, tmp_path: Path, local_embedder: Embedder, builds: Builds, lazy: bool
) -> None:
    budget = {"memory_budget_mb": BUDGET_MB} if lazy else {}
    sidecar = await create_server(
        config(store, tmp_path, **budget), embedder=local_embedder, poll=False
    )
    loop_thread = threading.get_ident()
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{sidecar.port}") as channel:
            stub = pb_grpc.RetrievalStub(channel)  # type: ignore[no-untyped-call]
            for rounds in range(2):  # lazy: the second round finds most bases evicted
                for i in range(BASES):
                    kb, session = kb_name(i), f"s{rounds}-{i}"
                    for text in (f"Tell me about {topic(i)}.", "And how long does that take?"):
                        request = pb.TurnRequest(
                            knowledge_base=kb, session_id=session, text=text, is_final=True
                        )
                        turn = await retried(lambda r=request: stub.Turn(r, timeout=30))
                        assert turn.snapshot_version == version_id(1)
                        assert {c.knowledge_base for c in turn.chunks} <= {kb}
                    read = pb.ReadPageRequest(knowledge_base=kb, source_path=f"{topic(i)}.md")
                    page = await retried(lambda r=read: stub.ReadPage(r, timeout=30))
                    assert page.title == topic(i).title()
    finally:
        await sidecar.stop(0.5)
    built = builds.counts()
    assert built["searcher"] >= BASES  # every base's, and in lazy mode again after evictions
    if lazy:
        assert sidecar.holder.evictions > 0
        assert built["searcher"] > BASES
    for what in ("gazetteer", "page index", "bm25", "vectors", "sources"):
        assert built[what] == built["searcher"], what
    # a base's answers, a cache, are not written under a memory budget (the bases' bytes)
    assert built["answers"] == (0 if lazy else built["searcher"])
    assert builds.on(loop_thread) == []


class GatedEmbedder:
    """The real model, except that embedding ``gated`` waits for ``release``: a call is then
    in flight, holding its searcher, for as long as the test wants."""

    def __init__(self, inner: Embedder, gated: str) -> None:
        self.inner = inner
        self.gated = gated
        self.entered = asyncio.Event()
        self.release = asyncio.Event()

    @property
    def info(self) -> EmbedderInfo:
        return self.inner.info

    async def embed(self, texts: Sequence[str]) -> Vectors:
        if self.gated in texts:
            self.entered.set()
            await self.release.wait()
        return await self.inner.embed(texts)

    def embed_batch(self, texts: Sequence[str]) -> Vectors:
        return self.inner.embed_batch(texts)

    async def aclose(self) -> None:
        return None


async def test_a_call_in_flight_keeps_its_searcher_across_a_swap(
    tmp_path: Path, local_embedder: Embedder
) -> None:
    root = tmp_path / "store"
    old, new = version_id(1), version_id(2)
    write_version(root, old, local_embedder, "password")
    question = "How do I reset my password?"
    embedder = GatedEmbedder(local_embedder, question)
    settings = config(root, tmp_path, budget_ms=10_000)
    sidecar = await create_server(settings, embedder=embedder, poll=False)
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{sidecar.port}") as channel:
            stub = pb_grpc.RetrievalStub(channel)  # type: ignore[no-untyped-call]
            request = pb.TurnRequest(
                knowledge_base=KB, session_id="a", text=question, is_final=True
            )
            in_flight = asyncio.ensure_future(stub.Turn(request, timeout=30))
            await asyncio.wait_for(embedder.entered.wait(), LOAD_WAIT_S)
            serving = sidecar.holder.use(KB)
            write_version(root, new, local_embedder, "roaming")
            assert await sidecar.refresher.refresh() == [KB]  # swapped while the call waits
            assert sidecar.holder.use(KB) is not serving
            embedder.release.set()
            turn = await in_flight
            after = await stub.Turn(
                pb.TurnRequest(knowledge_base=KB, session_id="b", text=question, is_final=True),
                timeout=30,
            )
    finally:
        await sidecar.stop(0.5)
    assert turn.snapshot_version == old
    assert turn.chunks
    assert all(c.chunk_id.startswith(old) for c in turn.chunks)
    assert "reset" in turn.chunks[0].text
    assert after.snapshot_version == new
    assert after.chunks
    assert all(c.chunk_id.startswith(new) for c in after.chunks)


def test_bm25_scores_only_the_matching_documents_and_reuses_its_buffers() -> None:
    texts = [
        "reset the password in settings",
        "roaming costs nothing in the union",
        "the password reset link expires",
        "voicemail keeps messages",
        "settings hold the roaming switch",
        *(f"filler document {i} of the archive" for i in range(60)),
    ]
    index = LexicalIndex.build(texts)
    bm25 = Bm25(index)
    # rare terms (their postings de-duplicated), one term, common terms (the buffer scanned)
    queries = ("password reset", "roaming settings password", "voicemail", "filler archive")
    for query in (*queries, "filler password", "nothing matches here", ""):
        dense = index.scores(query)
        scored, at = bm25.score(query, at=np.arange(len(texts), dtype=np.int64))
        assert sorted(scored.docs.tolist()) == np.flatnonzero(dense).tolist()
        assert scored.scores.tolist() == dense[scored.docs].tolist()  # the same to the bit
        assert at.tolist() == dense.tolist()
        assert scored.top(3) == index.search(query, 3)
        keep = scored.docs % 2 == 0
        mask = np.arange(len(texts)) % 2 == 0
        assert scored.top(3, keep) == index.search(query, 3, mask)
        assert not bm25._sums.any()  # zero again for the next query


def test_a_searcher_counts_each_sources_chunks_once(tmp_path: Path) -> None:
    root = tmp_path / "store"
    folder = write_two_sources(root)
    snapshot = load_snapshot(folder)
    found = Searcher.build(snapshot)
    sources = found.sources
    for name in snapshot.source_names:
        ids = sources.ids([name])
        assert ids is not None
        want = [i for i, c in enumerate(snapshot.chunks) if c.source == name]
        assert sources.count(ids) == len(want)
        assert sources.labels_of(ids).tolist() == want
        assert np.flatnonzero(sources.mask(ids)).tolist() == want
    assert sources.ids(list(snapshot.source_names)) is None  # every source: no filter
    assert sources.ids(["nope"]) == ()
    assert sources.count(()) == 0


def test_what_a_load_and_a_searcher_build_keep_counts_in_their_bytes(tmp_path: Path) -> None:
    """memory_budget_mb evicts by ``memory_bytes``: what loading a snapshot and building its
    searcher keep (the filter index's pages, the gazetteer's tables built here, the buffers)
    counts in it, near what they allocate (not just the files)."""
    folder = without_tables(write_two_sources(tmp_path / "store"))  # the tables built at load
    load_snapshot(folder)  # once untraced: the process's one-time caches (regexes) not counted
    tracemalloc.start()
    try:
        snapshot = load_snapshot(folder)
        loaded, _ = tracemalloc.get_traced_memory()
        Searcher.build(snapshot)
        tracemalloc.reset_peak()
        before, _ = tracemalloc.get_traced_memory()
        searcher = Searcher.build(snapshot)
        built = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    files = sum(snapshot.manifest.sizes.values()) + HNSW_INDEX_BYTES
    assert snapshot.memory_bytes - files >= loaded // 2  # the filter index, the chunks kept
    assert searcher.held_bytes == searcher.gazetteer.built_bytes > 0
    assert searcher.memory_bytes - snapshot.memory_bytes >= built // 2


def test_a_searcher_writes_its_bases_answers_and_counts_them(tmp_path: Path) -> None:
    snapshot = load_snapshot(write_two_sources(tmp_path / "store"))
    found = Searcher.build(snapshot)
    assert found.answers is not None  # a small base's: every chunk's, written once here
    assert found.answers.knowledge_base == snapshot.manifest.knowledge_base
    without = replace(found, answers=None)
    assert found.memory_bytes - without.memory_bytes == found.answers.nbytes > 0


def without_tables(folder: Path) -> Path:
    """The snapshot as one written before gazetteer.bin: its manifest lists no tables."""
    manifest = json.loads((folder / MANIFEST).read_bytes())
    del manifest["files"][GAZETTEER], manifest["sizes"][GAZETTEER]
    (folder / GAZETTEER).unlink()
    (folder / MANIFEST).write_text(json.dumps(manifest))
    return folder


def test_the_page_index_of_a_mapped_table_is_that_of_its_decoded_chunks(tmp_path: Path) -> None:
    snapshot = load_snapshot(write_two_sources(tmp_path / "store"))
    index = searcher.page_index(snapshot.chunks)  # read from the columns, nothing decoded
    assert index == searcher.page_index(list(snapshot.chunks))
    assert index[("blog", "p3.md")] == 3


def test_a_built_searcher_keeps_no_page_the_load_scanned_and_still_reads_them(
    tmp_path: Path,
) -> None:
    snapshot = load_snapshot(write_two_sources(tmp_path / "store"))
    chunks, lexical = snapshot.folder / CHUNKS, snapshot.folder / LEXICAL
    built = Searcher.build(snapshot)  # the gazetteer and page index read every chunk
    if resident_kb(chunks) is None:
        pytest.skip("no /proc/self/smaps: resident pages are not visible here")
    assert resident_kb(chunks) == resident_kb(lexical) == 0
    assert built.chunks[7].title == "Page 7"  # read again through the same mapping
    assert [label for label, _ in snapshot.lexical.search("Page 5", 1)] == [5]
    assert (resident_kb(chunks) or 0) > 0  # the read mapped its page: the check sees it


def write_two_sources(root: Path) -> Path:
    """A snapshot whose chunks come from two sources, interleaved."""
    embedder = HashEmbedder()
    chunks = [
        Chunk(
            chunk_id=f"c{i}",
            source="faq" if i % 3 else "blog",
            source_path=f"p{i}.md",
            title=f"Page {i}",
            breadcrumbs=(),
            text=f"text {i}",
            embed_text=f"Page {i} text {i}",
            metadata={},
        )
        for i in range(12)
    ]
    folder = LocalStore(root).staging_dir("two")
    write_snapshot(
        folder,
        knowledge_base="two",
        version=version_id(1),
        embedder=embedder.info,
        chunks=chunks,
        vectors=embedder.embed_batch([c.embed_text for c in chunks]),
        pages={},
        page_count=12,
        hnsw_m=8,
        hnsw_ef_construction=50,
        target_recall=0.9,
        sources=["blog", "faq"],
    )
    return folder


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="malloc_trim is glibc's")
def test_a_load_hands_the_heap_it_freed_back_where_the_c_library_can() -> None:
    assert refresh.release_free_heap()
