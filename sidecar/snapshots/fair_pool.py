"""Threads shared fairly between requesters: the first loads' pointer reads and downloads.

A FIFO thread pool let one requester decide how many of its downloads started: a caller
asking for 40 bases a store trickled took all 32 threads and queued 8 more jobs, and another
caller's first load waited behind them for their timeouts. Here each requester's jobs wait in
a queue of its own, and a free thread takes the next job of the next requester in turn (one
job each, round-robin), among those that may start one: a requester may hold a thread only
while it holds fewer than the threads left free (``may_start``). A requester alone gets half
the threads; a second half of the rest; the last free thread waits for a requester with
nothing running, which takes any free thread. So a requester's first job starts at once while a thread is free, whatever another
requester has queued, and otherwise on the next thread that frees, before any queued job of
a requester already running some; every job still ends within its own deadlines (the store's).

All the bookkeeping runs on the event loop (``submit`` and the jobs' ends); the jobs run on
the pool's threads.
"""

from __future__ import annotations

import asyncio
import functools
from collections import OrderedDict, deque
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

_T = TypeVar("_T")

_Job = tuple["asyncio.Future[Any]", Callable[[], Any]]


class FairPool:
    """``threads`` threads; jobs queued per requester, started in turn (module docstring)."""

    def __init__(self, threads: int, name: str) -> None:
        self.threads = threads
        self._name = name
        self._executor = ThreadPoolExecutor(threads, name)
        self._queued: OrderedDict[str, deque[_Job]] = OrderedDict()  # in turn order
        self._running: dict[str, int] = {}  # requester -> its jobs on a thread now
        self._shut = False  # ``shutdown`` ran: no job is taken

    def submit(self, requester: str, fn: Callable[..., _T], *args: Any) -> asyncio.Future[_T]:
        """Run ``fn(*args)`` on a thread, in ``requester``'s turn: its future (on the loop).
        After ``shutdown``, RuntimeError, the pool's counts as they were."""
        if self._shut:
            raise RuntimeError(f"the thread pool {self._name!r} is shut down: no job is taken")
        future: asyncio.Future[_T] = asyncio.get_running_loop().create_future()
        self._queued.setdefault(requester, deque()).append((future, functools.partial(fn, *args)))
        self._dispatch()
        return future

    def running(self, requester: str) -> int:
        """``requester``'s jobs on a thread now."""
        return self._running.get(requester, 0)

    def queued(self, requester: str) -> int:
        """``requester``'s jobs waiting for a thread."""
        return len(self._queued.get(requester, ()))

    def may_start(self, requester: str) -> bool:
        """Whether ``requester`` may take a free thread: it holds fewer than are left free."""
        return self.running(requester) < self.threads - sum(self._running.values())

    def _dispatch(self) -> None:
        while (requester := self._next()) is not None:
            self._start(requester)

    def _next(self) -> str | None:
        """The first requester in turn with a job queued that may start it now."""
        return next((r for r in self._queued if self.may_start(r)), None)

    def _start(self, requester: str) -> None:
        """Start ``requester``'s first queued job (one cancelled while queued is dropped) and
        move it to the back of the turn."""
        jobs = self._queued[requester]
        future, job = jobs.popleft()
        if jobs:
            self._queued.move_to_end(requester)
        else:
            del self._queued[requester]
        if future.cancelled():
            return
        self._running[requester] = self.running(requester) + 1
        ran = asyncio.get_running_loop().run_in_executor(self._executor, job)
        ran.add_done_callback(functools.partial(self._ended, requester, future))

    def _ended(self, requester: str, future: asyncio.Future[Any], ran: asyncio.Future[Any]) -> None:
        self._running[requester] -= 1
        if not self._running[requester]:
            del self._running[requester]
        if not future.cancelled():
            if ran.cancelled():
                future.cancel()
            elif (exc := ran.exception()) is not None:
                future.set_exception(exc)
            else:
                future.set_result(ran.result())
        self._dispatch()

    def shutdown(self) -> None:
        """Cancel every queued job and the threads' pending ones; a running job ends by its
        own deadlines (the store's ``close`` cuts its download)."""
        self._shut = True
        for jobs in self._queued.values():
            for future, _ in jobs:
                future.cancel()
        self._queued.clear()
        self._executor.shutdown(wait=False, cancel_futures=True)
