"""The turn engine's follow-up behaviour, through a real engine over small bases built here.

Each test feeds a conversation through ``run_turns`` (a real snapshot, the shipped
``FakeEmbedder``), so none needs ``../shared/data`` or the model.
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest

from index.embedders.base import FakeEmbedder
from sidecar.turn import engine as engine_module
from sidecar.turn import followups
from sidecar.turn.engine import TurnInput, TurnResult
from sidecar.turn.followups import Source
from sidecar.turn.hits import Hit
from sidecar.turn.prefetch import Prefetcher
from sidecar.turn.skip import Skip
from tests.conftest import eventually
from tests.turns import SESSION, build_engine, run_turns

PLACES = {
    "BLUE DOOR CAFE": [
        "Blue Door Cafe takes reservations for groups of up to eight.",
        "Blue Door Cafe serves breakfast until noon, near the park, with two entrances.",
    ],
    "HARBOR GRILL": [
        "Harbor Grill takes reservations online and by phone.",
        "Harbor Grill has outdoor seating by the park and two dining rooms.",
    ],
    "PARK INN": ["Park Inn has free parking for guests.", "Park Inn rooms overlook the river."],
    "RIVER INN": ["River Inn is two miles from the station.", "River Inn has two bars."],
    "TWO TWO CAFE": ["Two Two Cafe serves coffee and cake.", "Two Two Cafe opens at seven."],
    "LANTERN HOUSE": ["Lantern House has two gardens.", "Lantern House sells two kinds of tea."],
}


def assert_said_as_itself(result: TurnResult, text: str, title: str) -> None:
    """The turn was searched as said (nothing folded in) and answered from page ``title``."""
    assert result.query == text
    assert result.followup.used == ""
    assert result.hits[0].chunk.title == title


async def test_the_agents_naming_wins_over_a_passing_mention(tmp_path: Path) -> None:
    listed = await run_turns(
        PLACES,
        [
            ("user", "I'm looking for somewhere to eat near the park."),
            ("agent", "There are two options, Blue Door Cafe and Harbor Grill."),
            ("user", "ok does the second one take reservations"),
        ],
        tmp_path / "listed",
    )
    assert listed[-1].followup.source == Source.OPTIONS
    assert listed[-1].followup.used == "HARBOR GRILL"
    assert listed[-1].hits[0].chunk.title == "HARBOR GRILL"
    named = await run_turns(
        PLACES,
        [
            ("user", "Where could I have breakfast?"),
            ("agent", "There is a nice place, it's called Blue Door Cafe."),
            ("user", "I see one place by the park there, is it that one?"),
            ("user", "Do they take reservations?"),
        ],
        tmp_path / "named",
    )
    assert [r.followup.used for r in named[2:]] == ["BLUE DOOR CAFE"] * 2
    assert named[-1].query == "BLUE DOOR CAFE: Do they take reservations?"


LISTED = ("agent", "There are two options, Blue Door Cafe and Harbor Grill.")


@pytest.mark.parametrize(
    "asked",
    [
        "which of them has outdoor seating?",
        "do either of them take reservations",
        "uh are they both near the park",
        "is one better than the other?",
        "do they take reservations",  # right after the list: "they" is the list
    ],
)
async def test_a_question_over_the_agents_list_gets_the_best_chunk_of_each(
    tmp_path: Path, asked: str
) -> None:
    """Asked of the options together, each option's chunks are ranked by the turn's words
    (embedded once) and the best of each answers: not the first option's two chunks."""
    embedder = FakeEmbedder()
    engine = build_engine(PLACES, tmp_path, embedder=embedder)
    results = await run_turns(engine, [("user", "Somewhere to eat near the park?"), LISTED])
    embedder.calls.clear()
    last = (await run_turns(engine, [("user", asked)]))[-1]
    await engine.aclose()
    assert last.followup.source == Source.OPTIONS
    assert last.followup.used == "BLUE DOOR CAFE | HARBOR GRILL"
    assert last.query == f"BLUE DOOR CAFE | HARBOR GRILL: {asked}"
    assert {hit.chunk.title for hit in last.hits[:2]} == {"BLUE DOOR CAFE", "HARBOR GRILL"}
    assert {hit.chunk.title for hit in last.hits} <= {"BLUE DOOR CAFE", "HARBOR GRILL"}
    assert embedder.calls == [(asked,)]  # one embedding, the turn's words
    assert results[0].hits  # the first turn was searched


async def test_a_question_over_the_list_keeps_each_options_best_below_min_score(
    tmp_path: Path,
) -> None:
    """The turn's words alone, without the options' names, rate their chunks lower than a
    turn folded with a name: each option's best answers even under min_score, as a turn
    folded with an entity it points back at keeps that entity's chunks."""
    asked = "which of them has outdoor seating?"
    results = await run_turns(PLACES, [LISTED, ("user", asked)], tmp_path, min_score=0.3)
    titles = [hit.chunk.title for hit in results[-1].hits]
    assert sorted(titles) == ["BLUE DOOR CAFE", "HARBOR GRILL"]
    assert min(hit.score for hit in results[-1].hits) < 0.3  # one of them is below it


@pytest.mark.parametrize(
    "asked", ["could you first confirm they take reservations?", "ok at last do they have seats"]
)
async def test_an_ordinal_not_said_of_the_list_picks_no_option(tmp_path: Path, asked: str) -> None:
    """ "first" and "last" name a position in the list only after "the" or before "one": "could
    you first confirm" and "at last" pick none, and "they" right after the list asks about
    both."""
    results = await run_turns(PLACES, [LISTED, ("user", asked)], tmp_path)
    assert results[-1].followup.source == Source.OPTIONS
    assert results[-1].followup.used == "BLUE DOOR CAFE | HARBOR GRILL"


async def test_a_question_over_the_list_searched_ahead_is_embedded_only(tmp_path: Path) -> None:
    """Searched ahead on its interim transcript, a question over the listed options embeds
    its words alone and ranks nothing: the final ranks each option's chunks itself, from the
    vector then cached. The words were ranked ahead as one query, a ranking every such final
    threw away."""
    embedder = FakeEmbedder()
    engine = build_engine(PLACES, tmp_path, embedder=embedder)
    asked = "which of them has outdoor seating?"
    try:
        await run_turns(engine, [LISTED])
        planned = engine.plan(TurnInput(session_id=SESSION, text=asked, is_final=False))
        assert planned is not None
        assert (planned.each, planned.query) == (True, asked)
        deadline = asyncio.get_running_loop().time() + 5.0
        assert await engine.search_ahead(planned, deadline) is None
        embedder.calls.clear()
        last = await engine.turn(TurnInput(session_id=SESSION, text=asked))
    finally:
        await engine.aclose()
    assert embedder.calls == []  # embedded ahead
    assert last.followup.used == "BLUE DOOR CAFE | HARBOR GRILL"
    assert {hit.chunk.title for hit in last.hits[:2]} == {"BLUE DOOR CAFE", "HARBOR GRILL"}


async def test_the_other_one_and_a_position_pick_from_the_agents_list(tmp_path: Path) -> None:
    """ "the second one" picks from the list and is tracked after it ("do they ..." asks about
    it); "the other one" is the option not being talked about."""
    results = await run_turns(
        PLACES,
        [
            LISTED,
            ("user", "the second one"),
            ("user", "do they take reservations?"),
            ("agent", "Yes, Harbor Grill takes reservations online and by phone."),
            ("user", "what about the other one?"),
        ],
        tmp_path,
    )
    picked, asked, other = results[1], results[2], results[4]
    # "they" after a pick is the picked one, not the list
    assert (picked.followup.used, picked.followup.source) == ("HARBOR GRILL", Source.OPTIONS)
    assert asked.query == "HARBOR GRILL: do they take reservations?"
    assert (other.followup.used, other.followup.source) == ("BLUE DOOR CAFE", Source.OPTIONS)
    assert other.hits[0].chunk.title == "BLUE DOOR CAFE"


async def test_a_list_is_left_when_the_caller_names_another_place(tmp_path: Path) -> None:
    """Once the caller asks about a place not on the agent's list, "which of them" is no
    question over that list."""
    results = await run_turns(
        PLACES,
        [LISTED, ("user", "Does River Inn have a bar?"), ("user", "which of them is nearest?")],
        tmp_path,
    )
    assert results[-1].followup.source != Source.OPTIONS


@pytest.mark.parametrize(
    ("text", "over"),
    [
        ("which one is quieter", True),
        ("do any of those have parking", True),
        ("neither has a pool right", True),
        ("i don't like that one either", False),  # "either" last: "too"
        ("does it do both breakfast and dinner", False),  # a coordination
        ("which floor is the room on", False),
        ("is there one with a garden", False),
    ],
)
def test_the_words_that_ask_about_a_whole_list(text: str, over: bool) -> None:
    assert followups._over_list(text.split()) is over


HELP = {
    "PHONE ABROAD": [
        "Roaming in Europe costs five dollars a day with a travel pass.",
        "Turn roaming on in the app settings before you travel.",
        "Calls home from abroad are free with a travel pass.",
    ],
    "BILLS": ["Your bill arrives by email each month.", "Pay your bill by card or bank transfer."],
    "STORES": ["Our stores open at nine.", "Bring your card to a store to swap a phone."],
}


async def test_the_recent_turns_fold_is_surer_where_the_turns_own_words_agree(
    tmp_path: Path,
) -> None:
    """A turn folded with the recent exchange reports how well its two searches agree: one
    whose own words find the folded answer too is surer than one whose words point elsewhere
    (it was a constant 0.5)."""
    exchange = [
        ("user", "How much does roaming cost in Europe?"),
        ("agent", "A travel pass costs five dollars a day."),
    ]
    found = []
    for i, last in enumerate(["and roaming with a travel pass?", "and what about my bill?"]):
        results = await run_turns(HELP, [*exchange, ("user", last)], tmp_path / str(i))
        assert results[-1].followup.source == Source.RECENT_TURNS
        found.append(results[-1].followup.confidence)
    agreeing, elsewhere = found
    assert 0.0 <= elsewhere < agreeing <= 1.0
    assert agreeing - elsewhere > 0.2


@pytest.mark.parametrize(
    ("searched", "last"),
    [("lexically", "and what about my bill?"), ("hybrid", "and roaming with a travel pass?")],
)
async def test_a_fold_not_searched_by_cosines_keeps_the_guess_for_its_confidence(
    tmp_path: Path, searched: str, last: str
) -> None:
    """A fold's confidence reads its searches' cosines: a turn searched lexically (the
    embedder down: BM25 scores) or on a hybrid base (fused scores) reported 1.0 for scores that
    are not cosines; it is the documented guess, 0.5."""
    embedder = FakeEmbedder()
    engine = build_engine(HELP, tmp_path, embedder=embedder)
    if searched == "hybrid":
        engine.hybrid_bases = frozenset(engine.known_bases)
    else:
        embedder.fail = True
    exchange = [
        ("user", "How much does roaming cost in Europe?"),
        ("agent", "A travel pass costs five dollars a day."),
    ]
    results = await run_turns(engine, [*exchange, ("user", last)])
    assert results[-1].degraded is (searched == "lexically")
    assert results[-1].followup.source == Source.RECENT_TURNS
    assert results[-1].followup.confidence == 0.5


async def test_a_spoken_number_does_not_become_a_name(tmp_path: Path) -> None:
    results = await run_turns(
        PLACES,
        [
            ("user", "tell me about harbor grill"),
            ("agent", "Harbor Grill is by the water."),
            ("user", "the zip code is nine four one two two"),
            ("user", "do they take reservations"),
        ],
        tmp_path,
    )
    assert "TWO TWO CAFE" not in results[2].query  # "two two" is not Two Two Cafe
    assert results[3].followup.used == "HARBOR GRILL"
    assert results[3].hits[0].chunk.title == "HARBOR GRILL"


PAGES = {
    "RETIREMENT BENEFITS": [
        "You can start retirement benefits at 62.",
        "Your retirement benefits depend on your earnings.",
    ],
    "DISABILITY BENEFITS": [
        "Disability benefits turn into retirement benefits at full retirement age.",
        "Apply for disability benefits if you cannot work because of a condition.",
    ],
    "SURVIVOR BENEFITS": [
        "Survivor benefits replace retirement benefits for a widow or widower.",
        "Children can get survivor benefits after a parent dies.",
    ],
    "MEDICARE": [
        "Medicare starts at 65, whether or not you take retirement benefits.",
        "Working past 65 with retirement benefits can change your Medicare premium.",
    ],
}


async def test_a_generic_title_does_not_lock_the_session(tmp_path: Path) -> None:
    results = await run_turns(
        PAGES,
        [
            ("user", "how do retirement benefits work"),
            ("user", "What if I cannot work anymore because of a condition?"),
            ("user", "How do I apply?"),
        ],
        tmp_path,
    )
    # "retirement benefits" is as common elsewhere as on its page: never the session's entity
    assert all(r.followup.source != Source.ENTITY for r in results)
    assert results[1].hits[0].chunk.title == "DISABILITY BENEFITS"
    assert results[2].followup.source == Source.RECENT_TURNS
    assert results[2].hits[0].chunk.title == "DISABILITY BENEFITS"


async def test_an_answer_is_searched_with_the_agents_question(tmp_path: Path) -> None:
    question = "Do you want to know how to prove your immigration status?"
    base = {
        "SOCIAL SECURITY CARD": [
            "To prove your immigration status, show your current immigration document.",
            "A replacement card is free.",
        ],
        "RETIREMENT": ["You can start retirement benefits at 62."],
    }
    results = await run_turns(
        base,
        [
            ("user", "It's my first time getting a card. I'm a noncitizen adult."),
            ("agent", "You need a document from immigration."),
            ("agent", question),
            ("user", "Yes, please tell me."),
            ("agent", question),
            ("user", "Yes."),
            ("agent", "A replacement card is free."),
            ("user", "Yes."),
        ],
        tmp_path,
    )
    for answer in (results[3], results[5]):
        assert answer.skipped is Skip.NOT_SKIPPED
        assert answer.followup.source == Source.AGENT_QUESTION
        assert question in answer.query
        assert "immigration status" in answer.hits[0].chunk.text
    assert results[7].skipped is Skip.BACKCHANNEL  # no question asked: "Yes." is a backchannel


async def test_an_answer_is_searched_with_what_the_caller_asked_before_the_question(
    tmp_path: Path,
) -> None:
    """ "Yes." answers the exchange: the caller's request and the agent's question about it,
    where the question alone ("Do you want to know how?") names nothing."""
    base = {
        "BENEFITS FOR VETERANS": ["Veterans apply for disability compensation online or by mail."],
        "STUDENT AID": ["Students apply for federal aid with the FAFSA form each year."],
    }
    request = "I am a veteran and I was hurt in service, can I get disability compensation?"
    results = await run_turns(
        base,
        [
            ("user", request),
            ("agent", "You may qualify."),
            ("agent", "Do you want to know how to apply?"),
            ("user", "Yes."),
        ],
        tmp_path,
    )
    answer = results[3]
    assert answer.followup.source == Source.AGENT_QUESTION
    assert answer.query.startswith(request)
    assert "Do you want to know how to apply?" in answer.followup.used
    assert "disability compensation" in answer.hits[0].chunk.text


DOCS = {
    "GOOGLE DRIVE": [
        "To set up Google Drive, run rclone config and choose drive.",
        "Google Drive limits uploads to 750 GB a day.",
    ],
    "FILTERING": ["Use --exclude to skip files matching a pattern when you transfer."],
    "INSTALL": ["Install rclone with the install script or a package manager."],
}


async def test_a_self_contained_question_after_a_topic_is_searched_as_itself(
    tmp_path: Path,
) -> None:
    question = "how can I skip files matching a pattern"
    results = await run_turns(
        DOCS,
        [
            ("user", "Tell me about Google Drive."),
            ("agent", "Google Drive is set up with rclone config."),
            ("user", question),
            ("user", "and how much can I upload a day there"),
        ],
        tmp_path,
        embedder=FakeEmbedder(dimension=1024),  # few hash collisions between the words
    )
    # Google Drive stays tracked, yet the turn's own words answer it
    assert results[2].hits[0].chunk.title == "FILTERING"
    # the entity is still tracked for the follow-up that leans on it
    assert results[3].followup.used == "GOOGLE DRIVE"
    assert results[3].hits[0].chunk.text == "Google Drive limits uploads to 750 GB a day."


SYNC_DOCS = {
    "BISYNC": [
        "Bisync keeps a lock file while a sync runs.",
        "Bisync filters are read on the first run.",
    ],
    "FAQ": [
        "No such host: the lookup of the domain failed in DNS.",
        "Copy the config file from one machine to another.",
    ],
    "INSTALL": ["Install rclone with the install script or a package manager."],
}


async def test_a_question_after_the_caller_moved_on_from_a_topic_is_searched_as_itself(
    tmp_path: Path,
) -> None:
    """A question answered on another page lets the tracked page go: the next question that
    does not point back is searched as said, where folded with the page's name ("BISYNC: the
    lookup says no such host while a sync runs") the name's words would win it the page's
    lock-file chunk over the FAQ answer its own words prefer. A turn that points back is
    still folded with the page."""
    lookup = "the lookup says no such host while a sync runs"
    results = await run_turns(
        SYNC_DOCS,
        [
            ("user", "Tell me about Bisync."),
            ("user", "how do I copy the config file from one machine to another"),
            ("user", lookup),
            ("user", "what about filters for it"),
        ],
        tmp_path,
        embedder=FakeEmbedder(dimension=1024),  # few hash collisions between the words
    )
    assert results[1].hits[0].chunk.title == "FAQ"
    assert_said_as_itself(results[2], lookup, "FAQ")
    assert results[2].hits[0].chunk.text.startswith("No such host")
    assert results[3].followup.source == Source.ENTITY
    assert results[3].followup.used == "BISYNC"
    assert results[3].hits[0].chunk.text == "Bisync filters are read on the first run."


TERMINAL = {
    "KEY BINDINGS": [
        "Key bindings map keys to commands such as copy and paste.",
        "Add a key binding to run a command from the keyboard.",
        "Paste has a shortcut: ctrl+v.",
    ],
    "CONFIGURATION": [
        "You find the settings file in the dropdown menu.",
        "Paste has a setting: trim blanks.",
    ],
    "LAUNCHING": ["Start the terminal from the command line with a profile and a folder."],
    # a page that says both the tracked page's words and the question's
    "PALETTE": ["Find the key bindings and settings in the command palette."],
}


async def test_a_question_the_tracked_name_does_not_decide_keeps_its_own_answer(
    tmp_path: Path,
) -> None:
    """Folded with the tracked page ("KEY BINDINGS: where can I find the settings file"), the
    question's best chunk is a third page's, not the tracked one's: the name did not decide
    the answer, so the turn's own ranking stands, though its own words prefer their answer by
    less than the margin a tracked entity is otherwise kept by. Where the folded search's
    best chunk is the tracked page's, the page still answers."""
    question = "where can I find the settings file"
    results = await run_turns(
        TERMINAL,
        [
            ("user", "Tell me about key bindings."),
            ("user", "what does paste have as a setting"),
            ("user", question),
        ],
        tmp_path,
        embedder=FakeEmbedder(dimension=1024),  # few hash collisions between the words
    )
    # the tracked page answers a question whose folded search finds it first
    assert results[1].followup.source == Source.ENTITY
    assert results[1].followup.used == "KEY BINDINGS"
    assert results[1].hits[0].chunk.title == "KEY BINDINGS"
    assert_said_as_itself(results[2], question, "CONFIGURATION")


BACKENDS = {
    "GOOGLE DRIVE": [
        "To set up Google Drive, run rclone config and choose drive.",
        "Google Drive limits uploads to 750 GB a day.",
    ],
    "PCLOUD": ["pCloud keeps modification times.", "pCloud limits file names to 255 characters."],
    # pages that list every backend: "pCloud" is a word of theirs too, so it names its page weakly
    "OVERVIEW": [
        "Backends: Google Drive, pCloud and Box.",
        "Every backend, pCloud or Box, keeps hashes.",
    ],
    "BOX": ["Box needs an enterprise account for shared folders."],
}


async def test_a_turn_naming_another_page_weakly_leaves_the_tracked_one(tmp_path: Path) -> None:
    """A turn that names another page, if only weakly, and points back at nothing has changed
    the subject: it is not folded with the page tracked before (which stays tracked: a weak
    name may be ordinary words, as a spoken number is)."""
    results = await run_turns(
        BACKENDS,
        [
            ("user", "Tell me about Google Drive."),
            ("user", "Tell me about pCloud."),
        ],
        tmp_path,
        embedder=FakeEmbedder(dimension=1024),  # few hash collisions between the words
    )
    assert_said_as_itself(results[1], "Tell me about pCloud.", "PCLOUD")


async def test_a_new_question_after_recent_turns_keeps_its_own_answer(tmp_path: Path) -> None:
    question = "how can I skip files matching a pattern"
    results = await run_turns(
        DOCS,
        [
            ("user", "How do I set up my cloud storage?"),
            # no page named: "pick drive" names Google Drive here, where no other page says "drive"
            ("agent", "Run rclone config and pick a backend."),
            ("user", question),
            ("user", "And after that?"),
        ],
        tmp_path,
        embedder=FakeEmbedder(dimension=1024),  # few hash collisions between the words
    )
    assert results[2].hits[0].chunk.title == "FILTERING"
    assert results[3].followup.source == Source.RECENT_TURNS  # a follow-up is still completed
    assert question in results[3].query


# A help line's pages, none of whose titles the callers say ("roaming", "voicemail" name none)
PHONE_HELP = {
    "TRAVEL ABROAD": [
        "How much roaming costs in Europe: 2 euros a day.",
        "Roaming in Europe: how much data you get.",
    ],
    "MAILBOX": [
        "Set up voicemail: call 123 and choose a PIN.",
        "Change your voicemail PIN from the voicemail menu.",
    ],
    "SIGN-IN HELP": [
        "Forgot your password? Reset it here.",
        "After five wrong passwords your account is locked for an hour.",
    ],
    "PRICE LIST": [
        "Our plans are Basic, Plus and Unlimited.",
        "A family discount takes 10 percent off every line.",
    ],
}


async def test_a_short_question_of_its_own_after_a_topic_is_searched_as_itself(
    tmp_path: Path,
) -> None:
    """A turn of five words or fewer that points back at nothing ("I forgot my password") is
    searched alone too, and is answered as said where its own words single out another page
    than the folded query's answer: folded with the roaming question, or with a tracked page,
    it was answered from that page whatever it asked. Words several pages answer alike
    ("Can I make reservations?" after a restaurant) stay folded with the tracked page."""
    engine = build_engine(
        {**PHONE_HELP, "MAILBOX": [*PHONE_HELP["MAILBOX"], "Mailbox is the voicemail service."]},
        tmp_path / "help",
        embedder=FakeEmbedder(dimension=1024),  # few hash collisions between the words
        min_score=0.3,
    )
    try:
        after_exchange = [
            await engine.turn(TurnInput(session_id="roaming", text=text))
            for text in ("How much does roaming cost in Europe?", "I forgot my password")
        ]
        after_page = [
            await engine.turn(TurnInput(session_id="mailbox", text=text))
            for text in ("Tell me about Mailbox.", "I forgot my password")
        ]
    finally:
        await engine.aclose()
    assert after_page[0].hits[0].chunk.title == "MAILBOX"
    assert_said_as_itself(after_exchange[1], "I forgot my password", "SIGN-IN HELP")
    assert_said_as_itself(after_page[1], "I forgot my password", "SIGN-IN HELP")
    alike = await run_turns(
        PLACES,
        [("user", "Tell me about Park Inn."), ("user", "Can I make reservations?")],
        tmp_path / "places",
        embedder=FakeEmbedder(dimension=1024),
    )
    assert alike[1].followup.used == "PARK INN"


async def test_a_short_question_of_its_own_is_judged_within_the_pages_the_call_may_reach(
    tmp_path: Path,
) -> None:
    """Whether a short question's own words single out its page is read from its own search,
    within the call's paths: a page the call may not reach (an old copy of the sign-in help)
    that its words rate as high does not keep it folded with the roaming question. It was
    judged by a search of the whole base; reachable, that copy still keeps it folded."""
    base = {
        **PHONE_HELP,
        "MAILBOX": [*PHONE_HELP["MAILBOX"], "Mailbox is the voicemail service."],
        "OLD SIGN-IN HELP": ["Forgot your password? Reset it here, on the old site."],
    }
    engine = build_engine(base, tmp_path, embedder=FakeEmbedder(dimension=1024), min_score=0.3)
    reach = {"all": (), "new": ("TRAVEL*", "MAILBOX*", "SIGN-IN*", "PRICE*")}
    try:
        last = {
            name: [
                await engine.turn(TurnInput(session_id=name, text=text, source_paths=paths))
                for text in ("How much does roaming cost in Europe?", "I forgot my password")
            ][-1]
            for name, paths in reach.items()
        }
    finally:
        await engine.aclose()
    assert_said_as_itself(last["new"], "I forgot my password", "SIGN-IN HELP")
    assert last["all"].followup.source == Source.RECENT_TURNS


async def test_a_tracked_page_the_caller_moved_on_from_is_not_folded_into_short_questions(
    tmp_path: Path,
) -> None:
    """Once the caller moved on from the tracked page (a question answered on another page),
    later short questions that point back at nothing are searched as said, each answered
    from its own page: they were all still folded with the page, at confidence 1. A turn
    that leans back by an elliptic opening alone ("and for Unlimited?") is folded with the
    last exchange, not the page left behind; one that points back at it with a pronoun
    ("what about the PIN for it") is still folded with it."""
    results = await run_turns(
        {**PHONE_HELP, "MAILBOX": [*PHONE_HELP["MAILBOX"], "Mailbox is the voicemail service."]},
        [
            ("user", "Tell me about Mailbox."),
            ("user", "How much does roaming cost in Europe?"),
            ("user", "I forgot my password"),
            ("user", "Is there a family discount?"),
            ("user", "and for Unlimited?"),
            ("user", "what about the PIN for it"),
        ],
        tmp_path,
        embedder=FakeEmbedder(dimension=1024),
        min_score=0.3,
    )
    assert results[0].hits[0].chunk.title == "MAILBOX"
    assert results[1].hits[0].chunk.title == "TRAVEL ABROAD"
    assert_said_as_itself(results[2], "I forgot my password", "SIGN-IN HELP")
    assert_said_as_itself(results[3], "Is there a family discount?", "PRICE LIST")
    # an elliptic opening alone leans on what was just said, not on the page left behind (its
    # own words, searched beside the exchange, rank "Basic, Plus and Unlimited" first of both)
    assert "MAILBOX" not in results[4].query
    assert results[4].followup.used != "MAILBOX"
    assert results[4].hits[0].chunk.text == "Our plans are Basic, Plus and Unlimited."
    assert results[5].followup.used == "MAILBOX"
    assert results[5].hits[0].chunk.title == "MAILBOX"


# A help line whose chunks share their words with its callers' questions (cosines above 0.3)
PLAN_HELP = {
    "TRAVEL ABROAD": [
        "Roaming in Europe costs 2 euros a day.",
        "Roaming in Europe: you get 5 GB of data a day.",
    ],
    "SIGN-IN HELP": [
        "Forgot your password? Reset your password here.",
        "After five wrong passwords your account is locked for an hour.",
    ],
    "PRICE LIST": [
        "Our plans are Basic, Plus and Unlimited.",
        "A family discount takes 10 percent off every plan.",
    ],
    "MAILBOX": [
        "Set up voicemail: call 123 and choose a PIN.",
        "Change your voicemail PIN from the voicemail menu.",
    ],
}


BILLING = {
    "BILLS": ["Your bill arrives by email each month."],
    "STORES": ["Our stores open at nine."],
    "ROAM": ["Roaming in Europe costs five dollars a day."],
}


async def _answered_on(tmp_path: Path, context_url: str, min_score: float) -> TurnResult:
    """The last turn of a conversation whose last turn is searched twice (folded with the
    recent exchange, and alone), the caller on page ``context_url`` (BILLS' related page)."""
    engine = build_engine(
        BILLING,
        tmp_path / f"{min_score}-{bool(context_url)}",
        min_score=min_score,
        context_bonus=0.2,
        metadata={"BILLS": {"related_urls": "/billing/*"}},
    )
    turns = [
        ("user", "How much does roaming cost in Europe?"),
        ("agent", "Roaming costs five dollars a day."),
        ("user", "what about the weather today"),
    ]
    try:
        results = [
            await engine.turn(
                TurnInput(session_id=SESSION, text=text, speaker=who, context_url=context_url)
            )
            for who, text in turns
        ]
    finally:
        await engine.aclose()
    assert results[-1].followup.source == Source.RECENT_TURNS
    return results[-1]


def _score_of(title: str, result: TurnResult) -> float:
    return next(hit.score for hit in result.hits if hit.chunk.title == title)


@pytest.mark.parametrize("min_score", [0.15, 0.25])
async def test_a_context_url_lifts_a_turns_two_searches_after_min_score_not_past_it(
    tmp_path: Path, min_score: float
) -> None:
    """A turn searched twice keeps the chunks of the caller's page (``context_url``) only where
    its own cosines reach ``min_score``, as a single search does, and lifts them there; how
    sure its fold is reads the cosines, not the lift. Both searches were ranked with the bonus
    before the threshold: at 0.25 the billing chunk (cosines under it) came back, and the
    fold's confidence moved with the page the caller was on."""
    plain = await _answered_on(tmp_path, "", min_score)
    on_page = await _answered_on(tmp_path, "https://app.example.com/billing/march", min_score)
    assert {h.chunk.title for h in on_page.hits} == {h.chunk.title for h in plain.hits}
    assert on_page.followup.confidence == plain.followup.confidence
    if min_score < 0.2:  # the billing chunk passes the threshold: lifted, above its own score
        assert _score_of("BILLS", on_page) > _score_of("BILLS", plain)
    else:
        assert [h.chunk.title for h in on_page.hits] == ["ROAM"]


@pytest.mark.parametrize("min_score", [0.0, 0.3])
async def test_min_score_does_not_reorder_the_two_searches_fused_ranking(
    tmp_path: Path, min_score: float
) -> None:
    """A turn folded with the recent exchange and searched alone too is ranked by both searches'
    cosines as read before min_score, the threshold only choosing the candidates: at 0.3 the
    turn alone's list was cut short, and the exchange's chunks it did not keep counted at its
    last kept cosine, well above their own, so "is there a discount for a family" after
    roaming prices was answered with roaming (at 0.0, and now at 0.3 too: the discount)."""
    results = await run_turns(
        PLAN_HELP,
        [
            ("user", "How much does roaming cost in Europe?"),
            ("user", "is there a discount for a family"),
        ],
        tmp_path,
        embedder=FakeEmbedder(dimension=1024),
        min_score=min_score,
    )
    assert results[1].hits[0].chunk.text.startswith("A family discount")
    assert all(hit.score >= min_score for hit in results[1].hits)


async def test_a_tracked_entity_survives_a_backchannel_and_a_skipped_turn(tmp_path: Path) -> None:
    results = await run_turns(
        PLACES,
        [
            ("user", "Tell me about Harbor Grill."),
            ("user", "okay"),
            ("user", "Thank you very much."),
            ("user", "do they have outdoor seating"),
        ],
        tmp_path,
    )
    assert [r.skipped for r in results[1:3]] == [Skip.BACKCHANNEL, Skip.CLOSING]
    assert results[3].followup.used == "HARBOR GRILL"
    assert results[3].hits[0].chunk.title == "HARBOR GRILL"


@pytest.mark.parametrize("fault", [{"hang": True}, {"fail": True}, {"delay": 1.0}])
async def test_a_stuck_or_broken_embedder_falls_back_with_the_follow_up(
    tmp_path: Path, fault: dict[str, object]
) -> None:
    engine = build_engine(PLACES, tmp_path, embedder=FakeEmbedder(**fault), budget_ms=50)  # type: ignore[arg-type]
    results = await run_turns(
        engine, [("user", "Tell me about Harbor Grill."), ("user", "do they take reservations")]
    )
    await engine.aclose()
    assert all(r.degraded for r in results)
    assert results[1].query == "HARBOR GRILL: do they take reservations"
    assert results[1].hits[0].chunk.title == "HARBOR GRILL"


async def test_an_answer_about_a_tracked_entity_is_searched_with_it(tmp_path: Path) -> None:
    """With an entity tracked, the entity names the answer's topic: "Yes." after the agent's
    question about the Lensfield is searched with the Lensfield and the question, not with the
    caller's earlier request."""
    base = {
        "LENSFIELD HOTEL": ["Breakfast at the Lensfield is served from seven.", "Free parking."],
        "GONVILLE HOTEL": ["Breakfast at the Gonville costs extra.", "Parking is paid."],
    }
    request = "I need somewhere to stay in the centre with free parking please"
    results = await run_turns(
        base,
        [
            ("user", request),
            ("agent", "The Lensfield Hotel has free parking."),
            ("agent", "Would you like to know about breakfast?"),
            ("user", "Yes."),
        ],
        tmp_path,
    )
    answer = results[3]
    assert answer.followup.source == Source.AGENT_QUESTION
    assert answer.followup.used.startswith("LENSFIELD HOTEL: ")
    assert request not in answer.query
    assert answer.hits[0].chunk.title == "LENSFIELD HOTEL"


async def test_a_turn_that_says_only_a_weak_name_makes_it_the_topic(tmp_path: Path) -> None:
    """ "Tell me about pCloud." says nothing but the name, so "pCloud" has no ordinary reading
    there, even though the overview pages say it too: the follow-up leans on pCloud, not on
    the page tracked before. A turn whose other words carry content (a spoken number beside
    "Two Two Cafe") keeps the tracked entity (``test_a_spoken_number_does_not_become_a_name``)."""
    results = await run_turns(
        BACKENDS,
        [
            ("user", "Tell me about Google Drive."),
            ("user", "Tell me about pCloud."),
            ("user", "What about the limits on file names for it?"),
        ],
        tmp_path,
        embedder=FakeEmbedder(dimension=1024),  # few hash collisions between the words
    )
    assert results[1].query == "Tell me about pCloud."
    assert results[2].followup.source == Source.ENTITY
    assert results[2].followup.used == "PCLOUD"
    assert results[2].hits[0].chunk.text == "pCloud limits file names to 255 characters."


async def test_a_weak_name_said_alone_is_tracked_when_answered_from_a_prefetch(
    tmp_path: Path,
) -> None:
    """A final "Tell me about pCloud." answered from the search started on its interim
    transcript tracks pCloud as one searched at the final does
    (``test_a_turn_that_says_only_a_weak_name_makes_it_the_topic``): the follow-up leans on
    pCloud, not on the page tracked before."""
    engine = build_engine(BACKENDS, tmp_path, embedder=FakeEmbedder(dimension=1024))
    prefetcher = Prefetcher(engine, stable_ms=200)
    try:
        await run_turns(engine, [("user", "Tell me about Google Drive.")])
        said = "Tell me about pCloud."
        prefetcher.interim(TurnInput(session_id=SESSION, text=said, is_final=False))
        named = await engine.turn(TurnInput(session_id=SESSION, text=said), prefetcher)
        follow_up = "What about the limits on file names for it?"
        [after] = await run_turns(engine, [("user", follow_up)])
    finally:
        await prefetcher.aclose()
        await engine.aclose()
    assert named.prefetched
    assert named.query == said
    assert after.followup.source == Source.ENTITY
    assert after.followup.used == "PCLOUD"
    assert after.hits[0].chunk.text == "pCloud limits file names to 255 characters."


async def test_a_final_planned_otherwise_than_its_interim_is_searched_as_its_own_plan(
    tmp_path: Path,
) -> None:
    """The interim "what is conhost exe" is folded with the tracked page; its final "What is
    conhost.exe?" writes a file name and is searched as said
    (``test_a_word_only_another_page_uses_names_that_page``): the prefetch is not its answer."""
    engine = build_engine(DOCS_PAGES, tmp_path, embedder=FakeEmbedder(dimension=1024))
    prefetcher = Prefetcher(engine, stable_ms=50)
    try:
        await run_turns(
            engine, [("user", "Tell me about Acme Terminal Appearance Profile Settings.")]
        )
        prefetcher.interim(
            TurnInput(session_id=SESSION, text="what is conhost exe", is_final=False)
        )
        await eventually(lambda: engine.counters.prefetch_started == 1, "the interim's prefetch")
        final = "What is conhost.exe?"
        result = await engine.turn(TurnInput(session_id=SESSION, text=final), prefetcher)
    finally:
        await prefetcher.aclose()
        await engine.aclose()
    assert engine.counters.prefetch_started == 1
    assert not result.prefetched
    assert_said_as_itself(result, final, "ACME TERMINAL FAQ")


APP_PAGES = {
    # every page's title starts with the product's name, as a docs site's do
    "ACME TERMINAL ACTIONS": [
        "Acme Terminal actions can run in any of the shells it supports.",
        "Acme Terminal actions can open a new tab.",
    ],
    "ACME TERMINAL PROFILES": [
        "Acme Terminal supports these shells: PowerShell, Command Prompt and WSL."
    ],
    "ACME TERMINAL THEMES": ["Acme Terminal themes set the colour of the tab row."],
}


async def test_a_question_saying_the_base_s_shared_name_is_searched_as_itself(
    tmp_path: Path,
) -> None:
    """ "What shells does Acme Terminal support?" says the words every page's title shares
    (``Gazetteer.shared``) as a name of its own (no "the" before them): it is not folded with
    the tracked page, whose other words ("Actions") are not what it asks about. "Can the
    terminal ..." uses a word of the tracked name as a common noun: that leans on the tracked
    page."""
    turns = [
        ("user", "Tell me about Acme Terminal Actions."),
        ("user", "Can the terminal open a new tab with a key binding?"),
        ("user", "What shells does Acme Terminal support?"),
    ]
    results = await run_turns(
        APP_PAGES,
        turns,
        tmp_path,
        embedder=FakeEmbedder(dimension=1024),  # few hash collisions between the words
    )
    assert results[0].followup.used == ""  # named confidently: searched as said, and tracked
    assert results[1].query.startswith("ACME TERMINAL ACTIONS: ")
    assert results[1].followup.used == "ACME TERMINAL ACTIONS"
    assert_said_as_itself(
        results[2], "What shells does Acme Terminal support?", "ACME TERMINAL PROFILES"
    )


DOCS_PAGES = {
    # most titles start with the product's name; "profile" is a word of two of them
    "ACME TERMINAL APPEARANCE PROFILE SETTINGS": [
        "Acme Terminal appearance profile settings set the font face and the cursor shape."
    ],
    "ACME TERMINAL GENERAL PROFILE SETTINGS": [
        "Acme Terminal general profile settings set the starting directory and the icon."
    ],
    "ACME TERMINAL ACTIONS": ["Acme Terminal actions bind keys to commands."],
    "ACME TERMINAL THEMES": ["Acme Terminal themes set the colour of the tab row."],
    "ACME TERMINAL STARTUP": ["Acme Terminal startup settings choose the default profile."],
    "ACME TERMINAL SCRIPTING": [
        "A batch file can start an Acme Terminal profile with the wt command and its options."
    ],
    "ACME TERMINAL FAQ": ["Conhost.exe is the classic console host that Acme Terminal replaces."],
}


async def test_a_question_with_an_expletive_it_says_its_own_topic(tmp_path: Path) -> None:
    """ "Is it possible to ..." has an "it" that refers to nothing (it stands for the clause
    after it), and "an Acme Terminal profile" brings in a profile the conversation has not
    had (an indefinite article) by a word two page titles share: the question names its own
    topic and is searched as said, not folded with the page tracked before. "Does it set the
    cursor shape?" points back and stays folded."""
    said = "Is it possible to start an Acme Terminal profile from a batch file?"
    results = await run_turns(
        DOCS_PAGES,
        [
            ("user", "Tell me about Acme Terminal Appearance Profile Settings."),
            ("user", said),
            ("user", "Tell me about Acme Terminal Appearance Profile Settings."),
            ("user", "Does it set the cursor shape?"),
        ],
        tmp_path,
        embedder=FakeEmbedder(dimension=1024),  # few hash collisions between the words
    )
    assert results[0].followup.used == ""  # named confidently: searched as said, and tracked
    assert_said_as_itself(results[1], said, "ACME TERMINAL SCRIPTING")
    assert results[3].followup.used == "ACME TERMINAL APPEARANCE PROFILE SETTINGS"


async def test_a_word_only_another_page_uses_names_that_page(tmp_path: Path) -> None:
    """ "What is conhost.exe?" is short, but says a word only one other page's chunks hold (the
    lexical index knows it: a file name): it names its own topic and is searched as said. A
    short turn whose rare word is the tracked page's own ("What is the cursor shape?") leans on
    the tracked page."""
    results = await run_turns(
        DOCS_PAGES,
        [
            ("user", "Tell me about Acme Terminal Appearance Profile Settings."),
            ("user", "What is conhost.exe?"),
            ("user", "What is the cursor shape?"),
        ],
        tmp_path,
        embedder=FakeEmbedder(dimension=1024),  # few hash collisions between the words
    )
    assert_said_as_itself(results[1], "What is conhost.exe?", "ACME TERMINAL FAQ")
    assert results[2].followup.used == "ACME TERMINAL APPEARANCE PROFILE SETTINGS"


async def test_a_file_name_said_aloud_names_the_page_that_uses_it(tmp_path: Path) -> None:
    """A transcript writes "conhost.exe" as "conhost dot exe": the words joined by "dot" are
    read as the written file name is, and the turn is searched as said; a transcript's short
    turn about the tracked page's own words still leans on the tracked page."""
    results = await run_turns(
        DOCS_PAGES,
        [
            ("user", "tell me about acme terminal appearance profile settings"),
            ("user", "what is conhost dot exe"),
            ("user", "what is the cursor shape"),
        ],
        tmp_path,
        embedder=FakeEmbedder(dimension=1024),  # few hash collisions between the words
    )
    # searched as said (the hashing test embedder ranks "dot" and "exe" apart from "conhost.exe")
    assert (results[1].query, results[1].followup.used) == ("what is conhost dot exe", "")
    assert results[2].followup.used == "ACME TERMINAL APPEARANCE PROFILE SETTINGS"


async def test_a_name_pointed_back_at_as_a_section_of_the_tracked_page_is_folded(
    tmp_path: Path,
) -> None:
    """ "what about command line arguments for it" names another page confidently, but points
    back, and the tracked page has a section of that name: it asks about that section and is
    folded with the tracked page. Pointing back at a page with no such section ("what about
    themes for it" on the command line page), it names its own topic and is searched as said."""
    results = await run_turns(
        {
            "ACME TERMINAL INSTALLATION": [
                "## Install\n\nGet Acme Terminal from the store.",
                "## Command line arguments\n\nThe installer starts wt with options.",
            ],
            "ACME TERMINAL COMMAND LINE ARGUMENTS": ["## Examples\n\nwt new-tab opens a tab."],
            "ACME TERMINAL THEMES": ["## Colours\n\nThemes set the colour of the tab row."],
        },
        [
            ("user", "Tell me about Acme Terminal installation."),
            ("user", "what about command line arguments for it"),
            ("user", "what about themes for it"),
        ],
        tmp_path,
        kind="markdown",
    )
    assert results[0].followup.used == ""  # named confidently: searched as said, and tracked
    assert (
        results[1].query == "ACME TERMINAL INSTALLATION: what about command line arguments for it"
    )
    assert results[1].followup.source == Source.ENTITY
    assert (results[2].query, results[2].followup.used) == ("what about themes for it", "")


async def test_a_section_named_in_more_chunks_than_are_read_a_turn_is_no_section(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The section check reads the chunks holding the section's words only while they are few
    (``SECTION_CHUNKS``): in a base where they are common (here: more than one chunk, the bound
    made small), the turn is searched as said, and no turn's work grows with the base."""
    monkeypatch.setattr(followups, "SECTION_CHUNKS", 1)
    results = await run_turns(
        {
            "ACME TERMINAL INSTALLATION": [
                "## Install\n\nGet Acme Terminal from the store.",
                "## Command line arguments\n\nThe installer starts wt with options.",
            ],
            "ACME TERMINAL COMMAND LINE ARGUMENTS": ["## Examples\n\nwt new-tab opens a tab."],
        },
        [
            ("user", "Tell me about Acme Terminal installation."),
            ("user", "what about command line arguments for it"),
        ],
        tmp_path,
        kind="markdown",
    )
    assert (results[1].query, results[1].followup.used) == (
        "what about command line arguments for it",
        "",
    )


async def test_a_spoken_opener_that_mishears_the_shared_words_names_its_page(
    tmp_path: Path,
) -> None:
    """A recogniser mishears "Acme Terminal", the words every title shares ("acme tunnel");
    "profile settings" is in three names and "general" alone is an ordinary word of the base
    (other pages' chunks use it): the rest of the name said together,
    "general profile settings", names the page, so the opener is searched as said and tracked,
    and "what about the icon for it" is folded with that page, not with the turn before."""
    results = await run_turns(
        {
            "ACME TERMINAL GENERAL PROFILE SETTINGS": [
                "General profile settings set the starting directory and the icon of a profile."
            ],
            "ACME TERMINAL APPEARANCE PROFILE SETTINGS": [
                "Appearance profile settings set the font face and the cursor shape."
            ],
            "ACME TERMINAL ADVANCED PROFILE SETTINGS": [
                "Advanced profile settings set the bell style and the history size."
            ],
            "ACME TERMINAL STARTUP": ["Startup options pick a profile, in general the first."],
            "ACME TERMINAL ACTIONS": ["Actions bind keys to commands, as a general rule one."],
            "ACME TERMINAL THEMES": ["Themes set the colour of the tab row."],
            "ACME TERMINAL PANES": ["Panes split a tab in two."],
        },
        [
            ("user", "how do i bind keys to commands"),
            ("user", "tell me about acme tunnel general profile settings"),
            ("user", "what about the icon for it"),
        ],
        tmp_path,
        embedder=FakeEmbedder(dimension=1024),  # few hash collisions between the words
    )
    opener = "tell me about acme tunnel general profile settings"
    assert_said_as_itself(results[1], opener, "ACME TERMINAL GENERAL PROFILE SETTINGS")
    assert results[2].followup.used == "ACME TERMINAL GENERAL PROFILE SETTINGS"
    assert results[2].followup.source == Source.ENTITY


async def test_a_question_naming_the_product_after_another_question_is_searched_as_itself(
    tmp_path: Path,
) -> None:
    """Two questions in a row, nothing tracked: the second points back at nothing and says the
    words every title shares ("Acme CLI") as a name, so it is a question put in full and is
    searched as said, not folded with the first (whose answer the folded query would prefer:
    its chunk holds words of both)."""
    said = "Acme CLI gives a failed to load config file error"
    results = await run_turns(
        {
            "ACME CLI FAQ": [
                "Acme CLI using too much memory: lower the buffer size. An error that a file "
                "fails to load is often memory too."
            ],
            "ACME CLI CONFIG FILE": ["Where Acme CLI loads its config file from."],
            "ACME CLI SYNC": [
                "Acme CLI sync makes a folder match another; it reads the config file first."
            ],
            "ACME CLI COPY": ["Acme CLI copy copies new files; the config file names the remotes."],
            "ACME CLI MOUNT": ["Acme CLI mount shows a remote as a disk, as its config file says."],
        },
        [("user", "Acme CLI is using too much memory"), ("user", said)],
        tmp_path,
        embedder=FakeEmbedder(dimension=1024),  # few hash collisions between the words
    )
    assert results[0].hits[0].chunk.title == "ACME CLI FAQ"
    assert_said_as_itself(results[1], said, "ACME CLI CONFIG FILE")


async def test_a_weak_name_said_as_one_word_makes_it_the_topic(tmp_path: Path) -> None:
    """A recogniser writes "Box Drive" as "boxdrive": the turn still says nothing but the
    name, if weakly (the overview pages say it too), its words run together, so the name
    becomes the topic and the follow-up leans on it, not on the page tracked before."""
    results = await run_turns(
        {
            "PCLOUD": ["pCloud keeps modification times.", "pCloud uploads at most 50 GB a day."],
            "BOX DRIVE": [
                "Box Drive needs an enterprise account.",
                "Box Drive uploads 5 GB a day.",
            ],
            "OVERVIEW": [
                "Backends: Google Drive, Box Drive and pCloud.",
                "Every backend, Box Drive or pCloud, keeps hashes.",
                "Box Drive and Google Drive keep modification times.",
            ],
            "LIMITS": ["Box Drive and pCloud cap file names.", "Box Drive has no quota call."],
        },
        [
            ("user", "tell me about pcloud"),
            ("user", "tell me about uh boxdrive"),
            ("user", "what about the uploads a day for it"),
        ],
        tmp_path,
        embedder=FakeEmbedder(dimension=1024),  # few hash collisions between the words
    )
    assert results[1].query == "tell me about uh boxdrive"
    assert results[2].followup.source == Source.ENTITY
    assert results[2].followup.used == "BOX DRIVE"


# A misheard name: "OneDrive" is on the overview pages too, so no key names OneDrive's page by it
HEARD = {
    "GOOGLE DRIVE": [
        "Google Drive limits uploads to 750 GB a day.",
        "Google Drive shares folders with a link.",
        "Google Drive keeps trashed files for 30 days.",
    ],
    "MICROSOFT ONEDRIVE": [
        "OneDrive for Business needs a tenant id.",
        "OneDrive limits files to 250 GB.",
        "OneDrive keeps versions of a file.",
    ],
    "OVERVIEW": [
        "Backends: Google Drive, OneDrive and pCloud.",
        "Every backend, OneDrive or pCloud, keeps hashes.",
    ],
    "PCLOUD": ["pCloud keeps modification times.", "pCloud limits file names to 255 characters."],
}


async def test_a_misheard_distinctive_name_is_tracked(tmp_path: Path) -> None:
    """ "misoft onedrive" is Microsoft OneDrive as a recogniser heard it: no gazetteer key matches
    it (a syllable dropped), but its words sound like that name and no other, and the turn's
    own search finds only that page: it is answered as said, not folded with Google Drive, and
    the follow-up leans on OneDrive."""
    results = await run_turns(
        HEARD,
        [
            ("user", "tell me about google drive"),
            ("user", "tell um me about misoft um onedrive"),
            ("user", "what about the versions for it"),
        ],
        tmp_path,
        embedder=FakeEmbedder(dimension=1024),  # few hash collisions between the words
    )
    assert_said_as_itself(results[1], "tell um me about misoft um onedrive", "MICROSOFT ONEDRIVE")
    assert results[2].followup.source == Source.ENTITY
    assert results[2].followup.used == "MICROSOFT ONEDRIVE"


async def test_a_name_s_sound_in_an_ordinary_sentence_is_not_tracked(tmp_path: Path) -> None:
    """ "goal drive" sounds like Google Drive, but the turn's own search does not find only that
    page: the words are ordinary speech here, the turn is folded with the page tracked before,
    and that page stays tracked."""
    results = await run_turns(
        HEARD,
        [
            ("user", "tell me about microsoft onedrive"),
            ("user", "does it keep versions of a file for my goal drive"),
            ("user", "what about a tenant id"),
        ],
        tmp_path,
        embedder=FakeEmbedder(dimension=1024),  # few hash collisions between the words
    )
    assert results[1].followup.used == "MICROSOFT ONEDRIVE"
    assert results[2].followup.used == "MICROSOFT ONEDRIVE"


async def test_one_ordinary_word_that_sounds_like_a_name_is_no_topic(tmp_path: Path) -> None:
    """ "price?" is one letter off premiumize.me's first word: a follow-up about the page
    tracked, not a naming said alone; the next turn still leans on Google Drive."""
    base = {
        **HEARD,
        "PREMIUMIZE.ME": ["Premiumize.me needs an API key.", "Premiumize.me has no hashes."],
        "CRYPT": ["Crypt encrypts file names.", "Crypt wraps another remote."],
    }
    results = await run_turns(
        base,
        [
            ("user", "tell me about google drive"),
            ("user", "price?"),
            ("user", "what are the limits"),
        ],
        tmp_path,
        embedder=FakeEmbedder(dimension=1024),  # few hash collisions between the words
    )
    assert results[1].followup.used == "GOOGLE DRIVE"
    assert results[2].followup.used == "GOOGLE DRIVE"


async def test_a_sound_many_names_share_names_none_of_them(tmp_path: Path) -> None:
    """ "corel bey" sounds like both Coral Bay and Koral Bay: it names neither, and a short turn
    saying it is folded with the place tracked before."""
    base = {
        "CORAL BAY": ["Coral Bay has a pool.", "Coral Bay has a spa.", "Coral Bay has a gym."],
        "KORAL BAY": ["Koral Bay has a pool.", "Koral Bay has a spa.", "Koral Bay has a bar."],
        "HARBOR GRILL": ["Harbor Grill serves fish.", "Harbor Grill opens at noon."],
    }
    results = await run_turns(
        base,
        [("user", "tell me about harbor grill"), ("user", "and corel bey")],
        tmp_path,
        embedder=FakeEmbedder(dimension=1024),  # few hash collisions between the words
    )
    assert results[1].followup.used == "HARBOR GRILL"


async def test_a_misheard_name_in_a_question_is_tracked_when_its_own_search_confirms_it(
    tmp_path: Path,
) -> None:
    """A question that says more than the misheard name ("keep versions of a file") is not
    taken as naming it on its words alone; its own search finding only OneDrive's chunks at the
    top confirms it, and the follow-up leans on OneDrive, not on Google Drive."""
    results = await run_turns(
        HEARD,
        [
            ("user", "tell me about google drive"),
            ("user", "can misoft onedrive keep versions of a file"),
            ("user", "what about a tenant id"),
        ],
        tmp_path,
        embedder=FakeEmbedder(dimension=1024),  # few hash collisions between the words
    )
    assert results[1].hits[0].chunk.title == "MICROSOFT ONEDRIVE"
    assert results[2].followup.used == "MICROSOFT ONEDRIVE"


# a help desk's pages: one the caller's question is about, and one of many like sections (a fee
# per vehicle class) that every search about registrations also finds, lower, several times
HELP_DESK = {
    "RENEWALS": [
        "Renew your registration online with the plate number.",
        "Mail the renewal form with a check when you cannot renew online.",
    ],
    "FEES": [
        "Pay the registration fee online for a car.",
        "Pay the registration fee online for a truck.",
        "Pay the registration fee online for a trailer.",
        "Pay the registration fee online or with a check for a bus.",
    ],
}


async def test_a_page_of_many_like_sections_counts_once_a_search_in_the_page_prior(
    tmp_path: Path,
) -> None:
    """Each search votes once for each page in its top five: the fee page's three or four like
    sections in every search's top do not outvote the renewals page the caller's question
    found first, so the vague last turn gets the renewals page's other section (the answer)
    in its top three (summed by score, the fee page led and its sections took that place)."""
    engine = build_engine(HELP_DESK, tmp_path, embedder=FakeEmbedder(dimension=1024), max_results=5)
    try:
        results = await run_turns(
            engine,
            [
                ("user", "How do I renew my registration online?"),
                ("agent", "You can renew online with your plate number."),
                ("user", "Can I pay with a check?"),
                ("agent", "Yes, mail it with the form."),
                ("user", "Is that the only way?"),
            ],
        )
        pages = engine.sessions.get(SESSION).pages
    finally:
        await engine.aclose()
    assert pages["FEES"] <= pages["RENEWALS"]
    assert results[-1].followup.source == Source.RECENT_TURNS
    top3 = [hit.chunk.text for hit in results[-1].hits[:3]]
    assert any(text.startswith("Mail the renewal form") for text in top3)


SETTINGS = {
    "ACME TERMINAL THEMES": [
        "## Tab row\n\nA theme sets the colour of the tab row.",
        "## Background\n\nA theme's window background can be dark or light.",
    ],
    "ACME TERMINAL APPEARANCE": [
        "## Background color\n\nSets the background color of a profile, in hex.",
        "## Font\n\nSets the font face of a profile.",
    ],
}
BACKGROUND = "what about background color for it"


async def test_a_follow_up_pointing_back_gets_the_tracked_page_s_like_section(
    tmp_path: Path,
) -> None:
    """ "what about background color for it" after the theme settings is folded with that page,
    yet its words match the appearance page's "Background color" section better than the
    theme page's "Background": the tracked page's chunks are lifted (``ENTITY_BONUS``), so its
    own section answers, and the other page's stays among the results."""
    results = await run_turns(
        SETTINGS,
        [("user", "Tell me about Acme Terminal themes."), ("user", BACKGROUND)],
        tmp_path,
        kind="markdown",
        embedder=FakeEmbedder(dimension=1024),  # few hash collisions between the words
    )
    followup = results[1]
    assert followup.followup.source == Source.ENTITY
    assert followup.followup.used == "ACME TERMINAL THEMES"
    assert followup.hits[0].chunk.breadcrumbs[-1] == "Background"
    assert followup.hits[0].chunk.title == "ACME TERMINAL THEMES"
    assert "ACME TERMINAL APPEARANCE" in [hit.chunk.title for hit in followup.hits]


async def test_a_follow_up_answered_from_a_prefetch_gets_the_tracked_page_s_like_section(
    tmp_path: Path,
) -> None:
    """The same follow-up answered from the search started on its interim transcript is
    lifted as one searched at the final is (``test_a_follow_up_pointing_back_gets_...``)."""
    engine = build_engine(
        SETTINGS, tmp_path, embedder=FakeEmbedder(dimension=1024), kind="markdown"
    )
    prefetcher = Prefetcher(engine, stable_ms=200)
    try:
        await run_turns(engine, [("user", "Tell me about Acme Terminal themes.")])
        said = f"{BACKGROUND}?"  # a pause: the interim is searched ahead at once
        prefetcher.interim(TurnInput(session_id=SESSION, text=said, is_final=False))
        result = await engine.turn(TurnInput(session_id=SESSION, text=said), prefetcher)
    finally:
        await prefetcher.aclose()
        await engine.aclose()
    assert result.prefetched
    assert result.followup.used == "ACME TERMINAL THEMES"
    assert result.hits[0].chunk.breadcrumbs[-1] == "Background"


async def test_a_turn_makes_hits_for_its_answer_alone(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A turn ranks the candidates of its searches (the folded query's and its own words',
    each up to FUSION_DEPTH deep) as (chunk, score) pairs, and makes a ``Hit`` only for each
    chunk it answers with: it made one for every candidate of both searches, and again for
    each score the fold or a lift changed, ~18 a turn to answer 2.5."""
    made: list[Hit] = []

    class Counted(Hit):
        __slots__ = ()

        def __init__(self, *args: Any) -> None:
            made.append(self)
            super().__init__(*args)

    monkeypatch.setattr(engine_module, "Hit", Counted)
    results = await run_turns(
        DOCS,
        [
            ("user", "How do I set up my cloud storage?"),
            ("agent", "Run rclone config and pick a backend."),
            ("user", "how can I skip files matching a pattern"),
            ("user", "And after that?"),
            ("user", "what about the daily limit"),
        ],
        tmp_path,
        embedder=FakeEmbedder(dimension=1024),
        max_results=2,
    )
    assert results[3].followup.source == Source.RECENT_TURNS  # folded: two searches ranked
    answered = [hit for r in results for hit in r.hits]
    assert answered  # the answers are still made of hits, and nothing else is
    assert len(made) == len(answered)
    assert all(type(hit) is Counted for hit in answered)


def test_the_listed_options_chunks_are_read_grouped_by_entity() -> None:
    """``Listed`` groups the chunks' labels by entity once, each group ascending as a scan of
    every chunk's entity finds them, for any order of the chunks' entities."""
    entity_of = np.array([2, 0, 2, 1, 0, 2, 2], dtype=np.int32)
    table: Any = SimpleNamespace(names=["A ", "B", "C"], entity_of=entity_of)
    listed = followups.Listed.of(table)
    for at, name in enumerate(("A", "B", "C")):
        labels = listed.labels_of(name)
        assert labels is not None
        assert labels.tolist() == np.flatnonzero(entity_of == at).tolist()
    assert listed.labels_of("D") is None
    assert followups.Listed.nothing().labels_of("A") is None
