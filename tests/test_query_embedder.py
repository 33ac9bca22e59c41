"""``QueryEmbedder.get_many``: a turn's queries in one embedder call, with ``get``'s semantics.

Unit tests of one piece: the embedder is ``FakeEmbedder`` or a gated one the test releases, so
each test decides when a call finishes. No assertion is about a duration: a deadline that has
to pass is one that has already passed, or one the gated embedder is held past.
"""

from __future__ import annotations

import asyncio
import sys
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import pytest

from index.embedders.base import EmbedderInfo, FakeEmbedder, Vectors
from sidecar.turn import query_embedder
from sidecar.turn.query_embedder import ENTRY_QUERY_BYTES, QueryEmbedder
from tests.conftest import eventually
from tests.turns import build_engine, run_turns

FAR_S = 60.0  # a deadline no test reaches: the calls it covers finish when released


class Gated:
    """An embedder whose calls finish when the test sets ``release`` (until then they wait,
    as a busy or stuck model does); records each call's texts."""

    def __init__(self, rows: int | None = None) -> None:
        self.fake = FakeEmbedder(dimension=16)
        self.release = asyncio.Event()
        self.calls: list[tuple[str, ...]] = []
        self.rows = rows  # answer this many vectors instead of one per text (a broken embedder)

    @property
    def info(self) -> EmbedderInfo:
        return self.fake.info

    def embed_batch(self, texts: Sequence[str]) -> Vectors:
        return self.fake.embed_batch(texts)

    async def embed(self, texts: Sequence[str]) -> Vectors:
        self.calls.append(tuple(texts))
        await self.release.wait()
        vectors = self.fake.embed_batch(texts)
        return vectors if self.rows is None else vectors[: self.rows]

    async def aclose(self) -> None:
        return None


def far() -> float:
    return asyncio.get_running_loop().time() + FAR_S


def passed() -> float:
    return asyncio.get_running_loop().time() - 1.0


async def test_uncached_queries_go_to_the_embedder_in_one_call() -> None:
    fake = FakeEmbedder(dimension=16)
    vectors = QueryEmbedder(fake, cache_size=16)
    folded, alone = await vectors.get_many(
        ["roaming prices and how to turn it on", "turn it on"], far()
    )
    assert fake.calls == [("roaming prices and how to turn it on", "turn it on")]
    assert folded is not None
    assert alone is not None
    np.testing.assert_array_equal(
        folded, fake.embed_batch(["roaming prices and how to turn it on"])[0]
    )
    np.testing.assert_array_equal(alone, fake.embed_batch(["turn it on"])[0])
    # each landed in the cache on its own: the searches that follow find them there
    assert vectors.cached("turn it on") is not None
    again = await vectors.get("turn it on", far())
    assert again is not None
    np.testing.assert_array_equal(again, alone)
    assert (vectors.stats.hits, vectors.stats.misses) == (1, 2)


async def test_a_cached_query_is_not_sent_again_and_a_repeated_one_is_sent_once() -> None:
    fake = FakeEmbedder(dimension=16)
    vectors = QueryEmbedder(fake, cache_size=16)
    first = await vectors.get("roaming", far())
    got = await vectors.get_many(["roaming", "data plans", "data plans"], far())
    assert fake.calls == [("roaming",), ("data plans",)]
    assert first is not None
    assert got[0] is not None
    np.testing.assert_array_equal(got[0], first)
    assert got[1] is not None
    assert got[2] is got[1]


async def test_a_query_already_in_flight_is_joined_not_sent_again() -> None:
    gated = Gated()
    vectors = QueryEmbedder(gated, cache_size=16)
    single = asyncio.create_task(vectors.get("roaming", far()))
    await eventually(lambda: gated.calls == [("roaming",)])
    many = asyncio.create_task(vectors.get_many(["roaming", "data plans"], far()))
    # only the query not yet in flight is sent, in a call of its own
    await eventually(lambda: len(gated.calls) == 2)
    assert gated.calls[1] == ("data plans",)
    gated.release.set()
    joined, new = await many
    assert joined is not None
    assert new is not None
    np.testing.assert_array_equal(joined, await single)
    assert vectors.stats.joined == 1


async def test_get_joins_a_query_of_a_batch_in_flight_and_reads_its_row() -> None:
    gated = Gated()
    vectors = QueryEmbedder(gated, cache_size=16)
    many = asyncio.create_task(vectors.get_many(["roaming", "data plans"], far()))
    await eventually(lambda: gated.calls == [("roaming", "data plans")])
    second = asyncio.create_task(vectors.get("data plans", far()))
    await asyncio.sleep(0)
    gated.release.set()
    _, want = await many
    got = await second
    assert got is not None
    assert want is not None
    np.testing.assert_array_equal(got, want)
    assert gated.calls == [("roaming", "data plans")]
    assert vectors.stats.joined == 1


async def test_a_late_batch_answers_none_then_fills_the_cache() -> None:
    gated = Gated()
    vectors = QueryEmbedder(gated, cache_size=16)
    deadline = asyncio.get_running_loop().time() + 0.05
    assert await vectors.get_many(["roaming", "data plans"], deadline) == [None, None]
    assert vectors.stats.late == 2
    # the late call holds the one late slot: a new query is not submitted behind it
    assert await vectors.get_many(["voicemail"], far()) == [None]
    assert vectors.stats.busy == 1
    assert gated.calls == [("roaming", "data plans")]
    gated.release.set()
    await eventually(lambda: vectors.cached("data plans") is not None)
    assert vectors.cached("roaming") is not None
    assert await vectors.get("voicemail", far()) is not None  # the slot is free again


async def test_a_late_batch_still_running_is_cut_off(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(query_embedder, "LATE_CUTOFF_S", 0.01)
    gated = Gated()  # never released: a stuck model
    vectors = QueryEmbedder(gated, cache_size=16)
    deadline = asyncio.get_running_loop().time() + 0.01
    assert await vectors.get_many(["roaming", "data plans"], deadline) == [None, None]
    await eventually(lambda: not vectors._inflight and not vectors._late)
    assert vectors.cached("roaming") is None
    fake = FakeEmbedder(dimension=16)
    vectors.embedder = fake
    (again,) = await vectors.get_many(["roaming"], far())
    assert again is not None  # sent again, not refused as busy
    assert fake.calls == [("roaming",)]


async def test_past_the_deadline_nothing_is_sent() -> None:
    fake = FakeEmbedder(dimension=16)
    vectors = QueryEmbedder(fake, cache_size=16)
    assert await vectors.get_many(["roaming", "data plans"], passed()) == [None, None]
    assert fake.calls == []
    assert vectors.stats.late == 2


async def test_a_failing_embedder_answers_none_for_each_query() -> None:
    vectors = QueryEmbedder(FakeEmbedder(dimension=16, fail=True), cache_size=16)
    assert await vectors.get_many(["roaming", "data plans"], far()) == [None, None]
    assert vectors.stats.failed == 2
    assert vectors.cached("roaming") is None


async def test_an_answer_with_too_few_vectors_is_a_failure() -> None:
    gated = Gated(rows=1)
    gated.release.set()
    vectors = QueryEmbedder(gated, cache_size=16)
    assert await vectors.get_many(["roaming", "data plans"], far()) == [None, None]
    assert vectors.stats.failed == 2
    assert vectors.cached("roaming") is None


async def test_a_cancelled_caller_leaves_the_call_running_for_the_cache() -> None:
    gated = Gated()
    vectors = QueryEmbedder(gated, cache_size=16)
    caller = asyncio.create_task(vectors.get_many(["roaming", "data plans"], far()))
    await eventually(lambda: len(gated.calls) == 1)
    caller.cancel()
    with pytest.raises(asyncio.CancelledError):
        await caller
    assert vectors.stats.late == 0  # it was left, not late: counted apart
    # but it holds the late slot (a client hanging up at once cannot queue work ahead of others)
    assert await vectors.get("another caller", far()) is None
    assert vectors.stats.busy == 1
    gated.release.set()
    await eventually(lambda: vectors.cached("data plans") is not None)


async def test_a_query_asked_ahead_and_superseded_holds_no_late_slot() -> None:
    """An interim's search ahead is cancelled by the sidecar itself when a newer interim comes:
    its call goes on for the cache, and another caller's query is still embedded."""
    gated = Gated()
    vectors = QueryEmbedder(gated, cache_size=16)
    ahead = asyncio.create_task(vectors.ahead(["how do I roam"], far()))
    await eventually(lambda: len(gated.calls) == 1)
    ahead.cancel()
    with pytest.raises(asyncio.CancelledError):
        await ahead
    other = asyncio.create_task(vectors.get("another caller", far()))
    await eventually(lambda: len(gated.calls) == 2)
    gated.release.set()
    assert await other is not None
    assert vectors.stats.busy == 0
    await eventually(lambda: vectors.cached("how do I roam") is not None)


async def test_a_shared_call_cut_off_answers_none_to_the_one_waiting() -> None:
    gated = Gated()
    vectors = QueryEmbedder(gated, cache_size=16)
    caller = asyncio.create_task(vectors.get_many(["roaming", "data plans"], far()))
    await eventually(lambda: len(gated.calls) == 1)
    await vectors.aclose()  # cancels the call itself, not the caller
    assert await caller == [None, None]
    assert vectors.stats.failed == 2


async def test_a_turn_searched_folded_and_alone_embeds_both_in_one_call(tmp_path: Path) -> None:
    fake = FakeEmbedder(dimension=1024)  # few hash collisions between the words
    base = {
        "GOOGLE DRIVE": ["To set up Google Drive, run rclone config and choose drive."],
        "FILTERING": ["Use --exclude to skip files matching a pattern when you transfer."],
    }
    question = "how can I skip files matching a pattern"
    engine = build_engine(base, tmp_path, embedder=fake)
    try:
        *_, later = await run_turns(
            engine, [("user", "Tell me about Google Drive."), ("user", question)]
        )
    finally:
        await engine.aclose()
    # searched folded with the tracked entity and alone: its own words answered it
    assert later.hits[0].chunk.title == "FILTERING"
    # both queries went to the embedder together, in one call
    assert fake.calls[1:] == [(f"GOOGLE DRIVE: {question}", question)]


async def test_the_cache_is_bounded_in_bytes_long_queries_taking_the_room_of_several() -> None:
    """The attack: 2,048 cached queries of 16 KiB each held ~36 MB under a setting of "2048".
    ``cache_size`` entries are counted as queries of ENTRY_QUERY_BYTES: a long one takes the
    room of several, so long queries push the older ones out sooner, and the bytes held stay
    within what ``cache_size`` short ones would hold."""
    fake = FakeEmbedder(dimension=16)
    vectors = QueryEmbedder(fake, cache_size=8)
    short = [f"short question {i}" for i in range(8)]
    for query in short:
        await vectors.get(query, far())
    assert all(vectors.cached(q) is not None for q in short)  # eight short ones fit
    long = ["\U0001f4de" * 500 + str(i) for i in range(8)]  # 2 kB of str each
    for query in long:
        await vectors.get(query, far())
    held = [q for q in (*short, *long) if vectors.cached(q) is not None]
    assert long[-1] in held
    assert all(q not in held for q in short)  # pushed out
    assert sum(map(sys.getsizeof, held)) <= 8 * (ENTRY_QUERY_BYTES + 4 * 16 + 200)
    huge = "\U0001f4de" * 4000  # larger than the whole cache: answered, not kept
    assert await vectors.get(huge, far()) is not None
    assert vectors.cached(huge) is None
    assert vectors.cached(long[-1]) is not None
    await vectors.get_many(["one call", "of two queries"], far())
    kept = vectors.cached("one call")
    assert kept is not None
    assert kept.base is None  # its own row, not a view of both
