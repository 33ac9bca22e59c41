"""A local HTTP server that speaks the OpenAI embeddings API, and misbehaves on request.

    server = OpenAIServer().start()          # a daemon thread on 127.0.0.1, port chosen by the OS
    config = EmbedderConfig(provider="openai", base_url=server.base_url, dimensions=64)
    server.set(Behaviour(latency="lognormal:120:0.35"))  # or trickle_s=, fail_status=, close=, hang=
    ...
    server.stop()

    python -m tests.openai_server [--port 0] [--dimension 64]   # prints the port, serves until killed

``POST /v1/embeddings`` answers with deterministic vectors (``HashEmbedder``, in the dimension the
request's ``dimensions`` asks for), so a snapshot built through this server and a query embedded
through it agree. ``POST /_control`` with a JSON ``Behaviour`` changes how the next requests are
answered; ``GET /_stats`` returns the request count and the last request's body. Each request
runs on its own thread, so slow answers overlap as a real server's do.
"""

from __future__ import annotations

import argparse
import gzip
import math
import random
import threading
from dataclasses import asdict, dataclass, fields, replace
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler
from typing import Any

import orjson

from index.embedders.base import HashEmbedder
from tests.local_http import LocalHttpServer, send_json

DEFAULT_DIMENSION = 64
HOLD_TIMEOUT_S = 10.0


@dataclass(frozen=True, slots=True)
class Behaviour:
    """How the server answers: the defaults answer at once.

    ``latency`` is milliseconds before the answer: ``"0"``, a fixed ``"120"``, ``"uniform:80:200"``,
    or ``"lognormal:MEDIAN:SIGMA"`` (a long tail: sigma 0.35 puts p99 at ~2.3x the median).
    """

    latency: str = "0"
    trickle_s: float = 0.0  # > 0: send the body in 16-byte pieces this far apart
    fail_status: int = 0  # e.g. 429 or 500: answer the next ``fail_times`` requests with it
    fail_times: int = 0  # -1: every request
    close: bool = False  # close the connection without answering
    hang: bool = False  # never answer (until the server stops)
    hold_until: int = 0  # hold every answer until this many requests are in flight at once
    values: str = ""  # "huge" (1e39 and more: past float32's range), "zero", "long" (4x): values
    pad_bytes: int = 0  # > 0: a valid answer padded with a string of this many bytes
    shift_index: bool = False  # answer index i + 1 for text i
    drop_mid_body: bool = False  # send the headers and half the body, then close
    gzip_error: bool = False  # with fail_status: the error's body gzipped, unasked
    retry_after: str = ""  # with fail_status: the error's Retry-After header, as sent
    containers: int = 0  # > 0: a valid answer padded with a list of this many empty lists


def sample_latency_ms(spec: str, rng: random.Random) -> float:
    """One latency in milliseconds drawn from a ``Behaviour.latency`` spec."""
    kind, _, args = spec.partition(":")
    if not args:
        return float(kind)
    a, b = (float(x) for x in args.split(":"))
    if kind == "uniform":
        return rng.uniform(a, b)
    if kind == "lognormal":
        return a * math.exp(rng.gauss(0.0, b))
    raise ValueError(f"unknown latency spec {spec!r}")


class OpenAIServer(LocalHttpServer):
    """The server and its switches; thread-safe."""

    def __init__(self, port: int = 0, dimension: int = DEFAULT_DIMENSION, seed: int = 0) -> None:
        self.dimension = dimension
        self._behaviour = Behaviour()
        self._lock = threading.Lock()
        self._rng = random.Random(seed)
        self._embedders: dict[int, HashEmbedder] = {}
        self.requests = 0  # embedding requests received
        self.last_request: dict[str, Any] = {}
        self.in_flight = 0
        self.max_in_flight = 0  # the most embedding requests in flight at once
        self._gathered = threading.Condition(self._lock)
        super().__init__(_handler_for(self), port, name="openai-server")

    def _wake(self) -> None:
        with self._lock:
            self._gathered.notify_all()

    def set(self, behaviour: Behaviour | None = None, **changes: Any) -> None:
        """Replace the behaviour, or change some of its fields."""
        with self._lock:
            self._behaviour = replace(behaviour or self._behaviour, **changes)

    # -- used by the handler threads -------------------------------------------------------

    def _enter(self) -> None:
        with self._lock:
            self.in_flight += 1
            self.max_in_flight = max(self.max_in_flight, self.in_flight)
            self._gathered.notify_all()
            hold = self._behaviour.hold_until
            # HOLD_TIMEOUT_S: a client that never sends enough requests at once still gets answers
            self._gathered.wait_for(
                lambda: self.in_flight >= hold or self.stopping.is_set(), timeout=HOLD_TIMEOUT_S
            )

    def _exit(self) -> None:
        with self._lock:
            self.in_flight -= 1

    def _next(self, body: dict[str, Any]) -> tuple[Behaviour, float, int]:
        """The behaviour for one request, its latency in seconds and the status to fail with."""
        with self._lock:
            self.requests += 1
            self.last_request = body
            b = self._behaviour
            status = 0
            if b.fail_status and b.fail_times != 0:
                status = b.fail_status
                if b.fail_times > 0:
                    self._behaviour = replace(b, fail_times=b.fail_times - 1)
            latency_s = sample_latency_ms(b.latency, self._rng) / 1000.0
        return b, latency_s, status

    def _embeddings(self, body: dict[str, Any]) -> bytes:
        texts = body.get("input", [])
        if isinstance(texts, str):
            texts = [texts]
        dimension = int(body.get("dimensions") or self.dimension)
        with self._lock:
            embedder = self._embedders.setdefault(
                dimension, HashEmbedder(dimension=dimension, name="openai-server")
            )
        vectors = embedder.embed_batch([str(t) for t in texts])
        tokens = sum(len(str(t).split()) for t in texts)
        with self._lock:
            b = self._behaviour
        rows = [_values(row.tolist(), b.values) for row in vectors]
        answer = {
            "object": "list",
            "data": [
                {"object": "embedding", "index": i + b.shift_index, "embedding": row}
                for i, row in enumerate(rows)
            ],
            "model": body.get("model", ""),
            "usage": {"prompt_tokens": tokens, "total_tokens": tokens},
        }
        if b.pad_bytes:
            answer["padding"] = "x" * b.pad_bytes
        if b.containers:
            answer["nested"] = [[] for _ in range(b.containers)]
        return orjson.dumps(answer)


def _values(row: list[float], kind: str) -> list[float]:
    """A vector's values as a misbehaving server answers them (``Behaviour.values``)."""
    if kind == "huge":
        return [v * 1e39 for v in row]  # float32 cannot hold them: infinities, NaN once scaled
    if kind == "zero":
        return [0.0] * len(row)
    if kind == "long":
        return row * 4  # four times the dimension asked for
    return row


class _Handler(BaseHTTPRequestHandler):
    api: OpenAIServer  # the server whose behaviour this handler plays (set by _handler_for)
    protocol_version = "HTTP/1.1"  # keep-alive, as the openai client expects
    # headers and body go out in two writes: with Nagle on, the body waits ~40 ms for the
    # client's delayed ACK of the headers, which no real API server adds
    disable_nagle_algorithm = True

    def log_message(self, format: str, *args: Any) -> None:
        return  # quiet: tests and benchmarks read their own output

    def _read_json(self) -> dict[str, Any]:
        length = int(self.headers.get("Content-Length") or 0)
        raw = self.rfile.read(length) if length else b"{}"
        data = orjson.loads(raw)
        return data if isinstance(data, dict) else {}

    def _send(self, status: int, body: bytes, trickle_s: float = 0.0) -> None:
        send_json(self, status, body, self.api.stopping, trickle_s)

    def do_GET(self) -> None:
        if self.path != "/_stats":
            self._send(HTTPStatus.NOT_FOUND, b'{"error": {"message": "not found"}}')
            return
        with self.api._lock:
            stats = {"requests": self.api.requests, "last_request": self.api.last_request}
        self._send(HTTPStatus.OK, orjson.dumps(stats))

    def do_POST(self) -> None:
        body = self._read_json()
        if self.path == "/_control":
            known = {f.name for f in fields(Behaviour)}
            self.api.set(Behaviour(**{k: v for k, v in body.items() if k in known}))
            self._send(HTTPStatus.OK, orjson.dumps(asdict(self.api._behaviour)))
            return
        if self.path != "/v1/embeddings":
            self._send(HTTPStatus.NOT_FOUND, b'{"error": {"message": "not found"}}')
            return
        self.api._enter()
        try:
            self._embeddings_reply(body)
        finally:
            self.api._exit()

    def _embeddings_reply(self, body: dict[str, Any]) -> None:
        behaviour, latency_s, status = self.api._next(body)
        if behaviour.hang:
            self.api.stopping.wait()
            self.close_connection = True
            return
        if latency_s > 0 and self.api.stopping.wait(latency_s):
            self.close_connection = True
            return
        if behaviour.close:
            self.close_connection = True  # finish() closes the socket: no response at all
            return
        if status:
            error = {"error": {"message": f"injected {status}", "type": "server_error"}}
            if behaviour.pad_bytes:
                error["padding"] = "x" * behaviour.pad_bytes  # type: ignore[assignment]
            if behaviour.gzip_error:
                self._send_gzipped(status, orjson.dumps(error))
                return
            retry = {"Retry-After": behaviour.retry_after} if behaviour.retry_after else {}
            send_json(self, status, orjson.dumps(error), self.api.stopping, headers=retry)
            return
        answer = self.api._embeddings(body)
        if behaviour.drop_mid_body:
            self._send_half(answer)
            return
        self._send(HTTPStatus.OK, answer, behaviour.trickle_s)

    def _send_gzipped(self, status: int, body: bytes) -> None:
        """``body`` gzipped, whatever the request's Accept-Encoding said."""
        packed = gzip.compress(body)
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Encoding", "gzip")
        self.send_header("Content-Length", str(len(packed)))
        self.end_headers()
        self.wfile.write(packed)

    def _send_half(self, body: bytes) -> None:
        """The headers of ``body`` and half of it, then the connection closed."""
        self.send_response(HTTPStatus.OK)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body[: len(body) // 2])
        self.wfile.flush()
        self.close_connection = True


def _handler_for(server: OpenAIServer) -> type[BaseHTTPRequestHandler]:
    return type("Handler", (_Handler,), {"api": server})


def main() -> None:
    parser = argparse.ArgumentParser(description="A local OpenAI embeddings API server.")
    parser.add_argument("--port", type=int, default=0)
    parser.add_argument("--dimension", type=int, default=DEFAULT_DIMENSION)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    server = OpenAIServer(port=args.port, dimension=args.dimension, seed=args.seed)
    print(server.port, flush=True)
    try:
        server._httpd.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        server._httpd.server_close()


if __name__ == "__main__":
    main()
