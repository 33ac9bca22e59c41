"""Chunk messages encoded once and merged into responses (sidecar/edge/messages.py): a unit test of the
cache alone; every server test goes through it end to end."""

from __future__ import annotations

import tracemalloc
from dataclasses import replace

import pytest

from index.types import Chunk
from sidecar.edge.messages import ChunkMessages, _held_bytes, chunk_message
from sidecar.gen import retrieval_pb2 as pb
from sidecar.turn.hits import Hit

CHUNK = Chunk(
    chunk_id="c1",
    source="faq",
    source_path="billing.md",
    title="Billing",
    breadcrumbs=("Billing", "Refunds"),
    text="Refunds take five days.",
    embed_text="Billing > Refunds\n\nRefunds take five days.",
    url="https://example.com/billing",
    metadata={"lang": "en"},
)


def messages_encoded(chunk: Chunk) -> bytes:
    messages = ChunkMessages()
    for _ in range(2):
        filled(messages, [Hit("billing", chunk, 0.5)])
    return messages._cache[("billing", chunk.chunk_id)][1]


def filled(messages: ChunkMessages, hits: list[Hit]) -> pb.SearchResponse:
    response = pb.SearchResponse(snapshot_version="v1")
    messages.fill(response, "chunks", hits)
    return response


def test_a_response_equals_one_built_field_by_field_with_each_hits_score() -> None:
    messages = ChunkMessages()
    other = replace(CHUNK, chunk_id="c2", text="Invoices come monthly.")
    hits = [Hit("billing", CHUNK, 0.8), Hit("billing", other, 0.6)]
    for _ in range(2):  # built, then from the cache
        got = filled(messages, hits)
        assert list(got.chunks) == [chunk_message(h.knowledge_base, h.chunk, h.score) for h in hits]
    again = filled(messages, [Hit("billing", CHUNK, 0.1)])
    assert again.chunks[0].score == pytest.approx(0.1)  # a score never sticks to the cache
    kept = pb.SearchResponse.FromString(b"\x0a" + messages._cache[("billing", "c1")][1] + b"\0" * 4)
    assert kept.chunks[0] == chunk_message("billing", CHUNK)  # its score 0: none kept


def test_a_chunk_changed_under_the_same_id_is_built_anew() -> None:
    messages = ChunkMessages()
    for _ in range(2):  # built twice: kept
        filled(messages, [Hit("billing", CHUNK, 0.5)])
    assert ("billing", "c1") in messages._cache
    moved = replace(CHUNK, url="https://example.com/new-billing", metadata={"lang": "fr"})
    got = filled(messages, [Hit("billing", moved, 0.5)]).chunks[0]
    assert (got.url, dict(got.metadata)) == ("https://example.com/new-billing", {"lang": "fr"})
    other_base = filled(messages, [Hit("support", CHUNK, 0.5)]).chunks[0]
    assert other_base.knowledge_base == "support"


def test_the_cache_is_bounded_in_bytes() -> None:
    one = _held_bytes(CHUNK, messages_encoded(CHUNK))
    messages = ChunkMessages(max_bytes=3 * one)
    for i in range(10):
        for _ in range(2):  # kept on its second build
            filled(messages, [Hit("billing", replace(CHUNK, chunk_id=f"c{i}"), 0.5)])
        assert messages._bytes <= 3 * one
        assert ("billing", f"c{i}") in messages._cache
    assert len(messages._cache) <= 3


def test_what_the_cache_holds_is_within_its_bound_chunks_and_all() -> None:
    """The bound counts what an entry keeps alive: the chunk (its text and embedded text), not
    only the encoding (which counted a fifth of it). Chunks made for the cache alone, as a
    snapshot's table decodes them, measured with tracemalloc."""
    bound = 1 << 20
    messages = ChunkMessages(max_bytes=bound)
    text = "The billing page explains refunds and invoices. " * 40
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        for i in range(2_000):
            chunk = replace(
                CHUNK, chunk_id=f"c{i}", text=f"{i} {text}", embed_text=f"Billing: {i} {text}"
            )
            for _ in range(2):
                messages.fill(pb.SearchResponse(), "chunks", [Hit("billing", chunk, 0.5)])
            del chunk
        held = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    assert messages._cache  # it keeps them (and started over when full)
    assert held <= bound + 2_000 * 100  # its entries, and the set of the 2,000 chunks seen


def test_a_chunk_larger_than_the_whole_cache_is_not_kept() -> None:
    messages = ChunkMessages(max_bytes=1_000)
    big = replace(CHUNK, text="x" * 5_000)
    for _ in range(3):
        filled(messages, [Hit("billing", big, 0.5)])
    assert messages._cache == {}
    assert messages._bytes == 0


def test_a_chunk_built_once_is_not_kept_and_one_built_twice_is() -> None:
    messages = ChunkMessages()
    first = filled(messages, [Hit("billing", CHUNK, 0.5)])
    assert messages._cache == {}  # most hits of varied questions come once: none kept
    second = filled(messages, [Hit("billing", CHUNK, 0.4)])
    assert ("billing", "c1") in messages._cache
    third = filled(messages, [Hit("billing", CHUNK, 0.3)])
    built = [chunk_message("billing", CHUNK, score) for score in (0.5, 0.4, 0.3)]
    assert [first.chunks[0], second.chunks[0], third.chunks[0]] == built


def test_a_list_metadata_value_is_joined_in_the_message() -> None:
    listed = replace(CHUNK, metadata={"tags": ("roaming", "eu"), "lang": "en"})
    messages = ChunkMessages()
    for _ in range(3):  # encoded, encoded and kept, from the cache
        got = filled(messages, [Hit("billing", listed, 0.5)]).chunks[0]
        assert dict(got.metadata) == {"tags": "roaming, eu", "lang": "en"}


def test_each_field_gets_its_own_hits_in_order_beside_the_other_fields() -> None:
    messages = ChunkMessages()
    other = replace(CHUNK, chunk_id="c2", text="Invoices come monthly.")
    for _ in range(3):  # encoded, kept, from the cache
        got = pb.TurnResponse(query="refunds", snapshot_version="v1")
        messages.fill(got, "chunks", [Hit("billing", other, 0.7), Hit("billing", CHUNK, 0.25)])
        messages.fill(got, "context", [Hit("billing", CHUNK, 0.0)])
        messages.fill(got, "context", [])
        want = pb.TurnResponse(
            query="refunds",
            snapshot_version="v1",
            chunks=[chunk_message("billing", other, 0.7), chunk_message("billing", CHUNK, 0.25)],
            context=[chunk_message("billing", CHUNK, 0.0)],
        )
        assert got == want
        assert got.SerializeToString() == want.SerializeToString()
