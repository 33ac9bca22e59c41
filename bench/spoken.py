"""Spoken DSTC11: the written DSTC11 dialogues as speech recognition would transcribe the caller.

A deterministic transformation, seeded per dialogue and turn (``SEED``, the dialogue id and the
turn's index), so a set is the same on every run and machine. Only the user's turns are
transcribed: the agent's turns are the agent's own text, handed to TTS, and reach the sidecar as
written (a voice agent sends its LLM's words, not a transcript of its speech). The knowledge base
stays written too.

What a user turn goes through (``Speech.transcribe``), in order:

1. **Numbers as words**: prices ("£10.50" -> "ten pounds fifty"), times ("5:30pm" -> "five thirty
   p m", "17:00" -> "seventeen hundred"), phone numbers and any run of five or more digits digit
   by digit ("01223 351880" -> "zero one two two three ..."), ordinals ("2nd" -> "second"),
   decimals ("4.5" -> "four point five"), codes mixing letters and digits (postcodes, booking
   references: "cb21ab" -> "c b two one a b"), other numbers as cardinals ("1,200" -> "one
   thousand two hundred"); "%" "&" "+" as "percent" "and" "plus". ``number_words`` is ours.
2. **Lower case, no punctuation**: accents folded, hyphens and slashes are spaces, every other
   mark dropped except an apostrophe inside a word ("don't", as recognisers write it).
3. **Word boundaries**: compounds the set's own turns write both as one word and as two (each
   part at least ``MIN_PART_LETTERS`` letters) are heard the other way: split (``SPLIT_RATE``:
   "guesthouse" -> "guest house") or merged (``MERGE_RATE``: "price range" -> "pricerange").
4. **Names misheard**: a name word is one written capitalised mid-sentence here and in at least
   ``NAME_SHARE`` of its uses in the set's turns ("Lovell", not "Restaurant"), or any word seen
   at most ``RARE_COUNT`` times (rare words, names written in lower case); never a number word.
   At its first mention in a dialogue it is misheard with ``NAME_ERROR_RATE``, and then heard
   the same way at every later mention (a recogniser hears one caller's name alike through a
   call). Misheard, it becomes one drawn among what applies: a sound-alike (the most common other
   vocabulary word of the same ``phonetic`` code, a small Metaphone-like key), a vocabulary word
   and a sound-alike ("cityroomz" -> "city rooms"), its halves heard as sound-alike words
   ("lovell" -> "low value"), or the word with a middle syllable dropped ("tandoori" -> "tari").
5. **Disfluencies**: a filler ("uh", "um") at a random word boundary (``FILLER_RATE``, a second
   one at ``FILLER_RATE**2``), and a restart repeating the first two or three words
   (``RESTART_RATE``: "i want i want a cheap hotel").
"""

from __future__ import annotations

import random
import re
import unicodedata
from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import replace
from itertools import pairwise

from bench.conversations import ConversationSet, Dialogue, Said
from sidecar.turn.engine import Speaker

SEED = "voxrecall-spoken-1"  # change it to draw another, equally valid, spoken set
FILLER_RATE = 0.3  # a turn's chance of an "uh"/"um" (and FILLER_RATE**2 of a second)
RESTART_RATE = 0.1  # a turn's chance of starting again: "i want i want a ..."
NAME_ERROR_RATE = 0.35  # a name word's chance of being misheard (sound-alike, split, syllable)
SPLIT_RATE = 0.5  # a word that is two vocabulary words: its chance of being heard as two
MERGE_RATE = 0.5  # two words that are one vocabulary word: their chance of being heard as one
RARE_COUNT = 3  # a word seen at most this often in the set's turns is treated as a name
NAME_SHARE = 0.5  # a name is written capitalised mid-sentence at least this often in the set
COMMON_COUNT = 3  # a sound-alike is drawn from words seen at least this often (ASR favours them)
FILLERS = ("uh", "um", "uh", "umm")
RESTART_WORDS = (2, 3)
MIN_NAME_LETTERS = 4  # shorter names ("the", "bar") are too short to mishear differently
MIN_PART_LETTERS = 3  # each word of a split or merge ("in the" is never heard as "inthe")

# -- numbers ------------------------------------------------------------------------------------

_ONES = (
    "zero one two three four five six seven eight nine ten eleven twelve thirteen fourteen "
    "fifteen sixteen seventeen eighteen nineteen"
).split()
_TENS = "_ _ twenty thirty forty fifty sixty seventy eighty ninety".split()
_SCALES = ((10**9, "billion"), (10**6, "million"), (1000, "thousand"), (100, "hundred"))
NUMBER_WORDS = frozenset(  # spoken numbers are heard right: never misheard as a name
    [*_ONES, *_TENS[2:], *(name for _, name in _SCALES), "point", "oh", "pounds", "dollars"]
)
_ORDINAL = {"one": "first", "two": "second", "three": "third", "five": "fifth", "eight": "eighth",
            "nine": "ninth", "twelve": "twelfth"}  # fmt: skip


def number_words(n: int) -> str:
    """A non-negative integer in English words: 1205 -> "one thousand two hundred five"."""
    if n < 0:
        raise ValueError(f"number_words takes a non-negative integer, got {n}")
    if n < 20:
        return _ONES[n]
    if n < 100:
        tens, ones = divmod(n, 10)
        return _TENS[tens] + (f" {_ONES[ones]}" if ones else "")
    for scale, name in _SCALES:
        if n >= scale:
            high, rest = divmod(n, scale)
            return f"{number_words(high)} {name}" + (f" {number_words(rest)}" if rest else "")
    raise AssertionError("unreachable")  # pragma: no cover


def ordinal_words(n: int) -> str:
    """21 -> "twenty first", 40 -> "fortieth"."""
    *head, last = number_words(n).split()
    if last in _ORDINAL:
        last = _ORDINAL[last]
    elif last.endswith("y"):
        last = last[:-1] + "ieth"
    else:
        last += "th"
    return " ".join([*head, last])


def digit_words(digits: str) -> str:
    return " ".join(_ONES[int(d)] for d in digits if d.isdigit())


def spell(token: str) -> str:
    """A code read out character by character: "cb21ab" -> "c b two one a b"."""
    return " ".join(_ONES[int(c)] if c.isdigit() else c for c in token.lower() if c.isalnum())


def time_words(hour: int, minute: int, meridiem: str) -> str:
    said = number_words(hour)
    if minute:
        said += f" oh {number_words(minute)}" if minute < 10 else f" {number_words(minute)}"
    elif not meridiem:
        said += " hundred" if hour > 12 else " o'clock"
    return f"{said} {' '.join(meridiem)}".strip()


_CURRENCY = {"£": ("pound", "pounds"), "$": ("dollar", "dollars"), "€": ("euro", "euros")}


def _price(m: re.Match[str]) -> str:
    one, many = _CURRENCY[m["cur"]]
    units = int(m["units"].replace(",", ""))
    said = f"{number_words(units)} {one if units == 1 else many}"
    cents = int(m["cents"] or 0)
    return f" {said} {number_words(cents)} " if cents else f" {said} "


def _time(m: re.Match[str]) -> str:
    groups = m.groupdict()
    meridiem = (groups["mer"] or "").replace(".", "").lower()
    return f" {time_words(int(groups['h']), int(groups.get('m') or 0), meridiem)} "


def _long_digits(m: re.Match[str]) -> str:
    return f" {digit_words(m[0])} "


def _code(m: re.Match[str]) -> str:
    token = m[0]
    ordinal = re.fullmatch(r"(\d+)(st|nd|rd|th)", token, re.I)
    if ordinal:
        return f" {ordinal_words(int(ordinal[1]))} "
    return f" {spell(token)} "


def _decimal(m: re.Match[str]) -> str:
    return f" {number_words(int(m['i']))} point {digit_words(m['f'])} "


def _cardinal(m: re.Match[str]) -> str:
    return f" {number_words(int(m[0].replace(',', '')))} "


_NUMBER_RULES: tuple[tuple[re.Pattern[str], Callable[[re.Match[str]], str]], ...] = (
    (re.compile(r"(?P<cur>[£$€])\s?(?P<units>\d[\d,]*)(?:\.(?P<cents>\d{2}))?"), _price),
    (re.compile(r"\b(?P<h>\d{1,2}):(?P<m>\d{2})\s*(?P<mer>[ap]\.?m\.?\b)?", re.I), _time),
    (re.compile(r"\b(?P<h>\d{1,2})\s*(?P<mer>[ap]\.?m\.?)(?!\w)", re.I), _time),
    (re.compile(r"\b\d(?:[\d -]*\d){4,}\b"), _long_digits),  # phone numbers: 5+ digits
    (re.compile(r"\b(?=[a-z]*\d)(?=\d*[a-z])[a-z\d]+\b", re.I), _code),  # postcodes, 2nd
    (re.compile(r"\b(?P<i>\d+)\.(?P<f>\d+)\b"), _decimal),
    (re.compile(r"\b\d{1,3}(?:,\d{3})+\b|\b\d+\b"), _cardinal),
)
_SYMBOLS = {"%": " percent ", "&": " and ", "+": " plus "}


def numbers_spoken(text: str) -> str:
    """Every digit of ``text`` as spoken words (rule 1 of the module docstring)."""
    for symbol, said in _SYMBOLS.items():
        text = text.replace(symbol, said)
    for pattern, said_as in _NUMBER_RULES:
        text = pattern.sub(said_as, text)
    return text


# -- words --------------------------------------------------------------------------------------


def fold(text: str) -> str:
    """Accents folded, curly apostrophes straightened."""
    text = unicodedata.normalize("NFKD", text.replace("’", "'"))
    return "".join(c for c in text if not unicodedata.combining(c))


def written_words(text: str) -> list[tuple[str, bool]]:
    """The words of a written turn (numbers already spoken), each with whether it was written
    capitalised in mid-sentence (a name, most likely). Lower case, no punctuation (rule 2)."""
    out: list[tuple[str, bool]] = []
    sentence_start = True
    for raw in re.split(r"[\s/\u2013\u2014-]+", fold(text)):
        word = re.sub(r"[^A-Za-z0-9']", "", raw).strip("'")
        if word:
            named = word[0].isupper() and not sentence_start and word != "I"
            out.append((word.lower(), named))
            sentence_start = bool(re.search(r"[.!?:]['\")]*$", raw))
        elif re.search(r"[.!?:]$", raw):
            sentence_start = True
    return out


def words_of(text: str) -> list[str]:
    return [w for w, _ in written_words(numbers_spoken(text))]


# -- the phonetic code --------------------------------------------------------------------------

_PHONETIC_RULES = tuple(
    (re.compile(a), b)
    for a, b in (
        (r"^[gkp]n", "n"), (r"^wr", "r"), (r"^x", "s"), (r"^wh", "w"), (r"mb$", "m"),
        (r"ph", "f"), (r"gh(?=[^aeiou]|$)", ""), (r"tch", "x"), (r"sch", "sk"), (r"ck", "k"),
        (r"c(?=[iey])", "s"), (r"sh|ch", "x"), (r"c|q", "k"), (r"x", "ks"), (r"z", "s"),
        (r"dg(?=[iey])", "j"), (r"d", "t"), (r"g(?=[iey])", "j"), (r"th", "0"), (r"v", "f"),
        (r"(?<=[^aeiou])h|h(?=[^aeiou]|$)", ""), (r"[wy](?=[^aeiou]|$)", ""),
    )
)  # fmt: skip


def phonetic(word: str) -> str:
    """A small Metaphone-like key: words that sound alike share it ("rooms", "roomz")."""
    w = re.sub(r"[^a-z]", "", word.lower())
    if not w:
        return ""
    for pattern, said in _PHONETIC_RULES:
        w = pattern.sub(said, w)
    head, tail = w[:1], re.sub(r"[aeiouy]", "", w[1:])
    key = head + tail
    return re.sub(r"(.)\1+", r"\1", key)


def syllables(word: str) -> list[str]:
    """The word cut after each vowel group ("tandoori" -> "ta", "ndoo", "ri")."""
    return re.findall(r"[^aeiouy]*[aeiouy]+(?:[^aeiouy]+$)?|[^aeiouy]+$", word)


# -- the transcriber ----------------------------------------------------------------------------


class Speech:
    """Transcribes written user turns as speech recognition would (the module docstring), with
    the words of the whole set as its vocabulary."""

    def __init__(self, texts: Iterable[str]) -> None:
        written = [written_words(numbers_spoken(t)) for t in texts]
        said = [[w for w, _ in ws] for ws in written]
        self.counts: Counter[str] = Counter(w for ws in said for w in ws)
        self.capitalised: Counter[str] = Counter(w for ws in written for w, cap in ws if cap)
        self.bigrams: Counter[str] = Counter(f"{a} {b}" for ws in said for a, b in pairwise(ws))
        common = sorted(w for w, c in self.counts.items() if c >= COMMON_COUNT and len(w) > 2)
        self.common = frozenset(common)
        self.by_code: dict[str, list[str]] = {}
        for w in sorted(common, key=lambda w: (-self.counts[w], w)):
            self.by_code.setdefault(phonetic(w), []).append(w)

    def transcribe(self, text: str, rng: random.Random, heard: dict[str, str] | None = None) -> str:
        """``text`` as recognised; ``heard`` holds how this dialogue's names were heard so far
        (filled here), so a name is heard the same way at every mention of one call."""
        heard = {} if heard is None else heard
        words = written_words(numbers_spoken(text))
        said = self._boundaries([w for w, _ in words], rng)
        named = {w for w, flag in words if flag}
        said = [self._hear(w, w in named, rng, heard) for w in said]
        return " ".join(self._disfluent(" ".join(said).split(), rng))

    def sound_alike(self, word: str) -> str | None:
        """The most common other vocabulary word of the same phonetic code, if any."""
        others = [w for w in self.by_code.get(phonetic(word), ()) if w != word]
        return others[0] if others else None

    def _boundaries(self, words: list[str], rng: random.Random) -> list[str]:
        out: list[str] = []
        i = 0
        while i < len(words):
            w = words[i]
            nxt = words[i + 1] if i + 1 < len(words) else ""
            if self._compound(w, nxt) and rng.random() < MERGE_RATE:
                out.append(w + nxt)
                i += 2
                continue
            split = self._compound_parts(w)
            out.extend(split if split and rng.random() < SPLIT_RATE else [w])
            i += 1
        return out

    def _compound(self, left: str, right: str) -> bool:
        """Whether the set writes ``left right`` both as two words and as one ("guest house")."""
        return (
            min(len(left), len(right)) >= MIN_PART_LETTERS
            and left + right in self.common
            and self.bigrams[f"{left} {right}"] >= COMMON_COUNT
        )

    def _compound_parts(self, word: str) -> list[str] | None:
        for cut in range(MIN_PART_LETTERS, len(word) - MIN_PART_LETTERS + 1):
            if self._compound(word[:cut], word[cut:]):
                return [word[:cut], word[cut:]]
        return None

    def _split(self, word: str) -> str | None:
        """A name heard as a vocabulary word and a sound-alike ("cityroomz" -> "city rooms")."""
        for cut in range(MIN_PART_LETTERS, len(word) - MIN_PART_LETTERS + 1):
            left, right = word[:cut], word[cut:]
            heard = right if right in self.common else self.sound_alike(right)
            if left in self.common and heard:
                return f"{left} {heard}"
        return None

    def _is_name(self, word: str, capitalised: bool) -> bool:
        if len(word) < MIN_NAME_LETTERS or not word.isalpha() or word in NUMBER_WORDS:
            return False
        if self.counts[word] <= RARE_COUNT:
            return True
        return capitalised and self.capitalised[word] >= NAME_SHARE * self.counts[word]

    def _hear(self, word: str, capitalised: bool, rng: random.Random, heard: dict[str, str]) -> str:
        if word not in heard and self._is_name(word, capitalised):
            heard[word] = self._misheard(word, rng) if rng.random() < NAME_ERROR_RATE else word
        return heard.get(word, word)

    def _misheard(self, word: str, rng: random.Random) -> str:
        ways = [
            way
            for way in (
                self.sound_alike(word),
                self._split(word),
                self._pieces(word),
                self._dropped(word),
            )
            if way and way != word
        ]
        return rng.choice(ways) if ways else word

    def _pieces(self, word: str) -> str | None:
        """The word heard as two sound-alike words ("harbor" -> "hard bore")."""
        parts = syllables(word)
        if len(parts) < 2:
            return None
        half = len(parts) // 2
        left, right = "".join(parts[:half]), "".join(parts[half:])
        heard = [self.sound_alike(p) or (p if p in self.common else None) for p in (left, right)]
        if None in heard:
            return None
        return " ".join(str(h) for h in heard)

    def _dropped(self, word: str) -> str | None:
        """The word with a middle syllable dropped ("tandoori" -> "tari")."""
        parts = syllables(word)
        if len(parts) < 3:
            return None
        return "".join(parts[:1] + parts[2:])

    def _disfluent(self, words: list[str], rng: random.Random) -> list[str]:
        if not words:
            return words
        if rng.random() < RESTART_RATE and len(words) > 3:
            k = rng.choice(RESTART_WORDS)
            words = words[:k] + words
        for rate in (FILLER_RATE, FILLER_RATE**2):
            if rng.random() < rate:
                words.insert(rng.randrange(len(words)), rng.choice(FILLERS))
        return words


def redraw(spec: str) -> None:
    """Draw another spoken set: ``SEED[,NAME_ERROR_RATE[,FILLER_RATE]]`` replace this module's
    constants (``quality_conversations --spoken``): the same transformation, another seed, or a
    harsher recogniser, to see that a result does not hang on one draw."""
    global SEED, NAME_ERROR_RATE, FILLER_RATE
    seed, *rates = spec.split(",")
    if len(rates) > 2 or not all(0.0 <= float(r) <= 1.0 for r in rates):
        raise ValueError(
            f"--spoken takes SEED[,NAME_ERROR_RATE[,FILLER_RATE]] (rates 0-1): {spec!r}"
        )
    SEED = seed or SEED
    NAME_ERROR_RATE = float(rates[0]) if rates else NAME_ERROR_RATE
    FILLER_RATE = float(rates[1]) if len(rates) > 1 else FILLER_RATE


def turn_rng(dialogue_id: str, index: int, seed: str = "") -> random.Random:
    """The seeded draw of one turn (a string seed hashes the same on every run and machine):
    under ``seed``, or this module's ``SEED`` (``bench.asr`` passes its own)."""
    return random.Random(f"{seed or SEED}\x00{dialogue_id}\x00{index}")


def transcribed(speech: Speech, d: Dialogue) -> Dialogue:
    """The dialogue with its user turns transcribed, its names heard alike throughout."""
    heard: dict[str, str] = {}
    turns = tuple(
        Said(t.speaker, speech.transcribe(t.text, turn_rng(d.dialogue_id, i), heard), t.qid)
        if t.speaker == Speaker.USER
        else t
        for i, t in enumerate(d.turns)
    )
    return Dialogue(d.dialogue_id, turns)


def spoken(cs: ConversationSet) -> ConversationSet:
    """``cs`` with its user turns transcribed (``Speech``); agent turns and the base unchanged."""
    speech = Speech(dict.fromkeys(t.text for d in cs.dialogues for t in d.turns))  # each text once
    dialogues = [transcribed(speech, d) for d in cs.dialogues]
    return replace(
        cs, name=f"{cs.name}-spoken", dialogues=dialogues, notes=f"{cs.notes}; user turns spoken"
    )
