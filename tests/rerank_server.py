"""A local HTTP server that speaks the Cohere ``rerank`` API, and misbehaves on request.

    server = RerankServer().start()                # a daemon thread on 127.0.0.1, port from the OS
    config = RerankConfig(base_url=server.base_url)   # POST {base_url}/rerank
    server.set(latency_s=0.5)                      # or trickle_s=, fail_status=, close=, body=
    ...
    server.stop()

``POST /v1/rerank`` (or ``/rerank``) with ``{model, query, documents, top_n}`` answers ``{id,
results: [{index, relevance_score}], meta}``, best first, the top ``top_n``. The score is the
share of the query's words a document holds ("overlap", what a reranker rewards), or, with
``order="reverse"``, the documents' own order reversed (so a test can tell the order came from
here). Each request runs on its own thread.
"""

from __future__ import annotations

import re
import time
from dataclasses import dataclass, replace
from http.server import BaseHTTPRequestHandler
from typing import Any, Literal

import orjson

from tests.local_http import LocalHttpServer

WORD = re.compile(r"[a-z0-9]+")
HOLD_S = 10.0  # the longest a slow answer is held, so a stopped server never hangs a thread


@dataclass(frozen=True, slots=True)
class Behaviour:
    order: Literal["overlap", "reverse"] = "overlap"
    latency_s: float = 0.0  # before the answer
    trickle_s: float = 0.0  # > 0: the body in 8-byte pieces this far apart
    fail_status: int = 0  # answer every request with this status (429, 500, ...)
    close: bool = False  # close the connection without answering
    body: bytes = b""  # answer 200 with exactly this body
    echo: bool = False  # each result holds its document, {"document": {"text": ...}}, as Jina's


def scores(query: str, documents: list[str], order: str) -> list[float]:
    if order == "reverse":
        return [float(i) / max(1, len(documents)) for i in range(len(documents))]
    words = set(WORD.findall(query.lower()))
    return [len(words & set(WORD.findall(d.lower()))) / max(1, len(words)) for d in documents]


class RerankServer(LocalHttpServer):
    def __init__(self) -> None:
        self.behaviour = Behaviour()
        self.requests: list[dict[str, Any]] = []
        super().__init__(_handler_for(self), name="rerank-server")

    def set(self, **changes: Any) -> None:
        self.behaviour = replace(Behaviour(), **changes)


def _handler_for(server: RerankServer) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, format: str, *args: Any) -> None:  # quiet
            pass

        def do_POST(self) -> None:
            raw = self.rfile.read(int(self.headers.get("content-length", "0")))
            if self.path not in ("/v1/rerank", "/rerank"):
                self._send(404, b'{"message": "not found"}')
                return
            request = orjson.loads(raw)
            server.requests.append(request)
            b = server.behaviour
            if b.latency_s:
                server.stopping.wait(min(b.latency_s, HOLD_S))
            if b.close:
                self.close_connection = True
                self.connection.close()
                return
            if b.fail_status:
                self._send(b.fail_status, b'{"message": "try again later"}')
                return
            self._send(200, b.body or _answer(request, b.order, b.echo), trickle_s=b.trickle_s)

        def _send(self, status: int, body: bytes, trickle_s: float = 0.0) -> None:
            self.send_response(status)
            self.send_header("content-type", "application/json")
            self.send_header("content-length", str(len(body)))
            self.end_headers()
            if not trickle_s:
                self.wfile.write(body)
                return
            for i in range(0, len(body), 8):
                if server.stopping.is_set():
                    return
                try:
                    self.wfile.write(body[i : i + 8])
                    self.wfile.flush()
                except OSError:  # the client gave up
                    return
                time.sleep(trickle_s)

    return Handler


def _answer(request: dict[str, Any], order: str, echo: bool = False) -> bytes:
    documents = request["documents"]
    scored = scores(request["query"], documents, order)
    ranked = sorted(range(len(documents)), key=lambda i: (-scored[i], i))
    top = ranked[: int(request.get("top_n") or len(documents))]
    results: list[dict[str, Any]] = [{"index": i, "relevance_score": scored[i]} for i in top]
    if echo:
        for result in results:
            result["document"] = {"text": documents[result["index"]]}
    return orjson.dumps({"id": "r1", "results": results, "meta": {"billed_units": {}}})


def main() -> None:
    """``python -m tests.rerank_server [--latency S]``: print the port, serve until killed."""
    import argparse

    parser = argparse.ArgumentParser(description=main.__doc__)
    parser.add_argument("--latency", type=float, default=0.0, help="seconds before each answer")
    args = parser.parse_args()
    server = RerankServer()
    server.set(latency_s=args.latency)
    print(server.port, flush=True)
    server._httpd.serve_forever()


if __name__ == "__main__":
    main()
