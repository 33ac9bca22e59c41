"""``bench.grpc_floor`` and ``bench.http_floor``: the canned ``Turn`` servers the DIY comparison
measures gRPC's and HTTP's own cost against, how ``bench.turn_latency --diy`` reads them beside
the sidecar's RPC share, its callers over ``/v1/turn`` and on ``Converse``, and how it reads the
``Converse`` round beside the DIY system. No timing is asserted."""

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


async def test_converse_callers_record_each_final_by_its_text(
    example_config: Config, local_embedder: Embedder
) -> None:
    """``--diy``'s ``Converse`` round: interims per word, then each final, answered once and
    recorded with its text (what the DIY system's time for the same turn is found by)."""
    calls = [["How do I reset my password?", "mm-hmm"]]
    converse = turn_latency.SCENARIOS[1]
    async with running(example_config, local_embedder) as sc:
        run = await turn_latency.drive(sc.port, converse, calls)
    assert converse.converse
    assert [(s.text, s.skipped) for s in run.samples] == [
        ("How do I reset my password?", False),
        ("mm-hmm", True),
    ]
    assert not run.samples[1].prefetched  # a backchannel is never searched, ahead or not
    diy = [("How do I reset my password?", 6.0), ("mm-hmm", 5.0)]
    out = turn_latency.converse_beside(run, diy)
    assert out["converse_goal_met"] is (out["converse_client"]["p50_ms"] <= 5.5)
    assert out["converse_prefetched"] == out["converse_prefetched_searched"] / 2


def test_converse_is_read_beside_the_diy_round() -> None:
    """Over every final and over the searched ones (against the DIY system's time for the same
    texts); the prefetched share of each; a round with no Converse finals meets no goal."""
    run = Run(
        samples=[
            Sample(1.0, 2.0, False, False, True, "a"),
            Sample(5.0, 8.0, False, False, False, "b"),
            Sample(0.1, 1.0, False, True, False, "mm-hmm"),
            Sample(1.0, 3.0, False, False, True, "c"),
        ]
    )
    diy = [("a", 4.0), ("b", 6.0), ("mm-hmm", 2.0), ("c", 8.0)]
    out = turn_latency.converse_beside(run, diy)
    assert out["converse_client"]["p50_ms"] == 2.5
    assert out["converse_client_searched"]["p50_ms"] == 3.0
    assert out["converse_client_prefetched"]["p50_ms"] == 2.5
    assert out["converse_client_not_prefetched"]["p50_ms"] == 8.0
    assert out["converse_server"]["p50_ms"] == 1.0
    assert out["converse_prefetched"] == 0.5
    assert out["converse_prefetched_searched"] == 0.6667
    assert out["converse_over_diy_p50"] == 0.5  # 2.5 against the DIY's 5.0
    assert out["searched_converse_over_diy_p50"] == 0.5  # 3.0 against a, b, c's 6.0
    assert out["converse_goal_met"] is True
    assert turn_latency.converse_beside(Run(), diy)["converse_goal_met"] is False


def test_each_ratio_has_its_median_over_the_rounds() -> None:
    rounds = [
        {"turn_over_diy_p50": t, "turn_http_over_diy_p50": h, "converse_over_diy_p50": c}
        for t, h, c in ((1.6, 1.2, 0.9), (1.1, 1.7, 0.4), (1.3, 1.5, 1.2))
    ]
    assert turn_latency.medians(rounds) == {
        "median_turn_over_diy_p50": 1.3,
        "median_turn_http_over_diy_p50": 1.5,
        "median_converse_over_diy_p50": 0.9,
    }
