"""How a build shows its embedding, the long part of it: a bar on a terminal; anywhere else (a
file, a container's log, CI) a log line at a steady interval. Both say how many chunks of how
many are embedded, the rate and the time left; the log's first line says what was read."""

from __future__ import annotations

import logging
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field

log = logging.getLogger("voxrecall.index")

# A log line this often: a build is seen to be alive well within a minute, and a long build's log
# stays readable (a 4,000-chunk base on two cores logs about a dozen lines).
PROGRESS_EVERY_S = 10.0
BAR_WIDTH = 30


def duration(seconds: float) -> str:
    """``42 s``, ``3 min 5 s``, ``2 h 10 min``: a time left, as a person reads it."""
    whole = max(0, round(seconds))
    if whole < 60:
        return f"{whole} s"
    if whole < 3600:
        return f"{whole // 60} min {whole % 60} s"
    return f"{whole // 3600} h {whole % 3600 // 60} min"


@dataclass(slots=True)
class EmbedProgress:
    """``progress(done, total)`` for one base's build (``index.build.embed_chunks`` calls it with
    0 before the first batch, then after each)."""

    knowledge_base: str
    pages: int
    chunks: int
    every_s: float = PROGRESS_EVERY_S
    tty: bool = field(default_factory=lambda: sys.stderr.isatty())
    clock: Callable[[], float] = time.monotonic
    started: float = field(init=False)
    next_line: float = field(init=False)

    def __post_init__(self) -> None:
        self.started = self.next_line = self.clock()

    def __call__(self, done: int, total: int) -> None:
        if not total:
            return
        if done == 0:
            self.started = self.clock()
            self.next_line = self.started + self.every_s
            log.info(
                "%s: %d pages read, %d chunks: embedding %d (%d reused)",
                self.knowledge_base, self.pages, self.chunks, total, self.chunks - total,
            )  # fmt: skip
        elif self.tty:
            self._bar(done, total)
        elif done == total or self.clock() >= self.next_line:
            self.next_line = self.clock() + self.every_s
            log.info("%s: %s", self.knowledge_base, self.status(done, total))

    def status(self, done: int, total: int) -> str:
        """``embedded 640 of 4110 chunks (16%), 31.2 chunks/s, 1 min 51 s left``."""
        elapsed = max(self.clock() - self.started, 1e-6)
        rate = done / elapsed
        tail = (
            f"in {duration(elapsed)}"
            if done == total
            else f"{duration((total - done) / rate)} left"
        )
        return (
            f"embedded {done} of {total} chunks ({100 * done // total}%), "
            f"{rate:.1f} chunks/s, {tail}"
        )

    def _bar(self, done: int, total: int) -> None:
        filled = BAR_WIDTH * done // total
        bar = f"[{'#' * filled}{'.' * (BAR_WIDTH - filled)}]"
        # padded, so that a shorter line overwrites all of a longer one before it
        sys.stderr.write(f"\r  {bar} {self.status(done, total):<72}")
        if done == total:
            sys.stderr.write("\n")
        sys.stderr.flush()
