"""The adapters' shared async client: Converse per call, the Turn fallback, the context message."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import grpc
import pytest

from sidecar.adapters.client import KNOWLEDGE_HEADER, Voxrecall, is_knowledge, knowledge_text
from sidecar.gen import retrieval_pb2 as pb
from sidecar.gen import retrieval_pb2_grpc as pb_grpc
from tests.adapters import ROAMING, VOICEMAIL, knowledge_sidecar_fixture  # noqa: F401


@pytest.fixture
async def vr(knowledge_sidecar: Any) -> AsyncIterator[Voxrecall]:
    async with Voxrecall(f"127.0.0.1:{knowledge_sidecar.port}", turn_timeout_s=10) as client:
        yield client


async def test_finals_are_answered_in_order_over_one_converse_stream(vr: Voxrecall) -> None:
    stream = vr.turn_stream("client-1")
    await stream.interim("How much does roaming")
    await stream.interim(ROAMING)
    first, _ = await stream.final(ROAMING)
    second, _ = await stream.final("okay")
    await stream.aclose()
    assert stream.streaming
    assert "roaming.md" in [c.source_path for c in first.chunks]
    assert first.query == ROAMING
    assert second.skipped == pb.BACKCHANNEL
    assert {c.chunk_id for c in first.chunks} <= {c.chunk_id for c in second.context}


async def test_a_final_cancelled_while_it_waits_leaves_the_stream_open(vr: Voxrecall) -> None:
    """A caller cancelled mid-turn (Pipecat cancels a frame on each interruption) loses that
    answer, not the call's stream: the next interim still prefetches, which only the stream
    does. grpc.aio cancels an RPC whose read or write is cancelled, so it used to."""
    stream = vr.turn_stream("client-3")
    await stream.interim("How much does roaming")
    waiting = asyncio.create_task(stream.final(ROAMING))
    await asyncio.sleep(0)  # it is in the stream's write or read now
    waiting.cancel()
    with pytest.raises(asyncio.CancelledError):
        await waiting
    await stream.interim(VOICEMAIL)
    resp, prefetched = await stream.final(VOICEMAIL)
    await stream.aclose()
    assert prefetched
    assert resp.query == VOICEMAIL
    assert "voicemail.md" in [c.source_path for c in resp.chunks]


class TurnOnly(pb_grpc.RetrievalServicer):  # type: ignore[misc]
    """A sidecar without Converse (an older one): every other RPC is UNIMPLEMENTED."""

    async def Turn(self, request: pb.TurnRequest, context: Any) -> pb.TurnResponse:
        return pb.TurnResponse(query=request.text)


async def test_without_converse_finals_go_through_turn() -> None:
    server = grpc.aio.server()
    pb_grpc.add_RetrievalServicer_to_server(TurnOnly(), server)  # type: ignore[no-untyped-call]
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        async with Voxrecall(f"127.0.0.1:{port}", turn_timeout_s=10) as client:
            stream = client.turn_stream("client-2")
            await stream.interim("how do I")
            resp, prefetched = await stream.final("how do I reset my password")
            again, _ = await stream.final("and my PIN")
    finally:
        await server.stop(0.5)
    assert not stream.streaming  # the sidecar said UNIMPLEMENTED once; no stream since
    assert (resp.query, prefetched) == ("how do I reset my password", False)
    assert again.query == "and my PIN"


def chunk(i: int) -> pb.Chunk:
    return pb.Chunk(
        source="help",
        source_path=f"p{i}.md",
        title=f"Page {i}",
        breadcrumbs=[f"Page {i}", "Section"],
        text=f"  text {i}\n",
    )


def test_knowledge_text_names_where_each_chunk_comes_from() -> None:
    text = knowledge_text([chunk(1), chunk(2)])
    assert text == (
        f"{KNOWLEDGE_HEADER}\n\n"
        "[1] Page 1 > Section (help:p1.md)\ntext 1\n\n"
        "[2] Page 2 > Section (help:p2.md)\ntext 2"
    )
    assert is_knowledge(text)
    assert knowledge_text([]) == ""
    assert not is_knowledge("You are a helpful agent.")
