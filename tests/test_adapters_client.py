"""The adapters' shared async client: Converse per call, the Turn fallback, the context message."""

from __future__ import annotations

import asyncio
import socket
from collections.abc import AsyncIterator, Iterator
from typing import Any

import grpc
import orjson
import pytest

from sidecar.adapters.client import (
    KNOWLEDGE_HEADER,
    MAX_KNOWLEDGE_CHARS,
    MAX_KNOWLEDGE_CHUNKS,
    Voxrecall,
    call_tool,
    is_knowledge,
    knowledge_text,
)
from sidecar.gen import retrieval_pb2 as pb
from sidecar.gen import retrieval_pb2_grpc as pb_grpc
from tests.adapters import ROAMING, VOICEMAIL, knowledge_sidecar_fixture  # noqa: F401
from tests.conftest import LIVENESS_S, eventually


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


def test_knowledge_text_is_bounded_whatever_the_answer_holds() -> None:
    # an answer of 400,000 chunks held the event loop 0.5 s and made 6.7 MB of context
    many = knowledge_text([chunk(i) for i in range(1000)])
    assert many.count("(help:p") == MAX_KNOWLEDGE_CHUNKS
    huge = pb.Chunk(source="help", source_path="big.md", title="Big", text="x" * 100_000)
    assert knowledge_text([chunk(1), huge, chunk(2)]).count("(help:") == 1  # left out whole
    assert knowledge_text([huge]) == ""
    assert len(many) <= MAX_KNOWLEDGE_CHARS


SERVICE = "voxrecall.v1.Retrieval"


class Hostile:
    """A sidecar that answers what no sidecar should: a Turn and an InvokeTool that are not
    their messages, a Converse that answers finals never sent (or breaks late); it notes the
    time each Turn had left."""

    def __init__(self, converse: str) -> None:
        self.converse = converse
        self.turn_time_left: list[float] = []

    async def turn(self, request: pb.TurnRequest, context: Any) -> bytes:
        self.turn_time_left.append(context.time_remaining())
        return b"not a protobuf"

    async def invoke(self, request: pb.InvokeToolRequest, context: Any) -> bytes:
        return b"not a protobuf"

    async def stream(self, requests: AsyncIterator[pb.ConverseRequest], context: Any) -> Any:
        if self.converse == "unasked":
            for i in range(100_000):  # answers for nothing, as fast as they go
                yield pb.ConverseResponse(transcript=f"never said {i}")
        elif self.converse == "breaks-late":
            async for _ in requests:
                await asyncio.sleep(0.5)
                await context.abort(grpc.StatusCode.INTERNAL, "broke late")

    def handlers(self) -> grpc.GenericRpcHandler:
        return grpc.method_handlers_generic_handler(SERVICE, {
            "Turn": grpc.unary_unary_rpc_method_handler(
                self.turn, request_deserializer=pb.TurnRequest.FromString,
                response_serializer=lambda raw: raw),
            "InvokeTool": grpc.unary_unary_rpc_method_handler(
                self.invoke, request_deserializer=pb.InvokeToolRequest.FromString,
                response_serializer=lambda raw: raw),
            "Converse": grpc.stream_stream_rpc_method_handler(
                self.stream, request_deserializer=pb.ConverseRequest.FromString,
                response_serializer=pb.ConverseResponse.SerializeToString),
        })  # fmt: skip


@pytest.fixture
async def hostile() -> AsyncIterator[tuple[Hostile, int]]:
    sidecar = Hostile("unasked")
    server = grpc.aio.server()
    server.add_generic_rpc_handlers((sidecar.handlers(),))
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        yield sidecar, port
    finally:
        await server.stop(0.5)


async def test_an_answer_that_cannot_be_read_is_a_failed_call(
    hostile: tuple[Hostile, int],
) -> None:
    # grpc.aio logs a response it cannot parse and hands over None: every adapter then failed
    # on an attribute of None (a Pipecat transcription dropped, a Realtime call never answered)
    _, port = hostile
    async with Voxrecall(f"127.0.0.1:{port}", turn_timeout_s=5, tool_timeout_s=5) as client:
        with pytest.raises(grpc.aio.AioRpcError) as failed:
            await client.turn("s", "how do I reset my password")
        tool = await call_tool(client, "knowledge_search", '{"query": "password"}')
    assert failed.value.code() == grpc.StatusCode.INTERNAL
    assert "the sidecar's Turn answer could not be read" in str(failed.value.details())
    assert tool.is_error  # the model reads an error output, as for any failed call
    assert orjson.loads(tool.output)["error"]["type"] == "unavailable"


async def test_answers_a_sidecar_sends_for_no_final_end_the_stream(
    hostile: tuple[Hostile, int],
) -> None:
    # they were queued without end: 89,000 in 10 s, 900 MB, while the caller paused
    _, port = hostile
    async with Voxrecall(f"127.0.0.1:{port}", turn_timeout_s=5) as client:
        stream = client.turn_stream("s")
        await stream.interim("how do I")
        assert stream._interim is not None
        await stream._interim  # the stream is open, and answering for nothing
        converse = stream._converse
        assert converse is not None
        with pytest.raises(asyncio.InvalidStateError, match="answered a final never sent"):
            async with asyncio.timeout(LIVENESS_S):
                await converse.answer()
        assert converse.answers.qsize() <= 1  # the error alone: no answer was kept
        await stream.aclose()


async def test_a_final_whose_stream_breaks_late_falls_back_within_its_own_deadline(
    hostile: tuple[Hostile, int],
) -> None:
    # the plain Turn sent instead got a whole turn_timeout_s of its own: twice the budget
    sidecar, port = hostile
    sidecar.converse = "breaks-late"
    async with Voxrecall(f"127.0.0.1:{port}", turn_timeout_s=3) as client:
        stream = client.turn_stream("s")
        with pytest.raises(grpc.aio.AioRpcError):  # the Turn's answer cannot be read either
            await stream.final("how do I reset my password")
    (left,) = sidecar.turn_time_left
    assert left < 2.6  # at least the 0.5 s the stream took is gone from the Turn's 3 s


@pytest.fixture
def silent_port() -> Iterator[int]:
    """A port that accepts connections and never speaks HTTP/2: a write to it waits."""
    listener = socket.create_server(("127.0.0.1", 0))
    try:
        yield listener.getsockname()[1]
    finally:
        listener.close()


async def test_an_interim_never_waits_to_go_out(silent_port: int) -> None:
    # a pipeline's frame waited on each interim's write (350 ms to 1 s a sidecar down): the
    # silent port holds the write, not the caller
    async with Voxrecall(f"127.0.0.1:{silent_port}", turn_timeout_s=30) as client:
        stream = client.turn_stream("s")
        await stream.interim("how do I")
        sending = stream._interim
        assert sending is not None
        await eventually(  # its write has begun (the stream's reader and it), on the silent port
            lambda: stream._converse is not None and len(stream._converse._tasks) == 2
        )
        await stream.interim("how do I reset")
        await stream.interim("how do I reset my")
        assert not sending.done()  # still going out, and the caller went on
        assert stream._interim is sending  # one at a time
        assert stream._next_interim == "how do I reset my"  # the newest waits to follow
        await stream.aclose()
        await asyncio.wait({sending}, timeout=LIVENESS_S)
        assert sending.done()  # the closed stream's interims go with it


async def test_a_final_whose_stream_is_closed_under_it_is_not_cancelled(silent_port: int) -> None:
    # aclose() while a final's write waited cancelled the write, and its cancellation reached
    # the final's caller, which nothing had cancelled: the stream's end is a broken stream
    async with Voxrecall(f"127.0.0.1:{silent_port}", turn_timeout_s=1) as client:
        stream = client.turn_stream("s")
        waiting = asyncio.create_task(stream.final("how do I reset my password"))
        await eventually(  # its write is under way, on the silent port
            lambda: stream._converse is not None and stream._converse._owed == 1
        )
        await stream.aclose()
        with pytest.raises((grpc.aio.AioRpcError, TimeoutError)):  # its Turn's deadline
            await waiting
        assert not waiting.cancelled()


async def test_a_transcript_holding_a_lone_surrogate_is_answered(vr: Voxrecall) -> None:
    # protobuf raised UnicodeEncodeError into the pipeline (a Pipecat transcription dropped)
    stream = vr.turn_stream("client-surrogate")
    await stream.interim("how much does roaming \udce9")
    resp, _ = await stream.final("How much does roaming cost \udce9")
    await stream.aclose()
    assert resp.query.startswith("How much does roaming cost")
