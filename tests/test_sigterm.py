"""SIGTERM against a real ``voxrecall serve`` process: health goes NOT_SERVING, new calls are
refused, the call in flight finishes within the grace period, and the process exits 0.

The embedder is the local OpenAI-compatible server, told to answer slowly, so a turn is surely
in flight when the signal lands (the test waits until the embedding request has arrived).
"""

from __future__ import annotations

import asyncio
import os
import signal
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from index.embedders.remote import OpenAIEmbedder
from sidecar.gen import retrieval_pb2 as pb
from sidecar.gen import retrieval_pb2_grpc as pb_grpc
from tests.hardening_kit import (
    PROCESS_WAIT_S,
    ServeProcess,
    build_store,
    sidecar_config,
    toml_config,
)
from tests.openai_server import Behaviour, OpenAIServer

SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING
TURN = pb.TurnRequest(
    session_id="s", text="how do I reset my password", is_final=True, budget_ms=9000
)


def stub_for(channel: grpc.aio.Channel) -> pb_grpc.RetrievalStub:
    return pb_grpc.RetrievalStub(channel)  # type: ignore[no-untyped-call]


@pytest.fixture(scope="module")
def openai() -> Iterator[OpenAIServer]:
    server = OpenAIServer().start()
    yield server
    server.stop()


Start = Callable[[float], ServeProcess]


@pytest.fixture
def serve(tmp_path: Path, openai: OpenAIServer) -> Iterator[Start]:
    """Starts ``voxrecall serve`` with a grace period over a store built through ``openai``."""
    provider = {"provider": "openai", "base_url": openai.base_url, "dimensions": 64}
    embedder = OpenAIEmbedder(sidecar_config(tmp_path, embedder=provider).embedder)
    build_store(tmp_path, embedder, provider)
    asyncio.run(embedder.aclose())
    started: list[ServeProcess] = []

    def start(grace_s: float) -> ServeProcess:
        config = tmp_path / "voxrecall.toml"
        config.write_text(
            toml_config(
                tmp_path, embedder=provider, grace_s=grace_s, log_format="json", poll_seconds=3600
            ),
            encoding="utf-8",
        )
        env = {"PATH": os.environ.get("PATH", ""), "OPENAI_API_KEY": "unused-by-the-test-server"}
        started.append(ServeProcess(config, env, "--listen", "127.0.0.1:0"))
        return started[-1]

    yield start
    for process in started:
        process.stop()
    openai.set(Behaviour())


async def _target(process: ServeProcess) -> str:
    found = await asyncio.to_thread(process.wait_for, r"listening on port (\d+)")
    return f"127.0.0.1:{found.group(1)}"


async def _wait_for(condition: Callable[[], bool], what: str) -> None:
    deadline = time.monotonic() + PROCESS_WAIT_S
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.02)


async def test_sigterm_drains_the_call_in_flight_refuses_new_ones_and_exits_zero(
    serve: Start, openai: OpenAIServer
) -> None:
    process = serve(30)
    target = await _target(process)
    async with grpc.aio.insecure_channel(target) as channel:
        health = health_pb2_grpc.HealthStub(channel)
        assert (await health.Check(health_pb2.HealthCheckRequest(), timeout=10)).status == SERVING
        watch = health.Watch(health_pb2.HealthCheckRequest())
        assert (await watch.read()).status == SERVING

        openai.set(Behaviour(latency="1500"))
        before = openai.requests
        in_flight = stub_for(channel).Turn(TURN, timeout=PROCESS_WAIT_S)  # starts now
        await _wait_for(lambda: openai.requests > before, "the turn's embedding request")
        process.proc.send_signal(signal.SIGTERM)

        assert (await watch.read()).status == NOT_SERVING
        async with grpc.aio.insecure_channel(target) as fresh:
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                await stub_for(fresh).Turn(TURN, timeout=10)
        assert refused.value.code() is grpc.StatusCode.UNAVAILABLE

        answered = await in_flight
        assert answered.chunks
        assert not answered.degraded
        watch.cancel()
    code = await asyncio.to_thread(process.proc.wait, PROCESS_WAIT_S)
    assert code == 0, process.log()
    assert any("draining" in line for line in process.lines)


async def test_a_call_outliving_the_grace_period_is_cut_and_the_process_still_exits_zero(
    serve: Start, openai: OpenAIServer
) -> None:
    process = serve(0.5)
    target = await _target(process)
    async with grpc.aio.insecure_channel(target) as channel:
        health = health_pb2_grpc.HealthStub(channel)
        assert (await health.Check(health_pb2.HealthCheckRequest(), timeout=10)).status == SERVING
        openai.set(Behaviour(hang=True))
        before = openai.requests
        in_flight = stub_for(channel).Turn(TURN, timeout=PROCESS_WAIT_S)  # starts now
        await _wait_for(lambda: openai.requests > before, "the turn's embedding request")
        process.proc.send_signal(signal.SIGTERM)
        with pytest.raises(grpc.aio.AioRpcError) as cut:
            await in_flight
        assert cut.value.code() in (grpc.StatusCode.CANCELLED, grpc.StatusCode.UNAVAILABLE)
    code = await asyncio.to_thread(process.proc.wait, PROCESS_WAIT_S)
    assert code == 0, process.log()


async def test_sigint_stops_an_idle_sidecar_with_exit_zero(serve: Start) -> None:
    process = serve(1)
    await _target(process)
    process.proc.send_signal(signal.SIGINT)
    assert await asyncio.to_thread(process.proc.wait, PROCESS_WAIT_S) == 0
