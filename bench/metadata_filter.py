"""Metadata filters at 50%, 10% and 1% selectivity: ``python -m bench.metadata_filter [--quick]``.

The method of ``bench.source_filter``: a snapshot of 20,000 seeded, clustered 384-d vectors
(``bench.corpus``), here with a filterable field ``share`` whose values let through 50%, 10% and
1% of the chunks (assigned at random; a chunk holds a list of them, as frontmatter tags do) and a
``plan`` field on every third chunk, written and loaded as a real snapshot (``filters.json``,
value partitions built at load). For each filter, top-10 latency per query (one thread) and
recall@10 against exact search over the allowed chunks, for:

- ``filtered``: what the sidecar does (``index.filters.search`` over the request's ``Allowed``,
  the mask taken from the filter index's cache as a caller's repeated filter is)
- ``hnsw_filter``: hnswlib's ``filter=`` callable (calls back into Python per candidate)
- ``filtered_and_plan``: the share filter and ``plan = starter`` together (two filters)

and the unfiltered query as the floor. Goal: every ``filtered`` p50 within 2x of unfiltered,
recall@10 >= 0.95. Writes ``bench/results/metadata_filter.json``.
"""

from __future__ import annotations

import argparse
import json
import platform
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from bench.corpus import CACHE, CorpusSpec, load_or_generate
from bench.report import plain
from bench.source_filter import summary, timed
from index.embedders.base import EmbedderInfo
from index.errors import SnapshotError
from index.filters import search
from index.snapshot import LoadedSnapshot, load_snapshot, write_snapshot
from index.types import Chunk, MetadataFilter

RESULTS = Path(__file__).resolve().parent / "results" / "metadata_filter.json"
K = 10
SHARES = {"half": 0.5, "tenth": 0.1, "hundredth": 0.01}
STARTER = MetadataFilter("plan", ("starter",))


def assign(n: int) -> list[tuple[str, ...]]:
    """Each chunk's ``share`` values: each value on its share of the chunks, drawn apart."""
    rng = np.random.default_rng(13)
    drawn = {name: rng.random(n) < share for name, share in SHARES.items()}
    return [tuple(name for name in SHARES if drawn[name][i]) for i in range(n)]


def snapshot(spec: CorpusSpec) -> LoadedSnapshot:
    folder = CACHE / f"metadata-filter-{spec.key}"
    try:
        return load_snapshot(folder)
    except SnapshotError:
        shutil.rmtree(folder, ignore_errors=True)  # a stale format: write it afresh
    corpus = load_or_generate(spec)
    shares = assign(spec.n)
    chunks = [
        Chunk(f"c{i}", "docs", f"p{i}.md", f"page {i}", (f"page {i}",), f"text {i}", f"text {i}",
              metadata={"share": shares[i], "plan": "starter" if i % 3 == 0 else "pro"})
        for i in range(spec.n)
    ]  # fmt: skip
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
        sources=["docs"],
        filterable=["share", "plan"],
    )
    return load_snapshot(folder)


def run(quick: bool) -> dict[str, Any]:
    spec = CorpusSpec(n=5000 if quick else 20000, dim=384, queries=100 if quick else 200)
    snap = snapshot(spec)
    queries = load_or_generate(spec).queries
    vectors = np.asarray(snap.index.get_items(np.arange(spec.n), return_type="numpy"))

    micros, _ = timed(lambda q: [label for label, _ in snap.search_dense(q, K)], queries)
    floor = summary(micros, [[0]] * len(queries), [[0]] * len(queries))
    del floor["recall_at_3"]
    results: dict[str, Any] = {"unfiltered": floor}
    for name, share in SHARES.items():
        row: dict[str, Any] = {"share": share}
        for label, filters in (
            ("filtered", [MetadataFilter("share", (name,))]),
            ("filtered_and_plan", [MetadataFilter("share", (name,)), STARTER]),
        ):
            allowed = snap.filters.allowed(filters, [])
            assert allowed is not None
            ids = np.flatnonzero(allowed.mask)
            scores = queries @ vectors[ids].T
            truth = [list(ids[np.argsort(-r, kind="stable")[:K]]) for r in scores]

            def ours(q: np.ndarray, filters: list[MetadataFilter] = filters) -> list[int]:
                got = snap.filters.allowed(filters, [])  # from the cache, as a repeated filter
                assert got is not None
                return [label for label, _ in search(snap.index, snap.filters, q, K, got)]

            methods: dict[str, Callable[[np.ndarray], list[int]]] = {label: ours}
            if label == "filtered":
                mask = allowed.mask

                def hnsw_filter(q: np.ndarray, mask: np.ndarray = mask) -> list[int]:
                    labels, _ = snap.index.knn_query(
                        q.reshape(1, -1), k=K, num_threads=1, filter=lambda i: bool(mask[i])
                    )
                    return [int(x) for x in labels[0]]

                methods["hnsw_filter"] = hnsw_filter
            row[f"{label}_allowed"] = int(allowed.count)
            for method, fn in methods.items():
                measured = summary(*timed(fn, queries), truth)
                measured[f"recall_at_{K}"] = measured.pop("recall_at_3")  # summary's name
                row[method] = measured
        row["p50_vs_unfiltered"] = {
            key: round(row[key]["p50_us"] / floor["p50_us"], 2)
            for key in ("filtered", "filtered_and_plan", "hnsw_filter")
        }
        results[name] = row
    worst_ratio = max(results[s]["p50_vs_unfiltered"]["filtered"] for s in SHARES)
    worst_recall = min(
        results[s][key][f"recall_at_{K}"]
        for s in SHARES
        for key in ("filtered", "filtered_and_plan")
    )
    goals = {  # as python -m bench prints them
        "filtered_p50_vs_unfiltered": {
            "value": worst_ratio, "goal": "<= 2 at every selectivity", "met": worst_ratio <= 2.0
        },
        "recall_at_10": {"value": worst_recall, "goal": ">= 0.95", "met": worst_recall >= 0.95},
    }  # fmt: skip
    return {
        "suite": "filters",
        "n": spec.n,
        "dim": spec.dim,
        "queries": len(queries),
        "k": K,
        "ef": snap.manifest.hnsw.ef,
        "value_partitions": len(snap.filters.partitions),
        "results": results,
        "goals": goals,
        "env": {"python": platform.python_version(), "machine": platform.machine()},
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=plain(__doc__))
    parser.add_argument("--quick", action="store_true", help="5,000 vectors, 100 queries")
    args = parser.parse_args()
    out = run(args.quick)
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps(out, indent=2) + "\n", encoding="utf-8")
    print(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
