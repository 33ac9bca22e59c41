"""Attack s13 F15: the HTTP and S3 stores follow a redirect only within their own origin, so a
store (or a CDN in front of it) redirecting elsewhere never hands the request's headers, an S3
store's signature among them, to another host.

Real parts: two real HTTP servers on 127.0.0.1 (two ports, so two origins); the S3 store signs
with SigV4 from test credentials in the environment, as it would with real ones.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler
from pathlib import Path

import pytest

from index.errors import StoreUnavailable
from index.http_bounds import _origin
from index.http_store import HttpOptions, HttpStore
from index.s3_store import S3Options, S3Store
from tests.local_http import LocalHttpServer

POINTER = b"20990101T000000000000Z\n"
FAST = HttpOptions(timeout_s=5.0, attempts=1)


class Server(LocalHttpServer):
    """Answers every GET with ``redirect_to`` + the path (a 302) when set, else a pointer;
    records each request's headers."""

    def __init__(self) -> None:
        self.redirect_to = ""
        self.seen: list[dict[str, str]] = []
        super().__init__(_handler(self))

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"


def _handler(server: Server) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            server.seen.append(dict(self.headers.items()))
            if server.redirect_to == "loop":  # the same path again, for ever
                self.send_response(302)
                self.send_header("Location", self.path)
                self.send_header("Content-Length", "0")
                self.end_headers()
                return
            if server.redirect_to == "huge" and not self.path.startswith("/moved"):
                # a gigabyte announced, a mebibyte sent, the rest held back until the test ends
                self.send_response(302)
                self.send_header("Location", f"/moved{self.path}")
                self.send_header("Content-Length", str(1 << 30))
                self.end_headers()
                with contextlib.suppress(OSError):
                    self.wfile.write(b"x" * (1 << 20))
                    self.wfile.flush()
                    server.stopping.wait(30)
                self.close_connection = True
                return
            if server.redirect_to and not self.path.startswith("/moved"):
                self.send_response(302)
                self.send_header("Location", f"{server.redirect_to}/moved{self.path}")
                self.send_header("Content-Length", "0")
                self.end_headers()
                return
            self.send_response(200)
            self.send_header("Content-Length", str(len(POINTER)))
            self.end_headers()
            self.wfile.write(POINTER)

        def log_message(self, format: str, *args: object) -> None:
            pass

    return Handler


@pytest.fixture
def servers() -> Iterator[tuple[Server, Server]]:
    store, elsewhere = Server().start(), Server().start()
    try:
        yield store, elsewhere
    finally:
        store.stop()
        elsewhere.stop()


@pytest.fixture
def credentials(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    for key in list(os.environ):
        if key.startswith("AWS_"):
            monkeypatch.delenv(key)
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "testing")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "testing")
    monkeypatch.setenv("AWS_SESSION_TOKEN", "session-token")
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "no-aws-config"))
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "no-aws-credentials"))
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")


def test_an_http_store_refuses_a_redirect_to_another_host(
    servers: tuple[Server, Server], tmp_path: Path
) -> None:
    store, elsewhere = servers
    store.redirect_to = elsewhere.url
    http = HttpStore(store.url, tmp_path / "cache", FAST)
    with pytest.raises(StoreUnavailable, match="redirect to another origin refused") as refused:
        http.latest("support")
    assert elsewhere.url in str(refused.value)  # where it led, for a person to act on
    assert elsewhere.seen == []


def test_an_s3_store_never_sends_its_signature_to_another_host(
    servers: tuple[Server, Server], tmp_path: Path, credentials: None
) -> None:
    store, elsewhere = servers
    store.redirect_to = elsewhere.url
    s3 = S3Store("s3://snaps/prod", tmp_path / "cache", FAST, S3Options(endpoint_url=store.url))
    with pytest.raises(StoreUnavailable, match="another origin"):
        s3.latest("support")
    assert "AWS4-HMAC-SHA256" in store.seen[0]["Authorization"]  # it did sign: to its own host
    assert elsewhere.seen == []


def test_a_redirect_within_the_store_is_followed(
    servers: tuple[Server, Server], tmp_path: Path
) -> None:
    store, _ = servers
    store.redirect_to = store.url
    assert (
        HttpStore(store.url, tmp_path / "cache", FAST).latest("support") == POINTER.decode().strip()
    )


def test_a_redirect_s_body_is_not_read(servers: tuple[Server, Server], tmp_path: Path) -> None:
    """Attack s20: urllib reads a redirect's body whole before it follows it, so a 302 announcing
    a gigabyte (or chunked without end) was read into memory until the download's deadline, and
    the request failed at it. The body is never read: the redirect is followed at once."""
    store, _ = servers
    store.redirect_to = "huge"
    options = HttpOptions(timeout_s=5.0, download_timeout_s=3.0, attempts=1)
    http = HttpStore(store.url, tmp_path / "cache", options)
    assert http.latest("support") == POINTER.decode().strip()
    assert len(store.seen) == 2  # the redirect, then where it led


def test_a_redirect_loop_is_refused_in_one_line(
    servers: tuple[Server, Server], tmp_path: Path
) -> None:
    """Attack s17 F6: urllib's text for a loop is three lines ("...infinite loop.\\nThe last
    30x error message was:\\nFound"), and the refusal carried them as they were into the log
    and Status."""
    store, _ = servers
    store.redirect_to = "loop"
    with pytest.raises(StoreUnavailable, match="infinite loop") as refused:
        HttpStore(store.url, tmp_path / "cache", FAST).latest("support")
    said = str(refused.value)
    assert "\n" not in said
    assert "\r" not in said
    assert "infinite loop.\\nThe last 30x error message was:\\nFound" in said


def test_an_origin_is_the_same_with_its_default_port_spelt_out() -> None:
    """A same-origin redirect to ``https://h:443/...`` from ``https://h/...`` was refused as
    another origin (the host and port compared as written)."""
    assert _origin("https://Store.example/a") == _origin("https://store.example:443/b")
    assert _origin("http://store.example/a") == _origin("http://store.example:80/b")
    assert _origin("http://store.example/a") != _origin("https://store.example/a")
    assert _origin("https://store.example/a") != _origin("https://store.example:8443/a")
    assert _origin("https://user@store.example/a") == _origin("https://store.example/a")
