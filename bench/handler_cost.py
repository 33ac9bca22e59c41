"""The CPU a ``Search`` costs in the sidecar's own Python: ``python -m bench.handler_cost``.

A sidecar built by ``create_server`` over the ``search`` suite's cached corpus (20,000 x 384 by
default), its ``Search`` handler called in this process with no transport: through the
interceptor with every hook (``wrapped``), without the interceptor (``bare``), each with the
response serialized as grpc does next (by the method's serializer), and hnswlib's
``knn_query`` of the same queries alone (``knn``); then the interceptor with one hook at a time,
against none, for what each hook costs. Times are this thread's CPU (``time.thread_time``:
grpc's own threads and other processes do not count), the least of ``--rounds`` rounds of
``--calls`` calls. ``wrapped - knn`` is the sidecar's Python share of a call, without grpc's
(de)serialisation and transport (``bench.search``'s ``sidecar_share_ms`` includes those).

hnswlib searched in a loop by itself keeps the graph in the CPU's caches; inside a call, after
the handler's Python, the same search costs more. So the graph is also timed inside the wrapped
calls (its ``knn_query`` behind a proxy that adds this thread's CPU): ``knn_in_call_us``, and
``python_beside_graph_us`` (``wrapped`` less it) is what the sidecar's own code costs a call.
``hooks_alone_us``: the interceptor and its hooks around a handler that returns a response built
before, less that handler alone (the hooks without a graph search evicting them between calls).

``ways_alternating``: ``wrapped`` with the engine's short way for a plain Search
(``Engine._nearest``) and with it turned off (the same calls through ``relevance.rank``), in
alternating blocks of ``WAY_BLOCK`` calls (load falls on both alike; means, not least rounds):
each way's CPU a call and the graph's inside it (what each way leaves in the caches);
``plain_over_general`` of the whole call, ``python_plain_over_general`` of the Python beside
the graph.

Writes ``bench/results/handler_cost.json`` (``--out``).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import time
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

from bench.corpus import CACHE, CorpusSpec, load_or_generate
from bench.in_process import (
    Context,
    Handler,
    cache_option,
    cpu_us,
    serialized,
    served,
    wrapped,
    written,
)
from bench.ours import _request
from bench.profile_turn import TimedIndex
from sidecar.edge.interceptor import HookInterceptor
from sidecar.gen import retrieval_pb2 as pb

RESULTS = Path(__file__).resolve().parent / "results" / "handler_cost.json"
WARM_CALLS = 200


def _timed_graph(holder: Any, kb: str) -> TimedIndex:
    """Serve ``kb``'s searcher again with its graph behind a ``TimedIndex`` on this thread's CPU."""
    searcher = holder.use(kb)
    graph = TimedIndex(searcher.snapshot.index, time.thread_time)
    holder.publish(replace(searcher, snapshot=replace(searcher.snapshot, index=graph)))
    return graph


# calls a block when the two ways alternate: short enough that load moves both alike
WAY_BLOCK = 50


async def _ways(
    engine: Any, fn: Handler, requests: list[Any], graph: TimedIndex, calls: int
) -> dict[str, Any]:
    """``fn`` (the wrapped handler) with the engine's short way for a plain Search and with
    the general way, alternating blocks of WAY_BLOCK calls, ``calls`` each: each way's CPU a
    call and the graph's inside it. Empty for a tree without the short way (a before run)."""
    if not hasattr(engine, "_plain"):
        return {}
    spent = {"plain": [0.0, 0.0], "general": [0.0, 0.0]}  # this thread's CPU, the graph's
    for block in range(2 * max(1, calls // WAY_BLOCK)):
        way = "general" if block % 2 else "plain"
        graph_s = graph.seconds
        with _general_way(engine, way == "general"):
            us = await cpu_us(fn, requests, WAY_BLOCK)
        spent[way][0] += us
        spent[way][1] += (graph.seconds - graph_s) / WAY_BLOCK * 1e6
    blocks = max(1, calls // WAY_BLOCK)
    plain, general = (spent[w][0] / blocks for w in ("plain", "general"))
    return {
        "ways_alternating": {
            way: {"cpu_us": round(cpu / blocks, 1), "knn_in_call_us": round(g / blocks, 1)}
            for way, (cpu, g) in spent.items()
        },
        "plain_over_general": round(plain / general, 3),
        "python_plain_over_general": round(
            (plain - spent["plain"][1] / blocks) / (general - spent["general"][1] / blocks), 3
        ),
    }


@contextlib.contextmanager
def _general_way(engine: Any, on: bool) -> Iterator[None]:
    """While ``on``: every Search takes the engine's general way (``relevance.rank``), not the
    short way a plain one takes (``Engine._plain`` answers False on this engine alone)."""
    if not on:
        yield
        return
    engine._plain = lambda *args: False
    try:
        yield
    finally:
        del engine._plain


async def measure(
    n: int, dim: int, queries: int, calls: int, rounds: int, cache: Path = CACHE
) -> dict[str, Any]:
    corpus = load_or_generate(CorpusSpec(n=n, dim=dim, queries=queries), cache)
    sidecar, servicer = await served(corpus, dim, cache)
    try:
        assert sidecar.guards is not None
        bare: Handler = servicer.Search
        interceptor = sidecar.guards.interceptors[0]
        assert isinstance(interceptor, HookInterceptor)
        requests = [_request(q) for q in corpus.queries]
        index = sidecar.holder.get("bench")
        assert index is not None
        graph = _timed_graph(sidecar.holder, "bench")

        async def knn(request: Any, context: Any) -> None:
            index.index.knn_query(corpus.queries[knn.i % len(requests)].reshape(1, -1), k=10)  # type: ignore[attr-defined]
            knn.i += 1  # type: ignore[attr-defined]

        knn.i = 0  # type: ignore[attr-defined]
        built = await bare(requests[0], Context())

        async def answered(request: Any, context: Any) -> Any:
            return built

        variants: dict[str, Handler] = {
            "wrapped": serialized(await wrapped(interceptor, bare, "Search"), pb.SearchResponse),
            "bare": serialized(bare, pb.SearchResponse),
            "knn": knn,
            "hooks_alone": await wrapped(interceptor, answered, "Search"),
            "answered": answered,
        }
        for hook in interceptor.hooks:
            variants[f"hook:{type(hook).__name__}"] = await wrapped(
                HookInterceptor([hook]), bare, "Search"
            )
        best: dict[str, float] = {}
        for fn in variants.values():
            await cpu_us(fn, requests, WARM_CALLS)
        for _ in range(rounds):
            for name, fn in variants.items():
                graph_s, graph_calls = graph.seconds, graph.calls
                us = await cpu_us(fn, requests, calls)
                best[name] = min(us, best.get(name, us))
                if name == "wrapped":  # the graph's share of these calls, from the same round
                    in_call = (graph.seconds - graph_s) / (graph.calls - graph_calls) * 1e6
                    if us == best[name]:
                        best["knn_in_call"] = in_call
        ways = await _ways(servicer.engine, variants["wrapped"], requests, graph, rounds * calls)
    finally:
        await sidecar.stop(0.1)
    return {
        "n": n,
        "dim": dim,
        "calls": calls,
        "rounds": rounds,
        "load_average": os.getloadavg(),
        "cpu_us_per_call": {k: round(v, 1) for k, v in best.items() if ":" not in k},
        "sidecar_python_share_us": round(best["wrapped"] - best["knn"], 1),
        "python_beside_graph_us": round(best["wrapped"] - best["knn_in_call"], 1),
        "hooks_us": round(best["wrapped"] - best["bare"], 1),
        **ways,
        # the interceptor and every hook around a handler that returns a built response: the
        # hooks' cost without the graph's cache misses around them (steadier than hooks_us)
        "hooks_alone_us": round(best["hooks_alone"] - best["answered"], 1),
        "each_hook_us": {
            k.split(":", 1)[1]: round(v - best["bare"], 1) for k, v in best.items() if ":" in k
        },
    }


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, default=20_000)
    parser.add_argument("--dim", type=int, default=384)
    parser.add_argument("--queries", type=int, default=200, help="as the corpus was cached with")
    parser.add_argument("--calls", type=int, default=2000)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--out", type=Path, default=RESULTS)
    cache_option(parser)
    args = parser.parse_args(argv)
    result = asyncio.run(
        measure(args.n, args.dim, args.queries, args.calls, args.rounds, args.cache)
    )
    return written(result, args.out)


if __name__ == "__main__":
    main()
