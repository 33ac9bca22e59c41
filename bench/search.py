"""The ``search`` suite: top-10 latency, recall and throughput of voxrecall beside its peers.

Every system answers the same seeded queries over the same corpus (``bench.corpus``), measured
the same way (``bench.measure``): a sequential single client, the systems taking turns so that
load elsewhere on the machine falls on all alike, first in blocks of 20 queries (warm: the
p50/p95/p99), then query by query (cold: every call after the other systems' work, as a sidecar
called once per caller turn meets it); then 16 concurrent clients, one system at a time. Servers
(the sidecar, PostgreSQL, Chroma) run in their own processes on 127.0.0.1 and are all stopped at
the end, also on error. The goals of issue 7 are checked on the ratios of this one run, so a
noisy machine moves the figures but not the verdicts; against pgvector, warm p50, cold p50 and
qps x16 are each a goal, and ``versus_pgvector`` says which system is ahead on each, since they
have disagreed (a warm p50 ahead while pgvector answered cold calls and 16 clients faster).
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib
import importlib.util
import logging
import os
import time
import traceback
from collections.abc import Callable
from dataclasses import replace
from functools import partial
from pathlib import Path
from typing import Any

from bench.corpus import CACHE, Corpus, CorpusSpec, load_or_generate
from bench.measure import (
    WARM_BLOCK,
    AsyncSystem,
    Plan,
    SyncSystem,
    System,
    Unavailable,
    calibration_recall,
    choose_ef,
    interleaved,
    percentiles_ms,
    summarise,
    throughput,
)
from bench.ours import HNSW, GrpcEcho, SidecarProcess, Voxrecall, build_snapshot, embedder_info
from bench.systems import Hnswlib, NumpyExact

log = logging.getLogger("bench.search")

FULL = {"n": 100_000, "dim": 1536, "queries": 1000, "throughput": 2000}
QUICK = {"n": 20_000, "dim": 384, "queries": 200, "throughput": 400}
EXACT_QUERIES = 200  # numpy-exact scans every vector: ~1 s a query at 1M, and its recall is 1
PEERS = {  # name -> module under bench.peers
    "faiss-hnsw": "faiss_hnsw",
    "pgvector": "pgvector",
    "chroma": "chroma",
    "qdrant": "qdrant_edge",
}
# the packages each peer imports, checked before it is opened: a missing one is a skipped row
# saying what to install, with no "opening" line before it
REQUIRES = {
    "faiss-hnsw": ("faiss",),
    "pgvector": ("pgserver", "psycopg", "pgvector"),
    "chroma": ("chromadb",),
    "qdrant": ("qdrant_edge",),
}
INSTALL = "pip install -e '.[bench]'"
# grpc-knn: the sidecar's graph searched in a bare method of its process, answering the echo's
# bytes: what any Python gRPC server pays for a Search, with no code of the sidecar's on the call
KNN = "grpc-knn"
SERVED = ("voxrecall", "grpc-echo", KNN)  # the systems the sidecar's process serves
CORE = ("numpy-exact", "hnswlib", *SERVED)
# voxrecall again, at the ef where its graph reaches pgvector's recall on the calibration
# queries: the goal compares the two at equal recall, and the default ef may land lower.
MATCHED = "voxrecall-matched"
ALL = (*CORE, MATCHED, *PEERS)
APPROXIMATE = ("hnswlib", "voxrecall", MATCHED, "faiss-hnsw", "pgvector", "chroma", "qdrant")
MIN_RECALL = 0.95
# The sidecar runs as a deployment on this machine would: one worker process per core
# ([sidecar] workers), as PostgreSQL serves each connection from a process of its own.
WORKERS = os.cpu_count() or 1


def _not_installed(name: str) -> str | None:
    """Why ``name`` cannot run here for want of a package, or None."""
    missing = [m for m in REQUIRES[name] if importlib.util.find_spec(m) is None]
    return f"{', '.join(missing)} not installed ({INSTALL})" if missing else None


def _open_peer(name: str, corpus: Corpus, cache: Path) -> SyncSystem | dict[str, Any]:
    """The opened peer, or its ``{"skipped": reason}`` row."""
    if why := _not_installed(name):
        return {"skipped": why}
    module = importlib.import_module(f"bench.peers.{PEERS[name]}")
    opener: Callable[[Corpus, Path, float], SyncSystem] = module.open_system
    started = time.perf_counter()
    log.info("opening %s (a first run builds its index: minutes at 100k x 1536)", name)
    try:
        system = opener(corpus, cache, HNSW.target_recall)
    except Unavailable as exc:
        return {"skipped": str(exc)}
    except Exception as exc:  # a peer that breaks is reported, and the others still run
        traceback.print_exc()
        return {"skipped": f"failed: {type(exc).__name__}: {exc}"}
    system.setting["open_s"] = round(time.perf_counter() - started, 1)
    return system


async def _measure(
    sync: list[SyncSystem],
    makers: list[Callable[[], AsyncSystem]],
    corpus: Corpus,
    plan: Plan,
) -> dict[str, dict[str, Any]]:
    opened = [make() for make in makers]  # grpc.aio channels belong to the loop they start on
    try:
        systems: list[System] = sorted([*sync, *opened], key=lambda s: ALL.index(s.name))
        log.info("timing %s, taking turns query by query", ", ".join(s.name for s in systems))
        limits = {"numpy-exact": EXACT_QUERIES}
        k = corpus.spec.k
        timed = await interleaved(systems, corpus.queries, plan, k, limits, block=WARM_BLOCK)
        engines = {
            s.name: s.server_timings(plan.latency_queries)
            for s in systems
            if isinstance(s, Voxrecall)
        }
        log.info("timing again query by query (cold)")
        cold = await interleaved(systems, corpus.queries, plan, k, limits, block=1)
        rows = {}
        for system in systems:
            log.info("throughput of %s", system.name)
            own = replace(
                plan,
                throughput_queries=min(
                    plan.throughput_queries, limits.get(system.name, plan.throughput_queries)
                ),
            )
            qps = await throughput(system, corpus.queries, own)
            cold_ms = percentiles_ms(cold[system.name][0])
            rows[system.name] = {
                **summarise(corpus, *timed[system.name]),
                f"qps_concurrent_{plan.concurrency}": round(qps, 1),
                "cold_p50_ms": cold_ms["p50_ms"],
                "cold_p99_ms": cold_ms["p99_ms"],
                **engines.get(system.name, {}),
                "setting": system.setting,
            }
        return rows
    finally:
        for system in opened:
            await system.aclose()


def _served(
    wanted: set[str], proc: SidecarProcess, setting: dict[str, Any]
) -> list[Callable[[], AsyncSystem]]:
    """The wanted systems the sidecar's process serves: the sidecar, its echo, the bare search."""
    response_bytes = proc.info["response_bytes"]
    makers: dict[str, Callable[[], AsyncSystem]] = {
        "voxrecall": partial(Voxrecall, proc.port, setting),
        "grpc-echo": partial(GrpcEcho, proc.echo_port, response_bytes),
        KNN: partial(GrpcEcho, proc.echo_port, response_bytes, "Knn", KNN),
    }
    return [make for name, make in makers.items() if name in wanted]


def _measure_all(
    corpus: Corpus, cache: Path, plan: Plan, wanted: set[str], unwanted: str
) -> dict[str, dict[str, Any]]:
    """Open every wanted system, time them together, and close them all, also on error; a peer
    not wanted is a row skipped for the reason ``unwanted``."""
    rows: dict[str, dict[str, Any]] = {}
    sync: list[SyncSystem] = []
    makers: list[Callable[[], AsyncSystem]] = []
    floor: Hnswlib | None = None
    with contextlib.ExitStack() as stack:
        if "numpy-exact" in wanted:
            sync.append(NumpyExact(corpus))
        if wanted & {"hnswlib", *SERVED}:
            started = time.perf_counter()
            log.info(
                "voxrecall's snapshot of %d vectors: from the cache, or built (a first run: "
                "minutes at 100k x 1536)",
                corpus.spec.n,
            )
            snapshot, built = build_snapshot(corpus, cache)
            build_s = round(time.perf_counter() - started, 1)
            log.info("snapshot %s in %.1f s", "built" if built else "read from the cache", build_s)
            floor = Hnswlib(corpus, snapshot)
            if "hnswlib" in wanted:
                sync.append(floor)
            setting = {**floor.setting, "transport": "grpc tcp 127.0.0.1"}
            if built:
                setting["build_s"] = build_s
            if wanted & set(SERVED):
                log.info("starting a sidecar process on the snapshot (%d workers)", WORKERS)
                proc = SidecarProcess(
                    snapshot.parent.parent, embedder_info(corpus), workers=WORKERS
                )
                stack.callback(proc.close)
                setting["load_s"] = round(proc.info["load_s"], 2)
                setting["workers"] = WORKERS
                makers.extend(_served(wanted, proc, setting))
        for name in PEERS:
            if name not in wanted:
                rows[name] = {"skipped": unwanted}
                continue
            peer = _open_peer(name, corpus, cache)
            if isinstance(peer, dict):
                rows[name] = peer
            else:
                stack.callback(peer.close)
                sync.append(peer)
        if MATCHED in wanted:
            pg = next((s for s in sync if s.name == "pgvector"), None)
            if pg is None or floor is None:
                rows[MATCHED] = {"skipped": "matches pgvector's recall: needs pgvector and hnswlib"}
            else:
                target = calibration_recall(pg.search, corpus)
                ef = choose_ef(floor.at, corpus, target)
                floor.at(floor.setting["ef_search"])  # back to the snapshot's own
                other = SidecarProcess(
                    snapshot.parent.parent, embedder_info(corpus), ef_search=ef, workers=WORKERS
                )
                stack.callback(other.close)
                matched = {**setting, "ef_search": ef, "calibration_recall_to_reach": target}
                makers.append(partial(Voxrecall, other.port, matched, name=MATCHED))
        rows.update(asyncio.run(_measure(sync, makers, corpus, plan)))
    for name in ("grpc-echo", KNN):  # the one searches nothing, neither answers what it found
        if name in rows:
            rows[name]["recall_at_10"] = None
    return rows


def _ratio(a: float, b: float) -> float:
    return round(a / b, 3) if b else float("inf")


PGVECTOR_GOALS = (
    "voxrecall_p50_over_pgvector",
    "voxrecall_cold_p50_over_pgvector",
    "voxrecall_qps_over_pgvector",
)
# (metric, row key, True when more is better): the three a "faster than pgvector?" answer needs
VERSUS = (("warm p50 ms", "p50_ms", False), ("cold p50 ms", "cold_p50_ms", False),
          ("qps x16", "qps_concurrent_16", True))  # fmt: skip


def _compared(vox: dict[str, Any], pg: dict[str, Any], ok: dict[str, Any]) -> str:
    """voxrecall's row compared with pgvector's: the default setting when it already reaches
    pgvector's recall, else the recall-matched one."""
    return MATCHED if vox["recall_at_10"] < pg["recall_at_10"] and MATCHED in ok else "voxrecall"


def versus_pgvector(systems: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """Which of voxrecall and pgvector wins each metric of this run, and a one-line verdict
    naming both sides: a warm p50 that favours one says nothing of the cold call or of load."""
    ok = {name: row for name, row in systems.items() if "skipped" not in row}
    if "voxrecall" not in ok or "pgvector" not in ok:
        missing = [n for n in ("voxrecall", "pgvector") if n not in ok]
        return {"skipped": f"not measured: {', '.join(missing)}"}
    pg = ok["pgvector"]
    name = _compared(ok["voxrecall"], pg, ok)
    ours = ok[name]
    out: dict[str, Any] = {"compared": name}
    for metric, key, more_is_better in VERSUS:
        ratio = _ratio(ours[key], pg[key])
        ahead = ratio >= 1.0 if more_is_better else ratio <= 1.0
        out[metric] = {
            name: ours[key],
            "pgvector": pg[key],
            "ratio": ratio,
            "better": name if ahead else "pgvector",
        }
    wins = {
        side: [m for m, _, _ in VERSUS if out[m]["better"] == side] for side in (name, "pgvector")
    }
    out["verdict"] = (
        "; ".join(
            f"{side} ahead on {', '.join(metrics)}" for side, metrics in wins.items() if metrics
        )
        + f" (recall@10 {ours['recall_at_10']} vs {pg['recall_at_10']})"
    )
    return out


def _pgvector_goals(versus: dict[str, Any], ok: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """The three pgvector goals from ``versus_pgvector``'s ratios: each met when its system is
    ahead at equal or better recall (a sidecar called once per caller turn meets every call
    cold, so the warm p50 alone never settles "faster than pgvector": bench/README.md)."""
    name = versus["compared"]
    ours, pg = ok[name]["recall_at_10"], ok["pgvector"]["recall_at_10"]
    goals: dict[str, Any] = {}
    for goal, (metric, _, more_is_better) in zip(PGVECTOR_GOALS, VERSUS, strict=True):
        goals[goal] = {
            "value": versus[metric]["ratio"],
            "goal": f"{'>=' if more_is_better else '<='} 1.0 at equal or better recall",
            "compared": name,
            "met": versus[metric]["better"] == name and ours >= pg,
        }
    goals[PGVECTOR_GOALS[0]]["recall"] = {name: ours, "pgvector": pg}
    return goals


def _share_parts(vox: dict[str, Any], knn: dict[str, Any], floor: float) -> dict[str, float]:
    """The share split at ``grpc-knn``: what the same graph searched in a bare method of the
    sidecar's process costs beyond the echo and the in-loop search (no code of the sidecar's
    on that call), and what the sidecar's own code costs above that."""
    return {
        "bare_server_share_ms": round(knn["p50_ms"] - floor, 3),
        "above_bare_server_ms": round(vox["p50_ms"] - knn["p50_ms"], 3),
    }


def check_goals(systems: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """Issue 7's goals, each as the measured ratio, the goal, and whether it was met."""
    ok = {name: row for name, row in systems.items() if "skipped" not in row}
    goals: dict[str, Any] = {}
    low = {n: ok[n]["recall_at_10"] for n in APPROXIMATE if n in ok}
    goals["recall_at_10_min"] = {
        "value": min(low.values(), default=None),
        "goal": f">= {MIN_RECALL}",
        "met": all(r >= MIN_RECALL for r in low.values()),
        "per_system": low,
    }
    vox = ok.get("voxrecall")

    def need(*names: str) -> str | None:
        missing = [n for n in ("voxrecall", *names) if n not in ok]
        return f"not measured: {', '.join(missing)}" if missing else None

    if (why := need("grpc-echo", "hnswlib")) is None and vox:
        floor = ok["grpc-echo"]["p50_ms"] + ok["hnswlib"]["p50_ms"]
        value = _ratio(vox["p50_ms"], floor)
        goals["voxrecall_p50_over_echo_plus_hnswlib"] = {"value": value, "goal": "<= 1.3"}
        goals["voxrecall_p50_over_echo_plus_hnswlib"]["met"] = value <= 1.3
        # issue 19: the sidecar's own share of a call, beyond the transport and the search
        share = round(vox["p50_ms"] - floor, 3)
        goals["sidecar_share_ms"] = {"value": share, "goal": "<= 0.08", "met": share <= 0.08}
        if KNN in ok:
            goals["sidecar_share_ms"] |= _share_parts(vox, ok[KNN], floor)
    else:
        goals["voxrecall_p50_over_echo_plus_hnswlib"] = {"skipped": why}
        goals["sidecar_share_ms"] = {"skipped": why}
    if (why := need("pgvector")) is None and vox:
        goals.update(_pgvector_goals(versus_pgvector(systems), ok))
    else:
        for goal in PGVECTOR_GOALS:
            goals[goal] = {"skipped": why}
    if (why := need("chroma")) is None and vox:
        value = _ratio(ok["chroma"]["p50_ms"], vox["p50_ms"])
        goals["chroma_p50_over_voxrecall"] = {"value": value, "goal": ">= 3", "met": value >= 3}
    else:
        goals["chroma_p50_over_voxrecall"] = {"skipped": why}
    return goals


def run(
    quick: bool,
    *,
    n: int | None = None,
    dim: int | None = None,
    queries: int | None = None,
    systems: tuple[str, ...] | None = None,
    cache: Path = CACHE,
) -> dict[str, Any]:
    """Measure ``systems`` (default: all; ``--quick``: no peer) and return the suite's JSON."""
    size = QUICK if quick else FULL
    spec = CorpusSpec(n=n or size["n"], dim=dim or size["dim"], queries=queries or size["queries"])
    wanted = set(systems or (CORE if quick else ALL))
    unknown = wanted - set(ALL)
    if unknown:
        raise ValueError(f"unknown system(s) {sorted(unknown)}; known: {', '.join(ALL)}")
    started = time.perf_counter()
    log.info(
        "corpus %d x %d: read from the cache, or drawn with each query's exact top-%d (a first "
        "run: about a minute at 100k x 1536)",
        spec.n,
        spec.dim,
        spec.k,
    )
    corpus = load_or_generate(spec, cache)
    corpus_s = round(time.perf_counter() - started, 1)
    log.info("corpus ready in %.1f s", corpus_s)
    plan = Plan(latency_queries=spec.queries, throughput_queries=size["throughput"])
    # an explicit --systems decides, quick or not; only quick's own default leaves peers out
    unwanted = "not selected (--systems)" if systems else "--quick measures no peer"
    results = _measure_all(corpus, cache, plan, wanted, unwanted)
    ordered = {name: results[name] for name in ALL if name in results}
    return {
        "suite": "search",
        "n": spec.n,
        "dim": spec.dim,
        "k": spec.k,
        "queries": spec.queries,
        "seed": spec.seed,
        "concurrency": plan.concurrency,
        "target_recall": HNSW.target_recall,
        "corpus_s": corpus_s,
        "systems": ordered,
        "goals": check_goals(ordered),
        "versus_pgvector": versus_pgvector(ordered),
    }
