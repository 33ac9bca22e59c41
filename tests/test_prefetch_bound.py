"""The prefetch bound: one Converse stream starts at most PREFETCH_BURST searches ahead per
PREFETCH_BURST x ``prefetch_stable_ms``, however many interim transcripts it sends
(``sidecar.turn.prefetch``)."""

from __future__ import annotations

from pathlib import Path

from index.embedders.base import FakeEmbedder
from sidecar.turn.engine import Engine, TurnInput
from sidecar.turn.prefetch import PREFETCH_BURST, Prefetcher
from tests.conftest import eventually
from tests.test_turns import BACKENDS
from tests.turns import SESSION, build_engine

LONG_MS = 60_000  # a bound no test outlives: what it holds back is never started


def interim(text: str) -> TurnInput:
    return TurnInput(session_id=SESSION, text=text, is_final=False)


def engine_at(tmp_path: Path) -> Engine:
    return build_engine(BACKENDS, tmp_path, embedder=FakeEmbedder(dimension=1024))


async def test_a_flood_of_paused_interims_starts_a_burst_of_prefetches(tmp_path: Path) -> None:
    """200 interims of new words, each ending in "?" (each one "stable" at once), within one
    ``prefetch_stable_ms``: the first PREFETCH_BURST are searched ahead, the rest wait and are
    replaced, and each held back is counted."""
    engine = engine_at(tmp_path)
    prefetcher = Prefetcher(engine, stable_ms=LONG_MS)
    try:
        for i in range(200):
            prefetcher.interim(interim(f"how big can a pCloud file name be, number {i}?"))
        assert engine.counters.prefetch_started == PREFETCH_BURST
        assert engine.counters.prefetch_deferred == 200 - PREFETCH_BURST
    finally:
        await prefetcher.aclose()
        await engine.aclose()


async def test_the_last_paused_interim_held_back_is_searched_when_due(tmp_path: Path) -> None:
    """Paused interims past the burst in a row: the last waits out the bound, then is searched
    ahead, and its final is answered from that search: the stable clause a speaker ends on is
    not lost, only put off."""
    engine = engine_at(tmp_path)
    prefetcher = Prefetcher(engine, stable_ms=50)
    said = "What are the limits on file names in pCloud?"
    try:
        for i in range(PREFETCH_BURST):
            prefetcher.interim(interim(f"Tell me about Google Drive, part {i}."))
        prefetcher.interim(interim(said))
        assert engine.counters.prefetch_started == PREFETCH_BURST
        assert engine.counters.prefetch_deferred == 1
        await eventually(
            lambda: engine.counters.prefetch_started == PREFETCH_BURST + 1, "the held-back one"
        )
        result = await engine.turn(TurnInput(session_id=SESSION, text=said), prefetcher)
    finally:
        await prefetcher.aclose()
        await engine.aclose()
    assert result.prefetched
    assert result.query == said


async def test_words_that_change_without_a_pause_start_nothing(tmp_path: Path) -> None:
    """Interims whose words keep changing, none ending in a pause, are never stable: the
    bound's one waiting interim is replaced each time, and no prefetch starts."""
    engine = engine_at(tmp_path)
    prefetcher = Prefetcher(engine, stable_ms=LONG_MS)
    try:
        for i in range(50):
            prefetcher.interim(interim(f"how big can a pCloud file name be {i}"))
        assert engine.counters.prefetch_started == 0
        assert engine.counters.prefetch_deferred == 0
    finally:
        await prefetcher.aclose()
        await engine.aclose()


async def test_a_short_question_s_quick_interims_each_start_within_the_burst(
    tmp_path: Path,
) -> None:
    """A second attack: a four-word question's punctuated interims 150 ms apart with the final
    right after lost every prefetch to one start per ``prefetch_stable_ms`` (the first interim's
    words, three of four, do not match the final). Within the burst each starts at once, and the
    final is answered from the last."""
    engine = engine_at(tmp_path)
    prefetcher = Prefetcher(engine, stable_ms=LONG_MS)
    said = "pCloud file name limits?"
    try:
        prefetcher.interim(interim("pCloud file name?"))
        prefetcher.interim(interim(said))
        assert engine.counters.prefetch_started == 2
        assert engine.counters.prefetch_deferred == 0
        result = await engine.turn(TurnInput(session_id=SESSION, text=said), prefetcher)
    finally:
        await prefetcher.aclose()
        await engine.aclose()
    assert result.prefetched
