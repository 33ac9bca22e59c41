"""A real HTTP server on 127.0.0.1 (port 0) serving pages from a dict, honouring ETag and
Last-Modified, and recording every request's path and answer status."""

from __future__ import annotations

import threading
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from types import TracebackType


@dataclass
class ServedPage:
    body: bytes
    content_type: str = "text/html; charset=utf-8"
    etag: str = ""
    last_modified: str = ""
    status: int = 200  # anything but 200 is answered as an error with no body


class PagesServer:
    """``with PagesServer() as server: server.pages["/a"] = ServedPage(...); server.url("/a")``."""

    def __init__(self) -> None:
        self.pages: dict[str, ServedPage] = {}
        self.log: list[tuple[str, int]] = []
        self._lock = threading.Lock()
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                page = outer.pages.get(self.path)
                status = outer._status(
                    page, self.headers.get("If-None-Match"), self.headers.get("If-Modified-Since")
                )
                with outer._lock:
                    outer.log.append((self.path, status))
                self.send_response(status)
                if page is not None and page.etag:
                    self.send_header("ETag", page.etag)
                if page is not None and page.last_modified:
                    self.send_header("Last-Modified", page.last_modified)
                if status == 200 and page is not None:
                    self.send_header("Content-Type", page.content_type)
                    self.send_header("Content-Length", str(len(page.body)))
                    self.end_headers()
                    self.wfile.write(page.body)
                else:
                    self.send_header("Content-Length", "0")
                    self.end_headers()

            def log_message(self, format: str, *args: object) -> None:
                return None

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)

    @staticmethod
    def _status(page: ServedPage | None, if_none_match: str | None, if_modified: str | None) -> int:
        if page is None:
            return 404
        if page.status != 200:
            return page.status
        if page.etag and if_none_match == page.etag:
            return 304
        if not page.etag and page.last_modified and if_modified == page.last_modified:
            return 304
        return 200

    def url(self, path: str) -> str:
        host, port = self._server.server_address[:2]
        return f"http://{host!s}:{port}{path}"

    def statuses(self, since: int = 0) -> list[int]:
        """The answer statuses of the requests from number ``since`` on."""
        with self._lock:
            return [status for _, status in self.log[since:]]

    def __enter__(self) -> PagesServer:
        self._thread.start()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(timeout=10)
