"""A real S3-compatible server for store tests: moto in server mode, in its own process on
127.0.0.1, and a proxy in front of it with the same switches as ``tests/static_http.py``.

``MotoServer`` starts ``python -m moto.server`` on a free port and waits until it answers.
``Mirror`` makes a bucket hold what a local folder holds (the contract suite writes snapshots
into a folder, as a publisher does, then reads them through each store). ``FaultProxy`` passes
requests on to moto and misbehaves on purpose: ``fail_next`` answers 500 to that many requests,
``cut_next`` sends the headers of that many answers for keys ending in ``cut_suffix`` and half
the body, and for keys ending in ``hostile_suffix``, ``hostile`` = ``"oversize"`` announces and
sends the object and 1 MiB more, ``"trickle"`` sends the headers and then one byte every
``trickle_s`` seconds (0: silence) until the proxy stops, and the liars of
``tests.static_http.lie`` (``"continue"``, ``"trailer"``, ``"headers"``) answer in their place.
"""

from __future__ import annotations

import hashlib
import http.client
import os
import subprocess
import sys
import threading
import time
import uuid
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

from bench.measure import free_port
from tests.static_http import LIARS, Logged, lie

STARTUP_S = 60.0  # moto imports every AWS service's models on start: seconds on a busy machine
CREDENTIALS = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing"}


class MotoServer:
    """``python -m moto.server`` in a child process, on a free port of 127.0.0.1."""

    def __init__(self, env: dict[str, str] | None = None) -> None:
        self.port = free_port()
        self.env = env or {}  # e.g. INITIAL_NO_AUTH_ACTION_COUNT: check signatures and IAM
        self._process: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> MotoServer:
        self._process = subprocess.Popen(
            [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(self.port)],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            env={**os.environ, **self.env},
        )
        deadline = time.monotonic() + STARTUP_S
        while not self._answers():
            if self._process.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"moto server did not start on port {self.port}")
            time.sleep(0.1)
        return self

    def stop(self) -> None:
        if self._process is not None:
            self._process.terminate()
            self._process.wait(timeout=30)
            self._process = None

    def _answers(self) -> bool:
        try:
            conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=2)
            conn.request("GET", "/moto-api/")
            conn.getresponse().read()
            conn.close()
            return True
        except OSError:
            return False


def s3_client(endpoint_url: str) -> Any:
    import boto3

    return boto3.session.Session(
        aws_access_key_id="testing", aws_secret_access_key="testing", region_name="us-east-1"
    ).client("s3", endpoint_url=endpoint_url)


def new_bucket(client: Any) -> str:
    name = f"vox-{uuid.uuid4().hex[:16]}"
    client.create_bucket(Bucket=name)
    return name


class Mirror:
    """Makes ``s3://bucket/prefix`` hold exactly the files under ``root`` (dot-files included:
    a staging folder is as invisible in a bucket as in a folder, because no pointer names it)."""

    def __init__(self, root: Path, client: Any, bucket: str, prefix: str) -> None:
        self.root, self.client, self.bucket, self.prefix = root, client, bucket, prefix
        self._sent: dict[str, str] = {}

    def sync(self) -> None:
        here = {
            f"{self.prefix}/{p.relative_to(self.root).as_posix()}": p
            for p in self.root.rglob("*")
            if p.is_file()
        }
        for key in set(self._sent) - set(here):
            self.client.delete_object(Bucket=self.bucket, Key=key)
            del self._sent[key]
        for key, path in here.items():
            data = path.read_bytes()
            digest = hashlib.sha256(data).hexdigest()
            if self._sent.get(key) != digest:
                self.client.put_object(Bucket=self.bucket, Key=key, Body=data)
                self._sent[key] = digest


class FaultProxy:
    """An HTTP proxy on 127.0.0.1 in front of ``upstream`` (moto) that misbehaves on demand."""

    def __init__(self, upstream_port: int) -> None:
        self.upstream_port = upstream_port
        self.fail_next = 0
        self.cut_next = 0
        self.cut_suffix = "\0"
        self.hostile = ""  # "", "oversize" or "trickle"
        self.hostile_suffix = "\0"
        self.trickle_s = 0.0
        self.etag_pad = 0  # bytes added inside every ETag sent (and taken off If-None-Match)
        self.stopped = threading.Event()
        self.log: list[Logged] = []
        self.lock = threading.Lock()
        owner = self

        class Handler(_ProxyHandler):
            proxy = owner

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._server.daemon_threads = True
        self.port = self._server.server_address[1]
        self._thread = threading.Thread(
            target=self._server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True
        )
        self._thread.start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def requests(self, suffix: str) -> list[Logged]:
        with self.lock:
            return [r for r in self.log if r.path.endswith(suffix)]

    def take(self, switch: str) -> bool:
        with self.lock:
            left = int(getattr(self, switch))
            if left > 0:
                setattr(self, switch, left - 1)
            return left > 0

    def stop(self) -> None:
        self.stopped.set()
        self._server.shutdown()
        self._server.server_close()
        self._thread.join()


_HOP = frozenset({"connection", "transfer-encoding", "keep-alive", "content-length"})


class _ProxyHandler(BaseHTTPRequestHandler):
    proxy: FaultProxy
    protocol_version = "HTTP/1.1"

    def do_GET(self) -> None:
        proxy = self.proxy
        path = self.path.split("?", 1)[0]
        wanted = self.headers.get("Range", "")
        if proxy.take("fail_next"):
            self._send_plain(path, 500, b"<Error><Code>InternalError</Code></Error>", wanted)
            return
        status, headers, body = self._upstream()
        with proxy.lock:
            proxy.log.append(Logged("GET", path, status, wanted))
        if status == 200 and proxy.hostile and path.endswith(proxy.hostile_suffix):
            if proxy.hostile in LIARS:
                self.close_connection = True
                lie(self._raw_write, proxy.hostile, proxy.stopped, proxy.trickle_s)
                return
            self._hostile(headers, body)
            return
        self.send_response(status)
        for name, value in headers:
            self.send_header(name, value)
        self.send_header("Content-Length", str(len(body)))
        cut = path.endswith(proxy.cut_suffix) and status < 300 and proxy.take("cut_next")
        if cut:
            self.send_header("Connection", "close")
            self.close_connection = True
        self.end_headers()
        self.wfile.write(body[: len(body) // 2] if cut else body)

    def _upstream(self) -> tuple[int, list[tuple[str, str]], bytes]:
        conn = http.client.HTTPConnection("127.0.0.1", self.proxy.upstream_port, timeout=30)
        try:
            pad = "0" * self.proxy.etag_pad
            headers = {k: v for k, v in self.headers.items() if k.lower() not in _HOP}
            if pad and "If-None-Match" in headers:
                headers["If-None-Match"] = headers["If-None-Match"].replace(pad + '"', '"')
            conn.request("GET", self.path, headers=headers)
            resp = conn.getresponse()
            body = resp.read()
            kept = [(k, v) for k, v in resp.getheaders() if k.lower() not in _HOP]
            if pad:
                kept = [(k, v[:-1] + pad + '"' if k.lower() == "etag" else v) for k, v in kept]
            return resp.status, kept, body
        finally:
            conn.close()

    def _hostile(self, headers: list[tuple[str, str]], body: bytes) -> None:
        proxy = self.proxy
        self.send_response(200)
        for name, value in headers:
            self.send_header(name, value)
        self.close_connection = True
        self.send_header("Connection", "close")
        if proxy.hostile == "oversize":
            body += bytes(1 << 20)
            self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        try:
            if proxy.hostile == "oversize":
                self.wfile.write(body)
                return
            self.wfile.flush()
            for i in range(len(body)):
                if proxy.stopped.wait(proxy.trickle_s) or not proxy.trickle_s:
                    break
                self.wfile.write(body[i : i + 1])
                self.wfile.flush()
            proxy.stopped.wait()
        except OSError:
            return  # the client hung up

    def _raw_write(self, data: bytes) -> None:
        self.wfile.write(data)
        self.wfile.flush()

    def _send_plain(self, path: str, status: int, body: bytes, wanted: str) -> None:
        with self.proxy.lock:
            self.proxy.log.append(Logged("GET", path, status, wanted))
        self.send_response(status)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format: str, *args: object) -> None:
        """Quiet: tests read ``FaultProxy.log``."""
