"""The HTTP door: Turn and Search, MCP, platform webhooks and health over HTTP, beside gRPC, in
the same loop.

    door = HttpDoor(config, engine, lifecycle, guards, toolbox)
    port = door.bind("127.0.0.1:8080")         # before anything serves: a port in use stops it
    await door.start()                          # uvicorn serving as a task of this event loop
    ...
    await door.stop()                          # after the drain (sidecar.edge.server.Sidecar.stop)

Paths: ``POST /v1/turn`` and ``POST /v1/search`` (the gRPC methods, their messages in proto3's
JSON mapping, ``sidecar.http.rpc``), ``/mcp`` (MCP streamable HTTP, ``sidecar.http.mcp``),
``POST /vapi/knowledge-base`` and ``POST /tools/{function}`` (``sidecar.http.webhooks``),
``GET /healthz`` (the process is up) and
``GET /readyz`` (200 once every base has a snapshot; 503 while loading or draining). Health
needs no token, as on gRPC.

Every other call runs the hooks a gRPC call runs (``sidecar.edge.guards``: the log context, metrics,
the bearer token and the caller's scope, the drain gate, the concurrency limit, the byte limits
of each field), on a ``Call`` whose door is ``http``, and checks the same proto messages
(``TurnRequest``, ``SearchRequest``, ``InvokeToolRequest``, ``ReadPageRequest``) a gRPC client
would send: whatever
the token could not reach over gRPC it cannot reach here. The body is read after the token's
check and before the concurrency slot is taken (``HttpDoor._admit``). A body over ``[sidecar.http]
max_body_bytes`` is refused (413) before it is read whole, and one with more JSON objects and
arrays than one per ``BYTES_PER_CONTAINER`` of it (400) before it is parsed
(``check_json_containers``); one that does not arrive within
``BODY_TIMEOUT_S`` gets 408; a request's head over ``MAX_HEAD_BYTES`` gets 431, and one not
whole within ``HEAD_TIMEOUT_S`` is closed (``_BoundedHead``). The rest of a request, read by the
app or not (a body, a chunked body's trailer), must be whole within ``REQUEST_TIMEOUT_S`` of its
call's start, its trailer within ``MAX_TRAILER_BYTES`` (read and dropped: no path sees one), a
chunked body in at most ``max_chunks`` chunks (``BYTES_PER_CHUNK``, ``MIN_MAX_CHUNKS``: the
parser calls Python once per chunk, whatever its size), or the connection is closed; an answer
sent before its request is whole (health, 404, a refused token, 413) says ``connection:
close``, and the connection closes once the rest has been read and dropped (at most
``MAX_DROPPED_BYTES`` of it). Requests pipelined ahead of their answers wait in a queue of at
most ``MAX_PIPELINED`` (one more closes the connection), and no more is read while one waits or while the client leaves its answers unread. At most
``[sidecar.http] max_connections`` connections are served at once: one more gets a 503 as soon
as it is accepted, before it is read and without a task, and is closed (``_Admission``); so does one
past ``max_connections_per_ip`` from one client address (with TLS, where nothing can be said
before a handshake, it is only closed, and the log says so). With TLS the door makes the handshake
itself, counted from the accept and bounded by ``TLS_HANDSHAKE_TIMEOUT_S``. Errors are ``{"error": {"code",
"message"}}`` with the HTTP status
``sidecar.edge.status.http_status_for`` gives; the ``x-call-id`` header names the call in the logs.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import functools
import logging
import socket
import ssl
import sys
import termios
from collections import Counter
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from typing import Any, cast

import grpc
import httptools
import orjson
import uvicorn
from starlette.types import Message, Receive, Scope, Send
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol, RequestResponseCycle

from index.errors import CannotListen, VoxrecallError
from index.json_count import json_containers
from sidecar.config import Config
from sidecar.edge import tls
from sidecar.edge.addresses import share_key
from sidecar.edge.guards import Guards
from sidecar.edge.interceptor import Call, Phases
from sidecar.edge.lifecycle import Lifecycle, State
from sidecar.edge.status import (
    caller_message,
    code_of_http_status,
    http_status_for,
    status_for,
)
from sidecar.errors import (
    BodyEncoded,
    BodyTooLarge,
    IdleTimeout,
    InvalidArgument,
    RequestError,
    ResourceExhausted,
    Unauthenticated,
    Unavailable,
)
from sidecar.functions.tools import Toolbox
from sidecar.http.mcp import (
    McpDoor,
    initialize_refusal,
    session_header_refusal,
    session_refusal,
)
from sidecar.http.rpc import SEARCH_PATH, TURN_PATH, PlainCalls
from sidecar.http.webhooks import Reply, Webhooks
from sidecar.turn.engine import Engine

log = logging.getLogger("voxrecall.http")

MCP_PATH = "/mcp"
VAPI_PATH = "/vapi/knowledge-base"
TOOLS_PREFIX = "/tools/"
PATHS = (
    f"{TURN_PATH}, {SEARCH_PATH}, {MCP_PATH}, {VAPI_PATH}, {TOOLS_PREFIX}{{function}}, /healthz, "
    "/readyz"
)
# A 405's code: the gRPC status name a path asked with a method it does not take maps to (as
# grpc-gateway maps its 405s), not INVALID_ARGUMENT, which says the request's content was wrong.
METHOD_NOT_ALLOWED = grpc.StatusCode.UNIMPLEMENTED.name
# The server answers each MCP POST with JSON and pushes nothing, so a GET event stream would only
# hold a connection (and a max_streams slot) open: the spec lets a server refuse it with 405.
MCP_GET_REFUSED = "this MCP server sends no event stream: POST each JSON-RPC message to /mcp"
# A platform posts a few kilobytes at once; a body still arriving after this long is a client
# that stalled (or one holding a slot on purpose).
BODY_TIMEOUT_S = 10.0
# A JSON body may hold one object or array per this many bytes of max_body_bytes (32,768 at the
# default): each is a Python object its parse builds on the event loop (87,000 empty arrays fit
# in 256 KiB; a parse of them held the loop 16 ms and more). The densest real payloads hold one
# per 22 bytes (Vapi messages of two words as OpenAI content parts), Retell's transcript with
# every word's timings one per 35, Vapi's tool calls one per 41
# (tests/test_http_door.py, test_real_payloads_are_far_within_the_json_limit).
BYTES_PER_CONTAINER = 8
# After the drain every call is done: this is how long a connection still sending gets.
CLOSE_TIMEOUT_S = 1
# A request's head (request line and headers): at most this many bytes (431 past it), and
# whole within HEAD_TIMEOUT_S of the connection or of its first byte (closed after that).
# uvicorn's httptools protocol bounds neither: a client could grow one header without end, or
# hold a connection open by never finishing one.
MAX_HEAD_BYTES = 64 * 1024
# ... and at most this many fields (431 past it): each costs the event loop a few callbacks, and
# 13,000 empty ones fit in 64 KiB (13 ms a request: four clients held another's calls 95 ms).
# A platform's webhook sends about 20.
MAX_HEAD_FIELDS = 128
HEAD_TIMEOUT_S = 10.0
# A request with a body that asks to upgrade its connection (``curl --http2`` on http:// asks
# for h2c): the parser hands the body to the upgrade, so the request looked empty (a 400 saying
# "a zero-length document" to a client that sent one). The door speaks HTTP/1.1 only.
UPGRADE_WITH_BODY = (
    "the request asks to upgrade its connection (Upgrade: h2c from curl --http2?), and its body "
    "would be lost: the door speaks HTTP/1.1 only; send it without Upgrade (curl --http1.1)"
)
UNKNOWN_CODING = (
    "the request's Transfer-Encoding is not chunked alone: the door decodes no other transfer "
    "coding (gzip, deflate); send the body as it is, chunked or with a Content-Length"
)
TWO_AUTHORIZATIONS = "the request has more than one Authorization header: send one"
# While the door has more to write than the socket takes, a client must read MIN_READ_BYTES of
# its answers every UNREAD_ANSWER_S, or its connection is dropped: an answer being written (an
# MCP tool's, a page's) holds its call's ``max_concurrent_rpcs`` slot until it is, and 64
# connections pipelining tool calls they never read held every slot, every caller refused, for
# as long as they stayed open. A slow mobile link reads hundreds of times as much; one byte
# every 9 s would otherwise hold a slot as long as it liked.
UNREAD_ANSWER_S = 10.0
MIN_READ_BYTES = 16 * 1024
# An MCP request's answer must start within this: the SDK waits on its own streams with no
# deadline, and a request whose answer never came (two of one id in flight) held its slot for
# ever. Its tools answer within the turn's budget; reading a page, within milliseconds.
MCP_ANSWER_S = 30.0
# The rest of a request (its body, a chunked body's trailer) must be whole within this long of
# its call's start, or the connection is closed: BODY_TIMEOUT_S's 408 comes first where the
# body is read, and this bounds the paths that answer without reading it (health, 404, 405, a
# refused token), which uvicorn would otherwise read on for ever.
REQUEST_TIMEOUT_S = BODY_TIMEOUT_S + 2.0
# A body a client sends on after its answer (a 413 for one over max_body_bytes, a refused
# token, health) is read and dropped, so that the client reads the answer (a close with its
# bytes unread would reset the connection and lose it), up to this many bytes: past them the
# connection is closed. Nothing of it is kept; REQUEST_TIMEOUT_S bounds it too.
MAX_DROPPED_BYTES = 16 * 1024 * 1024
# A chunked body's trailer fields are read and dropped (no path reads them; uvicorn would add
# them to the request's headers without bound): more than this many bytes of them closes the
# connection.
MAX_TRAILER_BYTES = 8 * 1024
# A chunked body's chunks: at most max_body_bytes // BYTES_PER_CHUNK of them, and never fewer
# than MIN_MAX_CHUNKS (1,024 at the default 256 KiB), besides the last, empty one; one more
# closes the connection (``max_chunks``). The parser calls Python once for each chunk, and the
# limits in body bytes do not count its framing: 1-byte chunks (six wire bytes each) held the
# event loop over a second for a client with no token, whose 16 MiB of body read and dropped
# after its 401 were 100 MB on the wire. A body of max_body_bytes in chunks of 256 bytes (or
# of any size, up to 1,024 of them) still fits; HTTP clients send 1 to 64 KiB at a time.
BYTES_PER_CHUNK = 256
MIN_MAX_CHUNKS = 1024
# An idle keep-alive connection is closed after this long (uvicorn's default, named here): a
# platform sends its next call on it within seconds, and an idle one must give its slot back.
KEEP_ALIVE_S = 5
# A connection refused over max_connections gets its 503 at once and its side closed for
# writing; it has this long to send its request and read the answer before its socket closes
# (closing on a request still arriving would reset the connection and lose the 503).
REFUSED_LINGER_S = 1.0
# HTTP/1.1 pipelining: requests a client sends before reading the answers wait in a queue and
# are answered one at a time. At most this many wait per connection (each holds its head, up to
# MAX_HEAD_BYTES); one more closes the connection, its queued requests and unsent answers
# dropped. No common client pipelines; one that sends without reading would otherwise have
# every request of each read queued (8,000 GETs in one 256 KiB read) and every answer kept.
MAX_PIPELINED = 8
# Such a close is logged once per this many (the first one logged): one client reconnecting
# without end must not flood the log. A plain HTTP request to the TLS door, a TLS client at the
# plain door, a request the parser refuses (400) and an upgrade request are logged so too
# (``_Admission``).
OVERRUN_LOG_EVERY = 1000
# uvicorn's answer to a request its parser refuses (a Content-Length of ``z`` or of 2**64 or more),
# kept as uvicorn sends it: 400, this text, and the connection closed.
INVALID_REQUEST = "Invalid HTTP request received."
# The reason OpenSSL gives a handshake whose first bytes are a plain HTTP request.
PLAIN_HTTP = "HTTP_REQUEST"
# The first bytes of a TLS record holding a handshake (type 22, version 3.x): an https:// client
# at the plain door.
TLS_RECORD = b"\x16\x03"
# A TLS handshake is a round trip or two: one not done within this long is a client that stalled
# (or one holding a connection on purpose); asyncio's own default would hold it for 60 s.
TLS_HANDSHAKE_TIMEOUT_S = 5.0
JSON = (b"content-type", b"application/json")


class _Context:
    """What the hooks touch of a gRPC servicer context, for a call over HTTP: the call id header
    ``CallLog`` sets goes into the reply's headers; ``peer`` is the client's address."""

    def __init__(self, peer: str = "") -> None:
        self.headers: list[tuple[bytes, bytes]] = []
        self._peer = peer

    def peer(self) -> str:
        return self._peer

    def set_trailing_metadata(self, metadata: Sequence[tuple[str, str]]) -> None:
        self.headers.extend((k.encode(), v.encode()) for k, v in metadata)

    def code(self) -> None:
        return None


class HttpCall(Call):
    """One call over HTTP, run through the same hooks as a gRPC call (``Call``, as
    ``sidecar.edge.interceptor`` runs them): ``start(until=...)`` the hooks that read only the
    headers, then, once the body is in, ``start()`` the rest; ``check`` each message it
    carries, ``finish`` exactly once."""

    __slots__ = ("answered",)

    def __init__(
        self, phases: Phases, method: str, headers: dict[str, str], peer: str = ""
    ) -> None:
        super().__init__(method, "http", headers, cast(Any, _Context(peer)), phases, door="http")
        self.answered = False  # a response has started: no error answer can follow it

    @property
    def reply(self) -> _Context:
        """The call's context as the door made it: the reply's headers (the call id), as the
        hooks set them."""
        return cast(_Context, self.context)

    def rename(self, method: str) -> None:
        """Name the call once its body says what it is (an MCP request's method)."""
        self.method = method  # on the call's lines from now on (``logs.current``)

    def finish(self, code: grpc.StatusCode) -> None:
        """End the hooks with ``code``, unless a refusal seen in ``check`` named the call's."""
        if self.code is grpc.StatusCode.OK:
            self.code = code
        self.end()


def headers_of(scope: Scope) -> dict[str, str]:
    """The request's headers, names in lower case (ASGI gives them so), values as text."""
    return {k.decode("latin-1"): v.decode("latin-1") for k, v in scope["headers"]}


def peer_of(scope: Scope) -> str:
    """The client's address (``127.0.0.1:5000``), or empty where the server does not say."""
    client = scope.get("client")
    return f"{client[0]}:{client[1]}" if client else ""


async def read_body(receive: Receive, headers: dict[str, str], limit: int) -> bytes:
    """The whole body, at most ``limit`` bytes (``BodyTooLarge`` past it, before reading on),
    within ``BODY_TIMEOUT_S``; one with a ``Content-Encoding`` is refused unread (415)."""
    encoding = headers.get("content-encoding", "").strip()
    if encoding and encoding.lower() != "identity":
        raise BodyEncoded(
            f"Content-Encoding {encoding[:40]!r} is not supported: send the body uncompressed"
        )
    length = headers.get("content-length", "")
    if length.isdigit() and int(length) > limit:
        raise BodyTooLarge(_too_large(int(length), limit))
    chunks: list[bytes] = []
    size = 0
    try:
        async with asyncio.timeout(BODY_TIMEOUT_S):
            while True:
                message = await receive()
                if message["type"] == "http.disconnect":
                    raise ClientGone
                chunk = message.get("body", b"")
                size += len(chunk)
                if size > limit:
                    raise BodyTooLarge(_too_large(size, limit))
                chunks.append(chunk)
                if not message.get("more_body", False):
                    return b"".join(chunks)
    except TimeoutError:
        raise IdleTimeout(
            f"the request body did not arrive within {BODY_TIMEOUT_S:g} s: send it whole"
        ) from None


class ClientGone(Exception):
    """The client disconnected before its request was whole: nobody to answer."""


def _too_large(size: int, limit: int) -> str:
    return (
        f"the request body is {size} bytes or more; the limit is {limit} "
        "([sidecar.http] max_body_bytes)"
    )


def max_chunks(max_body: int) -> int:
    """How many chunks (besides the last) a chunked body may have, for a door of
    ``max_body_bytes``."""
    return max(MIN_MAX_CHUNKS, max_body // BYTES_PER_CHUNK)


def max_json_containers(max_body: int) -> int:
    """The JSON objects and arrays a body may hold: one per ``BYTES_PER_CONTAINER`` of
    ``max_body_bytes``."""
    return max_body // BYTES_PER_CONTAINER


def check_json_containers(body: bytes, limit: int) -> None:
    """Refuse (400) a body with more than ``limit`` JSON objects and arrays, before it is
    parsed: each is a Python object the parse builds on the event loop and the collector walks
    while it lives. Counted at C speed as its ``[`` and ``{``, brackets inside strings too, so
    the count errs only toward refusing. A body no longer than ``limit`` cannot pass it: not
    scanned (nearly every platform's post)."""
    if len(body) <= limit:
        return
    count = json_containers(body)
    if count > limit:
        raise InvalidArgument(
            f"the request body holds {count} JSON objects and arrays (counting brackets inside "
            f"strings); the limit is {limit}, one per {BYTES_PER_CONTAINER} bytes of "
            "[sidecar.http] max_body_bytes: send the payload without padding"
        )


def error_body(exc: VoxrecallError) -> bytes:
    code = status_for(exc).name
    return orjson.dumps({"error": {"code": code, "message": caller_message(exc)}})


async def respond(
    send: Send, status: int, body: bytes, headers: Sequence[tuple[bytes, bytes]] = ()
) -> None:
    await send(
        {
            "type": "http.response.start",
            "status": status,
            "headers": [JSON, (b"content-length", str(len(body)).encode()), *headers],
        }
    )
    await send({"type": "http.response.body", "body": body})


def replay(body: bytes, receive: Receive) -> Receive:
    """A ``receive`` that gives ``body`` (already read) once, then what the client sends next."""
    given = False

    async def receive_again() -> Message:
        nonlocal given
        if not given:
            given = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()

    return receive_again


Handler = Callable[[HttpCall, dict[str, str], bytes], Awaitable[Reply]]


class HttpDoor:
    """The ASGI app of the HTTP door, and the uvicorn server that runs it in this loop."""

    def __init__(
        self,
        config: Config,
        engine: Engine,
        lifecycle: Lifecycle,
        guards: Guards,
        toolbox: Toolbox,
    ) -> None:
        self.config = config
        self.engine = engine
        self.lifecycle = lifecycle
        self.phases = Phases.of(guards.hooks)
        self.body_at = guards.body_at
        self.max_body = config.sidecar.http.max_body_bytes
        self.max_containers = max_json_containers(self.max_body)
        http = config.sidecar.http
        self.admission = _Admission(
            http.max_connections, http.max_connections_per_ip, tls=config.sidecar.tls.enabled
        )
        self.auth = guards.auth
        self.mcp = McpDoor(config, engine, toolbox, guards.auth)
        self.webhooks = Webhooks(config, engine, toolbox)
        self.plain = PlainCalls(engine, lifecycle)
        self._server: _InLoopServer | None = None
        self._serving: asyncio.Task[None] | None = None
        self._mcp_task: asyncio.Task[None] | None = None
        self._mcp_ready = asyncio.Event()
        self._mcp_stop = asyncio.Event()
        self._socket: socket.socket | None = None

    # -- routing -----------------------------------------------------------------------------

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return  # no websockets; lifespan is off
        path: str = scope["path"]
        if path in ("/healthz", "/readyz"):
            await self._health(path, scope, send)
        elif path.rstrip("/") == MCP_PATH:
            await self._mcp(scope, receive, send)
        elif path == TURN_PATH:
            await self._posted("Turn", scope, receive, send, self.plain.turn)
        elif path == SEARCH_PATH:
            await self._posted("Search", scope, receive, send, self.plain.search)
        elif path == VAPI_PATH:
            await self._posted("Vapi", scope, receive, send, self.webhooks.vapi)
        elif path.startswith(TOOLS_PREFIX) and len(path) > len(TOOLS_PREFIX):
            function = path[len(TOOLS_PREFIX) :]
            await self._posted(
                "Tool", scope, receive, send, lambda c, h, b: self.webhooks.tool(c, function, h, b)
            )
        else:
            body = {"error": {"code": "NOT_FOUND", "message": f"no path {path!r}; paths: {PATHS}"}}
            await respond(send, 404, orjson.dumps(body))

    async def _health(self, path: str, scope: Scope, send: Send) -> None:
        state = self.lifecycle.state
        if path == "/healthz":
            await respond(send, 200, orjson.dumps({"status": "ok", "state": state.name}))
            return
        ready = state is State.SERVING  # as gRPC health says (lazy bases: SERVING from the start)
        body: dict[str, Any] = {"status": "ready" if ready else "not ready", "state": state.name}
        if not ready and self.engine.load_on_demand is None:
            waiting = self.engine.holder.waiting(self.engine.known_bases)
            named = self._nameable(scope, waiting)
            if named is not None:  # a caller's count is of its own bases: "2 of 25" misread
                body["waiting_for"] = named[:20]  # the first 20 by name: 5,000 were 1 MB
                waiting = named
            body["waiting_count"] = len(waiting)  # without a token, all of them: no name in it
        await respond(send, 200 if ready else 503, orjson.dumps(body))

    def _nameable(self, scope: Scope, bases: list[str]) -> list[str] | None:
        """Those of ``bases`` the client may learn the names of: with auth, only a caller's own
        (its token is optional here: an orchestrator's probe sends none), and none without a
        valid token (it learns no base name, as every other call's refusal says none)."""
        if self.auth is None:
            return bases
        caller = self.auth.identify(headers_of(scope).get("authorization", ""))
        if caller is None:
            return None
        return self.auth.reachable_bases(caller, bases)

    async def _posted(
        self, method: str, scope: Scope, receive: Receive, send: Send, handler: Handler
    ) -> None:
        """A path that takes a POST body (Turn, Search, the webhooks): the call as ``method``,
        its hooks, its body, ``handler``'s answer."""
        if scope["method"] != "POST":
            error = {"code": METHOD_NOT_ALLOWED, "message": f"{scope['path']} takes POST"}
            await respond(send, 405, orjson.dumps({"error": error}), [(b"allow", b"POST")])
            return
        headers = headers_of(scope)
        call = HttpCall(self.phases, method, headers, peer_of(scope))
        async with self._guarded(call, send) as answer:
            request = await self._admit(call, receive, headers)
            answer.append(await handler(call, headers, request))
        if answer:
            status, payload, extra = answer[0]
            await respond(send, status, payload, [*call.reply.headers, *extra])

    async def _mcp(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["method"] == "GET":  # the server pushes nothing: no event stream to hold open
            refusal = {"error": {"code": METHOD_NOT_ALLOWED, "message": MCP_GET_REFUSED}}
            await respond(send, 405, orjson.dumps(refusal), [(b"allow", b"POST, DELETE")])
            return
        headers = headers_of(scope)
        call = HttpCall(self.phases, "MCP", headers, peer_of(scope))
        status: list[int] = []
        answering = asyncio.timeout(MCP_ANSWER_S)

        async def watched(message: Message) -> None:
            if message["type"] == "http.response.start":
                answering.reschedule(None)  # its write is bounded by the client's reads
                call.answered = True
                status.append(message["status"])
                message = {**message, "headers": [*message["headers"], *call.reply.headers]}
            await send(message)

        async with self._guarded(call, send):
            posted = scope["method"] == "POST"
            body = await self._admit(call, receive, headers, read=posted)
            if posted:
                call.rename(self.mcp.method_name(body))
                unsent = initialize_refusal(call.method, body) or session_header_refusal(
                    headers, body
                )
                if unsent is not None:  # refused before the SDK sees it
                    await self._refuse_mcp(call, send, unsent)
                    return
            with self.mcp.in_flight.claimed(headers, body) as duplicate:
                if duplicate is not None:
                    await self._refuse_mcp(call, send, duplicate)
                    return
                scoped = self.mcp.scope_for(scope, call)
                try:
                    async with answering:
                        await self.mcp.handle(scoped, replay(body, receive), watched, len(body))
                except TimeoutError as exc:
                    if not answering.expired():
                        raise
                    raise Unavailable(
                        f"the MCP request had no answer within {MCP_ANSWER_S:g} s: send it again"
                    ) from exc
                except ResourceExhausted as exc:  # its owner's sessions are full: a JSON-RPC 429
                    call.code = grpc.StatusCode.RESOURCE_EXHAUSTED
                    answer = session_refusal(body, caller_message(exc))
                    await respond(send, 429, answer, call.reply.headers)
                    return
            if status and status[0] >= 400:
                call.code = code_of_http_status(status[0])

    @staticmethod
    async def _refuse_mcp(call: HttpCall, send: Send, refusal: bytes) -> None:
        """A JSON-RPC error the door answers 400 before the SDK sees the request."""
        call.code = grpc.StatusCode.INVALID_ARGUMENT
        await respond(send, 400, refusal, call.reply.headers)

    async def _admit(
        self, call: HttpCall, receive: Receive, headers: dict[str, str], *, read: bool = True
    ) -> bytes:
        """The hooks that need only the headers (the token: a stranger's body is never read),
        then the body under its byte cap and deadline, then the rest (the drain gate, a slot):
        a client trickling its body holds a connection, never a ``max_concurrent_rpcs``
        slot."""
        call.start(until=self.body_at)
        body = await read_body(receive, headers, self.max_body) if read else b""
        check_json_containers(body, self.max_containers)
        call.start()
        return body

    @contextlib.asynccontextmanager
    async def _guarded(self, call: HttpCall, send: Send) -> AsyncIterator[list[Reply]]:
        """Run the body as ``call``: a refusal or error becomes its JSON answer (unless an
        answer has started); the hooks end with the call's code; a call cut off by the drain
        answers 503."""
        code = grpc.StatusCode.OK
        answer: list[Reply] = []
        failed: tuple[int, bytes, list[tuple[bytes, bytes]]] | None = None
        try:
            yield answer
        except RequestError as exc:
            code = status_for(exc)
            failed = http_status_for(exc), error_body(exc), _refusal_headers(exc, call)
        except ClientGone:
            code = grpc.StatusCode.CANCELLED
        except asyncio.CancelledError:
            if not call.cut:
                code = grpc.StatusCode.CANCELLED
                raise
            code = grpc.StatusCode.UNAVAILABLE
            body = {"error": {"code": "UNAVAILABLE", "message": call.cut}}
            failed = 503, orjson.dumps(body), call.reply.headers
        except VoxrecallError as exc:
            code = status_for(exc)
            if code is grpc.StatusCode.INTERNAL:  # the rest: the call log's line, as gRPC's
                log.error("%s failed: %s", call.method, exc)
            failed = http_status_for(exc), error_body(exc), call.reply.headers
        except Exception:
            code = grpc.StatusCode.INTERNAL
            log.exception("%s failed", call.method)
            body = {"error": {"code": "INTERNAL", "message": "internal error: see the logs"}}
            failed = 500, orjson.dumps(body), call.reply.headers
        finally:
            call.finish(code)
        if failed is not None and not call.answered:  # an MCP event stream cut mid-way just ends
            await respond(send, *failed)

    # -- the server --------------------------------------------------------------------------

    @property
    def scheme(self) -> str:
        """What the door speaks, as the start line says it: HTTPS with ``[sidecar.tls]``."""
        return "HTTPS" if self.config.sidecar.tls.enabled else "HTTP"

    def bind(self, listen: str) -> int:
        """Bind ``listen`` now (port 0 picks one), so a port in use stops the start before
        anything serves; the bound port."""
        self._socket = _bind(listen, reuse_port=self.config.sidecar.workers > 1)
        if not self.config.sidecar.tls.enabled and not tls.is_loopback(listen):
            log.warning(
                "HTTP on %s without TLS: anyone who can reach it can read the traffic; set "
                "[sidecar.tls] cert_file and key_file",
                listen,
            )
        port: int = self._socket.getsockname()[1]
        return port

    async def start(self) -> None:
        """Start MCP's session manager and uvicorn, as a task of this loop, on the bound
        socket."""
        assert self._socket is not None, "bind first"
        t = self.config.sidecar.tls
        context = tls.server_context(t) if t.enabled else None
        uv_config = uvicorn.Config(
            self,
            lifespan="off",
            ws="none",
            log_config=None,
            access_log=False,
            server_header=False,
            timeout_graceful_shutdown=CLOSE_TIMEOUT_S,
            timeout_keep_alive=KEEP_ALIVE_S,
            http=cast(
                Any,
                functools.partial(
                    _BoundedHead,
                    admission=self.admission,
                    tls=context,
                    max_chunks=max_chunks(self.max_body),
                ),
            ),
        )
        self._mcp_task = asyncio.create_task(self._run_mcp())
        await self._mcp_ready.wait()
        self._server = _InLoopServer(uv_config)
        self._serving = asyncio.create_task(self._server.serve(sockets=[self._socket]))
        while not self._server.started:
            if self._serving.done():
                await self._serving  # raises what stopped the start
                raise OSError("the HTTP door did not start")
            await asyncio.sleep(0.005)

    async def stop(self) -> None:
        """Stop listening and close the connections (the drain has finished the calls)."""
        self.admission.closing = True
        if self._server is not None and self._serving is not None:
            self._server.should_exit = True
            with contextlib.suppress(asyncio.CancelledError):
                await self._serving
        for handshake in list(self.admission.handshakes):  # each closes its socket
            handshake.cancel()
        await asyncio.gather(*self.admission.handshakes, return_exceptions=True)
        self._mcp_stop.set()
        if self._mcp_task is not None:
            await self._mcp_task
        if self._socket is not None:
            self._socket.close()
        self._server = self._serving = self._mcp_task = self._socket = None

    async def _run_mcp(self) -> None:
        """MCP's session manager, entered and left in this one task (anyio's task group must
        be), from ``start`` until ``stop``."""
        async with self.mcp.running():
            self._mcp_ready.set()
            await self._mcp_stop.wait()


class _Admission:
    """How many connections the door serves at once (``[sidecar.http] max_connections``, in
    each worker) and from each client address (``max_connections_per_ip``, 0: no cap), and
    how many it refused: a full door or address is logged once when it fills and once when it
    has room again, so a flood of connections cannot flood the log too. Every count is bounded
    by the connections open: an address is kept only while it holds one.

    uvicorn's own ``limit_concurrency`` is not used: it reads a connection's request head and
    answers 503 from a task of its own, so a refused connection still costs a task and up to
    a head's bytes, and it counts the connection being refused (``limit`` - 1 are served)."""

    def __init__(self, limit: int, per_ip: int, *, tls: bool = False) -> None:
        self.limit = limit
        self.per_ip = per_ip
        # what a refused connection gets, as the log says it: with TLS nothing can be said
        # before a handshake, so it is only closed (``_BoundedHead._refuse``)
        self.refusal = "closed unanswered (TLS)" if tls else "answered 503"
        self.open = 0
        self.by_ip: Counter[str] = Counter()
        self.refused = 0  # since the door last had room
        self.refused_total = 0
        self.refused_by_ip: Counter[str] = Counter()  # addresses at their cap: since they had room
        self.overrun_total = 0  # connections closed past MAX_PIPELINED
        self.cut_total = 0  # connections closed past a bound of a request (``cut``), those too
        self.plain_http_total = 0  # plain HTTP requests to a TLS door
        self.tls_client_total = 0  # TLS handshakes at a plain door (answered 400)
        self.invalid_total = 0  # requests the parser refused (400)
        self.upgrade_total = 0  # requests that asked to upgrade the connection (not done)
        self.handshakes: set[asyncio.Task[None]] = set()  # TLS handshakes under way
        self.closing = False  # the door stops: a handshake done now is not served
        self._full = _refusal("max_connections", limit)  # the 503s, made once
        self._address_full = _refusal("max_connections_per_ip", per_ip)

    def admit(self, address: str) -> bytes | None:
        """Count a connection from ``address`` (until ``release``), or the whole 503 it gets."""
        if self.open >= self.limit:
            return self._refuse_full()
        if self.per_ip and self.by_ip[address] >= self.per_ip:
            return self._refuse_address(address)
        if self.refused:
            log.warning(
                "the HTTP door has room again; it refused %d connection(s) while full",
                self.refused,
            )
            self.refused = 0
        self.open += 1
        self.by_ip[address] += 1
        return None

    def overran(self, address: str) -> None:
        """A connection from ``address`` queued more than ``MAX_PIPELINED`` requests and is
        closed: counted, and logged as every ``cut`` is."""
        self.overrun_total += 1
        self.cut(
            address, f"it sent more than {MAX_PIPELINED} requests ahead without reading the answers"
        )

    def cut(self, address: str, why: str) -> None:
        """A connection from ``address`` is closed for ``why`` (a request past one of its
        bounds, where no answer can be given): logged the first time, then once per
        ``OVERRUN_LOG_EVERY``."""
        self.cut_total += 1
        if _logged(self.cut_total):
            log.warning(
                "closed a connection from %s: %s (%d such connection(s) closed since the start)",
                address,
                why,
                self.cut_total,
            )

    def plain_http(self, address: str) -> None:
        """A plain ``http://`` request came to the TLS door (a platform's URL typed without the
        s): the client only sees its connection closed, so the log says why, for the first and
        then once per ``OVERRUN_LOG_EVERY`` (a flood of them must not flood the log)."""
        self.plain_http_total += 1
        if _logged(self.plain_http_total):
            log.info(
                "a plain http:// request from %s came to the HTTP door, which speaks HTTPS only "
                "([sidecar.tls]): it was closed unanswered; send it to https:// (%d such since "
                "the start)",
                address,
                self.plain_http_total,
            )

    def tls_client(self, address: str) -> None:
        """A TLS handshake (an ``https://`` URL) came to the plain door: the parser refuses it
        and it is answered 400, which the client cannot read (curl says only "wrong version
        number"), so the log says why, as ``plain_http`` does for the mirror mistake."""
        self.tls_client_total += 1
        if _logged(self.tls_client_total):
            log.info(
                "a TLS (https://) client from %s came to the HTTP door, which speaks plain HTTP: "
                "it was answered 400 and closed; send it to http://, or set [sidecar.tls] to "
                "serve HTTPS (%d such since the start)",
                address,
                self.tls_client_total,
            )

    def invalid(self, address: str) -> None:
        """A request from ``address`` the parser refused was answered 400 and closed: logged as
        every ``cut`` is (uvicorn wrote a WARNING line for each: 2,000 bad requests from one
        client, 2,000 lines in 0.6 s)."""
        self.invalid_total += 1
        if _logged(self.invalid_total):
            log.warning(
                "answered 400 to a request from %s that is not valid HTTP/1.1 (a bad request line, "
                "header or Content-Length) and closed its connection (%d such since the start)",
                address,
                self.invalid_total,
            )

    def upgrade(self, address: str) -> None:
        """A request from ``address`` asked to upgrade its connection (a WebSocket): the door
        upgrades none and answers it as a plain request; logged as ``plain_http`` is (uvicorn
        wrote two WARNING lines for each, one of them advice to install a WebSocket library)."""
        self.upgrade_total += 1
        if _logged(self.upgrade_total):
            log.info(
                "a request from %s asked to upgrade its connection: the HTTP door upgrades none "
                "(no WebSocket) and answered it as a plain request (%d such since the start)",
                address,
                self.upgrade_total,
            )

    def release(self, address: str) -> None:
        self.open -= 1
        self.by_ip[address] -= 1
        if not self.by_ip[address]:
            del self.by_ip[address]
        refused = self.refused_by_ip.pop(address, 0)
        if refused:
            log.warning(
                "the HTTP door has room for %s again; it refused %d of its connection(s)",
                address,
                refused,
            )

    def _refuse_full(self) -> bytes:
        if not self.refused:
            log.warning(
                "the HTTP door is full: %d connections open ([sidecar.http] max_connections); "
                "more are %s until one closes",
                self.limit,
                self.refusal,
            )
        self.refused += 1
        self.refused_total += 1
        return self._full

    def _refuse_address(self, address: str) -> bytes:
        if not self.refused_by_ip[address]:
            log.warning(
                "%s holds %d connections to the HTTP door ([sidecar.http] "
                "max_connections_per_ip); more from it are %s until one closes",
                address,
                self.per_ip,
                self.refusal,
            )
        self.refused_by_ip[address] += 1
        self.refused_total += 1
        return self._address_full


def _logged(count: int) -> bool:
    """Whether the ``count``-th of a kind of event a client can repeat at will is logged: the
    first, then one per ``OVERRUN_LOG_EVERY`` (a flood of them must not flood the log)."""
    return (count - 1) % OVERRUN_LOG_EVERY == 0


def _refusal(key: str, limit: int) -> bytes:
    """The whole 503 a connection over ``key``'s ``limit`` gets, before it has sent anything."""
    whose = "" if key == "max_connections" else " from your address"
    message = (
        f"the HTTP door is serving {limit} connections{whose}, its limit ([sidecar.http] {key}): "
        "retry in a moment, and reuse one connection for many calls"
    )
    body = orjson.dumps({"error": {"code": "UNAVAILABLE", "message": message}})
    head = (
        "HTTP/1.1 503 Service Unavailable\r\ncontent-type: application/json\r\n"
        f"connection: close\r\nretry-after: 1\r\ncontent-length: {len(body)}\r\n\r\n"
    )
    return head.encode() + body


class _BoundedHead(HttpToolsProtocol):
    """uvicorn's httptools protocol with each request bounded: its head by ``MAX_HEAD_BYTES``
    (431, then closed) and ``HEAD_TIMEOUT_S`` (closed); the rest of it (body, a chunked body's
    trailer) by ``REQUEST_TIMEOUT_S`` from its call's start, ``MAX_TRAILER_BYTES`` and
    ``max_chunks`` (closed), counted as it is parsed, whether or not the app reads it. An answer
    sent before its request is whole says ``connection: close``; the rest of the request is then
    read and dropped (at most ``MAX_DROPPED_BYTES`` of it, within the same deadline) and the connection closed at its
    end, so the client reads the answer rather than a reset (``_close_at_end``). Connections
    past the door's ``_Admission`` are refused as they are accepted (``_refuse``). With TLS it
    makes the handshake itself (``_handshake``), so a connection counts from its accept and its
    handshake is bounded (``TLS_HANDSHAKE_TIMEOUT_S``). The body is ``read_body``'s."""

    _deadline: asyncio.TimerHandle | None = None  # the head's, then the rest of the request's
    _unread: asyncio.TimerHandle | None = None  # the check of its reads, while writing is paused
    _in_head = False  # a request's head is awaited (a new connection) or arriving
    _in_body = False  # a request's head is in, and the rest of it (body, trailer) is not
    _head_bytes = 0  # read while a head was not whole
    _trailer_bytes = 0  # of the request's trailer fields, dropped
    _chunks = 0  # of the request's chunked body, its last one included
    _fields = 0  # of the request's head
    _parsed = False  # the parser called back during the read being fed
    _unparsed = 0  # of the request's body, bytes read in reads the parser made nothing of
    _late_bytes = 0  # of the request's body, read and dropped after its answer
    _keep_alive = True  # whether the request asked to keep its connection
    _closing = False  # answered before the request was whole: closed once it is
    _refused: asyncio.Handle | None = None  # the close of a refused connection, pending
    _address = ""  # the client's address
    _admitted = False  # counted by the admission, until the connection is lost
    _served = False  # uvicorn's protocol has its transport (with TLS: the handshake is done)
    _dropped = False  # being closed: the parser stops at its next callback (``_go_on``)
    _fed = False  # the connection's first bytes have reached the parser

    def __init__(
        self,
        *args: Any,
        admission: _Admission,
        tls: ssl.SSLContext | None,
        max_chunks: int = MIN_MAX_CHUNKS,
        **kwargs: Any,
    ) -> None:
        super().__init__(*args, **kwargs)
        self.admission = admission
        self.tls = tls
        self.max_chunks = max_chunks
        # with TLS, what the handshake's last read decrypted before ``_serve`` ran: one read's
        # worth, handed to the parser then (and counted in the head's bytes)
        self._early: list[bytes] = []
        # the connection's calls not answered whole yet (its requests pipelined: uvicorn's
        # ``self.cycle`` is only the newest)
        self._cycles: list[RequestResponseCycle] = []

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        self._address = _address_of(transport)
        refusal = self.admission.admit(self._address)
        if refusal is not None:
            self._refuse(transport, refusal)
            return
        self._admitted = True
        if self.tls is None:
            self._serve(transport)
            return
        transport.pause_reading()  # the handshake reads first (start_tls resumes it)
        handshake = self.loop.create_task(self._handshake(transport, self.tls))
        self.admission.handshakes.add(handshake)
        handshake.add_done_callback(self.admission.handshakes.discard)

    async def _handshake(self, transport: asyncio.Transport, context: ssl.SSLContext) -> None:
        """The TLS handshake, within ``TLS_HANDSHAKE_TIMEOUT_S``; then serve over it."""
        starting = asyncio.ensure_future(
            self.loop.start_tls(
                transport,
                self,
                context,
                server_side=True,
                ssl_handshake_timeout=TLS_HANDSHAKE_TIMEOUT_S,
            )
        )
        # start_tls's first step hands the transport to its TLS protocol and queues that
        # protocol's connection_made: one step after it, what this protocol read before is
        # handed over, before the transport reads anything more
        self.loop.call_soon(self.loop.call_soon, self._hand_over, transport)
        try:
            secure = await starting
        except OSError as exc:  # a bad handshake, one out of time, or a client gone
            if getattr(exc, "reason", None) == PLAIN_HTTP:
                self.admission.plain_http(self._address)
            else:
                log.debug("a TLS handshake from %s failed: %s", self._address, exc)
            secure = None
        except asyncio.CancelledError:  # the door stops: start_tls closed the socket if it ran
            if transport.get_protocol() is self:  # cancelled before start_tls took the socket
                transport.abort()
            self._release()
            raise
        if secure is None or secure.is_closing() or self.admission.closing:
            if secure is not None:
                secure.close()
            self._release()
            return
        self._serve(secure)

    def _hand_over(self, transport: asyncio.Transport) -> None:
        """The bytes read before the handshake began (uvloop reads once after a
        ``pause_reading`` made in ``connection_made``: the client's hello, half the time),
        given to the TLS protocol now holding ``transport``, which never saw them."""
        raw, self._early = self._early, []
        tls: Any = transport.get_protocol()
        if tls is self or transport.is_closing():  # (uvloop's is no asyncio.BufferedProtocol)
            return
        for data in raw:
            view = memoryview(data)
            while view:
                buffer = tls.get_buffer(len(view))
                size = min(len(buffer), len(view))
                buffer[:size] = view[:size]
                tls.buffer_updated(size)
                view = view[size:]

    def _serve(self, transport: asyncio.Transport) -> None:
        self._served = True
        super().connection_made(transport)
        self._in_head = True
        self._arm(HEAD_TIMEOUT_S)
        early, self._early = self._early, []
        for data in early:
            self.data_received(data)

    def _refuse(self, transport: asyncio.Transport, refusal: bytes) -> None:
        """Answer 503 now, close our side for writing, and close the socket when the client
        closes its own or after ``REFUSED_LINGER_S``: no parser, no task, no buffer kept, and
        the connection is neither one of uvicorn's nor counted. With TLS nothing can be said
        before a handshake, which a refused connection is not worth: it is closed at once."""
        self.transport = transport
        if self.tls is not None:
            self._refused = self.loop.call_soon(transport.abort)
            return
        transport.write(refusal)
        if transport.can_write_eof():
            transport.write_eof()
        self._refused = self.loop.call_later(REFUSED_LINGER_S, transport.close)

    def _release(self) -> None:
        if self._admitted:
            self._admitted = False
            self.admission.release(self._address)

    def connection_lost(self, exc: Exception | None) -> None:
        if self._refused is not None:
            self._refused.cancel()
            return
        self._release()
        self._read_again()
        if not self._served:
            return  # a TLS handshake that never finished
        self._disarm()
        super().connection_lost(exc)
        for cycle in self._cycles:  # uvicorn tells only the newest: each earlier one wrote on
            if not cycle.response_complete:  # to the closed transport (uvloop raises), its
                cycle.disconnected = True  # handler failed, and the log had three errors
                cycle.message_event.set()
        self._cycles = []

    def shutdown(self) -> None:
        self._keep_alive = False  # the server stops: no request keeps its connection
        super().shutdown()

    # -- the parser's callbacks: each stops the parser once the connection is being dropped --

    def _go_on(self) -> None:
        """Stop the parser (``_feed`` ends its read there) if the connection is being
        dropped: the rest of the read is neither parsed nor seen. Every callback's first step:
        the read made something (``_unparsed_read``)."""
        self._parsed = True
        if self._dropped:
            raise _Stopped

    def on_message_begin(self) -> None:
        self._go_on()
        super().on_message_begin()
        self._in_head = True
        self._trailer_bytes = self._late_bytes = self._chunks = self._unparsed = 0
        self._fields = 0
        self._arm(HEAD_TIMEOUT_S)

    def on_url(self, url: bytes) -> None:
        self._go_on()
        super().on_url(url)

    def on_header(self, name: bytes, value: bytes) -> None:
        self._go_on()
        if self._in_head:
            self._fields += 1
            if self._fields > MAX_HEAD_FIELDS:
                self._refuse_head(f"the request has over {MAX_HEAD_FIELDS} header fields")
                self._go_on()
            super().on_header(name, value)
        else:  # a field of a chunked body's trailer
            self._trailer(len(name) + len(value))

    def on_headers_complete(self) -> None:
        self._go_on()
        self._disarm()
        self._in_head = False
        self._head_bytes = 0
        if _head_size(self.url, self.headers) > MAX_HEAD_BYTES:  # whole within one read
            self._refuse_head()
            return
        refusal = _head_refusal(self.headers, self.parser.should_upgrade())
        if refusal is not None:
            self._refuse_head(*refusal)
            return
        self._in_body = True
        super().on_headers_complete()
        self._cycles = [c for c in self._cycles if not c.response_complete] + [self.cycle]
        self._answer_first(self.cycle)
        if len(self.pipeline) > MAX_PIPELINED:
            self._overran()
            return
        self._arm_rest()

    def on_chunk_header(self) -> None:
        """A chunk of a chunked body: counted against ``max_chunks``."""
        self._go_on()
        self._chunks += 1
        if self._chunks > self.max_chunks + 1:  # + 1: the last, empty chunk is not one of them
            self._cut(f"its chunked body came in more than {self.max_chunks} chunks")
            self._go_on()

    def on_body(self, body: bytes) -> None:
        self._go_on()
        if not self._closing:
            super().on_body(body)
            return
        self._late_bytes += len(body)  # answered already: read and dropped, up to a cap
        if self._late_bytes > MAX_DROPPED_BYTES:
            self._cut(f"it sent more than {MAX_DROPPED_BYTES} bytes of a body after its answer")

    def on_message_complete(self) -> None:
        self._go_on()
        self._disarm()
        self._in_body = False
        if self._closing:  # its answer is out and said close: nothing more is read
            self._dropped = True
            self.transport.close()
            return
        if not self.cycle.response_started:  # whole before its answer: kept alive as asked
            self.cycle.keep_alive = self._keep_alive
        super().on_message_complete()

    # -- the rest of a request --------------------------------------------------------------

    def _arm_rest(self) -> None:
        """Once the call of a request still arriving has started (at once, or when its turn
        in the pipeline comes), the rest of it must come within ``REQUEST_TIMEOUT_S``."""
        if self._in_body and self._deadline is None and not self._queued(self.cycle):
            self._arm(REQUEST_TIMEOUT_S)

    def _queued(self, cycle: RequestResponseCycle) -> bool:
        return any(queued is cycle for queued, _ in self.pipeline)

    def _answer_first(self, cycle: RequestResponseCycle) -> None:
        """Until ``cycle``'s request is whole, an answer to it says ``connection: close``
        (``on_message_complete`` puts back what the request asked), and uvicorn's close after
        that answer is ``_close_at_end``'s."""
        self._keep_alive = cycle.keep_alive
        cycle.keep_alive = False
        cycle.transport = cast(asyncio.Transport, _ClosedAtEnd(self.transport, self._close_at_end))

    def _close_at_end(self) -> None:
        """uvicorn closes the connection after an answer that said ``connection: close``: at
        once if its request is whole, else once it is, its rest read and dropped meanwhile
        (closed with the client's bytes unread, the connection would be reset and the answer
        lost)."""
        if self._in_body and not self.transport.is_closing():
            self._closing = True
        else:
            self.transport.close()

    def _trailer(self, size: int) -> None:
        """A trailer field: dropped (no path reads one), counted against MAX_TRAILER_BYTES."""
        self._trailer_bytes += size
        if self._trailer_bytes > MAX_TRAILER_BYTES:
            self._cut(f"its chunked body's trailer fields were over {MAX_TRAILER_BYTES} bytes")

    def _cut(self, why: str) -> None:
        """Close the connection now, for ``why`` (logged as ``_Admission.cut`` says)."""
        self.admission.cut(self._address, why)
        self._drop()

    def _drop(self) -> None:
        """Drop the queued requests and what is unsent, and close. The parser stops at its next
        callback (``_go_on``), and nothing more is read."""
        self._disarm()
        self._dropped = True
        self.pipeline.clear()
        self.transport.abort()

    def _overran(self) -> None:
        """Too many pipelined requests queued: the connection is dropped."""
        self.admission.overran(self._address)
        self._drop()

    # -- reading and writing ----------------------------------------------------------------

    def on_response_complete(self) -> None:
        """uvicorn resumes reading after each answer; read on only while no request waits in
        the queue and the client reads its answers (else it would queue more, and their
        answers pile up unsent)."""
        super().on_response_complete()
        if self.pipeline or self.flow.write_paused:
            self.flow.pause_reading()
        self._arm_rest()  # a request whose turn came (super started its call)

    def pause_writing(self) -> None:
        super().pause_writing()
        self.flow.pause_reading()  # answers the client leaves unread: read no more requests
        if self._unread is None:
            self._watch_reads(self._unsent())

    def resume_writing(self) -> None:
        self._read_again()
        super().resume_writing()
        if not self.pipeline and (self.cycle is None or self.cycle.response_complete):
            self.flow.resume_reading()  # what on_response_complete held back

    def data_received(self, data: bytes) -> None:
        if self._refused is not None:
            return  # a refused connection's request: read and dropped
        if not self._served:
            self._early.append(data)
            return
        if self._in_head:
            self._head_bytes += len(data)
        in_body, self._parsed = self._in_body, False
        self._feed(data)
        if self._in_head and self._head_bytes > MAX_HEAD_BYTES and not self.transport.is_closing():
            self._refuse_head()  # a head still arriving, over the limit across reads
        elif in_body:
            self._unparsed_read(len(data))

    def _unparsed_read(self, size: int) -> None:
        """A read of a request's body: none of the body's bytes, chunks or trailer fields
        reached the door if the parser called nothing back, which honest framing (a chunk's
        size line, a line's end) never asks of more than a few bytes. It is then a trailer field
        or a chunk extension that never ends: the parser holds the one whole until its line ends
        (copying it on every read: one held the event loop for seconds and grew without bound)
        and reads the other on for as long as it comes. More than MAX_TRAILER_BYTES of such
        reads in a row closes the connection."""
        if self._parsed:
            self._unparsed = 0
            return
        self._unparsed += size
        if self._unparsed > MAX_TRAILER_BYTES and not self._dropped:
            self._cut(
                f"it sent over {MAX_TRAILER_BYTES} bytes of a chunked body's framing or trailer "
                "with no end to a line"
            )

    def _feed(self, data: bytes) -> None:
        """uvicorn's ``data_received`` (as of uvicorn 0.55; the door's request tests catch a
        drift), with its log lines said by the door's admission, so a
        client cannot flood the log: a request the parser refuses is answered 400 as uvicorn
        answers it (``invalid``); one asking to upgrade is served as a plain request
        (``upgrade``: the door has no WebSocket, so uvicorn would not upgrade it either). A
        connection that opens with a TLS record is logged as a TLS client instead
        (``tls_client``)."""
        first, self._fed = not self._fed, True
        self._unset_keepalive_if_required()
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError:
            if self._dropped:
                return  # a callback stopped it (``_go_on``): the connection is being dropped
            if first and self.tls is None and data.startswith(TLS_RECORD):
                self.admission.tls_client(self._address)
            else:
                self.admission.invalid(self._address)
            self.send_400_response(INVALID_REQUEST)
        except httptools.HttpParserUpgrade:
            self.admission.upgrade(self._address)

    def _refuse_head(
        self,
        message: str = f"the request's headers are over {MAX_HEAD_BYTES} bytes",
        status: bytes = b"431 Request Header Fields Too Large",
        code: str = "INVALID_ARGUMENT",
    ) -> None:
        """431 (or ``status``, its error ``code``), and close: nothing more of the connection is
        read."""
        self._disarm()
        self._dropped = True
        body = orjson.dumps({"error": {"code": code, "message": message}})
        self.transport.write(
            b"HTTP/1.1 " + status + b"\r\ncontent-type: "
            b"application/json\r\nconnection: close\r\ncontent-length: "
            + str(len(body)).encode()
            + b"\r\n\r\n"
            + body
        )
        self.transport.close()

    def _arm(self, seconds: float) -> None:
        self._disarm()
        self._deadline = self.loop.call_later(seconds, self._late)

    def _disarm(self) -> None:
        if self._deadline is not None:
            self._deadline.cancel()
            self._deadline = None

    def _watch_reads(self, unsent: int) -> None:
        """While writing is paused: in UNREAD_ANSWER_S, check the client read at least
        MIN_READ_BYTES of the ``unsent`` bytes since."""
        self._unread = self.loop.call_later(UNREAD_ANSWER_S, self._read_since, unsent)

    def _read_since(self, unsent: int) -> None:
        """A client that reads on (a slow link) is watched again; one that read less than
        MIN_READ_BYTES in UNREAD_ANSWER_S is dropped: an answer being written holds its call's
        slot until it is (the call ends with the connection)."""
        now = self._unsent()
        if unsent - now >= MIN_READ_BYTES:
            self._watch_reads(now)
            return
        self._unread = None
        self._cut(
            f"it read {max(unsent - now, 0):,} bytes of its answers in {UNREAD_ANSWER_S:g} s "
            f"(at least {MIN_READ_BYTES:,} are asked)"
        )

    def _unsent(self) -> int:
        """The bytes written and not yet read by the client: the transport's, and the socket's
        send queue (on loopback the kernel holds megabytes: a client reading steadily from it
        leaves the transport's own untouched)."""
        return self.transport.get_write_buffer_size() + _socket_unsent(self.transport)

    def _read_again(self) -> None:
        if self._unread is not None:
            self._unread.cancel()
            self._unread = None

    def _late(self) -> None:
        """A head, or the rest of a request, not whole within its deadline: closed."""
        self._deadline = None
        if not self.transport.is_closing():
            self.transport.close()


class _Stopped(Exception):
    """Raised by a parser callback to stop the parser: the connection is being dropped."""


class _ClosedAtEnd:
    """A connection's transport as the answer to one request (uvicorn's
    ``RequestResponseCycle``) sees it: its close is the protocol's ``_close_at_end``."""

    def __init__(self, transport: asyncio.Transport, close: Callable[[], None]) -> None:
        self._transport = transport
        self.close = close

    def __getattr__(self, name: str) -> Any:
        return getattr(self._transport, name)


def _head_refusal(
    headers: Sequence[tuple[bytes, bytes]], upgrade: bool
) -> tuple[str, bytes, str] | None:
    """Why a whole head is refused (its message, status and error code), or None: an upgrade
    with a body, a transfer coding but chunked (its body was read as chunked and handed on still
    coded), more than one Authorization field (which one a proxy before the door checked is
    unknown)."""
    if upgrade and _has_body(headers):
        return UPGRADE_WITH_BODY, b"400 Bad Request", "INVALID_ARGUMENT"
    fields = [value for name, value in headers if name == b"transfer-encoding"]
    codings = [c.strip() for value in fields for c in value.lower().split(b",") if c.strip()]
    if codings and codings != [b"chunked"]:
        return UNKNOWN_CODING, b"501 Not Implemented", "UNIMPLEMENTED"
    if sum(name == b"authorization" for name, _ in headers) > 1:
        return TWO_AUTHORIZATIONS, b"400 Bad Request", "INVALID_ARGUMENT"
    return None


def _has_body(headers: Sequence[tuple[bytes, bytes]]) -> bool:
    """Whether a head announces a body (a Content-Length above 0, or chunked)."""
    for name, value in headers:
        if name == b"transfer-encoding" or (name == b"content-length" and value.strip(b"0 ")):
            return True
    return False


def _socket_unsent(transport: asyncio.BaseTransport) -> int:
    """The bytes in the transport's socket's send queue, not yet taken by the client (Linux's
    SIOCOUTQ, TIOCOUTQ's number); 0 where that cannot be read."""
    sock = transport.get_extra_info("socket")
    request = getattr(termios, "TIOCOUTQ", None)
    if sock is None or request is None:
        return 0
    try:
        got = fcntl.ioctl(sock.fileno(), request, bytes(4))
    except (OSError, ValueError):  # not a TCP socket, or closed
        return 0
    return max(int.from_bytes(got, sys.byteorder, signed=True), 0)


def _head_size(url: bytes, headers: Sequence[tuple[bytes, bytes]]) -> int:
    """A parsed head's bytes as sent: its target, each field with its ': ' and CRLF."""
    return len(url) + sum(len(name) + len(value) + 4 for name, value in headers)


def _address_of(transport: asyncio.BaseTransport) -> str:
    """The client's share key (``sidecar.edge.addresses``: its IPv4 address, its IPv6 /64; a
    socket without an address, "")."""
    peer = transport.get_extra_info("peername")
    return share_key(str(peer[0])) if isinstance(peer, tuple) and peer else ""


class _InLoopServer(uvicorn.Server):
    """uvicorn without its signal handlers: the sidecar's SIGTERM drain stops both doors."""

    @contextlib.contextmanager
    def capture_signals(self) -> Any:
        yield


def _bind(listen: str, *, reuse_port: bool) -> socket.socket:
    host, _, port = listen.rpartition(":")
    host = host.strip("[]")
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    # IPPROTO_TCP named: asyncio sets TCP_NODELAY on the accepted sockets only then (without
    # it, a reply's head and body wait out the client's delayed ACK: 40 ms a request)
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    if reuse_port:  # the workers of one sidecar share the port, as on gRPC
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    try:
        sock.bind((host, int(port)))
    except OSError as exc:
        sock.close()
        raise CannotListen(listen, "[sidecar.http] listen", exc.strerror or str(exc)) from exc
    sock.listen(1024)
    sock.setblocking(False)
    return sock


def _refusal_headers(exc: RequestError, call: HttpCall) -> list[tuple[bytes, bytes]]:
    headers = list(call.reply.headers)
    if isinstance(exc, Unauthenticated):
        headers.append((b"www-authenticate", exc.challenge.encode()))
    return headers
