"""Inputs that cost more than they should (issue 14, items 7-9), against a real sidecar on
127.0.0.1: error outputs within the output cap, log lines bounded, every text field checked in
bytes on every RPC, no lexical work on a text that is for logging only, and a malformed body
answered INVALID_ARGUMENT (UNAUTHENTICATED first) with one short log line."""

from __future__ import annotations

import io
import logging
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import orjson
import pytest

from index.embedders.base import Embedder
from index.lexical import LexicalIndex
from sidecar.edge import logs
from sidecar.edge.limits import MAX_CALL_ID, MAX_PAGE_PATH
from sidecar.edge.server import Sidecar
from sidecar.functions.tools import error_output
from sidecar.gen import retrieval_pb2 as pb
from sidecar.gen import retrieval_pb2_grpc as pb_grpc
from tests.hardening_kit import TOKEN_A, bearer, build_store, running, sidecar_config

OUTPUT_CHARS = 2000
QUESTION = "how do I reset my password"


@pytest.fixture(scope="module")
def store(tmp_path_factory: pytest.TempPathFactory, local_embedder: Embedder) -> Path:
    return build_store(tmp_path_factory.mktemp("costly"), local_embedder)


@pytest.fixture
async def sidecar(store: Path, local_embedder: Embedder) -> AsyncIterator[Sidecar]:
    async with running(sidecar_config(store, tool_output_chars=OUTPUT_CHARS), local_embedder) as sc:
        yield sc


@pytest.fixture
async def stub(sidecar: Sidecar) -> AsyncIterator[pb_grpc.RetrievalStub]:
    async with grpc.aio.insecure_channel(f"127.0.0.1:{sidecar.port}") as channel:
        yield pb_grpc.RetrievalStub(channel)  # type: ignore[no-untyped-call]


@pytest.fixture
def log_lines() -> Iterator[io.StringIO]:
    """Every log line, as the sidecar writes them (json)."""
    stream = io.StringIO()
    logs.configure("INFO", "json", stream=stream)
    yield stream
    logging.getLogger().handlers.clear()


async def _error(call: Any) -> grpc.aio.AioRpcError:
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await call
    return info.value


# -- item 7: InvokeTool's errors within the output cap; log lines bounded ----------------------


def _control_keys(size: int) -> str:
    """A JSON object of many distinct keys of control characters: every key is refused, and
    each repeated in an error would come back longer than it went in."""
    key_json = len(orjson.dumps({"\x01\x02\x03" * 4 + "0000000": 1}))  # escaped: 6 a char
    keys = {"\x01\x02\x03" * 4 + f"{i:07d}": 1 for i in range(size // key_json)}
    return orjson.dumps(keys).decode()


@pytest.mark.parametrize("size", [30_000, 3_800_000])
async def test_an_amplifying_tool_call_gets_an_error_within_the_output_cap(
    stub: pb_grpc.RetrievalStub, log_lines: io.StringIO, size: int
) -> None:
    arguments = _control_keys(size)
    reply = await stub.InvokeTool(
        pb.InvokeToolRequest(name="search_help", arguments_json=arguments, call_id="c1")
    )
    assert reply.is_error
    assert len(reply.output) <= OUTPUT_CHARS
    error = orjson.loads(reply.output)["error"]
    assert error["type"] == "invalid_arguments"
    lines = log_lines.getvalue().splitlines()
    assert lines
    assert max(len(line.encode()) for line in lines) < 2 * logs.MAX_FIELD_BYTES


def test_an_error_output_is_cut_to_fit_and_stays_valid_json() -> None:
    message = "\x00" * 10_000  # each becomes six characters of JSON
    out = error_output("invalid_arguments", message, 300)
    assert len(out) <= 300
    assert orjson.loads(out)["error"]["message"].endswith("...")


def test_every_logged_field_is_bounded(log_lines: io.StringIO) -> None:
    log = logging.getLogger("voxrecall.test")
    huge = "\U0001f4de" * 100_000
    log.info("echo %s", huge, extra={"field": huge, "count": 3})
    try:
        raise ValueError(huge)
    except ValueError:
        log.exception("failed")
    for line in log_lines.getvalue().splitlines():
        record = orjson.loads(line)
        assert len(record["msg"].encode()) < logs.MAX_FIELD_BYTES + 100
        assert len(record.get("field", "").encode()) < logs.MAX_FIELD_BYTES + 100
        assert len(record.get("exc", "").encode()) < logs.MAX_TRACEBACK_BYTES + 100
    assert orjson.loads(log_lines.getvalue().splitlines()[0])["count"] == 3


# -- item 8: every text field checked in bytes; a logging-only text is never searched -----------


async def test_search_with_a_vector_still_checks_its_query(
    stub: pb_grpc.RetrievalStub, sidecar: Sidecar
) -> None:
    dim = sidecar.engine.embedder.info.dimension
    vector = np.ones(dim, dtype="<f4").tobytes()
    request = pb.SearchRequest(query="roaming " * 480_000, vector=vector)
    refused = await _error(stub.Search(request))
    assert refused.code() is grpc.StatusCode.INVALID_ARGUMENT
    assert "query is at least" in (refused.details() or "")


async def test_a_query_beside_a_vector_gets_no_lexical_work(
    stub: pb_grpc.RetrievalStub,
    sidecar: Sidecar,
    monkeypatch: pytest.MonkeyPatch,
    local_embedder: Embedder,
) -> None:
    sidecar.engine.hybrid_bases = frozenset({"help"})
    scored: list[str] = []
    original = LexicalIndex.weighted  # every BM25 query's terms are looked up here

    def spy(self: LexicalIndex, query: str, *args: Any, **kwargs: Any) -> Any:
        scored.append(query)
        return original(self, query, *args, **kwargs)

    monkeypatch.setattr(LexicalIndex, "weighted", spy)
    vector = (await local_embedder.embed([QUESTION]))[0].astype("<f4").tobytes()
    with_vector = await stub.Search(pb.SearchRequest(query="roaming " * 100, vector=vector))
    assert with_vector.chunks
    assert scored == []  # the query was for logging only
    assert (await stub.Search(pb.SearchRequest(query=QUESTION))).chunks
    assert scored  # a hybrid search of text does run BM25: the spy sees it


@pytest.mark.parametrize(
    ("rpc", "message", "field"),
    [
        ("Turn", pb.TurnRequest(text="hi", knowledge_base="k" * 2000), "knowledge_base"),
        ("Turn", pb.TurnRequest(text="\U0001f4de" * 4500), "text"),
        ("Search", pb.SearchRequest(query="hi", sources=["s"] * 300), "sources"),
        ("Search", pb.SearchRequest(query="hi", context_url="u" * 9000), "context_url"),
        ("ReadPage", pb.ReadPageRequest(source_path="p", source="s" * 2000), "source"),
        ("EndSession", pb.EndSessionRequest(session_id="\U0001f4de" * 300), "session_id"),
        ("InvokeTool", pb.InvokeToolRequest(name="n", call_id="c" * 2000), "call_id"),
    ],
)
async def test_every_text_field_is_checked_in_bytes_on_every_rpc(
    stub: pb_grpc.RetrievalStub, rpc: str, message: Any, field: str
) -> None:
    refused = await _error(getattr(stub, rpc)(message))
    assert refused.code() is grpc.StatusCode.INVALID_ARGUMENT
    assert f"{field} " in (refused.details() or "")


@pytest.mark.parametrize(
    ("rpc", "message", "named"),
    [
        (
            "InvokeTool",
            pb.InvokeToolRequest(name="n", call_id="c" * 2000),
            "call_id is at least 2000",
        ),
        ("ReadPage", pb.ReadPageRequest(source_path="p" * 20_000), "source_path is at least 20000"),
    ],
)
async def test_a_field_the_handler_bounds_is_refused_naming_that_limit(
    stub: pb_grpc.RetrievalStub, rpc: str, message: Any, named: str
) -> None:
    """The limit a refusal names is the one that holds (256 bytes of call id, 4096 of page
    path), not the looser bound of any name or of a text."""
    refused = await _error(getattr(stub, rpc)(message))
    assert refused.code() is grpc.StatusCode.INVALID_ARGUMENT
    limit = {"InvokeTool": MAX_CALL_ID, "ReadPage": MAX_PAGE_PATH}[rpc]
    assert refused.details() == f"{named} bytes; the limit is {limit}"


async def test_a_tool_name_of_any_length_is_an_error_output_the_model_reads(
    stub: pb_grpc.RetrievalStub,
) -> None:
    """The tool name is the model's, as its arguments are: a runaway one is an unknown function
    the model can correct, quoted in part, never a failed call."""
    name = "search_help" + "x" * 5000
    answer = await stub.InvokeTool(
        pb.InvokeToolRequest(name=name, arguments_json='{"query": "roaming"}', call_id="c1")
    )
    assert answer.is_error
    assert answer.call_id == "c1"
    error = orjson.loads(answer.output)["error"]
    assert error["type"] == "unknown_function"
    assert "search_help" in error["message"]
    assert len(answer.output) < 1000


async def test_a_converse_turn_field_is_checked_too(stub: pb_grpc.RetrievalStub) -> None:
    stream = stub.Converse()
    await stream.write(pb.ConverseRequest(turn=pb.TurnRequest(text="\U0001f4de" * 4500)))
    refused = await _error(stream.read())
    assert refused.code() is grpc.StatusCode.INVALID_ARGUMENT
    assert "turn.text" in (refused.details() or "")


# -- item 9: a malformed body ----------------------------------------------------------------------


def _raw(channel: grpc.aio.Channel, method: str) -> Any:
    identity = bytes  # no serialization on the client: the bytes go as they are
    return channel.unary_unary(
        f"/voxrecall.v1.Retrieval/{method}",
        request_serializer=identity,
        response_deserializer=identity,
    )


@pytest.mark.parametrize("token", [None, TOKEN_A])
async def test_a_malformed_body_is_refused_with_a_status_and_one_short_line(
    store: Path, local_embedder: Embedder, monkeypatch: pytest.MonkeyPatch, token: str | None
) -> None:
    monkeypatch.setenv("VOX_TEST_TOKEN", TOKEN_A)
    stream = io.StringIO()
    logs.configure("INFO", "json", stream=stream)
    config = sidecar_config(store, auth={"token_env": "VOX_TEST_TOKEN"})
    try:
        async with (
            running(config, local_embedder) as sidecar,
            grpc.aio.insecure_channel(f"127.0.0.1:{sidecar.port}") as channel,
        ):
            metadata = bearer(token) if token else None
            refused = await _error(_raw(channel, "Turn")(b"\xff" * 100, metadata=metadata))
    finally:
        logging.getLogger().handlers.clear()
    expected = grpc.StatusCode.INVALID_ARGUMENT if token else grpc.StatusCode.UNAUTHENTICATED
    assert refused.code() is expected
    if token:
        assert "100 bytes" in (refused.details() or "")
    lines = [orjson.loads(line) for line in stream.getvalue().splitlines()]
    calls = [line for line in lines if line.get("method") == "Turn"]
    assert [line["msg"].split(" in ")[0] for line in calls] == [f"Turn {expected.name}"]
    assert not [line for line in lines if line["level"] == "ERROR" or "exc" in line]


async def test_a_malformed_message_in_a_stream_ends_it_invalid_argument(
    stub: pb_grpc.RetrievalStub, sidecar: Sidecar
) -> None:
    async with grpc.aio.insecure_channel(f"127.0.0.1:{sidecar.port}") as channel:
        converse = channel.stream_stream(
            "/voxrecall.v1.Retrieval/Converse",
            request_serializer=bytes,
            response_deserializer=bytes,
        )
        stream = converse()
        good = pb.ConverseRequest(turn=pb.TurnRequest(session_id="m", text=QUESTION, is_final=True))
        await stream.write(good.SerializeToString())
        assert pb.ConverseResponse.FromString(await stream.read()).turn.chunks
        await stream.write(b"\xff" * 100)
        refused = await _error(stream.read())
    assert refused.code() is grpc.StatusCode.INVALID_ARGUMENT
    assert "not a valid message" in (refused.details() or "")


async def test_a_vector_of_huge_finite_values_is_searched_not_an_overflow(
    stub: pb_grpc.RetrievalStub, sidecar: Sidecar
) -> None:
    """Found by tests/test_fuzz.py: 1.8e19 in a float32 overflowed the norm (UNKNOWN)."""
    dim = sidecar.engine.embedder.info.dimension
    vector = np.full(dim, 1.8e19, dtype="<f4").tobytes()
    reply = await stub.Search(pb.SearchRequest(vector=vector, min_score=-1.0))
    assert reply.chunks
    nan = np.full(dim, np.nan, dtype="<f4").tobytes()
    refused = await _error(stub.Search(pb.SearchRequest(vector=nan)))
    assert refused.code() is grpc.StatusCode.INVALID_ARGUMENT
