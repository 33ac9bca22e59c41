"""Does hybrid retrieval help? BEIR SciFact through the sidecar's own ranking code:
``python -m bench.quality_scifact [--quick]``.

Every document (``title + " " + text``) becomes one chunk of a real snapshot (hnswlib graph, BM25
index with the stemming analyzer), embedded by the embedded default model; each test query is
ranked by ``sidecar.relevance.rank`` as dense, as BM25 (the fallback), and as hybrid (reciprocal
rank fusion of both, what ``hybrid = true`` does), with thresholds off so every query ranks. Reports
nDCG@10, recall@3 and recall@10 beside the figures measured for the issue, and writes
``bench/results/quality_scifact.json``. Document vectors are cached under ``bench/.cache/``.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import platform
import shutil
import statistics
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np

from bench.corpus import CACHE
from bench.eval_lexical_scifact import DEFAULT_DATA, load, ndcg_at, recall_at
from index.embedders.base import EmbedderInfo, Vectors
from index.embedders.local import MODEL_SHA256, NAME, LocalEmbedder
from index.errors import SnapshotError
from index.snapshot import LoadedSnapshot, load_snapshot, write_snapshot
from index.types import Chunk
from sidecar import relevance

RESULTS = Path(__file__).resolve().parent / "results" / "quality_scifact.json"
REFERENCE = {"dense": 0.643, "bm25_stemmed": 0.686, "fused_stemmed": 0.711}  # nDCG@10, the issue
SLICE = 32  # documents per hand-off to an embedding thread


def embed_all(texts: list[str]) -> Vectors:
    """Every text on every core (one text at a time per thread, as the sidecar's model runs)."""
    key = hashlib.sha256(MODEL_SHA256.encode())
    for text in texts:
        key.update(text.encode())
    path = CACHE / f"scifact-vectors-{key.hexdigest()[:16]}.npy"
    if path.is_file():
        cached: Vectors = np.load(path)
        return cached
    embedder = LocalEmbedder(threads=1)
    slices = [texts[i : i + SLICE] for i in range(0, len(texts), SLICE)]
    start = time.perf_counter()
    with ThreadPoolExecutor(os.cpu_count() or 1) as pool:
        vectors = np.concatenate(list(pool.map(embedder.embed_batch, slices)))
    print(f"embedded {len(texts)} documents in {time.perf_counter() - start:.0f} s")
    path.parent.mkdir(parents=True, exist_ok=True)
    np.save(path, vectors)
    return vectors


def snapshot(doc_ids: list[str], texts: list[str], vectors: Vectors) -> LoadedSnapshot:
    folder = (
        CACHE
        / f"scifact-snapshot-{len(texts)}-{hashlib.sha256(vectors.tobytes()).hexdigest()[:12]}"
    )
    try:
        return load_snapshot(folder)
    except SnapshotError:
        shutil.rmtree(folder, ignore_errors=True)  # a stale format: write it afresh
    chunks = [
        Chunk(doc_id, "scifact", doc_id, doc_id, (doc_id,), text, text)
        for doc_id, text in zip(doc_ids, texts, strict=True)
    ]
    write_snapshot(
        folder,
        knowledge_base="scifact",
        version="v1",
        embedder=EmbedderInfo(NAME, vectors.shape[1]),
        chunks=chunks,
        vectors=vectors,
        pages={},
        page_count=len(chunks),
        hnsw_m=16,
        hnsw_ef_construction=200,
        target_recall=0.98,
        sources=["scifact"],
    )
    return load_snapshot(folder)


def run(quick: bool, data_dir: Path = DEFAULT_DATA.parent) -> dict[str, Any]:
    """The SciFact part of the ``quality`` suite of ``python -m bench``."""
    data = data_dir / "scifact"
    doc_ids, texts, queries, qrels = load(data)
    if quick:
        queries = dict(list(queries.items())[:50])
        judged = {d for q in queries for d in qrels[q]}
        keep = [i for i, d in enumerate(doc_ids) if d in judged or i < 1000]
        doc_ids, texts = [doc_ids[i] for i in keep], [texts[i] for i in keep]
    vectors = embed_all(texts)
    snap = snapshot(doc_ids, texts, vectors)
    embedder = LocalEmbedder(threads=1)
    qids = list(queries)
    qvectors = embedder.embed_batch([queries[q] for q in qids])

    modes = {"dense": (True, False), "bm25": (False, False), "hybrid": (True, True)}
    scores: dict[str, dict[str, float]] = {}
    for mode, (dense, hybrid) in modes.items():
        ndcg, rec3, rec10, micros = [], [], [], []
        for qid, qvec in zip(qids, qvectors, strict=True):
            query = relevance.Query(
                text=queries[qid],
                vector=qvec if dense else None,
                limit=10,
                min_score=-1.0,
                min_lexical_score=0.0,
                hybrid=hybrid,
            )
            start = time.perf_counter_ns()
            ranked = [snap.chunks[label].chunk_id for label, _ in relevance.rank(snap, query)]
            micros.append((time.perf_counter_ns() - start) / 1000.0)
            ndcg.append(ndcg_at(ranked, qrels[qid], 10))
            rec3.append(recall_at(ranked, qrels[qid], 3))
            rec10.append(recall_at(ranked, qrels[qid], 10))
        scores[mode] = {
            "ndcg_at_10": round(statistics.fmean(ndcg), 4),
            "recall_at_3": round(statistics.fmean(rec3), 4),
            "recall_at_10": round(statistics.fmean(rec10), 4),
            "rank_p50_us": round(statistics.median(micros), 1),
        }
    # the same dense model searched exactly: what the graph's ef costs in quality
    exact = np.einsum("qd,nd->qn", qvectors, vectors)
    ranked_exact = [[doc_ids[i] for i in np.argsort(-row)[:10]] for row in exact]
    scores["dense_exact"] = {
        "ndcg_at_10": round(
            statistics.fmean(
                ndcg_at(r, qrels[q], 10) for r, q in zip(ranked_exact, qids, strict=True)
            ),
            4,
        ),
        "recall_at_3": round(
            statistics.fmean(
                recall_at(r, qrels[q], 3) for r, q in zip(ranked_exact, qids, strict=True)
            ),
            4,
        ),
        "recall_at_10": round(
            statistics.fmean(
                recall_at(r, qrels[q], 10) for r, q in zip(ranked_exact, qids, strict=True)
            ),
            4,
        ),
    }
    truth = np.argsort(-exact, axis=1)[:, :10]
    labels, _ = snap.index.knn_query(qvectors, k=10)
    graph_recall = float(
        np.mean([len(set(a) & set(b)) / 10 for a, b in zip(labels, truth, strict=True)])
    )
    best_single = max(scores["dense"]["ndcg_at_10"], scores["bm25"]["ndcg_at_10"])
    return {
        "data": str(data),
        "quick": quick,
        "documents": len(texts),
        "queries": len(qids),
        "embedder": snap.manifest.embedder.name,
        "fusion_depth": relevance.FUSION_DEPTH,
        "hnsw_ef": snap.manifest.hnsw.ef,
        "hnsw_recall_at_10_build_estimate": snap.manifest.hnsw.measured_recall_at_10,
        "hnsw_recall_at_10_real_queries": round(graph_recall, 4),
        "scores": scores,
        "reference_ndcg_at_10": REFERENCE,
        "hybrid_minus_best_single_ndcg_at_10": round(
            scores["hybrid"]["ndcg_at_10"] - best_single, 4
        ),
        "hybrid_helps": scores["hybrid"]["ndcg_at_10"] > best_single,
        "env": {"python": platform.python_version(), "cpus": os.cpu_count()},
        "scifact": scores,  # what the quality suite reads
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument(
        "--data", type=Path, default=DEFAULT_DATA.parent, help="the shared data folder"
    )
    parser.add_argument("--quick", action="store_true", help="50 queries over a 1,000-doc slice")
    args = parser.parse_args()
    out = run(args.quick, args.data)
    del out["scifact"]  # the same numbers are under "scores"
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps(out, indent=2) + "\n", encoding="utf-8")
    print(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
