"""The turn engine: what happens to one caller turn or one explicit search, free of gRPC.

A turn's hot path is: skip? -> follow-up query -> embed (under the budget) -> search -> threshold.
When the embedder misses its share of the budget, or fails, the snapshot's lexical index answers
and the result says ``degraded``. Searches run inline: an hnswlib query is well under a
millisecond and a BM25 query a few, cheaper than a hop to a thread.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
from cachetools import LRUCache

from index.config import SidecarConfig
from index.embedders.base import Embedder, Vectors
from index.errors import EmbedderError, SnapshotNotFound
from index.lexical import reciprocal_rank_fusion
from index.snapshot import LoadedSnapshot
from sidecar import followups
from sidecar.budget import Budget
from sidecar.errors import InvalidArgument, NotFound
from sidecar.holder import SnapshotHolder
from sidecar.sessions import Hit, Session, SessionStore
from sidecar.skip import Skip, SkipPolicy

log = logging.getLogger("voxrecall.engine")

MAX_TEXT_CHARS = 4000  # a spoken turn is a few hundred characters; more is a client bug
MAX_LIMIT = 50
MAX_BUDGET_MS = 10_000
MAX_SESSION_ID = 256
FUSION_DEPTH = 20  # candidates per retriever before reciprocal rank fusion


class Speaker:
    USER = "user"
    AGENT = "agent"


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


@dataclass(frozen=True, slots=True)
class SearchResult:
    hits: list[Hit]
    snapshot_version: str
    degraded: bool = False
    timings: Timings = Timings()


@dataclass(frozen=True, slots=True)
class TurnResult:
    hits: list[Hit]
    context: list[Hit]
    skipped: Skip
    query: str
    snapshot_version: str
    degraded: bool = False
    timings: Timings = Timings()


@dataclass(slots=True)
class Counters:
    turns: int = 0
    skipped: int = 0
    degraded: int = 0
    query_cache_hits: int = 0
    query_cache_misses: int = 0
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
    ) -> None:
        self.config = config
        self.embedder = embedder
        self.holder = holder
        self.known_bases = known_bases
        self.sessions = sessions
        self.skip_policy = skip_policy or SkipPolicy()
        self.hybrid_bases = hybrid_bases
        self.default_knowledge_base = default_knowledge_base
        self.counters = Counters()
        self._query_cache: LRUCache[str, Vectors] = LRUCache(
            maxsize=max(1, config.query_cache_size)
        )

    # -- entry points -------------------------------------------------------------------------

    async def turn(self, req: TurnInput) -> TurnResult:
        budget = Budget.start(self._budget_ms(req.budget_ms))
        self._check_text(req.text, allow_empty=True)
        self._check_session(req.session_id)
        kb = req.knowledge_base or self.default_knowledge_base
        snapshot = self._snapshot(kb)
        session = self.sessions.get(req.session_id)
        self.counters.turns += 1

        if req.speaker == Speaker.AGENT:
            session.record_turn(Speaker.AGENT, req.text)
            return self._skipped(session, Skip.AGENT_TURN, snapshot, budget)
        if not req.is_final:
            return self._skipped(session, Skip.NOT_FINAL, snapshot, budget)
        skip = self.skip_policy.classify(req.text)
        if skip is not Skip.NOT_SKIPPED:
            session.record_turn(Speaker.USER, req.text)
            return self._skipped(session, skip, snapshot, budget)

        query = followups.rewrite(session, req.text)
        session.record_turn(Speaker.USER, req.text)
        result = await self._search(
            snapshot,
            kb,
            query,
            budget,
            limit=self.config.max_results,
            min_score=self.config.min_score,
            sources=req.sources,
        )
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
        )

    async def search(self, req: SearchInput) -> SearchResult:
        budget = Budget.start(self._budget_ms(req.budget_ms))
        if not req.vector:
            self._check_text(req.query, allow_empty=False)
        self._check_session(req.session_id)
        if req.limit < 0 or req.limit > MAX_LIMIT:
            raise InvalidArgument(
                f"limit must be between 1 and {MAX_LIMIT} (0 for the default), got {req.limit}"
            )
        if not (-1.0 <= req.min_score <= 1.0):
            raise InvalidArgument(f"min_score must be between -1 and 1, got {req.min_score}")
        kb = req.knowledge_base or self.default_knowledge_base
        snapshot = self._snapshot(kb)
        vector = self._vector_from_bytes(req.vector, snapshot) if req.vector else None
        result = await self._search(
            snapshot,
            kb,
            req.query,
            budget,
            limit=req.limit or self.config.max_results,
            min_score=req.min_score or self.config.min_score,
            sources=req.sources,
            vector=vector,
        )
        if req.session_id:
            self._remember(self.sessions.get(req.session_id), result.hits)
        return SearchResult(
            hits=result.hits,
            snapshot_version=result.snapshot_version,
            degraded=result.degraded,
            timings=Timings(result.timings.embed_ms, result.timings.search_ms, budget.elapsed_ms()),
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
        vector: Vectors | None = None,
    ) -> SearchResult:
        embed_start = time.perf_counter()
        if vector is None:
            vector = await self._embed_query(query, budget)
        embed_ms = (time.perf_counter() - embed_start) * 1000.0

        search_start = time.perf_counter()
        mask = snapshot.source_mask(sources)
        degraded = vector is None
        if vector is None:
            ranked = [
                (label, score)
                for label, score in snapshot.lexical.search(query, limit, mask)
                if score >= self.config.min_lexical_score
            ]
        elif kb in self.hybrid_bases:
            dense = snapshot.search_dense(vector, FUSION_DEPTH, mask)
            lexical = snapshot.lexical.search(query, FUSION_DEPTH, mask) if query else []
            relevant = {label for label, score in dense if score >= min_score}
            relevant |= {
                label for label, score in lexical if score >= self.config.min_lexical_score
            }
            fused = reciprocal_rank_fusion([[i for i, _ in dense], [i for i, _ in lexical]])
            ranked = [(label, score) for label, score in fused if label in relevant][:limit]
        else:
            ranked = [
                (label, s)
                for label, s in snapshot.search_dense(vector, limit, mask)
                if s >= min_score
            ]
        hits = [
            Hit(knowledge_base=kb, chunk=snapshot.chunks[label], score=score)
            for label, score in ranked
        ]
        search_ms = (time.perf_counter() - search_start) * 1000.0
        return SearchResult(
            hits=hits,
            snapshot_version=snapshot.version,
            degraded=degraded,
            timings=Timings(embed_ms=embed_ms, search_ms=search_ms),
        )

    async def _embed_query(self, query: str, budget: Budget) -> Vectors | None:
        """The query's vector, or None when the embedder missed its share of the budget or failed."""
        cached = self._query_cache.get(query)
        if cached is not None:
            self.counters.query_cache_hits += 1
            return cached
        self.counters.query_cache_misses += 1
        try:
            async with asyncio.timeout_at(budget.embed_deadline()):
                vectors = await self.embedder.embed([query])
        except TimeoutError:
            log.warning("embedder missed the budget (%.0f ms): lexical fallback", budget.total_ms)
            return None
        except EmbedderError as exc:
            log.warning("embedder failed: %s: lexical fallback", exc)
            return None
        vector: Vectors = vectors[0]
        self._query_cache[query] = vector
        return vector

    # -- helpers -------------------------------------------------------------------------------

    def _snapshot(self, kb: str) -> LoadedSnapshot:
        if not kb:
            raise InvalidArgument("knowledge_base is empty and no default is configured")
        if kb not in self.known_bases:
            raise NotFound(
                f"unknown knowledge base {kb!r}; known: {', '.join(sorted(self.known_bases))}"
            )
        snapshot = self.holder.get(kb)
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

    def _remember(self, session: Session, hits: list[Hit]) -> None:
        session.retain(hits)
        if hits:
            session.topic = hits[0].chunk.title

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
        vector = np.frombuffer(data, dtype="<f4").astype(np.float32)
        norm = float(np.linalg.norm(vector))
        if not np.isfinite(norm) or norm == 0.0:
            raise InvalidArgument("vector must be finite and non-zero")
        return vector / norm
