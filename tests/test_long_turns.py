"""A turn at the text cap (4,000 characters, ~600 words) plans with bounded work: names are
matched over its first and last ``NAMED_TOKENS`` tokens (``sidecar.turn.text``), so one such turn
no longer holds the event loop for a lookup per word; an ordinary turn is matched whole."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest

from index.embedders.base import FakeEmbedder
from sidecar.turn.followups import Gazetteer, Source
from sidecar.turn.sounds import SoundNames
from sidecar.turn.text import NAMED_TOKENS, Utterance
from tests.test_turns import BACKENDS
from tests.turns import run_turns

FILLER = " ".join(f"roaming{i}" for i in range(600))  # distinct words: no lookup is remembered


def test_an_ordinary_turn_is_matched_whole_and_a_long_one_by_its_two_ends() -> None:
    ordinary = Utterance.of(" ".join(f"word{i}" for i in range(2 * NAMED_TOKENS)))
    assert ordinary.named == ordinary.tokens
    long = Utterance.of(FILLER)
    assert long.named == long.tokens[:NAMED_TOKENS] + long.tokens[-NAMED_TOKENS:]


async def test_a_turn_at_the_text_cap_looks_names_up_in_a_bounded_number_of_words(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The gazetteer and the sound names see at most 2 * NAMED_TOKENS of a 3,999-character
    turn's tokens, whether the turn is the caller's or the agent's."""
    seen: list[int] = []

    def counted(find: Any) -> Any:
        def find_counted(self: Any, toks: Sequence[str], **how: Any) -> Any:
            seen.append(len(toks))
            return find(self, toks, **how)

        return find_counted

    monkeypatch.setattr(Gazetteer, "find", counted(Gazetteer.find))
    monkeypatch.setattr(SoundNames, "find", counted(SoundNames.find))
    turns = [("user", FILLER[:3999]), ("agent", FILLER[:3999]), ("user", f"{FILLER[:3900]} why?")]
    await run_turns(BACKENDS, turns, tmp_path, embedder=FakeEmbedder(dimension=1024))
    assert seen
    assert max(seen) <= 2 * NAMED_TOKENS


async def test_a_long_turn_ending_on_a_name_makes_it_the_topic(tmp_path: Path) -> None:
    """What a long turn ends on is matched: its follow-up leans on the page it named."""
    results = await run_turns(
        BACKENDS,
        [
            ("user", f"{FILLER[:3000]} so how do I set up Google Drive?"),
            ("user", "What about its upload limits?"),
        ],
        tmp_path,
        embedder=FakeEmbedder(dimension=1024),
    )
    assert results[1].followup.source == Source.ENTITY
    assert results[1].followup.used == "GOOGLE DRIVE"


def test_an_agent_answer_of_a_few_hundred_tokens_is_matched_whole() -> None:
    """A second attack: at 64 tokens an end, an agent's answer of ~200 tokens listing three
    options in its middle lost them, and "the second one" after it folded the padding."""
    padding = " ".join(f"pleasantry{i}" for i in range(110))
    answer = Utterance.of(f"{padding} I can help with voicemail, roaming, or passwords. {padding}")
    assert len(answer.tokens) > 200
    assert answer.named == answer.tokens
    assert "roaming" in answer.named
