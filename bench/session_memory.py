"""Session memory: the sidecar's RSS with many maximal sessions, bounded by bytes and not.

    python -m bench.session_memory                  # 10,000 sessions, both modes
    python -m bench.session_memory --sessions 50    # the smoke mode

The sidecar runs as its own process (``voxrecall serve``, the real embedded model) over a store
built from ``examples/kb``, twice: ``unbounded`` (``max_session_bytes`` and
``session_memory_bytes`` too large to bind: only ``max_sessions`` = 10,000 bounds the store, as
before issue 14) and ``bounded`` (the defaults: 64 KiB a session, 256 MiB in all). Each session is
maximal: 8 agent turns of 4,000 four-byte characters (the longest turn the sidecar takes) and 3
vector Searches of 50 results it retains. RSS is read from ``/proc`` before and after; the
``Status`` reply says how many sessions are held and the bytes they keep. Writes
``bench/results/session_memory.json``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import grpc
import numpy as np

from bench.report import plain
from bench.soak import _rss_mb, _start
from index.build import build_knowledge_base
from index.embedders.local import LocalEmbedder
from sidecar.config import SidecarConfig, parse_config
from sidecar.gen import retrieval_pb2 as pb
from sidecar.gen import retrieval_pb2_grpc as pb_grpc

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "bench" / "results"
CALL_TIMEOUT_S = 30.0  # far above any of these calls; one past it fails the run
TURN_TEXT = "\U0001f4de" * 4000  # 4,000 characters of 4 bytes: the longest turn there is
AGENT_TURNS = 8  # sessions.RECENT_TURNS: what an unbounded session keeps
SEARCHES = 3  # [sidecar] context_turns: the retained searches
RESULTS_PER_SEARCH = 50  # the largest Search limit
WORKERS = 8
MODES = {
    # the loader's tops (64 MiB a session, 64 GiB in all): far past what 10,000 maximal sessions
    # hold (each ~1 MiB), so only max_sessions bounds them
    "unbounded": {"max_session_bytes": 64 << 20, "session_memory_bytes": 64 << 30},
    "bounded": {
        "max_session_bytes": SidecarConfig().max_session_bytes,
        "session_memory_bytes": SidecarConfig().session_memory_bytes,
    },
}


def _build(folder: Path) -> Path:
    """A store of the example knowledge base; returns its folder."""
    store = folder / "store"
    raw = {
        "knowledge_base": [
            {"name": "help", "source": [{"type": "markdown", "path": str(REPO / "examples/kb")}]}
        ],
        "index": {"store": str(store)},
    }
    config = parse_config(raw, folder)
    build_knowledge_base(config, config.knowledge_bases[0], LocalEmbedder())
    return store


def _config(folder: Path, store: Path, keys: dict[str, int]) -> Path:
    path = folder / "voxrecall.toml"
    lines = [
        '[[knowledge_base]]\nname = "help"\n[[knowledge_base.source]]\ntype = "markdown"',
        f'path = "{REPO / "examples/kb"}"\n[sidecar]\nstore = "{store}"\nmax_sessions = 10000',
        *(f"{key} = {value}" for key, value in keys.items()),
    ]
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


async def _session(stub: pb_grpc.RetrievalStub, session_id: str, vector: bytes) -> None:
    for _ in range(AGENT_TURNS):
        turn = pb.TurnRequest(session_id=session_id, text=TURN_TEXT, speaker=pb.AGENT)
        await stub.Turn(turn, timeout=CALL_TIMEOUT_S)
    for _ in range(SEARCHES):
        search = pb.SearchRequest(
            session_id=session_id,
            vector=vector,
            limit=RESULTS_PER_SEARCH,
            min_score=-1.0,
            query="logged only",
        )
        await stub.Search(search, timeout=CALL_TIMEOUT_S)


async def _load(port: int, sessions: int) -> dict[str, Any]:
    vector = np.full(384, 1.0 / np.sqrt(384), dtype="<f4").tobytes()
    ids = iter(range(sessions))
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
        stub = pb_grpc.RetrievalStub(channel)  # type: ignore[no-untyped-call]

        async def worker() -> None:
            for i in ids:
                await _session(stub, f"maximal-{i:06d}", vector)

        start = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(WORKERS)))
        seconds = time.perf_counter() - start
        status = await stub.Status(pb.StatusRequest(), timeout=CALL_TIMEOUT_S)
    return {
        "seconds": round(seconds, 1),
        "sessions_held": int(status.sessions),
        "session_bytes": int(status.session_bytes),
    }


async def _warm(port: int) -> None:
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
        stub = pb_grpc.RetrievalStub(channel)  # type: ignore[no-untyped-call]
        await stub.Turn(pb.TurnRequest(text="how do I reset my password"), timeout=60)


def _mode(folder: Path, store: Path, name: str, sessions: int) -> dict[str, Any]:
    config = _config(folder, store, MODES[name])
    proc, port = _start(config, folder / f"{name}.log")
    try:
        asyncio.run(_warm(port))
        before = _rss_mb(proc.pid)
        load = asyncio.run(_load(port, sessions))
        after = _rss_mb(proc.pid)
    finally:
        proc.terminate()
        proc.wait(timeout=60)
    return {
        **MODES[name],
        "rss_before_mb": round(before, 1),
        "rss_after_mb": round(after, 1),
        "growth_mb": round(after - before, 1),
        **load,
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.session_memory", description=plain(__doc__))
    p.add_argument("--sessions", type=int, default=10_000, help="sessions opened (10,000)")
    p.add_argument(
        "--out", type=Path, default=RESULTS / "session_memory.json", help="the JSON written"
    )
    args = p.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="voxrecall-sessions-") as tmp:
        folder = Path(tmp)
        store = _build(folder)
        modes = {name: _mode(folder, store, name, args.sessions) for name in MODES}
    result = {
        "command": " ".join(["python -m bench.session_memory", *(argv or sys.argv[1:])]),
        "cpus": os.cpu_count(),
        "sessions": args.sessions,
        "per_session": {
            "agent_turns": AGENT_TURNS,
            "turn_chars": len(TURN_TEXT),
            "searches_retained": SEARCHES,
            "results_per_search": RESULTS_PER_SEARCH,
        },
        "modes": modes,
        "growth_ratio_bounded_to_unbounded": round(
            modes["bounded"]["growth_mb"] / max(modes["unbounded"]["growth_mb"], 1e-9), 3
        ),
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n", encoding="utf-8")
    print(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
