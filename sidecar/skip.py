"""Should this turn search at all? Backchannels and closings need no knowledge.

Short is not the same as skippable: "Is it quiet?" needs the base, "Thank you very much." does
not. A turn is skipped only when every word of it belongs to the acknowledgement vocabulary (or
it is one of the closing phrases), and it has at most ``max_words`` words.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass, field
from enum import IntEnum


class Skip(IntEnum):
    """Mirrors voxrecall.v1.SkipReason."""

    NOT_SKIPPED = 0
    BACKCHANNEL = 1
    AGENT_TURN = 2
    NOT_FINAL = 3
    EMPTY = 4
    CLOSING = 5


BACKCHANNEL_WORDS_EN = frozenset(
    """
    yeah yes yep yup ya yea ok okay k sure right alright allright uh huh uhhuh uh-huh mm mhm mmhm
    mm-hmm hmm hm um umm er erm ah oh ooh aha wow cool great good nice fine perfect awesome
    excellent wonderful lovely gotcha got it i see see understood sounds makes sense correct
    exactly indeed totally absolutely definitely no nope nah well so and then go on really
    """.split()
)

CLOSING_PHRASES_EN = (
    "thank you",
    "thanks",
    "thank you very much",
    "thank you so much",
    "thanks a lot",
    "many thanks",
    "bye",
    "goodbye",
    "good bye",
    "bye bye",
    "have a nice day",
    "have a good day",
    "that's all",
    "that is all",
    "that's it",
    "that will be all",
    "that's all i need",
    "no that's all",
    "nothing else",
    "no thanks",
    "no thank you",
)

_WORD = re.compile(r"[\w'-]+")


def words(text: str) -> list[str]:
    return _WORD.findall(text.lower().replace("’", "'"))


@dataclass(frozen=True, slots=True)
class SkipPolicy:
    """A configurable skip rule; ``language`` selects the built-in word lists."""

    max_words: int = 6
    backchannel_words: frozenset[str] = BACKCHANNEL_WORDS_EN
    closing_phrases: tuple[str, ...] = CLOSING_PHRASES_EN
    extra_phrases: tuple[str, ...] = field(default=())
    language: str = "en"

    def classify(self, text: str) -> Skip:
        tokens = words(text)
        if not tokens:
            return Skip.EMPTY
        if len(tokens) > self.max_words:
            return Skip.NOT_SKIPPED
        joined = " ".join(tokens)
        rest = _strip_phrases(joined, (*self.closing_phrases, *self.extra_phrases))
        if rest != joined:
            leftover = rest.split()
            if all(t in self.backchannel_words for t in leftover):
                return Skip.CLOSING
            return Skip.NOT_SKIPPED
        if all(t in self.backchannel_words for t in tokens):
            return Skip.BACKCHANNEL
        return Skip.NOT_SKIPPED


def _strip_phrases(text: str, phrases: Iterable[str]) -> str:
    padded = f" {text} "
    for phrase in sorted(phrases, key=len, reverse=True):
        padded = padded.replace(f" {phrase} ", " ")
    return " ".join(padded.split())
