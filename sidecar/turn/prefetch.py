"""Speculative prefetch for one Converse stream: search a stable interim transcript ahead of its
final one, and answer the final from that search when the two match.

**Stable** (a prefetch starts) when an interim transcript has at least MIN_WORDS words, would be
searched as a final turn (not a backchannel or closing), and either

- ends in pause-like punctuation (``?``, ``.`` or ``!``): recognisers punctuate a clause once
  the speaker pauses, or
- kept the same words for ``prefetch_stable_ms`` (default 200 ms): no new words for that long
  means the speaker paused.

Words compare normalised: lowercased, punctuation dropped, whitespace collapsed.

**At most PREFETCH_BURST prefetches start per stream per PREFETCH_BURST x
``prefetch_stable_ms``** (each is a plan and an embedding, most of it on the event loop or the
one embedding thread): one per ``prefetch_stable_ms`` on average, a few at once. A
pause-punctuated interim past that waits until a start is free, and a newer interim replaces it
meanwhile (counted, ``prefetch_deferred``). A recogniser sends a few interims a second, and a
short question's punctuated interims may come faster than ``prefetch_stable_ms`` with the final
right after (one start a window lost every such prefetch: a second attack), so an ordinary
stream loses nothing; a stream sending fifty a second no longer starts fifty searches a second
(20 such streams held every other caller's Status p50 at ~50 ms; bench/README.md).

A start is taken when the interim is planned, whatever the plan gives: an interim its plan
refuses (a filter the base has no index for, an unknown source) or would not search takes its
start too, so a stream of refused interims plans at most PREFETCH_BURST of them a window as any
other. A refusal is counted (``prefetch_refused``) and logged at INFO once per stream (later ones
at DEBUG), cut to REFUSAL_LOG_BYTES: the final turn reports the error to its caller; each such
interim logged 1.2 KB at INFO, over 1,200 lines in 2 s from one stream.

**An interim over PREFETCH_MAX_BYTES is never searched ahead** (counted,
``prefetch_too_long``; its final is searched as usual): a spoken question is a few hundred bytes
at most, and each prefetch's embedding costs with its length, up to the model's 256 tokens.

**Every stream's prefetches share the embedder, behind every final turn**
(``QueryEmbedder.ahead``): a prefetch's embedding waits until no final turn's is in flight and
no other prefetch's is (nor the last one's rest: prefetches embed at most AHEAD_SHARE of the
time), then runs on the embedder's background lane, so a final never queues behind one; the
waiting ones are taken one caller (``caller``: the stream's client, one
connection on the loopback, else one host) at a time in turn, and at most AHEAD_WAITING wait
(more drop the oldest of the caller with the most waiting). Only the per-stream bound above
limited prefetch before, so four streams of long interims made ~20 embeddings a second on the
one worker and another caller's final queued behind them (bench/README.md). A final whose
matching prefetch is still waiting for its turn cancels it and is searched as usual.

**Match** (the final is answered from the prefetch, ``prefetched = true``) when the knowledge
base, sources, context_url, filters, source_paths and snapshot are the same (a final scoped
otherwise than its interim, by its filters or paths, searches itself: the prefetch's pages may be
ones the final may not reach, or miss ones it may) and the final's normalised words equal the
prefetched ones or overlap them with a Jaccard index of at least MATCH_JACCARD (0.8: one word
added to a turn of four or more distinct words still matches, one changed in a turn of nine or
more; "split the pane" against "split the pane in two" does not). A matching prefetch still embedding when the final arrives is
waited for until the final's embedding deadline; past it the turn falls back to the lexical index
rather than embed the same words a second time. Otherwise the final is searched as usual. A final
answered from a prefetch leaves the session as one searched at the final would: the pages found
are counted, and a weak name said alone ("Tell me about pCloud.") is tracked
(``sidecar.turn.engine``).

A final searched itself (a plan of two searches, or planned otherwise than its interim) still
takes from a matching prefetch the vectors of the queries its interim said alike, the same text
but for the punctuation and space it ends in (``Engine.turn``, ``text.unended``): a recogniser
adds "?" to its final and seldom to its interims, and the final would take the prefetch's whole
answer for words that close. They are read by that final only, never cached under its words.

One prefetch runs at a time: a stable transcript with other words cancels the one before (its
embedding may finish in the background and fill the query cache). ``aclose`` cancels everything
the prefetcher started; the servicer calls it when the stream ends, however it ends.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from collections.abc import Coroutine
from dataclasses import dataclass, replace
from typing import Any, NamedTuple, TypeVar

from index.errors import VoxrecallError, shortened
from sidecar.snapshots.searcher import Searcher
from sidecar.turn.budget import Budget
from sidecar.turn.engine import (
    Engine,
    PlannedSearch,
    PrefetchMatch,
    Ranking,
    Timings,
    TurnInput,
)
from sidecar.turn.text import words as transcript_words

log = logging.getLogger("voxrecall.prefetch")

MIN_WORDS = 3  # a shorter interim is most often the start of a longer question
MATCH_JACCARD = 0.8
PAUSE_PUNCTUATION = ("?", ".", "!")
# Prefetches a stream may start at once (``Prefetcher``: one per prefetch_stable_ms on average).
PREFETCH_BURST = 3
# The longest interim searched ahead, in UTF-8 bytes: over twice the longest user turn in the
# evaluation sets (225 bytes; 99.9% are under 210).
PREFETCH_MAX_BYTES = 512
# A prefetch's own embedding deadline: a final transcript follows its stable interim within a
# second or so; a prefetch still embedding after this is for a turn already answered.
PREFETCH_TIMEOUT_S = 2.0
# The most of a refused plan's message a log line repeats, in UTF-8 bytes: the message may quote
# what the call sent (a filter field of 1 KiB), and a stream's interims come many a second.
REFUSAL_LOG_BYTES = 256

_T = TypeVar("_T")


def normalise(text: str) -> tuple[str, ...]:
    """The words of a transcript: lowercased, without punctuation (``sidecar.turn.text.words``)."""
    return tuple(transcript_words(text))


def _too_long(text: str) -> bool:
    """Whether ``text`` is over PREFETCH_MAX_BYTES in UTF-8 (a str of more characters is: not
    encoded)."""
    too_many = len(text) > PREFETCH_MAX_BYTES
    return too_many or len(text.encode("utf-8", "surrogatepass")) > PREFETCH_MAX_BYTES


def words_match(ahead: tuple[str, ...], final: tuple[str, ...]) -> bool:
    """Equal words, or word sets with a Jaccard index of at least MATCH_JACCARD."""
    if ahead == final:
        return True
    a, b = set(ahead), set(final)
    return bool(a | b) and len(a & b) / len(a | b) >= MATCH_JACCARD


class _Scope(NamedTuple):
    """What a turn's search is scoped by, as its request says it: a final answered from a
    prefetch must say the same (its filters and paths decide the pages it may reach). Each is
    a set, as the search reads it: the same paths or filters in another order are the same."""

    knowledge_base: str
    sources: frozenset[str]
    context_url: str
    filters: frozenset[tuple[str, frozenset[str]]]
    source_paths: frozenset[str]


@dataclass(slots=True)
class _Ahead:
    words: tuple[str, ...]
    scope: _Scope  # the interim's
    planned: PlannedSearch
    task: asyncio.Task[Ranking | None]


class Prefetcher:
    """The speculative side of one Converse stream; used from the event loop only."""

    def __init__(self, engine: Engine, stable_ms: int, caller: str = "") -> None:
        self._engine = engine
        self._caller = caller  # whose turn among the streams' prefetches (QueryEmbedder.ahead)
        self._stable_s = stable_ms / 1000.0
        self._seen: tuple[str, ...] = ()  # the words of the latest interim
        self._timer: asyncio.Task[None] | None = None  # starts ``_waiting`` when it is due
        self._waiting: tuple[TurnInput, tuple[str, ...]] | None = None  # an interim and its words
        self._due = 0.0  # loop time at which ``_waiting`` starts
        # loop times of the stream's last PREFETCH_BURST starts: the next may start once the
        # oldest is PREFETCH_BURST x stable_ms old
        self._starts: deque[float] = deque(maxlen=PREFETCH_BURST)
        self._ahead: _Ahead | None = None
        self._refused = False  # a plan of this stream's was refused (logged at INFO once)
        self._tasks: set[asyncio.Task[Any]] = set()

    def interim(self, req: TurnInput) -> None:
        """An interim transcript arrived: maybe start (or schedule) a prefetch."""
        if self._stable_s <= 0:
            return
        if _too_long(req.text):
            self._engine.counters.prefetch_too_long += 1
            self._seen, self._waiting = (), None  # a newer interim: the one waiting is stale
            return
        words = normalise(req.text)
        if words == self._seen:
            return  # unchanged: a running stability timer keeps running
        self._seen = words
        self._waiting = None  # a newer interim: the one waiting is stale
        if len(words) < MIN_WORDS:
            return
        now = asyncio.get_running_loop().time()
        paused = req.text.rstrip().endswith(PAUSE_PUNCTUATION)
        due = now if paused else now + self._stable_s
        free = self._free_at()
        if paused and free <= now:
            self._start(req, words)
            return
        if paused:
            self._engine.counters.prefetch_deferred += 1  # the stream's recent starts fill it
        self._waiting, self._due = (req, words), max(due, free)
        if self._timer is None:
            self._timer = self._spawn(self._when_due(), "voxrecall-prefetch-timer")

    async def take(
        self, req: TurnInput, searcher: Searcher, budget: Budget
    ) -> PrefetchMatch | None:
        """The prefetch for this final transcript, if one matches (see the module docstring)."""
        ahead, self._ahead = self._ahead, None
        self._cancel(self._timer)
        self._timer, self._waiting, self._seen = None, None, ()
        if ahead is None:
            return None
        if not self._matches(ahead, req, searcher):
            self._cancel(ahead.task)
            return None
        if not await self._under_way(ahead):
            self._cancel(ahead.task)  # still waiting for its turn at the embedder
            return None
        start = time.perf_counter()
        if not ahead.task.done():
            try:
                async with asyncio.timeout_at(budget.embed_deadline()):
                    await asyncio.shield(ahead.task)
            except TimeoutError:
                self._cancel(ahead.task)  # its embedding goes on in the background
                planned = ahead.planned
                return PrefetchMatch(
                    planned.query, None, planned.followup, planned.queries, planned.depth
                )
        if ahead.task.cancelled() or ahead.task.exception() is not None:
            return None
        result = ahead.task.result()
        if result is None:
            return None  # the prefetch missed or failed: search as usual
        waited_ms = (time.perf_counter() - start) * 1000.0
        return PrefetchMatch(
            query=ahead.planned.query,
            result=replace(result, timings=Timings(embed_ms=waited_ms)),
            followup=ahead.planned.followup,
            embedded=ahead.planned.queries,
            depth=ahead.planned.depth,
        )

    def discard(self) -> None:
        """A final transcript was answered: whatever it did not take is stale now."""
        if self._ahead is not None:
            self._cancel(self._ahead.task)
        self._cancel(self._timer)
        self._ahead, self._timer, self._waiting, self._seen = None, None, None, ()

    async def aclose(self) -> None:
        """Cancel the timer and every prefetch still running, and wait for them to end."""
        tasks = list(self._tasks)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        self._ahead = self._timer = self._waiting = None

    # -- helpers ---------------------------------------------------------------------------

    async def _when_due(self) -> None:
        """Start the waiting interim's prefetch once it is due; a newer interim may replace it
        (or put its time off) while this sleeps, and one of too few words drops it."""
        loop = asyncio.get_running_loop()
        while self._waiting is not None:
            wait = self._due - loop.time()
            if wait <= 0:
                break
            await asyncio.sleep(wait)  # a deadline that moves: no one event to wait on
        self._timer = None
        waiting, self._waiting = self._waiting, None
        if waiting is not None:
            self._start(*waiting)

    def _start(self, req: TurnInput, words: tuple[str, ...]) -> None:
        if self._ahead is not None and self._ahead.words == words:
            return  # already searching these words
        loop = asyncio.get_running_loop()
        self._starts.append(loop.time())  # a plan refused or skipped takes its start too
        planned = self._planned(req)
        if planned is None:
            return
        if self._ahead is not None:
            self._cancel(self._ahead.task)
        search = self._engine.search_ahead(planned, loop.time() + PREFETCH_TIMEOUT_S, self._caller)
        task = self._spawn(search, "voxrecall-prefetch")
        self._ahead = _Ahead(words, self._scope(req), planned, task)
        self._engine.counters.prefetch_started += 1

    def _planned(self, req: TurnInput) -> PlannedSearch | None:
        """What the interim would search, or None: one the final would not search, or one its
        plan refuses (counted, and said once per stream: the final turn reports the error)."""
        try:
            return self._engine.plan(req)
        except VoxrecallError as exc:
            self._engine.counters.prefetch_refused += 1
            level = logging.DEBUG if self._refused else logging.INFO
            self._refused = True
            log.log(level, "no prefetch: %s", shortened(str(exc), REFUSAL_LOG_BYTES))
            return None

    async def _under_way(self, ahead: _Ahead) -> bool:
        """Whether the prefetch is done or every query it embeds (``PlannedSearch.queries``) is
        embedded or being embedded, not waiting for its turn behind other calls: it waits in
        line while any of them has not started. A prefetch started in this pass of the loop is
        let take its first step first: it joins the line or submits its embedding before it
        waits on anything."""
        started = self._engine.vectors.started
        if ahead.task.done() or all(map(started, ahead.planned.queries)):
            return True
        await asyncio.sleep(0)
        return ahead.task.done() or all(map(started, ahead.planned.queries))

    def _free_at(self) -> float:
        """The loop time from which the stream may start another prefetch."""
        if len(self._starts) < PREFETCH_BURST:
            return 0.0
        return self._starts[0] + PREFETCH_BURST * self._stable_s

    def _matches(self, ahead: _Ahead, req: TurnInput, searcher: Searcher) -> bool:
        """Whether the final ``req`` may take ``ahead``: the same snapshot, the same scope
        (base, sources, context_url, filters and paths) and words close enough."""
        return (
            ahead.planned.searcher is searcher
            and ahead.scope == self._scope(req)
            and words_match(ahead.words, normalise(req.text))
        )

    def _scope(self, req: TurnInput) -> _Scope:
        kb = req.knowledge_base or self._engine.default_knowledge_base
        return _Scope(
            kb,
            frozenset(req.sources),
            req.context_url,
            frozenset((f.field, frozenset(f.any_of)) for f in req.filters),
            frozenset(req.source_paths),
        )

    def _spawn(self, coro: Coroutine[Any, Any, _T], name: str) -> asyncio.Task[_T]:
        task = asyncio.get_running_loop().create_task(coro, name=name)
        self._tasks.add(task)
        task.add_done_callback(self._done)
        return task

    def _done(self, task: asyncio.Task[Any]) -> None:
        self._tasks.discard(task)
        if not task.cancelled() and task.exception() is not None:
            log.error("prefetch failed", exc_info=task.exception())

    @staticmethod
    def _cancel(task: asyncio.Task[Any] | None) -> None:
        if task is not None and not task.done():
            task.cancel()
