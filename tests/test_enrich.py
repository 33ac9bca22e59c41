"""Index-time enrichment against a real local chat completions server (tests/chat_server.py):
clean-up and summaries land in the snapshot, failures keep the original, the cache prevents a
second call, the spend cap stops the build and publishes nothing, images are sent only from
approved sources."""

from __future__ import annotations

import base64
import contextlib
import os
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import orjson
import pytest

from index import build as index_build
from index import enrich
from index.build import build_knowledge_base
from index.chunker import MAX_PAGE_HEADINGS
from index.embedders.base import HashEmbedder, Vectors
from index.enrich import ORIGINALS, summary_writer
from index.errors import ConfigError, SnapshotError, SpendCapReached
from index.llm import ModelCaller, answer_limit
from index.snapshot import load_snapshot, page_key, write_snapshot
from index.sources import image
from index.store import LocalStore
from index.summaries import SUMMARY_TEXTS, heading_summary
from sidecar.config import Config, parse_config
from sidecar.edge.server import create_server
from sidecar.gen import retrieval_pb2 as pb
from sidecar.gen import retrieval_pb2_grpc as pb_grpc
from sidecar.snapshots.searcher import Searcher
from sidecar.turn import relevance
from tests.chat_server import ChatServer, image_urls, user_text
from tests.hardening_kit import uses_of

BROKEN = (
    "# Router manual\n\nACME Router Manual - page 1\n\nThe router con-\nnects to the wall socket. "
    + "Wait for the green light before you press anything at all. " * 8
    + "\n\nACME Router Manual - page 2\n"
)
SHORT = "# Billing\n\nInvoices are sent on the first of each month.\n"
PNG = b"\x89PNG\r\n\x1a\n" + b"\x00" * 64  # the server never decodes it


@pytest.fixture
def server() -> Iterator[ChatServer]:
    s = ChatServer().start()
    yield s
    s.stop()


@pytest.fixture
def embedder() -> HashEmbedder:
    return HashEmbedder(dimension=256, name="hash")


def docs(root: Path) -> Path:
    folder = root / "docs"
    folder.mkdir()
    (folder / "manual.md").write_text(BROKEN)
    (folder / "billing.md").write_text(SHORT)
    return folder


def configure(
    tmp_path: Path, server: ChatServer, sources: list[dict[str, Any]], **options: Any
) -> Config:
    llm = {
        "base_url": server.base_url,
        "clean_min_bytes": 200,
        "retries": 2,
        "timeout_s": 5.0,
        **options.pop("llm", {}),
    }
    kb = {"name": "kb", "source": sources, **options}
    raw = {"knowledge_base": [kb], "index": {"store": str(tmp_path / "store"), "llm": llm}}
    return parse_config(raw, base=tmp_path)


def build(config: Config, embedder: HashEmbedder) -> Any:
    caller = ModelCaller(config.index.llm, backoff_s=0.01) if config.index.llm else None
    return build_knowledge_base(config, config.knowledge_bases[0], embedder, caller=caller)


def latest(config: Config, embedder: HashEmbedder) -> Any:
    store = LocalStore(config.index.store)
    return load_snapshot(store.latest_dir("kb"), expected=embedder.info)


def test_cleanup_lands_in_the_snapshot_and_the_original_is_kept(
    tmp_path: Path, server: ChatServer, embedder: HashEmbedder
) -> None:
    server.answer = lambda body: "# Router manual\n\nThe router connects to the wall socket."
    sources = [{"type": "markdown", "path": str(docs(tmp_path)), "clean": True}]
    config = configure(tmp_path, server, sources)
    summary = build(config, embedder)
    assert summary.published
    assert summary.as_dict()["llm"] == {"calls": 1, "cache_hits": 0, "tokens": 100, "failures": 0}
    assert server.requests == 1  # the short page is not sent
    assert "page 2" in user_text(server.bodies[0])
    snap = latest(config, embedder)
    texts = [c.text for c in snap.chunks if c.source_path == "manual.md"]
    assert texts == ["The router connects to the wall socket."]
    originals = orjson.loads((snap.folder / ORIGINALS).read_bytes())
    assert originals == {page_key("markdown", "manual.md"): BROKEN}
    assert ORIGINALS in snap.manifest.files


def test_a_cleaned_page_the_chunker_refuses_leaves_no_original_behind(
    tmp_path: Path, server: ChatServer, embedder: HashEmbedder
) -> None:
    """A review: a page refused after its cleanup (here more headings than a page may have) was
    left out of the tables, but its original stayed in originals.json and the content hash."""
    server.answer = lambda body: "# Router manual\n\n" + "## h\nw\n" * (MAX_PAGE_HEADINGS + 1)
    sources = [{"type": "markdown", "path": str(docs(tmp_path)), "clean": True}]
    config = configure(tmp_path, server, sources)
    summary = build(config, embedder)
    assert summary.published
    assert [s["path"] for s in summary.skipped_pages] == ["manual.md"]
    snap = latest(config, embedder)
    assert {c.source_path for c in snap.chunks} == {"billing.md"}
    assert ORIGINALS not in snap.manifest.files


@pytest.mark.parametrize(
    "fault",
    [
        {"fail_status": 500, "fail_times": -1},
        {"fail_status": 429, "fail_times": -1},
        {"malformed": "json"},
        {"malformed": "shape"},
        {"malformed": "empty"},
        {"cut": True},
    ],
)
def test_a_failed_cleanup_keeps_the_original_and_is_named(
    tmp_path: Path, server: ChatServer, embedder: HashEmbedder, fault: dict[str, Any]
) -> None:
    server.set(**fault)
    sources = [{"type": "markdown", "path": str(docs(tmp_path)), "clean": True}]
    config = configure(tmp_path, server, sources)
    summary = build(config, embedder).as_dict()
    assert summary["published"]
    assert summary["llm"]["failures"] == 1
    assert summary["llm"]["calls"] == (0 if "fail_status" in fault else 1)
    [failed] = summary["enrichment_failures"]
    assert failed["label"] == "markdown:manual.md"
    assert failed["task"] == "clean"
    snap = latest(config, embedder)
    manual = " ".join(c.text for c in snap.chunks if c.source_path == "manual.md")
    assert "con-\nnects" in manual  # the original, not a half answer
    assert ORIGINALS not in snap.manifest.files


def test_an_answer_larger_than_its_tokens_can_hold_is_a_failure(
    tmp_path: Path, server: ChatServer, embedder: HashEmbedder
) -> None:
    """A server that streams far more than max_output_tokens could say is not read whole: the
    page keeps its original text and the failure is named."""
    server.answer = lambda body: "# Router\n\n" + "The router connects. " * 20_000  # ~420 kB
    sources = [{"type": "markdown", "path": str(docs(tmp_path)), "clean": True}]
    config = configure(tmp_path, server, sources, llm={"max_output_tokens": 64})
    assert answer_limit(64) < 420_000
    summary = build(config, embedder).as_dict()
    assert summary["published"]
    assert summary["llm"]["failures"] == 1
    [failed] = summary["enrichment_failures"]
    assert failed["label"] == "markdown:manual.md"
    assert "max_output_tokens = 64" in failed["reason"]
    manual = " ".join(
        c.text for c in latest(config, embedder).chunks if c.source_path == "manual.md"
    )
    assert "con-\nnects" in manual


def test_429_and_500_are_retried(
    tmp_path: Path, server: ChatServer, embedder: HashEmbedder
) -> None:
    server.set(fail_status=429, fail_times=2)
    sources = [{"type": "markdown", "path": str(docs(tmp_path)), "clean": True}]
    config = configure(tmp_path, server, sources)
    summary = build(config, embedder).as_dict()
    assert server.requests == 3
    assert summary["llm"]["calls"] == 1
    assert summary["llm"]["failures"] == 0


def test_a_trickling_answer_is_cut_by_the_whole_request_deadline(
    tmp_path: Path, server: ChatServer, embedder: HashEmbedder
) -> None:
    # every 16 bytes 0.2 s apart: each read is quick, the whole answer takes many seconds
    server.set(trickle_s=0.2)
    sources = [{"type": "markdown", "path": str(docs(tmp_path)), "clean": True}]
    config = configure(tmp_path, server, sources, llm={"timeout_s": 0.5, "retries": 0})
    summary = build(config, embedder).as_dict()
    [failed] = summary["enrichment_failures"]
    assert "timeout_s" in failed["reason"]


def test_the_cache_prevents_a_second_call(
    tmp_path: Path, server: ChatServer, embedder: HashEmbedder
) -> None:
    folder = docs(tmp_path)
    sources = [{"type": "markdown", "path": str(folder), "clean": True}]
    config = configure(tmp_path, server, sources, summaries=True)
    first = build(config, embedder).as_dict()["llm"]
    chunks = len(latest(config, embedder).chunks)
    assert first["calls"] == 1 + chunks  # the clean-up, then a summary per chunk
    (folder / "billing.md").write_text(SHORT + "\nLate fees apply after thirty days.\n")
    second = build(config, embedder).as_dict()["llm"]
    assert server.requests == first["calls"] + 1  # only the edited chunk's summary is asked
    assert second["calls"] == 1
    assert second["cache_hits"] == chunks
    assert second["tokens"] == 100


def test_the_spend_cap_stops_the_build_and_publishes_nothing(
    tmp_path: Path, server: ChatServer, embedder: HashEmbedder
) -> None:
    folder = docs(tmp_path)
    for i in range(4):
        (folder / f"copy{i}.md").write_text(BROKEN.replace("Router", f"Router {i}"))
    sources = [{"type": "markdown", "path": str(folder), "clean": True}]
    config = configure(
        tmp_path, server, sources, llm={"max_build_tokens": 250, "max_concurrency": 1}
    )
    with pytest.raises(SpendCapReached, match="max_build_tokens = 250 reached"):
        build(config, embedder)
    assert server.requests == 3  # 100 tokens each: the third passes 250, no fourth starts
    assert LocalStore(config.index.store).latest("kb") is None


def test_summaries_land_in_the_snapshot_and_are_searched(
    tmp_path: Path, server: ChatServer, embedder: HashEmbedder
) -> None:
    asked = "quarterly ledger dispatch timing"  # no word of it is in any page
    server.answer = lambda body: asked if "Invoices" in user_text(body) else "unrelated"
    sources = [{"type": "markdown", "path": str(docs(tmp_path))}]
    config = configure(tmp_path, server, sources, summaries=True)
    build(config, embedder)
    snap = latest(config, embedder)
    assert snap.summaries is not None
    assert snap.manifest.extra["summaries"] == "model"
    texts = orjson.loads((snap.folder / SUMMARY_TEXTS).read_bytes())
    billing = next(i for i, c in enumerate(snap.chunks) if c.source_path == "billing.md")
    assert texts[billing] == asked
    # the hash embedder gives texts without a common word ~zero cosine: only the summary finds it
    query = embedder.embed_batch([asked])[0]
    q = relevance.Query(text="", vector=query, limit=3, min_score=0.5, min_lexical_score=1.0)
    assert [label for label, _ in relevance.rank(Searcher.build(snap), q)] == [billing]
    content_only = [label for label, _ in snap.search_dense(query, 3) if _ >= 0.5]
    assert content_only == []


def test_the_heading_view_needs_no_model(tmp_path: Path, embedder: HashEmbedder) -> None:
    folder = docs(tmp_path)
    raw = {
        "knowledge_base": [
            {"name": "kb", "summaries": True, "summary_text": "heading",
             "source": [{"type": "markdown", "path": str(folder)}]}
        ],
        "index": {"store": str(tmp_path / "store")},
    }  # fmt: skip
    config = parse_config(raw, base=tmp_path)
    build_knowledge_base(config, config.knowledge_bases[0], embedder)
    snap = latest(config, embedder)
    texts = orjson.loads((snap.folder / SUMMARY_TEXTS).read_bytes())
    assert texts == [heading_summary(c) for c in snap.chunks]
    assert "Billing\nInvoices are sent on the first of each month." in texts


async def test_a_search_by_a_vector_alone_uses_a_base_with_summaries_once(
    tmp_path: Path, embedder: HashEmbedder, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A vector alone on a base with a summary prong goes the general way (``nearest_to`` gives
    it up before using the base), which searches the summaries too: the base used once."""
    raw = {
        "knowledge_base": [
            {"name": "kb", "summaries": True, "summary_text": "heading",
             "source": [{"type": "markdown", "path": str(docs(tmp_path))}]}
        ],
        "index": {"store": str(tmp_path / "store")},
        "sidecar": {"store": str(tmp_path / "store"), "listen": "127.0.0.1:0", "min_score": -1.0},
    }  # fmt: skip
    config = parse_config(raw, base=tmp_path)
    build_knowledge_base(config, config.knowledge_bases[0], embedder)
    (vector,) = embedder.embed_batch(["Invoices are sent on the first of each month."])
    sidecar = await create_server(config, embedder=embedder, poll=False)
    try:
        assert sidecar.holder.get("kb").summaries is not None  # type: ignore[union-attr]
        used = uses_of(sidecar, monkeypatch)
        async with grpc.aio.insecure_channel(f"127.0.0.1:{sidecar.port}") as channel:
            stub = pb_grpc.RetrievalStub(channel)  # type: ignore[no-untyped-call]
            request = pb.SearchRequest(vector=np.asarray(vector, dtype="<f4").tobytes())
            answer = await stub.Search(request, timeout=10)
    finally:
        await sidecar.stop(0.5)
    assert used == ["kb"]
    assert "Invoices" in answer.chunks[0].text


def test_model_work_without_an_llm_table_is_refused(tmp_path: Path) -> None:
    source = {"type": "markdown", "path": str(tmp_path), "clean": True}
    raw = {"knowledge_base": [{"name": "kb", "source": [source]}]}
    with pytest.raises(ConfigError, match=r"needs a model: add an \[index.llm\]"):
        parse_config(raw, base=tmp_path)


def images(root: Path, big: int = 0) -> Path:
    folder = root / "images"
    folder.mkdir()
    (folder / "router-lights.png").write_bytes(PNG)
    if big:
        (folder / "huge.png").write_bytes(PNG + b"\x00" * big)
    return folder


def test_an_unapproved_image_is_never_sent(
    tmp_path: Path, server: ChatServer, embedder: HashEmbedder
) -> None:
    sources = [
        {"type": "markdown", "path": str(docs(tmp_path))},
        {"name": "shots", "type": "image", "path": str(images(tmp_path))},
    ]
    summary = build(configure(tmp_path, server, sources), embedder).as_dict()
    assert server.requests == 0
    [skipped] = summary["skipped_pages"]
    assert skipped["path"].startswith("shots:")
    assert "approved = true" in skipped["reason"]


def test_an_approved_image_becomes_a_page(
    tmp_path: Path, server: ChatServer, embedder: HashEmbedder
) -> None:
    server.answer = lambda body: "A router with three lights.\n\n## Text in the image\n\nWAN LAN"
    folder = images(tmp_path, big=4096)
    sources = [{"type": "image", "path": str(folder), "approved": True}]
    config = configure(tmp_path, server, sources, llm={"max_image_bytes": 1024})
    summary = build(config, embedder).as_dict()
    assert server.requests == 1  # huge.png is over max_image_bytes: skipped, never sent
    assert [s["path"] for s in summary["skipped_pages"]] == ["huge.png"]
    [url] = image_urls(server.bodies[0])
    assert url == "data:image/png;base64," + base64.b64encode(PNG).decode()
    snap = latest(config, embedder)
    assert {c.source_path for c in snap.chunks} == {"router-lights.png"}
    assert "WAN LAN" in " ".join(c.text for c in snap.chunks)


def test_images_are_read_a_batch_at_a_time_and_one_image_is_asked_once(
    tmp_path: Path, server: ChatServer, embedder: HashEmbedder, monkeypatch: pytest.MonkeyPatch
) -> None:
    """800 links to one 4 MiB image were read at once (3.6 GB) and sent 800 times: a source's
    images are read IMAGES_HELD_BYTES at a time, and one input is asked once."""
    server.answer = lambda body: "A router with three lights."
    folder = images(tmp_path)
    for n in range(6):
        os.link(folder / "router-lights.png", folder / f"copy-{n}.png")
        (folder / f"other-{n}.png").write_bytes(PNG + bytes([n]) * 64)
    batches: list[int] = []
    describe = enrich.describe_images

    def watched(source: Any, got: list[Any], caller: Any) -> Any:
        batches.append(sum(len(image.data) for image in got))
        return describe(source, got, caller)

    monkeypatch.setattr(enrich, "describe_images", watched)
    monkeypatch.setattr(image, "IMAGES_HELD_BYTES", 3 * (len(PNG) + 64))
    sources = [{"type": "image", "path": str(folder), "approved": True}]
    summary = build(configure(tmp_path, server, sources), embedder).as_dict()
    assert len(batches) >= 4
    assert max(batches) <= 3 * (len(PNG) + 64)
    assert server.requests == 7  # the one image of seven names, and the six others
    assert summary["skipped_pages"] == []
    assert summary["pages"] == 13


def test_an_image_the_model_fails_on_is_not_asked_again_in_a_later_batch(
    tmp_path: Path, server: ChatServer, embedder: HashEmbedder, monkeypatch: pytest.MonkeyPatch
) -> None:
    """One input is asked once a build: a failure was asked again in each batch of its names
    (the answer cache keeps successes only), 50 x (1 + retries) requests for 800 names."""
    server.set(fail_status=500, fail_times=-1)
    folder = images(tmp_path)
    for n in range(8):
        os.link(folder / "router-lights.png", folder / f"copy-{n}.png")
    monkeypatch.setattr(image, "IMAGES_HELD_BYTES", 3 * len(PNG))  # batches of three
    sources = [{"type": "image", "path": str(folder), "approved": True}]
    with contextlib.suppress(SnapshotError):  # no page: nothing to publish
        build(configure(tmp_path, server, sources), embedder)
    assert server.requests == 3  # once, with its two retries


class Counting(HashEmbedder):
    """Remembers every text a build embedded."""

    def __init__(self) -> None:
        super().__init__(dimension=256, name="hash")
        self.embedded: list[str] = []

    def embed_batch(self, texts: Sequence[str]) -> Vectors:
        self.embedded.extend(texts)
        return super().embed_batch(texts)


def test_summary_vectors_of_unchanged_chunks_are_reused(
    tmp_path: Path, server: ChatServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    embedder = Counting()
    folder = docs(tmp_path)
    config = configure(
        tmp_path, server, [{"type": "markdown", "path": str(folder)}], summaries=True
    )
    build(config, embedder)
    before = latest(config, embedder)
    (folder / "returns.md").write_text("# Returns\n\nReturn it within 30 days.\n")
    embedder.embedded.clear()
    loads: list[Path] = []
    load = index_build.load_snapshot
    monkeypatch.setattr(
        index_build,
        "load_snapshot",
        lambda folder, **kw: loads.append(folder) or load(folder, **kw),
    )
    build(config, embedder)
    after = latest(config, embedder)
    assert after.summaries is not None
    assert after.version != before.version
    new = next(c for c in after.chunks if c.source_path == "returns.md")
    # the new chunk's text and its summary; nothing of the unchanged pages
    assert embedder.embedded == [new.embed_text, f"model: {new.embed_text}"]
    assert loads == [before.folder]  # both kinds of vectors from one load of the published one


def test_a_snapshot_serves_its_summaries_without_reading_their_texts(
    tmp_path: Path, server: ChatServer, embedder: HashEmbedder
) -> None:
    """Queries read only the summary vectors: a load (checksums already checked by the store's
    fetch) never parses summaries.json, whatever it holds."""
    config = configure(
        tmp_path, server, [{"type": "markdown", "path": str(docs(tmp_path))}], summaries=True
    )
    build(config, embedder)
    texts = latest(config, embedder).folder / SUMMARY_TEXTS
    texts.write_bytes(b"#" * texts.stat().st_size)  # not JSON, same size
    snap = load_snapshot(texts.parent, expected=embedder.info, checksums=False)
    assert snap.summaries is not None
    assert snap.summaries.count == len(snap.chunks)


def test_the_summaries_benchmark_adds_a_second_view_to_a_snapshot(
    tmp_path: Path, embedder: HashEmbedder
) -> None:
    from bench.summaries import with_summaries

    raw = {
        "knowledge_base": [
            {"name": "kb", "source": [{"type": "markdown", "path": str(docs(tmp_path))}]}
        ],
        "index": {"store": str(tmp_path / "store")},
    }
    config = parse_config(raw, base=tmp_path)
    build_knowledge_base(config, config.knowledge_bases[0], embedder)
    base = latest(config, embedder)
    assert base.summaries is None
    views = [heading_summary(c) for c in base.chunks]
    copy = with_summaries(base, views, embedder, tmp_path / "copy")
    assert copy.summaries is not None
    assert [c.chunk_id for c in copy.chunks] == [c.chunk_id for c in base.chunks]
    assert orjson.loads((copy.folder / SUMMARY_TEXTS).read_bytes()) == views


def test_the_summary_prong_keeps_to_the_sources_asked_for(
    tmp_path: Path, server: ChatServer, embedder: HashEmbedder
) -> None:
    asked = "quarterly ledger dispatch timing"
    server.answer = lambda body: asked if "Invoices" in user_text(body) else "unrelated"
    other = tmp_path / "other"
    other.mkdir()
    (other / "returns.md").write_text("# Returns\n\nReturn it within 30 days.\n")
    sources = [
        {"name": "docs", "type": "markdown", "path": str(docs(tmp_path))},
        {"name": "other", "type": "markdown", "path": str(other)},
    ]
    config = configure(tmp_path, server, sources, summaries=True)
    build(config, embedder)
    snap = latest(config, embedder)
    query = embedder.embed_batch([asked])[0]
    searcher = Searcher.build(snap)

    def ranked(sources: tuple[str, ...]) -> list[str]:
        q = relevance.Query(
            text="", vector=query, limit=3, min_score=0.5, min_lexical_score=1.0, sources=sources
        )
        return [snap.chunks[label].source_path for label, _ in relevance.rank(searcher, q)]

    assert ranked(("docs",)) == ["billing.md"]
    assert ranked(("other",)) == []


def test_an_empty_base_with_summaries_is_searched_without_touching_hnswlib(tmp_path: Path) -> None:
    """hnswlib never loads an empty summary index, and a query on an index it never loaded
    crashes the process: an empty base (every page skipped) answers nothing instead."""
    embedder = HashEmbedder(8)
    write_snapshot(
        tmp_path / "v1",
        knowledge_base="kb",
        version="v1",
        embedder=embedder.info,
        chunks=[],
        vectors=np.zeros((0, 8), dtype=np.float32),
        pages={},
        page_count=0,
        hnsw_m=8,
        hnsw_ef_construction=50,
        target_recall=0.9,
        more_files=summary_writer([], np.zeros((0, 8), dtype=np.float32), 8, 50),
    )
    snapshot = load_snapshot(tmp_path / "v1", embedder.info)
    assert snapshot.summaries is not None
    (vector,) = embedder.embed_batch(["anything"])
    assert snapshot.summaries.search(vector, 3) == []
    assert snapshot.summaries.scores(vector, []) == {}
    ranked = relevance.rank(
        Searcher.build(snapshot),
        relevance.Query(
            text="anything", vector=vector, limit=3, min_score=0.0, min_lexical_score=0.0
        ),
    )
    assert ranked == []
