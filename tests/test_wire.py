"""A Search's response written as bytes (sidecar/edge/wire.py) parses as the message protobuf
builds, field by field; its serializer sends the bytes as they are; hooks that need the message
get it parsed once, and what they change is sent. Every server test goes through it end to end."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import grpc
import pytest

from index.types import Chunk
from sidecar.edge.interceptor import Call, Hook, HookRun, Phases
from sidecar.edge.messages import chunk_message
from sidecar.edge.wire import passing_through, search_response
from sidecar.gen import retrieval_pb2 as pb
from sidecar.turn.engine import BasePolicy, SearchResult, Timings
from sidecar.turn.hits import Hit
from sidecar.turn.rerank import Status as RerankStatus
from tests.test_messages import CHUNK as BILLING

CHUNK = replace(BILLING, metadata={"lang": "en", "tags": ["a", "b"]})
BARE = Chunk(
    chunk_id="c2", source="", source_path="", title="", breadcrumbs=(), text="", embed_text=""
)
UNICODE = replace(
    CHUNK,
    chunk_id="ü-€-😀",
    title="Rückerstattung 🙂",
    text="返金には5日かかります。" * 40,  # a length past one varint byte
    metadata={"sprache": "deutsch ü"},
)
LONG = replace(CHUNK, chunk_id="c3", text="x" * 70_000)  # a three-byte length


def built(result: SearchResult, policy: BasePolicy) -> pb.SearchResponse:
    """The response as protobuf builds it, field by field."""
    return pb.SearchResponse(
        chunks=[chunk_message(h.knowledge_base, h.chunk, h.score) for h in result.hits],
        timings=pb.Timings(
            embed_ms=result.timings.embed_ms,
            search_ms=result.timings.search_ms,
            total_ms=result.timings.total_ms,
        ),
        snapshot_version=result.snapshot_version,
        degraded=result.degraded,
        fallback=policy.fallback if not result.hits else "",
        instructions=policy.instructions,
        rerank=result.rerank.name,
    )


def result(hits: list[Hit], **fields: Any) -> SearchResult:
    return SearchResult(hits=hits, snapshot_version="v-2026", **fields)


CASES = {
    "hits with metadata": (
        result([Hit("billing", CHUNK, 0.8), Hit("billing", BARE, -0.25)]),
        BasePolicy(),
    ),
    "empty, with a fallback": (result([]), BasePolicy(fallback="I could not find that.")),
    "empty, nothing at all": (SearchResult(hits=[], snapshot_version=""), BasePolicy()),
    "degraded, timed, reranked": (
        result(
            [Hit("billing", CHUNK, 3.5)],
            degraded=True,
            timings=Timings(embed_ms=1.25, search_ms=0.5, total_ms=2.0),
            rerank=RerankStatus.RERANK_TIMED_OUT,
        ),
        BasePolicy(instructions="Answer briefly."),
    ),
    "a fallback not sent beside hits": (
        result([Hit("billing", CHUNK, 0.5)], rerank=RerankStatus.RERANKED),
        BasePolicy(fallback="nothing", instructions="Cite the page."),
    ),
    "unicode and long fields": (
        result(
            [Hit("wissen-ü", UNICODE, 0.9), Hit("billing", LONG, 0.1)],
            rerank=RerankStatus.RERANK_FAILED,
        ),
        BasePolicy(fallback="—", instructions="Antworte kurz 🙂" * 100),
    ),
}


@pytest.mark.parametrize("case", CASES, ids=list(CASES))
def test_a_written_response_parses_as_the_one_protobuf_builds(case: str) -> None:
    found, policy = CASES[case]
    for _ in range(3):  # encoded, encoded and kept, then from the kept encodings
        encoded = search_response(found, policy)
        got = pb.SearchResponse.FromString(encoded.data)
        assert got == built(found, policy)
    assert got.timings.total_ms == pytest.approx(found.timings.total_ms)
    assert [c.score for c in got.chunks] == pytest.approx([h.score for h in found.hits])
    assert encoded.timings is found.timings  # the metrics hook reads these, not the bytes


def test_the_serializer_sends_the_bytes_and_still_serializes_a_message() -> None:
    handler = passing_through(
        grpc.unary_unary_rpc_method_handler(
            lambda request, context: None,
            response_serializer=pb.SearchResponse.SerializeToString,
        )
    )
    encoded = search_response(*CASES["hits with metadata"])
    assert handler.response_serializer(encoded) is encoded.data
    message = pb.SearchResponse(snapshot_version="v1")
    assert handler.response_serializer(message) == message.SerializeToString()


class Reads(Hook):
    """A hook that reads encoded answers as they are."""

    reads_encoded = True

    def __init__(self) -> None:
        self.seen: list[Any] = []

    def response(self, call: Call, message: Any) -> None:
        self.seen.append(message)


class Needs(Hook):
    """A hook that needs the message, and changes it."""

    def __init__(self) -> None:
        self.seen: list[Any] = []

    def response(self, call: Call, message: Any) -> None:
        self.seen.append(message)
        message.instructions = "changed by a hook"


def sent(hooks: list[Hook], message: Any) -> None:
    run = HookRun(Phases.of(hooks), Call("Search", "voxrecall.v1.Retrieval", {}, None, task=None))  # type: ignore[arg-type]
    run.sent(message)


def test_hooks_that_read_encoded_answers_never_make_the_message() -> None:
    reads = Reads()
    encoded = search_response(*CASES["hits with metadata"])
    sent([reads, Reads()], encoded)
    assert reads.seen == [encoded]
    assert encoded.wire() is encoded.data  # nothing parsed: the kept bytes go out


def test_a_hook_that_needs_the_message_gets_it_parsed_once_and_its_change_is_sent() -> None:
    found, policy = CASES["hits with metadata"]
    reads, first, second = Reads(), Needs(), Needs()
    encoded = search_response(found, policy)
    sent([first, reads, second], encoded)
    assert reads.seen == [encoded]
    assert first.seen[0] is second.seen[0]  # parsed once for both
    assert isinstance(first.seen[0], pb.SearchResponse)
    expected = built(found, policy)
    expected.instructions = "changed by a hook"
    assert pb.SearchResponse.FromString(encoded.wire()) == expected


def test_a_message_answer_reaches_every_hook_as_it_is() -> None:
    reads, needs = Reads(), Needs()
    message = pb.SearchResponse(snapshot_version="v1")
    sent([reads, needs], message)
    assert reads.seen == [message]
    assert needs.seen == [message]
