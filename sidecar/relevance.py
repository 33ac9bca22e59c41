"""Ranking one query against one snapshot: dense, lexical fallback, or hybrid; thresholds; the
``context_url`` bonus. Pure and synchronous: an hnswlib query is well under a millisecond and a
BM25 query a few, cheaper than a hop to a thread.

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
from typing import Literal
from urllib.parse import urlsplit

import numpy as np

from index.embedders.base import Vectors
from index.filters import Allowed
from index.filters import search as search_allowed
from index.lexical import (
    SPOKEN_STOPWORDS,
    FloatArray,
    convex_fusion,
    reciprocal_rank_fusion,
)
from index.snapshot import LoadedSnapshot
from index.types import MetaValue

# Candidates per retriever before fusion. On SciFact (bench/quality_scifact.py) convex fusion
# scored the same at 20 and 100 (nDCG@10 0.739 both), so the cheaper depth stays.
FUSION_DEPTH = 20
# Candidates looked at when a context_url may lift one: a related chunk this far down can
# climb into the top max_results with a realistic bonus, farther down it is not relevant enough.
CONTEXT_DEPTH = 10
LEXICAL_LIFT = 2.0
# the frontmatter / metadata key holding the globs: a string of comma-separated globs, or a list
RELATED_URLS = "related_urls"

Ranked = list[tuple[int, float]]


@dataclass(frozen=True, slots=True)
class Query:
    """What to rank: ``vector`` is None when the embedder gave nothing (lexical fallback)."""

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
    # "rrf" (reciprocal rank, k=60) is what hybrid did before convex fusion; kept so the quality
    # benchmark can measure both through this code.
    fusion: Literal["convex", "rrf"] = "convex"
    # A base built with summaries (index/summaries.py): how its summary prong joins the content
    # prong; "off" (the content prong alone) is for the quality benchmark.
    summaries: Literal["max", "mean", "off"] = "max"


def related_to(context_url: str) -> Callable[[Mapping[str, MetaValue]], bool] | None:
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


def rank(snapshot: LoadedSnapshot, q: Query) -> Ranked:
    """The chunk labels to answer with and their scores, best first, at most ``q.limit``."""
    related = related_to(q.context_url) if q.context_bonus else None
    depth = q.limit if related is None else max(q.limit, CONTEXT_DEPTH)
    if q.vector is None:
        mask = q.allowed.mask if q.allowed is not None else snapshot.source_mask(q.sources)
        lexical = [
            (label, score)
            for label, score in snapshot.lexical.search(q.text, depth, mask, drop=SPOKEN_STOPWORDS)
            if score >= q.min_lexical_score
        ]
        if related is not None:
            lift = 1.0 + LEXICAL_LIFT * q.context_bonus
            lexical = _lift(snapshot, lexical, related, lambda s: s * lift)
        return lexical[: q.limit]
    if q.hybrid:
        depth = max(depth, FUSION_DEPTH)
    dense = _dense(snapshot, q, depth)
    if snapshot.summaries is not None and q.summaries != "off":
        dense = _with_summaries(snapshot, q, dense, depth)
    relevant = {label for label, score in dense if score >= q.min_score}
    if not q.hybrid:
        if related is not None:
            dense = _lift(snapshot, dense, related, lambda s: s + q.context_bonus)
        return [(label, score) for label, score in dense if label in relevant][: q.limit]
    if not relevant:
        return []
    bm25_all = snapshot.lexical.scores(q.text, drop=SPOKEN_STOPWORDS)
    mask = q.allowed.mask if q.allowed is not None else snapshot.source_mask(q.sources)
    lexical = snapshot.lexical.top(bm25_all, depth, mask)
    if q.fusion == "rrf":
        if related is not None:
            dense = _lift(snapshot, dense, related, lambda s: s + q.context_bonus)
        relevant |= {label for label, score in lexical if score >= q.min_lexical_score}
        fused = reciprocal_rank_fusion([[i for i, _ in dense], [i for i, _ in lexical]])
        return [(label, score) for label, score in fused if label in relevant][: q.limit]
    cosine, bm25 = _score_both(snapshot, q.vector, bm25_all, dense, lexical)
    relevant |= {label for label, score in cosine.items() if score >= q.min_score}
    relevant |= {label for label, score in bm25.items() if score >= q.min_lexical_score}
    if related is not None:  # after the thresholds: they apply to the unlifted score
        cosine = {
            label: score + q.context_bonus if related(snapshot.chunks[label].metadata) else score
            for label, score in cosine.items()
        }
    fused = convex_fusion([cosine, bm25])
    return [(label, score) for label, score in fused if label in relevant][: q.limit]


def _with_summaries(snapshot: LoadedSnapshot, q: Query, dense: Ranked, depth: int) -> Ranked:
    """The content prong fused with the summary prong: the top ``depth`` of each, every
    candidate scored exactly in both views, its score the better cosine ("max") or their mean.
    Either way a score stays a cosine, so ``min_score`` keeps its meaning."""
    assert snapshot.summaries is not None
    assert q.vector is not None
    n = len(snapshot.chunks)
    mask = q.allowed.mask if q.allowed is not None else snapshot.source_mask(q.sources)
    # a source or metadata filter: over-fetch, as search_dense does from the shared graph
    fetch = min(n, depth * 10 if mask is not None else depth)
    found = [label for label, _ in snapshot.summaries.search(q.vector, fetch)]
    if mask is not None:
        found = [label for label in found if mask[label]][:depth]
    cosine = dict(dense)
    labels = list(dict.fromkeys([*cosine, *found]))
    missing = [label for label in labels if label not in cosine]
    if missing:
        vectors = np.asarray(snapshot.index.get_items(missing, return_type="numpy"))
        cosine.update(zip(missing, (vectors @ q.vector.ravel()).tolist(), strict=True))
    summary = snapshot.summaries.scores(q.vector, labels)
    fused = [(label, _fuse(q.summaries, cosine[label], summary[label])) for label in labels]
    fused.sort(key=lambda hit: -hit[1])
    return fused[:depth]


def _fuse(how: str, content: float, summary: float) -> float:
    return max(content, summary) if how == "max" else (content + summary) / 2


def _dense(snapshot: LoadedSnapshot, q: Query, depth: int) -> Ranked:
    """The dense candidates: through the filter index when the query has filters or paths."""
    assert q.vector is not None
    if q.allowed is None:
        return snapshot.search_dense(q.vector, depth, q.sources)
    return search_allowed(snapshot.index, snapshot.filters, q.vector, depth, q.allowed)


def _score_both(
    snapshot: LoadedSnapshot, vector: Vectors, bm25_all: FloatArray, dense: Ranked, lexical: Ranked
) -> tuple[dict[int, float], dict[int, float]]:
    """Every candidate's cosine and BM25, in one order (the dense ranking, then the lexical
    one's new labels): a candidate only one retriever returned is scored by the other exactly,
    not assumed to be the other's worst (on SciFact that assumption cost 0.018 nDCG@10)."""
    cosine = dict(dense)
    labels = list(dict.fromkeys([*cosine, *(label for label, _ in lexical)]))
    no_cosine = [label for label in labels if label not in cosine]
    if no_cosine:
        # the graph stores the vectors as built (unit length, inner-product space)
        vectors = np.asarray(snapshot.index.get_items(no_cosine, return_type="numpy"))
        cosine.update(zip(no_cosine, (vectors @ vector.ravel()).tolist(), strict=True))
    bm25 = bm25_all[labels].tolist()
    return {label: cosine[label] for label in labels}, dict(zip(labels, bm25, strict=True))


def _lift(
    snapshot: LoadedSnapshot,
    ranked: Ranked,
    related: Callable[[Mapping[str, MetaValue]], bool],
    lifted: Callable[[float], float],
) -> Ranked:
    out = [
        (label, lifted(score) if related(snapshot.chunks[label].metadata) else score)
        for label, score in ranked
    ]
    out.sort(key=lambda hit: -hit[1])  # stable: ties keep their order
    return out
