"""One suite of scope cases, run against every door: gRPC, Turn over HTTP (``/v1/turn``), MCP
over HTTP, and the webhooks.

Each case is a token and something it tries to reach (a function, a page, a base); the answer
(reached or refused) must be the same through every door that offers a way to it.
"""

from __future__ import annotations

import hashlib
import hmac
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

import grpc
import httpx2
import orjson
import pytest
import pytest_asyncio
from mcp.client.session import ClientSession
from mcp.client.streamable_http import streamable_http_client

from index.embedders.base import Embedder
from sidecar.edge.server import Sidecar
from sidecar.gen import retrieval_pb2 as pb
from sidecar.gen import retrieval_pb2_grpc as pb_grpc
from tests.hardening_kit import TOKEN_A, TOKEN_B, bearer, build_store, running, sidecar_config

pytestmark = pytest.mark.asyncio(loop_scope="module")

AUTH = {
    "token_env": "VOX_SCOPE_TOKEN",
    "caller": [
        {
            "name": "billing-agent",
            "token_env": "VOX_SCOPE_BILLING",
            "knowledge_bases": ["billing"],
            "functions": ["search_billing"],
        }
    ],
}
SECRET = "scope-webhook-secret-0001"
HTTP = {
    "listen": "127.0.0.1:0",
    "read_page_bases": ["help", "billing"],
    "webhook_secret_env": "VOX_SCOPE_WEBHOOK",
}
# (token, kind, target, reached)
CASES = [
    (TOKEN_A, "function", "search_help", True),
    (TOKEN_A, "function", "search_billing", True),
    (TOKEN_A, "page", "help/password.md", True),
    (TOKEN_A, "base", "help", True),
    (TOKEN_B, "function", "search_help", False),
    (TOKEN_B, "function", "search_billing", True),
    (TOKEN_B, "page", "help/password.md", False),
    (TOKEN_B, "page", "billing/refunds.md", True),
    (TOKEN_B, "base", "help", False),
]
# the kinds each door has a way to
DOORS = {"grpc": {"function", "page", "base"}, "plain": {"base"}, "plain-search": {"base"}, "mcp": {"function", "page"}, "webhooks": {"function", "base"}}  # fmt: skip


@pytest_asyncio.fixture(loop_scope="module", scope="module")
async def sidecar(
    tmp_path_factory: pytest.TempPathFactory, local_embedder: Embedder
) -> AsyncIterator[Sidecar]:
    root = build_store(tmp_path_factory.mktemp("scopes"), local_embedder)
    with pytest.MonkeyPatch.context() as env:
        env.setenv("VOX_SCOPE_TOKEN", TOKEN_A)
        env.setenv("VOX_SCOPE_BILLING", TOKEN_B)
        env.setenv("VOX_SCOPE_WEBHOOK", SECRET)
        config = sidecar_config(Path(root), auth=AUTH, http=HTTP)
    async with running(config, local_embedder) as sc:
        yield sc


async def through_grpc(sc: Sidecar, token: str, kind: str, target: str) -> bool:
    async with grpc.aio.insecure_channel(f"127.0.0.1:{sc.port}") as channel:
        stub = pb_grpc.RetrievalStub(channel)  # type: ignore[no-untyped-call]
        md = bearer(token)
        try:
            if kind == "function":
                request = pb.InvokeToolRequest(name=target, arguments_json='{"query": "refund"}')
                return not (await stub.InvokeTool(request, metadata=md)).is_error
            if kind == "page":
                kb, _, path = target.partition("/")
                await stub.ReadPage(
                    pb.ReadPageRequest(knowledge_base=kb, source_path=path), metadata=md
                )
                return True
            turn = pb.TurnRequest(
                session_id="s", text="reset", knowledge_base=target, is_final=True
            )
            await stub.Turn(turn, metadata=md)
            return True
        except grpc.aio.AioRpcError as exc:
            if exc.code() is not grpc.StatusCode.NOT_FOUND:
                raise
            return False


@asynccontextmanager
async def mcp(sc: Sidecar, token: str) -> AsyncIterator[ClientSession]:
    async with (
        httpx2.AsyncClient(headers={"authorization": f"Bearer {token}"}) as http,
        streamable_http_client(f"http://127.0.0.1:{sc.http_port}/mcp", http_client=http) as (r, w),
        ClientSession(r, w) as session,
    ):
        await session.initialize()
        yield session


async def through_mcp(sc: Sidecar, token: str, kind: str, target: str) -> bool:
    async with mcp(sc, token) as session:
        listed = {t.name for t in (await session.list_tools()).tools}
        if kind == "function":
            result = await session.call_tool(target, {"query": "refund"})
            assert (target in listed) is not result.is_error  # listed exactly when callable
        else:
            kb, _, path = target.partition("/")
            result = await session.call_tool(
                "read_page", {"source_path": path, "knowledge_base": kb}
            )
    if result.is_error:
        error = orjson.loads(result.content[0].text)["error"]
        assert error["type"] in ("unknown_function", "not_found", "invalid_arguments"), error
    return not result.is_error


async def through_webhooks(sc: Sidecar, token: str, kind: str, target: str) -> bool:
    if kind == "function":
        # a call id of its own: a signature covers the body alone, and a signed body is
        # accepted once (a replay to another path too)
        path = f"/tools/{target}"
        body = orjson.dumps({"args": {"query": "refund"}, "call_id": f"call-{target}"})
    else:
        message = {"type": "knowledge-base-request", "call": {"id": "c1"},
                   "messages": [{"role": "user", "content": "reset my password"}]}  # fmt: skip
        path, body = "/vapi/knowledge-base", orjson.dumps({"message": message})
    reply = await post(sc, token, path, body)
    assert reply.status_code in (200, 404), reply.text
    return reply.status_code == 200


async def through_plain(sc: Sidecar, token: str, kind: str, target: str) -> bool:
    turn = {"session_id": "s", "text": "reset", "knowledge_base": target, "is_final": True}
    return _reached(await post(sc, token, "/v1/turn", orjson.dumps(turn)))


async def through_plain_search(sc: Sidecar, token: str, kind: str, target: str) -> bool:
    search = {"query": "reset", "knowledge_base": target}
    return _reached(await post(sc, token, "/v1/search", orjson.dumps(search)))


def _reached(reply: httpx2.Response) -> bool:
    assert reply.status_code in (200, 404), reply.text
    return reply.status_code == 200


async def post(sc: Sidecar, token: str, path: str, body: bytes) -> httpx2.Response:
    stamp = str(int(time.time()))
    signature = hmac.new(SECRET.encode(), f"{stamp}.".encode() + body, hashlib.sha256).hexdigest()
    headers = {
        "authorization": f"Bearer {token}",
        "x-voxrecall-timestamp": stamp,
        "x-voxrecall-signature": f"sha256={signature}",
    }
    async with httpx2.AsyncClient() as http:
        return await http.post(
            f"http://127.0.0.1:{sc.http_port}{path}", content=body, headers=headers
        )


THROUGH = {
    "grpc": through_grpc,
    "plain": through_plain,
    "plain-search": through_plain_search,
    "mcp": through_mcp,
    "webhooks": through_webhooks,
}


@pytest.mark.parametrize(
    ("door", "token", "kind", "target", "reached"),
    [(door, *case) for door, kinds in DOORS.items() for case in CASES if case[1] in kinds],
)
async def test_a_token_reaches_the_same_things_through_every_door(
    sidecar: Sidecar, door: str, token: str, kind: str, target: str, reached: bool
) -> None:
    assert await THROUGH[door](sidecar, token, kind, target) is reached


# -- names outside a token's scope ------------------------------------------------------------

# For the billing token: a name that exists outside its scope, and one that exists nowhere.
HIDDEN = {"function": ("search_help", "search_nowhere"), "base": ("help", "nowhere")}


async def answer_grpc(sc: Sidecar, kind: str, name: str) -> str:
    async with grpc.aio.insecure_channel(f"127.0.0.1:{sc.port}") as channel:
        stub = pb_grpc.RetrievalStub(channel)  # type: ignore[no-untyped-call]
        try:
            if kind == "function":
                request = pb.InvokeToolRequest(name=name, arguments_json='{"query": "refund"}')
                reply = await stub.InvokeTool(request, metadata=bearer(TOKEN_B))
                return f"{reply.is_error} {reply.output} {reply.instructions}"
            turn = pb.TurnRequest(session_id="s", text="reset", knowledge_base=name, is_final=True)
            await stub.Turn(turn, metadata=bearer(TOKEN_B))
            return "reached"
        except grpc.aio.AioRpcError as exc:
            return f"{exc.code().name} {exc.details()}"


async def answer_plain(sc: Sidecar, kind: str, name: str) -> str:
    turn = {"session_id": "s", "text": "reset", "knowledge_base": name, "is_final": True}
    reply = await post(sc, TOKEN_B, "/v1/turn", orjson.dumps(turn))
    return f"{reply.status_code} {reply.text}"


async def answer_mcp(sc: Sidecar, kind: str, name: str) -> str:
    async with mcp(sc, TOKEN_B) as session:
        result = await session.call_tool(name, {"query": "refund"})
    return f"{result.is_error} {result.content[0].text}"


async def answer_webhooks(sc: Sidecar, kind: str, name: str) -> str:
    reply = await post(sc, TOKEN_B, f"/tools/{name}", orjson.dumps({"args": {"query": "x"}}))
    return f"{reply.status_code} {reply.text}"


ANSWER = {
    "grpc": answer_grpc,
    "plain": answer_plain,
    "mcp": answer_mcp,
    "webhooks": answer_webhooks,
}


@pytest.mark.parametrize(
    ("door", "kind", "answer"),
    [
        ("grpc", "function", 'True {"error":{"type":"unknown_function"'),
        ("grpc", "base", "NOT_FOUND unknown knowledge base"),
        ("plain", "base", '404 {"error":{"code":"NOT_FOUND","message":"unknown knowledge base'),
        ("mcp", "function", 'True {"error":{"type":"unknown_function"'),
        ("webhooks", "function", '404 {"error":{"code":"NOT_FOUND"'),
    ],
)
async def test_a_name_outside_the_scope_is_answered_as_one_that_does_not_exist(
    sidecar: Sidecar, door: str, kind: str, answer: str
) -> None:
    """A token scoped to billing learns nothing of the help base or its function: asking for
    them gets, word for word, what asking for a name that exists nowhere gets."""
    existing, missing = HIDDEN[kind]
    hidden = await ANSWER[door](sidecar, kind, existing)
    unknown = await ANSWER[door](sidecar, kind, missing)
    assert hidden.startswith(answer), hidden
    assert hidden.replace(existing, "NAME") == unknown.replace(missing, "NAME")
    assert existing not in unknown  # not listed among what the token may use
