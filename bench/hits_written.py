"""What writing a Search's hits costs, from decoded chunks or from the chunk table
(``python -m bench.hits_written``).

In one process, over the ``search`` suite's cached snapshot (built if missing), its mapped chunk
table and answers of ``HITS`` hits, two workloads: ``fresh``, labels drawn at random over the
whole base (varied questions over a large base: nearly every hit new to both caches), and
``repeated``, answers drawn from a pool of ``--pool`` asked again (a small base, or the same
questions). Three ways, each with its own caches kept across rounds, as a serving process keeps
them, in alternating rounds of ``--calls`` answers (load falls on all alike):

    decoded   as a plain Search was written before: each hit's chunk read from the table (its
              decoded-chunk cache, 2 MiB) into a ``Hit``, its message kept or encoded
              (``ChunkMessages.pieces``)
    table     ``TableHits`` written from the table's bytes (``ChunkMessages.table_pieces``,
              encodings kept on a second sighting)
    unkept    ``table_encoded`` for every hit, nothing kept: whether keeping is worth it

Each answer's pieces are joined, as ``wire.search_response`` joins them. Prints and writes
(``--out``, default ``bench/results/hits_written.json``) CPU us an answer (``time.thread_time``),
the least of ``--rounds`` rounds, and each way over ``decoded``.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from bench.corpus import CorpusSpec, load_or_generate
from bench.ours import build_snapshot
from bench.report import plain
from index.tables import ChunkTable
from sidecar.edge.messages import ChunkMessages, table_encoded
from sidecar.turn.hits import Hit, TableHits

RESULTS = Path(__file__).resolve().parent / "results" / "hits_written.json"
HITS = 10  # a Search's default max_results
KB = "bench"
KEY = b"\x0a"  # SearchResponse.chunks' key

Answer = list[tuple[int, float]]
Way = Callable[[ChunkTable, list[Answer]], None]


def _decoded(messages: ChunkMessages) -> Way:
    def write(table: ChunkTable, answers: list[Answer]) -> None:
        for found in answers:
            parts: list[bytes] = []
            messages.pieces(parts, KEY, [Hit(KB, table[label], s) for label, s in found])
            b"".join(parts)

    return write


def _table(messages: ChunkMessages) -> Way:
    def write(table: ChunkTable, answers: list[Answer]) -> None:
        for found in answers:
            parts: list[bytes] = []
            messages.table_pieces(parts, KEY, TableHits(KB, table, found))
            b"".join(parts)

    return write


def _unkept(table: ChunkTable, answers: list[Answer]) -> None:
    blob = table.blob
    for found in answers:
        parts: list[bytes] = []
        for label, _ in found:
            raw = table.utf8(label)
            assert raw is not None  # a build's chunks are all within their caps, and UTF-8
            parts += (KEY, table_encoded(KB, blob, raw), b"\x45\0\0\0\0")
        b"".join(parts)


def _answers(rng: random.Random, n: int, calls: int, pool: list[Answer] | None) -> list[Answer]:
    if pool is not None:
        return [rng.choice(pool) for _ in range(calls)]
    return [[(rng.randrange(n), 0.5) for _ in range(HITS)] for _ in range(calls)]


def measure(n: int, dim: int, queries: int, calls: int, rounds: int, pool: int) -> dict[str, Any]:
    folder, _ = build_snapshot(load_or_generate(CorpusSpec(n=n, dim=dim, queries=queries)))
    table = ChunkTable.open(folder / "chunks.bin")
    rng = random.Random(20240607)
    pools: dict[str, list[Answer] | None] = {
        "fresh": None,
        "repeated": _answers(rng, len(table), pool, None),
    }
    out: dict[str, Any] = {"n": len(table), "dim": dim, "calls": calls, "rounds": rounds}
    for workload, kept in pools.items():
        ways: dict[str, Way] = {
            "decoded": _decoded(ChunkMessages()),
            "table": _table(ChunkMessages()),
            "unkept": _unkept,
        }
        best = dict.fromkeys(ways, float("inf"))
        for _ in range(rounds):
            answers = _answers(rng, len(table), calls, kept)  # the same answers for every way
            for name, way in ways.items():
                start = time.thread_time()
                way(table, answers)
                best[name] = min(best[name], (time.thread_time() - start) / calls * 1e6)
        out[workload] = {
            "us_per_answer": {k: round(v, 1) for k, v in best.items()},
            "over_decoded": {k: round(v / best["decoded"], 3) for k, v in best.items()},
        }
    out["load"] = [round(x, 2) for x in os.getloadavg()]
    return out


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=plain(__doc__))
    parser.add_argument("--n", type=int, default=50_000, help="chunks in the base (default 50,000)")
    parser.add_argument("--dim", type=int, default=1536, help="vector dimension (default 1536)")
    parser.add_argument("--queries", type=int, default=1000, help="as the corpus was cached with")
    parser.add_argument("--calls", type=int, default=2000, help="answers written a round")
    parser.add_argument("--rounds", type=int, default=7, help="rounds, the ways interleaved")
    parser.add_argument("--pool", type=int, default=200, help="answers the repeated ones are of")
    parser.add_argument("--out", type=Path, default=RESULTS, help="the JSON written")
    args = parser.parse_args(argv)
    result = measure(args.n, args.dim, args.queries, args.calls, args.rounds, args.pool)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n", encoding="utf-8")
    print(json.dumps(result, indent=2))
    return result


if __name__ == "__main__":
    main()
