"""``bench.grpc_floor`` and ``bench.http_floor``: the canned ``Turn`` servers the DIY comparison
measures gRPC's and HTTP's own cost against, how ``bench.turn_latency --diy`` reads them beside
the sidecar's RPC share, and its callers over ``/v1/turn``. No timing is asserted."""

from __future__ import annotations

import asyncio
from pathlib import Path

import orjson
from google.protobuf import json_format

from bench import turn_latency
from bench.turn_latency import Run, Sample
from index.embedders.base import Embedder
from sidecar.config import Config
from sidecar.gen import retrieval_pb2 as pb
from tests.hardening_kit import running
from tests.test_http_rpc import with_http

ANSWER = pb.TurnResponse(
    query="how do I split a pane",
    chunks=[pb.Chunk(chunk_id="c1", text="Alt+Shift+D splits the pane.", title="Panes")],
    snapshot_version="v1",
)


def test_every_caller_gets_the_canned_answer_and_is_timed(tmp_path: Path) -> None:
    calls = [["How do I split a pane?"], ["Thanks.", "And close it?"]]
    run = asyncio.run(turn_latency.grpc_floor(ANSWER, calls, tmp_path))
    assert_each_turn_timed(run)
    assert run.answer == ANSWER  # the bytes the sidecar sent, answered as they are


def assert_each_turn_timed(run: Run) -> None:
    """Every turn of the calls above answered once, with a client time."""
    assert sorted(s.text for s in run.samples) == [
        "And close it?",
        "How do I split a pane?",
        "Thanks.",
    ]
    assert all(s.client_ms > 0 for s in run.samples)


def test_the_rpc_share_is_read_against_the_floor() -> None:
    floor = Run(samples=[Sample(0.0, ms, False, False, False) for ms in (1.0, 2.0, 3.0)])
    out = turn_latency.floor_beside({"turn_rpc": {"p50_ms": 2.5}}, floor)
    assert out["grpc_floor"]["p50_ms"] == 2.0
    assert out["turn_rpc_above_floor_p50_ms"] == 0.5


def test_every_http_caller_gets_the_canned_json_and_is_timed(tmp_path: Path) -> None:
    calls = [["How do I split a pane?"], ["Thanks.", "And close it?"]]
    answer = orjson.dumps(json_format.MessageToDict(ANSWER, preserving_proto_field_name=True))
    run = asyncio.run(turn_latency.http_floor(answer, calls, tmp_path))
    assert_each_turn_timed(run)
    assert run.answer == ANSWER
    assert run.answer_json == answer


async def test_http_callers_turn_through_the_sidecars_door(
    example_config: Config, local_embedder: Embedder
) -> None:
    """``--diy``'s callers over ``/v1/turn``: every turn answered by the sidecar, its server
    time read from the answer, beside the floor and the round's DIY p50."""
    calls = [["How do I reset my password?", "mm-hmm"]]
    async with running(with_http(example_config), local_embedder) as sc:
        run = await turn_latency.drive_http(sc.http_port, "t", calls, 150)
    assert [(s.text, s.skipped) for s in run.samples] == [
        ("How do I reset my password?", False),
        ("mm-hmm", True),
    ]
    assert run.samples[0].server_ms > 0
    assert orjson.loads(run.answer_json)["chunks"]
    out = turn_latency.http_beside({"diy": {"p50_ms": 1000.0}}, run, run)
    assert out["turn_http_goal_met"] is (out["turn_http_client"]["p50_ms"] <= 1000.0)
    assert out["http_floor"] == out["turn_http_client"]
