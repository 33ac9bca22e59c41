"""The snapshot holder: one immutable snapshot per knowledge base behind a single reference.

A request reads ``holder.get(kb)`` once and keeps that reference until it ends, so a swap never
changes a snapshot under a running search; the old snapshot is freed by the garbage collector
when the last request holding it finishes. ``publish`` is one reference assignment.

Refusals are kept beside the snapshots: the last one per base (shown by ``Status``) and a count
per reason (``refusals``), the figures a metrics exporter reads.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType

from index.snapshot import LoadedSnapshot


@dataclass(frozen=True, slots=True)
class Refusal:
    """Why a base's newest offered snapshot is not served: ``kind`` is the metric's label."""

    version: str  # empty when the store could not even say which version it has
    kind: str  # corrupt, incompatible, invalid, incomplete, unavailable, disk_full, cache_write, backwards
    reason: str
    at: float

    def __str__(self) -> str:
        at = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(self.at))
        return f"{self.version or 'store'}: {self.kind}: {self.reason} (last seen {at})"


class SnapshotHolder:
    def __init__(self) -> None:
        self._snapshots: Mapping[str, LoadedSnapshot] = MappingProxyType({})
        self._refusals: dict[str, Refusal] = {}
        self.refusals: Counter[str] = Counter()  # refusals by kind, since start

    def get(self, knowledge_base: str) -> LoadedSnapshot | None:
        return self._snapshots.get(knowledge_base)

    def all(self) -> Mapping[str, LoadedSnapshot]:
        return self._snapshots

    def publish(self, snapshot: LoadedSnapshot) -> None:
        kb = snapshot.manifest.knowledge_base
        self._snapshots = MappingProxyType({**self._snapshots, kb: snapshot})

    def refuse(self, knowledge_base: str, version: str, kind: str, reason: str) -> bool:
        """Record a refusal; False (and not counted again) when it repeats the last one."""
        last = self._refusals.get(knowledge_base)
        repeat = last is not None and (last.version, last.kind) == (version, kind)
        self._refusals[knowledge_base] = Refusal(version, kind, reason, time.time())
        if not repeat:
            self.refusals[kind] += 1
        return not repeat

    def last_refusal(self, knowledge_base: str) -> Refusal | None:
        return self._refusals.get(knowledge_base)
