"""Structured logs: one JSON object a line, with the session id and call id of the call at hand.

    logs.configure(level="INFO", fmt="json", secrets=[token, api_key])   # once, in the entry point
    server = grpc.aio.server(interceptors=[HookInterceptor([CallLog(), ...])])

``CallLog`` gives every call an id (the caller's ``x-call-id`` metadata when it sends a usable
one, else a fresh one, returned in the trailing metadata) and puts it and the session id in
context variables, so every log line written while the call runs carries them, in the engine as
in the service. Any configured secret that finds its way into a message is replaced by
``[redacted]`` before the line is written. Every field of a line (the message, each extra, a
traceback) is cut to ``MAX_FIELD_BYTES`` (``bounded``), so no input makes a line large.
"""

from __future__ import annotations

import contextvars
import logging
import re
import sys
from collections.abc import Iterable
from datetime import UTC, datetime
from random import getrandbits as _random_bits
from typing import Any, TextIO

import grpc
import orjson

from sidecar.edge.interceptor import Call, Hook
from sidecar.gen import retrieval_pb2 as pb
from sidecar.turn.sessions import connection

session_id: contextvars.ContextVar[str] = contextvars.ContextVar("session_id", default="")
call_id: contextvars.ContextVar[str] = contextvars.ContextVar("call_id", default="")
method: contextvars.ContextVar[str] = contextvars.ContextVar("method", default="")
door: contextvars.ContextVar[str] = contextvars.ContextVar("door", default="")

CALL_ID_HEADER = "x-call-id"
# A caller's own id is kept only when it is short and plain, so it cannot forge log lines.
_CALL_ID = re.compile(r"[A-Za-z0-9._:-]{1,64}")
REDACTED = "[redacted]"
# A log line's message or field: a sentence with a few quoted values fits many times over; more
# is a caller's input echoed back, and a line per call of it would flood the log.
MAX_FIELD_BYTES = 4096
MAX_TRACEBACK_BYTES = 16 * 1024  # a deep traceback is still worth reading whole
# A record's own attributes, and what a library attaches for its terminal alone (uvicorn's
# ``color_message``: the message again, in ANSI colour codes): neither is an extra of the line.
_RECORD_FIELDS = frozenset(vars(logging.makeLogRecord({}))) | {"color_message"}

log = logging.getLogger("voxrecall.calls")


class JsonFormatter(logging.Formatter):
    """``{"ts", "level", "logger", "msg", "session_id", "call_id", "method", "door", ...}`` a
    line (``door``: the listener the call came in by, grpc or http)."""

    def __init__(self, secrets: Iterable[str] = ()) -> None:
        super().__init__()
        self.secrets = tuple(s for s in secrets if s)

    def format(self, record: logging.LogRecord) -> str:
        line: dict[str, Any] = {
            "ts": datetime.fromtimestamp(record.created, UTC).isoformat(timespec="milliseconds"),
            "level": record.levelname,
            "logger": record.name,
            "msg": bounded(record.getMessage()),
        }
        for key, var in (
            ("session_id", session_id),
            ("call_id", call_id),
            ("method", method),
            ("door", door),
        ):
            value = var.get()
            if value:
                line[key] = value
        for key, value in vars(record).items():
            if key not in _RECORD_FIELDS and not key.startswith("_"):
                line[key] = _field(value)  # extra={...}
        if record.exc_info:
            line["exc"] = bounded(self.formatException(record.exc_info), MAX_TRACEBACK_BYTES)
        text = orjson.dumps(line, default=str).decode()
        return scrub(text, self.secrets)


class TextFormatter(logging.Formatter):
    """The plain format, with the call's ids appended when there are some."""

    def __init__(self, secrets: Iterable[str] = ()) -> None:
        super().__init__("%(asctime)s %(levelname)s %(name)s: %(message)s")
        self.secrets = tuple(s for s in secrets if s)

    def format(self, record: logging.LogRecord) -> str:
        record = logging.makeLogRecord({**vars(record), "msg": bounded(record.getMessage())})
        record.args = None
        text = super().format(record)
        if record.exc_text:
            text = text.replace(record.exc_text, bounded(record.exc_text, MAX_TRACEBACK_BYTES))
        ids = [f"{k}={v.get()}" for k, v in (("session", session_id), ("call", call_id)) if v.get()]
        return scrub(f"{text} [{' '.join(ids)}]" if ids else text, self.secrets)


def bounded(text: str, limit: int = MAX_FIELD_BYTES) -> str:
    """``text``, cut to at most ``limit`` bytes of UTF-8 (and a note of the cut) when longer."""
    if len(text) * 4 <= limit:
        return text
    if len(text) <= limit and len(text.encode("utf-8", "surrogatepass")) <= limit:
        return text
    head = text[:limit].encode("utf-8", "surrogatepass")[:limit].decode("utf-8", "ignore")
    return f"{head}...[cut: {len(text)} characters]"


def _field(value: Any) -> Any:
    if value is None or isinstance(value, bool | int | float):
        return value
    return bounded(value if isinstance(value, str) else str(value))


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


class CallLog(Hook):
    """Sets the log context of each call, and logs its end at DEBUG (failures at INFO)."""

    def start(self, call: Call) -> None:
        given = call.metadata.get(CALL_ID_HEADER)  # most callers send none: no match tried
        call.call_id = given if given and _CALL_ID.fullmatch(given) else _fresh_call_id()
        call_id.set(call.call_id)
        method.set(call.method)
        door.set(call.door)
        session_id.set("")
        connection.set(call.context.peer)  # whose queue a lazy load joins (read then)
        call.context.set_trailing_metadata(((CALL_ID_HEADER, call.call_id),))

    def request(self, call: Call, message: Any) -> None:
        sid = _session_of(message)
        if sid and sid != call.session_id:
            call.session_id = sid
            session_id.set(sid)

    def end(self, call: Call) -> None:
        level = logging.DEBUG if call.code is grpc.StatusCode.OK else logging.INFO
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
