"""Selective source filters: ``python -m bench.source_filter [--quick]``.

A snapshot of 20,000 seeded, clustered 384-d vectors (``bench.corpus``) with three sources: 1%,
10% and 89% of the chunks, assigned at random. For each filter, top-3 latency per query (one
thread) and recall@3 against exact search over the allowed chunks, for:

- ``hnsw_filter``: hnswlib's ``filter=`` callable (calls back into Python per candidate)
- ``overfetch``: over-fetch from the shared graph, post-filter, exact fallback read from the graph
  (the snapshot without its per-source partitions)
- ``partitions``: what the sidecar does (``LoadedSnapshot.search_dense``): exact numpy search
  over the allowed sources' partitions when the filter lets through under half the chunks

and the unfiltered query as the floor. Writes ``bench/results/source_filter.json``.
"""

from __future__ import annotations

import argparse
import json
import platform
import shutil
import statistics
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np

from bench.corpus import CACHE, CorpusSpec, load_or_generate
from bench.report import plain
from index.embedders.base import EmbedderInfo
from index.errors import SnapshotError
from index.snapshot import LoadedSnapshot, load_snapshot, write_snapshot
from index.types import Chunk

RESULTS = Path(__file__).resolve().parent / "results" / "source_filter.json"
K = 3  # max_results
SOURCES = {"one-percent": 0.01, "ten-percent": 0.10}  # the rest is "rest"
WARMUP = 20


def assign_sources(n: int) -> list[str]:
    order = np.random.default_rng(11).permutation(n)
    names = ["rest"] * n
    start = 0
    for name, share in SOURCES.items():
        count = int(n * share)
        for label in order[start : start + count]:
            names[int(label)] = name
        start += count
    return names


def snapshot(spec: CorpusSpec) -> LoadedSnapshot:
    folder = CACHE / f"source-filter-{spec.key}"
    try:
        return load_snapshot(folder)
    except SnapshotError:
        shutil.rmtree(folder, ignore_errors=True)  # a stale format: write it afresh
    corpus = load_or_generate(spec)
    names = assign_sources(spec.n)
    chunks = [
        Chunk(f"c{i}", names[i], f"p{i}.md", f"page {i}", (f"page {i}",), f"text {i}", f"text {i}")
        for i in range(spec.n)
    ]
    write_snapshot(
        folder,
        knowledge_base="filters",
        version="v1",
        embedder=EmbedderInfo("bench/clustered", spec.dim),
        chunks=chunks,
        vectors=corpus.vectors,
        pages={},
        page_count=spec.n,
        hnsw_m=16,
        hnsw_ef_construction=200,
        target_recall=0.98,
        sources=sorted({*names}),
    )
    return load_snapshot(folder)


def timed(
    fn: Callable[[np.ndarray], list[int]], queries: np.ndarray
) -> tuple[list[float], list[list[int]]]:
    for q in queries[:WARMUP]:
        fn(q)
    micros, found = [], []
    for q in queries:
        start = time.perf_counter_ns()
        labels = fn(q)
        micros.append((time.perf_counter_ns() - start) / 1000.0)
        found.append(labels)
    return micros, found


def summary(micros: list[float], found: list[list[int]], truth: list[list[int]]) -> dict[str, Any]:
    recall = statistics.fmean(
        len(set(f) & set(t)) / len(t) for f, t in zip(found, truth, strict=True)
    )
    ordered = sorted(micros)
    return {
        "mean_us": round(statistics.fmean(micros), 1),
        "p50_us": round(ordered[len(ordered) // 2], 1),
        "p99_us": round(ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))], 1),
        "recall_at_3": round(recall, 4),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=plain(__doc__))
    parser.add_argument("--quick", action="store_true", help="5,000 vectors, 100 queries")
    args = parser.parse_args()
    spec = CorpusSpec(n=5000 if args.quick else 20000, dim=384, queries=100 if args.quick else 200)
    snap = snapshot(spec)
    queries = load_or_generate(spec).queries
    vectors = np.asarray(snap.index.get_items(np.arange(spec.n), return_type="numpy"))
    without = replace(snap, partitions={})
    sources = np.asarray([c.source for c in snap.chunks])

    micros, _ = timed(lambda q: [label for label, _ in snap.search_dense(q, K)], queries)
    floor = summary(micros, [[0]] * len(queries), [[0]] * len(queries))
    del floor["recall_at_3"]
    results: dict[str, Any] = {"unfiltered": floor}
    for name, share in SOURCES.items():
        allowed = sources == name
        allowed_labels = np.flatnonzero(allowed)
        scores = queries @ vectors[allowed_labels].T
        truth = [list(allowed_labels[np.argsort(-row, kind="stable")[:K]]) for row in scores]

        def hnsw_filter(q: np.ndarray, allowed: np.ndarray = allowed) -> list[int]:
            labels, _ = snap.index.knn_query(
                q.reshape(1, -1), k=K, num_threads=1, filter=lambda label: bool(allowed[label])
            )
            return [int(x) for x in labels[0]]

        def overfetch(q: np.ndarray, name: str = name) -> list[int]:
            return [label for label, _ in without.search_dense(q, K, [name])]

        def partitions(q: np.ndarray, name: str = name) -> list[int]:
            return [label for label, _ in snap.search_dense(q, K, [name])]

        row: dict[str, Any] = {"share": share, "allowed": int(allowed.sum())}
        methods: dict[str, Callable[[np.ndarray], list[int]]] = {
            "hnsw_filter": hnsw_filter,
            "overfetch": overfetch,
            "partitions": partitions,
        }
        for method, fn in methods.items():
            row[method] = summary(*timed(fn, queries), truth)
        # medians: the shared machine's stalls land in the means and the tails
        base = row["partitions"]["p50_us"]
        row["p50_ratio"] = {
            "hnsw_filter_vs_partitions": round(row["hnsw_filter"]["p50_us"] / base, 1),
            "overfetch_vs_partitions": round(row["overfetch"]["p50_us"] / base, 1),
            "partitions_vs_unfiltered": round(base / floor["p50_us"], 2),
        }
        results[name] = row

    out = {
        "n": spec.n,
        "dim": spec.dim,
        "queries": len(queries),
        "k": K,
        "ef": snap.manifest.hnsw.ef,
        "results": results,
        "env": {"python": platform.python_version(), "machine": platform.machine()},
    }
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps(out, indent=2) + "\n", encoding="utf-8")
    print(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
