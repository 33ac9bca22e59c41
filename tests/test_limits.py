"""Limits against a real server: calls in flight, message size, long text cut to the embedder's
input, deadlines only the caller's own; and the call's ids in the logs and the trailers."""

from __future__ import annotations

import asyncio
import io
import json
import logging
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import grpc
import httpx2
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from index.embedders.base import Embedder, FakeEmbedder
from index.errors import ConfigError
from sidecar.config import parse_config
from sidecar.edge import logs
from sidecar.edge.server import Sidecar
from sidecar.edge.service import RetrievalService
from sidecar.errors import InvalidArgument
from sidecar.gen import retrieval_pb2 as pb
from sidecar.gen import retrieval_pb2_grpc as pb_grpc
from sidecar.turn.engine import MAX_TEXT_BYTES, SearchInput
from tests.conftest import eventually
from tests.hardening_kit import TOKEN_A, bearer, build_store, running, sidecar_config

WAIT_S = 30.0  # a bound on waiting for the server to notice a closed stream, not a timing
QUESTION = "how do I reset my password"
FORGED = 'x", "level": "ERROR' + "-" * 80  # quotes, spaces, too long


@pytest.fixture(scope="module")
def store(tmp_path_factory: pytest.TempPathFactory, local_embedder: Embedder) -> Path:
    return build_store(tmp_path_factory.mktemp("limits"), local_embedder)


@pytest.fixture
async def sidecar(store: Path, local_embedder: Embedder) -> AsyncIterator[Sidecar]:
    config = sidecar_config(
        store, max_concurrent_rpcs=2, max_streams=2, max_message_bytes=64 * 1024
    )
    async with running(config, local_embedder) as sc:
        yield sc


def _turn(text: str = QUESTION, **fields: object) -> pb.TurnRequest:
    return pb.TurnRequest(**{"session_id": "l", "text": text, "is_final": True, **fields})  # type: ignore[arg-type]


async def test_over_the_concurrency_limit_a_call_is_refused_and_health_still_answers(
    sidecar: Sidecar,
) -> None:
    """Streams and unary calls are counted apart: with every stream held, a third stream is
    refused and a Turn still answers."""
    async with grpc.aio.insecure_channel(f"127.0.0.1:{sidecar.port}") as channel:
        stub = pb_grpc.RetrievalStub(channel)  # type: ignore[no-untyped-call]
        streams = [stub.Converse() for _ in range(2)]  # an open stream holds its slot
        for i, stream in enumerate(streams):
            await stream.write(pb.ConverseRequest(turn=_turn(session_id=f"c{i}")))
            assert (await stream.read()).turn.chunks  # surely in flight now
        # the refused stream is read for its status, not written to: the refusal may come
        # before a write would return, and then the write raises instead
        third = stub.Converse()
        assert await third.code() is grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "max_streams" in (await third.details() or "")
        health = health_pb2_grpc.HealthStub(channel)
        reply = await health.Check(health_pb2.HealthCheckRequest())
        assert reply.status == health_pb2.HealthCheckResponse.SERVING
        assert (await stub.Turn(_turn())).chunks  # unary calls have slots of their own

        await streams[0].done_writing()
        assert await streams[0].code() is grpc.StatusCode.OK
        deadline = time.monotonic() + WAIT_S
        while sidecar.guards is not None and sidecar.guards.limit.in_flight > 1:
            assert time.monotonic() < deadline
            await asyncio.sleep(0.02)
        again = stub.Converse()  # a stream slot is free again
        await again.write(pb.ConverseRequest(turn=_turn(session_id="c4")))
        assert (await again.read()).turn.chunks
        for stream in (streams[1], again):
            await stream.done_writing()
            assert await stream.code() is grpc.StatusCode.OK
    assert sidecar.guards is not None
    assert sidecar.guards.limit.refused == 1


async def test_a_message_over_max_message_bytes_is_refused(sidecar: Sidecar) -> None:
    async with grpc.aio.insecure_channel(f"127.0.0.1:{sidecar.port}") as channel:
        stub = pb_grpc.RetrievalStub(channel)  # type: ignore[no-untyped-call]
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await stub.Turn(_turn("word " * 20_000))  # 100 KB > 64 KiB
        assert info.value.code() is grpc.StatusCode.RESOURCE_EXHAUSTED
        assert (await stub.Turn(_turn())).chunks  # and the server carries on


async def test_long_text_is_cut_to_the_embedders_input_and_the_answer_says_so(
    sidecar: Sidecar,
) -> None:
    long_text = QUESTION + " " + "please tell me more about it " * 80  # ~2400 chars, > 256 tokens
    async with grpc.aio.insecure_channel(f"127.0.0.1:{sidecar.port}") as channel:
        stub = pb_grpc.RetrievalStub(channel)  # type: ignore[no-untyped-call]
        cut = await stub.Turn(_turn(long_text, budget_ms=5000))  # room to embed it all
        whole = await stub.Turn(_turn())
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await stub.Turn(_turn("x" * (MAX_TEXT_BYTES + 1)))
    assert cut.truncated
    assert cut.chunks
    assert not cut.degraded
    assert not whole.truncated
    assert info.value.code() is grpc.StatusCode.INVALID_ARGUMENT
    assert f"limit is {MAX_TEXT_BYTES}" in (info.value.details() or "")


async def test_a_text_limit_is_in_bytes_and_names_the_field_sent(sidecar: Sidecar) -> None:
    """One unit for every text limit, bytes: 5,000 two-byte characters (10,000 bytes) are within
    it (they were refused as over 4000 characters), and Search's error names query, not text."""
    async with grpc.aio.insecure_channel(f"127.0.0.1:{sidecar.port}") as channel:
        stub = pb_grpc.RetrievalStub(channel)  # type: ignore[no-untyped-call]
        within = await stub.Search(pb.SearchRequest(query="é" * 5000, min_score=-1))
        turn = await stub.Turn(_turn("é" * 5000))
    assert within.chunks
    assert turn.snapshot_version  # answered, not refused
    over = "é" * (MAX_TEXT_BYTES // 2) + "x"  # past the engine's own check, the edge's aside
    with pytest.raises(InvalidArgument) as info:
        await sidecar.engine.search(SearchInput(query=over))
    assert str(info.value) == f"query is {MAX_TEXT_BYTES + 1} bytes; the limit is {MAX_TEXT_BYTES}"


async def test_deadline_exceeded_only_when_the_callers_own_deadline_passed(
    tmp_path: Path,
) -> None:
    """A model that never answers (with the real one, a process descheduled past a 1 ms budget
    could still find its vector there when it next ran, and rightly use it)."""
    store = build_store(tmp_path, FakeEmbedder(dimension=32))
    config = sidecar_config(store, max_concurrent_rpcs=2, max_streams=2)
    async with (
        running(config, FakeEmbedder(dimension=32, hang=True)) as sidecar,
        grpc.aio.insecure_channel(f"127.0.0.1:{sidecar.port}") as channel,
    ):
        stub = pb_grpc.RetrievalStub(channel)  # type: ignore[no-untyped-call]
        tight = await stub.Turn(_turn("how do I export my data", budget_ms=1), timeout=30)
        waiting = stub.Converse(timeout=0.2)  # the server waits on the caller's first turn
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await waiting.read()
    # a budget the server cannot meet is answered (lexically), not failed
    assert tight.degraded
    assert tight.chunks
    assert info.value.code() is grpc.StatusCode.DEADLINE_EXCEEDED


async def test_each_call_has_an_id_in_its_trailers_and_its_log_lines(
    sidecar: Sidecar, json_log: io.StringIO
) -> None:
    async with grpc.aio.insecure_channel(f"127.0.0.1:{sidecar.port}") as channel:
        stub = pb_grpc.RetrievalStub(channel)  # type: ignore[no-untyped-call]
        call = stub.Turn(_turn(knowledge_base="nope", session_id="sess-42"),
                         metadata=(("x-call-id", "agent-call-7"),))  # fmt: skip
        with pytest.raises(grpc.aio.AioRpcError):
            await call
        own = stub.Turn(_turn(session_id="sess-43"))
        await own
        trailers = dict(await own.trailing_metadata() or ())
        forged = stub.Turn(_turn(), metadata=(("x-call-id", FORGED),))
        await forged
        forged_id = dict(await forged.trailing_metadata() or ())["x-call-id"]
    assert len(trailers["x-call-id"]) == 16  # generated
    assert forged_id != FORGED
    assert len(forged_id) == 16
    lines = [json.loads(line) for line in json_log.getvalue().splitlines()]
    failed = [x for x in lines if x.get("call_id") == "agent-call-7"]
    assert failed
    assert failed[-1]["session_id"] == "sess-42"
    assert failed[-1]["method"] == "Turn"
    assert "NOT_FOUND" in failed[-1]["msg"]
    assert any(x.get("call_id") == trailers["x-call-id"] for x in lines)


@pytest.fixture
def json_log() -> Iterator[io.StringIO]:
    stream = io.StringIO()
    root = logging.getLogger()
    saved = root.level, list(root.handlers)
    logs.configure("DEBUG", "json", stream=stream)
    yield stream
    root.setLevel(saved[0])
    root.handlers[:] = saved[1]


def test_log_lines_outside_a_call_carry_no_ids_and_the_level_filters() -> None:
    stream = io.StringIO()
    root = logging.getLogger()
    saved = root.level, list(root.handlers)
    logs.configure("WARNING", "json", stream=stream)
    try:
        logging.getLogger("voxrecall.test").info("not shown")
        logging.getLogger("voxrecall.test").warning("shown %d", 1, extra={"kb": "help"})
    finally:
        root.setLevel(saved[0])
        root.handlers[:] = saved[1]
    (line,) = [json.loads(x) for x in stream.getvalue().splitlines()]
    assert line["msg"] == "shown 1"
    assert line["level"] == "WARNING"
    assert line["kb"] == "help"
    assert "call_id" not in line
    assert "session_id" not in line


@pytest.mark.parametrize(
    ("key", "value", "message"),
    [
        ("max_concurrent_rpcs", 0, "max_concurrent_rpcs"),
        ("max_message_bytes", 10, "max_message_bytes"),
        ("log_level", "LOUD", "log_level"),
        ("log_format", "xml", "log_format"),
        ("metrics_listen", "9464", "metrics_listen"),
    ],
)
def test_the_config_refuses_bad_operations_keys(
    tmp_path: Path, key: str, value: object, message: str
) -> None:
    with pytest.raises(ConfigError, match=message):
        parse_config({"sidecar": {key: value}}, tmp_path)


# -- a failed call's slot ----------------------------------------------------------------------

SHARE_OF_ONE = {
    "caller": [{"name": "agent", "token_env": "VOX_TEST_AGENT", "max_concurrent_rpcs": 1}]
}
# a failing call: the method whose handler fails, its request, and the status its client gets
FAILURES = {
    "invalid-argument": ("EndSession", pb.EndSessionRequest(), grpc.StatusCode.INVALID_ARGUMENT),
    "not-found": (
        "Search",
        pb.SearchRequest(knowledge_base="nope", query=QUESTION),
        grpc.StatusCode.NOT_FOUND,
    ),
}


class _StatusOut:
    """A handler's servicer context whose ``abort`` returns (raises) only once ``go`` is set:
    the failed call's status is out and its client has it while its handler has not ended, the
    window in which an agent's next call arrives (a few in 100 alternating doors, unforced)."""

    def __init__(self, context: Any, go: asyncio.Event) -> None:
        self._context, self.go = context, go

    async def abort(self, *args: Any, **kwargs: Any) -> None:
        try:
            await self._context.abort(*args, **kwargs)
        finally:
            await asyncio.wait_for(self.go.wait(), WAIT_S)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._context, name)


@pytest.mark.parametrize("door", ["grpc", "http"])
@pytest.mark.parametrize("failure", list(FAILURES))
async def test_a_callers_failed_call_does_not_refuse_its_next_one(
    store: Path,
    local_embedder: Embedder,
    monkeypatch: pytest.MonkeyPatch,
    failure: str,
    door: str,
) -> None:
    """A caller with a share of 1 whose call failed and who calls again as soon as it has the
    status, on either door, is served: the failed call's slot is held apart (as an answer's is)
    before its status goes out, so its handler, not yet over, takes no room from the next one."""
    method, request, code = FAILURES[failure]
    go = asyncio.Event()
    handler = getattr(RetrievalService, method)

    async def held_past_its_status(self: RetrievalService, request: Any, context: Any) -> Any:
        return await handler(self, request, _StatusOut(context, go))

    monkeypatch.setattr(RetrievalService, method, held_past_its_status)
    monkeypatch.setenv("VOX_TEST_AGENT", TOKEN_A)
    config = sidecar_config(store, auth=SHARE_OF_ONE, http={"listen": "127.0.0.1:0"})
    async with (
        running(config, local_embedder) as sc,
        grpc.aio.insecure_channel(f"127.0.0.1:{sc.port}") as channel,
        httpx2.AsyncClient() as http,
    ):
        assert sc.guards is not None
        limit = sc.guards.limit
        stub = pb_grpc.RetrievalStub(channel)  # type: ignore[no-untyped-call]
        try:
            with pytest.raises(grpc.aio.AioRpcError) as failed:
                await getattr(stub, method)(request, metadata=bearer(TOKEN_A))
            assert failed.value.code() is code
            search = {"knowledge_base": "help", "query": QUESTION}
            if door == "grpc":
                answer = await stub.Search(pb.SearchRequest(**search), metadata=bearer(TOKEN_A))
                assert answer.chunks
            else:
                reply = await http.post(
                    f"http://127.0.0.1:{sc.http_port}/v1/search",
                    json=search,
                    headers={"authorization": f"Bearer {TOKEN_A}"},
                )
                assert reply.status_code == 200, reply.text
                assert reply.json()["chunks"]
            assert limit.unary.by_caller == {}  # the failed call's handler waits: not running
        finally:
            go.set()
        await eventually(lambda: limit.unary.in_flight == 0, "the failed call's slot")
        assert limit.unary.held_by == {}
