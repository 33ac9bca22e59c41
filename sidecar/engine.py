"""The turn engine: what happens to one caller turn or one explicit search, free of gRPC.

A turn's hot path is: skip? -> follow-up query -> embed (under the budget) -> rank (threshold,
hybrid, context_url: ``sidecar/relevance.py``). The budget bounds the whole turn: embedding gets
what is left of it less a reserve (``sidecar/budget.py``), and when the embedder misses that, or
fails, the snapshot's lexical index answers and the result says ``degraded``. Query vectors are
cached, and a late one is bounded (``sidecar/query_embedder.py``). Converse streams may hand a
turn a result searched ahead on an interim transcript (``sidecar/prefetch.py``).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Protocol

import numpy as np

from index.config import SidecarConfig
from index.embedders.base import Embedder, Vectors
from index.errors import SnapshotNotFound
from index.filters import Allowed
from index.snapshot import LoadedSnapshot
from index.types import Chunk, MetadataFilter
from sidecar import followups, relevance, scope
from sidecar.budget import Budget
from sidecar.errors import InvalidArgument, Loading, NotFound
from sidecar.holder import SnapshotHolder
from sidecar.limits import TokenLimited
from sidecar.query_embedder import QueryEmbedder
from sidecar.rerank import Reranker
from sidecar.rerank import Status as RerankStatus
from sidecar.sessions import Hit, Mention, Session, SessionStore
from sidecar.skip import Skip, SkipPolicy

log = logging.getLogger("voxrecall.engine")

MAX_TEXT_CHARS = 4000  # a spoken turn is a few hundred characters; more is a client bug
MAX_LIMIT = 50
MAX_BUDGET_MS = 10_000
MAX_SESSION_ID = 256
# How much better (in the turn's own cosine) the turn alone must rate its best chunk than the
# folded query's best for the turn to keep its own result: a new question is not bent to the
# conversation, while a follow-up whose words fit many pages still is. Measured on doc2dial-dev
# and the topic-switch sessions: 0.05 kept 97% of stand-alone questions but lost doc2dial to
# its joined-turns baseline; 0.1 is +0.06 over it there and keeps about 80% of stand-alone ones.
STANDALONE_MARGIN = 0.1
# The same when a tracked entity was folded in: a named entity is strong evidence (on DSTC11, 584
# of the 2,129 judged follow-ups do not refer back, and 0.1 let too many of them stray to
# another hotel's chunk), so the turn alone must prefer its chunk by more.
ENTITY_STANDALONE_MARGIN = 0.25
# The page prior (doc2dial-style dialogues stay on one help page): each searched turn counts the
# pages of its top PRIOR_COUNTED chunks, by score; a chunk on a page the conversation found gets
# up to +PRIOR_BONUS (the most found page) among the top PRIOR_DEPTH. Measured on doc2dial-dev.
PRIOR_COUNTED = 5
ALONE_DEPTH = 20  # how deep the turn alone is searched beside a folded query
PRIOR_BONUS = 0.1
PRIOR_DEPTH = 20
MAX_PAGES = 64  # pages a session keeps counts for
MAX_UNREAD = 4  # agent turns waiting for the next user turn to be counted
MAX_READ_LATER = 4  # agent turns embedded in the background at once, all sessions together
READ_LATER_S = 2.0  # an agent turn's embedding still running this long after it came is dropped


class Speaker:
    USER = followups.USER
    AGENT = followups.AGENT


@dataclass(frozen=True, slots=True)
class Timings:
    embed_ms: float = 0.0
    search_ms: float = 0.0
    total_ms: float = 0.0


@dataclass(frozen=True, slots=True)
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


@dataclass(frozen=True, slots=True)
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


@dataclass(frozen=True, slots=True)
class SearchResult:
    hits: list[Hit]
    snapshot_version: str
    degraded: bool = False
    timings: Timings = Timings()
    rerank: RerankStatus = RerankStatus.RERANK_NONE


@dataclass(frozen=True, slots=True)
class TurnResult:
    hits: list[Hit]
    context: list[Hit]
    skipped: Skip
    query: str
    snapshot_version: str
    degraded: bool = False
    timings: Timings = Timings()
    prefetched: bool = False  # answered from a search started on an interim transcript
    truncated: bool = False  # the query was longer than the embedder reads: it was cut there
    followup: followups.FollowUp = followups.NO_FOLLOWUP  # what the query folded in, and why
    rerank: RerankStatus = RerankStatus.RERANK_NONE


@dataclass(frozen=True, slots=True)
class Planned:
    """What a final user turn with some text would search now (computed ahead by Converse)."""

    knowledge_base: str
    snapshot: LoadedSnapshot
    query: str
    sources: tuple[str, ...]
    context_url: str
    allowed: Allowed | None = None  # the filters' and paths' mask (sidecar/scope.py)


@dataclass(frozen=True, slots=True)
class Taken:
    """A prefetch matching a final turn: its result, or None when it is still embedding past
    the turn's embedding deadline (the turn then falls back rather than embed the words again)."""

    query: str
    result: SearchResult | None


class Prefetch(Protocol):
    """A source of results searched ahead (``sidecar.prefetch.Prefetcher``)."""

    async def take(self, req: TurnInput, snapshot: LoadedSnapshot, budget: Budget) -> Taken | None:
        """The prefetch matching this final turn, waited for until the embedding deadline at
        most, or None when none matches."""
        ...


@dataclass(slots=True)
class Counters:
    turns: int = 0
    skipped: int = 0
    degraded: int = 0
    prefetched: int = 0  # final turns answered from a prefetch
    prefetch_started: int = 0  # prefetches started on interim transcripts
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
        self.load_on_demand: Callable[[str], int] | None = None
        self.sessions = sessions
        self.skip_policy = skip_policy or SkipPolicy()
        self.hybrid_bases = hybrid_bases
        self.default_knowledge_base = default_knowledge_base
        self.policies = dict(policies or {})
        self.counters = Counters()
        self.vectors = QueryEmbedder(embedder, config.query_cache_size)
        self._reading: set[asyncio.Task[Vectors | None]] = set()  # agent turns being embedded
        # whether the embedder reads less than all of a query (sidecar.limits.truncated); the
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
        self._check_text(req.text, allow_empty=True)
        self._check_session(req.session_id)
        kb = req.knowledge_base or self.default_knowledge_base
        snapshot = self.snapshot(kb)
        allowed = scope.resolve(snapshot, kb, req.filters, req.source_paths, req.sources)
        session = self.sessions.get(req.session_id)
        self.counters.turns += 1
        if req.speaker != Speaker.AGENT and not req.is_final:
            return self._skipped(session, Skip.NOT_FINAL, snapshot, budget)
        utterance = followups.Utterance.of(req.text)
        mentions = followups.gazetteer(snapshot).find(utterance.tokens)
        if req.speaker == Speaker.AGENT:
            self._record(session, Speaker.AGENT, utterance, mentions)
            self._read_later(session, utterance)
            return self._skipped(session, Skip.AGENT_TURN, snapshot, budget)
        skip = self._skip(session, utterance)
        if skip is not Skip.NOT_SKIPPED:
            self._record(session, Speaker.USER, utterance, mentions)
            return self._skipped(session, skip, snapshot, budget)
        plan = followups.plan(session, utterance, mentions, self.config.followups)
        self._record(session, Speaker.USER, utterance, mentions)
        taken = await prefetch.take(req, snapshot, budget) if prefetch is not None else None
        if taken is not None and taken.result is not None:
            query, result = taken.query, taken.result
            self.counters.prefetched += 1
        else:
            if plan.prior:
                await self._read(session, snapshot, budget)
            embed = taken is None
            query, result = await self._retrieve(
                snapshot, kb, req, session, plan, budget, embed, allowed
            )
        result = await self._reranked(kb, query, result, self.config.max_results, budget)
        self._remember(session, result.hits)
        if result.degraded:
            self.counters.degraded += 1
        return TurnResult(
            hits=result.hits,
            context=session.context(self._context_limit()),
            skipped=Skip.NOT_SKIPPED,
            query=query,
            snapshot_version=snapshot.version,
            degraded=result.degraded,
            timings=Timings(
                embed_ms=result.timings.embed_ms,
                search_ms=result.timings.search_ms,
                total_ms=budget.elapsed_ms(),
            ),
            prefetched=taken is not None and taken.result is not None,
            truncated=self._truncates(query),
            followup=plan.followup if query == plan.query else followups.NO_FOLLOWUP,
            rerank=result.rerank,
        )

    async def _retrieve(
        self,
        snapshot: LoadedSnapshot,
        kb: str,
        req: TurnInput,
        session: Session,
        plan: followups.Plan,
        budget: Budget,
        embed: bool,
        allowed: Allowed | None = None,
    ) -> tuple[str, SearchResult]:
        """Search the plan's query; when the plan says so, the turn alone too (both embedded
        at once), and keep the turn's own result when it confidently prefers another chunk."""
        queries = [plan.query, req.text] if plan.alone else [plan.query]
        priors = [session.pages if plan.prior and session.pages else None, None]
        # the turn alone is searched deeper: what it makes of the folded query's best chunk is
        # then read, not guessed from its own third result
        depth = self._depth(kb, self.config.max_results)  # the rerank stage's candidates
        limits = [depth, max(depth, ALONE_DEPTH)]
        searches = [
            self._search(
                snapshot,
                kb,
                query,
                budget,
                limit=limit,
                min_score=self.config.min_score,
                sources=req.sources,
                context_url=req.context_url,
                embed=embed,
                prior=prior,
                allowed=allowed,
            )
            for query, prior, limit in zip(queries, priors, limits, strict=False)
        ]
        results = await asyncio.gather(*searches) if len(searches) > 1 else [await searches[0]]
        own = results[-1]  # the turn's own words' result: what the conversation's pages count
        _count_pages(session, [(hit.chunk, hit.score) for hit in own.hits[:PRIOR_COUNTED]])
        entity = plan.followup.source == followups.Source.ENTITY
        margin = ENTITY_STANDALONE_MARGIN if entity else STANDALONE_MARGIN
        if len(results) == 2 and _stands_alone(results[0], own, margin):
            return req.text, replace(own, hits=own.hits[:depth])
        return queries[0], results[0]

    def _read_later(self, session: Session, utterance: followups.Utterance) -> None:
        """Embed an agent turn in the background (it is read by the next user turn's page
        prior), off the caller's path and bounded: beyond MAX_READ_LATER at once, it waits."""
        if not self.config.followups.enabled or not utterance.words:
            return
        session.unread = [*session.unread[-MAX_UNREAD + 1 :], utterance.text]
        if len(self._reading) >= MAX_READ_LATER:
            return
        loop = asyncio.get_running_loop()
        task = loop.create_task(self.vectors.get(utterance.text, loop.time() + READ_LATER_S))
        self._reading.add(task)
        task.add_done_callback(self._reading.discard)

    async def _read(self, session: Session, snapshot: LoadedSnapshot, budget: Budget) -> None:
        """Count the pages the agent's turns since the last user turn are about: their vectors
        were embedded when they arrived (or are joined now, within the turn's embedding time)."""
        unread, session.unread = session.unread, []
        for text in unread:
            vector = await self.vectors.get(text, budget.embed_deadline())
            if vector is None:
                continue
            found = snapshot.search_dense(vector, PRIOR_COUNTED)
            _count_pages(session, [(snapshot.chunks[label], score) for label, score in found])

    def plan(self, req: TurnInput) -> Planned | None:
        """What a final user turn with ``req.text`` would search now, or None when it would not
        search; validates like ``turn`` and records nothing."""
        self._check_text(req.text, allow_empty=True)
        self._check_session(req.session_id)
        kb = req.knowledge_base or self.default_knowledge_base
        snapshot = self.snapshot(kb)
        allowed = scope.resolve(snapshot, kb, req.filters, req.source_paths, req.sources)
        if req.speaker == Speaker.AGENT:
            return None
        session = self.sessions.get(req.session_id)
        utterance = followups.Utterance.of(req.text)
        if self._skip(session, utterance) is not Skip.NOT_SKIPPED:
            return None
        mentions = followups.gazetteer(snapshot).find(utterance.tokens)
        query = followups.plan(session, utterance, mentions, self.config.followups).query
        return Planned(kb, snapshot, query, req.sources, req.context_url, allowed)

    async def search_ahead(self, planned: Planned, deadline: float) -> SearchResult | None:
        """Embed and rank a planned query ahead of its turn; None when the embedder missed
        ``deadline`` (``loop.time()``) or failed: the turn itself then decides."""
        start = time.perf_counter()
        vector = await self.vectors.get(planned.query, deadline)
        if vector is None:
            return None
        embed_ms = (time.perf_counter() - start) * 1000.0
        return self._rank(
            planned.snapshot,
            planned.knowledge_base,
            planned.query,
            vector,
            limit=self._depth(planned.knowledge_base, self.config.max_results),
            min_score=self.config.min_score,
            sources=planned.sources,
            context_url=planned.context_url,
            embed_ms=embed_ms,
            allowed=planned.allowed,
        )

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
        budget = Budget.start(self._budget_ms(req.budget_ms))
        # with a vector the query is for logging only: checked like any text, never searched
        self._check_text(req.query, allow_empty=bool(req.vector))
        self._check_session(req.session_id)
        if req.limit < 0 or req.limit > MAX_LIMIT:
            raise InvalidArgument(
                f"limit must be between 1 and {MAX_LIMIT} (0 for the default), got {req.limit}"
            )
        if not (-1.0 <= req.min_score <= 1.0):
            raise InvalidArgument(f"min_score must be between -1 and 1, got {req.min_score}")
        kb = req.knowledge_base or self.default_knowledge_base
        snapshot = self.snapshot(kb)
        allowed = scope.resolve(snapshot, kb, req.filters, req.source_paths, req.sources)
        vector = self._vector_from_bytes(req.vector, snapshot) if req.vector else None
        limit = req.limit or self.config.max_results
        result = await self._search(
            snapshot,
            kb,
            "" if vector is not None else req.query,
            budget,
            limit=self._depth(kb, limit),
            min_score=req.min_score or self.config.min_score,
            sources=req.sources,
            context_url=req.context_url,
            vector=vector,
            allowed=allowed,
        )
        text = "" if vector is not None else req.query  # a vector's query is for logs only
        result = await self._reranked(kb, text, result, limit, budget)
        if req.session_id:
            self._remember(self.sessions.get(req.session_id), result.hits)
        return SearchResult(
            hits=result.hits,
            snapshot_version=result.snapshot_version,
            degraded=result.degraded,
            timings=Timings(result.timings.embed_ms, result.timings.search_ms, budget.elapsed_ms()),
            rerank=result.rerank,
        )

    def end_session(self, session_id: str) -> bool:
        self._check_session(session_id)
        return self.sessions.end(session_id)

    # -- the search itself ---------------------------------------------------------------------

    async def _search(
        self,
        snapshot: LoadedSnapshot,
        kb: str,
        query: str,
        budget: Budget,
        *,
        limit: int,
        min_score: float,
        sources: Sequence[str],
        context_url: str = "",
        vector: Vectors | None = None,
        embed: bool = True,
        prior: Mapping[str, float] | None = None,
        allowed: Allowed | None = None,
    ) -> SearchResult:
        """Embed under the budget (unless given a vector, or told not to), then rank."""
        start = time.perf_counter()
        if vector is None and embed:
            vector = await self.vectors.get(query, budget.embed_deadline())
        return self._rank(
            snapshot,
            kb,
            query,
            vector,
            limit=limit,
            min_score=min_score,
            sources=sources,
            context_url=context_url,
            embed_ms=(time.perf_counter() - start) * 1000.0,
            prior=prior,
            allowed=allowed,
        )

    def _rank(
        self,
        snapshot: LoadedSnapshot,
        kb: str,
        query: str,
        vector: Vectors | None,
        *,
        limit: int,
        min_score: float,
        sources: Sequence[str],
        context_url: str,
        embed_ms: float,
        prior: Mapping[str, float] | None = None,
        allowed: Allowed | None = None,
    ) -> SearchResult:
        start = time.perf_counter()
        ranked = relevance.rank(
            snapshot,
            relevance.Query(
                text=query,
                vector=vector,
                limit=max(limit, PRIOR_DEPTH) if prior else limit,
                min_score=min_score,
                min_lexical_score=self.config.min_lexical_score,
                sources=sources,
                hybrid=kb in self.hybrid_bases and bool(query),  # no text: dense only
                context_url=context_url,
                context_bonus=self.config.context_bonus,
                allowed=allowed,
            ),
        )
        hits = [
            Hit(knowledge_base=kb, chunk=snapshot.chunks[label], score=score)
            for label, score in ranked
        ]
        if prior:
            hits = _lifted(hits, prior)[:limit]
        return SearchResult(
            hits=hits,
            snapshot_version=snapshot.version,
            degraded=vector is None,
            timings=Timings(embed_ms=embed_ms, search_ms=(time.perf_counter() - start) * 1000.0),
        )

    # -- the rerank stage ------------------------------------------------------------------------

    def policy(self, kb: str) -> BasePolicy:
        return self.policies.get(kb, NO_POLICY)

    def _depth(self, kb: str, limit: int) -> int:
        """How many candidates a search of ``kb`` keeps: the rerank stage's, when it has one."""
        reranker = self.policy(kb).reranker
        return max(limit, reranker.config.candidates) if reranker is not None else limit

    async def _reranked(
        self, kb: str, query: str, result: SearchResult, limit: int, budget: Budget
    ) -> SearchResult:
        """The result in the reranker's order, cut to ``limit``; in vector order, saying why,
        when the reranker misses its share of what is left of the budget or fails."""
        reranker = self.policy(kb).reranker
        if reranker is None or len(result.hits) < 2 or not query:
            return replace(result, hits=result.hits[:limit])
        left_ms = max(0.0, budget.remaining_ms() - budget.reserve_ms) * reranker.config.budget_share
        deadline = asyncio.get_running_loop().time() + left_ms / 1000.0
        documents = [hit.chunk.embed_text for hit in result.hits]
        order, status = await reranker.order(query, documents, deadline)
        hits = [result.hits[i] for i in order] if order is not None else result.hits
        return replace(result, hits=hits[:limit], rerank=status)

    # -- helpers -------------------------------------------------------------------------------

    def snapshot(self, kb: str) -> LoadedSnapshot:
        """The snapshot serving ``kb``, or the error a caller can act on."""
        if not kb:
            raise InvalidArgument("knowledge_base is empty and no default is configured")
        if kb not in self.known_bases:
            raise NotFound(
                f"unknown knowledge base {kb!r}; known: {', '.join(sorted(self.known_bases))}"
            )
        snapshot = self.holder.use(kb)
        if snapshot is None and self.load_on_demand is not None:
            retry_ms = self.load_on_demand(kb)
            if retry_ms:
                raise Loading(
                    f"knowledge base {kb!r} is loading (its first call, or it was evicted to keep "
                    f"within [sidecar] memory_budget_mb): retry in about {retry_ms} ms",
                    retry_ms,
                )
        if snapshot is None:
            raise SnapshotNotFound(
                f"knowledge base {kb!r} has no snapshot loaded yet: run `voxrecall index build` "
                "against the sidecar's store, and it is picked up on the next poll"
            )
        return snapshot

    def _skipped(
        self, session: Session, skip: Skip, snapshot: LoadedSnapshot, budget: Budget
    ) -> TurnResult:
        self.counters.skipped += 1
        self.counters.by_skip[skip.name] = self.counters.by_skip.get(skip.name, 0) + 1
        return TurnResult(
            hits=[],
            context=session.context(self._context_limit()),
            skipped=skip,
            query="",
            snapshot_version=snapshot.version,
            timings=Timings(total_ms=budget.elapsed_ms()),
        )

    def _skip(self, session: Session, utterance: followups.Utterance) -> Skip:
        """Why a final user turn needs no search, or NOT_SKIPPED. A reply to the agent's
        question ("Yes." to "Do you want to know how to apply?") is an answer, searched with
        the question, not a backchannel."""
        skip = self.skip_policy.classify_words(utterance.words)
        answer = self.config.followups.enabled and followups.replies(utterance)
        if skip is Skip.BACKCHANNEL and answer and followups.agent_question(session):
            return Skip.NOT_SKIPPED
        return skip

    @staticmethod
    def _record(
        session: Session,
        speaker: str,
        utterance: followups.Utterance,
        mentions: tuple[Mention, ...],
    ) -> None:
        followups.remember(session, session.record_turn(speaker, utterance.text, mentions))

    @staticmethod
    def _remember(session: Session, hits: list[Hit]) -> None:
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
    def _check_text(text: str, *, allow_empty: bool) -> None:
        if not allow_empty and not text.strip():
            raise InvalidArgument("query is empty: send the words to search for")
        if len(text) > MAX_TEXT_CHARS:
            raise InvalidArgument(f"text is {len(text)} characters; the limit is {MAX_TEXT_CHARS}")

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
        vector = np.frombuffer(data, dtype="<f4").astype(np.float64)
        bad = np.flatnonzero(~np.isfinite(vector))
        if bad.size:
            i = int(bad[0])
            raise InvalidArgument(f"vector[{i}] is {vector[i]}: every component must be finite")
        peak = float(np.max(np.abs(vector)))
        if peak == 0.0:
            raise InvalidArgument("vector is all zeros: it has no direction to search by")
        scaled = vector / peak  # in [-1, 1]: its norm cannot overflow, however large the values
        return (scaled / np.linalg.norm(scaled)).astype(np.float32)


def _count_pages(session: Session, found: Sequence[tuple[Chunk, float]]) -> None:
    """Add what one turn's search found to the session's pages (``Session.pages``)."""
    for chunk, score in found:
        page = followups.chunk_entity(chunk)
        session.pages[page] = session.pages.get(page, 0.0) + max(score, 0.0)
    if len(session.pages) > MAX_PAGES:  # keep the pages most found
        kept = sorted(session.pages.items(), key=lambda kv: -kv[1])[:MAX_PAGES]
        session.pages = dict(kept)
    session.fit()  # the pages count in the session's bytes


def _lifted(hits: list[Hit], pages: Mapping[str, float]) -> list[Hit]:
    """The hits re-ranked with the page prior: + PRIOR_BONUS times how much the conversation
    found a hit's page, relative to the page it found most (the score reported is the lifted
    one, as ``context_url``'s bonus is)."""
    most = max(pages.values())
    if most <= 0.0:
        return hits
    lifted = [
        replace(
            hit,
            score=hit.score
            + PRIOR_BONUS * pages.get(followups.chunk_entity(hit.chunk), 0.0) / most,
        )
        for hit in hits
    ]
    lifted.sort(key=lambda hit: -hit.score)
    return lifted


def _reads_everything(text: str) -> bool:
    return False


def _stands_alone(folded: SearchResult, alone: SearchResult, margin: float) -> bool:
    """Whether the turn alone confidently prefers another chunk than the folded query found:
    judged by the turn's own scores (the folded query's are lifted by the words folded in), its
    best beats the folded query's best by ``margin``."""
    if not alone.hits or folded.degraded or alone.degraded:
        return bool(alone.hits) and not folded.hits
    if not folded.hits:
        return True
    top = folded.hits[0].chunk.chunk_id
    own = {h.chunk.chunk_id: h.score for h in alone.hits}
    theirs = own.get(top, alone.hits[-1].score)  # below the last one when not among them
    return alone.hits[0].chunk.chunk_id != top and alone.hits[0].score - theirs >= margin
