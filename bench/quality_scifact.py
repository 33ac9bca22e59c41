"""Does hybrid retrieval help? BEIR SciFact through the sidecar's own ranking code:
``python -m bench.quality_scifact [--quick]``.

Every document (``title + " " + text``) becomes one chunk of a real snapshot (hnswlib graph, BM25
index with the stemming analyzer), embedded by the embedded default model; each test query is
ranked by ``sidecar.turn.relevance.rank`` as dense, as BM25 (the fallback), as hybrid (convex fusion
of both, what ``hybrid = true`` does) and as ``hybrid_rrf`` (reciprocal rank fusion, what it did
before; computed here, no longer in the product), with thresholds off so every query ranks.
Reports nDCG@10, recall@3 and recall@10 beside the figures measured for the issue, and writes ``bench/results/quality_scifact.json``.
Document vectors are cached under ``bench/.cache/``.

Nothing here is tuned on these 300 queries (SciFact has no other split here): the fusion is the
literature's default (Bruch et al. 2023: convex combination, min-max normalisation, weight 0.5)
and BM25 keeps Lucene's k1/b. Every variant tried is listed in bench/README.md.
"""

from __future__ import annotations

import argparse
import hashlib
import itertools
import json
import os
import platform
import random
import shutil
import statistics
import time
from collections import Counter, defaultdict
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np

from bench.corpus import CACHE
from bench.eval_lexical_scifact import DEFAULT_DATA, load, ndcg_at, recall_at
from bench.report import plain
from index.embedders.base import EmbedderInfo, Vectors
from index.embedders.local import MODEL_SHA256, NAME, LocalEmbedder
from index.errors import SnapshotError
from index.lexical import SPOKEN_STOPWORDS, reciprocal_rank_fusion
from index.snapshot import LoadedSnapshot, load_snapshot, write_snapshot
from index.types import Chunk
from sidecar.snapshots.searcher import Searcher
from sidecar.turn import relevance

RESULTS = Path(__file__).resolve().parent / "results" / "quality_scifact.json"
REFERENCE = {"dense": 0.643, "bm25_stemmed": 0.686, "fused_stemmed": 0.711}  # nDCG@10, the issue
GOAL = 0.72  # nDCG@10 of the product's best mode, the goal
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

    searcher = Searcher.build(snap)
    modes: dict[str, tuple[bool, bool]] = {
        "dense": (True, False),
        "bm25": (False, False),
        "hybrid": (True, True),
        "hybrid_rrf": (True, True),  # not the product's: reciprocal_rank_ranked below
    }
    # per query, every mode in turn: a burst of load elsewhere falls on all modes alike
    per_mode: dict[str, dict[str, list[float]]] = {
        mode: {"ndcg": [], "rec3": [], "rec10": [], "micros": []} for mode in modes
    }
    for qid, qvec in zip(qids, qvectors, strict=True):
        for mode, (dense, hybrid) in modes.items():
            query = relevance.Query(
                text=queries[qid],
                vector=qvec if dense else None,
                limit=10,
                min_score=-1.0,
                min_lexical_score=0.0,
                hybrid=hybrid,
            )
            start = time.perf_counter_ns()
            if mode == "hybrid_rrf":
                labels = reciprocal_rank_ranked(searcher, query)
            else:
                labels = [label for label, _ in relevance.rank(searcher, query)]
            ranked = [snap.chunks[label].chunk_id for label in labels]
            got = per_mode[mode]
            got["micros"].append((time.perf_counter_ns() - start) / 1000.0)
            got["ndcg"].append(ndcg_at(ranked, qrels[qid], 10))
            got["rec3"].append(recall_at(ranked, qrels[qid], 3))
            got["rec10"].append(recall_at(ranked, qrels[qid], 10))
    scores: dict[str, dict[str, float]] = {
        mode: {
            "ndcg_at_10": round(statistics.fmean(got["ndcg"]), 4),
            "recall_at_3": round(statistics.fmean(got["rec3"]), 4),
            "recall_at_10": round(statistics.fmean(got["rec10"]), 4),
            "rank_p50_us": round(statistics.median(got["micros"]), 1),
        }
        for mode, got in per_mode.items()
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
    best = max(scores[m]["ndcg_at_10"] for m in modes)
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
        "goal": {"best_mode_ndcg_at_10": GOAL, "met": best >= GOAL},
        "env": {"python": platform.python_version(), "cpus": os.cpu_count()},
        "scifact": scores,  # what the quality suite reads
    }


def reciprocal_rank_ranked(searcher: Searcher, q: relevance.Query) -> list[int]:
    """What hybrid did before convex fusion (dropped from the product; measured here against
    it): reciprocal rank fusion (k=60) of each retriever's top ``FUSION_DEPTH``."""
    assert q.vector is not None
    depth = max(q.limit, relevance.FUSION_DEPTH)
    dense = searcher.snapshot.search_dense(q.vector, depth)
    lexical = searcher.snapshot.lexical.search(q.text, depth, drop=SPOKEN_STOPWORDS)
    fused = reciprocal_rank_fusion([[i for i, _ in dense], [i for i, _ in lexical]])
    return [label for label, _ in fused[: q.limit]]


# -- every fusion variant tried, for the record (``--variants``) ---------------------------------

Norm = Callable[[list[float], str], Callable[[float], float]]


def _minmax(scores: list[float], kind: str) -> Callable[[float], float]:
    lo, hi = min(scores), max(scores)
    return lambda s: (s - lo) / (hi - lo) if hi > lo else 1.0


def _theoretical_minmax(scores: list[float], kind: str) -> Callable[[float], float]:
    """Bruch et al.'s TMM: the scoring function's lower bound (cosine -1, BM25 0), observed max."""
    lo, hi = (-1.0 if kind == "dense" else 0.0), max(scores)
    return lambda s: (s - lo) / (hi - lo) if hi > lo else 1.0


def _zscore(scores: list[float], kind: str) -> Callable[[float], float]:
    mu, sd = statistics.fmean(scores), statistics.pstdev(scores) or 1.0
    return lambda s: (s - mu) / sd


NORMS: dict[str, Norm] = {"minmax": _minmax, "tmm": _theoretical_minmax, "z": _zscore}


def variants(data_dir: Path, folds: int = 5, repeats: int = 20) -> dict[str, Any]:
    """nDCG@10 of every fusion variant tried on SciFact, and the held-out nDCG@10 of picking the
    best variant by ``folds``-fold cross-validation (``repeats`` shuffles): what choosing among
    them on these very queries would be worth on unseen ones."""
    doc_ids, texts, queries, qrels = load(data_dir / "scifact")
    snap = snapshot(doc_ids, texts, embed_all(texts))
    qids = list(queries)
    qvectors = LocalEmbedder(threads=1).embed_batch([queries[q] for q in qids])
    drop = SPOKEN_STOPWORDS
    per_query: dict[str, list[float]] = defaultdict(list)
    for qid, qvec in zip(qids, qvectors, strict=True):
        bm25_all = snap.lexical.scores(queries[qid], drop=drop)

        def judge(name: str, ranked: list[int], qid: str = qid) -> None:
            per_query[name].append(ndcg_at([doc_ids[i] for i in ranked[:10]], qrels[qid], 10))

        for depth in (20, 100):
            dense = snap.search_dense(qvec, depth)
            lexical = snap.lexical.top(bm25_all, depth)
            if depth == 20:
                judge("dense", [i for i, _ in dense])
                judge("bm25", [i for i, _ in lexical])
            fused = reciprocal_rank_fusion([[i for i, _ in dense], [i for i, _ in lexical]])
            judge(f"rrf k60 d{depth}", [i for i, _ in fused])
            labels = list(dict.fromkeys([*(i for i, _ in dense), *(i for i, _ in lexical)]))
            vectors = np.asarray(snap.index.get_items(labels, return_type="numpy"))
            exact = (
                dict(zip(labels, (vectors @ qvec).tolist(), strict=True)),
                {i: float(bm25_all[i]) for i in labels},
            )
            truncated = (dict(dense), dict(lexical))
            alphas = (0.3, 0.4, 0.5, 0.6, 0.7) if depth == 20 else (0.5,)
            for (norm_name, norm), alpha in itertools.product(NORMS.items(), alphas):
                for scoring, (cos, bm) in (("exact", exact), ("truncated", truncated)):
                    ncos, nbm = norm(list(cos.values()), "dense"), norm(list(bm.values()), "bm25")
                    floor_cos, floor_bm = ncos(min(cos.values())), nbm(min(bm.values()))
                    score = {
                        i: alpha * (ncos(cos[i]) if i in cos else floor_cos)
                        + (1 - alpha) * (nbm(bm[i]) if i in bm else floor_bm)
                        for i in labels
                    }
                    ranked = sorted(labels, key=lambda i: -score[i])
                    judge(f"convex {norm_name} a{alpha} d{depth} {scoring}", ranked)
    names = list(per_query)
    fusions = [n for n in names if n not in ("dense", "bm25")]
    held: list[float] = []
    picked: Counter[str] = Counter()
    n = len(qids)
    for seed in range(repeats):
        order = list(range(n))
        random.Random(seed).shuffle(order)
        outcome = [0.0] * n
        for f in range(folds):
            test = set(order[f::folds])
            best = max(
                fusions, key=lambda v: sum(x for i, x in enumerate(per_query[v]) if i not in test)
            )
            picked[best] += 1
            for i in test:
                outcome[i] = per_query[best][i]
        held.append(statistics.fmean(outcome))
    return {
        "queries": n,
        "ndcg_at_10": {v: round(statistics.fmean(per_query[v]), 4) for v in names},
        "cross_validated_pick": {
            "folds": folds,
            "repeats": repeats,
            "held_out_ndcg_at_10": round(statistics.fmean(held), 4),
            "held_out_min": round(min(held), 4),
            "held_out_max": round(max(held), 4),
            "picked": dict(picked.most_common()),
        },
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=plain(__doc__))
    parser.add_argument(
        "--data", type=Path, default=DEFAULT_DATA.parent, help="the shared data folder"
    )
    parser.add_argument("--quick", action="store_true", help="50 queries over a 1,000-doc slice")
    parser.add_argument(
        "--variants", action="store_true", help="every fusion variant tried, and a CV pick"
    )
    args = parser.parse_args()
    if args.variants:
        out = variants(args.data)
        path = RESULTS.with_name("quality_scifact_variants.json")
        path.write_text(json.dumps(out, indent=2) + "\n", encoding="utf-8")
        print(json.dumps(out, indent=2))
        return
    out = run(args.quick, args.data)
    del out["scifact"]  # the same numbers are under "scores"
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps(out, indent=2) + "\n", encoding="utf-8")
    print(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
