"""A Converse stream whose client sends and never reads its answers: once gRPC's flow-control
window is full the server cannot write the next answer; it must not hold its stream slot (and
its session's turn) for ever. A real sidecar on port 0 answering chunks of 32 KiB each, so that
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


async def test_a_stream_that_never_reads_its_answers_ends_and_gives_its_slot_back(
    tmp_path: Path, local_embedder: Embedder
) -> None:
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
            await eventually(lambda: limit.streams.in_flight == 0, "the unread stream's slot")
            answers, ended = await _read_to_the_end(stream)  # read at last
            assert 0 < answers < TURNS
            assert ended.code() is grpc.StatusCode.DEADLINE_EXCEEDED
            assert "answers were not read" in (ended.details() or "")
            # the session goes on, on a new stream that reads
            again = stub.Converse()
            await again.write(pb.ConverseRequest(turn=turn))
            await again.done_writing()
            assert (await again.read()).turn.chunks
            assert await again.code() is grpc.StatusCode.OK
