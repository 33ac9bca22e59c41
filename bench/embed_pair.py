"""A later turn's two query vectors from the embedded model: ``python -m bench.embed_pair``.

A turn searched both folded with the conversation and alone needs two vectors. ``two gets``
is how the engine asked before: two ``QueryEmbedder.get`` at once, each its own job on the
model's one worker thread; ``get_many`` is how it asks now: one ``embed`` call of both texts,
which ``LocalEmbedder`` runs side by side, a thread each. The two ways take turns, pair after
pair, on texts never embedded before (nothing is cached), in one process; the wall time of each
pair, p50 and p95 in ms, and their ratio. ``--quick``: 10 pairs.

Writes ``bench/results/embed_pair.json`` (``--out``).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import time
from pathlib import Path
from typing import Any

from bench.report import plain
from index.embedders.local import LocalEmbedder
from sidecar.turn.query_embedder import QueryEmbedder

RESULTS = Path(__file__).resolve().parent / "results" / "embed_pair.json"
DEADLINE_S = 60.0  # no pair may fall back: the time measured is the embedding's
# (what the caller said before, the turn now): the folded query is both, the turn alone is
# the second; a number makes every pair's texts new to the cache
TURNS = [
    ("How much does roaming cost in Europe?", "and how do I turn it on"),
    ("I want to change the colour scheme of my terminal", "is there a shortcut for that"),
    ("Tell me about Google Drive", "how much can I upload a day there"),
    ("Do you want to know how to prove your immigration status?", "yes I am a noncitizen adult"),
    ("Which hotels have free parking in the centre?", "does the second one take reservations"),
]


def pair(i: int) -> tuple[str, str]:
    before, turn = TURNS[i % len(TURNS)]
    return f"{before} {turn} ({i})", f"{turn} ({i})"


async def two_gets(vectors: QueryEmbedder, texts: tuple[str, str]) -> float:
    deadline = asyncio.get_running_loop().time() + DEADLINE_S
    start = time.perf_counter()
    got = await asyncio.gather(*(vectors.get(text, deadline) for text in texts))
    assert all(v is not None for v in got)
    return (time.perf_counter() - start) * 1000.0


async def get_many(vectors: QueryEmbedder, texts: tuple[str, str]) -> float:
    deadline = asyncio.get_running_loop().time() + DEADLINE_S
    start = time.perf_counter()
    got = await vectors.get_many(texts, deadline)
    assert all(v is not None for v in got)
    return (time.perf_counter() - start) * 1000.0


def summary(ms: list[float]) -> dict[str, float]:
    ordered = sorted(ms)
    return {
        "p50_ms": round(statistics.median(ordered), 2),
        "p95_ms": round(ordered[min(len(ordered) - 1, int(0.95 * len(ordered)))], 2),
    }


async def run(pairs: int) -> dict[str, Any]:
    embedder = LocalEmbedder()
    try:
        vectors = QueryEmbedder(embedder, cache_size=4 * pairs + 8)
        await vectors.get_many(pair(-1), asyncio.get_running_loop().time() + DEADLINE_S)  # warm
        ways = {"two_gets": two_gets, "get_many": get_many}
        times: dict[str, list[float]] = {name: [] for name in ways}
        for i in range(pairs):
            order = list(ways) if i % 2 == 0 else list(reversed(ways))
            for n, name in enumerate(order):
                times[name].append(await ways[name](vectors, pair(2 * i + n)))
    finally:
        await embedder.aclose()
    out = {name: summary(ms) for name, ms in times.items()}
    return {
        "pairs": pairs,
        "cpus": os.cpu_count(),
        **out,
        "get_many_over_two_gets_p50": round(
            out["get_many"]["p50_ms"] / out["two_gets"]["p50_ms"], 3
        ),
        "load_average": [round(x, 2) for x in os.getloadavg()],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=plain(__doc__))
    parser.add_argument("--pairs", type=int, default=200, help="pairs embedded (default 200)")
    parser.add_argument("--quick", action="store_true", help="10 pairs")
    parser.add_argument("--out", type=Path, default=RESULTS, help="the JSON written")
    args = parser.parse_args()
    result = asyncio.run(run(10 if args.quick else args.pairs))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n", encoding="utf-8")
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
