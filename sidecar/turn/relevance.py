"""Ranking one query against one snapshot's searcher (``sidecar/snapshots/searcher.py``): one strategy
per mode, dense, lexical fallback or hybrid; thresholds; the ``context_url`` bonus. Pure and
synchronous: an hnswlib query is well under a millisecond and a BM25 query a few, cheaper than a
hop to a thread. Everything a query reads was built with the searcher, before the swap.

    dense     cosine >= min_score, best first
    lexical   (no vector: the embedder missed or failed) BM25 >= min_lexical_score
    summaries (a base built with summaries = true) the content prong fused with the summary
              prong (``_with_summaries``) before any of the above
    hybrid    the top FUSION_DEPTH of each, every candidate scored exactly by both (cosine and
              BM25), fused by a convex combination of min-max-normalised scores with equal
              weights; the score is the fused one, in [0, 1]. The dense side judges whether the
              base knows the topic at all: with no chunk at min_score the answer is empty (BM25
              scores have no fixed scale, and common words give unrelated questions high ones).
              Otherwise a chunk is kept when either score passes its own threshold.

The query's text reaches BM25 without the frames of a spoken question (``SPOKEN_STOPWORDS``:
"how do I", "can you tell me"), which would otherwise rank the pages that say them.

``context_url`` (the page a web or in-app caller is on) lifts chunks whose ``related_urls``
metadata (comma-separated globs, e.g. ``/settings/integrations/*``) match it: ``+bonus`` on the
cosine similarity, then re-sorted. The bonus never lets a chunk past ``min_score``: thresholds
apply to the unlifted score. BM25 scores have no fixed scale, so a matching lexical result is
multiplied by ``1 + LEXICAL_LIFT * bonus`` instead (the same relative lift +0.05 gives a
typical relevant cosine of 0.5).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from fnmatch import fnmatchcase
from typing import Literal, TypeVar
from urllib.parse import urlsplit

import numpy as np
import numpy.typing as npt

from index.embedders.base import Vectors
from index.filters import Allowed, Mask
from index.filters import search as search_allowed
from index.lexical import SPOKEN_STOPWORDS, convex_fusion
from index.types import MetaValue
from sidecar.errors import InvalidArgument
from sidecar.snapshots.searcher import Searcher

# Candidates per retriever before fusion. On SciFact (bench/quality_scifact.py) convex fusion
# scored the same at 20 and 100 (nDCG@10 0.739 both), so the cheaper depth stays.
FUSION_DEPTH = 20
# Candidates looked at when a context_url may lift one: a related chunk this far down can
# climb into the top max_results with a realistic bonus, farther down it is not relevant enough.
CONTEXT_DEPTH = 10
LEXICAL_LIFT = 2.0
# A listed option's chunks scored exactly by a question over the options (``each_best``): at
# most this many of each (a page of more is scored by its first ones). The largest entity of
# every measured set holds 686 chunks (rclone's docs; DSTC11's places 100, doc2dial's pages 53).
EACH_CHUNKS = 1024
# the frontmatter / metadata key holding the globs: a string of comma-separated globs, or a list
RELATED_URLS = "related_urls"

Ranked = list[tuple[int, float]]
Related = Callable[[Mapping[str, MetaValue]], bool]
Item = TypeVar("Item")  # what a score is of: a chunk's label, or the chunk


@dataclass(slots=True)
class Query:
    """What to rank: ``vector`` is None when the embedder gave nothing (lexical fallback).
    One per search, never changed (slotted rather than frozen: a frozen ``__init__`` is slower)."""

    text: str
    vector: Vectors | None
    limit: int
    min_score: float
    min_lexical_score: float
    sources: Sequence[str] = ()
    hybrid: bool = False
    context_url: str = ""
    context_bonus: float = 0.0
    # Metadata filters and page paths (with ``sources`` folded in): None when there are none.
    allowed: Allowed | None = None
    # A base built with summaries (index/summaries.py): how its summary prong joins the content
    # prong; "off" (the content prong alone) is for the quality benchmark.
    summaries: Literal["max", "mean", "off"] = "max"


def check_context_url(context_url: str) -> None:
    """``context_url`` parsed as ``related_to`` will parse it, or InvalidArgument saying why: a
    caller's "http://[" is its mistake to fix, not an exception in the middle of a ranking."""
    if not context_url:
        return
    try:
        urlsplit(context_url.strip())
    except ValueError as exc:
        raise InvalidArgument(
            f"context_url is not a URL: {exc} (got {context_url[:80]!r}); send the page the "
            "caller is on, like https://app.example.com/settings/billing, or leave it empty"
        ) from None


def related_to(context_url: str) -> Related | None:
    """A predicate over chunk metadata: do its ``related_urls`` globs match the caller's page?

    A glob starting with ``/`` is matched against the URL's path (so ``/settings/*`` matches
    ``https://app.example.com/settings/billing?tab=2``); any other glob against the whole URL.
    """
    url = context_url.strip()
    if not url:
        return None
    path = urlsplit(url).path or "/"

    def matches(metadata: Mapping[str, MetaValue]) -> bool:
        value = metadata.get(RELATED_URLS, "")
        for glob in value.split(",") if isinstance(value, str) else value:
            glob = glob.strip()
            if glob and fnmatchcase(path if glob.startswith("/") else url, glob):
                return True
        return False

    return matches


def rank(searcher: Searcher, q: Query) -> Ranked:
    """The chunk labels to answer with and their scores, best first, at most ``q.limit``."""
    related = related_to(q.context_url) if q.context_bonus else None
    depth = q.limit if related is None else max(q.limit, CONTEXT_DEPTH)
    if q.vector is None:
        return lexical(searcher, q, related, depth)
    if q.hybrid:
        return hybrid(searcher, q, related, max(depth, FUSION_DEPTH))
    return dense(searcher, q, related, depth)


def lexical(searcher: Searcher, q: Query, related: Related | None, depth: int) -> Ranked:
    """No vector (the embedder missed or failed): BM25 >= min_lexical_score, a related chunk's
    score multiplied by ``1 + LEXICAL_LIFT * bonus``."""
    scored, _ = searcher.bm25.score(q.text, drop=SPOKEN_STOPWORDS)
    ranked = [
        (label, score)
        for label, score in scored.top(depth, _keep(searcher, q, scored.docs))
        if score >= q.min_lexical_score
    ]
    if related is not None:
        lift = 1.0 + LEXICAL_LIFT * q.context_bonus
        ranked = _lifted(ranked, _metadata(searcher), related, lambda s: s * lift)
    return ranked[: q.limit]


def dense(searcher: Searcher, q: Query, related: Related | None, depth: int) -> Ranked:
    """Cosine >= min_score, best first; a related chunk gets ``+bonus`` after the threshold."""
    found = _dense(searcher, q, depth)
    if related is None:  # most calls: one pass, no set
        return [(label, score) for label, score in found if score >= q.min_score][: q.limit]
    relevant = [(label, score) for label, score in found if score >= q.min_score]
    return context_lifted(relevant, _metadata(searcher), related, q.context_bonus)[: q.limit]


def context_lifted(
    found: Sequence[tuple[Item, float]],
    metadata_of: Callable[[Item], Mapping[str, MetaValue]],
    related: Related,
    bonus: float,
) -> list[tuple[Item, float]]:
    """Cosines already at ``min_score`` (the threshold applies to the unlifted score) with
    ``+bonus`` on each related chunk's, re-sorted: the ``context_url`` lift of a dense ranking
    (``dense``; ``sidecar.turn.engine`` lifts a turn's two searches after its own threshold)."""
    return _lifted(found, metadata_of, related, lambda s: s + bonus)


def hybrid(searcher: Searcher, q: Query, related: Related | None, depth: int) -> Ranked:
    """The top ``depth`` of each retriever, every candidate scored exactly by both, fused by a
    convex combination (see the module docstring); empty when no chunk reaches min_score."""
    assert q.vector is not None
    found = _dense(searcher, q, depth)
    if not any(score >= q.min_score for _, score in found):
        return []
    cosine, bm25 = _score_both(searcher, q, found, depth)
    relevant = {label for label, score in cosine.items() if score >= q.min_score}
    relevant |= {label for label, score in bm25.items() if score >= q.min_lexical_score}
    if related is not None:  # after the thresholds: they apply to the unlifted score
        chunks = searcher.chunks
        cosine = {
            label: score + q.context_bonus if related(chunks[label].metadata) else score
            for label, score in cosine.items()
        }
    fused = convex_fusion([cosine, bm25])
    return [(label, score) for label, score in fused if label in relevant][: q.limit]


def each_best(searcher: Searcher, q: Query, groups: Sequence[npt.NDArray[np.integer]]) -> Ranked:
    """The chunks of each group (a listed option's labels: at most EACH_CHUNKS of it, those the
    query may reach) scored exactly by the query's vector from the stored vectors: the best of
    each group first, best first, then the groups' other chunks with cosine >= min_score, best
    first; at most ``q.limit``. "Which of them has parking?" is answered by each option's best
    chunk, not by the one whose name its words happen to rate highest. The best of each is kept
    below min_score, as a turn folded with an entity it points back at keeps that entity's: the
    turn asks about those options, and its words alone, without their names, rate their
    chunks lower (on DSTC11 at min_score 0.3, 17 such turns rated every option's best at
    0.15-0.30 and got nothing)."""
    assert q.vector is not None
    firsts: Ranked = []
    rest: Ranked = []
    for group in groups:
        labels = group[:EACH_CHUNKS]
        keep = _keep(searcher, q, labels)
        if keep is not None:
            labels = labels[keep]
        if not len(labels):
            continue
        scores = searcher.vectors_of(labels) @ q.vector.ravel()
        order = np.argsort(-scores, kind="stable")[: q.limit]
        ranked = [(int(labels[i]), float(scores[i])) for i in order]
        firsts += ranked[:1]
        rest += [(label, score) for label, score in ranked[1:] if score >= q.min_score]
    firsts.sort(key=lambda hit: -hit[1])
    rest.sort(key=lambda hit: -hit[1])
    return (firsts + rest)[: q.limit]


def _keep(searcher: Searcher, q: Query, labels: npt.NDArray[np.integer]) -> Mask | None:
    """Which of ``labels`` the query may reach (its filters, or its sources); None: all."""
    if q.allowed is not None:
        keep: Mask = q.allowed.mask[labels]
        return keep
    ids = searcher.sources.ids(q.sources)
    return None if ids is None else searcher.sources.among(ids, labels)


def _dense(searcher: Searcher, q: Query, depth: int) -> Ranked:
    """The dense candidates: through the filter index when the query has filters or paths,
    the source partitions when it names sources; joined with the summary prong if built."""
    assert q.vector is not None
    snapshot, sources = searcher.snapshot, searcher.sources
    ids = sources.ids(q.sources)
    if q.allowed is not None:
        found = search_allowed(snapshot.index, snapshot.filters, q.vector, depth, q.allowed)
    elif ids is None:
        found = snapshot.search_dense(q.vector, depth)
    else:
        labels = lambda: sources.labels_of(ids)  # noqa: E731 (only when exact search needs them)
        found = snapshot.search_sources(q.vector, depth, ids, sources.count(ids), labels)
    if snapshot.summaries is not None and q.summaries != "off":
        found = _with_summaries(searcher, q, found, depth)
    return found


def _with_summaries(searcher: Searcher, q: Query, dense: Ranked, depth: int) -> Ranked:
    """The content prong fused with the summary prong: the top ``depth`` of each, every
    candidate scored exactly in both views, its score the better cosine ("max") or their mean.
    Either way a score stays a cosine, so ``min_score`` keeps its meaning."""
    summaries = searcher.snapshot.summaries
    assert summaries is not None
    assert q.vector is not None
    n = len(searcher.chunks)
    filtered = q.allowed is not None or searcher.sources.ids(q.sources) is not None
    # a source or metadata filter: over-fetch, as search_dense does from the shared graph
    fetch = min(n, depth * 10 if filtered else depth)
    found = np.asarray([label for label, _ in summaries.search(q.vector, fetch)], dtype=np.int64)
    keep = _keep(searcher, q, found)
    labels_found = (found if keep is None else found[keep])[:depth].tolist()
    cosine = dict(dense)
    labels = list(dict.fromkeys([*cosine, *labels_found]))
    _add_cosines(searcher, q.vector, cosine, labels)
    summary = summaries.scores(q.vector, labels)
    fused = [(label, _fuse(q.summaries, cosine[label], summary[label])) for label in labels]
    fused.sort(key=lambda hit: -hit[1])
    return fused[:depth]


def _fuse(how: str, content: float, summary: float) -> float:
    return max(content, summary) if how == "max" else (content + summary) / 2


def _add_cosines(
    searcher: Searcher, vector: Vectors, cosine: dict[int, float], labels: Sequence[int]
) -> None:
    """Score the ``labels`` ``cosine`` lacks exactly, from the stored vectors (unit length,
    inner-product space) the searcher reads from the mapped graph file."""
    missing = [label for label in labels if label not in cosine]
    if missing:
        scores = searcher.vectors_of(missing) @ vector.ravel()
        cosine.update(zip(missing, scores.tolist(), strict=True))


def _score_both(
    searcher: Searcher, q: Query, found: Ranked, depth: int
) -> tuple[dict[int, float], dict[int, float]]:
    """Every candidate's cosine and BM25, in one order (the dense ranking, then the lexical
    one's new labels): a candidate only one retriever returned is scored by the other exactly,
    not assumed to be the other's worst (on SciFact that assumption cost 0.018 nDCG@10)."""
    assert q.vector is not None
    dense_labels = np.asarray([label for label, _ in found], dtype=np.int64)
    scored, at = searcher.bm25.score(q.text, drop=SPOKEN_STOPWORDS, at=dense_labels)
    top = scored.top(depth, _keep(searcher, q, scored.docs))
    cosine = dict(found)
    labels = list(dict.fromkeys([*cosine, *(label for label, _ in top)]))
    _add_cosines(searcher, q.vector, cosine, labels)
    bm25 = dict(zip(dense_labels.tolist(), at.tolist(), strict=True))
    bm25.update(top)
    return {label: cosine[label] for label in labels}, {label: bm25[label] for label in labels}


def _metadata(searcher: Searcher) -> Callable[[int], Mapping[str, MetaValue]]:
    chunks = searcher.chunks
    return lambda label: chunks[label].metadata


def _lifted(
    ranked: Sequence[tuple[Item, float]],
    metadata_of: Callable[[Item], Mapping[str, MetaValue]],
    related: Related,
    lifted: Callable[[float], float],
) -> list[tuple[Item, float]]:
    out = [(item, lifted(score) if related(metadata_of(item)) else score) for item, score in ranked]
    out.sort(key=lambda hit: -hit[1])  # stable: ties keep their order
    return out
