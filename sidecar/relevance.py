"""Ranking one query against one snapshot: dense, lexical fallback, or hybrid; thresholds; the
``context_url`` bonus. Pure and synchronous: an hnswlib query is well under a millisecond and a
BM25 query a few, cheaper than a hop to a thread.

    dense     cosine >= min_score, best first
    lexical   (no vector: the embedder missed or failed) BM25 >= min_lexical_score
    hybrid    dense and BM25 rankings fused by reciprocal rank; the score is the fused score.
              The dense side judges whether the base knows the topic at all: with no chunk at
              min_score the answer is empty (BM25 scores have no fixed scale, and common words
              give unrelated questions high ones). Otherwise a chunk is kept when either
              retriever found it relevant by its own threshold.

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
from urllib.parse import urlsplit

from index.embedders.base import Vectors
from index.lexical import reciprocal_rank_fusion
from index.snapshot import LoadedSnapshot

FUSION_DEPTH = 20  # candidates per retriever before reciprocal rank fusion
# Candidates looked at when a context_url may lift one: a related chunk this far down can
# climb into the top max_results with a realistic bonus, farther down it is not relevant enough.
CONTEXT_DEPTH = 10
LEXICAL_LIFT = 2.0
RELATED_URLS = "related_urls"  # the frontmatter / metadata key holding the globs

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


def related_to(context_url: str) -> Callable[[Mapping[str, str]], bool] | None:
    """A predicate over chunk metadata: do its ``related_urls`` globs match the caller's page?

    A glob starting with ``/`` is matched against the URL's path (so ``/settings/*`` matches
    ``https://app.example.com/settings/billing?tab=2``); any other glob against the whole URL.
    """
    url = context_url.strip()
    if not url:
        return None
    path = urlsplit(url).path or "/"

    def matches(metadata: Mapping[str, str]) -> bool:
        for glob in metadata.get(RELATED_URLS, "").split(","):
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
        mask = snapshot.source_mask(q.sources)
        lexical = [
            (label, score)
            for label, score in snapshot.lexical.search(q.text, depth, mask)
            if score >= q.min_lexical_score
        ]
        if related is not None:
            lift = 1.0 + LEXICAL_LIFT * q.context_bonus
            lexical = _lift(snapshot, lexical, related, lambda s: s * lift)
        return lexical[: q.limit]
    dense = snapshot.search_dense(q.vector, FUSION_DEPTH if q.hybrid else depth, q.sources)
    relevant = {label for label, score in dense if score >= q.min_score}
    if related is not None:
        dense = _lift(snapshot, dense, related, lambda s: s + q.context_bonus)
    if not q.hybrid:
        return [(label, score) for label, score in dense if label in relevant][: q.limit]
    if not relevant:
        return []
    mask = snapshot.source_mask(q.sources)
    lexical = snapshot.lexical.search(q.text, FUSION_DEPTH, mask) if q.text else []
    relevant |= {label for label, score in lexical if score >= q.min_lexical_score}
    fused = reciprocal_rank_fusion([[i for i, _ in dense], [i for i, _ in lexical]])
    return [(label, score) for label, score in fused if label in relevant][: q.limit]


def _lift(
    snapshot: LoadedSnapshot,
    ranked: Ranked,
    related: Callable[[Mapping[str, str]], bool],
    lifted: Callable[[float], float],
) -> Ranked:
    out = [
        (label, lifted(score) if related(snapshot.chunks[label].metadata) else score)
        for label, score in ranked
    ]
    out.sort(key=lambda hit: -hit[1])  # stable: ties keep their order
    return out
