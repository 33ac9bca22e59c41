"""Queries asked ahead of a turn (an interim transcript, for the prefetch) go behind every final
turn's, one at a time, a caller at a time, in a bounded line (``QueryEmbedder.ahead``).

Unit tests of one piece with an embedder whose calls the test releases (``Lanes``: the hot lane
and the background lane apart), so the test decides when a call finishes; then the prefetcher
over the engine. No assertion is about a duration.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Sequence
from pathlib import Path

import pytest

from index.embedders.base import FakeEmbedder, Vectors
from sidecar.turn import query_embedder
from sidecar.turn.engine import Engine, TurnInput
from sidecar.turn.prefetch import PREFETCH_MAX_BYTES, Prefetcher
from sidecar.turn.query_embedder import AHEAD_WAITING, QueryEmbedder
from tests.conftest import eventually
from tests.test_embed_later import Lanes, far, settle
from tests.test_turns import BACKENDS, PHONE_HELP
from tests.turns import SESSION, build_engine


@pytest.fixture
def no_rest(monkeypatch: pytest.MonkeyPatch) -> None:
    """Ahead calls may take all the time: the tests of order and line need no rest."""
    monkeypatch.setattr(query_embedder, "AHEAD_SHARE", 1.0)


def ahead(
    vectors: QueryEmbedder, text: str, caller: str = ""
) -> asyncio.Task[list[Vectors | None]]:
    return asyncio.create_task(vectors.ahead([text], far(), caller))


@pytest.mark.usefixtures("no_rest")
async def test_a_final_turn_is_embedded_before_the_ahead_query_waiting() -> None:
    """A prefetch asked while a final turn embeds waits; a second final turn asked meanwhile
    goes to the embedder at once, and the prefetch only once neither is in flight, on the
    background lane (never on the worker the finals use)."""
    lanes = Lanes()
    vectors = QueryEmbedder(lanes, cache_size=16)
    first = asyncio.create_task(vectors.get("how do I roam", far()))
    await eventually(lambda: len(lanes.calls) == 1)
    interim = ahead(vectors, "what does a data plan cost in France?")
    await settle()
    assert lanes.calls == [("hot", ("how do I roam",))]  # held: a final turn is in flight
    joined = ahead(vectors, "how do I roam")  # words in flight: joined at once, not held
    second = asyncio.create_task(vectors.get("how do I reset my password", far()))
    await eventually(lambda: len(lanes.calls) == 2)
    assert lanes.calls[1] == ("hot", ("how do I reset my password",))  # the final goes first
    lanes.later.set()
    lanes.hot.set()
    assert await first is not None
    assert await second is not None
    assert (await interim)[0] is not None
    assert (await joined)[0] is not None
    assert vectors.stats.joined == 1
    assert lanes.calls[2] == ("later", ("what does a data plan cost in France?",))
    assert vectors.stats.busy == vectors.stats.late == vectors.stats.dropped == 0


@pytest.mark.usefixtures("no_rest")
async def test_an_ahead_query_waits_for_the_background_calls_on_its_lane() -> None:
    """The background lane is one thread, first in first out: an ahead call submitted behind
    an agent turn's embedding (``later``) queued there, and a final joining it waited for both."""
    lanes = Lanes()
    vectors = QueryEmbedder(lanes, cache_size=16)
    read = asyncio.create_task(vectors.later("A travel pass costs five dollars a day.", far()))
    await eventually(lambda: len(lanes.calls) == 1)
    interim = ahead(vectors, "what does a data plan cost in France?")
    await settle()
    assert lanes.calls == [("later", ("A travel pass costs five dollars a day.",))]
    assert not vectors.started("what does a data plan cost in France?")  # in line, not queued
    lanes.later.set()
    assert await read is not None
    assert (await interim)[0] is not None
    assert lanes.calls[1] == ("later", ("what does a data plan cost in France?",))
    assert vectors.stats.dropped == 0


@pytest.mark.usefixtures("no_rest")
async def test_one_ahead_call_at_a_time_whoever_asks() -> None:
    lanes = Lanes()
    vectors = QueryEmbedder(lanes, cache_size=16)
    one = ahead(vectors, "how do I roam in Spain?", "a")
    two = ahead(vectors, "how do I roam in Italy?", "b")
    await eventually(lambda: len(lanes.calls) == 1)
    await settle()
    assert lanes.calls == [("later", ("how do I roam in Spain?",))]
    lanes.later.set()
    assert (await one)[0] is not None
    assert (await two)[0] is not None
    assert lanes.calls[1] == ("later", ("how do I roam in Italy?",))


@pytest.mark.usefixtures("no_rest")
async def test_the_ahead_queries_waiting_are_taken_a_caller_at_a_time() -> None:
    """One client's many streams do not take every turn from another client's one stream."""
    lanes = Lanes()
    vectors = QueryEmbedder(lanes, cache_size=16)
    final = asyncio.create_task(vectors.get("how do I roam", far()))
    await eventually(lambda: len(lanes.calls) == 1)
    asked = [ahead(vectors, f"flood {i}?", "flood") for i in range(3)]
    asked.append(ahead(vectors, "how much is roaming in Peru?", "caller"))
    await settle()
    lanes.later.set()
    lanes.hot.set()
    await final
    await asyncio.gather(*asked)
    order = [texts[0] for lane, texts in lanes.calls if lane == "later"]
    assert order == ["flood 0?", "how much is roaming in Peru?", "flood 1?", "flood 2?"]


@pytest.mark.usefixtures("no_rest")
async def test_ahead_queries_past_the_line_drop_the_biggest_callers_oldest() -> None:
    """While a final turn embeds, AHEAD_WAITING ahead queries wait; each one more drops the
    oldest of the caller with the most waiting, counted, never another caller's."""
    lanes = Lanes()
    vectors = QueryEmbedder(lanes, cache_size=16)
    final = asyncio.create_task(vectors.get("how do I roam", far()))
    await eventually(lambda: len(lanes.calls) == 1)
    mine = ahead(vectors, "how much is roaming in Peru?", "caller")
    flood = [ahead(vectors, f"flood {i}?", "flood") for i in range(AHEAD_WAITING + 4)]
    await settle()
    assert vectors.stats.dropped == 5
    assert all(task.done() and task.result() == [None] for task in flood[:5])
    assert not any(task.done() for task in flood[5:])
    assert not mine.done()
    lanes.later.set()
    lanes.hot.set()
    await final
    assert (await mine)[0] is not None
    await asyncio.gather(*flood)
    embedded = {texts[0] for lane, texts in lanes.calls if lane == "later"}
    assert embedded == {"how much is roaming in Peru?"} | {f"flood {i}?" for i in range(5, 20)}
    assert len(lanes.calls) == 1 + AHEAD_WAITING  # the final, then every query left in line


async def test_an_ahead_call_rests_before_the_next_and_one_out_of_time_is_dropped(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """An ahead call is followed by a rest in proportion (AHEAD_SHARE of the time at most): the
    next waits it out, and one whose deadline comes first is dropped and counted."""
    monkeypatch.setattr(query_embedder, "AHEAD_SHARE", 1e-9)  # a rest no test outlives
    lanes = Lanes()
    lanes.later.set()
    lanes.hot.set()
    vectors = QueryEmbedder(lanes, cache_size=16)
    assert (await vectors.ahead(["how do I roam in Spain?"], far()))[0] is not None
    soon = asyncio.get_running_loop().time() + 0.05
    assert await vectors.ahead(["how do I roam in Italy?"], soon) == [None]
    assert vectors.stats.dropped == 1
    assert lanes.calls == [("later", ("how do I roam in Spain?",))]
    # a final turn does not rest: it is embedded at once
    assert await vectors.get("how do I roam in Italy?", far()) is not None
    await vectors.aclose()


# -- the prefetcher ----------------------------------------------------------------------------


async def test_an_interim_over_the_byte_bound_is_not_searched_ahead(tmp_path: Path) -> None:
    fake = FakeEmbedder(dimension=1024)
    engine = build_engine(BACKENDS, tmp_path, embedder=fake)
    prefetcher = Prefetcher(engine, stable_ms=200)
    said = "How big can a pCloud file name be, " + "and " * (PREFETCH_MAX_BYTES // 4) + "why?"
    try:
        prefetcher.interim(TurnInput(session_id=SESSION, text=said, is_final=False))
        await settle()
        assert engine.counters.prefetch_too_long == 1
        assert engine.counters.prefetch_started == 0
        assert fake.calls == []
    finally:
        await prefetcher.aclose()
        await engine.aclose()


def another_callers_final(engine: Engine) -> Awaitable[Vectors | None]:
    return engine.vectors.get("another caller's turn", far())


def an_agent_turn_read_later(engine: Engine) -> Awaitable[Vectors | None]:
    return engine.vectors.later("An agent's turn, read later.", far())


@pytest.mark.parametrize("holder", [another_callers_final, an_agent_turn_read_later])
async def test_a_final_whose_prefetch_waits_in_line_is_searched_at_once(
    tmp_path: Path, holder: Callable[[Engine], Awaitable[Vectors | None]]
) -> None:
    """The prefetch of a final's words still waiting in line (behind another caller's final
    turn on the worker, or an agent turn's embedding on the background lane it would be
    queued behind) is cancelled, and the final embeds its words itself on the worker rather
    than wait for the prefetch (and fall back to the lexical index at its deadline)."""
    lanes = Lanes()
    engine = build_engine(BACKENDS, tmp_path, embedder=lanes)
    prefetcher = Prefetcher(engine, stable_ms=200, caller="me")
    said = "What are the limits on file names in pCloud?"
    try:
        held = asyncio.ensure_future(holder(engine))
        await eventually(lambda: len(lanes.calls) == 1)
        prefetcher.interim(TurnInput(session_id=SESSION, text=said, is_final=False))
        await settle()
        assert engine.counters.prefetch_started == 1
        assert len(lanes.calls) == 1  # the prefetch waits behind the call holding the lane
        turn = asyncio.create_task(
            engine.turn(TurnInput(session_id=SESSION, text=said), prefetcher)
        )
        await eventually(lambda: len(lanes.calls) == 2)
        assert lanes.calls[1][0] == "hot"  # the final's own embedding, on the worker
        lanes.hot.set()
        result = await turn
        lanes.later.set()
        await held
    finally:
        await prefetcher.aclose()
        await engine.aclose()
    assert not result.prefetched
    assert not result.degraded
    assert engine.vectors.stats.dropped == 0  # cancelled in line, not waited on till dropped


class HeldByAnother(Lanes):
    """Calls run at once but another caller's, held until the test releases the hot lane."""

    async def embed(self, texts: Sequence[str]) -> Vectors:
        self.calls.append(("hot", tuple(texts)))
        if "another caller's turn" in texts:
            await self.hot.wait()
        return self.fake.embed_batch(texts)


async def test_a_final_whose_prefetchs_own_words_wait_in_line_is_searched_at_once(
    tmp_path: Path,
) -> None:
    """A prefetch whose folded query was embedded before, but whose turn's own words (searched
    alone too: ``PlannedSearch.alone``) wait in line behind another caller's final, is still
    waiting: the final cancels it and embeds its words itself. It read only the folded query
    as started, and the final waited on the prefetch until it was dropped from the line."""
    lanes = HeldByAnother()
    engine = build_engine(
        {**PHONE_HELP, "MAILBOX": [*PHONE_HELP["MAILBOX"], "Mailbox is the voicemail service."]},
        tmp_path,
        embedder=lanes,
    )
    prefetcher = Prefetcher(engine, stable_ms=200, caller="me")
    said = "How can I change the code that protects my messages?"
    try:
        await engine.turn(TurnInput(session_id=SESSION, text="Tell me about Mailbox."))
        planned = engine.plan(TurnInput(session_id=SESSION, text=said, is_final=False))
        assert planned is not None
        assert planned.alone == said
        await engine.vectors.get(planned.query, far())  # the folded query, embedded before
        held = asyncio.ensure_future(another_callers_final(engine))
        await settle()
        prefetcher.interim(TurnInput(session_id=SESSION, text=said, is_final=False))
        await settle()
        assert engine.counters.prefetch_started == 1
        assert not engine.vectors.started(said)  # in line behind another caller's final
        result = await engine.turn(TurnInput(session_id=SESSION, text=said), prefetcher)
        lanes.hot.set()
        await held
    finally:
        await prefetcher.aclose()
        await engine.aclose()
    assert engine.vectors.stats.dropped == 0  # cancelled in line, not waited on till dropped
    assert not result.prefetched
    assert not result.degraded
