"""Quality of the turn engine: skip policy, follow-ups, query rewriting.

    .venv/bin/python -m bench.quality_turns [--quick] [--data ../shared/data]

* ``skip``: precision and recall of "skip" against ``needs_retrieval == false`` on the 4,173
  labelled DSTC11 user turns, overall and among short turns (at most ``SHORT_WORDS`` words).
* ``dstc11``: a snapshot of the DSTC11 FAQ + review snippets, each embedded as "entity\\n\\ntext"
  with the embedded model, served by a real sidecar engine. Every judged dialogue's history is
  fed in order into one session (user turns as USER, system turns as AGENT), then its last user
  turn is scored: hit@3 and MRR@10 against ``qrels/val.tsv``. Beside it, the same last turn
  searched alone, with the two previous turns (user and system) prepended, and with the gold
  entity prefixed as "entity: turn" (the entity of most judged snippets when there are several;
  the ceiling of entity folding), all through the same engine. ``session_hybrid`` is the session
  on a ``hybrid = true`` base (convex fusion). ``lexical_fallback``: what the BM25 fallback
  (``sidecar.turn.relevance.rank`` without a vector) finds for the last turn and for the gold-entity
  prefixed one, with and without the spoken-query stopwords.
* ``cast``: TREC CAsT follow-ups: how close the query the session would search gets to the
  human rewrite (recall and precision of the rewrite's content words, and cosine of the embedded
  texts), against the two naive baselines: the raw turn, and the last three turns joined. No base knows these topics, so only the conversation's own words count.

The snapshot is cached under ``bench/.cache/`` keyed by the corpus hash (the full one takes a few
minutes to embed on two cores). ``--quick`` uses four entities and a few hundred turns.
"""

from __future__ import annotations

import argparse
import asyncio
import csv
import hashlib
import json
import platform
import time
from collections import Counter, defaultdict
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import orjson

from bench.report import plain
from bench.shared_data import SHARED_DATA
from index.build import embed_chunks
from index.chunker import chunk_page
from index.embedders.base import Embedder
from index.lexical import SPOKEN_STOPWORDS
from index.snapshot import FORMAT_VERSION, LoadedSnapshot, write_pages_snapshot
from index.store import LocalStore, new_version_id
from index.types import Page
from sidecar.config import Config, parse_config
from sidecar.snapshots.searcher import Searcher
from sidecar.turn import followups, relevance
from sidecar.turn.engine import Engine, SearchInput, Speaker, TurnInput, TurnResult
from sidecar.turn.sessions import Session
from sidecar.turn.skip import Skip, SkipPolicy, words

ROOT = Path(__file__).resolve().parent
RESULTS = ROOT / "results" / "quality_turns.json"
CACHE = ROOT / ".cache"
DEFAULT_DATA = SHARED_DATA
KB = "dstc11"
SHORT_WORDS = 4  # "short" turns: backchannels, closings, and questions like "Is it quiet?"
QUICK_ENTITIES = 4  # the most-judged entities: ~350 snippets, embedded in seconds
QUICK_TURNS = 300
EVAL_DEPTH = 10  # MRR@10 needs ten results; hit@3 reads the first three
EVAL_BUDGET_MS = 10_000  # quality, not latency: the embedder must never miss the budget here


# -- skip ---------------------------------------------------------------------------------------


def skip_quality(path: Path, policy: SkipPolicy) -> dict[str, Any]:
    rows = [orjson.loads(line) for line in path.read_bytes().splitlines() if line.strip()]

    def score(subset: list[dict[str, Any]]) -> dict[str, Any]:
        tp = fp = fn = 0
        wrongly_skipped: list[str] = []
        for row in subset:
            skipped = policy.classify(row["text"]) is not Skip.NOT_SKIPPED
            skippable = not row["needs_retrieval"]
            tp += skipped and skippable
            fp += skipped and not skippable
            fn += skippable and not skipped
            if skipped and not skippable:
                wrongly_skipped.append(row["text"])
        return {
            "turns": len(subset),
            "skippable": tp + fn,
            "skipped": tp + fp,
            "precision": round(tp / (tp + fp), 4) if tp + fp else None,
            "recall": round(tp / (tp + fn), 4) if tp + fn else None,
            "wrongly_skipped": wrongly_skipped[:20],
        }

    short = [r for r in rows if len(words(r["text"])) <= SHORT_WORDS]
    return {
        **score(rows),
        "short": {"definition": f"at most {SHORT_WORDS} words", **score(short)},
        "policy": {"max_words": policy.max_words, "language": policy.language},
    }


# -- DSTC11 ---------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Dstc:
    records: list[dict[str, Any]]
    queries: list[dict[str, Any]]  # judged ones only
    qrels: dict[str, set[str]]
    entity: dict[str, str]  # doc id -> entity name

    def gold_entity(self, qid: str) -> str:
        """The entity most of a query's relevant snippets are about; a tie goes to the first
        name in order (not to the set's order, which follows PYTHONHASHSEED)."""
        counts = Counter(self.entity[d] for d in self.qrels[qid])
        return min(counts, key=lambda name: (-counts[name], name))


def load_dstc(folder: Path, quick: bool) -> Dstc:
    records = [orjson.loads(line) for line in (folder / "corpus.jsonl").read_bytes().splitlines()]
    entity = {str(r["_id"]): str(r["entity_name"]) for r in records}
    qrels: dict[str, set[str]] = defaultdict(set)
    with (folder / "qrels" / "val.tsv").open(newline="") as f:
        reader = csv.reader(f, delimiter="\t")
        next(reader)
        for qid, did, score in reader:
            if int(score) > 0:
                qrels[qid].add(did)
    queries = [
        q
        for q in (
            orjson.loads(line) for line in (folder / "queries_val.jsonl").read_bytes().splitlines()
        )
        if q["_id"] in qrels
    ]
    if quick:
        judged = Counter(entity[d] for q in queries for d in qrels[q["_id"]])
        keep = {name for name, _ in judged.most_common(QUICK_ENTITIES)}
        records = [r for r in records if r["entity_name"] in keep]
        queries = [q for q in queries if {entity[d] for d in qrels[q["_id"]]} <= keep]
        queries = queries[:QUICK_TURNS]
    return Dstc(records, queries, dict(qrels), entity)


def dstc_store(data: Dstc, embedder: Embedder) -> Path:
    """A store holding a snapshot of the records, built once and cached by their hash (with the
    embedder and the snapshot format version, so a format change rebuilds it)."""
    digest = hashlib.sha256(f"{embedder.info.name}\x00{FORMAT_VERSION}".encode())
    for r in data.records:
        digest.update(orjson.dumps(r, option=orjson.OPT_SORT_KEYS))
    pages = [
        Page(
            source=KB,
            source_path=str(r["_id"]),
            title=str(r["title"]),
            text=str(r["text"]),
            kind="text",
            context=str(r["entity_name"]),
        )
        for r in data.records
    ]
    return pages_store(KB, digest.hexdigest(), pages, embedder)


def pages_store(kb: str, digest: str, pages: list[Page], embedder: Embedder) -> Path:
    """A store under ``bench/.cache/KB-DIGEST`` holding one snapshot of ``pages`` (each chunked
    as the indexer would), built and embedded the first time and read back after that.
    ``digest`` must change with anything that shapes the snapshot (the pages, the embedder, the
    snapshot format)."""
    store_dir = CACHE / f"{kb}-{digest[:16]}" / "store"
    store = LocalStore(store_dir)
    if store.latest(kb) is not None:
        return store_dir
    chunks = [c for p in pages for c in chunk_page(p)]
    start = time.perf_counter()
    vectors, _ = embed_chunks(embedder, chunks, {}, batch_size=64, progress=_progress)
    print(f"  {kb}: embedded {len(chunks)} chunks in {time.perf_counter() - start:.0f} s")
    staging = store.staging_dir(kb)
    version = new_version_id(digest)
    write_pages_snapshot(
        staging,
        knowledge_base=kb,
        version=version,
        embedder=embedder.info,
        pages=pages,
        chunks=chunks,
        vectors=vectors,
    )
    store.publish(kb, staging, version)
    return store_dir


def _progress(done: int, total: int) -> None:
    if done % 1024 < 64 or done == total:
        print(f"  embedding {done}/{total}", flush=True)


def eval_config(store_dir: Path, sidecar: dict[str, Any] | None = None) -> Config:
    """The evaluation config over ``store_dir``, with ``sidecar`` merged into ``[sidecar]``."""
    raw: dict[str, Any] = {
        "index": {"store": str(store_dir)},
        "sidecar": {
            "store": str(store_dir),
            "listen": "127.0.0.1:0",
            "max_results": EVAL_DEPTH,
            "min_score": 0.0,
            "budget_ms": EVAL_BUDGET_MS,
            **(sidecar or {}),
        },
    }
    return parse_config(raw, base=store_dir.parent)


class Ranking:
    """hit@3 and MRR@10 accumulated over queries."""

    def __init__(self) -> None:
        self.hits = 0
        self.rr = 0.0
        self.n = 0

    def add(self, ranked: list[str], relevant: set[str]) -> None:
        self.n += 1
        self.hits += any(d in relevant for d in ranked[:3])
        self.rr += next((1.0 / (i + 1) for i, d in enumerate(ranked[:10]) if d in relevant), 0.0)

    def as_dict(self) -> dict[str, Any]:
        return {
            "hit_at_3": round(self.hits / self.n, 4) if self.n else None,
            "mrr_at_10": round(self.rr / self.n, 4) if self.n else None,
            "turns": self.n,
        }


async def dstc_quality(data: Dstc, engine: Engine) -> dict[str, Any]:
    async def search(query: str) -> list[str]:
        result = await engine.search(SearchInput(query=query, limit=EVAL_DEPTH))
        return [h.chunk.source_path for h in result.hits]

    async def in_session(q: dict[str, Any], hybrid: bool) -> TurnResult:
        """Feed the dialogue's history into one session, then ask its last turn."""
        engine.hybrid_bases = frozenset({KB}) if hybrid else frozenset()
        sid = f"dstc-{q['_id']}-{'hybrid' if hybrid else 'dense'}"
        for turn in q["history"]:
            speaker = Speaker.USER if turn["speaker"] == "U" else Speaker.AGENT
            await engine.turn(TurnInput(session_id=sid, text=turn["text"], speaker=speaker))
        result = await engine.turn(TurnInput(session_id=sid, text=q["text"]))
        engine.end_session(sid)
        return result

    last, previous, ceiling, session = Ranking(), Ranking(), Ranking(), Ranking()
    session_hybrid = Ranking()
    skipped = degraded = 0
    examples: list[dict[str, str]] = []
    for q in data.queries:
        relevant = data.qrels[q["_id"]]
        text = q["text"]
        last.add(await search(text), relevant)
        before = [h["text"] for h in q["history"][-2:]]
        previous.add(await search(" ".join([*before, text])), relevant)
        gold = data.gold_entity(q["_id"])
        ceiling.add(await search(f"{gold}: {text}"), relevant)

        hybrid = await in_session(q, hybrid=True)
        session_hybrid.add([h.chunk.source_path for h in hybrid.hits], relevant)
        result = await in_session(q, hybrid=False)
        skipped += result.skipped is not Skip.NOT_SKIPPED
        degraded += result.degraded
        ranked = [h.chunk.source_path for h in result.hits]
        session.add(ranked, relevant)
        if len(examples) < 8 and result.query != text:
            examples.append({"turn": text, "query": result.query})
    return {
        "last_turn": last.as_dict(),
        "last_turn_with_two_previous": previous.as_dict(),
        "session": {**session.as_dict(), "skipped": skipped, "degraded": degraded},
        "session_hybrid": session_hybrid.as_dict(),
        "gold_entity_ceiling": ceiling.as_dict(),
        "snippets": len(data.records),
        "examples": examples,
    }


def lexical_fallback(data: Dstc, snapshot: LoadedSnapshot, min_lexical_score: float) -> Any:
    """hit@3 / MRR@10 of the BM25 fallback alone: the product's (spoken-query stopwords dropped)
    against Lucene's stopwords only, for the last turn and the gold-entity-prefixed one."""
    searcher = Searcher.build(snapshot)

    def product(text: str) -> list[str]:
        query = relevance.Query(text, None, EVAL_DEPTH, 0.0, min_lexical_score)
        return [snapshot.chunks[label].source_path for label, _ in relevance.rank(searcher, query)]

    def stop33(text: str) -> list[str]:
        hits = snapshot.lexical.search(text, EVAL_DEPTH)
        return [snapshot.chunks[i].source_path for i, s in hits if s >= min_lexical_score]

    out: dict[str, Any] = {}
    for name, ranker in (("spoken_stopwords", product), ("lucene_stopwords_only", stop33)):
        last, prefixed = Ranking(), Ranking()
        for q in data.queries:
            relevant = data.qrels[q["_id"]]
            last.add(ranker(q["text"]), relevant)
            gold = data.gold_entity(q["_id"])
            prefixed.add(ranker(f"{gold}: {q['text']}"), relevant)
        out[name] = {"last_turn": last.as_dict(), "gold_entity_prefixed": prefixed.as_dict()}
    out["spoken_stopwords_dropped"] = len(SPOKEN_STOPWORDS)
    return out


# -- TREC CAsT ------------------------------------------------------------------------------------


CAST_JOINED = 3  # turns joined for the naive baseline, the raw turn included


def content_words(text: str) -> set[str]:
    return {w for w in words(text) if w not in followups.FUNCTION_WORDS_EN}


def cast_quality(path: Path, embedder: Embedder, quick: bool) -> dict[str, Any]:
    rows = [orjson.loads(line) for line in path.read_bytes().splitlines() if line.strip()]
    rows = [r for r in rows if r["history"] and r["raw"].strip() != r["manual_rewrite"].strip()]
    if quick:
        rows = rows[:QUICK_TURNS]
    queries: dict[str, list[str]] = {"raw_turn": [], "session": [], "joined3": []}
    rewrites = []
    for r in rows:
        session = Session(session_id="cast", context_turns=3)
        for said in r["history"]:
            followups.rewrite(session, said)
            followups.record(session, Speaker.USER, said)
        queries["raw_turn"].append(r["raw"])
        queries["session"].append(followups.rewrite(session, r["raw"]))
        queries["joined3"].append(" ".join([*r["history"], r["raw"]][-CAST_JOINED:]))
        rewrites.append(r["manual_rewrite"])
    target = embedder.embed_batch(rewrites)
    scores = {name: cast_scores(qs, rewrites, embedder, target) for name, qs in queries.items()}
    changed = sum(a != b for a, b in zip(queries["raw_turn"], queries["session"], strict=True))
    return {
        "turns": len(rows),
        "rewritten": changed,
        **scores,
        "examples": [
            {"turn": a, "query": b, "rewrite": c}
            for a, b, c in list(
                zip(queries["raw_turn"], queries["session"], rewrites, strict=True)
            )[:6]
        ],
    }


def cast_scores(
    queries: list[str], rewrites: list[str], embedder: Embedder, target: np.ndarray
) -> dict[str, float]:
    """How close each query is to its human rewrite: the share of the rewrite's content words it
    holds (recall), the share of its own content words the rewrite holds (precision: a query that
    joins every turn holds more of the rewrite's words and much else), and the cosine of the two
    embedded texts, the measure that weighs both."""
    recall, precision = [], []
    for query, rewrite in zip(queries, rewrites, strict=True):
        want, have = content_words(rewrite), content_words(query)
        if want:
            recall.append(len(want & have) / len(want))
        if have:
            precision.append(len(want & have) / len(have))
    cosine = np.sum(embedder.embed_batch(queries) * target, axis=1)
    return {
        "content_recall": round(float(np.mean(recall)), 4),
        "content_precision": round(float(np.mean(precision)), 4),
        "cosine": round(float(cosine.mean()), 4),
    }


# -- main -----------------------------------------------------------------------------------------


async def run(data_dir: Path, quick: bool) -> dict[str, Any]:
    from index.embedders.local import LocalEmbedder
    from sidecar.edge.server import create_server

    started = time.perf_counter()
    out: dict[str, Any] = {
        "quick": quick,
        "python": platform.python_version(),
        "machine": platform.machine(),
    }
    out["skip"] = skip_quality(data_dir / "turns-dstc11" / "labeled_user_turns.jsonl", SkipPolicy())
    print(f"skip: {json.dumps({k: out['skip'][k] for k in ('precision', 'recall')})}")

    dstc = load_dstc(data_dir / "dstc11-faq-reviews", quick)
    embedder = LocalEmbedder()
    store_dir = await asyncio.to_thread(dstc_store, dstc, embedder)
    sidecar = await create_server(eval_config(store_dir), embedder=embedder, poll=False)
    try:
        out["dstc11"] = await dstc_quality(dstc, sidecar.engine)
        snapshot = sidecar.engine.holder.get(KB)
        assert snapshot is not None  # the server serves only once it is loaded
        out["dstc11"]["lexical_fallback"] = lexical_fallback(
            dstc, snapshot, sidecar.config.sidecar.min_lexical_score
        )
    finally:
        await sidecar.stop(0.5)
    out["dstc11"]["engine"] = {
        "max_results": EVAL_DEPTH,
        "min_score": 0.0,
        "budget_ms": EVAL_BUDGET_MS,
    }
    print("dstc11:", {k: v for k, v in out["dstc11"].items() if k != "examples"})

    out["cast"] = cast_quality(
        data_dir / "followups-trec-cast" / "followup_turns.jsonl", embedder, quick
    )
    print("cast:", {k: v for k, v in out["cast"].items() if k != "examples"})
    await embedder.aclose()
    out["seconds"] = round(time.perf_counter() - started, 1)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=plain(__doc__))
    parser.add_argument("--quick", action="store_true", help="a small subset (smoke mode)")
    parser.add_argument("--data", type=Path, default=DEFAULT_DATA, help="the evaluation data")
    parser.add_argument("--out", type=Path, default=RESULTS, help="the JSON written")
    args = parser.parse_args()
    result = asyncio.run(run(args.data, args.quick))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_bytes(orjson.dumps(result, option=orjson.OPT_INDENT_2))
    print(f"wrote {args.out} in {result['seconds']} s")


if __name__ == "__main__":
    main()
