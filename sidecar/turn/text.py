"""A turn's text, normalised and split once: the one word tokenizer of the turn's stages.

``words`` (lower case, typographic apostrophes made plain, "don't" and "uh-huh" one word each)
is what the skip policy matches its lexicons against, what the follow-up rules read ("is it a
question", "does it refer back") and what a prefetch compares an interim transcript with;
``tokens`` (accents, apostrophes and "&" normalised, letters and digits only) is what names are
matched by, so that "Hobson's" finds "HOBSONS HOUSE" and "B&B" finds "B and B" (it lives in
``index.entities``: the indexer makes a snapshot's name keys with it). An ``Utterance`` holds
both, computed once per turn.

The lexical index's analyzer (``index.lexical.analyze``: ``\\w+``, stopwords, Snowball stems) is
not this one and must not become it: it is what each snapshot's BM25 index was built with (its
name is recorded in the snapshot, ``index.lexical.ANALYZER``), so a query is analyzed exactly as
the snapshot's texts were.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from index.entities import tokens as tokens  # the indexer rates names by the same tokens

_WORD = re.compile(r"[\w'-]+")


def words(text: str) -> list[str]:
    """A turn's words, lower case, with typographic apostrophes made plain."""
    return _WORD.findall(text.lower().replace("’", "'"))


@dataclass(frozen=True, slots=True)
class Utterance:
    """One turn's text, normalised and tokenised once for every stage of the turn: ``words`` for
    the skip policy and the follow-up rules, ``tokens`` for name matching."""

    text: str
    words: tuple[str, ...]
    tokens: tuple[str, ...]

    @classmethod
    def of(cls, text: str) -> Utterance:
        return cls(text, tuple(words(text)), tuple(tokens(text)))
