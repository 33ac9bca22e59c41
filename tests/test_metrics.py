"""The Prometheus endpoint, scraped over HTTP from a real server, and faults it must show:
an embedder failing or hanging, the store unreachable, a snapshot refused."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import shutil
import socket
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from prometheus_client.parser import text_string_to_metric_families

from index.embedders.base import Embedder
from index.embedders.remote import OpenAIEmbedder
from index.http_store import HttpOptions, HttpStore
from index.store import LocalStore, new_version_id
from sidecar.edge import metrics
from sidecar.edge.server import Sidecar, create_server
from sidecar.gen import retrieval_pb2 as pb
from sidecar.gen import retrieval_pb2_grpc as pb_grpc
from tests.conftest import LIVENESS_S
from tests.hardening_kit import build_store, running, sidecar_config
from tests.openai_server import Behaviour, OpenAIServer
from tests.snapshot_kit import flip_a_byte, point_at
from tests.static_http import StaticServer

Samples = dict[tuple[str, frozenset[tuple[str, str]]], float]
QUESTION = "how do I reset my password"
OPENAI = {"provider": "openai", "base_url": "", "dimensions": 64}


def scrape(port: int) -> Samples:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as reply:
        text = reply.read().decode()
    return {
        (s.name, frozenset(s.labels.items())): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def value(samples: Samples, name: str, **labels: str) -> float:
    return samples.get((name, frozenset(labels.items())), 0.0)


async def scraped(sidecar: Sidecar) -> Samples:
    return await asyncio.to_thread(scrape, sidecar.metrics_port)


@pytest.fixture(scope="module")
def store(tmp_path_factory: pytest.TempPathFactory, local_embedder: Embedder) -> Path:
    return build_store(tmp_path_factory.mktemp("metrics"), local_embedder)


def _turn(text: str, **fields: object) -> pb.TurnRequest:
    return pb.TurnRequest(**{"session_id": "m1", "text": text, "is_final": True, **fields})  # type: ignore[arg-type]


async def test_calls_stages_skips_sessions_and_snapshots_are_counted(
    store: Path, local_embedder: Embedder
) -> None:
    config = sidecar_config(store, metrics_listen="127.0.0.1:0")
    async with (
        running(config, local_embedder) as sidecar,
        grpc.aio.insecure_channel(f"127.0.0.1:{sidecar.port}") as channel,
    ):
        assert sidecar.metrics_port > 0
        stub = pb_grpc.RetrievalStub(channel)  # type: ignore[no-untyped-call]
        searched = await stub.Turn(_turn(QUESTION))
        again = await stub.Turn(_turn(QUESTION, session_id="m2"))  # the same words: cached
        backchannel = await stub.Turn(_turn("yeah"))
        closing = await stub.Turn(_turn("thank you very much, bye"))
        await stub.Search(pb.SearchRequest(query="refund", knowledge_base="billing"))
        with pytest.raises(grpc.aio.AioRpcError):
            await stub.Search(pb.SearchRequest(query="x", limit=-1))
        with pytest.raises(grpc.aio.AioRpcError):
            await stub.Turn(_turn(QUESTION, knowledge_base="nope"))
        m = await scraped(sidecar)

    assert searched.chunks
    assert not searched.skipped
    assert again.chunks
    assert not again.skipped
    assert backchannel.skipped == pb.BACKCHANNEL
    assert closing.skipped == pb.CLOSING
    assert value(m, "voxrecall_rpcs_total", door="grpc", method="Turn", code="OK") == 4
    assert value(m, "voxrecall_rpcs_total", door="grpc", method="Search", code="OK") == 1
    assert (
        value(m, "voxrecall_rpcs_total", door="grpc", method="Search", code="INVALID_ARGUMENT") == 1
    )
    assert value(m, "voxrecall_rpcs_total", door="grpc", method="Turn", code="NOT_FOUND") == 1
    assert value(m, "voxrecall_refusals_total", reason="invalid_argument") == 1
    assert value(m, "voxrecall_refusals_total", reason="not_found") == 1
    assert value(m, "voxrecall_rpc_seconds_count", door="grpc", method="Turn") == 5
    # stages: embed and search for searched turns only, total for every answered turn
    assert value(m, "voxrecall_stage_seconds_count", rpc="Turn", stage="embed") == 2
    assert value(m, "voxrecall_stage_seconds_count", rpc="Turn", stage="total") == 4
    assert value(m, "voxrecall_stage_seconds_count", rpc="Search", stage="search") == 1
    assert value(m, "voxrecall_skips_total", reason="backchannel") == 1
    assert value(m, "voxrecall_skips_total", reason="closing") == 1
    assert value(m, "voxrecall_degraded_turns_total") == 0
    assert value(m, "voxrecall_query_embeddings_total", outcome="hit") >= 1
    assert value(m, "voxrecall_query_embeddings_total", outcome="miss") >= 2
    assert 0 < value(m, "voxrecall_query_cache_hit_ratio") < 1
    assert value(m, "voxrecall_sessions") == 2
    assert value(m, "voxrecall_session_bytes") == sidecar.engine.sessions.bytes > 0
    assert value(m, "voxrecall_state", state="serving") == 1
    assert value(m, "voxrecall_state", state="loading") == 0
    for kb in ("help", "billing"):
        version = LocalStore(store / "store").latest_dir(kb).name
        assert value(m, "voxrecall_snapshot_info", knowledge_base=kb, version=version) == 1
        assert value(m, "voxrecall_snapshot_age_seconds", knowledge_base=kb) > 0
        assert value(m, "voxrecall_snapshot_chunks", knowledge_base=kb) > 0
    assert value(m, "voxrecall_rpcs_in_flight") == 0
    assert value(m, "voxrecall_connections_closed_unread_total") == 0
    assert not any(QUESTION in str(key) for key in m)  # no query text in a label


async def test_searches_ahead_and_the_finals_that_took_them_are_counted(
    store: Path, local_embedder: Embedder
) -> None:
    config = sidecar_config(store, metrics_listen="127.0.0.1:0")
    async with (
        running(config, local_embedder) as sidecar,
        grpc.aio.insecure_channel(f"127.0.0.1:{sidecar.port}") as channel,
    ):
        call = pb_grpc.RetrievalStub(channel).Converse(timeout=60)  # type: ignore[no-untyped-call]
        rambling = pb.TurnRequest(session_id="p1", text=QUESTION * 25 + "?", is_final=False)
        await call.write(pb.ConverseRequest(turn=rambling))  # over 512 bytes: never ahead
        interim = pb.TurnRequest(session_id="p1", text=QUESTION + "?", is_final=False)
        await call.write(pb.ConverseRequest(turn=interim))  # a pause: searched ahead at once
        await call.write(pb.ConverseRequest(turn=_turn(QUESTION + "?", session_id="p1")))
        answered = await call.read()
        await call.write(pb.ConverseRequest(turn=_turn("and what about refunds", session_id="p1")))
        await call.read()  # a final nobody searched ahead
        await call.done_writing()
        m = await scraped(sidecar)

    assert answered.prefetched
    assert value(m, "voxrecall_prefetches_started_total") == 1
    assert value(m, "voxrecall_prefetched_turns_total") == 1
    assert value(m, "voxrecall_prefetches_deferred_total") == 0  # one interim: nothing held back
    assert value(m, "voxrecall_prefetches_too_long_total") == 1
    assert value(m, "voxrecall_query_embeddings_total", outcome="dropped") == 0


async def test_the_endpoint_stops_with_the_sidecar(store: Path, local_embedder: Embedder) -> None:
    async with running(sidecar_config(store, metrics_listen="127.0.0.1:0"), local_embedder) as sc:
        port = sc.metrics_port
        assert value(await asyncio.to_thread(scrape, port), "voxrecall_sessions") == 0
    with pytest.raises(urllib.error.URLError):
        await asyncio.to_thread(scrape, port)


async def test_connections_to_the_endpoint_past_its_cap_are_closed_unread(
    store: Path, local_embedder: Embedder
) -> None:
    """prometheus_client's server held a thread and a descriptor for every connection opened and
    left silent, for ever (741 in a minute): past METRICS_CONNECTIONS one is closed unread,
    while those within it wait for their requests; a scrape is served once one goes."""
    async with running(sidecar_config(store, metrics_listen="127.0.0.1:0"), local_embedder) as sc:
        port = sc.metrics_port
        within = [
            socket.create_connection(("127.0.0.1", port))
            for _ in range(metrics.METRICS_CONNECTIONS)
        ]
        past = [socket.create_connection(("127.0.0.1", port)) for _ in range(20)]
        try:
            for conn in past:  # closed unread: end of file
                conn.settimeout(LIVENESS_S)
                assert conn.recv(1) == b""
            for conn in within:  # open, their requests awaited
                conn.settimeout(0.2)
                with pytest.raises(TimeoutError):
                    conn.recv(1)
        finally:
            for conn in (*within, *past):
                conn.close()
        assert value(await scraped(sc), "voxrecall_sessions") == 0  # served again


async def test_a_silent_connection_to_the_endpoint_is_closed_at_its_timeout(
    store: Path, local_embedder: Embedder, monkeypatch: pytest.MonkeyPatch
) -> None:
    """... and one that sends nothing is let go after METRICS_TIMEOUT_S."""
    monkeypatch.setattr(metrics, "METRICS_TIMEOUT_S", 0.5)
    async with running(sidecar_config(store, metrics_listen="127.0.0.1:0"), local_embedder) as sc:
        conn = socket.create_connection(("127.0.0.1", sc.metrics_port))
        try:
            conn.settimeout(LIVENESS_S)
            with contextlib.suppress(ConnectionResetError):
                assert conn.recv(1) in (b"", b"H")  # closed (or wsgiref's 408 first)
        finally:
            conn.close()


# -- faults ------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def openai() -> Iterator[OpenAIServer]:
    server = OpenAIServer().start()
    yield server
    server.stop()


@pytest.fixture(scope="module")
def openai_store(tmp_path_factory: pytest.TempPathFactory, openai: OpenAIServer) -> Path:
    """The same pages embedded through the local OpenAI-compatible server."""
    root = tmp_path_factory.mktemp("metrics-openai")
    embedder_raw = {**OPENAI, "base_url": openai.base_url}
    embedder = OpenAIEmbedder(sidecar_config(root, embedder=embedder_raw).embedder)
    try:
        return build_store(root, embedder, provider=embedder_raw)
    finally:
        asyncio.run(embedder.aclose())


@pytest.mark.parametrize(
    ("behaviour", "outcome"),
    [(Behaviour(fail_status=500, fail_times=-1), "failed"), (Behaviour(hang=True), "late")],
    ids=["failing", "hanging"],
)
async def test_a_failing_or_hanging_embedder_degrades_turns_and_says_so(
    openai_store: Path,
    openai: OpenAIServer,
    behaviour: Behaviour,
    outcome: str,
    caplog: pytest.LogCaptureFixture,
) -> None:
    config = sidecar_config(
        openai_store, embedder={**OPENAI, "base_url": openai.base_url}, metrics_listen="127.0.0.1:0"
    )
    embedder = OpenAIEmbedder(config.embedder)
    openai.set(behaviour)
    try:
        async with (
            running(config, embedder) as sidecar,
            grpc.aio.insecure_channel(f"127.0.0.1:{sidecar.port}") as channel,
        ):
            stub = pb_grpc.RetrievalStub(channel)  # type: ignore[no-untyped-call]
            with caplog.at_level(logging.WARNING, logger="voxrecall"):
                resp = await stub.Turn(_turn("how do I reset the password", budget_ms=300))
            m = await scraped(sidecar)
    finally:
        openai.set(Behaviour())
        await embedder.aclose()
    assert resp.degraded
    assert resp.chunks
    assert value(m, "voxrecall_degraded_turns_total") == 1
    assert value(m, "voxrecall_query_embeddings_total", outcome=outcome) >= 1
    assert value(m, "voxrecall_rpcs_total", door="grpc", method="Turn", code="OK") == 1
    assert any("embedder" in r.getMessage() for r in caplog.records)


async def test_an_unreachable_store_keeps_the_served_snapshot_and_is_counted(
    store: Path, local_embedder: Embedder, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    static = StaticServer(store / "store").start()
    http = HttpStore(static.url, tmp_path / "cache", HttpOptions(timeout_s=2, attempts=1))
    config = sidecar_config(store, metrics_listen="127.0.0.1:0")
    sidecar = await create_server(config, embedder=local_embedder, poll=False, store=http)
    try:
        served = sidecar.holder.get("help")
        assert served is not None
        static.stop()
        with caplog.at_level(logging.WARNING, logger="voxrecall"):
            await sidecar.refresher.refresh()
        async with grpc.aio.insecure_channel(f"127.0.0.1:{sidecar.port}") as channel:
            resp = await pb_grpc.RetrievalStub(channel).Turn(_turn(QUESTION))  # type: ignore[no-untyped-call]
        m = await scraped(sidecar)
    finally:
        await sidecar.stop(0.5)
    assert resp.chunks
    assert resp.snapshot_version == served.version
    assert value(m, "voxrecall_snapshot_refusals_total", kind="unavailable") >= 1
    assert value(m, "voxrecall_snapshot_info", knowledge_base="help", version=served.version) == 1
    assert value(m, "voxrecall_state", state="serving") == 1
    assert any(r.levelno >= logging.WARNING for r in caplog.records)


async def test_a_refused_snapshot_keeps_the_served_one_and_is_counted(
    store: Path, local_embedder: Embedder, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    root = tmp_path / "store"
    shutil.copytree(store / "store", root)
    config = sidecar_config(store, metrics_listen="127.0.0.1:0", store=str(root))
    async with running(config, local_embedder) as sidecar:
        served = LocalStore(root).latest_dir("help")
        bad = new_version_id("badbadba", now=time.time() + 60)
        shutil.copytree(served, root / "help" / bad)
        flip_a_byte(root / "help" / bad)
        point_at(root, bad, kb="help")
        with caplog.at_level(logging.WARNING, logger="voxrecall"):
            await sidecar.refresher.refresh()
        async with grpc.aio.insecure_channel(f"127.0.0.1:{sidecar.port}") as channel:
            stub = pb_grpc.RetrievalStub(channel)  # type: ignore[no-untyped-call]
            resp = await stub.Turn(_turn(QUESTION))
            status = await stub.Status(pb.StatusRequest())
        m = await scraped(sidecar)
    assert resp.chunks
    assert resp.snapshot_version == served.name
    assert value(m, "voxrecall_snapshot_refusals_total", kind="corrupt") == 1
    assert value(m, "voxrecall_snapshot_info", knowledge_base="help", version=served.name) == 1
    help_status = next(kb for kb in status.knowledge_bases if kb.name == "help")
    assert bad in help_status.last_refusal
    assert any(bad in r.getMessage() for r in caplog.records)


def test_a_hot_path_histogram_has_no_labelled_child_to_count_into_unexported() -> None:
    """Its observations are folded from the tallies; a child made by ``labels`` was counted and
    never exported, so asking for one is an error, not a silent loss."""
    from sidecar.edge.metrics import Histogram

    hist = Histogram("voxrecall_test_seconds", "test", ("method",), (0.1, 1.0))
    with pytest.raises(TypeError, match="Tally"):
        hist.labels("Search")
