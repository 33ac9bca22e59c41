"""Relevance: thresholds and max_results, hybrid as a per-base choice, fast source filters, and
the context_url bonus. Real snapshots of real docs, the real embedded model, a real server."""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import pytest

from index.build import build_knowledge_base
from index.embedders.base import Embedder
from index.lexical import SPOKEN_STOPWORDS
from index.snapshot import LoadedSnapshot, load_snapshot
from index.store import LocalStore
from index.tables import ChunkTable
from sidecar.config import Config
from sidecar.edge.server import Sidecar, create_server
from sidecar.gen import retrieval_pb2 as pb
from sidecar.gen import retrieval_pb2_grpc as pb_grpc
from sidecar.snapshots.searcher import Searcher
from sidecar.turn.relevance import FUSION_DEPTH, Query, rank, related_to
from tests.conftest import make_config, shared

# a budget no loaded machine misses (Search takes the sidecar's: AMPLE_BUDGET_MS in conftest):
# these tests judge the dense ranking, never the fallback
BUDGET_MS = 10_000


async def search(sidecar: Sidecar, **fields: Any) -> pb.SearchResponse:
    async with grpc.aio.insecure_channel(f"127.0.0.1:{sidecar.port}") as channel:
        resp: pb.SearchResponse = await pb_grpc.RetrievalStub(channel).Search(
            pb.SearchRequest(**fields), timeout=30
        )
        return resp


async def turn(sidecar: Sidecar, text: str, **fields: Any) -> pb.TurnResponse:
    fields.setdefault("budget_ms", BUDGET_MS)
    async with grpc.aio.insecure_channel(f"127.0.0.1:{sidecar.port}") as channel:
        resp: pb.TurnResponse = await pb_grpc.RetrievalStub(channel).Turn(
            pb.TurnRequest(text=text, is_final=True, **fields), timeout=30
        )
        return resp


# -- thresholds ------------------------------------------------------------------------------


async def test_turn_answers_at_most_max_results_above_min_score(wt_sidecar: Sidecar) -> None:
    resp = await turn(wt_sidecar, "How do I change the color scheme of a profile?")
    assert 0 < len(resp.chunks) <= wt_sidecar.config.sidecar.max_results
    assert all(c.score >= wt_sidecar.config.sidecar.min_score for c in resp.chunks)


@pytest.mark.parametrize(
    "question",
    ["What is a good recipe for banana bread?", "Who won the football world cup in 1998?"],
)
async def test_unrelated_question_returns_nothing(wt_sidecar: Sidecar, question: str) -> None:
    assert list((await turn(wt_sidecar, question)).chunks) == []
    assert list((await search(wt_sidecar, query=question, limit=10)).chunks) == []


async def test_search_min_score_drops_weaker_results(wt_sidecar: Sidecar) -> None:
    loose = await search(wt_sidecar, query="split a pane", limit=10, min_score=0.2)
    strict = await search(wt_sidecar, query="split a pane", limit=10, min_score=0.6)
    assert len(strict.chunks) < len(loose.chunks)
    assert all(c.score >= 0.6 for c in strict.chunks)


@pytest.mark.parametrize(
    ("question", "limit", "min_score"),
    [("split a pane", 7, 0.3), ("How do I change the color scheme of a profile?", 3, 0.0)],
)
async def test_plain_search_answers_as_the_general_path(
    wt_sidecar: Sidecar,
    local_embedder: Embedder,
    question: str,
    limit: int,
    min_score: float,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A Search with no sources, filter, lift or rerank takes the engine's short way (the
    graph's labels and scores written from the chunk table, no chunk decoded); naming every
    source takes the general one (relevance.rank, its hits' chunks decoded and encoded): the
    same chunks, every field, scores and order, by text and by vector alike."""
    vector = local_embedder.embed_batch([question])[0].astype("<f4").tobytes()
    decoded = counting_decodes(monkeypatch)
    for asked in ({"query": question}, {"query": "", "vector": vector}):
        decoded.clear()
        plain = await search(wt_sidecar, limit=limit, min_score=min_score, **asked)
        assert decoded == []  # written from the table's bytes
        general = await search(
            wt_sidecar, limit=limit, min_score=min_score, sources=["terminal-docs"], **asked
        )
        assert decoded
        assert 0 < len(plain.chunks) <= limit
        assert not plain.degraded
        assert not general.degraded
        assert list(plain.chunks) == list(general.chunks)
        assert all(c.score >= min_score for c in plain.chunks)


def counting_decodes(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The labels of the chunks read from the tables as Chunks from now on."""
    decoded: list[int] = []
    read = ChunkTable.__getitem__

    def counted(table: ChunkTable, i: Any) -> Any:
        decoded.append(i)
        return read(table, i)

    monkeypatch.setattr(ChunkTable, "__getitem__", counted)
    return decoded


# -- hybrid: a per-base choice ---------------------------------------------------------------


@pytest.fixture
async def hybrid_sidecar(wt_config: Config, local_embedder: Embedder) -> AsyncIterator[Sidecar]:
    """The same snapshot, served with ``hybrid = true``."""
    (kb,) = wt_config.knowledge_bases
    config = replace(wt_config, knowledge_bases=(replace(kb, hybrid=True),))
    sidecar = await create_server(config, embedder=local_embedder, poll=False)
    yield sidecar
    await sidecar.stop(0.5)


@pytest.mark.parametrize("name", ["snapOnInput", "bellStyle", "altGrAliasing"])
async def test_hybrid_base_fuses_exact_setting_names(
    wt_sidecar: Sidecar, hybrid_sidecar: Sidecar, name: str
) -> None:
    question = f"What is the {name} setting?"  # documented in profile-advanced.md
    # a loose threshold, so that the dense side judges the base on topic well clear of it
    hybrid = await search(hybrid_sidecar, query=question, min_score=0.25)
    dense = await search(wt_sidecar, query=question, min_score=0.25)
    assert hybrid.chunks[0].source_path == "customize-settings/profile-advanced.md"
    assert not hybrid.degraded
    scores = [c.score for c in hybrid.chunks]  # fused: convex combination of [0, 1] scores
    assert scores == sorted(scores, reverse=True)
    assert all(0.0 <= s <= 1.0 for s in scores)
    assert all(c.score >= 0.25 for c in dense.chunks)  # the other base stays dense: cosines


@pytest.mark.parametrize(
    "question",
    [
        "Can you tell me how do I split a pane?",
        "What is the snapOnInput setting?",
        "How do I change the color scheme of a profile?",
    ],
)
def test_hybrid_fuses_exact_scores_of_every_candidate(
    wt_config: Config, local_embedder: Embedder, question: str
) -> None:
    """rank() against the fusion computed from scratch: every candidate of either top list
    scored exactly by both retrievers (cosine of the stored vectors, BM25 of every chunk)."""
    snap = loaded(wt_config)
    vector = local_embedder.embed_batch([question])[0]
    depth = 2 * FUSION_DEPTH  # a limit past the fusion depth: candidates come that deep
    everything = np.asarray(snap.index.get_items(range(len(snap.chunks)), return_type="numpy"))
    cosine = everything @ vector
    bm25 = snap.lexical.scores(question, drop=SPOKEN_STOPWORDS).astype(np.float64)
    dense_top = [label for label, _ in snap.search_dense(vector, depth)]  # the graph's top
    lexical_top = snap.lexical.search(question, depth, drop=SPOKEN_STOPWORDS)
    candidates = list(dict.fromkeys([*dense_top, *(label for label, _ in lexical_top)]))

    def norm(values: np.ndarray) -> np.ndarray:
        return np.asarray((values - values.min()) / (values.max() - values.min()))

    fused = 0.5 * norm(cosine[candidates]) + 0.5 * norm(bm25[candidates])
    order = np.argsort(-fused, kind="stable")[:depth]
    query = Query(question, vector, limit=depth, min_score=-1.0, min_lexical_score=0.0, hybrid=True)
    got = rank(Searcher.build(snap), query)
    assert [label for label, _ in got] == [candidates[i] for i in order]
    assert [score for _, score in got] == pytest.approx(fused[order].tolist(), abs=1e-5)
    # some came from BM25 alone: their cosine was read from the graph, not assumed the worst
    assert {label for label, _ in got} - set(dense_top)


def test_lexical_fallback_ignores_spoken_question_frames(wt_config: Config) -> None:
    snap = loaded(wt_config)
    searcher = Searcher.build(snap)

    def fallback(text: str) -> list[int]:
        query = Query(text, None, limit=5, min_score=0.3, min_lexical_score=1.0)
        return [label for label, _ in rank(searcher, query)]

    spoken = fallback("Um, can you tell me how do I split a pane?")
    assert spoken == fallback("split pane")
    assert "pane" in snap.chunks[spoken[0]].text.lower()
    assert fallback("Can you tell me what it is?") == []  # nothing left to search for


async def test_hybrid_still_drops_unrelated_questions(hybrid_sidecar: Sidecar) -> None:
    resp = await turn(hybrid_sidecar, "What is a good recipe for banana bread?")
    assert list(resp.chunks) == []


# -- source filters --------------------------------------------------------------------------


@pytest.fixture(scope="module")
def two_sources(tmp_path_factory: pytest.TempPathFactory, local_embedder: Embedder) -> Config:
    docs = shared("docs-windows-terminal", "docs")
    config = make_config(
        tmp_path_factory.mktemp("two") / "store",
        [
            {"name": "tutorials", "type": "markdown", "path": str(docs / "tutorials")},
            {"name": "settings", "type": "markdown", "path": str(docs / "customize-settings")},
        ],
    )
    build_knowledge_base(config, config.knowledge_bases[0], local_embedder)
    return config


def loaded(config: Config) -> LoadedSnapshot:
    return load_snapshot(LocalStore(config.index.store).latest_dir("docs"))


def exact_top(snap: LoadedSnapshot, vector: np.ndarray, source: str, k: int) -> list[int]:
    labels = [i for i, c in enumerate(snap.chunks) if c.source == source]
    vectors = np.asarray(snap.index.get_items(labels, return_type="numpy"))
    order = np.argsort(-(vectors @ vector), kind="stable")[:k]
    return [labels[i] for i in order]


def test_partitions_answer_exactly_like_brute_force(
    two_sources: Config, local_embedder: Embedder
) -> None:
    snap = loaded(two_sources)
    assert set(snap.partitions) == {0, 1}
    without = replace(snap, partitions={})  # forces over-fetch from the shared graph
    for question in ("How do I set up a custom prompt?", "Change the tab color"):
        vector = local_embedder.embed_batch([question])[0]
        for source in ("tutorials", "settings"):
            want = exact_top(snap, vector, source, 5)
            assert [label for label, _ in snap.search_dense(vector, 5, [source])] == want
            over = [label for label, _ in without.search_dense(vector, 5, [source])]
            assert len(over) == 5
            assert all(snap.chunks[i].source == source for i in over)
    assert snap.search_dense(vector, 5, ["nope"]) == []
    assert snap.search_dense(vector, 5, ["tutorials", "settings"]) == snap.search_dense(vector, 5)


async def test_source_filter_over_the_wire(two_sources: Config, local_embedder: Embedder) -> None:
    sidecar = await create_server(two_sources, embedder=local_embedder, poll=False)
    try:
        question = "How do I set up a custom prompt with Oh My Posh?"
        everything = await search(sidecar, query=question, limit=5)
        # a low threshold, so the filtered source has something to return
        settings = await search(
            sidecar, query=question, limit=5, min_score=0.05, sources=["settings"]
        )
        with pytest.raises(grpc.aio.AioRpcError) as missing:
            await search(sidecar, query=question, limit=5, sources=["nope"])
    finally:
        await sidecar.stop(0.5)
    assert everything.chunks[0].source == "tutorials"
    assert settings.chunks
    assert {c.source for c in settings.chunks} == {"settings"}
    # an unknown source is refused, naming it and the base's sources, not answered "nothing"
    assert missing.value.code() is grpc.StatusCode.INVALID_ARGUMENT
    assert "no source 'nope'" in str(missing.value.details())
    assert "'settings'" in str(missing.value.details())


# -- context_url -----------------------------------------------------------------------------

PAGE = """---
title: {title}
related_urls: {urls}
---
# {title}

{body}
"""
CONNECT = """To connect an account, open Settings, choose the account and press Connect. Sign in when
you are asked and allow access. The connection shows as active within a minute."""
BILLING = """To change the card you pay with, open Billing, press Edit next to the card, enter the
new number and save. Invoices already sent keep the old card."""


@pytest.fixture(scope="module")
def pages_config(tmp_path_factory: pytest.TempPathFactory, local_embedder: Embedder) -> Config:
    """Two nearly identical "connect" pages told apart only by the page the caller is on."""
    root = tmp_path_factory.mktemp("ctx")
    docs = root / "docs"
    docs.mkdir()
    pages = {
        "calendar.md": ("Connect your calendar", '["/settings/integrations/calendar*"]', CONNECT),
        "slack.md": ("Connect Slack", "/settings/integrations/slack/*", CONNECT),
        "billing.md": ("Update billing details", "https://app.example.com/settings/*", BILLING),
    }
    for name, (title, urls, body) in pages.items():
        page = PAGE.format(title=title, urls=urls, body=body)
        (docs / name).write_text(page, encoding="utf-8")
    config = make_config(root / "store", [{"name": "help", "type": "markdown", "path": str(docs)}])
    build_knowledge_base(config, config.knowledge_bases[0], local_embedder)
    return config


async def test_context_url_lifts_related_chunks(
    pages_config: Config, local_embedder: Embedder
) -> None:
    sidecar = await create_server(pages_config, embedder=local_embedder, poll=False)
    question = "How do I connect my account?"
    try:
        plain = await search(sidecar, query=question)
        on_slack = await search(
            sidecar, query=question, context_url="/settings/integrations/slack/channels"
        )
        on_calendar = await search(
            sidecar,
            query=question,
            context_url="https://app.example.com/settings/integrations/calendar?tab=2",
        )
        unrelated = await turn(
            sidecar,
            "What is a good recipe for banana bread?",
            context_url="/settings/integrations/slack/x",
        )
    finally:
        await sidecar.stop(0.5)
    bonus = pages_config.sidecar.context_bonus
    plain_scores = {c.source_path: c.score for c in plain.chunks}
    assert on_slack.chunks[0].source_path == "slack.md"
    assert on_calendar.chunks[0].source_path == "calendar.md"
    assert on_slack.chunks[0].score == pytest.approx(plain_scores["slack.md"] + bonus, abs=1e-4)
    assert [c.score for c in on_slack.chunks] == sorted(
        (c.score for c in on_slack.chunks), reverse=True
    )
    assert list(unrelated.chunks) == []  # the bonus never lifts a chunk past min_score


@pytest.mark.parametrize(
    ("urls", "page", "related"),
    [
        ("/settings/integrations/*", "/settings/integrations/slack", True),
        ("/settings/integrations/*", "https://app.example.com/settings/integrations/x?a=1", True),
        ("/settings/integrations/*", "/settings/billing", False),
        ("/billing, /settings/integrations/*", "/settings/integrations/x#top", True),
        ("https://docs.example.com/*", "https://docs.example.com/start", True),
        ("https://docs.example.com/*", "/start", False),
        ("", "/settings", False),
    ],
)
def test_related_urls_globs(urls: str, page: str, related: bool) -> None:
    matches = related_to(page)
    assert matches is not None
    assert matches({"related_urls": urls}) is related


def test_no_context_url_matches_nothing() -> None:
    assert related_to("") is None
    assert related_to("   ") is None


def test_metadata_from_frontmatter_lists(pages_config: Config) -> None:
    snap = loaded(pages_config)
    calendar = next(c for c in snap.chunks if c.source_path == "calendar.md")
    # a frontmatter list stays a list (filters match any element); its globs still lift
    assert calendar.metadata["related_urls"] == ("/settings/integrations/calendar*",)
    matches = related_to("https://app.example.com/settings/integrations/calendar-sync")
    assert matches is not None
    assert matches(calendar.metadata)


def test_pages_exist(pages_config: Config) -> None:
    assert Path(pages_config.knowledge_bases[0].sources[0].path or "").is_dir()
