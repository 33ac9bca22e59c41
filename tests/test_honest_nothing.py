"""An honest nothing after a topic: a question off the base, asked right after a page the
session tracks, gets no hits at the configured ``min_score``, as it does asked alone, while the
turns that lean on the page are still answered from it.

Through a real engine (``run_turns``) over the example help centre (``examples/kb``) with the
embedded model and the production ``min_score`` (0.3): the README's promise, as a newcomer
following it found it broken (the tracked name "Voicemail" folded into "What is the capital of
France?" lifted three voicemail chunks to 0.38-0.42).
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import pytest

from index.embedders.base import Embedder
from sidecar.config import Config
from sidecar.turn import engine as engine_module
from sidecar.turn.engine import Engine, TurnInput
from sidecar.turn.followups import Source
from sidecar.turn.prefetch import Prefetcher
from tests.turns import SESSION, run_turns

VOICEMAIL = "help-center:voicemail.md"
OFF_TOPIC = "What is the capital of France?"


@pytest.fixture
async def engine(example_config: Config, local_embedder: Embedder) -> AsyncIterator[Engine]:
    from sidecar.edge.server import create_server

    sidecar = await create_server(example_config, embedder=local_embedder, poll=False)
    yield sidecar.engine
    await sidecar.stop(0.5)


def pages(result: Any) -> set[str]:
    return {f"{hit.chunk.source}:{hit.chunk.source_path}" for hit in result.hits}


async def test_an_off_topic_question_after_a_tracked_page_gets_an_honest_nothing(
    engine: Engine,
) -> None:
    assert engine.config.min_score == 0.3  # the production default, as examples/voxrecall.toml
    alone = await run_turns(engine, [("user", OFF_TOPIC)])
    assert alone[0].hits == []  # asked alone: nothing on the base
    engine.end_session(SESSION)
    results = await run_turns(
        engine,
        [
            ("user", "How do I set up voicemail?"),
            ("user", OFF_TOPIC),
            ("user", "and how do I turn it on?"),
            ("user", "how much does it cost?"),
        ],
    )
    assert pages(results[0]) == {VOICEMAIL}
    # the page is tracked, yet the question's own words find nothing: nor does the turn
    assert results[1].hits == []
    assert results[1].query == OFF_TOPIC
    assert results[1].followup.used == ""
    # the page stays tracked: the follow-ups that point back are answered from it
    for result in results[2:]:
        assert result.followup.source == Source.ENTITY
        assert result.followup.used == "Voicemail"
        assert result.hits
        assert pages(result) == {VOICEMAIL}


async def test_a_question_that_does_not_point_back_but_asks_about_the_page_is_answered(
    engine: Engine,
) -> None:
    """No "it", and over five words (it does not refer back), but about the page: its own
    words find chunks at min_score asked alone, and after the page the page answers it."""
    for question in (
        "How many messages can be stored at one time?",
        "Can I read my messages instead?",
    ):
        alone = await run_turns(engine, [("user", question)])
        engine.end_session(SESSION)
        assert alone[0].hits
        results = await run_turns(
            engine, [("user", "How do I set up voicemail?"), ("user", question)]
        )
        engine.end_session(SESSION)
        assert results[1].followup.used == "Voicemail"
        assert results[1].hits
        assert pages(results[1]) == {VOICEMAIL}


async def test_an_off_topic_question_answered_from_a_prefetch_gets_an_honest_nothing(
    engine: Engine,
) -> None:
    """The same question on a Converse stream, searched ahead on its interim transcript: the
    prefetch ranked the folded query only ("Voicemail: What is the capital of France?"), so
    the final turn ranks both its searches itself (their vectors embedded ahead) and gets the
    nothing the turn searched at its final gets."""
    await run_turns(engine, [("user", "How do I set up voicemail?")])
    prefetcher = Prefetcher(engine, stable_ms=200)
    try:
        said = OFF_TOPIC  # ends in "?": a pause, searched ahead at once
        prefetcher.interim(TurnInput(session_id=SESSION, text=said, is_final=False))
        result = await engine.turn(TurnInput(session_id=SESSION, text=said), prefetcher)
    finally:
        await prefetcher.aclose()
        engine.end_session(SESSION)
    assert engine.counters.prefetch_started == 1
    assert result.hits == []
    assert result.query == OFF_TOPIC


async def test_an_off_topic_question_after_an_exchange_gets_an_honest_nothing(
    engine: Engine,
) -> None:
    results = await run_turns(
        engine, [("user", "How much does roaming cost in Europe?"), ("user", OFF_TOPIC)]
    )
    engine.end_session(SESSION)
    assert results[0].hits
    assert results[1].hits == []  # no chunk of the base holds "capital" or "France"


class FailingGraph:
    """A graph hnswlib cannot search: its RuntimeError, as one whose search stops short."""

    def knn_query(self, *args: Any, **kwargs: Any) -> Any:
        raise RuntimeError("Cannot return the results in a contiguous 2D array")


@pytest.mark.parametrize("hybrid", [False, True])
async def test_the_check_of_a_name_alone_turn_reads_the_turns_own_search(
    engine: Engine, monkeypatch: pytest.MonkeyPatch, hybrid: bool
) -> None:
    """The check of a name-alone turn by its own words reads the turn's own search, before
    min_score, on a dense base: a graph that fails after the turn's two searches changes
    nothing (it searched the graph a third time, repeating that search without the call's
    filters). A hybrid base's own search is fused, so the check makes a dense one; a graph
    that cannot answer it (GraphSearchFailed, attack 2's F9) skips the check, counted as every
    failed graph search, rather than failing the turn with the graph's error."""
    if hybrid:
        engine.hybrid_bases = frozenset(engine.known_bases)
    snapshot = engine.searcher(engine.default_knowledge_base).snapshot

    def name_alone(plan: Any, own: Any) -> bool:
        alone = checked(plan, own)
        if alone:  # the graph fails from here: after the turn's two searches
            monkeypatch.setattr(snapshot, "index", FailingGraph())
        return alone

    checked = engine_module._name_alone
    monkeypatch.setattr(engine_module, "_name_alone", name_alone)
    failures = engine.counters.graph_failures
    results = await run_turns(engine, [("user", "How do I set up voicemail?"), ("user", OFF_TOPIC)])
    assert engine.counters.graph_failures == failures + hybrid
    if hybrid:
        assert results[1].followup.used == "Voicemail"  # the folded answer, as before the check
        assert pages(results[1]) == {VOICEMAIL}
    else:
        assert results[1].hits == []  # checked: the honest nothing
