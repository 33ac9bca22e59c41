"""What each part of a ``Search`` call costs: ``python -m bench.search_parts``.

The ``search`` suite's sidecar process, started several times side by side, each with one part
swapped out (in the child process only: the product has no such switches), all answering the
same queries in turns of 20 so that load elsewhere falls on all alike:

    sidecar           as shipped
    no-hooks          without the interceptor's hooks (call log, metrics, drain gate, limit)
    canned            the handler answers a stored top-10 response: hooks and typed messages,
                      no engine and no search
    canned-knn        the handler searches the graph as grpc-knn does and answers a stored
                      response: the sidecar's server and hooks around a bare search
    drop:H1+H2        without the hooks of those classes (``drop:CallLog``, ``drop:Metrics``)
    grpc-echo         raw bytes in and out of a bare method: the transport floor
    grpc-knn          a bare method searching the sidecar's own graph, answering the echo's bytes:
                      the floor of a Python server's Search (no code of the sidecar's on the call)
    hnswlib           the same graph searched in this process (``bench.systems.Hnswlib``)

Prints p50/p95 of one sequential client and queries per second of 16 concurrent ones (one
channel, as ``search`` measures), and the server process's CPU per call over the sequential
turns (``/proc/PID/stat``, summed over every turn: a tick is 10 ms, a turn ~20 ms; the echo runs
in the ``sidecar`` variant's process; hnswlib's is this thread's CPU). ``share`` is the issue's
sidecar share of a Search: the sidecar's p50 less the echo's and hnswlib's, and the same of the
CPU per call. Writes ``bench/results/search_parts.json`` (``--out``). ``--variants`` picks
them (``sidecar,sidecar#2,drop:ConcurrencyLimit``: ``#2`` a second process of the same variant,
as each server process runs some tens of microseconds apart from another of the same code).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import time
from pathlib import Path
from typing import Any

import grpc
import numpy as np

from bench.corpus import CACHE, CorpusSpec, load_or_generate
from bench.ours import CALL_TIMEOUT_S, _request, build_snapshot, embedder_info
from bench.profile_search import _cpu_s, _start, _stop
from bench.sidecar_proc import bare_knn
from bench.systems import Hnswlib
from sidecar.gen import retrieval_pb2 as pb
from sidecar.gen import retrieval_pb2_grpc as pb_grpc

RESULTS = Path(__file__).resolve().parent / "results" / "search_parts.json"
VARIANTS = ("sidecar", "no-hooks", "canned", "canned-knn")
BLOCK = 20  # queries per turn, as the search suite's warm percentiles
CONCURRENCY = 16


def _stored(search: Any, searched: bool) -> Any:
    """A ``Search`` that answers the first call's response to every call; ``searched``, after
    searching the served graph for the call's vector as ``grpc-knn`` does."""
    stored: list[Any] = []

    async def canned(self: Any, request: Any, context: Any) -> Any:
        if not stored:
            stored.append(await search(self, request, context))
        if searched:
            bare_knn(self.holder.get(request.knowledge_base).index, request)
        return stored[0]

    return canned


def _patch(variant: str) -> None:
    """Swap the variant's part out of this (child) process."""
    from sidecar.edge import guards, service
    from sidecar.edge.interceptor import HookInterceptor

    variant = variant.partition("#")[0]  # "sidecar#2": a second process of the same variant

    if variant == "no-hooks":
        build = guards.Guards.build.__func__  # type: ignore[attr-defined]

        def without_hooks(cls: Any, *args: Any, **kwargs: Any) -> Any:
            built = build(cls, *args, **kwargs)
            return cls(built.limit, built.metrics, built.auth, (), built.options)

        guards.Guards.build = classmethod(without_hooks)  # type: ignore[assignment]
    elif variant.startswith("drop:"):
        names = set(variant.removeprefix("drop:").split("+"))
        build = guards.Guards.build.__func__  # type: ignore[attr-defined]

        def dropped(cls: Any, *args: Any, **kwargs: Any) -> Any:
            built = build(cls, *args, **kwargs)
            hooks = [h for h in built.hooks if type(h).__name__ not in names]
            interceptors = (HookInterceptor(hooks),)
            return cls(built.limit, built.metrics, built.auth, interceptors, built.options)

        guards.Guards.build = classmethod(dropped)  # type: ignore[assignment]
    elif variant in ("canned", "canned-knn"):
        service.RetrievalService.Search = _stored(  # type: ignore[method-assign]
            service.RetrievalService.Search, searched=variant == "canned-knn"
        )


async def _measure(
    ports: dict[str, int],
    pids: dict[str, int],
    echo_port: int,
    graph: Hnswlib,
    queries: Any,
    blocks: int,
    rounds: int,
) -> dict[str, dict[str, float]]:
    requests = [_request(q) for q in queries]
    channels = {name: grpc.aio.insecure_channel(f"127.0.0.1:{p}") for name, p in ports.items()}
    calls: dict[str, Any] = {
        name: pb_grpc.RetrievalStub(c).Search  # type: ignore[no-untyped-call]
        for name, c in channels.items()
    }
    channels["echo"] = grpc.aio.insecure_channel(f"127.0.0.1:{echo_port}")
    for name, method in (("grpc-echo", "Search"), ("grpc-knn", "Knn")):
        calls[name] = channels["echo"].unary_unary(
            f"/bench.Echo/{method}",
            request_serializer=pb.SearchRequest.SerializeToString,
            response_deserializer=pb.SearchResponse.FromString,
        )
    try:
        # connect and warm every path; the top chunks show what each variant answers
        answers: dict[str, list[str]] = {name: [] for name in calls}
        for name, call in calls.items():
            for r in requests[:200]:
                reply = await call(r, timeout=CALL_TIMEOUT_S)
                answers[name].append(reply.chunks[0].chunk_id)
        samples: dict[str, list[float]] = {name: [] for name in (*calls, "hnswlib")}
        cpu = dict.fromkeys(samples, 0.0)
        for b in range(blocks):
            for name, call in calls.items():
                pid = pids.get(name, pids["sidecar"])  # the echoes serve in the sidecar's process
                cpu0 = _cpu_s(pid)
                for i in range(BLOCK):
                    r = requests[(b * BLOCK + i) % len(requests)]
                    t0 = time.perf_counter()
                    await call(r, timeout=CALL_TIMEOUT_S)
                    samples[name].append(time.perf_counter() - t0)
                cpu[name] += _cpu_s(pid) - cpu0
            cpu0 = time.thread_time()
            for i in range(BLOCK):
                q = queries[(b * BLOCK + i) % len(queries)]
                t0 = time.perf_counter()
                graph.search(q)
                samples["hnswlib"].append(time.perf_counter() - t0)
            cpu["hnswlib"] += time.thread_time() - cpu0
        per = 40  # calls per client per round
        spent = {name: 0.0 for name in calls}
        for _ in range(rounds):
            for name, call in calls.items():

                async def client(offset: int, call: Any = call) -> None:
                    for i in range(per):
                        r = requests[(offset * per + i) % len(requests)]
                        await call(r, timeout=CALL_TIMEOUT_S)

                t0 = time.perf_counter()
                await asyncio.gather(*(client(c) for c in range(CONCURRENCY)))
                spent[name] += time.perf_counter() - t0
        out: dict[str, dict[str, Any]] = {}
        for name, xs in samples.items():
            ms = np.asarray(xs) * 1000.0
            out[name] = {
                "p50_ms": round(float(np.percentile(ms, 50)), 4),
                "p95_ms": round(float(np.percentile(ms, 95)), 4),
                "server_cpu_us_per_call": round(cpu[name] / len(xs) * 1e6, 1),
            }
            if name in calls:
                out[name][f"qps_concurrent_{CONCURRENCY}"] = round(
                    per * CONCURRENCY * rounds / spent[name], 1
                )
                out[name]["same_answers_as_sidecar"] = answers[name] == answers["sidecar"]
                out[name]["distinct_top_chunks"] = len(set(answers[name]))
        return out
    finally:
        for channel in channels.values():
            await channel.close(None)


def _share(rows: dict[str, dict[str, Any]], served: str = "sidecar") -> dict[str, float]:
    """The sidecar's own share of a Search: its p50 (and server CPU per call) less the echo's and
    hnswlib's; ``served="grpc-knn"``, the same of the bare method searching the same graph."""
    sidecar, echo, graph = rows[served], rows["grpc-echo"], rows["hnswlib"]
    return {
        "p50_ms": round(sidecar["p50_ms"] - echo["p50_ms"] - graph["p50_ms"], 4),
        "cpu_us": round(
            sidecar["server_cpu_us_per_call"]
            - echo["server_cpu_us_per_call"]
            - graph["server_cpu_us_per_call"],
            1,
        ),
    }


def _variants(text: str) -> tuple[str, ...]:
    """``--variants``: known ones (``VARIANTS``, ``drop:...``), ``sidecar`` among them."""
    variants = tuple(text.split(","))
    for variant in variants:
        base = variant.partition("#")[0]
        if base not in VARIANTS and not base.startswith("drop:"):
            raise argparse.ArgumentTypeError(f"unknown variant {variant!r}: one of {VARIANTS}")
    if "sidecar" not in variants:
        raise argparse.ArgumentTypeError("the variants must include sidecar (the share's base)")
    return variants


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, default=100_000)
    parser.add_argument("--dim", type=int, default=1536)
    parser.add_argument("--queries", type=int, default=1000, help="as the corpus was cached with")
    parser.add_argument("--blocks", type=int, default=150, help="turns of 20 sequential calls")
    parser.add_argument("--rounds", type=int, default=4, help="throughput rounds per variant")
    parser.add_argument(
        "--variants",
        type=_variants,
        default=VARIANTS,
        help="comma-separated, sidecar among them; drop:Hook[+Hook] drops hooks by class name; "
        "name#2 starts a second process of a variant (each server has an offset of its own)",
    )
    parser.add_argument("--out", type=Path, default=RESULTS, help="the JSON file to write")
    args = parser.parse_args(argv)
    corpus = load_or_generate(CorpusSpec(n=args.n, dim=args.dim, queries=args.queries), CACHE)
    snapshot, _ = build_snapshot(corpus, CACHE)
    info = embedder_info(corpus)
    started: dict[str, tuple[Any, dict[str, Any]]] = {}
    try:
        for variant in args.variants:
            patch = f"from bench.search_parts import _patch\n_patch({variant!r})\n"
            store = snapshot.parent.parent
            started[variant] = _start(store, info.dimension, info.name, None, prelude=patch)
        ports = {name: int(meta["port"]) for name, (_, meta) in started.items()}
        pids = {name: proc.pid for name, (proc, _) in started.items()}
        echo_port = int(started["sidecar"][1]["echo_port"])
        graph = Hnswlib(corpus, snapshot)
        load = os.getloadavg()
        rows = asyncio.run(
            _measure(ports, pids, echo_port, graph, corpus.queries, args.blocks, args.rounds)
        )
    finally:
        for proc, _ in started.values():
            _stop(proc)
    result = {
        "n": args.n,
        "dim": args.dim,
        "variants": rows,
        "share": _share(rows),
        "bare_server_share": _share(rows, "grpc-knn"),  # the same formula's floor
        "load_average": [load, os.getloadavg()],  # at the start, at the end
    }
    for name, row in rows.items():
        qps = row.get(f"qps_concurrent_{CONCURRENCY}", "-")
        print(f"{name:18} p50 {row['p50_ms']:.3f} ms  p95 {row['p95_ms']:.3f} ms  "
              f"{row['server_cpu_us_per_call']:>7} us CPU  {qps:>7} qps x{CONCURRENCY}")  # fmt: skip
    print("share (sidecar - echo - hnswlib):", result["share"])
    print("bare server's share (grpc-knn - echo - hnswlib):", result["bare_server_share"])
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    return result


if __name__ == "__main__":
    main()
