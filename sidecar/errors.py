"""The errors of a call: its input or its state. The request branch of the one tree that
``index.errors`` draws; every class here is plain Python (no gRPC), so the turn engine can raise
them and stay free of any transport.

    RequestError
    ├── InvalidArgument        the request is malformed; the message says what to change
    │   ├── BodyEncoded        an HTTP body sent with a Content-Encoding (gzip, ...)
    │   ├── FilterRefused      a filter or path the serving snapshot cannot apply
    │   └── ToolCallError      a model called a knowledge function wrongly (an error output)
    ├── NotFound
    ├── Unavailable
    │   ├── RetryLater         not now, for a while: retry after ``retry_ms``
    │   │   └── Loading        a base is loading for this call
    │   └── Draining           the sidecar is shutting down: retry on another instance
    ├── ResourceExhausted
    │   └── BodyTooLarge       an HTTP body over [sidecar.http] max_body_bytes (413)
    ├── IdleTimeout            a stream sent nothing for too long
    └── Unauthenticated        (a name outside a token's scope is NotFound: nothing is learnt)

Handlers raise; ``sidecar.edge.status`` maps each class to its gRPC and HTTP status in one table.
"""

from __future__ import annotations

from index.errors import VoxrecallError


class RequestError(VoxrecallError):
    """A call that cannot be answered as asked; the message tells the caller what to change."""


class InvalidArgument(RequestError):
    pass


class BodyEncoded(InvalidArgument):
    """An HTTP request body sent with a ``Content-Encoding`` other than identity: the door never
    inflates one (a small gzip may inflate to any size), and its bytes are not JSON."""


class FilterRefused(InvalidArgument):
    """Filters or source_paths that cannot be applied: too many, empty, or on a field the
    serving snapshot did not index."""


class ToolCallError(InvalidArgument):
    """A call the model made wrongly; a knowledge function answers it as an error output of
    ``type`` (``invalid_arguments``, ...), never as a status code."""

    def __init__(self, type_: str, message: str) -> None:
        super().__init__(message)
        self.type = type_
        self.message = message


class NotFound(RequestError):
    pass


class Unavailable(RequestError):
    pass


class RetryLater(Unavailable):
    """Not now, and not for a while: retry after ``retry_ms``, which the status carries as
    ``grpc-retry-pushback-ms`` for clients that retry by policy (a base whose pointer the store
    could not give, read again at the next poll)."""

    def __init__(self, message: str, retry_ms: int) -> None:
        super().__init__(message)
        self.retry_ms = retry_ms


class Loading(RetryLater):
    """A base is being loaded for this call (``[sidecar] memory_budget_mb``): retry after
    ``retry_ms``."""


class Draining(Unavailable):
    """The sidecar is shutting down: a new call goes to another instance, not here again (its
    status carries a ``grpc-retry-pushback-ms`` of -1: a retry policy does not retry it)."""


class ResourceExhausted(RequestError):
    pass


class BodyTooLarge(ResourceExhausted):
    """An HTTP request body over ``[sidecar.http] max_body_bytes``: RESOURCE_EXHAUSTED, as
    gRPC answers a message over its size, with HTTP's own 413."""


class IdleTimeout(RequestError):
    """A stream that sent nothing for too long; the caller opens a new one when it has more."""


class Unauthenticated(RequestError):
    """``challenge``: what the HTTP door's 401 sends as ``WWW-Authenticate``, naming what the
    caller must send (the bearer token, unless a header of a platform's is what was wrong)."""

    def __init__(self, message: str, challenge: str = "Bearer") -> None:
        super().__init__(message)
        self.challenge = challenge
