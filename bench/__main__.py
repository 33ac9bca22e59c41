"""``python -m bench SUITE [--quick] [--out DIR]``: run a suite, write DIR/SUITE.json, print a table.

The suites and what each needs are ``SUITE_HELP`` (the ``--help`` text; bench/README.md's suite
table lists the same). ``--quick`` is the smoke mode CI runs: small sizes, no optional peer
unless ``--systems`` names one, a couple of minutes a suite on two cores; it checks that a suite
still runs and judges no goal. ``turn`` and ``quality`` call the entry points of
``bench.turn_latency``, ``bench.quality_scifact``, ``bench.quality_turns`` and
``bench.quality_conversations``. See bench/README.md.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib
import importlib.util
import inspect
import json
import logging
import os
import platform
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from bench import report
from bench.shared_data import SHARED_DATA

# One BLAS thread: a single query's matrix-vector product gains nothing from more, and on a
# loaded two-core machine OpenBLAS's spinning threads were measured to make it 3x slower. Set
# before numpy is imported, here and in the sidecar processes that inherit the environment.
for _var in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ.setdefault(_var, "1")

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "bench" / "results"
SUITES = ("search", "turn", "quality", "scale", "index", "shards", "http", "filters", "policy")
# One line a suite for --help: what it measures, and what it needs beyond the package (the
# evaluation data in ../shared/data, or VOXRECALL_SHARED_DATA; the bench extra's peers).
SUITE_HELP = {
    "search": "top-10 latency, recall and qps x16 of voxrecall beside its floors and peers "
    "(synthetic vectors; peers need the bench extra)",
    "turn": "the Turn RPC end to end (needs ../shared/data: Windows Terminal docs, DSTC11)",
    "quality": "SciFact, DSTC11, CAsT and the conversation sets (needs ../shared/data)",
    "scale": "snapshot size, load time, memory and Search latency at 10k-1M chunks (synthetic)",
    "index": "the build's embedding rate (the rclone docs in ../shared/data; else examples/kb)",
    "shards": "the base -> shard mapping's balance and the routing overhead (examples/kb)",
    "http": "the HTTP door (MCP, /tools, Vapi) beside gRPC InvokeTool and Turn (examples/kb)",
    "filters": "metadata filters at 50/10/1% selectivity against unfiltered (synthetic)",
    "policy": "Turn and InvokeTool agree on the same questions (needs ../shared/data)",
    "fuzz_snapshot": "mutated snapshots loaded in child processes: crashes, hangs, bugs "
    "(--seconds; not part of all)",
    "all": "every suite above but fuzz_snapshot, one after another",
}


# Packages of the project's dependencies that every suite imports: one missing means Python is not
# the project's venv (a system `python`), which a line says better than the first import's traceback.
REQUIRED = ("grpc", "numpy", "hnswlib", "onnxruntime")


def outside_the_venv() -> str | None:
    """The line to print when a package every suite needs cannot be imported, else None."""
    missing = [name for name in REQUIRED if importlib.util.find_spec(name) is None]
    if not missing:
        return None
    return (
        f"python -m bench: {sys.executable} cannot import {', '.join(missing)}: run it with the "
        "project's venv, `.venv/bin/python -m bench ...` (README.md, first commands)"
    )


def machine() -> dict[str, Any]:
    cpu = ""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return {
        "cpu": cpu or platform.processor(),
        "cores": os.cpu_count(),
        "memory_gib": round(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30, 1),
        "load_average_at_start": [round(x, 2) for x in os.getloadavg()],
        "python": platform.python_version(),
        "platform": platform.platform(),
    }


def _entry(module: str, function: str = "run") -> Callable[..., Any] | str:
    """A suite's entry point, or why it is missing (the module is being written elsewhere)."""
    try:
        mod = importlib.import_module(module)
    except ModuleNotFoundError as exc:
        if exc.name != module:
            raise
        return f"not implemented yet: expected {module}.{function}(quick: bool) -> dict"
    fn = getattr(mod, function, None)
    if not callable(fn):
        return f"not implemented yet: {module} has no {function}(quick: bool) -> dict"
    return fn  # type: ignore[no-any-return]


def _call(fn: Callable[..., Any], quick: bool) -> dict[str, Any]:
    """Call ``fn(quick=...)`` (with ``data_dir`` when it takes one), awaiting it if async."""
    kwargs: dict[str, Any] = {"quick": quick}
    if "data_dir" in inspect.signature(fn).parameters:
        if not SHARED_DATA.is_dir():
            return {"skipped": f"shared data not present: {SHARED_DATA}"}
        kwargs["data_dir"] = SHARED_DATA
    try:
        result = fn(**kwargs)
        if inspect.isawaitable(result):
            result = asyncio.run(result)  # type: ignore[arg-type]
    except FileNotFoundError as exc:  # a set of the shared data missing: skipped, as tests skip
        if exc.filename and Path(exc.filename).is_relative_to(SHARED_DATA):
            return {"skipped": f"shared data not present: {exc.filename}"}
        raise
    return dict(result)


def run_turn(quick: bool) -> dict[str, Any]:
    fn = _entry("bench.turn_latency")
    if isinstance(fn, str):
        return {"suite": "turn", "skipped": fn}
    result = _call(fn, quick)
    if "skipped" in result:  # one line, as the README says: no empty scenarios table before it
        return {"suite": "turn", **result}
    scenarios = result.pop("scenarios", None)
    if scenarios is None:  # a flat {scenario: {p50_ms, ...}} is accepted too
        scenarios = {k: v for k, v in result.items() if isinstance(v, dict) and "p50_ms" in v}
        result = {k: v for k, v in result.items() if k not in scenarios}
    return {"suite": "turn", "scenarios": scenarios, **result}


def run_quality(quick: bool) -> dict[str, Any]:
    out: dict[str, Any] = {"suite": "quality"}
    scifact = _entry("bench.quality_scifact")
    if isinstance(scifact, str):
        out["scifact"] = {"skipped": scifact}
    else:
        result = _call(scifact, quick)
        out["scifact"] = result.pop("scifact", result)
        if result is not out["scifact"]:
            out["scifact_run"] = result  # the module's other figures (settings, references)
    turns = _entry("bench.quality_turns")
    if isinstance(turns, str):
        out["dstc11"] = out["skip"] = {"skipped": turns}
    else:
        result = _call(turns, quick)
        if "skipped" in result:
            out["dstc11"] = out["skip"] = result
        else:
            out.update({k: v for k, v in result.items() if k in ("dstc11", "skip", "cast")})
    conversations = _entry("bench.quality_conversations")
    if isinstance(conversations, str):
        out["conversations"] = {"skipped": conversations}
    else:
        result = _call(conversations, quick)
        out["conversations"] = result.get("table", result)  # one row a set: the table below
        out["conversations_detail"] = result.get("sets", {})
    return _all_skipped(out, ("scifact", "dstc11", "conversations"))


def _all_skipped(out: dict[str, Any], parts: tuple[str, ...]) -> dict[str, Any]:
    """A suite whose every part skipped, as one ``skipped`` (one line, naming what was missing:
    ``shared data not present: PATH, PATH``); a suite with any part run, as it was."""
    reasons = [
        out[part].get("skipped") if isinstance(out.get(part), dict) else None for part in parts
    ]
    if not all(isinstance(reason, str) for reason in reasons):
        return out
    prefix = "shared data not present: "
    unique = dict.fromkeys(str(r).removeprefix(prefix) for r in reasons)
    data = all(str(r).startswith(prefix) for r in reasons)
    return {"suite": out["suite"], "skipped": (prefix if data else "") + ", ".join(unique)}


def run_suite(name: str, args: argparse.Namespace) -> dict[str, Any]:
    if name == "search":
        from bench import search

        systems = tuple(args.systems.split(",")) if args.systems else None
        return search.run(args.quick, n=args.n, dim=args.dim, queries=args.queries, systems=systems)
    if name == "scale":
        from bench import scale

        sizes = tuple(int(s) for s in args.sizes.split(",")) if args.sizes else None
        return scale.run(args.quick, sizes=sizes)
    if name == "turn":
        return run_turn(args.quick)
    if name == "index":  # the build's embedding rate, old and new ways in one run
        from bench import embed_rate

        return embed_rate.run(args.quick)
    if name == "shards":
        from bench import shards

        return shards.run(args.quick)
    if name == "http":
        from bench import http_door

        return http_door.run(args.quick)
    if name == "filters":
        from bench import metadata_filter

        return metadata_filter.run(args.quick)
    if name == "policy":
        from bench import policy_agreement

        return {"suite": "policy", **_call(policy_agreement.run, args.quick)}
    if name == "fuzz_snapshot":
        from bench import fuzz_snapshot

        return fuzz_snapshot.run(args.quick, seconds=args.seconds)
    return run_quality(args.quick)


def table(result: dict[str, Any]) -> str:
    """The suite's table (``bench.report``), its goals, and the conversation sets' rows."""
    lines = report.sections(result) + report.versus_lines(result) + report.goal_lines(result)
    lines += _conversations_table(result.get("conversations"))
    return "\n".join(lines + report.skip_lines(result))


def _conversations_table(rows: Any) -> list[str]:
    """The conversation sets' rows, as ``bench.quality_conversations`` prints them."""
    if not isinstance(rows, dict) or not rows:
        return []
    if isinstance(rows.get("skipped"), str):
        return [f"conversations: skipped: {rows['skipped']}"]
    from bench.quality_conversations import table as conversations_table

    return [conversations_table(rows), ""]


def plot(name: str, result: dict[str, Any], out: Path) -> list[str]:
    try:
        from bench import plots
    except ImportError as exc:  # pragma: no cover - matplotlib is in the bench extra
        return [f"no plot: {exc}"]
    try:
        if name == "search" and "systems" in result:
            return [str(plots.search_percentiles(result, out / "search.png"))]
        if name == "scale" and "sizes" in result:
            return [str(plots.scale_latency(result, out / "scale.png"))]
    except ImportError as exc:
        return [f"no plot: matplotlib is not installed ({exc}); pip install -e '.[bench]'"]
    return []


def search_systems() -> tuple[str, ...]:
    """The search suite's systems, read without importing its peers' packages."""
    from bench.search import ALL

    return ALL


def main(argv: list[str] | None = None) -> int:
    if (problem := outside_the_venv()) is not None:
        print(problem, file=sys.stderr)
        return 2
    parser = argparse.ArgumentParser(
        prog="python -m bench",
        description="Run a benchmark suite, write DIR/SUITE.json and print its table. Figures, "
        "commands and the data each suite needs: bench/README.md.",
        epilog="suites:\n" + "\n".join(f"  {k:<16}{v}" for k, v in SUITE_HELP.items()),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("suite", choices=tuple(SUITE_HELP), help="one of the suites below")
    parser.add_argument(
        "--quick",
        action="store_true",
        help="smoke mode: small sizes, no peer unless --systems names one, no goal judged",
    )
    parser.add_argument(
        "--out", type=Path, default=RESULTS, help="folder for SUITE.json (default: bench/results)"
    )
    search = parser.add_argument_group("search")
    search.add_argument("--n", type=int, help="corpus size (default 100,000; quick 20,000)")
    search.add_argument("--dim", type=int, help="dimension (default 1536; quick 384)")
    search.add_argument("--queries", type=int, help="timed queries (default 1000; quick 200)")
    search.add_argument(
        "--systems",
        help="comma-separated, of "
        + ", ".join(search_systems())
        + " (default: all; quick: no peer)",
    )
    parser.add_argument("--sizes", help="scale: comma-separated N to measure")
    parser.add_argument(
        "--seconds", type=float, default=300.0, help="fuzz_snapshot: how long (default 300)"
    )
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    # a line per request (or per CPU feature faiss looks for) drowns the progress
    for noisy in ("httpx", "chromadb", "pgserver", "faiss.loader"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
    args.out.mkdir(parents=True, exist_ok=True)
    for name in SUITES if args.suite == "all" else (args.suite,):
        started = time.perf_counter()
        print(f"== {name}{' (quick)' if args.quick else ''}", flush=True)
        info = {
            "command": " ".join(["python -m bench", *(argv or sys.argv[1:])]),
            "machine": machine(),
        }
        result = run_suite(name, args)
        result = {**result, "quick": args.quick, **info}
        if args.quick and isinstance(result.get("goals"), dict):
            result["goals"] = report.unjudged(result["goals"])
        result["elapsed_s"] = round(time.perf_counter() - started, 1)
        path = args.out / f"{name}.json"
        path.write_text(json.dumps(result, indent=2) + "\n")
        print(table(result))
        for line in plot(name, result, args.out):
            print(line)
        print(f"wrote {path} in {result['elapsed_s']} s", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
