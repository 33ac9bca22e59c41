"""HTTP requests that end by a deadline, whatever the server sends: the stores' and the url
source's.

``http.client`` bounds each wait on the socket (``timeout``), never a request: a server that
trickles its status line and headers a byte at a time, answers ``100 Continue`` without end,
or sends a chunked body's trailer without end holds the thread inside loops of http.client's
own, each read well inside the timeout. ``Connections.bounded`` puts a deadline on what a
thread connects: a timer shuts its sockets down when it passes (a socket shut down wakes its
reader with end-of-file), so none of those loops outlasts it, and ``Deadline.passed`` tells
the caller that whatever http.client raised or returned then was the cut. ``Connections.close``
cuts every request in flight the same way (a store's drain).

``opener`` builds a urllib opener over such connections, and follows a redirect only where its handler allows: ``SameOrigin`` for a store (its headers
are signed for its own host), ``WebOnly`` for a crawled page (any host, but only http or https).
Neither reads a redirect's body.
"""

from __future__ import annotations

import contextlib
import http.client
import socket
import ssl
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
import weakref
from collections.abc import Iterator
from typing import Any

from index.errors import one_line, shortened

__all__ = ["Connections", "Deadline", "SameOrigin", "WebOnly", "opener"]

WEB_SCHEMES = frozenset({"http", "https"})
MAX_SHOWN_URL = 200  # of a refused redirect's target, in its message


class Deadline:
    """The sockets one request opened, shut down when its deadline passes (``expire``, from a
    timer's thread); ``passed`` says it did."""

    def __init__(self) -> None:
        self.passed = False
        self._sockets: list[socket.socket] = []
        self._lock = threading.Lock()

    def add(self, sock: socket.socket) -> None:
        with self._lock:
            self._sockets.append(sock)
            passed = self.passed
        if passed:
            _shutdown(sock)

    def expire(self) -> None:
        with self._lock:
            self.passed = True
            sockets = list(self._sockets)
        for sock in sockets:
            _shutdown(sock)


class Connections:
    """The sockets of one user's requests (a store's, the url source's), so ``close`` can cut a
    read blocked in another thread (a socket shut down wakes its reader with end-of-file), and
    so can a request's deadline (``bounded``)."""

    def __init__(self) -> None:
        self._sockets: weakref.WeakSet[socket.socket] = weakref.WeakSet()
        self._lock = threading.Lock()
        self._closed = False
        self._local = threading.local()  # the request this thread makes now: its Deadline

    def track(self, sock: socket.socket) -> None:
        with self._lock:
            self._sockets.add(sock)
            closed = self._closed
        request: Deadline | None = getattr(self._local, "request", None)
        if request is not None:
            request.add(sock)
        if closed:
            _shutdown(sock)

    @contextlib.contextmanager
    def bounded(self, deadline: float) -> Iterator[Deadline]:
        """The sockets this thread connects inside are shut down at ``deadline`` (a timer
        thread, cancelled on the way out): http.client's own loops cannot outlast it."""
        request = Deadline()
        timer = threading.Timer(max(0.0, deadline - time.monotonic()), request.expire)
        timer.daemon = True
        self._local.request = request
        timer.start()
        try:
            yield request
        finally:
            timer.cancel()
            self._local.request = None

    def close(self) -> None:
        with self._lock:
            self._closed = True
            sockets = list(self._sockets)
        for sock in sockets:
            _shutdown(sock)


def _shutdown(sock: socket.socket) -> None:
    # the plain socket's shutdown, also under TLS, where the reader is inside SSL_read; an
    # OSError: already closed
    with contextlib.suppress(OSError):
        socket.socket.shutdown(sock, socket.SHUT_RDWR)


def _tracked(cls: type[http.client.HTTPConnection], connections: Connections) -> type[Any]:
    class Tracked(cls):  # type: ignore[valid-type,misc]
        def connect(self) -> None:
            super().connect()
            connections.track(self.sock)

    return Tracked


class _HttpHandler(urllib.request.HTTPHandler):
    def __init__(self, connections: Connections) -> None:
        super().__init__()
        self._connection: Any = _tracked(http.client.HTTPConnection, connections)

    def http_open(self, req: urllib.request.Request) -> http.client.HTTPResponse:
        return self.do_open(self._connection, req)


class _HttpsHandler(urllib.request.HTTPSHandler):
    def __init__(self, connections: Connections) -> None:
        self._tls = ssl.create_default_context()
        super().__init__(context=self._tls)
        self._connection: Any = _tracked(http.client.HTTPSConnection, connections)

    def https_open(self, req: urllib.request.Request) -> http.client.HTTPResponse:
        return self.do_open(self._connection, req, context=self._tls)


def _origin(url: str) -> tuple[str, str, int | None]:
    """A URL's scheme, host and port, the scheme's default port spelt out or not."""
    parts = urllib.parse.urlsplit(url)
    scheme = parts.scheme.lower()
    return scheme, (parts.hostname or "").lower(), parts.port or _DEFAULT_PORTS.get(scheme)


_DEFAULT_PORTS = {"http": 80, "https": 443}


class _Redirects(urllib.request.HTTPRedirectHandler):
    """Follows a redirect that ``refused`` lets through, its body unread: urllib reads a
    redirect's body whole (``fp.read()``) before it follows it, so a 302 of gigabytes, or
    chunked without end, was read into memory until the deadline. Its body is never used:
    closed here, that read finds nothing (the next request opens its own connection). A
    refused one is an HTTPError of its code, naming where it led."""

    def refused(self, url: str, newurl: str) -> str | None:
        raise NotImplementedError

    def redirect_request(
        self,
        req: urllib.request.Request,
        fp: Any,
        code: int,
        msg: str,
        headers: Any,
        newurl: str,
    ) -> urllib.request.Request | None:
        why = self.refused(req.full_url, newurl)
        if why is not None:
            where = shortened(one_line(newurl), MAX_SHOWN_URL)
            raise urllib.error.HTTPError(req.full_url, code, f"{why}: {where}", headers, fp)
        fp.close()
        return super().redirect_request(req, fp, code, msg, headers, newurl)


class SameOrigin(_Redirects):
    """Follows a redirect only to the same scheme, host and port: urllib's own handler passes
    every header on (an S3 store's SigV4 ``Authorization`` and session token included) to any
    host, and from https to http. A static server or S3 needs no redirect elsewhere."""

    def refused(self, url: str, newurl: str) -> str | None:
        if _origin(newurl) != _origin(url):
            return "redirect to another origin refused"
        return None


class WebOnly(_Redirects):
    """Follows a redirect to any host over http or https: a docs site moves its pages (to
    https, to another host), but a page is never fetched by ftp or from a file."""

    def refused(self, url: str, newurl: str) -> str | None:
        scheme = urllib.parse.urlsplit(newurl).scheme.lower()
        if scheme not in WEB_SCHEMES:
            return f"redirect to a {scheme} URL refused (only http and https are fetched)"
        return None


def opener(
    connections: Connections, redirects: _Redirects, *, env_proxies: bool = False
) -> urllib.request.OpenerDirector:
    """A urllib opener whose sockets ``connections`` tracks, following redirects as
    ``redirects`` allows, through the environment's proxies (``HTTPS_PROXY``...) only where
    ``env_proxies`` (a crawl of public pages from behind a company's proxy; never a store)."""
    return urllib.request.build_opener(
        urllib.request.ProxyHandler(None if env_proxies else {}),
        redirects,
        _HttpHandler(connections),
        _HttpsHandler(connections),
    )
