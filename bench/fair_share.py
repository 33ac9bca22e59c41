"""Fair shares: what a starved caller gets while another holds every stream it may and floods.

    python -m bench.fair_share                  # 20 seconds of load
    python -m bench.fair_share --duration 3     # the smoke mode

A sidecar (``create_server`` on 127.0.0.1, the real embedded model, the default limits: 64
unary calls and 64 streams) over a store built from ``examples/kb``, with two callers and no
shares configured (so a fair half each). The hog opens Converse streams until it is refused and
holds them, then runs more concurrent Turn loops than its share of unary calls. Meanwhile the
other caller plays calls: a Converse stream with a few turns, then Turns. Reported: the share of
the other caller's calls answered, and how many of the hog's were refused. Writes
``bench/results/fair_share.json``.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any

import grpc

from bench.in_process import written
from bench.report import plain
from index.build import build_knowledge_base
from index.embedders.local import LocalEmbedder
from sidecar.config import parse_config
from sidecar.edge.server import create_server
from sidecar.gen import retrieval_pb2 as pb
from sidecar.gen import retrieval_pb2_grpc as pb_grpc

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "bench" / "results"
CALL_TIMEOUT_S = 30.0  # far above a turn: a call past it counts as a failure
TOKENS = {"BENCH_HOG_TOKEN": "h" * 32, "BENCH_VICTIM_TOKEN": "v" * 32}
HOG = (("authorization", f"Bearer {'h' * 32}"),)
VICTIM = (("authorization", f"Bearer {'v' * 32}"),)
HOG_LOOPS = 48  # more unary calls at once than its share (32 of 64)
QUESTION = "how do I reset my password"


def _config(folder: Path) -> Any:
    raw = {
        "knowledge_base": [
            {"name": "help", "source": [{"type": "markdown", "path": str(REPO / "examples/kb")}]}
        ],
        "index": {"store": str(folder / "store")},
        "sidecar": {
            "store": str(folder / "store"),
            "listen": "127.0.0.1:0",
            "auth": {
                "caller": [
                    {"name": "hog", "token_env": "BENCH_HOG_TOKEN"},
                    {"name": "victim", "token_env": "BENCH_VICTIM_TOKEN"},
                ]
            },
        },
    }
    os.environ.update(TOKENS)
    return parse_config(raw, folder)


def _turn(session_id: str, text: str = QUESTION) -> pb.TurnRequest:
    return pb.TurnRequest(session_id=session_id, text=text, is_final=True)


async def _hold_streams(stub: pb_grpc.RetrievalStub) -> list[Any]:
    """The hog's streams, opened until one is refused; each has answered a turn."""
    held: list[Any] = []
    while True:
        stream = stub.Converse(metadata=HOG)
        try:  # the refusal may end the call before the write is done: then the write raises
            await stream.write(pb.ConverseRequest(turn=_turn(f"hog-{len(held)}")))
            await stream.read()
        except grpc.aio.AioRpcError as exc:
            if exc.code() is not grpc.StatusCode.RESOURCE_EXHAUSTED:
                raise
            return held
        held.append(stream)


async def _flood(stub: pb_grpc.RetrievalStub, until: float, codes: Counter[str]) -> None:
    while time.monotonic() < until:
        text = f"{QUESTION} {sum(codes.values())}"  # never cached: every call embeds
        try:
            await stub.Turn(_turn("hog-flood", text), metadata=HOG, timeout=CALL_TIMEOUT_S)
            codes["OK"] += 1
        except grpc.aio.AioRpcError as exc:
            codes[exc.code().name] += 1
            await asyncio.sleep(0.005)  # a refused client backs off a little


async def _victim(stub: pb_grpc.RetrievalStub, until: float, codes: Counter[str]) -> None:
    n = 0
    while time.monotonic() < until:
        n += 1
        try:
            stream = stub.Converse(metadata=VICTIM, timeout=CALL_TIMEOUT_S)
            for text in (QUESTION, "and on a second phone?"):
                await stream.write(pb.ConverseRequest(turn=_turn(f"victim-{n}", text)))
                await stream.read()
                codes["OK"] += 1
            await stream.done_writing()
            await stream.code()
            await stub.Turn(_turn(f"victim-{n}"), metadata=VICTIM, timeout=CALL_TIMEOUT_S)
            codes["OK"] += 1
        except grpc.aio.AioRpcError as exc:
            codes[exc.code().name] += 1


async def _run(folder: Path, duration: float) -> dict[str, Any]:
    config = _config(folder)
    embedder = LocalEmbedder()
    build_knowledge_base(config, config.knowledge_bases[0], embedder)
    sidecar = await create_server(config, embedder=embedder, poll=False)
    hog_codes: Counter[str] = Counter()
    victim_codes: Counter[str] = Counter()
    try:
        async with (
            grpc.aio.insecure_channel(f"127.0.0.1:{sidecar.port}") as hog_channel,
            grpc.aio.insecure_channel(f"127.0.0.1:{sidecar.port}") as victim_channel,
        ):
            hog = pb_grpc.RetrievalStub(hog_channel)  # type: ignore[no-untyped-call]
            held = await _hold_streams(hog)
            until = time.monotonic() + duration
            await asyncio.gather(
                *(_flood(hog, until, hog_codes) for _ in range(HOG_LOOPS)),
                _victim(pb_grpc.RetrievalStub(victim_channel), until, victim_codes),  # type: ignore[no-untyped-call]
            )
            for stream in held:
                await stream.done_writing()
    finally:
        await sidecar.stop(1.0)
    victim_calls = sum(victim_codes.values())
    return {
        "hog_streams_held": len(held),
        "hog_concurrent_turn_loops": HOG_LOOPS,
        "hog_calls": dict(hog_codes),
        "victim_calls": dict(victim_codes),
        "victim_answered_share": round(victim_codes["OK"] / victim_calls, 4) if victim_calls else 0,
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.fair_share", description=plain(__doc__))
    p.add_argument("--duration", type=float, default=20.0, help="seconds of load (default 20)")
    p.add_argument("--out", type=Path, default=RESULTS / "fair_share.json", help="the JSON written")
    args = p.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="voxrecall-fair-") as tmp:
        result = {
            "command": " ".join(["python -m bench.fair_share", *(argv or sys.argv[1:])]),
            "cpus": os.cpu_count(),
            "duration_s": args.duration,
            **asyncio.run(_run(Path(tmp), args.duration)),
        }
    written(result, args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
