"""The skip policy: backchannels and closings are not searched; short questions are."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Any

import grpc
import orjson
import pytest

from index.errors import ConfigError
from sidecar.config import SKIP_LANGUAGES, Config, SkipConfig, parse_config
from sidecar.edge.server import create_server
from sidecar.gen import retrieval_pb2 as pb
from sidecar.gen import retrieval_pb2_grpc as pb_grpc
from sidecar.turn.skip import LEXICONS, Skip, SkipPolicy, words
from tests.conftest import SHARED_DATA, shared

SKIPPED = [
    ("yeah", Skip.BACKCHANNEL),
    ("Ok.", Skip.BACKCHANNEL),
    ("mm-hmm", Skip.BACKCHANNEL),
    ("Yes, please.", Skip.BACKCHANNEL),
    ("Thank you very much.", Skip.CLOSING),
    ("thank you so much for all of your help today", Skip.CLOSING),
    ("That's all, thanks.", Skip.CLOSING),
    ("Thats all thanks !", Skip.CLOSING),
    ("No, that is all I need. Thank you for your help!", Skip.CLOSING),
    ("Great, thank you. Have a nice day. Bye!", Skip.CLOSING),
    ("That sounds great.", Skip.CLOSING),
    ("I don't care.", Skip.CLOSING),
    ("Okay, got it.", Skip.CLOSING),
    ("  ", Skip.EMPTY),
    ("...", Skip.EMPTY),
]

SEARCHED = [
    "Is it quiet?",
    "Is it good?",
    "Is that all?",
    "Are the rooms clean?",
    "What about parking?",
    "Do they serve alcohol",
    "Thank you. What is the address?",
    "Okay, thanks! Are they both 4-star?",
    "No thanks, I just need the address please.",
    "thanks, i'm also looking to stay at a guesthouse.",
    "Does it do that?",
    "Great! How much is it?",
]


@pytest.mark.parametrize(("text", "reason"), SKIPPED)
def test_acknowledgements_and_closings_are_skipped(text: str, reason: Skip) -> None:
    assert SkipPolicy().classify(text) is reason


@pytest.mark.parametrize("text", SEARCHED)
def test_questions_are_searched_however_short(text: str) -> None:
    assert SkipPolicy().classify(text) is Skip.NOT_SKIPPED


def test_max_words_caps_what_can_be_skipped() -> None:
    closing = "No that's all. Thank you. Goodbye."  # six words
    assert SkipPolicy(max_words=6).classify(closing) is Skip.CLOSING
    assert SkipPolicy(max_words=5).classify(closing) is Skip.NOT_SKIPPED


def test_extra_phrases_skip_only_as_whole_words() -> None:
    policy = SkipPolicy(extra_phrases=("Cheers, mate",))
    assert policy.classify("cheers mate!") is Skip.CLOSING
    assert policy.classify("Ok, cheers mate. Bye.") is Skip.CLOSING
    assert policy.classify("cheers mates") is Skip.NOT_SKIPPED
    assert SkipPolicy().classify("cheers mate") is Skip.NOT_SKIPPED


def test_an_unknown_language_is_a_config_error() -> None:
    with pytest.raises(ConfigError, match="'xx'"):
        SkipPolicy(language="xx")
    with pytest.raises(ConfigError, match=r"\[sidecar.skip\].*'fr'"):
        parse_config({"sidecar": {"skip": {"language": "fr"}}}, Path("."))
    assert set(SKIP_LANGUAGES) == set(LEXICONS), "config and skip.py disagree on languages"


@pytest.mark.parametrize(
    ("table", "message"),
    [
        ({"max_words": 0}, "max_words"),
        ({"phrases": "thanks"}, "phrases"),
        ({"phrases": ["ok", ""]}, "phrases"),
        ({"threshold": 3}, "unknown key"),
    ],
)
def test_bad_skip_tables_are_refused(table: dict[str, Any], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        parse_config({"sidecar": {"skip": table}}, Path("."))


def test_the_skip_table_builds_the_policy() -> None:
    config = parse_config(
        {"sidecar": {"skip": {"max_words": 3, "phrases": ["ta"], "language": "en"}}}, Path(".")
    )
    assert config.sidecar.skip == SkipConfig(max_words=3, phrases=("ta",), language="en")
    policy = SkipPolicy.from_config(config.sidecar.skip)
    assert policy.classify("ta") is Skip.CLOSING
    assert policy.classify("thank you so much") is Skip.NOT_SKIPPED  # four words > 3


def test_precision_on_labelled_dstc11_turns() -> None:
    """Against ``needs_retrieval`` on 4,173 real user turns: a skipped question is rare."""
    path = shared("turns-dstc11", "labeled_user_turns.jsonl")
    rows = [orjson.loads(line) for line in path.read_bytes().splitlines() if line.strip()]
    policy = SkipPolicy()
    skipped = [r for r in rows if policy.classify(r["text"]) is not Skip.NOT_SKIPPED]
    wrong = [r["text"] for r in skipped if r["needs_retrieval"]]
    assert len(wrong) / len(skipped) <= 0.05, wrong
    short = [r for r in rows if len(words(r["text"])) <= 4 and not r["needs_retrieval"]]
    caught = sum(policy.classify(r["text"]) is not Skip.NOT_SKIPPED for r in short)
    assert caught / len(short) >= 0.3  # the rest are requests: "What's the postcode?"


async def test_the_server_says_why_a_turn_was_not_searched(example_sidecar: Any) -> None:
    async with grpc.aio.insecure_channel(f"127.0.0.1:{example_sidecar.port}") as channel:
        client = pb_grpc.RetrievalStub(channel)
        thanks = await client.Turn(
            pb.TurnRequest(session_id="skip", text="Thank you very much.", is_final=True),
            timeout=10,
        )
        question = await client.Turn(
            pb.TurnRequest(session_id="skip", text="Is it quiet?", is_final=True), timeout=10
        )
    assert thanks.skipped == pb.CLOSING
    assert thanks.query == ""
    assert not thanks.chunks
    assert question.skipped == pb.NOT_SKIPPED
    assert question.query.endswith("Is it quiet?")


async def test_configured_phrases_reach_the_server(
    example_config: Config, local_embedder: Any
) -> None:
    skip = SkipConfig(max_words=4, phrases=("cheers mate",))
    config = replace(example_config, sidecar=replace(example_config.sidecar, skip=skip))
    sidecar = await create_server(config, embedder=local_embedder, poll=False)
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{sidecar.port}") as channel:
            client = pb_grpc.RetrievalStub(channel)
            said = [
                await client.Turn(pb.TurnRequest(session_id="s", text=t, is_final=True), timeout=10)
                for t in ("Cheers, mate!", "thank you so much for everything")
            ]
    finally:
        await sidecar.stop(0.5)
    assert said[0].skipped == pb.CLOSING
    assert said[1].skipped == pb.NOT_SKIPPED  # five words: over max_words


def test_the_word_check_before_the_patterns_changes_no_answer() -> None:
    """A turn with a word no closing or backchannel holds is searched without running the
    closing patterns: the same answers as the patterns alone, on every labelled DSTC11 turn (or
    the lists above without the data) and on a phrase joined by an optional space."""
    fast = SkipPolicy(extra_phrases=("talk soon",))
    assert fast._vocabulary is not None
    slow = SkipPolicy(extra_phrases=("talk soon",))
    object.__setattr__(slow, "_vocabulary", None)  # the patterns decide every turn
    texts = [t for t, _ in SKIPPED] + SEARCHED + ["goodbye", "good bye now", "talk soon", "talk"]
    path = SHARED_DATA / "turns-dstc11" / "labeled_user_turns.jsonl"
    if path.exists():
        texts += [orjson.loads(line)["text"] for line in path.read_bytes().splitlines() if line]
    assert [fast.classify(t) for t in texts] == [slow.classify(t) for t in texts]
    assert fast.classify("goodbye") is not Skip.NOT_SKIPPED
    assert fast.classify("talk soon") is Skip.CLOSING


@pytest.mark.parametrize("phrase", ["ciào a tutti", "check-in done", "über danke"])
def test_an_extra_closing_with_accents_or_hyphens_is_still_a_closing(phrase: str) -> None:
    """The word check before the patterns must not cut words the ASCII split cannot list."""
    assert SkipPolicy(extra_phrases=(phrase,)).classify(phrase.capitalize() + ".") is Skip.CLOSING


def test_a_turn_over_max_words_is_searched_and_a_turn_of_apostrophes_is_empty() -> None:
    policy = SkipPolicy(max_words=2)
    assert policy.classify("okay okay") is Skip.BACKCHANNEL
    assert policy.classify("okay okay okay") is Skip.NOT_SKIPPED  # no words joined for it
    assert SkipPolicy(max_words=1).classify_words(["'"]) is Skip.EMPTY
