"""What a Search's Python costs piece by piece, and what the hooks cost around handlers that
touch more or less data: ``python -m bench.hook_pressure``.

``bench.in_process``'s sidecar (2,000 x 384 by default), its graph's ``knn`` answered from a
canned result (the first answer for each k, kept), so no hnswlib search runs and what is timed
is the sidecar's own Python.

``pieces_us``: parts of a ``Search`` by ``timeit`` on this thread's CPU (least of 5 x
``--number``): the request read into a ``SearchInput``, the vector read, the graph's answer
made into hits, the response written, ``Engine.search`` and the whole handler.

``hooks_us``: the interceptor with every hook (``all``) and with one hook that does nothing
(``nothing``) around each handler, less that handler alone (least of ``--rounds`` rounds of
``--calls`` calls, this thread's CPU): one answering a response written before (``answered``),
``Engine.search`` (``engine``), the whole ``Search`` (``search``), and handlers reading one
attribute of each of N objects picked at random from 200,000 (``walk_N``: data scattered as a
graph search's is). Writes ``bench/results/hook_pressure.json`` (``--out``).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import random
import time
import timeit
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from unittest import mock

import index.snapshot
from bench import report
from bench.corpus import CACHE, CorpusSpec, load_or_generate
from bench.in_process import Context, Handler, cache_option, cpu_us, served, wrapped, written
from bench.ours import _request
from sidecar.edge import service, wire
from sidecar.edge.interceptor import Hook, HookInterceptor
from sidecar.turn.engine import SearchInput, _nearest_hits

RESULTS = Path(__file__).resolve().parent / "results" / "hook_pressure.json"
WALKS = (300, 1_500, 3_000)
OBJECTS = 200_000


class Nothing(Hook):
    """A hook whose start does nothing: the interceptor's own cost."""

    def start(self, call: Any) -> None:
        pass


class _Slot:
    __slots__ = ("value",)

    def __init__(self, value: int) -> None:
        self.value = value


@contextlib.contextmanager
def _canned_graph() -> Iterator[None]:
    """The graph's ``knn`` answered from the first answer for each k, while inside: put back
    after, so nothing else in the process searches a canned graph."""
    real, kept = index.snapshot.knn, {}

    def canned(graph: Any, query: Any, k: int, where: object) -> Any:
        if k not in kept:
            kept[k] = real(graph, query, k, where)
        return kept[k]

    with mock.patch.object(index.snapshot, "knn", canned):
        yield


def _walker(n: int, built: Any) -> Handler:
    objects = [_Slot(i) for i in range(OBJECTS)]
    picks = random.Random(n).sample(objects, n)

    async def walk(request: Any, context: Any) -> Any:
        total = 0
        for o in picks:
            total += o.value
        return built

    return walk


def _pieces(servicer: Any, request: Any, number: int) -> dict[str, float]:
    engine = servicer.engine
    searcher = engine.searcher("bench")
    given = SearchInput(query="", knowledge_base="bench", vector=request.vector)
    vector = engine._vector_from_bytes(request.vector, searcher.snapshot)
    found = _run(engine.search(given))
    policy = servicer._policy("bench")

    timed = {
        "search_input": lambda: service.search_input(request),
        "vector_read": lambda: engine._vector_from_bytes(request.vector, searcher.snapshot),
        "graph_answer_into_hits": lambda: _nearest_hits(searcher, "bench", vector, 10, 0.0),
        "response_written": lambda: wire.search_response(found, policy),
        "engine_search": lambda: _run(engine.search(given)),
        "whole_search": lambda: _run(servicer.Search(request, Context())),
    }
    return {
        name: round(
            min(timeit.repeat(fn, timer=time.thread_time, number=number, repeat=5)) / number * 1e6,
            2,
        )
        for name, fn in timed.items()
    }


def _run(coroutine: Any) -> Any:
    """A coroutine that never waits, run to its end without an event loop's round trip."""
    try:
        coroutine.send(None)
    except StopIteration as stop:
        return stop.value
    raise RuntimeError("the coroutine waited")


async def measure(
    n: int, dim: int, queries: int, calls: int, rounds: int, number: int, cache: Path = CACHE
) -> Any:
    corpus = load_or_generate(CorpusSpec(n=n, dim=dim, queries=queries), cache)
    sidecar, servicer = await served(corpus, dim, cache)
    with _canned_graph():
        try:
            requests = [_request(q) for q in corpus.queries]
            built = await servicer.Search(requests[0], Context())
            given = SearchInput(query="", knowledge_base="bench", vector=requests[0].vector)

            async def answered(request: Any, context: Any) -> Any:
                return built

            async def engine(request: Any, context: Any) -> Any:
                await servicer.engine.search(given)
                return built

            handlers: dict[str, Handler] = {
                "answered": answered,
                "engine": engine,
                "search": servicer.Search,
                **{f"walk_{w}": _walker(w, built) for w in WALKS},
            }
            interceptor = sidecar.guards.interceptors[0]  # type: ignore[union-attr]
            assert isinstance(interceptor, HookInterceptor)
            variants: dict[str, Handler] = {}
            for name, handler in handlers.items():
                variants[name] = handler
                variants[f"all+{name}"] = await wrapped(interceptor, handler, "Search")
                variants[f"nothing+{name}"] = await wrapped(
                    HookInterceptor([Nothing()]), handler, "Search"
                )
            best: dict[str, float] = {}
            for fn in variants.values():
                await cpu_us(fn, requests, calls // 4)
            for _ in range(rounds):
                for name, fn in variants.items():
                    us = await cpu_us(fn, requests, calls)
                    best[name] = min(us, best.get(name, us))
            pieces = _pieces(servicer, requests[0], number)
        finally:
            await sidecar.stop(0.1)
    return {
        "n": n,
        "dim": dim,
        "load_average": os.getloadavg(),
        "pieces_us": pieces,
        "handler_us": {name: round(best[name], 2) for name in handlers},
        "hooks_us": {
            name: {
                hooks: round(best[f"{hooks}+{name}"] - best[name], 2)
                for hooks in ("all", "nothing")
            }
            for name in handlers
        },
    }


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=report.plain(__doc__))
    parser.add_argument("--n", type=int, default=2_000, help="chunks of the synthetic corpus")
    parser.add_argument("--dim", type=int, default=384, help="its vectors' dimension")
    parser.add_argument("--queries", type=int, default=100, help="as the corpus was cached with")
    parser.add_argument("--calls", type=int, default=4_000, help="calls a round, per handler")
    parser.add_argument("--rounds", type=int, default=5, help="rounds; the least is kept")
    parser.add_argument("--number", type=int, default=20_000, help="timeit's calls a repeat")
    parser.add_argument("--out", type=Path, default=RESULTS, help="the JSON written")
    cache_option(parser)
    args = parser.parse_args(argv)
    result: dict[str, Any] = asyncio.run(
        measure(args.n, args.dim, args.queries, args.calls, args.rounds, args.number, args.cache)
    )
    return written(result, args.out)


if __name__ == "__main__":
    main()
