"""Ingest on request: ``voxrecall index watch --listen HOST:PORT`` takes an authenticated HTTP
request to rebuild one base now, for a docs repository's CI to call after a merge.

    POST /rebuild/<knowledge_base>   Authorization: Bearer <token>  ->  202 {"queued": true}
    GET  /rebuild/<knowledge_base>   the same token                 ->  200 the base's last build

The token is read once, from the variable ``[index] rebuild_token_env`` names
(``VOXRECALL_REBUILD_TOKEN``); without one of at least ``MIN_TOKEN_CHARS`` characters the
listener refuses to start. A wrong or missing token is 401, an unknown base 404. The request
only queues the rebuild: the watcher runs it next (at once when idle, after the build in
progress otherwise), as every build: the new snapshot is published (its ``LATEST`` pointer
moved) only once complete, and nothing when nothing changed. Requests carry no body.

A connection gets ``REQUEST_TIMEOUT_S`` for its whole request, each read and all of them
together (one that stalls or trickles is closed), and at most ``MAX_CONNECTIONS`` are served at
once, at most ``MAX_CONNECTIONS_PER_ADDRESS`` of them from one address (one past that is closed
unread): the listener's threads are bounded, and held briefly, whatever its callers do, and one
address cannot take every slot. A connection shows the token as soon as its head's
``Authorization: Bearer <token>`` line has arrived whole (its bytes are watched as they come,
before the head is parsed, and the bytes its handler has not read yet are looked at before it
is pushed out), and keeps its slot from then on. When all ``MAX_CONNECTIONS`` are
held, a new connection pushes out one that has not shown the token (closed with its request
unread, as a refused one): first one that sent nothing, then one whose first bytes are not the
start of ``POST /rebuild/``, then one whose are, the oldest of each. Only ``MAX_CONNECTIONS``
requests with the token in progress keep a newcomer out (then it is closed unread).

What that guarantees: strangers that send nothing or anything but a rebuild POST cannot push
out a CI request whose first bytes have arrived, nor any request once its token line has. What
it does not: a request whose token line has not arrived yet can still be pushed out by
strangers that send the start of a rebuild POST themselves, from enough addresses to fill the
slots (``MAX_CONNECTIONS_PER_ADDRESS`` each) and re-opened as they are pushed out; the CI's
request, its head sent in one write, is exposed for a round trip, one sent in pieces for
longer. The listener belongs on a private network, or behind the platform's network policy,
reachable from the CI alone; its client retries a closed connection.

A connection closed under its handler (by its client, pushed out, cut at its deadline) ends
quietly; an unexpected error in a handler is logged as a refusal is, one line, no traceback.
A refused or pushed-out connection is logged once per address a
``REFUSAL_WINDOW_S``; the ones after it are counted, and the count is written once the window is
over (with the address's next refusal, any connection after the window, or ``stop``), for at most
``REFUSAL_ADDRESSES`` addresses at once (the others are one, "other addresses"): a flood of
connections writes a few lines a minute, not one per connection.
"""

from __future__ import annotations

import contextlib
import hmac
import io
import logging
import os
import socket
import sys
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import partial
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Protocol, cast

import orjson

from index.config import MIN_TOKEN_CHARS, named, quoted
from index.errors import ConfigError

__all__ = ["RebuildListener", "Rebuilds"]

log = logging.getLogger("voxrecall.index.ingest")

PREFIX = "/rebuild/"
# A CI job sends its request (a line and a head, no body) at once; a connection not done after
# this long is stalled, or holding a slot on purpose (at 10 s, 16 idle connections re-opened
# every 10 s kept every request out).
REQUEST_TIMEOUT_S = 2.0
# Requests are rare: more at once than this is a flood, and each would hold a thread (past it,
# a newcomer pushes out the oldest connection without the token: eight stranger addresses
# holding 2 idle connections each kept the CI's POST out).
MAX_CONNECTIONS = 16
# ... and a CI job sends one or two at once: more from one address is a stranger taking slots
# (at 4, four stranger addresses' idle connections held all 16, and the CI's POST was refused;
# at 2, it takes eight addresses).
MAX_CONNECTIONS_PER_ADDRESS = MAX_CONNECTIONS // 8
# One line per refused connection was 153,379 lines (10.6 MB) in 6 s from 20 threads on 4
# addresses: a refusal gets a line once per address a window, the rest a count at its end ...
REFUSAL_WINDOW_S = 60.0
# ... and the addresses told apart are bounded: a flood from many addresses is one.
REFUSAL_ADDRESSES = 64
OTHER_ADDRESSES = "other addresses"
# What the CI's request starts with: a connection whose first bytes are not a prefix of it is
# pushed out before one whose are (and one that sent nothing before both).
PLAUSIBLE = b"POST " + PREFIX.encode()
# A head's line longer than this is not the CI's: its Authorization line is not looked for in
# the bytes as they arrive (the whole head is still checked once parsed).
MAX_WATCHED_LINE = 8192
# A connection about to be pushed out is looked at first: its bytes not read yet, up to this
# many, may show the token (the CI's head, arrived before its handler read it).
MAX_PEEK = 4096


class Rebuilds(Protocol):
    """What the listener asks of the watcher."""

    def bases(self) -> Sequence[str]: ...  # the bases it rebuilds, by name
    def request(self, knowledge_base: str) -> None: ...
    def last(self, knowledge_base: str) -> dict[str, Any]: ...


class RebuildListener:
    """An HTTP server on its own daemon threads; ``start`` binds, ``stop`` closes."""

    def __init__(self, listen: str, token: str, rebuilds: Rebuilds, env: str) -> None:
        if len(token) < MIN_TOKEN_CHARS:
            raise ConfigError(
                f"--listen needs a rebuild token of at least {MIN_TOKEN_CHARS} characters in "
                f"${env} ([index] rebuild_token_env); make one with `openssl rand -hex 32`"
            )
        host, _, port = listen.rpartition(":")
        if not host or not port.isdigit() or int(port) > 65535:
            raise ConfigError(f"--listen must be host:port, e.g. 127.0.0.1:8089, got {listen!r}")
        self._httpd = _BoundedServer(
            (host, int(port)), _handler(token.encode(), rebuilds), token.encode()
        )
        self._httpd.daemon_threads = True
        self._thread: threading.Thread | None = None

    @property
    def port(self) -> int:
        return int(self._httpd.server_address[1])

    def start(self) -> RebuildListener:
        self._thread = threading.Thread(
            target=self._httpd.serve_forever, name="voxrecall-rebuild", daemon=True
        )
        self._thread.start()
        log.info("rebuild requests on port %d: POST %s<knowledge_base>", self.port, PREFIX)
        return self

    def stop(self) -> None:
        self._httpd.shutdown()
        self._httpd.server_close()
        self._httpd.refusals.flush()
        if self._thread is not None:
            self._thread.join(timeout=5)


class _BoundedServer(ThreadingHTTPServer):
    """A threading server that serves at most ``MAX_CONNECTIONS`` connections at once, and at
    most ``MAX_CONNECTIONS_PER_ADDRESS`` from one address; one past the address's share is
    closed unread (its client may retry). When every slot is held, a new connection pushes out
    the oldest one that has not shown the token yet (one still reading its request): only
    ``MAX_CONNECTIONS`` requests that showed the token keep a newcomer out."""

    def __init__(
        self, address: tuple[str, int], handler: type[BaseHTTPRequestHandler], token: bytes
    ) -> None:
        super().__init__(address, handler)
        self._expected = b"Bearer " + token
        self._lock = threading.Lock()
        self._held: dict[Any, _Held] = {}  # socket -> its slot, oldest first
        self._by_address: dict[str, int] = {}
        self.refusals = RefusalLines()

    def process_request(self, request: Any, client_address: Any) -> None:
        if not self._take(request, client_address[0]):
            self.shutdown_request(request)
            return
        try:
            super().process_request(request, client_address)
        except BaseException:
            self._give_back(request)
            raise

    def process_request_thread(self, request: Any, client_address: Any) -> None:
        try:
            super().process_request_thread(request, client_address)
        finally:
            self._give_back(request)

    def vouch(self, request: Any) -> bool:
        """``request`` showed the token: it keeps its slot to the end. False when it was
        already pushed out."""
        with self._lock:
            held = self._held.get(request)
            if held is not None:
                held.vouched = True
            return held is not None

    def _take(self, request: Any, address: str) -> bool:
        """A slot for one more connection from ``address``, if it may have one."""
        with self._lock:
            if self._by_address.get(address, 0) >= MAX_CONNECTIONS_PER_ADDRESS:
                self.refusals.refused(
                    address, f"{MAX_CONNECTIONS_PER_ADDRESS} connections open from this address"
                )
                return False
            if len(self._held) >= MAX_CONNECTIONS and not self._push_out():
                self.refusals.refused(
                    address, f"{MAX_CONNECTIONS} requests with the token in progress"
                )
                return False
            self.refusals.sweep()
            self._held[request] = _Held(address)
            self._by_address[address] = self._by_address.get(address, 0) + 1
            return True

    def heard(self, request: Any, first: bytes) -> None:
        """``request``'s first bytes so far (``_Held.rank``)."""
        with self._lock:
            held = self._held.get(request)
            if held is not None:
                held.first = first

    def handle_error(self, request: Any, client_address: Any) -> None:
        """A connection closed under its handler (by its client, pushed out, or cut at its
        deadline: the handler's last write fails) ends quietly; another error is one line of
        the refusal lines (socketserver wrote a traceback each: 15,590 in 10 s), its stack at
        DEBUG."""
        error = sys.exc_info()[1]
        if isinstance(error, (ConnectionError, TimeoutError)):
            log.debug("rebuild listener: a connection from %s closed: %s", client_address, error)
            return
        log.debug("rebuild listener: a handler failed", exc_info=error)  # a bug's stack
        with self._lock:
            self.refusals.failed(str(client_address[0]), f"{type(error).__name__}: {error}"[:200])

    def _push_out(self) -> bool:
        """Close the connection that has not shown the token, if any, that least looks like the
        CI's (``_Held.rank``), the oldest of those; its slot is free at once (its thread ends on
        the closed socket). Under the lock."""
        unvouched = [(held.rank(), r) for r, held in self._held.items() if not held.vouched]
        unvouched.sort(key=lambda ranked: ranked[0])  # stable: the oldest of each rank first
        request = next((r for _, r in unvouched if not self._token_unread(r)), None)
        if request is None:
            return False
        address = self._release(request)
        with contextlib.suppress(OSError):  # its blocked read returns; its handler ends
            request.shutdown(socket.SHUT_RDWR)
        self.refusals.refused(
            address, f"pushed out without a token: {MAX_CONNECTIONS} connections open in all"
        )
        return True

    def _token_unread(self, request: Any) -> bool:
        """Whether ``request``'s bytes its handler has not read yet show the token: then it is
        vouched for, not pushed out. Under the lock; never waits."""
        try:  # a copy without the handler's timeout (``dup`` copies it): MSG_DONTWAIT answers
            # at once, where a socket with a timeout first polls for up to that long
            with socket.socket(fileno=os.dup(request.fileno())) as copy:
                data = copy.recv(MAX_PEEK, socket.MSG_PEEK | socket.MSG_DONTWAIT)
        except OSError:  # nothing unread (BlockingIOError), or closed
            return False
        if not any(_is_token_line(line, self._expected) for line in data.split(b"\n")):
            return False
        self._held[request].vouched = True
        return True

    def _give_back(self, request: Any) -> None:
        with self._lock:
            if request in self._held:  # not when it was pushed out
                self._release(request)

    def _release(self, request: Any) -> str:
        """Forget ``request``'s slot; answers its address. Under the lock."""
        address = self._held.pop(request).address
        left = self._by_address.pop(address) - 1
        if left:
            self._by_address[address] = left
        return address


@dataclass
class _Held:
    """A served connection's slot: its address, whether it showed the token, and its first
    bytes so far (up to ``len(PLAUSIBLE)``)."""

    address: str
    vouched: bool = False
    first: bytes = b""

    def rank(self) -> int:
        """The order it is pushed out in: 0 when it sent nothing, 1 when its first bytes are
        not the start of a POST to the rebuild path, 2 when they are."""
        if not self.first:
            return 0
        return 2 if PLAUSIBLE.startswith(self.first) else 1


class _Head:
    """Watches a connection's bytes as they arrive, before its head is parsed: tells the
    server its first bytes (``heard``), and vouches for it (``vouch``) once a whole line of
    them is ``Authorization: Bearer <token>``, so a CI request whose head is still arriving
    keeps its slot from then on. Stops at the head's end or at a line over
    ``MAX_WATCHED_LINE`` bytes."""

    def __init__(
        self, token: bytes, heard: Callable[[bytes], None], vouch: Callable[[], object]
    ) -> None:
        self._expected = b"Bearer " + token
        self._heard = heard
        self._vouch = vouch
        self._first = b""
        self._line = b""
        self._done = False

    def feed(self, data: bytes) -> None:
        if len(self._first) < len(PLAUSIBLE):
            self._first += data[: len(PLAUSIBLE) - len(self._first)]
            self._heard(self._first)
        if self._done:
            return
        *lines, self._line = (self._line + data).split(b"\n")
        for line in lines:
            self._done = self._done or self._ends(line)
        if len(self._line) > MAX_WATCHED_LINE:
            self._done = True

    def _ends(self, line: bytes) -> bool:
        """Whether ``line`` ends the watch: the head's end, or the token shown."""
        if not line.strip():
            return True
        if _is_token_line(line, self._expected):
            self._vouch()
            return True
        return False


def _is_token_line(line: bytes, expected: bytes) -> bool:
    """Whether ``line`` is ``Authorization: <expected>``."""
    name, _, value = line.partition(b":")
    return name.lower() == b"authorization" and hmac.compare_digest(value.strip(), expected)


class _Watched(io.RawIOBase):
    """A connection's socket reader that hands each chunk read to ``feed`` too."""

    def __init__(self, raw: Any, feed: Callable[[bytes], None]) -> None:
        super().__init__()
        self._raw = raw
        self._feed = feed

    def readable(self) -> bool:
        return True

    def readinto(self, buffer: Any) -> int | None:
        count = self._raw.readinto(buffer)
        if count:
            self._feed(bytes(memoryview(buffer)[:count]))
        return cast("int | None", count)

    def close(self) -> None:
        self._raw.close()
        super().close()


class RefusalLines:
    """The log lines of refused connections: the first from an address in a
    ``REFUSAL_WINDOW_S`` gets a warning, the others a count, written once the window is over
    (by ``sweep``, at most once a window, or ``flush``). At most ``REFUSAL_ADDRESSES`` addresses
    are told apart at once; the ones past them are counted as ``OTHER_ADDRESSES``. Not
    thread-safe: the server calls it under its lock."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._since: dict[str, float] = {}  # address -> its window's start
        self._counts: dict[str, int] = {}  # address -> refusals since its line
        self._swept = clock()

    def refused(self, address: str, why: str) -> None:
        """Log this refusal (``why`` says which limit), or count it."""
        self._note(address, "closed a connection from {} unread, ", why)

    def failed(self, address: str, error: str) -> None:
        """Log a connection's unexpected error (one line, no traceback), or count it."""
        self._note(address, "a connection from {} failed: ", error)

    def _note(self, address: str, what: str, why: str) -> None:
        """Log ``what`` (``{}``: the address) and ``why``, or count it in the address's
        window."""
        now = self.sweep()
        if address not in self._since and len(self._since) >= REFUSAL_ADDRESSES:
            address = OTHER_ADDRESSES
        if address in self._since and now - self._since[address] >= REFUSAL_WINDOW_S:
            self._write(address, now)  # its window is over: its count, then a new line
        if address in self._since:
            self._counts[address] = self._counts.get(address, 0) + 1
            return
        self._since[address] = now
        log.warning(
            "rebuild listener: %s%s (more refusals from it are counted, one line every %.0f s)",
            what.format(address),
            why,
            REFUSAL_WINDOW_S,
        )

    def sweep(self) -> float:
        """Write the counts of the windows that are over and forget those addresses; at most
        once a window. Answers the time."""
        now = self._clock()
        if now - self._swept >= REFUSAL_WINDOW_S:
            self._swept = now
            for address in [a for a, t in self._since.items() if now - t >= REFUSAL_WINDOW_S]:
                self._write(address, now)
        return now

    def flush(self) -> None:
        """Write every count now (the listener stops)."""
        now = self._clock()
        for address in list(self._since):
            self._write(address, now)

    def _write(self, address: str, now: float) -> None:
        since = self._since.pop(address)
        count = self._counts.pop(address, 0)
        if count:
            log.warning(
                "rebuild listener: closed %d more connections from %s in %.0f s",
                count,
                address,
                now - since,
            )


def _reply(handler: BaseHTTPRequestHandler, status: int, body: dict[str, Any]) -> None:
    data = orjson.dumps(body)
    handler.send_response(status)
    handler.send_header("Content-Type", "application/json")
    handler.send_header("Content-Length", str(len(data)))
    if status == HTTPStatus.UNAUTHORIZED:
        handler.send_header("WWW-Authenticate", "Bearer")
    handler.end_headers()
    handler.wfile.write(data)


def _keeps_slot(handler: BaseHTTPRequestHandler) -> bool:
    """The request showed the token: its connection may no longer be pushed out. False when it
    already was."""
    return cast(_BoundedServer, handler.server).vouch(handler.connection)


def _handler(token: bytes, rebuilds: Rebuilds) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"
        timeout = REQUEST_TIMEOUT_S  # per read: a stalled connection is closed

        def setup(self) -> None:
            super().setup()
            server = cast(_BoundedServer, self.server)
            request = self.connection
            head = _Head(token, partial(server.heard, request), partial(server.vouch, request))
            self.rfile = io.BufferedReader(_Watched(self.rfile.detach(), head.feed))
            # the whole request, not only each read: a byte every few seconds passes any
            # per-read timeout, and 16 such connections would keep every request out
            self._deadline = threading.Timer(REQUEST_TIMEOUT_S, self._cut)
            self._deadline.daemon = True
            self._deadline.start()

        def _cut(self) -> None:
            with contextlib.suppress(OSError):  # the blocked read returns; the handler ends
                self.connection.shutdown(socket.SHUT_RDWR)

        def finish(self) -> None:
            self._deadline.cancel()
            super().finish()

        def log_message(self, format: str, *args: Any) -> None:
            log.debug("%s %s", self.address_string(), format % args)

        def _base(self) -> str | None:
            """The base the request names, after its token and the base were checked."""
            self.close_connection = True  # requests are rare: no keep-alive, no body to drain
            given = self.headers.get("Authorization", "").encode()
            if not hmac.compare_digest(given, b"Bearer " + token):
                _reply(self, HTTPStatus.UNAUTHORIZED, {"error": "a valid bearer token is required"})
                return None
            if not _keeps_slot(self):
                return None  # pushed out while its head arrived: its socket is closed
            if not self.path.startswith(PREFIX):
                _reply(self, HTTPStatus.NOT_FOUND, {"error": f"use {PREFIX}<knowledge_base>"})
                return None
            kb = self.path[len(PREFIX) :]
            known = rebuilds.bases()
            if kb not in known:  # named as the sidecar's unknown-base errors are: a few, cut
                error = f"no knowledge base {quoted(kb)}; known: {named(known)}"
                _reply(self, HTTPStatus.NOT_FOUND, {"error": error})
                return None
            return kb

        def do_POST(self) -> None:
            kb = self._base()
            if kb is not None:
                rebuilds.request(kb)
                log.info("rebuild of %s requested by %s", kb, self.address_string())
                _reply(self, HTTPStatus.ACCEPTED, {"knowledge_base": kb, "queued": True})

        def do_GET(self) -> None:
            kb = self._base()
            if kb is not None:
                _reply(self, HTTPStatus.OK, rebuilds.last(kb))

    return Handler
