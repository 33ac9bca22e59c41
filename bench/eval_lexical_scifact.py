"""Evaluate the lexical (BM25) index on BEIR SciFact: nDCG@10, recall@3, build time, latency.

    .venv/bin/python -m bench.eval_lexical_scifact [--data ../shared/data/scifact]

Indexes ``title + " " + text`` of every corpus document and runs the test queries, at Lucene's
and Anserini's k1/b, with Lucene's stopwords only and with the spoken-query stopwords dropped
from the query as well (what the sidecar does). The data is read in place; nothing is copied
into the repository.
"""

from __future__ import annotations

import argparse
import csv
import itertools
import math
import statistics
import time
from collections import defaultdict
from pathlib import Path

import orjson

from bench.report import plain
from bench.shared_data import SHARED_DATA
from index.lexical import SPOKEN_STOPWORDS, LexicalIndex

DEFAULT_DATA = SHARED_DATA / "scifact"
SETTINGS = [(0.9, 0.4), (1.2, 0.75)]  # Anserini's and Lucene's defaults
QUERY_STOPWORDS = {"lucene33": frozenset[str](), "lucene33+spoken": SPOKEN_STOPWORDS}


def load(data: Path) -> tuple[list[str], list[str], dict[str, str], dict[str, dict[str, int]]]:
    doc_ids: list[str] = []
    texts: list[str] = []
    with (data / "corpus.jsonl").open("rb") as f:
        for line in f:
            rec = orjson.loads(line)
            doc_ids.append(str(rec["_id"]))
            texts.append(f"{rec.get('title', '')} {rec.get('text', '')}")
    qrels: dict[str, dict[str, int]] = defaultdict(dict)
    with (data / "qrels" / "test.tsv").open(newline="") as f:
        reader = csv.reader(f, delimiter="\t")
        next(reader)  # header
        for qid, did, score in reader:
            qrels[qid][did] = int(score)
    queries: dict[str, str] = {}
    with (data / "queries_test.jsonl").open("rb") as f:
        for line in f:
            rec = orjson.loads(line)
            if str(rec["_id"]) in qrels:
                queries[str(rec["_id"])] = rec["text"]
    return doc_ids, texts, queries, qrels


def ndcg_at(ranked: list[str], rels: dict[str, int], k: int) -> float:
    """BEIR/pytrec_eval nDCG: gain = rel, discount = log2(rank + 1)."""
    dcg = sum(rels.get(d, 0) / math.log2(i + 2) for i, d in enumerate(ranked[:k]))
    ideal = sorted((r for r in rels.values() if r > 0), reverse=True)[:k]
    idcg = sum(r / math.log2(i + 2) for i, r in enumerate(ideal))
    return dcg / idcg if idcg > 0 else 0.0


def recall_at(ranked: list[str], rels: dict[str, int], k: int) -> float:
    relevant = {d for d, r in rels.items() if r > 0}
    return len(relevant.intersection(ranked[:k])) / len(relevant) if relevant else 0.0


def main() -> None:
    parser = argparse.ArgumentParser(description=plain(__doc__))
    parser.add_argument("--data", type=Path, default=DEFAULT_DATA, help="the scifact set")
    args = parser.parse_args()
    doc_ids, texts, queries, qrels = load(args.data)
    print(f"{len(texts)} docs, {len(queries)} queries")

    t0 = time.perf_counter()
    built = LexicalIndex.build(texts)
    build_s = time.perf_counter() - t0
    data = built.to_bytes()
    t0 = time.perf_counter()
    LexicalIndex.from_bytes(data)
    load_s = time.perf_counter() - t0
    print(
        f"build {build_s:.2f}s (cold stem cache), vocab {built.vocab_size}, "
        f"{len(data) / 1e6:.2f} MB serialized, load {load_s * 1e3:.1f} ms"
    )
    t0 = time.perf_counter()
    LexicalIndex.build(texts)
    print(f"rebuild {time.perf_counter() - t0:.2f}s (warm stem cache)")

    for (k1, b), (stop_name, drop) in itertools.product(SETTINGS, QUERY_STOPWORDS.items()):
        index = LexicalIndex.from_bytes(data, k1=k1, b=b)
        for qtext in queries.values():  # warm-up: stem cache, numpy paths
            index.search(qtext, 10, drop=drop)
        ndcg: list[float] = []
        rec3: list[float] = []
        lat: list[float] = []
        for qid, qtext in queries.items():
            t0 = time.perf_counter()
            hits = index.search(qtext, 10, drop=drop)
            lat.append(time.perf_counter() - t0)
            ranked = [doc_ids[d] for d, _ in hits]
            ndcg.append(ndcg_at(ranked, qrels[qid], 10))
            rec3.append(recall_at(ranked, qrels[qid], 3))
        lat_ms = sorted(x * 1e3 for x in lat)
        print(
            f"k1={k1} b={b} query stopwords {stop_name}: nDCG@10 {statistics.fmean(ndcg):.4f}  "
            f"recall@3 {statistics.fmean(rec3):.4f}  "
            f"latency p50 {statistics.median(lat_ms):.3f} ms "
            f"p99 {lat_ms[int(0.99 * (len(lat_ms) - 1))]:.3f} ms"
        )


if __name__ == "__main__":
    main()
