"""A client started before its sidecar: how soon after the sidecar serves it is answered.

    python -m bench.client_reconnect              # 6 refused tries before the sidecar listens
    python -m bench.client_reconnect --tries 1    # the smoke mode

A port on 127.0.0.1 takes each connection and closes it unanswered (nothing serves gRPC there
yet) while a client calls, until its channel has tried ``--tries`` times; then a real sidecar
(``create_server``, the hash embedder, a snapshot of ``examples/kb``) listens on that same port,
and a call made with ``wait_for_ready`` measures the time from the sidecar serving to its answer.
Two clients, one after the other: the project's channel options (``sidecar.connection``: 100 ms
growing 1.6x to 2 s between tries) and gRPC's defaults (1 s growing 1.6x to 120 s). Reported
for each: the time its tries took and the time to the first answer, and the ratio of the two
clients' waits. Writes ``bench/results/client_reconnect.json``.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import grpc

from bench.in_process import written
from bench.report import plain
from index.build import build_knowledge_base
from index.embedders.base import HashEmbedder
from sidecar.config import parse_config
from sidecar.connection import Connection
from sidecar.edge.server import create_server
from sidecar.gen import retrieval_pb2 as pb
from sidecar.gen import retrieval_pb2_grpc as pb_grpc

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "bench" / "results"
EMBEDDER = HashEmbedder(dimension=64)
GIVE_UP_S = 300.0  # a bound on each phase: gRPC's default reaches 120 s between tries
MODES: dict[str, list[tuple[str, str | int]]] = {
    "project": Connection().options(),
    "grpc_default": [],
}


class Refuser:
    """A port that takes each connection and closes it unanswered, counting them."""

    def __init__(self, tries: int) -> None:
        self.tries = 0
        self.enough = asyncio.Event()
        self._wanted = tries

    async def refuse(self, _reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.tries += 1
        writer.close()
        if self.tries >= self._wanted:
            self.enough.set()


def _config(folder: Path, port: int) -> Any:
    raw = {
        "knowledge_base": [
            {"name": "help", "source": [{"type": "markdown", "path": str(REPO / "examples/kb")}]}
        ],
        "index": {"store": str(folder / "store")},
        "sidecar": {"store": str(folder / "store"), "listen": f"127.0.0.1:{port}"},
    }
    return parse_config(raw, folder)


async def _refused_until(stub: pb_grpc.RetrievalStub, refuser: Refuser) -> None:
    """Calls while nothing serves (each refused at once), until the channel tried enough."""
    give_up = time.monotonic() + GIVE_UP_S
    while not refuser.enough.is_set() and time.monotonic() < give_up:
        with contextlib.suppress(grpc.aio.AioRpcError):
            await stub.Search(pb.SearchRequest(knowledge_base="help", query="password"))
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(refuser.enough.wait(), timeout=1.0)


async def _one(folder: Path, options: list[tuple[str, str | int]], tries: int) -> dict[str, Any]:
    refuser = Refuser(tries)
    listener = await asyncio.start_server(refuser.refuse, "127.0.0.1", 0)
    port = listener.sockets[0].getsockname()[1]
    config = _config(folder, port)
    build_knowledge_base(config, config.knowledge_bases[0], EMBEDDER)
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}", options=options) as channel:
        stub = pb_grpc.RetrievalStub(channel)  # type: ignore[no-untyped-call]
        started = time.monotonic()
        await _refused_until(stub, refuser)
        tried_s = time.monotonic() - started
        listener.close()
        await listener.wait_closed()
        sidecar = await create_server(config, embedder=EMBEDDER, poll=False)
        serving = time.monotonic()
        try:
            found = await stub.Search(
                pb.SearchRequest(knowledge_base="help", query="password"),
                timeout=GIVE_UP_S,
                wait_for_ready=True,
            )
            answered_s = time.monotonic() - serving
        finally:
            await sidecar.stop(0.5)
    return {
        "refused_tries": refuser.tries,
        "tries_took_s": round(tried_s, 3),
        "answered_after_serving_s": round(answered_s, 3),
        "answered": bool(found.chunks),
    }


async def _run(folder: Path, tries: int) -> dict[str, Any]:
    modes = {}
    for name, options in MODES.items():
        modes[name] = await _one(folder / name, options, tries)
    ours = modes["project"]["answered_after_serving_s"]
    theirs = modes["grpc_default"]["answered_after_serving_s"]
    return {"modes": modes, "default_over_project": round(theirs / max(ours, 1e-3), 2)}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.client_reconnect", description=plain(__doc__))
    p.add_argument("--tries", type=int, default=6, help="refused tries before it serves (6)")
    p.add_argument("--out", type=Path, default=RESULTS / "client_reconnect.json", help="JSON")
    args = p.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="voxrecall-reconnect-") as tmp:
        result = {
            "command": " ".join(["python -m bench.client_reconnect", *(argv or sys.argv[1:])]),
            "cpus": os.cpu_count(),
            "tries": args.tries,
            **asyncio.run(_run(Path(tmp), args.tries)),
        }
    written(result, args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
