"""What one call may reach: its metadata filters and page paths, and the caller's own filters.

    allowed = scope.resolve(searcher, "help", filters, source_paths, sources)

A call's filters (``SearchRequest.filters``, ``TurnRequest.filters``, a knowledge function's
fixed filters and its model's arguments) and the filters of the caller's token
(``[sidecar.auth.caller] filters``, set per call by ``sidecar.edge.auth`` in ``caller_filters``) all
apply together: the caller's filters are intersected with whatever a request asks, so no request
can widen them. A field the snapshot has no index for is INVALID_ARGUMENT naming the fields it
has, never a silent "no filter" (for a caller's filters too: a base that cannot apply them
answers nothing rather than everything). A source the snapshot does not have is
INVALID_ARGUMENT too, naming it and the sources it has (``check_sources``): a misspelt or
dropped source would otherwise answer nothing, as if the base knew nothing of the question.
"""

from __future__ import annotations

import bisect
import heapq
from collections.abc import Iterable, Sequence
from contextvars import ContextVar

from index.config import NAMED, named, quoted
from index.filters import Allowed
from index.types import MetadataFilter
from sidecar.errors import FilterRefused, NotFound
from sidecar.snapshots.searcher import Searcher

# The current call's caller's filters ([sidecar.auth.caller] filters); empty without auth.
caller_filters: ContextVar[tuple[MetadataFilter, ...]] = ContextVar("caller_filters", default=())
# A request names a few fields; past this it is a client bug, refused before any mask is built.
MAX_FILTERS = 16
# Each glob is matched against every page of the snapshot (once, then the mask is cached):
# 16 globs over 10,000 pages is ~20 ms the first time.
MAX_SOURCE_PATHS = 16
# A glob becomes a regex compiled on the event loop, at a cost that grows with its wildcards
# faster than with its length: 512 "*a" (1 KiB) took 0.13 s each, 2 s for a call's 16 fresh
# ones while every other call waited; 16 wildcards take ~2 ms. A path needs a few.
MAX_GLOB_WILDCARDS = 16
_WILDCARDS = ("*", "?", "[")


def unknown_base(kb: str, known: Iterable[str]) -> NotFound:
    """The answer for a base a call cannot reach: one that does not exist, or (for a scoped
    token, ``sidecar.edge.auth``) one outside its scope, alike, so a token learns no name outside
    its scope; ``known`` is what the caller may reach. It names the first ``NAMED`` of them
    (``named``): a sidecar of 800 bases listed them all, over the 16 KiB of metadata a gRPC client
    takes, which then answered RESOURCE_EXHAUSTED instead."""
    names = list(known)
    first = heapq.nsmallest(NAMED, names)
    more = f" and {len(names) - NAMED} more" if len(names) > NAMED else ""
    return NotFound(f"unknown knowledge base {quoted(kb)}; known: {named(first)}{more}")


def check_sources(searcher: Searcher, kb: str, sources: Sequence[str]) -> None:
    """Every one of ``sources`` is a source of the searcher's snapshot, or INVALID_ARGUMENT
    naming the unknown ones and the ones it has (after a hot swap that dropped a source too)."""
    if not sources:
        return
    names = searcher.sources.names
    unknown = [s for s in dict.fromkeys(sources) if s not in names]
    if unknown:
        raise FilterRefused(
            f"knowledge base {kb!r} has no source {named(unknown)} (snapshot "
            f"{searcher.version}); its sources: {named(names)}: name one of them, or none to "
            "search them all"
        )


def check(filters: Sequence[MetadataFilter], source_paths: Sequence[str]) -> None:
    """A request's filters and paths, as written: INVALID_ARGUMENT saying what to change.
    (The interceptor already bounds every string in bytes: ``sidecar.edge.limits``.)"""
    if len(filters) > MAX_FILTERS:
        raise FilterRefused(f"{len(filters)} filters; the limit is {MAX_FILTERS}")
    for i, f in enumerate(filters):
        if not f.field:
            raise FilterRefused(f"filters[{i}].field is empty: name a filterable field")
        if not f.any_of or not all(f.any_of):
            raise FilterRefused(
                f"filters[{i}] ({f.field!r}) needs any_of: one or more non-empty values"
            )
    if len(source_paths) > MAX_SOURCE_PATHS:
        raise FilterRefused(f"{len(source_paths)} source_paths; the limit is {MAX_SOURCE_PATHS}")
    if not all(source_paths):
        raise FilterRefused(
            'a source_paths entry is empty: give a prefix ending in "/", a glob, or a path'
        )
    for i, pattern in enumerate(source_paths):
        wildcards = sum(map(pattern.count, _WILDCARDS))
        if wildcards > MAX_GLOB_WILDCARDS:
            raise FilterRefused(
                f"source_paths[{i}] has {wildcards} wildcards (*, ?, [); the limit is "
                f"{MAX_GLOB_WILDCARDS}: name a folder or a simpler glob"
            )


ROOTS = ("./", "/")  # how a path written from a folder, or the file system's root, begins
QUOTED_PATH = 80  # how much of a refused path the error repeats


def check_rooted(paths: Sequence[str], source_paths: Sequence[str]) -> None:
    """A pattern written from a root (``./voicemail.md``, ``/voicemail.md``) where no page's path
    begins so (a folder source's paths are relative to its folder) is refused, saying how
    results give it, rather than matching nothing. ``paths``: the snapshot's, sorted."""
    for i, pattern in enumerate(source_paths):
        root = next((r for r in ROOTS if pattern.startswith(r)), "")
        at = bisect.bisect_left(paths, root)
        if root and not (at < len(paths) and paths[at].startswith(root)):
            raise FilterRefused(
                f"source_paths[{i}] {pattern[:QUOTED_PATH]!r} begins with {root!r}, as no page's "
                f"path does: give it as results do, e.g. {pattern.removeprefix(root)[:QUOTED_PATH]!r}"
            )


def resolve(
    searcher: Searcher,
    kb: str,
    filters: Sequence[MetadataFilter],
    source_paths: Sequence[str],
    sources: Sequence[str],
) -> Allowed | None:
    """What the call may reach in the searcher's snapshot, with the caller's filters; None: no
    filter beyond ``sources`` (which the snapshot's source partitions serve)."""
    check_sources(searcher, kb, sources)
    caller = caller_filters.get()
    if not filters and not source_paths and not caller:
        return None  # most calls: nothing to check, nothing to mask
    check(filters, source_paths)
    snapshot = searcher.snapshot
    every = (*filters, *caller)
    unknown = snapshot.filters.unknown(every)
    if unknown:
        known = ", ".join(sorted(snapshot.filters.fields)) or "none"
        raise FilterRefused(
            f"knowledge base {kb!r} cannot filter on {', '.join(map(repr, unknown))} (its "
            f"filterable fields: {known}): add them to its [[knowledge_base]] filterable and "
            "rebuild"
        )
    if not every and not source_paths:
        return None
    check_rooted(snapshot.filters.paths, source_paths)
    ids = searcher.sources.ids(sources)
    mask = searcher.sources.mask(ids) if ids is not None else None
    return snapshot.filters.allowed(every, source_paths, mask)
