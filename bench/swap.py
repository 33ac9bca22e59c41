"""Snapshot swaps under load: ``python -m bench.swap [--quick]``.

1. Under load: a sidecar (``voxrecall serve``, its own process, the real local embedder) polls a
   local store every 0.25 s while 16 concurrent callers send ``Turn`` and ``Search`` over loopback
   gRPC; a new version is published every few seconds (at least 20 times). Counts failed calls and
   compares p50/p99 latency of calls overlapping a swap window (from publishing to 0.5 s after the
   first answer from the new version, about a second) with the calls outside every window.
2. Swap cost: for 10k and 100k chunks, in a fresh process serving one snapshot, the time to
   fetch (sha256 of every file), load (the other checks, parse, hnswlib load) and warm the next
   one, as the refresher does; the event loop's longest stall in each phase (a 1 ms ticker) and
   the garbage collector's longest pause; and the peak RSS while both are held.

Snapshots are synthetic: random unit vectors recorded under the local embedder's name and 384
dimensions (so the sidecar accepts them), words drawn from a small vocabulary. Questions repeat
from a pool of 256, so after the first round their embeddings come from the query cache: the
figures are transport, search and swap interference, not the model. Writes
``bench/results/swap.json``; built snapshots are cached in ``bench/.cache/swap/``.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import gc
import json
import os
import platform
import resource
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import numpy as np
from grpc_health.v1 import health_pb2, health_pb2_grpc

from bench.measure import free_port
from bench.report import plain
from index.embedders.base import EmbedderInfo, normalise
from index.snapshot import (
    FORMAT_VERSION,
    MANIFEST,
    Manifest,
    load_snapshot,
    write_atomic,
    write_snapshot,
)
from index.store import LocalStore, manifest_files, new_version_id
from index.types import Chunk
from sidecar.gen import retrieval_pb2 as pb
from sidecar.gen import retrieval_pb2_grpc as pb_grpc
from sidecar.snapshots.holder import SnapshotHolder
from sidecar.snapshots.refresh import freeze_heap, warm_up
from sidecar.snapshots.searcher import Searcher

RESULTS = Path(__file__).resolve().parent / "results" / "swap.json"
CACHE = Path(__file__).resolve().parent / ".cache" / "swap"
KB = "bench"
INFO = EmbedderInfo(name="local/all-MiniLM-L6-v2-int8", dimension=384)  # as the sidecar's model
CONCURRENCY = 16
POLL_S = 0.25  # short, so a swap follows a publish within a window of about a second
AFTER_SWAP_S = 0.5  # how long after the first answer from a new version still counts as "around"
TICK_S = 0.001  # the loop-lag probe's period during a measured swap
CALL_TIMEOUT_S = 5.0  # far above any healthy call; a call that hits it counts as failed
START_TIMEOUT_S = 120.0
_WORDS = (
    "plan price roaming voicemail password invoice refund router signal data minutes texts "
    "contract upgrade device sim card number transfer account login security billing support "
    "coverage network europe travel abroad family share limit speed outage repair warranty"
).split()
QUESTIONS = [
    f"How do I change the {_WORDS[i % len(_WORDS)]} on my {_WORDS[(i * 7 + 3) % len(_WORDS)]} "
    f"{_WORDS[(i * 13 + 5) % len(_WORDS)]}?"
    for i in range(256)
]


# -- snapshots -------------------------------------------------------------------------------


def synthetic_snapshot(folder: Path, n: int, version: str) -> Manifest:
    """A snapshot of ``n`` synthetic chunks with random unit vectors, written into ``folder``."""
    rng = np.random.default_rng(n)
    words = np.asarray(_WORDS)
    chunks = [
        Chunk(
            chunk_id=f"c{i}",
            source="synthetic",
            source_path=f"page-{i // 10}.md",
            title=f"Page {i // 10}",
            breadcrumbs=(f"Page {i // 10}", f"Section {i % 10}"),
            text=" ".join(rng.choice(words, size=60)),
            embed_text=f"Page {i // 10} > Section {i % 10}\n" + " ".join(rng.choice(words, 60)),
        )
        for i in range(n)
    ]
    vectors = normalise(rng.normal(size=(n, INFO.dimension)).astype(np.float32))
    pages = {f"synthetic:page-{p}.md": f"Page {p} text." for p in range((n + 9) // 10)}
    return write_snapshot(
        folder,
        knowledge_base=KB,
        version=version,
        embedder=INFO,
        chunks=chunks,
        vectors=vectors,
        pages=pages,
        page_count=len(pages),
        hnsw_m=16,
        hnsw_ef_construction=100,
        target_recall=0.95,
        sources=["synthetic"],
    )


def cached_snapshot(n: int, cache: Path = CACHE) -> tuple[Path, float]:
    """A built synthetic snapshot of ``n`` chunks (cached across runs), and its build seconds."""
    folder = cache / f"{n}-f{FORMAT_VERSION}" / KB / "v0"  # a format change rebuilds
    if (folder / MANIFEST).is_file():
        return folder, 0.0
    shutil.rmtree(folder, ignore_errors=True)
    start = time.perf_counter()
    synthetic_snapshot(folder, n, "v0")
    return folder, time.perf_counter() - start


def publish_copy(base: Path, store: LocalStore, version: str) -> None:
    """Publish ``base`` again as ``version``: hard links to its data files, a new manifest."""
    manifest = Manifest.from_json((base / MANIFEST).read_bytes(), str(base))
    staging = store.staging_dir(KB)
    for name in manifest_files(manifest, str(base)):
        os.link(base / name, staging / name)
    write_atomic(staging / MANIFEST, dataclasses.replace(manifest, version=version).to_json())
    store.publish(KB, staging, version, keep=3)


# -- part 1: swaps under load ------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Call:
    start: float
    seconds: float
    kind: str
    code: str
    version: str
    degraded: bool


class Versions:
    """When each snapshot version first answered a call; a swap waits for its version here."""

    def __init__(self) -> None:
        self.first_seen: dict[str, float] = {}
        self._waiting: dict[str, asyncio.Event] = {}

    def saw(self, version: str, at: float) -> None:
        if version and version not in self.first_seen:
            self.first_seen[version] = at
            self._waiting.setdefault(version, asyncio.Event()).set()

    async def wait(self, version: str, timeout_s: float) -> float | None:
        event = self._waiting.setdefault(version, asyncio.Event())
        try:
            await asyncio.wait_for(event.wait(), timeout_s)
        except TimeoutError:
            return None
        return self.first_seen[version]


def write_config(folder: Path, store: Path, port: int) -> Path:
    (folder / "empty").mkdir(exist_ok=True)
    path = folder / "voxrecall.toml"
    path.write_text(
        f"""
[[knowledge_base]]
name = "{KB}"
[[knowledge_base.source]]
type = "markdown"
path = "empty"

[index]
store = "{store}"

[sidecar]
listen = "127.0.0.1:{port}"
store = "{store}"
poll_seconds = {POLL_S}
min_score = -1.0
""",
        encoding="utf-8",
    )
    return path


async def wait_serving(port: int, proc: subprocess.Popen[bytes]) -> None:
    deadline = time.monotonic() + START_TIMEOUT_S
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
        health = health_pb2_grpc.HealthStub(channel)
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                raise RuntimeError(f"the sidecar exited with {proc.returncode}")
            try:
                resp = await health.Check(health_pb2.HealthCheckRequest(), timeout=2)
                if resp.status == health_pb2.HealthCheckResponse.SERVING:
                    return
            except grpc.aio.AioRpcError:
                pass
            await asyncio.sleep(0.2)
    raise TimeoutError("the sidecar did not become SERVING")


async def caller(
    i: int,
    client: pb_grpc.RetrievalStub,
    stop: asyncio.Event,
    calls: list[Call],
    versions: Versions,
) -> None:
    n = 0
    while not stop.is_set():
        question = QUESTIONS[(i * 17 + n) % len(QUESTIONS)]
        kind = "Turn" if (i + n) % 2 else "Search"
        start = time.perf_counter()
        try:
            resp: Any
            if kind == "Turn":
                resp = await client.Turn(
                    pb.TurnRequest(session_id=f"caller-{i}", text=question, is_final=True),
                    timeout=CALL_TIMEOUT_S,
                )
            else:
                resp = await client.Search(pb.SearchRequest(query=question), timeout=CALL_TIMEOUT_S)
            code, version, degraded = "OK", resp.snapshot_version, resp.degraded
        except grpc.aio.AioRpcError as exc:
            code, version, degraded = exc.code().name, "", False
        end = time.perf_counter()
        calls.append(Call(start, end - start, kind, code, version, degraded))
        versions.saw(version, end)
        n += 1


def percentiles(seconds: list[float]) -> dict[str, float]:
    if not seconds:
        return {"calls": 0}
    ms = np.asarray(seconds) * 1000.0
    return {
        "calls": len(ms),
        "p50_ms": float(np.percentile(ms, 50)),
        "p99_ms": float(np.percentile(ms, 99)),
        "max_ms": float(ms.max()),
    }


def under_load(
    chunks: int, swaps: int, period_s: float, warmup_s: float, cache: Path = CACHE
) -> dict[str, Any]:
    """Start a sidecar process on a store holding one version, then drive calls and swaps."""
    base, _ = cached_snapshot(chunks, cache)
    with tempfile.TemporaryDirectory(prefix="voxrecall-swap-") as tmp:
        folder = Path(tmp)
        store = LocalStore(folder / "store")
        publish_copy(base, store, new_version_id("00000000"))
        port = free_port()
        config = write_config(folder, store.root, port)
        log = (folder / "sidecar.log").open("wb")
        proc = subprocess.Popen(
            [sys.executable, "-m", "sidecar.cli", "serve", "--config", str(config)],
            stdout=log,
            stderr=subprocess.STDOUT,
        )
        try:
            asyncio.run(wait_serving(port, proc))
            result = asyncio.run(_drive(port, store, base, swaps, period_s, warmup_s))
            result["server_peak_rss_mb"] = _vm_hwm_mb(proc.pid)
        finally:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
            log.close()
    result["snapshot_chunks"] = chunks
    return result


async def _drive(
    port: int, store: LocalStore, base: Path, swaps: int, period_s: float, warmup_s: float
) -> dict[str, Any]:
    calls: list[Call] = []
    versions = Versions()
    windows: list[tuple[float, float]] = []
    lags: list[float] = []
    published: list[str] = []
    stop = asyncio.Event()
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
        client = pb_grpc.RetrievalStub(channel)  # type: ignore[no-untyped-call]
        tasks = [
            asyncio.ensure_future(caller(i, client, stop, calls, versions))
            for i in range(CONCURRENCY)
        ]
        await asyncio.sleep(warmup_s)
        measured_from = time.perf_counter()
        await asyncio.sleep(period_s)
        for k in range(1, swaps + 1):
            version = new_version_id(f"{k:08x}")
            published.append(version)
            t_pub = time.perf_counter()
            await asyncio.to_thread(publish_copy, base, store, version)
            seen = await versions.wait(version, timeout_s=30.0)
            if seen is not None:
                lags.append(seen - t_pub)
                windows.append((t_pub, seen + AFTER_SWAP_S))
            await asyncio.sleep(max(0.0, t_pub + period_s - time.perf_counter()))
        stop.set()
        await asyncio.gather(*tasks)

    measured = [c for c in calls if c.start >= measured_from]
    around = [c for c in measured if any(_overlaps(c, w) for w in windows)]
    steady = [c for c in measured if not any(_overlaps(c, w) for w in windows)]
    failed = [c for c in measured if c.code != "OK"]
    steady_p = percentiles([c.seconds for c in steady if c.code == "OK"])
    around_p = percentiles([c.seconds for c in around if c.code == "OK"])
    return {
        "concurrency": CONCURRENCY,
        "poll_seconds": POLL_S,
        "swaps_published": len(published),
        "swaps_observed": len(windows),
        "calls": len(measured),
        "calls_per_s": len(measured) / (time.perf_counter() - measured_from),
        "failed": len(failed),
        "failed_by_code": {
            code: sum(c.code == code for c in failed) for code in {c.code for c in failed}
        },
        "degraded": sum(c.degraded for c in measured),
        "unknown_version_answers": sum(
            1
            for c in measured
            if c.code == "OK" and c.version not in {*published, *versions.first_seen}
        ),
        "steady": steady_p,
        "around_swaps": around_p,
        "ratio_p50": around_p.get("p50_ms", 0.0) / max(steady_p.get("p50_ms", 1.0), 1e-9),
        "ratio_p99": around_p.get("p99_ms", 0.0) / max(steady_p.get("p99_ms", 1.0), 1e-9),
        "publish_to_first_answer_ms": {
            "p50": float(np.percentile(lags, 50)) * 1000 if lags else None,
            "max": max(lags) * 1000 if lags else None,
        },
        "window_s_mean": float(np.mean([b - a for a, b in windows])) if windows else None,
    }


def _overlaps(call: Call, window: tuple[float, float]) -> bool:
    return call.start < window[1] and call.start + call.seconds > window[0]


def _vm_hwm_mb(pid: int) -> float | None:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    except OSError:
        return None
    return None


# -- part 2: what one swap costs ----------------------------------------------------------------


def _status_mb(field: str) -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(f"{field}:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def _reset_peak() -> bool:
    """Reset the kernel's peak-RSS mark (VmHWM), so the next peak is the swap's own."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
    except OSError:
        return False
    return True


def _peak_mb(reset: bool) -> float:
    if reset:
        return _status_mb("VmHWM")
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux; never reset


class GcPauses:
    """The garbage collector's pauses while installed: the longest, and the total, in seconds."""

    def __init__(self) -> None:
        self.longest = 0.0
        self.total = 0.0
        self.collections = 0
        self._began = 0.0

    def __enter__(self) -> GcPauses:
        gc.callbacks.append(self._on_gc)
        return self

    def __exit__(self, *exc: object) -> None:
        gc.callbacks.remove(self._on_gc)

    def _on_gc(self, phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            self._began = time.perf_counter()
            return
        took = time.perf_counter() - self._began
        self.longest = max(self.longest, took)
        self.total += took
        self.collections += 1


async def _swap_off_the_loop(
    store: LocalStore, version: str
) -> tuple[Any, list[float], list[tuple[float, float]]]:
    """Fetch, load and warm in worker threads as the refresher does, while a 1 ms ticker on the
    loop records how late it wakes: the stall a call would feel. Returns the snapshot, the phase
    ends, and each tick's (wake time, lag)."""
    done = asyncio.Event()
    ticks: list[tuple[float, float]] = []

    async def ticker() -> None:
        while not done.is_set():
            start = time.perf_counter()
            await asyncio.sleep(TICK_S)
            now = time.perf_counter()
            ticks.append((now, now - start - TICK_S))

    tick = asyncio.ensure_future(ticker())
    await asyncio.sleep(0)  # the ticker is waiting before the first phase starts
    ends = [time.perf_counter()]
    fetched = await asyncio.to_thread(store.fetch, KB, version)
    ends.append(time.perf_counter())
    # the refresher's call: fetch checked every file's sha256 (the SnapshotStore contract)
    snapshot = await asyncio.to_thread(load_snapshot, fetched, INFO, checksums=False)
    ends.append(time.perf_counter())
    searcher = await asyncio.to_thread(warm_up, snapshot)
    ends.append(time.perf_counter())
    done.set()
    await tick
    return searcher, ends, ticks


def _worst_lag_ms(ticks: list[tuple[float, float]], start: float, end: float) -> float:
    """The longest loop stall of the ticks that woke up in [start, end]."""
    return 1000 * max((lag for at, lag in ticks if start <= at <= end), default=0.0)


def measure_swap(folder: Path) -> dict[str, Any]:
    """In this (fresh) process: serve one snapshot, then fetch, load and warm the next."""
    store = LocalStore(folder.parent.parent)
    rss_start = _status_mb("VmRSS")
    holder = SnapshotHolder()
    holder.publish(
        Searcher.build(load_snapshot(store.fetch(KB, folder.name), INFO, checksums=False))
    )
    freeze_heap()  # as the refresher does after each swap
    rss_serving = _status_mb("VmRSS")
    peak_first_load = _status_mb("VmHWM")
    reset = _reset_peak()
    with GcPauses() as pauses:
        searcher, (t0, t1, t2, t3), ticks = asyncio.run(_swap_off_the_loop(store, folder.name))
    holder.publish(searcher)
    snapshot = searcher.snapshot
    peak = _peak_mb(reset)
    stalls = [_worst_lag_ms(ticks, a, b) for a, b in ((t0, t1), (t1, t2), (t2, t3 + 1.0))]
    return {
        "chunks": len(snapshot.chunks),
        "files_mb": sum(p.stat().st_size for p in folder.iterdir()) / 2**20,
        "fetch_verify_s": t1 - t0,
        "load_s": t2 - t1,
        "warm_s": t3 - t2,
        "swap_total_s": t3 - t0,
        "loop_stall_max_ms": max(stalls),
        "loop_stall_max_ms_by_phase": dict(zip(("fetch", "load", "warm"), stalls, strict=True)),
        "loop_lag_p99_ms": float(np.percentile([lag for _, lag in ticks], 99)) * 1000,
        "gc_pause_max_ms": pauses.longest * 1000,
        "gc_pause_total_ms": pauses.total * 1000,
        "gc_collections": pauses.collections,
        "rss_at_start_mb": rss_start,
        "rss_serving_one_mb": rss_serving,
        "peak_rss_first_load_mb": peak_first_load,
        "peak_rss_during_swap_mb": peak,
        "peak_reset_before_swap": reset,  # False: the peak may be the first load's
        "swap_extra_peak_mb": peak - rss_serving,
    }


def swap_cost(n: int, cache: Path = CACHE) -> dict[str, Any]:
    folder, build_s = cached_snapshot(n, cache)
    done = subprocess.run(
        [sys.executable, "-m", "bench.swap", "--measure-swap", str(folder)],
        capture_output=True,
        check=True,
    )
    result: dict[str, Any] = json.loads(done.stdout)
    result["build_s"] = build_s or None  # None: reused from bench/.cache
    return result


# -- entry point -------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=plain(__doc__))
    parser.add_argument("--quick", action="store_true", help="smoke mode: few swaps, small sizes")
    parser.add_argument("--out", type=Path, default=RESULTS, help="the JSON written")
    parser.add_argument("--measure-swap", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.measure_swap is not None:
        result = measure_swap(args.measure_swap)
        print(json.dumps(result))
        return result

    if args.quick:
        load_chunks, swaps, period_s, warmup_s, sizes = 2_000, 4, 2.0, 2.0, [2_000]
    else:
        load_chunks, swaps, period_s, warmup_s, sizes = 10_000, 24, 2.5, 3.0, [10_000, 100_000]
    print(f"swap cost for {sizes} chunks ...", flush=True)
    costs = [swap_cost(n) for n in sizes]
    print(f"{swaps} swaps of {load_chunks} chunks under {CONCURRENCY} concurrent calls ...")
    loaded = under_load(load_chunks, swaps, period_s, warmup_s)
    result = {
        "quick": args.quick,
        "under_load": loaded,
        "swap_cost": costs,
        "notes": "synthetic snapshots: random unit vectors under the local model's name and 384 "
        "dimensions; questions repeat from a pool of 256 (query embeddings cached after the "
        "first round); sidecar and callers share the machine's cores",
        "env": {
            "python": platform.python_version(),
            "machine": platform.machine(),
            "cpus": os.cpu_count(),
        },
    }
    _print(result)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n", encoding="utf-8")
    print(f"wrote {args.out}")
    return result


def _print(result: dict[str, Any]) -> None:
    u = result["under_load"]
    steady, around = u["steady"], u["around_swaps"]
    print(
        f"  {u['swaps_observed']}/{u['swaps_published']} swaps, {u['calls']} calls "
        f"({u['calls_per_s']:.0f}/s), {u['failed']} failed, {u['degraded']} degraded"
    )
    print(
        f"  steady p50/p99 {steady.get('p50_ms', 0):.1f}/{steady.get('p99_ms', 0):.1f} ms; "
        f"around swaps {around.get('p50_ms', 0):.1f}/{around.get('p99_ms', 0):.1f} ms; "
        f"ratio {u['ratio_p50']:.2f}/{u['ratio_p99']:.2f}"
    )
    for c in result["swap_cost"]:
        print(
            f"  {c['chunks']:>7} chunks ({c['files_mb']:.0f} MB): swap {c['swap_total_s']:.2f} s "
            f"(fetch+sha {c['fetch_verify_s']:.2f}, load {c['load_s']:.2f}, "
            f"warm {c['warm_s']:.3f}), loop stalled up to {c['loop_stall_max_ms']:.0f} ms "
            f"(GC pauses up to {c['gc_pause_max_ms']:.0f} ms); "
            f"RSS serving {c['rss_serving_one_mb']:.0f} MB, "
            f"peak during swap {c['peak_rss_during_swap_mb']:.0f} MB "
            f"(+{c['swap_extra_peak_mb']:.0f})"
        )


if __name__ == "__main__":
    main()
