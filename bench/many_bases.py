"""Many small bases behind one sidecar under ``[sidecar] memory_budget_mb`` (issue 19, 2).

``python -m bench.many_bases [--bases 1000] [--chunks 1000-5000] [--budget-mb 512] [--quick]``
writes BASES snapshots of 1-5k synthetic chunks each (384-d random unit vectors, the ``search``
suite's chunk texts; cached in bench/.cache), starts a sidecar process with the budget, and calls
every base once in a shuffled order, then a second round over the same order, each call a
``Search`` with a query vector:

    first_call_ms     from a base's first call to its first answer: UNAVAILABLE while it loads,
                      retried after the ``grpc-retry-pushback-ms`` the sidecar sends
    steady_ms         20 more calls to a base just loaded (p50/p99 over all bases)
    rss_mb            the sidecar's resident memory before any base (``rss_start_mb``), after each
                      base (its largest, and what it grew by: ``rss_growth_mb``, to set beside the
                      budget) and its peak (VmHWM)

``--quick`` (CI's smoke run): 20 bases of 200-500 chunks in an 8 MiB budget. Writes
``bench/results/many_bases.json`` (``--out``).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import grpc
import numpy as np

from bench.corpus import CACHE
from bench.measure import percentiles_ms
from bench.ours import _chunks
from index.embedders.base import EmbedderInfo
from index.snapshot import FORMAT_VERSION, write_snapshot
from index.store import LocalStore, new_version_id
from sidecar.gen import retrieval_pb2 as pb
from sidecar.gen import retrieval_pb2_grpc as pb_grpc

RESULTS = Path(__file__).resolve().parent / "results" / "many_bases.json"
DIM = 384
INFO = EmbedderInfo(name=f"bench/synthetic-{DIM}", dimension=DIM)
STEADY_CALLS = 20
CALL_TIMEOUT_S = 10.0  # a bound on one call; loads are waited for by retrying, not by a call
LOAD_WAIT_S = 120.0  # a bound on one base's first answer, however busy the machine


def build_store(bases: int, low: int, high: int, cache: Path = CACHE) -> Path:
    """BASES snapshots of ``low``-``high`` chunks each, cached by every parameter."""
    root = cache / f"many-bases-{bases}-{low}-{high}-f{FORMAT_VERSION}" / "store"
    rng = np.random.default_rng(19)
    store = LocalStore(root)
    for b in range(bases):
        kb = f"kb{b:04d}"
        n = int(rng.integers(low, high + 1))
        if store.latest(kb) is not None:
            continue
        vectors = rng.normal(size=(n, DIM)).astype(np.float32)
        vectors /= np.linalg.norm(vectors, axis=1, keepdims=True)
        chunks = _chunks(n)
        staging = store.staging_dir(kb)
        version = new_version_id(f"{b:08x}")
        write_snapshot(
            staging, knowledge_base=kb, version=version, embedder=INFO, chunks=chunks,
            vectors=vectors, pages={f"synthetic:doc-{i}.md": f"Document {i}" for i in range(n // 8 + 1)},
            page_count=n // 8 + 1, hnsw_m=16, hnsw_ef_construction=100, target_recall=0.95,
        )  # fmt: skip
        store.publish(kb, staging, version)
    return root


SERVE = """
import asyncio, json, sys
from pathlib import Path
from sidecar.config import parse_config
from index.embedders.base import HashEmbedder
from sidecar.edge.server import create_server

async def main():
    store, budget, dim, name = Path(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
    raw = {"sidecar": {"store": str(store), "listen": "127.0.0.1:0", "memory_budget_mb": budget,
                       "min_score": -1.0, "cache_dir": str(store.parent / "sidecar-cache")}}
    sidecar = await create_server(parse_config(raw, base=store.parent),
                                  embedder=HashEmbedder(dimension=dim, name=name), poll=False)
    print(json.dumps({"port": sidecar.port}), flush=True)
    await asyncio.to_thread(sys.stdin.read)
    print(json.dumps({"evictions": sidecar.holder.evictions}), flush=True)
    await sidecar.stop(0.5)

asyncio.run(main())
"""


def _rss_mb(pid: int) -> tuple[float, float]:
    fields = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        key, _, value = line.partition(":")
        if key in ("VmRSS", "VmHWM"):
            fields[key] = int(value.split()[0]) / 1024
    return fields["VmRSS"], fields["VmHWM"]


async def _first_answer(stub: pb_grpc.RetrievalStub, request: pb.SearchRequest) -> float:
    """Milliseconds from the first call to the first answer, retrying as the sidecar hints."""
    loop = asyncio.get_running_loop()
    started = loop.time()
    while True:
        try:
            await stub.Search(request, timeout=CALL_TIMEOUT_S)
            return (loop.time() - started) * 1000.0
        except grpc.aio.AioRpcError as exc:
            if exc.code() is not grpc.StatusCode.UNAVAILABLE or loop.time() - started > LOAD_WAIT_S:
                raise
            hint = dict(exc.trailing_metadata() or ()).get("grpc-retry-pushback-ms", "50")
            await asyncio.sleep(int(hint) / 1000.0)


async def _calls(port: int, pid: int, names: list[str], rounds: int) -> dict[str, Any]:
    rng = np.random.default_rng(7)
    firsts: list[float] = []
    steady: list[float] = []
    rss: list[float] = []
    rss_start = _rss_mb(pid)[0]  # no base loaded yet: the process itself
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
        stub = pb_grpc.RetrievalStub(channel)  # type: ignore[no-untyped-call]
        for _ in range(rounds):
            for kb in names:
                v = rng.normal(size=DIM).astype("<f4")
                request = pb.SearchRequest(
                    knowledge_base=kb, vector=(v / np.linalg.norm(v)).tobytes(), limit=3
                )
                firsts.append(await _first_answer(stub, request))
                for _ in range(STEADY_CALLS):
                    started = time.perf_counter()
                    await stub.Search(request, timeout=CALL_TIMEOUT_S)
                    steady.append(time.perf_counter() - started)
                rss.append(_rss_mb(pid)[0])
    first = percentiles_ms(np.asarray([f * 1e6 for f in firsts], dtype=np.int64))
    calls = percentiles_ms(np.asarray([s * 1e9 for s in steady], dtype=np.int64))
    return {
        "first_call_p50_ms": first["p50_ms"],
        "first_call_p95_ms": first["p95_ms"],
        "first_call_max_ms": round(max(firsts), 1),
        "steady_p50_ms": calls["p50_ms"],
        "steady_p99_ms": calls["p99_ms"],
        "rss_start_mb": round(rss_start, 1),
        "rss_max_mb": round(max(rss), 1),
        "rss_growth_mb": round(max(rss) - rss_start, 1),
        "peak_rss_mb": round(_rss_mb(pid)[1], 1),
    }


def run(quick: bool, bases: int = 1000, low: int = 1000, high: int = 5000, budget_mb: int = 512,
        rounds: int = 2) -> dict[str, Any]:  # fmt: skip
    if quick:
        bases, low, high, budget_mb = 20, 200, 500, 8
    started = time.perf_counter()
    root = build_store(bases, low, high)
    built_s = time.perf_counter() - started
    names = [f"kb{b:04d}" for b in range(bases)]
    random.Random(5).shuffle(names)
    proc = subprocess.Popen(
        [sys.executable, "-c", SERVE, str(root), str(budget_mb), str(DIM), INFO.name],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
        cwd=Path(__file__).resolve().parents[1],
    )  # fmt: skip
    assert proc.stdin is not None
    assert proc.stdout is not None
    try:
        port = json.loads(proc.stdout.readline())["port"]
        row = asyncio.run(_calls(port, proc.pid, names, rounds))
        proc.stdin.close()
        row["evictions"] = json.loads(proc.stdout.readline())["evictions"]
    finally:
        if proc.poll() is None:
            proc.stdin.close()
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
    return {
        "suite": "many_bases",
        "bases": bases,
        "chunks_per_base": [low, high],
        "budget_mb": budget_mb,
        "rounds": rounds,
        "store_mb": round(sum(p.stat().st_size for p in root.rglob("*") if p.is_file()) / 2**20, 1),
        "build_s": round(built_s, 1),
        **row,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.many_bases", description=__doc__)
    parser.add_argument("--bases", type=int, default=1000)
    parser.add_argument("--chunks", default="1000-5000", help="chunks per base, LOW-HIGH")
    parser.add_argument("--budget-mb", type=int, default=512)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args(argv)
    low, high = (int(x) for x in args.chunks.split("-"))
    result = run(args.quick, args.bases, low, high, args.budget_mb, args.rounds)
    result["command"] = " ".join(["python -m bench.many_bases", *(argv or sys.argv[1:])])
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
