"""What every local model server of the tests shares: a ThreadingHTTPServer on 127.0.0.1 (port 0
picks one) served from a daemon thread, a ``stopping`` event its handlers wait on (so a hanging or
trickling answer ends when the test stops the server), ``start`` and ``stop``.

    class ChatServer(LocalHttpServer):
        def __init__(self) -> None:
            super().__init__(_handler_for(self), name="chat-server")
"""

from __future__ import annotations

import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Self


class LocalHttpServer:
    def __init__(
        self, handler: type[BaseHTTPRequestHandler], port: int = 0, name: str = ""
    ) -> None:
        self.stopping = threading.Event()
        self._httpd = ThreadingHTTPServer(("127.0.0.1", port), handler)
        self._httpd.daemon_threads = True
        self._name = name or type(self).__name__
        self._thread: threading.Thread | None = None

    @property
    def port(self) -> int:
        return int(self._httpd.server_address[1])

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}/v1"

    def start(self) -> Self:
        self._thread = threading.Thread(
            target=self._httpd.serve_forever, name=self._name, daemon=True
        )
        self._thread.start()
        return self

    def stop(self) -> None:
        self.stopping.set()  # wakes hanging and trickling handlers
        self._wake()
        self._httpd.shutdown()
        self._httpd.server_close()
        if self._thread is not None:
            self._thread.join(timeout=5)

    def _wake(self) -> None:
        """Wake whatever else a handler may wait on (a server with its own conditions)."""


def send_json(
    handler: BaseHTTPRequestHandler,
    status: int,
    body: bytes,
    stopping: threading.Event,
    trickle_s: float = 0.0,
    headers: dict[str, str] | None = None,
) -> None:
    """Answer ``body`` as JSON, with ``headers`` besides; with ``trickle_s``, 16 bytes at a time
    with that pause between (cut short when the server stops). A client that gave up ends the
    connection quietly."""
    handler.send_response(status)
    for name, value in (headers or {}).items():
        handler.send_header(name, value)
    handler.send_header("Content-Type", "application/json")
    handler.send_header("Content-Length", str(len(body)))
    handler.end_headers()
    try:
        if trickle_s <= 0:
            handler.wfile.write(body)
            return
        handler.wfile.flush()
        for start in range(0, len(body), 16):
            if stopping.wait(trickle_s):
                handler.close_connection = True
                return
            handler.wfile.write(body[start : start + 16])
            handler.wfile.flush()
    except (BrokenPipeError, ConnectionResetError):
        handler.close_connection = True
