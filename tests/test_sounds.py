"""Names as a recogniser hears them (``sidecar.turn.sounds``): which runs of words sound like
one name. How a name heard changes a turn: tests/test_turns.py."""

from __future__ import annotations

import random

from index.entities import FUNCTION_WORDS_EN, tokens
from sidecar.turn.followups import FILLERS_EN, _content
from sidecar.turn.sessions import Mention
from sidecar.turn.sounds import (
    HEARD_CONFIDENCE,
    MAX_KEY_LETTERS,
    MAX_NAMES,
    MAX_TABLE_BYTES,
    SoundNames,
    sound_key,
)

NAMES = ["Google Drive", "Microsoft OneDrive", "Amazon S3", "Coral Bay", "Koral Bay", "Box"]


def heard(text: str, names: list[str] = NAMES) -> list[str]:
    sounds = SoundNames.of(names, FUNCTION_WORDS_EN, frozenset(), FILLERS_EN, len(names))
    found = sounds.find(tokens(text)).mentions()
    assert all(m.confidence == HEARD_CONFIDENCE for m in found)
    return [m.name for m in found]


def test_words_that_sound_alike_share_a_key() -> None:
    assert sound_key("google") == sound_key("goal")
    assert sound_key("three") == "3"


def test_a_name_misheard_past_one_edit_is_heard() -> None:
    assert heard("tell um me about misoft um onedrive") == ["Microsoft OneDrive"]  # a syllable
    assert heard("azon s three") == ["Amazon S3"]  # a letter dropped, a digit said, two words
    assert heard("what about goal drive") == ["Google Drive"]  # a sound-alike


def test_a_run_that_sounds_like_two_names_names_neither() -> None:
    assert heard("tell me about corel bey") == []


def test_a_name_said_as_written_is_left_to_the_gazetteer() -> None:
    assert heard("tell me about google drive") == []


def test_a_short_name_or_words_apart_are_not_heard() -> None:
    assert heard("the bocks") == []  # too few letters to tell from ordinary speech
    assert heard("my goal is to drive there") == []  # not one run


def test_a_base_of_too_many_names_hears_none() -> None:
    sounds = SoundNames.of(NAMES, FUNCTION_WORDS_EN, frozenset(), FILLERS_EN, 10**6)
    assert sounds.find(tokens("goal drive")).mentions() == ()


def test_the_tables_bytes_are_counted_and_grow_with_the_names() -> None:
    few = SoundNames.of(NAMES[:2], FUNCTION_WORDS_EN, frozenset(), FILLERS_EN, 2)
    more = [f"{first} {second}" for first in ("Alpha", "Bravo", "Delta") for second in NAMES]
    many = SoundNames.of(more, FUNCTION_WORDS_EN, frozenset(), FILLERS_EN, len(more))
    assert 0 < few.nbytes < many.nbytes
    none = SoundNames.of(more, FUNCTION_WORDS_EN, frozenset(), FILLERS_EN, MAX_NAMES + 1)
    assert none.nbytes < few.nbytes  # above MAX_NAMES nothing is built


def test_a_name_word_too_long_to_say_is_not_heard_nor_its_name() -> None:
    """The attack: one name word of 800 consonants took 347 MB and 32 s to load (its drop
    variants grow with the square of its letters, each as long as it)."""
    long_word = "kt" * 100
    assert len(sound_key(long_word)) > MAX_KEY_LETTERS
    sounds = SoundNames.of(
        [f"{long_word} drive", *NAMES], FUNCTION_WORDS_EN, frozenset(), FILLERS_EN, 7
    )
    assert len(sounds) == len(SoundNames.of(NAMES, FUNCTION_WORDS_EN, frozenset(), FILLERS_EN, 6))
    assert sounds.find(tokens("misoft onedrive")).mentions()  # the other names still heard


def test_the_tables_stop_at_their_bytes_limit() -> None:
    """As many names as a base may have, each as long as a name heard may be, of words no two
    names share (every variant its own entry): the tables stop at MAX_TABLE_BYTES, keeping the
    names first met."""
    rng = random.Random(1)
    consonants = "ktpsfmnlr"

    def word() -> str:
        return "".join(rng.choice(consonants) for _ in range(MAX_KEY_LETTERS))

    names = [" ".join(word() for _ in range(4)) for _ in range(MAX_NAMES)]
    sounds = SoundNames.of(names, FUNCTION_WORDS_EN, frozenset(), FILLERS_EN, len(names))
    assert 0 < len(sounds) < len(names)
    assert sounds.nbytes <= MAX_TABLE_BYTES
    # the cheapest names first, whatever their order: a review found the names kept in one
    # order and its reverse had none in common, and costly names early shut out cheap ones
    cheap = [f"{name.split()[0][:6]} drive" for name in names[:50]]
    costly = names[: MAX_NAMES - len(cheap)]
    forward = SoundNames.of(
        [*costly, *cheap], FUNCTION_WORDS_EN, frozenset(), FILLERS_EN, MAX_NAMES
    )
    backward = SoundNames.of(
        [*cheap, *reversed(costly)], FUNCTION_WORDS_EN, frozenset(), FILLERS_EN, MAX_NAMES
    )
    assert forward._names == backward._names
    assert all(name in forward._names for name in cheap)
    assert (
        sounds.find(tokens(names[0].replace(" ", " uh "))).mentions() == ()
    )  # written: gazetteer's


def test_one_word_heard_is_no_turn_s_only_naming() -> None:
    names = ["Premiumize.me", "Google Drive"]
    sounds = SoundNames.of(names, FUNCTION_WORDS_EN, frozenset(), FILLERS_EN, len(names))
    assert [m.name for m in sounds.find(tokens("price")).mentions()] == ["Premiumize.me"]
    assert sounds.find(tokens("price")).only(_content) is None  # a word a follow-up says
    only = sounds.find(tokens("tell me about goal drive")).only(_content)
    assert only is not None
    assert only.name == "Google Drive"


def test_a_name_word_heard_as_two_words_is_heard() -> None:
    names = ["Appearance Profile Settings", "General Profile Settings"]
    assert heard("tell me about appear ansi profile uh settings", names) == [names[0]]


def test_a_name_said_alone_after_the_base_s_shared_words_misheard_is_the_only_one() -> None:
    names = ["Windows Terminal Appearance Profile Settings", "Windows Terminal Actions"]
    shared = frozenset({"windows", "terminal"})
    sounds = SoundNames.of(names, FUNCTION_WORDS_EN, shared, FILLERS_EN, len(names))
    said = sounds.find(tokens("tell me about way needs uh tenal appear ansi profile settings"))
    assert said.only(_content) == Mention(names[0], HEARD_CONFIDENCE)
    other = sounds.find(tokens("tell me about old tunnels appear ansi profile settings"))
    assert other.mentions() == (Mention(names[0], HEARD_CONFIDENCE),)
    assert other.only(_content) is None  # "old tunnels" says more than the name
