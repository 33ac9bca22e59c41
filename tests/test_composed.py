"""One embedding per turn: a follow-up's folded query vector composed from its parts' vectors.

``FakeEmbedder`` is ``MeanPooled`` with weights that make the composition exact (a bag of words
joined is the weighted sum of its parts), so a composed turn must answer exactly as the folded
text embedded would; the embedded model's closeness is measured in ``bench.composed_vectors``.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import pytest

from index.embedders.base import FakeEmbedder, MeanPooled, Vectors
from index.errors import EmbedderError
from sidecar.turn import composed
from sidecar.turn.engine import TurnInput
from sidecar.turn.sessions import Session, Speaker
from tests.conftest import eventually
from tests.turns import SESSION, Unpooled, build_engine, run_turns

BASE = {
    "GOOGLE DRIVE": ["To set up Google Drive, run rclone config and choose drive."],
    "FILTERING": ["Use --exclude to skip files matching a pattern when you transfer."],
    "SYNC": ["rclone sync makes the destination match the source, deleting extra files."],
}
FIRST = "How do I mirror a folder?"  # names no entity of BASE: a follow-up folds it in
FOLLOWUP = "and does it delete files"
QUESTION = "how can I skip files matching a pattern"  # after a named entity: folded and alone


class Picky(FakeEmbedder):
    """Fails every call holding one of ``refuse``; holds every call holding one of ``hold``
    until the test ends (a model stuck on one text)."""

    def __init__(self, *, refuse: Sequence[str] = (), hold: Sequence[str] = ()) -> None:
        super().__init__(dimension=1024)
        self.refuse, self.hold = set(refuse), set(hold)

    async def embed(self, texts: Sequence[str]) -> Vectors:
        if self.hold & set(texts):
            self.calls.append(tuple(texts))
            await asyncio.Event().wait()  # until cancelled
        if self.refuse & set(texts):
            self.calls.append(tuple(texts))
            raise EmbedderError("refused")
        return await super().embed(texts)


def test_the_fake_embedder_composes_exactly() -> None:
    fake = FakeEmbedder(dimension=256)
    assert isinstance(fake, MeanPooled)
    assert not isinstance(Unpooled(), MeanPooled)
    parts = ("HARBOR GRILL", "do they take reservations")
    vectors = fake.embed_batch(parts)
    made = composed.compose(list(vectors), [fake.weight(p) for p in parts])
    np.testing.assert_allclose(made, fake.embed_batch(["HARBOR GRILL: " + parts[1]])[0], atol=1e-6)


def test_pieces_of_each_fold() -> None:
    session = Session("s", context_turns=3)
    for speaker, text in [
        (Speaker.USER, "What does  sync do?"),
        (Speaker.AGENT, "It mirrors a folder."),
        (Speaker.AGENT, "Anything else?"),
        (Speaker.USER, "yes"),
    ]:
        session.record_turn(speaker, text)
    said = ("What does  sync do?", "It mirrors a folder.", "Anything else?")
    recent = "What does sync do? It mirrors a folder. Anything else? yes"
    # the recent turns, whitespace folded as followups joins them; the turn itself last
    assert composed.pieces(recent, "yes", session, most=3) == said
    assert composed.pieces(recent, "yes", session) is None  # more than MOST_PARTS
    assert composed.pieces("Anything else? yes", "yes", session) == ("Anything else?",)
    # an entity's name with the agent's question, and an entity's name alone
    with_question = "SYNC: It mirrors a folder. Anything else? yes"
    assert composed.pieces(with_question, "yes", session, most=3) == ("SYNC", *said[1:])
    assert composed.pieces("SYNC: yes", "yes", session) == ("SYNC",)
    # recent turns cut to the fold's word limit, or a text folded otherwise: not composed
    assert (
        composed.pieces("sync do? It mirrors a folder. Anything else? yes", "yes", session) is None
    )
    assert composed.pieces("yes", "yes", session) is None
    assert composed.pieces("about SYNC yes", "yes", session) is None


async def test_a_followup_costs_one_embedder_call_and_answers_as_the_folded_text(
    tmp_path: Path,
) -> None:
    turns = [("user", "Tell me about Google Drive."), ("user", QUESTION)]
    fake = FakeEmbedder(dimension=1024)
    unpooled = Unpooled()
    composed_results = await run_turns(BASE, turns, tmp_path / "a", embedder=fake)
    embedded_results = await run_turns(BASE, turns, tmp_path / "b", embedder=unpooled)
    question = QUESTION
    # the name was embedded when it became tracked, off the turn; the turn: itself alone
    assert fake.calls[1:] == [("GOOGLE DRIVE",), (question,)]
    assert unpooled.calls[1:] == [(f"GOOGLE DRIVE: {question}", question)]
    mine, theirs = composed_results[-1], embedded_results[-1]
    assert mine.query == theirs.query
    assert [h.chunk.chunk_id for h in mine.hits] == [h.chunk.chunk_id for h in theirs.hits]
    assert [h.score for h in mine.hits] == pytest.approx([h.score for h in theirs.hits], abs=1e-5)


async def test_recent_turns_fold_from_the_vectors_of_their_turns(tmp_path: Path) -> None:
    fake = FakeEmbedder(dimension=1024)
    results = await run_turns(BASE, [("user", FIRST), ("user", FOLLOWUP)], tmp_path, embedder=fake)
    assert results[-1].followup.used == FIRST  # folded with the recent turn
    assert fake.calls == [(FIRST,), (FOLLOWUP,)]


async def test_a_part_cut_to_the_word_limit_embeds_the_folded_text(tmp_path: Path) -> None:
    fake = FakeEmbedder(dimension=1024)
    long = "How do I mirror a folder " + " ".join(f"word{i}" for i in range(80)) + "?"
    results = await run_turns(BASE, [("user", long), ("user", FOLLOWUP)], tmp_path, embedder=fake)
    assert results[-1].followup.used  # folded with the end of the long turn
    folded, alone = fake.calls[-1]  # the folded text and the turn, in one call
    assert alone == FOLLOWUP
    assert folded == f"{results[-1].followup.used} {FOLLOWUP}"


async def test_a_fold_of_several_parts_embeds_the_folded_text(tmp_path: Path) -> None:
    said = "It copies the files and deletes the extra ones."
    fake = FakeEmbedder(dimension=1024)
    engine = build_engine(BASE, tmp_path, embedder=fake)
    try:
        await run_turns(engine, [("user", FIRST), ("agent", said)])
        await eventually(lambda: fake.calls[-1] == (said,), "the agent turn's embedding")
        results = await run_turns(engine, [("user", FOLLOWUP)])
    finally:
        await engine.aclose()
    assert results[-1].followup.used == f"{FIRST} {said}"
    # the caller's turn and the agent's: more than MOST_PARTS, so not composed
    assert fake.calls[-1] == (f"{FIRST} {said} {FOLLOWUP}", FOLLOWUP)


async def test_a_part_that_failed_embeds_the_folded_text(tmp_path: Path) -> None:
    picky = Picky(refuse=["GOOGLE DRIVE"])
    engine = build_engine(BASE, tmp_path, embedder=picky)
    try:
        await run_turns(engine, [("user", "Tell me about Google Drive.")])
        await eventually(lambda: not engine._reading, "the name's embedding")
        results = await run_turns(engine, [("user", QUESTION)])
    finally:
        await engine.aclose()
    assert not results[-1].degraded
    assert picky.calls[-1] == (f"GOOGLE DRIVE: {QUESTION}", QUESTION)


async def test_a_part_still_embedding_never_holds_the_turn_past_its_budget(tmp_path: Path) -> None:
    picky = Picky(hold=["GOOGLE DRIVE"])
    engine = build_engine(BASE, tmp_path, embedder=picky, budget_ms=300)
    try:
        await run_turns(engine, [("user", "Tell me about Google Drive.")])
        request = TurnInput(session_id=SESSION, text=QUESTION)
        result = await asyncio.wait_for(engine.turn(request), 10)  # the name never finishes
    finally:
        await engine.aclose()
    assert (QUESTION,) in picky.calls  # the turn itself was embedded beside the stuck name
    assert result.degraded  # the folded query: lexically, within the budget
    assert result.hits


async def test_an_embedder_that_is_not_mean_pooled_embeds_both(tmp_path: Path) -> None:
    embedder = Unpooled()
    await run_turns(BASE, [("user", FIRST), ("user", FOLLOWUP)], tmp_path, embedder=embedder)
    assert embedder.calls[-1] == (f"{FIRST} {FOLLOWUP}", FOLLOWUP)
