"""Garbage frozen at snapshot swaps: ``python -m bench.frozen_garbage [--quick]``.

1. Sessions across swaps: an in-process sidecar (the real local embedder, its HTTP door) serves
   one base from a local store. ``SESSIONS`` MCP sessions are opened on the door (initialize, one
   ``search`` call each), a new version is built and published and the refresher loads it (a
   swap, ``freeze_heap``), then the sessions are ended; ``SWAPS`` times. After each swap: the
   objects the collector tracks (``len(gc.get_objects())``, frozen ones not included), the
   frozen ones (``gc.get_freeze_count()``) and the RSS; at the end, the frozen garbage itself:
   the objects a full collection frees once the heap is unfrozen. Run twice in one process:
   with the branch point's ``freeze_heap`` (``gc.collect(1); gc.freeze()`` at every swap) and
   with the bounded one (``sidecar/snapshots/refresh.py``). The client runs in the same process,
   so its objects alive at a swap are frozen too (as a gRPC call's would be).
2. The cost of the bound at 100k chunks (``bench.swap``'s synthetic snapshot, cached in
   ``bench/.cache/swap/``), in a fresh process serving it: the heap's objects, how long
   ``sys.getallocatedblocks()`` (the bound's count, at every swap), ``gc.get_freeze_count()``
   (the count it replaced) and the full collection (run when the heap has grown by
   ``FREEZE_GROWTH``) hold the GIL.

Writes ``bench/results/frozen_garbage.json``.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx2

from bench.swap import INFO, KB, _status_mb, cached_snapshot
from index.build import build_knowledge_base
from index.embedders.base import Embedder
from index.embedders.local import LocalEmbedder
from index.snapshot import load_snapshot
from index.store import LocalStore
from sidecar.config import Config, parse_config
from sidecar.edge.server import create_server
from sidecar.snapshots import refresh
from sidecar.snapshots.holder import SnapshotHolder
from sidecar.snapshots.searcher import Searcher

RESULTS = Path(__file__).resolve().parent / "results" / "frozen_garbage.json"
SESSIONS = 20
SWAPS = 100
ACCEPT = {"accept": "application/json, text/event-stream"}
INITIALIZE = {
    "jsonrpc": "2.0",
    "id": 1,
    "method": "initialize",
    "params": {
        "protocolVersion": "2025-06-18",
        "capabilities": {},
        "clientInfo": {"name": "bench", "version": "0"},
    },
}
PAGE = "# Passwords\n\nTo reset your password, open Settings, choose Security and press Reset.\n"


def _config(root: Path) -> Config:
    raw = {
        "knowledge_base": [
            {"name": "help", "source": [{"name": "faq", "type": "markdown", "path": str(root)}]}
        ],
        "index": {"store": str(root / "store")},
        "sidecar": {
            "store": str(root / "store"),
            "listen": "127.0.0.1:0",
            "http": {"listen": "127.0.0.1:0", "max_connections_per_ip": 0},
            "max_sessions": 10_000,
        },
    }
    return parse_config(raw, base=root)


def _publish(config: Config, embedder: Embedder, n: int) -> None:
    """A new version: the page changed (one line), so the build publishes one."""
    (Path(config.knowledge_bases[0].sources[0].path) / "faq.md").write_text(
        f"{PAGE}\nRevision {n}.\n", encoding="utf-8"
    )
    build_knowledge_base(config, config.knowledge_bases[0], embedder)


async def _open(http: httpx2.AsyncClient, url: str) -> str:
    opened = await http.post(url, json=INITIALIZE, headers=ACCEPT)
    opened.raise_for_status()
    sid = opened.headers["mcp-session-id"]
    headers = {**ACCEPT, "mcp-session-id": sid, "mcp-protocol-version": "2025-06-18"}
    done = {"jsonrpc": "2.0", "method": "notifications/initialized"}
    await http.post(url, json=done, headers=headers)
    call = {
        "jsonrpc": "2.0",
        "id": 2,
        "method": "tools/call",
        "params": {"name": "search", "arguments": {"query": "reset my password"}},
    }
    (await http.post(url, json=call, headers=headers)).raise_for_status()
    return sid


async def _sessions_across_swaps(
    root: Path, embedder: Embedder, freeze: Callable[[], object], swaps: int, sessions: int
) -> dict[str, Any]:
    config = _config(root)
    _publish(config, embedder, 0)
    full = []

    def counted() -> None:
        full.append(bool(freeze()))

    refresh.freeze_heap = counted  # type: ignore[assignment]  # what _publish calls at a swap
    rows: list[dict[str, float]] = []
    sidecar = await create_server(config, embedder=embedder, poll=False)
    try:
        url = f"http://127.0.0.1:{sidecar.http_port}/mcp"
        async with httpx2.AsyncClient(timeout=30) as http:
            for n in range(1, swaps + 1):
                sids = [await _open(http, url) for _ in range(sessions)]
                await asyncio.to_thread(_publish, config, embedder, n)
                assert await sidecar.refresher.refresh() == ["help"]
                for sid in sids:
                    headers = {**ACCEPT, "mcp-session-id": sid}
                    (await http.delete(url, headers=headers)).raise_for_status()
                rows.append(
                    {
                        "swap": n,
                        "tracked": len(gc.get_objects()),
                        "frozen": gc.get_freeze_count(),
                        "blocks": sys.getallocatedblocks(),
                        "rss_mb": _status_mb("VmRSS"),
                    }
                )
    finally:
        await sidecar.stop(0.5)  # close() unfreezes the heap
        refresh.freeze_heap = freeze  # type: ignore[assignment]
    garbage, garbage_bytes = _collect_garbage()
    first, last = rows[0], rows[-1]
    return {
        "per_swap": rows,
        "full_collections": sum(full),
        "frozen_growth_per_swap": (last["frozen"] - first["frozen"]) / (len(rows) - 1),
        "rss_growth_mb": last["rss_mb"] - first["rss_mb"],
        "frozen_most_over_first": max(r["frozen"] for r in rows) - first["frozen"],
        "blocks_most_over_first": max(r["blocks"] for r in rows) - first["blocks"],
        "frozen_garbage_at_end": garbage,
        "frozen_garbage_bytes_at_end": garbage_bytes,
        "frozen_garbage_per_session_swap": garbage / (swaps * sessions),
    }


def _collect_garbage() -> tuple[int, int]:
    """A full collection of the (unfrozen) heap: the objects it frees, and their bytes
    (``sys.getsizeof`` of each, its own size only)."""
    gc.set_debug(gc.DEBUG_SAVEALL)
    try:
        found = gc.collect()
        size = sum(sys.getsizeof(o) for o in gc.garbage)
    finally:
        gc.set_debug(0)
        gc.garbage.clear()
    return found, size


def sessions_across_swaps(swaps: int, sessions: int) -> dict[str, Any]:
    embedder = LocalEmbedder()
    bounded = refresh.freeze_heap

    def branch_point() -> bool:
        gc.collect(1)
        gc.freeze()
        return False

    out: dict[str, Any] = {"swaps": swaps, "sessions": sessions}
    for name, freeze in (("branch_point", branch_point), ("bounded", bounded)):
        with tempfile.TemporaryDirectory(prefix="frozen-garbage-") as tmp:
            out[name] = asyncio.run(
                _sessions_across_swaps(Path(tmp), embedder, freeze, swaps, sessions)
            )
        gc.collect()
    return out


def measure_stall(folder: Path) -> dict[str, Any]:
    """In this (fresh) process: serve the snapshot, frozen, then time the bound's two parts."""
    store = LocalStore(folder.parent.parent)
    holder = SnapshotHolder()
    holder.publish(
        Searcher.build(load_snapshot(store.fetch(KB, folder.name), INFO, checksums=False))
    )
    refresh.freeze_heap()  # the first swap: sets the base
    start = time.perf_counter()
    frozen = gc.get_freeze_count()
    count_s = time.perf_counter() - start
    start = time.perf_counter()
    blocks = sys.getallocatedblocks()
    blocks_s = time.perf_counter() - start
    start = time.perf_counter()
    gc.collect(1)
    gc.freeze()
    young_s = time.perf_counter() - start
    start = time.perf_counter()
    gc.unfreeze()
    gc.collect()
    gc.freeze()
    full_s = time.perf_counter() - start
    return {
        "chunks": len(holder.get(KB).chunks),  # type: ignore[union-attr]
        "frozen_objects": frozen,
        "freeze_count_ms": count_s * 1000,
        "allocated_blocks": blocks,
        "allocated_blocks_ms": blocks_s * 1000,
        "young_collection_and_freeze_ms": young_s * 1000,
        "full_collection_ms": full_s * 1000,
        "rss_mb": _status_mb("VmRSS"),
    }


def stall(n: int) -> dict[str, Any]:
    folder, _ = cached_snapshot(n)
    done = subprocess.run(
        [sys.executable, "-m", "bench.frozen_garbage", "--measure-stall", str(folder)],
        capture_output=True,
        check=True,
    )
    result: dict[str, Any] = json.loads(done.stdout)
    return result


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="5 swaps of 5 sessions, 10k chunks")
    parser.add_argument("--measure-stall", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.measure_stall:
        print(json.dumps(measure_stall(args.measure_stall)))
        return {}
    swaps, sessions, chunks = (5, 5, 10_000) if args.quick else (SWAPS, SESSIONS, 100_000)
    result = {
        "sessions_across_swaps": sessions_across_swaps(swaps, sessions),
        "stall": stall(chunks),
        "freeze_growth": refresh.FREEZE_GROWTH,
        "freeze_slack": refresh.FREEZE_SLACK,
    }
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps(result, indent=2) + "\n", encoding="utf-8")
    for name in ("branch_point", "bounded"):
        row = result["sessions_across_swaps"][name]
        print(
            f"{name}: frozen +{row['frozen_growth_per_swap']:.0f} objects/swap, "
            f"at most +{row['frozen_most_over_first']}, "
            f"{row['full_collections']} full collections, "
            f"RSS +{row['rss_growth_mb']:.1f} MB, frozen garbage at end "
            f"{row['frozen_garbage_at_end']} objects, "
            f"{row['frozen_garbage_bytes_at_end'] / 1024:.0f} KiB "
            f"({row['frozen_garbage_per_session_swap']:.1f} per session per swap)"
        )
    print(json.dumps(result["stall"]))
    return result


if __name__ == "__main__":
    main()
