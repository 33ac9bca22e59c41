"""The HTTP door: MCP, platform webhooks and health over HTTP, beside gRPC, in the same loop.

    door = HttpDoor(config, engine, lifecycle, guards, toolbox)
    port = door.bind("127.0.0.1:8080")         # before anything serves: a port in use stops it
    await door.start()                          # uvicorn serving as a task of this event loop
    ...
    await door.stop()                          # after the drain (sidecar.edge.server.Sidecar.stop)

Paths: ``/mcp`` (MCP streamable HTTP, ``sidecar.http.mcp``), ``POST /vapi/knowledge-base`` and
``POST /tools/{function}`` (``sidecar.http.webhooks``), ``GET /healthz`` (the process is up) and
``GET /readyz`` (200 once every base has a snapshot; 503 while loading or draining). Health
needs no token, as on gRPC.

Every other call runs the hooks a gRPC call runs (``sidecar.edge.guards``: the log context, metrics,
the drain gate, the bearer token and the caller's scope, the concurrency limit, the byte limits
of each field), on a ``Call`` whose door is ``http``, and checks the same proto messages
(``TurnRequest``, ``InvokeToolRequest``, ``ReadPageRequest``) a gRPC client would send: whatever
the token could not reach over gRPC it cannot reach here. A body over ``[sidecar.http]
max_body_bytes`` is refused (413) before it is read whole; one that does not arrive within
``BODY_TIMEOUT_S`` gets 408; a request's head over ``MAX_HEAD_BYTES`` gets 431, and one not
whole within ``HEAD_TIMEOUT_S`` is closed (``_BoundedHead``). At most ``[sidecar.http]
max_connections`` connections are served at once: one more gets a 503 as soon as it is
accepted, before it is read and without a task, and is closed (``_Admission``). Errors are ``{"error": {"code", "message"}}`` with the HTTP status
``sidecar.edge.status.http_status_for`` gives; the ``x-call-id`` header names the call in the logs.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import socket
import ssl
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from typing import Any, cast

import grpc
import orjson
import uvicorn
from starlette.types import Message, Receive, Scope, Send
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from index.errors import VoxrecallError
from sidecar.config import Config
from sidecar.edge import logs, tls
from sidecar.edge.guards import Guards
from sidecar.edge.interceptor import Call, Hook
from sidecar.edge.lifecycle import Lifecycle, State
from sidecar.edge.status import code_of_http_status, http_status_for, status_for
from sidecar.errors import BodyTooLarge, IdleTimeout, RequestError
from sidecar.functions.tools import Toolbox
from sidecar.http.mcp import McpDoor
from sidecar.http.webhooks import Reply, Webhooks
from sidecar.turn.engine import Engine

log = logging.getLogger("voxrecall.http")

MCP_PATH = "/mcp"
VAPI_PATH = "/vapi/knowledge-base"
TOOLS_PREFIX = "/tools/"
PATHS = f"{MCP_PATH}, {VAPI_PATH}, {TOOLS_PREFIX}{{function}}, /healthz, /readyz"
# The server answers each MCP POST with JSON and pushes nothing, so a GET event stream would only
# hold a connection (and a max_streams slot) open: the spec lets a server refuse it with 405.
MCP_GET_REFUSED = "this MCP server sends no event stream: POST each JSON-RPC message to /mcp"
# A platform posts a few kilobytes at once; a body still arriving after this long is a client
# that stalled (or one holding a slot on purpose).
BODY_TIMEOUT_S = 10.0
# After the drain every call is done: this is how long a connection still sending gets.
CLOSE_TIMEOUT_S = 1
# A request's head (request line and headers): at most this many bytes (431 past it), and
# whole within HEAD_TIMEOUT_S of the connection or of its first byte (closed after that).
# uvicorn's httptools protocol bounds neither: a client could grow one header without end, or
# hold a connection open by never finishing one.
MAX_HEAD_BYTES = 64 * 1024
HEAD_TIMEOUT_S = 10.0
# An idle keep-alive connection is closed after this long (uvicorn's default, named here): a
# platform sends its next call on it within seconds, and an idle one must give its slot back.
KEEP_ALIVE_S = 5
# A connection refused over max_connections gets its 503 at once and its side closed for
# writing; it has this long to send its request and read the answer before its socket closes
# (closing on a request still arriving would reset the connection and lose the 503).
REFUSED_LINGER_S = 1.0
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


class HttpCall:
    """One call over HTTP, run through the same hooks as a gRPC call (``sidecar.edge.interceptor``):
    ``begin`` may refuse it, ``check`` each message it carries, ``finish`` exactly once."""

    def __init__(
        self, hooks: Sequence[Hook], method: str, headers: dict[str, str], peer: str = ""
    ) -> None:
        self.hooks = hooks
        self.context = _Context(peer)
        self.call = Call(method, "http", headers, cast(Any, self.context), door="http")
        self.code: grpc.StatusCode | None = None  # a refusal seen in check, or the final code
        self.answered = False  # a response has started: no error answer can follow it
        self._started: list[Hook] = []

    def begin(self) -> None:
        for hook in self.hooks:
            hook.start(self.call)
            self._started.append(hook)

    def rename(self, method: str) -> None:
        """Name the call once its body says what it is (an MCP request's method)."""
        self.call.method = method
        logs.method.set(method)

    def check(self, message: Any) -> None:
        """Run every hook's ``request`` on ``message``; a refusal is remembered, then raised."""
        try:
            for hook in self.hooks:
                hook.request(self.call, message)
        except RequestError as exc:
            self.code = status_for(exc)
            raise

    def sent(self, message: Any) -> None:
        for hook in self.hooks:
            hook.response(self.call, message)

    def finish(self, code: grpc.StatusCode) -> None:
        self.call.code = self.code or code
        for hook in reversed(self._started):
            hook.end(self.call)
        self._started.clear()


def headers_of(scope: Scope) -> dict[str, str]:
    """The request's headers, names in lower case (ASGI gives them so), values as text."""
    return {k.decode("latin-1"): v.decode("latin-1") for k, v in scope["headers"]}


def peer_of(scope: Scope) -> str:
    """The client's address (``127.0.0.1:5000``), or empty where the server does not say."""
    client = scope.get("client")
    return f"{client[0]}:{client[1]}" if client else ""


async def read_body(receive: Receive, headers: dict[str, str], limit: int) -> bytes:
    """The whole body, at most ``limit`` bytes (``BodyTooLarge`` past it, before reading on),
    within ``BODY_TIMEOUT_S``."""
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


def error_body(exc: VoxrecallError) -> bytes:
    code = status_for(exc).name
    return orjson.dumps({"error": {"code": code, "message": str(exc)}})


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
        self.hooks = guards.hooks
        self.max_body = config.sidecar.http.max_body_bytes
        self.admission = _Admission(config.sidecar.http.max_connections)
        self.mcp = McpDoor(config, engine, toolbox, guards.auth)
        self.webhooks = Webhooks(config, engine, toolbox)
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
            await self._health(path, send)
        elif path.rstrip("/") == MCP_PATH:
            await self._mcp(scope, receive, send)
        elif path == VAPI_PATH:
            await self._webhook("Vapi", scope, receive, send, self.webhooks.vapi)
        elif path.startswith(TOOLS_PREFIX) and len(path) > len(TOOLS_PREFIX):
            function = path[len(TOOLS_PREFIX) :]
            await self._webhook(
                "Tool", scope, receive, send, lambda c, h, b: self.webhooks.tool(c, function, h, b)
            )
        else:
            body = {"error": {"code": "NOT_FOUND", "message": f"no path {path!r}; paths: {PATHS}"}}
            await respond(send, 404, orjson.dumps(body))

    async def _health(self, path: str, send: Send) -> None:
        state = self.lifecycle.state
        if path == "/healthz":
            await respond(send, 200, orjson.dumps({"status": "ok", "state": state.name}))
            return
        ready = state is State.SERVING  # as gRPC health says (lazy bases: SERVING from the start)
        body: dict[str, Any] = {"status": "ready" if ready else "not ready", "state": state.name}
        if not ready and self.engine.load_on_demand is None:
            holder = self.engine.holder
            body["waiting_for"] = sorted(
                kb for kb in self.engine.known_bases if holder.get(kb) is None
            )
        await respond(send, 200 if ready else 503, orjson.dumps(body))

    async def _webhook(
        self, method: str, scope: Scope, receive: Receive, send: Send, handler: Handler
    ) -> None:
        if scope["method"] != "POST":
            error = {"code": "INVALID_ARGUMENT", "message": f"{scope['path']} takes POST"}
            await respond(send, 405, orjson.dumps({"error": error}), [(b"allow", b"POST")])
            return
        headers = headers_of(scope)
        call = HttpCall(self.hooks, method, headers, peer_of(scope))
        async with self._guarded(call, send) as answer:
            call.begin()
            request = await read_body(receive, headers, self.max_body)
            answer.append(await handler(call, headers, request))
        if answer:
            status, payload, extra = answer[0]
            await respond(send, status, payload, [*call.context.headers, *extra])

    async def _mcp(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["method"] == "GET":  # the server pushes nothing: no event stream to hold open
            refusal = {"error": {"code": "METHOD_NOT_ALLOWED", "message": MCP_GET_REFUSED}}
            await respond(send, 405, orjson.dumps(refusal), [(b"allow", b"POST, DELETE")])
            return
        headers = headers_of(scope)
        call = HttpCall(self.hooks, "MCP", headers, peer_of(scope))
        status: list[int] = []

        async def watched(message: Message) -> None:
            if message["type"] == "http.response.start":
                call.answered = True
                status.append(message["status"])
                message = {**message, "headers": [*message["headers"], *call.context.headers]}
            await send(message)

        async with self._guarded(call, send):
            call.begin()
            body = b""
            if scope["method"] == "POST":
                body = await read_body(receive, headers, self.max_body)
                call.rename(self.mcp.method_name(body))
            await self.mcp.handle(self.mcp.scope_for(scope, call), replay(body, receive), watched)
            if status and status[0] >= 400:
                call.code = code_of_http_status(status[0])

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
            if not call.call.cut:
                code = grpc.StatusCode.CANCELLED
                raise
            code = grpc.StatusCode.UNAVAILABLE
            body = {"error": {"code": "UNAVAILABLE", "message": call.call.cut}}
            failed = 503, orjson.dumps(body), call.context.headers
        except VoxrecallError as exc:
            code = status_for(exc)
            log.error("%s failed: %s", call.call.method, exc)
            failed = http_status_for(exc), error_body(exc), call.context.headers
        except Exception:
            code = grpc.StatusCode.INTERNAL
            log.exception("%s failed", call.call.method)
            body = {"error": {"code": "INTERNAL", "message": "internal error: see the logs"}}
            failed = 500, orjson.dumps(body), call.context.headers
        finally:
            call.finish(code)
        if failed is not None and not call.answered:  # an MCP event stream cut mid-way just ends
            await respond(send, *failed)

    # -- the server --------------------------------------------------------------------------

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
        uv_config = uvicorn.Config(
            self,
            lifespan="off",
            ws="none",
            log_config=None,
            access_log=False,
            server_header=False,
            timeout_graceful_shutdown=CLOSE_TIMEOUT_S,
            timeout_keep_alive=KEEP_ALIVE_S,
            http=cast(Any, functools.partial(_BoundedHead, admission=self.admission)),
            **_tls_options(self.config),
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
        if self._server is not None and self._serving is not None:
            self._server.should_exit = True
            with contextlib.suppress(asyncio.CancelledError):
                await self._serving
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
    each worker), and how many it refused while full: logged once when it fills and once when
    it has room again, so a flood of connections cannot flood the log too.

    uvicorn's own ``limit_concurrency`` is not used: it reads a connection's request head and
    answers 503 from a task of its own, so a refused connection still costs a task and up to
    a head's bytes, and it counts the connection being refused (``limit`` - 1 are served)."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.refused = 0  # since the door last had room
        self.refused_total = 0

    def admit(self, open_now: int) -> bool:
        if open_now < self.limit:
            if self.refused:
                log.warning(
                    "the HTTP door has room again; it refused %d connection(s) while full",
                    self.refused,
                )
                self.refused = 0
            return True
        if not self.refused:
            log.warning(
                "the HTTP door is full: %d connections open ([sidecar.http] max_connections); "
                "more are answered 503 until one closes",
                self.limit,
            )
        self.refused += 1
        self.refused_total += 1
        return False

    def refusal(self) -> bytes:
        """The whole 503 a refused connection gets, before it has sent anything."""
        message = (
            f"the HTTP door is serving {self.limit} connections, its limit ([sidecar.http] "
            "max_connections): retry in a moment, and reuse one connection for many calls"
        )
        body = orjson.dumps({"error": {"code": "UNAVAILABLE", "message": message}})
        head = (
            "HTTP/1.1 503 Service Unavailable\r\ncontent-type: application/json\r\n"
            f"connection: close\r\nretry-after: 1\r\ncontent-length: {len(body)}\r\n\r\n"
        )
        return head.encode() + body


class _BoundedHead(HttpToolsProtocol):
    """uvicorn's httptools protocol with each request's head bounded: ``MAX_HEAD_BYTES``
    (431, then closed) and ``HEAD_TIMEOUT_S`` (closed), and connections past the door's
    ``_Admission`` refused as they are accepted (``_refuse``). The body is ``read_body``'s."""

    _head_timer: asyncio.TimerHandle | None = None
    _head_bytes = 0
    _refused: asyncio.TimerHandle | None = None  # the close of a refused connection, pending

    def __init__(self, *args: Any, admission: _Admission, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.admission = admission

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        if not self.admission.admit(len(self.connections)):
            self._refuse(transport)
            return
        super().connection_made(transport)
        self._arm()

    def _refuse(self, transport: asyncio.Transport) -> None:
        """Answer 503 now, close our side for writing, and close the socket when the client
        closes its own or after ``REFUSED_LINGER_S``: no parser, no task, no buffer kept, and
        the connection is not one of uvicorn's (which the limit counts)."""
        self.transport = transport
        transport.write(self.admission.refusal())
        if transport.can_write_eof():
            transport.write_eof()
        self._refused = self.loop.call_later(REFUSED_LINGER_S, transport.close)

    def connection_lost(self, exc: Exception | None) -> None:
        if self._refused is not None:
            self._refused.cancel()
            return
        self._disarm()
        super().connection_lost(exc)

    def on_message_begin(self) -> None:
        super().on_message_begin()
        self._arm()

    def on_headers_complete(self) -> None:
        self._disarm()
        self._head_bytes = 0
        super().on_headers_complete()

    def data_received(self, data: bytes) -> None:
        if self._refused is not None:
            return  # a refused connection's request: read and dropped
        if self._head_timer is not None:
            self._head_bytes += len(data)
        super().data_received(data)
        if self._head_timer is None or self.transport.is_closing():
            return
        if self._head_bytes > MAX_HEAD_BYTES:
            self._disarm()
            message = f"the request's headers are over {MAX_HEAD_BYTES} bytes"
            body = orjson.dumps({"error": {"code": "INVALID_ARGUMENT", "message": message}})
            self.transport.write(
                b"HTTP/1.1 431 Request Header Fields Too Large\r\ncontent-type: "
                b"application/json\r\nconnection: close\r\ncontent-length: "
                + str(len(body)).encode()
                + b"\r\n\r\n"
                + body
            )
            self.transport.close()

    def _arm(self) -> None:
        self._disarm()
        self._head_timer = self.loop.call_later(HEAD_TIMEOUT_S, self._head_late)

    def _disarm(self) -> None:
        if self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None

    def _head_late(self) -> None:
        self._head_timer = None
        if not self.transport.is_closing():
            self.transport.close()


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
        raise OSError(f"cannot listen on {listen} ([sidecar.http] listen): {exc}") from exc
    sock.listen(1024)
    sock.setblocking(False)
    return sock


def _tls_options(config: Config) -> dict[str, Any]:
    """uvicorn's TLS settings from ``[sidecar.tls]`` (the files are read now: a bad one stops
    the start with the key that named it)."""
    t = config.sidecar.tls
    if not t.enabled or t.cert_file is None or t.key_file is None:
        return {}
    tls.read_pem(t.cert_file, "[sidecar.tls] cert_file")
    tls.read_pem(t.key_file, "[sidecar.tls] key_file")
    options: dict[str, Any] = {"ssl_certfile": str(t.cert_file), "ssl_keyfile": str(t.key_file)}
    if t.client_ca_file is not None:
        tls.read_pem(t.client_ca_file, "[sidecar.tls] client_ca_file")
        options |= {"ssl_ca_certs": str(t.client_ca_file), "ssl_cert_reqs": ssl.CERT_REQUIRED}
    return options


def _refusal_headers(exc: RequestError, call: HttpCall) -> list[tuple[bytes, bytes]]:
    headers = list(call.context.headers)
    if status_for(exc) is grpc.StatusCode.UNAUTHENTICATED:
        headers.append((b"www-authenticate", b"Bearer"))
    return headers
