"""A Search's response written as bytes (sidecar/edge/wire.py) parses as the message protobuf
builds, field by field; its serializer sends the bytes as they are; hooks that need the message
get it parsed once, and what they change is sent. Every server test goes through it end to end."""

from __future__ import annotations

import copy
import gc
import pickle
from dataclasses import replace
from pathlib import Path
from typing import Any

import grpc
import pytest

from index.tables import MAX_FIELD_BYTES, ChunkTable
from index.types import Chunk
from sidecar.edge.interceptor import Call, Hook, Phases
from sidecar.edge.messages import Answers, ChunkMessages, chunk_message
from sidecar.edge.wire import passing_through, search_response
from sidecar.gen import retrieval_pb2 as pb
from sidecar.turn.engine import BasePolicy, SearchResult, Timings
from sidecar.turn.hits import Hit, TableHits
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
    call = Call("Search", "voxrecall.v1.Retrieval", {}, None, Phases.of(hooks), task=None)  # type: ignore[arg-type]
    call.sent(message)


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


# -- a plain Search's hits, written from the chunk table ---------------------------------------

# chunks whose metadata has at most one entry: protobuf writes a map's entries in its own hash
# order, the table's bytes in the table's, so only those are compared byte for byte
ONE_ENTRY = replace(CHUNK, metadata={"tags": ("a", "", "b")})  # a list, joined with ", "
TABLE = [
    ONE_ENTRY,
    BARE,
    UNICODE,
    replace(LONG, metadata={}),  # a text over the cap: cut at it, as decoding cuts it
    replace(CHUNK, chunk_id="c4", breadcrumbs=("", "Ärger"), url="", metadata={"": ""}),
    replace(CHUNK, chunk_id="c5", title="T" * (MAX_FIELD_BYTES + 10), metadata={}),  # over a cap
    replace(CHUNK, chunk_id="c6", title="AB", text="CD text", metadata={"k": "AB"}),
    replace(CHUNK, chunk_id="c7", title="Broken title"),  # two entries
]
SPLIT, BROKEN = 6, 7  # made not UTF-8 by ``crafted``


def crafted(tmp_path: Path) -> ChunkTable:
    """TABLE as a mapped table, with bytes no build writes: chunk SPLIT's title ending in a
    character's first byte and its text starting with its second (the chunk's span is UTF-8,
    neither string is), and one of chunk BROKEN's title bytes not UTF-8."""
    data = bytearray(ChunkTable.dump(TABLE))
    at = data.index(b"ABCD text")  # chunk SPLIT's title, then its text
    data[at + 1 : at + 3] = "é".encode()
    data[data.index(b"Broken title") + 1] = 0xFF
    (tmp_path / "c.bin").write_bytes(bytes(data))
    return ChunkTable.open(tmp_path / "c.bin")


def old_way(kb: str, table: ChunkTable, found: list[tuple[int, float]]) -> bytes:
    """The response's bytes as the hits' chunks, decoded, were written before."""
    hits = [Hit(kb, table[label], score) for label, score in found]
    return search_response(result(hits), BasePolicy()).data


def test_hits_written_from_a_table_are_the_bytes_of_its_decoded_chunks(tmp_path: Path) -> None:
    table = crafted(tmp_path)
    assert table[SPLIT].title == "A\ufffd"  # replaced, as decoding replaces it
    assert table[SPLIT].text.startswith("\ufffdD")
    assert "\ufffd" in table[BROKEN].title
    decoded = [i for i in range(len(TABLE)) if table.utf8(i) is None]
    assert decoded == [3, 5, SPLIT, BROKEN]  # over a cap, or not UTF-8: the rest from their bytes
    for label in range(len(TABLE)):
        found = [(label, 0.75)]
        written = search_response(result(TableHits("wissen-ü", table, found)), BasePolicy())
        expected = old_way("wissen-ü", table, found)
        if len(table[label].metadata) <= 1:
            assert written.data == expected, label
        assert pb.SearchResponse.FromString(written.data) == pb.SearchResponse.FromString(expected)
    sent = pb.SearchResponse.FromString(written.data).chunks[0]  # BROKEN, two entries
    assert sent.metadata == {"lang": "en", "tags": "a, b"}


def test_a_responses_hits_from_a_table_parse_as_protobuf_builds_them(tmp_path: Path) -> None:
    table = crafted(tmp_path)
    found = [(label, 1.0 - label / 10) for label in reversed(range(len(TABLE)))]
    hits = TableHits("billing", table, found)
    written = search_response(result(hits), BasePolicy(fallback="none"))
    expected = built(result([Hit("billing", table[i], s) for i, s in found]), BasePolicy())
    assert pb.SearchResponse.FromString(written.data) == expected
    assert [c.title for c in expected.chunks][-1] == ONE_ENTRY.title
    assert len(expected.chunks[-6].title.encode()) == MAX_FIELD_BYTES  # c5's, cut at its cap


def test_table_hits_make_each_hit_from_the_table_when_read(tmp_path: Path) -> None:
    table = crafted(tmp_path)
    hits = TableHits("billing", table, [(2, 0.5), (0, 0.25)])
    assert len(hits) == 2
    assert list(hits) == [Hit("billing", table[2], 0.5), Hit("billing", table[0], 0.25)]
    assert hits[0] is next(iter(hits))  # made once, then kept
    assert hits[1:] == [Hit("billing", TABLE[0], 0.25)]
    # a list's value: equal to the same hits in a list, pickled and copied as that list
    assert hits == list(hits)
    assert list(hits) == hits
    assert TableHits("billing", table, []) == []
    assert pickle.loads(pickle.dumps(hits)) == list(hits)
    assert copy.deepcopy(hits) == list(hits)
    assert repr(hits).startswith("TableHits([Hit(")


def test_a_tables_encodings_are_kept_the_second_time_and_only_for_that_table(
    tmp_path: Path,
) -> None:
    table = crafted(tmp_path)
    messages = ChunkMessages()
    first = b""
    for _ in range(3):  # written, written and kept, then from the kept bytes
        parts: list[bytes] = []
        messages.table_pieces(parts, b"\x0a", TableHits("billing", table, [(2, 0.5)]))
        assert not first or b"".join(parts) == first
        first = b"".join(parts)
    assert list(messages._tables[table]["billing"]) == [2]  # by base, then label
    (tmp_path / "other").mkdir()
    other = crafted(tmp_path / "other")  # the next snapshot: its own encodings
    for _ in range(2):
        messages.table_pieces([], b"\x0a", TableHits("billing", other, [(2, 0.5)]))
    assert messages._tables[other] is not messages._tables[table]
    assert len(messages._tables) == 2
    assert messages.held_bytes > 0
    del table, other
    gc.collect()
    assert not messages._tables  # a snapshot let go takes its encodings with it
    assert messages.held_bytes == 0  # and their count: the next table gets the whole bound


def test_a_tables_kept_encodings_stay_within_the_bound(tmp_path: Path) -> None:
    table = crafted(tmp_path)
    messages = ChunkMessages(max_bytes=700)  # two of chunks 0, 4 and 6 (~300 bytes each)
    for label in (0, 4, 6, 0, 4, 6, 0, 4, 6):  # each kept on its second sighting
        messages.table_pieces([], b"\x0a", TableHits("billing", table, [(label, 0.5)]))
        assert messages.held_bytes <= messages.max_bytes
        assert len(messages._tables[table]["billing"]) <= 2
    messages.table_pieces([], b"\x0a", TableHits("billing", table, [(2, 0.5)] * 2))
    assert len(messages._tables[table]["billing"]) <= 2  # 1,700 bytes: never kept


# -- a base's answers, written once when its snapshot loads ------------------------------------


def test_answers_written_at_load_are_the_bytes_a_hit_from_the_table_gets(tmp_path: Path) -> None:
    table = crafted(tmp_path)  # chunks over a cap and not UTF-8 among them: decoded, then written
    answers = Answers.of("wissen-ü", table)
    assert answers is not None
    for label in range(len(TABLE)):
        found = [(label, 0.75), (0, -0.5)]
        written = search_response(
            result(TableHits("wissen-ü", table, found, answers)), BasePolicy()
        )
        assert (
            written.data
            == search_response(result(TableHits("wissen-ü", table, found)), BasePolicy()).data
        )
    every = [(label, 1.0 - label / 10) for label in range(len(TABLE))]
    written = search_response(result(TableHits("wissen-ü", table, every, answers)), BasePolicy())
    expected = built(result([Hit("wissen-ü", table[i], s) for i, s in every]), BasePolicy())
    assert pb.SearchResponse.FromString(written.data) == expected
    assert answers.nbytes >= sum(len(answers.piece(i)) for i in range(len(TABLE)))


def test_answers_for_another_base_are_not_read(tmp_path: Path) -> None:
    table = crafted(tmp_path)
    answers = Answers.of("billing", table)
    hits = TableHits("support", table, [(2, 0.5)], answers)
    got = pb.SearchResponse.FromString(search_response(result(hits), BasePolicy()).data)
    assert got.chunks[0].knowledge_base == "support"


def test_a_base_whose_answers_pass_the_cap_gets_none_and_is_written_per_hit(
    tmp_path: Path,
) -> None:
    table = crafted(tmp_path)
    whole = Answers.of("billing", table)
    assert whole is not None
    size = sum(len(whole.piece(i)) for i in range(len(TABLE)))
    assert Answers.of("billing", table, cap=size) is not None  # just fits
    assert Answers.of("billing", table, cap=size - 1) is None  # stopped as it passed the cap


def test_a_table_of_over_twice_the_cap_is_not_even_tried(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    table = crafted(tmp_path)

    def unread(self: ChunkTable, label: int) -> None:
        raise AssertionError(f"chunk {label} read")

    monkeypatch.setattr(ChunkTable, "utf8", unread)
    assert Answers.of("billing", table, cap=table.blob.nbytes // 2 - 1) is None
    with pytest.raises(AssertionError, match="chunk 0 read"):
        Answers.of("billing", table, cap=-(-table.blob.nbytes // 2))  # tried: within twice it
