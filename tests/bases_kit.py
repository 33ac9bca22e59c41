"""Many small bases in one store, served lazily or loaded: the config over such a store, base
names, and calls retried while their base loads (``[sidecar] memory_budget_mb``)."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any, TypeVar

import grpc

from sidecar.config import Config, parse_config
from sidecar.gen import retrieval_pb2 as pb
from sidecar.gen import retrieval_pb2_grpc as pb_grpc

LOAD_WAIT_S = 60.0  # a bound on waiting for one small base to load on a busy machine, not a timing
_T = TypeVar("_T")


def kb_name(i: int) -> str:
    return f"kb{i:02d}"


def config(
    store: Path, tmp_path: Path, *, tables: dict[str, Any] | None = None, **sidecar: Any
) -> Config:
    """A sidecar over ``store`` on port 0 with these ``[sidecar]`` keys: every hit counted (no
    min_score) and a budget no busy machine misses; ``tables``: more of the config
    (``knowledge_base``, ``function``)."""
    keys = {"store": str(store), "listen": "127.0.0.1:0", "min_score": -1.0, "budget_ms": 5_000}
    raw = {**(tables or {}), "index": {"store": str(store)}, "sidecar": {**keys, **sidecar}}
    return parse_config(raw, base=tmp_path)


def own_channel(port: int) -> grpc.aio.Channel:
    """A channel with a connection of its own: another caller (channels to one target share a
    connection otherwise, and the sidecar sees one requester)."""
    return grpc.aio.insecure_channel(
        f"127.0.0.1:{port}", options=[("grpc.use_local_subchannel_pool", 1)]
    )


def hint_ms(exc: grpc.aio.AioRpcError) -> int:
    """The retry hint of a call refused while its base loads."""
    return int(dict(exc.trailing_metadata() or ())["grpc-retry-pushback-ms"])


async def retried(
    call: Callable[[], Awaitable[_T]], refused: list[grpc.aio.AioRpcError] | None = None
) -> _T:
    """``call``'s response, retried while its base loads after the hint the sidecar gives (each
    such refusal appended to ``refused``); any other error is raised."""
    loop = asyncio.get_running_loop()
    give_up = loop.time() + LOAD_WAIT_S
    while True:
        try:
            return await call()
        except grpc.aio.AioRpcError as exc:
            loading = "is loading" in str(exc.details())
            if exc.code() is not grpc.StatusCode.UNAVAILABLE or not loading:
                raise
            if loop.time() > give_up:
                raise
            if refused is not None:
                refused.append(exc)
            await asyncio.sleep(hint_ms(exc) / 1000)


def search(kb: str) -> pb.SearchRequest:
    return pb.SearchRequest(knowledge_base=kb, query="how do I reset my password", limit=3)


async def answered(stub: pb_grpc.RetrievalStub, kb: str) -> pb.SearchResponse:
    """A search of ``kb``, retried while it loads."""
    response: pb.SearchResponse = await retried(
        lambda: stub.Search(search(kb), timeout=LOAD_WAIT_S)
    )
    return response
