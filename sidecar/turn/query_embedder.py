"""Query vectors on the hot path: a cache, a deadline on every call, and a bound on late work.

    vectors = QueryEmbedder(embedder, cache_size=2048)
    vector = await vectors.get("how do I split a pane", deadline)  # None: fall back
    folded, alone = await vectors.get_many([folded_query, turn_text], deadline)

A call that misses its deadline is not cancelled but left to finish in the background ("late"):
its vector then lands in the cache, so the same words next time (the final transcript after an
interim one, a caller repeating the question) are answered at once. A second caller asking for
words already being embedded joins that call instead of starting another.

``get_many`` asks for several queries at once (a turn's folded query and the turn alone): the
ones neither cached nor in flight go to the embedder in ONE ``embed`` call, so the embedded
model's single worker takes one job (one hand-off to its thread and back, not one per query,
each waiting on the other's); each query is then answered as ``get`` answers it, and lands in
the cache alone. The embedded model runs each text of a call through the graph on its own,
unpadded, so a vector is the same whichever call it came in.

At most ``embedder.parallel_calls`` calls left behind (late, or their caller cancelled; 1 unless
the embedder says otherwise) run at a time; while that many are in flight a new query is not
submitted at all and the caller falls back at once. For the embedded model that is the point: its
single worker thread runs one job at a time, so a job submitted behind a late one would only queue
and miss its own deadline too. A cancelled caller counts as a late one: a client that sends turns
and hangs up at once would otherwise queue a job per call for LATE_CUTOFF_S each, and every other
caller's turn would wait behind them.

``later`` embeds in the background (an agent's turn, read by the next user turn's page prior),
behind every caller: it is submitted only once no caller's query is being embedded, or after
LATER_WAIT_S at most (so a stream of callers delays it, never starves it), and to the embedder's
background lane where it has one (``Deferrable``: the embedded model's runs on a thread of its
own), so a caller's query arriving meanwhile never queues behind it on the worker. A caller
asking for the same words while they wait embeds them at once itself. A call on the background
lane is never counted among the late ones: it does not hold the worker.

``ahead`` embeds a query searched ahead of its turn (an interim transcript, for the prefetch),
behind every caller's and only while the embedder is otherwise idle: a new ahead query waits
until no caller's query and no background query (``later``: the lane is first in first out, and
a final joining the ahead call would wait behind them) is in flight, fewer than
AHEAD_IN_FLIGHT ahead calls are (one left
behind by its prefetch counts until it ends) and the last one's rest is over (ahead calls take
at most AHEAD_SHARE of the time), and is then submitted on the background lane where there is
one, so a final turn is never queued behind it on the worker. The waiting ones are
taken a caller at a time in turn (``caller``: whose connection asked, so many streams of one
client do not take every turn from another's one); at most AHEAD_WAITING wait, and one more
drops the oldest of the caller with the most waiting (``dropped``, as is one whose deadline
passes while it waits). Ahead queries asked for words cached or in flight join at once. Without
this, a few streams of long interims (each embedding on the worker) queued every other caller's
final behind theirs (bench/README.md, "Prefetch under a flood of interims").

A call left behind (late, or its caller cancelled) is cancelled LATE_CUTOFF_S later if it is still
running. For a remote embedder that closes the request. A job already running on the local
worker thread cannot be interrupted: it finishes there and its result is dropped (a job still
queued for the worker is removed).
"""

from __future__ import annotations

import asyncio
import logging
import sys
from collections import deque
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass

from cachetools import LRUCache

from index.embedders.base import Deferrable, Embedder, Vectors
from index.errors import EmbedderError

log = logging.getLogger("voxrecall.embed")

# A vector arriving this long after its caller gave up is for a turn long answered; past it a
# trickling remote response stops holding a connection and a late slot.
LATE_CUTOFF_S = 2.0
# A background query (``later``) waits at most this long for the callers' queries in flight to
# end before it is submitted anyway: a steady stream of callers delays it, never starves it.
LATER_WAIT_S = 0.5
# Ahead calls (``ahead``) in flight at once, whoever asked: one keeps the embedder's second core
# (the background lane's thread) from being taken by many streams' speculation.
AHEAD_IN_FLIGHT = 1
# The share of the time ahead calls may take: one that took d seconds is followed by a rest of
# d x (1 / AHEAD_SHARE - 1) before the next is submitted. On a machine of two busy cores the one
# ahead call in flight without a rest still held another caller's p50 at several times its own
# (bench/README.md).
AHEAD_SHARE = 0.25
# Ahead queries waiting for their turn, all callers together; one more drops the oldest of the
# caller with the most waiting. Each stream waits with one at most (a newer interim cancels the
# one before), so this bounds the speculation a flood of streams can queue.
AHEAD_WAITING = 16


@dataclass(slots=True)
class EmbedStats:
    hits: int = 0  # answered from the cache
    misses: int = 0  # not in the cache
    joined: int = 0  # joined a call already in flight for the same words
    late: int = 0  # missed the caller's deadline (the call went on in the background)
    busy: int = 0  # not submitted: late calls already fill the embedder
    failed: int = 0  # the embedder raised, or the call was cut off
    dropped: int = 0  # ahead queries never embedded: pushed out of the queue, or out of time


# The cache holds ``cache_size`` entries of a query of this many bytes and its vector, in bytes:
# a longer query (a turn may be 16 KiB) takes the room of several, so the cache is bounded in
# bytes whatever its callers say.
ENTRY_QUERY_BYTES = 512
_ENTRY_OVERHEAD = 200  # an entry's array header and its place in the cache's dict and order


class _Cache(LRUCache[str, Vectors]):
    """Query vectors, least recently used first out, bounded in bytes: an entry counts its
    query's and its vector's (cachetools sizes a value alone; the key's size is noted here)."""

    _key_bytes = 0

    def __setitem__(self, key: str, value: Vectors) -> None:
        """Cache ``value``; one larger than the whole cache is not kept."""
        self._key_bytes = sys.getsizeof(key)
        if self.getsizeof(value) <= self.maxsize:
            super().__setitem__(key, value)

    def getsizeof(self, value: Vectors) -> int:  # type: ignore[override]
        return self._key_bytes + int(value.nbytes) + _ENTRY_OVERHEAD


class QueryEmbedder:
    """One per engine; used from the event loop only."""

    def __init__(self, embedder: Embedder, cache_size: int) -> None:
        self.embedder = embedder
        self.stats = EmbedStats()
        room = ENTRY_QUERY_BYTES + 4 * embedder.info.dimension + _ENTRY_OVERHEAD
        self._cache = _Cache(maxsize=max(1, cache_size) * room)
        # query -> the call embedding it, and its row in that call's answer
        self._inflight: dict[str, tuple[asyncio.Task[Vectors], int]] = {}
        self._late: set[asyncio.Task[Vectors]] = set()
        self._left: dict[asyncio.Task[Vectors], asyncio.TimerHandle] = {}
        self.max_late = max(1, int(getattr(embedder, "parallel_calls", 1)))
        self._hot: set[asyncio.Task[Vectors]] = set()  # callers' calls in flight
        self._background: set[asyncio.Task[Vectors]] = set()  # background calls in flight
        self._idle: list[asyncio.Future[None]] = []  # background queries waiting for no _hot
        self._embed_later: Callable[[Sequence[str]], Awaitable[Vectors]] = embedder.embed
        self._lane = isinstance(embedder, Deferrable)  # background calls do not hold the worker
        self._ahead: set[asyncio.Task[Vectors]] = set()  # ahead calls in flight (left ones too)
        self._granted = 0  # ahead queries given their turn, not yet submitted
        self._rest_until = 0.0  # loop time before which no ahead call is submitted
        self._rest: asyncio.TimerHandle | None = None  # looks at the line when the rest ends
        # caller -> its ahead queries waiting for a turn, oldest first; the first caller's
        # oldest goes next, and that caller then goes to the back
        self._waiting: dict[str, deque[asyncio.Future[bool]]] = {}
        if isinstance(embedder, Deferrable):
            self._embed_later = embedder.embed_later

    def cached(self, query: str) -> Vectors | None:
        return self._cache.get(query)

    def reused(self, query: str) -> Vectors | None:
        """The query's vector where it is cached (counted a hit), for another text to stand
        in for (``Engine.turn``: a final's words as its interim said them); never embeds."""
        vector = self.cached(query)
        if vector is not None:
            self.stats.hits += 1
        return vector

    def started(self, query: str) -> bool:
        """Whether the query's vector is cached or being embedded (an ahead query still waiting
        for its turn is neither)."""
        return query in self._cache or query in self._inflight

    async def get(self, query: str, deadline: float) -> Vectors | None:
        """The query's unit vector, or None when the deadline (``loop.time()``) passed first or
        the embedder failed; never raises for the embedder's sake."""
        vector = self._cache.get(query)
        if vector is not None:
            self.stats.hits += 1
            return vector
        return (await self.get_many((query,), deadline))[0]

    async def ahead(
        self, queries: Sequence[str], deadline: float, caller: str = ""
    ) -> list[Vectors | None]:
        """The queries' vectors as ``get_many`` answers them, asked ahead of a turn (an interim
        transcript) by ``caller``: embedded only in its turn while the embedder is otherwise
        idle (see the module docstring); None for each when dropped first. Its cancelling is
        the sidecar's own choice (a newer interim came), not a caller hanging up: a call under
        way goes on for the cache without counting among the late ones."""
        if not all(map(self.started, queries)) and not await self._turn(caller, deadline):
            return [self._cache.get(query) for query in queries]
        return await self.get_many(queries, deadline, ahead=True)

    async def later(self, query: str, deadline: float) -> Vectors | None:
        """The query's vector embedded in the background, behind every caller's: submitted once
        no caller's query is in flight (or LATER_WAIT_S at most), on the embedder's background
        lane; None as ``get`` answers it (the deadline passed first, the embedder failed)."""
        if not self.started(query) and self._hot:
            loop = asyncio.get_running_loop()
            idle = loop.create_future()
            self._idle.append(idle)
            wait = min(LATER_WAIT_S, max(0.0, deadline - loop.time()))
            try:
                await asyncio.wait((idle,), timeout=wait)
            finally:
                idle.cancel()
                self._idle.remove(idle)
        return (await self.get_many((query,), deadline, background=True))[0]

    async def get_many(
        self,
        queries: Sequence[str],
        deadline: float,
        *,
        ahead: bool = False,
        background: bool = False,
    ) -> list[Vectors | None]:
        """Each query's vector, or None where ``get`` would answer None (counted per query as
        ``get`` counts); the queries neither cached nor in flight are embedded in one call
        (``background``: on the embedder's background lane, if it has one, never counted late
        there)."""
        found: dict[str, Vectors | None] = {}
        waiting: dict[str, tuple[asyncio.Task[Vectors], int]] = {}
        new: list[str] = []
        for query in dict.fromkeys(queries):  # a query asked twice is looked up once
            vector = self._cache.get(query)
            if vector is not None:
                self.stats.hits += 1
                found[query] = vector
                continue
            self.stats.misses += 1
            entry = self._inflight.get(query)
            if entry is not None:
                self.stats.joined += 1
                waiting[query] = entry
            else:
                new.append(query)
        if new and self._admit(len(new), deadline, background):
            task = self._submit(new, "ahead" if ahead else "background" if background else "hot")
            waiting.update((query, (task, row)) for row, query in enumerate(new))
        if waiting:
            late = not ((background or ahead) and self._lane)
            found.update(
                await self._collect(
                    waiting, deadline, late_if_cancelled=late and not ahead, late=late
                )
            )
        return [found.get(query) for query in queries]

    async def _turn(self, caller: str, deadline: float) -> bool:
        """Wait in ``caller``'s line until an ahead call may be submitted: True (the caller
        submits at once, before anything else runs); False when dropped first (pushed out of
        the line, or ``deadline`` passed)."""
        turn: asyncio.Future[bool] = asyncio.get_running_loop().create_future()
        self._waiting.setdefault(caller, deque()).append(turn)
        if sum(len(line) for line in self._waiting.values()) > AHEAD_WAITING:
            self._drop_one()
        self._next_ahead()
        try:
            async with asyncio.timeout_at(deadline):
                return await turn
        except TimeoutError:
            self.stats.dropped += 1
            return False
        finally:
            self._leave_line(caller, turn)

    def _leave_line(self, caller: str, turn: asyncio.Future[bool]) -> None:
        """``turn`` leaves the line: still in it (its asker cancelled, or out of time), it is
        removed; given, the turn is taken or handed on (the next is looked at once the asker
        has submitted, or given up)."""
        line = self._waiting.get(caller)
        if line is not None and turn in line:
            line.remove(turn)
            if not line:
                del self._waiting[caller]
        elif turn.done() and not turn.cancelled() and turn.result():
            self._granted -= 1
            asyncio.get_running_loop().call_soon(self._next_ahead)

    def _drop_one(self) -> None:
        """The line is full: the oldest query of the caller with the most waiting is dropped."""
        caller = max(self._waiting, key=lambda name: len(self._waiting[name]))
        turn = self._first(caller)
        if turn is not None:
            turn.set_result(False)
            self.stats.dropped += 1

    def _next_ahead(self) -> None:
        """While the embedder is otherwise idle, the next caller in line gets its turn, and
        goes to the back of the callers."""
        while self._ahead_free():
            caller = next(iter(self._waiting))
            turn = self._first(caller)
            if caller in self._waiting:
                self._waiting[caller] = self._waiting.pop(caller)  # to the back
            if turn is not None:
                turn.set_result(True)
                self._granted += 1

    def _ahead_free(self) -> bool:
        """Whether an ahead query waiting may be given its turn now: no caller's query in
        flight, no background call (``later``: its lane is one thread, first in first out, and a
        final joining the ahead call would wait behind them), fewer than AHEAD_IN_FLIGHT ahead
        calls, the last one's rest over (else the line is looked at again when it is)."""
        if not self._waiting or self._hot or self._background:
            return False
        if len(self._ahead) + self._granted >= AHEAD_IN_FLIGHT:
            return False
        loop = asyncio.get_running_loop()
        if loop.time() >= self._rest_until:
            return True
        if self._rest is None:
            self._rest = loop.call_at(self._rest_until, self._rested)
        return False

    def _rested(self) -> None:
        self._rest = None
        self._next_ahead()

    def _first(self, caller: str) -> asyncio.Future[bool] | None:
        """Take ``caller``'s oldest query waiting off its line (None: only cancelled ones, whose
        askers have not run since, were left)."""
        line = self._waiting[caller]
        turn = None
        while line and turn is None:
            first = line.popleft()
            turn = None if first.done() else first
        if not line:
            del self._waiting[caller]
        return turn

    async def aclose(self) -> None:
        """Drop the ahead queries waiting, cancel every call still running and wait for them to
        end."""
        for line in self._waiting.values():
            for turn in line:
                if not turn.done():
                    turn.set_result(False)
        self._waiting.clear()
        if self._rest is not None:
            self._rest.cancel()
        tasks = list({task for task, _ in self._inflight.values()})
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    def _admit(self, count: int, deadline: float, background: bool = False) -> bool:
        """Whether ``count`` new queries may go to the embedder now: not while late calls fill
        it (``busy``), nor a background query while a background call missed its deadline and
        still runs (a hung model would queue one per agent turn on its lane), nor past the
        deadline (``late``)."""
        stuck = background and any(task in self._left for task in self._background)
        if stuck or len(self._late) >= self.max_late:
            self.stats.busy += count
            return False
        if deadline <= asyncio.get_running_loop().time():
            self.stats.late += count
            return False
        return True

    async def _collect(
        self,
        waiting: Mapping[str, tuple[asyncio.Task[Vectors], int]],
        deadline: float,
        *,
        late_if_cancelled: bool = True,
        late: bool = True,
    ) -> dict[str, Vectors | None]:
        """Wait for the calls ``waiting`` holds until ``deadline``, without cancelling them: a
        call still running then is left to finish in the background (late, unless ``late`` is
        False); a cancelled caller leaves them all, bounded by LATE_CUTOFF_S (and counted late
        unless told otherwise)."""
        tasks = {task for task, _ in waiting.values()}
        timeout = max(0.0, deadline - asyncio.get_running_loop().time())
        try:
            await asyncio.wait(tasks, timeout=timeout)
        except asyncio.CancelledError:
            for task in tasks:
                self._leave(task, late=late_if_cancelled)
            raise
        for task in tasks:
            self._report(task, late)
        return {query: self._outcome(task, row) for query, (task, row) in waiting.items()}

    def _report(self, task: asyncio.Task[Vectors], late: bool = True) -> None:
        """Once per call: a call still running is left to finish (late), a failure logged."""
        if not task.done():
            self._leave(task, late=late)
            if late:  # a background read (late=False) has no turn to fall back
                log.warning("embedder missed its deadline: the turn falls back")
        elif not task.cancelled() and isinstance(task.exception(), EmbedderError):
            log.warning("embedder failed: %s: the turn falls back", task.exception())

    def _outcome(self, task: asyncio.Task[Vectors], row: int) -> Vectors | None:
        """One query's vector from the call embedding it, counted as ``get`` counts it."""
        if not task.done():
            self.stats.late += 1
            return None
        if task.cancelled():  # the shared call was cut off, not this caller
            self.stats.failed += 1
            return None
        exc = task.exception()
        if isinstance(exc, EmbedderError):
            self.stats.failed += 1
            return None
        if exc is not None:
            raise exc
        vector: Vectors = task.result()[row]
        return vector

    def _submit(self, queries: list[str], lane: str = "hot") -> asyncio.Task[Vectors]:
        """One call for ``queries`` on ``lane``: "hot" (a caller's, on ``embed``), "background"
        (``later``) or "ahead" (both on the embedder's background lane where it has one)."""
        embed = self.embedder.embed if lane == "hot" else self._embed_later
        task = asyncio.get_running_loop().create_task(
            self._embed(queries, embed), name="voxrecall-embed"
        )
        for row, query in enumerate(queries):
            self._inflight[query] = (task, row)
        {"hot": self._hot, "background": self._background, "ahead": self._ahead}[lane].add(task)
        started = task.get_loop().time()

        def done(t: asyncio.Task[Vectors]) -> None:
            self._call_ended(t, lane, started)
            vectors = t.result() if not t.cancelled() and t.exception() is None else None
            for row, query in enumerate(queries):
                entry = self._inflight.get(query)
                if entry is not None and entry[0] is t:
                    del self._inflight[query]
                if vectors is not None:
                    self._cache[query] = vectors[row].copy()  # not a view of them all

        task.add_done_callback(done)
        return task

    def _call_ended(self, task: asyncio.Task[Vectors], lane: str, started: float) -> None:
        """A call submitted at ``started`` on ``lane`` ended: it leaves every count; an ahead
        call's rest begins (AHEAD_SHARE); with no caller's query left in flight, the background
        and ahead queries waiting go on."""
        if lane == "ahead":
            now = task.get_loop().time()
            self._rest_until = now + (now - started) * (1.0 / AHEAD_SHARE - 1.0)
        for calls in (self._late, self._hot, self._background, self._ahead):
            calls.discard(task)
        handle = self._left.pop(task, None)
        if handle is not None:
            handle.cancel()
        if not self._hot:
            self._wake_idle()
            self._next_ahead()

    def _wake_idle(self) -> None:
        """No caller's query is in flight: the background queries waiting for that go on."""
        for idle in self._idle:
            if not idle.done():
                idle.set_result(None)

    async def _embed(
        self, queries: list[str], embed: Callable[[Sequence[str]], Awaitable[Vectors]]
    ) -> Vectors:
        vectors = await embed(queries)
        if len(vectors) != len(queries):
            raise EmbedderError(
                f"the embedder answered {len(vectors)} vectors for {len(queries)} texts"
            )
        return vectors

    def _leave(self, task: asyncio.Task[Vectors], *, late: bool = True) -> None:
        """The caller stops waiting (late, or cancelled); the call goes on, bounded by
        LATE_CUTOFF_S and (``late``) counted among the late ones."""
        if task.done():
            return
        if late:
            self._late.add(task)
        if task not in self._left:
            self._left[task] = asyncio.get_running_loop().call_later(LATE_CUTOFF_S, task.cancel)
