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


# A run of a turn without whitespace is read up to its first MAX_RUN_BYTES (as the embedder
# hands its tokenizer only the head the model reads, ``LocalEmbedder._encode``): no real word is
# longer (the longest run of every evaluation set's turns is 75 bytes; a long URL fits), while a
# turn at the text cap without whitespace (punctuation, one long token) was read whole, 0.5-2 ms
# of the event loop for what says nothing (``python -m bench.turn_text``).
MAX_RUN_BYTES = 1024
_LONG_RUN = re.compile(rf"\S{{{MAX_RUN_BYTES // 4 + 1},}}")  # chars that may pass the bytes
# every byte of a UTF-8 text as "x", but ASCII whitespace as " ": a run past MAX_RUN_BYTES then
# shows as MAX_RUN_BYTES + 1 x's in a row (a search in C, ~20 us at the text cap)
_RUNS = bytes(0x20 if chr(b).isspace() and b < 0x80 else 0x78 for b in range(256))
_PAST = b"x" * (MAX_RUN_BYTES + 1)


def read(text: str) -> str:
    """``text`` with each run of it without whitespace cut to its first ``MAX_RUN_BYTES``: what
    the turn's words and tokens are taken from. A real turn is returned as it is."""
    data = text.encode("utf-8", "surrogatepass")
    if len(data) <= MAX_RUN_BYTES or _PAST not in data.translate(_RUNS):
        return text
    return _LONG_RUN.sub(_run_head, text)


def _run_head(run: re.Match[str]) -> str:
    return run[0].encode("utf-8", "surrogatepass")[:MAX_RUN_BYTES].decode("utf-8", "ignore")


def words(text: str) -> list[str]:
    """A turn's words, lower case, with typographic apostrophes made plain (of ``read``)."""
    return _words(read(text))


# What a transcript may end in that a recogniser adds once the speaker stops (its final) and
# seldom to the same words heard mid-sentence (its interims): a clause's end, and space.
_ENDING = ".?!,;:…。？！ \t\r\n"


def unended(text: str) -> str:
    """``text`` without the punctuation and space it ends in ("is it quiet?" -> "is it quiet"):
    a final transcript's words as its stable interim said them (``Engine.turn``)."""
    return text.rstrip(_ENDING)


def _words(text: str) -> list[str]:
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
        said = read(text)
        toks = tuple(tokens(said))
        return cls(text, tuple(_words(said)), toks, named_tokens(toks))


def named_tokens(toks: Sequence[str]) -> tuple[str, ...]:
    """The tokens a turn's names are matched over (``NAMED_TOKENS``)."""
    if len(toks) <= 2 * NAMED_TOKENS:
        return tuple(toks)
    return (*toks[:NAMED_TOKENS], *toks[-NAMED_TOKENS:])
