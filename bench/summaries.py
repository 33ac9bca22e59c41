"""Does a second view of every chunk help? ``python -m bench.summaries [--quick]``.

The offline view of ``summaries = true`` (``summary_text = "heading"``: each chunk's heading
path and first sentence, ``index.summaries.heading_summary``) is embedded by the embedded model
as a second vector, and every query is ranked by ``sidecar.turn.relevance.rank`` three ways on the
same snapshot: the content prong alone (``summaries = "off"``), fused keeping the better cosine
(``"max"``, what the sidecar does) and fused by the mean of both (``"mean"``). Sets:

* SciFact (``bench.quality_scifact``'s snapshot: one chunk per abstract; the heading path is
  the paper's title): nDCG@10, recall@3 and recall@10 over its test queries, dense ranking.
* DSTC11 and doc2dial-dev (``bench.conversations``: their cached snapshots, a copy of each with
  the summaries added): the session hit@3 of the conversation benchmark, through the engine.

The model view (``summary_text = "model"``) needs a reachable chat model and is not measured
here. Writes ``bench/results/summaries.json``; the summary vectors are cached in bench/.cache.
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import platform
import statistics
import time
from pathlib import Path
from typing import Any, Literal

import numpy as np

from bench import quality_conversations, quality_scifact
from bench.corpus import CACHE
from bench.eval_lexical_scifact import DEFAULT_DATA, load, ndcg_at, recall_at
from bench.report import plain
from index.embedders.base import Embedder
from index.embedders.local import LocalEmbedder
from index.enrich import summary_writer
from index.errors import SnapshotError
from index.snapshot import LoadedSnapshot, load_snapshot, write_snapshot
from index.store import LocalStore, new_version_id
from index.summaries import first_sentence, heading_summary
from sidecar.snapshots.searcher import Searcher
from sidecar.turn import relevance

RESULTS = Path(__file__).resolve().parent / "results" / "summaries.json"
Fusion = Literal["off", "max", "mean"]
FUSIONS: tuple[Fusion, ...] = ("off", "max", "mean")


def with_summaries(
    snap: LoadedSnapshot, texts: list[str], embedder: Embedder, folder: Path, version: str = ""
) -> LoadedSnapshot:
    """A copy of ``snap`` in ``folder`` with ``texts`` as its summaries (cached there), as
    ``version`` (default: the same)."""
    try:
        return load_snapshot(folder)
    except SnapshotError:
        pass
    n = len(snap.chunks)
    vectors = np.asarray(snap.index.get_items(np.arange(n)), dtype=np.float32)
    start = time.perf_counter()
    summary_vectors = np.concatenate(
        [embedder.embed_batch(texts[i : i + 64]) for i in range(0, n, 64)]
    )
    print(f"  embedded {n} summaries in {time.perf_counter() - start:.0f} s", flush=True)
    manifest = snap.manifest
    write_snapshot(
        folder,
        knowledge_base=manifest.knowledge_base,
        version=version or manifest.version,
        embedder=manifest.embedder,
        chunks=snap.chunks,
        vectors=vectors,
        pages=snap.pages,
        page_count=manifest.pages,
        hnsw_m=manifest.hnsw.m,
        hnsw_ef_construction=manifest.hnsw.ef_construction,
        target_recall=0.98,
        sources=manifest.sources,
        extra={**manifest.extra, "summaries": "heading"},
        more_files=summary_writer(texts, summary_vectors, manifest.hnsw.m, 200),
    )
    return load_snapshot(folder)


def scifact(quick: bool, embedder: Embedder) -> dict[str, Any]:
    data = DEFAULT_DATA
    doc_ids, texts, queries, qrels = load(data)
    titles = _titles(data)
    if quick:
        queries = dict(list(queries.items())[:50])
        judged = {d for q in queries for d in qrels[q]}
        keep = [i for i, d in enumerate(doc_ids) if d in judged or i < 1000]
        doc_ids, texts = [doc_ids[i] for i in keep], [texts[i] for i in keep]
    vectors = quality_scifact.embed_all(texts)
    base = quality_scifact.snapshot(doc_ids, texts, vectors)
    views = [
        f"{titles[d]}\n{first_sentence(t[len(titles[d]) + 1 :])}"
        for d, t in zip(doc_ids, texts, strict=True)
    ]
    digest = hashlib.sha256("\n".join(views).encode()).hexdigest()[:12]
    snap = with_summaries(base, views, embedder, CACHE / f"scifact-summaries-{len(views)}-{digest}")
    qids = list(queries)
    qvectors = embedder.embed_batch([queries[q] for q in qids])
    out: dict[str, Any] = {"documents": len(doc_ids), "queries": len(qids)}
    searcher = Searcher.build(snap)
    for fusion in FUSIONS:
        ndcg, rec3, rec10 = [], [], []
        for qid, qvec in zip(qids, qvectors, strict=True):
            query = relevance.Query(
                text=queries[qid], vector=qvec, limit=10, min_score=-1.0,
                min_lexical_score=0.0, summaries=fusion,
            )  # fmt: skip
            ranked = [snap.chunks[label].chunk_id for label, _ in relevance.rank(searcher, query)]
            ndcg.append(ndcg_at(ranked, qrels[qid], 10))
            rec3.append(recall_at(ranked, qrels[qid], 3))
            rec10.append(recall_at(ranked, qrels[qid], 10))
        out[fusion] = {
            "ndcg_at_10": round(statistics.fmean(ndcg), 4),
            "recall_at_3": round(statistics.fmean(rec3), 4),
            "recall_at_10": round(statistics.fmean(rec10), 4),
        }
    return out


def _titles(data: Path) -> dict[str, str]:
    import orjson

    with (data / "corpus.jsonl").open("rb") as f:
        return {str(r["_id"]): str(r.get("title", "")) for r in map(orjson.loads, f)}


async def dialogues(name: str, quick: bool, embedder: Embedder) -> dict[str, Any]:
    """The session hit@3 of one conversation set, content prong alone and fused."""
    cs = quality_conversations.DIALOGUE_SETS[name](quality_conversations.DEFAULT_DATA, quick, False)
    store_dir = await asyncio.to_thread(cs.store, embedder)
    kb = next(iter(LocalStore(store_dir).knowledge_bases()))
    store = LocalStore(store_dir)
    base = await asyncio.to_thread(load_snapshot, store.latest_dir(kb))
    views = [heading_summary(c) for c in base.chunks]
    digest = hashlib.sha256("\n".join(views).encode()).hexdigest()[:12]
    fused_dir = CACHE / f"{name}-summaries-{digest}" / "store"
    fused_store = LocalStore(fused_dir)
    if fused_store.latest(kb) is None:
        staging = fused_store.staging_dir(kb)
        version = new_version_id(digest)
        await asyncio.to_thread(with_summaries, base, views, embedder, staging, version)
        fused_store.publish(kb, staging, version)
    out: dict[str, Any] = {}
    for label, folder in (("off", store_dir), ("max", fused_dir)):
        config = quality_conversations.eval_config(folder)
        async with quality_conversations.served(config, embedder) as engine:
            result = await quality_conversations.score_set(cs, engine)
        out[label] = {
            "session_hit_at_3": result["session"]["hit_at_3"],
            "session_mrr_at_10": result["session"]["mrr_at_10"],
        }
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=plain(__doc__))
    parser.add_argument("--quick", action="store_true", help="slices of every set (smoke mode)")
    parser.add_argument(
        "--sets",
        default="scifact,dstc11,doc2dial",
        help="comma-separated, of scifact, dstc11, doc2dial (default: all three)",
    )
    args = parser.parse_args(argv)
    embedder = LocalEmbedder()
    started = time.perf_counter()
    result: dict[str, Any] = {"quick": args.quick, "python": platform.python_version()}
    for name in args.sets.split(","):
        if name == "scifact":
            result[name] = scifact(args.quick, embedder)
        else:
            result[name] = asyncio.run(dialogues(name, args.quick, embedder))
        print(f"{name}: {json.dumps(result[name])}", flush=True)
    result["seconds"] = round(time.perf_counter() - started, 1)
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {RESULTS} in {result['seconds']} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
