"""One server interceptor that runs a list of hooks around every call (health checks excepted).

    server = grpc.aio.server(interceptors=[HookInterceptor([logs, metrics, auth, limits])])

A hook sees a call start (its metadata), each request message, each response message, and the
end with the final status code. ``start`` and ``request`` may raise a ``RequestError``: the call
is then refused with the status ``sidecar.edge.status.status_for`` maps it to. Hooks run in list
order; ``end`` runs for every hook whose ``start`` returned, in reverse order, exactly once, and
before the call's answer or its status goes out: a refusal, and a handler's error (``abort``),
end the hooks before they abort the call, as a handler's return does before gRPC sends it.

Wrapping the method handler (rather than only reading ``handler_call_details``) is what lets a
hook read request fields (a knowledge base, a session id) and responses (timings, skips). The
request deserializer is wrapped too: a body that is not the method's message becomes
``Malformed`` rather than an exception inside grpc (UNKNOWN and a traceback), so the hooks start
first (an unauthenticated call gets UNAUTHENTICATED) and the call then ends INVALID_ARGUMENT.
"""

from __future__ import annotations

import asyncio
import inspect
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar, NoReturn

import grpc

from sidecar.edge.status import abort_trailers, caller_message, status_for
from sidecar.edge.wire import EncodedResponse
from sidecar.errors import Draining, InvalidArgument, RequestError
from sidecar.turn.sessions import at_hand

# Health stays callable without a token and under any load: a kubelet probing a busy sidecar
# must see SERVING, not RESOURCE_EXHAUSTED. Its Watch streams are bounded by the servicer itself
# (sidecar/edge/health.py).
EXEMPT_SERVICES = ("/grpc.health.v1.Health/",)

Context = grpc.aio.ServicerContext[Any, Any]
# Read once: a member looked up through its enum class (``grpc.StatusCode.OK``) costs ~0.2 us on
# Python 3.11, and every call's end compares its code with it.
OK = grpc.StatusCode.OK
Trailers = tuple[tuple[str, str], ...]  # an abort's trailing metadata
# A call's metadata entries read and allowed (``sidecar.edge.limits.check_metadata``): 100,000
# empty ones fit in a connection's first stream (gRPC holds later ones to 16 KiB), and each
# lookup of an entry (the call id, the token) walked them all, 150 ms a call. A client sends
# about ten.
MAX_METADATA_ENTRIES = 128


@dataclass(frozen=True, slots=True)
class Malformed:
    """A request body that did not parse as the method's message."""

    size: int  # bytes

    def error(self) -> InvalidArgument:
        return InvalidArgument(
            f"the request body ({self.size} bytes) is not a valid message for this method: "
            "send the message the proto defines"
        )


def _tolerant(deserializer: Callable[[bytes], Any] | None) -> Callable[[bytes], Any] | None:
    """``deserializer``, answering ``Malformed`` for a body it cannot parse."""
    if deserializer is None:
        return None

    def deserialize(data: bytes) -> Any:
        try:
            return deserializer(data)
        except Exception:  # protobuf's DecodeError, or anything a parser raises on garbage
            return Malformed(len(data))

    return deserialize


def metadata_of(context: Context) -> Sequence[tuple[str, Any]]:
    """A call's invocation metadata: a tuple of (key, value) pairs, as grpc.aio gives it on a
    server (its stub says ``Metadata``)."""
    return context.invocation_metadata() or ()  # type: ignore[return-value]


class Hook:
    """Override what a hook needs; every method is called from the event loop."""

    # Whether ``response`` takes an ``EncodedResponse`` (a Search's answer as bytes,
    # sidecar/edge/wire.py) as it is: reading its ``timings``, or passing over a type it does not
    # handle. Otherwise it gets the message, parsed from the bytes once a call for such hooks.
    reads_encoded: ClassVar[bool] = False

    def start(self, call: Call) -> None:
        """Before the handler; raise a RequestError to refuse the call."""

    def request(self, call: Call, message: Any) -> None:
        """For each request message; raise a RequestError to refuse it."""

    def response(self, call: Call, message: Any) -> None:
        """For each response message sent."""

    def end(self, call: Call) -> None:
        """Once, with ``call.code`` final."""


class _WriteWatchingContext:
    """The servicer context, with ``write`` seen by the hooks (Converse writes its answers)."""

    def __init__(self, context: Context, on_write: Callable[[Any], None]) -> None:
        self._context = context
        self._on_write = on_write

    async def write(self, message: Any) -> None:
        await self._context.write(message)
        self._on_write(message)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._context, name)


@dataclass(frozen=True, slots=True)
class Phases:
    """The hooks' methods per phase, only those a hook overrides: a hook that does nothing in a
    phase costs nothing there. Each with the hook's position, for ``end``'s rule."""

    start: tuple[tuple[int, Callable[[Call], None]], ...]
    request: tuple[Callable[[Call, Any], None], ...]
    response: tuple[Callable[[Call, Any], None], ...]
    encoded: tuple[Callable[[Call, Any], None], ...]  # the same, for an EncodedResponse
    end: tuple[tuple[int, Callable[[Call], None]], ...]  # reversed: the last hook's first
    count: int

    @classmethod
    def of(cls, hooks: Sequence[Hook]) -> Phases:
        def overrides(hook: Hook, name: str) -> bool:
            return getattr(type(hook), name) is not getattr(Hook, name)

        return cls(
            start=tuple((i, h.start) for i, h in enumerate(hooks) if overrides(h, "start")),
            request=tuple(h.request for h in hooks if overrides(h, "request")),
            response=tuple(h.response for h in hooks if overrides(h, "response")),
            encoded=tuple(
                h.response if h.reads_encoded else _parsed(h.response)
                for h in hooks
                if overrides(h, "response")
            ),
            end=tuple(
                (i, h.end) for i, h in reversed(list(enumerate(hooks))) if overrides(h, "end")
            ),
            count=len(hooks),
        )


def _parsed(response: Callable[[Call, Any], None]) -> Callable[[Call, Any], None]:
    """A hook's ``response`` that takes a message, given an ``EncodedResponse``'s message."""

    def with_message(call: Call, encoded: EncodedResponse) -> None:
        response(call, encoded.message())

    return with_message


NO_HOOKS = Phases.of(())  # a call's phases made without any (a hook's own unit test)


@dataclass(slots=True, eq=False)
class Call:
    """One call and the hooks around it, on either door: the one object a call makes for them.
    Hooks leave what they learn here for the others (a field each: no dict of its own); its
    metadata is kept as given and read by ``header``; the log context is this record
    (``sidecar.edge.logs``), and so is the connection a lazy load queues by (``peer``). Compared
    and hashed as itself (``eq=False``): a limit holds the calls in flight in a set.

    It runs its hooks (``phases``): ``start`` (all of them, or in two steps with ``until``: the
    HTTP door reads a body between them), ``check`` each request, ``sent`` each response,
    ``end`` once. A refusal sets ``code`` and raises the ``RequestError``."""

    method: str  # "Turn"
    service: str  # "voxrecall.v1.Retrieval"
    # a gRPC call's invocation metadata, (key, value) pairs as grpc gives them (keys in lower
    # case: gRPC allows no other), or the HTTP door's headers
    metadata: dict[str, str] | Sequence[tuple[str, Any]]
    context: Context
    phases: Phases = NO_HOOKS
    # a request stream (Converse, reflection), counted apart from unary calls
    streaming: bool = False
    door: str = "grpc"  # the listener it came in by: "grpc", or "http" (sidecar.http.door)
    task: asyncio.Task[Any] | None = field(default_factory=asyncio.current_task)
    started: float = field(default_factory=time.perf_counter)
    call_id: str = ""
    session_id: str = ""
    caller: Any = None  # the authenticated caller (sidecar.edge.auth), None without auth
    code: grpc.StatusCode = OK
    slot: Any = None  # the pool a concurrency limit counts the call in (sidecar.edge.limits)
    tally: Any = None  # what the metrics count its door's method in (sidecar.edge.metrics)
    cut: str = ""  # set with the task cancelled: the drain's grace ended; the call ends UNAVAILABLE
    begun: int = 0  # hooks whose start returned: those before this position

    def cut_off(self, reason: str) -> None:
        """End this call from outside (the drain, when its grace ends): UNAVAILABLE, which a
        client retries on another instance, where a plain cancel would answer CANCELLED."""
        self.cut = reason
        if self.task is not None:
            self.task.cancel()

    def elapsed_s(self) -> float:
        return time.perf_counter() - self.started

    def answer_held(self) -> bool:
        """Whether, its handler over, the call's answer is still held for its client to read:
        never for a call whose door writes its answer itself (HTTP)."""
        return False

    def peer(self) -> str:
        """The address the call came from (grpc's form: ``ipv4:127.0.0.1:5000``)."""
        return self.context.peer()

    def header(self, name: str) -> str:
        """The text of metadata entry ``name`` (lower case; the last one sent when it is sent
        twice), "" when there is none: found where a hook asks (the call id, the token), where
        a dict of every entry was made for every call."""
        metadata = self.metadata
        if isinstance(metadata, dict):
            return metadata.get(name, "")
        found = ""
        for key, value in metadata[:MAX_METADATA_ENTRIES]:  # past them, refused (FieldLimits)
            if key == name and type(value) is str:  # a "-bin" entry's value is bytes
                found = value
        return found

    def header_count(self, name: str) -> int:
        """How many entries ``name`` the call sent (an HTTP call's headers, one at most: the
        door refuses a second Authorization)."""
        metadata = self.metadata
        if isinstance(metadata, dict):
            return int(name in metadata)
        return sum(key == name for key, _ in metadata[:MAX_METADATA_ENTRIES])

    # -- the hooks around it --------------------------------------------------------------------

    def start(self, until: int | None = None) -> None:
        """Every hook's ``start`` from where the last step stopped, up to position ``until``
        (the end by default)."""
        first = self.begun
        stop = self.phases.count if until is None else until
        try:
            if first == 0 and until is None:  # a gRPC call: every hook in one pass, unchecked
                for i, start in self.phases.start:
                    self.begun = i  # the hooks before this one have started, whatever it raises
                    start(self)
            else:
                for i, start in self.phases.start:
                    if first <= i < stop:
                        self.begun = i
                        start(self)
        except RequestError as exc:
            self.refused(exc)
        if stop > self.begun:
            self.begun = stop

    def check(self, message: Any) -> None:
        try:
            if isinstance(message, Malformed):
                raise message.error()
            for request in self.phases.request:
                request(self, message)
        except RequestError as exc:
            self.refused(exc)

    def sent(self, message: Any) -> None:
        phases = self.phases
        hooks = phases.encoded if type(message) is EncodedResponse else phases.response
        for response in hooks:
            response(self, message)

    def end(self) -> None:
        """Every started hook's ``end``, with ``code`` final; once."""
        begun = self.begun
        self.begun = 0
        if begun == self.phases.count:  # every hook started (nearly every call): no check
            for _, end in self.phases.end:
                end(self)
            return
        for i, end in self.phases.end:
            if i < begun:
                end(self)

    def refused(self, exc: RequestError) -> NoReturn:
        """The call's code is the refusal's; ``exc`` goes on up."""
        self.code = status_for(exc)
        raise exc


class _HookedCall(Call):
    """A gRPC call and the hooks around it: a refusal aborts the call with its status."""

    __slots__ = ()

    def prepare(self, arg: Any, *, stream_in: bool) -> Any:
        """Start the hooks, and check the request (or each one of a request stream as it
        comes): the handler's argument. A refusal raises its ``RequestError`` (``refuse``)."""
        self.start()
        if stream_in:
            return _checked(arg, self)
        self.check(arg)
        return arg

    def answer_held(self) -> bool:
        """gRPC sends the answer (and the status) after the handler returns, and holds it while
        the client's flow-control window has no room for it: until then the call is not done."""
        return not self.context.done()

    async def refuse(self, exc: RequestError) -> NoReturn:
        context = self.context
        await self.abort(self.code, caller_message(exc), abort_trailers(context, exc), context)

    async def abort(
        self, code: grpc.StatusCode, details: str, trailers: Trailers, context: Any = None
    ) -> NoReturn:
        """End the call with status ``code``: every started hook's ``end`` first, as before a
        handler's answer goes out (so the limit holds the call's slot apart until gRPC is done
        with it, ``ConcurrencyLimit.end``: its client, told of the failure, may call again at
        once), then the status goes out through ``context`` (the handler's; the call's own by
        default)."""
        self.code = code
        self.end()
        await (context or self.context).abort(code, details, trailing_metadata=trailers)
        raise AssertionError("unreachable: abort raises")

    async def __aenter__(self) -> _HookedCall:
        return self

    async def __aexit__(self, kind: Any, exc: BaseException | None, tb: Any) -> None:
        await self.close(exc)

    async def close(self, exc: BaseException | None) -> None:
        """The one end of every kind of call: a call cut off by the drain (``Call.cut_off``)
        aborts UNAVAILABLE here (AbortError); then every started hook's ``end``, whatever
        happened."""
        try:
            # (a call aborted already, its code set, has nothing left to end: gRPC refuses a
            # second abort, and the sweep may cut a call whose abort waits behind its answers)
            cut = isinstance(exc, asyncio.CancelledError) and self.cut
            if cut and self.code is OK and not self.context.done():
                context = self.context  # a pushback of -1: not retried on this sidecar
                trailers = abort_trailers(context, Draining(self.cut))
                await self.abort(grpc.StatusCode.UNAVAILABLE, self.cut, trailers)
        finally:
            self.finish(exc)

    def finish(self, exc: BaseException | None) -> None:
        if exc is None:
            self.code = _code_of(self.context) or OK
        elif self.code is OK:
            self.code = _code_of(self.context) or _code_for(exc, self.context)
        self.end()


async def abort(
    context: Context, code: grpc.StatusCode, details: str, trailers: Trailers = ()
) -> NoReturn:
    """``context.abort`` for a handler: the call at hand (``sessions.at_hand``, which ``CallLog``
    sets as the call starts), if it is a hooked gRPC call, ends first (``_HookedCall.abort``),
    so its status goes out only once its slot is held apart, as an answer does."""
    call = at_hand.get()
    if isinstance(call, _HookedCall):
        await call.abort(code, details, trailers, context)
    else:  # no hooks around it (a servicer served without them)
        await context.abort(code, details, trailing_metadata=trailers)
    raise AssertionError("unreachable: abort raises")


def _code_of(context: Context) -> grpc.StatusCode | None:
    code = context.code()
    if isinstance(code, grpc.StatusCode):
        return code
    return None


def _code_for(exc: BaseException, context: Context) -> grpc.StatusCode:
    if isinstance(exc, asyncio.CancelledError):
        remaining = context.time_remaining()
        if remaining is not None and remaining <= 0:
            return grpc.StatusCode.DEADLINE_EXCEEDED
        return grpc.StatusCode.CANCELLED
    return grpc.StatusCode.UNKNOWN  # what grpc answers for an exception no handler mapped


class HookInterceptor(grpc.aio.ServerInterceptor):  # type: ignore[type-arg]
    """Wraps every non-exempt method handler so ``hooks`` run around it."""

    def __init__(self, hooks: Sequence[Hook]) -> None:
        self.hooks = tuple(hooks)
        self._phases = Phases.of(self.hooks)
        # method -> (its handler, the wrapped one): built once, not on every call
        self._wrapped: dict[str, tuple[Any, grpc.RpcMethodHandler]] = {}  # type: ignore[type-arg]

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],  # type: ignore[type-arg]
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:  # type: ignore[type-arg]
        handler = await continuation(handler_call_details)
        method: str = handler_call_details.method
        if handler is None or method.startswith(EXEMPT_SERVICES) or not self.hooks:
            return handler
        cached = self._wrapped.get(method)
        if cached is not None and cached[0] is handler:
            return cached[1]
        service, _, name = method.lstrip("/").partition("/")
        phases = self._phases

        def new_hooked_call(context: Context, streaming: bool) -> _HookedCall:
            return _HookedCall(name, service, metadata_of(context), context, phases, streaming)

        wrapped = _wrap(handler, new_hooked_call)
        self._wrapped[method] = (handler, wrapped)
        return wrapped


NewHookedCall = Callable[[Context, bool], _HookedCall]


def _wrap(handler: Any, new_hooked_call: NewHookedCall) -> grpc.RpcMethodHandler:  # type: ignore[type-arg]
    kwargs = {
        "request_deserializer": _tolerant(handler.request_deserializer),
        "response_serializer": handler.response_serializer,
    }
    if handler.unary_unary:
        return grpc.unary_unary_rpc_method_handler(
            _single(handler.unary_unary, new_hooked_call, stream_in=False), **kwargs
        )
    if handler.unary_stream:
        return grpc.unary_stream_rpc_method_handler(
            _streaming(handler.unary_stream, new_hooked_call, stream_in=False), **kwargs
        )
    if handler.stream_unary:
        return grpc.stream_unary_rpc_method_handler(
            _single(handler.stream_unary, new_hooked_call, stream_in=True), **kwargs
        )
    return grpc.stream_stream_rpc_method_handler(
        _streaming(handler.stream_stream, new_hooked_call, stream_in=True), **kwargs
    )


async def _checked(requests: AsyncIterator[Any], run: _HookedCall) -> AsyncIterator[Any]:
    async for message in requests:
        run.check(message)  # a refusal inside a request stream reaches the handler, which maps it
        yield message


async def _prepare(run: _HookedCall, arg: Any, *, stream_in: bool) -> Any:
    """``run.prepare``, a refusal aborting the call with its status."""
    try:
        return run.prepare(arg, stream_in=stream_in)
    except RequestError as exc:
        await run.refuse(exc)


def _single(inner: Any, new_hooked_call: NewHookedCall, *, stream_in: bool) -> Any:
    """A behaviour with one response (unary-unary, stream-unary), with the hooks around it:
    what ``async with run`` does, spelled out (every call takes this way, and the context
    manager's and ``_prepare``'s coroutines cost more than the rest of the wrapping)."""

    async def behaviour(arg: Any, context: Context) -> Any:
        run = new_hooked_call(context, stream_in)
        try:
            try:
                arg = run.prepare(arg, stream_in=stream_in)
            except RequestError as exc:
                await run.refuse(exc)
            response = await inner(arg, context)
            run.sent(response)
        except BaseException as exc:
            await run.close(exc)
            raise
        run.finish(None)
        return response

    return behaviour


def _streaming(inner: Any, new_hooked_call: NewHookedCall, *, stream_in: bool) -> Any:
    """A response-streaming behaviour, as an async generator or a coroutine like ``inner``."""

    if inspect.isasyncgenfunction(inner):

        async def generator(arg: Any, context: Context) -> AsyncIterator[Any]:
            async with new_hooked_call(context, stream_in) as run:
                async for response in inner(await _prepare(run, arg, stream_in=stream_in), context):
                    run.sent(response)
                    yield response

        return generator

    async def coroutine(arg: Any, context: Context) -> None:
        async with new_hooked_call(context, stream_in) as run:
            await inner(
                await _prepare(run, arg, stream_in=stream_in),
                _WriteWatchingContext(context, run.sent),
            )

    return coroutine
