"""How every search system is measured, the same way for each: the timing loops and the summary.

A system is either synchronous (``search`` from the calling thread; ``client`` makes an
independent one for a worker thread) or asynchronous (``asearch`` on an event loop). Latency is a
sequential single client, one query at a time, after a warm-up, with the systems taking turns
(in blocks of queries, warm, and query by query, cold); throughput is ``concurrency`` clients at
once, each with its own connection as a separate caller has (threads, or tasks on one loop), over
a fixed number of queries, one system at a time.
"""

from __future__ import annotations

import asyncio
import socket
import threading
import time
from collections.abc import Awaitable, Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import AbstractAsyncContextManager
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

import numpy as np
import numpy.typing as npt

from bench.corpus import F32, Corpus, recall_at_k

SearchFn = Callable[[F32], Sequence[int]]
WARMUP = 50  # queries before timing: connections open, caches and branch predictors warm
WARM_BLOCK = 20  # queries a system answers in a row when timed warm: short, so a burst
# of load elsewhere still lands on every system
REWARM = 5  # untimed queries before each warm block: the other systems' turns evicted caches
# The ef values a system's setting is chosen from: the smallest reaching the target recall.
EF_LADDER = (10, 16, 24, 32, 40, 48, 64, 80, 96, 128, 192, 256, 384, 512)


def free_port() -> int:
    """A loopback port free now, for a server a benchmark starts (a sidecar's workers share one)."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


class Unavailable(Exception):
    """A system cannot run here (its package is missing, its server cannot start): skipped."""


@runtime_checkable
class SyncSystem(Protocol):
    name: str
    setting: dict[str, Any]

    def search(self, query: F32) -> Sequence[int]: ...

    def client(self) -> SearchFn:
        """An independent client (its own connection) for one worker thread."""
        ...

    def close(self) -> None: ...


AsyncSearchFn = Callable[[F32], Awaitable[Sequence[int]]]


@runtime_checkable
class AsyncSystem(Protocol):
    name: str
    setting: dict[str, Any]

    async def asearch(self, query: F32) -> Sequence[int]: ...

    def clients(self, n: int) -> AbstractAsyncContextManager[list[AsyncSearchFn]]:
        """``n`` independent clients (each its own connection), for concurrent tasks."""
        ...

    async def aclose(self) -> None: ...


System = SyncSystem | AsyncSystem


@dataclass(frozen=True, slots=True)
class Plan:
    """How much to measure: queries timed one by one, and queries spread over concurrent clients."""

    latency_queries: int
    throughput_queries: int
    concurrency: int = 16
    warmup: int = WARMUP


def percentiles_ms(samples_ns: npt.NDArray[np.int64]) -> dict[str, float]:
    ms = samples_ns.astype(np.float64) / 1e6
    return {
        "p50_ms": round(float(np.percentile(ms, 50)), 4),
        "p95_ms": round(float(np.percentile(ms, 95)), 4),
        "p99_ms": round(float(np.percentile(ms, 99)), 4),
        "mean_ms": round(float(ms.mean()), 4),
    }


def _pad(ids: Sequence[int], k: int) -> list[int]:
    out = [int(i) for i in ids[:k]]
    return out + [-1] * (k - len(out))


def summarise(
    corpus: Corpus, latencies_ns: npt.NDArray[np.int64], found: npt.NDArray[np.int64]
) -> dict[str, Any]:
    """The latency and recall part of the row the JSON keeps for one system."""
    return {
        "recall_at_10": round(recall_at_k(found, corpus.truth[: len(found)]), 4),
        **percentiles_ms(latencies_ns),
        "queries": len(latencies_ns),
    }


async def _one(system: System, query: F32) -> Sequence[int]:
    if isinstance(system, AsyncSystem):
        return await system.asearch(query)
    return system.search(query)


async def interleaved(
    systems: Sequence[System],
    queries: F32,
    plan: Plan,
    k: int,
    limits: dict[str, int],
    block: int = 1,
) -> dict[str, tuple[npt.NDArray[np.int64], npt.NDArray[np.int64]]]:
    """Latency and results of each system, the systems taking turns: A answers queries i to
    i + block, then B answers the same ones, and so on, so that a burst of load elsewhere on the
    machine falls on every system alike. Synchronous systems are called on this loop's thread.

    With ``block=1`` every call follows other systems' work (cold caches, a process woken from
    sleep), as a sidecar called once per caller turn sees it; with a larger block each system
    runs warm, as under steady traffic, after ``REWARM`` untimed queries at the start of each
    block. ``limits`` caps the timed queries of a slow system (exact search over a large corpus).
    """
    for system in systems:
        for q in queries[: plan.warmup]:
            await _one(system, q)
    counts = {
        s.name: min(plan.latency_queries, limits.get(s.name, plan.latency_queries)) for s in systems
    }
    lat = {s.name: np.empty(counts[s.name], dtype=np.int64) for s in systems}
    found = {s.name: np.empty((counts[s.name], k), dtype=np.int64) for s in systems}
    for first in range(0, plan.latency_queries, block):
        for system in systems:
            rows = range(first, min(first + block, counts[system.name]))
            if block > 1 and len(rows):
                for j in range(REWARM):
                    await _one(system, queries[-1 - j])  # never timed, never scored
            for i in rows:
                start = time.perf_counter_ns()
                ids = await _one(system, queries[i])
                lat[system.name][i] = time.perf_counter_ns() - start
                found[system.name][i] = _pad(ids, k)
    return {name: (lat[name], found[name]) for name in lat}


async def throughput(system: System, queries: F32, plan: Plan) -> float:
    """Queries per second with ``plan.concurrency`` clients: tasks for async systems, else threads."""
    if isinstance(system, AsyncSystem):
        async with system.clients(plan.concurrency) as searches:
            return await qps_tasks(searches, queries, plan)
    return await asyncio.to_thread(qps_threads, system, queries, plan)


def qps_threads(system: SyncSystem, queries: F32, plan: Plan) -> float:
    """Queries per second with ``concurrency`` threads, each with its own client."""
    per = max(1, plan.throughput_queries // plan.concurrency)
    started: list[float] = []
    # the clock starts as the last thread arrives, before any is released
    ready = threading.Barrier(plan.concurrency, action=lambda: started.append(time.perf_counter()))

    def worker(offset: int) -> None:
        search = system.client()
        search(queries[offset % len(queries)])  # connect before the clock starts
        ready.wait()
        for i in range(per):
            search(queries[(offset + i) % len(queries)])

    with ThreadPoolExecutor(plan.concurrency) as pool:
        futures = [pool.submit(worker, t * per) for t in range(plan.concurrency)]
        for f in futures:
            f.result()
        elapsed = time.perf_counter() - started[0]
    return per * plan.concurrency / elapsed


async def qps_tasks(searches: Sequence[AsyncSearchFn], queries: F32, plan: Plan) -> float:
    """Queries per second with one task per client on this loop, each one query at a time."""
    per = max(1, plan.throughput_queries // len(searches))
    for t, search in enumerate(searches):  # connect before the clock starts
        await search(queries[t % len(queries)])

    async def worker(search: AsyncSearchFn, offset: int) -> None:
        for i in range(per):
            await search(queries[(offset + i) % len(queries)])

    start = time.perf_counter()
    await asyncio.gather(*(worker(search, t * per) for t, search in enumerate(searches)))
    return per * len(searches) / (time.perf_counter() - start)


def choose_ef(search_at: Callable[[int], SearchFn], corpus: Corpus, target: float) -> int:
    """The smallest ef on EF_LADDER whose recall@k on the calibration queries reaches ``target``.

    Every approximate peer gets its setting this one way, on queries that are never timed.
    """
    ef = EF_LADDER[-1]
    for ef in EF_LADDER:
        if ef >= corpus.spec.k and calibration_recall(search_at(ef), corpus) >= target:
            return ef
    return ef


def calibration_recall(search: SearchFn, corpus: Corpus) -> float:
    """recall@k of ``search`` on the calibration queries (never the timed ones)."""
    k = corpus.spec.k
    found = np.array([_pad(search(q), k) for q in corpus.calibration], dtype=np.int64)
    return recall_at_k(found, corpus.calibration_truth)
