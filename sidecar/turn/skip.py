"""Should this turn search at all? Backchannels, acknowledgements and closings need no knowledge.

Short is not the same as skippable: "Is it quiet?" needs the base, "Thank you very much." does
not. A turn is skipped only when all of it is made of the language's closing phrases ("thank you
for your help", "that's all I need", "have a nice day") and backchannel words ("yeah", "ok",
"mm-hmm"), and it has at most ``max_words`` words. One other word ("quiet", "parking", "what")
and the turn is searched: a wrongly skipped question costs more than a wasted search.

Measured on the 4,173 labelled DSTC11 user turns by ``python -m bench.quality_turns``.
"""

from __future__ import annotations

import itertools
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from enum import IntEnum
from typing import TYPE_CHECKING

from index.errors import ConfigError
from sidecar.turn.text import words

if TYPE_CHECKING:  # the config reads LEXICONS for its languages: this module comes first
    from sidecar.config import SkipConfig

# Longer turns are never skipped; the labelled closings fit in 16 ([sidecar.skip] max_words).
MAX_WORDS = 16


class Skip(IntEnum):
    """Mirrors voxrecall.v1.SkipReason."""

    NOT_SKIPPED = 0
    BACKCHANNEL = 1
    AGENT_TURN = 2
    NOT_FINAL = 3
    EMPTY = 4
    CLOSING = 5


@dataclass(frozen=True, slots=True)
class Lexicon:
    """One language's words that carry no request, and its closing phrases (regular
    expressions over the turn's words, lower case, apostrophes dropped, one space apart)."""

    backchannel: frozenset[str]
    closings: tuple[str, ...]


_EN_BACKCHANNEL = frozenset(
    """
    yeah yes yep yup ya yea yah ok okay okey k kk sure right alright allright aight uh huh uhhuh
    uh-huh mm mhm mmhm mm-hmm mmm hmm hm um umm er erm ah oh ooh aha wow cool great good nice
    fine perfect awesome excellent wonderful lovely fantastic brilliant super gotcha understood
    correct exactly indeed totally absolutely definitely certainly no nope nah well so really
    and please thanks thank cheers bye goodbye oops sorry hey hi hello
    """.split()
)

_GOOD = r"(good|great|nice|fine|perfect|lovely|wonderful|excellent|fantastic|awesome|ideal|ok|okay)"
_FOR_HELP = (
    r"( (for|with) (all )?(of )?((your|the|my|this) (help|time|assistance|information|info|"
    r"effort|patience|service|booking)|everything|that|it))"
)

_EN_CLOSINGS = (
    # thanks, with what for and how much
    rf"(thank you|thank u|thankyou|thanks|thanx|thx|ty|many thanks|much appreciated|i appreciate it)"
    rf"( (so|very) much| a lot| a bunch| much| again| kindly)?{_FOR_HELP}?( today| though| anyway)?",
    rf"(you have|youve) been( (so|very|really))? (helpful|great|a great help|a big help){_FOR_HELP}?",
    # goodbyes
    r"(good ?bye|bye( bye)?|bye now|see (you|ya)( later)?|take care|adios|ciao|farewell)",
    r"(have a|you have a)( (nice|good|great|wonderful|lovely|pleasant))? (day|one|evening|night|weekend|afternoon|morning)",
    r"good (night|day|evening|afternoon)|goodnight",
    # that's all
    r"(no )?(that|thats|thatll|this|it|its|i think that|i think thats)"
    r"( is| was| will| will be| would be| should be| should| about| just)?"
    r" (all|it|everything|enough|do it|does it|do|covers it|cover it)( else)?"
    r"( (of )?the (information|info|help))?( for me)?"
    r"( (that )?i (need|needed|want|wanted|require|required)( to know)?)?"
    r"( (for|at) (now|today|the day|tonight|this time|the moment))?( today| then)?",
    r"(i dont|i do not) need (anything|any thing|nothing) (else|more|further)( today| for now)?",
    r"(no )?(there is |theres )?nothing (else|more|further)( for (me|now|today))?",
    r"(i am|im|i think im|i think i am) (all set|good|fine|done)( for now| then| today)?",
    r"all set",
    # acknowledgements
    rf"(that |it |this )?(sounds|sound|seems|looks)( really| very)? {_GOOD}",
    rf"(that|thats|it|its|this)( (is|was|will be|would be|is just))?( really| very| so)? {_GOOD}",
    r"(that|it|this) (works|will work|would work|is correct|is right|is fine with me)( for me)?",
    r"(got it|i see|makes sense|fair enough|of course|no problem|no worries|will do|go ahead|go on)",
    r"(you are|youre) welcome",
    # no preference
    r"(i dont|i do not) (care|mind|have a preference)",
    r"(it |that )?(doesnt|does not) matter( to me)?",
    r"no (preference|particular preference)",
    r"(anything|either|either one|any|whatever) (is|would be|will be|works) (fine|ok|okay|good)",
)

LEXICONS: dict[str, Lexicon] = {
    "en": Lexicon(backchannel=_EN_BACKCHANNEL, closings=_EN_CLOSINGS),
}


def _normal(text: str) -> str:
    """Words one space apart, apostrophes dropped ("That's all!" -> "thats all")."""
    return " ".join(w.replace("'", "") for w in words(text))


# What makes a pattern match a word it does not spell out: a character class or wildcard, a
# letter quantified or touching a group ("thanks?", "good(night|day)"), an optional space
# anywhere but between two words ("good ?bye": the two words joined are listed too).
_UNLISTABLE = re.compile(
    r"\[|\\[wWdDsS]|(?<!\\)\.|[a-z0-9][?*+{]|[a-z0-9]\((?! )|\)[a-z0-9]|(?<![a-z0-9]) \?|"
    r" \?(?![a-z0-9])"
)
# Characters the listed words are made of, with the pattern syntax around them: a pattern with any
# other ("ciào", "check\-in") holds words the ASCII split would cut, so it is matched, not listed.
_LISTABLE = re.compile(r"[a-z0-9 ()|?\\]*")


def _vocabulary(patterns: Sequence[str]) -> frozenset[str] | None:
    """Every word the closing ``patterns`` can match: their literal words, and any two written
    one after the other (for "good ?bye"); None when a pattern can match a word it does not
    spell out (``_UNLISTABLE``)."""
    words: set[str] = set()
    for pattern in patterns:
        if _UNLISTABLE.search(pattern) or not _LISTABLE.fullmatch(pattern):
            return None
        literal = re.findall(r"[a-z0-9]+", pattern)
        words.update(literal)
        words.update(a + b for a, b in itertools.pairwise(literal))
    return frozenset(words)


@dataclass(frozen=True, slots=True)
class SkipPolicy:
    """A configurable skip rule: ``language`` selects the built-in lexicon, ``extra_phrases``
    add closings (said as plain words), ``max_words`` caps what can be skipped.

    >>> policy = SkipPolicy()
    >>> policy.classify("Thank you very much."), policy.classify("Is it quiet?")
    (<Skip.CLOSING: 5>, <Skip.NOT_SKIPPED: 0>)
    """

    max_words: int = MAX_WORDS
    extra_phrases: tuple[str, ...] = ()
    language: str = "en"
    _pattern: re.Pattern[str] = field(init=False, repr=False, compare=False)
    # every word a skipped turn can hold (None: a pattern matches words it does not spell out)
    _vocabulary: frozenset[str] | None = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        lexicon = LEXICONS.get(self.language)
        if lexicon is None:
            raise ConfigError(
                f"skip language {self.language!r} has no built-in word lists; known: {', '.join(LEXICONS)}"
            )
        extra = [re.escape(_normal(p)) for p in self.extra_phrases if _normal(p)]
        alternatives = "|".join(f"(?:{p})" for p in (*extra, *lexicon.closings))
        object.__setattr__(self, "_pattern", re.compile(rf"(?<!\S)(?:{alternatives})(?!\S)"))
        vocabulary = _vocabulary((*extra, *lexicon.closings))
        if vocabulary is not None:
            vocabulary |= lexicon.backchannel
        object.__setattr__(self, "_vocabulary", vocabulary)

    @classmethod
    def from_config(cls, config: SkipConfig) -> SkipPolicy:
        return cls(
            max_words=config.max_words, extra_phrases=config.phrases, language=config.language
        )

    @property
    def backchannel(self) -> frozenset[str]:
        return LEXICONS[self.language].backchannel

    def classify(self, text: str) -> Skip:
        """Why this user turn needs no search, or ``NOT_SKIPPED``."""
        return self.classify_words(words(text))

    def classify_words(self, said: Sequence[str]) -> Skip:
        """``classify`` of a turn already split by ``words``."""
        if len(said) > self.max_words and len(said) > 1:
            return Skip.NOT_SKIPPED  # most turns: too long to skip, no need to join their words
        normal = " ".join(w.replace("'", "") for w in said)
        if not normal:
            return Skip.EMPTY
        count = normal.count(" ") + 1
        if count > self.max_words:
            return Skip.NOT_SKIPPED
        if self._vocabulary is not None and not self._vocabulary.issuperset(normal.split()):
            return Skip.NOT_SKIPPED  # a word no closing or backchannel has: no need to match
        rest = self._pattern.sub(" ", normal).split()
        if any(w not in self.backchannel for w in rest):
            return Skip.NOT_SKIPPED
        return Skip.CLOSING if len(rest) < count else Skip.BACKCHANNEL
