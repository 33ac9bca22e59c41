"""The gRPC port against a hostile caller: idle connections, and a flood of health watches.

    python -m bench.hostile_grpc                 # 500 connections, 2,000 watches
    python -m bench.hostile_grpc --quick         # 50 and 200: the smoke mode

Two ``voxrecall serve`` processes over a store built from ``examples/kb``: one with
``max_connection_idle_s`` = 15 (the default was 15 when this was measured; it is 300 now), one with 86400 (no idle bound: keepalive alone, as before it).
Against each: ``--connections`` connections that send HTTP/2's preface and SETTINGS and then
nothing, and the seconds until the server closes each (min, median, max); then ``--watches``
``grpc.health.v1.Health/Watch("")`` streams over 4 connections, how many were answered and how
many refused (and why), and the server's RSS before and with them open. Writes
``bench/results/hostile_grpc.json``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import selectors
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from pathlib import Path
from typing import Any

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from bench.report import plain

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "bench" / "results"
PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + b"\x00\x00\x00\x04\x00\x00\x00\x00\x00"
CLOSE_WAIT_S = 120.0  # past keepalive's close (30 s quiet + 10 s unanswered, ~60 s seen)
START_WAIT_S = 120.0  # imports, the model, the snapshot


def _config(folder: Path, port: int, idle_s: float) -> Path:
    path = folder / f"vr-{port}.toml"
    path.write_text(
        "[[knowledge_base]]\n"
        'name = "help"\n'
        "[[knowledge_base.source]]\n"
        'type = "markdown"\n'
        f"path = {json.dumps(str(REPO / 'examples/kb'))}\n"
        "[index]\n"
        f"store = {json.dumps(str(folder / 'store'))}\n"
        "[sidecar]\n"
        f"store = {json.dumps(str(folder / 'store'))}\n"
        f'listen = "127.0.0.1:{port}"\n'
        f"max_connection_idle_s = {idle_s}\n"
    )
    return path


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def _serve(config: Path) -> subprocess.Popen[str]:
    proc = subprocess.Popen(
        [sys.executable, "-m", "sidecar.cli", "serve", "--config", str(config)],
        cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    assert proc.stderr is not None
    deadline = time.monotonic() + START_WAIT_S
    for line in proc.stderr:
        if "listening on port" in line:  # its log from here on is read and dropped
            threading.Thread(target=proc.stderr.read, daemon=True).start()
            return proc
        assert time.monotonic() < deadline, "the sidecar did not start"
    raise RuntimeError(f"the sidecar exited: {proc.wait()}")


def _rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS"):
            return int(line.split()[1]) / 1024
    return 0.0


def idle_connections(port: int, n: int) -> dict[str, Any]:
    """``n`` connections that say nothing after the preface: seconds until each is closed."""
    sel = selectors.DefaultSelector()
    start = time.monotonic()
    for _ in range(n):
        s = socket.create_connection(("127.0.0.1", port))
        s.sendall(PREFACE)
        s.setblocking(False)
        sel.register(s, selectors.EVENT_READ)
    closed: list[float] = []
    while len(closed) < n and time.monotonic() - start < CLOSE_WAIT_S:
        for key, _ in sel.select(1):
            sock: socket.socket = key.fileobj  # type: ignore[assignment]
            try:
                data = sock.recv(65536)
            except OSError:
                data = b""
            if not data:
                closed.append(time.monotonic() - start)
                sel.unregister(sock)
                sock.close()
    for key in list(sel.get_map().values()):
        key.fileobj.close()  # type: ignore[union-attr]
    spread = (min(closed), statistics.median(closed), max(closed)) if closed else ()
    return {"connections": n, "closed": len(closed), "close_s_min_median_max": spread}


async def watches(port: int, pid: int, n: int) -> dict[str, Any]:
    """``n`` Watch("") streams over 4 connections: answered, refused by why, RSS."""
    options = [("grpc.use_local_subchannel_pool", 1)]
    channels = [grpc.aio.insecure_channel(f"127.0.0.1:{port}", options=options) for _ in range(4)]
    before = _rss_mb(pid)
    stubs = [health_pb2_grpc.HealthStub(ch) for ch in channels]
    calls = [stubs[i % 4].Watch(health_pb2.HealthCheckRequest()) for i in range(n)]
    outcome: Counter[str] = Counter()

    async def first(call: Any) -> None:
        try:
            await asyncio.wait_for(call.read(), 30)
            outcome["answered"] += 1
        except grpc.aio.AioRpcError as exc:
            outcome[f"{exc.code().name}: {(exc.details() or '')[:70]}"] += 1

    await asyncio.gather(*(first(call) for call in calls))
    during = _rss_mb(pid)
    check = await stubs[0].Check(health_pb2.HealthCheckRequest(), timeout=10)
    for call in calls:
        call.cancel()
    for ch in channels:
        await ch.close()
    return {
        "watches": n,
        "outcome": dict(outcome),
        "rss_mb_before": round(before),
        "rss_mb_open": round(during),
        "check_status": health_pb2.HealthCheckResponse.ServingStatus.Name(check.status),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=plain(__doc__))
    parser.add_argument("--connections", type=int, default=500, help="idle connections opened")
    parser.add_argument("--watches", type=int, default=2000, help="health watches opened")
    parser.add_argument("--quick", action="store_true", help="50 connections, 200 watches")
    parser.add_argument(
        "--out", type=Path, default=RESULTS / "hostile_grpc.json", help="the JSON written"
    )
    args = parser.parse_args(argv)
    if args.quick:
        args.connections, args.watches = 50, 200
    results: dict[str, Any] = {"load": os.getloadavg()}
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        first = _config(folder, 0, 15)
        subprocess.run(
            [sys.executable, "-m", "sidecar.cli", "index", "build", "--config", str(first)],
            cwd=REPO, check=True, capture_output=True,
        )  # fmt: skip
        for label, idle_s in (("max_connection_idle_s=15", 15.0), ("no idle bound", 86400.0)):
            port = _free_port()
            proc = _serve(_config(folder, port, idle_s))
            try:
                run = {"idle": idle_connections(port, args.connections)}
                run["watch"] = asyncio.run(watches(port, proc.pid, args.watches))
            finally:
                proc.terminate()
                proc.wait()
            results[label] = run
            print(label, json.dumps(run), flush=True)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=2) + "\n")
    print(f"load {results['load']}; wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
