from __future__ import annotations

from sidecar.turn import followups, prefetch, skip
from sidecar.turn.text import MAX_RUN_BYTES, Utterance, read, tokens, unended, words


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


def test_the_rules_memos_on_an_utterance_agree_with_the_text() -> None:
    """What the follow-up rules work out once per utterance is what they would from its text:
    its words without fillers, and whether its last sentence asks (one sentence or several)."""
    cases = {
        "Uh, is it quiet?": True,
        "um which one do you mean": True,
        "It is quiet. Uh, do you want the address": True,
        "Do you want the address. It is on Milton Road": False,
        "yes please": False,
        "": False,
    }
    for text, asks in cases.items():
        said = Utterance.of(text)
        assert followups.asks(said) is asks is followups.is_question(text)
        assert followups.asks(said) is asks  # the memo, read again
        spoken = followups._spoken(said)
        assert spoken == tuple(w for w in words(text) if w not in followups.FILLERS_EN)
        assert followups._spoken(said) is spoken


def test_an_agent_turn_keeps_whether_it_asks_for_the_callers_next_turns() -> None:
    from sidecar.turn.engine import Engine, Speaker
    from sidecar.turn.sessions import Session

    asking, telling = Session("a", 3), Session("b", 3)
    Engine._record(asking, Speaker.AGENT, Utterance.of("It is open. Shall I book it"), ())
    Engine._record(telling, Speaker.AGENT, Utterance.of("Shall I book it? It is booked."), ())
    assert asking.turns[-1].question is True
    assert telling.turns[-1].question is False
    assert followups.agent_question(asking) == "It is open. Shall I book it"
    assert followups.agent_question(telling) == ""
    Engine._record(asking, Speaker.USER, Utterance.of("yes"), ())
    assert asking.turns[-1].question is None  # a caller's turn is never asked about
    assert followups.agent_question(asking) == ""


def test_a_run_without_whitespace_is_read_up_to_its_first_max_run_bytes() -> None:
    """A turn at the text cap without whitespace (punctuation, one long token) is read as its
    head is: it was tokenized whole on the event loop, for what says nothing. The text stays
    whole; a run in the middle of a turn is cut alone, the words after it still read."""
    cap = 16 * 1024
    for run in ("a." * (cap // 2), "x" * cap, "&" * cap, "é" * (cap // 2), "Hobson's-" * 1820):
        head = run.encode()[:MAX_RUN_BYTES].decode("utf-8", "ignore")
        said, cut = Utterance.of(run), Utterance.of(head)
        assert (said.words, said.tokens, said.named) == (cut.words, cut.tokens, cut.named)
        assert said.text == run
        assert words(run) == words(head)  # a prefetch's and the skip policy's words too
    said = Utterance.of("the " + "!" * cap + " Hobson's House please")
    assert said.words[-3:] == ("hobson's", "house", "please")
    assert said.tokens == ("the", "hobsons", "house", "please")


def test_a_real_turn_is_read_whole() -> None:
    """Runs up to MAX_RUN_BYTES (a long URL) and a long turn of words are as they were."""
    url = "https://example.com/help/" + "a1-" * 300  # ~925 bytes, no whitespace
    assert len(url.encode()) <= MAX_RUN_BYTES
    text = "please open " + url + " and tell me " + "about the hotel " * 900
    assert read(text) is text
    said = Utterance.of(text)
    assert said.tokens == tuple(tokens(text))
    assert said.words[-3:] == ("about", "the", "hotel")


def test_a_long_run_with_a_lone_surrogate_is_read_as_any_other() -> None:
    """An in-process caller may hand a turn a lone surrogate (the network cannot: its decoders
    refuse one); the words were read before the cut at MAX_RUN_BYTES, so they are after it."""
    said = "x" * 2000 + "\ud800 and the rest"
    utterance = Utterance.of(said)
    assert utterance.words[-2:] == ("the", "rest")
    assert len(utterance.words[0]) == MAX_RUN_BYTES


def test_a_final_reads_as_its_interim_but_for_the_punctuation_it_ends_in() -> None:
    """What a recogniser adds to its final (a clause's end, space) is dropped; the rest,
    case and a word's own dot or sign among it, is the text as said."""
    assert unended("is this location quiet? ") == "is this location quiet"
    assert unended("What is conhost.exe?!") == "What is conhost.exe"
    assert unended("Is it quiet…") == unended("Is it quiet.") == "Is it quiet"
    assert unended("is it 50%?") == "is it 50%"
    assert unended("Tell me about Apple.") != unended("tell me about apple")
