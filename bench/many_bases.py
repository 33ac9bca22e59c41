"""Many small bases behind one sidecar under ``[sidecar] memory_budget_mb`` (issue 19, 2).

``python -m bench.many_bases [--bases 1000] [--chunks 1000-5000] [--distinct 50] [--budget-mb 512]
[--malloc-arena-max N] [--quick]`` writes DISTINCT snapshots of 1-5k synthetic chunks each (384-d
random unit vectors, the ``search`` suite's chunk texts) and publishes the other bases as copies of
them (``publish_copies``: the files linked, the manifest naming the copy; cached in bench/.cache),
starts a sidecar process with the budget (``bench.sidecar_proc --memory-budget-mb``), and calls
every base once in a shuffled order, then a second round over the same order, each call a
``Search`` with a query vector:

    first_call_ms     from a base's first call to its first answer: UNAVAILABLE while it loads,
                      retried after the ``grpc-retry-pushback-ms`` the sidecar sends
    steady_ms         20 more calls to a base just loaded (p50/p99 over all bases)
    rss_mb            the sidecar's resident memory before any base (``rss_start_mb``), after each
                      base (its largest, and what it grew by: ``rss_growth_mb``, to set beside the
                      budget) and its peak (VmHWM)

The vectors are not a model's: nothing here measures quality, and a load, a search and the memory
they take depend on the sizes, not on what the vectors mean. A copy is loaded as a base of its
own (its graph read into memory, its files mapped); its mapped files share the page cache with
the base it copies, which a store of distinct files would not (every file here is in the page
cache after the build either way).

``--malloc-arena-max N`` runs the sidecar with ``MALLOC_ARENA_MAX=N`` (glibc's per-thread arenas).
``--quick`` (CI's smoke run): 20 bases of 200-500 chunks (5 distinct) in an 8 MiB budget. Writes
``bench/results/many_bases.json`` (``--out``).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import subprocess
import sys
import time
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from pathlib import Path
from typing import Any

import grpc
import numpy as np

from bench.corpus import CACHE
from bench.measure import percentiles_ms
from bench.ours import _chunks
from bench.report import plain
from index.embedders.base import EmbedderInfo
from index.snapshot import FORMAT_VERSION, MANIFEST, read_manifest, write_atomic, write_snapshot
from index.store import LocalStore, new_version_id
from sidecar.gen import retrieval_pb2 as pb
from sidecar.gen import retrieval_pb2_grpc as pb_grpc

RESULTS = Path(__file__).resolve().parent / "results" / "many_bases.json"
DIM = 384
INFO = EmbedderInfo(name=f"bench/synthetic-{DIM}", dimension=DIM)
STEADY_CALLS = 20
CALL_TIMEOUT_S = 10.0  # a bound on one call; loads are waited for by retrying, not by a call
LOAD_WAIT_S = 120.0  # a bound on one base's first answer, however busy the machine


def build_store(bases: int, low: int, high: int, distinct: int, cache: Path = CACHE) -> Path:
    """BASES bases: DISTINCT snapshots of ``low``-``high`` chunks each and copies of them, cached
    by every parameter."""
    root = cache / f"many-bases-{bases}-{low}-{high}-d{distinct}-f{FORMAT_VERSION}" / "store"
    rng = np.random.default_rng(19)
    store = LocalStore(root)
    for b in range(distinct):
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
    for b in range(distinct):
        source = f"kb{b:04d}"
        copies = [f"kb{c:04d}" for c in range(b + distinct, bases, distinct)]
        todo = [kb for kb in copies if store.latest(kb) is None]
        publish_copies(root, source, str(store.latest(source)), todo)
    return root


def publish_copies(
    root: Path, source: str, version: str, names: Iterable[str], threads: int = 8
) -> None:
    """Publish ``source``'s snapshot ``version`` under each of ``names`` as a publisher would: its
    files linked into a staging folder, its manifest written again naming the new base (the one
    place a snapshot names its base; every file's sha256 and size stay true), then
    ``LocalStore.publish``. ``threads`` at a time: each waits on its fsyncs."""
    store = LocalStore(root)
    folder = store.version_dir(source, version)
    manifest = read_manifest(folder)

    def copy(name: str) -> None:
        staging = store.staging_dir(name)
        for file in manifest.files:
            os.link(folder / file, staging / file)
        write_atomic(staging / MANIFEST, replace(manifest, knowledge_base=name).to_json())
        store.publish(name, staging, version)

    with ThreadPoolExecutor(threads) as pool:
        list(pool.map(copy, names))


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
        rounds: int = 2, distinct: int = 50, arena_max: int = 0) -> dict[str, Any]:  # fmt: skip
    if quick:
        bases, low, high, budget_mb, distinct = 20, 200, 500, 8, 5
    distinct = min(distinct, bases)
    started = time.perf_counter()
    root = build_store(bases, low, high, distinct)
    built_s = time.perf_counter() - started
    names = [f"kb{b:04d}" for b in range(bases)]
    random.Random(5).shuffle(names)
    env = {**os.environ, **({"MALLOC_ARENA_MAX": str(arena_max)} if arena_max else {})}
    proc = subprocess.Popen(
        [sys.executable, "-m", "bench.sidecar_proc", "--store", str(root), "--dim", str(DIM),
         "--embedder", INFO.name, "--memory-budget-mb", str(budget_mb)],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env,
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
        "distinct_bases": distinct,
        "chunks_per_base": [low, high],
        "budget_mb": budget_mb,
        "malloc_arena_max": arena_max or None,
        "rounds": rounds,
        "store_mb": round(_store_bytes(root) / 2**20, 1),
        "build_s": round(built_s, 1),
        **row,
    }


def _store_bytes(root: Path) -> int:
    """The snapshots' bytes as a sidecar reads them: a linked copy counts as much as a file."""
    return sum(p.stat().st_size for p in root.rglob("*") if p.is_file())


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.many_bases", description=plain(__doc__))
    parser.add_argument("--bases", type=int, default=1000, help="bases served")
    parser.add_argument("--chunks", default="1000-5000", help="chunks per base, LOW-HIGH")
    parser.add_argument("--budget-mb", type=int, default=512, help="[sidecar] memory_budget_mb")
    parser.add_argument("--rounds", type=int, default=2, help="passes over the bases")
    parser.add_argument("--distinct", type=int, default=50, help="bases written; the rest copies")
    parser.add_argument("--malloc-arena-max", type=int, default=0, help="0: glibc's default")
    parser.add_argument("--quick", action="store_true", help="smoke mode: 50 bases")
    parser.add_argument("--out", type=Path, default=RESULTS, help="the JSON written")
    args = parser.parse_args(argv)
    low, high = (int(x) for x in args.chunks.split("-"))
    result = run(
        args.quick, args.bases, low, high, args.budget_mb, args.rounds, args.distinct,
        args.malloc_arena_max,
    )  # fmt: skip
    result["command"] = " ".join(["python -m bench.many_bases", *(argv or sys.argv[1:])])
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
