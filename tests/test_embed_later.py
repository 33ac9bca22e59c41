"""Background embeddings (an agent's turn, for the page prior) go behind every caller's query.

``QueryEmbedder.later`` submits only once no caller's query is in flight, or LATER_WAIT_S at
most, on the embedder's background lane (``Deferrable``). Unit tests with an embedder whose
calls the test releases, so the test decides when a call finishes; then the embedded model
itself. No assertion is about a duration.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Sequence

import numpy as np
import pytest

from index.embedders.base import Deferrable, EmbedderInfo, FakeEmbedder, Vectors
from index.embedders.local import LocalEmbedder
from sidecar.turn import query_embedder
from sidecar.turn.query_embedder import QueryEmbedder
from tests.conftest import eventually

FAR_S = 60.0  # a deadline (and a wait) no test reaches


class Lanes:
    """An embedder with a background lane; each lane's calls finish when the test releases it.
    ``calls`` records (lane, texts) in the order the calls were made."""

    def __init__(self) -> None:
        self.fake = FakeEmbedder(dimension=16)
        self.hot = asyncio.Event()
        self.later = asyncio.Event()
        self.calls: list[tuple[str, tuple[str, ...]]] = []

    @property
    def info(self) -> EmbedderInfo:
        return self.fake.info

    def embed_batch(self, texts: Sequence[str]) -> Vectors:
        return self.fake.embed_batch(texts)

    async def embed(self, texts: Sequence[str]) -> Vectors:
        self.calls.append(("hot", tuple(texts)))
        await self.hot.wait()
        return self.fake.embed_batch(texts)

    async def embed_later(self, texts: Sequence[str]) -> Vectors:
        self.calls.append(("later", tuple(texts)))
        await self.later.wait()
        return self.fake.embed_batch(texts)

    async def aclose(self) -> None:
        return None


def far() -> float:
    return asyncio.get_running_loop().time() + FAR_S


async def settle() -> None:
    """Let every task that can run, run (a call not made by now waits on something)."""
    for _ in range(20):
        await asyncio.sleep(0)


@pytest.fixture
def no_wait_limit(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(query_embedder, "LATER_WAIT_S", FAR_S)


@pytest.mark.usefixtures("no_wait_limit")
async def test_a_callers_query_is_embedded_before_a_waiting_background_one() -> None:
    lanes = Lanes()
    assert isinstance(lanes, Deferrable)
    vectors = QueryEmbedder(lanes, cache_size=16)
    first = asyncio.create_task(vectors.get("how do I roam", far()))
    await eventually(lambda: len(lanes.calls) == 1)
    agent = asyncio.create_task(vectors.later("Roaming is free in the EU.", far()))
    await settle()
    assert lanes.calls == [("hot", ("how do I roam",))]  # held while a caller's query runs
    second = asyncio.create_task(vectors.get("what does a data plan cost", far()))
    await eventually(lambda: len(lanes.calls) == 2)
    assert lanes.calls[1] == ("hot", ("what does a data plan cost",))  # the caller goes first
    lanes.later.set()
    lanes.hot.set()
    assert await first is not None
    assert await second is not None
    assert await agent is not None  # submitted once no caller's query was in flight
    assert lanes.calls[2] == ("later", ("Roaming is free in the EU.",))
    assert vectors.stats.late == 0
    assert vectors.stats.busy == 0


async def test_a_background_query_is_not_starved_by_callers(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(query_embedder, "LATER_WAIT_S", 0.01)
    lanes = Lanes()
    vectors = QueryEmbedder(lanes, cache_size=16)
    stuck = asyncio.create_task(vectors.get("how do I roam", far()))  # never released
    await eventually(lambda: len(lanes.calls) == 1)
    lanes.later.set()
    # the caller's query is still in flight: the background one goes after LATER_WAIT_S anyway
    assert await vectors.later("Roaming is free in the EU.", far()) is not None
    assert not stuck.done()
    assert lanes.calls[1] == ("later", ("Roaming is free in the EU.",))
    stuck.cancel()
    await vectors.aclose()


async def test_a_hung_lane_takes_no_more_background_queries_until_its_call_ends() -> None:
    """A model that hangs on the lane would otherwise queue one call per agent turn there."""
    lanes = Lanes()
    vectors = QueryEmbedder(lanes, cache_size=16)
    soon = asyncio.get_running_loop().time() + 0.05
    assert await vectors.later("Roaming is free in the EU.", soon) is None  # left running
    assert await vectors.later("Calls to the UK cost extra.", far()) is None  # not submitted
    assert lanes.calls == [("later", ("Roaming is free in the EU.",))]
    assert vectors.stats.busy == 1
    lanes.later.set()  # the lane's call ends: background queries go on again
    await eventually(lambda: vectors.cached("Roaming is free in the EU.") is not None)
    assert await vectors.later("Calls to the UK cost extra.", far()) is not None
    await vectors.aclose()


@pytest.mark.usefixtures("no_wait_limit")
async def test_a_caller_asking_for_a_waiting_background_query_embeds_it_at_once() -> None:
    """The next user turn reads the agent's turn (the page prior): it does not wait for it."""
    lanes = Lanes()
    vectors = QueryEmbedder(lanes, cache_size=16)
    other = asyncio.create_task(vectors.get("how do I roam", far()))
    await eventually(lambda: len(lanes.calls) == 1)
    agent = asyncio.create_task(vectors.later("Roaming is free in the EU.", far()))
    await settle()
    reader = asyncio.create_task(vectors.get("Roaming is free in the EU.", far()))
    await eventually(lambda: len(lanes.calls) == 2)
    assert lanes.calls[1] == ("hot", ("Roaming is free in the EU.",))
    lanes.hot.set()
    assert await other is not None
    assert await reader is not None
    assert await agent is not None
    assert len(lanes.calls) == 2  # embedded once: the background query found it cached


async def test_an_embedder_without_a_background_lane_embeds_later_as_usual() -> None:
    fake = FakeEmbedder(dimension=16)
    assert not isinstance(fake, Deferrable)
    vectors = QueryEmbedder(fake, cache_size=16)
    vector = await vectors.later("Roaming is free in the EU.", far())
    assert vector is not None
    assert fake.calls == [("Roaming is free in the EU.",)]


# -- the embedded model ------------------------------------------------------------------------


@pytest.mark.usefixtures("no_wait_limit")
async def test_the_embedded_models_background_query_runs_after_the_callers() -> None:
    """With the real model: an agent's turn asked for while two callers' queries run is
    embedded after both, on its own lane, to the vector ``embed`` makes of it."""
    embedder = LocalEmbedder()
    vectors = QueryEmbedder(embedder, cache_size=16)
    done: list[str] = []

    async def track(name: str, job: Awaitable[Vectors | None]) -> Vectors | None:
        vector = await job
        done.append(name)
        return vector

    agent_text = "You can open a new tab with Ctrl+Shift+T, or from the dropdown menu. " * 4
    try:
        # made in one go: their first steps run in this order in one pass of the loop (the first
        # caller's query submitted, the agent's held, the second caller's submitted) before any
        # embedding can have finished
        first = asyncio.ensure_future(track("first", vectors.get("how do I open a new tab", far())))
        agent = asyncio.ensure_future(track("agent", vectors.later(agent_text, far())))
        second = asyncio.ensure_future(track("second", vectors.get("how do I split a pane", far())))
        got = await asyncio.gather(first, agent, second)
        assert all(v is not None for v in got)
        assert done[-1] == "agent"
        (alone,) = await embedder.embed([agent_text])
        assert got[1] is not None
        assert np.array_equal(got[1], alone)
    finally:
        await vectors.aclose()
        await embedder.aclose()
