"""A follow-up's folded query vector, composed from vectors already computed: one embedding a turn.

A later turn of a conversation is searched twice: the turn alone, and folded with what it
follows ("HARBOR GRILL: do they take reservations", or the recent turns joined with it). Each
part of the folded text had its vector computed before this turn came, off the caller's path:
a user turn's when it was searched, an agent turn's in the background when it was said
(``Engine._read_later``), a tracked entity's name in the background when it became tracked. So
only the turn itself is embedded (one model run, as a plain vector search does), and the folded
query's vector is made from its parts':

    parts = pieces(folded, text, session)           # None: not made of known parts
    vector = compose([vectors...], [weights...])    # the parts' and the turn's, in order

The embedded model mean-pools its token embeddings, so the vector of texts joined is close to
the mean of their vectors weighted by their token counts (``MeanPooled.weight``; the model's
vectors are normalised, so their pooled norms are lost and the weights are the counts alone).
Measured with ``python -m bench.composed_vectors``. Where a part's vector is neither cached nor
being embedded, the engine embeds the folded text as before.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from index.embedders.base import Vectors
from sidecar.turn.sessions import Session

# How many of the session's latest turns a folded prefix is matched against (the folded
# recent turns hold at most followups.MAX_FOLDED_WORDS words, so a few turns at most).
MAX_PARTS = 8
# The most earlier texts a folded vector is composed from (beside the turn): one, an entity's
# name or one earlier turn. Composed from more (a caller's turn and the agent's answer, the
# doc2dial shape) the vector strays further from the folded text's (cosine 0.89 on average over
# doc2dial's folded turns) and the session's hit@3 fell from 0.582 to 0.563 on doc2dial-dev;
# such a fold embeds the folded text as before (``python -m bench.composed_vectors``).
MOST_PARTS = 1


def pieces(
    folded: str, text: str, session: Session, most: int | None = None
) -> tuple[str, ...] | None:
    """The texts ``folded`` was joined from, oldest first, without ``text`` (the turn, last):
    whole earlier turns of ``session`` as recorded (their vectors' cache keys) and, before them,
    an entity's name folded as ``"NAME: "``; None when ``folded`` is not ``text`` after at most
    ``most`` such parts (MOST_PARTS unless given), after a turn cut to the fold's word limit, or
    when folded otherwise."""
    found = _pieces(folded, text, session)
    limit = MOST_PARTS if most is None else most
    return found if found is not None and len(found) <= limit else None


def _pieces(folded: str, text: str, session: Session) -> tuple[str, ...] | None:
    if not folded.endswith(text) or len(folded) == len(text):
        return None
    rest = folded[: len(folded) - len(text)].rstrip(" ")
    turns = [said.text for said in session.turns]
    if turns and turns[-1] == text:
        turns.pop()  # the turn itself is recorded before it is searched
    found: list[str] = []
    for said in reversed(turns[-MAX_PARTS:]):
        joined = " ".join(said.split())
        if not joined:
            continue
        if rest == joined:
            found.append(said)
            return tuple(reversed(found))
        if not rest.endswith(" " + joined):
            break
        found.append(said)
        rest = rest[: len(rest) - len(joined) - 1]
    return _named(rest, found)


def _named(rest: str, found: list[str]) -> tuple[str, ...] | None:
    """The parts with what is left of the prefix before them, when that is an entity's name
    folded as ``"NAME:"``; None otherwise."""
    if not rest.endswith(":") or len(rest) < 2:
        return None
    return (rest[:-1], *reversed(found))


def compose(vectors: Sequence[Vectors], weights: Sequence[float]) -> Vectors:
    """The unit vector of the weighted sum of unit ``vectors`` (each a row or a 1-d vector)."""
    total = np.zeros(np.shape(vectors[0])[-1], dtype=np.float64)
    for vector, weight in zip(vectors, weights, strict=True):
        total += weight * np.asarray(vector, dtype=np.float64).reshape(-1)
    norm = float(np.linalg.norm(total))
    out: Vectors = (total / (norm or 1.0)).astype(np.float32)
    return out
