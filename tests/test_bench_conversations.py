"""The conversation sets of issue 12 and their harness (``bench.quality_conversations``).

The spoken transformation is tested on invented turns (no shared data); the harness runs on tiny
slices of the real sets through a real engine when ``../shared/data`` is present. No figure is
asserted, only that every judged turn is scored and every mode measured the same way.
"""

from __future__ import annotations

import json
import random
import re
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest

from bench import (
    asr,
    conversations,
    doc2dial_halves,
    quality_conversations,
    quality_turns,
    spoken,
    topics,
)
from bench.conversations import (
    ConversationSet,
    Dialogue,
    Said,
    after_agent_question,
    first_after_switch,
)
from bench.quality_conversations import eval_config, measure, served
from index.embedders.base import Embedder
from index.types import Chunk
from sidecar.config import Config
from sidecar.turn.engine import Speaker
from tests.conftest import SHARED_DATA, shared

WRITTEN = [
    "I'm looking for the Alexander Lodge, it's at 365 Milton Road, CB4 1SR.",
    "Can I book it for 2 people at 5:30pm on the 3rd? It costs £12.50 a night, right?",
    "Their number is 01223 425478 & they're 100% booked on Friday.",
    "What's the Wi-Fi like at Cityroomz? Is it 4.5 stars?",
    "Is the guesthouse near the Alexander Lodge quiet?",
    "Ok, thank you.",
]
VOCABULARY = [
    *WRITTEN,
    "I want a guest house in the north. A guest house with parking.",
    "The guesthouse has city rooms and a city view. The rooms are city rooms.",
    "There are rooms at the Alexander Lodge and rooms at Cityroomz; the rooms are clean.",
    "The city centre has a guest house, another guest house, and a guesthouse.",
]


def test_numbers_are_spoken_as_words() -> None:
    said = spoken.numbers_spoken
    assert spoken.number_words(0) == "zero"
    assert spoken.number_words(1205) == "one thousand two hundred five"
    assert spoken.ordinal_words(21) == "twenty first"
    assert spoken.ordinal_words(40) == "fortieth"
    assert said("£12.50").split() == ["twelve", "pounds", "fifty"]
    assert said("at 5:30pm").split() == ["at", "five", "thirty", "p", "m"]
    assert said("at 17:00").split() == ["at", "seventeen", "hundred"]
    assert said("01223 425478").split()[:5] == ["zero", "one", "two", "two", "three"]
    assert said("CB4 1SR").split() == ["c", "b", "four", "one", "s", "r"]
    assert said("the 3rd").split() == ["the", "third"]
    assert said("4.5 stars").split() == ["four", "point", "five", "stars"]
    assert said("1,200 rooms").split() == ["one", "thousand", "two", "hundred", "rooms"]


def test_phonetic_code_groups_sound_alikes() -> None:
    assert spoken.phonetic("roomz") == spoken.phonetic("rooms")
    assert spoken.phonetic("phone") == spoken.phonetic("fone")
    assert spoken.phonetic("knight") == spoken.phonetic("nite")
    assert spoken.phonetic("lodge") != spoken.phonetic("house")


def test_transcripts_are_lower_case_words_without_digits_or_punctuation() -> None:
    speech = spoken.Speech(VOCABULARY)
    for i, text in enumerate(WRITTEN * 20):
        heard = speech.transcribe(text, spoken.turn_rng("d", i))
        assert heard == heard.lower()
        assert not re.search(r"\d", heard), heard
        assert re.fullmatch(r"[a-z' ]+", heard), heard
        assert heard.split() == heard.split(" ")  # one space between words, none around


def test_transcripts_are_seeded_per_dialogue_and_turn() -> None:
    speech = spoken.Speech(VOCABULARY)
    text = WRITTEN[0]
    again = spoken.Speech(VOCABULARY)
    assert speech.transcribe(text, spoken.turn_rng("d1", 3)) == again.transcribe(
        text, spoken.turn_rng("d1", 3)
    )
    draws = {speech.transcribe(text, spoken.turn_rng(f"d{i}", 3)) for i in range(40)}
    assert len(draws) > 1  # another dialogue draws other errors


def test_another_draw_of_the_spoken_set_is_another_seed_and_harsher_rates(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    for name in ("SEED", "NAME_ERROR_RATE", "FILLER_RATE"):
        monkeypatch.setattr(spoken, name, getattr(spoken, name))  # restored after the test
    speech = spoken.Speech(VOCABULARY)
    first = [speech.transcribe(WRITTEN[0], spoken.turn_rng("d", i)) for i in range(40)]
    spoken.redraw("another-seed,1.0,1.0")
    assert (spoken.SEED, spoken.NAME_ERROR_RATE, spoken.FILLER_RATE) == ("another-seed", 1.0, 1.0)
    heard = [speech.transcribe(WRITTEN[0], spoken.turn_rng("d", i)) for i in range(40)]
    assert heard != first
    assert all({"uh", "um", "umm"} & set(h.split()) for h in heard)  # a filler in every turn
    assert all("alexander" not in h.split() for h in heard)  # the name always misheard
    with pytest.raises(ValueError, match="SEED"):
        spoken.redraw("seed,1.5")


def test_transcripts_have_fillers_restarts_and_misheard_names() -> None:
    speech = spoken.Speech(VOCABULARY)
    heard = [speech.transcribe(WRITTEN[0], spoken.turn_rng("d", i)) for i in range(200)]
    plain = " ".join(spoken.words_of(WRITTEN[0]))
    assert any({"uh", "um", "umm"} & set(h.split()) for h in heard)
    assert any(
        h.startswith("i'm looking i'm looking") or h.startswith("i'm looking for i'm")
        for h in heard
    )
    assert any("alexander" not in h.split() for h in heard)  # the name misheard
    assert sum(h == plain for h in heard) > 20  # and many turns heard exactly
    # compounds the set writes both ways are heard either way
    compounds = [speech.transcribe(WRITTEN[4], spoken.turn_rng("c", i)) for i in range(60)]
    assert any("guest house" in c for c in compounds)
    assert speech._split("cityroomz") == "city rooms"


def test_spoken_set_transcribes_user_turns_only() -> None:
    dialogue = Dialogue(
        "d1",
        (
            Said(Speaker.USER, "Do you know the Alexander Lodge?"),
            Said(Speaker.AGENT, "Yes, the Alexander Lodge is at 365 Milton Road. Anything else?"),
            Said(Speaker.USER, "Is it quiet at 11pm?", "q1"),
        ),
    )
    cs = ConversationSet(
        "toy", "kb", [dialogue], {"q1": frozenset({"x"})}, {"q1": "Alexander Lodge"}, "gold_entity",
        store=lambda e: Path("."),
    )  # fmt: skip
    out = spoken.spoken(cs)
    assert out.name == "toy-spoken"
    turns = out.dialogues[0].turns
    assert turns[1] == dialogue.turns[1]  # the agent's own text, as written
    assert turns[2].qid == "q1"
    assert not re.search(r"\d", turns[2].text)
    assert "eleven" in turns[2].text.split()
    assert after_agent_question(turns, 2)
    assert not after_agent_question(turns, 1)


def test_a_switched_set_asks_each_dialogue_after_another_conversation_about_something_else() -> (
    None
):
    def dialogue(name: str, opener: str, qid: str) -> Dialogue:
        return Dialogue(
            name,
            (
                Said(Speaker.USER, opener),
                Said(Speaker.AGENT, f"Here is what {name} says. Anything else?"),
                Said(Speaker.USER, f"And {name} again?", qid),
            ),
        )

    a, b = (
        dialogue("a", "Tell me about roaming", "qa"),
        dialogue("b", "Tell me about voicemail", "qb"),
    )
    b2 = dialogue("b2", "Tell me about voicemail", "qb2")  # the same conversation cut elsewhere
    c = dialogue("c", "Tell me about roaming prices", "qc")  # another conversation, a's page
    gold = {"qa": "Roaming", "qb": "Voicemail", "qb2": "Voicemail", "qc": "Roaming"}
    cs = ConversationSet(
        "toy", "kb", [a, b, b2, c], {q: frozenset({q}) for q in gold}, gold, "gold_title",
        store=lambda e: Path("."),
    )  # fmt: skip
    out = conversations.switched(cs, "toy-switch")
    assert out.name == "toy-switch"
    assert out.qrels == cs.qrels
    assert out.gold == cs.gold
    assert out.judged == cs.judged  # the same judged turns, and no others
    first, second, third, fourth = out.dialogues
    # wrapping round: c is about a's page, so b2 before it
    assert first.turns == (*[Said(t.speaker, t.text) for t in b2.turns], *a.turns)
    assert second.turns == (*[Said(t.speaker, t.text) for t in a.turns], *b.turns)
    # b (the same conversation) is passed over for a, the nearest about something else
    assert third.turns == (*[Said(t.speaker, t.text) for t in a.turns], *b2.turns)
    assert fourth.turns == (*[Said(t.speaker, t.text) for t in b2.turns], *c.turns)
    assert [d.dialogue_id for d in out.dialogues] == ["a", "b", "b2", "c"]
    assert [d.opens for d in out.dialogues] == [len(b2.turns), len(a.turns), len(a.turns), 3]
    # the caller's first turn of its own conversation, and no other, follows the switch
    opens = first.opens
    firsts = [i for i in range(len(first.turns)) if first_after_switch(first, i)]
    assert firsts == [opens]
    assert not any(first_after_switch(d, i) for d in cs.dialogues for i in range(len(d.turns)))


# -- the harness on the real sets (skipped without ../shared/data) --------------------------------


@pytest.fixture
def tmp_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setattr(quality_turns, "CACHE", tmp_path / "cache")
    return tmp_path / "cache"


def _check_modes(row: dict[str, Any], ceiling: str) -> None:
    n = row["session"]["turns"]
    assert n > 0
    for mode in ("session", "last_turn", "joined3", ceiling):
        assert row[mode]["turns"] == n
        assert 0.0 <= row[mode]["hit_at_3"] <= 1.0
        assert 0.0 <= row[mode]["mrr_at_10"] <= 1.0
    best = max(row["last_turn"]["hit_at_3"], row["joined3"]["hit_at_3"])
    assert row["best_naive"]["hit_at_3"] == best
    assert row["session_minus_best_naive"]["hit_at_3"] == round(
        row["session"]["hit_at_3"] - best, 4
    )
    assert row["session"]["degraded"] == 0  # the budget is large: the embedder never misses
    assert row["after_agent_question"]["session"]["turns"] <= n
    # the per-turn records add up to the figures
    assert len(row["per_turn"]) == n
    for mode in ("session", "last_turn", "joined3", ceiling):
        hits = sum(t["hit_at_3"][mode] for t in row["per_turn"])
        assert row[mode]["hit_at_3"] == round(hits / n, 4)
    assert 0.0 <= row["session"]["gold_top1"] <= 1.0


async def test_harness_scores_every_judged_turn_of_each_set(
    tmp_cache: Path, local_embedder: Embedder
) -> None:
    shared("doc2dial-dev")
    shared("dstc11-faq-reviews")
    result = await measure(
        SHARED_DATA,
        sets=("dstc11", "dstc11-spoken", "doc2dial", "doc2dial-switch"),
        tiny=True,
        embedder=local_embedder,
        per_turn=True,
    )
    sets = result["sets"]
    _check_modes(sets["doc2dial-switch"], "gold_title")
    switch = sets["doc2dial-switch"]["first_after_switch"]
    assert 0 < switch["session"]["turns"] <= 4  # at most one a dialogue, when it is judged
    assert result["table"]["doc2dial-switch"]["switch_turns"] == switch["session"]["turns"]
    assert "first_after_switch" not in sets["doc2dial"]
    del result["table"]["doc2dial-switch"]
    _check_modes(sets["dstc11"], "gold_entity")
    _check_modes(sets["dstc11-spoken"], "gold_entity")
    _check_modes(sets["doc2dial"], "gold_title")
    assert sets["dstc11"]["session"]["turns"] == sets["dstc11-spoken"]["session"]["turns"]
    # the tiny DSTC11 base holds one entity, the gold one: every answer's top-1 is about it
    answered = [t for t in sets["dstc11"]["per_turn"] if t["top1_about"]]
    assert len({t["top1_about"] for t in answered}) == 1
    n = sets["dstc11"]["session"]["turns"]
    assert sets["dstc11"]["session"]["gold_top1"] == round(len(answered) / n, 4)
    # four dialogues, three judged turns each, some right after an agent's question
    assert sets["doc2dial"]["session"]["turns"] == 12
    assert sets["doc2dial"]["after_agent_question"]["session"]["turns"] > 0
    assert set(result["table"]) == {"dstc11", "dstc11-spoken", "doc2dial"}
    assert result["table"]["doc2dial"]["turns"] == 12
    assert [p.name for p in tmp_cache.iterdir() if p.name.startswith("doc2dial-")]  # noqa: ASYNC240


async def test_engine_variants_are_measured_without_rebuilding(
    tmp_cache: Path, local_embedder: Embedder
) -> None:
    shared("doc2dial-dev")
    first = await measure(SHARED_DATA, sets=("doc2dial",), tiny=True, embedder=local_embedder)
    built = sorted(tmp_cache.glob("*/store/**/*"))  # noqa: ASYNC240 (a test, a small folder)
    off = await measure(
        SHARED_DATA,
        sets=("doc2dial",),
        tiny=True,
        embedder=local_embedder,
        sidecar={"followups": {"enabled": False}},
    )
    again = sorted(tmp_cache.glob("*/store/**/*"))  # noqa: ASYNC240
    assert again == built  # the cached snapshot served both
    for mode in ("last_turn", "joined3", "gold_title"):  # Search ignores the follow-up settings
        assert off["sets"]["doc2dial"][mode] == first["sets"]["doc2dial"][mode]
    # the variant took effect: with follow-ups off no Turn searched anything but what was said
    assert first["sets"]["doc2dial"]["examples"]
    assert off["sets"]["doc2dial"]["examples"] == []


def test_the_command_line_sets_fold_and_min_score_over_the_evaluation_config(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """``--fold referring`` measures that setting (docs/config.md's ``fold`` figures), beside
    ``--min-score``; without either, the evaluation config is left as it is."""
    given: list[dict[str, Any] | None] = []

    async def run(*args: Any) -> dict[str, Any]:
        given.append(args[5])
        return {"skipped": "the engine is not what is tested"}

    monkeypatch.setattr(quality_conversations, "_run_cached", run)
    data = ["--data", str(tmp_path)]
    assert quality_conversations.main([*data, "--fold", "referring", "--min-score", "0.3"]) == 0
    assert quality_conversations.main(data) == 0
    assert given == [{"min_score": 0.3, "followups": {"fold": "referring"}}, None]
    with pytest.raises(SystemExit):
        quality_conversations.main([*data, "--fold", "never"])


async def test_topic_sessions_compare_each_question_with_itself_alone(
    wt_config: Config, local_embedder: Embedder
) -> None:
    folder = shared("docs-windows-terminal")
    store = wt_config.index.store
    async with served(eval_config(store), local_embedder) as engine:
        result = await topics.topic_quality("docs", folder, engine, per_turn=True)
    questions = topics.faq_questions(folder)
    assert result["faq_questions"] == len(questions)
    assert result["followups"] == len(result["pairs"]) > 0
    assert result["standalone_turns"] == len(questions) + result["followups"]
    assert 0.0 <= result["standalone_same_top1"] <= 1.0
    # every turn listed; the stand-alone ones say whether they kept their top-1 alone
    rows = result["per_turn"]
    assert len(rows) == result["standalone_turns"] + result["followups"]
    alone = [row for row in rows if row["kind"] != "followup"]
    kept = sum(row["same_top1"] for row in alone) / len(alone)
    assert round(kept, 4) == result["standalone_same_top1"]
    for pair in result["pairs"]:
        assert pair["followup"].endswith(" for it?")
        assert pair["opener"].startswith("Tell me about ")


def test_topic_sessions_keep_pairs_together_and_are_seeded() -> None:
    pairs = [
        topics.Asked("opener", f"Tell me about P{i}.", f"p{i}.md") if j == 0
        else topics.Asked("followup", f"What about x for it? {i}", f"p{i}.md", f"Tell me about P{i}.")
        for i in range(4) for j in range(2)
    ]  # fmt: skip
    questions = [f"question {i}?" for i in range(12)]
    a = topics.sessions(questions, pairs, random.Random("s"))
    b = topics.sessions(questions, pairs, random.Random("s"))
    assert a == b
    flat = [t for s in a for t in s]
    assert sorted(t.text for t in flat) == sorted([*questions, *(p.text for p in pairs)])
    for run in a:
        assert len(run) <= topics.SESSION_TURNS
        for i, t in enumerate(run):
            if t.kind == "followup":
                assert i > 0
                assert run[i - 1].text == t.opener


def test_topic_sessions_said_aloud_are_seeded_transcripts_with_their_openers() -> None:
    """The second topic draw: every turn as a caller says it, the same on every run, a
    follow-up's opener the words its session heard, kinds and pages kept."""
    runs = [
        [
            topics.Asked("faq", "Where is settings.json kept, and can I edit it?"),
            topics.Asked("opener", "Tell me about Shell Integration.", "shell.md"),
            topics.Asked("followup", "What about limitations for it?", "shell.md", "x"),
        ],
        [topics.Asked("faq", "How do I open 2 tabs at once?")],
    ]
    vocabulary = ["Shell integration marks prompts.", "Open tabs with ctrl+t."]
    a = topics.said_aloud(runs, vocabulary, "seed", "docs")
    assert a == topics.said_aloud(runs, vocabulary, "seed", "docs")
    assert [[t.kind for t in run] for run in a] == [[t.kind for t in run] for run in runs]
    assert [[t.page for t in run] for run in a] == [[t.page for t in run] for run in runs]
    for run in a:
        for t in run:
            assert t.text == t.text.lower()
            assert not any(c in t.text for c in "?.,")
            assert not any(c.isdigit() for c in t.text)
    assert "dot json" in a[0][0].text  # a file name's dot is said
    assert a[0][2].opener == a[0][1].text  # the follow-up's opener as heard in its session
    assert "two" in a[1][0].text.split()


def test_a_name_is_heard_the_same_way_through_a_dialogue() -> None:
    speech = spoken.Speech(VOCABULARY)
    texts = [
        f"Is the Alexander Lodge {what}?"
        for what in ("quiet", "clean", "near the centre", "open late", "cheap")
    ]
    forms = set()
    for n in range(40):
        heard: dict[str, str] = {}
        said = [
            speech.transcribe(t, spoken.turn_rng(f"d{n}", i), heard) for i, t in enumerate(texts)
        ]
        form = heard["alexander"]
        for text in said:  # every mention heard alike, fillers aside
            assert f"{form} lodge" in " ".join(w for w in text.split() if w not in spoken.FILLERS)
        forms.add(form)
    assert "alexander" in forms
    assert len(forms) > 1  # other dialogues hear it otherwise


def _chunk(page: str, title: str, *headings: str) -> Chunk:
    crumbs = (title, *headings)
    return Chunk(
        chunk_id=f"{page}-{len(headings)}-{'-'.join(headings)}",
        source="docs",
        source_path=page,
        title=title,
        breadcrumbs=crumbs,
        text="body",
        embed_text=" > ".join(crumbs) + "\n\nbody",
    )


def test_followups_ask_for_a_heading_that_several_pages_share() -> None:
    chunks = [
        _chunk("drive.md", "Google Drive", "Limitations"),
        _chunk("drive.md", "Google Drive", "Making your own client_id"),  # markup: never asked
        _chunk("drive.md", "Google Drive", "Shared drives"),  # only this page: not ambiguous
        _chunk("s3.md", "Amazon S3", "Limitations"),
        _chunk("s3.md", "Amazon S3", "See Also"),  # navigation: never asked
        _chunk("b2.md", "Backblaze B2", "See Also"),
        _chunk("one.md", "Same title", "Limitations"),  # a title two pages share: never opened
        _chunk("two.md", "Same title", "Limitations"),
    ]
    snapshot: Any = SimpleNamespace(chunks=chunks)
    pairs = topics.followup_pairs(snapshot, 10, random.Random("t"))
    openers = {p.text: p.page for p in pairs if p.kind == "opener"}
    assert openers == {
        "Tell me about Google Drive.": "drive.md",
        "Tell me about Amazon S3.": "s3.md",
    }
    for opener, followup in zip(pairs[::2], pairs[1::2], strict=True):
        assert followup.text == "What about limitations for it?"
        assert (followup.page, followup.opener) == (opener.page, opener.text)
    assert len(topics.followup_pairs(snapshot, 1, random.Random("t"))) == 2  # one pair


def test_doc2dial_halves_score_the_first_and_last_half_of_the_dialogues_apart() -> None:
    """A judged turn's qid is its dialogue's id and its turn's: each half is scored on its own
    dialogues, in the order the set lists them."""
    per_turn = [
        {"qid": qid, "hit_at_3": {"session": hit, "joined3": False}}
        for qid, hit in (("d_1_4", True), ("d_1_6", False), ("d2_3", True), ("d3_2", False))
    ]
    first, last = doc2dial_halves.halves(per_turn, ["d_1", "d2", "d3", "d4"])
    assert first == {"turns": 3, "session": 0.6667, "joined3": 0.0}
    assert last == {"turns": 1, "session": 0.0, "joined3": 0.0}


def test_a_dstc11_gold_entity_tie_goes_the_same_way_whatever_the_order() -> None:
    """One relevant snippet about each of two entities: the gold one is the first name, not the
    one the set's iteration order (which follows PYTHONHASHSEED) met first; a majority wins."""
    entity = {"z1": "Zedd Hotel", "z2": "Zedd Hotel", "a1": "Acorn House"}
    for order in (["z1", "a1"], ["a1", "z1"]):
        data = quality_turns.Dstc([], [], {"tie": dict.fromkeys(order)}, entity)  # type: ignore[dict-item]
        assert data.gold_entity("tie") == "Acorn House"
    data = quality_turns.Dstc([], [], {"most": {"a1", "z1", "z2"}}, entity)
    assert data.gold_entity("most") == "Zedd Hotel"


# -- the second recogniser (bench.asr) ------------------------------------------------------------


def test_second_recogniser_says_numbers_as_callers_do() -> None:
    said = asr.numbers_said
    assert said("at 5:30pm").split() == ["at", "half", "past", "five"]
    assert said("at 17:00").split() == ["at", "five", "o'clock"]
    assert said("by 6:45").split() == ["by", "quarter", "to", "seven"]
    assert said("£12.50 a night").split() == ["twelve", "fifty", "a", "night"]
    assert said("01223 425478").split()[:6] == ["oh", "one", "double", "two", "three", "four"]
    assert said("CB4 1SR").split() == ["c", "b", "four", "one", "s", "r"]  # as bench.spoken


def test_second_recogniser_hears_by_manner_of_sound_not_by_a_sound_key() -> None:
    assert asr.coarse("lovell") == asr.coarse("level")  # l/v/l: place and voicing lost
    assert asr.coarse("milton") == asr.coarse("molten")
    assert asr.coarse("lodge") != asr.coarse("house")
    assert asr._pieces("milton") == ("mil", "ton")  # a consonant cluster shared


def _second_draws(text: str, n: int = 200, vocabulary: list[str] = VOCABULARY) -> list[str]:
    recogniser = asr.Recogniser(vocabulary)
    return [recogniser.transcribe(text, spoken.turn_rng("d", i, asr.SEED)) for i in range(n)]


def test_both_transformations_draw_a_turn_from_one_seeded_stream_under_their_own_seeds() -> None:
    """One ``turn_rng`` (``bench.spoken``'s) for both: each set's draws as they were."""
    for seed in (spoken.SEED, asr.SEED):
        want = random.Random(f"{seed}\x00d1\x003").random()
        assert spoken.turn_rng("d1", 3, seed).random() == want
    assert spoken.turn_rng("d1", 3).random() == random.Random(f"{spoken.SEED}\x00d1\x003").random()
    assert not hasattr(asr, "turn_rng")


def test_second_recogniser_is_seeded_per_dialogue_and_turn(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("SEED", "RARE_ERROR", "SIDES"):
        monkeypatch.setattr(asr, name, getattr(asr, name))  # restored after the test
    text = WRITTEN[0]
    first = asr.Recogniser(VOCABULARY).transcribe(text, spoken.turn_rng("d1", 3, asr.SEED))
    assert asr.Recogniser(VOCABULARY).transcribe(text, spoken.turn_rng("d1", 3, asr.SEED)) == first
    assert len(set(_second_draws(text, 40))) > 1  # other turns draw other errors
    before = _second_draws(text, 40)
    asr.redraw(f"{asr.PREFIX}other")
    assert _second_draws(text, 40) != before
    asr.redraw(f"{asr.PREFIX}other,1.0,caller")
    assert (asr.RARE_ERROR, asr.SIDES) == (1.0, "caller")
    for spec in ("voxrecall-spoken-3", f"{asr.PREFIX}1,1.5", f"{asr.PREFIX}1,0.5,agent"):
        with pytest.raises(ValueError, match=asr.PREFIX):
            asr.redraw(spec)


def test_second_recogniser_transcripts_are_lower_case_words() -> None:
    for heard in _second_draws(WRITTEN[1]) + _second_draws(WRITTEN[2]):
        assert re.fullmatch(r"[a-z' ]+", heard), heard
        assert heard.split() == heard.split(" ")


def test_second_recogniser_forms() -> None:
    """Each documented form turns up in a few hundred draws of one turn, and most words are
    still heard right."""
    text = "I'm looking for the Alexander Lodge at Cityroomz, it has a view of the river."
    heard = _second_draws(text, 400)
    plain = " ".join(spoken.words_of(text))
    assert any(
        h.startswith(("yeah so", "okay um", "hmm", "so ", "right", "okay so")) for h in heard
    )
    assert any("a l e x a n d e r" in h for h in heard)  # a name spelled after it
    assert any("thealexander" in h or "atcityroomz" in h for h in heard)  # run into "the"
    assert any("alexander" not in h.split() and "alexander" not in h for h in heard)
    assert any(len(h.split()) < len(plain.split()) and h.split()[-1] != "river" for h in heard)
    assert any(" the " not in f" {h} " for h in heard)  # a short function word dropped
    assert sum("lodge" in h.split() for h in heard) > 300  # a word said often is heard right


def test_second_recogniser_hears_rare_words_worst() -> None:
    recogniser = asr.Recogniser(VOCABULARY)
    assert recogniser.error_rate("cityroomz") > recogniser.error_rate("rooms") > 0
    assert recogniser.error_rate("the") == recogniser.error_rate("two") == 0.0


def test_second_recogniser_transcribes_both_sides_each_heard_alike_through_a_call(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    named = "Is the Alexander Lodge near Cityroomz?"
    dialogue = Dialogue(
        "d1",
        (
            Said(Speaker.USER, "Do you know the Alexander Lodge?"),
            Said(Speaker.AGENT, "Yes, the Alexander Lodge is at 365 Milton Road. Anything else?"),
            *(Said(Speaker.USER, named, f"q{i}") for i in range(30)),
        ),
    )
    cs = ConversationSet(
        "toy", "kb", [dialogue], {"q1": frozenset({"x"})}, {"q1": "Alexander Lodge"}, "gold_entity",
        store=lambda e: Path("."),
    )  # fmt: skip
    out = asr.recognised(cs)
    turns = out.dialogues[0].turns
    assert out.name == "toy-spoken"
    assert "?" not in turns[1].text  # the agent recognised too
    assert "three hundred" in turns[1].text
    assert [t.qid for t in turns] == [t.qid for t in dialogue.turns]
    sound_alike = asr.Recogniser(t.text for t in dialogue.turns).sound_alike
    for t in turns[2:]:  # a sound-alike once heard for the caller stays so for the caller
        words = t.text.split()
        assert not ("cityroomz" in words and sound_alike("cityroomz") in words)
    monkeypatch.setattr(asr, "SIDES", "caller")
    caller_only = asr.recognised(cs).dialogues[0].turns
    assert caller_only[1] == dialogue.turns[1]  # the agent as written, as bench.spoken has it
    assert caller_only[2:] == turns[2:]  # the caller heard alike either way


def test_spoken_flag_picks_the_second_recogniser(monkeypatch: pytest.MonkeyPatch) -> None:
    from bench import quality_conversations as qc

    monkeypatch.setattr(asr, "SEED", asr.SEED)
    monkeypatch.setitem(qc.DIALOGUE_SETS, "dstc11-spoken", qc.DIALOGUE_SETS["dstc11-spoken"])
    qc.redraw_spoken(f"{asr.PREFIX}7")
    assert f"{asr.PREFIX}7" == asr.SEED
    assert qc.DIALOGUE_SETS["dstc11-spoken"] is qc.dstc11_recognised


def test_spoken_misses_classes_a_missed_turn_by_where_the_gold_name_was_heard() -> None:
    from bench import spoken_misses

    turns = (
        Said(Speaker.USER, "a cheap hotel in the north"),
        Said(Speaker.AGENT, "the alexander lodge is cheap would you like to book"),
        Said(Speaker.USER, "do they have parking", "q1"),
    )
    d = Dialogue("d1", turns)
    row = {"top1_about": "CITYROOMZ", "hit_at_3": {"session": False, "gold_entity": True}}
    assert (
        spoken_misses.miss_class(d, 2, "ALEXANDER LODGE", row)
        == "gold named as heard (agent), lost; ceiling hit"
    )
    assert (
        spoken_misses.miss_class(d, 2, "LOVELL LODGE", row) == "gold never heard whole; ceiling hit"
    )
    on_gold = {**row, "top1_about": "LOVELL LODGE", "hit_at_3": {"gold_entity": False}}
    assert (
        spoken_misses.miss_class(d, 2, "LOVELL LODGE", on_gold)
        == "gold top-1, chunk missed; ceiling missed"
    )


class _WordVectors(Embedder):
    """A unit test's embedder: a text's vector is its content words' one-hot sum, normalised."""

    def __init__(self, vocabulary: list[str]) -> None:
        self.words = sorted({w for text in vocabulary for w in quality_turns.content_words(text)})

    @property
    def dim(self) -> int:
        return len(self.words)

    def embed_batch(self, texts: list[str]) -> Any:
        rows = np.zeros((len(texts), self.dim), dtype=np.float32)
        for row, text in zip(rows, texts, strict=True):
            for word in quality_turns.content_words(text):
                row[self.words.index(word)] = 1.0
        return rows / np.maximum(np.linalg.norm(rows, axis=1, keepdims=True), 1e-9)


def test_cast_judges_the_session_against_the_better_of_both_naive_baselines(
    tmp_path: Path,
) -> None:
    from bench.quality_conversations import cast_row

    rows = [
        {"raw": "Is it treatable?", "manual_rewrite": "Is throat cancer treatable?",
         "history": ["What is throat cancer?", "Tell me about lung cancer symptoms today."]},
    ]  # fmt: skip
    path = tmp_path / "followup_turns.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    texts = [t for r in rows for t in (r["raw"], r["manual_rewrite"], *r["history"])]
    result = quality_turns.cast_quality(path, _WordVectors(texts), quick=False)
    joined = result["joined3"]
    # the joined query holds every rewrite word and much else: full recall, low precision
    assert joined["content_recall"] == 1.0
    assert joined["content_precision"] < result["raw_turn"]["content_precision"]
    row = cast_row(result)
    best = max(row["raw_cosine"], row["joined3_cosine"])
    assert row["cosine_gain"] == round(row["session_cosine"] - best, 4)
    assert row["joined3_cosine"] > row["raw_cosine"]  # here the better baseline is the joined one
