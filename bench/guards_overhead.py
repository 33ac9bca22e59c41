"""What the guards cost a call: the same sidecar with and without its interceptor hooks.

    python -m bench.guards_overhead [--quick]

Two servers over one store in this process: one as ``create_server`` builds it (call log,
metrics, a bearer token, the concurrency limit), one with no interceptor at all. One client
alternates between them in blocks, so both see the same machine load; each call is timed at the
client. ``Status`` has almost no handler, so it shows the hooks' fixed cost; ``Turn`` repeats one
question (its vector is cached) so the embedder's time does not drown it. Writes
``bench/results/guards_overhead.json``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import tempfile
import time
from dataclasses import replace
from pathlib import Path
from typing import Any
from unittest import mock

import grpc
import numpy as np

from bench.report import plain
from index.build import build_knowledge_base
from index.embedders.local import LocalEmbedder
from sidecar.config import parse_config
from sidecar.edge.guards import Guards
from sidecar.edge.server import Sidecar, create_server
from sidecar.gen import retrieval_pb2 as pb
from sidecar.gen import retrieval_pb2_grpc as pb_grpc

REPO = Path(__file__).resolve().parents[1]
TOKEN = "bench-token-0123456789abcdef"
BLOCK = 100  # calls per server before switching: long enough to amortise the switch
CALL_TIMEOUT_S = 10.0


_real_build = Guards.build


def _bare_build(*args: Any, **kwargs: Any) -> Guards:
    """The guards as built, with no interceptor installed: the server without hooks."""
    return replace(_real_build(*args, **kwargs), interceptors=())


async def _servers(folder: Path, embedder: LocalEmbedder) -> tuple[Sidecar, Sidecar]:
    os.environ["VOXRECALL_BENCH_TOKEN"] = TOKEN  # read once, by parse_config, as serve does
    raw = {
        "knowledge_base": [
            {"name": "help", "source": [{"type": "markdown", "path": str(REPO / "examples/kb")}]}
        ],
        "index": {"store": str(folder / "store")},
        "sidecar": {
            "listen": "127.0.0.1:0",
            "metrics_listen": "127.0.0.1:0",
            "auth": {"token_env": "VOXRECALL_BENCH_TOKEN"},
        },
    }
    config = parse_config(raw, folder)
    build_knowledge_base(config, config.knowledge_bases[0], embedder)
    guarded = await create_server(config, embedder=embedder, poll=False)
    with mock.patch.object(Guards, "build", _bare_build):
        bare = await create_server(config, embedder=embedder, poll=False)
    return guarded, bare


async def _timed(calls: int, stub: Any, rpc: str, turn: pb.TurnRequest, metadata: Any) -> list[int]:
    out = []
    for _ in range(calls):
        start = time.perf_counter_ns()
        await _call(stub, rpc, turn, metadata)
        out.append(time.perf_counter_ns() - start)
    return out


def _summary(ns: list[int]) -> dict[str, float]:
    a = np.asarray(ns, dtype=np.float64) / 1000.0
    return {
        "calls": len(ns),
        "p50_us": round(float(np.percentile(a, 50)), 1),
        "p99_us": round(float(np.percentile(a, 99)), 1),
    }


async def _measure(calls: int) -> dict[str, Any]:
    embedder = LocalEmbedder()
    with tempfile.TemporaryDirectory(prefix="voxrecall-guards-") as tmp:
        guarded, bare = await _servers(Path(tmp), embedder)
        md = (("authorization", f"Bearer {TOKEN}"),)
        results: dict[str, Any] = {}
        try:
            async with (
                grpc.aio.insecure_channel(f"127.0.0.1:{guarded.port}") as g_channel,
                grpc.aio.insecure_channel(f"127.0.0.1:{bare.port}") as b_channel,
            ):
                stubs = {
                    "guarded": (pb_grpc.RetrievalStub(g_channel), md),  # type: ignore[no-untyped-call]
                    "bare": (pb_grpc.RetrievalStub(b_channel), ()),  # type: ignore[no-untyped-call]
                }
                turn = pb.TurnRequest(
                    session_id="b", text="how do I reset my password", is_final=True
                )
                for rpc in ("Status", "Turn"):
                    samples: dict[str, list[int]] = {"guarded": [], "bare": []}
                    for stub, metadata in stubs.values():  # warm both up
                        await _call(stub, rpc, turn, metadata)
                    for _ in range(calls // BLOCK):
                        for name, (stub, metadata) in stubs.items():
                            samples[name] += await _timed(BLOCK, stub, rpc, turn, metadata)
                    g, b = _summary(samples["guarded"]), _summary(samples["bare"])
                    results[rpc] = {
                        "guarded": g,
                        "bare": b,
                        "p50_ratio": round(g["p50_us"] / b["p50_us"], 3),
                        "p50_added_us": round(g["p50_us"] - b["p50_us"], 1),
                    }
        finally:
            await guarded.stop(0.5)
            await bare.stop(0.5)
            await embedder.aclose()
    return results


async def _call(stub: Any, rpc: str, turn: pb.TurnRequest, metadata: Any) -> Any:
    if rpc == "Status":
        return await stub.Status(pb.StatusRequest(), metadata=metadata, timeout=CALL_TIMEOUT_S)
    return await stub.Turn(turn, metadata=metadata, timeout=CALL_TIMEOUT_S)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.guards_overhead", description=plain(__doc__))
    p.add_argument("--quick", action="store_true", help="400 calls per RPC and server, not 3000")
    p.add_argument("--calls", type=int, default=0, help="calls per RPC and server (overrides)")
    p.add_argument(
        "--out",
        type=Path,
        default=REPO / "bench/results/guards_overhead.json",
        help="the JSON written",
    )
    args = p.parse_args(argv)
    calls = args.calls or (400 if args.quick else 3000)
    results = {
        "calls_per_rpc_and_server": calls,
        "cpus": os.cpu_count(),
        **asyncio.run(_measure(calls)),
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=2) + "\n", encoding="utf-8")
    print(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
