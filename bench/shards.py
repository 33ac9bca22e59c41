"""Sharding bases across sidecars: ``python -m bench shards [--quick]``.

- balance: 10,000 base names over 4, 8 and 16 shards, the fullest shard over the mean;
- growth: the share of bases that move from 8 to 9 shards (the ideal is 1/9), all to the new one;
- routing overhead: ``shard_of`` for a base never seen, ``ShardRouter.client`` for a known base,
  and, against one real sidecar on 127.0.0.1, ``Search`` through the router beside ``Search``
  on a client held directly, interleaved call by call (p50 of each, and the difference).
"""

from __future__ import annotations

import asyncio
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from index.build import build_knowledge_base
from index.embedders.base import HashEmbedder
from sidecar.adapters.client import Voxrecall
from sidecar.config import parse_config
from sidecar.edge.server import create_server
from sidecar.shards import ShardRouter, shard_of

EXAMPLE_KB = Path(__file__).resolve().parents[1] / "examples" / "kb"

NAMES = [f"tenant-{i:05d}" for i in range(10_000)]
EMBEDDER = HashEmbedder(dimension=32)


def balance() -> dict[str, Any]:
    out: dict[str, Any] = {}
    for shards in (4, 8, 16):
        counts = [0] * shards
        for name in NAMES:
            counts[shard_of(name, shards)] += 1
        mean = len(NAMES) / shards
        out[str(shards)] = {"max_over_mean": round(max(counts) / mean, 3), "counts": counts}
    return out


def growth() -> dict[str, Any]:
    moved = [n for n in NAMES if shard_of(n, 8) != shard_of(n, 9)]
    return {
        "moved_share_8_to_9": round(len(moved) / len(NAMES), 4),
        "ideal": round(1 / 9, 4),
        "all_into_the_new_shard": all(shard_of(n, 9) == 8 for n in moved),
    }


def _per_call_us(fn: Any, names: list[str], repeat: int) -> float:
    start = time.perf_counter()
    for _ in range(repeat):
        for name in names:
            fn(name)
    return (time.perf_counter() - start) / (repeat * len(names)) * 1e6


async def _search_pair(quick: bool) -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as tmp:
        bases = [f"tenant-{i}" for i in range(4)]
        source = {"type": "markdown", "path": str(EXAMPLE_KB)}
        raw = {
            "knowledge_base": [{"name": kb, "source": [source]} for kb in bases],
            "index": {"store": "store"},
            "sidecar": {"listen": "127.0.0.1:0", "min_score": -1.0},
        }
        config = parse_config(raw, base=Path(tmp))
        for kb in config.knowledge_bases:  # the example help centre, once per base
            await asyncio.to_thread(
                build_knowledge_base, config, kb, EMBEDDER, progress=lambda done, total: None
            )
        sidecar = await create_server(config, embedder=EMBEDDER)
        target = f"127.0.0.1:{sidecar.port}"
        router = ShardRouter([target])  # one shard: the same sidecar either way
        direct = {kb: Voxrecall(target, knowledge_base=kb) for kb in bases}
        routed_ms: list[float] = []
        direct_ms: list[float] = []
        try:
            for i in range(200 if quick else 3000):
                kb = bases[i % len(bases)]
                for client, times in ((router, routed_ms), (direct, direct_ms)):
                    start = time.perf_counter()
                    if isinstance(client, ShardRouter):
                        await client.client(kb).search("How much does roaming cost?")
                    else:
                        await client[kb].search("How much does roaming cost?")
                    times.append((time.perf_counter() - start) * 1000)
        finally:
            await router.close()
            for c in direct.values():
                await c.close()
            await sidecar.stop(0.5)
    routed, plain = statistics.median(routed_ms[10:]), statistics.median(direct_ms[10:])
    return {
        "search_p50_ms_direct": round(plain, 4),
        "search_p50_ms_routed": round(routed, 4),
        "routed_minus_direct_ms": round(routed - plain, 4),
        "calls_each": len(routed_ms),
    }


def run(quick: bool = False) -> dict[str, Any]:
    names = NAMES[:1000]
    router = ShardRouter([f"voxrecall-shard-{i}:50051" for i in range(8)])
    for name in names:
        router.client(name)  # known bases: what an agent routes after its first call
    repeat = 3 if quick else 30
    return {
        "balance": balance(),
        "growth": growth(),
        "shard_of_us": round(_per_call_us(lambda n: shard_of(n, 8), names, repeat), 3),
        "router_known_base_us": round(_per_call_us(router.client, names, repeat), 3),
        **asyncio.run(_search_pair(quick)),
    }
