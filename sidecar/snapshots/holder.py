"""The snapshot holder: one immutable searcher per knowledge base behind a single reference.

A searcher (``sidecar/snapshots/searcher.py``) is a snapshot and everything built from it for queries. A
request reads ``holder.use(kb)`` once and keeps that reference until it ends, so a swap never
changes a snapshot, or anything built from it, under a running search; the old searcher and its
snapshot are freed when the last request holding them finishes. ``publish`` is one reference
assignment. ``get(kb)`` is the served snapshot alone (its version, counts, manifest).

With a memory budget (``[sidecar] memory_budget_mb``) bases come and go: ``use`` marks a base
used (by the call's requester, ``addresses.load_requester``), ``over_budget`` names the ones to
``remove`` until the loaded bases' bytes (``Searcher.memory_bytes``) fit with a base about to
be published: the least recently used first. A base just loaded is not yet used: it is *fresh*
until its first call uses it (the caller that asked for it retries after the hint). Each
requester's newest fresh base goes only after every used one, for ``FRESH_S``; so a caller
cycling through bases cannot get another caller's new base evicted before that caller's first
call. A requester's older fresh bases (it asked for another since, and never called them) go
before every used one: a caller cycling through bases it never calls evicts its own, not a base
another caller is using. A new version of a used base keeps its place.

A base is in a *working set* when it was called again within ``REUSE_S`` of its previous call
(by any requester) and last called less than ``REUSE_S`` ago; it is the working set of the
requesters that called it in that window (the last ``SHARERS`` of them, kept per base), and is
evicted for the load of a requester only when that requester is the only one whose working set
holds it: a base several agent processes share (on the loopback each connection is a requester)
is theirs together, none of their loads evicts it while another still calls it, and calling a
base another requester keeps using (once, or every few seconds) does not make it evictable for
one's own loads. A load that could only be made by evicting one is not served
(``over_budget`` says None, ``room_in`` when to try again): a caller going through many bases,
however many connections or addresses it uses, cannot thrash the bases other callers keep
coming back to; when the working sets alone fill the budget, new loads wait (the working-set
rule of paging, not thrashing). A working set goes for the loads of its one requester, least
recently used first as any base, and a poll's new version of a loaded base may evict
any base (the budget holds).

Refusals are kept beside the snapshots: the last one per base (shown by ``Status``) and a count
per reason (``refusals``), the figures a metrics exporter reads.
"""

from __future__ import annotations

import time
from collections import Counter, OrderedDict
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType

from index.errors import shortened
from index.snapshot import LoadedSnapshot
from sidecar.edge.addresses import load_requester
from sidecar.snapshots.searcher import Searcher

# How long a base loaded for a caller stays ahead of used bases before its first call. A caller
# retries after the hint (the last load's time: tens to hundreds of milliseconds); 10 s covers a
# slow client on a busy machine, and bounds how long a base whose caller went away is kept ahead
# of bases in use.
FRESH_S = 10.0
# A base its caller comes back to within this, and called this recently, is in that caller's
# working set: another caller's load does not evict it. A voice agent searches its base every
# turn or few (seconds apart); a caller gone for 30 s lets its bases go.
REUSE_S = 30.0
# Requesters remembered per base as calling it (its working set's): a base shared by more
# agent processes than this is protected for the last ones only; its others' loads may evict it.
SHARERS = 8
# A refusal's reason as kept (and shown by Status, and quoted by a call refused for the base):
# a sentence naming a file and a cause fits many times over; a store's error text is cut at
# its source too (``index.http_store.MAX_REASON_BYTES``), and this holds whatever else says more.
MAX_REFUSAL_BYTES = 1024


@dataclass(slots=True)
class Uses:
    """A base's calls: the last one's peer and requester (``load_requester``, worked out again
    only for a call from another peer) and time, whether it came within ``reuse_s`` of the one
    before (by any requester), and the last ``SHARERS`` requesters' last calls, oldest first."""

    peer: str
    requester: str
    at: float
    again: bool = False
    by: OrderedDict[str, float] = field(default_factory=OrderedDict)


@dataclass(frozen=True, slots=True)
class Refusal:
    """Why a base's newest offered snapshot is not served: ``kind`` is the metric's label."""

    version: str  # empty when the store could not even say which version it has
    kind: str  # corrupt, incompatible, invalid, incomplete, unavailable, disk_full, cache_write,
    # backwards, over_budget
    reason: str
    at: float
    retried: bool = False  # the store or the cache failed, not the version: it is tried again

    def __str__(self) -> str:
        at = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(self.at))
        return f"{self.version or 'store'}: {self.kind}: {self.reason} (last seen {at})"


class SnapshotHolder:
    def __init__(self) -> None:
        self._searchers: Mapping[str, Searcher] = MappingProxyType({})
        self._refusals: dict[str, Refusal] = {}
        self.refusals: Counter[str] = Counter()  # refusals by kind, since start
        self._used: OrderedDict[str, None] = OrderedDict()  # least recently used first
        self._fresh: dict[str, tuple[float, str]] = {}  # loaded, not used: when, for whom
        self._calls: dict[str, Uses] = {}  # base -> its calls (kept after an eviction)
        self.fresh_s = FRESH_S
        self.reuse_s = REUSE_S
        self.evictions = 0  # bases removed to keep within the memory budget, since start
        # bases a store's listing named (a config that names none) whose LATEST was not there
        # at the last read of their pointer (a folder made, nothing published yet): not waited
        # for (``waiting``); the refresher keeps it
        self.unpublished: set[str] = set()
        # bases whose pointer could not be read at its last read (an error, not an absent
        # LATEST: a store answering 500, a file that cannot be read): read again at each poll,
        # and not waited for once another base serves (``waiting``); the refresher keeps it
        self.unreadable: set[str] = set()

    def waiting(self, known: Iterable[str]) -> list[str]:
        """The bases of ``known`` with no snapshot served that a sidecar waits for (LOADING),
        by name: not a listed base with nothing published yet (``unpublished``), nor, once
        another base serves, one whose pointer could not be read (``unreadable``): one broken
        base holds no sidecar out of SERVING, a store that fails every base's does."""
        skip = self.unreadable if self._searchers else frozenset()
        return sorted(
            kb
            for kb in known
            if kb not in self.unpublished and kb not in skip and self.get(kb) is None
        )

    def forget(self, names: set[str]) -> None:
        """Drop what is kept of bases the sidecar no longer knows (gone from the store, not
        loaded): their calls, kept after an eviction, and their last refusal would otherwise
        grow with every name a store ever listed."""
        for kb in names:
            self._calls.pop(kb, None)
            self._fresh.pop(kb, None)
            self._refusals.pop(kb, None)
        self.unpublished -= names
        self.unreadable -= names

    def get(self, knowledge_base: str) -> LoadedSnapshot | None:
        """The snapshot served for ``knowledge_base`` (a call searches through ``use``)."""
        searcher = self._searchers.get(knowledge_base)
        return searcher.snapshot if searcher is not None else None

    def use(self, knowledge_base: str, peer: str = "") -> Searcher | None:
        """The searcher for a call: marks the base most recently used (O(1)), by the requester
        of ``peer`` (the call's client) when one is given (a sidecar with a memory budget)."""
        searcher = self._searchers.get(knowledge_base)
        if searcher is not None:
            if self._fresh:
                self._fresh.pop(knowledge_base, None)
            self._used[knowledge_base] = None
            self._used.move_to_end(knowledge_base)
            if peer:
                self._called(knowledge_base, peer, time.monotonic())
        return searcher

    def _called(self, kb: str, peer: str, now: float) -> None:
        """Record a call; on the hot path, so a call from the last call's connection (the
        usual case) compares strings, not requesters: O(1)."""
        uses = self._calls.get(kb)
        if uses is None:
            uses = self._calls[kb] = Uses(peer, load_requester(peer), now)
        else:
            uses.again = now - uses.at <= self.reuse_s
            uses.at = now
            if uses.peer != peer:
                uses.peer, uses.requester = peer, load_requester(peer)
        uses.by[uses.requester] = now
        uses.by.move_to_end(uses.requester)
        if len(uses.by) > SHARERS:
            uses.by.popitem(last=False)

    def _kept_from(self, kb: str, now: float, requester: str | None) -> bool:
        """Whether ``kb`` is in a working set (see the module docstring) of a requester other
        than ``requester`` (None: a poll, kept from nothing): ``requester`` calling it too does
        not make it evictable for its loads."""
        uses = self._calls.get(kb)
        if requester is None or uses is None or not uses.again or now - uses.at > self.reuse_s:
            return False
        return any(by != requester and now - at <= self.reuse_s for by, at in uses.by.items())

    def publish(self, searcher: Searcher, requester: str = "") -> None:
        """Serve ``searcher`` (built, warm) for its base: one reference swap. A base new here is
        fresh (not used yet) for ``requester`` (who asked for its load); a new version of a used
        base keeps its place."""
        kb = searcher.snapshot.manifest.knowledge_base
        self._searchers = MappingProxyType({**self._searchers, kb: searcher})
        if kb not in self._used and kb not in self._fresh:
            self._fresh[kb] = (time.monotonic(), requester)

    def loaded_bytes(self) -> int:
        return sum(s.memory_bytes for s in self._searchers.values())

    def over_budget(
        self, budget_bytes: int, keep: str, adding: int = 0, requester: str | None = None
    ) -> list[str] | None:
        """The bases (never ``keep``) whose removal brings the loaded bytes, with ``adding``
        more for ``keep`` (replacing its searcher, if any), within ``budget_bytes``, in
        ``eviction_order``. For a load of ``requester``'s (None: a poll) a working set it is not
        in is not evicted: None when only that would make room."""
        current = self._searchers.get(keep)
        excess = self.loaded_bytes() - (current.memory_bytes if current else 0) + adding
        excess -= budget_bytes
        out: list[str] = []
        for kb in self.eviction_order(time.monotonic(), keep, requester):
            if excess <= 0:
                break
            searcher = self._searchers.get(kb)
            if kb != keep and searcher is not None:
                out.append(kb)
                excess -= searcher.memory_bytes
        return out if excess <= 0 or requester is None else None

    def room_in(self, requester: str) -> float:
        """Seconds until the first base of a working set ``requester`` is not in leaves it (its
        callers did not come back within ``reuse_s``): when a load refused room may try again."""
        now = time.monotonic()
        lapses = [
            self._calls[kb].at + self.reuse_s - now
            for kb in self._used
            if self._kept_from(kb, now, requester)
        ]
        return max(0.0, min(lapses, default=0.0))

    def eviction_order(self, now: float, keep: str = "", requester: str | None = None) -> list[str]:
        """Which loaded bases go first: fresh ones loaded more than ``fresh_s`` ago (their
        caller did not come), then fresh ones whose requester has a newer fresh base than
        ``keep`` (the one loading now), then the used ones, least recently used first (for a
        load of ``requester``'s, the working sets it is not in left out), then each
        requester's newest fresh base, oldest first."""
        stale = [kb for kb, (at, _) in self._fresh.items() if now - at > self.fresh_s]
        newest: dict[str, str] = {}  # requester -> its newest waiting base; dicts keep order
        crowded: list[str] = []
        for kb, (at, asker) in self._fresh.items():
            if now - at <= self.fresh_s and kb != keep:
                if asker in newest:
                    crowded.append(newest[asker])
                newest[asker] = kb
        newest_of = set(newest.values())
        waiting = [kb for kb in self._fresh if kb == keep or kb in newest_of]
        stale_set = set(stale)
        used = self._used_order(now, requester)
        return [*stale, *crowded, *used, *(kb for kb in waiting if kb not in stale_set)]

    def _used_order(self, now: float, requester: str | None) -> list[str]:
        """The used bases, least recently used first; for a load of ``requester``'s, without
        the working sets it is not in."""
        if requester is None:
            return list(self._used)
        return [kb for kb in self._used if not self._kept_from(kb, now, requester)]

    def remove(self, knowledge_base: str) -> None:
        """Stop serving a base (evicted): its searcher goes when the last call holding it ends."""
        self._searchers = MappingProxyType(
            {kb: s for kb, s in self._searchers.items() if kb != knowledge_base}
        )
        self._used.pop(knowledge_base, None)
        self._fresh.pop(knowledge_base, None)
        self.evictions += 1

    def clear(self) -> None:
        """Serve nothing more: each searcher (and its mapped files) goes when the last call
        holding it ends. A stopped sidecar calls it, so a process that goes on unmaps them."""
        self._searchers = MappingProxyType({})
        self._used.clear()
        self._fresh.clear()
        self._calls.clear()

    def refuse(
        self, knowledge_base: str, version: str, kind: str, reason: str, retried: bool = False
    ) -> bool:
        """Record a refusal, its reason cut to ``MAX_REFUSAL_BYTES``; False (and not counted
        again) when it repeats the last one."""
        last = self._refusals.get(knowledge_base)
        repeat = last is not None and (last.version, last.kind) == (version, kind)
        kept = shortened(reason, MAX_REFUSAL_BYTES)
        self._refusals[knowledge_base] = Refusal(version, kind, kept, time.time(), retried)
        if not repeat:
            self.refusals[kind] += 1
        return not repeat

    def last_refusal(self, knowledge_base: str) -> Refusal | None:
        return self._refusals.get(knowledge_base)
