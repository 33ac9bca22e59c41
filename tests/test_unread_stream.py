"""A Converse stream whose client sends and never reads its answers: once gRPC's flow-control
window is full the server cannot write the next answer; it must not wait on it (and hold its
session's turn) for ever, nor give its slot back while gRPC still holds its answers. A real sidecar on port 0 answering chunks of 32 KiB each, so that
a few dozen answers fill the window."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import grpc

from index.embedders.base import Embedder
from sidecar.gen import retrieval_pb2 as pb
from sidecar.gen import retrieval_pb2_grpc as pb_grpc
from tests.conftest import LIVENESS_S, eventually
from tests.test_large_pages import serving

QUESTION = "How do I reset my password?"
TURNS = 200  # ~200 KB an answer (3 chunks and 3 of context, 32 KiB each): far past the window


async def _read_to_the_end(stream: Any) -> tuple[int, grpc.aio.AioRpcError]:
    """How many answers a stream gave before it ended with an error, and the error."""
    answers = 0
    while True:
        try:
            await asyncio.wait_for(stream.read(), LIVENESS_S)
        except grpc.aio.AioRpcError as exc:
            return answers, exc
        answers += 1


async def test_a_stream_that_never_reads_its_answers_ends_and_keeps_its_slot_till_read(
    tmp_path: Path, local_embedder: Embedder
) -> None:
    """The handler ends (DEADLINE_EXCEEDED) and answers no more turns, but gRPC holds the answers
    it wrote, unread: the stream keeps its slot (``lingering``) until its client reads them, so
    streams that never read are bounded by ``max_streams``, not only by memory."""
    written = {"chunk_pad": 5000}  # each chunk's text cut to 32 KiB as read
    async with serving(tmp_path, local_embedder, written, stream_idle_s=1.0) as sc:
        assert sc.guards is not None
        limit = sc.guards.limit
        async with grpc.aio.insecure_channel(f"127.0.0.1:{sc.port}") as channel:
            stub = pb_grpc.RetrievalStub(channel)  # type: ignore[no-untyped-call]
            stream = stub.Converse()
            turn = pb.TurnRequest(session_id="unread", text=QUESTION, is_final=True)
            for _ in range(TURNS):  # sent, never read
                await stream.write(pb.ConverseRequest(turn=turn))
            await eventually(lambda: limit.lingering == 1, "the unread stream's handler ends")
            assert limit.streams.in_flight == 1  # its answers are still held for it
            answers, ended = await _read_to_the_end(stream)  # read at last
            await eventually(lambda: limit.streams.in_flight == 0, "its slot, once read")
            assert limit.lingering == 0
            assert 0 < answers < TURNS
            assert ended.code() is grpc.StatusCode.DEADLINE_EXCEEDED
            assert "answers were not read" in (ended.details() or "")
            # the session goes on, on a new stream that reads
            again = stub.Converse()
            await again.write(pb.ConverseRequest(turn=turn))
            await again.done_writing()
            assert (await again.read()).turn.chunks
            assert await again.code() is grpc.StatusCode.OK
