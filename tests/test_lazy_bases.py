"""Many bases under a memory budget (issue 19, 2): each loads on its first call, the least recently
used go when the loaded bases' bytes would pass ``[sidecar] memory_budget_mb``, and the sidecar is
SERVING from the start. A call to a base that is loading gets UNAVAILABLE with a retry hint.

Real parts: a real sidecar on port 0, real snapshots of the real model's vectors in a local store.
The bases are small, with a page of padding each, so that a 10 MiB budget holds three of them.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import grpc
import httpx2
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from index.config import ConfigError
from index.embedders.base import Embedder
from sidecar.edge.server import Sidecar, create_server
from sidecar.gen import retrieval_pb2_grpc as pb_grpc
from sidecar.snapshots import refresh
from tests.bases_kit import LOAD_WAIT_S, answered, config, kb_name, search
from tests.snapshot_kit import TOPICS, version_id, write_version

BASES = 12
PAGE_BYTES = 300_000  # each base ~3 MiB with its chunk cache and hnswlib's fixed cost
BUDGET_MB = 10
FITS = 3


@pytest.fixture(scope="module")
def store(tmp_path_factory: pytest.TempPathFactory, local_embedder: Embedder) -> Path:
    root = tmp_path_factory.mktemp("lazy") / "store"
    topics = sorted(TOPICS)
    for i in range(BASES):
        write_version(
            root, version_id(1), local_embedder, topics[i % len(topics)], kb=kb_name(i),
            page_bytes=PAGE_BYTES,
        )  # fmt: skip
    return root


@contextlib.asynccontextmanager
async def serving(
    store: Path, tmp_path: Path, embedder: Embedder, **more: Any
) -> AsyncIterator[tuple[Sidecar, grpc.aio.Channel]]:
    sidecar = await create_server(
        config(store, tmp_path, memory_budget_mb=BUDGET_MB, **more), embedder=embedder, poll=False
    )
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{sidecar.port}") as channel:
            yield sidecar, channel
    finally:
        await sidecar.stop(0.5)


def loaded(sidecar: Sidecar) -> set[str]:
    """The bases the sidecar serves now (``get`` marks nothing used, unlike a call's ``use``)."""
    return {kb for kb in sidecar.engine.known_bases if sidecar.holder.get(kb) is not None}


async def test_bases_load_on_first_call_and_the_least_recently_used_go_within_the_budget(
    store: Path, tmp_path: Path, local_embedder: Embedder
) -> None:
    budget = BUDGET_MB * 2**20
    async with serving(store, tmp_path, local_embedder) as (sidecar, channel):
        health = health_pb2_grpc.HealthStub(channel)
        check = await health.Check(health_pb2.HealthCheckRequest())
        assert check.status == health_pb2.HealthCheckResponse.SERVING
        assert loaded(sidecar) == set()  # nothing loaded before its first call

        stub = pb_grpc.RetrievalStub(channel)  # type: ignore[no-untyped-call]
        with pytest.raises(grpc.aio.AioRpcError) as first:
            await stub.Search(search(kb_name(0)), timeout=LOAD_WAIT_S)
        assert first.value.code() is grpc.StatusCode.UNAVAILABLE
        assert "'kb00' is loading" in str(first.value.details())
        assert int(dict(first.value.trailing_metadata() or ())["grpc-retry-pushback-ms"]) > 0

        await answered(stub, kb_name(0))
        assert loaded(sidecar) == {kb_name(0)}
        size = sidecar.holder.loaded_bytes()
        assert budget // size == FITS  # what the assertions below rely on
        for _ in range(2):  # the second round finds every base evicted and loads it again
            for i in range(BASES):
                resp = await answered(stub, kb_name(i))
                assert resp.chunks
                assert {c.knowledge_base for c in resp.chunks} == {kb_name(i)}
                assert kb_name(i) in loaded(sidecar)
                assert sidecar.holder.loaded_bytes() <= budget
                assert len(loaded(sidecar)) <= FITS
                check = await health.Check(health_pb2.HealthCheckRequest())
                assert check.status == health_pb2.HealthCheckResponse.SERVING
        assert sidecar.holder.evictions == 2 * BASES - FITS


async def test_the_least_recently_used_base_goes_not_the_first_loaded(
    store: Path, tmp_path: Path, local_embedder: Embedder
) -> None:
    async with serving(store, tmp_path, local_embedder) as (sidecar, channel):
        stub = pb_grpc.RetrievalStub(channel)  # type: ignore[no-untyped-call]
        for i in range(FITS):
            await answered(stub, kb_name(i))
        assert loaded(sidecar) == {kb_name(i) for i in range(FITS)}
        await answered(stub, kb_name(0))  # kb00 used again: kb01 is now the least recent
        await answered(stub, kb_name(FITS))
        assert loaded(sidecar) == {kb_name(0), kb_name(2), kb_name(FITS)}


async def test_a_base_the_store_does_not_have_is_not_found_without_a_load(
    store: Path, tmp_path: Path, local_embedder: Embedder
) -> None:
    async with serving(store, tmp_path, local_embedder) as (sidecar, channel):
        stub = pb_grpc.RetrievalStub(channel)  # type: ignore[no-untyped-call]
        with pytest.raises(grpc.aio.AioRpcError) as missing:
            await stub.Search(search("nope"), timeout=LOAD_WAIT_S)
        assert missing.value.code() is grpc.StatusCode.NOT_FOUND
        assert sidecar.refresher.waiting == 0


async def test_a_base_over_the_budget_on_its_own_is_refused_once_naming_why(
    store: Path, tmp_path: Path, local_embedder: Embedder, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Attack F8: under a budget smaller than any one base, a base is refused once, the caller
    told its size and the budget; nothing is evicted, and calls to it (and to another such
    base) do not fetch it again and again. Attack s23: one whose files alone pass the budget
    is refused before it is loaded (a 174 MiB base under a 16 MiB budget took the process
    250 MB past its peak to load, then was refused)."""

    def unloadable(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError("a base over the budget by its files was loaded")

    monkeypatch.setattr(refresh, "load_snapshot", unloadable)
    sidecar = await create_server(
        config(store, tmp_path, memory_budget_mb=2), embedder=local_embedder, poll=False
    )
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{sidecar.port}") as channel:
            stub = pb_grpc.RetrievalStub(channel)  # type: ignore[no-untyped-call]
            for _ in range(2):
                for kb in (kb_name(0), kb_name(1)):
                    with pytest.raises(grpc.aio.AioRpcError) as refused:
                        await answered(stub, kb)
                    assert refused.value.code() is grpc.StatusCode.UNAVAILABLE
                    details = str(refused.value.details())
                    assert "over_budget" in details
                    assert "memory_budget_mb = 2 on its own" in details
            assert loaded(sidecar) == set()
            assert sidecar.holder.evictions == 0
            assert sidecar.holder.refusals == {"over_budget": 2}  # one load each, refused once
    finally:
        await sidecar.stop(0.5)


@pytest.mark.parametrize("value", [-1, 1.5, True, "64"])
def test_memory_budget_mb_is_a_whole_number(value: object, store: Path, tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="memory_budget_mb"):
        config(store, tmp_path, memory_budget_mb=value)


async def test_the_http_door_is_ready_before_any_base_loads_and_after_evictions(
    store: Path, tmp_path: Path, local_embedder: Embedder
) -> None:
    """/readyz says what gRPC health says: a lazy sidecar is ready from the start, and an evicted
    base does not make it unready (a readiness probe would pull the pod)."""
    http = {"http": {"listen": "127.0.0.1:0"}}
    async with (
        serving(store, tmp_path, local_embedder, **http) as (sidecar, channel),
        httpx2.AsyncClient() as client,
    ):
        readyz = f"http://127.0.0.1:{sidecar.http_port}/readyz"
        assert (await client.get(readyz)).json() == {"status": "ready", "state": "SERVING"}
        stub = pb_grpc.RetrievalStub(channel)  # type: ignore[no-untyped-call]
        for i in range(FITS + 1):
            await answered(stub, kb_name(i))
        assert sidecar.holder.evictions >= 1
        assert (await client.get(readyz)).status_code == 200


async def test_a_vapi_request_refused_while_its_base_loads_is_answered_when_retried(
    store: Path, tmp_path: Path, local_embedder: Embedder
) -> None:
    """The refused request's messages were not fed: the platform's retry feeds and answers them
    (it was answered as a repeat of nothing: no documents)."""
    http = {"http": {"listen": "127.0.0.1:0", "vapi_knowledge_base": kb_name(0)}}
    body = {
        "message": {
            "type": "knowledge-base-request",
            "messages": [{"role": "user", "content": "how do I reset my password"}],
            "call": {"id": "call-1"},
        }
    }
    async with (
        serving(store, tmp_path, local_embedder, **http) as (sidecar, channel),
        httpx2.AsyncClient() as client,
    ):
        vapi = f"http://127.0.0.1:{sidecar.http_port}/vapi/knowledge-base"
        first = await client.post(vapi, json=body)
        assert first.status_code == 503  # its base is loading
        await answered(pb_grpc.RetrievalStub(channel), kb_name(0))  # type: ignore[no-untyped-call]
        retried = await client.post(vapi, json=body)
        assert retried.status_code == 200
        assert retried.json()["documents"]
