"""Limits that protect the sidecar as a whole: calls in flight, and the embedder's input.

``ConcurrencyLimit`` refuses a call over ``[sidecar] max_concurrent_rpcs`` at once with
RESOURCE_EXHAUSTED instead of queueing it: a voice turn answered late is worth nothing, and the
caller can retry elsewhere. A Converse stream holds its slot for as long as it is open.
``DrainGate`` refuses new calls with UNAVAILABLE once the sidecar drains, ``wait_idle`` tells
the drain when the calls in flight are done, and ``cut_off`` ends those still running when the
grace period is over, with UNAVAILABLE (clients retry it; CANCELLED they do not).
"""

from __future__ import annotations

import asyncio
from typing import Protocol, runtime_checkable

from sidecar.errors import ResourceExhausted
from sidecar.interceptor import Call, Hook
from sidecar.lifecycle import Lifecycle

_SLOT = "limits.slot"


class ConcurrencyLimit(Hook):
    """Counts calls in flight; used from the event loop only, so a plain int is enough."""

    def __init__(self, limit: int) -> None:
        if limit < 1:
            raise ValueError(f"limit must be >= 1, got {limit}")
        self.limit = limit
        self.in_flight = 0
        self.refused = 0
        self._calls: dict[int, Call] = {}  # the calls holding a slot, by id()
        self._idle: asyncio.Event | None = None  # made on the loop, when a drain waits

    async def wait_idle(self, deadline: float) -> bool:
        """Wait until no call is in flight or ``deadline`` (``loop.time()``) passes; whether
        the calls finished."""
        if self.in_flight == 0:
            return True
        self._idle = asyncio.Event()
        try:
            async with asyncio.timeout_at(deadline):
                await self._idle.wait()
        except TimeoutError:
            return False
        return True

    def cut_off(self, reason: str) -> int:
        """End every call in flight with UNAVAILABLE ``reason``; how many there were."""
        calls = list(self._calls.values())
        for call in calls:
            call.cut_off(reason)
        return len(calls)

    def start(self, call: Call) -> None:
        if self.in_flight >= self.limit:
            self.refused += 1
            raise ResourceExhausted(
                f"{self.in_flight} calls in flight, the limit is {self.limit} "
                "([sidecar] max_concurrent_rpcs): retry with backoff"
            )
        self.in_flight += 1
        call.notes[_SLOT] = True
        self._calls[id(call)] = call

    def end(self, call: Call) -> None:
        if call.notes.pop(_SLOT, False):
            self.in_flight -= 1
            self._calls.pop(id(call), None)
            if self.in_flight == 0 and self._idle is not None:
                self._idle.set()


class DrainGate(Hook):
    """Refuses every new call once the sidecar is draining (health checks are never hooked)."""

    def __init__(self, lifecycle: Lifecycle) -> None:
        self.lifecycle = lifecycle

    def start(self, call: Call) -> None:
        self.lifecycle.check_accepting()


@runtime_checkable
class TokenLimited(Protocol):
    """An embedder that cuts its input at a token limit (the embedded model does, at 256)."""

    def truncates(self, text: str) -> bool:
        """Whether ``text`` is longer than the embedder reads."""
        ...


def truncated(embedder: object, text: str) -> bool:
    """Whether the embedder reads less than all of ``text``; False for one without a limit
    a turn can reach (the OpenAI models read 8191 tokens, more than a turn may hold)."""
    return isinstance(embedder, TokenLimited) and embedder.truncates(text)
