"""The CPU a ``Turn`` costs in the sidecar's own Python around the engine:
``python -m bench.turn_cost``.

``bench.handler_cost``'s sidecar (``create_server`` over the ``search`` suite's cached corpus,
20,000 x 384 by default), its ``Turn`` handler called in this process with no transport, through
the interceptor with every hook and the response serialized as grpc does next. The engine's
turn is taken out: real turns are run once (``--sessions`` sessions of ``TURNS`` each: searched
turns with the session's context growing, a backchannel, an agent turn) and their results are
answered again, so what is timed is what a Turn costs beside its search: the request read, the
response made and serialized, the interceptor and the hooks.

Two ways of making the response, in alternating blocks of ``BLOCK`` calls (load falls on both
alike; means over the blocks): ``bytes``, the servicer as it is (``sidecar.edge.wire``'s
``turn_response``: the response's bytes from kept pieces), and ``message``, the ``TurnResponse``
built field by field, its chunks merged from their kept encodings, as the servicer built it
before (``message_response`` here). ``bytes_over_message``: their ratio.

``hooks_alone_us``: the interceptor and every hook around a handler that returns a response
written before, less that handler alone, for a Turn and for a Search (the same hooks; a
difference is per-method work); ``each_hook_us`` the same with one hook at a time. Times are this
thread's CPU (``time.thread_time``), least of ``--rounds`` rounds for the hooks.

``converse_answer_us``: a Converse stream's answer to each turn made and serialized by its
method's serializer, ``bytes`` as the servicer writes it (``converse_response``) and ``parsed``
as it did before (the turn's bytes parsed into a built ``ConverseResponse``, serialized by
protobuf), least of ``--rounds`` alternating rounds; ``converse_bytes_over_parsed`` their ratio.
Writes ``bench/results/turn_cost.json`` (``--out``).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from unittest import mock

from bench.corpus import CACHE, CorpusSpec, load_or_generate
from bench.in_process import (
    Handler,
    cache_option,
    cpu_us,
    serialized,
    serializer,
    served,
    wrapped,
    written,
)
from sidecar.edge import service
from sidecar.edge.interceptor import HookInterceptor
from sidecar.edge.messages import MESSAGES
from sidecar.edge.service import RetrievalService, set_timings
from sidecar.gen import retrieval_pb2 as pb
from sidecar.turn.engine import BasePolicy, TurnResult
from sidecar.turn.skip import Skip

RESULTS = Path(__file__).resolve().parent / "results" / "turn_cost.json"
BLOCK = 100  # calls a block when the two ways alternate
WARM_CALLS = 300
# one session's turns: searched ones (each adds to the session's context), an agent turn naming
# a page, a backchannel
TURNS = (
    "how do I set up document {s}",
    "and what about the settings of document {s}",
    "Would you like to read document {t} next?",
    "yeah",
    "which options does it have",
    "is there a shortcut for that",
)


def message_response(result: TurnResult, policy: BasePolicy) -> pb.TurnResponse:
    """The ``TurnResponse`` as the servicer built it before it wrote bytes: field by field, the
    chunks merged from their kept encodings."""
    searched = result.skipped is Skip.NOT_SKIPPED
    response = pb.TurnResponse(
        skipped=result.skipped.name,
        degraded=result.degraded,
        query=result.query,
        snapshot_version=result.snapshot_version,
        truncated=result.truncated,
        followup=pb.FollowUp(
            used=result.followup.used,
            source=result.followup.source,
            confidence=result.followup.confidence,
        ),
        fallback=policy.fallback if searched and not result.hits else "",
        instructions=policy.instructions,
        rerank=result.rerank.name,
    )
    set_timings(response.timings, result.timings)
    MESSAGES.fill(response, "chunks", result.hits)
    MESSAGES.fill(response, "context", result.context)
    return response


@contextlib.contextmanager
def _way(way: str) -> Iterator[None]:
    """The servicer making its response ``way``: as it is (``bytes``) or as before."""
    if way == "bytes":
        yield
        return
    with mock.patch.object(service, "turn_response", message_response):
        yield


async def _turns(engine: Any, sessions: int) -> tuple[list[pb.TurnRequest], list[TurnResult]]:
    """Real turns, run once: their requests and what the engine answered."""
    requests, results = [], []
    for s in range(sessions):
        for text in TURNS:
            agent = text.startswith("Would")
            request = pb.TurnRequest(
                session_id=f"call-{s}",
                text=text.format(s=s * 7, t=s * 7 + 3),
                knowledge_base="bench",
                speaker=pb.AGENT if agent else pb.USER,
                is_final=True,
            )
            requests.append(request)
            results.append(await engine.turn(service.turn_input(request)))
    return requests, results


async def measure(
    n: int, dim: int, queries: int, sessions: int, calls: int, rounds: int, cache: Path = CACHE
) -> Any:
    corpus = load_or_generate(CorpusSpec(n=n, dim=dim, queries=queries), cache)
    # every turn finds its max_results (3): random vectors score low, under the 0.3 default
    sidecar, servicer = await served(corpus, dim, cache, min_score=-1.0)
    try:
        interceptor = sidecar.guards.interceptors[0]  # type: ignore[union-attr]
        assert isinstance(interceptor, HookInterceptor)
        requests, results = await _turns(servicer.engine, sessions)
        answers = {id(r): a for r, a in zip(requests, results, strict=True)}
        _current: list[Any] = [None]  # the request in hand: its turn's kept result is answered

        async def answered_turn(turn: Any, prefetch: Any = None) -> TurnResult:
            return answers[id(_current[0])]

        async def turn_handler(request: Any, context: Any) -> Any:
            _current[0] = request
            return await servicer.Turn(request, context)

        servicer.engine.turn = answered_turn  # type: ignore[method-assign]
        whole = serialized(await wrapped(interceptor, turn_handler, "Turn"), pb.TurnResponse)
        ways = await _alternating(whole, requests, calls)
        hooks = await _hooks(interceptor, servicer, requests, results, calls, rounds)
        converse = _converse(servicer._policy("bench"), requests, results, calls, rounds)
        searched = sum(r.skipped is Skip.NOT_SKIPPED for r in results)
    finally:
        await sidecar.stop(0.1)
    return {
        "n": n,
        "dim": dim,
        "turns": len(requests),
        "searched_turns": searched,
        "mean_hits": round(sum(len(r.hits) for r in results) / len(results), 1),
        "mean_context": round(sum(len(r.context) for r in results) / len(results), 1),
        "calls_per_way": calls,
        "load_average": os.getloadavg(),
        **ways,
        **hooks,
        **converse,
    }


async def _alternating(fn: Handler, requests: list[Any], calls: int) -> dict[str, Any]:
    """``fn`` with each way of making the response, in alternating blocks: mean CPU a call."""
    for way in ("bytes", "message"):
        with _way(way):
            await cpu_us(fn, requests, WARM_CALLS)
    spent = {"bytes": 0.0, "message": 0.0}
    blocks = max(1, calls // BLOCK)
    for block in range(2 * blocks):
        way = ("bytes", "message")[block % 2]
        with _way(way):
            spent[way] += await cpu_us(fn, requests, BLOCK)
    return {
        "turn_cpu_us_alternating": {way: round(us / blocks, 1) for way, us in spent.items()},
        "bytes_over_message": round(spent["bytes"] / spent["message"], 3),
    }


async def _hooks(
    interceptor: HookInterceptor,
    servicer: RetrievalService,
    requests: list[Any],
    results: list[TurnResult],
    calls: int,
    rounds: int,
) -> dict[str, Any]:
    """The interceptor and hooks around a handler answering a response written before, less
    the handler alone: for a Turn, a Search, and each hook alone around a Turn."""
    written = service.turn_response(results[0], servicer._policy("bench"))

    async def answered(request: Any, context: Any) -> Any:
        return written

    variants: dict[str, Handler] = {
        "answered": answered,
        "turn": await wrapped(interceptor, answered, "Turn"),
        "search": await wrapped(interceptor, answered, "Search"),
    }
    for hook in interceptor.hooks:
        variants[f"hook:{type(hook).__name__}"] = await wrapped(
            HookInterceptor([hook]), answered, "Turn"
        )
    best: dict[str, float] = {}
    for fn in variants.values():
        await cpu_us(fn, requests, WARM_CALLS)
    for _ in range(rounds):
        for name, fn in variants.items():
            us = await cpu_us(fn, requests, calls)
            best[name] = min(us, best.get(name, us))
    alone = best["answered"]
    return {
        "hooks_alone_us": {m: round(best[m] - alone, 1) for m in ("turn", "search")},
        "each_hook_us": {
            k.split(":", 1)[1]: round(v - alone, 1) for k, v in best.items() if ":" in k
        },
    }


def parsed_answer(result: TurnResult, policy: BasePolicy, transcript: str) -> pb.ConverseResponse:
    """A Converse answer as the servicer made it before it wrote bytes: the turn's written
    bytes parsed into a built message."""
    return pb.ConverseResponse(
        turn=pb.TurnResponse.FromString(service.turn_response(result, policy).data),
        prefetched=result.prefetched,
        transcript=transcript,
    )


def _converse(
    policy: BasePolicy,
    requests: list[pb.TurnRequest],
    results: list[TurnResult],
    calls: int,
    rounds: int,
) -> dict[str, Any]:
    """Each turn's Converse answer made and serialized, both ways, alternating rounds."""
    serialize = serializer(pb.ConverseResponse)
    ways = {"bytes": service.converse_response, "parsed": parsed_answer}
    turns = [(result, request.text) for request, result in zip(requests, results, strict=True)]
    best: dict[str, float] = {}
    for round_ in range(2 * rounds + 2):  # the first two warm both up
        for name, make in sorted(ways.items(), reverse=bool(round_ % 2)):
            started = time.thread_time()
            for i in range(calls):
                result, transcript = turns[i % len(turns)]
                serialize(make(result, policy, transcript))
            us = (time.thread_time() - started) / calls * 1e6
            if round_ >= 2:
                best[name] = min(us, best.get(name, us))
    return {
        "converse_answer_us": {name: round(us, 2) for name, us in best.items()},
        "converse_bytes_over_parsed": round(best["bytes"] / best["parsed"], 3),
    }


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, default=20_000)
    parser.add_argument("--dim", type=int, default=384)
    parser.add_argument("--queries", type=int, default=200, help="as the corpus was cached with")
    parser.add_argument("--sessions", type=int, default=8)
    parser.add_argument("--calls", type=int, default=4000, help="per way, and per hooks round")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--out", type=Path, default=RESULTS)
    cache_option(parser)
    args = parser.parse_args(argv)
    result: dict[str, Any] = asyncio.run(
        measure(args.n, args.dim, args.queries, args.sessions, args.calls, args.rounds, args.cache)
    )
    return written(result, args.out)


if __name__ == "__main__":
    main()
