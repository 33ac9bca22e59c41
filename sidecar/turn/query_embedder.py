"""Query vectors on the hot path: a cache, a deadline on every call, and a bound on late work.

    vectors = QueryEmbedder(embedder, cache_size=2048)
    vector = await vectors.get("how do I split a pane", deadline)  # None: fall back

A call that misses its deadline is not cancelled but left to finish in the background ("late"):
its vector then lands in the cache, so the same words next time (the final transcript after an
interim one, a caller repeating the question) are answered at once. A second caller asking for
words already being embedded joins that call instead of starting another.

At most ``embedder.parallel_calls`` calls left behind (late, or their caller cancelled; 1 unless
the embedder says otherwise) run at a time; while that many are in flight a new query is not
submitted at all and the caller falls back at once. For the embedded model that is the point: its
single worker thread runs one job at a time, so a job submitted behind a late one would only queue
and miss its own deadline too. A cancelled caller counts as a late one: a client that sends turns
and hangs up at once would otherwise queue a job per call for LATE_CUTOFF_S each, and every other
caller's turn would wait behind them.

A call left behind (late, or its caller cancelled) is cancelled LATE_CUTOFF_S later if it is still
running. For a remote embedder that closes the request. A job already running on the local
worker thread cannot be interrupted: it finishes there and its result is dropped (a job still
queued for the worker is removed).
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass

from cachetools import LRUCache

from index.embedders.base import Embedder, Vectors
from index.errors import EmbedderError

log = logging.getLogger("voxrecall.embed")

# A vector arriving this long after its caller gave up is for a turn long answered; past it a
# trickling remote response stops holding a connection and a late slot.
LATE_CUTOFF_S = 2.0


@dataclass(slots=True)
class EmbedStats:
    hits: int = 0  # answered from the cache
    misses: int = 0  # not in the cache
    joined: int = 0  # joined a call already in flight for the same words
    late: int = 0  # missed the caller's deadline (the call went on in the background)
    busy: int = 0  # not submitted: late calls already fill the embedder
    failed: int = 0  # the embedder raised, or the call was cut off


class QueryEmbedder:
    """One per engine; used from the event loop only."""

    def __init__(self, embedder: Embedder, cache_size: int) -> None:
        self.embedder = embedder
        self.stats = EmbedStats()
        self._cache: LRUCache[str, Vectors] = LRUCache(maxsize=max(1, cache_size))
        self._inflight: dict[str, asyncio.Task[Vectors]] = {}
        self._late: set[asyncio.Task[Vectors]] = set()
        self._left: dict[asyncio.Task[Vectors], asyncio.TimerHandle] = {}
        self.max_late = max(1, int(getattr(embedder, "parallel_calls", 1)))

    def cached(self, query: str) -> Vectors | None:
        return self._cache.get(query)

    async def get(self, query: str, deadline: float) -> Vectors | None:
        """The query's unit vector, or None when the deadline (``loop.time()``) passed first or
        the embedder failed; never raises for the embedder's sake."""
        vector = self._cache.get(query)
        if vector is not None:
            self.stats.hits += 1
            return vector
        self.stats.misses += 1
        loop = asyncio.get_running_loop()
        task = self._inflight.get(query)
        if task is not None:
            self.stats.joined += 1
        elif len(self._late) >= self.max_late:
            self.stats.busy += 1
            return None
        elif deadline <= loop.time():
            self.stats.late += 1
            return None
        else:
            task = self._submit(query)
        try:
            async with asyncio.timeout_at(deadline):
                vectors = await asyncio.shield(task)
        except TimeoutError:
            self.stats.late += 1
            self._leave(task)
            log.warning("embedder missed its deadline: the turn falls back")
            return None
        except EmbedderError as exc:
            self.stats.failed += 1
            log.warning("embedder failed: %s: the turn falls back", exc)
            return None
        except asyncio.CancelledError:
            current = asyncio.current_task()
            if task.cancelled() and (current is None or not current.cancelling()):
                self.stats.failed += 1  # the shared call was cut off, not this caller
                return None
            self._leave(task)
            raise
        row: Vectors = vectors[0]
        return row

    async def aclose(self) -> None:
        """Cancel every call still running and wait for them to end."""
        tasks = list(self._inflight.values())
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    def _submit(self, query: str) -> asyncio.Task[Vectors]:
        task = asyncio.get_running_loop().create_task(
            self.embedder.embed([query]), name="voxrecall-embed"
        )
        self._inflight[query] = task

        def done(t: asyncio.Task[Vectors]) -> None:
            self._late.discard(t)
            handle = self._left.pop(t, None)
            if handle is not None:
                handle.cancel()
            if self._inflight.get(query) is t:
                del self._inflight[query]
            if not t.cancelled() and t.exception() is None:
                self._cache[query] = t.result()[0]

        task.add_done_callback(done)
        return task

    def _leave(self, task: asyncio.Task[Vectors]) -> None:
        """The caller stops waiting (late, or cancelled); the call goes on, bounded by
        LATE_CUTOFF_S and counted among the late ones."""
        if task.done():
            return
        self._late.add(task)
        if task not in self._left:
            self._left[task] = asyncio.get_running_loop().call_later(LATE_CUTOFF_S, task.cancel)
