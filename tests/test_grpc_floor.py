"""``bench.grpc_floor``: the canned ``Turn`` server the DIY comparison measures gRPC's own cost
against, and how ``bench.turn_latency --diy`` reads it beside the sidecar's RPC share. No timing
is asserted."""

from __future__ import annotations

import asyncio
from pathlib import Path

from bench import turn_latency
from bench.turn_latency import Run, Sample
from sidecar.gen import retrieval_pb2 as pb

ANSWER = pb.TurnResponse(
    query="how do I split a pane",
    chunks=[pb.Chunk(chunk_id="c1", text="Alt+Shift+D splits the pane.", title="Panes")],
    snapshot_version="v1",
)


def test_every_caller_gets_the_canned_answer_and_is_timed(tmp_path: Path) -> None:
    calls = [["How do I split a pane?"], ["Thanks.", "And close it?"]]
    run = asyncio.run(turn_latency.grpc_floor(ANSWER, calls, tmp_path))
    assert sorted(s.text for s in run.samples) == [
        "And close it?",
        "How do I split a pane?",
        "Thanks.",
    ]
    assert all(s.client_ms > 0 for s in run.samples)
    assert run.answer == ANSWER  # the bytes the sidecar sent, answered as they are


def test_the_rpc_share_is_read_against_the_floor() -> None:
    floor = Run(samples=[Sample(0.0, ms, False, False, False) for ms in (1.0, 2.0, 3.0)])
    out = turn_latency.floor_beside({"turn_rpc": {"p50_ms": 2.5}}, floor)
    assert out["grpc_floor"]["p50_ms"] == 2.0
    assert out["turn_rpc_above_floor_p50_ms"] == 0.5
