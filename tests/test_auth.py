"""Bearer tokens and per-caller scopes against a real server on port 0."""

from __future__ import annotations

import io
import logging
from collections.abc import AsyncIterator
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from index.embedders.base import Embedder
from index.errors import ConfigError
from sidecar.config import parse_config
from sidecar.edge import logs
from sidecar.edge.server import create_server
from sidecar.gen import retrieval_pb2 as pb
from sidecar.gen import retrieval_pb2_grpc as pb_grpc
from tests.hardening_kit import TOKEN_A, TOKEN_B, bearer, build_store, running, sidecar_config

AUTH = {
    "token_env": "VOX_TEST_TOKEN",
    "caller": [
        {
            "name": "billing-agent",
            "token_env": "VOX_TEST_BILLING",
            "knowledge_bases": ["billing"],
            "functions": ["search_billing"],
        }
    ],
}


@pytest.fixture(scope="module")
def store(tmp_path_factory: pytest.TempPathFactory, local_embedder: Embedder) -> Path:
    return build_store(tmp_path_factory.mktemp("auth"), local_embedder)


@pytest.fixture
def tokens(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("VOX_TEST_TOKEN", TOKEN_A)
    monkeypatch.setenv("VOX_TEST_BILLING", TOKEN_B)


@pytest.fixture
async def stub(
    store: Path, local_embedder: Embedder, tokens: None
) -> AsyncIterator[pb_grpc.RetrievalStub]:
    async with (
        running(sidecar_config(store, auth=AUTH), local_embedder) as sidecar,
        grpc.aio.insecure_channel(f"127.0.0.1:{sidecar.port}") as channel,
    ):
        yield pb_grpc.RetrievalStub(channel)  # type: ignore[no-untyped-call]


TURN = pb.TurnRequest(session_id="s1", text="how do I reset my password", is_final=True)


async def _code(call: object) -> grpc.StatusCode:
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await call  # type: ignore[misc]
    return info.value.code()


async def test_no_token_is_unauthenticated_with_a_message_saying_what_to_send(
    stub: pb_grpc.RetrievalStub,
) -> None:
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await stub.Turn(TURN)
    assert info.value.code() is grpc.StatusCode.UNAUTHENTICATED
    assert "authorization: Bearer" in (info.value.details() or "")


@pytest.mark.parametrize(
    "header",
    [f"Bearer {TOKEN_A}x", f"Bearer {TOKEN_A[:-1]}", f"Basic {TOKEN_A}", "Bearer ", TOKEN_A],
)
async def test_a_wrong_token_is_unauthenticated_and_never_echoed(
    stub: pb_grpc.RetrievalStub, header: str
) -> None:
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await stub.Turn(TURN, metadata=(("authorization", header),))
    assert info.value.code() is grpc.StatusCode.UNAUTHENTICATED
    details = info.value.details() or ""
    assert TOKEN_A[:8] not in details
    assert TOKEN_B[:8] not in details


async def test_two_authorization_entries_are_unauthenticated_whichever_is_right(
    stub: pb_grpc.RetrievalStub,
) -> None:
    """The last entry was taken, whichever a proxy before the sidecar had checked."""
    for first, last in ((TOKEN_B, TOKEN_A), (TOKEN_A, TOKEN_A)):
        metadata = (("authorization", f"Bearer {first}"), ("authorization", f"Bearer {last}"))
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await stub.Turn(TURN, metadata=metadata)
        assert info.value.code() is grpc.StatusCode.UNAUTHENTICATED
        assert "more than one authorization header" in (info.value.details() or "")


async def test_the_right_token_answers(stub: pb_grpc.RetrievalStub) -> None:
    resp = await stub.Turn(TURN, metadata=bearer(TOKEN_A))
    assert resp.chunks
    assert resp.chunks[0].title == "Reset your password"
    status = await stub.Status(pb.StatusRequest(), metadata=bearer(TOKEN_A))
    assert {kb.name for kb in status.knowledge_bases} == {"help", "billing"}


async def test_health_needs_no_token(store: Path, local_embedder: Embedder, tokens: None) -> None:
    async with (
        running(sidecar_config(store, auth=AUTH), local_embedder) as sidecar,
        grpc.aio.insecure_channel(f"127.0.0.1:{sidecar.port}") as channel,
    ):
        health = health_pb2_grpc.HealthStub(channel)
        reply = await health.Check(health_pb2.HealthCheckRequest())
        assert reply.status == health_pb2.HealthCheckResponse.SERVING


async def test_a_scoped_caller_reaches_only_its_bases_and_functions(
    stub: pb_grpc.RetrievalStub,
) -> None:
    md = bearer(TOKEN_B)
    ok = await stub.Turn(
        pb.TurnRequest(session_id="b", text="when is my refund paid", knowledge_base="billing",
                       is_final=True),
        metadata=md,
    )  # fmt: skip
    assert ok.chunks[0].knowledge_base == "billing"
    denied = grpc.StatusCode.NOT_FOUND  # as if it did not exist: a token learns no names
    assert await _code(stub.Turn(TURN, metadata=md)) is denied  # the default base is "help"
    help_turn = pb.TurnRequest(text="reset password", knowledge_base="help", is_final=True)
    assert await _code(stub.Turn(help_turn, metadata=md)) is denied
    search = pb.SearchRequest(query="password", knowledge_base="help")
    assert await _code(stub.Search(search, metadata=md)) is denied
    page = pb.ReadPageRequest(knowledge_base="help", source_path="password.md")
    assert await _code(stub.ReadPage(page, metadata=md)) is denied
    tool = pb.InvokeToolRequest(name="search_help", arguments_json='{"query": "password"}')
    hidden = await stub.InvokeTool(tool, metadata=md)  # an unknown function, for this token
    assert hidden.is_error
    assert "unknown_function" in hidden.output
    assert not hidden.instructions

    allowed = await stub.InvokeTool(
        pb.InvokeToolRequest(name="search_billing", arguments_json='{"query": "refund"}'),
        metadata=md,
    )
    assert not allowed.is_error
    assert allowed.chunks
    tools = await stub.ListTools(pb.ListToolsRequest(), metadata=md)
    assert [t.name for t in tools.tools] == ["search_billing"]
    status = await stub.Status(pb.StatusRequest(), metadata=md)
    assert [kb.name for kb in status.knowledge_bases] == ["billing"]


async def test_callers_never_share_a_session_id(stub: pb_grpc.RetrievalStub) -> None:
    def turn(text: str) -> pb.TurnRequest:
        return pb.TurnRequest(
            session_id="call-1", text=text, knowledge_base="billing", is_final=True
        )

    searched = await stub.Turn(turn("when is my refund paid"), metadata=bearer(TOKEN_A))
    assert searched.chunks
    # a backchannel answers with the session's retained context: the other caller has none
    mine = await stub.Turn(turn("okay"), metadata=bearer(TOKEN_A))
    theirs = await stub.Turn(turn("okay"), metadata=bearer(TOKEN_B))
    assert mine.skipped
    assert theirs.skipped
    assert [c.chunk_id for c in mine.context] == [c.chunk_id for c in searched.chunks]
    assert not theirs.context
    end = pb.EndSessionRequest(session_id="call-1")
    assert (await stub.EndSession(end, metadata=bearer(TOKEN_B))).existed  # its own
    assert not (await stub.EndSession(end, metadata=bearer(TOKEN_B))).existed
    still = await stub.Turn(turn("okay"), metadata=bearer(TOKEN_A))
    assert [c.chunk_id for c in still.context] == [c.chunk_id for c in searched.chunks]
    assert (await stub.EndSession(end, metadata=bearer(TOKEN_A))).existed


async def test_a_scoped_caller_is_refused_mid_stream(stub: pb_grpc.RetrievalStub) -> None:
    call = stub.Converse(metadata=bearer(TOKEN_B))
    await call.write(pb.ConverseRequest(turn=pb.TurnRequest(
        session_id="c", text="refund timing", knowledge_base="billing", is_final=True)))  # fmt: skip
    first = await call.read()
    assert isinstance(first, pb.ConverseResponse)
    assert first.turn.chunks
    await call.write(pb.ConverseRequest(turn=pb.TurnRequest(
        session_id="c", text="reset password", knowledge_base="help", is_final=True)))  # fmt: skip
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await call.read()
    assert info.value.code() is grpc.StatusCode.NOT_FOUND


async def test_an_unset_token_variable_stops_the_start(
    store: Path, local_embedder: Embedder, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("VOX_TEST_TOKEN", raising=False)
    monkeypatch.setenv("VOX_TEST_BILLING", TOKEN_B)
    config = sidecar_config(store, auth=AUTH)
    with pytest.raises(ConfigError, match="VOX_TEST_TOKEN is unset"):
        await create_server(config, embedder=local_embedder, poll=False)


async def test_a_short_token_stops_the_start(
    store: Path, local_embedder: Embedder, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("VOX_TEST_TOKEN", "short")
    config = sidecar_config(store, auth={"token_env": "VOX_TEST_TOKEN"})
    with pytest.raises(ConfigError, match="shorter than") as info:
        await create_server(config, embedder=local_embedder, poll=False)
    assert "short" not in str(info.value).replace("shorter", "")


def test_the_config_refuses_a_token_in_the_file_and_unknown_scopes(tmp_path: Path) -> None:
    def parse(auth: dict[str, object]) -> None:
        parse_config({"sidecar": {"auth": auth}}, tmp_path)

    with pytest.raises(ConfigError, match="never goes in the file"):
        parse({"token_env": "X", "token": "secret-in-the-file"})
    with pytest.raises(ConfigError, match="token_env is required"):
        parse({"caller": [{"name": "a"}]})
    with pytest.raises(ConfigError, match="not \\[\\[function\\]\\]s"):
        parse({"token_env": "X", "functions": ["nope"]})
    with pytest.raises(ConfigError, match="caller names must be unique"):
        parse({"caller": [{"name": "a", "token_env": "X"}, {"name": "a", "token_env": "Y"}]})


async def test_tokens_never_reach_the_logs(
    store: Path, local_embedder: Embedder, tokens: None
) -> None:
    stream = io.StringIO()
    root = logging.getLogger()
    saved = root.level, list(root.handlers)
    logs.configure("DEBUG", "json", secrets=[TOKEN_A, TOKEN_B], stream=stream)
    try:
        async with (
            running(sidecar_config(store, auth=AUTH), local_embedder) as sidecar,
            grpc.aio.insecure_channel(f"127.0.0.1:{sidecar.port}") as channel,
        ):
            stub = pb_grpc.RetrievalStub(channel)  # type: ignore[no-untyped-call]
            await stub.Turn(TURN, metadata=bearer(TOKEN_A))
            await _code(stub.Turn(TURN, metadata=bearer(TOKEN_B)))
            await _code(stub.Turn(TURN, metadata=bearer(TOKEN_A + "x")))
            # a secret that finds its way into a message is replaced before the line is written
            logging.getLogger("voxrecall.test").warning("leaked %s", TOKEN_B)
    finally:
        root.setLevel(saved[0])
        root.handlers[:] = saved[1]
    text = stream.getvalue()
    assert "NOT_FOUND" in text
    assert "UNAUTHENTICATED" in text
    assert "billing-agent" in text  # the caller is named ...
    assert TOKEN_A[:16] not in text
    assert TOKEN_B[:16] not in text
    assert logs.REDACTED in text
