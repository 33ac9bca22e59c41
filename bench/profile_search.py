"""Where a Search call's time goes in the sidecar: ``python -m bench.profile_search``.

Two views of the ``search`` suite's sidecar process serving the cached corpus:

1. Server CPU per request (from ``/proc/PID/stat``) of ``Search`` against the echo method on the
   same process, one client and 16 concurrent ones: what the service adds to the transport.
2. A cProfile of the sidecar process (its event-loop thread, where every handler runs) over
   sequential ``Search`` calls: the handler's functions by cumulative time per call. cProfile
   inflates Python code against C code, so read the shares, not the absolute figures.

Writes ``bench/results/profile_search.json`` and prints both.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import pstats
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import grpc

from bench.corpus import CACHE, CorpusSpec, load_or_generate
from bench.ours import CALL_TIMEOUT_S, _request, build_snapshot, embedder_info
from bench.report import plain
from sidecar.gen import retrieval_pb2 as pb
from sidecar.gen import retrieval_pb2_grpc as pb_grpc

RESULTS = Path(__file__).resolve().parent / "results" / "profile_search.json"
SECONDS = 4.0  # per load run: enough calls for a stable CPU share
TOP = 25  # functions listed from the profile


def _cpu_s(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _start(
    store: Path, dim: int, name: str, profile: Path | None, prelude: str = ""
) -> tuple[Any, dict[str, Any]]:
    """``bench.sidecar_proc`` in a child, under cProfile with ``profile``, after ``prelude``
    (code run first in the child: ``bench.search_parts`` swaps a part out there)."""
    args = f"Path({str(store)!r}), {dim}, {name!r}"
    serve = f"uvloop.run(run({args}))"
    code = prelude + "import uvloop\nfrom pathlib import Path\nfrom bench.sidecar_proc import run\n"
    code += f"import cProfile\ncProfile.run({serve!r}, {str(profile)!r})" if profile else serve
    proc = subprocess.Popen(
        [sys.executable, "-c", code],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        cwd=Path(__file__).resolve().parents[1],
        text=True,
    )
    assert proc.stdout is not None
    line = proc.stdout.readline()
    if not line:
        raise RuntimeError(f"sidecar process exited with {proc.wait(5)}")
    return proc, json.loads(line)


def _stop(proc: Any) -> None:
    proc.stdin.close()  # it drains and exits
    try:
        proc.wait(30)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
    proc.stdout.close()


async def cpu_per_request(info: dict[str, Any], pid: int, queries: Any) -> dict[str, Any]:
    out: dict[str, Any] = {}
    async with (
        grpc.aio.insecure_channel(f"127.0.0.1:{info['port']}") as channel,
        grpc.aio.insecure_channel(f"127.0.0.1:{info['echo_port']}") as echo_channel,
    ):
        stub = pb_grpc.RetrievalStub(channel)  # type: ignore[no-untyped-call]
        echo = echo_channel.unary_unary(
            "/bench.Echo/Search",
            request_serializer=pb.SearchRequest.SerializeToString,
            response_deserializer=pb.SearchResponse.FromString,
        )
        for name, call in (("voxrecall", stub.Search), ("grpc-echo", echo)):
            for clients in (1, 16):
                done = 0

                async def client(offset: int, call: Any = call) -> None:
                    nonlocal done
                    end = time.monotonic() + SECONDS
                    while time.monotonic() < end:
                        q = queries[(offset + done) % len(queries)]
                        await call(_request(q), timeout=CALL_TIMEOUT_S)
                        done += 1

                cpu0, started = _cpu_s(pid), time.perf_counter()
                await asyncio.gather(*(client(i * 7) for i in range(clients)))
                elapsed = time.perf_counter() - started
                out[f"{name} x{clients}"] = {
                    "qps": round(done / elapsed, 1),
                    "server_cpu_ms_per_call": round((_cpu_s(pid) - cpu0) / done * 1000, 3),
                }
    return out


async def sequential(port: int, queries: Any, calls: int) -> None:
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
        stub = pb_grpc.RetrievalStub(channel)  # type: ignore[no-untyped-call]
        for i in range(calls):
            await stub.Search(_request(queries[i % len(queries)]), timeout=CALL_TIMEOUT_S)


def handler_profile(path: Path, calls: int) -> list[dict[str, Any]]:
    """The functions under the gRPC handler, by cumulative time per call."""
    stats = pstats.Stats(str(path))
    rows = []
    for (file, line, func), (_, ncalls, tottime, cumtime, _) in stats.stats.items():  # type: ignore[attr-defined]
        if ncalls < calls // 2 or "bench/" in file:
            continue
        rows.append(
            {
                "function": f"{Path(file).name}:{line}({func})",
                "calls_per_search": round(ncalls / calls, 1),
                "cum_us_per_search": round(cumtime / calls * 1e6, 1),
                "self_us_per_search": round(tottime / calls * 1e6, 1),
            }
        )
    rows.sort(key=lambda r: -float(r["cum_us_per_search"]))
    return [r for r in rows if "runners.py" not in r["function"]][:TOP]


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=plain(__doc__))
    parser.add_argument("--n", type=int, default=20_000, help="chunks in the base (default 20,000)")
    parser.add_argument("--dim", type=int, default=384, help="vector dimension (default 384)")
    parser.add_argument("--queries", type=int, default=200, help="as the corpus was cached with")
    parser.add_argument("--calls", type=int, default=3000, help="profiled sequential calls")
    args = parser.parse_args(argv)
    corpus = load_or_generate(CorpusSpec(n=args.n, dim=args.dim, queries=args.queries), CACHE)
    snapshot, _ = build_snapshot(corpus, CACHE)
    info_e = embedder_info(corpus)
    store = snapshot.parent.parent
    result: dict[str, Any] = {"n": args.n, "dim": args.dim}
    proc, info = _start(store, info_e.dimension, info_e.name, None)
    try:
        result["cpu"] = asyncio.run(cpu_per_request(info, proc.pid, corpus.queries))
    finally:
        _stop(proc)
    with tempfile.TemporaryDirectory() as tmp:
        profile = Path(tmp) / "sidecar.prof"
        proc, info = _start(store, info_e.dimension, info_e.name, profile)
        try:
            asyncio.run(sequential(info["port"], corpus.queries, args.calls))
        finally:
            _stop(proc)
        result["profile"] = handler_profile(profile, args.calls)
    for name, row in result["cpu"].items():
        print(f"{name:14} {row['qps']:>8} qps  {row['server_cpu_ms_per_call']:.3f} ms server CPU")
    print(f"\n{'function':<58}{'calls':>7}{'cum us':>9}{'self us':>9}")
    for row in result["profile"]:
        print(
            f"{row['function'][:57]:<58}{row['calls_per_search']:>7}"
            f"{row['cum_us_per_search']:>9}{row['self_us_per_search']:>9}"
        )
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps(result, indent=2) + "\n")
    return result


if __name__ == "__main__":
    main()
