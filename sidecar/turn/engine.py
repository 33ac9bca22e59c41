"""The turn engine: what happens to one caller turn or one explicit search, free of gRPC.

A turn's hot path is: skip? -> follow-up query -> embed (under the budget) -> rank (threshold,
hybrid, context_url: ``sidecar/turn/relevance.py``), all against the base's searcher, read once per
call (``sidecar/snapshots/searcher.py``: the snapshot and everything built from it before it was served;
nothing is built on the event loop). The budget bounds the whole turn: embedding gets
what is left of it less a reserve (``sidecar/turn/budget.py``), and when the embedder misses that, or
fails, the snapshot's lexical index answers and the result says ``degraded``. Query vectors are
cached, and a late one is bounded (``sidecar/turn/query_embedder.py``). Converse streams may hand a
turn a result searched ahead on an interim transcript (``sidecar/turn/prefetch.py``).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import NamedTuple, Protocol

import numpy as np

from index.embedders.base import Embedder, NoDirection, TokenLimited, Vectors, unit_vector
from index.errors import GraphSearchFailed, SnapshotNotFound, VoxrecallError
from index.filters import Allowed
from index.lexical import LexicalIndex
from index.snapshot import LoadedSnapshot
from index.tables import ChunkTable
from index.types import Chunk, MetadataFilter, MetaValue
from sidecar.config import MAX_BUDGET_MS, MAX_LIMIT, SidecarConfig
from sidecar.errors import InvalidArgument, Loading, RetryLater
from sidecar.snapshots.holder import SnapshotHolder
from sidecar.snapshots.searcher import Searcher
from sidecar.turn import followups, relevance, scope
from sidecar.turn.budget import Budget
from sidecar.turn.hits import Hit, Scored, TableHits
from sidecar.turn.query_embedder import QueryEmbedder
from sidecar.turn.rerank import Reranker
from sidecar.turn.rerank import Status as RerankStatus
from sidecar.turn.sessions import Mention, Session, SessionStore, connection
from sidecar.turn.sessions import Speaker as Speaker  # re-exported: TurnInput.speaker's values
from sidecar.turn.skip import Skip, SkipPolicy
from sidecar.turn.text import Utterance, unended

log = logging.getLogger("voxrecall.engine")

# A spoken turn is a few hundred bytes; more is a client bug. In bytes, as every limit is: the
# edge's field limit on text and query is this one (sidecar/edge/limits.py).
MAX_TEXT_BYTES = 16 * 1024
MAX_TEXT_CHARS = MAX_TEXT_BYTES // 4  # characters that fit it whatever they are: where to cut
MAX_SESSION_ID = 256
# a caller's vector as the wire carries it: little-endian float32 (a dtype made once, not per call)
_WIRE_FLOATS = np.dtype("<f4")
# The page prior (doc2dial-style dialogues stay on one help page): each searched turn counts the
# pages of its top PRIOR_COUNTED chunks, one vote each; a chunk on a page the conversation found
# gets up to +PRIOR_BONUS (the page most turns found) among the top PRIOR_DEPTH. Measured on
# doc2dial-dev.
PRIOR_COUNTED = 5
# How much better (in the turn's own cosine) the turn alone must rate its best chunk than the
# folded query's best for the turn to keep its own result outright: a question that plainly
# changes the subject keeps its answer. Below it, a turn folded with the recent exchange is
# answered by both queries ranked by their mean cosine. On doc2dial-dev the mean alone scores
# 0.577 and keeps fewer new questions whole; 0.1 before the mean falls to ~0.51, 0.15 ~0.56.
STANDALONE_MARGIN = 0.15
# The same against a tracked entity, where below it the entity-folded query answers: a named
# entity is strong evidence (on DSTC11, hundreds of places with reviews of the same aspects,
# ranking both by their mean cosine fell from 0.806 to 0.795, and 0.1 let turns stray too).
# Below it the turn still keeps its own result when the folded query's best chunk is not the
# entity's (``_about``): the name did not decide the answer.
ENTITY_STANDALONE_MARGIN = 0.25
# How deep the folded query and the turn alone are each searched before their candidates are
# fused: the top results of either, with room for the page prior to lift one into the top.
FUSION_DEPTH = 20
PRIOR_BONUS = 0.1
# A turn folded with the tracked entity alone (it points back: "what about tab color for it",
# "do they take reservations") asks about that entity, yet the name's words can lose to the
# turn's words on a like page ("Background color" of the appearance settings after the theme
# settings, which have a background section too; another hotel's review of its staff): the
# entity's chunks among the folded query's top PRIOR_DEPTH get +ENTITY_BONUS. Measured (all
# sets, bench/README.md): 0.03 / 0.05 / 0.1 / 0.15 / 0.2 give DSTC11 0.8159 / 0.8173 / 0.8192 /
# 0.8192 / 0.8192 (0.8107 without); at 0.2 a stand-alone question of topics-2 is pulled to it.
ENTITY_BONUS = 0.1
PRIOR_DEPTH = 20
# How far above every other page a short turn that points back at nothing ("I forgot my
# password" after roaming prices) must rate its own best chunk's page, in its own cosine, to be
# answered as said rather than folded (``_switched``): its words single out a page of their own.
# Measured (all sets, bench/README.md): 0.15 moves DSTC11 and spoken DSTC11 by 2 turns each
# (a decor question whose words one other restaurant's review says nearly verbatim), 0.10 by 4
# and 7; the margin over the folded answer's chunk alone instead, 0.15, lost 9 and 6.
SHORT_MARGIN = 0.15
MAX_PAGES = 64  # pages a session keeps counts for
MAX_UNREAD = 4  # agent turns waiting for the next user turn to be counted
MAX_READ_LATER = 4  # agent turns embedded in the background at once, all sessions together
READ_LATER_S = 2.0  # an agent turn's embedding still running this long after it came is dropped


EntityOf = Callable[[Chunk], str]  # a chunk's entity (``followups.Gazetteer.entity_of``)


# The values made on every call (inputs, results, timings, scopes) are slotted dataclasses that
# are never changed once made, but not frozen: a frozen class's ``__init__`` sets each field
# through ``object.__setattr__``, a few times the cost of a plain slotted one, on every call.


@dataclass(slots=True)
class Timings:
    embed_ms: float = 0.0
    search_ms: float = 0.0
    total_ms: float = 0.0


@dataclass(slots=True)
class TurnInput:
    session_id: str
    text: str
    knowledge_base: str = ""
    speaker: str = Speaker.USER
    is_final: bool = True
    budget_ms: int = 0
    sources: tuple[str, ...] = ()
    context_url: str = ""
    filters: tuple[MetadataFilter, ...] = ()
    source_paths: tuple[str, ...] = ()


@dataclass(slots=True)
class SearchInput:
    query: str
    knowledge_base: str = ""
    limit: int = 0
    min_score: float = 0.0
    sources: tuple[str, ...] = ()
    session_id: str = ""
    context_url: str = ""
    vector: bytes = b""
    budget_ms: int = 0
    filters: tuple[MetadataFilter, ...] = ()
    source_paths: tuple[str, ...] = ()


@dataclass(frozen=True, slots=True)
class BasePolicy:
    """What a base says beside its results (``fallback`` when nothing passes, ``instructions``
    always) and its optional rerank stage: one policy for Turn, Search and the tools alike."""

    fallback: str = ""
    instructions: str = ""
    reranker: Reranker | None = None


NO_POLICY = BasePolicy()


@dataclass(slots=True)
class SearchResult:
    hits: Sequence[Hit]  # a plain Search's are TableHits: made from the table when read
    snapshot_version: str
    degraded: bool = False
    timings: Timings = field(default_factory=Timings)
    rerank: RerankStatus = RerankStatus.RERANK_NONE


@dataclass(slots=True)
class Ranking:
    """A search as ranked, before its answer is made: its candidates as (chunk, score) pairs,
    best first, all from ``knowledge_base``. A turn's searches go ``depth`` deep and its follow-up
    folding (``_combined``, the lifts) re-ranks them; ``Hit``s are made only for the few that
    answer (``result``), not for every candidate of both searches."""

    knowledge_base: str
    found: list[Scored]
    snapshot_version: str
    degraded: bool = False
    timings: Timings = field(default_factory=Timings)
    rerank: RerankStatus = RerankStatus.RERANK_NONE
    # how sure the recent-turns fold that ranked it is, as its two searches say (``_agreement``);
    # None: not ranked so
    sure: float | None = None

    def result(self) -> SearchResult:
        """The answer: a ``Hit`` for each kept candidate."""
        kb = self.knowledge_base
        return SearchResult(
            [Hit(kb, chunk, score) for chunk, score in self.found],
            self.snapshot_version,
            self.degraded,
            self.timings,
            self.rerank,
        )


@dataclass(slots=True)
class TurnResult:
    hits: Sequence[Hit]
    context: list[Hit]
    skipped: Skip
    query: str
    snapshot_version: str
    degraded: bool = False
    timings: Timings = field(default_factory=Timings)
    prefetched: bool = False  # answered from a search started on an interim transcript
    truncated: bool = False  # the query was longer than the embedder reads: it was cut there
    followup: followups.FollowUp = followups.NO_FOLLOWUP  # what the query folded in, and why
    rerank: RerankStatus = RerankStatus.RERANK_NONE


@dataclass(frozen=True, slots=True)
class PlannedSearch:
    """What a final user turn with some text would search now (computed ahead by Converse)."""

    knowledge_base: str
    searcher: Searcher
    query: str
    sources: tuple[str, ...]
    context_url: str
    allowed: Allowed | None = None  # the filters' and paths' mask (sidecar/turn/scope.py)
    followup: followups.FollowUp = followups.NO_FOLLOWUP  # what the query folded in
    # the turn's words, where its plan searches them alone too (``_searches_both``): embedded
    # ahead with the query, for the final turn's own two searches
    alone: str = ""
    # a question over the agent's listed options (``query``: its words alone): embedded ahead
    # only, the final ranking each option's chunks itself (``Engine._each_listed``)
    each: bool = False
    # how deep its one search looks (``Engine._one_depth``): a final planned as deep is answered
    # from it, one planned deeper (a page prior found since) searches itself
    depth: int = 0
    # the agent's turns since the caller's last, which its final reads for the page prior
    reads: tuple[str, ...] = ()

    @property
    def queries(self) -> tuple[str, ...]:
        """What a search ahead embeds, in one call: the query, and the turn's words alone."""
        return (self.query, self.alone) if self.alone else (self.query,)


@dataclass(slots=True)
class SearchScope:
    """Where one search looks and what it keeps: the base's searcher, how many results, the
    threshold, and the call's sources, ``context_url`` and filters' mask."""

    searcher: Searcher
    knowledge_base: str
    limit: int
    min_score: float
    sources: Sequence[str] = ()
    context_url: str = ""
    allowed: Allowed | None = None


class Searched(NamedTuple):
    """A turn's two searches (``Engine._searched_both``)."""

    folded: Ranking  # the folded query's ranking at min_score
    own: Ranking  # the turn alone's
    # both before min_score, plain cosines where they are cosines (``Engine._ranked_before``)
    before: tuple[Ranking, Ranking]
    said: Vectors | None  # the turn's own vector; None when not embedded
    target: SearchScope  # what both searched: how deep, within what the call may reach


@dataclass(frozen=True, slots=True)
class PrefetchMatch:
    """A prefetch matching a final turn: its result, or None when it is still embedding past
    the turn's embedding deadline (the turn then falls back rather than embed the words again)."""

    query: str
    result: Ranking | None
    followup: followups.FollowUp = followups.NO_FOLLOWUP  # what the prefetched query folded in
    embedded: tuple[str, ...] = ()  # what the prefetch embedded (``PlannedSearch.queries``)
    depth: int = 0  # how deep it searched (``PlannedSearch.depth``)


class Prefetch(Protocol):
    """A source of results searched ahead (``sidecar.turn.prefetch.Prefetcher``)."""

    async def take(
        self, req: TurnInput, searcher: Searcher, budget: Budget
    ) -> PrefetchMatch | None:
        """The prefetch matching this final turn, waited for until the embedding deadline at
        most, or None when none matches."""
        ...


@dataclass(slots=True)
class Counters:
    turns: int = 0
    skipped: int = 0
    degraded: int = 0
    graph_failures: int = 0  # searches the graph could not answer (GraphSearchFailed)
    prefetched: int = 0  # final turns answered from a prefetch
    prefetch_started: int = 0  # prefetches started on interim transcripts
    prefetch_deferred: int = 0  # paused interims held back by their stream's prefetch bound
    prefetch_too_long: int = 0  # interims over PREFETCH_MAX_BYTES, never searched ahead
    prefetch_refused: int = 0  # interims whose plan was refused (a bad filter), never searched
    by_skip: dict[str, int] = field(default_factory=dict)


class Engine:
    def __init__(
        self,
        config: SidecarConfig,
        embedder: Embedder,
        holder: SnapshotHolder,
        known_bases: frozenset[str],
        sessions: SessionStore,
        skip_policy: SkipPolicy | None = None,
        hybrid_bases: frozenset[str] = frozenset(),
        default_knowledge_base: str = "",
        policies: Mapping[str, BasePolicy] | None = None,
    ) -> None:
        self.config = config
        self.embedder = embedder
        self.holder = holder
        self.known_bases = known_bases
        # With [sidecar] memory_budget_mb: starts loading a base that is not loaded, returns the
        # retry hint in ms (0: it cannot be loaded now). None: every base is loaded at start.
        self.load_on_demand: Callable[[str, str], int] | None = None  # (base, connection)
        self.sessions = sessions
        self.skip_policy = skip_policy or SkipPolicy()
        self.hybrid_bases = hybrid_bases
        self.default_knowledge_base = default_knowledge_base
        self.policies = dict(policies or {})
        self.counters = Counters()
        self._graph_logged: dict[str, str] = {}  # base -> the snapshot whose failure was logged
        self.vectors = QueryEmbedder(embedder, config.query_cache_size)
        self._reading: set[asyncio.Task[Vectors | None]] = set()  # agent turns being embedded
        # whether the embedder reads less than all of a query (TokenLimited); the
        # protocol check is slow, so it is made once here rather than on every turn
        self._truncates: Callable[[str], bool] = _reads_everything
        if isinstance(embedder, TokenLimited):
            self._truncates = embedder.truncates

    # -- entry points -------------------------------------------------------------------------

    async def turn(self, req: TurnInput, prefetch: Prefetch | None = None) -> TurnResult:
        """One transcript event; ``prefetch`` offers results searched ahead (Converse).

        One pipeline over the utterance, normalised and tokenised once: validate -> skip ->
        rewrite (``followups.plan``) -> retrieve -> remember (the turn is recorded with the
        entities it names, found once).
        """
        budget = Budget.start(self._budget_ms(req.budget_ms))
        kb, searcher, allowed = self._admit(req)
        session = self.sessions.get(req.session_id)
        self.counters.turns += 1
        if req.speaker != Speaker.AGENT and not req.is_final:
            return self._skipped(session, Skip.NOT_FINAL, searcher, budget)
        utterance = Utterance.of(req.text)
        gazetteer = searcher.gazetteer
        agent = req.speaker == Speaker.AGENT  # the agent's naming: its names' words alone too
        mentions = gazetteer.find(utterance.named, words=agent)
        if agent:
            self._record(session, Speaker.AGENT, utterance, mentions)
            self._read_later(session, utterance)
            return self._skipped(session, Skip.AGENT_TURN, searcher, budget)
        skip = self._skip(session, utterance)
        if skip is not Skip.NOT_SKIPPED:
            self._record(session, Speaker.USER, utterance, mentions, skipped=True)
            return self._skipped(session, skip, searcher, budget)
        plan = self._plan(session, utterance, mentions, searcher, allowed)
        self._record(session, Speaker.USER, utterance, mentions)
        followups.track_pick(session, plan)
        taken = await prefetch.take(req, searcher, budget) if prefetch is not None else None
        if plan.prior:
            await self._read(session, searcher, kb, budget)
        ahead: Mapping[str, Vectors] = {}
        if taken is not None and not self._answers(taken, plan, req.text, kb, session):
            # the words it embeds that its interim said alike are read from the prefetch's
            ahead = self._said_ahead(taken.embedded, _embeds(plan, req.text))
            taken = None
        prefetched = taken is not None and taken.result is not None
        if taken is not None and taken.result is not None:
            query = taken.query
            result = self._one_answered(searcher, kb, req.text, session, plan, taken.result)
            self.counters.prefetched += 1
        else:
            embed = taken is None
            query, result = await self._retrieve(
                searcher, kb, req, utterance, session, plan, budget, embed, allowed, ahead
            )
        ranked = await self._reranked(kb, query, result, self.config.max_results, budget)
        _moved_on(session, mentions, query == req.text, ranked, gazetteer.entity_of)
        answer = ranked.result()  # the answer's hits, made now for the few kept
        self._remember(session, answer.hits)
        if answer.degraded:
            self.counters.degraded += 1
        return TurnResult(
            hits=answer.hits,
            context=session.context(self._context_limit()),
            skipped=Skip.NOT_SKIPPED,
            query=query,
            snapshot_version=searcher.version,
            degraded=answer.degraded,
            timings=Timings(
                embed_ms=answer.timings.embed_ms,
                search_ms=answer.timings.search_ms,
                total_ms=budget.elapsed_ms(),
            ),
            prefetched=prefetched,
            truncated=self._truncates(query),
            followup=_followup(plan, query, prefetched, ranked.sure),
            rerank=answer.rerank,
        )

    def _admit(self, req: TurnInput) -> tuple[str, Searcher, Allowed | None]:
        """A turn's checks, shared by ``turn`` and ``plan``: its text and session id, its base
        (with the searcher serving it) and what its filters and paths let it reach."""
        self._check_text(req.text, "text", allow_empty=True)
        self._check_session(req.session_id)
        relevance.check_context_url(req.context_url)
        kb = req.knowledge_base or self.default_knowledge_base
        searcher = self.searcher(kb)
        return kb, searcher, scope.resolve(searcher, kb, req.filters, req.source_paths, req.sources)

    async def _retrieve(
        self,
        searcher: Searcher,
        kb: str,
        req: TurnInput,
        utterance: Utterance,
        session: Session,
        plan: followups.Plan,
        budget: Budget,
        embed: bool,
        allowed: Allowed | None = None,
        ahead: Mapping[str, Vectors] | None = None,
    ) -> tuple[str, Ranking]:
        """Search the plan's query; when the plan says so, the turn alone too (both embedded at
        once), and rank the candidates of both by both (``_combined``): a new question keeps
        its own answer where its words clearly prefer it, a follow-up gets the conversation's.
        A query ``ahead`` holds is not embedded: its vector is there (``_said_ahead``)."""
        ahead = ahead or {}
        entity_of = searcher.gazetteer.entity_of
        keep = self._depth(kb, self.config.max_results)  # the rerank stage's candidates
        if plan.each:
            target = self._turn_scope(searcher, kb, req, keep, allowed)
            result = await self._each_listed(target, plan, budget, embed, ahead.get(plan.asked))
            _count_pages(session, result.found, entity_of)
            return plan.query, result
        if not _searches_both(plan, req.text):
            vector = ahead.get(plan.query)
            return await self._retrieve_one(
                searcher, kb, req, session, plan, budget, embed, allowed, vector
            )
        prior = _prior(session, plan)
        depth = max(keep, FUSION_DEPTH)
        target = self._turn_scope(searcher, kb, req, depth, allowed)
        both = await self._searched_both(target, (plan.query, req.text), budget, embed, ahead)
        # the turn's own words' result is what the conversation's pages count
        _count_pages(session, both.own.found, entity_of)
        return self._folded_or_own(searcher, kb, req, utterance, session, plan, both, prior)

    async def _retrieve_one(
        self,
        searcher: Searcher,
        kb: str,
        req: TurnInput,
        session: Session,
        plan: followups.Plan,
        budget: Budget,
        embed: bool,
        allowed: Allowed | None,
        vector: Vectors | None = None,
    ) -> tuple[str, Ranking]:
        """A turn searched once, the plan's query (its entity and the conversation's pages
        lifted); ``vector``: its vector, embedded ahead."""
        depth = self._one_depth(kb, plan, _prior(session, plan) is not None)
        search = self._turn_search(
            searcher, kb, plan.query, req, budget, embed, depth, allowed, vector
        )
        return plan.query, self._one_answered(searcher, kb, req.text, session, plan, await search)

    def _one_answered(
        self, searcher: Searcher, kb: str, text: str, session: Session, plan: followups.Plan,
        found: Ranking,
    ) -> Ranking:  # fmt: skip
        """A turn's one search (``found``: searched at its final, or ahead on its interim, as
        deep, ``_answers``) made its answer: the entity it points at and the conversation's
        pages lifted, cut to the rerank stage's candidates; its pages counted, and a weak name
        it says alone ("Tell me about pCloud."), or that its own result confirms, tracked."""
        entity_of = searcher.gazetteer.entity_of
        keep = self._depth(kb, self.config.max_results)
        lifted = _entity_lifted(found, _pointed_at(plan), entity_of)
        result = _prior_lifted(lifted, _prior(session, plan), entity_of, keep)
        _count_pages(session, result.found, entity_of)
        if plan.query == text:
            _confirm(session, plan, result, entity_of)
        return result

    def _one_depth(self, kb: str, plan: followups.Plan, prior: bool) -> int:
        """How deep a turn's one search looks: the rerank stage's candidates, and PRIOR_DEPTH
        where the conversation's pages (``prior``) or the entity it points at lift chunks from
        below."""
        keep = self._depth(kb, self.config.max_results)
        return max(keep, PRIOR_DEPTH) if prior or _pointed_at(plan) else keep

    def _answers(
        self,
        taken: PrefetchMatch,
        plan: followups.Plan,
        text: str,
        kb: str,
        session: Session,
    ) -> bool:
        """Whether a prefetch's search is the one a final's plan makes, so its answer is the
        one the final searched would get. Not when the final was planned otherwise on its
        interim words ("conhost exe" folded, "conhost.exe?" said as a name of its own); nor for
        a plan of two searches, folded and alone, of which the prefetch ranked the first only
        (the final ranks both, ``_combined``, ``_backed``); nor a question over the agent's
        listed options, ranked per option (``_each_listed``); nor one searched less deep than
        the final's (a page prior the agent's turns gave since: ``_one_depth``)."""
        return (
            taken.followup == plan.followup
            and not _searches_both(plan, text)
            and not plan.each
            and taken.depth == self._one_depth(kb, plan, _prior(session, plan) is not None)
        )

    def _folded_or_own(
        self,
        searcher: Searcher,
        kb: str,
        req: TurnInput,
        utterance: Utterance,
        session: Session,
        plan: followups.Plan,
        both: Searched,
        prior: Mapping[str, float] | None,
    ) -> tuple[str, Ranking]:
        """Which of a turn's two searches (``_searched_both``) answers it: the turn's own words
        where they name their own topic or a short question of its own, else the fold."""
        folded, own = both.folded, both.own
        entity_of = searcher.gazetteer.entity_of
        keep = self._depth(kb, self.config.max_results)
        if _confirm(session, plan, own, entity_of):  # it names its own topic: answered as said
            return req.text, _cut(own, keep)
        if plan.short and self._switched(plan, both):
            return req.text, _cut(own, keep)  # a short question of its own
        if not plan.alone:  # searched alone only to see whether it names its own topic
            found = _entity_lifted(folded, _pointed_at(plan), entity_of)
            return plan.query, _prior_lifted(found, prior, entity_of, keep)
        return self._combined_both(searcher, kb, req, utterance, plan, both, prior)

    def _combined_both(
        self,
        searcher: Searcher,
        kb: str,
        req: TurnInput,
        utterance: Utterance,
        plan: followups.Plan,
        both: Searched,
        prior: Mapping[str, float] | None,
    ) -> tuple[str, Ranking]:
        """A turn searched alone too: the fold backed by the turn's name, the turn's own
        answer, or both ranked by both (``_combined``), with how sure the fold is where its
        searches read cosines (``_agreement``)."""
        folded, own, before = both.folded, both.own, both.before
        entity_of = searcher.gazetteer.entity_of
        keep = self._depth(kb, self.config.max_results)
        if _name_alone(plan, own) and both.said is not None:
            folded = self._backed(both)
        elif _asked_alone(plan, own, utterance, searcher.snapshot.lexical):
            return req.text, _cut(own, keep)  # nothing: the exchange alone found them
        floors = _floors((folded, own), before, self.config.min_score)
        query, result = _combined(plan, req.text, (folded, own), floors, prior, entity_of, keep)
        if plan.followup.source == followups.Source.RECENT_TURNS and query == plan.query:
            result = replace(result, sure=self._agreement(kb, before))
        return query, result

    def _agreement(self, kb: str, before: tuple[Ranking, Ranking]) -> float | None:
        """``_agreement`` of the folded query's plain cosines at ``min_score`` and the turn
        alone's before it (no ``context_url`` lift: the caller's page is no agreement); None
        (the plan's guess) where either was lexical (``degraded``: BM25's scores) or the base
        is hybrid (fused ranks)."""
        folded, every = before
        if folded.degraded or every.degraded or kb in self.hybrid_bases:
            return None
        min_score = self.config.min_score
        kept = replace(folded, found=[hit for hit in folded.found if hit[1] >= min_score])
        return _agreement(kept, every)

    async def _each_listed(
        self,
        target: SearchScope,
        plan: followups.Plan,
        budget: Budget,
        embed: bool,
        vector: Vectors | None = None,
    ) -> Ranking:
        """A question over the agent's listed options (``plan.each``): the turn's words
        (``plan.asked``) embedded once, each option's chunks ranked by them exactly, the best of
        each first (``relevance.each_best``); without a vector, BM25 of the names and the words
        (``degraded``), as any turn's fallback. ``vector``: the words' vector, embedded ahead."""
        start = time.perf_counter()
        if vector is None and embed:
            vector = await self.vectors.get(plan.asked, budget.embed_deadline())
        embed_ms = (time.perf_counter() - start) * 1000.0
        searcher = target.searcher
        groups = [searcher.gazetteer.labels_of(name) for name in plan.each]
        if vector is None or any(labels is None for labels in groups):
            # no vector, or a base whose names' chunks are not indexed: ranked as one query
            found = self._rank(
                target, plan.query if vector is None else plan.asked, vector, embed_ms
            )
            return replace(
                found, found=_each_first(found.found, plan.each, searcher.gazetteer.entity_of)
            )
        start = time.perf_counter()
        query = self._query(target, plan.asked, vector)
        ranked = relevance.each_best(searcher, query, [g for g in groups if g is not None])
        chunks = searcher.chunks
        return Ranking(
            target.knowledge_base,
            [(chunks[label], score) for label, score in ranked],
            snapshot_version=searcher.version,
            timings=Timings(embed_ms=embed_ms, search_ms=(time.perf_counter() - start) * 1000.0),
        )

    async def _turn_search(
        self,
        searcher: Searcher,
        kb: str,
        query: str,
        req: TurnInput,
        budget: Budget,
        embed: bool,
        limit: int = 0,
        allowed: Allowed | None = None,
        vector: Vectors | None = None,
    ) -> Ranking:
        """One of a turn's searches, ``limit`` deep (at least ``max_results``), within what
        the call may reach (``allowed``); ``vector``: the query's, embedded ahead."""
        target = self._turn_scope(searcher, kb, req, limit, allowed)
        deadline = budget.embed_deadline()
        return await self._search(target, query, deadline, vector=vector, embed=embed)

    async def _searched_both(
        self,
        target: SearchScope,
        queries: tuple[str, str],
        budget: Budget,
        embed: bool,
        ahead: Mapping[str, Vectors] | None = None,
    ) -> Searched:
        """A turn's two searches (the folded query, the turn alone), both rankings before
        ``min_score`` (``_floors`` sees where it cut them, ``_agreement`` reads the turn
        alone's cosines; the same rankings where the threshold does not cut a dense one) and
        the turn's own vector (None when not embedded), both queries embedded in one embedder
        call: on the embedded model's one
        worker, two calls would run one after the other, each with its own hand-off to the
        worker thread and back. A query ``ahead`` holds is not embedded: its vector is there."""
        start = time.perf_counter()
        vectors = [(ahead or {}).get(query) for query in queries]
        missing = [query for query, vector in zip(queries, vectors, strict=True) if vector is None]
        if embed and missing:
            got = iter(await self.vectors.get_many(missing, budget.embed_deadline()))
            vectors = [next(got) if vector is None else vector for vector in vectors]
        embed_ms = (time.perf_counter() - start) * 1000.0
        first, first_all = self._ranked_before(target, queries[0], vectors[0], embed_ms)
        own, own_all = self._ranked_before(target, queries[1], vectors[1], embed_ms)
        return Searched(first, own, (first_all, own_all), vectors[1], target)

    def _ranked_before(
        self, target: SearchScope, query: str, vector: Vectors | None, embed_ms: float
    ) -> tuple[Ranking, Ranking]:
        """One of a turn's two searches: its ranking at ``min_score`` (``context_url``'s lift
        added after the threshold, as a single search's) and its plain cosines before it (the
        same ranking where no cosines are there to read: BM25 or a hybrid base). The turn's
        searches are FUSION_DEPTH deep, past the CONTEXT_DEPTH a lift looks down to."""
        if vector is None or target.knowledge_base in self.hybrid_bases:
            ranked = self._rank(target, query, vector, embed_ms)
            return ranked, ranked
        every = self._rank(replace(target, min_score=-1.0, context_url=""), query, vector, embed_ms)
        if every.degraded:  # the graph failed: BM25 answered, min_score is not its threshold
            ranked = self._rank(target, query, None, embed_ms) if target.context_url else every
            return ranked, ranked  # (lifted by the caller's page, as any search's fallback)
        kept = [scored for scored in every.found if scored[1] >= target.min_score]
        related = relevance.related_to(target.context_url) if self.config.context_bonus else None
        if related is not None:
            kept = relevance.context_lifted(kept, _metadata, related, self.config.context_bonus)
        return replace(every, found=kept), every

    def _turn_scope(
        self, searcher: Searcher, kb: str, req: TurnInput, limit: int, allowed: Allowed | None
    ) -> SearchScope:
        return SearchScope(
            searcher,
            kb,
            limit=max(limit, self.config.max_results),
            min_score=self.config.min_score,
            sources=req.sources,
            context_url=req.context_url,
            allowed=allowed,
        )

    def _read_later(self, session: Session, utterance: Utterance) -> None:
        """Embed an agent turn in the background (it is read by the next user turn's page
        prior), off the caller's path and behind every caller's query (``QueryEmbedder.later``),
        and bounded: beyond MAX_READ_LATER at once, it waits."""
        if not self.config.followups.enabled or not utterance.words:
            return
        session.keep_unread(utterance.text, MAX_UNREAD)
        if len(self._reading) >= MAX_READ_LATER:
            return
        loop = asyncio.get_running_loop()
        task = loop.create_task(self.vectors.later(utterance.text, loop.time() + READ_LATER_S))
        self._reading.add(task)
        task.add_done_callback(self._reading.discard)

    async def _read(self, session: Session, searcher: Searcher, kb: str, budget: Budget) -> None:
        """Count the pages the agent's turns since the last user turn are about: their vectors
        were embedded when they arrived (or are joined now, within the turn's embedding time).
        A graph that cannot answer counts nothing: the pages are a prior, not the answer."""
        unread, session.unread = session.unread, []
        for text in unread:
            vector = await self.vectors.get(text, budget.embed_deadline())
            if vector is None:
                continue
            try:
                found = searcher.snapshot.search_dense(vector, PRIOR_COUNTED)
            except GraphSearchFailed as exc:
                self._graph_failed(kb, searcher, exc)
                continue
            chunks = searcher.chunks
            scored = [(chunks[label], score) for label, score in found]
            _count_pages(session, scored, searcher.gazetteer.entity_of)

    def _said_ahead(self, embedded: Sequence[str], wanted: Sequence[str]) -> dict[str, Vectors]:
        """The vectors a prefetch ``embedded`` (still cached) for the queries a final turn
        ``wanted`` that its interim said alike: the same text but for the punctuation and space
        it ends in (``text.unended``: "... is it quiet" for "... is it quiet?"), which a
        recogniser adds to its final. Only this final reads them, as it would be answered from
        a prefetch of words that close (``prefetch.words_match``); nothing else finds them
        under its words, so no other turn's answer hangs on what was embedded before it."""
        said = {unended(query): query for query in embedded}
        found: dict[str, Vectors] = {}
        for query in wanted:
            alike = said.get(unended(query))
            vector = self.vectors.reused(alike) if alike is not None else None
            if vector is not None:
                found[query] = vector
        return found

    def plan(self, req: TurnInput) -> PlannedSearch | None:
        """What a final user turn with ``req.text`` would search now, or None when it would not
        search; validates like ``turn`` and records nothing."""
        kb, searcher, allowed = self._admit(req)
        if req.speaker == Speaker.AGENT:
            return None
        session = self.sessions.get(req.session_id)
        utterance = Utterance.of(req.text)
        if self._skip(session, utterance) is not Skip.NOT_SKIPPED:
            return None
        mentions = searcher.gazetteer.find(utterance.named)
        plan = self._plan(session, utterance, mentions, searcher, allowed)
        alone = req.text if _searches_both(plan, req.text) else ""
        # a question over listed options embeds its words alone: searched ahead so, the final
        # turn finds their vector cached (``_each_listed``)
        query = plan.asked if plan.each else plan.query
        return PlannedSearch(
            kb,
            searcher,
            query,
            req.sources,
            req.context_url,
            allowed,
            plan.followup,
            alone,
            each=bool(plan.each),
            # the pages its final will count: those counted, and the agent's turns it reads
            depth=self._one_depth(kb, plan, plan.prior and bool(session.pages or session.unread)),
            reads=tuple(session.unread) if plan.prior else (),
        )

    def _plan(
        self,
        session: Session,
        utterance: Utterance,
        mentions: tuple[Mention, ...],
        searcher: Searcher,
        allowed: Allowed | None,
    ) -> followups.Plan:
        """``followups.plan`` for a user turn, with the snapshot's names and the keywords of
        the chunks the call may reach (``allowed``)."""
        gazetteer = searcher.gazetteer
        mask = allowed.mask if allowed is not None else None
        keyword = followups.keyword_of(
            searcher.snapshot.lexical, searcher.chunks, gazetteer.entity_of, mask
        )
        section = followups.section_of(
            searcher.snapshot.lexical, searcher.chunks, gazetteer.entity_of, mask
        )
        return followups.plan(
            session,
            utterance,
            mentions,
            self.config.followups,
            gazetteer.shared,
            keyword,
            section,
            gazetteer.sounds,
        )

    async def search_ahead(
        self, planned: PlannedSearch, deadline: float, caller: str = ""
    ) -> Ranking | None:
        """Embed and rank a planned query ahead of its turn, behind every caller's turn and in
        ``caller``'s turn among the others searching ahead (``QueryEmbedder.ahead``); None when
        it was dropped, the embedder missed ``deadline`` (``loop.time()``) or failed: the turn
        itself then decides. A question over listed options is embedded only: the final ranks
        each option's chunks itself, from the vector then cached."""
        target = SearchScope(
            planned.searcher,
            planned.knowledge_base,
            limit=max(planned.depth, self._depth(planned.knowledge_base, self.config.max_results)),
            min_score=self.config.min_score,
            sources=planned.sources,
            context_url=planned.context_url,
            allowed=planned.allowed,
        )
        start = time.perf_counter()
        # the final searches both when it has ``alone``: both embedded now, in one call
        # the agent's turns its final reads (``_read``), embedded now too when not yet: the
        # final then finds them cached, as it finds the query's vector
        wanted = (*planned.queries, *planned.reads)
        vector = (await self.vectors.ahead(wanted, deadline, caller))[0]
        if vector is None or planned.each:  # no lexical search ahead: the turn falls back
            return None
        embed_ms = (time.perf_counter() - start) * 1000.0
        return self._rank(target, planned.query, vector, embed_ms=embed_ms)

    async def aclose(self) -> None:
        """Cancel query embeddings still running in the background."""
        for task in list(self._reading):
            task.cancel()
        await asyncio.gather(*self._reading, return_exceptions=True)
        await self.vectors.aclose()
        for policy in self.policies.values():
            if policy.reranker is not None:
                await policy.reranker.aclose()

    async def search(self, req: SearchInput) -> SearchResult:
        started = time.monotonic()
        total_ms = self._budget_ms(req.budget_ms)
        self._check_search(req)
        kb = req.knowledge_base or self.default_knowledge_base
        searcher = self.searcher(kb)
        allowed = scope.resolve(searcher, kb, req.filters, req.source_paths, req.sources)
        if req.vector and allowed is None and self._plain(req, kb, searcher, ""):
            result = self._nearest_to(searcher, kb, req.limit, req.min_score, req.vector)
        else:
            budget = Budget.start(total_ms, started=started)
            result = await self._searched(req, kb, searcher, allowed, budget)
        if req.session_id:
            self._remember(self.sessions.get(req.session_id), result.hits)
        result.timings.total_ms = (time.monotonic() - started) * 1000.0  # this call's alone
        return result

    async def _searched(
        self,
        req: SearchInput,
        kb: str,
        searcher: Searcher,
        allowed: Allowed | None,
        budget: Budget,
    ) -> SearchResult:
        """Any Search but a plain one given its vector: a plain one by its words (``_nearest``),
        or one with filters, sources, a lift, a lexical side or a rerank stage."""
        vector = self._vector_from_bytes(req.vector, searcher.snapshot) if req.vector else None
        limit = req.limit or self.config.max_results
        min_score = req.min_score or self.config.min_score
        query = "" if vector is not None else req.query  # a vector's query is for logs only
        if vector is None and allowed is None and self._plain(req, kb, searcher, query):
            return await self._nearest(searcher, kb, query, limit, min_score, budget)
        target = SearchScope(
            searcher,
            kb,
            limit=self._depth(kb, limit),
            min_score=min_score,
            sources=req.sources,
            context_url=req.context_url,
            allowed=allowed,
        )
        ranked = await self._search(target, query, budget.embed_deadline(), vector=vector)
        return (await self._reranked(kb, query, ranked, limit, budget)).result()

    def _check_search(self, req: SearchInput) -> None:
        # with a vector the query is for logging only: checked like any text, never searched
        self._check_text(req.query, "query", allow_empty=bool(req.vector))
        self._check_session(req.session_id)
        relevance.check_context_url(req.context_url)
        if req.limit < 0 or req.limit > MAX_LIMIT:
            raise InvalidArgument(
                f"limit must be between 1 and {MAX_LIMIT} (0 for the default), got {req.limit}"
            )
        if not (-1.0 <= req.min_score <= 1.0):
            raise InvalidArgument(f"min_score must be between -1 and 1, got {req.min_score}")

    def _plain(self, req: SearchInput, kb: str, searcher: Searcher, query: str) -> bool:
        """Whether a Search (with no filter) is the common one: the graph's nearest chunks
        alone, no sources, no ``context_url`` lift, no summary prong, no lexical side, no
        rerank stage (``nearest_to`` and ``_nearest``, which rank as ``relevance.dense``
        does)."""
        return (
            not req.sources
            and not (self.config.context_bonus and req.context_url.strip())
            and searcher.snapshot.summaries is None
            and not (query and kb in self.hybrid_bases)
            and self.policy(kb).reranker is None
        )

    def nearest_to(
        self, kb: str, vector: bytes, limit: int, min_score: float
    ) -> SearchResult | None:
        """The commonest Search in one step, for the servicer to call before it makes a
        ``SearchInput``: a vector and nothing else (no words, session, sources, filter, page
        paths or lift: the caller has seen to those), over a base its graph alone answers
        (``_plain``), for a caller with no filters of its own (``scope.caller_filters``). Checked
        and answered as ``search`` answers it (``_nearest_to``); None, before the base is used,
        for a call ``search`` must answer instead: any other base, or a limit or score it
        refuses."""
        started = time.monotonic()
        if not (0 <= limit <= MAX_LIMIT and -1.0 <= min_score <= 1.0) or scope.caller_filters.get():
            return None
        kb = kb or self.default_knowledge_base
        served = self.holder.get(kb)  # read, not used: ``search`` uses it once, if it must
        if self.policy(kb).reranker is not None or (
            served is not None and served.summaries is not None
        ):
            return None
        result = self._nearest_to(self.searcher(kb), kb, limit, min_score, vector)
        result.timings.total_ms = (time.monotonic() - started) * 1000.0
        return result

    def _nearest_to(
        self,
        searcher: Searcher,
        kb: str,
        limit: int,
        min_score: float,
        vector: bytes,
    ) -> SearchResult:
        """A plain Search (``_plain``) given its vector: the vector checked and scaled (its
        ``embed_ms``), then the graph's answer straight into hits; a graph that fails it counted
        and answered as any search's (``_unsearched``)."""
        start = time.perf_counter()
        unit = self._vector_from_bytes(vector, searcher.snapshot)
        embed_ms = (time.perf_counter() - start) * 1000.0
        limit = limit or self.config.max_results
        min_score = min_score or self.config.min_score
        return self._from_graph(searcher, kb, "", unit, limit, min_score, embed_ms)

    async def _nearest(
        self,
        searcher: Searcher,
        kb: str,
        query: str,
        limit: int,
        min_score: float,
        budget: Budget,
    ) -> SearchResult:
        """A plain Search (``_plain``) by its words: embed by the budget's deadline, then the
        graph's answer straight into hits, in one pass; without a vector, the lexical fallback
        as any search's."""
        start = time.perf_counter()
        vector = await self.vectors.get(query, budget.embed_deadline())
        embed_ms = (time.perf_counter() - start) * 1000.0
        if vector is None:
            target = SearchScope(searcher, kb, limit=limit, min_score=min_score)
            return self._rank(target, query, None, embed_ms=embed_ms).result()
        return self._from_graph(searcher, kb, query, vector, limit, min_score, embed_ms)

    def _from_graph(
        self,
        searcher: Searcher,
        kb: str,
        query: str,
        vector: Vectors,
        limit: int,
        min_score: float,
        embed_ms: float,
    ) -> SearchResult:
        """A plain Search's graph answer straight into hits (``_nearest_hits``); a graph that
        fails it counted and answered as any search's (``_unsearched``)."""
        start = time.perf_counter()
        try:
            hits = _nearest_hits(searcher, kb, vector, limit, min_score)
        except GraphSearchFailed as exc:
            target = SearchScope(searcher, kb, limit=limit, min_score=min_score)
            return self._unsearched(target, query, exc, embed_ms).result()
        search_ms = (time.perf_counter() - start) * 1000.0
        return SearchResult(hits, searcher.version, timings=Timings(embed_ms, search_ms))

    def end_session(self, session_id: str) -> bool:
        self._check_session(session_id)
        return self.sessions.end(session_id)

    # -- the search itself ---------------------------------------------------------------------

    async def _search(
        self,
        target: SearchScope,
        query: str,
        deadline: float,
        *,
        vector: Vectors | None = None,
        embed: bool = True,
    ) -> Ranking:
        """Embed by ``deadline`` (``loop.time()``; unless given a vector, or told not to), then
        rank: without a vector, lexically (the result says ``degraded``)."""
        start = time.perf_counter()
        if vector is None and embed:
            vector = await self.vectors.get(query, deadline)
        return self._rank(target, query, vector, embed_ms=(time.perf_counter() - start) * 1000.0)

    def _rank(
        self, target: SearchScope, query: str, vector: Vectors | None, embed_ms: float
    ) -> Ranking:
        start = time.perf_counter()
        searcher = target.searcher
        try:
            ranked = relevance.rank(searcher, self._query(target, query, vector))
        except GraphSearchFailed as exc:
            return self._unsearched(target, query, exc, embed_ms)
        chunks = searcher.chunks
        return Ranking(
            target.knowledge_base,
            [(chunks[label], score) for label, score in ranked],
            snapshot_version=searcher.version,
            degraded=vector is None,
            timings=Timings(embed_ms=embed_ms, search_ms=(time.perf_counter() - start) * 1000.0),
        )

    def _unsearched(
        self, target: SearchScope, query: str, exc: GraphSearchFailed, embed_ms: float
    ) -> Ranking:
        """A search the graph could not answer: counted, then answered as a missed embedding
        is, by the lexical index (``degraded``): a voice agent gets an answer mid-call, where
        INTERNAL would leave it none. A search by a vector alone has no text to fall back on:
        the error (INTERNAL, naming the graph) is raised on, never hnswlib's UNKNOWN."""
        self._graph_failed(target.knowledge_base, target.searcher, exc)
        if not query:
            raise exc
        return self._rank(target, query, None, embed_ms)

    def _query(self, target: SearchScope, query: str, vector: Vectors | None) -> relevance.Query:
        return relevance.Query(
            text=query,
            vector=vector,
            limit=target.limit,
            min_score=target.min_score,
            min_lexical_score=self.config.min_lexical_score,
            sources=target.sources,
            hybrid=target.knowledge_base in self.hybrid_bases and bool(query),  # no text: dense
            context_url=target.context_url,
            context_bonus=self.config.context_bonus,
            allowed=target.allowed,
        )

    def _backed(self, both: Searched) -> Ranking:
        """``_backed``, or the folded query's ranking as searched when the graph cannot answer
        the turn's dense search on a hybrid base (``_alone_cosines``): the rule is skipped
        (counted and logged as every search the graph fails), rather than the turn failing
        with the graph's error where every other search of it is answered."""
        try:
            return _backed(both.folded, self._alone_cosines(both), self.config.min_score)
        except GraphSearchFailed as exc:
            self._graph_failed(both.target.knowledge_base, both.target.searcher, exc)
            return both.folded

    def _switched(self, plan: followups.Plan, both: Searched) -> bool:
        """``_switched`` against the folded query's answer (the tracked entity's chunks lifted
        where the turn is folded with it alone), or False when the graph cannot answer the
        turn's dense search on a hybrid base (counted and logged as every search the graph
        fails): the turn is then answered as folded."""
        target = both.target
        entity_of = target.searcher.gazetteer.entity_of
        answer = _entity_lifted(both.folded, _pointed_at(plan), entity_of)
        if both.said is None or answer.degraded or both.own.degraded:
            return False
        try:
            return _switched(entity_of, answer, both.own, self._alone_cosines(both))
        except GraphSearchFailed as exc:
            self._graph_failed(target.knowledge_base, target.searcher, exc)
            return False

    def _alone_cosines(self, both: Searched) -> Sequence[Scored]:
        """The turn alone's chunks by cosine, as deep as its search and before ``min_score``,
        within what the call may reach: its ranking before the threshold, or on a hybrid base
        (whose ranking is fused) a dense one of its vector, made as every dense search is."""
        target = both.target
        if target.knowledge_base not in self.hybrid_bases:
            return both.before[1].found
        plain = self._query(replace(target, min_score=-1.0, context_url=""), "", both.said)
        chunks = target.searcher.chunks  # no text: dense; the graph's error is the caller's
        return [(chunks[label], score) for label, score in relevance.rank(target.searcher, plain)]

    def _graph_failed(self, kb: str, searcher: Searcher, exc: GraphSearchFailed) -> None:
        """Count a search the graph could not answer; log it once per snapshot of a base (one
        such graph fails a share of every turn's searches: a line per turn would flood)."""
        self.counters.graph_failures += 1
        version = searcher.version
        if self._graph_logged.get(kb) != version:
            self._graph_logged[kb] = version
            log.error(
                "base %r snapshot %s: %s; answering lexically (degraded) until a new snapshot",
                kb,
                version,
                exc,
            )

    # -- the rerank stage ------------------------------------------------------------------------

    def policy(self, kb: str) -> BasePolicy:
        return self.policies.get(kb, NO_POLICY)

    def _depth(self, kb: str, limit: int) -> int:
        """How many candidates a search of ``kb`` keeps: the rerank stage's, when it has one."""
        reranker = self.policy(kb).reranker
        return max(limit, reranker.config.candidates) if reranker is not None else limit

    async def _reranked(
        self, kb: str, query: str, result: Ranking, limit: int, budget: Budget
    ) -> Ranking:
        """The result in the reranker's order, cut to ``limit``; in vector order, saying why,
        when the reranker misses its share of what is left of the budget or fails."""
        reranker = self.policy(kb).reranker
        if reranker is None or len(result.found) < 2 or not query:
            return _cut(result, limit)
        left_ms = max(0.0, budget.remaining_ms() - budget.reserve_ms) * reranker.config.budget_share
        deadline = asyncio.get_running_loop().time() + left_ms / 1000.0
        found = result.found
        order, status = await reranker.order(query, [c.embed_text for c, _ in found], deadline)
        kept = [found[i] for i in order] if order is not None else found
        return replace(result, found=kept[:limit], rerank=status)

    # -- helpers -------------------------------------------------------------------------------

    def snapshot(self, kb: str) -> LoadedSnapshot:
        """The snapshot serving ``kb``, or the error a caller can act on."""
        return self.searcher(kb).snapshot

    def searcher(self, kb: str) -> Searcher:
        """The searcher serving ``kb`` (read once per call), or the error a caller can act on."""
        if not kb:
            raise InvalidArgument("knowledge_base is empty and no default is configured")
        if kb not in self.known_bases:
            raise scope.unknown_base(kb, self.known_bases)
        load = self.load_on_demand
        peer = connection() if load is not None else ""  # whose working set the base is in
        searcher = self.holder.use(kb, peer)
        if searcher is None and load is not None:
            retry_ms = load(kb, peer)
            if retry_ms:
                raise Loading(
                    f"knowledge base {kb!r} is loading (its first call, or it was evicted to keep "
                    "within [sidecar] memory_budget_mb, or it waits for room while other callers "
                    f"keep using theirs): retry in about {retry_ms} ms",
                    retry_ms,
                )
        if searcher is None:
            raise self._not_loaded(kb)
        return searcher

    def _not_loaded(self, kb: str) -> VoxrecallError:
        """Why ``kb`` has nothing to serve: its pointer could not be read (read again, a retry
        hint), its newest version could not be fetched (tried again), or was refused (a good one
        must be published), or none was ever published."""
        refusal = self.holder.last_refusal(kb)
        again = (
            "on a call after [sidecar] poll_seconds"
            if self.load_on_demand is not None
            else "on the next poll"
        )
        if refusal is not None and kb in self.holder.unreadable:
            return self._unreadable(kb, str(refusal), again)
        if refusal is not None and refusal.retried:
            return SnapshotNotFound(
                f"knowledge base {kb!r} has no snapshot loaded: fetching its newest version "
                f"failed ({refusal}), a fault of the store or this sidecar's disk, not of the "
                f"snapshot; it is tried again {again}"
            )
        if refusal is not None:
            return SnapshotNotFound(
                f"knowledge base {kb!r} has no snapshot loaded: its newest version was refused "
                f"({refusal}); publish a good one (`voxrecall index build`): it is tried {again}"
            )
        return SnapshotNotFound(
            f"knowledge base {kb!r} has no snapshot loaded yet: run `voxrecall index build` "
            "against the sidecar's store, and it is picked up on the next poll"
        )

    def _unreadable(self, kb: str, refusal: str, again: str) -> RetryLater:
        """A base whose pointer (LATEST) the store could not give at its last read: retry after
        the next read, a poll away."""
        poll_s = self.config.poll_seconds
        return RetryLater(
            f"knowledge base {kb!r} has no snapshot loaded: its pointer (LATEST) could not be "
            f"read ({refusal}), a fault of the store, not of a snapshot; it is read again {again}: "
            f"retry in about {poll_s:g} s",
            round(poll_s * 1000),
        )

    def _skipped(
        self, session: Session, skip: Skip, searcher: Searcher, budget: Budget
    ) -> TurnResult:
        self.counters.skipped += 1
        self.counters.by_skip[skip.name] = self.counters.by_skip.get(skip.name, 0) + 1
        return TurnResult(
            hits=[],
            context=session.context(self._context_limit()),
            skipped=skip,
            query="",
            snapshot_version=searcher.version,
            timings=Timings(total_ms=budget.elapsed_ms()),
        )

    def _skip(self, session: Session, utterance: Utterance) -> Skip:
        """Why a final user turn needs no search, or NOT_SKIPPED. A reply to the agent's
        question ("Yes." to "Do you want to know how to apply?") is an answer, searched with
        the question, not a backchannel."""
        skip = self.skip_policy.classify_words(utterance.words)
        if skip is not Skip.BACKCHANNEL or not self.config.followups.enabled:
            return skip
        if followups.replies(utterance) and followups.agent_question(session):
            return Skip.NOT_SKIPPED
        return skip

    @staticmethod
    def _record(
        session: Session,
        speaker: str,
        utterance: Utterance,
        mentions: tuple[Mention, ...],
        skipped: bool = False,
    ) -> None:
        # an agent's turn keeps whether it asks: the caller's next turns read it (agent_question)
        question = followups.asks(utterance) if speaker == Speaker.AGENT else None
        said = session.record_turn(speaker, utterance.text, mentions, question, skipped)
        followups.remember(session, said)

    @staticmethod
    def _remember(session: Session, hits: Sequence[Hit]) -> None:
        session.retain(hits)

    def _context_limit(self) -> int:
        return self.config.context_turns * self.config.max_results

    def _budget_ms(self, requested: int) -> float:
        if requested < 0 or requested > MAX_BUDGET_MS:
            raise InvalidArgument(
                f"budget_ms must be between 1 and {MAX_BUDGET_MS} (0 for the default), got {requested}"
            )
        return float(requested or self.config.budget_ms)

    @staticmethod
    def _check_text(text: str, field: str, *, allow_empty: bool) -> None:
        """``field`` (text, or Search's query) within ``MAX_TEXT_BYTES``, named as the caller
        sent it; encoded only when its length cannot decide."""
        if not allow_empty and not text.strip():
            raise InvalidArgument(f"{field} is empty: send the words to search for")
        fits = len(text) * 4 <= MAX_TEXT_BYTES
        size = len(text) if fits else len(text.encode("utf-8", "surrogatepass"))
        if size > MAX_TEXT_BYTES:
            raise InvalidArgument(f"{field} is {size} bytes; the limit is {MAX_TEXT_BYTES}")

    @staticmethod
    def _check_session(session_id: str) -> None:
        if len(session_id) > MAX_SESSION_ID:
            raise InvalidArgument(
                f"session_id is {len(session_id)} characters; the limit is {MAX_SESSION_ID}"
            )

    def _vector_from_bytes(self, data: bytes, snapshot: LoadedSnapshot) -> Vectors:
        dim = snapshot.manifest.embedder.dimension
        if len(data) != dim * 4:
            raise InvalidArgument(
                f"vector is {len(data)} bytes; this snapshot needs {dim} float32 values ({dim * 4} bytes, little-endian)"
            )
        given = np.frombuffer(data, dtype=_WIRE_FLOATS)
        try:
            return unit_vector(given)
        except NoDirection as exc:
            if exc.at is None:
                raise InvalidArgument(
                    "vector is all zeros: it has no direction to search by"
                ) from None
            raise InvalidArgument(
                f"vector[{exc.at}] is {given[exc.at]}: every component must be finite"
            ) from None


def _nearest_hits(
    searcher: Searcher, kb: str, vector: Vectors, limit: int, min_score: float
) -> Sequence[Hit]:
    """The graph's nearest ``limit`` chunks with cosine >= ``min_score``, best first, as hits
    (``relevance.dense`` without a lift or sources): labels and scores (``TableHits``), which
    the servicer writes from the answers written at load, or from the table, without decoding
    a chunk."""
    snapshot = searcher.snapshot
    chunks = snapshot.chunks
    found = snapshot.nearest(vector, limit, min_score)
    if type(chunks) is ChunkTable:
        return TableHits(kb, chunks, found, searcher.answers)
    return [Hit(kb, chunks[label], score) for label, score in found]


def _count_pages(session: Session, found: Sequence[Scored], entity_of: EntityOf) -> None:
    """Add what one turn's search found to the session's pages (``Session.pages``): one vote
    for each page among its top PRIOR_COUNTED, keeping the MAX_PAGES most found. The prior is
    how many turns found a page, not how much of their tops it filled: a page of many like
    sections (a fee per vehicle class, a list of questions) fills the top of every search near
    its subject, and summed it outvoted the page each turn found first."""
    pages = dict.fromkeys(entity_of(chunk) for chunk, _ in found[:PRIOR_COUNTED])
    session.count_pages([(page, 1.0) for page in pages], MAX_PAGES)


def _prior_lifted(
    result: Ranking, prior: Mapping[str, float] | None, entity_of: EntityOf, limit: int
) -> Ranking:
    """``result`` with the page prior applied (when there is one), cut to ``limit``."""
    if prior and not result.degraded:
        return replace(result, found=_lifted(result.found, prior, entity_of)[:limit])
    return _cut(result, limit)


def _prior(session: Session, plan: followups.Plan) -> Mapping[str, float] | None:
    """The pages the conversation has been on, where the plan lifts them (``Plan.prior``)."""
    return session.pages if plan.prior and session.pages else None


def _pointed_at(plan: followups.Plan) -> str:
    """The tracked entity a turn points back at and is folded with alone ("what about tab
    color for it"), whose chunks its search lifts (``_entity_lifted``); "" for any other plan."""
    if plan.followup.source in followups.ONE_ENTITY and not plan.alone:
        return plan.followup.used
    return ""


def _entity_lifted(result: Ranking, entity: str, entity_of: EntityOf) -> Ranking:
    """``result`` with ``entity``'s chunks lifted by ENTITY_BONUS (none when ``entity`` is "" or
    the result is lexical): the turn asked about that page, and another page's like section
    ("Background color" of the appearance settings, asked after the theme settings) that the
    turn's words rate a little higher is not what it asked about."""
    if not entity or result.degraded:
        return result
    lifted = [
        _plus(scored, ENTITY_BONUS) if entity_of(scored[0]) == entity else scored
        for scored in result.found
    ]
    lifted.sort(key=_by_score)
    return replace(result, found=lifted)


def _by_score(scored: Scored) -> float:
    """The sort key of a ranking, best first (a stable sort: ties keep their order)."""
    return -scored[1]


def _cut(result: Ranking, limit: int) -> Ranking:
    return result if len(result.found) <= limit else replace(result, found=result.found[:limit])


def _lifted(
    found: Sequence[Scored], pages: Mapping[str, float], entity_of: EntityOf
) -> list[Scored]:
    """The hits re-ranked with the page prior: + PRIOR_BONUS times how much the conversation
    found a hit's page, relative to the page it found most (the score reported is the lifted
    one, as ``context_url``'s bonus is)."""
    most = max(pages.values())
    if most <= 0.0:
        return list(found)
    bonus = PRIOR_BONUS / most
    lifted = [_plus(scored, bonus * pages.get(entity_of(scored[0]), 0.0)) for scored in found]
    lifted.sort(key=_by_score)
    return lifted


def _plus(scored: Scored, bonus: float) -> Scored:
    """``scored`` with ``bonus`` added to its score; the pair itself when there is none."""
    return (scored[0], scored[1] + bonus) if bonus else scored


def _reads_everything(text: str) -> bool:
    return False


def _confirm(session: Session, plan: followups.Plan, own: Ranking, entity_of: EntityOf) -> bool:
    """Track the entity the turn named weakly when its own search finds only that entity's
    chunks at the top (``followups.confirmed``), or when the turn says nothing but its name
    (``followups.only_names``); whether it did."""
    if plan.names:  # no ordinary reading of the words is left: they name it
        followups.confirm(session, plan.named[0])
        return True
    if own.degraded or not plan.named:
        return False
    named = followups.confirmed(plan.named, [entity_of(chunk) for chunk, _ in own.found])
    if named is not None:
        followups.confirm(session, named)
    return named is not None


def _embeds(plan: followups.Plan, text: str) -> tuple[str, ...]:
    """What ``Engine._retrieve`` embeds for a turn of ``text`` planned so: the words of a
    question over listed options, the folded query and the turn alone, or the plan's query."""
    if plan.each:
        return (plan.asked,)
    return (plan.query, text) if _searches_both(plan, text) else (plan.query,)


def _searches_both(plan: followups.Plan, text: str) -> bool:
    """Whether ``Engine._retrieve`` searches the turn alone beside the plan's folded query:
    to rank both (``plan.alone``), or to see whether the turn names its own topic
    (``plan.named``, ``_confirm``)."""
    return plan.query != text and (plan.alone or plan.short or bool(plan.named))


def _moved_on(
    session: Session,
    mentions: Sequence[Mention],
    as_said: bool,
    result: Ranking,
    entity_of: EntityOf,
) -> None:
    """Let the tracked entity go (``followups.leave``) when the turn was answered as said and
    its best chunk is another page's, though it did not name the entity (``_about``): the
    caller moved on ("Tell me about Bisync." ... "can rclone sync directly from drive to s3",
    answered from the FAQ). The next question that does not point back is then searched as
    said: folded with the entity, its words can lose to the name's ("tcp lookup ... no such
    host" to Bisync's "Lock file"). A turn that points back ("what about filters for it")
    is still folded with it. A turn answered with the entity folded in never lets it go."""
    tracked = session.entity
    if tracked is None or session.left or not as_said or result.degraded or not result.found:
        return
    if any(m.name == tracked.name for m in mentions):
        return
    if entity_of(result.found[0][0]) != tracked.name:
        followups.leave(session)


def _combined(
    plan: followups.Plan,
    text: str,
    searched: tuple[Ranking, Ranking],
    floors: tuple[float, float],
    prior: Mapping[str, float] | None,
    entity_of: EntityOf,
    limit: int,
) -> tuple[str, Ranking]:
    """The folded query's and the turn's own candidates (``searched``) ranked by both
    (``_fused``, a chunk one did not return counted at its floor: ``_floors``), the page prior
    after; the query reported is the turn's when its own words decided the answer."""
    folded, own = searched
    if folded.degraded or own.degraded:
        # BM25 scores of two queries are on no common scale: the planned query answers
        chosen, query = (folded, plan.query) if folded.found or not own.found else (own, text)
        return query, _cut(chosen, limit)
    entity = plan.followup.source in followups.ONE_ENTITY
    margin = ENTITY_STANDALONE_MARGIN if entity else STANDALONE_MARGIN
    if not plan.refers and _stands_alone(folded, own, margin):
        return text, _cut(own, limit)
    if entity:
        if not _about(folded, plan.followup.used, entity_of):
            return text, _cut(own, limit)  # the entity did not decide it: the turn's words did
        return plan.query, _cut(folded, limit)
    found = _fused(folded.found, own.found, floors)
    if prior:
        found = _lifted(found, prior, entity_of)
    timings = Timings(
        embed_ms=max(folded.timings.embed_ms, own.timings.embed_ms),
        search_ms=folded.timings.search_ms + own.timings.search_ms,
    )
    result = Ranking(folded.knowledge_base, found[:limit], folded.snapshot_version, timings=timings)
    return (text if _own_answer(found, folded, own) else plan.query), result


def _metadata(chunk: Chunk) -> Mapping[str, MetaValue]:
    return chunk.metadata


def _agreement(folded: Ranking, own: Ranking) -> float | None:
    """How sure a turn folded with the recent exchange is of its answer, from its two searches:
    the mean of the turn alone's cosine for the folded query's best chunk and the folded
    query's cosine for the turn alone's best (a chunk a search did not return counts at its
    last score), within 0 to 1. Where the two agree the fold was right more often: on
    doc2dial-dev's 481 turns answered so, by quarter of it, hit@3 0.46, 0.52, 0.65, 0.80
    (the constant 0.5 it replaces said nothing). None when either found nothing."""
    if not folded.found or not own.found:
        return None
    top_folded, top_own = folded.found[0][0].chunk_id, own.found[0][0].chunk_id
    theirs = next((s for c, s in own.found if c.chunk_id == top_folded), own.found[-1][1])
    ours = next((s for c, s in folded.found if c.chunk_id == top_own), folded.found[-1][1])
    return round(min(1.0, max(0.0, (theirs + ours) / 2.0)), 3)


def _followup(
    plan: followups.Plan, query: str, prefetched: bool, sure: float | None
) -> followups.FollowUp:
    """What a turn's answer folded in (``TurnResult.followup``): the plan's, when its query
    answered (nothing when the turn's own words did), as sure as its searches said where they
    said (``_agreement``)."""
    if not prefetched and query != plan.query:
        return followups.NO_FOLLOWUP
    if sure is None or plan.followup.source != followups.Source.RECENT_TURNS:
        return plan.followup
    return replace(plan.followup, confidence=sure)


def _stands_alone(folded: Ranking, own: Ranking, margin: float) -> bool:
    """Whether the turn alone prefers another chunk than the folded query found by ``margin``
    of its own cosine (its best against its score for the folded
    query's best; below its last one when not among them)."""
    if not folded.found or not own.found:
        return bool(own.found)
    top = folded.found[0][0].chunk_id
    theirs = next((s for c, s in own.found if c.chunk_id == top), own.found[-1][1])
    best, best_score = own.found[0]
    return best.chunk_id != top and best_score - theirs >= margin


def _switched(
    entity_of: EntityOf, folded: Ranking, own: Ranking, cosines: Sequence[Scored]
) -> bool:
    """Whether a short turn that points back at nothing (``Plan.short``: "I forgot my password"
    after roaming prices) asks a question of its own: its own best chunk's page is not the
    folded answer's best chunk's, and its own words single that page out, rating it
    SHORT_MARGIN above any other page in cosine (read from the turn's own ``cosines``, as deep
    as its search, before ``min_score``: a page not among them counts at the last of them, the
    most it could have). Words many pages answer alike ("is the room spotless", of any hotel)
    single out none."""
    if not own.found or not folded.found or not cosines:
        return False
    best = own.found[0][0]
    page = entity_of(best)
    if entity_of(folded.found[0][0]) == page:
        return False
    mine = next((s for chunk, s in cosines if chunk.chunk_id == best.chunk_id), None)
    other = next((s for chunk, s in cosines if entity_of(chunk) != page), cosines[-1][1])
    return mine is not None and mine - other >= SHORT_MARGIN


def _name_alone(plan: followups.Plan, own: Ranking) -> bool:
    """Whether only the tracked name can have found the folded query's hits: the turn is folded
    with an entity it does not point back at ("What is the capital of France?" after a page on
    voicemail), and its own words, searched alone, find nothing at or above min_score."""
    source = plan.followup.source
    return source in followups.ONE_ENTITY and not plan.refers and not own.found and not own.degraded


def _asked_alone(
    plan: followups.Plan, own: Ranking, utterance: Utterance, lexical: LexicalIndex
) -> bool:
    """Whether a turn folded with the recent exchange is a question off the base: it points
    back at nothing, asks, its own search finds nothing at min_score, and no chunk holds any
    of its words ("What is the capital of France?" after "How much does roaming cost in
    Europe?"). Only the exchange's words can have found the folded chunks, and its answer is
    the honest nothing it gets asked alone. A question in the base's words ("Can you explain
    to me on the subject?") may lean on the exchange without a pointer, and keeps them."""
    source = plan.followup.source
    if source != followups.Source.RECENT_TURNS or plan.refers or own.found or own.degraded:
        return False
    return followups.asks(utterance) and not len(lexical.matching(utterance.text))


def _backed(folded: Ranking, cosines: Sequence[Scored], min_score: float) -> Ranking:
    """``folded`` less the hits the turn's own words do not back: a hit is kept when the mean of
    its score and the turn's own cosine for its chunk (``cosines``: as deep as its search,
    before ``min_score``) reaches ``min_score`` (a chunk not among them is given the last of
    them, the most it could have), as ``_fused`` scores a chunk by both queries. The name alone
    rates its page's chunks high whatever is asked; an off-topic question folded with it
    ("Voicemail: What is the capital of France?") still clears the threshold on the name's
    words, where by both it does not, and its answer is the honest nothing it gets asked
    alone. A question that does not point back but asks about the page ("Can I pay by card?"
    after a hotel) has its own words near the page's chunks, and keeps them."""
    if not cosines:
        return replace(folded, found=[])
    own = {chunk.chunk_id: score for chunk, score in cosines}
    floor = cosines[-1][1]
    kept = [
        (chunk, score)
        for chunk, score in folded.found
        if (score + own.get(chunk.chunk_id, floor)) / 2.0 >= min_score
    ]
    return replace(folded, found=kept)


def _about(folded: Ranking, entity: str, entity_of: EntityOf) -> bool:
    """Whether the entity-folded query's best chunk is the tracked ``entity``'s. The name is
    folded in to lift that entity's chunks over the like chunks of others ("Do guests find the
    staff friendly?"); where another page's chunk still comes first, the name did not decide
    the answer, the turn's words did, and the turn alone ranks those words truer: a question
    of its own ("Where can I find the settings file?" after a page on key bindings) keeps its
    own answer, however close the two are in its own cosine."""
    return bool(folded.found) and entity_of(folded.found[0][0]) == entity


def _floors(
    searched: tuple[Ranking, Ranking], before: tuple[Ranking, Ranking], min_score: float
) -> tuple[float, float]:
    """The most a chunk each of a turn's two searches did not return can have scored in it
    (``_fused``): its last score, or ``min_score`` where the threshold cut it short (the
    search before it, ``before``, returned more), the chunks it dropped being below it. The
    last kept score counted them well above their own, and the other search's chunks won:
    "What plans do you have?" after "How much does roaming cost in Europe?" (the README's
    example base, at ``min_score`` 0.3) was answered from the roaming page."""
    return (
        _floor(searched[0].found, before[0].found, min_score),
        _floor(searched[1].found, before[1].found, min_score),
    )


def _floor(kept: Sequence[Scored], before: Sequence[Scored], min_score: float) -> float:
    """One search's floor (``_floors``): ``kept`` at the threshold, ``before`` it."""
    if not kept:
        return min_score
    return min_score if len(kept) < len(before) else kept[-1][1]


def _fused(
    folded: Sequence[Scored], own: Sequence[Scored], floors: tuple[float, float]
) -> list[Scored]:
    """The candidates of the folded query and of the turn alone, each scored by the mean of its
    two cosines (CombSUM): a chunk one search did not return is given that search's floor
    (``_floors``), the most it could have had. A chunk both queries like wins over one only the
    conversation's words (or only the turn's) like; no threshold decides between the two
    queries."""
    if not folded or not own:
        return list(folded or own)
    first = {chunk.chunk_id: score for chunk, score in folded}
    second = {chunk.chunk_id: score for chunk, score in own}
    floor_first, floor_second = floors
    candidates = {chunk.chunk_id: chunk for chunk, _ in (*folded, *own)}
    out = [
        (chunk, (first.get(key, floor_first) + second.get(key, floor_second)) / 2.0)
        for key, chunk in candidates.items()
    ]
    out.sort(key=_by_score)
    return out


def _own_answer(found: Sequence[Scored], folded: Ranking, own: Ranking) -> bool:
    """Whether the turn's own words decided the answer: its best chunk is the turn alone's
    best, where the folded query's was another (the turn is then reported as searched as said;
    where both agree, what was folded in is reported)."""
    if not found or not own.found:
        return False
    top = found[0][0].chunk_id
    return top == own.found[0][0].chunk_id and (
        not folded.found or top != folded.found[0][0].chunk_id
    )


def _each_first(found: Sequence[Scored], names: Sequence[str], entity_of: EntityOf) -> list[Scored]:
    """``found`` with the best chunk of each of ``names`` first, best first (a question over
    listed options ranked as one query: ``Engine._each_listed``), then the rest as ranked."""
    wanted = set(names)
    first: list[Scored] = []
    for scored in found:
        name = entity_of(scored[0])
        if name in wanted:
            wanted.discard(name)
            first.append(scored)
    taken = {id(scored) for scored in first}
    return [*first, *(scored for scored in found if id(scored) not in taken)]
