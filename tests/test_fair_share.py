"""No caller can starve or evict another (issue 14, items 4, 5, 6, 16-18), against a real
sidecar on 127.0.0.1: per-caller shares of the streams, the calls and the sessions; streams
that go idle end; session memory bounded in bytes; scopes that leak nothing."""

from __future__ import annotations

import asyncio
import re
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import grpc
import orjson
import pytest

from index.embedders.base import Embedder
from index.errors import ConfigError
from sidecar.config import Config
from sidecar.edge.server import Sidecar
from sidecar.gen import retrieval_pb2 as pb
from sidecar.gen import retrieval_pb2_grpc as pb_grpc
from tests.conftest import eventually
from tests.hardening_kit import TOKEN_A, TOKEN_B, bearer, build_store, running, sidecar_config

TOKEN_C = "c" * 12 + "-token-for-tests-0003"
HOG, VICTIM = bearer(TOKEN_A), bearer(TOKEN_B)
TWO_CALLERS = {
    "caller": [
        {"name": "hog", "token_env": "VOX_TEST_HOG"},
        {"name": "victim", "token_env": "VOX_TEST_VICTIM"},
    ]
}
QUESTION = "how do I reset my password"
THANKS = "Thank you very much."  # skipped: answered with the session's retained context
WAIT_S = 30.0  # a bound on waiting for a stream to end, not a timing


@pytest.fixture(scope="module")
def store(tmp_path_factory: pytest.TempPathFactory, local_embedder: Embedder) -> Path:
    return build_store(tmp_path_factory.mktemp("fair"), local_embedder)


@pytest.fixture(autouse=True)
def tokens(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("VOX_TEST_HOG", TOKEN_A)
    monkeypatch.setenv("VOX_TEST_VICTIM", TOKEN_B)
    monkeypatch.setenv("VOX_TEST_SCOPED", TOKEN_C)


@asynccontextmanager
async def serving(
    config: Config, embedder: Embedder
) -> AsyncIterator[tuple[Sidecar, pb_grpc.RetrievalStub]]:
    async with (
        running(config, embedder) as sidecar,
        grpc.aio.insecure_channel(f"127.0.0.1:{sidecar.port}") as channel,
    ):
        yield sidecar, pb_grpc.RetrievalStub(channel)  # type: ignore[no-untyped-call]


def _turn(text: str = QUESTION, session_id: str = "s", **fields: Any) -> pb.TurnRequest:
    return pb.TurnRequest(session_id=session_id, text=text, is_final=True, **fields)


async def _open(stub: pb_grpc.RetrievalStub, metadata: Any, session_id: str) -> Any:
    """A Converse stream that has answered one turn: surely holding its slot."""
    stream = stub.Converse(metadata=metadata)
    await stream.write(pb.ConverseRequest(turn=_turn(session_id=session_id)))
    assert (await stream.read()).turn.chunks
    return stream


async def _code(call: Any) -> grpc.aio.AioRpcError:
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await call
    return info.value


# -- item 4: lockout ---------------------------------------------------------------------------


async def test_a_caller_holding_every_stream_it_may_starves_no_one(
    store: Path, local_embedder: Embedder
) -> None:
    """The attack: one caller opens streams until refused. It gets its share (half of
    max_streams), the other caller still opens streams and every one of its calls answers."""
    config = sidecar_config(store, auth=TWO_CALLERS, max_streams=4, max_concurrent_rpcs=4)
    async with serving(config, local_embedder) as (sidecar, stub):
        held = [await _open(stub, HOG, f"hog-{i}") for i in range(2)]
        extra = stub.Converse(metadata=HOG)  # read for its status, not written to: the
        # refusal may come before a write returns, and then the write raises instead
        assert await extra.code() is grpc.StatusCode.RESOURCE_EXHAUSTED
        details = await extra.details() or ""
        assert "'hog'" in details
        assert "max_streams = 2" in details

        answered = 0
        for i in range(20):  # the starved caller's calls, unary and streams
            answered += bool((await stub.Turn(_turn(session_id=f"v{i}"), metadata=VICTIM)).chunks)
        own = [await _open(stub, VICTIM, f"victim-{i}") for i in range(2)]
        assert answered == 20
        # every stream is held now; unary calls are counted apart and still answer
        assert sidecar.guards is not None
        assert sidecar.guards.limit.streams.in_flight == 4
        assert (await stub.Turn(_turn(), metadata=HOG)).chunks
        assert (await stub.Turn(_turn(), metadata=VICTIM)).chunks
        for stream in held + own:
            await stream.done_writing()
            assert await stream.code() is grpc.StatusCode.OK


async def test_an_idle_stream_ends_deadline_exceeded_and_gives_its_slot_back(
    store: Path, local_embedder: Embedder
) -> None:
    config = sidecar_config(store, auth=TWO_CALLERS, max_streams=2, stream_idle_s=0.3)
    async with serving(config, local_embedder) as (sidecar, stub):
        stream = await _open(stub, HOG, "idle")  # its share: one stream
        ended = await _code(asyncio.wait_for(stream.read(), WAIT_S))
        assert ended.code() is grpc.StatusCode.DEADLINE_EXCEEDED
        assert "stream_idle_s" in (ended.details() or "")
        assert "same session_id" in (ended.details() or "")
        assert sidecar.guards is not None
        limit = sidecar.guards.limit
        await eventually(lambda: limit.in_flight == 0, "the idle stream's slot")
        again = stub.Converse(metadata=HOG)  # the share is free again, the session kept
        for text in (QUESTION, THANKS):  # both sent at once: no idle gap, whatever the load
            await again.write(pb.ConverseRequest(turn=_turn(text, session_id="idle")))
        await again.done_writing()
        assert (await again.read()).turn.chunks
        assert (await again.read()).turn.context
        assert await again.code() is grpc.StatusCode.OK


# -- items 5, 6, 17: sessions --------------------------------------------------------------------


async def test_a_caller_opening_many_sessions_evicts_only_its_own(
    store: Path, local_embedder: Embedder
) -> None:
    config = sidecar_config(store, auth=TWO_CALLERS, max_sessions=20)  # 10 each
    async with serving(config, local_embedder) as (sidecar, stub):
        first = await stub.Turn(_turn(session_id="live"), metadata=VICTIM)
        assert first.chunks
        for i in range(60):  # the attack, scaled down: many sessions, fast
            await stub.Turn(_turn(THANKS, session_id=f"flood-{i}"), metadata=HOG)
        after = await stub.Turn(_turn(THANKS, session_id="live"), metadata=VICTIM)
        assert [c.chunk_id for c in after.context] == [c.chunk_id for c in first.chunks]

        hog = await stub.Status(pb.StatusRequest(), metadata=HOG)
        victim = await stub.Status(pb.StatusRequest(), metadata=VICTIM)
        assert hog.sessions == 10  # its quota, its own newest
        assert victim.sessions == 1  # item 17: each caller sees its own
        assert 0 < victim.session_bytes < hog.session_bytes
        assert sidecar.engine.sessions.usage().sessions == 11


async def test_session_memory_is_bounded_in_bytes_and_shown(
    store: Path, local_embedder: Embedder
) -> None:
    """Long agent turns (2000 characters of 4 bytes each, and their UTF-8 copies) into many
    sessions: what a session keeps stays under max_session_bytes, all of them under
    session_memory_bytes."""
    per_session, total = 40 * 1024, 300 * 1024
    config = sidecar_config(store, max_session_bytes=per_session, session_memory_bytes=total)
    long_turn = "\U0001f4de" * 2000
    async with serving(config, local_embedder) as (sidecar, stub):
        for i in range(30):
            for _ in range(4):
                await stub.Turn(_turn(long_turn, session_id=f"s{i}", speaker=pb.AGENT))
        status = await stub.Status(pb.StatusRequest())
        sessions = sidecar.engine.sessions
        assert status.session_bytes == sessions.bytes <= total
        assert 0 < status.sessions < 30  # the oldest went
        newest = sessions.peek("s29")
        assert newest is not None
        assert newest.size == newest.measure() <= per_session
        assert len(newest.turns) == 2  # 16 kB each: the oldest turns went first
        assert sessions.peek("s0") is None


# -- items 16, 18: scopes ------------------------------------------------------------------------


SCOPED = {
    "caller": [
        {"name": "full", "token_env": "VOX_TEST_HOG"},
        {"name": "billing-only", "token_env": "VOX_TEST_VICTIM", "knowledge_bases": ["billing"]},
        {"name": "fn-only", "token_env": "VOX_TEST_SCOPED", "functions": ["search_billing"]},
    ]
}


async def test_an_unknown_function_lists_only_what_the_caller_may_see(
    store: Path, local_embedder: Embedder
) -> None:
    async with serving(sidecar_config(store, auth=SCOPED), local_embedder) as (_, stub):
        call = pb.InvokeToolRequest(name="nosuchfn", arguments_json="{}")
        scoped = await stub.InvokeTool(call, metadata=VICTIM)
        assert scoped.is_error
        message = orjson.loads(scoped.output)["error"]["message"]
        assert "search_billing" in message
        assert "search_help" not in message
        full = await stub.InvokeTool(call, metadata=HOG)
        assert "search_help" in orjson.loads(full.output)["error"]["message"]


async def test_a_caller_scoped_by_functions_reaches_only_their_bases(
    store: Path, local_embedder: Embedder
) -> None:
    config = sidecar_config(store, auth=SCOPED)
    scoped = next(c for c in config.sidecar.auth.callers if c.name == "fn-only")
    assert scoped.knowledge_bases == ("billing",)
    fn_only = bearer(TOKEN_C)
    async with serving(config, local_embedder) as (_, stub):
        for call in (
            stub.Turn(_turn(), metadata=fn_only),  # the default base, help
            stub.Search(pb.SearchRequest(query=QUESTION, knowledge_base="help"), metadata=fn_only),
            stub.ReadPage(pb.ReadPageRequest(source_path="password.md"), metadata=fn_only),
        ):
            assert (
                await _code(call)
            ).code() is grpc.StatusCode.NOT_FOUND  # as if help did not exist
        billing = await stub.Turn(_turn("refund", knowledge_base="billing"), metadata=fn_only)
        assert billing.chunks
        status = await stub.Status(pb.StatusRequest(), metadata=fn_only)
        assert [kb.name for kb in status.knowledge_bases] == ["billing"]


# -- the config: shares ----------------------------------------------------------------------------


def _callers(store: Path, **sidecar: Any) -> dict[str, Any]:
    config = sidecar_config(store, **sidecar)
    return {c.name: c for c in config.sidecar.auth.callers}


def test_each_caller_gets_a_fair_share_unless_given_one(store: Path) -> None:
    callers = _callers(store, auth=SCOPED, max_concurrent_rpcs=64, max_streams=10)
    assert [c.max_concurrent_rpcs for c in callers.values()] == [21, 21, 21]
    assert [c.max_streams for c in callers.values()] == [3, 3, 3]
    given = {
        "caller": [
            {"name": "big", "token_env": "VOX_TEST_HOG", "max_sessions": 8000},
            {"name": "small", "token_env": "VOX_TEST_VICTIM"},
        ]
    }
    callers = _callers(store, auth=given)
    assert (callers["big"].max_sessions, callers["small"].max_sessions) == (8000, 2000)
    assert callers["small"].session_memory_bytes == 128 * 1024 * 1024


@pytest.mark.parametrize(
    ("caller", "sidecar", "says"),
    [
        ({"max_streams": 100}, {}, "add up to 100, more than the [sidecar] limit 64"),
        ({"max_sessions": -1}, {}, "whole number >= 1"),
        ({"session_memory_bytes": 1000}, {}, "whole number >= 65536"),
        ({}, {"max_streams": 1}, "the least that works is 1"),
    ],
)
def test_shares_that_cannot_work_are_refused(
    store: Path, caller: dict[str, Any], sidecar: dict[str, Any], says: str
) -> None:
    auth = {
        "caller": [
            {"name": "one", "token_env": "VOX_TEST_HOG", **caller},
            {"name": "two", "token_env": "VOX_TEST_VICTIM"},
        ]
    }
    with pytest.raises(ConfigError, match=re.escape(says)):
        sidecar_config(store, auth=auth, **sidecar)
