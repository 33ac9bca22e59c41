"""``POST /v1/turn`` and ``POST /v1/search`` (sidecar/http/rpc.py): the JSON answer holds every
field as protobuf's own writer does for the response the gRPC method gives, and the calls are the
gRPC methods' (the same answers, sessions, refusals, limits and drain), against a real sidecar on
127.0.0.1 port 0 over the example help centre, and a real HTTP client.

The scope cases of ``/v1/turn`` run with every other door's in tests/test_http_scopes.py.
"""

from __future__ import annotations

import asyncio
import base64
import logging
import math
import random
import struct
from collections.abc import AsyncIterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import grpc
import httpx2
import orjson
import pytest
from google.protobuf import json_format
from google.protobuf.message import Message

from index.embedders.base import Embedder, FakeEmbedder
from index.errors import SnapshotNotFound
from sidecar.config import Config
from sidecar.edge.lifecycle import State
from sidecar.edge.server import Sidecar
from sidecar.edge.wire import search_response, turn_response
from sidecar.gen import retrieval_pb2 as pb
from sidecar.gen import retrieval_pb2_grpc as pb_grpc
from sidecar.http.rpc import answered, json_float, search_json, turn_json
from sidecar.turn.engine import MAX_TEXT_BYTES, BasePolicy
from sidecar.turn.hits import TableHits
from tests import test_wire, test_wire_turn
from tests.conftest import eventually
from tests.hardening_kit import build_store, running, sidecar_config
from tests.test_metrics import scrape, value

PASSWORD = "How do I reset my password?"


def as_dict(message: Message) -> dict[str, Any]:
    return json_format.MessageToDict(message, preserving_proto_field_name=True)


# -- the answer, field by field ----------------------------------------------------------------


@pytest.mark.parametrize("case", test_wire_turn.CASES, ids=list(test_wire_turn.CASES))
def test_a_turns_json_is_what_protobuf_writes_of_its_response(case: str) -> None:
    found, policy = test_wire_turn.CASES[case]
    message = pb.TurnResponse.FromString(turn_response(found, policy).data)
    assert orjson.loads(turn_json(found, policy)) == as_dict(message)


@pytest.mark.parametrize("case", test_wire.CASES, ids=list(test_wire.CASES))
def test_a_searchs_json_is_what_protobuf_writes_of_its_response(case: str) -> None:
    found, policy = test_wire.CASES[case]
    message = pb.SearchResponse.FromString(search_response(found, policy).data)
    assert orjson.loads(search_json(found, policy)) == as_dict(message)


def test_hits_from_a_chunk_table_are_written_as_protobuf_writes_them(tmp_path: Path) -> None:
    table = test_wire_turn._dumped(tmp_path)
    from index.tables import ChunkTable

    hits = TableHits("billing", ChunkTable.open(table), [(1, 0.5), (0, 0.25)])
    found = test_wire.result(hits)
    message = pb.SearchResponse.FromString(search_response(found, BasePolicy()).data)
    assert orjson.loads(search_json(found, BasePolicy())) == as_dict(message)


def test_the_fields_come_in_the_protos_order() -> None:
    """Without metadata (a map, whose order protobuf leaves to its hash) the bytes are those of
    protobuf's dict as orjson writes it."""
    found, policy = test_wire_turn.CASES["every flag"]
    found = replace(found, hits=[replace(h, chunk=test_wire.BARE) for h in found.hits])
    message = pb.TurnResponse.FromString(turn_response(found, policy).data)
    assert turn_json(found, policy) == orjson.dumps(as_dict(message))


def test_a_message_a_hook_parsed_and_changed_is_what_is_answered() -> None:
    """As on gRPC (``EncodedResponse.wire``): a hook that reads the message may change it."""
    found, policy = test_wire_turn.CASES["hits and context"]

    class Changing:
        def sent(self, encoded: Any) -> None:
            encoded.message().query = "changed by a hook"

    status, body, _ = answered(Changing(), turn_response(found, policy), lambda: b"unchanged")  # type: ignore[arg-type]
    assert status == 200
    assert orjson.loads(body)["query"] == "changed by a hook"
    assert orjson.loads(body)["chunks"] == orjson.loads(turn_json(found, policy))["chunks"]


SPECIAL = [0.0, -0.0, 1.0, -1.0, 0.1, 0.8, 1e-45, 1e-40, 3.4028234e38, -3.4e38, 123456.789]


@pytest.mark.parametrize("value", [*SPECIAL, math.inf, -math.inf, math.nan])
def test_a_float_is_written_as_protobuf_writes_a_float_field(value: float) -> None:
    written = as_dict(pb.Timings(embed_ms=value)).get("embed_ms")
    assert repr(json_float(value)) == repr(written)  # -0.0 apart from 0.0, 0.8 from 0.80000001


def test_random_float32_values_are_written_as_protobuf_writes_them() -> None:
    rng = random.Random(19)
    for _ in range(5000):
        (value,) = struct.unpack("<f", rng.randbytes(4))
        if math.isnan(value):
            continue
        written = as_dict(pb.Timings(total_ms=value)).get("total_ms")
        assert repr(json_float(value)) == repr(written), value


# -- a real sidecar ------------------------------------------------------------------------------


def with_http(config: Config, **sidecar: Any) -> Config:
    http = replace(config.sidecar.http, listen="127.0.0.1:0")
    return replace(config, sidecar=replace(config.sidecar, http=http, **sidecar))


@pytest.fixture
async def sidecar(example_config: Config, local_embedder: Embedder) -> AsyncIterator[Sidecar]:
    async with running(
        with_http(example_config, metrics_listen="127.0.0.1:0"), local_embedder
    ) as sc:
        yield sc


async def post(sc: Sidecar, path: str, body: Any, **headers: str) -> httpx2.Response:
    content = body if isinstance(body, bytes) else orjson.dumps(body)
    async with httpx2.AsyncClient() as http:
        return await http.post(
            f"http://127.0.0.1:{sc.http_port}{path}", content=content, headers=headers
        )


async def grpc_turn(sc: Sidecar, **fields: Any) -> pb.TurnResponse:
    async with grpc.aio.insecure_channel(f"127.0.0.1:{sc.port}") as channel:
        stub = pb_grpc.RetrievalStub(channel)  # type: ignore[no-untyped-call]
        reply: pb.TurnResponse = await stub.Turn(pb.TurnRequest(**fields))
        return reply


async def grpc_search(sc: Sidecar, request: pb.SearchRequest) -> pb.SearchResponse:
    async with grpc.aio.insecure_channel(f"127.0.0.1:{sc.port}") as channel:
        stub = pb_grpc.RetrievalStub(channel)  # type: ignore[no-untyped-call]
        reply: pb.SearchResponse = await stub.Search(request)
        return reply


def untimed(answer: dict[str, Any]) -> dict[str, Any]:
    """An answer less its timings (each call's own), which must still be there."""
    assert set(answer.pop("timings")) <= {"embed_ms", "search_ms", "total_ms"}
    return answer


TURNS = [PASSWORD, "how long does the link work", "mm-hmm", "And how much is roaming in France?"]


async def test_a_turn_over_http_answers_what_the_grpc_method_answers(sidecar: Sidecar) -> None:
    """Two calls, one per door, the same turns: the same answers, field for field, the
    follow-ups and the session's context too."""
    for text in TURNS:
        fields = {"text": text, "is_final": True}
        by_grpc = as_dict(await grpc_turn(sidecar, session_id="by-grpc", **fields))
        reply = await post(sidecar, "/v1/turn", {"session_id": "by-http", **fields})
        assert reply.status_code == 200, reply.text
        assert reply.headers["content-type"] == "application/json"
        assert reply.headers["x-call-id"]  # the call's id in the logs, as on every door path
        assert untimed(reply.json()) == untimed(by_grpc)
    assert reply.json()["chunks"]
    assert reply.json()["context"]  # the session's retained chunks
    m = scrape(sidecar.metrics_port)
    assert value(m, "voxrecall_rpcs_total", door="http", method="Turn", code="OK") == len(TURNS)


async def test_a_search_over_http_answers_what_the_grpc_method_answers(
    sidecar: Sidecar, local_embedder: Embedder
) -> None:
    """A query, and a vector sent as the mapping sends bytes (base64)."""
    (vector,) = await local_embedder.embed(["roaming charges abroad"])
    data = vector.astype("<f4").tobytes()
    asked = [
        pb.SearchRequest(query="roaming charges abroad", limit=2),
        pb.SearchRequest(vector=data, limit=3, min_score=0.1),
    ]
    bodies = [
        {"query": "roaming charges abroad", "limit": 2},
        {"vector": base64.b64encode(data).decode(), "limit": 3, "minScore": 0.1},
    ]
    for request, body in zip(asked, bodies, strict=True):
        by_grpc = as_dict(await grpc_search(sidecar, request))
        reply = await post(sidecar, "/v1/search", body)
        assert reply.status_code == 200, reply.text
        assert untimed(reply.json()) == untimed(by_grpc)
        assert reply.json()["chunks"]
    assert reply.json()["chunks"][0]["title"] == "Using your phone abroad"


def ask(text: str) -> dict[str, Any]:
    return {"text": text, "is_final": True}


@pytest.mark.parametrize("first", ["http", "grpc"])
async def test_a_session_id_names_one_session_on_both_doors(sidecar: Sidecar, first: str) -> None:
    """A turn on one door and the next on the other, with the same session id: the second
    carries the first's chunks as its context, as two turns on one door do."""
    session = f"one-session-{first}"
    if first == "http":
        said = (await post(sidecar, "/v1/turn", {"session_id": session, **ask(PASSWORD)})).json()
        then = as_dict(await grpc_turn(sidecar, session_id=session, **ask(TURNS[1])))
    else:
        said = as_dict(await grpc_turn(sidecar, session_id=session, **ask(PASSWORD)))
        reply = await post(sidecar, "/v1/turn", {"session_id": session, **ask(TURNS[1])})
        then = reply.json()
    alone = as_dict(await grpc_turn(sidecar, session_id=f"alone-{first}", **ask(TURNS[1])))
    first_chunk = said["chunks"][0]["chunk_id"]
    assert first_chunk in [c["chunk_id"] for c in then["context"]]
    assert "context" not in alone  # a new session has none
    assert sidecar.engine.end_session(session)


@pytest.mark.parametrize(
    "body",
    [
        {
            "sessionId": "camel",
            "text": "Sure, I can help with that.",
            "isFinal": True,
            "speaker": 2,
        },
        {"session_id": "named", "text": "Sure, I can help with that.", "speaker": "AGENT"},
    ],
    ids=["lowerCamelCase, an enum by number", "proto names, an enum by name"],
)
async def test_the_body_takes_every_form_the_mapping_allows(
    sidecar: Sidecar, body: dict[str, Any]
) -> None:
    reply = await post(sidecar, "/v1/turn", body)
    assert reply.status_code == 200, reply.text
    assert reply.json()["skipped"] == "AGENT_TURN"  # the speaker was read


BAD_BODIES = [
    (b"", "not JSON"),
    (b"how do I reset my password", "not JSON"),
    (b'{"text": "reset', "not JSON"),
    (b"\xff\xfe", "not JSON"),
    (b"[]", "a JSON object"),
    (b" null", "a JSON object"),
    (b'{"text": 5}', "Failed to parse text field"),
    (b'{"txt": "reset"}', 'has no field named "txt"'),
    (b'{"speaker": "BOSS"}', "Invalid enum value BOSS"),
    (b'{"budget_ms": 1.5}', "Failed to parse budget_ms field"),
    (b'{"filters": [{"field": "tags", "any_of": "a"}]}', "Failed to parse filters field"),
    (orjson.dumps({"speaker": "X" * 10_000}), "..."),  # the complaint is cut
    # a value 1,000 deep where a list goes: protobuf's complaint recursed (a 500 and a traceback)
    (b'{"text": "x", "sources": ' + b'{"a":' * 1000 + b"1" + b"}" * 1001, "nested too deep"),
    (b'{"text": "x", "filters": ' + b"[" * 1000 + b"]" * 1000 + b"}", "nested too deep"),
]


@pytest.mark.parametrize(("body", "said"), BAD_BODIES)
async def test_a_body_that_is_not_the_message_is_a_400_saying_what_is_wrong(
    sidecar: Sidecar, body: bytes, said: str
) -> None:
    reply = await post(sidecar, "/v1/turn", body)
    assert reply.status_code == 400, reply.text
    error = reply.json()["error"]
    assert error["code"] == "INVALID_ARGUMENT"
    assert said in error["message"]
    assert error["message"].startswith("the body is not a TurnRequest in proto3's JSON mapping")
    assert '"is_final": true' in error["message"]  # what to send
    assert len(error["message"]) < 1000


@pytest.mark.parametrize(
    "fields",
    [
        {"text": "x", "speaker": 7},
        {"text": "x", "budget_ms": -1},
        {"text": "x" * (MAX_TEXT_BYTES + 1)},
        {"text": "x", "session_id": "s" * 5000},
        {"text": "x", "knowledge_base": "nowhere"},
        {"text": "x", "sources": ["a"] * 257},
        {"text": "x", "filters": [{"field": "tags", "any_of": ["a"] * 300}]},
    ],
    ids=[
        "unknown speaker",
        "negative budget",
        "text over its limit",
        "id over its limit",
        "base",
        "too many sources",
        "too many values",
    ],
)
async def test_a_message_the_method_refuses_is_refused_as_grpc_refuses_it(
    sidecar: Sidecar, fields: dict[str, Any], caplog: pytest.LogCaptureFixture
) -> None:
    """The same hooks and engine: the same code (as its HTTP status) and the same message,
    and the same log: the call log's line, never an ERROR of its own (the door logged each
    refused base at ERROR, a line a call however many came)."""
    caplog.set_level(logging.INFO, logger="voxrecall")
    with pytest.raises(grpc.aio.AioRpcError) as refused:
        await grpc_turn(sidecar, **fields)
    reply = await post(sidecar, "/v1/turn", fields)
    error = reply.json()["error"]
    assert error["code"] == refused.value.code().name
    assert error["message"] == refused.value.details()
    assert reply.status_code == {"INVALID_ARGUMENT": 400, "NOT_FOUND": 404}[error["code"]]
    assert [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING] == []


async def test_a_base_that_cannot_answer_now_is_logged_as_grpc_logs_it(
    sidecar: Sidecar, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """A base not published yet over the door: its 503 and the call log's INFO line, as on
    gRPC; the door added an ERROR line of its own for each such call."""
    caplog.set_level(logging.INFO, logger="voxrecall")

    async def loading(*args: Any, **kwargs: Any) -> Any:
        raise SnapshotNotFound("knowledge base 'help' has no snapshot loaded yet")

    monkeypatch.setattr(sidecar.engine, "search", loading)
    reply = await post(sidecar, "/v1/search", {"query": "reset my password"})
    assert reply.status_code == 503
    assert reply.json()["error"]["code"] == "UNAVAILABLE"
    assert [r.levelname for r in caplog.records if r.getMessage().startswith("Search ")] == ["INFO"]
    assert [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING] == []


@pytest.mark.parametrize(
    ("body", "said"),
    [
        ({"text": "x", "sources": ["a"] * 65_000}, "sources has 65000 entries; the limit is 256"),
        ({"sourcePaths": ["a/"] * 40_000}, "sourcePaths has 40000 entries"),
        ({"filters": [{"field": "f", "anyOf": ["a"] * 50_000}]}, "filters.anyOf has 50000"),
        ({"filters": [{}] * 20_000}, "filters has 20000 entries"),
        # each list within its entries, together 61,000 values: the engine's limit of filters
        (
            {"filters": [{"field": "f", "any_of": ["a"] * 256}] * 240},
            "240 filters; the limit is 16",
        ),
    ],
)
async def test_a_list_over_its_entries_is_refused_before_protobufs_parser_walks_it(
    sidecar: Sidecar, body: dict[str, Any], said: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """protobuf's parser is Python: 65,000 one-letter sources (254 KB) held the event loop 101
    ms in it before the hooks' limit on a repeated field refused them. The same limit is read
    first, on the JSON."""
    parsed: list[Any] = []
    parse = json_format.ParseDict
    monkeypatch.setattr(
        json_format, "ParseDict", lambda *a, **k: parsed.append(a) or parse(*a, **k)
    )
    assert sidecar.http is not None
    monkeypatch.setattr(sidecar.http, "max_body", 1 << 20)  # the bodies are up to 640 KB
    reply = await post(sidecar, "/v1/turn", body)
    assert reply.status_code == 400, reply.text
    assert said in reply.json()["error"]["message"]
    assert parsed == []


async def test_only_a_post_is_taken_and_the_paths_are_listed(sidecar: Sidecar) -> None:
    async with httpx2.AsyncClient() as http:
        got = await http.get(f"http://127.0.0.1:{sidecar.http_port}/v1/search")
        nowhere = await http.post(f"http://127.0.0.1:{sidecar.http_port}/v1/turns", json={})
    assert got.status_code == 405
    assert got.headers["allow"] == "POST"
    assert nowhere.status_code == 404
    assert "/v1/turn, /v1/search" in nowhere.json()["error"]["message"]


async def test_a_draining_sidecar_refuses_a_turn_as_on_grpc(sidecar: Sidecar) -> None:
    sidecar.lifecycle.state = State.DRAINING
    try:
        reply = await post(sidecar, "/v1/turn", {"text": PASSWORD})
    finally:
        sidecar.lifecycle.state = State.SERVING
    assert reply.status_code == 503
    assert reply.json()["error"]["code"] == "UNAVAILABLE"


async def test_a_turn_over_the_concurrency_limit_is_429_and_counted(tmp_path: Path) -> None:
    """One unary slot, held by a turn whose model never answers (it waits out its budget): a
    turn over HTTP meanwhile is refused as a gRPC call is, and the limit counts it."""
    store = build_store(tmp_path, FakeEmbedder(dimension=32))
    config = sidecar_config(
        store, http={"listen": "127.0.0.1:0"}, max_concurrent_rpcs=1, budget_ms=5000
    )
    async with running(config, FakeEmbedder(dimension=32, hang=True)) as sc:
        turn = {"text": "reset my password", "is_final": True}
        held = asyncio.create_task(post(sc, "/v1/turn", turn))
        assert sc.guards is not None
        limit = sc.guards.limit
        await eventually(lambda: limit.in_flight == 1, "the first turn holding the slot")
        refused = await post(sc, "/v1/search", {"query": "reset my password"})
        assert (await held).status_code == 200
    assert refused.status_code == 429
    assert refused.json()["error"]["code"] == "RESOURCE_EXHAUSTED"
    assert "max_concurrent_rpcs" in refused.json()["error"]["message"]
    assert limit.refused == 1
