"""A sidecar and a gRPC echo server in a process of their own, as a deployment runs them.

``python -m bench.sidecar_proc --store DIR --dim D --embedder NAME`` serves the store's
snapshots with ``create_server`` on 127.0.0.1 (queries arrive as vectors, so a fake embedder whose
info matches the snapshot's stands in for the model), and beside it, on a second server, a
``bench.Echo/Search`` method that answers every request with the bytes of a real ``Search``
response of the same store: the transport floor, the same sizes with no search behind them; and
``bench.Echo/Knn``, which searches the sidecar's own graph (the very hnswlib index it serves)
for the request's vector and answers those same bytes: the least a Python gRPC server does to
answer a Search, with no code of the sidecar's on the call (the ``grpc-knn`` system).
It prints one JSON line (ports, response size, load time), then serves until its stdin closes.

``--memory-budget-mb N`` serves the store's bases lazily under that budget (``bench.many_bases``):
nothing is loaded before the first line, no echo server runs (``echo_port`` 0), and when its stdin
closes it prints a second line, ``{"evictions": N}``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import uvloop

from bench.report import plain
from index.embedders.base import HashEmbedder
from sidecar.config import SidecarConfig, parse_config
from sidecar.edge.server import Sidecar, create_server
from sidecar.gen import retrieval_pb2 as pb
from sidecar.gen import retrieval_pb2_grpc as pb_grpc

KB = "bench"  # the knowledge base bench.ours publishes; named in every request
LIMIT = 10
CALL_TIMEOUT_S = 10.0  # generous: only the first call waits for a connection


async def _canned_response(port: int, dim: int) -> bytes:
    """The bytes of a real top-10 Search response of this sidecar."""
    vector = np.full(dim, 1.0 / np.sqrt(dim), dtype="<f4").tobytes()
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
        stub = pb_grpc.RetrievalStub(channel)  # type: ignore[no-untyped-call]
        resp: pb.SearchResponse = await stub.Search(
            pb.SearchRequest(knowledge_base=KB, vector=vector, limit=LIMIT, min_score=-1.0),
            timeout=CALL_TIMEOUT_S,
        )
    return resp.SerializeToString()


MAX_MESSAGE_BYTES = SidecarConfig().max_message_bytes  # the sidecar's own default limit


def bare_knn(index: Any, request: pb.SearchRequest) -> None:
    """The least a server does for a Search: ``index`` (an ``hnswlib.Index``) searched for the
    request's vector, the answer left unread (``grpc-knn``, ``bench.search_parts``' canned-knn)."""
    index.knn_query(np.frombuffer(request.vector, dtype="<f4").reshape(1, -1), k=LIMIT)


def echo_server(response: bytes, index: Any) -> tuple[grpc.aio.Server, int]:
    """The echo and, on ``index`` (an ``hnswlib.Index``), the bare search beside it."""

    async def handle(request: bytes, context: grpc.aio.ServicerContext[bytes, bytes]) -> bytes:
        return response

    async def knn(request: pb.SearchRequest, context: Any) -> bytes:
        bare_knn(index, request)
        return response

    server = grpc.aio.server(
        options=[
            ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
            ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
            ("grpc.so_reuseport", 0),
        ]
    )
    handler = grpc.unary_unary_rpc_method_handler(handle)  # raw bytes in and out
    searched = grpc.unary_unary_rpc_method_handler(
        knn, request_deserializer=pb.SearchRequest.FromString
    )
    server.add_generic_rpc_handlers(
        (grpc.method_handlers_generic_handler("bench.Echo", {"Search": handler, "Knn": searched}),)
    )
    port = server.add_insecure_port("127.0.0.1:0")
    return server, port


async def _serve_lazy(sidecar: Sidecar, load_s: float) -> None:
    """Lazy bases: no base is loaded to echo; the evictions once stdin closes."""
    try:
        print(json.dumps({"port": sidecar.port, "echo_port": 0, "load_s": load_s}), flush=True)
        await asyncio.to_thread(sys.stdin.read)  # until the parent closes our stdin
        print(json.dumps({"evictions": sidecar.holder.evictions}), flush=True)
    finally:
        await sidecar.stop(0.5)


async def run(
    store: Path,
    dim: int,
    embedder_name: str,
    ef_search: int = 0,
    listen: str = "127.0.0.1:0",
    workers: int = 1,
    memory_budget_mb: int = 0,
) -> None:
    """``workers`` > 1: this process is one of that many on ``listen`` (a fixed port), as
    ``voxrecall serve`` runs its workers (sidecar/edge/workers.py) without the supervisor."""
    sidecar_keys = {"ef_search": ef_search, "listen": listen, "workers": workers}
    if memory_budget_mb:
        sidecar_keys |= {"memory_budget_mb": memory_budget_mb, "min_score": -1.0}
    raw: dict[str, Any] = {"sidecar": {"store": str(store), **sidecar_keys}}
    config = parse_config(raw, base=store.parent)
    started = time.perf_counter()
    sidecar = await create_server(
        config, embedder=HashEmbedder(dimension=dim, name=embedder_name), poll=False
    )
    load_s = time.perf_counter() - started
    echo: grpc.aio.Server | None = None
    if memory_budget_mb:
        await _serve_lazy(sidecar, load_s)
        return
    try:
        response = await _canned_response(sidecar.port, dim)
        served = sidecar.holder.get(KB)
        assert served is not None, f"the store has no base {KB!r}"
        echo, echo_port = echo_server(response, served.index)
        await echo.start()
        print(
            json.dumps(
                {
                    "port": sidecar.port,
                    "echo_port": echo_port,
                    "response_bytes": len(response),
                    "load_s": load_s,
                }
            ),
            flush=True,
        )
        await asyncio.to_thread(sys.stdin.read)  # until the parent closes our stdin
    finally:
        if echo is not None:
            await echo.stop(0.5)
        await sidecar.stop(0.5)


def main() -> None:
    parser = argparse.ArgumentParser(description=plain(__doc__))
    parser.add_argument("--store", type=Path, required=True, help="the snapshot store")
    parser.add_argument("--dim", type=int, required=True, help="the vectors' dimension")
    parser.add_argument("--embedder", required=True, help="the embedder name the snapshot records")
    parser.add_argument(
        "--ef-search", type=int, default=0, help="[sidecar] ef_search (0: the snapshot's)"
    )
    parser.add_argument("--listen", default="127.0.0.1:0", help="[sidecar] listen")
    parser.add_argument("--workers", type=int, default=1, help="[sidecar] workers")
    parser.add_argument(
        "--memory-budget-mb", type=int, default=0, help="[sidecar] memory_budget_mb (0: none)"
    )
    args = parser.parse_args()
    keys = (args.ef_search, args.listen, args.workers, args.memory_budget_mb)
    uvloop.run(run(args.store, args.dim, args.embedder, *keys))


if __name__ == "__main__":
    main()
