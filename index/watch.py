"""The periodic batch indexer (``voxrecall index watch``).

Every ``poll_s`` seconds it looks at each knowledge base and rebuilds it when:

    start      it has not been built by this watcher yet
    files      a file under one of its local sources changed (modification times and sizes are
               polled: no file-system notification dependency, and it works on shared volumes),
               or a source of it was approved (``voxrecall source approve``)
    urls       a ``url`` source is due for a re-crawl (its ``refresh`` interval passed)
    schedule   ``interval_s`` passed since its last build
    request    someone asked for it (``request``: the HTTP endpoint of ``index/ingest.py``)

A build publishes only when a chunk changed, so sidecars pull only real updates. A failed build
(whatever it raised) is logged and retried at the next trigger; the other bases are still built. SIGTERM or SIGINT stops the watcher: between builds at
once, during a build at the next embedding slice, before anything is written.
"""

from __future__ import annotations

import hashlib
import logging
import signal
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from types import FrameType
from typing import Any

from index.build import BuildSummary, build_knowledge_base
from index.config import BuildConfig, KnowledgeBaseConfig
from index.embedders.base import Embedder
from index.errors import VoxrecallError
from index.sources.folder import Listing, list_files
from index.sources.url import UrlOptions, next_due

__all__ = ["BuildEvent", "WatchOptions", "Watcher", "run_watch", "stop_on_signals"]

log = logging.getLogger("voxrecall.index.watch")

DEFAULT_INTERVAL_S = 3600.0  # a full rebuild per hour catches what polling cannot see
DEFAULT_POLL_S = 10.0  # a docs edit reaches the store within seconds; a stat walk costs ~ms


@dataclass(frozen=True, slots=True)
class WatchOptions:
    """How often the watcher rebuilds on schedule and how often it polls for changes."""

    interval_s: float = DEFAULT_INTERVAL_S
    poll_s: float = DEFAULT_POLL_S

    def __post_init__(self) -> None:
        if self.interval_s <= 0 or self.poll_s < 0:
            raise ValueError("interval must be > 0 and poll >= 0 seconds")


@dataclass(frozen=True, slots=True)
class BuildEvent:
    """One build the watcher ran: why, and its summary (None when it failed: ``error``)."""

    knowledge_base: str
    reasons: tuple[str, ...]
    summary: BuildSummary | None
    error: str = ""


class Stopped(Exception):
    """Raised inside a build to abandon it when the watcher is asked to stop."""


def local_fingerprint(kb: KnowledgeBaseConfig) -> str:
    """A hash of the path, size and modification time of every file of the base's local
    sources, and of the names their walk skipped (a name not UTF-8, a link loop: a rebuild
    reports them)."""
    h = hashlib.sha256()
    for source in kb.sources:
        if source.path is None:
            continue
        h.update(f"\x00{source.name}\x00".encode(errors="surrogatepass"))
        listing = _listing(source.path, bool(source.options.get("follow_symlinks")))
        for rel, path in listing.files:
            try:
                st = path.stat()
            except OSError:
                continue  # removed while walking: the next poll sees it gone
            h.update(f"{rel}\x00{st.st_size}\x00{st.st_mtime_ns}\n".encode(errors="surrogatepass"))
        for skipped in listing.skipped:
            h.update(f"{skipped.path}\x00skipped\n".encode(errors="surrogatepass"))
    return h.hexdigest()


def _listing(root: Path, follow_symlinks: bool) -> Listing:
    """Every file of a source's path, walked as a build walks it (``list_files``: a tree of
    any depth, each real folder once, links as the source's ``follow_symlinks`` says)."""
    if root.is_file():
        return Listing(files=[(root.name, root)])
    if not root.is_dir():
        return Listing()
    return list_files(root, None, follow_symlinks=follow_symlinks)


@dataclass(slots=True)
class _State:
    built_at: float | None = None
    fingerprint: str = ""


@dataclass(slots=True)
class Watcher:
    """Rebuilds the config's knowledge bases when due; ``run`` is one bounded or endless loop."""

    config: BuildConfig
    embedder: Embedder
    options: WatchOptions = WatchOptions()
    stop: threading.Event = field(default_factory=threading.Event)
    clock: Callable[[], float] = time.time
    # set by ``request`` and on stop: ends the pause between polls early
    wake: threading.Event = field(default_factory=threading.Event)
    _states: dict[str, _State] = field(default_factory=dict)
    _requested: set[str] = field(default_factory=set)
    _last: dict[str, BuildEvent] = field(default_factory=dict)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def bases(self) -> list[str]:
        return [kb.name for kb in self.config.knowledge_bases]

    def request(self, knowledge_base: str) -> None:
        """Rebuild this base at the next cycle, which starts at once when the watcher is idle."""
        with self._lock:
            self._requested.add(knowledge_base)
        self.wake.set()

    def last(self, knowledge_base: str) -> dict[str, Any]:
        """Whether a rebuild is queued, and the base's last build (what the endpoint shows)."""
        with self._lock:
            queued, event = knowledge_base in self._requested, self._last.get(knowledge_base)
        out: dict[str, Any] = {"knowledge_base": knowledge_base, "queued": queued, "last": None}
        if event is not None:
            summary = event.summary.as_dict() if event.summary is not None else None
            out["last"] = {"reasons": list(event.reasons), "error": event.error, "summary": summary}
        return out

    def reasons(self, kb: KnowledgeBaseConfig, now: float) -> tuple[list[str], str]:
        """Why ``kb`` should be rebuilt now (empty: it should not), and its local fingerprint."""
        state = self._states.setdefault(kb.name, _State())
        fingerprint = local_fingerprint(kb) + self._approved(kb)
        if state.built_at is None:
            return ["start"], fingerprint
        with self._lock:
            reasons = ["request"] if kb.name in self._requested else []
        if fingerprint != state.fingerprint:
            reasons.append("files")
        if any(self._url_due(kb, s.name, s.options, now) for s in kb.sources if s.type == "url"):
            reasons.append("urls")
        if now - state.built_at >= self.options.interval_s:
            reasons.append("schedule")
        return reasons, fingerprint

    def _approved(self, kb: KnowledgeBaseConfig) -> str:
        """A hash of the base's approved registry entries: approving one is a change."""
        from index.curation import approved_sources

        try:
            approved = approved_sources(self.config.index.registry, kb)
        except VoxrecallError:
            return ""  # the build reports the registry's error
        return hashlib.sha256(
            repr([(s.name, dict(s.options)) for s in approved]).encode()
        ).hexdigest()

    def _url_due(
        self, kb: KnowledgeBaseConfig, source: str, raw: Mapping[str, Any], now: float
    ) -> bool:
        try:
            options = UrlOptions.from_options(source, raw)
        except VoxrecallError:
            return False  # the build reports the config error
        return next_due(self.config.index.cache_dir, kb.name, source, options) <= now

    def cycle(self) -> list[BuildEvent]:
        """Check every base once and build those that are due."""
        events = []
        for kb in self.config.knowledge_bases:
            if self.stop.is_set():
                break
            now = self.clock()
            reasons, fingerprint = self.reasons(kb, now)
            if reasons:
                with self._lock:
                    self._requested.discard(kb.name)  # a request made during the build: again
                event = self._build(kb, tuple(reasons), fingerprint, now)
                with self._lock:
                    self._last[kb.name] = event
                events.append(event)
        return events

    def _build(
        self, kb: KnowledgeBaseConfig, reasons: tuple[str, ...], fingerprint: str, now: float
    ) -> BuildEvent:
        state = self._states[kb.name]
        # taken before the build, so an edit made during it triggers the next one
        state.fingerprint, state.built_at = fingerprint, now
        try:
            summary = build_knowledge_base(
                self.config, kb, self.embedder, progress=self._check_stop, now=now
            )
        except Stopped:
            raise
        except VoxrecallError as exc:
            log.error("%s: build failed (%s): %s", kb.name, ", ".join(reasons), exc)
            return BuildEvent(kb.name, reasons, None, str(exc))
        except Exception as exc:  # a bug one base's input found must not stop the others' builds
            log.exception("%s: build failed (%s)", kb.name, ", ".join(reasons))
            return BuildEvent(kb.name, reasons, None, f"{type(exc).__name__}: {exc}")
        outcome = "published" if summary.published else "unchanged"
        log.info(
            "%s (%s): %s %s: %d chunks, %d embedded, %d removed, %d skipped pages",
            kb.name, ", ".join(reasons), outcome, summary.version, summary.chunks,
            summary.embedded, summary.removed, len(summary.skipped_pages),
        )  # fmt: skip
        return BuildEvent(kb.name, reasons, summary)

    def _check_stop(self, done: int, total: int) -> None:
        if self.stop.is_set():
            raise Stopped(f"stopped after embedding {done} of {total} chunks")

    def run(self, max_cycles: int | None = None) -> list[BuildEvent]:
        """Poll until stopped (or for ``max_cycles`` cycles); returns the builds it ran."""
        events: list[BuildEvent] = []
        cycles = 0
        while not self.stop.is_set() and (max_cycles is None or cycles < max_cycles):
            try:
                events.extend(self.cycle())
            except Stopped as exc:
                log.info("build abandoned: %s", exc)
                break
            cycles += 1
            if max_cycles is None or cycles < max_cycles:
                self.wake.wait(self.options.poll_s)
                self.wake.clear()
        return events


@contextmanager
def stop_on_signals(stop: threading.Event, *also: threading.Event) -> Iterator[None]:
    """Set ``stop`` (and ``also``) on SIGTERM or SIGINT inside the block (main thread only)."""

    def handler(signum: int, frame: FrameType | None) -> None:
        log.info("%s received: stopping", signal.Signals(signum).name)
        stop.set()
        for event in also:
            event.set()

    previous = {sig: signal.signal(sig, handler) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        yield
    finally:
        for sig, old in previous.items():
            signal.signal(sig, old)


def run_watch(
    config: BuildConfig,
    embedder: Embedder,
    options: WatchOptions,
    max_cycles: int | None = None,
    listen: str = "",
) -> list[BuildEvent]:
    """Run a watcher in the main thread until SIGTERM or SIGINT (or ``max_cycles``); with
    ``listen`` (host:port), rebuild requests are taken over HTTP (``index/ingest.py``)."""
    from index.ingest import RebuildListener

    watcher = Watcher(config, embedder, options)
    listener = (
        RebuildListener(listen, config.index.rebuild_token, watcher, config.index.rebuild_token_env)
        if listen
        else None
    )
    if listener is not None:
        listener.start()
    try:
        with stop_on_signals(watcher.stop, watcher.wake):
            events = watcher.run(max_cycles)
    finally:
        if listener is not None:
            listener.stop()
    log.info("watch stopped after %d build(s)", len(events))
    return events
