"""A real static HTTP server on 127.0.0.1 for store tests, with switches that make it misbehave.

It serves a folder the way nginx or a CDN would: ``ETag`` and ``If-None-Match`` (304),
``Range: bytes=N-`` (206). Switches: ``fail_next`` answers 500 to that many requests
(with ``fail_reason`` as its reason phrase when set: a status line as long as a server cares),
``fail_suffix`` to every request for a path ending in it, for as long as it is set,
``cut_next`` sends the headers of that many answers for paths ending in ``cut_suffix`` but only
half the body, and ``stop()`` closes the port (``start()`` reopens the same port). Hostile
answers for paths ending in ``hostile_suffix``, as ``hostile`` says: ``"unbounded"`` sends no
Content-Length and the file followed by zeros until the client hangs up; ``"oversize"``
announces and sends the file and 1 MiB more; ``"trickle"`` sends no Content-Length and one byte
every ``trickle_s`` seconds (0: the headers, then silence) until the client hangs up or the
server stops. ``hostile_sent`` counts the body bytes those answers got out. The liars (``lie``)
never finish an answer's head or trailer: ``"continue"`` sends ``100 Continue`` answers without
end, ``"trailer"`` a chunked body whose trailer never ends, ``"headers"`` one header line every
``trickle_s`` seconds. ``ignore_range`` answers every ``Range`` request with the whole file
(200), as a server without range support does. ``etag_pad`` makes every ETag that many bytes
longer. ``length_header`` is sent as every file's Content-Length (the body ended by the close).
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import unquote

LIARS = ("continue", "trailer", "headers")


def lie(
    write: Callable[[bytes], object], kind: str, stopped: threading.Event, pace_s: float
) -> None:
    """An answer whose head or trailer never ends (``kind``: one of LIARS), until the client
    hangs up or ``stopped`` is set; every loop is one that http.client runs inside itself."""
    try:
        if kind == "continue":
            while not stopped.is_set():
                write(b"HTTP/1.1 100 Continue\r\n\r\n" * 64)
        elif kind == "trailer":
            write(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nhello\r\n0\r\n")
            while not stopped.is_set():
                write(b"X-Trailer: y\r\n" * 64)
        else:
            write(b"HTTP/1.1 200 OK\r\n")
            while not stopped.wait(pace_s):
                write(b"X-Header: y\r\n")
    except OSError:
        return  # the client hung up


@dataclass(frozen=True, slots=True)
class Logged:
    method: str
    path: str
    status: int
    range: str = ""


class StaticServer:
    def __init__(self, root: Path) -> None:
        self.root = root
        self.fail_next = 0
        self.fail_suffix = "\0"  # matches no path until a test sets it
        self.fail_reason = ""  # the reason phrase of those 500s; "" is the standard one
        self.cut_next = 0
        self.cut_suffix = ""
        self.hostile = ""  # "", "unbounded", "oversize", "trickle" or one of LIARS
        self.hostile_suffix = "\0"  # matches no path until a test sets it
        self.trickle_s = 0.0
        self.hostile_sent = 0
        self.ignore_range = False
        self.etag_pad = 0  # bytes added inside every ETag (a server whose ETags are huge)
        # set: every answer's Content-Length as sent (ISO-8859-1), its body ended by the close
        self.length_header = ""
        self.stopped = threading.Event()
        self.log: list[Logged] = []
        self._lock = threading.Lock()
        self._server: ThreadingHTTPServer | None = None
        self._thread: threading.Thread | None = None
        self.port = 0

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> StaticServer:
        owner = self
        self.stopped.clear()

        class Handler(_Handler):
            server_owner = owner

        self._server = ThreadingHTTPServer(("127.0.0.1", self.port), Handler)
        self._server.daemon_threads = True
        self.port = self._server.server_address[1]
        self._thread = threading.Thread(
            target=self._server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True
        )
        self._thread.start()
        return self

    def stop(self) -> None:
        self.stopped.set()  # ends a trickle
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None
        if self._thread is not None:
            self._thread.join()
            self._thread = None

    def requests(self, suffix: str) -> list[Logged]:
        with self._lock:
            return [r for r in self.log if r.path.endswith(suffix)]

    def _take(self, switch: str) -> bool:
        with self._lock:
            left = int(getattr(self, switch))
            if left > 0:
                setattr(self, switch, left - 1)
            return left > 0

    def _record(self, entry: Logged) -> None:
        with self._lock:
            self.log.append(entry)


class _Handler(BaseHTTPRequestHandler):
    server_owner: StaticServer

    def do_GET(self) -> None:
        owner = self.server_owner
        path = unquote(self.path.split("?", 1)[0])
        wanted = self.headers.get("Range", "")
        if owner._take("fail_next") or path.endswith(owner.fail_suffix):
            self._answer(path, 500, b"injected failure", wanted)
            return
        file = (owner.root / path.lstrip("/")).resolve()
        if not file.is_relative_to(owner.root.resolve()) or not file.is_file():
            self._answer(path, 404, b"not found", wanted)
            return
        stat = file.stat()
        etag = f'"{stat.st_size:x}-{stat.st_mtime_ns:x}{"0" * owner.etag_pad}"'
        if self.headers.get("If-None-Match") == etag:
            owner._record(Logged("GET", path, 304, wanted))
            self.send_response(304)
            self.send_header("ETag", etag)
            self.end_headers()
            return
        data = file.read_bytes()
        if owner.hostile and path.endswith(owner.hostile_suffix):
            owner._record(Logged("GET", path, 200, wanted))
            if owner.hostile in LIARS:
                self.close_connection = True
                lie(self._raw_write, owner.hostile, owner.stopped, owner.trickle_s)
                return
            self._hostile(data)
            return
        ranged = bool(wanted) and not owner.ignore_range
        start = int(wanted.removeprefix("bytes=").split("-")[0]) if ranged else 0
        status = 206 if ranged else 200
        body = data[start:]
        owner._record(Logged("GET", path, status, wanted))
        self.send_response(status)
        self.send_header("ETag", etag)
        self.send_header("Content-Length", owner.length_header or str(len(body)))
        self.close_connection = self.close_connection or bool(owner.length_header)
        if status == 206:
            self.send_header("Content-Range", f"bytes {start}-{len(data) - 1}/{len(data)}")
        self.end_headers()
        if path.endswith(owner.cut_suffix) and owner._take("cut_next"):
            self.wfile.write(body[: len(body) // 2])
            self.close_connection = True
            return
        self.wfile.write(body)

    def _hostile(self, data: bytes) -> None:
        owner = self.server_owner
        kind = owner.hostile
        self.send_response(200)
        if kind == "oversize":
            data += bytes(1 << 20)
            self.send_header("Content-Length", str(len(data)))
        self.close_connection = True
        self.end_headers()
        try:
            if kind == "trickle":
                self._trickle(data)
                return
            self._send(data)
            while kind == "unbounded" and not owner.stopped.is_set():
                self._send(bytes(1 << 16))
        except OSError:
            return  # the client hung up: what a capped download does

    def _trickle(self, data: bytes) -> None:
        owner = self.server_owner
        self.wfile.flush()
        for i in range(len(data)):
            if owner.stopped.wait(owner.trickle_s) or not owner.trickle_s:
                break
            self._send(data[i : i + 1])
        owner.stopped.wait()  # silence until the server stops (or the client hangs up)

    def _raw_write(self, data: bytes) -> None:
        self.wfile.write(data)
        self.wfile.flush()

    def _send(self, body: bytes) -> None:
        self.wfile.write(body)
        self.wfile.flush()
        with self.server_owner._lock:
            self.server_owner.hostile_sent += len(body)

    def _answer(self, path: str, status: int, body: bytes, wanted: str) -> None:
        self.server_owner._record(Logged("GET", path, status, wanted))
        reason = self.server_owner.fail_reason if status == 500 else ""
        self.send_response(status, reason or None)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format: str, *args: object) -> None:
        """Quiet: tests read ``StaticServer.log`` instead."""
