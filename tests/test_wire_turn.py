"""A Turn's response written as bytes (sidecar/edge/wire.py ``turn_response``) parses as the
message protobuf builds, field by field, for every field: the hits and the session's context,
the skip, the timings, the follow-up, the policy's words, unicode, and lengths past one byte."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from index.tables import ChunkTable
from sidecar.edge.interceptor import Call
from sidecar.edge.messages import chunk_message
from sidecar.edge.metrics import Metrics
from sidecar.edge.wire import EncodedResponse, turn_response
from sidecar.gen import retrieval_pb2 as pb
from sidecar.turn.engine import BasePolicy, Timings, TurnResult
from sidecar.turn.followups import FollowUp
from sidecar.turn.hits import Hit, TableHits
from sidecar.turn.rerank import Status as RerankStatus
from sidecar.turn.skip import Skip
from tests.test_wire import BARE, CHUNK, LONG, UNICODE


def built(result: TurnResult, policy: BasePolicy) -> pb.TurnResponse:
    """The response as protobuf builds it, field by field (as the servicer built it before)."""
    searched = result.skipped is Skip.NOT_SKIPPED
    return pb.TurnResponse(
        chunks=[chunk_message(h.knowledge_base, h.chunk, h.score) for h in result.hits],
        context=[chunk_message(h.knowledge_base, h.chunk, h.score) for h in result.context],
        skipped=result.skipped.name,
        degraded=result.degraded,
        query=result.query,
        timings=pb.Timings(
            embed_ms=result.timings.embed_ms,
            search_ms=result.timings.search_ms,
            total_ms=result.timings.total_ms,
        ),
        snapshot_version=result.snapshot_version,
        truncated=result.truncated,
        followup=pb.FollowUp(
            used=result.followup.used,
            source=result.followup.source,
            confidence=result.followup.confidence,
        ),
        fallback=policy.fallback if searched and not result.hits else "",
        instructions=policy.instructions,
        rerank=result.rerank.name,
    )


def turn(hits: list[Hit], **fields: Any) -> TurnResult:
    fields = {"context": [], "skipped": Skip.NOT_SKIPPED, "query": "", **fields}
    return TurnResult(hits=hits, snapshot_version="v-2026", **fields)


TIMED = Timings(embed_ms=1.25, search_ms=0.5, total_ms=2.0)
ENTITY = FollowUp(used="the Pro plan", source="entity", confidence=0.75)
CASES = {
    "hits and context": (
        turn(
            [Hit("billing", CHUNK, 0.8), Hit("billing", BARE, -0.25)],
            context=[Hit("billing", CHUNK, 0.5), Hit("support", BARE, 0.1)],
            query="how do refunds work",
            followup=ENTITY,
        ),
        BasePolicy(fallback="not sent beside hits", instructions="Answer briefly."),
    ),
    "searched, nothing found": (
        turn([], query="zzz", timings=TIMED),
        BasePolicy(fallback="I could not find that."),
    ),
    "skipped, no fallback": (
        turn([], skipped=Skip.BACKCHANNEL, query="", context=[Hit("billing", CHUNK, 0.3)]),
        BasePolicy(fallback="not sent: nothing was searched"),
    ),
    "nothing at all": (
        TurnResult(hits=[], context=[], skipped=Skip.NOT_SKIPPED, query="", snapshot_version=""),
        BasePolicy(),
    ),
    "every flag": (
        turn(
            [Hit("billing", CHUNK, 3.5)],
            degraded=True,
            truncated=True,
            timings=TIMED,
            rerank=RerankStatus.RERANK_TIMED_OUT,
            followup=FollowUp(used="what plan are you on?", source="agent_question"),
        ),
        BasePolicy(instructions="Cite the page."),
    ),
    "every skip and status": (
        turn([], skipped=Skip.CLOSING, rerank=RerankStatus.RERANK_FAILED),
        BasePolicy(),
    ),
    "unicode and long fields": (
        turn(
            [Hit("wissen-ü", UNICODE, 0.9), Hit("billing", LONG, 0.1)],
            context=[Hit("wissen-ü", UNICODE, 0.2)],
            query="Rückerstattung 😀 " * 1200,  # a three-byte length
            followup=FollowUp(used="返金 " * 50, source="recent_turns", confidence=1.0),
        ),
        BasePolicy(fallback="—", instructions="Antworte kurz 🙂" * 100),
    ),
}


@pytest.mark.parametrize("case", CASES, ids=list(CASES))
def test_a_written_turn_response_parses_as_the_one_protobuf_builds(case: str) -> None:
    found, policy = CASES[case]
    for _ in range(3):  # encoded, encoded and kept, then from the kept encodings
        written = turn_response(found, policy)
        got = pb.TurnResponse.FromString(written.data)
        assert got == built(found, policy)
    expected = built(found, policy)
    assert got.HasField("timings")
    assert got.HasField("followup")
    assert got.followup.confidence == pytest.approx(found.followup.confidence)
    assert [c.score for c in got.chunks] == pytest.approx([h.score for h in found.hits])
    assert [c.score for c in got.context] == pytest.approx([h.score for h in found.context])
    assert got.SerializeToString(deterministic=True) == expected.SerializeToString(
        deterministic=True
    )
    assert written.kind is pb.TurnResponse
    assert written.timings is found.timings


@pytest.mark.parametrize("skip", list(Skip))
@pytest.mark.parametrize("status", list(RerankStatus))
def test_every_skip_and_rerank_status_is_written_as_protobuf_reads_it(
    skip: Skip, status: RerankStatus
) -> None:
    """Each enum's number taken by name, as protobuf's: not by the Python enum's value, which
    agrees today only by chance (a review)."""
    found = turn([], skipped=skip, rerank=status)
    got = pb.TurnResponse.FromString(turn_response(found, BasePolicy()).data)
    assert got.skipped == pb.SkipReason.Value(skip.name)
    assert got.rerank == pb.RerankStatus.Value(status.name)


def test_a_hitless_turn_is_protobufs_bytes_exactly() -> None:
    """Without chunks (whose score a kept encoding writes last) every field is in protobuf's
    order and form: the bytes are protobuf's own."""
    found = turn(
        [],
        skipped=Skip.NOT_SKIPPED,
        query="wie lange dauert 😀",
        timings=TIMED,
        degraded=True,
        truncated=True,
        followup=ENTITY,
        rerank=RerankStatus.RERANKED,
    )
    policy = BasePolicy(fallback="Nichts gefunden.", instructions="Kurz.")
    assert turn_response(found, policy).data == built(found, policy).SerializeToString()


def test_a_turns_hits_from_a_table_parse_as_protobuf_builds_them(tmp_path: Path) -> None:
    table = ChunkTable.open(_dumped(tmp_path))
    found = [(1, 0.5), (0, 0.25)]
    written = turn_response(turn(TableHits("billing", table, found)), BasePolicy())
    hits = [Hit("billing", table[label], score) for label, score in found]
    assert pb.TurnResponse.FromString(written.data) == built(turn(hits), BasePolicy())


def _dumped(tmp_path: Path) -> Path:
    chunks = [CHUNK, replace(UNICODE, metadata={})]
    (tmp_path / "c.bin").write_bytes(ChunkTable.dump(chunks))
    return tmp_path / "c.bin"


def test_the_metrics_hook_reads_a_written_turns_timings_and_skip() -> None:
    """A skipped turn's embed and search stages are not observed; its total is."""
    searched = turn_response(turn([], timings=TIMED), BasePolicy())
    skipped = turn_response(turn([], skipped=Skip.AGENT_TURN, timings=TIMED), BasePolicy())
    assert (searched.searched, skipped.searched) == (True, False)
    seen: list[tuple[str, bool]] = []

    class Stages:
        def _timings(self, call: Call, timings: Timings, *, searched: bool) -> None:
            assert timings is TIMED
            seen.append((call.method, searched))

    call = Call("Turn", "voxrecall.v1.Retrieval", {}, None, task=None)  # type: ignore[arg-type]
    for written in (searched, skipped):
        Metrics.response(Stages(), call, written)  # type: ignore[arg-type]
    assert seen == [("Turn", True), ("Turn", False)]
    assert isinstance(searched, EncodedResponse)
