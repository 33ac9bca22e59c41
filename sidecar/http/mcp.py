"""The MCP server of the HTTP door: every ``[[function]]`` as an MCP tool, over streamable HTTP.

Built on the official SDK's low-level ``Server`` and its ``StreamableHTTPSessionManager``
(stateful sessions, JSON responses). A tool's input schema is the one ``ListTools`` gives
(``KnowledgeFunction.parameters``), its result the same compact JSON as ``InvokeTool``; with
``[sidecar.http] read_page_bases``, a ``read_page`` tool reads a whole page of those bases,
within ``tool_output_chars`` like every output: a longer page is cut (``truncated``), and the
answer gives the ``next_offset`` to read on from (``page_output``).
Everything a model can get wrong (bad arguments, an unknown tool, a function outside the
token's scope, a base with no snapshot, a page that is not there, a tools/call whose params the
SDK would refuse: arguments not an object, a name not a string) is a tool result with
``isError``, never a failed request; arguments sent as the JSON string a model emitted are read
as their object, by the one reading ``/tools/`` gives them (``call_params``,
``arguments_object``).

The SDK runs each MCP session in a task of its own, so a tool call does not run in the HTTP
request's context: ``scope_for`` hands the request's ``HttpCall`` and a copy of its context
(the caller's scope and sessions, the log ids the hooks set) to the handler through the ASGI
scope, and the handler runs in that context. The voxrecall session of a call is the
``x-voxrecall-session`` header when given, else the MCP session id, so a call's tool calls
share its retained context. A session belongs to the caller that opened it (the SDK answers
another token's request for it 404), and each caller (without ``[sidecar.auth]``, each client
address) holds at most its share of ``[sidecar] max_sessions`` (``SessionShares``, checked
before the SDK sees a request that opens one: 429), so one caller's sessions never make
another's ``initialize`` fail; each counts ``MCP_SESSION_BYTES`` in its caller's share of the
sessions' bytes (``session_memory_bytes``), so they are bounded in bytes too. The SDK's line per session opened and closed is left out of
the log (a client opening sessions on end, or a drain closing thousands, wrote two lines each);
the drain logs once how many it closed.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import logging
import time
from collections import Counter
from collections.abc import AsyncIterator, Callable, Coroutine, Iterator, Mapping
from contextlib import asynccontextmanager
from typing import TYPE_CHECKING, Any, TypeVar

import mcp_types as types
import orjson
from mcp.server.auth.middleware.bearer_auth import AuthenticatedUser
from mcp.server.auth.provider import AccessToken
from mcp.server.context import ServerRequestContext
from mcp.server.lowlevel.server import Server
from mcp.server.streamable_http_manager import StreamableHTTPSessionManager
from mcp.server.transport_security import TransportSecuritySettings
from starlette.types import Message, Receive, Scope, Send

from index.config import quoted
from index.errors import SnapshotError, VoxrecallError
from sidecar import __version__
from sidecar.config import Config, HttpConfig
from sidecar.edge import tls
from sidecar.edge.addresses import share_key
from sidecar.edge.auth import Authenticator
from sidecar.edge.limits import check_session_header
from sidecar.edge.status import status_for, tool_error_type
from sidecar.errors import InvalidArgument, ResourceExhausted, ToolCallError
from sidecar.functions.tools import (
    INVALID_ARGUMENTS,
    MAX_ARGUMENTS_DEPTH,
    UNAVAILABLE,
    PageReader,
    Toolbox,
    arguments_object,
    error_output,
    finite_arguments,
    nested_past,
    not_an_object,
    too_deep,
)
from sidecar.gen import retrieval_pb2 as pb
from sidecar.turn.engine import Engine
from sidecar.turn.sessions import SessionStore

if TYPE_CHECKING:
    from sidecar.http.door import HttpCall

log = logging.getLogger("voxrecall.mcp")
# The SDK logs a line at INFO for every session opened and closed: quiet below WARNING, so a
# client opening sessions, or a drain closing them, costs no log line each.
SDK_SESSION_LOGGERS = ("mcp.server.streamable_http_manager", "mcp.server.streamable_http")

READ_PAGE = "read_page"
SESSION_HEADER = "x-voxrecall-session"
MCP_SESSION_HEADER = "mcp-session-id"
# The MCP methods named in metrics and logs ("MCP tools/call"); any other is "MCP other", so a
# client cannot make up label values.
KNOWN_METHODS = frozenset(
    {"initialize", "notifications/initialized", "ping", "tools/list", "tools/call"}
)
# What one MCP session holds in the SDK (its transport, streams, tasks and server session):
# 41 to 45 KB each, measured with tracemalloc over 100 to 200 sessions opened by initialize
# alone (the RSS grew 42 KB a session); counted in the sessions' bytes (``SessionShares``;
# tests/test_http_door.py keeps it honest).
MCP_SESSION_BYTES = 44 * 1024
# An initialize request's body, at most, in bytes: the SDK keeps its params (capabilities,
# clientInfo) as long as its session (even params it refused), which counts MCP_SESSION_BYTES
# whatever they hold: a 245 KB initialize held ~600 KB a session. Real clients send under 1 KiB.
MAX_INITIALIZE_BYTES = 8 * 1024
INITIALIZE = "MCP initialize"  # ``McpDoor.method_name`` of an initialize request
# The JSON-RPC code of a session refused for its owner's full share (the server-error range).
SESSIONS_FULL = -32000
# What an initialize's params hold in the SDK past MCP_SESSION_BYTES, per byte of its body over
# INITIALIZE_COUNTED_BYTES (those MCP_SESSION_BYTES covers: real clients' are a few hundred):
# 24.9 bytes measured with tracemalloc for the costliest shape found (empty lists, ``[[],...]``;
# small strings cost 6.6), so a session opened with an 8 KiB initialize counts what it holds.
INITIALIZE_BYTE_COST = 25
INITIALIZE_COUNTED_BYTES = 512


def session_bytes(initialize_bytes: int) -> int:
    """What a session opened by an initialize of ``initialize_bytes`` counts in the sessions'
    bytes: ``MCP_SESSION_BYTES``, and the params it keeps past those of a plain client."""
    extra = max(0, initialize_bytes - INITIALIZE_COUNTED_BYTES)
    return MCP_SESSION_BYTES + INITIALIZE_BYTE_COST * extra


_CALL = "voxrecall.call"
_CONTEXT = "voxrecall.context"
_MISTAKE = "voxrecall.mistake"  # what was wrong with a tools/call's params (``call_params``)
CALL_SHAPE = '{"name": "<a tool tools/list gives>", "arguments": {"query": "..."}}'
_T = TypeVar("_T")
READ_PAGE_DESCRIPTION = (
    "Read a whole page of the knowledge base, by the path a search result gave, when its "
    "excerpt is not enough. A long page comes in parts: call again with the next_offset an "
    "answer gives."
)
OFFSET = "offset"


def page_output(head: dict[str, str], text: str, offset: int, max_chars: int) -> str | None:
    """A page as compact JSON of at most ``max_chars`` characters: ``head`` (title, source,
    path, url) and ``text`` from ``offset`` (characters); cut where it must be (the longest
    part that fits, found by bisection), with ``truncated``, ``next_offset`` and a note saying
    how to read on. Only ``max_chars`` of the text are ever encoded, however long the page.
    None: the head leaves no room for a character of it."""
    window = text[offset : offset + max_chars]
    if offset + len(window) >= len(text):
        whole = orjson.dumps({**head, "text": window}).decode()
        if len(whole) <= max_chars:
            return whole
    lo, hi = 0, len(window)  # the longest part that fits is at least lo, less than hi + 1
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if len(_page_part(head, window[:mid], offset + mid)) <= max_chars:
            lo = mid
        else:
            hi = mid - 1
    return _page_part(head, window[:lo], offset + lo) if lo else None


def _page_part(head: dict[str, str], part: str, end: int) -> str:
    return orjson.dumps(
        {
            **head,
            "text": part,
            "truncated": True,
            "next_offset": end,
            "note": f"the page goes on: call read_page again with offset {end}",
        }
    ).decode()


class SessionShares:
    """The MCP sessions each owner holds (opening or open), against its share of ``[sidecar]
    max_sessions``. With auth the owners are the callers, each with its ``[sidecar.auth.caller]
    max_sessions`` (resolved by the config: the shares add up to at most the whole, so no
    caller can take another's). Without auth they are the client addresses, each with
    ``per_address`` (0: no share, the SDK's own ``max_sessions`` the only bound).

    ``take`` counts a session opening (or refuses it); ``opened`` names it once the SDK has
    answered with its id; ``settle`` gives back one that did not open; ``closed`` one the SDK
    discards, however it ended (DELETE, idle, a crash, the drain). An owner at its share is
    logged once, until it has room again.

    With ``store`` (the engine's sessions), each session also counts its bytes
    (``session_bytes``: ``MCP_SESSION_BYTES`` and its initialize's params) in its holder's bytes there (``SessionStore.reserve``: the caller's, without auth the one
    owner's), so the sessions' byte budget (``session_memory_bytes``) bounds MCP sessions too:
    one past it is refused as one past the share is, never making room by evicting a session
    (a live call's context)."""

    def __init__(
        self, shares: Mapping[str, int], per_address: int = 0, store: SessionStore | None = None
    ) -> None:
        self.shares = dict(shares)
        self.per_address = per_address
        self.store = store
        self.held: Counter[str] = Counter()
        # session id -> its owner, its holder, the bytes it counts there
        self.owner_of: dict[str, tuple[str, str, int]] = {}
        self.full: set[str] = set()  # owners at their share, logged

    def take(self, owner: str, holder: str = "", size: int = MCP_SESSION_BYTES) -> None:
        """Count a session ``owner`` opens, its ``size`` bytes in ``holder``'s (a caller's name,
        or "" without auth), or raise ``ResourceExhausted``."""
        self._within_share(owner)
        if self.store is not None and not self.store.reserve(holder, size):
            key = f"[sidecar{'.auth.caller' if holder else ''}] session_memory_bytes"
            of = f" of caller {holder!r}" if holder else ""
            raise ResourceExhausted(
                f"the sessions{of} fill its share of the sessions' bytes ({key}; this MCP "
                f"session counts {size} bytes, and never evicts a call's session): end an MCP "
                "session (DELETE /mcp with its mcp-session-id) or reuse one"
            )
        self.held[owner] += 1

    def _within_share(self, owner: str) -> None:
        share = self.shares.get(owner, self.per_address)
        held = self.held[owner]
        if share and held >= share:
            who, key = self._named(owner, share)
            if owner not in self.full:
                self.full.add(owner)
                log.warning(
                    "%s holds %d MCP sessions, its share (%s); its next ones are refused "
                    "until one closes",
                    who,
                    held,
                    key,
                )
            raise ResourceExhausted(
                f"{who} has {held} MCP sessions open, its share ({key}): end one "
                "(DELETE /mcp with its mcp-session-id) or reuse one"
            )

    def _named(self, owner: str, share: int) -> tuple[str, str]:
        if owner in self.shares:
            return f"caller {owner!r}", f"[sidecar.auth.caller] max_sessions = {share}"
        return f"address {owner}", (
            f"[sidecar] max_sessions x [sidecar.http] max_connections_per_ip / "
            f"max_connections = {share}"
        )

    def opened(
        self, owner: str, session_id: str, holder: str = "", size: int = MCP_SESSION_BYTES
    ) -> None:
        self.owner_of[session_id] = (owner, holder, size)

    def settle(
        self, owner: str, session_id: str | None, holder: str = "", size: int = MCP_SESSION_BYTES
    ) -> None:
        """The opening request is done: ``session_id`` None, nothing opened."""
        if session_id is None:
            self._give(owner, holder, size)

    def closed(self, session_id: str) -> None:
        """The SDK discards a session (it may say so twice: the second finds no owner)."""
        named = self.owner_of.pop(session_id, None)
        if named is not None:
            self._give(*named)

    def _give(self, owner: str, holder: str, size: int) -> None:
        if self.store is not None:
            self.store.release(holder, size)
        self.held[owner] -= 1
        if self.held[owner] <= 0:
            del self.held[owner]
        self.full.discard(owner)


class _SharedSessionManager(StreamableHTTPSessionManager):
    """The SDK's session manager, telling ``SessionShares`` of each session it discards."""

    def __init__(self, shares: SessionShares, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.session_shares = shares

    async def _discard_session(self, session_id: str, transport: Any) -> None:
        self.session_shares.closed(session_id)
        await super()._discard_session(session_id, transport)


def _per_address(max_sessions: int, http: HttpConfig) -> int:
    """Without auth, an address's share of the sessions: the share of the connections it may
    hold (``max_connections_per_ip`` of ``max_connections``; 0, no cap: no share), at least 1.
    Behind a proxy every client has its address; the docs say to lift the per-address cap
    there, which lifts this too."""
    if not http.max_connections_per_ip or http.max_connections_per_ip >= http.max_connections:
        return 0
    return max(1, max_sessions * http.max_connections_per_ip // http.max_connections)


def initialize_refusal(method_name: str, body: bytes) -> bytes | None:
    """The JSON-RPC error answering an initialize (``method_name``, ``McpDoor.method_name``)
    whose body is over ``MAX_INITIALIZE_BYTES``; None for any other request."""
    if method_name != INITIALIZE or len(body) <= MAX_INITIALIZE_BYTES:
        return None
    message = (
        f"this initialize is {len(body)} bytes; the limit is {MAX_INITIALIZE_BYTES} bytes "
        "(its session keeps its params): send your capabilities and clientInfo without payloads"
    )
    return _refusal(body, types.INVALID_PARAMS, message)


def session_header_refusal(headers: Mapping[str, str], body: bytes) -> bytes | None:
    """The JSON-RPC error answering a request whose ``x-voxrecall-session`` is longer than a
    session id may be (the door answers it 400, as ``/tools/`` does): the platform set it, and
    a tool error would tell the model, which sent no id. None when it is within the limit."""
    try:
        check_session_header(headers.get(SESSION_HEADER, ""), SESSION_HEADER)
    except InvalidArgument as exc:
        return _refusal(body, types.INVALID_PARAMS, str(exc))
    return None


def session_refusal(body: bytes, message: str) -> bytes:
    """The JSON-RPC error answering a request that would open a session past its owner's share
    (the door answers it 429): a client's SDK shows ``message`` only from a JSON-RPC error."""
    return _refusal(body, SESSIONS_FULL, message)


class RequestsInFlight:
    """The JSON-RPC ids of each session's requests in flight. The SDK keys a request's answer
    by its id alone: a second request of an id still in flight took the first one's answer, and
    the first waited for ever, its ``max_concurrent_rpcs`` slot held (an attacker's pipelined
    ``tools/call`` calls, every one ``id: 2``, leaked two slots a round). JSON-RPC asks ids to
    be unique; one in flight already is refused. Bounded: an entry lives while its call does."""

    def __init__(self) -> None:
        self._ids: set[tuple[str, str]] = set()

    @contextlib.contextmanager
    def claimed(self, headers: Mapping[str, str], body: bytes) -> Iterator[bytes | None]:
        """While the request runs, its id is its session's; the JSON-RPC error to answer
        instead (400) when the session has a request of that id in flight."""
        key = _request_key(headers, body)
        if key is None:
            yield None
        elif key in self._ids:
            message = f"a request of id {key[1]} is in flight in this session: give each its own"
            yield _refusal(body, types.INVALID_REQUEST, message)
        else:
            self._ids.add(key)
            try:
                yield None
            finally:
                self._ids.discard(key)


def _request_key(headers: Mapping[str, str], body: bytes) -> tuple[str, str] | None:
    """(session, id as the SDK keys it: ``str``) of a request in a session; None for a
    notification, a batch, a body that is not JSON, or one without a session."""
    session = headers.get(MCP_SESSION_HEADER, "")
    try:
        message = orjson.loads(body) if session else None
    except orjson.JSONDecodeError:
        return None
    if not isinstance(message, dict) or "method" not in message:
        return None
    found = message.get("id")
    return None if found is None else (session, str(found))


def _refusal(body: bytes, code: int, message: str) -> bytes:
    """A JSON-RPC error whose id is the request's, when its body (read whole already, within
    ``max_body_bytes``) names one, else null: a client matches an answer to its request by it."""
    try:
        request = orjson.loads(body)
    except orjson.JSONDecodeError:
        request = None
    found = request.get("id") if isinstance(request, dict) else None
    id_ = found if isinstance(found, str | int) and not isinstance(found, bool) else None
    return orjson.dumps({"jsonrpc": "2.0", "id": id_, "error": {"code": code, "message": message}})


def _text(output: str, is_error: bool) -> types.CallToolResult:
    return types.CallToolResult(content=[types.TextContent(text=output)], is_error=is_error)


class McpDoor:
    """The SDK server with voxrecall's tools, and the session manager that serves it."""

    def __init__(
        self, config: Config, engine: Engine, toolbox: Toolbox, auth: Authenticator | None
    ) -> None:
        self.engine = engine
        self.toolbox = toolbox
        self.auth = auth
        self.max_chars = config.sidecar.tool_output_chars
        self.read_page_bases = config.sidecar.http.read_page_bases
        self.pages = PageReader()
        self.server: Server[Any] = Server(
            "voxrecall",
            version=__version__,
            on_list_tools=self._list_tools,
            on_call_tool=self._call_tool,
        )
        # no OpenTelemetry span per message (the SDK's default): the sidecar's own metrics and
        # logs measure every call, and the span cost a tenth of an MCP call's time here
        self.server.middleware.clear()
        settings = config.sidecar
        loopback = tls.is_loopback(settings.http.listen)
        http = settings.http
        self.sessions = SessionShares(
            {c.name: c.max_sessions for c in settings.auth.callers},
            per_address=_per_address(settings.max_sessions, http),
            store=engine.sessions,
        )
        for name in SDK_SESSION_LOGGERS:
            logging.getLogger(name).setLevel(logging.WARNING)
        self.in_flight = RequestsInFlight()
        self.manager = _SharedSessionManager(
            self.sessions,
            app=self.server,
            json_response=True,  # one JSON answer per POST: no event stream to hold open
            # a browser page must not reach a loopback sidecar by rebinding a name to 127.0.0.1
            security_settings=TransportSecuritySettings(
                enable_dns_rebinding_protection=loopback,
                allowed_hosts=["127.0.0.1:*", "localhost:*", "[::1]:*"],
                allowed_origins=["http://127.0.0.1:*", "http://localhost:*", "http://[::1]:*"],
            ),
            session_idle_timeout=settings.session_ttl_s,
            max_request_body_size=settings.http.max_body_bytes,
            max_sessions=settings.max_sessions,
        )

    @asynccontextmanager
    async def running(self) -> AsyncIterator[None]:
        open_, started = 0, 0.0
        async with self.manager.run():
            try:
                yield
            finally:
                open_, started = len(self.sessions.owner_of), time.monotonic()
        if open_:  # one line for the lot, where the SDK logged one per session
            log.info("closed %d MCP session(s) in %.1f s", open_, time.monotonic() - started)

    async def handle(self, scope: Scope, receive: Receive, send: Send, body_bytes: int = 0) -> None:
        """Hand the request to the SDK, a tools/call's params made what it takes first
        (``call_params``); one that opens a session (a POST without a session id) is counted
        against its owner's share first (``ResourceExhausted``), its ``body_bytes`` with it
        (``session_bytes``)."""
        if scope["method"] == "POST":
            scope, receive = await _with_call_params(scope, receive)
        header = MCP_SESSION_HEADER.encode()
        if scope["method"] != "POST" or any(name == header for name, _ in scope["headers"]):
            await self.manager.handle_request(scope, receive, send)
            return
        call: HttpCall = scope[_CALL]
        caller, client = call.caller, scope.get("client")
        owner = caller.name if caller is not None else share_key(str(client[0] if client else ""))
        holder = caller.name if caller is not None else ""  # whose bytes (``sessions.owner``)
        size = session_bytes(body_bytes)
        self.sessions.take(owner, holder, size)
        opened: list[str] = []

        async def watched(message: Message) -> None:
            if message["type"] == "http.response.start" and message["status"] < 400:
                found = [v for k, v in message.get("headers", ()) if k.lower() == header]
                if found:
                    opened.append(found[0].decode("latin-1"))
                    self.sessions.opened(owner, opened[0], holder, size)
            await send(message)

        try:
            await self.manager.handle_request(scope, receive, watched)
        finally:
            self.sessions.settle(owner, opened[0] if opened else None, holder, size)

    @staticmethod
    def method_name(body: bytes) -> str:
        """``MCP tools/call``: what a POST body asks, for metrics and logs (bounded names)."""
        try:
            message = orjson.loads(body)
        except orjson.JSONDecodeError:
            return "MCP other"
        method = message.get("method") if isinstance(message, dict) else None
        # a list or an object there cannot be looked up in the set (TypeError: a 500)
        known = isinstance(method, str) and method in KNOWN_METHODS
        return f"MCP {method}" if known else "MCP other"

    @staticmethod
    def scope_for(scope: Scope, call: HttpCall) -> Scope:
        """The ASGI scope the SDK sees: the caller as its user (a session is its opener's), and
        the call with its context for the handlers."""
        caller = call.caller
        extra: dict[str, Any] = {_CALL: call, _CONTEXT: contextvars.copy_context()}
        if caller is not None:
            token = AccessToken(token=caller.name, client_id=caller.name, scopes=[])
            extra["user"] = AuthenticatedUser(token)
        return {**scope, **extra}

    # -- handlers ----------------------------------------------------------------------------

    async def _list_tools(
        self, ctx: ServerRequestContext[Any], params: types.PaginatedRequestParams | None
    ) -> types.ListToolsResult:
        return await _in_call(ctx, self._tools)

    async def _call_tool(
        self, ctx: ServerRequestContext[Any], params: types.CallToolRequestParams
    ) -> types.CallToolResult:
        mistake = ctx.request.scope.get(_MISTAKE) if ctx.request is not None else None
        if mistake is not None:  # params the SDK would have refused with a JSON-RPC error
            return self._error(*mistake)
        headers = ctx.request.headers if ctx.request is not None else {}
        session_id = headers.get(SESSION_HEADER) or headers.get(MCP_SESSION_HEADER) or ""

        async def call(http: HttpCall) -> types.CallToolResult:
            arguments = params.arguments or {}
            if params.name == READ_PAGE and self.read_page_bases:
                return await self._read_page(http, arguments)
            return await self._invoke(http, params.name, arguments, session_id)

        return await _in_call(ctx, call)

    async def _tools(self, call: HttpCall) -> types.ListToolsResult:
        tools = [
            types.Tool(
                name=fn.name,
                description=fn.config.description,
                input_schema=fn.parameters(strict=False),
            )
            for fn in self.toolbox.visible_functions()
        ]
        bases = self._page_bases(call)
        if bases:
            tools.append(
                types.Tool(
                    name=READ_PAGE,
                    description=READ_PAGE_DESCRIPTION,
                    input_schema=_page_schema(bases),
                )
            )
        return types.ListToolsResult(tools=tools)

    async def _invoke(
        self, call: HttpCall, name: str, arguments: dict[str, Any], session_id: str
    ) -> types.CallToolResult:
        try:
            arguments_json = orjson.dumps(finite_arguments(arguments, CALL_SHAPE)).decode()
        except ToolCallError as exc:
            return self._error(exc.type, exc.message)
        except orjson.JSONEncodeError as exc:  # an integer past 64 bits: a JSON-RPC error before
            return self._error(
                INVALID_ARGUMENTS,
                f"the arguments cannot be read ({exc}): send an object like {CALL_SHAPE}",
            )
        request = pb.InvokeToolRequest(
            name=name, arguments_json=arguments_json, session_id=session_id
        )
        try:
            call.check(request)  # the caller's scope and the byte limits, as on gRPC
            also = (READ_PAGE,) if self._page_bases(call) else ()
            result = await self.toolbox.invoke(
                self.engine, name, arguments_json, session_id, other_tools=also
            )
        except VoxrecallError as exc:
            return self._refused(exc)
        return _text(result.output, result.is_error)

    async def _read_page(self, call: HttpCall, arguments: dict[str, Any]) -> types.CallToolResult:
        try:
            kb, path, source, offset = page_arguments(arguments, self._page_bases(call))
        except ToolCallError as exc:
            return self._error(exc.type, exc.message)
        try:
            call.check(pb.ReadPageRequest(knowledge_base=kb, source_path=path, source=source))
            page = await self.pages.read(self.engine.searcher(kb), kb, path, source, offset)
        except VoxrecallError as exc:
            return self._refused(exc)
        head = {"title": page.title, "source": page.source, "path": page.source_path}
        if page.url:
            head["url"] = page.url
        output = page_output(head, page.text, offset, self.max_chars)
        if output is None:
            return self._error(
                INVALID_ARGUMENTS,
                "this page's title, path or URL alone is over [sidecar] tool_output_chars",
            )
        return _text(output, is_error=False)

    def _page_bases(self, call: HttpCall) -> list[str]:
        if self.auth is None:
            return list(self.read_page_bases)
        return self.auth.reachable_bases(call.caller, self.read_page_bases)

    def _refused(self, exc: VoxrecallError) -> types.CallToolResult:
        if isinstance(exc, SnapshotError):
            log.warning("tool call: %s", exc)
            return self._error(
                UNAVAILABLE,
                "the knowledge base cannot be searched right now; tell the caller you cannot "
                "look it up at the moment",
            )
        return self._error(tool_error_type(status_for(exc)), str(exc))

    def _error(self, type_: str, message: str) -> types.CallToolResult:
        return _text(error_output(type_, message, self.max_chars), is_error=True)


Mistake = tuple[str, str]  # (error type, message): a tool error's


async def _with_call_params(scope: Scope, receive: Receive) -> tuple[Scope, Receive]:
    """The scope and body the SDK is handed: a tools/call's params as it takes them, and what
    was wrong with them in the scope (``_MISTAKE``), for ``_call_tool`` to answer as a tool
    error. The door has read the body whole, within ``max_body_bytes``."""
    chunks = []
    while True:
        message = await receive()
        chunks.append(message.get("body", b""))
        if message["type"] != "http.request" or not message.get("more_body"):
            break
    body, mistake = call_params(b"".join(chunks))
    if mistake is not None:
        scope = {**scope, _MISTAKE: mistake}
    given = False

    async def replayed() -> Message:
        nonlocal given
        if given:
            return await receive()
        given = True
        return {"type": "http.request", "body": body, "more_body": False}

    return scope, replayed


def call_params(body: bytes) -> tuple[bytes, Mistake | None]:
    """A JSON-RPC body with a tools/call's params made what the SDK takes, and what was wrong
    with them (None: nothing). The SDK answers params not of its shape with a JSON-RPC error
    ("Invalid request parameters"), which a model never reads: arguments sent as the JSON
    string a model emitted are parsed (within ``MAX_ARGUMENTS_BYTES``); arguments not an object,
    or a name not a string, are a tool error saying what to send."""
    try:
        message = orjson.loads(body)
    except orjson.JSONDecodeError:
        return body, None
    if not isinstance(message, dict) or message.get("method") != "tools/call":
        return body, None
    params = message.get("params")
    fixed, mistake = _call_params(params)
    if fixed is params:
        return body, None
    try:
        return orjson.dumps({**message, "params": fixed}), mistake
    except orjson.JSONEncodeError:  # deep elsewhere than the arguments: the SDK answers it
        return body, None


def _call_params(params: Any) -> tuple[Any, Mistake | None]:
    """``params`` as the SDK takes them (``params`` itself when it does), and the mistake."""
    if not isinstance(params, dict):
        return {"name": ""}, (INVALID_ARGUMENTS, f"tools/call takes an object: {CALL_SHAPE}")
    name, given = params.get("name"), params.get("arguments")
    arguments, mistake = _arguments(given)
    if not isinstance(name, str):
        sent = "no name" if name is None else f"name {_shown(name)}"
        mistake = (INVALID_ARGUMENTS, f"{sent} was sent: send the tool's name, {CALL_SHAPE}")
        name = ""
    if name is params.get("name") and arguments is given:
        return params, None
    return {**params, "name": name, "arguments": arguments}, mistake


def _arguments(arguments: Any) -> tuple[dict[str, Any] | None, Mistake | None]:
    """Arguments as the SDK takes them (an object, or none), and what was wrong with them:
    JSON text (a model's) read as ``/tools/`` reads it (``arguments_object``); arguments nested
    past ``MAX_ARGUMENTS_DEPTH`` are dropped for the mistake saying so (the SDK's parser stops
    at about 200 levels, orjson writes 255: either was a JSON-RPC error the model never reads)."""
    if arguments is None:
        return None, None
    if isinstance(arguments, str):
        try:
            arguments = arguments_object(arguments, CALL_SHAPE)
        except ToolCallError as exc:
            return {}, (exc.type, exc.message)
    elif not isinstance(arguments, dict):
        return {}, (INVALID_ARGUMENTS, not_an_object(CALL_SHAPE))
    if nested_past(arguments, MAX_ARGUMENTS_DEPTH):
        return {}, (INVALID_ARGUMENTS, too_deep(MAX_ARGUMENTS_DEPTH, CALL_SHAPE))
    return arguments, None


# The page's path by the name a search result gives it, and by ReadPage's (the schema's first).
PAGE_PATHS = ("path", "source_path")


def page_arguments(arguments: Mapping[str, Any], bases: list[str]) -> tuple[str, str, str, int]:
    """read_page's base, page path, source and offset, or ``ToolCallError`` naming the argument
    to change and only the arguments its schema has (``PAGE_ARGUMENTS``)."""
    extra = sorted(k for k in arguments if k not in PAGE_ARGUMENTS)
    if extra:
        raise ToolCallError(
            INVALID_ARGUMENTS,
            f"{READ_PAGE} does not take {', '.join(extra)}; it takes {', '.join(PAGE_ARGUMENTS)}",
        )
    path = _page_path(arguments)
    source = arguments.get("source") or ""
    if not isinstance(source, str):
        raise ToolCallError(INVALID_ARGUMENTS, "source must be a string: the result's source")
    offset = arguments.get(OFFSET)
    offset = 0 if offset is None else offset  # null: from the start
    if type(offset) is not int or offset < 0:
        raise ToolCallError(
            INVALID_ARGUMENTS, "offset must be a whole number of characters, 0 or more"
        )
    return _page_base(arguments, bases), path, source, offset


def _page_path(arguments: Mapping[str, Any]) -> str:
    """The page path given by either name. Types are checked before the values are compared
    (a list or object is unhashable), and "" is not given: models send it for the optional
    fields they have no value for."""
    given = [arguments[k] for k in PAGE_PATHS if _given(arguments.get(k))]
    if not given:
        raise ToolCallError(
            INVALID_ARGUMENTS, "path is required: the page's path, as a search result gave it"
        )
    if not all(isinstance(path, str) for path in given) or len(set(given)) > 1:
        raise ToolCallError(
            INVALID_ARGUMENTS, "path must be one string: the path a search result gave"
        )
    return str(given[0])


def _given(value: Any) -> bool:
    """Whether an optional argument was given: null and "" (a model's "no value") are not."""
    return value is not None and value != ""


def _page_base(arguments: Mapping[str, Any], bases: list[str]) -> str:
    """The base read_page reads: the ``knowledge_base`` given, or the only one it may."""
    kb = arguments.get("knowledge_base")
    kb = kb if _given(kb) else None
    if kb is None and len(bases) == 1:
        return bases[0]
    if kb not in bases:
        raise ToolCallError(
            INVALID_ARGUMENTS,
            f"knowledge_base must be one of {', '.join(bases) or 'none'}; got {_shown(kb)}",
        )
    return str(kb)


def _shown(value: Any) -> str:
    return "nothing" if value is None else quoted(value)


# read_page's arguments but the base, whose names (an enum) are the caller's: built once.
_PAGE_PROPERTIES: dict[str, Any] = {
    "path": {"type": "string", "description": "The page's path, as a search result gave it."},
    "source_path": {"type": "string", "description": "The same as path (ReadPage's name)."},
    "source": {"type": "string", "description": "The result's source, when paths repeat."},
    OFFSET: {
        "type": "integer",
        "minimum": 0,
        "description": "Where to read on from: the next_offset a cut answer gave.",
    },
}
# Every argument read_page takes, in its schema's order.
PAGE_ARGUMENTS = (*_PAGE_PROPERTIES, "knowledge_base")


def _page_schema(bases: list[str]) -> dict[str, Any]:
    return {
        "type": "object",
        # the base listed with one base too (a call naming it was always taken)
        "properties": {**_PAGE_PROPERTIES, "knowledge_base": {"type": "string", "enum": bases}},
        # path or source_path: one is needed (page_arguments says so); neither is required here,
        # so a client that checks arguments against the schema passes either; the base is
        # required with several
        "required": ["knowledge_base"] if len(bases) > 1 else [],
        "additionalProperties": False,
    }


async def _in_call(
    ctx: ServerRequestContext[Any], handler: Callable[[HttpCall], Coroutine[Any, Any, _T]]
) -> _T:
    """Run ``handler`` with the HTTP call that carried this MCP request, in that call's
    context (the caller's scope, sessions and log ids)."""
    scope = ctx.request.scope if ctx.request is not None else {}
    call: HttpCall | None = scope.get(_CALL)
    context: contextvars.Context | None = scope.get(_CONTEXT)
    if call is None or context is None:
        raise RuntimeError("an MCP request reached voxrecall without its HTTP call")
    return await asyncio.create_task(handler(call), context=context)
