"""``python -m bench SUITE [--quick] [--out DIR]``: run a suite, write DIR/SUITE.json, print a table.

SUITE is ``search``, ``turn``, ``quality``, ``scale``, ``index`` (the build's embedding rate,
``bench/embed_rate.py``), ``shards`` (``bench/shards.py``), ``http`` (``bench/http_door.py``),
``filters`` (metadata filters at 50/10/1% selectivity, ``bench/metadata_filter.py``), ``policy``
(Turn and InvokeTool agree, ``bench/policy_agreement.py``) or ``all``; ``fuzz_snapshot [--seconds S]``
fuzzes the snapshot loader in child processes (``bench/fuzz_snapshot.py``; not part of ``all``). ``--quick`` is the smoke mode
CI runs: small sizes, no optional peer, a couple of minutes a suite on two cores; it checks that
a suite still runs, never a timing. ``turn`` and ``quality`` call the entry points of
``bench.turn_latency``, ``bench.quality_scifact``, ``bench.quality_turns`` and
``bench.quality_conversations``. See bench/README.md.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib
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

from bench.shared_data import SHARED_DATA

# One BLAS thread: a single query's matrix-vector product gains nothing from more, and on a
# loaded two-core machine OpenBLAS's spinning threads were measured to make it 3x slower. Set
# before numpy is imported, here and in the sidecar processes that inherit the environment.
for _var in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ.setdefault(_var, "1")

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "bench" / "results"
SUITES = ("search", "turn", "quality", "scale", "index", "shards", "http", "filters", "policy")


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
    return out


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


def _fmt(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.4g}"
    text = "-" if value is None else str(value)
    return text if len(text) <= 16 else text[:15] + "~"  # the JSON has it whole


def table(result: dict[str, Any]) -> str:
    """A plain-text table of a suite's rows: systems, sizes, scenarios or modes."""
    lines = []
    for section in ("systems", "sizes", "scenarios", "scifact", "dstc11"):
        rows = result.get(section)
        if not isinstance(rows, dict):
            continue
        if isinstance(rows.get("skipped"), str):
            lines.append(f"{section}: skipped: {rows['skipped']}")
            continue
        rows = {k: v for k, v in rows.items() if isinstance(v, dict)}
        if not rows:
            continue
        cols: list[str] = []
        for row in rows.values():
            cols += [c for c, v in row.items() if c not in cols and not isinstance(v, dict | list)]
        width = max(len(k) for k in rows) + 2
        lines.append(f"{section:<{width}}" + "".join(f"{c:>18}" for c in cols))
        for name, row in rows.items():
            if "skipped" in row and len(row) == 1:
                lines.append(f"{name:<{width}}  skipped: {row['skipped']}")
            else:
                lines.append(f"{name:<{width}}" + "".join(f"{_fmt(row.get(c)):>18}" for c in cols))
        lines.append("")
    for name, goal in result.get("goals", {}).items():
        verdict = goal.get("skipped") or (
            f"{goal['value']} (goal {goal['goal']}): {'met' if goal['met'] else 'MISSED'}"
        )
        lines.append(f"goal {name}: {verdict}")
    lines += _conversations_table(result.get("conversations"))
    if "skip" in result and isinstance(result["skip"], dict):
        lines.append(f"skip policy: {json.dumps(result['skip'])[:200]}")
    if "skipped" in result:
        lines.append(f"skipped: {result['skipped']}")
    return "\n".join(lines)


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


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench", description=__doc__.splitlines()[0])
    parser.add_argument("suite", choices=(*SUITES, "fuzz_snapshot", "all"))
    parser.add_argument("--quick", action="store_true", help="smoke mode: small, no peers")
    parser.add_argument("--out", type=Path, default=RESULTS, help="folder for SUITE.json")
    search = parser.add_argument_group("search")
    search.add_argument("--n", type=int, help="corpus size (default 100,000; quick 20,000)")
    search.add_argument("--dim", type=int, help="dimension (default 1536; quick 384)")
    search.add_argument("--queries", type=int, help="timed queries (default 1000; quick 200)")
    search.add_argument("--systems", help="comma-separated systems (default: all; quick: no peer)")
    parser.add_argument("--sizes", help="scale: comma-separated N to measure")
    parser.add_argument("--seconds", type=float, default=300.0, help="fuzz_snapshot: how long")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    for noisy in ("httpx", "chromadb", "pgserver"):  # a line per request drowns the progress
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
