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
from collections.abc import Sequence
from dataclasses import dataclass, field

from index.entities import tokens as tokens  # the indexer rates names by the same tokens

_WORD = re.compile(r"[\w'-]+")
# Names are matched over a long turn's first and last NAMED_TOKENS tokens only (``named``): a
# spoken turn is a few hundred characters (the longest of every evaluation set's 43,669 turns is
# 68 tokens) and an agent's answer, which lists the options "the second one" reads, a few
# hundred tokens (an attack: at 64 a 200-token answer's list was not seen), so no ordinary turn
# loses a word, while a turn at the text cap (16 KiB: ~2,400 tokens) no longer holds the event
# loop for every word's name lookups (~25 us each, more for a word one edit from a name).
# A name split across the two ends' seam, in the middle of a longer monologue, is not found.
NAMED_TOKENS = 128


def words(text: str) -> list[str]:
    """A turn's words, lower case, with typographic apostrophes made plain."""
    return _WORD.findall(text.lower().replace("’", "'"))


@dataclass(slots=True)
class Utterance:
    """One turn's text, normalised and tokenised once for every stage of the turn: ``words`` for
    the skip policy and the follow-up rules, ``tokens`` for name matching.

    Never changed once made, but for two memos the follow-up rules fill on first use
    (``followups.spoken`` and ``followups.asks``: the words without fillers, and whether the turn
    asks something), which three or four of them read a turn. Not frozen: a frozen class's
    ``__init__`` costs a few times a plain slotted one's, and the memos are set after it.

    ``named`` is the tokens names are matched by: all of them, but for a turn longer than twice
    NAMED_TOKENS, its first and last NAMED_TOKENS."""

    text: str
    words: tuple[str, ...]
    tokens: tuple[str, ...]
    named: tuple[str, ...]
    spoken: tuple[str, ...] | None = field(default=None, repr=False, compare=False)
    asks: bool | None = field(default=None, repr=False, compare=False)

    @classmethod
    def of(cls, text: str) -> Utterance:
        toks = tuple(tokens(text))
        return cls(text, tuple(words(text)), toks, named_tokens(toks))


def named_tokens(toks: Sequence[str]) -> tuple[str, ...]:
    """The tokens a turn's names are matched over (``NAMED_TOKENS``)."""
    if len(toks) <= 2 * NAMED_TOKENS:
        return tuple(toks)
    return (*toks[:NAMED_TOKENS], *toks[-NAMED_TOKENS:])
