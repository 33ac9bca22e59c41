"""Request errors, and the one place where every voxrecall error becomes a gRPC status.

    VoxrecallError (index.errors)
    ├── ConfigError, SourceError          -> INTERNAL (a server-side fault)
    ├── EmbedderError                     -> UNAVAILABLE (only where no fallback could answer)
    ├── SnapshotError
    │   └── SnapshotNotFound               -> UNAVAILABLE, the message says what to run
    └── RequestError
        ├── InvalidArgument                -> INVALID_ARGUMENT
        │   └── BodyTooLarge               -> INVALID_ARGUMENT (HTTP 413: over max_body_bytes)
        │   └── FilterRefused              a filter or path the snapshot cannot apply (a
        │                                  knowledge tool answers it as an error output)
        ├── NotFound                       -> NOT_FOUND
        ├── Unavailable                    -> UNAVAILABLE
        │   └── Loading                     -> UNAVAILABLE + grpc-retry-pushback-ms (a base loading)
        ├── ResourceExhausted              -> RESOURCE_EXHAUSTED
        ├── IdleTimeout                    -> DEADLINE_EXCEEDED (a stream sent nothing too long)
        ├── Unauthenticated                -> UNAUTHENTICATED
        └── PermissionDenied               -> PERMISSION_DENIED

Handlers raise; ``status_for`` maps; the servicer aborts with the mapped code and the message.
No handler builds a status code itself. The HTTP door (``sidecar.http_door``) answers the same
errors with ``http_status_for``: the HTTP status of the gRPC code ``status_for`` gives.
"""

from __future__ import annotations

import grpc

from index.errors import (
    EmbedderError,
    SnapshotError,
    SnapshotNotFound,
    VoxrecallError,
)


class RequestError(VoxrecallError):
    """A call that cannot be answered as asked; the message tells the caller what to change."""


class InvalidArgument(RequestError):
    pass


class BodyTooLarge(InvalidArgument):
    """An HTTP request body over ``[sidecar.http] max_body_bytes``."""


class FilterRefused(InvalidArgument):
    """Filters or source_paths that cannot be applied: too many, empty, or on a field the
    serving snapshot did not index."""


class NotFound(RequestError):
    pass


class Unavailable(RequestError):
    pass


class Loading(Unavailable):
    """A base is being loaded for this call (``[sidecar] memory_budget_mb``): retry after
    ``retry_ms``, which the status carries as ``grpc-retry-pushback-ms`` for clients that
    retry by policy."""

    def __init__(self, message: str, retry_ms: int) -> None:
        super().__init__(message)
        self.retry_ms = retry_ms


class ResourceExhausted(RequestError):
    pass


class IdleTimeout(RequestError):
    """A stream that sent nothing for too long; the caller opens a new one when it has more."""


class Unauthenticated(RequestError):
    pass


class PermissionDenied(RequestError):
    pass


_STATUS: tuple[tuple[type[VoxrecallError], grpc.StatusCode], ...] = (
    (InvalidArgument, grpc.StatusCode.INVALID_ARGUMENT),
    (NotFound, grpc.StatusCode.NOT_FOUND),
    (Unavailable, grpc.StatusCode.UNAVAILABLE),
    (ResourceExhausted, grpc.StatusCode.RESOURCE_EXHAUSTED),
    (IdleTimeout, grpc.StatusCode.DEADLINE_EXCEEDED),
    (Unauthenticated, grpc.StatusCode.UNAUTHENTICATED),
    (PermissionDenied, grpc.StatusCode.PERMISSION_DENIED),
    (SnapshotNotFound, grpc.StatusCode.UNAVAILABLE),
    (EmbedderError, grpc.StatusCode.UNAVAILABLE),
    (SnapshotError, grpc.StatusCode.INTERNAL),
)


def trailers_for(error: VoxrecallError) -> tuple[tuple[str, str], ...]:
    """Trailing metadata sent with the status: the retry hint of a base that is loading."""
    if isinstance(error, Loading):
        return (("grpc-retry-pushback-ms", str(error.retry_ms)),)
    return ()


def status_for(error: VoxrecallError) -> grpc.StatusCode:
    """The gRPC status code for one of our errors (the most specific class listed wins)."""
    for cls, code in _STATUS:
        if isinstance(error, cls):
            return code
    return grpc.StatusCode.INTERNAL


# The HTTP status of each gRPC code (as grpc-gateway maps them); anything else is 500.
_HTTP_STATUS = {
    grpc.StatusCode.INVALID_ARGUMENT: 400,
    grpc.StatusCode.NOT_FOUND: 404,
    grpc.StatusCode.UNAVAILABLE: 503,
    grpc.StatusCode.RESOURCE_EXHAUSTED: 429,
    grpc.StatusCode.DEADLINE_EXCEEDED: 408,  # our only one: a client that stopped sending
    grpc.StatusCode.UNAUTHENTICATED: 401,
    grpc.StatusCode.PERMISSION_DENIED: 403,
}


def http_status_for(error: VoxrecallError) -> int:
    """The HTTP status for one of our errors: that of the gRPC code ``status_for`` maps it to."""
    if isinstance(error, BodyTooLarge):
        return 413
    return _HTTP_STATUS.get(status_for(error), 500)
