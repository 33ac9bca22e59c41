"""Soak: many sessions opening and closing while turns flow, the sidecar's memory sampled.

    python -m bench.soak                 # 5 minutes
    python -m bench.soak --quick         # 1 minute (the smoke mode)
    python -m bench.soak --duration 900 --workers 16

The sidecar runs as its own process (``voxrecall serve``, the real embedded model) over a store
built from ``examples/kb``; its RSS is read from ``/proc`` once a second. Each worker plays phone
calls back to back: a fresh session, a few caller turns (varied wording, so the query cache keeps
churning past its bound), backchannels and agent turns, over Turn or a Converse stream; most calls
end with EndSession and some are abandoned, to be forgotten by ``session_ttl_s``. Writes
``bench/results/soak.json`` (every sample, and the RSS growth over the second half, where a
leak would show) and ``soak.png`` beside it when matplotlib is installed.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import re
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any

import grpc

from bench.report import plain
from index.build import build_knowledge_base
from index.embedders.local import LocalEmbedder
from sidecar.config import parse_config
from sidecar.gen import retrieval_pb2 as pb
from sidecar.gen import retrieval_pb2_grpc as pb_grpc

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "bench" / "results"
CALL_TIMEOUT_S = 10.0  # far above a turn; a call past it is counted as an error, not waited on
START_TIMEOUT_S = 120.0
SESSION_TTL_S = 20  # short, so abandoned sessions are forgotten within the run
QUERY_CACHE = 256  # small, so the cache fills early and its bound is what the run exercises
ABANDON_SHARE = 0.2  # calls that hang up without EndSession
CONVERSE_SHARE = 0.3  # calls played over a Converse stream instead of Turn
SUBJECTS = (
    "reset my password", "change my email address", "delete my account", "export my notes",
    "add a second device", "turn on two factor login", "share a notebook", "restore a deleted note",
    "cancel my subscription", "get a refund", "sync stops working", "the app crashes on start",
)  # fmt: skip
OPENERS = ("how do I", "can you tell me how to", "I want to", "what happens if I", "help me")
FILLERS = ("yeah", "ok", "mm-hmm", "right", "thank you very much")


def _question(rng: random.Random) -> str:
    return f"{rng.choice(OPENERS)} {rng.choice(SUBJECTS)} {rng.randrange(1000)}"


def _rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024.0
    raise RuntimeError(f"no VmRSS for pid {pid}")


def _build(folder: Path) -> Path:
    """A store of the example knowledge base; returns the config file for `voxrecall serve`."""
    store = folder / "store"
    raw = {
        "knowledge_base": [
            {"name": "help", "source": [{"type": "markdown", "path": str(REPO / "examples/kb")}]}
        ],
        "index": {"store": str(store)},
    }
    config = parse_config(raw, folder)
    build_knowledge_base(config, config.knowledge_bases[0], LocalEmbedder())
    path = folder / "voxrecall.toml"
    path.write_text(
        f'[[knowledge_base]]\nname = "help"\n[[knowledge_base.source]]\ntype = "markdown"\n'
        f'path = "{REPO / "examples/kb"}"\n[sidecar]\nstore = "{store}"\n'
        f"session_ttl_s = {SESSION_TTL_S}\nquery_cache_size = {QUERY_CACHE}\n"
        "max_concurrent_rpcs = 256\n",
        encoding="utf-8",
    )
    return path


def _start(config: Path, log: Path) -> tuple[subprocess.Popen[bytes], int]:
    """Start ``voxrecall serve``; its log goes to a file (a pipe nobody reads would fill)."""
    env = {**os.environ, "OPENBLAS_NUM_THREADS": "1", "OMP_NUM_THREADS": "1"}
    with log.open("wb") as sink:
        proc = subprocess.Popen(
            [sys.executable, "-m", "sidecar.cli", "serve", "--config", str(config),
             "--listen", "127.0.0.1:0"],
            cwd=REPO, env=env, stdout=subprocess.DEVNULL, stderr=sink,
        )  # fmt: skip
    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline:
        found = re.search(r"listening on port (\d+)", log.read_text(errors="replace"))
        if found:
            return proc, int(found.group(1))
        if proc.poll() is not None:
            raise RuntimeError("the sidecar exited:\n" + log.read_text(errors="replace"))
        time.sleep(0.2)
    proc.kill()
    raise RuntimeError("the sidecar did not start listening")


class Load:
    """The workers' counts, shared on one event loop."""

    def __init__(self) -> None:
        self.turns = 0
        self.calls = 0
        self.errors: Counter[str] = Counter()
        self.degraded = 0


async def _call(stub: pb_grpc.RetrievalStub, rng: random.Random, load: Load) -> None:
    """One phone call: a session, a few turns, then EndSession (or a hang-up)."""
    session = f"soak-{rng.getrandbits(64):016x}"
    turns: list[pb.TurnRequest] = []
    for _ in range(rng.randint(3, 8)):
        roll = rng.random()
        if roll < 0.55:
            turns.append(pb.TurnRequest(session_id=session, text=_question(rng), is_final=True))
        elif roll < 0.8:
            turns.append(
                pb.TurnRequest(session_id=session, text=rng.choice(FILLERS), is_final=True)
            )
        else:
            turns.append(
                pb.TurnRequest(
                    session_id=session, text="let me check that", speaker=pb.AGENT, is_final=True
                )
            )
    try:
        if rng.random() < CONVERSE_SHARE:
            stream = stub.Converse(timeout=CALL_TIMEOUT_S * len(turns))
            for turn in turns:
                await stream.write(pb.ConverseRequest(turn=turn))
                answer = await stream.read()
                load.turns += 1
                load.degraded += bool(answer.turn.degraded)
            await stream.done_writing()
        else:
            for turn in turns:
                resp = await stub.Turn(turn, timeout=CALL_TIMEOUT_S)
                load.turns += 1
                load.degraded += resp.degraded
        if rng.random() >= ABANDON_SHARE:
            await stub.EndSession(pb.EndSessionRequest(session_id=session), timeout=CALL_TIMEOUT_S)
        load.calls += 1
    except grpc.aio.AioRpcError as exc:
        load.errors[exc.code().name] += 1


async def _worker(port: int, seed: int, until: float, load: Load) -> None:
    rng = random.Random(seed)
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
        stub = pb_grpc.RetrievalStub(channel)  # type: ignore[no-untyped-call]
        while time.monotonic() < until:
            await _call(stub, rng, load)


async def _sessions(port: int) -> int:
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
        stub = pb_grpc.RetrievalStub(channel)  # type: ignore[no-untyped-call]
        status = await stub.Status(pb.StatusRequest(), timeout=CALL_TIMEOUT_S)
        return int(status.sessions)


async def _run(pid: int, port: int, duration_s: float, workers: int) -> dict[str, Any]:
    load = Load()
    start = time.monotonic()
    until = start + duration_s
    tasks = [asyncio.create_task(_worker(port, seed, until, load)) for seed in range(workers)]
    samples = []
    while time.monotonic() < until:
        samples.append(
            {
                "t_s": round(time.monotonic() - start, 2),
                "rss_mb": round(_rss_mb(pid), 2),
                "sessions": await _sessions(port),
                "turns": load.turns,
                "calls": load.calls,
            }
        )
        await asyncio.sleep(1.0)
    await asyncio.gather(*tasks)
    return {"samples": samples, "load": load}


def _slope_mb_per_min(samples: list[dict[str, Any]]) -> float:
    """Least-squares RSS growth over the samples, MB per minute."""
    n = len(samples)
    if n < 2:
        return 0.0
    ts = [s["t_s"] for s in samples]
    ys = [s["rss_mb"] for s in samples]
    mt, my = sum(ts) / n, sum(ys) / n
    var = sum((t - mt) ** 2 for t in ts)
    return (
        60.0 * sum((t - mt) * (y - my) for t, y in zip(ts, ys, strict=True)) / var if var else 0.0
    )


def _plot(result: dict[str, Any], path: Path) -> bool:
    try:
        import matplotlib
    except ImportError:
        return False
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    samples = result["samples"]
    fig, ax = plt.subplots(figsize=(8, 4.5))
    ax.plot([s["t_s"] for s in samples], [s["rss_mb"] for s in samples], label="sidecar RSS, MB")
    ax.set_xlabel("seconds")
    ax.set_ylabel("RSS, MB")
    ax.set_ylim(bottom=0)
    twin = ax.twinx()
    twin.plot(
        [s["t_s"] for s in samples], [s["sessions"] for s in samples], color="tab:orange", alpha=0.6,
        label="sessions held",
    )  # fmt: skip
    twin.set_ylabel("sessions held")
    s = result["summary"]
    ax.set_title(
        f"soak: {s['turns']:,} turns, {s['calls']:,} calls, {result['workers']} workers; "
        f"second half {s['second_half_mb_per_min']:+.2f} MB/min"
    )
    fig.legend(loc="lower left", bbox_to_anchor=(0.12, 0.14))
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.soak", description=plain(__doc__))
    p.add_argument("--duration", type=float, default=300.0, help="seconds of load (default 300)")
    p.add_argument("--quick", action="store_true", help="60 seconds, the smoke mode")
    p.add_argument("--workers", type=int, default=8, help="concurrent phone calls (default 8)")
    p.add_argument("--out", type=Path, default=RESULTS / "soak.json", help="the JSON written")
    args = p.parse_args(argv)
    duration = 60.0 if args.quick else args.duration
    with tempfile.TemporaryDirectory(prefix="voxrecall-soak-") as tmp:
        config = _build(Path(tmp))
        proc, port = _start(config, Path(tmp) / "sidecar.log")
        try:
            run = asyncio.run(_run(proc.pid, port, duration, args.workers))
        finally:
            proc.terminate()
            exit_code = proc.wait(timeout=60)
    samples, load = run["samples"], run["load"]
    half = samples[len(samples) // 2 :]
    summary = {
        "turns": load.turns,
        "calls": load.calls,
        "turns_per_s": round(load.turns / duration, 1),
        "degraded_turns": load.degraded,
        "errors": dict(load.errors),
        "rss_first_mb": samples[0]["rss_mb"] if samples else 0.0,
        "rss_second_half_start_mb": half[0]["rss_mb"] if half else 0.0,
        "rss_end_mb": samples[-1]["rss_mb"] if samples else 0.0,
        "rss_max_mb": max((s["rss_mb"] for s in samples), default=0.0),
        "second_half_mb_per_min": round(_slope_mb_per_min(half), 3),
        "sessions_max": max((s["sessions"] for s in samples), default=0),
        "exit_code_after_sigterm": exit_code,
    }
    result = {
        "duration_s": duration,
        "workers": args.workers,
        "session_ttl_s": SESSION_TTL_S,
        "query_cache_size": QUERY_CACHE,
        "cpus": os.cpu_count(),
        "summary": summary,
        "samples": samples,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    png = args.out.with_suffix(".png")
    result["plot"] = str(png) if _plot(result, png) else "matplotlib not installed: no plot"
    args.out.write_text(json.dumps(result, indent=2) + "\n", encoding="utf-8")
    print(json.dumps(summary, indent=2))
    print(f"wrote {args.out} ({result['plot']})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
