"""A local HTTP server that speaks the OpenAI chat completions API, and misbehaves on request.

    server = ChatServer().start()              # a daemon thread on 127.0.0.1, port chosen by the OS
    llm = LlmConfig(base_url=server.base_url, cache_dir=tmp / "llm")
    server.answer = lambda body: "..."         # what the model says (default: see ``echo``)
    server.set(fail_status=429, fail_times=2)  # or latency=, trickle_s=, malformed=, cut=, ...
    ...
    server.stop()

``POST /v1/chat/completions`` answers with ``answer(body)`` and reports ``tokens`` tokens of
usage; every request body is kept in ``bodies`` (what a test reads to see what was sent, an
image included). The same ``Behaviour`` switches as ``tests/openai_server.py`` (latency,
trickle_s, fail_status, fail_times, close, hang), plus ``malformed`` (an answer that is not
JSON, or JSON without a message) and ``cut`` (finish_reason "length").
"""

from __future__ import annotations

import random
import threading
from collections.abc import Callable
from dataclasses import dataclass, replace
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler
from typing import Any, Literal

import orjson

from tests.local_http import LocalHttpServer, send_json
from tests.openai_server import sample_latency_ms


@dataclass(frozen=True, slots=True)
class Behaviour:
    latency: str = "0"  # milliseconds before the answer (tests.openai_server.sample_latency_ms)
    trickle_s: float = 0.0  # > 0: send the body in 16-byte pieces this far apart
    fail_status: int = 0  # e.g. 429 or 500: answer the next ``fail_times`` requests with it
    fail_times: int = 0  # -1: every request
    malformed: Literal["", "json", "shape", "empty"] = ""  # every answer broken this way
    cut: bool = False  # finish_reason "length": the answer was cut at max_tokens
    close: bool = False  # close the connection without answering
    tokens: int = 100  # total_tokens reported per answer; 0: no usage in the answer


def user_text(body: dict[str, Any]) -> str:
    """The text of the request's user message (the text part of an image request)."""
    for message in body.get("messages", []):
        if message.get("role") != "user":
            continue
        content = message.get("content")
        if isinstance(content, str):
            return content
        return " ".join(p.get("text", "") for p in content if p.get("type") == "text")
    return ""


def image_urls(body: dict[str, Any]) -> list[str]:
    """The ``image_url`` URLs (data URIs) a request sent."""
    out = []
    for message in body.get("messages", []):
        content = message.get("content")
        if isinstance(content, list):
            out += [p["image_url"]["url"] for p in content if p.get("type") == "image_url"]
    return out


def echo(body: dict[str, Any]) -> str:
    """The default answer: the user's text after ``model:``."""
    return f"model: {user_text(body)}"


class ChatServer(LocalHttpServer):
    """The server and its switches; thread-safe."""

    def __init__(self, port: int = 0, seed: int = 0) -> None:
        self._behaviour = Behaviour()
        self._lock = threading.Lock()
        self._rng = random.Random(seed)
        self.answer: Callable[[dict[str, Any]], str] = echo
        self.bodies: list[dict[str, Any]] = []  # every chat request, in arrival order
        super().__init__(_handler_for(self), port, name="chat-server")

    @property
    def requests(self) -> int:
        with self._lock:
            return len(self.bodies)

    def set(self, behaviour: Behaviour | None = None, **changes: Any) -> None:
        with self._lock:
            self._behaviour = replace(behaviour or self._behaviour, **changes)

    def _next(self, body: dict[str, Any]) -> tuple[Behaviour, float, int]:
        with self._lock:
            self.bodies.append(body)
            b = self._behaviour
            status = 0
            if b.fail_status and b.fail_times != 0:
                status = b.fail_status
                if b.fail_times > 0:
                    self._behaviour = replace(b, fail_times=b.fail_times - 1)
            latency_s = sample_latency_ms(b.latency, self._rng) / 1000.0
        return b, latency_s, status

    def _completion(self, body: dict[str, Any], b: Behaviour) -> bytes:
        if b.malformed == "json":
            return b'{"choices": [{"message": '
        if b.malformed == "shape":
            return orjson.dumps({"choices": [{"text": "no message here"}]})
        text = "" if b.malformed == "empty" else self.answer(body)
        reply: dict[str, Any] = {
            "id": "chatcmpl-test",
            "object": "chat.completion",
            "model": body.get("model", ""),
            "choices": [
                {
                    "index": 0,
                    "message": {"role": "assistant", "content": text},
                    "finish_reason": "length" if b.cut else "stop",
                }
            ],
        }
        if b.tokens:
            reply["usage"] = {"prompt_tokens": b.tokens - 1, "completion_tokens": 1,
                              "total_tokens": b.tokens}  # fmt: skip
        return orjson.dumps(reply)


def _handler_for(server: ChatServer) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"
        disable_nagle_algorithm = True

        def log_message(self, format: str, *args: Any) -> None:
            return

        def _send(self, status: int, body: bytes, trickle_s: float = 0.0) -> None:
            send_json(self, status, body, server.stopping, trickle_s)

        def do_POST(self) -> None:
            length = int(self.headers.get("Content-Length") or 0)
            body = orjson.loads(self.rfile.read(length) if length else b"{}")
            if self.path != "/v1/chat/completions":
                self._send(HTTPStatus.NOT_FOUND, b'{"error": {"message": "not found"}}')
                return
            behaviour, latency_s, status = server._next(body)
            if latency_s > 0 and server.stopping.wait(latency_s):
                self.close_connection = True
                return
            if behaviour.close:
                self.close_connection = True
                return
            if status:
                error = {"error": {"message": f"injected {status}", "type": "server_error"}}
                self._send(status, orjson.dumps(error))
                return
            self._send(HTTPStatus.OK, server._completion(body, behaviour), behaviour.trickle_s)

    return Handler
