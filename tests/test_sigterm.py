"""SIGTERM against a real ``voxrecall serve`` process: health goes NOT_SERVING, new calls are
refused, the call in flight finishes within the grace period, and the process exits 0.

The embedder is the local OpenAI-compatible server, told to answer slowly, so a turn is surely
in flight when the signal lands (the test waits until the embedding request has arrived).
"""

from __future__ import annotations

import asyncio
import json
import os
import resource
import shutil
import signal
import time
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import grpc
import httpx2
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from bench.measure import free_port
from bench.ours import OWN_CONNECTION
from index.embedders.remote import OpenAIEmbedder
from index.snapshot import MANIFEST, VECTORS
from index.store import new_version_id
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
from tests.snapshot_kit import point_at
from tests.static_http import StaticServer

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


Start = Callable[..., ServeProcess]


@pytest.fixture
def serve(tmp_path: Path, openai: OpenAIServer) -> Iterator[Start]:
    """Starts ``voxrecall serve`` with a grace period over a store built through ``openai``."""
    provider = {"provider": "openai", "base_url": openai.base_url, "dimensions": 64}
    embedder = OpenAIEmbedder(sidecar_config(tmp_path, embedder=provider).embedder)
    build_store(tmp_path, embedder, provider)
    asyncio.run(embedder.aclose())
    started: list[ServeProcess] = []

    def start(grace_s: float, *, listen: str = "127.0.0.1:0", **sidecar: Any) -> ServeProcess:
        config = tmp_path / "voxrecall.toml"
        config.write_text(
            toml_config(
                tmp_path,
                embedder=provider,
                **{"grace_s": grace_s, "log_format": "json", "poll_seconds": 3600, **sidecar},
            ),
            encoding="utf-8",
        )
        env = {"PATH": os.environ.get("PATH", ""), "OPENAI_API_KEY": "unused-by-the-test-server"}
        started.append(ServeProcess(config, env, "--listen", listen))
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


async def _serving(process: ServeProcess, workers: int) -> str:
    """The address to call once each of ``process``'s ``workers`` logs its start line, which it
    writes once its snapshots are loaded: "listening on port N (SERVING)". A channel opened then
    connects at once. A health Check with wait_for_ready, sent before any worker had bound the
    port, waited out gRPC's reconnect backoff instead (1 s, growing 1.6 times a try): on a loaded
    machine workers serving at 35 s were reached at 45 s, and a start of 45 s not before the
    Check's 60 s deadline."""
    found = await asyncio.to_thread(
        process.wait_for, r"listening on port (\d+) \(SERVING\)", workers
    )
    return f"127.0.0.1:{found.group(1)}"


async def _check_serving(channel: grpc.aio.Channel) -> None:
    health = health_pb2_grpc.HealthStub(channel)
    assert (await health.Check(health_pb2.HealthCheckRequest(), timeout=10)).status == SERVING


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
        assert (
            cut.value.code() is grpc.StatusCode.UNAVAILABLE
        )  # retried elsewhere; CANCELLED is not
        assert "grace_s" in (cut.value.details() or "")
        # a pushback of -1: a retry policy does not try it again on this closing sidecar
        trailers = dict(cut.value.trailing_metadata() or ())
        assert trailers.get("grpc-retry-pushback-ms") == "-1", trailers
    code = await asyncio.to_thread(process.proc.wait, PROCESS_WAIT_S)
    assert code == 0, process.log()
    assert any("Turn UNAVAILABLE" in line for line in process.lines), process.log()
    assert any("grace period over: 1 call(s)" in line for line in process.lines), process.log()


async def test_sigint_stops_an_idle_sidecar_with_exit_zero(serve: Start) -> None:
    process = serve(1)
    await _target(process)
    said = await asyncio.to_thread(process.wait_for, r"listening on .*, up to (\d+) open files")
    assert int(said.group(1)) == resource.prlimit(process.proc.pid, resource.RLIMIT_NOFILE)[0]
    process.proc.send_signal(signal.SIGINT)
    assert await asyncio.to_thread(process.proc.wait, PROCESS_WAIT_S) == 0


IN_FLIGHT = 8  # the adversarial run's count: 6 of them ended CANCELLED, 2 UNAVAILABLE
GRACE_S = 6  # longer than a turn here (1.5 s in the embedder), shorter than the client's wait


def _turn(i: int) -> pb.TurnRequest:
    """A different question per call: no call joins another's embedding or hits the cache."""
    return pb.TurnRequest(
        session_id=f"s{i}", text=f"how do I reset my password on device {i}", is_final=True,
        budget_ms=9000,
    )  # fmt: skip


@pytest.mark.parametrize("workers", [1, 2])
async def test_sigterm_under_load_every_call_in_flight_finishes_and_new_ones_are_unavailable(
    workers: int, serve: Start, openai: OpenAIServer
) -> None:
    """Issue 14 (11): IN_FLIGHT turns, each on its own connection (so with 2 workers the kernel
    spreads them), are all inside the slow embedder when SIGTERM lands: every one answers OK;
    a call started after the signal is UNAVAILABLE; none ends CANCELLED."""
    port = free_port() if workers > 1 else 0
    process = serve(30, workers=workers, listen=f"127.0.0.1:{port}")
    target = await _serving(process, workers)
    # own connections: a process's channels otherwise share one, which reaches one worker
    channels = [grpc.aio.insecure_channel(target, options=OWN_CONNECTION) for _ in range(IN_FLIGHT)]
    try:
        for channel in channels:
            await _check_serving(channel)
        openai.set(Behaviour(latency="1500"))
        before = openai.requests
        calls = [
            asyncio.ensure_future(stub_for(ch).Turn(_turn(i), timeout=PROCESS_WAIT_S))
            for i, ch in enumerate(channels)
        ]
        await _wait_for(lambda: openai.requests - before >= IN_FLIGHT, "every call's embedding")
        process.proc.send_signal(signal.SIGTERM)
        # every worker draining: the late call's connection may reach either
        await asyncio.to_thread(process.wait_for, "draining", workers)
        async with grpc.aio.insecure_channel(target) as fresh:
            with pytest.raises(grpc.aio.AioRpcError) as late:
                await stub_for(fresh).Turn(_turn(99), timeout=10)
        outcomes = Counter()
        for call in calls:
            try:
                answer = await call
                outcomes["OK" if answer.chunks and not answer.degraded else "degraded"] += 1
            except grpc.aio.AioRpcError as exc:
                outcomes[exc.code().name] += 1
    finally:
        for channel in channels:
            await channel.close()
    assert outcomes == {"OK": IN_FLIGHT}, process.log()
    assert late.value.code() is grpc.StatusCode.UNAVAILABLE
    assert await asyncio.to_thread(process.proc.wait, PROCESS_WAIT_S) == 0, process.log()


async def _converse_outcome(call: Any) -> tuple[str, str]:
    """(what the turn in flight got, how the stream then ended)."""
    try:
        answer = await call.read()
        turn = "OK" if answer.turn.chunks and not answer.turn.degraded else "degraded"
    except grpc.aio.AioRpcError as exc:
        return exc.code().name, exc.code().name
    try:
        await call.read()
    except grpc.aio.AioRpcError as exc:
        return turn, exc.code().name
    return turn, "open"


@pytest.mark.parametrize("workers", [1, 2])
async def test_sigterm_answers_the_turns_in_flight_on_converse_streams_then_ends_them_unavailable(
    workers: int, serve: Start, openai: OpenAIServer
) -> None:
    """A voice agent's calls are Converse streams, open between turns: they ended CANCELLED
    when the grace period ran out. Now a turn in flight at SIGTERM is answered (the stream goes
    on during the grace period), and at its end every stream, busy or idle, ends UNAVAILABLE,
    which a client retries on another instance."""
    port = free_port() if workers > 1 else 0
    process = serve(GRACE_S, workers=workers, listen=f"127.0.0.1:{port}")
    target = await _serving(process, workers)
    channels = [
        grpc.aio.insecure_channel(target, options=OWN_CONNECTION) for _ in range(IN_FLIGHT + 1)
    ]
    try:
        for channel in channels:
            await _check_serving(channel)
        idle = stub_for(channels[-1]).Converse(timeout=PROCESS_WAIT_S)
        await idle.write(pb.ConverseRequest(turn=_turn(100)))
        assert (await idle.read()).turn.chunks  # open, answered, now between turns
        openai.set(Behaviour(latency="1500"))
        before = openai.requests
        streams = [stub_for(ch).Converse(timeout=PROCESS_WAIT_S) for ch in channels[:-1]]
        for i, stream in enumerate(streams):
            await stream.write(pb.ConverseRequest(turn=_turn(i)))
        await _wait_for(lambda: openai.requests - before >= IN_FLIGHT, "every turn's embedding")
        process.proc.send_signal(signal.SIGTERM)
        outcomes = Counter(await asyncio.gather(*(_converse_outcome(s) for s in streams)))
        with pytest.raises(grpc.aio.AioRpcError) as idle_end:
            await idle.read()
    finally:
        for channel in channels:
            await channel.close()
    assert outcomes == {("OK", "UNAVAILABLE"): IN_FLIGHT}, process.log()
    assert idle_end.value.code() is grpc.StatusCode.UNAVAILABLE
    assert await asyncio.to_thread(process.proc.wait, PROCESS_WAIT_S) == 0, process.log()


def _republish(store: Path, kb: str) -> str:
    """The current version of ``kb`` published again under a new id (what a rebuild does)."""
    current = (store / kb / "LATEST").read_text().strip()
    version = new_version_id("feedbeef")
    shutil.copytree(store / kb / current, store / kb / version)
    manifest = json.loads((store / kb / version / MANIFEST).read_text())
    manifest["version"] = version
    (store / kb / version / MANIFEST).write_text(json.dumps(manifest))
    point_at(store, version, kb)
    return version


@pytest.mark.parametrize("when", ["while_serving", "at_start"])
async def test_sigterm_cuts_a_download_from_a_trickling_store(
    when: str, serve: Start, tmp_path: Path
) -> None:
    """Issue 14 (10): a store that sends the headers and then nothing kept a refresh alive, and
    SIGTERM waited for it (78 s with grace_s 5). The drain now cuts the download: exit 0 well
    within the liveness bound, whatever the store does."""
    static = StaticServer(tmp_path / "store").start()
    try:
        settings = {"store": static.url, "cache_dir": str(tmp_path / "cache")}
        if when == "at_start":
            static.hostile, static.hostile_suffix = "trickle", f"/{VECTORS}"
            process = serve(5, http_timeout_s=3600, poll_seconds=0.2, **settings)
            await _wait_for(lambda: bool(static.requests(f"/{VECTORS}")), "the first download")
        else:
            process = serve(5, http_timeout_s=3600, poll_seconds=0.2, **settings)
            await _target(process)
            static.hostile, static.hostile_suffix = "trickle", f"/{VECTORS}"
            version = _republish(tmp_path / "store", "help")
            await _wait_for(
                lambda: bool(static.requests(f"/{version}/{VECTORS}")), "the new version's download"
            )
        process.proc.send_signal(signal.SIGTERM)
        code = await asyncio.to_thread(process.proc.wait, PROCESS_WAIT_S)
    finally:
        static.stop()
    assert code == 0, process.log()


async def test_sigterm_drains_the_http_door_too(serve: Start, openai: OpenAIServer) -> None:
    """A Vapi knowledge-base request in flight when SIGTERM lands finishes; a new HTTP call is
    refused 503 and /readyz says so; the process exits 0 (one drain stops both doors)."""
    port = free_port()
    process = serve(30, budget_ms=9000, http={"listen": f"127.0.0.1:{port}"})
    await _target(process)
    base = f"http://127.0.0.1:{port}"
    message = {"role": "user", "content": "how do I reset my password"}
    body = {
        "message": {"type": "knowledge-base-request", "messages": [message], "call": {"id": "c"}}
    }
    async with httpx2.AsyncClient(timeout=PROCESS_WAIT_S) as http:
        assert (await http.get(f"{base}/readyz")).status_code == 200
        openai.set(Behaviour(latency="1500"))
        before = openai.requests
        in_flight = asyncio.ensure_future(http.post(f"{base}/vapi/knowledge-base", json=body))
        await _wait_for(
            lambda: openai.requests > before or in_flight.done(), "the call's embedding request"
        )
        assert not in_flight.done(), (in_flight.result().text, process.log())
        process.proc.send_signal(signal.SIGTERM)
        await _wait_for(lambda: any("draining" in line for line in process.lines), "the drain")
        async with httpx2.AsyncClient(timeout=10) as fresh:
            refused = await fresh.post(f"{base}/vapi/knowledge-base", json=body)
            ready = await fresh.get(f"{base}/readyz")
        assert refused.status_code == 503
        assert refused.json()["error"]["code"] == "UNAVAILABLE"
        assert ready.status_code == 503
        answered = await in_flight
        assert answered.status_code == 200
        assert answered.json()["documents"][0]["content"].startswith("Reset your password")
    code = await asyncio.to_thread(process.proc.wait, PROCESS_WAIT_S)
    assert code == 0, process.log()
