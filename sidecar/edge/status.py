"""The one place where every voxrecall error becomes a status: gRPC for the servicer and the
interceptor, HTTP for the HTTP door, from the same table.

    error (most specific first)    gRPC status          HTTP
    BodyTooLarge                   RESOURCE_EXHAUSTED   413  (as gRPC's own, for a message too large)
    BodyEncoded                    INVALID_ARGUMENT     415  (a gzip body: sent uncompressed)
    InvalidArgument                INVALID_ARGUMENT     400
    NotFound                       NOT_FOUND            404
    Unavailable (and RetryLater)   UNAVAILABLE          503  (+ grpc-retry-pushback-ms; -1 for
                                                              Draining: not retried)
    ResourceExhausted              RESOURCE_EXHAUSTED   429
    IdleTimeout                    DEADLINE_EXCEEDED    408  (a client that stopped sending)
    Unauthenticated                UNAUTHENTICATED      401
    SnapshotNotFound               UNAVAILABLE          503  (the message says what to run; + a
                                                              pushback of -1: not retried)
    EmbedderError                  UNAVAILABLE          503  (only where no fallback answered)
    SnapshotError                  INTERNAL             500
    anything else                  INTERNAL             500  (ConfigError, SourceError: our fault)
    any other exception            INTERNAL             500  (a bug: ``internal_message``, the
                                                              traceback in the log; grpc itself
                                                              would answer UNKNOWN with its text)

Handlers raise; ``status_for`` maps; the servicer aborts with the mapped code and the message,
cut to ``MAX_STATUS_MESSAGE_BYTES`` (``status_message``), so a status always reaches its caller.
No handler builds a status code itself. The HTTP codes are those grpc-gateway gives each gRPC
code, except an over-long body's 413 and an encoded body's 415.
"""

from __future__ import annotations

from typing import Any

import grpc

from index.errors import EmbedderError, SnapshotError, SnapshotNotFound, VoxrecallError, shortened
from sidecar.errors import (
    BodyEncoded,
    BodyTooLarge,
    Draining,
    IdleTimeout,
    InvalidArgument,
    NotFound,
    ResourceExhausted,
    RetryLater,
    Unauthenticated,
    Unavailable,
)

Code = grpc.StatusCode
Context = grpc.aio.ServicerContext[Any, Any]
PUSHBACK = "grpc-retry-pushback-ms"  # gRFC A6: when a retry policy may try again, in ms
NO_RETRY = "-1"  # a negative pushback: a retry policy does not try again
# A retry hint is sent only when the retry it asks for comes this long before the call's deadline
# (a round trip and a turn's answer): a client's retry policy waits out a hint even past its
# deadline, and the caller got DEADLINE_EXCEEDED at its deadline instead of the refusal's message.
RETRY_MARGIN_S = 0.1
# A status message at most, in bytes: it travels in the trailing metadata (grpc-message,
# percent-encoded: up to three bytes a byte), which a client refuses whole past 16 KiB
# (RESOURCE_EXHAUSTED "metadata size exceeds hard limit" instead of the status sent). A message
# that names a base, a cause and what to do fits many times over; more is cut and marked.
MAX_STATUS_MESSAGE_BYTES = 2048

_STATUS: tuple[tuple[type[VoxrecallError], grpc.StatusCode, int], ...] = (
    (BodyTooLarge, Code.RESOURCE_EXHAUSTED, 413),
    (BodyEncoded, Code.INVALID_ARGUMENT, 415),
    (InvalidArgument, Code.INVALID_ARGUMENT, 400),
    (NotFound, Code.NOT_FOUND, 404),
    (Unavailable, Code.UNAVAILABLE, 503),
    (ResourceExhausted, Code.RESOURCE_EXHAUSTED, 429),
    (IdleTimeout, Code.DEADLINE_EXCEEDED, 408),
    (Unauthenticated, Code.UNAUTHENTICATED, 401),
    (SnapshotNotFound, Code.UNAVAILABLE, 503),
    (EmbedderError, Code.UNAVAILABLE, 503),
    (SnapshotError, Code.INTERNAL, 500),
)
_INTERNAL = (Code.INTERNAL, 500)


def _row(error: Exception) -> tuple[grpc.StatusCode, int]:
    for cls, code, http in _STATUS:
        if isinstance(error, cls):
            return code, http
    return _INTERNAL


def status_for(error: Exception) -> grpc.StatusCode:
    """The gRPC status code for one of our errors (the most specific class listed wins); any
    other exception is a fault of ours, INTERNAL."""
    return _row(error)[0]


def http_status_for(error: Exception) -> int:
    """The HTTP status for an error, from the same row as its gRPC code."""
    return _row(error)[1]


def internal_message(error: Exception) -> str:
    """What a caller reads for an exception that is none of ours: its kind, not its text (which
    may hold a path or a value of the server's); the log has the traceback."""
    return f"internal error ({type(error).__name__}): the sidecar's log has the details"


def caller_message(error: VoxrecallError) -> str:
    """What a caller reads for one of our errors: its text, but for an INTERNAL one (a snapshot
    that cannot be read, a graph that cannot answer) its kind only: that text names the server's
    own files, which the log has beside the error."""
    if status_for(error) is Code.INTERNAL:
        return internal_message(error)
    return status_message(str(error))


def status_message(text: str) -> str:
    """A status message as sent: cut to ``MAX_STATUS_MESSAGE_BYTES``, the cut marked."""
    return shortened(text, MAX_STATUS_MESSAGE_BYTES)


def code_of_http_status(status: int) -> grpc.StatusCode:
    """The gRPC code of an HTTP status someone else answered with (the MCP SDK's own refusals),
    read back from the table: another 4xx is INVALID_ARGUMENT, a 5xx INTERNAL."""
    for _cls, code, http in _STATUS:
        if http == status and code is not Code.INTERNAL:
            return code
    return Code.INVALID_ARGUMENT if status < 500 else Code.INTERNAL


# A refused tool call the model can act on (change its arguments, ask for what exists, try again
# later): its error output's type says so (``invalid_arguments``, as the sidecar's own tool path
# names arguments it refuses, ``not_found``, ``resource_exhausted``). Any other (the sidecar
# down, a token refused, a fault of ours) is ``unavailable``: the model can only tell the caller.
_MODEL_TYPES = {
    Code.INVALID_ARGUMENT: "invalid_arguments",
    Code.NOT_FOUND: "not_found",
    Code.RESOURCE_EXHAUSTED: "resource_exhausted",
}
UNAVAILABLE_TYPE = "unavailable"


def tool_error_type(code: grpc.StatusCode) -> str:
    """The ``{"error": {"type"}}`` a model reads for a tool call refused with ``code``: the same
    on MCP (``sidecar.http.mcp``) and in the adapters (``sidecar.adapters.client.call_tool``)."""
    return _MODEL_TYPES.get(code, UNAVAILABLE_TYPE)


def trailers_for(
    error: VoxrecallError, time_left_s: float | None = None
) -> tuple[tuple[str, str], ...]:
    """Trailing metadata sent with the status: the retry hint of a base that is loading (or whose
    pointer is read again at the next poll: ``RetryLater``), when the retry fits in the call's ``time_left_s`` (``retry_hint``); for a base with no snapshot or a
    sidecar draining, a negative one, which tells a gRPC retry policy not to retry (gRFC A6):
    no snapshot comes within a call's deadline, a draining sidecar answers every attempt alike,
    and retrying would spend the caller's turn before it goes to another instance."""
    if isinstance(error, RetryLater):
        return ((PUSHBACK, retry_hint(error.retry_ms, time_left_s)),)
    if isinstance(error, SnapshotNotFound | Draining):
        return ((PUSHBACK, NO_RETRY),)
    return ()


def retry_hint(retry_ms: int, time_left_s: float | None) -> str:
    """The pushback for a retry ``retry_ms`` away: itself while it comes ``RETRY_MARGIN_S``
    before the call's deadline (or the call has none), else -1, so that the caller reads the
    refusal (whose message says when to ask again) at once rather than at its deadline."""
    if time_left_s is None or retry_ms / 1000 < time_left_s - RETRY_MARGIN_S:
        return str(retry_ms)
    return NO_RETRY


def abort_trailers(context: Context, error: VoxrecallError) -> tuple[tuple[str, str], ...]:
    """The error's trailers (``trailers_for``, within the call's time left) after those the hooks
    set (the call id): trailers given to ``abort`` replace those set before, and every answer
    carries its call id. Empty when the error has none of its own: ``abort`` keeps those set."""
    own = trailers_for(error, context.time_remaining())
    return (*(context.trailing_metadata() or ()), *own) if own else ()
