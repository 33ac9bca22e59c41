"""Follow-ups: the entity or topic a turn refers back to is folded into what gets searched."""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import orjson
import pytest

from index import entities
from index.build import embed_chunks
from index.chunker import chunk_page
from index.embedders.base import Embedder, FakeEmbedder
from index.lexical import LexicalIndex
from index.snapshot import load_snapshot, write_snapshot
from index.sources.markdown import load_markdown
from index.store import LocalStore, new_version_id
from index.tables import ChunkTable
from index.types import Chunk, Page
from sidecar.config import Config, FollowupConfig, parse_config
from sidecar.edge.server import create_server
from sidecar.gen import retrieval_pb2 as pb
from sidecar.gen import retrieval_pb2_grpc as pb_grpc
from sidecar.snapshots.searcher import Searcher
from sidecar.turn import followups
from sidecar.turn.engine import TurnInput
from sidecar.turn.followups import FUNCTION_WORDS_EN, Gazetteer, Source
from sidecar.turn.sessions import Session
from sidecar.turn.text import Utterance, tokens
from tests.conftest import shared
from tests.turns import SESSION, build_engine, run_turns

HOTELS = ("THE LENSFIELD HOTEL", "HOBSONS HOUSE", "ACORN GUEST HOUSE", "GONVILLE HOTEL")
KB = "hotels"

# -- the gazetteer and the rewrite on their own ---------------------------------------------------

NAMES = [
    "THE LENSFIELD HOTEL",
    "HOBSONS HOUSE",
    "A AND B GUEST HOUSE",
    "ACORN GUEST HOUSE",
    "GONVILLE HOTEL",
    "WORTH HOUSE",
    "BRIDGE GUEST HOUSE",
    "PIZZA HUT CHERRY HINTON",
    "PIZZA HUT FEN DITTON",
    "PIZZA EXPRESS FEN DITTON",
    "CITYROOMZ",
]


def gaz(is_common: Any = None) -> Gazetteer:
    return Gazetteer(NAMES, FUNCTION_WORDS_EN, is_common, followups.STREETS_EN)


@pytest.mark.parametrize(
    ("text", "named"),
    [
        ("Does the Lensfield have parking?", ["THE LENSFIELD HOTEL"]),
        ("the lensfield hotel", ["THE LENSFIELD HOTEL"]),
        ("I'd like the A&B Guesthouse.", ["A AND B GUEST HOUSE"]),  # joined words, '&'
        ("Hobson's house or the acorn?", ["HOBSONS HOUSE", "ACORN GUEST HOUSE"]),
        ("I booked the Goonville for you.", ["GONVILLE HOTEL"]),  # one edit, 7+ letters
        ("citycroomz is in the centre", ["CITYROOMZ"]),
        ("uh hob sons house please", ["HOBSONS HOUSE"]),  # a recogniser's split words
        ("the lens field", ["THE LENSFIELD HOTEL"]),
        ("pizza hut cherry hinton", ["PIZZA HUT CHERRY HINTON"]),
        ("the one in fen ditton", []),  # shared by two entities: neither
        ("It is at 30 Bridge Street.", []),  # an address, not Bridge Guest House
        ("Is a guest house better than a hotel?", []),
        ("Is it quiet?", []),
    ],
)
def test_mentions(text: str, named: list[str]) -> None:
    assert gaz().mentions(text) == named


def _find_every_word_tried(g: Gazetteer, toks: tuple[str, ...]) -> dict[str, float]:
    """``find`` without its shortcut: every word goes through the full matcher."""
    found: dict[str, float] = {}
    i = 0
    while i < len(toks):
        span, at, near = g._match(toks, i)
        key = g.tables.rated.keys[at] if at >= 0 else ""
        name = g._keys.get(key) if key else None
        if name is not None:
            sure = g._sure.get(key, 1.0) * (followups.NEAR_FACTOR if near else 1.0)
            found[name] = max(found.get(name, 0.0), sure)
        i += span
    return {name: round(sure, 3) for name, sure in found.items()}


def test_words_no_name_can_start_with_are_passed_over_as_the_full_matcher_would() -> None:
    # find skips a word no key starts with that is a function word or no near match's initial;
    # over names, their words, misspellings, streets and ordinary words in random order, it
    # finds what trying every word finds
    g = gaz(lambda word, name: word == "worth")
    vocabulary = sorted(
        {t for name in NAMES for t in tokens(name)}
        | {"goonville", "citycroomz", "hob", "sons", "street", "the", "is", "it", "quiet", "park"}
        | {"lens", "field", "guesthouse", "gonvile", "xyz", "cherry", "a", "and", "b", "30"}
    )
    rng = np.random.default_rng(7)
    for _ in range(2000):
        toks = tuple(rng.choice(vocabulary, size=int(rng.integers(1, 12))).tolist())
        expected = _find_every_word_tried(g, toks)
        assert [(m.name, m.confidence) for m in g.find(toks)] == list(expected.items()), toks


def test_a_common_word_is_no_partial_name() -> None:
    assert gaz().mentions("Is it worth it?") == ["WORTH HOUSE"]
    assert gaz(lambda word, name: word == "worth").mentions("Is it worth it?") == []
    assert gaz(lambda word, name: word == "worth").mentions("worth house") == ["WORTH HOUSE"]


def _session(*turns: tuple[str, str], g: Gazetteer | None = None) -> Session:
    session = Session("s", context_turns=3)
    for speaker, text in turns:
        if speaker == "user":
            followups.rewrite(session, text, g or gaz())
        followups.record(session, speaker, text, g or gaz())
    return session


def test_the_newest_mention_wins_and_naming_one_is_searched_as_said() -> None:
    g = gaz()
    session = _session(
        ("user", "Tell me about the Lensfield."),
        ("agent", "It is in the south. Hobsons House is cheaper."),
        g=g,
    )
    assert followups.rewrite(session, "Is it quiet?", g) == "HOBSONS HOUSE: Is it quiet?"
    assert followups.rewrite(session, "And the Acorn?", g) == "And the Acorn?"
    followups.record(session, "user", "And the Acorn?", g)
    assert followups.rewrite(session, "Is it quiet?", g) == "ACORN GUEST HOUSE: Is it quiet?"


def test_a_weak_name_said_alone_moves_on_but_not_when_it_points_back_or_answers() -> None:
    """ "Pricing?" names the page it says (an ordinary word, so weakly); "What about pricing?"
    leans on the tracked entity and "Pricing, yes." answers the agent's question: both folded."""
    g = Gazetteer(
        [*NAMES, "ZETA SYNC", "PRICING"], FUNCTION_WORDS_EN, lambda word, name: word == "pricing"
    )
    session = _session(("user", "Tell me about Zeta Sync."), g=g)
    assert followups.rewrite(session, "Pricing?", g) == "Pricing?"
    assert followups.rewrite(session, "What about pricing?", g) == "ZETA SYNC: What about pricing?"
    followups.record(session, "agent", "Would you like to hear about pricing?", g)
    answered = followups.rewrite(session, "Pricing, yes.", g)
    assert answered.startswith("ZETA SYNC: Would you like to hear about pricing?")


def test_rewriting_records_nothing_about_the_turn_itself() -> None:
    """A planned interim transcript that is never finalised must not move the entity."""
    g = gaz()
    session = _session(("agent", "The Lensfield is nice."), g=g)
    followups.rewrite(session, "what about the acorn", g)  # planned, never recorded
    assert followups.rewrite(session, "Is it quiet?", g) == "THE LENSFIELD HOTEL: Is it quiet?"


def test_an_entity_no_turn_named_for_stale_turns_frames_only_a_turn_pointing_back() -> None:
    """Named, then STALE_TURNS turns about other things: the name was an earlier topic. A turn
    that points back still leans on it; one that does not is searched as said, and an answer to
    the agent's question is folded with the exchange, not the old name. One turn sooner, the
    name still frames both."""
    g = gaz()
    long_turn = "Do rooms come with breakfast included in the price of the booking?"
    chat = [("agent", "Let me look into that."), ("user", "Okay.")]
    fresh = _session(
        ("user", "Tell me about the Lensfield."),
        *chat * ((followups.STALE_TURNS - 2) // 2),
        ("agent", "Would you like to hear about our loyalty programme?"),
        g=g,
    )
    assert fresh.weight >= followups.STALE_WEIGHT
    assert followups.rewrite(fresh, long_turn, g).startswith("THE LENSFIELD HOTEL: ")
    assert followups.rewrite(fresh, "Yes, please.", g).startswith("THE LENSFIELD HOTEL: ")

    stale = _session(
        ("user", "Tell me about the Lensfield."),
        *chat * (followups.STALE_TURNS // 2),
        ("agent", "Would you like to hear about our loyalty programme?"),
        g=g,
    )
    assert stale.weight < followups.STALE_WEIGHT
    assert followups.rewrite(stale, "Is it quiet?", g) == "THE LENSFIELD HOTEL: Is it quiet?"
    assert followups.rewrite(stale, long_turn, g) == long_turn
    answered = followups.rewrite(stale, "Yes, please.", g)
    assert "LENSFIELD" not in answered
    assert "Would you like to hear about our loyalty programme?" in answered


def test_fold_referring_leaves_self_contained_turns_alone() -> None:
    g = gaz()
    referring = FollowupConfig(fold="referring")
    session = _session(("agent", "The Lensfield is nice."), g=g)
    long_turn = "Do rooms come with breakfast included in the price of the booking?"
    assert followups.rewrite(session, long_turn, g, referring) == long_turn
    assert followups.rewrite(session, long_turn, g).startswith("THE LENSFIELD HOTEL: ")
    assert followups.rewrite(session, "Do they have wifi?", g, referring).startswith(
        "THE LENSFIELD HOTEL: "
    )
    off = FollowupConfig(enabled=False)
    assert followups.rewrite(session, "Is it quiet?", g, off) == "Is it quiet?"


@pytest.mark.parametrize(
    ("turn", "refers"),
    [
        ("Is there a way to copy the config to another machine?", False),  # "is there": exists
        ("Can I copy the config from one machine to another?", False),  # "one" counts
        ("Can two people use rclone from two laptops at the same time?", False),
        ("Is there a roadmap or a feature list that I can contribute to?", False),  # a clause
        ("Is there free parking there for the guests?", True),  # the second "there": a place
        ("Do you know if that includes breakfast for the guests?", True),
        ("I see one place by the park there, is it that one?", True),
        ("How can I place an order for new checks?", False),  # "place" is a verb, not a place
        ("Does this hotel have free parking for the guests?", True),
        ("Do they take reservations?", True),  # few words, and a pronoun
        ("And what may I need to qualify for the booking?", True),  # a fragment: ellipsis
        ("What about rooms with a view of the river garden?", True),
        # "it" standing for the clause after it points at nothing; beside "known", "easy" or
        # "close" it may be the place itself
        ("Is it possible to book a table for eight people on Friday?", False),
        ("Would it be necessary to pay a deposit for the booking?", False),
        ("Is it known to have clean rooms and a friendly staff?", True),
        ("Is it easy to get to from the train station?", True),
        ("Is it close to the city centre and the museums?", True),
        # "too" says "also" at the end, "more than enough" before a word
        ("Do the rooms have a view of the river garden too?", True),
        ("Rclone is using too much memory or appears to leak", False),
        ("I need free parking at the hotel too please", True),  # only function words after it
        ("can you book a table too for me", True),
    ],
)
def test_a_word_that_can_refer_back_refers_only_where_it_is_used_so(
    turn: str, refers: bool
) -> None:
    """A self-contained question is searched alone too (its own words may keep its answer)
    even where it says "there", "one", "same" or "that" without pointing back; a turn that
    points back (a pronoun, an elliptic "and ..." or "what about ...") is searched with the
    entity only."""
    g = gaz()
    session = _session(("agent", "The Lensfield is nice."), g=g)
    plan = followups.plan(session, Utterance.of(turn), g.find(tokens(turn)))
    assert plan.followup.used == "THE LENSFIELD HOTEL"
    assert plan.alone is not refers


@pytest.mark.parametrize(
    ("turn", "said"),
    [
        (
            "what about what uh about advanced options for it",
            "what uh about advanced options for it",
        ),
        ("Can I, can I book it?", "can I book it?"),
        ("I want to I want to go there", "I want to go there"),
        ("is it quiet", "is it quiet"),
        ("no no is it quiet", "no no is it quiet"),  # one word twice: not a restart
        ("is it is it quiet", "is it quiet"),
    ],
)
def test_a_restart_is_searched_once(turn: str, said: str) -> None:
    """A run of two or three words said twice at once (fillers aside) is a restart: the turn
    is folded and searched with it said once; anything else is searched as said."""
    g = gaz()
    session = _session(("agent", "The Lensfield is nice."), g=g)
    plan = followups.plan(session, Utterance.of(turn), g.find(tokens(turn)))
    assert plan.query == f"THE LENSFIELD HOTEL: {said}"


def test_without_entities_a_turn_is_searched_with_the_recent_turns() -> None:
    session = _session(("user", "What is throat cancer?"))
    assert (
        followups.rewrite(session, "Is it treatable?") == "What is throat cancer? Is it treatable?"
    )
    session = _session(
        ("user", "What is throat cancer?"), ("agent", "A cancer of the throat."), ("user", "Ok.")
    )
    assert (
        followups.rewrite(session, "How long?")
        == "What is throat cancer? A cancer of the throat. Ok. How long?"
    )
    session = _session(("user", "What is throat cancer?"), ("user", "Tell me about Seafile."))
    assert followups.rewrite(session, "Is it free?") == "Tell me about Seafile. Is it free?"
    assert followups.rewrite(Session("new", 3), "How long?") == "How long?"


# -- through a real server over a real snapshot of DSTC11 hotels ----------------------------------


@pytest.fixture(scope="module")
def hotels_config(tmp_path_factory: pytest.TempPathFactory, local_embedder: Embedder) -> Config:
    corpus = shared("dstc11-faq-reviews", "corpus.jsonl")
    records = [orjson.loads(line) for line in corpus.read_bytes().splitlines()]
    pages = [
        Page(
            source="dstc11",
            source_path=str(r["_id"]),
            title=str(r["title"]),
            text=str(r["text"]),
            kind="text",
            context=str(r["entity_name"]),
        )
        for r in records
        if r["entity_name"] in HOTELS
    ]
    chunks = [c for p in pages for c in chunk_page(p)]
    vectors, _ = embed_chunks(local_embedder, chunks, {}, 32, progress=lambda done, total: None)
    store = LocalStore(tmp_path_factory.mktemp("hotels") / "store")
    staging = store.staging_dir(KB)
    version = new_version_id("hotels")
    write_snapshot(
        staging,
        knowledge_base=KB,
        version=version,
        embedder=local_embedder.info,
        chunks=chunks,
        vectors=np.asarray(vectors),
        pages={p.source_path: p.text for p in pages},
        page_count=len(pages),
        hnsw_m=16,
        hnsw_ef_construction=100,
        target_recall=0.95,
    )
    store.publish(KB, staging, version)
    return parse_config(
        {
            "index": {"store": str(store.root)},
            "sidecar": {"store": str(store.root), "listen": "127.0.0.1:0"},
        },
        base=store.root.parent,
    )


@pytest.fixture
async def hotels(hotels_config: Config, local_embedder: Embedder) -> AsyncIterator[Any]:
    sidecar = await create_server(hotels_config, embedder=local_embedder, poll=False)
    async with grpc.aio.insecure_channel(f"127.0.0.1:{sidecar.port}") as channel:
        yield pb_grpc.RetrievalStub(channel)
    await sidecar.stop(0.5)


async def say(client: Any, session: str, text: str, **kw: Any) -> Any:
    request = pb.TurnRequest(session_id=session, text=text, is_final=kw.pop("is_final", True), **kw)
    return await client.Turn(request, timeout=30)


async def test_the_entity_from_two_turns_ago_is_folded_in(hotels: Any) -> None:
    await say(hotels, "a", "Can you tell me about the Lensfield Hotel?")
    await say(hotels, "a", "It is an expensive hotel in the south.", speaker=pb.AGENT)
    resp = await say(hotels, "a", "Are their bathrooms clean?")
    assert resp.query == "THE LENSFIELD HOTEL: Are their bathrooms clean?"
    assert [c.title for c in resp.chunks] == ["THE LENSFIELD HOTEL"] * len(resp.chunks)
    assert resp.chunks
    alone = await say(hotels, "", "Are their bathrooms clean?")
    assert alone.query == "Are their bathrooms clean?"


async def test_an_agent_turn_introduces_the_entity(hotels: Any) -> None:
    first = await say(hotels, "b", "I need a guesthouse in the west.")
    assert first.query == "I need a guesthouse in the west."
    await say(hotels, "b", "Hobsons House has 3 stars. Shall I book it?", speaker=pb.AGENT)
    resp = await say(hotels, "b", "Is parking free?")
    assert resp.query == "HOBSONS HOUSE: Is parking free?"
    assert resp.chunks[0].title == "HOBSONS HOUSE"


async def test_naming_another_entity_changes_the_query(hotels: Any) -> None:
    await say(hotels, "c", "I am staying at the Lensfield.")
    named = await say(hotels, "c", "What about the Gonville, does it have parking?")
    assert named.query == "What about the Gonville, does it have parking?"
    assert named.chunks[0].title == "GONVILLE HOTEL"
    resp = await say(hotels, "c", "Is it quiet?")
    assert resp.query == "GONVILLE HOTEL: Is it quiet?"
    await say(hotels, "c", "I can also offer the Acorns guesthouse.", speaker=pb.AGENT)
    assert (await say(hotels, "c", "Is it quiet?")).query == "ACORN GUEST HOUSE: Is it quiet?"


async def test_interim_transcripts_and_skipped_turns_keep_the_entity(hotels: Any) -> None:
    await say(hotels, "d", "Tell me about Hobsons House.")
    interim = await say(hotels, "d", "what about the acorn", is_final=False)
    assert interim.skipped == pb.NOT_FINAL
    thanks = await say(hotels, "d", "Thank you very much.")
    assert thanks.skipped == pb.CLOSING
    resp = await say(hotels, "d", "Is it quiet?")
    assert resp.query == "HOBSONS HOUSE: Is it quiet?"


async def test_followups_can_be_turned_off(hotels_config: Config, local_embedder: Embedder) -> None:
    sidecar_config = replace(hotels_config.sidecar, followups=FollowupConfig(enabled=False))
    sidecar = await create_server(
        replace(hotels_config, sidecar=sidecar_config), embedder=local_embedder, poll=False
    )
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{sidecar.port}") as channel:
            client = pb_grpc.RetrievalStub(channel)
            await say(client, "e", "Hobsons House has 3 stars.", speaker=pb.AGENT)
            resp = await say(client, "e", "Is it quiet?")
    finally:
        await sidecar.stop(0.5)
    assert resp.query == "Is it quiet?"


def test_the_searcher_holds_the_snapshots_gazetteer(hotels_config: Config) -> None:
    # built once per snapshot, with its searcher (where: tests/test_searcher.py)
    store = LocalStore(Path(hotels_config.sidecar.store))
    snapshot = load_snapshot(store.latest_dir(KB))
    g = Searcher.build(snapshot).gazetteer
    assert g.size == len(HOTELS)
    assert g.mentions("the Lensfield or the Gonville") == ["THE LENSFIELD HOTEL", "GONVILLE HOTEL"]


async def test_a_markdown_base_follow_up_stays_on_the_page(wt_sidecar: Any) -> None:
    async with grpc.aio.insecure_channel(f"127.0.0.1:{wt_sidecar.port}") as channel:
        client = pb_grpc.RetrievalStub(channel)
        first = await say(client, "md", "How do I split the window into panes?")
        follow = await say(client, "md", "Can I resize them?")
    assert first.query == "How do I split the window into panes?"
    assert first.chunks
    assert follow.query.endswith("Can I resize them?")
    assert follow.query != "Can I resize them?"
    assert follow.followup.source in ("entity", "recent_turns")
    # on the pages the first answer found (both about split panes: which of the two comes first
    # is within the int8 kernels' rounding of one CPU against another); alone, "Can I resize
    # them?" finds neither (panes.md's and actions.md's resizing sections)
    assert follow.chunks[0].source_path in {chunk.source_path for chunk in first.chunks}


async def test_the_quality_bench_runs_on_a_few_dialogues(
    hotels_config: Config, local_embedder: Embedder
) -> None:
    """Smoke mode for bench/quality_turns.py: its DSTC11 loop through a real engine."""
    from bench.quality_turns import dstc_quality, load_dstc

    full = load_dstc(shared("dstc11-faq-reviews"), quick=False)
    queries = [
        q for q in full.queries if {full.entity[d] for d in full.qrels[q["_id"]]} <= set(HOTELS)
    ][:8]
    data = replace(full, queries=queries)
    sidecar = await create_server(hotels_config, embedder=local_embedder, poll=False)
    try:
        result = await dstc_quality(data, sidecar.engine)
    finally:
        await sidecar.stop(0.5)
    for row in ("last_turn", "last_turn_with_two_previous", "session", "gold_entity_ceiling"):
        assert result[row]["turns"] == len(queries) == 8
        assert 0.0 <= result[row]["hit_at_3"] <= 1.0
    assert result["session"]["skipped"] == 0
    assert all(ex["query"].endswith(ex["turn"]) for ex in result["examples"])


# -- is_common from the postings answers as the BM25 search did ---------------------------------


def searched_is_common(lexical: LexicalIndex, entity_of: list[str]) -> Any:
    """``is_common`` as first written: one BM25 search per word over every chunk (quadratic)."""
    words_of = {name: set(followups.tokens(name)) for name in set(entity_of)}

    def is_common(word: str, name: str) -> bool:
        whole = words_of[name] - {"the"} == {word}
        found = lexical.search(word, len(entity_of))
        elsewhere = sum(
            entity_of[d] != name and not (whole and word in words_of[entity_of[d]])
            for d, _ in found
        )
        return elsewhere >= entities.COMMON_ELSEWHERE

    return is_common


def dstc11_chunks() -> list[Chunk]:
    lines = shared("dstc11-faq-reviews", "corpus.jsonl").read_bytes().splitlines()
    pages = [
        Page(
            source="dstc11",
            source_path=str(r["_id"]),
            title=str(r["title"]),
            text=str(r["text"]),
            kind="text",
            context=str(r["entity_name"]),
        )
        for r in map(orjson.loads, lines)
    ]
    return [c for p in pages for c in chunk_page(p)]


def example_kb_chunks() -> list[Chunk]:
    pages, _ = load_markdown("kb", Path(__file__).resolve().parents[1] / "examples" / "kb")
    return [c for p in pages for c in chunk_page(p)]


def numbered_chunks() -> list[Chunk]:
    """The ``scale`` bench's corpus: "Document 1234" names whose partial name is a number."""
    from bench.ours import _chunks

    return _chunks(12_000)


@pytest.mark.parametrize("chunks", [dstc11_chunks, example_kb_chunks, numbered_chunks])
def test_common_words_from_postings_answer_as_the_search_did(chunks: Any) -> None:
    base: list[Chunk] = chunks()
    lexical = LexicalIndex.build(c.embed_text for c in base)
    entity_of = [entities.chunk_entity(c) for c in base]
    new = entities.common_words(lexical, entity_of)
    old = searched_is_common(lexical, entity_of)
    asked: list[tuple[str, str]] = []

    def recording(word: str, name: str) -> bool:
        asked.append((word, name))
        return bool(new(word, name))

    built = Gazetteer(entity_of, FUNCTION_WORDS_EN, recording, followups.STREETS_EN)
    before = Gazetteer(entity_of, FUNCTION_WORDS_EN, old, followups.STREETS_EN)
    assert asked, "the base has one-word names to judge"
    assert built._keys == before._keys  # the same names found, by the same keys
    # beyond what the gazetteer asks: every word of every name, stopwords and "the" included
    pairs = {(w, n) for n in set(entity_of) for w in followups.tokens(n)} | set(asked)
    verdicts = {pair: new(*pair) for pair in pairs}
    assert verdicts == {pair: old(*pair) for pair in pairs}
    assert any(verdicts.values())
    assert not all(verdicts.values())


def test_a_snapshot_gazetteer_is_built_with_common_words(hotels_config: Config) -> None:
    store = LocalStore(Path(hotels_config.sidecar.store))
    snapshot = load_snapshot(store.latest_dir(KB))
    entity_of = [entities.chunk_entity(c) for c in snapshot.chunks]
    old = searched_is_common(snapshot.lexical, entity_of)
    expected = Gazetteer(entity_of, FUNCTION_WORDS_EN, old, followups.STREETS_EN)
    assert followups.gazetteer(snapshot)._keys == expected._keys


@pytest.mark.parametrize("chunks", [dstc11_chunks, example_kb_chunks])
def test_a_mapped_tables_entities_are_its_chunks_entities(tmp_path: Path, chunks: Any) -> None:
    base: list[Chunk] = chunks()
    path = tmp_path / "chunks.bin"
    path.write_bytes(ChunkTable.dump(base))
    table = ChunkTable.open(path)
    expected = [c.chunk_id for c in base], [entities.chunk_entity(c) for c in base]
    assert entities.chunk_entities(table) == expected
    assert entities.chunk_entities(base) == expected
    assert len(set(expected[1])) > 1


def test_near_matches_are_remembered_within_a_bound(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(followups, "NEAR_KEPT", 8)
    names = ["Gonville Hotel", "Lensfield Hotel", "Cityroomz"]
    gaz = Gazetteer(names, FUNCTION_WORDS_EN)
    said = followups.tokens("is the gonvile near cityroomz or the lensfeld and other things")
    first = gaz.find(said)
    assert [m.name for m in first] == ["Gonville Hotel", "Cityroomz", "Lensfield Hotel"]
    for n in range(40):  # more spans than it keeps
        gaz.find(followups.tokens(f"gonvilles number {n} lensfields"))
        assert len(gaz._near_kept) <= 8
    assert gaz.find(said) == first


def test_the_words_most_names_share_are_the_shared_name() -> None:
    names = [
        "Windows Terminal Actions",
        "Windows Terminal Panes",
        "Windows Terminal SSH",
        "Selection",
    ]
    assert followups.Gazetteer(names, followups.FUNCTION_WORDS_EN).shared == {"windows", "terminal"}
    hotels = ["Lensfield Hotel", "Gonville Hotel", "Acorn Guest House", "Loch Fyne", "Nandos"]
    assert followups.Gazetteer(hotels, followups.FUNCTION_WORDS_EN).shared == frozenset()


DOCS_TITLES = [
    "Windows Terminal Interaction Settings",
    "Windows Terminal General Profile Settings",
    "Windows Terminal Appearance Profile Settings",
    "Windows Terminal Startup Settings",
    "Windows Terminal Actions",
    "Windows Terminal Panes",
    "Windows Terminal Themes",
    "Windows Terminal Tips",
    "Windows Terminal SSH",
]


@pytest.mark.parametrize(
    ("text", "named"),
    [
        # the shared words misheard: the rest of the name, said together, names the page
        ("tell me about windows tenal interaction settings", [DOCS_TITLES[0]]),
        ("tell me about window's tunnel general profile settings", [DOCS_TITLES[1]]),
        ("tell um me about windows tenal startup settings", [DOCS_TITLES[3]]),
        # words two names hold ("profile settings") name neither; one word left ("panes") is
        # no such key (the distinctive keys decide it: here every one is an ordinary word)
        ("how do i change the profile settings", []),
        ("how do i split panes", []),
    ],
)
def test_a_name_less_the_words_most_names_share_names_it(text: str, named: list[str]) -> None:
    # every one-word partial name an ordinary word ("interaction", "general", as in a real
    # docs base): only the words left said together name a page
    gazetteer = Gazetteer(DOCS_TITLES, FUNCTION_WORDS_EN, lambda word, name: True)
    assert gazetteer.shared == {"windows", "terminal"}
    assert gazetteer.mentions(text) == named


def test_words_left_that_another_name_holds_too_name_no_page() -> None:
    """ "getting started" is the one page's words less the shared ones, and in two other names
    that hold no shared word: said, it names none of the three."""
    titles = [*DOCS_TITLES, "Windows Terminal Getting Started", "Rclone Getting Started",
              "Docker Getting Started"]  # fmt: skip
    gazetteer = Gazetteer(titles, FUNCTION_WORDS_EN, lambda word, name: True)
    assert gazetteer.mentions("tell me about getting started") == []
    assert gazetteer.mentions("i am getting started with rclone") == []
    assert gazetteer.mentions("windows tenal interaction settings") == [DOCS_TITLES[0]]


@pytest.mark.parametrize(
    ("text", "named"),
    [
        ("Rclone gives Failed to load config file", True),  # first
        ("Is it possible to start a Windows Terminal profile from a batch file?", True),  # "a"
        ("Help! The Terminal has no titlebar.", False),  # "the": a common noun
        ("which terminal do you mean", False),
        ("How do I open 2 tabs at once?", False),
    ],
)
def test_the_words_most_names_share_said_as_a_name(text: str, named: bool) -> None:
    shared = frozenset({"windows", "terminal", "rclone"})
    assert followups.names_shared(Utterance.of(text), shared) is named
    assert followups.names_shared(Utterance.of(text), frozenset()) is False


@pytest.mark.parametrize(
    ("text", "code"),
    [
        ("What is conhost.exe?", ["conhost", "exe"]),
        ("run ./bin/rclone now", ["bin", "rclone"]),
        ("the SF86 form", ["sf86"]),
        ("PSReadLine and pCloud", ["psreadline", "pcloud"]),
        ("Is the hotel near the park?", []),
        # a run of slashes after a digit: the words around it, read in one pass (the first
        # pattern backtracked over the run at every start: a turn held the loop half a second)
        ("see conhost.exe 1" + "/" * 4000, ["conhost", "exe"]),
    ],
)
def test_words_written_as_code_are_a_file_name_mixed_digits_or_an_inner_capital(
    text: str, code: list[str]
) -> None:
    assert followups._written_as_code(text) == code


def test_a_keyword_names_a_page_from_the_chunks_the_call_may_reach_only() -> None:
    """ "conhost.exe" is held by one chunk of the FAQ and one of a page the caller's filters
    hide: to that caller it names the FAQ (to others, no page alone); a word only hidden chunks
    hold names nothing, as a word no chunk holds."""
    said = {
        "FAQ": "Conhost.exe is the old console host.",
        "SECRET": "Conhost.exe runs ACCT99 jobs.",
        "OTHER": "Tabs and panes.",
    }
    base = [Chunk(t, "s", f"{t}.md", t, (), text, text) for t, text in said.items()]
    lexical = LexicalIndex.build(c.embed_text for c in base)
    hidden = np.array([True, False, True])
    every = followups.keyword_of(lexical, base, entities.chunk_entity)
    reachable = followups.keyword_of(lexical, base, entities.chunk_entity, hidden)
    assert every("conhost") == ""  # two pages hold it
    assert reachable("conhost") == "FAQ"
    assert every("acct99") == "SECRET"
    assert reachable("acct99") == reachable("nowhere") == ""


def test_a_word_more_chunks_hold_than_are_read_a_turn_names_no_page(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A keyword's postings are read only while rare (``RARE_POSTINGS``): past that, however
    few chunks the caller may reach, the word names nothing and no mask runs over its postings
    (the bound made small here: "conhost" is in two chunks)."""
    base = [
        Chunk(t, "s", f"{t}.md", t, (), text, text)
        for t, text in {"FAQ": "Conhost.exe hosts.", "SECRET": "Conhost.exe runs."}.items()
    ]
    lexical = LexicalIndex.build(c.embed_text for c in base)
    reachable = followups.keyword_of(lexical, base, entities.chunk_entity, np.array([True, False]))
    assert reachable("conhost") == "FAQ"
    monkeypatch.setattr(followups, "RARE_POSTINGS", 1)
    assert reachable("conhost") == ""


def test_the_docs_a_section_check_keeps_are_those_both_lists_hold() -> None:
    """``_within`` (each of few docs bisected into a long sorted list) keeps what an
    intersection would, at either end of the long list, and for empty lists."""
    rng = np.random.default_rng(7)
    for _ in range(200):
        few = np.unique(rng.integers(0, 60, size=rng.integers(0, 8))).astype(np.int32)
        many = np.unique(rng.integers(0, 60, size=rng.integers(0, 50))).astype(np.int32)
        assert followups._within(few, many).tolist() == np.intersect1d(few, many).tolist()


# -- the recent turns a turn is folded with (no entity tracked), through a real engine ----------

WINDOW = {
    "APPEARANCE": ["Change the font face in the appearance settings.", "Font size is in points."],
    "LAYOUT": ["Split the window into panes with alt+shift+plus.", "Resize a pane with the mouse."],
    "STARTUP": ["Change the default profile in the startup settings."],
    "ELEVATION": ["Run a profile as administrator: set elevate in the profile."],
}


async def _planned_after(turns: list[tuple[str, str]], last: str, folder: Path) -> Any:
    """The search ``last`` is planned as after ``turns`` (fed through a real engine over
    WINDOW), and the result it then gets."""
    engine = build_engine(WINDOW, folder, embedder=FakeEmbedder(dimension=1024))
    try:
        await run_turns(engine, turns)
        planned = engine.plan(TurnInput(session_id=SESSION, text=last))
        [result] = await run_turns(engine, [("user", last)])
    finally:
        await engine.aclose()
    assert planned is not None
    return planned, result


async def test_a_skipped_closing_is_not_folded_into_the_next_question(tmp_path: Path) -> None:
    """ "ok great thanks" is skipped (a closing): its words carry nothing, and the question
    after it is folded with the exchange before it, not with them."""
    planned, result = await _planned_after(
        [("user", "How do I change the default profile?"), ("user", "ok great thanks")],
        "can I run it as administrator?",
        tmp_path,
    )
    assert planned.followup.source == Source.RECENT_TURNS
    assert planned.followup.used == "How do I change the default profile?"
    assert planned.query == "How do I change the default profile? can I run it as administrator?"
    assert "thanks" not in result.query
    assert result.hits[0].chunk.title == "ELEVATION"


async def test_a_question_put_in_full_after_a_fragment_is_searched_as_itself(
    tmp_path: Path,
) -> None:
    """After "How do I change the font?" / "and the size?" (a fragment leaning on the turn
    before it), a question of its own is searched as said: folded, it would get "and the
    size?" and none of the topic those words leaned on. A turn that refers back to it is
    still folded."""
    fragment = [("user", "How do I change the font?"), ("user", "and the size?")]
    question = "How do I split the window into panes?"
    planned, result = await _planned_after(fragment, question, tmp_path / "question")
    assert (planned.query, planned.followup) == (question, followups.NO_FOLLOWUP)
    assert result.query == question
    assert result.hits[0].chunk.title == "LAYOUT"
    planned, _ = await _planned_after(
        [*fragment, ("user", question)], "Can I resize them?", tmp_path / "follow-up"
    )
    assert planned.followup.source == Source.RECENT_TURNS
    assert planned.query != "Can I resize them?"


def test_a_fragment_the_agent_answered_or_a_turn_leaning_on_it_is_still_folded() -> None:
    """Only a question after the caller's own fragment, nothing said since, asks anew: after
    the agent's answer the exchange carries its topic (folded, as measured on doc2dial-dev),
    and a turn that points back leans on the fragment."""
    question = "How do I split the window into panes?"
    fragment = (("user", "How do I change the font?"), ("user", "and the size?"))
    assert followups.rewrite(_session(*fragment), question) == question
    answered = _session(*fragment, ("agent", "Font size is set in points."))
    assert followups.rewrite(answered, question).endswith(f"points. {question}")
    after_agent = _session(
        ("agent", "Do you want a bigger font?"), ("user", "yes the size"), g=gaz()
    )
    assert followups.rewrite(after_agent, question) == f"yes the size {question}"
    assert followups.rewrite(_session(*fragment), "Can I make it bold?") == (
        "and the size? Can I make it bold?"
    )
