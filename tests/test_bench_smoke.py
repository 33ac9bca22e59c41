"""The benchmark harness itself: its corpus, its verdicts, and one tiny ``search`` run end to end.

No timing is asserted: only that the suite runs against a real sidecar process, that every system
is judged on the same ground truth, and that the goals are read the way issue 7 states them.
"""

from __future__ import annotations

import argparse
import json
import logging
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import grpc
import numpy as np
import pytest

import index.snapshot
from bench import (
    handler_cost,
    hits_written,
    hook_pressure,
    scale,
    search,
    search_parts,
    sidecar_proc,
    turn_cost,
)
from bench.corpus import CorpusSpec, exact_top_k, generate, load_or_generate, recall_at_k
from sidecar.gen import retrieval_pb2 as pb

TINY = CorpusSpec(n=1500, dim=32, queries=60)


def test_corpus_is_seeded_unit_and_its_truth_is_exact(tmp_path: Path) -> None:
    a = generate(TINY)
    b = load_or_generate(TINY, tmp_path)  # drawn and cached
    c = load_or_generate(TINY, tmp_path)  # read back from the cache
    for other in (b, c):
        assert np.array_equal(a.vectors, other.vectors)
        assert np.array_equal(a.truth, other.truth)
    assert np.allclose(np.linalg.norm(a.vectors, axis=1), 1.0, atol=1e-5)
    brute = np.argsort(-(a.queries @ a.vectors.T), axis=1, kind="stable")[:, : TINY.k]
    assert recall_at_k(exact_top_k(a.vectors, a.queries, TINY.k), brute) == 1.0
    assert not np.array_equal(a.queries, a.calibration)
    assert generate(CorpusSpec(n=1500, dim=32, queries=60, seed=1)).vectors[0].tolist() != (
        a.vectors[0].tolist()
    )


def test_search_suite_runs_the_sidecar_and_agrees_with_hnswlib(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="bench.search")
    result = search.run(
        True,
        n=TINY.n,
        dim=TINY.dim,
        queries=TINY.queries,
        systems=("numpy-exact", "hnswlib", "voxrecall", "grpc-echo", "grpc-knn"),
        cache=tmp_path,
    )
    rows = result["systems"]
    assert (result["n"], result["dim"], result["k"]) == (TINY.n, TINY.dim, 10)
    for name in ("numpy-exact", "hnswlib", "voxrecall", "grpc-echo"):
        for key in ("recall_at_10", "p50_ms", "p95_ms", "p99_ms", "qps_concurrent_16"):
            assert key in rows[name], (name, key)
    assert rows["numpy-exact"]["recall_at_10"] == 1.0
    # the sidecar serves the very graph hnswlib loads, at the same ef: the same answers
    assert rows["voxrecall"]["recall_at_10"] == rows["hnswlib"]["recall_at_10"]
    assert rows["voxrecall"]["setting"]["ef_search"] == rows["hnswlib"]["setting"]["ef_search"]
    assert rows["grpc-echo"]["recall_at_10"] is None
    assert rows["grpc-echo"]["setting"]["response_bytes"] > 10 * 100  # ten real chunks
    assert rows["grpc-knn"]["recall_at_10"] is None  # it answers the echo's bytes
    # the share is split at the bare server that searches the same graph
    share = result["goals"]["sidecar_share_ms"]
    parts = share["bare_server_share_ms"] + share["above_bare_server_ms"]
    assert parts == pytest.approx(share["value"], abs=0.002)
    for peer in search.PEERS:
        assert rows[peer] == {"skipped": "not selected (--systems)"}  # named, even in --quick
    assert result["goals"]["voxrecall_p50_over_pgvector"] == {"skipped": "not measured: pgvector"}
    # a bare clone's first run spends minutes here: each step says so as it starts and ends
    said = [r.getMessage() for r in caplog.records if r.name == "bench.search"]
    steps = (
        "corpus ",
        "corpus ready in",
        "voxrecall's snapshot",
        "snapshot built in",
        "starting a sidecar",
    )
    for step in steps:
        assert any(line.startswith(step) for line in said), (step, said)


def _row(p50: float, recall: float | None = 0.99, qps: float = 1000.0) -> dict[str, object]:
    return {"p50_ms": p50, "cold_p50_ms": p50, "recall_at_10": recall, "qps_concurrent_16": qps}


def test_goals_are_the_issues_ratios() -> None:
    goals = search.check_goals(
        {
            "hnswlib": _row(0.3),
            "grpc-echo": _row(0.7, recall=None),
            "voxrecall": _row(1.2, qps=900.0),
            "pgvector": _row(1.0, recall=0.97, qps=1000.0),
            "chroma": _row(4.0, recall=0.94),
            "faiss-hnsw": {"skipped": "faiss-cpu is not installed"},
        }
    )
    assert goals["voxrecall_p50_over_echo_plus_hnswlib"] == {
        "value": 1.2,
        "goal": "<= 1.3",
        "met": True,
    }
    assert goals["sidecar_share_ms"] == {"value": 0.2, "goal": "<= 0.08", "met": False}
    assert goals["voxrecall_p50_over_pgvector"]["value"] == 1.2
    assert goals["voxrecall_p50_over_pgvector"]["met"] is False
    assert goals["voxrecall_qps_over_pgvector"]["met"] is False
    assert goals["chroma_p50_over_voxrecall"]["value"] == round(4.0 / 1.2, 3)
    assert goals["chroma_p50_over_voxrecall"]["met"] is True
    assert goals["recall_at_10_min"]["value"] == 0.94  # chroma's; echo and faiss do not count
    assert goals["recall_at_10_min"]["met"] is False


def test_pgvector_is_compared_at_equal_recall() -> None:
    base = {"hnswlib": _row(0.3), "grpc-echo": _row(0.7, recall=None)}
    pg = _row(1.0, recall=0.993)
    # the default setting falls short of pgvector's recall: the matched row is compared
    goals = search.check_goals(
        {**base, "voxrecall": _row(0.9, recall=0.987), search.MATCHED: _row(0.95, recall=0.994),
         "pgvector": pg}
    )  # fmt: skip
    verdict = goals["voxrecall_p50_over_pgvector"]
    assert verdict["compared"] == search.MATCHED
    assert verdict["value"] == 0.95
    assert verdict["met"] is True
    # no matched row: the default is compared, and its lower recall fails the goal
    verdict = search.check_goals({**base, "voxrecall": _row(0.9, recall=0.987), "pgvector": pg})[
        "voxrecall_p50_over_pgvector"
    ]
    assert verdict["compared"] == "voxrecall"
    assert verdict["met"] is False
    # the default already reaches it: no need for the matched row
    verdict = search.check_goals(
        {**base, "voxrecall": _row(0.9, recall=0.995), search.MATCHED: _row(0.8, recall=0.999),
         "pgvector": pg}
    )["voxrecall_p50_over_pgvector"]  # fmt: skip
    assert verdict["compared"] == "voxrecall"
    assert verdict["met"] is True


def test_search_parts_swaps_each_part_in_its_own_process(tmp_path: Path) -> None:
    tiny = ["--n", "2000", "--dim", "384", "--queries", "100", "--blocks", "1", "--rounds", "1"]
    result = search_parts.main([*tiny, "--out", str(tmp_path / "parts.json")])
    rows = result["variants"]
    assert set(rows) == {*search_parts.VARIANTS, "grpc-echo", "grpc-knn", "hnswlib"}
    for name, row in rows.items():
        assert row["p50_ms"] > 0
        assert row["server_cpu_us_per_call"] >= 0
        assert name == "hnswlib" or row["qps_concurrent_16"] > 0
    assert set(result["share"]) == set(result["bare_server_share"]) == {"p50_ms", "cpu_us"}
    # each swap took effect in its own process, and only there
    assert rows["sidecar"]["distinct_top_chunks"] > 1
    assert rows["no-hooks"]["same_answers_as_sidecar"]
    assert rows["canned"]["distinct_top_chunks"] == 1  # one stored answer for every query
    assert rows["canned-knn"]["distinct_top_chunks"] == 1
    assert rows["grpc-echo"]["distinct_top_chunks"] == 1
    assert rows["grpc-knn"]["distinct_top_chunks"] == 1  # the echo's bytes, after a search


async def test_search_parts_drops_the_named_hooks_and_only_those(
    monkeypatch: pytest.MonkeyPatch, example_config: Any, local_embedder: Any
) -> None:
    from sidecar.edge import guards
    from sidecar.edge.server import create_server
    from sidecar.gen import retrieval_pb2_grpc as pb_grpc

    monkeypatch.setattr(guards.Guards, "build", guards.Guards.build)  # put back after the test
    search_parts._patch("drop:CallLog+Metrics#2")
    sidecar = await create_server(example_config, embedder=local_embedder, poll=False)
    try:
        kinds = [type(hook).__name__ for hook in sidecar.guards.interceptors[0].hooks]
        assert kinds == ["DrainGate", "ConcurrencyLimit", "FieldLimits"]
        async with grpc.aio.insecure_channel(f"127.0.0.1:{sidecar.port}") as channel:
            call = pb_grpc.RetrievalStub(channel).Search(  # type: ignore[no-untyped-call]
                pb.SearchRequest(query="How do I reset my password?"), timeout=30
            )
            assert (await call).chunks
            assert "x-call-id" not in dict(await call.trailing_metadata())  # no call log
    finally:
        await sidecar.stop(0.5)


def test_search_parts_names_only_the_variants_it_has() -> None:
    assert search_parts._variants("sidecar,sidecar#2,drop:CallLog") == (
        "sidecar",
        "sidecar#2",
        "drop:CallLog",
    )
    with pytest.raises(argparse.ArgumentTypeError, match="unknown variant 'no-such'"):
        search_parts._variants("sidecar,no-such")
    with pytest.raises(argparse.ArgumentTypeError, match="must include sidecar"):
        search_parts._variants("no-hooks")


class SeenIndex:
    """An hnswlib index's ``knn_query`` that keeps what it was asked."""

    def __init__(self) -> None:
        self.queries: list[list[list[float]]] = []

    def knn_query(self, query: Any, k: int) -> None:
        self.queries.append(query.tolist())


async def test_the_bare_search_floors_search_the_requests_vector() -> None:
    """``grpc-knn`` and ``canned-knn`` are the share's floor only while they search: each hands
    the request's vector to the graph before answering its stored bytes."""
    vector = np.arange(4, dtype="<f4")
    request = pb.SearchRequest(knowledge_base="bench", vector=vector.tobytes())
    seen = SeenIndex()
    server, port = sidecar_proc.echo_server(b"stored", seen)
    await server.start()
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            knn = channel.unary_unary(
                "/bench.Echo/Knn", request_serializer=pb.SearchRequest.SerializeToString
            )
            assert await knn(request, timeout=10) == b"stored"
    finally:
        await server.stop(None)
    assert seen.queries == [[vector.tolist()]]

    async def search(self: Any, request: Any, context: Any) -> bytes:
        return b"answer"

    canned = search_parts._stored(search, searched=True)
    servicer = SimpleNamespace(holder=SimpleNamespace(get=lambda kb: SimpleNamespace(index=seen)))
    assert await canned(servicer, request, None) == b"answer"
    assert seen.queries == [[vector.tolist()]] * 2


def test_scale_extrapolation_is_marked_and_follows_the_measured_trend() -> None:
    rows = {
        10_000: {"snapshot_mb": 20.0, "load_s": 0.5, "rss_mb": 150.0},
        100_000: {"snapshot_mb": 200.0, "load_s": 5.0, "rss_mb": 600.0},
    }
    for n, p50 in ((10_000, 0.4), (100_000, 0.5)):
        rows[n] |= {"search_p50_ms": p50, "search_p99_ms": 2 * p50}
    guess = scale.extrapolate(1_000_000, rows, "needs more memory")
    assert guess["extrapolated"] == "needs more memory"
    assert guess["snapshot_mb"] == 2000.0
    assert guess["rss_mb"] == 5100.0
    assert guess["search_p50_ms"] == 0.6  # one more step per tenfold N


def test_scale_extrapolation_never_goes_below_what_was_measured() -> None:
    """The newcomer's quick run: p99 measured lower at 10k than at 2k (noise) was carried out
    to 1M as -1.103 ms."""
    rows = {
        2_000: {"snapshot_mb": 4.4, "rss_mb": 86.0, "search_p50_ms": 1.018, "search_p99_ms": 2.203},
        10_000: {"snapshot_mb": 23.0, "rss_mb": 84.0, "search_p50_ms": 0.9, "search_p99_ms": 1.6},
    }
    guess = scale.extrapolate(1_000_000, rows, "--quick measures only the small sizes")
    assert guess["search_p99_ms"] == 2.203  # the larger measured, not a negative time
    assert guess["search_p50_ms"] == 1.018
    assert guess["rss_mb"] == 86.0
    assert guess["snapshot_mb"] > 23.0  # a real trend still carries on


def test_hits_written_times_every_way_over_the_same_answers(tmp_path: Path) -> None:
    tiny = ["--n", "2000", "--dim", "384", "--queries", "100", "--calls", "20", "--rounds", "1"]
    result = hits_written.main([*tiny, "--out", str(tmp_path / "hits.json")])
    for workload in ("fresh", "repeated"):
        assert set(result[workload]["us_per_answer"]) == {"decoded", "table", "unkept"}
        assert all(us > 0 for us in result[workload]["us_per_answer"].values())


# The in-process cost tools, run small: a tiny corpus and a few calls, cached in the test's own
# folder (``--cache``), never the shared bench cache.
SMALL = ["--n", "1500", "--dim", "32", "--queries", "60", "--rounds", "1"]
HOOKS = {"CallLog", "Metrics", "DrainGate", "ConcurrencyLimit", "FieldLimits"}


def _small(tmp_path: Path, *extra: str) -> list[str]:
    return [*SMALL, *extra, "--cache", str(tmp_path / "cache"), "--out", str(tmp_path / "out.json")]


def _written(tmp_path: Path, result: dict[str, object]) -> None:
    """The JSON written is the result returned, and the corpus and its snapshot were cached in
    the test's folder."""
    assert json.loads((tmp_path / "out.json").read_text()) == json.loads(json.dumps(result))
    assert len(list((tmp_path / "cache").glob("corpus-*"))) == 1
    assert list((tmp_path / "cache").glob("*/*/bench"))  # the snapshot's store: a base "bench"


def test_hook_pressure_times_every_piece_and_handler_and_puts_the_graph_back(
    tmp_path: Path,
) -> None:
    knn = index.snapshot.knn
    result = hook_pressure.main(_small(tmp_path, "--calls", "40", "--number", "20"))
    _written(tmp_path, result)
    assert index.snapshot.knn is knn  # the canned graph is gone once measured
    assert set(result["pieces_us"]) == {
        "search_input", "vector_read", "graph_answer_into_hits", "response_written",
        "engine_search", "whole_search",
    }  # fmt: skip
    assert all(us > 0 for us in result["pieces_us"].values())
    walks = {f"walk_{w}" for w in hook_pressure.WALKS}
    assert set(result["handler_us"]) == set(result["hooks_us"]) == {
        "answered", "engine", "search", *walks
    }  # fmt: skip
    assert all(set(row) == {"all", "nothing"} for row in result["hooks_us"].values())


def test_handler_cost_times_the_search_with_and_without_each_hook(tmp_path: Path) -> None:
    result = handler_cost.main(_small(tmp_path, "--calls", "60"))
    _written(tmp_path, result)
    assert {"wrapped", "bare", "knn", "hooks_alone", "answered", "knn_in_call"} <= set(
        result["cpu_us_per_call"]
    )
    assert set(result["each_hook_us"]) == HOOKS  # one row per hook of the sidecar's interceptor
    assert (result["n"], result["dim"], result["calls"], result["rounds"]) == (1500, 32, 60, 1)


def test_turn_cost_replays_real_turns_every_way(tmp_path: Path) -> None:
    result = turn_cost.main(_small(tmp_path, "--calls", "100", "--sessions", "1"))
    _written(tmp_path, result)
    assert result["turns"] == len(turn_cost.TURNS)  # one session's turns, each answered
    assert 0 < result["searched_turns"] < result["turns"]  # the backchannel and agent skipped
    assert set(result["turn_cpu_us_alternating"]) == {"bytes", "message"}
    assert set(result["hooks_alone_us"]) == {"turn", "search"}
    assert set(result["each_hook_us"]) == HOOKS
    assert set(result["converse_answer_us"]) == {"bytes", "parsed"}
