"""Where a ``Turn``'s server-side time goes: ``python -m bench.turn_breakdown [--quick]``.

The ``local_default`` scenario of ``bench.turn_latency`` (the same calls, CONCURRENCY at once,
paced as spoken, the embedded model, a 150 ms budget) through the engine in process (no gRPC:
``bench.turn_latency``'s client-side minus server-side time is the RPC's share), the embedded
model behind a subclass that times, per turn, from the instrument's side only (nothing of it is
in the sidecar): how long its embedder call waited for the model's worker thread (``queue``),
each text's run through the model (``model``, with its token count), the hop back to the event
loop once the last text is done (``back``); and from the turn's own timings its ranking
(``search``) and the rest (``python``: the skip policy, the follow-up plan, recording the
turn, the hand-offs not counted above). Turns are grouped by each call's first turn (nothing
to fold in yet) and its later ones, and by how many texts the turn embedded (0: answered from
the cache or skipped, 1: the turn as said, 2: the folded query and the turn alone).

``--agent`` adds, after each user turn's answer, an agent turn of the base's words (a chunk's
first sentence), embedded in the background for the page prior, and measures it two ways in
turn, AGENT_ROUNDS rounds: on the model's one worker as a caller's query (as before
``QueryEmbedder.later``), and on the background lane behind the callers' queries. Writes
``bench/results/turn_breakdown.json``.
"""

from __future__ import annotations

import argparse
import asyncio
import contextvars
import json
import os
import random
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from bench.report import plain
from bench.turn_latency import CONCURRENCY, FAQ, WORK, build, pause_s, workload, write_config
from index.embedders.base import Vectors
from index.embedders.local import LocalEmbedder
from index.snapshot import load_snapshot
from index.store import LocalStore
from sidecar.config import SidecarConfig
from sidecar.snapshots.holder import SnapshotHolder
from sidecar.snapshots.searcher import Searcher
from sidecar.turn.engine import Engine, Speaker, TurnInput
from sidecar.turn.sessions import SessionStore

RESULTS = Path(__file__).resolve().parent / "results" / "turn_breakdown.json"
BUDGET_MS = 150


@dataclass(slots=True)
class Call:
    """One embedder call, as the instrument saw it."""

    texts: tuple[str, ...]
    called: float = 0.0
    started: float = 0.0  # the first text's run began (on a worker thread)
    ended: float = 0.0  # the last text's run ended
    back: float = 0.0  # the awaiting coroutine resumed
    model_ms: list[float] = field(default_factory=list)
    tokens: list[int] = field(default_factory=list)
    background: bool = False


# the turn whose embedder calls are being recorded (copied into the tasks the turn starts)
_CURRENT: contextvars.ContextVar[list[Call] | None] = contextvars.ContextVar("calls", default=None)


class TimedLocal(LocalEmbedder):
    """The embedded model, timing each call and each text's run (on the worker threads)."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self._lock = threading.Lock()
        self._runs: dict[str, tuple[float, float]] = {}  # text -> its run's start, end
        self.background: list[Call] = []  # calls made outside a timed turn (agent turns)

    async def embed(self, texts: Sequence[str]) -> Vectors:
        call = Call(tuple(texts), called=time.perf_counter())
        vectors = await super().embed(texts)
        call.back = time.perf_counter()
        self._close(call)
        return vectors

    async def embed_later(self, texts: Sequence[str]) -> Vectors:
        call = Call(tuple(texts), called=time.perf_counter())
        vectors = await super().embed_later(texts)
        call.back = time.perf_counter()
        self._close(call)
        return vectors

    def _close(self, call: Call) -> None:
        with self._lock:
            runs = [self._runs.pop(text) for text in call.texts if text in self._runs]
        if not runs:
            return
        call.started = min(start for start, _ in runs)
        call.ended = max(end for _, end in runs)
        call.model_ms = [(end - start) * 1000.0 for start, end in runs]
        call.tokens = [len(self._tokenizer.encode(text).ids) for text in call.texts]
        calls = _CURRENT.get()
        if calls is not None:
            calls.append(call)
        else:
            call.background = True
            self.background.append(call)

    def _embed_one(self, text: str) -> Vectors:
        start = time.perf_counter()
        vector = super()._embed_one(text)
        end = time.perf_counter()
        with self._lock:
            self._runs[text] = (start, end)
        return vector


@dataclass(slots=True)
class Measured:
    first: bool
    skipped: bool
    total_ms: float
    embed_ms: float
    search_ms: float
    calls: list[Call]
    followup: str


def engine_over(folder: Path, embedder: TimedLocal, budget_ms: int) -> Engine:
    snapshot = load_snapshot(folder)
    holder = SnapshotHolder()
    holder.publish(Searcher.build(snapshot))
    kb = snapshot.manifest.knowledge_base
    config = SidecarConfig(budget_ms=budget_ms)
    sessions = SessionStore(max_sessions=1024, ttl_s=600, context_turns=config.context_turns)
    return Engine(config, embedder, holder, frozenset({kb}), sessions, default_knowledge_base=kb)


async def one_call(
    engine: Engine, session: str, turns: list[str], agent: list[str], out: list[Measured]
) -> None:
    rng = random.Random(session)
    for n, text in enumerate(turns):
        await asyncio.sleep(pause_s(rng, text))
        calls: list[Call] = []
        token = _CURRENT.set(calls)
        try:
            result = await engine.turn(TurnInput(session_id=session, text=text))
        finally:
            _CURRENT.reset(token)
        out.append(
            Measured(
                first=n == 0,
                skipped=result.skipped.name != "NOT_SKIPPED",
                total_ms=result.timings.total_ms,
                embed_ms=result.timings.embed_ms,
                search_ms=result.timings.search_ms,
                calls=calls,
                followup=result.followup.source,
            )
        )
        if agent:
            said = rng.choice(agent)
            await engine.turn(TurnInput(session_id=session, text=said, speaker=Speaker.AGENT))


def percentile(values: list[float], p: float) -> float:
    return round(float(np.percentile(values, p)), 2) if values else 0.0


def stages(group: list[Measured]) -> dict[str, Any]:
    """p50 of each stage over ``group`` (the embedder stages over the turns that embedded)."""
    calls = [c for m in group for c in m.calls]
    return {
        "turns": len(group),
        "total_p50_ms": percentile([m.total_ms for m in group], 50),
        "total_p95_ms": percentile([m.total_ms for m in group], 95),
        "total_p99_ms": percentile([m.total_ms for m in group], 99),
        "embed_p50_ms": percentile([m.embed_ms for m in group], 50),
        "search_p50_ms": percentile([m.search_ms for m in group], 50),
        "python_p50_ms": percentile([m.total_ms - m.embed_ms - m.search_ms for m in group], 50),
        "queue_p50_ms": percentile([(c.started - c.called) * 1000.0 for c in calls], 50),
        "queue_p95_ms": percentile([(c.started - c.called) * 1000.0 for c in calls], 95),
        "queue_p99_ms": percentile([(c.started - c.called) * 1000.0 for c in calls], 99),
        "model_p50_ms": percentile([max(c.model_ms) for c in calls], 50),
        "model_per_text_p50_ms": percentile([ms for c in calls for ms in c.model_ms], 50),
        "tokens_p50": percentile([float(max(c.tokens)) for c in calls], 50),
        "back_p50_ms": percentile([(c.back - c.ended) * 1000.0 for c in calls], 50),
    }


def report(
    measured: list[Measured], background: list[Call], agent: Sequence[str] = ()
) -> dict[str, Any]:
    searched = [m for m in measured if not m.skipped]
    said = set(agent)
    out: dict[str, Any] = {
        "all_searched": stages(searched),
        # user turns that embedded an agent turn's words themselves (not ready in time)
        "turns_embedding_an_agent_turn": sum(
            any(text in said for c in m.calls for text in c.texts) for m in searched
        ),
        "first_turns": stages([m for m in searched if m.first]),
        "later_turns": stages([m for m in searched if not m.first]),
    }
    for texts in (0, 1, 2):
        group = [m for m in searched if sum(len(c.texts) for c in m.calls) == texts]
        out[f"embedded_{texts}_texts"] = stages(group)
    sources: dict[str, int] = {}
    for m in searched:
        sources[m.followup] = sources.get(m.followup, 0) + 1
    out["followup_sources"] = sources
    out["background_calls"] = {
        "calls": len(background),
        "model_p50_ms": percentile([max(c.model_ms) for c in background], 50),
        "tokens_p50": percentile([float(max(c.tokens)) for c in background], 50),
    }
    return out


def agent_lines(folder: Path, count: int = 50) -> list[str]:
    """Agent turns of the base's own words: the first sentence of some chunks."""
    chunks = load_snapshot(folder, checksums=False).chunks
    rng = random.Random(7)
    picked = rng.sample(list(chunks), min(count, len(chunks)))
    return [c.text.split(". ")[0][:300] for c in picked if c.text.strip()]


async def measure(
    calls: list[list[str]], folder: Path, threads: int, lines: list[str], on_worker: bool
) -> dict[str, Any]:
    """One pass over ``calls``; ``on_worker``: agent turns embedded as callers' queries are
    (on the model's one worker, in turn with them), as before ``QueryEmbedder.later``."""
    embedder = TimedLocal(threads=threads)
    engine = engine_over(folder, embedder, BUDGET_MS)
    if on_worker:
        vectors = engine.vectors

        async def as_a_caller(query: str, deadline: float) -> Vectors | None:
            return await vectors.get(query, deadline)

        setattr(vectors, "later", as_a_caller)  # noqa: B010 (a method replaced on one object)
    measured: list[Measured] = []
    gate = asyncio.Semaphore(CONCURRENCY)

    async def one(i: int, turns: list[str]) -> None:
        async with gate:
            await one_call(engine, f"call-{i}", turns, lines, measured)

    try:
        await one(-1, ["How do I open a new tab?"])  # warm-up
        measured.clear()
        embedder.background.clear()
        await asyncio.gather(*(one(i, turns) for i, turns in enumerate(calls)))
    finally:
        await engine.aclose()
        await embedder.aclose()
    return report(measured, embedder.background, lines)


# --agent: agent turns on the model's worker (before) and on the background lane (after), taking
# turns round after round, so that load from elsewhere falls on both alike
AGENT_ROUNDS = 3


async def run(quick: bool, agent: bool = False) -> dict[str, Any]:
    if not FAQ.is_file():
        return {"skipped": f"shared data not present: {FAQ.parent}"}
    calls = workload(quick)
    config = write_config(WORK / "local", "local", 0)
    await asyncio.to_thread(build, config, "local")
    folder = LocalStore(config.index.store).latest_dir(config.knowledge_bases[0].name)
    threads = config.embedder.threads
    out: dict[str, Any] = {
        "suite": "turn_breakdown",
        "quick": quick,
        "agent_turns": agent,
        "concurrency": CONCURRENCY,
        "budget_ms": BUDGET_MS,
    }
    if not agent:
        out.update(await measure(calls, folder, threads, [], on_worker=False))
    else:
        lines = agent_lines(folder)
        rounds = []
        for _ in range(1 if quick else AGENT_ROUNDS):
            pair = {}
            for name, on_worker in (("on_worker", True), ("background_lane", False)):
                pair[name] = await measure(calls, folder, threads, lines, on_worker)
                shown = {
                    k: pair[name][k] for k in ("all_searched", "turns_embedding_an_agent_turn")
                }
                print(name, json.dumps(shown), flush=True)
            rounds.append(pair)
        out["rounds"] = rounds
    out["load_average"] = os.getloadavg()
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=plain(__doc__))
    parser.add_argument("--quick", action="store_true", help="30 turns")
    parser.add_argument("--agent", action="store_true", help="an agent turn after each answer")
    args = parser.parse_args()
    result = asyncio.run(run(args.quick, args.agent))
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps(result, indent=2) + "\n", encoding="utf-8")
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
