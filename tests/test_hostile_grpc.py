"""The gRPC port against a hostile caller (an attack's findings): a context_url that is not a URL,
health watches without bound, reflection streams taking Converse's slots, idle connections
holding every file descriptor, and a store read without descriptors refused as corrupt. A real
sidecar on 127.0.0.1 port 0; no timing is asserted (waits are bounded, never measured)."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import grpc
import pytest

from index.embedders.base import Embedder
from sidecar.edge.server import Sidecar
from sidecar.gen import retrieval_pb2 as pb
from sidecar.gen import retrieval_pb2_grpc as pb_grpc
from tests.conftest import LIVENESS_S
from tests.hardening_kit import build_store, running, sidecar_config

QUESTION = "how do I reset my password"
NOT_A_URL = "http://["  # urlsplit: "Invalid IPv6 URL"
# HTTP/2's client preface and an empty SETTINGS frame: a connection that then says nothing
IDLE_S = 0.5
PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + b"\x00\x00\x00\x04\x00\x00\x00\x00\x00"


@pytest.fixture(scope="module")
def store(tmp_path_factory: pytest.TempPathFactory, local_embedder: Embedder) -> Path:
    return build_store(tmp_path_factory.mktemp("hostile-grpc"), local_embedder)


@pytest.fixture
async def sidecar(store: Path, local_embedder: Embedder) -> AsyncIterator[Sidecar]:
    async with running(sidecar_config(store, max_streams=2), local_embedder) as sc:
        yield sc


@pytest.fixture
async def channel(sidecar: Sidecar) -> AsyncIterator[grpc.aio.Channel]:
    async with grpc.aio.insecure_channel(f"127.0.0.1:{sidecar.port}") as ch:
        yield ch


def _turn(**fields: Any) -> pb.TurnRequest:
    return pb.TurnRequest(**{"session_id": "h", "text": QUESTION, "is_final": True, **fields})


async def _code(call: Any) -> grpc.StatusCode:
    """A call's status, waited for a bounded while (a call the old code never ended fails)."""
    code: grpc.StatusCode = await asyncio.wait_for(call.code(), LIVENESS_S)
    return code


# -- context_url -------------------------------------------------------------------------------


async def test_a_context_url_that_is_not_a_url_is_invalid_argument_on_turn_and_search(
    channel: grpc.aio.Channel,
) -> None:
    stub = pb_grpc.RetrievalStub(channel)  # type: ignore[no-untyped-call]
    calls = {
        "Turn": lambda: stub.Turn(_turn(context_url=NOT_A_URL)),
        "Search": lambda: stub.Search(pb.SearchRequest(query=QUESTION, context_url="https://[x/a")),
    }
    for name, call in calls.items():
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await call()
        assert refused.value.code() is grpc.StatusCode.INVALID_ARGUMENT, name
        assert "context_url is not a URL" in (refused.value.details() or ""), name
    # a path, as related_urls globs match it, is still a context_url
    assert (await stub.Turn(_turn(context_url="/settings/account"))).chunks


async def test_a_converse_stream_going_on_after_a_bad_context_url_ends_invalid_argument(
    channel: grpc.aio.Channel,
) -> None:
    stub = pb_grpc.RetrievalStub(channel)  # type: ignore[no-untyped-call]
    stream = stub.Converse()
    await stream.write(pb.ConverseRequest(turn=_turn(session_id="c", context_url=NOT_A_URL)))
    with contextlib.suppress(grpc.aio.AioRpcError):  # the refusal may come before this write
        await stream.write(pb.ConverseRequest(turn=_turn(session_id="c")))
    assert await _code(stream) is grpc.StatusCode.INVALID_ARGUMENT
    assert "context_url is not a URL" in (await stream.details() or "")
