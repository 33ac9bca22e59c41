from __future__ import annotations

from sidecar.turn import followups, prefetch, skip
from sidecar.turn.text import Utterance, tokens, words


def test_one_utterance_serves_every_stage() -> None:
    said = Utterance.of("Uh-huh, don’t book Hobson's B&B Café?")
    assert said.words == ("uh-huh", "don't", "book", "hobson's", "b", "b", "café")
    assert said.tokens == ("uh", "huh", "dont", "book", "hobsons", "b", "and", "b", "cafe")
    # the skip policy, the follow-up rules and a prefetch's comparison read the same words
    assert prefetch.normalise(said.text) == said.words
    assert skip.SkipPolicy().classify(said.text) is skip.SkipPolicy().classify_words(said.words)
    assert followups.Utterance is Utterance


def test_names_match_across_accents_apostrophes_and_ampersands() -> None:
    assert tokens("A & B Guest-House") == tokens("a and b guest house")
    assert tokens("Crêperie") == ["creperie"]
    assert words("THAT'S all") == ["that's", "all"]
