"""A sidecar's handlers called in this process, no transport: what ``bench.handler_cost`` and
``bench.turn_cost`` share.

``served`` builds a sidecar with ``create_server`` over a bench corpus's snapshot (not started)
and hands back the servicer it made; ``wrapped`` puts the sidecar's interceptor (every hook)
around a handler as grpc would for a method; ``serialized`` sends the answer through the
method's serializer as grpc does next (an ``EncodedResponse``'s bytes as they are); ``cpu_us``
times calls on this thread's CPU (``time.thread_time``: grpc's threads and other processes do
not count).
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any
from unittest import mock

import grpc
from google.protobuf.message import Message

from bench.corpus import CACHE
from bench.ours import build_snapshot, embedder_info
from index.embedders.base import HashEmbedder
from sidecar.config import parse_config
from sidecar.edge.interceptor import HookInterceptor
from sidecar.edge.server import Sidecar, create_server
from sidecar.edge.service import RetrievalService

Handler = Callable[[Any, Any], Awaitable[Any]]
SERVICE = "/voxrecall.v1.Retrieval/"


class Context:
    """What the hooks and the handlers touch of a servicer context."""

    def invocation_metadata(self) -> tuple[()]:
        return ()

    def set_trailing_metadata(self, metadata: Any) -> None:
        pass

    def peer(self) -> str:
        return "ipv4:127.0.0.1:1"

    def code(self) -> None:
        return None

    def time_remaining(self) -> float:
        return 10.0

    def done(self) -> bool:
        return True  # called in process: the answer is the caller's as the handler returns

    async def abort(self, code: Any, details: str = "", trailing_metadata: Any = ()) -> None:
        raise RuntimeError(f"{code}: {details}")


class _Details:
    def __init__(self, method: str) -> None:
        self.method = SERVICE + method
        self.invocation_metadata = ()


async def served(
    corpus: Any, dim: int, cache: Path = CACHE, **settings: Any
) -> tuple[Sidecar, RetrievalService]:
    """A sidecar over ``corpus``'s snapshot (built in ``cache``, or found there; ``[sidecar]``
    ``settings`` added), not started, and the servicer it made: its handlers are called in
    process."""
    folder, _ = build_snapshot(corpus, cache)
    store = folder.parent.parent
    raw = {"sidecar": {"store": str(store), "listen": "127.0.0.1:0", **settings}}
    made: list[RetrievalService] = []
    real_init = RetrievalService.__init__

    def keep(self: RetrievalService, *args: Any, **kwargs: Any) -> None:
        real_init(self, *args, **kwargs)
        made.append(self)

    with mock.patch.object(RetrievalService, "__init__", keep):
        sidecar = await create_server(
            parse_config(raw, base=store.parent),
            embedder=HashEmbedder(dimension=dim, name=embedder_info(corpus).name),
            poll=False,
        )
    return sidecar, made[0]


async def wrapped(interceptor: HookInterceptor, inner: Handler, method: str) -> Handler:
    """``inner`` as the interceptor wraps the unary ``method`` ("Search", "Turn")."""
    handler = grpc.unary_unary_rpc_method_handler(inner)

    async def continuation(details: Any) -> Any:
        return handler

    hooked = await interceptor.intercept_service(continuation, _Details(method))  # type: ignore[arg-type]
    return hooked.unary_unary  # type: ignore[no-any-return]


def cache_option(parser: argparse.ArgumentParser) -> None:
    """The in-process benches' ``--cache``: where the search suite's corpus is cached."""
    parser.add_argument(
        "--cache", type=Path, default=CACHE, help="where the corpus and its snapshot are cached"
    )


def written(result: dict[str, Any], out: Path) -> dict[str, Any]:
    """``result`` written to ``out`` as JSON and printed; returned (a bench's ``main``)."""
    text = json.dumps(result, indent=2)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(text + "\n", encoding="utf-8")
    print(text)
    return result


def serializer(message: type[Message]) -> Callable[[Any], bytes]:
    """What the serializer of a method answering ``message`` does with a handler's answer."""
    try:
        from sidecar.edge.wire import passing_through
    except ImportError:  # a tree from before the handlers wrote bytes (a before/after run)
        return message.SerializeToString  # type: ignore[no-any-return]
    plain = grpc.unary_unary_rpc_method_handler(None, response_serializer=message.SerializeToString)
    return passing_through(plain).response_serializer  # type: ignore[no-any-return]


def serialized(fn: Handler, message: type[Message]) -> Handler:
    """``fn``, its answer serialized as grpc would send it."""
    serialize = serializer(message)

    async def handler(request: Any, context: Any) -> bytes:
        return serialize(await fn(request, context))

    return handler


async def cpu_us(fn: Handler, requests: list[Any], calls: int) -> float:
    """``calls`` awaited calls of ``fn`` over ``requests`` in turn: this thread's CPU, us a call."""
    context = Context()
    started = time.thread_time()
    for i in range(calls):
        await fn(requests[i % len(requests)], context)
    return (time.thread_time() - started) / calls * 1e6
