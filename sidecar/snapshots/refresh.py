"""Pull, verify, warm, swap: keeps the holder at the newest good snapshot of every base.

For each base: read the store's pointer; when it names a version newer than the one served,
fetch it (the store checks every file's sha256 against the manifest and the hnswlib graphs'
layout, downloading first for an HTTP store, and records both), load and verify it (format,
embedder name and dimension, counts against the chunk store, the graphs' headers; the files are
not hashed nor the graphs' links checked a second time), build its searcher (``sidecar/snapshots/searcher.py``:
everything a query needs, the follow-ups' gazetteer and the page index included), run warm-up
queries, and publish the searcher with one reference swap. All of it but the swap runs off the
event loop, one refresh at a time. After a swap the
heap is frozen (``freeze_heap``) so the garbage collector stops walking the served snapshot; the
garbage frozen with it (sessions alive at the swap, ended since) is bounded: once the heap
has grown by ``FREEZE_GROWTH`` since the last full collection, one full collection runs.

With a memory budget (``budget_bytes`` > 0, ``[sidecar] memory_budget_mb``) bases are lazy: none
is loaded at start, and ``want(kb, peer)`` (a call to a base not loaded) queues its load. The
loads run one at a time, off the event loop, taken from one queue per requester (the client's
host, ``addresses.load_requester``: each connection on the loopback, where a sidecar's own agents
are) in turn, each base queued once (``LoadQueue``): a requester that asks for many
bases delays another's first load by at most one load per requester waiting, never by its whole
queue. A base's pointer read and download (``newest``: ``store.latest``, then ``store.fetch``)
run outside the load lock, on a thread of their own (one per base, at most ``MAX_DOWNLOADS``,
shared fairly between requesters: ``FairPool``, one requester alone holds at most half and
another's first job starts at once while a thread is free), each within the store's deadlines;
one still going after ``DOWNLOAD_WAIT_S`` goes on in the background while the next bases load,
and its base is queued again, the version it read kept, when it is in (the pointer is read once
per load): a store trickling some bases' pointers or files holds no other base's load (up to
``MAX_DOWNLOADS`` / 2 - 1 of one requester's trickling at once, and however many of another
requester's). A poll reads
the pointers of its bases in at most ``POLL_DOWNLOADS`` jobs on threads of its own
(``read_pointers``, a batch each), then downloads only the versions that changed, side by side on
those threads, outside the lock, and loads each as its download ends: its reads never hold a
first load's download thread, and 10,000 bases are 16 jobs a poll, not 10,000. A load is verified
and built before anything is evicted, then the bases ``SnapshotHolder.over_budget`` names go
until the loaded bytes are within the budget again: a version that fails evicts nothing, and the
process holds one base beyond the budget for the time of a load. When only other requesters'
working sets could make room (``SnapshotHolder`` says None), the load is not served: its base
is held back (``_held``), its calls told to retry, until the first of those bases may leave
(nothing evicted, nothing refused); its bytes are kept (``_held_bytes``), so a retry that still
finds no room extends the hold without building it again. A poll refreshes only the loaded bases: one evicted while
the poll read its pointer is left out.

A version that fails is refused: one log line per version and kind (the pointers a poll
starts failing to read, a store down failing every base's: one line for them all,
``refused_line``),
``holder.refusals[kind] += 1``
and the last refusal in ``Status``; the last good snapshot keeps serving. Every failure of a load
is a refusal (an unexpected exception too: kind ``invalid``, its traceback logged once), so a bad
version at start leaves the sidecar up, NOT_SERVING for that base. A corrupt or incompatible version, or a
pointer that went backwards, is not tried again; a store that did not answer or a half-uploaded
version is tried again on the next poll. A pointer that could not be read (an error, not an
absent LATEST) is read again at every poll; its base is ``SnapshotHolder.unreadable`` meanwhile,
logged once as it fails and once as it reads again, and not waited for once another base serves.
"""

from __future__ import annotations

import asyncio
import ctypes
import errno
import gc
import logging
import random
import sys
import time
from collections import Counter, OrderedDict, deque
from collections.abc import Awaitable, Callable, Collection, Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np

from index.embedders.base import EmbedderInfo
from index.errors import (
    CacheWriteError,
    CorruptSnapshot,
    IncompatibleSnapshot,
    IncompleteSnapshot,
    SnapshotError,
    StoreUnavailable,
)
from index.snapshot import HNSW_INDEX_BYTES, LoadedSnapshot, load_snapshot, read_manifest
from index.store import SnapshotStore
from sidecar.edge.addresses import load_requester
from sidecar.snapshots.fair_pool import FairPool
from sidecar.snapshots.holder import SnapshotHolder
from sidecar.snapshots.searcher import Searcher

log = logging.getLogger("voxrecall.refresh")

WARMUP_QUERIES = 8  # enough to touch the upper graph layers once
# Versions of a base refused for good that are remembered (the newest), so that none is fetched
# again however its store's pointer moves among them; a few ids a base.
REJECTED_KEPT = 16
# Lexical warm-up queries (chunk titles): two touch the postings' and lengths' arrays; each more
# scored every chunk again at 1M chunks whose titles share a word (34 ms a query), at every load.
WARMUP_LEXICAL = 2
# The retry hint before any lazy load was timed: a small base loads in tens of milliseconds.
FIRST_RETRY_MS = 100
# Lazy: how long the loader waits for one base's download before it goes on to the next base
# (the download goes on, on a thread of its own, and the base is queued again when it ends): a
# store trickling one base cannot hold every other base's first load.
DOWNLOAD_WAIT_S = 1.0
# Downloads at once: one thread per base downloading, up to the bases configured and this many,
# shared between requesters (``FairPool``: one requester alone holds at most half of them).
# A fixed two let two trickling bases take both threads, every other base's download waiting
# behind them for up to http_version_timeout_s (review s13 #15). Each holds a thread, a socket
# and a partial folder checked against the cache's free space; 32 stays far from a process's
# usual 1,024 descriptors.
MAX_DOWNLOADS = 32
# A poll's pointer reads and downloads run on threads of their own, this many at once: on the
# first loads' threads, a poll of more loaded bases than those threads took all of them, and a
# first call's load queued behind the poll's reads (4.1 s behind 40 bases whose LATEST took 4 s).
POLL_DOWNLOADS = 16
# Bases a poll's one line of failed pointer reads names (``refused_line``); the rest counted.
SHOWN_BASES = 5


class OverBudget(SnapshotError):
    """A version whose bytes pass ``[sidecar] memory_budget_mb`` on their own: served, it would
    evict every other base and be evicted by the next load, a reload per call for every caller."""

    def __init__(self, need_bytes: int, budget_bytes: int) -> None:
        super().__init__(
            f"it needs {need_bytes / 2**20:.1f} MiB loaded, more than [sidecar] "
            f"memory_budget_mb = {budget_bytes / 2**20:g} on its own: raise the budget or split "
            "the base"
        )


# (error class, refusal kind, retried on the next poll); the first match wins
_KINDS: tuple[tuple[type[SnapshotError], str, bool], ...] = (
    (OverBudget, "over_budget", False),
    (StoreUnavailable, "unavailable", True),
    (IncompleteSnapshot, "incomplete", True),
    (CacheWriteError, "cache_write", True),
    (IncompatibleSnapshot, "incompatible", False),
    (CorruptSnapshot, "corrupt", False),
    (SnapshotError, "invalid", False),
)


def refusal_kind(exc: SnapshotError) -> tuple[str, bool]:
    """The metric label for a failed refresh, and whether the same version is worth a retry."""
    for cls, kind, retry in _KINDS:
        if isinstance(exc, cls):
            cause = exc.__cause__
            if kind == "cache_write" and isinstance(cause, OSError) and cause.errno == errno.ENOSPC:
                return "disk_full", retry
            return kind, retry
    return "invalid", False


def warm_up(snapshot: LoadedSnapshot, answers: bool = True) -> Searcher:
    """Warm searches, then the snapshot's searcher (with its answers, ``Searcher.build``):
    blocking, run off the event loop."""
    if snapshot.chunks:
        warm_searches(snapshot)
    searcher = Searcher.build(snapshot, answers=answers)
    release_free_heap()
    return searcher


def _malloc_trim() -> Callable[[int], int] | None:
    """glibc's ``malloc_trim``, where the C library has it (not musl, not macOS): looked up
    among the symbols the process already has (``find_library`` would run ``ldconfig``)."""
    try:
        return getattr(ctypes.CDLL(None), "malloc_trim", None)
    except OSError:
        return None


_TRIM = _malloc_trim()


def release_free_heap() -> bool:
    """Hand the heap a load freed back to the system (``malloc_trim(0)``): a load runs on a
    worker thread, whose malloc arena keeps what the load's temporaries freed (the tables'
    checks, the page runs, hnswlib's reading buffers), resident and private to the process:
    40 MB of a worker at 1M chunks. A few milliseconds; False where the C library has no such
    call."""
    if _TRIM is None:
        return False
    _TRIM(0)
    return True


def warm_searches(snapshot: LoadedSnapshot) -> None:
    """Run a few queries so the first caller after a swap does not pay for cold pages.

    A graph hnswlib cannot search (it finds fewer neighbours than asked: a RuntimeError) is
    CorruptSnapshot here, before any caller would get it as an error."""
    rng = np.random.default_rng(0)
    dim = snapshot.manifest.embedder.dimension
    for _ in range(WARMUP_QUERIES):
        v = rng.normal(size=dim).astype(np.float32)
        try:
            snapshot.search_dense(v / np.linalg.norm(v), 3)
        except RuntimeError as exc:
            raise CorruptSnapshot(f"{snapshot.folder}: a warm-up search failed: {exc}") from exc
    for chunk in snapshot.chunks[:WARMUP_LEXICAL]:
        snapshot.lexical.search(chunk.title, 3)


# Frozen garbage: each swap freezes every object alive then, a live session's too, and a frozen
# reference cycle is never collected once it is garbage. When the heap has grown past its size
# after the last full collection by the larger of this share and FREEZE_SLACK blocks, the swap
# unfreezes it and runs one full collection, so the frozen garbage stays within that bound; a
# heap that grows by loading bases pays one such collection each time it grows by the share. The
# heap is counted in the object allocator's blocks (``sys.getallocatedblocks``: 0.03 ms, where
# counting the frozen objects walks their list: 3-13 ms at 100k chunks).
FREEZE_GROWTH = 0.25
FREEZE_SLACK = 100_000  # blocks: ~6 MB of sessions' garbage (~60 bytes each); a heap is ~500k


class _Frozen:
    """The heap's size in blocks after the last full collection, or its smallest since
    (evictions and freed old snapshots shrink it): the base the bound is counted from."""

    base: int | None = None


def freeze_heap() -> bool:
    """Take every object alive now out of the cyclic garbage collector's walks (``gc.freeze``);
    True when a full collection ran first, the heap past its bound (``FREEZE_GROWTH``).

    Full collections walked the served snapshot's objects with the GIL held, stalling the event
    loop (70-100 ms a time at 100k chunks, during the next load, before chunks were mapped;
    ``python -m bench.swap``). Frozen objects are still freed by reference counting when the
    last request holding an old snapshot ends, as snapshots hold no reference cycles. A reference
    cycle frozen while alive (a live session's: the MCP SDK's, a call's state) is never collected
    once it is garbage: the young generations are collected first (cheap: they are small), and
    once the heap has outgrown its bound it is unfrozen and collected in full, once (32-45 ms at
    100k chunks, ``python -m bench.frozen_garbage``), which keeps the frozen garbage bounded
    however many swaps a process serves.
    """
    gc.collect(1)
    gc.freeze()
    blocks = sys.getallocatedblocks()
    base = _Frozen.base
    if base is None or blocks <= base + max(FREEZE_SLACK, int(base * FREEZE_GROWTH)):
        _Frozen.base = blocks if base is None else min(base, blocks)
        return False
    collect_frozen()
    return True


def collect_frozen() -> None:
    """Collect the whole heap, frozen garbage included, and freeze it again: one full walk of
    the heap with the GIL held. The heap's size then is the next bound's base."""
    gc.unfreeze()
    gc.collect()
    gc.freeze()
    _Frozen.base = sys.getallocatedblocks()


def thaw_heap() -> None:
    """Hand the frozen heap back to the garbage collector (a stopped sidecar); the next
    ``freeze_heap`` counts its bound anew."""
    gc.unfreeze()
    _Frozen.base = None


class LoadQueue:
    """Bases waiting to load: one queue per requester, served in turn, each base queued once.

    ``take`` takes the first base of the requester whose turn it is, then moves that requester to
    the back, so with R requesters waiting a base waits for at most R - 1 loads ahead of its own
    requester's turn (and then its own requester's earlier bases)."""

    def __init__(self) -> None:
        self._by: OrderedDict[str, deque[str]] = OrderedDict()  # requester -> its bases
        self._queued: dict[str, str] = {}  # base -> its requester

    def __contains__(self, kb: object) -> bool:
        return kb in self._queued

    def __len__(self) -> int:
        return len(self._queued)

    def add(self, kb: str, requester: str) -> None:
        """Queue ``kb`` for ``requester``, unless it is queued already (for anyone)."""
        if kb in self._queued:
            return
        self._queued[kb] = requester
        self._by.setdefault(requester, deque()).append(kb)

    def ahead(self, kb: str) -> int:
        """How many queued bases ``take`` returns before ``kb`` (queued)."""
        mine = self._queued[kb]
        rounds = self._by[mine].index(kb)  # its requester's bases before it: one per round
        before = True  # requesters before its own in the turn take one more round
        ahead = rounds
        for requester, bases in self._by.items():
            if requester == mine:
                before = False
                continue
            ahead += min(len(bases), rounds + before)
        return ahead

    def take(self) -> tuple[str, str] | None:
        """The next base to load and its requester, or None when none waits."""
        if not self._by:
            return None
        requester, bases = next(iter(self._by.items()))
        kb = bases.popleft()
        if bases:
            self._by.move_to_end(requester)
        else:
            del self._by[requester]
        del self._queued[kb]
        return kb, requester

    def clear(self) -> None:
        self._by.clear()
        self._queued.clear()


class Downloading(Exception):
    """A download of ``version`` failed (its cause): the pointer was read, and named it."""

    def __init__(self, version: str) -> None:
        super().__init__(version)
        self.version = version


def newest(
    store: SnapshotStore,
    kb: str,
    served: str | None,
    rejected: Collection[str],
    keep: Sequence[str],
) -> str | None:
    """The version ``kb``'s pointer names, downloaded (``download``) when it is one to load:
    newer than ``served`` and not ``rejected``. Blocking: on a download thread."""
    version = store.latest(kb)
    if not to_load(version, served, rejected):
        return version
    assert version is not None
    return download(store, kb, version, keep)


def to_load(version: str | None, served: str | None, rejected: Collection[str]) -> bool:
    """Whether a pointer naming ``version`` names one to download and load."""
    return version is not None and version not in rejected and (served is None or version > served)


def download(store: SnapshotStore, kb: str, version: str, keep: Sequence[str]) -> str:
    """``version`` of ``kb`` fetched (``store.fetch``); blocking. A failed download is
    ``Downloading`` (its version), from the error as its cause, once the cache keeps only
    ``keep`` (the served versions) and the newest partial download: a store offering a new
    version every poll that never downloads must not fill the disk with their partials."""
    try:
        store.fetch(kb, version)
    except Exception as exc:
        try:
            store.retain(kb, keep)
        except OSError as pruning:
            log.warning("could not prune the snapshot cache of %s: %s", kb, pruning)
        raise Downloading(version) from exc
    return version


Pointer = tuple[str, str | None, Exception | None]  # a base, what its LATEST names, or the error


def read_pointers(store: SnapshotStore, kbs: Sequence[str]) -> list[Pointer]:
    """The pointers of ``kbs``, one after another: one job of a poll's pool for many bases."""
    read: list[Pointer] = []
    for kb in kbs:
        try:
            read.append((kb, store.latest(kb), None))
        except Exception as exc:
            read.append((kb, None, exc))
    return read


def refused_line(fresh: Sequence[tuple[str, str, str]]) -> str:
    """One line for the pointer reads of a poll that started failing (base, kind, reason): how
    many, of which kinds, the first ``SHOWN_BASES`` bases and the first reason."""
    kinds = Counter(kind for _, kind, _ in fresh)
    shown = ", ".join(kb for kb, _, _ in fresh[:SHOWN_BASES])
    more = f" and {len(fresh) - SHOWN_BASES} more" if len(fresh) > SHOWN_BASES else ""
    return (
        f"cannot read the pointers of {len(fresh)} bases "
        f"({', '.join(f'{n} {kind}' for kind, n in sorted(kinds.items()))}): {shown}{more}; "
        f"{fresh[0][0]}: {fresh[0][2]}; they are read again at each poll, and what each serves "
        "keeps serving (Status has each base's refusal)"
    )


def fetch_error(kb: str, exc: BaseException) -> tuple[str, SnapshotError]:
    """The version and the refusal of a failed ``newest``: its pointer's read (no version) or
    its download's (``Downloading``); an unexpected error (a bug) has its traceback logged."""
    version = exc.version if isinstance(exc, Downloading) else ""
    cause = exc.__cause__ if isinstance(exc, Downloading) else exc
    what = f"{kb} {version}" if version else f"the pointer of {kb}"
    if isinstance(cause, SnapshotError):
        return version, cause
    if isinstance(cause, OSError):
        return version, StoreUnavailable(f"cannot read {what}: {cause}")
    log.error("fetching %s failed", what, exc_info=cause)
    return version, SnapshotError(f"cannot fetch {what}: {cause!r}")


class Refresher:
    """Keeps ``holder`` at the newest good snapshot of each base in ``store``.

    ``refresh()`` runs one pass (tests call it to refresh now); ``poll_forever`` runs passes
    every ``poll_seconds`` with jitter. ``keep_downloaded`` served versions per base stay in the
    store's local cache (the current and the previous one by default); older ones are deleted.
    """

    def __init__(
        self,
        store: SnapshotStore,
        holder: SnapshotHolder,
        embedder: EmbedderInfo,
        knowledge_bases: Iterable[str],
        on_change: Callable[[], Awaitable[None]] | None = None,
        keep_downloaded: int = 2,
        ef_search: int = 0,
        budget_bytes: int = 0,
        retry_refused_s: float = 30.0,
    ) -> None:
        self.store = store
        self.budget_bytes = budget_bytes  # 0: every base loaded at start and kept
        self.retry_refused_s = retry_refused_s  # lazy: a refused base is tried again after this
        self._queue = LoadQueue()  # lazy: bases wanted, not loading yet
        self._loading = ""  # lazy: the base loading now
        self._loader: asyncio.Task[None] | None = None  # lazy: loads what the queue holds
        self._tried: dict[str, float] = {}  # lazy: when a base's last load on demand failed
        self._downloads: dict[str, asyncio.Future[str | None]] = {}  # lazy: in the background
        self._ready: dict[str, str | None] = {}  # lazy: downloaded in the background, queued
        self._held: dict[str, float] = {}  # lazy: held back for room until then (monotonic)
        self._held_bytes: dict[str, tuple[str, int]] = {}  # lazy: held: its version, its bytes
        self.knowledge_bases = tuple(knowledge_bases)
        self.listed = False  # the bases are a store's listing's (a config that names none)
        # threads start as downloads need them, so bases listed after the start (a config that
        # names none) download side by side too
        # shared fairly between requesters (``FairPool``): one that asks for many bases the
        # store trickles holds at most half the threads, and another's first load takes the next
        self._download_pool = FairPool(MAX_DOWNLOADS, "voxrecall-download")
        self._poll_pool = ThreadPoolExecutor(POLL_DOWNLOADS, "voxrecall-poll")
        self._closing = False
        self.load_ms = 0.0  # how long the last lazy load took: the retry hint
        self.ef_search = ef_search  # [sidecar] ef_search: 0 keeps each snapshot's own
        self.holder = holder
        self.embedder = embedder
        self.on_change = on_change
        self._lock = asyncio.Lock()
        # kb -> the last REJECTED_KEPT versions refused for good: a pointer flipping between
        # two bad versions (a stale CDN edge) fetched and refused one at every poll
        self._rejected: dict[str, deque[str]] = {}
        self.keep_downloaded = max(1, keep_downloaded)
        self._served: dict[str, deque[str]] = {
            kb: deque(maxlen=self.keep_downloaded) for kb in self.knowledge_bases
        }

    async def refresh(self) -> list[str]:
        """Load every base whose published version is newer than the one served; returns them.
        The bases' pointers are read in at most ``POLL_DOWNLOADS`` jobs of the poll's own
        threads (``read_pointers``: 10,000 bases were 10,000 jobs and future chains, the loop
        stalled up to a second each poll), then only the new versions are downloaded, side by
        side on those threads, outside the load lock, each loaded as its download ends: a
        store trickling pointers holds the poll (each read within the store's deadlines), a
        trickling download holds its base only, and neither holds a first load."""
        pointers = self._pointer_states()
        downloads: dict[asyncio.Future[str | None], str] = {}
        read = await self._read_pointers(self._polled())
        self._pointers_failed([(kb, exc) for kb, _, exc in read if exc is not None])
        for kb, version, exc in read:
            if exc is not None:
                continue
            self._note_pointer(kb, version)
            offer = await self._pointed(kb, version)
            if offer is not None:
                downloads[offer] = kb
        swapped = await self._serve_downloads(downloads)
        if self._pointer_states() != pointers and self.on_change is not None:
            await self.on_change()  # a base published or not yet, readable or not: LOADING
        return swapped

    def _pointer_states(self) -> tuple[frozenset[str], frozenset[str]]:
        """The bases with nothing published and those whose pointer could not be read: what
        LOADING waits on besides the snapshots (``SnapshotHolder.waiting``)."""
        return frozenset(self.holder.unpublished), frozenset(self.holder.unreadable)

    async def _read_pointers(self, kbs: Sequence[str]) -> list[Pointer]:
        """``read_pointers`` of ``kbs`` in at most ``POLL_DOWNLOADS`` jobs of the poll's pool."""
        jobs = min(POLL_DOWNLOADS, len(kbs))
        loop = asyncio.get_running_loop()
        batches = await asyncio.gather(
            *(
                loop.run_in_executor(self._poll_pool, read_pointers, self.store, kbs[i::jobs])
                for i in range(jobs)
            )
        )
        return [pointer for batch in batches for pointer in batch]

    async def _pointed(self, kb: str, version: str | None) -> asyncio.Future[str | None] | None:
        """What a poll does with the version ``kb``'s pointer names: its download started when
        it is one to load (returned), a pointer gone back refused (``_serve``), else nothing."""
        current = self.holder.get(kb)
        served = current.version if current is not None else None
        if to_load(version, served, self._rejected.get(kb, ())):
            assert version is not None
            keep = tuple(self._served.get(kb, ()))
            loop = asyncio.get_running_loop()
            return loop.run_in_executor(self._poll_pool, download, self.store, kb, version, keep)
        if version is not None and served is not None and version < served:
            async with self._lock:
                await self._serve(kb, version)
        return None

    async def _serve_downloads(self, downloads: dict[asyncio.Future[str | None], str]) -> list[str]:
        """Load each download as it ends (a queue its futures fill as they end, not a wait
        on all of those pending each round); the bases swapped."""
        ended: asyncio.Queue[asyncio.Future[str | None]] = asyncio.Queue()
        for offer in downloads:
            offer.add_done_callback(ended.put_nowait)
        swapped: list[str] = []
        for _ in downloads:
            offer = await ended.get()
            if await self._serve_offered(downloads[offer], offer):
                swapped.append(downloads[offer])
                if self.on_change is not None:
                    await self.on_change()
        return swapped

    async def _serve_offered(self, kb: str, offer: asyncio.Future[str | None]) -> str:
        """``kb`` when its offer (``_offer``, done) is loaded and served now, else ""."""
        if not self._offered(kb, offer):
            return ""
        self._note_pointer(kb, offer.result())
        async with self._lock:
            return kb if await self._serve(kb, offer.result()) else ""

    def _note_pointer(self, kb: str, version: str | None) -> None:
        """``kb``'s pointer was read (``version``): it is readable (again), and, for a listed
        base (``listed``), whether its store has a LATEST yet (a base with none is not waited
        for: ``SnapshotHolder.waiting``)."""
        if kb in self.holder.unreadable:
            self.holder.unreadable.discard(kb)
            log.info("the pointer of %s reads again: %s", kb, version or "nothing published")
        if version is not None:
            self.holder.unpublished.discard(kb)
        elif self.listed and kb in self._served:  # not one forgotten while its pointer read
            self.holder.unpublished.add(kb)

    def _offer(self, kb: str, requester: str) -> asyncio.Future[str | None]:
        """``kb``'s pointer read and, when it names a version to load, that version downloaded:
        on a thread of the first loads' (``newest``), in ``requester``'s turn (``FairPool``)."""
        current = self.holder.get(kb)
        served = current.version if current is not None else None
        keep = tuple(self._served.get(kb, ()))
        return self._download_pool.submit(
            requester,
            newest,
            self.store,
            kb,
            served,
            self._rejected.get(kb, ()),
            keep,
        )

    def _polled(self) -> tuple[str, ...]:
        if not self.budget_bytes:
            return self.knowledge_bases
        return tuple(kb for kb in self.knowledge_bases if self.holder.get(kb) is not None)

    def want(self, kb: str, peer: str = "") -> int:
        """Lazy mode: make sure ``kb`` is queued or loading (queued for the requester of
        ``peer``, the call's client: ``load_requester``); the retry hint in ms, or 0 when its
        last load failed less than ``retry_refused_s`` ago (the caller reports the refusal)."""
        requester = load_requester(peer)
        if kb in self._downloads:
            return round(DOWNLOAD_WAIT_S * 1000)
        if (held := self._held_ms(kb)) > 0:
            return held
        if kb not in self._queue and kb != self._loading:
            failed_at = self._tried.get(kb)
            if failed_at is not None and time.monotonic() - failed_at < self.retry_refused_s:
                return 0
        self._enqueue(kb, requester)
        return self._retry_ms(kb)

    def _held_ms(self, kb: str) -> int:
        """How long ``kb``, held back for room (``_room_for``), still waits, in ms (0: no
        more), within the retry hint's bounds."""
        until = self._held.get(kb)
        if until is None:
            return 0
        left = until - time.monotonic()
        if left <= 0:
            del self._held[kb]
            return 0
        return max(FIRST_RETRY_MS, min(round(left * 1000), round(self.holder.fresh_s * 500)))

    def _enqueue(self, kb: str, requester: str) -> None:
        if kb not in self._queue and kb != self._loading:
            self._queue.add(kb, requester)
        if self._loader is None:
            self._loader = asyncio.get_running_loop().create_task(self._load_queued())

    @property
    def waiting(self) -> int:
        """Bases queued to load, downloading, and the one loading (lazy mode)."""
        return len(self._queue) + len(self._downloads) + bool(self._loading)

    def _retry_ms(self, kb: str) -> int:
        """About when ``kb`` will be in: the last load's time for each load before it and its
        own, so that a caller far down the queue does not ask again after every load."""
        loads = 1 if kb == self._loading else self._queue.ahead(kb) + 1 + bool(self._loading)
        hint = max(FIRST_RETRY_MS if not self.load_ms else 10, round(self.load_ms)) * loads
        # never past the time a base just loaded waits for its caller (SnapshotHolder.fresh_s):
        # a caller told to come back later would find its base gone to a busier one
        return min(hint, round(self.holder.fresh_s * 1000 / 2))

    async def _load_queued(self) -> None:
        """Load what the queue holds, one base at a time, until it is empty."""
        try:
            while (taken := self._queue.take()) is not None:
                self._loading = taken[0]
                await self._load_wanted(*taken)
        finally:
            self._loading = ""
            self._loader = None

    async def _load_wanted(self, kb: str, requester: str) -> None:
        self._held.pop(kb, None)  # its wait for room, if any, is over: it is tried again
        if self.holder.get(kb) is not None:
            self._ready.pop(kb, None)
            return
        if kb in self._ready:
            version = self._ready.pop(kb)
        elif (offered := await self._downloaded(kb, requester)) is not None:
            version = offered.result()
        else:
            return  # still downloading, or the pointer or the download failed (a refusal)
        async with self._lock:  # a poll holds it too: its time is not the load's
            started = time.perf_counter()
            if self.holder.get(kb) is not None:
                return
            loaded = await self._serve(kb, version, requester)
        if loaded:
            self._tried.pop(kb, None)
            self.load_ms = (time.perf_counter() - started) * 1000.0
        elif kb not in self._held:  # held back for room: not a failure
            self._tried[kb] = time.monotonic()

    async def _downloaded(self, kb: str, requester: str) -> asyncio.Future[str | None] | None:
        """Read ``kb``'s pointer and download the version it names before the load, outside
        the lock and on a thread of its own, waiting at most ``DOWNLOAD_WAIT_S``: the done
        future when the load may go on; None when it goes on in the background (the base is
        queued again, its version ready, when it is in) or failed (refused, as a load would)."""
        offer = self._offer(kb, requester)
        done, _ = await asyncio.wait({offer}, timeout=DOWNLOAD_WAIT_S)
        if done:
            return offer if self._wanted_offer(kb, offer) else None
        log.info("%s is still downloading: other bases load meanwhile", kb)
        self._downloads[kb] = offer

        def ended(_: object) -> None:
            self._downloads.pop(kb, None)
            if self._wanted_offer(kb, offer) and not self._closing:
                self._ready[kb] = offer.result()
                self._enqueue(kb, requester)

        offer.add_done_callback(ended)
        return None

    def _offered(self, kb: str, offer: asyncio.Future[str | None]) -> bool:
        """Whether ``offer`` (``_offer``) succeeded; a failure is refused here: the pointer's
        (version unknown) or the download's."""
        if offer.cancelled():
            return False
        exc = offer.exception()
        if exc is None:
            return True
        if isinstance(exc, Downloading):  # the pointer read: readable again, its version bad
            self._note_pointer(kb, exc.version)
            self._refuse(kb, *fetch_error(kb, exc))
        else:
            self._pointer_failed(kb, exc)
        return False

    def _pointers_failed(self, failed: list[tuple[str, Exception]]) -> None:
        """``_pointer_failed`` for each pointer read of a poll that failed, those that started
        failing at this poll logged in one line (``refused_line``): a store down fails every
        base's pointer, and one line each was 10,000 lines at the first poll."""
        fresh = [
            started
            for kb, exc in failed
            if (started := self._pointer_failed(kb, exc, quiet=len(failed) > 1)) is not None
        ]
        if len(failed) > 1 and fresh:
            log.error("%s", refused_line(fresh))

    def _pointer_failed(
        self, kb: str, exc: BaseException, quiet: bool = False
    ) -> tuple[str, str, str] | None:
        """A read of ``kb``'s pointer failed (an error, not an absent LATEST): a refusal of no
        version (``Status`` shows it; a call is told to retry after the next poll), and the
        base ``unreadable``, not waited for once another base serves. Logged once as it starts
        failing (unless ``quiet``: the caller sums it up; returned, base, kind and reason, then)
        and once as it reads again (``_note_pointer``), not at every poll."""
        if kb not in self._served:  # forgotten while its pointer was read
            return None
        _, error = fetch_error(kb, exc)
        kind, retried = refusal_kind(error)
        self.holder.refuse(kb, "", kind, str(error), retried)
        if kb in self.holder.unreadable:
            return None
        self.holder.unreadable.add(kb)
        if not quiet:
            log.error(
                "cannot read the pointer of %s (%s): %s; %s; it is read again at each poll",
                kb,
                kind,
                error,
                self._keeps(kb),
            )
        return kb, kind, str(error)

    def _wanted_offer(self, kb: str, offer: asyncio.Future[str | None]) -> bool:
        """``_offered`` for a base loading on demand: a failure starts its
        ``retry_refused_s``."""
        if self._offered(kb, offer):
            self._note_pointer(kb, offer.result())
            return True
        self._tried[kb] = time.monotonic()
        return False

    async def _serve(self, kb: str, version: str | None, requester: str | None = None) -> bool:
        """Load, verify and publish ``version`` (what ``kb``'s pointer named, downloaded by
        ``newest``) when it is newer than the one served, for ``requester``'s load (None: a
        poll): under the load lock. A poll refreshes only the bases still loaded: one evicted
        while the poll read its pointer is not loaded again (that would evict another caller's
        working set for a base nobody asked for)."""
        current = self.holder.get(kb)
        if version is None or version in self._rejected.get(kb, ()):
            return False
        if current is None and requester is None and self.budget_bytes:
            return False
        if current is not None and version <= current.version:
            if version < current.version:
                self._reject(kb, version)
                self._record(
                    kb,
                    version,
                    "backwards",
                    f"the store's pointer went back from {current.version} (served) to {version}",
                )
            return False
        return await self._publish(kb, version, requester)

    async def _publish(self, kb: str, version: str, requester: str | None) -> bool:
        """Load ``version`` and serve it, evicting what it needs room for (``_room_for``)."""
        if self._still_no_room(kb, version, requester):
            return False
        searcher = await self._load_or_refuse(kb, version)
        if searcher is not None and self._over_budget_alone(kb, version, searcher):
            searcher = None
        if searcher is None:
            await self._prune(kb)  # a refused download goes: else one stays per version offered
            return False
        victims = self._room_for(kb, version, searcher, requester)
        if victims is None:
            return False  # its download stays for the retry
        self._held_bytes.pop(kb, None)
        self.holder.publish(searcher, requester or "")  # the swap: one reference, on the loop
        for victim in victims:  # after the load was verified: a bad version evicts nothing
            self.holder.remove(victim)
            log.info("evicted %s to keep within the memory budget", victim)
        freeze_heap()
        log.info("serving %s version %s (%d chunks)", kb, version, len(searcher.chunks))
        self._served.setdefault(kb, deque(maxlen=2)).append(version)
        await self._prune(kb)
        return True

    def _room_for(
        self, kb: str, version: str, searcher: Searcher, requester: str | None
    ) -> list[str] | None:
        """The bases to evict so that ``searcher`` fits the budget (``over_budget``); None when
        only other callers' working sets would make room: ``kb`` is held back (``_held``) until
        the first of them may leave, and its calls get the retry hint meanwhile."""
        if not self.budget_bytes:
            return []
        victims = self.holder.over_budget(self.budget_bytes, kb, searcher.memory_bytes, requester)
        if victims is None:
            self._held_bytes[kb] = (version, searcher.memory_bytes)
            self._hold(kb, version, requester)
        return victims

    def _still_no_room(self, kb: str, version: str, requester: str | None) -> bool:
        """Whether ``version``, built before and held back for room (``_held_bytes``), still
        has none: its hold is extended without building it again (a build takes tens of
        seconds at 1M chunks, under the load lock)."""
        held = self._held_bytes.get(kb)
        if held is None or held[0] != version or requester is None:
            return False
        if self.holder.over_budget(self.budget_bytes, kb, held[1], requester) is not None:
            return False
        self._hold(kb, version, requester)
        return True

    def _hold(self, kb: str, version: str, requester: str | None) -> None:
        """Hold ``kb`` back until the first working set in its way may leave (``room_in``)."""
        wait_s = self.holder.room_in(requester or "")
        self._held[kb] = time.monotonic() + wait_s
        log.info(
            "%s %s waits %.1f s for room: the bases other callers keep using fill "
            "[sidecar] memory_budget_mb",
            kb,
            version,
            wait_s,
        )

    def _over_budget_alone(self, kb: str, version: str, searcher: Searcher) -> bool:
        """Refuse (once, for good) a version whose bytes, loaded, pass the memory budget on
        their own (``OverBudget``; one whose files alone do is refused before it loads,
        ``_check_fits``)."""
        if not self.budget_bytes or searcher.memory_bytes <= self.budget_bytes:
            return False
        self._refuse(kb, version, OverBudget(searcher.memory_bytes, self.budget_bytes))
        return True

    def _check_fits(self, folder: Path) -> None:
        """``OverBudget`` for a version fetched into ``folder`` whose files and hnswlib's fixed
        cost alone (what its loaded bytes are at least, ``LoadedSnapshot.memory_bytes``) pass
        the memory budget: refused before it is loaded, which would take those bytes and more
        (a 174 MiB base under a 16 MiB budget took the process 250 MB past its peak)."""
        if not self.budget_bytes:
            return
        least = sum(read_manifest(folder).sizes.values()) + HNSW_INDEX_BYTES
        if least > self.budget_bytes:
            raise OverBudget(least, self.budget_bytes)

    async def _load_or_refuse(self, kb: str, version: str) -> Searcher | None:
        """``version``'s searcher, or None once it is refused (every failure is a refusal)."""
        try:
            return await self._load(kb, version)
        except SnapshotError as exc:
            self._refuse(kb, version, exc)
        except OSError as exc:
            self._refuse(kb, version, StoreUnavailable(f"cannot read {kb} {version}: {exc}"))
        except Exception as exc:  # a loader bug, not a verdict: still a refusal, traceback once
            log.exception("loading %s snapshot %s failed unexpectedly", kb, version)
            self._refuse(kb, version, SnapshotError(f"cannot load {kb} {version}: {exc!r}"))
        return None

    async def _prune(self, kb: str) -> None:
        """Keep only the served versions' downloads (``keep_downloaded``) in the store's cache,
        after every load, served or refused: a store offering a new bad version every poll
        must not fill the disk with them."""
        try:
            await asyncio.to_thread(self.store.retain, kb, tuple(self._served.get(kb, ())))
        except OSError as exc:
            log.warning("could not prune the snapshot cache of %s: %s", kb, exc)

    async def _load(self, kb: str, version: str) -> Searcher:
        """Fetch, load and verify, check it is the version asked for, warm and build its
        searcher: all off the loop."""
        folder = await asyncio.to_thread(self.store.fetch, kb, version)
        await asyncio.to_thread(self._check_fits, folder)
        # fetch checked every file's sha256 (the SnapshotStore contract; hashing them again
        # took 8 of the 52 s a 1M-chunk snapshot took to load) and, where the store says so,
        # the graphs' layout (checking it again: a third of what hnswlib's own load takes)
        snapshot = await asyncio.to_thread(
            load_snapshot,
            folder,
            self.embedder,
            checksums=False,
            fetched=getattr(self.store, "checks_graphs", False),
            ef_search=self.ef_search,
        )
        manifest = snapshot.manifest
        if (manifest.knowledge_base, manifest.version) != (kb, version):
            raise CorruptSnapshot(
                f"{folder}: the pointer names {kb} {version} but the manifest says "
                f"{manifest.knowledge_base} {manifest.version}"
            )
        # under a memory budget the bytes are the bases': no answers, a cache, to take theirs
        return await asyncio.to_thread(warm_up, snapshot, not self.budget_bytes)

    def _refuse(self, kb: str, version: str, exc: SnapshotError) -> None:
        kind, retry = refusal_kind(exc)
        if not retry:
            self._reject(kb, version)
        self._record(kb, version, kind, str(exc), retried=retry)

    def _reject(self, kb: str, version: str) -> None:
        """``version`` of ``kb`` is refused for good: never fetched or loaded again."""
        rejected = self._rejected.setdefault(kb, deque(maxlen=REJECTED_KEPT))
        if version not in rejected:
            rejected.append(version)

    def _record(
        self, kb: str, version: str, kind: str, reason: str, *, retried: bool = False
    ) -> None:
        if self.holder.refuse(kb, version, kind, reason, retried):
            log.error(
                "refused %s snapshot %s (%s): %s; %s",
                kb,
                version or "?",
                kind,
                reason,
                self._keeps(kb),
            )
        else:
            log.debug("still refusing %s snapshot %s (%s): %s", kb, version or "?", kind, reason)

    def _keeps(self, kb: str) -> str:
        served = self.holder.get(kb)
        return f"still serving {served.version}" if served else "nothing to serve yet"

    def close(self) -> None:
        """Abandon the store's waits (retry backoff), and hand the heap frozen at each swap back
        to the garbage collector, which then collects a stopped sidecar in a process that goes on
        (tests; an embedding host)."""
        self._closing = True
        self.store.close()
        self._download_pool.shutdown()
        self._poll_pool.shutdown(wait=False, cancel_futures=True)
        self._queue.clear()
        if self._loader is not None:
            self._loader.cancel()
        thaw_heap()

    def add_bases(self, names: Iterable[str]) -> list[str]:
        """Keep these bases current too (published to the store since the start): the next
        refresh loads them, or, with a memory budget, their first call; returns those new here."""
        new = [kb for kb in names if kb not in self._served]
        for kb in new:
            self._served[kb] = deque(maxlen=self.keep_downloaded)
        self.knowledge_bases = (*self.knowledge_bases, *new)
        return new

    def remove_bases(self, names: Iterable[str]) -> None:
        """Forget these bases (gone from the store's listing, not loaded)."""
        gone = set(names)
        self.knowledge_bases = tuple(kb for kb in self.knowledge_bases if kb not in gone)
        for kb in gone:
            self._served.pop(kb, None)
            self._rejected.pop(kb, None)
            self._tried.pop(kb, None)
            self._held.pop(kb, None)
            self._held_bytes.pop(kb, None)
            self._ready.pop(kb, None)
        self.holder.forget(gone)

    async def poll_forever(
        self, every_s: float, before: Callable[[], Awaitable[None]] | None = None
    ) -> None:
        """Refresh every ``every_s`` seconds with +-10% jitter, so a fleet does not poll in step;
        ``before`` runs first at each poll (the sidecar lists the store's bases again)."""
        while True:
            await asyncio.sleep(every_s * random.uniform(0.9, 1.1))
            try:
                if before is not None:
                    await before()
                await self.refresh()
            except Exception:  # keep polling: the last good snapshot serves meanwhile
                log.exception("snapshot refresh failed")
