"""The ``scale`` suite: what a snapshot of N chunks costs the sidecar that serves it.

For each N (10k, 100k, and 1M where this machine's memory allows): the snapshot's size on disk,
the time a fresh sidecar process takes to verify and load it (``create_server`` until it
serves), that process's resident memory, and Search p50/p99 over loopback gRPC (query vectors
sent as bytes, as in the ``search`` suite). ``--quick`` also runs ``bench.many_bases`` in its
smoke mode (many small bases under a memory budget). Beside them, measured in the same run: a bare
``hnswlib.Index.load_index`` of the very same graph file in a process of its own (the floor a
load is judged against: ``raw_hnswlib_load_s``, and ``raw_index_mb``, what the graph and vectors
take in memory as hnswlib holds them), and a second worker process serving the same snapshot
beside the first (``worker_rss_mb``, and ``worker_private_mb``: its pages no other process
shares; the mapped chunk, page and lexical files are shared through the page cache). Vectors are the ``search`` suite's synthetic corpus
at 384 dimensions, the embedded model's. A size that is not run is extrapolated from the two
largest measured ones and marked so: linearly for size, load time and memory, and for latency
by the same step per tenfold N (an HNSW search grows with log N), each never below the largest
of the two measured (a figure smaller at the larger size is noise, not a trend).
"""

from __future__ import annotations

import asyncio
import json
import math
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from bench.corpus import CACHE, CorpusSpec, load_or_generate, recall_at_k
from bench.measure import Plan, interleaved, percentiles_ms, throughput
from bench.ours import SidecarProcess, Voxrecall, build_snapshot, embedder_info
from index.snapshot import VECTORS, read_manifest

DIM = 384
FULL_SIZES = (10_000, 100_000, 1_000_000)
QUICK_SIZES = (2_000, 10_000)
FULL_QUERIES = 500
QUICK_QUERIES = 100
# Peak bytes per chunk while building and then serving (vectors in the corpus, the build's
# copy, the graph, chunk objects and JSON, the lexical index), measured at 100k with margin.
BYTES_PER_CHUNK = DIM * 4 * 4 + 6_000


def _available_bytes() -> int:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def _rss_mb(pid: int) -> dict[str, float]:
    out = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        key, _, value = line.partition(":")
        if key in ("VmRSS", "VmHWM"):
            out["rss_mb" if key == "VmRSS" else "peak_rss_mb"] = round(
                int(value.split()[0]) / 1024, 1
            )
    return out


def _private_mb(pid: int) -> float:
    """The process's pages no other process shares (smaps_rollup Private_Clean + Private_Dirty)."""
    kb = 0
    for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines():
        key, _, value = line.partition(":")
        if key in ("Private_Clean", "Private_Dirty"):
            kb += int(value.split()[0])
    return round(kb / 1024, 1)


# A bare load of the graph file: what hnswlib itself takes, in time and memory.
RAW_LOAD = """
import json, sys, time, hnswlib
from pathlib import Path

def rss_kb():
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])

before = rss_kb()
index = hnswlib.Index(space="ip", dim=int(sys.argv[2]))
started = time.perf_counter()
index.load_index(sys.argv[1], max_elements=int(sys.argv[3]))
load_s = time.perf_counter() - started
print(json.dumps({"load_s": load_s, "index_mb": (rss_kb() - before) / 1024}))
"""


# Where a sidecar's load goes, in a fresh process: the snapshot as the refresher loads what its
# store fetched (mapped files checked, the graph read; its sha256 and layout were checked at
# fetch and recorded), the warm-up searches, and the follow-ups gazetteer (from entities.bin).
LOAD_PARTS = """
import json, sys, time
from pathlib import Path
from index.snapshot import load_snapshot
from sidecar.turn import followups
from sidecar.snapshots import refresh

started = time.perf_counter()
snapshot = load_snapshot(Path(sys.argv[1]), fetched=True)
loaded = time.perf_counter()
refresh.warm_searches(snapshot)
warmed = time.perf_counter()
followups.gazetteer(snapshot)
print(json.dumps({"snapshot_load_s": loaded - started, "warm_up_s": warmed - loaded,
                  "gazetteer_s": time.perf_counter() - warmed}))
"""


def load_parts(snapshot: Path) -> dict[str, float]:
    out = subprocess.run(
        [sys.executable, "-c", LOAD_PARTS, str(snapshot)],
        capture_output=True, text=True, check=True, timeout=3600,
        cwd=Path(__file__).resolve().parents[1],
    )  # fmt: skip
    return {key: round(value, 3) for key, value in json.loads(out.stdout).items()}


def raw_hnswlib_load(snapshot: Path) -> dict[str, float]:
    """``load_index`` of the snapshot's graph in a fresh process; the faster of two runs (the
    first warms the page cache, as the sidecar's load finds it warm)."""
    count = read_manifest(snapshot).chunks
    runs = []
    for _ in range(2):
        out = subprocess.run(
            [sys.executable, "-c", RAW_LOAD, str(snapshot / VECTORS), str(DIM), str(count)],
            capture_output=True, text=True, check=True, timeout=1800,
        )  # fmt: skip
        runs.append(json.loads(out.stdout))
    best = min(runs, key=lambda r: r["load_s"])
    return {
        "raw_hnswlib_load_s": round(best["load_s"], 3),
        "raw_index_mb": round(best["index_mb"], 1),
    }


def _size_mb(folder: Path) -> float:
    return round(sum(p.stat().st_size for p in folder.iterdir() if p.is_file()) / 2**20, 1)


def measure(n: int, queries: int, cache: Path) -> dict[str, Any]:
    corpus = load_or_generate(CorpusSpec(n=n, dim=DIM, queries=queries), cache)
    started = time.perf_counter()
    snapshot, built = build_snapshot(corpus, cache)
    row: dict[str, Any] = {"snapshot_mb": _size_mb(snapshot)}
    if built:
        row["build_s"] = round(time.perf_counter() - started, 1)
    row.update(raw_hnswlib_load(snapshot))
    row.update(load_parts(snapshot))
    row["snapshot_load_vs_raw"] = round(row["snapshot_load_s"] / row["raw_hnswlib_load_s"], 2)
    # two workers on one port, started one after the other (as ``voxrecall serve`` starts them)
    proc = SidecarProcess(snapshot.parent.parent, embedder_info(corpus), workers=2)
    try:
        first, second = proc.procs
        row["load_s"] = round(proc.infos[0]["load_s"], 3)
        row["load_vs_raw"] = round(row["load_s"] / max(row["raw_hnswlib_load_s"], 1e-6), 2)
        row.update(_rss_mb(first.pid))
        row["worker_load_s"] = round(proc.infos[1]["load_s"], 3)
        row["worker_rss_mb"] = _rss_mb(second.pid)["rss_mb"]
        row["worker_private_mb"] = _private_mb(second.pid)
        plan = Plan(latency_queries=queries, throughput_queries=queries)

        async def timed() -> tuple[Any, Any, float]:
            system = Voxrecall(proc.port, {})
            try:
                lat = await interleaved([system], corpus.queries, plan, corpus.spec.k, {})
                qps = await throughput(system, corpus.queries, plan)
                return *lat[system.name], qps
            finally:
                await system.aclose()

        latencies, found, qps = asyncio.run(timed())
    finally:
        proc.close()
    lat = percentiles_ms(latencies)
    row.update(search_p50_ms=lat["p50_ms"], search_p99_ms=lat["p99_ms"])
    row["qps_concurrent_16"] = round(qps, 1)
    row["recall_at_10"] = round(recall_at_k(found, corpus.truth), 4)
    row["ef_search"] = read_manifest(snapshot).hnsw.ef
    return row


# What grows with N in proportion: extrapolated linearly.
LINEAR = ("snapshot_mb", "load_s", "rss_mb", "raw_hnswlib_load_s", "raw_index_mb", "worker_rss_mb",
          "worker_private_mb")  # fmt: skip


def extrapolate(n: int, rows: dict[int, dict[str, Any]], why: str) -> dict[str, Any]:
    """``n``'s row projected from the two largest measured sizes, each figure at least the
    largest measured (nothing here shrinks as N grows: a smaller figure at the larger size is
    noise, and its step, carried out to 1M, went below zero: a p99 of -1.1 ms)."""
    (n1, a), (n2, b) = sorted(rows.items())[-2:]
    out: dict[str, Any] = {"extrapolated": why}
    for key in LINEAR:
        if key not in a or key not in b:
            continue
        slope = (b[key] - a[key]) / (n2 - n1)
        out[key] = round(max(b[key] + slope * (n - n2), a[key], b[key]), 1)
    decades = math.log10(n / n2) / math.log10(n2 / n1)
    for key in ("search_p50_ms", "search_p99_ms"):
        out[key] = round(max(b[key] + (b[key] - a[key]) * decades, a[key], b[key]), 3)
    return out


def run(
    quick: bool, *, sizes: tuple[int, ...] | None = None, cache: Path = CACHE
) -> dict[str, Any]:
    """Measure each size that fits in memory; extrapolate (and mark) the rest."""
    sizes = sizes or (QUICK_SIZES if quick else FULL_SIZES)
    queries = QUICK_QUERIES if quick else FULL_QUERIES
    planned = sizes if sizes != QUICK_SIZES else (*QUICK_SIZES, *FULL_SIZES[1:])
    rows: dict[int, dict[str, Any]] = {}
    for n in sorted(set(planned)):
        need = n * BYTES_PER_CHUNK
        if n not in sizes:
            why = "--quick measures only the small sizes"
        elif need > _available_bytes():
            why = f"needs ~{need / 2**30:.1f} GiB, {_available_bytes() / 2**30:.1f} GiB available"
        else:
            rows[n] = measure(n, queries, cache)
            continue
        if len(rows) < 2:
            rows[n] = {"skipped": f"{why}; too few measured sizes to extrapolate"}
        else:
            measured = {k: v for k, v in rows.items() if "extrapolated" not in v}
            rows[n] = extrapolate(n, measured, why)
    out: dict[str, Any] = {
        "suite": "scale",
        "dim": DIM,
        "queries": queries,
        "sizes": {str(n): r for n, r in rows.items()},
    }
    if quick:  # the full run is its own command: python -m bench.many_bases
        from bench import many_bases

        out["many_bases"] = many_bases.run(True)
    return out
