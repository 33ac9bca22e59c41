"""A Converse stream's answer written as bytes (sidecar/edge/wire.py ``converse_response``)
parses as the ``ConverseResponse`` protobuf builds around the turn's response, field by field:
the turn (every case of tests/test_wire_turn.py), whether a prefetch answered it, and the
transcript (empty, unicode, and long enough for a length of several bytes)."""

from __future__ import annotations

from dataclasses import replace

import pytest

from sidecar.edge.interceptor import Call
from sidecar.edge.metrics import Metrics
from sidecar.edge.wire import converse_response
from sidecar.gen import retrieval_pb2 as pb
from sidecar.turn.engine import BasePolicy, Timings, TurnResult
from sidecar.turn.skip import Skip
from tests.test_wire_turn import CASES, TIMED, built, turn

TRANSCRIPTS = {
    "none": "",
    "plain": "How do refunds work?",
    "unicode, long": "Wie lange dauert die Rückerstattung? 😀 " * 500,
}


def built_answer(result: TurnResult, policy: BasePolicy, transcript: str) -> pb.ConverseResponse:
    """The answer as the servicer built it before: the turn's message, the flag, the words."""
    return pb.ConverseResponse(
        turn=built(result, policy), prefetched=result.prefetched, transcript=transcript
    )


@pytest.mark.parametrize("words", TRANSCRIPTS, ids=list(TRANSCRIPTS))
@pytest.mark.parametrize("prefetched", [False, True], ids=["searched", "prefetched"])
@pytest.mark.parametrize("case", CASES, ids=list(CASES))
def test_a_written_converse_answer_parses_as_the_one_protobuf_builds(
    case: str, prefetched: bool, words: str
) -> None:
    found, policy = CASES[case]
    found = replace(found, prefetched=prefetched)
    transcript = TRANSCRIPTS[words]
    expected = built_answer(found, policy, transcript)
    for _ in range(3):  # encoded, encoded and kept, then from the kept encodings
        written = converse_response(found, policy, transcript)
        got = pb.ConverseResponse.FromString(written.data)
        assert got == expected
    assert got.HasField("turn")
    assert got.turn.HasField("timings")
    assert got.turn.HasField("followup")
    assert got.prefetched is prefetched
    assert got.transcript == transcript
    assert [c.score for c in got.turn.chunks] == pytest.approx([h.score for h in found.hits])
    assert got.SerializeToString(deterministic=True) == expected.SerializeToString(
        deterministic=True
    )
    assert written.kind is pb.ConverseResponse
    assert written.timings is found.timings
    assert written.searched is (found.skipped is Skip.NOT_SKIPPED)


def test_a_hitless_answer_is_protobufs_bytes_exactly() -> None:
    """Without chunks (whose score a kept encoding writes last) every field is in protobuf's
    order and form, the turn's and the answer's: the bytes are protobuf's own."""
    found = turn([], query="wie lange 😀", timings=TIMED, degraded=True, prefetched=True)
    policy = BasePolicy(fallback="Nichts gefunden.", instructions="Kurz.")
    written = converse_response(found, policy, "wie lange dauert das 😀")
    assert (
        written.data == built_answer(found, policy, "wie lange dauert das 😀").SerializeToString()
    )


def test_the_metrics_hook_reads_a_written_answers_timings_and_skip() -> None:
    """As it read the built answer's turn: a skipped turn's embed and search stages unobserved."""
    seen: list[tuple[Timings, bool]] = []

    class Stages:
        def _timings(self, call: Call, timings: Timings, *, searched: bool) -> None:
            assert call.method == "Converse"
            seen.append((timings, searched))

    call = Call("Converse", "voxrecall.v1.Retrieval", {}, None, task=None)  # type: ignore[arg-type]
    for skip in (Skip.NOT_SKIPPED, Skip.BACKCHANNEL):
        written = converse_response(turn([], skipped=skip, timings=TIMED), BasePolicy(), "yes")
        Metrics.response(Stages(), call, written)  # type: ignore[arg-type]
    assert seen == [(TIMED, True), (TIMED, False)]
