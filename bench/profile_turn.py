"""What a ``Turn`` costs in Python beside a ``Search``: ``python -m bench.profile_turn``.

The engine in-process (no gRPC), every query vector already cached, so what is timed is the
turn's own work: validation, the skip policy, the follow-up plan (the gazetteer scan of the turn,
once), the ranking, recording the turn. A short conversation (a user naming a page, the agent
naming another, follow-ups, a backchannel) is replayed in a fresh session each pass; beside it the
same user turns go through ``Search``, and again with the base served ``hybrid = true``. Two
bases:

* the Windows Terminal docs of ``../shared/data`` (623 chunks; ``examples/kb`` without the data);
* ``bench.ours``' synthetic pages at ``--n`` chunks (100,000 by default), "Document 1234" titles.

Chunks are embedded with ``FakeEmbedder`` (the vectors' values do not change the Python cost,
but they do hnswlib's: the synthetic pages' vectors are nearly all alike, so the graph is searched
at a large ``ef``, ~3 ms a query at 100,000). hnswlib's own time is measured apart (its ``Index``
behind a proxy that times each ``knn_query``) and taken out: ``us_per_turn_python`` and
``us_per_search_python`` are what the sidecar's Python costs beside the graph search.
Prints and writes ``bench/results/profile_turn.json``: microseconds per user Turn, per Search,
and their ratio, measured in one run; beside the wall-clock figures, this thread's CPU per Turn and
per Search (``us_per_turn_cpu``, ``us_per_search_cpu``), which other processes on a loaded
machine change less (not at all the time this one waits for a core), and the Python's share of
it, the graph's CPU taken out (``us_per_turn_python_cpu``, ``us_per_search_python_cpu``).

``--flush-mb M`` writes to M MiB of memory after each graph search, inside the graph's timed
share (so taken out): the 623-chunk base's graph then leaves the CPU caches as cold as the
100,000-chunk one's does (its search walks tens of MB), and the Python after it pays the same
misses. Measured so, a Search's and a Turn's Python at 623 chunks rise to what they are at
100,000: the growth with N is cold caches after the graph, not per-call work of size N. (The
wall-clock figures, ``us_per_hybrid_search`` among them, then include the writing.)
``--replay`` is the other way round: each graph search is answered, after its first, with the
result kept from it (no walk of the graph), so the Python runs with the caches as it left them:
its own work, with no base's graph in between.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import tempfile
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np

from bench.ours import _chunks
from bench.quality_turns import DEFAULT_DATA
from index.chunker import chunk_page
from index.config import HnswConfig
from index.embedders.base import FakeEmbedder
from index.entities import chunk_entity
from index.snapshot import load_snapshot, write_snapshot
from index.sources.markdown import load_markdown
from index.store import new_version_id
from index.types import Chunk
from sidecar.config import SidecarConfig
from sidecar.snapshots.holder import SnapshotHolder
from sidecar.snapshots.refresh import freeze_heap
from sidecar.snapshots.searcher import Searcher
from sidecar.turn.engine import Engine, SearchInput, Speaker, TurnInput
from sidecar.turn.sessions import SessionStore

RESULTS = Path(__file__).resolve().parent / "results" / "profile_turn.json"
ROOT = Path(__file__).resolve().parents[1]
KB = "kb"
DIM = 384
PASSES = 300  # conversations replayed per base: enough calls for a stable mean
HNSW = HnswConfig()


def docs_chunks(data_dir: Path) -> list[Chunk]:
    folder = data_dir / "docs-windows-terminal" / "docs"
    if not folder.is_dir():
        folder = ROOT / "examples" / "kb"
    pages, _ = load_markdown(KB, folder)
    return [c for p in pages for c in chunk_page(p)]


class TimedIndex:
    """An hnswlib ``Index`` that adds the seconds each ``knn_query`` takes on ``clock`` (wall
    time; ``time.thread_time`` for this thread's CPU) to ``seconds``, and this thread's CPU
    in it to ``cpu_seconds``."""

    def __init__(
        self,
        index: Any,
        clock: Callable[[], float] = time.perf_counter,
        flush_mb: int = 0,
        replay: bool = False,
    ) -> None:
        self._index = index
        self._clock = clock
        self.seconds = self.cpu_seconds = 0.0
        self.calls = 0
        # written after each search (``--flush-mb``): what a large graph's walk does to the caches
        self._flush = np.zeros(flush_mb << 17) if flush_mb else None  # float64: 2**17 a MiB
        # each search's result by (query bytes, k), answered again (``--replay``); None: searched
        self._kept: dict[tuple[bytes, int], Any] | None = {} if replay else None

    def knn_query(self, *args: Any, **kwargs: Any) -> Any:
        started, cpu = self._clock(), time.thread_time()
        try:
            return self._search(*args, **kwargs)
        finally:
            if self._flush is not None:
                self._flush[::8] += 1.0  # one write a 64-byte line
            self.seconds += self._clock() - started
            self.cpu_seconds += time.thread_time() - cpu
            self.calls += 1

    def _search(self, query: Any, k: int = 1, **kwargs: Any) -> Any:
        if self._kept is None:
            return self._index.knn_query(query, k=k, **kwargs)
        key = (query.tobytes(), k)
        found = self._kept.get(key)
        if found is None:
            found = self._kept[key] = self._index.knn_query(query, k=k, **kwargs)
        return found

    def __getattr__(self, name: str) -> Any:
        return getattr(self._index, name)


def engine_over(
    chunks: list[Chunk], folder: Path, flush_mb: int = 0, replay: bool = False
) -> Engine:
    embedder = FakeEmbedder(dimension=DIM)
    version = new_version_id("profile-turn")
    write_snapshot(
        folder / version,
        knowledge_base=KB,
        version=version,
        embedder=embedder.info,
        chunks=chunks,
        vectors=embedder.embed_batch([c.embed_text for c in chunks]),
        pages={},
        page_count=len({c.source_path for c in chunks}),
        hnsw_m=HNSW.m,
        hnsw_ef_construction=HNSW.ef_construction,
        target_recall=HNSW.target_recall,
        sources=[KB],
    )
    return engine_of(folder / version, flush_mb, replay)


def engine_of(folder: Path, flush_mb: int = 0, replay: bool = False) -> Engine:
    """An engine serving the snapshot in ``folder``, its graph behind a ``TimedIndex``."""
    snapshot = load_snapshot(folder, checksums=False)
    snapshot = replace(snapshot, index=TimedIndex(snapshot.index, flush_mb=flush_mb, replay=replay))
    holder = SnapshotHolder()
    holder.publish(Searcher.build(snapshot))
    freeze_heap()  # as the refresher does once a snapshot is served: no collection walks it
    embedder = FakeEmbedder(dimension=DIM)
    config = SidecarConfig(budget_ms=10_000)
    sessions = SessionStore(max_sessions=1024, ttl_s=600, context_turns=config.context_turns)
    return Engine(config, embedder, holder, frozenset({KB}), sessions, default_knowledge_base=KB)


def conversation(chunks: list[Chunk]) -> list[tuple[str, str]]:
    """A few turns about two of the base's pages (named as their titles say)."""
    names = list(dict.fromkeys(chunk_entity(c) for c in chunks))
    first, second = names[len(names) // 3], names[2 * len(names) // 3]
    return [
        (Speaker.USER, f"Can you tell me about {first}?"),
        (Speaker.AGENT, f"Sure. {first} is covered, and so is {second}. Which one?"),
        (Speaker.USER, "the second one, how do I change it"),
        (Speaker.USER, "okay"),
        (Speaker.USER, "and is there a keyboard shortcut for that"),
        (Speaker.AGENT, "Yes, there is one. Do you want to know how to set it?"),
        (Speaker.USER, "yes please"),
        (Speaker.USER, "what settings can I change in the profile for the colour scheme"),
    ]


async def measure(engine: Engine, turns: list[tuple[str, str]], passes: int) -> dict[str, Any]:
    user = [text for speaker, text in turns if speaker == Speaker.USER]
    for i in range(2):  # every vector the turns and searches need lands in the cache
        for speaker, text in turns:
            await engine.turn(TurnInput(session_id=f"warm{i}", text=text, speaker=speaker))
    for text in user:
        await engine.search(SearchInput(query=text))
    misses = engine.vectors.stats.misses
    graph = engine.searcher(KB).snapshot.index
    assert isinstance(graph, TimedIndex)
    turn_s = search_s = turn_knn_s = search_knn_s = turn_cpu_s = search_cpu_s = 0.0
    turn_knn = search_knn = 0
    turn_knn_cpu = search_knn_cpu = 0.0  # the graph's share of the thread's CPU
    for n in range(passes):
        started, knn_s, knn = time.perf_counter(), graph.seconds, graph.calls
        cpu, knn_cpu = time.thread_time(), graph.cpu_seconds
        for speaker, text in turns:
            await engine.turn(TurnInput(session_id=f"s{n}", text=text, speaker=speaker))
        turn_cpu_s += time.thread_time() - cpu
        turn_knn_cpu += graph.cpu_seconds - knn_cpu
        turn_s += time.perf_counter() - started
        turn_knn_s += graph.seconds - knn_s
        turn_knn += graph.calls - knn
        engine.end_session(f"s{n}")
        started, knn_s, knn = time.perf_counter(), graph.seconds, graph.calls
        cpu, knn_cpu = time.thread_time(), graph.cpu_seconds
        for text in user:
            await engine.search(SearchInput(query=text))
        search_cpu_s += time.thread_time() - cpu
        search_knn_cpu += graph.cpu_seconds - knn_cpu
        search_s += time.perf_counter() - started
        search_knn_s += graph.seconds - knn_s
        search_knn += graph.calls - knn
    hybrid_s = await hybrid_searches(engine, user, passes)
    if engine.vectors.stats.misses != misses:
        raise RuntimeError("a timed call embedded: the figures would include the embedder")
    turns_timed, searches_timed = passes * len(turns), passes * len(user)
    per_turn = turn_s / turns_timed * 1e6
    per_search = search_s / searches_timed * 1e6
    python_turn = (turn_s - turn_knn_s) / turns_timed * 1e6
    python_search = (search_s - search_knn_s) / searches_timed * 1e6
    python_turn_cpu = (turn_cpu_s - turn_knn_cpu) / turns_timed * 1e6
    python_search_cpu = (search_cpu_s - search_knn_cpu) / searches_timed * 1e6
    return {
        "turns_per_pass": len(turns),
        "us_per_turn": round(per_turn, 1),
        "us_per_search": round(per_search, 1),
        "us_per_hybrid_search": round(hybrid_s / searches_timed * 1e6, 1),
        "turn_over_search": round(per_turn / per_search, 2),
        # this thread's CPU (graph included): what a loaded machine's other processes change less
        "us_per_turn_cpu": round(turn_cpu_s / turns_timed * 1e6, 1),
        "us_per_search_cpu": round(search_cpu_s / searches_timed * 1e6, 1),
        "cpu_turn_over_search": round(
            turn_cpu_s / turns_timed / (search_cpu_s / searches_timed), 2
        ),
        "us_per_turn_python": round(python_turn, 1),
        "us_per_search_python": round(python_search, 1),
        "python_turn_over_search": round(python_turn / python_search, 2),
        # the same on this thread's CPU, the graph's CPU taken out: the figures a load changes least
        "us_per_turn_python_cpu": round(python_turn_cpu, 1),
        "us_per_search_python_cpu": round(python_search_cpu, 1),
        "cpu_python_turn_over_search": round(python_turn_cpu / python_search_cpu, 2),
        "graph_searches_per_turn": round(turn_knn / turns_timed, 2),
        "graph_searches_per_search": round(search_knn / searches_timed, 2),
        "us_per_graph_search": round(
            (turn_knn_s + search_knn_s) / (turn_knn + search_knn) * 1e6, 1
        ),
        "load_average": round(os.getloadavg()[0], 2),
    }


async def hybrid_searches(engine: Engine, user: list[str], passes: int) -> float:
    """Seconds the same searches take with the base served ``hybrid = true``."""
    engine.hybrid_bases = frozenset({KB})
    try:
        started = time.perf_counter()
        for _ in range(passes):
            for text in user:
                await engine.search(SearchInput(query=text))
        return time.perf_counter() - started
    finally:
        engine.hybrid_bases = frozenset()


def engine_kept(
    chunks: list[Chunk], folder: Path, flush_mb: int = 0, replay: bool = False
) -> Engine:
    """``engine_over``, or the snapshot built in ``folder`` before (``--keep``)."""
    built = sorted(p for p in folder.iterdir() if p.is_dir()) if folder.is_dir() else []
    if built:
        return engine_of(built[-1], flush_mb, replay)
    return engine_over(chunks, folder, flush_mb, replay)


async def run(
    data_dir: Path,
    n: int,
    passes: int,
    keep: Path | None,
    flush_mb: int = 0,
    replay: bool = False,
) -> dict[str, Any]:
    out: dict[str, Any] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name, chunks in (("docs", docs_chunks(data_dir)), (f"synthetic-{n}", _chunks(n))):
            engine = engine_kept(chunks, (keep or Path(tmp)) / name, flush_mb, replay)
            try:
                row = await measure(engine, conversation(chunks), passes)
            finally:
                await engine.aclose()
            out[name] = {"chunks": len(chunks), "flush_mb": flush_mb, "replay": replay, **row}
            print(f"{name}: {json.dumps(out[name])}", flush=True)
    return out


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, default=100_000, help="chunks of the synthetic base")
    parser.add_argument("--passes", type=int, default=PASSES)
    parser.add_argument("--data", type=Path, default=DEFAULT_DATA)
    parser.add_argument("--out", type=Path, default=RESULTS)
    parser.add_argument(
        "--keep",
        type=Path,
        help="a folder to keep the snapshots in, and reuse them from (a 100,000-chunk build "
        "takes minutes): runs before and after a change then time the same snapshots",
    )
    parser.add_argument(
        "--flush-mb",
        type=int,
        default=0,
        help="MiB of memory written after each graph search (taken out with the graph's time): "
        "a small base's Python measured with caches as cold as a large graph leaves them",
    )
    parser.add_argument(
        "--replay",
        action="store_true",
        help="answer each graph search after its first with the result kept from it: the "
        "Python's own cost, with no walk of the graph between calls",
    )
    args = parser.parse_args(argv)
    result = asyncio.run(run(args.data, args.n, args.passes, args.keep, args.flush_mb, args.replay))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    return result


if __name__ == "__main__":
    main()
