"""Structured logs: one JSON object a line, with the session id and call id of the call at hand.

    logs.configure(level="INFO", fmt="json", secrets=[token, api_key])   # once, in the entry point
    server = grpc.aio.server(interceptors=[HookInterceptor([CallLog(), ...])])

``CallLog`` gives every call an id (the caller's ``x-call-id`` metadata when it sends a usable
one, else a fresh one, returned in the trailing metadata) and puts the call's record in a
context variable (``current``, one set a call), so every log line written while the call runs
carries its ids and its session id, in the engine as in the service. Any configured secret of ``MIN_SECRET_CHARS`` or more that finds its way into a
line is replaced by ``[redacted]`` in each field before the field is cut or encoded
(``clean``), so neither JSON's escaping of a ``"`` in it nor a cut through it lets it out (a
shorter one, vLLM's customary key ``EMPTY`` or an ``x``, is no secret, and replacing it in every
word would garble every line and tell the reader the key). Every field of a line (the message, each extra, a traceback) is
cut to ``MAX_FIELD_BYTES`` (``bounded``), and the call's ids to ``MAX_ID_BYTES`` (a session id
the field limits refuse is logged on the line of its refusal), so no input makes a line large.

A call's end is logged at DEBUG, a failed call's at INFO; at most ``FAILURE_LINES`` such lines a
``FAILURE_WINDOW_S`` per client address, method and code, the first ones, and one line saying how
many more there were (``FailureLines``): a client sending refused calls in a loop cannot make the
log grow with its call rate. The HTTP client libraries' own line per request (``httpx``'s "HTTP
Request: POST ...", one per embedding) is left out below WARNING (``QUIET_LOGGERS``). gRPC's own
ERROR line, with a traceback of its internals, for each call whose answer it could not send (its
client cancelled the call or closed its connection while the answer was held) is one failed call's
line like the others: at INFO, without the traceback, as many a window (``CoreBatchErrors``).
"""

from __future__ import annotations

import asyncio
import contextvars
import errno
import logging
import re
import sys
from collections.abc import Iterable
from dataclasses import dataclass
from datetime import UTC, datetime
from random import getrandbits as _random_bits
from time import monotonic
from typing import Any, TextIO, cast

import orjson

from sidecar.edge.addresses import peer_key
from sidecar.edge.interceptor import OK, Call, Hook
from sidecar.gen import retrieval_pb2 as pb
from sidecar.turn.sessions import at_hand

# The call at hand, whose ids every line written while it runs carries: one variable set once a
# call (its session id, learnt from the request, and its method, renamed by an MCP body, are read
# from the record as the line is written). The turn layer's own (``sessions.at_hand``, where a
# lazy load reads the call's connection): one variable, one set a call.
current = cast("contextvars.ContextVar[Call | None]", at_hand)

CALL_ID_HEADER = "x-call-id"
# A caller's own id is kept only when it is short and plain, so it cannot forge log lines.
_CALL_ID = re.compile(r"[A-Za-z0-9._:-]{1,64}")
REDACTED = "[redacted]"
# A log line's message or field: a sentence with a few quoted values fits many times over; more
# is a caller's input echoed back, and a line per call of it would flood the log.
MAX_FIELD_BYTES = 4096
MAX_TRACEBACK_BYTES = 16 * 1024  # a deep traceback is still worth reading whole
# A call's ids on every line of it: a session id may be 1 KiB (sidecar.edge.limits), or anything
# on the line refusing it; its first bytes and its length say which session it was.
MAX_ID_BYTES = 128
# A secret shorter than this is no secret (bearer tokens need MIN_TOKEN_CHARS, 16; an API key
# of "EMPTY" or "x" is a placeholder), and scrubbing it as a substring garbles every line.
MIN_SECRET_CHARS = 8
# Failed calls' lines per client address, method and code in a window: the first few of a kind say
# all there is to say; a client failing in a loop wrote 1,980 lines (2.4 MB) a second.
FAILURE_LINES = 10
FAILURE_WINDOW_S = 1.0
# Kinds a window tells apart: past them, a new client's failures count as "other clients" (a
# flood from 65,536 /64s of one /48 wrote a line each; s13's second attack, L1).
FAILURE_KINDS = 100
OTHER_CLIENTS = "other clients"
# Libraries that log a line per HTTP request at INFO (the OpenAI client's httpx, the reranker's):
# kept at WARNING, or a sidecar at 100 turns/s writes 100 lines a second about its embedder.
QUIET_LOGGERS = ("httpx", "httpx2", "httpcore", "httpcore2")
# A record's own attributes, and what a library attaches for its terminal alone (uvicorn's
# ``color_message``: the message again, in ANSI colour codes): neither is an extra of the line.
_RECORD_FIELDS = frozenset(vars(logging.makeLogRecord({}))) | {"color_message"}
# gRPC's logger, and the start of its line for an answer it could not send (grpcio's aio server:
# "ExecuteBatchError raised in core by servicer method [/voxrecall.v1.Retrieval/Search]").
GRPC_CORE_LOGGER = "grpc._cython.cygrpc"
_BATCH_ERROR = "ExecuteBatchError raised in core by servicer method ["
NOT_SENT = "ANSWER_NOT_SENT"  # the code such a line is counted under
_BATCH_FAILED = 'Failed "execute_batch"'  # the error of a batch that ran and failed
ALL_CLIENTS = "all clients"  # gRPC's line names no client: its lines are counted as one's

log = logging.getLogger("voxrecall.calls")


class JsonFormatter(logging.Formatter):
    """``{"ts", "level", "logger", "msg", "session_id", "call_id", "method", "door", ...}`` a
    line (``door``: the listener the call came in by, grpc or http)."""

    def __init__(self, secrets: Iterable[str] = ()) -> None:
        super().__init__()
        self.secrets = worth_scrubbing(secrets)

    def format(self, record: logging.LogRecord) -> str:
        line: dict[str, Any] = {
            "ts": datetime.fromtimestamp(record.created, UTC).isoformat(timespec="milliseconds"),
            "level": record.levelname,
            "logger": record.name,
            "msg": clean(record.getMessage(), self.secrets),
        }
        line.update(context_ids(self.secrets))
        for key, value in vars(record).items():
            if key not in _RECORD_FIELDS and not key.startswith("_"):
                line[key] = _field(value, self.secrets)  # extra={...}
        if record.exc_info:
            exc = self.formatException(record.exc_info)
            line["exc"] = clean(exc, self.secrets, MAX_TRACEBACK_BYTES)
        return orjson.dumps(line, default=str).decode()


class TextFormatter(logging.Formatter):
    """The plain format, with the call's ids appended when there are some."""

    def __init__(self, secrets: Iterable[str] = ()) -> None:
        super().__init__("%(asctime)s %(levelname)s %(name)s: %(message)s")
        self.secrets = worth_scrubbing(secrets)

    def format(self, record: logging.LogRecord) -> str:
        record = logging.makeLogRecord(
            {**vars(record), "msg": clean(record.getMessage(), self.secrets), "args": None}
        )
        if record.exc_info and not record.exc_text:
            record.exc_text = self.formatException(record.exc_info)
        if record.exc_text:
            record.exc_text = clean(record.exc_text, self.secrets, MAX_TRACEBACK_BYTES)
        if record.stack_info:
            record.stack_info = clean(record.stack_info, self.secrets, MAX_TRACEBACK_BYTES)
        text = super().format(record)
        context = context_ids(self.secrets)
        ids = [f"{k}={context[f'{k}_id']}" for k in ("session", "call") if f"{k}_id" in context]
        return f"{text} [{' '.join(ids)}]" if ids else text


def context_ids(secrets: tuple[str, ...] = ()) -> dict[str, str]:
    """The current call's ids as a line carries them, each cut to ``MAX_ID_BYTES``: the one place
    a caller's own strings reach a line outside its message and extras."""
    call = current.get()
    if call is None:
        return {}
    ids = (
        ("session_id", call.session_id),
        ("call_id", call.call_id),
        ("method", call.method),
        ("door", call.door),
    )
    return {key: clean(value, secrets, MAX_ID_BYTES) for key, value in ids if value}


def clean(text: str, secrets: tuple[str, ...], limit: int = MAX_FIELD_BYTES) -> str:
    """A field of a line as it is written: scrubbed of ``secrets``, then cut to ``limit``. In
    this order, and on the field rather than the line: a cut secret's head no longer matches it,
    nor does a secret holding ``"`` or ``\\`` once JSON has escaped it."""
    return bounded(scrub(text, secrets), limit)


def bounded(text: str, limit: int = MAX_FIELD_BYTES) -> str:
    """``text``, cut to at most ``limit`` bytes of UTF-8 (and a note of the cut) when longer."""
    if len(text) * 4 <= limit:
        return text
    if len(text) <= limit and len(text.encode("utf-8", "surrogatepass")) <= limit:
        return text
    head = text[:limit].encode("utf-8", "surrogatepass")[:limit].decode("utf-8", "ignore")
    return f"{head}...[cut: {len(text)} characters]"


def _field(value: Any, secrets: tuple[str, ...]) -> Any:
    if value is None or isinstance(value, bool | int | float):
        return value
    return clean(value if isinstance(value, str) else str(value), secrets)


def worth_scrubbing(secrets: Iterable[str]) -> tuple[str, ...]:
    """The secrets a line is scrubbed of: those of ``MIN_SECRET_CHARS`` or more, the longest
    first (a shorter secret that begins a longer one would otherwise leave the longer's rest)."""
    kept = {s for s in secrets if len(s) >= MIN_SECRET_CHARS}
    return tuple(sorted(kept, key=len, reverse=True))


def scrub(text: str, secrets: Iterable[str]) -> str:
    for secret in secrets:
        text = text.replace(secret, REDACTED)
    return text


def configure(
    level: str = "INFO",
    fmt: str = "json",
    secrets: Iterable[str] = (),
    stream: TextIO | None = None,
) -> None:
    """Send every log line to ``stream`` (stderr) in ``fmt``; replaces the handlers there were."""
    handler = logging.StreamHandler(stream or sys.stderr)
    formatter = JsonFormatter(secrets) if fmt == "json" else TextFormatter(secrets)
    handler.setFormatter(formatter)
    root = logging.getLogger()
    for old in list(root.handlers):
        root.removeHandler(old)
    root.addHandler(handler)
    root.setLevel(level)
    quiet_http_clients()


def quiet_http_clients() -> None:
    """The HTTP client libraries' line per request left out below WARNING (``QUIET_LOGGERS``):
    the sidecar's and every other command's logs (an index build's embeddings too)."""
    for name in QUIET_LOGGERS:
        logging.getLogger(name).setLevel(logging.WARNING)


def _fresh_call_id() -> str:
    """16 hex digits. Not a secret (it is sent back and logged), only unlikely to repeat: the
    ``random`` generator, seeded from the OS and again in a forked worker, at half the
    cost of ``secrets.token_hex``."""
    return f"{_random_bits(64):016x}"


def _session_of(message: Any) -> str:
    if isinstance(message, pb.ConverseRequest):
        message = message.turn
    value = getattr(message, "session_id", "")
    return value if isinstance(value, str) else ""


@dataclass(slots=True)
class _Kind:
    """One client's failures of one method and code in the window begun at ``since``."""

    since: float
    logged: int = 0
    suppressed: int = 0


class FailureLines:
    """Which failed calls get a line: the first ``FAILURE_LINES`` of each kind (client address,
    method, code) in a ``FAILURE_WINDOW_S``; the others are counted, and the count is written once
    the window is over (with the kind's next failure, or any call's end after it). A window
    tells ``FAILURE_KINDS`` kinds apart; the clients past them are one, "other clients"."""

    def __init__(self, limit: int = FAILURE_LINES) -> None:
        self.limit = limit
        self.kinds: dict[tuple[str, str, str], _Kind] = {}
        self._swept = monotonic()

    def admit(self, client: str, method: str, code: str) -> bool:
        """Whether this failure gets its line (counted if not)."""
        now = self.sweep()
        key = (client, method, code)
        if key not in self.kinds and len(self.kinds) >= FAILURE_KINDS:
            key = (OTHER_CLIENTS, method, code)  # a flood from many addresses: one kind
        kind = self.kinds.get(key)
        if kind is None:
            kind = self.kinds[key] = _Kind(now)
        if kind.logged < self.limit:
            kind.logged += 1
            return True
        kind.suppressed += 1
        return False

    def sweep(self) -> float:
        """Write the counts of the windows that are over, and forget those kinds (so the table
        holds only the last window's clients); at most once a window. Answers the time."""
        now = monotonic()
        if now - self._swept < FAILURE_WINDOW_S:
            return now
        self._swept = now
        over = [k for k, kind in self.kinds.items() if now - kind.since >= FAILURE_WINDOW_S]
        for key in over:
            kind = self.kinds.pop(key)
            if kind.suppressed:
                # outside any call's context: the count is no one call's
                contextvars.Context().run(_suppressed, key, kind.suppressed, now - kind.since)
        return now


def _suppressed(key: tuple[str, str, str], count: int, seconds: float) -> None:
    client, name, code = key
    log.info(
        "%s %s: %d more like this suppressed (from %s in %.1f s)",
        name,
        code,
        count,
        client or "an unknown client",
        seconds,
        extra={"client": client},
    )


class CoreBatchErrors(logging.Filter):
    """gRPC's line for a call whose answer it could not send because the call was over (its
    client cancelled it or closed its connection, or the sidecar cut it), rewritten as a failed
    call's line: INFO (nothing is wrong with the sidecar), no traceback (gRPC's internals, the
    same each time), the first ``FAILURE_LINES`` a window per method and then a count, as
    ``FailureLines`` keeps any failed call's. Before, a client cancelling the calls whose answers
    it left unread wrote an ERROR line of about 1 KB a call. gRPC's other lines pass as they are,
    among them the same words for a batch gRPC's core refused to start ("Failed
    grpc_call_start_batch": a fault of the server's, with its traceback)."""

    def __init__(self) -> None:
        super().__init__()
        self.failures = FailureLines()

    def filter(self, record: logging.LogRecord) -> bool:
        if not _answer_not_sent(record):
            return True
        method = record.msg[len(_BATCH_ERROR) :].rstrip("]").rpartition("/")[2]
        # at INFO now: left out where INFO is (gRPC's logger let it through as an ERROR)
        enabled = logging.getLogger(record.name).isEnabledFor(logging.INFO)
        if not (enabled and self.failures.admit(ALL_CLIENTS, method, NOT_SENT)):
            return False
        record.levelno, record.levelname = logging.INFO, logging.getLevelName(logging.INFO)
        record.msg = (
            f"{bounded(method, MAX_ID_BYTES)} {NOT_SENT}: the call was over before its answer "
            "went out (its client cancelled it or closed its connection, or the sidecar cut it)"
        )
        record.args, record.exc_info, record.exc_text = (), None, None
        return True


def _answer_not_sent(record: logging.LogRecord) -> bool:
    """Whether ``record`` is gRPC's line for a batch of a call's answer that ran and failed (the
    call was over), as against one its core refused to start."""
    message, exc = record.msg, record.exc_info[1] if record.exc_info else None
    return (
        isinstance(message, str)
        and message.startswith(_BATCH_ERROR)
        and str(exc).startswith(_BATCH_FAILED)
    )


# An accept that failed for want of resources: the event loop's own line for it, with its
# traceback, came for every connection refused so (a flood of connections past the process's
# file descriptors wrote 173,573 of them, 217 MB, in 20 s).
_OUT_OF_RESOURCES = frozenset({errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM})


class LoopErrors:
    """An event loop's exception handler: a failure for want of resources (an accept past the
    process's file descriptors) is written as a failed call's line is, the first
    ``FAILURE_LINES`` a window and then a count, without the traceback (the loop's own, the
    same each time); anything else goes to the loop's default handler."""

    def __init__(self) -> None:
        self.failures = FailureLines()
        self._sweep: asyncio.TimerHandle | None = None

    def __call__(self, loop: asyncio.AbstractEventLoop, context: dict[str, Any]) -> None:
        if not _refused_accept(context):
            loop.default_exception_handler(context)
            return
        exc = context["exception"]
        code = errno.errorcode.get(exc.errno or 0, "OSError")
        if not self.failures.admit(ALL_CLIENTS, "accept", code):
            self._count_later(loop)  # written when the window is over, if no line comes then
        else:
            log.warning(
                "%s: %s: connections are refused until some close (raise the open-file limit, "
                "or lower max_connections and max_grpc_connections)",
                context.get("message", "the event loop"),
                exc.strerror or exc,
            )

    def _count_later(self, loop: asyncio.AbstractEventLoop) -> None:
        if self._sweep is None or self._sweep.cancelled() or self._sweep.when() < loop.time():
            self._sweep = loop.call_later(FAILURE_WINDOW_S * 1.1, self.failures.sweep)


def _refused_accept(context: dict[str, Any]) -> bool:
    """Whether a loop's error is an accept it could not make for want of resources (asyncio
    names the listening socket; anything else, a task's ENOMEM too, is the default's)."""
    exc = context.get("exception")
    return (
        isinstance(exc, OSError)
        and exc.errno in _OUT_OF_RESOURCES
        and ("socket" in context or "accept" in str(context.get("message", "")))
    )


def quiet_loop_errors() -> None:
    """``LoopErrors`` on the running loop, unless it has a handler of its own."""
    loop = asyncio.get_running_loop()
    if loop.get_exception_handler() is None:
        loop.set_exception_handler(LoopErrors())


# The one on gRPC's logger (a process's servers share it); the counts of the lines it left out
# are written as a failed call's are, with the next such line or any call's end (``CallLog``).
CORE_LINES = CoreBatchErrors()


def quiet_grpc_core() -> None:
    """``CORE_LINES`` on gRPC's logger, once a process."""
    core = logging.getLogger(GRPC_CORE_LOGGER)
    if CORE_LINES not in core.filters:
        core.addFilter(CORE_LINES)


class CallLog(Hook):
    """Sets the log context of each call, and logs its end at DEBUG (failures at INFO, the
    first few of a kind: ``FailureLines``)."""

    def __init__(self) -> None:
        self.failures = FailureLines()

    def start(self, call: Call) -> None:
        given = call.header(CALL_ID_HEADER)  # most callers send none: no match tried
        call.call_id = given if given and _CALL_ID.fullmatch(given) else _fresh_call_id()
        current.set(call)  # the log's ids, and the connection a lazy load queues by
        call.context.set_trailing_metadata(((CALL_ID_HEADER, call.call_id),))

    def request(self, call: Call, message: Any) -> None:
        sid = _session_of(message)
        if sid:
            call.session_id = sid  # on this call's lines from now on (``current``)

    def end(self, call: Call) -> None:
        if call.code is OK:
            if self.failures.kinds:  # a window's count is written once its failures stop too
                self.failures.sweep()
            if CORE_LINES.failures.kinds:  # and so is the count of gRPC's lines left out
                CORE_LINES.failures.sweep()
            level = logging.DEBUG
        elif log.isEnabledFor(logging.INFO) and self.failures.admit(
            peer_key(call.context.peer()), call.method, call.code.name
        ):
            level = logging.INFO
        else:
            return
        if not log.isEnabledFor(level):
            return
        log.log(
            level,
            "%s %s in %.1f ms",
            call.method,
            call.code.name,
            call.elapsed_s() * 1000.0,
            extra={"caller": getattr(call.caller, "name", "")} if call.caller else None,
        )
