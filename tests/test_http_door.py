"""The HTTP door against a real sidecar on 127.0.0.1 port 0: the MCP SDK's own client, Vapi's
knowledge-base requests, the signed tool webhook, health, limits and metrics.

The scope cases that run against both doors are in tests/test_http_scopes.py.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import hashlib
import hmac
import io
import logging
import re
import socket
import ssl
import sys
import termios as termios_module
import time
import tracemalloc
from collections.abc import AsyncIterator, Callable, Coroutine
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import httpx2
import mcp_types as types
import orjson
import pytest
import uvloop
from mcp.client.session import ClientSession
from mcp.client.streamable_http import streamable_http_client
from mcp.shared.exceptions import MCPError

from index.embedders.base import Embedder, FakeEmbedder
from index.errors import ConfigError
from sidecar.config import parse_config
from sidecar.edge import logs
from sidecar.edge.metrics import Metrics
from sidecar.edge.server import Sidecar, create_server, start_line
from sidecar.errors import InvalidArgument, Loading, ToolCallError, Unauthenticated
from sidecar.gen import retrieval_pb2 as pb
from sidecar.gen import retrieval_pb2_grpc as pb_grpc
from sidecar.http import door as http_door
from sidecar.http import mcp
from sidecar.http import webhooks as webhooks_module
from sidecar.http.door import MAX_HEAD_BYTES
from sidecar.http.mcp import PAGE_ARGUMENTS, SDK_SESSION_LOGGERS, page_arguments
from sidecar.http.webhooks import (
    SESSION_HEADER,
    SIGNATURE_TOLERANCE_MS,
    Answers,
    Replays,
    Signature,
    verify_signature,
)
from sidecar.turn import sessions
from sidecar.turn.engine import MAX_TEXT_CHARS
from tests.conftest import eventually
from tests.hardening_kit import (
    TOKEN_A,
    TOKEN_B,
    build_store,
    make_certs,
    running,
    sidecar_config,
)
from tests.test_metrics import scrape, value

VAPI_SECRET = "vapi-secret-for-tests-0001"
LIVENESS_S = 20.0  # how long a raw exchange may wait for the door: not a timing check
WEBHOOK_SECRET = "webhook-secret-for-tests-0001"
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
HTTP = {
    "listen": "127.0.0.1:0",
    "read_page_bases": ["help", "billing"],
    "vapi_secret_env": "VOX_TEST_VAPI",
    "webhook_secret_env": "VOX_TEST_WEBHOOK",
    "max_body_bytes": 16 * 1024,
}


@pytest.fixture(scope="module")
def store(tmp_path_factory: pytest.TempPathFactory, local_embedder: Embedder) -> Path:
    return build_store(tmp_path_factory.mktemp("http"), local_embedder)


@pytest.fixture
def secrets(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("VOX_TEST_TOKEN", TOKEN_A)
    monkeypatch.setenv("VOX_TEST_BILLING", TOKEN_B)
    monkeypatch.setenv("VOX_TEST_VAPI", VAPI_SECRET)
    monkeypatch.setenv("VOX_TEST_WEBHOOK", WEBHOOK_SECRET)


@pytest.fixture
async def sidecar(store: Path, local_embedder: Embedder, secrets: None) -> AsyncIterator[Sidecar]:
    config = sidecar_config(store, auth=AUTH, http=HTTP, metrics_listen="127.0.0.1:0")
    async with running(config, local_embedder) as sc:
        yield sc


def url(sc: Sidecar, path: str) -> str:
    return f"http://127.0.0.1:{sc.http_port}{path}"


def auth(token: str = TOKEN_A, **more: str) -> dict[str, str]:
    return {"authorization": f"Bearer {token}", **more}


@asynccontextmanager
async def mcp_session(sc: Sidecar, token: str = TOKEN_A) -> AsyncIterator[ClientSession]:
    async with (
        httpx2.AsyncClient(headers=auth(token)) as http,
        streamable_http_client(url(sc, "/mcp"), http_client=http) as (read, write),
        ClientSession(read, write) as session,
    ):
        await session.initialize()
        yield session


def output(result: Any) -> dict[str, Any]:
    body: dict[str, Any] = orjson.loads(result.content[0].text)
    return body


# -- MCP --------------------------------------------------------------------------------------


async def test_the_sdk_client_lists_and_calls_every_tool_with_a_token(sidecar: Sidecar) -> None:
    async with mcp_session(sidecar) as session:
        listed = await session.list_tools()
        assert [t.name for t in listed.tools] == ["search_help", "search_billing", "read_page"]
        search_help = listed.tools[0]
        assert search_help.input_schema["required"] == ["query"]  # ListTools' schema
        assert "accounts" in (search_help.description or "")

        found = await session.call_tool("search_help", {"query": "how do I reset my password"})
        assert not found.is_error
        assert output(found)["results"][0]["title"] == "Reset your password"
        billing = await session.call_tool("search_billing", {"query": "when is my refund paid"})
        assert not billing.is_error
        assert output(billing)["results"][0]["title"] == "Refunds"
        page = await session.call_tool(
            "read_page", {"source_path": "password.md", "knowledge_base": "help"}
        )
        assert not page.is_error
        assert "A link arrives by email" in output(page)["text"]


@pytest.mark.parametrize(
    ("name", "arguments", "error_type"),
    [
        ("search_help", {"query": 5}, "invalid_arguments"),
        ("search_help", {"query": ""}, "invalid_arguments"),
        ("search_help", {"querry": "password"}, "invalid_arguments"),
        ("search_help", {"query": 10**30}, "invalid_arguments"),  # past orjson's 64 bits
        ("no_such_tool", {"query": "password"}, "unknown_function"),
        ("read_page", {"source_path": "nope.md", "knowledge_base": "help"}, "not_found"),
        ("read_page", {"source_path": "password.md", "knowledge_base": "x"}, "invalid_arguments"),
    ],
)
async def test_a_models_mistake_is_a_tool_error_not_a_failed_request(
    sidecar: Sidecar, name: str, arguments: dict[str, Any], error_type: str
) -> None:
    async with mcp_session(sidecar) as session:
        result = await session.call_tool(name, arguments)
    assert result.is_error
    assert output(result)["error"]["type"] == error_type


# JSON orjson reads (1024 levels) but does not write back (255)
DEEP_300 = "[" * 300 + "]" * 300
DEEP_220 = "[" * 220 + "]" * 220  # past what MCP's SDK parses (~200), short of orjson's 255
DEEPER = b"[" * 1000 + b"]" * 1000


@dataclass(frozen=True)
class RawParams:
    """A tools/call's params as JSON text, sent as written."""

    text: str


async def raw_mcp_calls(sc: Sidecar, params: list[Any]) -> list[dict[str, Any]]:
    """tools/call with each of ``params`` as sent, past the SDK client's own checks: the
    JSON-RPC answers."""
    async with httpx2.AsyncClient(headers={**auth(), **MCP_ACCEPT}) as http:
        opened = await http.post(url(sc, "/mcp"), json=INITIALIZE)
        headers = {"mcp-session-id": opened.headers["mcp-session-id"]}
        headers["mcp-protocol-version"] = "2025-06-18"
        answers = []
        for i, sent in enumerate(params):
            if isinstance(sent, RawParams):  # JSON no encoder writes (1e99999), as the bytes sent
                text = f'{{"jsonrpc": "2.0", "id": {i + 2}, "method": "tools/call", "params": {sent.text}}}'
                typed = {**headers, "content-type": "application/json"}
                reply = await http.post(url(sc, "/mcp"), content=text, headers=typed)
            else:
                call = {"jsonrpc": "2.0", "id": i + 2, "method": "tools/call", "params": sent}
                reply = await http.post(url(sc, "/mcp"), json=call, headers=headers)
            assert reply.status_code == 200, reply.text
            answers.append(reply.json())
    return answers


SEARCH_CALL = {
    "jsonrpc": "2.0",
    "id": 2,
    "method": "tools/call",
    "params": {"name": "search_help", "arguments": {"query": "reset my password"}},
}


async def open_session(http: httpx2.AsyncClient, sc: Sidecar) -> dict[str, str]:
    """An MCP session opened by ``http`` (its token and Accept): the headers its calls send."""
    opened = await http.post(url(sc, "/mcp"), json=INITIALIZE)
    return {
        "mcp-session-id": opened.headers["mcp-session-id"],
        "mcp-protocol-version": "2025-06-18",
    }


async def test_an_mcp_request_of_an_id_in_flight_is_refused_and_the_first_answered(
    sidecar: Sidecar, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The SDK keys a request's answer by its JSON-RPC id: a second request of an id in flight
    took the first one's answer stream, and the first waited for ever, its slot held (pipelined
    tools/call calls all of id 2 leaked two slots a round until every caller was refused). The
    second is refused 400 with a JSON-RPC error; the first is answered; the id is free again."""
    gate, waiting = asyncio.Event(), asyncio.Event()
    invoke = mcp.McpDoor._invoke

    async def held(self: Any, *args: Any) -> Any:
        if not waiting.is_set():  # the first call waits, in flight, until the test lets it go
            waiting.set()
            await gate.wait()
        return await invoke(self, *args)

    monkeypatch.setattr(mcp.McpDoor, "_invoke", held)
    call = SEARCH_CALL
    async with httpx2.AsyncClient(headers={**auth(), **MCP_ACCEPT}) as http:
        headers = await open_session(http, sidecar)
        first = asyncio.create_task(http.post(url(sidecar, "/mcp"), json=call, headers=headers))
        async with asyncio.timeout(LIVENESS_S):
            await waiting.wait()
        second = await http.post(url(sidecar, "/mcp"), json=call, headers=headers)
        gate.set()
        async with asyncio.timeout(LIVENESS_S):
            answered = await first
        again = await http.post(url(sidecar, "/mcp"), json=call, headers=headers)
    assert second.status_code == 400
    assert second.json()["id"] == 2
    assert second.json()["error"]["code"] == types.INVALID_REQUEST
    assert "a request of id 2 is in flight in this session" in second.json()["error"]["message"]
    assert answered.status_code == 200
    assert answered.json()["id"] == 2
    assert again.status_code == 200
    assert sidecar.guards is not None
    await eventually(lambda: sidecar.guards.limit.in_flight == 0)


async def test_an_mcp_request_without_an_answer_ends_at_its_deadline_and_frees_its_slot(
    sidecar: Sidecar, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The SDK waits for a request's answer with no deadline of its own: one that never came
    held its slot for ever. Its answer must start within MCP_ANSWER_S: then a 503 says to send
    it again, and the slot is free."""
    monkeypatch.setattr(http_door, "MCP_ANSWER_S", 0.3)

    async def never(self: Any, *args: Any) -> Any:
        await asyncio.Event().wait()

    monkeypatch.setattr(mcp.McpDoor, "_invoke", never)
    call = SEARCH_CALL
    async with httpx2.AsyncClient(headers={**auth(), **MCP_ACCEPT}) as http:
        headers = await open_session(http, sidecar)
        reply = await http.post(url(sidecar, "/mcp"), json=call, headers=headers)
    assert reply.status_code == 503
    assert reply.json()["error"]["message"] == (
        "the MCP request had no answer within 0.3 s: send it again"
    )
    assert sidecar.guards is not None
    await eventually(lambda: sidecar.guards.limit.in_flight == 0)


async def test_an_mcp_session_header_over_the_limit_is_a_400_not_the_models_error(
    sidecar: Sidecar,
) -> None:
    """Attack s23: MCP answered an ``x-voxrecall-session`` of 300 characters with a tool error
    naming ``session_id``, which the model never sent and cannot change; ``/tools/`` refused it
    400 naming the header, as the docs say. MCP now does the same, unsearched."""
    async with httpx2.AsyncClient(headers={**auth(), **MCP_ACCEPT}) as http:
        opened = await http.post(url(sidecar, "/mcp"), json=INITIALIZE)
        headers = {
            "mcp-session-id": opened.headers["mcp-session-id"],
            "mcp-protocol-version": "2025-06-18",
            SESSION_HEADER: "s" * 300,
        }
        params = {"name": "search_help", "arguments": {"query": "reset my password"}}
        call = {"jsonrpc": "2.0", "id": 7, "method": "tools/call", "params": params}
        reply = await http.post(url(sidecar, "/mcp"), json=call, headers=headers)
    assert reply.status_code == 400
    error = reply.json()
    assert error["id"] == 7
    assert error["error"]["message"] == (
        f"{SESSION_HEADER} is 300 characters; the limit is 256: send the platform's call id"
    )


@pytest.mark.parametrize("number", ["1e99999", "-1e99999"])
async def test_a_number_past_a_double_is_invalid_json_as_on_the_other_doors(
    sidecar: Sidecar, number: str
) -> None:
    """Attack s17 F6: the SDK read ``1e99999`` as infinity, orjson wrote it as null and the
    search ran, where gRPC ``InvokeTool`` and ``/tools/`` answer invalid_json (orjson refuses
    the number in their text)."""
    sent = RawParams(
        f'{{"name": "search_help", "arguments": {{"query": "reset my password", "sources": {number}}}}}'
    )
    (answer,) = await raw_mcp_calls(sidecar, [sent])
    assert "error" not in answer, answer
    assert answer["result"]["isError"]
    error = orjson.loads(answer["result"]["content"][0]["text"])["error"]
    assert error["type"] == "invalid_json"
    assert "not valid JSON (a number is " in error["message"]
    assert '"arguments": {"query": "..."}' in error["message"]


async def test_arguments_sent_as_a_json_string_are_taken_as_the_tool_webhook_takes_them(
    sidecar: Sidecar,
) -> None:
    """The attack: a model's arguments as the JSON string it emitted got a JSON-RPC error
    ("Invalid request parameters", which the model never reads); /tools/ took them."""
    sent = [{"name": "search_help", "arguments": '{"query": "reset my password"}'}]
    (answer,) = await raw_mcp_calls(sidecar, sent)
    assert "error" not in answer
    assert not answer["result"]["isError"]
    assert "Reset your password" in answer["result"]["content"][0]["text"]


@pytest.mark.parametrize(
    ("params", "error_type", "says"),
    [
        ({"name": "search_help", "arguments": ["reset password"]}, "invalid_arguments", "object"),
        ({"name": "search_help", "arguments": "reset password"}, "invalid_json", "not valid JSON"),
        ({"name": "search_help", "arguments": '"a string"'}, "invalid_arguments", "object"),
        ({"name": "search_help", "arguments": 5}, "invalid_arguments", "object"),
        (
            {"name": "search_help", "arguments": orjson.dumps({"query": "x" * 70_000}).decode()},
            "invalid_arguments",
            "the limit is 65536",
        ),
        ({"arguments": {"query": "x"}}, "invalid_arguments", "no name was sent"),
        ({"name": 5, "arguments": {"query": "x"}}, "invalid_arguments", "name 5 was sent"),
        (["search_help"], "invalid_arguments", "tools/call takes an object"),
        # attack s23: a name nested past what repr recurses through, and arguments (a model's
        # JSON text) nested past what orjson writes again, answered 500 with a traceback;
        # arguments nested past what the SDK parses (~200), a JSON-RPC error
        (RawParams(f'{{"name": {DEEPER.decode()}}}'), "invalid_arguments", "name [[[[...]]]]"),
        (
            {"name": "search_help", "arguments": f'{{"query": {DEEP_300}}}'},
            "invalid_arguments",
            "more than 32 levels deep",
        ),
        (
            {"name": "search_help", "arguments": f'{{"query": {DEEP_220}}}'},
            "invalid_arguments",
            "more than 32 levels deep",
        ),
        (
            RawParams(f'{{"name": "search_help", "arguments": {{"query": {DEEP_220}}}}}'),
            "invalid_arguments",
            "more than 32 levels deep",
        ),
    ],
)
async def test_malformed_tool_call_params_are_a_tool_error_saying_what_to_send(
    store: Path, local_embedder: Embedder, secrets: None, params: Any, error_type: str, says: str
) -> None:
    """The attack: arguments as a list, a missing or numeric name, got a JSON-RPC error with
    no word of what to send, not a tool result the model reads."""
    config = sidecar_config(store, auth=AUTH, http={**HTTP, "max_body_bytes": 128 * 1024})
    async with running(config, local_embedder) as sc:
        (answer,) = await raw_mcp_calls(sc, [params])
    assert "error" not in answer, answer
    assert answer["result"]["isError"]
    error = orjson.loads(answer["result"]["content"][0]["text"])["error"]
    assert error["type"] == error_type
    assert says in error["message"]
    assert '"arguments": {"query": "..."}' in error["message"] or "65536" in error["message"]


async def test_read_page_takes_the_path_a_search_result_gave(sidecar: Sidecar) -> None:
    """A search result names the page ``path``; read_page takes that name, and ReadPage's
    ``source_path`` too, as its schema lists them."""
    async with mcp_session(sidecar) as session:
        found = await session.call_tool("search_help", {"query": "how do I reset my password"})
        path = output(found)["results"][0]["path"]
        by_path = await session.call_tool("read_page", {"path": path, "knowledge_base": "help"})
        by_source_path = await session.call_tool(
            "read_page", {"source_path": path, "knowledge_base": "help"}
        )
    assert not by_path.is_error
    assert not by_source_path.is_error
    assert output(by_path)["text"] == output(by_source_path)["text"]
    assert "A link arrives by email" in output(by_path)["text"]


@pytest.mark.parametrize(
    ("arguments", "says"),
    [
        ({"knowledge_base": "help"}, "path is required"),
        ({"path": 5, "knowledge_base": "help"}, "path must be one string"),
        ({"path": "password.md", "source_path": "refunds.md", "knowledge_base": "help"}, "one"),
        ({"path": "password.md", "knowledge_base": "help", "page": 2}, "does not take page"),
        ({"path": "password.md"}, "knowledge_base must be one of help, billing; got nothing"),
    ],
)
async def test_a_wrong_read_page_call_names_the_argument_to_change(
    sidecar: Sidecar, arguments: dict[str, Any], says: str
) -> None:
    async with mcp_session(sidecar) as session:
        result = await session.call_tool("read_page", arguments)
    assert result.is_error
    error = output(result)["error"]
    assert error["type"] == "invalid_arguments"
    assert says in error["message"]


@pytest.mark.parametrize(
    "arguments",
    [
        {"path": ["password.md"], "knowledge_base": "help"},
        {"source_path": {"a": 1}, "knowledge_base": "help"},
        {"path": "password.md", "source_path": ["password.md"], "knowledge_base": "help"},
    ],
)
def test_a_list_or_object_path_is_an_argument_error_not_a_crash(arguments: dict[str, Any]) -> None:
    """An unhashable path is named as the argument to change, the tool's error output, rather
    than a TypeError the MCP layer answers with a JSON-RPC error and a traceback."""
    with pytest.raises(ToolCallError, match="path must be one string"):
        page_arguments(arguments, ["help", "billing"])


@pytest.mark.parametrize(
    "arguments",
    [
        {"path": "password.md", "knowledge_base": ""},
        {"path": "password.md", "source_path": "", "knowledge_base": ""},
        {"path": "", "source_path": "password.md", "source": "", "knowledge_base": None},
    ],
)
def test_read_page_takes_empty_optional_arguments_as_not_given(arguments: dict[str, Any]) -> None:
    """Models fill every listed property, "" for those they have no value for: with one base,
    "" is no base named, and "" beside a path is no second path."""
    assert page_arguments(arguments, ["help"]) == ("help", "password.md", "", 0)


def test_read_pages_arguments_are_checked_without_building_its_schema(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The names are the schema's, taken once: a call built the whole schema for its keys."""
    assert tuple(mcp._page_schema(["help", "billing"])["properties"]) == PAGE_ARGUMENTS
    monkeypatch.setattr(mcp, "_page_schema", lambda bases: pytest.fail("a schema per call"))
    with pytest.raises(
        ToolCallError, match=f"does not take colour; it takes {', '.join(PAGE_ARGUMENTS)}$"
    ):
        page_arguments({"path": "password.md", "colour": "red"}, ["help"])


def test_an_empty_knowledge_base_among_several_is_still_asked_for() -> None:
    with pytest.raises(
        ToolCallError, match="knowledge_base must be one of help, billing; got nothing"
    ):
        page_arguments({"path": "password.md", "knowledge_base": ""}, ["help", "billing"])


async def test_an_unknown_tool_error_names_every_tool_read_page_too(sidecar: Sidecar) -> None:
    async with mcp_session(sidecar) as session:
        result = await session.call_tool("no_such_tool", {"query": "password"})
    message = output(result)["error"]["message"]
    assert message.endswith("known: search_help, search_billing, read_page")


async def test_a_scoped_token_neither_sees_nor_calls_what_it_may_not(sidecar: Sidecar) -> None:
    async with mcp_session(sidecar, TOKEN_B) as session:
        listed = await session.list_tools()
        assert [t.name for t in listed.tools] == ["search_billing", "read_page"]
        assert listed.tools[1].input_schema["properties"].keys() == {
            "path",
            "source_path",
            "source",
            "offset",
            "knowledge_base",
        }
        refused = await session.call_tool("search_help", {"query": "reset password"})
        assert refused.is_error
        assert output(refused)["error"]["type"] == "unknown_function"  # as if it did not exist
        page = await session.call_tool(
            "read_page", {"source_path": "password.md", "knowledge_base": "help"}
        )
        assert page.is_error
        allowed = await session.call_tool("search_billing", {"query": "refund"})
        assert not allowed.is_error


async def test_mcp_without_a_token_is_401_with_a_json_error(sidecar: Sidecar) -> None:
    async with httpx2.AsyncClient() as http:
        reply = await http.post(url(sidecar, "/mcp"), json={"jsonrpc": "2.0", "id": 1})
    assert reply.status_code == 401
    assert reply.headers["www-authenticate"] == "Bearer"
    assert "authorization: Bearer" in reply.json()["error"]["message"]


INITIALIZE = {
    "jsonrpc": "2.0",
    "id": 1,
    "method": "initialize",
    "params": {
        "protocolVersion": "2025-06-18",
        "capabilities": {},
        "clientInfo": {"name": "test", "version": "1"},
    },
}
MCP_ACCEPT = {"accept": "application/json, text/event-stream"}


@pytest.mark.parametrize("method", [[], {"a": 1}], ids=["list", "object"])
async def test_an_mcp_method_that_is_not_a_string_is_the_sdks_error_not_a_500(
    sidecar: Sidecar, method: Any
) -> None:
    """Attack s20: the door names each MCP call by its method, looked up in the set of known
    ones: a list or an object there raised TypeError (unhashable), a 500 INTERNAL. It is now
    "MCP other", and the SDK answers the request as it answers any malformed one."""
    async with httpx2.AsyncClient() as http:
        reply = await http.post(
            url(sidecar, "/mcp"),
            json={"jsonrpc": "2.0", "id": 1, "method": method, "params": {}},
            headers=auth(**MCP_ACCEPT),
        )
    assert 400 <= reply.status_code < 500
    assert "INTERNAL" not in reply.text
    assert reply.json()["error"]["code"] < 0  # JSON-RPC's error for a request malformed


async def test_one_callers_mcp_sessions_cannot_lock_another_out(
    store: Path, local_embedder: Embedder, secrets: None, caplog: pytest.LogCaptureFixture
) -> None:
    """max_sessions = 4 between two callers: each holds at most its share of 2. The first
    opens sessions (initialize, never DELETE) until refused, 429 naming its share (where it
    took all four and the other's initialize got 503); the other still opens one; a session
    ended gives its share back. The SDK's line per session is not logged."""
    config = sidecar_config(store, auth=AUTH, http=HTTP, max_sessions=4)
    caplog.set_level(logging.INFO)
    async with running(config, local_embedder) as sc, httpx2.AsyncClient() as http:

        async def initialize(token: str) -> httpx2.Response:
            return await http.post(
                url(sc, "/mcp"), json=INITIALIZE, headers=auth(token, **MCP_ACCEPT)
            )

        opened = []
        for _ in range(5):
            reply = await initialize(TOKEN_A)
            if reply.status_code != 200:
                break
            opened.append(reply.headers["mcp-session-id"])
        assert len(opened) == 2
        assert reply.status_code == 429, reply.text
        assert "max_sessions = 2" in reply.json()["error"]["message"]

        other = await initialize(TOKEN_B)
        assert other.status_code == 200, other.text

        ended = await http.delete(
            url(sc, "/mcp"), headers=auth(TOKEN_A, **{"mcp-session-id": opened[0]})
        )
        assert ended.status_code == 200, ended.text
        assert (await initialize(TOKEN_A)).status_code == 200
    sdk = [r for r in caplog.records if r.name in SDK_SESSION_LOGGERS]
    assert not [r for r in sdk if r.levelno < logging.WARNING]  # two lines a session, before
    assert "closed 3 MCP session(s)" in caplog.text  # the drain: one line


async def test_mcp_sessions_count_in_the_sessions_bytes_and_are_bounded_by_them(
    store: Path, local_embedder: Embedder
) -> None:
    """The attack: an MCP session holds ~42 KB in the SDK, counted nowhere, so the default
    shares let 10,000 of them hold ~420 MB past ``session_memory_bytes``. Each counts
    ``MCP_SESSION_BYTES`` there: the budget of 4 is full at the 4th (429 naming the key), and a
    session ended gives its bytes back."""
    budget = 4 * mcp.MCP_SESSION_BYTES
    limits = {"max_session_bytes": 32768, "session_memory_bytes": budget}
    config = sidecar_config(store, http={"listen": "127.0.0.1:0"}, **limits)
    async with running(config, local_embedder) as sc, httpx2.AsyncClient() as http:
        replies = [
            await http.post(url(sc, "/mcp"), json=INITIALIZE, headers=MCP_ACCEPT) for _ in range(5)
        ]
        assert [r.status_code for r in replies] == [200, 200, 200, 200, 429]
        assert "session_memory_bytes" in replies[-1].json()["error"]["message"]
        assert replies[-1].json()["jsonrpc"] == "2.0"
        assert sc.engine.sessions.usage().bytes == budget
        sid = replies[0].headers["mcp-session-id"]
        ended = await http.delete(url(sc, "/mcp"), headers={**MCP_ACCEPT, "mcp-session-id": sid})
        assert ended.status_code == 200, ended.text
        assert sc.engine.sessions.usage().bytes == budget - mcp.MCP_SESSION_BYTES
        again = await http.post(url(sc, "/mcp"), json=INITIALIZE, headers=MCP_ACCEPT)
        assert again.status_code == 200, again.text


def fat_initialize(payload_bytes: int) -> dict[str, Any]:
    """An initialize carrying ``payload_bytes`` of small strings in its experimental
    capabilities (what the SDK keeps with the session)."""
    experimental = {f"k{i}": ["x" * 20] * 4 for i in range(payload_bytes // 110)}
    params = {**INITIALIZE["params"], "capabilities": {"experimental": experimental}}  # type: ignore[dict-item]
    return {**INITIALIZE, "params": params}


async def test_an_initialize_over_its_byte_limit_is_refused_and_opens_no_session(
    store: Path, local_embedder: Embedder
) -> None:
    """The attack: an initialize carrying ~245 KB in ``capabilities.experimental`` was kept with
    its session, which counts 44 KiB: 1,850 sessions held ~1.1 GB against a 256 MiB budget. One
    over ``MAX_INITIALIZE_BYTES`` is now a JSON-RPC error naming the limit, and opens none (the
    SDK opened one even for params it refused); so is one sent within a session."""
    config = sidecar_config(store, http={"listen": "127.0.0.1:0"})
    fat = fat_initialize(245_000)
    async with running(config, local_embedder) as sc, httpx2.AsyncClient() as http:
        refused = await http.post(url(sc, "/mcp"), json=fat, headers=MCP_ACCEPT)
        assert refused.status_code == 400, refused.text
        error = refused.json()["error"]
        assert error["code"] == -32602  # INVALID_PARAMS
        assert f"the limit is {mcp.MAX_INITIALIZE_BYTES} bytes" in error["message"]
        assert refused.json()["id"] == fat["id"]  # the request's, not null: a client matches by it
        assert "mcp-session-id" not in refused.headers
        assert sc.engine.sessions.usage().bytes == 0
        opened = await http.post(url(sc, "/mcp"), json=INITIALIZE, headers=MCP_ACCEPT)
        assert opened.status_code == 200, opened.text
        session = {**MCP_ACCEPT, "mcp-session-id": opened.headers["mcp-session-id"]}
        again = await http.post(url(sc, "/mcp"), json=fat, headers=session)
        assert again.status_code == 400, again.text
        assert f"the limit is {mcp.MAX_INITIALIZE_BYTES} bytes" in again.json()["error"]["message"]
        named = await http.post(url(sc, "/mcp"), json={**fat, "id": "init-7"}, headers=MCP_ACCEPT)
        assert named.json()["id"] == "init-7"
        odd = await http.post(url(sc, "/mcp"), json={**fat, "id": [1]}, headers=MCP_ACCEPT)
        assert odd.json()["id"] is None  # no id a request may have: null, as JSON-RPC says


async def test_an_sdk_client_reads_why_its_initialize_was_refused(
    store: Path, local_embedder: Embedder
) -> None:
    """The MCP SDK's own client raises the refusal's message (not "Server returned an error
    response")."""
    config = sidecar_config(store, http={"listen": "127.0.0.1:0"})
    fat = types.Implementation(name="x" * 20_000, version="1")
    async with (
        running(config, local_embedder) as sc,
        httpx2.AsyncClient() as http,
        streamable_http_client(url(sc, "/mcp"), http_client=http) as (read, write),
        ClientSession(read, write, client_info=fat) as session,
    ):
        with pytest.raises(MCPError, match=f"the limit is {mcp.MAX_INITIALIZE_BYTES} bytes"):
            await session.initialize()


async def test_mcp_sessions_filling_the_bytes_never_evict_a_live_calls_session(
    store: Path, local_embedder: Embedder
) -> None:
    """The attack: without auth every MCP session's bytes go to the one owner every call's
    session has, and a reservation evicted that owner's least recently used sessions: enough
    ``initialize`` calls (~6,000 by default) took live calls' context. Now the MCP sessions
    that do not fit beside it are refused (429), and the call keeps its context."""
    budget = 4 * mcp.MCP_SESSION_BYTES
    limits = {"max_session_bytes": 32768, "session_memory_bytes": budget}
    config = sidecar_config(store, http={"listen": "127.0.0.1:0"}, **limits)
    async with (
        running(config, local_embedder) as sc,
        grpc.aio.insecure_channel(f"127.0.0.1:{sc.port}") as channel,
        httpx2.AsyncClient() as http,
    ):
        stub = pb_grpc.RetrievalStub(channel)  # type: ignore[no-untyped-call]
        turn = pb.TurnRequest(session_id="call-1", text="reset my password", is_final=True)
        assert (await stub.Turn(turn)).chunks
        replies = [
            await http.post(url(sc, "/mcp"), json=INITIALIZE, headers=MCP_ACCEPT) for _ in range(5)
        ]
        assert [r.status_code for r in replies] == [200, 200, 200, 429, 429]
        assert "session_memory_bytes" in replies[-1].json()["error"]["message"]
        assert replies[-1].json()["jsonrpc"] == "2.0"
        kept = sc.engine.sessions.peek("call-1")
        assert kept is not None
        assert [said.text for said in kept.turns] == ["reset my password"]
        assert sc.engine.sessions.usage().bytes <= budget


async def test_an_sdk_client_reads_why_its_session_was_refused_for_bytes(
    store: Path, local_embedder: Embedder
) -> None:
    """The 429 for sessions filling their bytes was the door's own JSON, and the MCP SDK's
    client showed "Server returned an error response"; now it is a JSON-RPC error with the
    request's id, and the client raises its message, naming ``session_memory_bytes``."""
    limits = {"max_session_bytes": 32768, "session_memory_bytes": mcp.MCP_SESSION_BYTES}
    config = sidecar_config(store, http={"listen": "127.0.0.1:0"}, **limits)
    async with running(config, local_embedder) as sc, httpx2.AsyncClient() as http:
        first = await http.post(url(sc, "/mcp"), json=INITIALIZE, headers=MCP_ACCEPT)
        assert first.status_code == 200
        second = await http.post(url(sc, "/mcp"), json=INITIALIZE, headers=MCP_ACCEPT)
        assert second.status_code == 429
        assert second.json()["id"] == INITIALIZE["id"]
        async with (
            streamable_http_client(url(sc, "/mcp"), http_client=http) as (read, write),
            ClientSession(read, write) as session,
        ):
            with pytest.raises(MCPError, match="session_memory_bytes"):
                await session.initialize()


async def counted_over_allocated(sc: Sidecar, body: dict[str, Any]) -> float:
    """What 100 MCP sessions opened by ``body`` count in the sessions' bytes, over what
    tracemalloc sees the process allocate while they open (after 10 that build what is built
    once: the connection, the SDK's first objects)."""
    async with httpx2.AsyncClient() as http:

        async def initialize() -> None:
            reply = await http.post(url(sc, "/mcp"), json=body, headers=MCP_ACCEPT)
            assert reply.status_code == 200, reply.text

        for _ in range(10):
            await initialize()
        counted = sc.engine.sessions.usage().bytes
        gc.collect()
        tracemalloc.start()
        start = tracemalloc.get_traced_memory()[0]
        for _ in range(100):
            await initialize()
        gc.collect()
        used = tracemalloc.get_traced_memory()[0] - start
        tracemalloc.stop()
    return (sc.engine.sessions.usage().bytes - counted) / used


async def test_what_an_mcp_session_counts_is_what_it_allocates(
    store: Path, local_embedder: Embedder
) -> None:
    """``MCP_SESSION_BYTES`` stays honest: what 100 sessions (initialize alone) count in the
    sessions' bytes is within a quarter of what tracemalloc sees the process allocate for them."""
    config = sidecar_config(store, http={"listen": "127.0.0.1:0", "max_connections_per_ip": 0})
    async with running(config, local_embedder) as sc:
        assert 0.75 < await counted_over_allocated(sc, INITIALIZE) < 1.25


def costly_initialize(size: int) -> dict[str, Any]:
    """An initialize of at most ``size`` bytes whose params cost the most to keep: empty lists,
    each a Python list of 56 bytes for 3 bytes of JSON."""
    body = fat_initialize(0)
    experimental = body["params"]["capabilities"]["experimental"]
    while len(orjson.dumps(body)) < size - 200:
        experimental[f"k{len(experimental)}"] = {"v": [[] for _ in range(20)]}
    return body


async def test_a_session_counts_what_its_initialize_keeps(
    store: Path, local_embedder: Embedder
) -> None:
    """The attack's shape within the limit: a session opened by an initialize of ~8 KiB of
    empty lists held ~240 KB, counted 44 KiB. It now counts its initialize's bytes too
    (``session_bytes``): 100 of them count within a quarter of what tracemalloc sees."""
    config = sidecar_config(store, http={"listen": "127.0.0.1:0", "max_connections_per_ip": 0})
    body = costly_initialize(mcp.MAX_INITIALIZE_BYTES)
    async with running(config, local_embedder) as sc:
        assert 0.75 < await counted_over_allocated(sc, body) < 1.25


async def test_without_auth_one_address_cannot_lock_another_out_of_mcp(
    store: Path, local_embedder: Embedder
) -> None:
    """No callers: each client address holds at most the share of max_sessions that it may
    hold of the connections (4 x 2 / 4 = 2). 127.0.0.2 opens two and is refused a third (429,
    naming the share; it took all four before, and everyone else's initialize got 503);
    127.0.0.1 still opens one."""
    http = {"listen": "127.0.0.1:0", "max_connections": 4, "max_connections_per_ip": 2}
    config = sidecar_config(store, http=http, max_sessions=4)
    async with running(config, local_embedder) as sc:

        async def initialize(source: str) -> httpx2.Response:
            transport = httpx2.AsyncHTTPTransport(local_address=source)
            async with httpx2.AsyncClient(transport=transport) as client:
                return await client.post(url(sc, "/mcp"), json=INITIALIZE, headers=MCP_ACCEPT)

        replies = [await initialize("127.0.0.2") for _ in range(3)]
        assert [r.status_code for r in replies] == [200, 200, 429], replies[-1].text
        assert "address 127.0.0.2 has 2 MCP sessions open" in replies[-1].json()["error"]["message"]
        other = await initialize("127.0.0.1")
        assert other.status_code == 200, other.text


def _ipv6_loopback() -> bool:
    try:
        with socket.socket(socket.AF_INET6, socket.SOCK_STREAM) as probe:
            probe.bind(("::1", 0))
    except OSError:
        return False
    return True


@pytest.mark.skipif(not _ipv6_loopback(), reason="no IPv6 loopback here")
async def test_without_auth_an_ipv6_client_s_sessions_count_against_its_64(
    store: Path, local_embedder: Embedder
) -> None:
    """An IPv6 client may speak from any address of its /64, so its share is the /64's: the
    refusal names ``::/64``, not the one address (``sidecar.edge.addresses``)."""
    http = {"listen": "[::1]:0", "max_connections": 4, "max_connections_per_ip": 2}
    config = sidecar_config(store, http=http, max_sessions=4)
    async with running(config, local_embedder) as sc, httpx2.AsyncClient() as client:
        replies = [
            await client.post(
                f"http://[::1]:{sc.http_port}/mcp", json=INITIALIZE, headers=MCP_ACCEPT
            )
            for _ in range(3)
        ]
    assert [r.status_code for r in replies] == [200, 200, 429], replies[-1].text
    assert "address ::/64 has 2 MCP sessions open" in replies[-1].json()["error"]["message"]


async def test_a_base_with_no_snapshot_is_a_tool_error_and_not_ready(
    tmp_path: Path, store: Path, local_embedder: Embedder
) -> None:
    config = parse_config(
        {
            "knowledge_base": [
                {"name": "help", "source": [{"name": "p", "type": "markdown", "path": "p"}]}
            ],
            "function": [{"name": "search_help", "description": "Help.", "knowledge_base": "help"}],
            "sidecar": {
                "store": str(tmp_path / "empty"),
                "listen": "127.0.0.1:0",
                "http": {"listen": "127.0.0.1:0"},
            },
        },
        base=tmp_path,
    )
    async with running(config, local_embedder) as sc:
        async with mcp_session(sc) as session:
            result = await session.call_tool("search_help", {"query": "password"})
        assert result.is_error
        assert output(result)["error"]["type"] == "unavailable"
        async with httpx2.AsyncClient() as http:
            ready = await http.get(url(sc, "/readyz"))
            alive = await http.get(url(sc, "/healthz"))
    assert ready.status_code == 503
    assert ready.json() == {
        "status": "not ready",
        "state": "LOADING",
        "waiting_for": ["help"],
        "waiting_count": 1,
    }
    assert alive.status_code == 200


async def test_tool_calls_join_the_mcp_sessions_context(sidecar: Sidecar) -> None:
    seen: set[str] = set()

    async def note(response: httpx2.Response) -> None:
        seen.update(v for k, v in response.headers.items() if k == "mcp-session-id")

    async with (
        httpx2.AsyncClient(headers=auth(), event_hooks={"response": [note]}) as http,
        streamable_http_client(url(sidecar, "/mcp"), http_client=http) as (read, write),
        ClientSession(read, write) as session,
    ):
        await session.initialize()
        await session.call_tool("search_help", {"query": "how do I export my data"})
        await session.call_tool("search_help", {"query": "how do I reset my password"})
    (mcp_session_id,) = seen
    sessions.owner.set("default")
    session_state = sidecar.engine.sessions.peek(mcp_session_id)
    assert session_state is not None
    assert len(session_state.retained) == 2  # both calls' results: one retained context


# -- Vapi -------------------------------------------------------------------------------------

CALL_ID = "vapi-call-0001"
GREETING = {"role": "assistant", "content": "Hi, this is Notes support. How can I help?"}


def vapi_request(messages: list[dict[str, Any]]) -> dict[str, Any]:
    """The shape Vapi posts (its other call metadata trimmed to what matters here)."""
    return {
        "message": {
            "type": "knowledge-base-request",
            "timestamp": 1764600000000,
            "messages": messages,
            "messagesOpenAIFormatted": messages,
            "call": {"id": CALL_ID, "orgId": "org-1", "type": "webCall"},
        }
    }


async def vapi(sc: Sidecar, messages: list[dict[str, Any]], **headers: str) -> httpx2.Response:
    return await post_vapi_kb(sc, vapi_request(messages), **headers)


async def post_vapi_kb(
    sc: Sidecar, body: bytes | dict[str, Any], **headers: str
) -> httpx2.Response:
    """A Vapi knowledge-base request of ``body`` (bytes as they are, or JSON), with the shared
    secret and the token."""
    sent: dict[str, Any] = {"content": body} if isinstance(body, bytes) else {"json": body}
    async with httpx2.AsyncClient() as http:
        return await http.post(
            url(sc, "/vapi/knowledge-base"),
            headers=auth(**{"x-vapi-secret": VAPI_SECRET, **headers}),
            **sent,
        )


async def test_a_vapi_request_retried_as_it_was_gets_the_same_answer_at_the_text_cap(
    sidecar: Sidecar,
) -> None:
    """The attack: a retried request whose last turn was near the text cap answered 400 "text is
    4791 characters" (its folded query searched again as if the caller had sent it). A retry
    is answered with what the first request was."""
    words = " ".join(f"export{i}" for i in range(800))
    long_turn = ("How do I export my data? " + words)[: MAX_TEXT_CHARS - 1]
    messages = [
        GREETING,
        {"role": "user", "content": "How do I export my data?"},
        {"role": "bot", "message": "Go to Settings, Privacy, Export: it builds a zip."},
        {"role": "user", "content": long_turn},
    ]
    first = await vapi(sidecar, messages, **{SESSION_HEADER: "retried-call"})
    again = await vapi(sidecar, messages, **{SESSION_HEADER: "retried-call"})
    assert first.status_code == again.status_code == 200, again.text
    assert first.json()["documents"]  # an answer to lose
    assert again.json() == first.json()


async def test_a_vapi_retry_answers_what_its_request_was_answered_even_nothing(
    store: Path, local_embedder: Embedder, secrets: None
) -> None:
    """A review: the retry answered the session's last kept search, which is an earlier turn's
    when the retried turn found nothing (searches that find nothing are not kept), and a request
    ending on the agent's message answered nothing but its retry the turn before's chunks."""
    config = sidecar_config(store, auth=AUTH, http=HTTP, min_score=0.45)
    async with running(config, local_embedder) as sc:
        asked = [GREETING, {"role": "user", "content": "How do I export my data?"}]
        off_topic = [
            *asked,
            {"role": "bot", "message": "Is there anything else I can help with?"},
            {"role": "user", "content": "Who won the football world cup in 1998?"},
        ]
        header = {SESSION_HEADER: "retry-nothing"}
        assert (await vapi(sc, asked, **header)).json()["documents"]
        first, again = [await vapi(sc, off_topic, **header) for _ in range(2)]
        assert first.json() == again.json() == {"documents": []}
        answered = [*off_topic, {"role": "bot", "message": "France won it."}]
        header = {SESSION_HEADER: "retry-after-the-agent"}
        await vapi(sc, asked, **header)
        first, again = [await vapi(sc, answered[:2] + answered[-1:], **header) for _ in range(2)]
        assert first.json() == again.json() == {"documents": []}


async def test_a_vapi_call_sequence_resolves_the_follow_up_and_feeds_each_message_once(
    sidecar: Sidecar,
) -> None:
    first = [
        {"role": "system", "content": "You are the support agent of Notes."},
        GREETING,
        {"role": "user", "content": "How do I export my data?"},
    ]
    reply = await vapi(sidecar, first)
    assert reply.status_code == 200
    docs = reply.json()["documents"]
    assert docs[0]["content"].startswith("Export your data")
    assert set(docs[0]) == {"content", "similarity", "uuid"}

    second = [
        *first,
        {"role": "bot", "message": "Go to Settings, Privacy, Export: it builds a zip."},
        {"role": "user", "content": "and how long does it take?"},
    ]
    reply = await vapi(sidecar, second)
    assert reply.json()["documents"][0]["content"].startswith("Export your data")
    again = await vapi(sidecar, second)  # a retry of the same request: the same answer
    assert again.json()["documents"][0]["uuid"] == reply.json()["documents"][0]["uuid"]

    sessions.owner.set("default")
    session = sidecar.engine.sessions.peek(CALL_ID)
    assert session is not None
    assert session.turn_count == 4  # greeting, question, answer, follow-up: each once
    assert [t.text for t in session.turns][-1] == "and how long does it take?"


async def test_another_callers_vapi_requests_cannot_make_a_call_feed_its_turns_twice(
    store: Path, local_embedder: Embedder, secrets: None
) -> None:
    """The attack: what each call was fed was one table of ``max_sessions`` calls for every
    caller, least recently used first: another caller's requests of no messages, each a new
    call id, pushed a live call's out, and its next request fed its turns again (each user turn
    a search). It is kept in the call's own session, under its caller's quota."""
    config = sidecar_config(store, auth=AUTH, http=HTTP, max_sessions=8)
    async with running(config, local_embedder) as sc:
        asked = [GREETING, {"role": "user", "content": "How do I export my data?"}]
        assert (await vapi(sc, asked)).json()["documents"]
        async with httpx2.AsyncClient() as http:
            for i in range(40):  # another caller's, and the victim's own, requests feeding nothing
                body = vapi_request([] if i % 2 else [{"role": "system", "content": "Be kind."}])
                body["message"]["call"]["id"] = f"flood-{i}"
                token = TOKEN_B if i < 20 else TOKEN_A
                headers = auth(token, **{"x-vapi-secret": VAPI_SECRET})
                reply = await http.post(url(sc, "/vapi/knowledge-base"), json=body, headers=headers)
                assert reply.status_code == 200, reply.text
        follow_up = [
            *asked,
            {"role": "bot", "message": "Go to Settings, Privacy, Export: it builds a zip."},
            {"role": "user", "content": "and how long does it take?"},
        ]
        assert (await vapi(sc, follow_up)).status_code == 200
        sessions.owner.set("default")
        session = sc.engine.sessions.peek(CALL_ID)
        assert session is not None
        assert session.turn_count == 4  # each message fed once
        assert sc.engine.sessions.usage("billing-agent") == sessions.Usage(0, 0)


def test_a_vapi_calls_fed_state_is_counted_in_its_sessions_bytes() -> None:
    """``FED_BYTES`` stays honest: what 500 sessions' fed states count is within a quarter of
    what tracemalloc sees them allocate (their strings made beforehand, as a request's are)."""
    store = sessions.SessionStore(1000, 60.0, 3)
    queries = [f"{i:04d} how long does an export take" for i in range(500)]
    answers = [tuple(f"{i:04d}-chunk-{j}" for j in range(5)) for i in range(500)]
    held = [store.get(f"call-{i}") for i in range(500)]
    before = store.bytes
    tracemalloc.start()
    start = tracemalloc.get_traced_memory()[0]
    for i, session in enumerate(held):
        digest = hashlib.blake2b(str(i).encode(), digest_size=16).digest()
        session.keep_door_state(webhooks_module.Fed(1000 + i, digest, queries[i], answers[i]), 0)
    used = tracemalloc.get_traced_memory()[0] - start
    tracemalloc.stop()
    for session in held:
        assert isinstance(session.door_state, webhooks_module.Fed)
        session.keep_door_state(session.door_state, session.door_state.size())
    strings = sum(sys.getsizeof(s) for s in (*queries, *(i for a in answers for i in a)))
    tuples = sum(map(sys.getsizeof, answers))
    assert 0.75 < (store.bytes - before) / (used + strings + tuples) < 1.25


async def test_the_hooks_see_each_vapi_turns_timings_and_no_chunks_are_built_for_them(
    store: Path, local_embedder: Embedder, secrets: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The metrics hook reads whether a turn searched and its timings; Vapi answers documents,
    so the hooks get those and no chunk messages are built for them."""
    seen: list[tuple[str, Any]] = []
    real = Metrics.response

    def spied(self: Metrics, call: Any, message: Any) -> None:
        seen.append((call.method, message))
        real(self, call, message)

    monkeypatch.setattr(Metrics, "response", spied)
    config = sidecar_config(store, auth=AUTH, http=HTTP, metrics_listen="127.0.0.1:0")
    async with running(config, local_embedder) as sc:
        reply = await vapi(sc, [GREETING, {"role": "user", "content": "How do I export my data?"}])
        assert reply.json()["documents"]
        m = scrape(sc.metrics_port)
    turns = [message for method, message in seen if method == "Vapi"]
    assert len(turns) == 2  # the greeting and the question
    assert turns[-1].skipped == pb.NOT_SKIPPED
    assert turns[-1].timings.total_ms > 0
    assert not any(t.chunks or t.context for t in turns)
    assert value(m, "voxrecall_stage_seconds_count", rpc="Vapi", stage="total") == 2
    assert value(m, "voxrecall_stage_seconds_count", rpc="Vapi", stage="search") == 1


async def test_a_long_agent_message_is_fed_cut_not_refused(sidecar: Sidecar) -> None:
    rambling = {"role": "assistant", "content": "Thanks for calling, I am glad to help. " * 200}
    question = {"role": "user", "content": "How do I reset my password?"}
    body = vapi_request([rambling, question])
    body["message"]["call"]["id"] = "vapi-call-long"
    reply = await post_vapi_kb(sidecar, body)
    assert reply.status_code == 200
    assert reply.json()["documents"][0]["content"].startswith("Reset your password")


@pytest.mark.parametrize("secret", ["", "wrong-secret-0000000000"])
async def test_vapi_without_the_shared_secret_is_refused(sidecar: Sidecar, secret: str) -> None:
    reply = await vapi(sidecar, [{"role": "user", "content": "reset"}], **{"x-vapi-secret": secret})
    assert reply.status_code == 401
    assert "X-Vapi-Secret" in reply.json()["error"]["message"]


@pytest.mark.parametrize(
    ("body", "says"),
    [
        (b"{not json", "not JSON"),
        (b'{"message": {"type": "status-update"}}', "knowledge-base-request"),
        (b'{"message": {"type": "knowledge-base-request", "messages": []}}', "call.id"),
    ],
)
async def test_a_bad_vapi_body_is_a_400_saying_what_to_send(
    sidecar: Sidecar, body: bytes, says: str
) -> None:
    reply = await post_vapi_kb(sidecar, body)
    assert reply.status_code == 400
    assert reply.json()["error"]["code"] == "INVALID_ARGUMENT"
    assert says in reply.json()["error"]["message"]


@pytest.mark.parametrize("messages", [[], [{"role": "system", "content": "You are kind."}]])
async def test_a_vapi_call_id_over_the_name_limit_is_refused_before_it_is_kept(
    sidecar: Sidecar, messages: list[dict[str, Any]]
) -> None:
    """A request that feeds no turn is never checked by the hooks: its call id must still be
    bounded, or each remembered call holds as much as a whole body."""
    before = sidecar.engine.sessions.usage()
    body = vapi_request(messages)
    body["message"]["call"]["id"] = "c" * 8000
    reply = await post_vapi_kb(sidecar, body)
    by_header = await vapi(sidecar, messages, **{"x-voxrecall-session": "h" * 4000})
    for answer, field in ((reply, "message.call.id"), (by_header, SESSION_HEADER)):
        assert answer.status_code == 400
        assert answer.json()["error"]["code"] == "INVALID_ARGUMENT"
        assert answer.json()["error"]["message"].startswith(f"{field} is ")
        assert "the limit is 256" in answer.json()["error"]["message"]
    assert sidecar.engine.sessions.usage() == before


@pytest.mark.parametrize(
    ("payload", "headers", "field"),
    [
        ({"args": {"query": "x"}, "call": {"call_id": "c" * 900}}, {}, "call.call_id"),
        ({"query": "x", "session_id": "c" * 900}, {}, "session_id"),
        ({"query": "x", "call_id": "c" * 900}, {}, "call_id"),
        ({"query": "x"}, {SESSION_HEADER: "c" * 900}, SESSION_HEADER),
    ],
)
async def test_an_overlong_tool_call_id_is_refused_naming_the_field_sent(
    sidecar: Sidecar, payload: dict[str, Any], headers: dict[str, str], field: str
) -> None:
    """A Retell call id of 900 characters was refused as "session_id is 900 characters", a
    field the platform never sent."""
    body = orjson.dumps(payload)
    reply = await post_tool(sidecar, body, {**signed(body), **headers})
    assert reply.status_code == 400
    assert reply.json()["error"]["message"].startswith(f"{field} is 900 characters")


DEEP = b"[" * 600 + b"]" * 600  # JSON orjson reads (1024 levels) but writes only to 255


@pytest.mark.parametrize(
    "junk", [DEEP, b'{"role": "user", "content": ' + DEEP + b"}"], ids=["message", "content"]
)
async def test_a_deeply_nested_vapi_message_is_skipped_not_a_500(
    sidecar: Sidecar, junk: bytes
) -> None:
    question = orjson.dumps({"role": "user", "content": "How do I reset my password?"})
    body = (
        b'{"message": {"type": "knowledge-base-request", "call": {"id": "vapi-deep"}, '
        b'"messages": [' + junk + b", " + question + b"]}}"
    )
    reply = await post_vapi_kb(sidecar, body)
    assert reply.status_code == 200
    assert "Reset your password" in reply.json()["documents"][0]["content"]


@pytest.mark.parametrize("role", [[], {"a": 1}, ["user"]], ids=["list", "object", "in-a-list"])
async def test_a_vapi_message_whose_role_is_not_a_string_is_skipped_not_a_500(
    sidecar: Sidecar, role: Any
) -> None:
    """Attack s20: a role that is a list or an object was looked up in the set of roles
    (unhashable: TypeError), and the request answered 500 INTERNAL. Such a message is no
    turn; the others are answered."""
    question = {"role": "user", "content": "How do I reset my password?"}
    reply = await vapi(sidecar, [{"role": role, "content": "x"}, question])
    assert reply.status_code == 200
    assert "Reset your password" in reply.json()["documents"][0]["content"]


# -- the tool webhook -------------------------------------------------------------------------


# a signature refusal's WWW-Authenticate: the headers to send, as the README writes them
SIGNED_CHALLENGE = 'Signature headers="X-Voxrecall-Timestamp X-Voxrecall-Signature"'


def signed(body: bytes, secret: str = WEBHOOK_SECRET, age_s: int = 0) -> dict[str, str]:
    """The README's signing code: HMAC-SHA256 of "<unix seconds>.<body>"."""
    stamp = str(int(time.time()) - age_s)
    digest = hmac.new(secret.encode(), stamp.encode() + b"." + body, hashlib.sha256).hexdigest()
    return {"x-voxrecall-timestamp": stamp, "x-voxrecall-signature": f"sha256={digest}"}


def unstamped(body: bytes) -> dict[str, str]:
    """The scheme before the timestamp: the body alone, good forever."""
    digest = hmac.new(WEBHOOK_SECRET.encode(), body, hashlib.sha256).hexdigest()
    return {"x-voxrecall-signature": f"sha256={digest}"}


def retell_signed(body: bytes, secret: str = WEBHOOK_SECRET, age_ms: int = 0) -> dict[str, str]:
    stamp = str(int(time.time() * 1000) - age_ms)
    digest = hmac.new(secret.encode(), body + stamp.encode(), hashlib.sha256).hexdigest()
    return {"x-retell-signature": f"v={stamp},d={digest}"}


RETELL_BODY = orjson.dumps(
    {
        "name": "search_help",
        "args": {"query": "how do I reset my password"},
        "call": {"call_id": "retell-call-1", "agent_id": "agent-1"},
    }
)


async def post_tool(
    sc: Sidecar, body: bytes, headers: dict[str, str], function: str = "search_help"
) -> httpx2.Response:
    async with httpx2.AsyncClient() as http:
        return await http.post(
            url(sc, f"/tools/{function}"), content=body, headers={**auth(), **headers}
        )


@pytest.mark.parametrize(
    ("name", "says"),
    [
        (DEEPER, "the body's name is [[[[...]]]], not a string: send 'search_help' or none"),
        (b'"search_billing"', "the body names function 'search_billing' but the URL"),
    ],
)
async def test_a_tool_body_naming_another_function_is_a_400_naming_it(
    sidecar: Sidecar, name: bytes, says: str
) -> None:
    """Attack s23: a Retell body whose name was a list nested 1,000 deep answered 500 with a
    traceback (its repr, in the refusal, recursed past Python's limit)."""
    body = RETELL_BODY.replace(b'"search_help"', name, 1)
    reply = await post_tool(sidecar, body, retell_signed(body))
    assert reply.status_code == 400
    assert reply.json()["error"]["code"] == "INVALID_ARGUMENT"
    assert says in reply.json()["error"]["message"]


@pytest.mark.parametrize("sign", [signed, retell_signed])
async def test_a_signed_tool_call_returns_the_functions_output(sidecar: Sidecar, sign: Any) -> None:
    reply = await post_tool(sidecar, RETELL_BODY, sign(RETELL_BODY))
    assert reply.status_code == 200
    assert reply.json()["results"][0]["title"] == "Reset your password"
    assert "x-voxrecall-tool-error" not in reply.headers


@pytest.mark.parametrize(
    "headers",
    [
        {},
        signed(RETELL_BODY, "another-secret-000000000"),
        signed(RETELL_BODY + b" "),
        signed(RETELL_BODY, age_s=10 * 60),
        {**signed(RETELL_BODY), "x-voxrecall-timestamp": str(int(time.time()) - 1)},
        {**signed(RETELL_BODY), "x-voxrecall-timestamp": "soon"},
        unstamped(RETELL_BODY),
        retell_signed(RETELL_BODY, age_ms=10 * 60 * 1000),
        {"x-retell-signature": "v=1,d=zz"},
        {**signed(RETELL_BODY), "x-voxrecall-signature": "sha256=caf\xe9".encode("latin-1")},
    ],
    ids=[
        "unsigned",
        "other-secret",
        "other-body",
        "stale",
        "other-timestamp",
        "malformed-timestamp",
        "unstamped",
        "stale-retell",
        "malformed-retell",
        "non-ascii-signature",
    ],
)
async def test_an_unsigned_or_badly_signed_tool_call_is_refused(
    sidecar: Sidecar, headers: dict[str, str]
) -> None:
    """Each refusal's WWW-Authenticate names the signature's headers: the bearer token sent
    was good, and a client that read "Bearer" would look for the fault in its token."""
    reply = await post_tool(sidecar, RETELL_BODY, headers)
    assert reply.status_code == 401
    assert reply.json()["error"]["code"] == "UNAUTHENTICATED"
    assert reply.headers["www-authenticate"] == SIGNED_CHALLENGE


async def test_a_tool_call_without_a_good_token_is_challenged_for_the_token(
    sidecar: Sidecar,
) -> None:
    """Signed or not, a call whose bearer token is missing or wrong is asked for the token."""
    for headers in ({"authorization": "Bearer wrong-token"}, {"authorization": ""}):
        reply = await post_tool(sidecar, RETELL_BODY, {**signed(RETELL_BODY), **headers})
        assert reply.status_code == 401
        assert reply.headers["www-authenticate"] == "Bearer"


@pytest.mark.parametrize(("body", "says"), [(b"{not json", "not JSON"), (b"[1]", "JSON object")])
async def test_a_tool_body_not_a_json_object_is_told_both_shapes(
    sidecar: Sidecar, body: bytes, says: str
) -> None:
    """The 400 names Retell's body and the flat body ElevenLabs sends: showing Retell's alone,
    it sent an ElevenLabs user to the wrong shape."""
    reply = await post_tool(sidecar, body, signed(body))
    assert reply.status_code == 400
    message = reply.json()["error"]["message"]
    assert says in message
    assert '"args": {"query": "..."}, "call": {"call_id": "..."}' in message
    assert 'ElevenLabs sends them: {"query": "...", "session_id": "..."}' in message


async def test_a_signature_without_a_timestamp_is_refused_naming_the_header(
    sidecar: Sidecar,
) -> None:
    """A signature of the body alone never expires, so one captured call could be replayed
    for ever: it is refused, and the answer says what to send instead."""
    reply = await post_tool(sidecar, RETELL_BODY, unstamped(RETELL_BODY))
    assert reply.status_code == 401
    message = reply.json()["error"]["message"]
    assert "X-Voxrecall-Timestamp" in message
    assert "<timestamp>.<body>" in message


async def test_a_replayed_call_is_refused_once_the_window_has_passed(sidecar: Sidecar) -> None:
    captured = signed(RETELL_BODY)
    assert (await post_tool(sidecar, RETELL_BODY, captured)).status_code == 200
    # the window counted from the signature's own timestamp, not from when the test reads the
    # clock: the POST above may take seconds on a busy machine
    later = int(captured["x-voxrecall-timestamp"]) + SIGNATURE_TOLERANCE_MS / 1000 + 1
    with pytest.raises(Unauthenticated, match="more than 5 minutes"):
        verify_signature(WEBHOOK_SECRET.encode(), RETELL_BODY, captured, now=later)
    verify_signature(WEBHOOK_SECRET.encode(), RETELL_BODY, captured, now=later - 2)  # in it


@pytest.mark.parametrize("sign", [signed, retell_signed])
async def test_a_signed_call_sent_again_within_its_window_gets_its_first_answer(
    sidecar: Sidecar, sign: Any
) -> None:
    """A platform resends a call whose answer it lost (Retell cannot sign it anew): it gets the
    call's first answer, not a 401 mid-call; the same signature to another path, or from
    another caller, is refused as a replay."""
    captured = sign(RETELL_BODY)
    first = await post_tool(sidecar, RETELL_BODY, captured)
    assert first.status_code == 200
    again = await post_tool(sidecar, RETELL_BODY, captured)
    assert again.status_code == 200
    assert again.content == first.content
    elsewhere = await post_tool(sidecar, RETELL_BODY, captured, function="search_billing")
    assert elsewhere.status_code == 401  # the signature covers the body, not the path
    assert "already received" in elsewhere.json()["error"]["message"]
    assert elsewhere.headers["www-authenticate"] == SIGNED_CHALLENGE
    stranger = await post_tool(sidecar, RETELL_BODY, {**captured, **auth(TOKEN_B)})
    assert stranger.status_code in (401, 404)  # never the first caller's answer
    other = RETELL_BODY.replace(b"retell-call-1", b"retell-call-2")  # a new call: served
    assert (await post_tool(sidecar, other, sign(other))).status_code == 200


def _count_waiting(
    webhooks: Any, monkeypatch: pytest.MonkeyPatch
) -> Callable[[int], Coroutine[Any, Any, None]]:
    """A wait until ``n`` calls are waiting on a kept answer (``Answers.of`` entered while one
    is pending): a retry that came only after its call was answered would pass the tests below
    without waiting."""
    entered = 0
    changed = asyncio.Event()
    of = webhooks.answers.of

    async def counting(key: Any) -> Any:
        nonlocal entered
        if webhooks.answers._kept.get(key) is not None:
            entered += 1
            changed.set()
        return await of(key)

    monkeypatch.setattr(webhooks.answers, "of", counting)

    async def until(n: int) -> None:
        while entered < n:
            changed.clear()
            await changed.wait()

    return until


async def test_a_retry_while_its_call_is_answered_waits_for_that_answer(
    sidecar: Sidecar, monkeypatch: pytest.MonkeyPatch
) -> None:
    assert sidecar.http is not None
    webhooks = sidecar.http.webhooks
    release, entered = asyncio.Event(), asyncio.Event()
    served = 0
    tool = webhooks._tool

    async def slow(*args: Any) -> Any:
        nonlocal served
        served += 1
        entered.set()
        await release.wait()
        return await tool(*args)

    monkeypatch.setattr(webhooks, "_tool", slow)
    captured = retell_signed(RETELL_BODY)
    first = asyncio.create_task(post_tool(sidecar, RETELL_BODY, captured))
    await entered.wait()
    waiting = _count_waiting(webhooks, monkeypatch)
    retry = asyncio.create_task(post_tool(sidecar, RETELL_BODY, captured))
    await asyncio.wait_for(waiting(1), 10)  # the retry waits on the call's answer
    release.set()
    answers = await asyncio.gather(first, retry)
    assert [a.status_code for a in answers] == [200, 200]
    assert answers[0].content == answers[1].content
    assert served == 1  # the retry was answered with the call's answer, not searched again


async def test_a_retry_waits_for_its_calls_answer_a_bounded_time(
    sidecar: Sidecar, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A retry waited with no deadline for a call still being answered, holding its connection
    for as long as the call took: past ANSWER_WAIT_S it is 503, to be retried."""
    assert sidecar.http is not None
    webhooks = sidecar.http.webhooks
    release, entered = asyncio.Event(), asyncio.Event()
    tool = webhooks._tool

    async def held(*args: Any) -> Any:
        entered.set()
        await release.wait()
        return await tool(*args)

    monkeypatch.setattr(webhooks, "_tool", held)
    monkeypatch.setattr(webhooks_module, "ANSWER_WAIT_S", 0.2)
    captured = retell_signed(RETELL_BODY)
    first = asyncio.create_task(post_tool(sidecar, RETELL_BODY, captured))
    await entered.wait()
    retry = await asyncio.wait_for(post_tool(sidecar, RETELL_BODY, captured), 10)
    assert retry.status_code == 503
    assert "still being answered" in retry.text
    release.set()
    assert (await first).status_code == 200


async def test_every_retry_waiting_on_a_failed_call_is_answered_not_refused(
    sidecar: Sidecar, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two retries waited on a call that failed: the first was served afresh and the second
    refused as a replay (401). Now the first is served afresh and the second gets its answer."""
    assert sidecar.http is not None
    webhooks = sidecar.http.webhooks
    release, entered = asyncio.Event(), asyncio.Event()
    served = 0
    tool = webhooks._tool

    async def failing_once(*args: Any) -> Any:
        nonlocal served
        served += 1
        if served == 1:
            entered.set()
            await release.wait()
            raise InvalidArgument("the first attempt fails")
        return await tool(*args)

    monkeypatch.setattr(webhooks, "_tool", failing_once)
    captured = retell_signed(RETELL_BODY)
    first = asyncio.create_task(post_tool(sidecar, RETELL_BODY, captured))
    await entered.wait()
    waiting = _count_waiting(webhooks, monkeypatch)
    retries = [asyncio.create_task(post_tool(sidecar, RETELL_BODY, captured)) for _ in range(2)]
    await asyncio.wait_for(waiting(2), 10)  # both wait on the call's answer
    release.set()
    failed, *answers = await asyncio.gather(first, *retries)
    assert failed.status_code == 400
    assert [a.status_code for a in answers] == [200, 200]
    assert answers[0].content == answers[1].content
    assert served == 2  # the failed call, then once afresh for both retries


async def test_the_answers_kept_for_retries_are_bounded_in_bytes(
    sidecar: Sidecar, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The table was bounded in answers alone, and an answer may be 4 bytes a character of an
    unbounded ``tool_output_chars``: past its bytes the oldest answer is forgotten (its retry
    refused as a replay), and one over the whole budget is not kept."""
    assert sidecar.http is not None
    webhooks = sidecar.http.webhooks
    calls = [RETELL_BODY.replace(b"retell-call-1", f"retell-byte-{i}".encode()) for i in range(4)]
    probe = await post_tool(sidecar, calls[3], retell_signed(calls[3]))
    size = len(probe.content)  # the same results for every call id: the same size
    answers = Answers(size=100, budget=size * 5 // 2)  # two answers, by bytes alone
    monkeypatch.setattr(webhooks, "answers", answers)
    signatures = [retell_signed(body) for body in calls[:3]]
    for body, signature in zip(calls, signatures, strict=False):
        assert (await post_tool(sidecar, body, signature)).status_code == 200
    assert answers._kept.currsize <= answers.budget
    again = [await post_tool(sidecar, b, s) for b, s in zip(calls, signatures, strict=False)]
    assert [a.status_code for a in again] == [401, 200, 200]  # the oldest went
    assert again[2].content == probe.content

    small = Answers(size=100, budget=size // 2)  # no answer fits
    monkeypatch.setattr(webhooks, "answers", small)
    lone = RETELL_BODY.replace(b"retell-call-1", b"retell-large-1")
    signature = retell_signed(lone)
    assert (await post_tool(sidecar, lone, signature)).status_code == 200
    assert len(small._kept) == 0
    assert (await post_tool(sidecar, lone, signature)).status_code == 401


def test_the_replay_table_is_fixed_in_size_and_lets_no_forgotten_replay_through() -> None:
    """Past its size the oldest signature is forgotten, and a call signed no later than it is
    refused too (it could be that one again); newer calls are accepted."""
    now_ms = time.time() * 1000
    table = Replays(size=2)

    def sig(n: int, stamp_ms: float) -> Signature:
        return Signature(n.to_bytes(32, "big"), int(stamp_ms))

    for n in range(3):
        table.first("agent", sig(n, now_ms + n), now_ms)
    assert len(table._seen) == 2  # the first forgotten
    for n, stamp in ((0, now_ms), (9, now_ms), (2, now_ms + 2)):  # forgotten, as old, seen
        with pytest.raises(Unauthenticated, match="already received"):
            table.first("agent", sig(n, stamp), now_ms)
    table.first("agent", sig(3, now_ms + 3), now_ms)  # newer than the forgotten: accepted
    table.first("other", sig(3, now_ms + 3), now_ms)  # another caller's: its own
    table.forget("agent", sig(3, now_ms + 3))  # a call that failed may come again
    table.first("agent", sig(3, now_ms + 3), now_ms)
    later = now_ms + SIGNATURE_TOLERANCE_MS + 10  # the window has passed: all expire
    table.first("agent", sig(4, later), later)
    assert list(table._seen) == [("agent", sig(4, later).digest)]
    assert table.refused == 3


def test_a_signer_whose_clock_runs_ahead_does_not_lock_out_the_others() -> None:
    """The table forgets the earliest signed call, not the first to arrive: a call signed four
    minutes ahead (within the tolerance) must not become the floor every honest call is under."""
    now_ms = time.time() * 1000
    table = Replays(size=2)

    def sig(n: int, stamp_ms: float) -> Signature:
        return Signature(n.to_bytes(32, "big"), int(stamp_ms))

    table.first("fast", sig(0, now_ms + 240_000), now_ms)
    table.first("agent", sig(1, now_ms), now_ms)
    table.first("agent", sig(2, now_ms), now_ms)  # full: the earliest signed goes
    table.first("agent", sig(3, now_ms + 1_000), now_ms)  # an honest call a second later
    assert table.floor_ms <= now_ms
    with pytest.raises(Unauthenticated, match="already received"):
        table.first("fast", sig(0, now_ms + 240_000), now_ms)  # still remembered
    table.forget("agent", sig(3, now_ms + 1_000))  # forgotten entries do not expire others
    later = now_ms + SIGNATURE_TOLERANCE_MS + 10
    table.first("agent", sig(4, later), later)
    assert ("fast", sig(0, 0).digest) in table._seen  # its window runs from its own stamp


@pytest.mark.parametrize(
    "payload",
    [
        {"arguments": '{"query": "how do I reset my password"}', "session_id": "s-1"},
        {"query": "how do I reset my password", "session_id": "conv-1"},  # ElevenLabs' flat body
    ],
)
async def test_the_tool_webhook_takes_each_platforms_shape(
    sidecar: Sidecar, payload: dict[str, Any]
) -> None:
    body = orjson.dumps(payload)
    reply = await post_tool(sidecar, body, signed(body))
    assert reply.status_code == 200
    assert reply.json()["results"][0]["title"] == "Reset your password"


async def test_tool_arguments_nested_too_deep_are_a_400_not_a_500(sidecar: Sidecar) -> None:
    body = b'{"query": ' + DEEP + b', "session_id": "s-deep"}'
    reply = await post_tool(sidecar, body, signed(body))
    assert reply.status_code == 400
    assert reply.json()["error"]["code"] == "INVALID_ARGUMENT"
    assert "flat object" in reply.json()["error"]["message"]


async def test_a_source_path_naming_no_page_is_told_apart_from_a_miss(sidecar: Sidecar) -> None:
    """A model whose own source_paths named no page must read so, or it will not retry without
    them; a real miss still says nothing matched."""
    nowhere = orjson.dumps({"args": {"query": "reset my password", "source_paths": ["nope/"]}})
    reply = await post_tool(sidecar, nowhere, signed(nowhere))
    assert reply.status_code == 200
    assert reply.json()["results"] == []
    assert "No page of the knowledge base is under source_paths 'nope/'" in reply.json()["note"]
    path = reply.json()["note"]
    assert "without source_paths" in path
    found = orjson.dumps({"args": {"query": "reset my password", "source_paths": ["*.md"]}})
    assert (await post_tool(sidecar, found, signed(found))).json()["results"]


async def test_an_empty_vapi_answer_says_whether_anything_was_asked(sidecar: Sidecar) -> None:
    """Vapi reads only documents; a person testing by curl must tell "nothing asked" from
    "nothing found" (the x-voxrecall-note header), also on a retry."""
    header = {SESSION_HEADER: "empty-answers"}
    for messages in ([], [GREETING]):
        for _ in range(2):  # the request, then its retry
            reply = await vapi(sidecar, messages, **header)
            assert reply.json() == {"documents": []}
            assert reply.headers["x-voxrecall-note"].startswith("nothing asked")
    asked = [GREETING, {"role": "user", "content": "How do I reset my password?"}]
    reply = await vapi(sidecar, asked, **header)
    assert reply.json()["documents"]
    assert "x-voxrecall-note" not in reply.headers
    skipped = [*asked, {"role": "bot", "message": "Done."}, {"role": "user", "content": "ok"}]
    reply = await vapi(sidecar, skipped, **header)
    assert reply.headers["x-voxrecall-note"].startswith("not searched")


async def test_tool_webhook_mistakes_are_outputs_and_bad_requests_are_4xx(
    sidecar: Sidecar,
) -> None:
    empty = orjson.dumps({"args": {"query": ""}})
    mistake = await post_tool(sidecar, empty, signed(empty))
    assert mistake.status_code == 200  # the model reads it and corrects itself
    assert mistake.headers["x-voxrecall-tool-error"] == "true"
    assert mistake.json()["error"]["type"] == "invalid_arguments"

    body = orjson.dumps({"args": {"query": "x"}})
    unknown = await post_tool(sidecar, body, signed(body), function="search_nothing")
    assert unknown.status_code == 404
    assert "search_help" in unknown.json()["error"]["message"]
    other = orjson.dumps({"name": "search_billing", "args": {"query": "x"}})
    mismatch = await post_tool(sidecar, other, signed(other))
    assert mismatch.status_code == 400
    assert "/tools/search_billing" in mismatch.json()["error"]["message"]
    scoped = await post_tool(sidecar, body, {**signed(body), **auth(TOKEN_B)})
    assert scoped.status_code == 404  # outside the token's scope: as if it did not exist
    assert scoped.json()["error"]["message"].endswith("known: search_billing")


# -- Vapi's tools -----------------------------------------------------------------------------


def vapi_tool_calls(calls: list[dict[str, Any]], call_id: str = "vapi-tools-1") -> bytes:
    """Vapi's ``tool-calls`` server message (its other call metadata trimmed)."""
    return orjson.dumps(
        {
            "message": {
                "type": "tool-calls",
                "toolCallList": calls,
                "call": {"id": call_id, "orgId": "org-1"},
            }
        }
    )


def tool_call(id_: str, name: str, arguments: Any) -> dict[str, Any]:
    return {"id": id_, "type": "function", "function": {"name": name, "arguments": arguments}}


async def post_vapi_tools(
    sc: Sidecar, body: bytes, function: str = "search_help", **headers: str
) -> httpx2.Response:
    return await post_tool(
        sc, body, {**signed(body), "x-vapi-secret": VAPI_SECRET, **headers}, function
    )


async def test_vapis_tool_calls_are_each_answered_in_vapis_results_form(sidecar: Sidecar) -> None:
    """The newcomer's attack: Vapi's own envelope got "does not take 'message'". Each call is
    answered by the function it names, in order; the model's mistakes are that call's error."""
    body = vapi_tool_calls(
        [
            tool_call("call_a", "search_help", {"query": "how do I reset my password"}),
            tool_call("call_b", "search_nothing", {"query": "x"}),
            tool_call("call_c", "search_help", {"query": ""}),
            tool_call("call_d", "search_help", '{"query": "reset my password"}'),  # as a string
        ]
    )
    reply = await post_vapi_tools(sidecar, body)
    assert reply.status_code == 200
    results = reply.json()["results"]
    assert [r["toolCallId"] for r in results] == ["call_a", "call_b", "call_c", "call_d"]
    assert orjson.loads(results[0]["result"])["results"][0]["title"] == "Reset your password"
    assert orjson.loads(results[1]["error"])["error"]["type"] == "unknown_function"
    assert "search_help" in orjson.loads(results[1]["error"])["error"]["message"]
    assert orjson.loads(results[2]["error"])["error"]["type"] == "invalid_arguments"
    assert "result" not in results[2]
    assert orjson.loads(results[3]["result"])["results"]
    assert reply.headers["x-voxrecall-tool-error"] == "true"
    sessions.owner.set("default")
    session = sidecar.engine.sessions.peek("vapi-tools-1")
    assert session is not None  # the call's id is its session
    assert len(session.retained) == 2


async def test_vapis_tool_calls_are_scoped_like_any_other(sidecar: Sidecar) -> None:
    body = vapi_tool_calls([tool_call("call_a", "search_help", {"query": "reset my password"})])
    reply = await post_vapi_tools(sidecar, body, **auth(TOKEN_B))
    (result,) = reply.json()["results"]
    assert orjson.loads(result["error"])["error"]["type"] == "unknown_function"  # outside scope


async def test_vapis_tool_calls_without_the_secret_are_refused_naming_the_header(
    sidecar: Sidecar,
) -> None:
    body = vapi_tool_calls([tool_call("call_a", "search_help", {"query": "reset"})])
    reply = await post_vapi_tools(sidecar, body, **{"x-vapi-secret": "wrong-secret-000000000"})
    assert reply.status_code == 401
    assert "X-Vapi-Secret" in reply.json()["error"]["message"]
    assert reply.headers["www-authenticate"] == 'Secret header="X-Vapi-Secret"'


@pytest.mark.parametrize(
    ("calls", "says"),
    [
        ("not a list", "toolCallList must be the list"),
        ([{"function": {"name": "search_help"}}], "needs its id"),
        ([tool_call(f"c{i}", "search_help", {"query": "x"}) for i in range(17)], "at most 16"),
    ],
)
async def test_a_bad_vapi_tool_calls_envelope_is_a_400_saying_what_to_send(
    sidecar: Sidecar, calls: Any, says: str
) -> None:
    reply = await post_vapi_tools(sidecar, vapi_tool_calls(calls))
    assert reply.status_code == 400
    assert reply.json()["error"]["code"] == "INVALID_ARGUMENT"
    assert says in reply.json()["error"]["message"]


async def test_one_bad_call_of_a_vapi_envelope_is_its_own_error_and_the_others_run(
    sidecar: Sidecar,
) -> None:
    """A 5,000-character function name, or arguments nested 1,000 deep, refused the whole
    envelope (400, naming no call) after the calls before them had searched: each is now that
    call's error (the name an unknown function, quoted in part), and the calls around it are
    answered."""
    good = tool_call("call_a", "search_help", {"query": "how do I reset my password"})
    long_name = tool_call("call_b", "s" * 5000, {"query": "x"})
    deep = orjson.dumps(tool_call("call_c", "search_help", {})).replace(b"{}", DEEPER)
    last = tool_call("call_d", "search_help", {"query": "reset my password"})
    body = vapi_tool_calls([good, long_name, {}, last]).replace(b"{}", deep)
    reply = await post_vapi_tools(sidecar, body)
    assert reply.status_code == 200
    results = reply.json()["results"]
    assert [r["toolCallId"] for r in results] == ["call_a", "call_b", "call_c", "call_d"]
    assert orjson.loads(results[0]["result"])["results"][0]["title"] == "Reset your password"
    assert orjson.loads(results[3]["result"])["results"]
    unknown = orjson.loads(results[1]["error"])["error"]  # the model's name: one to correct
    assert unknown["type"] == "unknown_function"
    assert "search_help" in unknown["message"]
    deep_error = orjson.loads(results[2]["error"])["error"]
    assert deep_error["type"] == "invalid_arguments"
    assert "call_c" in deep_error["message"]
    assert "flat object" in deep_error["message"]
    assert len(results[1]["name"]) <= 256  # not echoed whole
    assert len(results[1]["error"]) < 1000
    assert reply.headers["x-voxrecall-tool-error"] == "true"


async def test_a_vapi_call_its_base_cannot_answer_now_is_its_own_error(
    sidecar: Sidecar, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A call whose search is refused (its base loading: UNAVAILABLE) made the whole envelope a
    503 after the calls before it had searched and fed the session: it is that call's error,
    the type a retry is told by, and the others are answered."""
    assert sidecar.http is not None
    engine = sidecar.http.webhooks.engine
    search = engine.search

    async def loading_for_one(req: Any, *args: Any, **kwargs: Any) -> Any:
        if req.query == "the base that loads":
            raise Loading("knowledge base 'help' is loading: retry in about 1 s", 1000)
        return await search(req, *args, **kwargs)

    monkeypatch.setattr(engine, "search", loading_for_one)
    calls = [
        tool_call("call_a", "search_help", {"query": "how do I reset my password"}),
        tool_call("call_b", "search_help", {"query": "the base that loads"}),
        tool_call("call_c", "search_help", {"query": "reset my password"}),
    ]
    reply = await post_vapi_tools(sidecar, vapi_tool_calls(calls, call_id="vapi-loading"))
    assert reply.status_code == 200
    results = reply.json()["results"]
    assert [r["toolCallId"] for r in results] == ["call_a", "call_b", "call_c"]
    assert "result" in results[0]
    assert "result" in results[2]
    error = orjson.loads(results[1]["error"])["error"]
    assert error["type"] == "unavailable"
    assert "is loading" in error["message"]
    assert reply.headers["x-voxrecall-tool-error"] == "true"


@pytest.mark.parametrize(
    ("bad", "says"),
    [
        ({"function": {"name": "search_help"}}, "toolCallList[1].id has none"),
        (tool_call("c" * 300, "search_help", {"query": "x"}), "toolCallList[1].id is 300"),
    ],
    ids=["no-id", "long-id"],
)
async def test_an_envelope_whose_call_cannot_be_answered_is_refused_before_any_runs(
    sidecar: Sidecar, bad: dict[str, Any], says: str
) -> None:
    """A call without an id, or with one of 300 characters (200 KB ids were echoed back), cannot
    be answered: the envelope is refused naming the entry, before the call ahead of it
    searched."""
    good = tool_call("call_a", "search_help", {"query": "how do I reset my password"})
    body = vapi_tool_calls([good, bad], call_id="vapi-refused-whole")
    reply = await post_vapi_tools(sidecar, body)
    assert reply.status_code == 400
    assert says in reply.json()["error"]["message"]
    assert b"c" * 300 not in reply.content
    sessions.owner.set("default")
    assert sidecar.engine.sessions.peek("vapi-refused-whole") is None  # nothing searched


def marked(body: bytes, marker: str) -> bytes:
    """``body`` with ``marker`` as a key of its message (no dict of it is kept by the test)."""
    return body.replace(b'"message":{', b'"message":{"' + marker.encode() + b'":[[],[]],', 1)


@pytest.mark.parametrize("path", ["tools", "vapi"])
async def test_the_parsed_body_is_let_go_before_the_searches(
    sidecar: Sidecar, monkeypatch: pytest.MonkeyPatch, path: str
) -> None:
    """A Vapi envelope's parsed body was held through its searches: 64 bodies of tiny JSON
    values kept millions of objects alive for the collector to walk on every search."""
    assert sidecar.http is not None
    marker = "held-body-marker-7f3a"
    alive: list[bool] = []
    engine = sidecar.http.webhooks.engine

    def watched(run: Any) -> Any:
        async def running(*args: Any, **kwargs: Any) -> Any:
            alive.append(any(isinstance(o, dict) and marker in o for o in gc.get_objects()))
            return await run(*args, **kwargs)

        return running

    monkeypatch.setattr(engine, "search", watched(engine.search))
    monkeypatch.setattr(engine, "turn", watched(engine.turn))
    if path == "tools":
        reply = await post_vapi_tools(
            sidecar,
            marked(vapi_tool_calls([tool_call("c1", "search_help", {"query": "reset"})]), marker),
        )
    else:
        asked = vapi_request([{"role": "user", "content": "How do I reset my password?"}])
        reply = await post_vapi_kb(
            sidecar, marked(orjson.dumps(asked), marker), **{SESSION_HEADER: "let-go"}
        )
    assert reply.status_code == 200
    assert alive
    assert not any(alive)


async def test_a_retell_signature_stamped_in_seconds_is_told_it_is_milliseconds(
    sidecar: Sidecar,
) -> None:
    stamp = str(int(time.time()))
    digest = hmac.new(WEBHOOK_SECRET.encode(), RETELL_BODY + stamp.encode(), hashlib.sha256)
    headers = {"x-retell-signature": f"v={stamp},d={digest.hexdigest()}"}
    reply = await post_tool(sidecar, RETELL_BODY, headers)
    assert reply.status_code == 401
    assert "milliseconds" in reply.json()["error"]["message"]


async def test_an_empty_vapi_list_and_content_parts_are_read_as_they_are(sidecar: Sidecar) -> None:
    """``"messages": []`` has no message at all (not "not the caller's"); a user message whose
    content is a list of OpenAI content parts is the caller's words."""
    empty = await vapi(sidecar, [], **{SESSION_HEADER: "parts-empty"})
    assert (
        empty.headers["x-voxrecall-note"]
        == "nothing asked: no user or assistant message has words yet"
    )
    parts = [{"type": "text", "text": "How do I reset"}, {"type": "text", "text": "my password?"}]
    asked = await vapi(
        sidecar, [GREETING, {"role": "user", "content": parts}], **{SESSION_HEADER: "parts-1"}
    )
    assert asked.json()["documents"][0]["content"].startswith("Reset your password")


# -- limits, methods, metrics -----------------------------------------------------------------


async def test_a_body_over_the_byte_limit_is_413_before_it_is_read(sidecar: Sidecar) -> None:
    big = orjson.dumps({"args": {"query": "x" * 20_000}})
    reply = await post_tool(sidecar, big, signed(big))
    assert reply.status_code == 413
    assert reply.json()["error"]["code"] == "RESOURCE_EXHAUSTED"  # as gRPC's own for a message
    assert "max_body_bytes" in reply.json()["error"]["message"]
    async with httpx2.AsyncClient() as http:
        wrong = await http.get(url(sidecar, "/tools/search_help"), headers=auth())
        nowhere = await http.get(url(sidecar, "/nowhere"))
    assert wrong.status_code == 405
    assert wrong.json()["error"]["code"] == "UNIMPLEMENTED"  # the method, not the request's content
    assert nowhere.status_code == 404
    assert "/vapi/knowledge-base" in nowhere.json()["error"]["message"]


def padded(payload: dict[str, Any], size: int) -> bytes:
    """``payload`` with a ``junk`` key of empty arrays, ``size`` bytes in all: the body of
    thousands of tiny JSON values whose parse held the event loop (87,000 in 256 KiB)."""
    body = orjson.dumps(payload)
    return body[:-1] + b', "junk": [' + b"[]," * ((size - len(body) - 12) // 3) + b"[]]}"


def padded_requests() -> list[tuple[str, bytes]]:
    envelope = orjson.loads(vapi_tool_calls([tool_call("c", "search_help", {"query": "x"})]))
    return [
        ("/tools/search_help", padded(envelope, 15_000)),
        ("/tools/search_help", padded({"args": {"query": "x"}, "call": {"call_id": "c"}}, 15_000)),
        ("/vapi/knowledge-base", padded(vapi_request([{"role": "user", "content": "x"}]), 15_000)),
        ("/mcp", padded({**INITIALIZE}, 15_000)),
    ]


@pytest.mark.parametrize(
    ("path", "body"), padded_requests(), ids=["vapi-tools", "tool", "vapi", "mcp"]
)
async def test_a_body_of_many_tiny_json_values_is_refused_before_it_is_parsed(
    sidecar: Sidecar, path: str, body: bytes, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every JSON body the door reads is held to one object or array per 8 bytes of
    max_body_bytes (2,048 at the tests' 16 KiB): the padded body is refused naming the limit,
    and no search runs for it."""
    searched: list[str] = []

    def recorded(name: str) -> Any:
        async def refused(*args: Any, **kwargs: Any) -> Any:
            searched.append(name)
            raise AssertionError(f"{name} ran for a refused body")

        return refused

    monkeypatch.setattr(sidecar.engine, "search", recorded("search"))
    monkeypatch.setattr(sidecar.engine, "turn", recorded("turn"))
    headers = {**auth(), **signed(body), "x-vapi-secret": VAPI_SECRET, **MCP_ACCEPT}
    async with httpx2.AsyncClient() as http:
        reply = await http.post(url(sidecar, path), content=body, headers=headers)
    assert reply.status_code == 400
    assert reply.json()["error"]["code"] == "INVALID_ARGUMENT"
    message = reply.json()["error"]["message"]
    assert "JSON objects and arrays" in message
    assert "the limit is 2048" in message
    assert "max_body_bytes" in message
    assert searched == []


def retell_body(utterances: int) -> bytes:
    """Retell's custom function body with the call's transcript and every word's timings."""
    turns = []
    for i in range(utterances):
        words = ["uh", "I", "want", "to", "reset", "my", "password", "please"][: 1 + i % 8]
        timed = [{"word": w, "start": 0.25 * j, "end": 0.25 * j + 0.2} for j, w in enumerate(words)]
        turns.append(
            {"role": "user" if i % 2 else "agent", "content": " ".join(words), "words": timed}
        )
    call = {"call_id": "retell-long", "transcript_object": turns}
    return orjson.dumps(
        {"name": "search_help", "args": {"query": "reset my password"}, "call": call}
    )


def vapi_parts_body(messages: int) -> bytes:
    """Vapi's knowledge-base request of short messages as OpenAI content parts: the densest
    real shape, one object or array per 22 bytes."""
    said = [
        {
            "role": "assistant" if i % 2 else "user",
            "content": [{"type": "text", "text": "okay yes"}],
        }
        for i in range(messages)
    ]
    asked = {"role": "user", "content": [{"type": "text", "text": "How do I reset my password?"}]}
    return orjson.dumps(vapi_request([*said, asked]))


async def test_real_payloads_are_far_within_the_json_limit(sidecar: Sidecar) -> None:
    """The densest real shapes, filling the byte limit, hold a third of the objects and arrays
    the door takes, and are answered."""
    limit = HTTP["max_body_bytes"]
    assert isinstance(limit, int)
    retell, vapi_kb = retell_body(70), vapi_parts_body(120)
    for body in (retell, vapi_kb):
        assert limit * 0.8 < len(body) <= limit
        assert (body.count(b"[") + body.count(b"{")) * 2.5 < limit // http_door.BYTES_PER_CONTAINER
    tool = await post_tool(sidecar, retell, signed(retell))
    assert tool.status_code == 200
    assert tool.json()["results"][0]["title"] == "Reset your password"
    kb = await post_vapi_kb(sidecar, vapi_kb)
    assert kb.status_code == 200
    assert kb.json()["documents"][0]["content"].startswith("Reset your password")


async def exchange(sc: Sidecar, data: bytes) -> bytes:
    """What the door answers to ``data`` sent raw, up to its closing the connection."""
    reader, writer = await asyncio.open_connection("127.0.0.1", sc.http_port)
    try:
        writer.write(data)
        await writer.drain()
        async with asyncio.timeout(LIVENESS_S):
            return await reader.read()
    except ConnectionResetError:
        return b""
    finally:
        writer.close()


class BodyReads:
    """Each body the door starts to read (the real read goes on) puts the slots then in flight
    in ``started``: a test waits on it to know the door holds a call in its body, no timing."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.started: asyncio.Queue[int] = asyncio.Queue()
        self.limit: Any = None  # the sidecar's ConcurrencyLimit, once it runs
        real = http_door.read_body

        async def spied(receive: Any, headers: dict[str, str], limit: int) -> bytes:
            self.started.put_nowait(self.limit.in_flight)
            return await real(receive, headers, limit)

        monkeypatch.setattr(http_door, "read_body", spied)


async def answer_head(reader: asyncio.StreamReader) -> bytes:
    async with asyncio.timeout(LIVENESS_S):
        return await reader.readuntil(b"\r\n\r\n")


def head(path: str, length: int, token: str | None = TOKEN_A) -> bytes:
    bearer = f"authorization: Bearer {token}\r\n" if token else ""
    return (
        f"POST {path} HTTP/1.1\r\nhost: x\r\n{bearer}content-type: application/json\r\n"
        f"content-length: {length}\r\n\r\n"
    ).encode()


async def test_a_body_still_arriving_holds_no_slot_and_a_strangers_is_never_read(
    store: Path, local_embedder: Embedder, secrets: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A client trickling its body (up to BODY_TIMEOUT_S) holds a connection, not one of the
    max_concurrent_rpcs slots: with one slot, another call is served meanwhile, and the
    trickled call is served once its body is whole. A call without a token is refused from its
    headers, before any of its body is read."""
    reads = BodyReads(monkeypatch)
    body = RETELL_BODY
    # two slots, one each for the two callers: TOKEN_A's calls have one slot between them
    config = sidecar_config(store, auth=AUTH, http={"listen": "127.0.0.1:0"}, max_concurrent_rpcs=2)
    async with running(config, local_embedder) as sc:
        assert sc.guards is not None
        reads.limit = sc.guards.limit
        reader, writer = await asyncio.open_connection("127.0.0.1", sc.http_port)
        writer.write(head("/tools/search_help", len(body)) + body[:10])  # and then it stalls
        await writer.drain()
        async with asyncio.timeout(LIVENESS_S):
            assert await reads.started.get() == 0  # in its body, and holding no slot
        other = await post_tool(sc, body, {})
        assert other.status_code == 200, other.text  # the one slot was free

        writer.write(body[10:])  # the rest of the body: the trickled call is served too
        await writer.drain()
        assert (await answer_head(reader)).startswith(b"HTTP/1.1 200 ")
        writer.close()
        while not reads.started.empty():
            reads.started.get_nowait()

        reader, writer = await asyncio.open_connection("127.0.0.1", sc.http_port)
        writer.write(head("/tools/search_help", 1000, token=None))
        await writer.drain()
        assert (await answer_head(reader)).startswith(b"HTTP/1.1 401 ")  # with no body sent
        writer.close()
        assert reads.started.empty()  # and its body never read
        assert sc.guards.limit.in_flight == 0


async def test_headers_over_the_head_limit_are_431_not_read_on(sidecar: Sidecar) -> None:
    start = b"POST /vapi/knowledge-base HTTP/1.1\r\nhost: x\r\nx-junk: "
    # one byte over, and no end to the headers: only the limit answers it (all of it is read
    # by then, so the close cannot cut the answer off with a reset)
    head = start + b"a" * (MAX_HEAD_BYTES + 1 - len(start))
    answer = await exchange(sidecar, head)
    assert answer.startswith(b"HTTP/1.1 431 ")
    assert b"headers are over" in answer
    async with httpx2.AsyncClient() as http:  # the door serves on
        assert (await http.get(url(sidecar, "/healthz"))).status_code == 200


@pytest.fixture
def short_heads(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(http_door, "HEAD_TIMEOUT_S", 0.2)


@pytest.mark.usefixtures("short_heads")
@pytest.mark.parametrize(
    "sent", [b"", b"POST /mcp HTTP/1.1\r\nhost: x\r\n"], ids=["nothing", "half"]
)
async def test_a_connection_that_stalls_in_its_head_is_closed(
    sidecar: Sidecar, sent: bytes
) -> None:
    assert await exchange(sidecar, sent) == b""  # closed, where it was held open for ever


PIPELINED_GET = b"GET /healthz HTTP/1.1\r\nhost: x\r\n\r\n"


async def test_requests_pipelined_within_the_bound_are_all_answered_in_order(
    sidecar: Sidecar,
) -> None:
    answers = await exchange(sidecar, PIPELINED_GET * http_door.MAX_PIPELINED + CLOSING_GET)
    assert answers.count(b"HTTP/1.1 200 ") == http_door.MAX_PIPELINED + 1


async def test_a_client_pipelining_without_reading_is_closed_with_its_queue_bounded(
    sidecar: Sidecar, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A client sends GETs back to back and never reads an answer: past MAX_PIPELINED queued
    requests its connection is closed, the queue never held more, nothing more of it is read
    (where every request was queued and every answer kept, without end), and the door serves
    others on."""
    queued: list[int] = []  # the queue's length after each request's head
    real = http_door._BoundedHead.on_headers_complete

    def counted(self: http_door._BoundedHead) -> None:
        real(self)
        queued.append(len(self.pipeline))

    monkeypatch.setattr(http_door._BoundedHead, "on_headers_complete", counted)
    assert sidecar.http is not None
    _, writer = await asyncio.open_connection("127.0.0.1", sidecar.http_port)
    sent = 0
    with contextlib.suppress(ConnectionError):
        async with asyncio.timeout(LIVENESS_S):
            while sent < 4 << 20:  # 4 MiB: far past what a bounded door reads of it
                writer.write(PIPELINED_GET * 1000)
                await writer.drain()
                sent += len(PIPELINED_GET) * 1000
    assert sent < 4 << 20, "the door read on without closing the connection"
    assert max(queued) == http_door.MAX_PIPELINED  # one more closed it (the queue dropped)
    assert sidecar.http.admission.overrun_total == 1
    writer.close()
    async with httpx2.AsyncClient() as http:  # the door serves on
        assert (await http.get(url(sidecar, "/healthz"))).status_code == 200


def door_protocols(monkeypatch: pytest.MonkeyPatch) -> list[http_door._BoundedHead]:
    """The door's connections' protocols, each as its connection is made."""
    made: list[http_door._BoundedHead] = []
    connection_made = http_door._BoundedHead.connection_made

    def kept(self: http_door._BoundedHead, transport: asyncio.Transport) -> None:
        made.append(self)
        connection_made(self, transport)

    monkeypatch.setattr(http_door._BoundedHead, "connection_made", kept)
    return made


class Unsent:
    """A connection's unsent bytes at each of the door's checks, as a client reading at a pace
    leaves them (the last figure from then on)."""

    def __init__(self, sizes: list[int]) -> None:
        self.sizes = sizes
        self.checks = 0

    def __call__(self) -> int:
        self.checks += 1
        return self.sizes[min(self.checks, len(self.sizes)) - 1]


async def test_a_connection_whose_answers_go_unread_is_dropped_and_one_read_on_is_not(
    sidecar: Sidecar, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An answer being written holds its call's slot until it is: 64 connections pipelining
    MCP tool calls they never read held every slot (every caller refused) for as long as they
    stayed open. While the door cannot write all it has (its flow control paused, as when the
    socket is full), a client must read MIN_READ_BYTES every UNREAD_ANSWER_S: one that reads
    nothing, or a byte at a time, is dropped; one that reads on at a slow link's pace is kept
    until it stops; one that reads all (writing resumes) is kept. The first version dropped a
    client reading steadily at 40 KB/s: it counted only the reads that emptied the buffer."""
    monkeypatch.setattr(http_door, "UNREAD_ANSWER_S", 0.2)
    made = door_protocols(monkeypatch)
    assert sidecar.http is not None
    clients = [await asyncio.open_connection("127.0.0.1", sidecar.http_port) for _ in range(4)]
    await eventually(lambda: len(made) == 4)
    _, read_all, trickling, reading_on = made
    step = http_door.MIN_READ_BYTES
    trickled = Unsent([10 * step - n for n in range(50)])  # a byte a check
    slow = Unsent([5 * step, 4 * step, 3 * step, 2 * step, 2 * step])  # reads on, then stops
    trickling._unsent = trickled  # type: ignore[method-assign]
    reading_on._unsent = slow  # type: ignore[method-assign]
    for protocol in made:
        protocol.pause_writing()  # what the transport does when the socket is full
    read_all.resume_writing()
    for index in (0, 2):  # nothing read, a byte a check: dropped at the first check
        async with asyncio.timeout(LIVENESS_S):
            assert await clients[index][0].read() == b""
    assert slow.checks < 5  # the slow reader is still served meanwhile
    async with asyncio.timeout(LIVENESS_S):
        assert await clients[3][0].read() == b""  # dropped once it stopped reading
    assert slow.checks == 5
    assert sidecar.http.admission.cut_total == 3
    clients[1][1].write(b"GET /healthz HTTP/1.1\r\nhost: x\r\nconnection: close\r\n\r\n")
    async with asyncio.timeout(LIVENESS_S):
        assert (await clients[1][0].read()).startswith(b"HTTP/1.1 200 ")
    for _, writer in clients:
        writer.close()


async def test_the_bytes_a_client_has_not_read_count_the_sockets_send_queue() -> None:
    """On loopback the kernel holds megabytes of a connection's answers: a client reading
    steadily from them left the transport's own buffer untouched, and the door took it for one
    that read nothing (the first version dropped a client reading 40 KB/s). What the socket
    still holds counts, and falls as the client reads."""
    if not hasattr(termios_module, "TIOCOUTQ"):
        pytest.skip("needs TIOCOUTQ (Linux)")
    accepted: asyncio.Queue[tuple[asyncio.StreamReader, asyncio.StreamWriter]] = asyncio.Queue()

    async def keep(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await accepted.put((reader, writer))

    server = await asyncio.start_server(keep, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    client_reader, client_writer = await asyncio.open_connection("127.0.0.1", port)
    _, writer = await accepted.get()
    writer.write(
        b"x" * (4 << 20)
    )  # the client reads none of it yet (the socket takes its share now)
    held = http_door._socket_unsent(writer.transport)
    assert held > 0
    async with asyncio.timeout(LIVENESS_S):
        await client_reader.readexactly(4 << 20)
        await writer.drain()
    assert http_door._socket_unsent(writer.transport) < held
    for w in (writer, client_writer):
        w.close()
    server.close()


def test_an_answer_written_after_its_pipelined_connection_is_lost_is_dropped_quietly(
    store: Path, local_embedder: Embedder, monkeypatch: pytest.MonkeyPatch, caplog: Any
) -> None:
    """uvicorn tells only a connection's newest call that it is lost: an earlier one, its
    request pipelined, wrote on to the closed transport, which uvloop refuses (RuntimeError),
    and each such call logged errors with tracebacks (three for an MCP call: 218 lines for 90
    connections an attacker left). Served under uvloop, as ``voxrecall serve`` runs."""
    caplog.set_level(logging.WARNING)
    made = door_protocols(monkeypatch)
    real_respond = http_door.respond

    async def scenario() -> None:
        gate, waiting, written = asyncio.Event(), asyncio.Event(), asyncio.Event()

        async def held(*args: Any, **kwargs: Any) -> None:
            if waiting.is_set():
                await real_respond(*args, **kwargs)
                return
            waiting.set()  # the first answer waits until its client is gone
            await gate.wait()
            try:
                await real_respond(*args, **kwargs)
            finally:  # (an error it raises is logged in this same step, before the test reads)
                written.set()

        monkeypatch.setattr(http_door, "respond", held)
        config = sidecar_config(store, http={"listen": "127.0.0.1:0"})
        async with running(config, local_embedder) as sc:
            _, writer = await asyncio.open_connection("127.0.0.1", sc.http_port)
            writer.write(b"GET /healthz HTTP/1.1\r\nhost: x\r\n\r\n" * 2)  # pipelined
            await eventually(lambda: waiting.is_set() and len(made[0]._cycles) == 2)
            made[0]._drop()  # as the door drops it (answers unread, too many pipelined)
            gate.set()
            async with asyncio.timeout(LIVENESS_S):
                await written.wait()  # the first answer is written (or dropped) now
            writer.close()

    uvloop.run(scenario())
    errors = [r for r in caplog.records if r.levelno >= logging.ERROR]
    assert errors == [], [r.getMessage() for r in errors]


# -- the connection cap ------------------------------------------------------------------------


@pytest.fixture
def long_keep_alive(monkeypatch: pytest.MonkeyPatch) -> None:
    # the connections a test holds stay open for the whole test, however slow the machine
    monkeypatch.setattr(http_door, "KEEP_ALIVE_S", 600)


async def ask(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, path: str) -> bytes:
    """One GET on a kept-alive connection: the answer's head and body."""
    writer.write(f"GET {path} HTTP/1.1\r\nhost: x\r\n\r\n".encode())
    await writer.drain()
    async with asyncio.timeout(LIVENESS_S):
        head = await reader.readuntil(b"\r\n\r\n")
        length = re.search(rb"content-length: (\d+)", head, re.IGNORECASE)
        assert length is not None, head
        return head + await reader.readexactly(int(length.group(1)))


CLOSING_GET = b"GET /healthz HTTP/1.1\r\nhost: x\r\nconnection: close\r\n\r\n"


@pytest.mark.usefixtures("long_keep_alive")
async def test_connections_over_max_connections_get_503_while_the_others_serve_on(
    store: Path, local_embedder: Embedder
) -> None:
    config = sidecar_config(store, http={"listen": "127.0.0.1:0", "max_connections": 2})
    async with (
        running(config, local_embedder) as sc,
        grpc.aio.insecure_channel(f"127.0.0.1:{sc.port}") as channel,
    ):
        assert sc.http is not None
        held = [await asyncio.open_connection("127.0.0.1", sc.http_port) for _ in range(2)]
        for reader, writer in held:  # both served, and kept open
            assert (await ask(reader, writer, "/healthz")).startswith(b"HTTP/1.1 200 ")

        refused = await asyncio.gather(*(exchange(sc, CLOSING_GET) for _ in range(20)))
        for answer in refused:  # answered at once, whole (no reset), and closed
            assert answer.startswith(b"HTTP/1.1 503 "), answer
            assert b"max_connections" in answer
        assert sc.http.admission.refused_total == 20

        for reader, writer in held:  # the first two serve on
            assert (await ask(reader, writer, "/readyz")).startswith(b"HTTP/1.1 200 ")
        stub = pb_grpc.RetrievalStub(channel)  # type: ignore[no-untyped-call]
        turn = pb.TurnRequest(session_id="s", text="reset my password", is_final=True)
        assert (await stub.Turn(turn)).chunks  # and gRPC is not starved

        held[0][1].close()  # a connection that closes gives its slot back
        await held[0][1].wait_closed()
        answer = b""
        async with asyncio.timeout(LIVENESS_S):  # the door sees the close soon: not a timing
            while not answer.startswith(b"HTTP/1.1 200 "):
                answer = await exchange(sc, CLOSING_GET)  # 503 until it has seen it
        held[1][1].close()


@pytest.mark.usefixtures("long_keep_alive")
async def test_one_address_over_its_cap_gets_503_while_another_is_served(
    store: Path, local_embedder: Embedder
) -> None:
    """max_connections_per_ip: 127.0.0.2 (Linux routes all of 127/8 to loopback) holding its
    two connections is refused a third, while 127.0.0.1 is served; a close gives its slot back."""
    http = {"listen": "127.0.0.1:0", "max_connections": 10, "max_connections_per_ip": 2}
    config = sidecar_config(store, http=http)
    async with running(config, local_embedder) as sc:
        assert sc.http is not None

        async def connect(source: str) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
            return await asyncio.open_connection("127.0.0.1", sc.http_port, local_addr=(source, 0))

        held = [await connect("127.0.0.2") for _ in range(2)]
        for reader, writer in held:
            assert (await ask(reader, writer, "/healthz")).startswith(b"HTTP/1.1 200 ")
        reader, writer = await connect("127.0.0.2")
        writer.write(CLOSING_GET)
        async with asyncio.timeout(LIVENESS_S):
            refused = await reader.read()
        writer.close()
        assert refused.startswith(b"HTTP/1.1 503 "), refused
        assert b"max_connections_per_ip" in refused
        assert b"retry-after: 1" in refused

        other = await exchange(sc, CLOSING_GET)  # from 127.0.0.1: served
        assert other.startswith(b"HTTP/1.1 200 "), other
        for reader, writer in held:  # the address's first two serve on
            assert (await ask(reader, writer, "/readyz")).startswith(b"HTTP/1.1 200 ")

        held[0][1].close()
        await held[0][1].wait_closed()
        answer = b""
        async with asyncio.timeout(LIVENESS_S):  # the door sees the close soon: not a timing
            while not answer.startswith(b"HTTP/1.1 200 "):
                reader, writer = await connect("127.0.0.2")
                writer.write(CLOSING_GET)
                answer = await reader.read()
                writer.close()
        held[1][1].close()


async def test_http_calls_are_counted_by_door(sidecar: Sidecar) -> None:
    await post_tool(sidecar, RETELL_BODY, signed(RETELL_BODY))
    await post_tool(sidecar, RETELL_BODY, {})
    async with mcp_session(sidecar) as session:
        await session.call_tool("search_help", {"query": "password"})
    m = scrape(sidecar.metrics_port)
    assert value(m, "voxrecall_rpcs_total", door="http", method="Tool", code="OK") == 1
    assert value(m, "voxrecall_rpcs_total", door="http", method="Tool", code="UNAUTHENTICATED") == 1
    assert value(m, "voxrecall_rpcs_total", door="http", method="MCP tools/call", code="OK") == 1


async def test_the_concurrency_limit_counts_both_doors(
    store: Path, local_embedder: Embedder
) -> None:
    config = sidecar_config(store, http={"listen": "127.0.0.1:0"}, max_streams=1)
    async with (
        running(config, local_embedder) as sc,
        grpc.aio.insecure_channel(f"127.0.0.1:{sc.port}") as channel,
    ):
        stub = pb_grpc.RetrievalStub(channel)  # type: ignore[no-untyped-call]
        stream = stub.Converse()
        turn = pb.TurnRequest(session_id="c", text="reset my password", is_final=True)
        await stream.write(pb.ConverseRequest(turn=turn))
        await stream.read()  # the stream holds the one stream slot now
        async with httpx2.AsyncClient() as http:  # an HTTP call counts against the unary slots
            called = await http.post(
                url(sc, "/tools/search_help"), json={"args": {"query": "reset my password"}}
            )
            event_stream = await http.get(url(sc, "/mcp"), headers={"accept": "text/event-stream"})
        await stream.done_writing()
    assert called.status_code == 200  # the stream slot is not the unary one
    # no MCP event stream to hold a slot open: the spec's 405, with what to do instead
    assert event_stream.status_code == 405
    assert "POST" in event_stream.json()["error"]["message"]


def test_the_http_config_refuses_secrets_in_the_file_and_bad_values(tmp_path: Path) -> None:
    def parse(http: dict[str, Any]) -> None:
        sidecar_config(tmp_path, http=http)

    with pytest.raises(ConfigError, match="never goes in the file"):
        parse({"vapi_secret": "x"})
    with pytest.raises(ConfigError, match="host:port"):
        parse({"listen": "8080"})
    with pytest.raises(ConfigError, match="max_body_bytes"):
        parse({"max_body_bytes": 10})
    with pytest.raises(ConfigError, match="max_connections"):
        parse({"max_connections": 0})
    with pytest.raises(ConfigError, match="max_connections_per_ip"):
        parse({"max_connections_per_ip": -1})
    with pytest.raises(ConfigError, match="not configured"):
        parse({"read_page_bases": ["nope"]})


async def test_the_http_door_speaks_mutual_tls_from_the_same_files(
    tmp_path: Path, store: Path, local_embedder: Embedder
) -> None:
    certs = make_certs(tmp_path / "certs")
    tls = {
        "cert_file": str(certs / "server.pem"),
        "key_file": str(certs / "server.key"),
        "client_ca_file": str(certs / "ca.pem"),
    }
    config = sidecar_config(store, tls=tls, http={"listen": "127.0.0.1:0"})
    async with running(config, local_embedder) as sc:
        base = f"https://127.0.0.1:{sc.http_port}"
        trusted = ssl.create_default_context(cafile=str(certs / "ca.pem"))
        with_cert = ssl.create_default_context(cafile=str(certs / "ca.pem"))
        with_cert.load_cert_chain(str(certs / "client.pem"), str(certs / "client.key"))
        async with httpx2.AsyncClient(verify=with_cert) as http:
            assert (await http.get(f"{base}/readyz")).status_code == 200
        async with httpx2.AsyncClient(verify=trusted) as http:  # no client certificate
            with pytest.raises(httpx2.TransportError):
                await http.get(f"{base}/readyz")
        async with httpx2.AsyncClient() as http:  # plaintext to a TLS port
            with pytest.raises(httpx2.TransportError):
                await http.get(f"http://127.0.0.1:{sc.http_port}/readyz")


async def test_a_tls_door_says_https_and_logs_a_plain_http_request_once_per_many(
    tmp_path: Path,
    store: Path,
    local_embedder: Embedder,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A team that read "HTTP on port" sent http:// and saw its calls closed and a silent log:
    the start line says HTTPS, and such a request is logged (the first, then one per
    OVERRUN_LOG_EVERY, so a flood of them is not a line each)."""
    caplog.set_level(logging.INFO, logger="voxrecall")
    monkeypatch.setattr(http_door, "OVERRUN_LOG_EVERY", 3)
    certs = make_certs(tmp_path / "certs")
    tls = {"cert_file": str(certs / "server.pem"), "key_file": str(certs / "server.key")}
    config = sidecar_config(store, tls=tls, http={"listen": "127.0.0.1:0"})
    async with running(config, local_embedder) as sc:
        assert f"HTTPS on port {sc.http_port}" in start_line(sc)
        assert sc.http is not None
        admission, counted = sc.http.admission, asyncio.Event()
        plain_http = admission.plain_http

        def count(address: str) -> None:
            plain_http(address)
            if admission.plain_http_total == 4:
                counted.set()

        monkeypatch.setattr(admission, "plain_http", count)
        for _ in range(4):
            await exchange(sc, b"GET /readyz HTTP/1.1\r\nhost: x\r\n\r\n")
        async with asyncio.timeout(LIVENESS_S):  # the door counts each as its handshake fails
            await counted.wait()
    said = [r.getMessage() for r in caplog.records if "plain http://" in r.getMessage()]
    assert len(said) == 2  # the first and the fourth
    assert "https://" in said[0]
    plain = sidecar_config(store, http={"listen": "127.0.0.1:0"})
    async with running(plain, local_embedder) as sc:
        assert f", HTTP on port {sc.http_port}" in start_line(sc)


def test_a_tls_door_under_uvloop_takes_the_hello_sent_with_the_connect(
    tmp_path: Path, store: Path, local_embedder: Embedder
) -> None:
    """uvloop reads once after a ``pause_reading`` made in ``connection_made``: the hello of
    about every other client was read by the door's own protocol, never by TLS, and its
    handshake ran out its 5 s (``SSLEOFError``). Served under uvloop, as ``voxrecall serve``
    runs, every client that sends its hello with the connect is answered."""
    certs = make_certs(tmp_path / "certs")
    tls = {"cert_file": str(certs / "server.pem"), "key_file": str(certs / "server.key")}
    config = sidecar_config(store, tls=tls, http={"listen": "127.0.0.1:0"})
    trusted = ssl.create_default_context(cafile=str(certs / "ca.pem"))

    def ready(port: int) -> bytes:
        with (
            socket.create_connection(("127.0.0.1", port), timeout=LIVENESS_S) as raw,
            trusted.wrap_socket(raw, server_hostname="localhost") as tls_socket,
        ):
            tls_socket.sendall(b"GET /readyz HTTP/1.1\r\nhost: x\r\nconnection: close\r\n\r\n")
            return tls_socket.recv(12)

    async def clients() -> list[bytes]:
        async with running(config, local_embedder) as sc:
            return [await asyncio.to_thread(ready, sc.http_port) for _ in range(16)]

    assert uvloop.run(clients()) == [b"HTTP/1.1 200"] * 16


async def test_a_tls_handshake_cancelled_before_it_began_closes_its_socket(
    tmp_path: Path, store: Path, local_embedder: Embedder
) -> None:
    """The door's stop cancels every handshake: one cancelled before start_tls had run left its
    socket open (paused, served by no one) until the process ended."""
    certs = make_certs(tmp_path / "certs")
    tls = {"cert_file": str(certs / "server.pem"), "key_file": str(certs / "server.key")}
    config = sidecar_config(store, tls=tls, http={"listen": "127.0.0.1:0"})
    loop = asyncio.get_running_loop()

    class CancelledAtOnce(set[asyncio.Task[None]]):
        def add(self, task: asyncio.Task[None]) -> None:  # as the door's stop would, then
            super().add(task)
            loop.call_soon(task.cancel)

    async with running(config, local_embedder) as sc:
        assert sc.http is not None
        sc.http.admission.handshakes = CancelledAtOnce()
        reader, writer = await asyncio.open_connection("127.0.0.1", sc.http_port)
        try:
            async with asyncio.timeout(LIVENESS_S):
                assert await reader.read() == b""  # closed by the door
        finally:
            writer.close()


@pytest.mark.usefixtures("long_keep_alive")
async def test_a_tls_handshake_counts_toward_the_cap_and_is_bounded(
    tmp_path: Path,
    store: Path,
    local_embedder: Embedder,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Connections that open and never say hello hold their slots (one more is closed at once,
    and the log says it was closed, not answered) only until TLS_HANDSHAKE_TIMEOUT_S closes
    them; then a real client is served."""
    caplog.set_level(logging.WARNING, logger="voxrecall")
    monkeypatch.setattr(http_door, "TLS_HANDSHAKE_TIMEOUT_S", 0.5)
    certs = make_certs(tmp_path / "certs")
    tls = {"cert_file": str(certs / "server.pem"), "key_file": str(certs / "server.key")}
    config = sidecar_config(store, tls=tls, http={"listen": "127.0.0.1:0", "max_connections": 2})
    async with running(config, local_embedder) as sc:
        assert sc.http is not None
        silent = [await asyncio.open_connection("127.0.0.1", sc.http_port) for _ in range(2)]
        assert (await exchange(sc, b"")) == b""  # a third: closed at once, the two are counted
        (full,) = [m for m in map(logging.LogRecord.getMessage, caplog.records) if "is full" in m]
        assert "closed unanswered (TLS)" in full
        assert "503" not in full
        for reader, writer in silent:  # and each is closed when its handshake is out of time
            async with asyncio.timeout(LIVENESS_S):
                assert await reader.read() == b""
            writer.close()
        trusted = ssl.create_default_context(cafile=str(certs / "ca.pem"))
        async with httpx2.AsyncClient(verify=trusted) as http:
            status = 0
            async with asyncio.timeout(LIVENESS_S):  # the door counts the closes soon after
                while status != 200:
                    with contextlib.suppress(httpx2.TransportError):
                        reply = await http.get(f"https://127.0.0.1:{sc.http_port}/readyz")
                        status = reply.status_code
        assert sc.http.admission.open <= 1
        assert not sc.http.admission.handshakes


async def test_http_calls_log_their_door(sidecar: Sidecar) -> None:
    stream = io.StringIO()
    root = logging.getLogger()
    saved = root.level, list(root.handlers)
    logs.configure("DEBUG", "json", stream=stream)
    try:
        await post_tool(sidecar, RETELL_BODY, signed(RETELL_BODY))
    finally:
        root.setLevel(saved[0])
        root.handlers[:] = saved[1]
    lines = [orjson.loads(line) for line in stream.getvalue().splitlines()]
    ended = [line for line in lines if line.get("msg", "").startswith("Tool OK")]
    assert ended
    assert ended[0]["door"] == "http"
    assert ended[0]["method"] == "Tool"


# -- the budget ----------------------------------------------------------------------------------


async def test_a_stuck_embedder_is_answered_lexically_through_every_http_door(
    tmp_path: Path, secrets: None
) -> None:
    """The turn's budget and lexical fallback hold on the HTTP door as on gRPC: with a model
    that never answers, a Vapi request, a tool webhook call and an MCP tool call still answer,
    from the lexical index, within the budget."""
    store = build_store(tmp_path, FakeEmbedder(dimension=32))
    config = sidecar_config(store, auth=AUTH, http=HTTP, budget_ms=150)
    async with running(config, FakeEmbedder(dimension=32, hang=True)) as sc:
        reply = await vapi(sc, [{"role": "user", "content": "How do I export my data?"}])
        assert reply.status_code == 200
        assert reply.json()["documents"][0]["content"].startswith("Export your data")

        tool = await post_tool(sc, RETELL_BODY, signed(RETELL_BODY))
        assert tool.status_code == 200
        assert tool.json()["results"][0]["title"] == "Reset your password"

        async with mcp_session(sc) as session:
            result = await session.call_tool("search_help", {"query": "reset my password"})
        assert not result.is_error
        assert output(result)["results"][0]["title"] == "Reset your password"
        assert sc.engine.vectors.stats.late >= 1  # the stuck model was left behind, not awaited


@pytest.mark.parametrize("variable", ["VOX_TEST_VAPI", "VOX_TEST_WEBHOOK"])
async def test_a_secret_variable_named_but_unset_stops_the_start(
    store: Path,
    local_embedder: Embedder,
    secrets: None,
    monkeypatch: pytest.MonkeyPatch,
    variable: str,
) -> None:
    """An unset secret would accept every unsigned call: the start stops, as for a token."""
    monkeypatch.setenv(variable, "")
    config = sidecar_config(store, auth=AUTH, http=HTTP)
    with pytest.raises(ConfigError, match=f"{variable} is unset or empty"):
        await create_server(config, embedder=local_embedder, poll=False)


@pytest.mark.parametrize("variable", ["VOX_TEST_VAPI", "VOX_TEST_WEBHOOK"])
async def test_a_secret_too_short_to_be_redacted_stops_the_start(
    store: Path,
    local_embedder: Embedder,
    secrets: None,
    monkeypatch: pytest.MonkeyPatch,
    variable: str,
) -> None:
    """The logs redact secrets of 8 characters or more: a 7-character secret would be written
    in every line that held it, so it is refused, as a short token is."""
    monkeypatch.setenv(variable, "s3cr3t!")
    config = sidecar_config(store, auth=AUTH, http=HTTP)
    with pytest.raises(ConfigError, match=f"{variable} is shorter than 8 characters"):
        await create_server(config, embedder=local_embedder, poll=False)


def test_a_json_line_leaves_out_uvicorns_colour_codes() -> None:
    """uvicorn attaches ``color_message`` (its message in ANSI colours) for a terminal; in the
    JSON log it was a field full of escape codes."""
    record = logging.makeLogRecord(
        {"msg": "Uvicorn running on %s", "args": ("http://127.0.0.1:8080",), "levelno": 20}
    )
    record.color_message = "Uvicorn running on \x1b[1m%s\x1b[0m"
    line = orjson.loads(logs.JsonFormatter().format(record))
    assert line["msg"] == "Uvicorn running on http://127.0.0.1:8080"
    assert "color_message" not in line
