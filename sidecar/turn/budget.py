"""A typed latency budget for one call, measured on the monotonic clock.

    budget = Budget.start(total_ms=150)
    async with asyncio.timeout_at(budget.embed_deadline()):
        ...

The budget bounds the whole turn on the server. Embedding gets what is left of it minus a
reserve for the lexical fallback, search and serialisation, so that missing the embedder still
leaves time to answer. The cut is the sidecar's own (``asyncio.timeout_at``): a client library's
timeout applies per read and does not bound a response that trickles in.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass

# What the fallback path needs after the embedder is abandoned: a BM25 query over a few thousand
# chunks takes ~1-5 ms here, plus response building; 15 ms keeps a 150 ms budget honest.
FALLBACK_RESERVE_MS = 15.0


@dataclass(slots=True)
class Budget:
    """``total_ms`` from ``started`` (``time.monotonic()``); ``reserve_ms`` is kept for the
    fallback, at most a third of the total so that a small budget still leaves time to embed.
    One per call, never changed (slotted rather than frozen: a frozen ``__init__`` is slower)."""

    total_ms: float
    started: float
    reserve_ms: float = FALLBACK_RESERVE_MS

    @classmethod
    def start(
        cls,
        total_ms: float,
        reserve_ms: float = FALLBACK_RESERVE_MS,
        *,
        started: float | None = None,
    ) -> Budget:
        """A budget from now, or from ``started`` (``time.monotonic()``, read before: a call
        that may not need its budget makes it only when it does)."""
        if total_ms <= 0:
            raise ValueError(f"a budget must be positive, got {total_ms} ms")
        return cls(
            total_ms=total_ms,
            started=time.monotonic() if started is None else started,
            reserve_ms=min(reserve_ms, total_ms / 3),
        )

    def elapsed_ms(self) -> float:
        return (time.monotonic() - self.started) * 1000.0

    def remaining_ms(self) -> float:
        return max(0.0, self.total_ms - self.elapsed_ms())

    def embed_deadline(self) -> float:
        """An absolute ``loop.time()`` for ``asyncio.timeout_at``: the end of the budget less the
        reserve (now, when nothing is left)."""
        # ``remaining_ms() - reserve_ms``, inlined: every call takes this on its way
        left_ms = self.total_ms - (time.monotonic() - self.started) * 1000.0 - self.reserve_ms
        return asyncio.get_running_loop().time() + max(0.0, left_ms) / 1000.0
