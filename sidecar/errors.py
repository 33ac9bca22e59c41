"""Request errors, and the one place where every voxrecall error becomes a gRPC status.

    VoxrecallError (index.errors)
    ├── ConfigError, SourceError          -> INTERNAL (a server-side fault)
    ├── EmbedderError                     -> UNAVAILABLE (only where no fallback could answer)
    ├── SnapshotError
    │   └── SnapshotNotFound               -> UNAVAILABLE, the message says what to run
    └── RequestError
        ├── InvalidArgument                -> INVALID_ARGUMENT
        │   └── FilterRefused              a filter or path the snapshot cannot apply (a
        │                                  knowledge tool answers it as an error output)
        ├── NotFound                       -> NOT_FOUND
        ├── Unavailable                    -> UNAVAILABLE
        ├── ResourceExhausted              -> RESOURCE_EXHAUSTED
        ├── IdleTimeout                    -> DEADLINE_EXCEEDED (a stream sent nothing too long)
        ├── Unauthenticated                -> UNAUTHENTICATED
        └── PermissionDenied               -> PERMISSION_DENIED

Handlers raise; ``status_for`` maps; the servicer aborts with the mapped code and the message.
No handler builds a status code itself.
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


class FilterRefused(InvalidArgument):
    """Filters or source_paths that cannot be applied: too many, empty, or on a field the
    serving snapshot did not index."""


class NotFound(RequestError):
    pass


class Unavailable(RequestError):
    pass


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


def status_for(error: VoxrecallError) -> grpc.StatusCode:
    """The gRPC status code for one of our errors (the most specific class listed wins)."""
    for cls, code in _STATUS:
        if isinstance(error, cls):
            return code
    return grpc.StatusCode.INTERNAL
