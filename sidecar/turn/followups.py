"""Follow-up handling: fold what a turn refers back to into the query, with no LLM.

"Are their bathrooms clean?" alone retrieves every hotel's bathrooms; the session knows whose.
The snapshot knows its entities (the distinct titles and contexts of its chunks: a jsonl base's
hotels and restaurants, a Markdown base's pages). Every turn is scanned for them once, when it is
recorded; each match has a confidence from the snapshot's own statistics: the share of the chunks
holding the matched words that belong to that entity. Ordinary speech that happens to contain a
name's words ("by the park" and "Park Inn", "nine four one two two" and "Two Two Cafe", a page
called "Retirement Benefits") is about as likely in the chunks of other entities, so it matches
with a low confidence and is treated as ordinary words.

The session's entity is the newest confidently named one, where the agent's naming (and listing:
"the second one" picks from the agent's last list) outweighs a passing mention by the caller, and
fades with each turn. A user turn is then searched as (``plan``):

    it names an entity itself                      as said                      source "none"
    it asks about the options of the agent's       each option's chunks ranked  "options"
      last list together ("which of them",           by the turn's words, the
      "do either of them": ``_listed``)              best of each first
    it says nothing but a weak name ("Tell me      as said, and tracks it       source "none"
      about pCloud.": ``only_names``)
    it names another than the tracked one, if      as said                      source "none"
      weakly, and points back at nothing
    it writes a word as a file name or a command   as said                      source "none"
      ("conhost.exe") that only a few chunks of
      another entity hold, and points back at
      nothing (``_keyword_topic``)
    it says the words most names share, as a       as said                      source "none"
      name ("Windows Terminal", no "the"), and
      points back at nothing (``says_shared``)
    it answers the agent's question ("Yes.",       "entity: agent's turns turn" "agent_question"
      "I'm a noncitizen adult.")                   or, with no entity tracked,
                                                   "exchange turn"
    an entity is tracked (``fold``)                "entity: turn"               "entity"
      or picked from the agent's list ("the                                     "options"
      second one", "the other one"; tracked after)
      unless the caller moved on from it (a turn   as said                      source "none"
      answered on another page: ``leave``) and
      this one points back at nothing
    none is, and it says the words most names      as said                      source "none"
      share as a name ("Rclone gives ...", "a
      Windows Terminal profile") and points back
      at nothing (``names_shared``)
    none is, and it asks, pointing back at         as said                      source "none"
      nothing, after a fragment of the caller's
      that leaned on the caller's turn before it
      ("and the size?"; ``asks_after_fragment``)
    otherwise, after earlier turns                 "exchange turn"              "recent_turns"

where a folded turn is its words with a restart said once ("what about what uh about X":
``said_once``; a turn searched as said is searched as said), and the exchange is the caller's
previous turn with content and what the agent said after it (with no entity to name the topic,
an answer's content is in both: "I lost my card." / "Do you want to know how to replace it?" /
"Yes."), less the turns the skip policy passed over ("ok great thanks").
Turns that do not name an entity also get a prior: chunks of the pages the conversation's
searches found (the caller's turns, and the agent's, embedded in the background as they arrive)
are lifted a little (``sidecar.turn.engine``). A turn folded with the recent exchange is also
searched alone: a question whose own words clearly prefer another page keeps its answer, and
otherwise the candidates of both searches are ranked by the mean of their two cosines, so a chunk
both the turn and the conversation point to wins (``Plan.alone``); one folded with an entity
that does not refer back keeps its own result when its own words prefer another chunk by a
wider margin, or when the folded query's best chunk is not the entity's (the name did not decide
the answer, the turn's words did: ``sidecar.turn.engine``); where its own words find nothing at
``min_score``, it keeps only the folded chunks they back too, and off the base nothing. A turn
folded with either by its length alone (five words or fewer, none pointing back: "I forgot my
password", ``Plan.short``) is searched alone too, and answered as said where its own words
single out a page other than the folded answer's. A
page named by a word other pages also use ("pCloud", which every overview lists) is a weak
match, taken as the turn's topic only when the turn's own top results are all that page's
(``confirmed``), or when the turn says nothing but its name ("Tell me about pCloud.":
``only_names``). A name the recogniser heard past one edit ("goal drive", "misoft onedrive") is
such a weak naming too, heard by its sound (``heard``, ``sidecar.turn.sounds``). An agent's
turn that names no entity by a key names one by a word only that name holds ("sala find" of
Sala Thong, the other word misheard; ``NameWords``), or by a name run into the short word
before it ("thegardenia"): the agent names the place it offers, and a recogniser hearing both
sides of a call mishears the rest. There a name said with a hesitation inside it ("the
cambridge chop uh house") is the name, and a whole name that longer names hold ("nandos" beside
Nandos City Centre) is rated without their chunks (``whole_names``), and where nothing names
a place confidently, a name said without its inner function words ("a b guesthouse") is one
(``Elided``).
``TurnResponse.followup`` shows what was folded in, from where, and how sure it
was (nothing, when the turn's own words decided the answer).
"""

from __future__ import annotations

import logging
import re
import sys
from collections import Counter
from collections.abc import Callable, Iterable, Iterator, Sequence
from collections.abc import Set as AbstractSet
from dataclasses import dataclass, replace

import numpy as np
import numpy.typing as npt

from index.entities import (
    COMMON_ELSEWHERE,
    MIN_ALIAS_CHARS,
    RULES,
    WEAK_CONFIDENCE,
    Confidence,
    EntityStats,
    EntityTable,
    Rated,
    chunk_entities,
    chunk_entity,
    rate,
)
from index.entities import (
    FUNCTION_WORDS_EN as FUNCTION_WORDS_EN,
)
from index.key_tables import KeyOwners, KeySure, KeyTables, RatedKeys
from index.lexical import IntArray, LexicalIndex
from index.snapshot import LoadedSnapshot
from index.tables import ChunkTable
from index.types import Chunk
from sidecar.config import FollowupConfig
from sidecar.turn.sessions import Mention, Said, Session, Speaker
from sidecar.turn.sounds import SoundNames
from sidecar.turn.text import Utterance, named_tokens, tokens, words

log = logging.getLogger(__name__)

STREETS_EN = frozenset("street st road rd lane avenue ave way drive square".split())

REFERRING_EN = frozenset(
    """
    it its it's they their theirs them there that that's this these those he she his her him
    one ones same also else too
    """.split()
)
# Not "place": it pointed back in DSTC11's "is the place quiet?" (which "is it quiet?" says as well:
# no judged turn of any set changed without it), but a help line's caller places an order, a
# hold or a call, and such a turn was then folded with the tracked page and never searched alone.
# Referring words that often do not refer (English grammar, no data set's words): "that" after a
# content word opens a clause ("a list that I can join", "sure that"); "one" and "same" before
# a content word count or compare ("from one machine to another", "at the same time"); "there"
# beside a form of "be" says that something exists ("is there a roadmap", "there are two").
CLAUSE_THAT_EN = frozenset({"that"})
DETERMINER_LIKE_EN = frozenset({"one", "same"})
EXISTENTIAL_THERE_EN = frozenset({"there"})
# "too" says "also" at the end of what is said ("do they have wifi too"); before a word it says
# "more than enough" ("using too much memory", "too slow") and points at nothing.
CLAUSE_FINAL_EN = frozenset({"too"})
BE_EN = frozenset("is are was were be been isn't aren't wasn't weren't 's".split())
# "it" with no referent (an expletive): "is it possible to ...", "would it be necessary to
# ...", "it's okay to ...". These adjectives take a clause ("to ...", "that ...") as their
# subject, "it" standing in for it; adjectives that also say something of a thing ("easy",
# "hard": "is it easy to get to?"; "known", "close") are not among them, "it" may refer there.
CLAUSE_ADJECTIVES_EN = frozenset(
    "possible impossible necessary required mandatory ok okay allowed permitted true advisable".split()
)
CLAUSE_OPENERS_EN = frozenset({"to", "that", "whether"})
# Words that make the noun after them a common noun ("the hotel", "which hotel", "your app"):
# a word of a name said after none of them is said as a name ("does Windows Terminal support").
# Not "a" and "an": an indefinite article brings in something the conversation has not had yet,
# so what follows it is no pointer to the tracked entity ("tabs in a Windows Terminal window").
DETERMINERS_EN = frozenset(
    "the this that these those which what each every any some my your our their its his her".split()
)
# Openings that continue the conversation's topic with a fragment ("what about the parking",
# "and the price?", "regarding the criteria, ..."): ellipsis, whatever follows.
ELLIPTIC_OPENERS_EN = (("what", "about"), ("how", "about"), ("and",), ("regarding",))

# Words that open a question; a turn starting with one (after fillers) asks rather than answers.
QUESTION_OPENERS_EN = frozenset(
    """
    what which who whom whose when where why how is are was were do does did can could will would
    shall should may might have has had am
    """.split()
)
_SENTENCE_BREAK = re.compile(r"[.!?]\s+")  # where a turn's last sentence starts (``is_question``)
# Words a reply opens with ("Yes, please tell me", "No, I'm a student").
REPLY_OPENERS_EN = frozenset("yes yeah yep yup ya sure ok okay no nope nah please".split())
FILLERS_EN = frozenset("uh um umm uhm er erm ah hmm mm mhm well so oh".split())
# The fillers that are no word ("uh"; not "well", "so", "oh" or "ah", which are words a
# name may hold): a recogniser writes one inside a name the speaker hesitated in ("the
# cambridge chop uh house"), and no name holds one.
HESITATIONS_EN = FILLERS_EN - frozenset("well so oh ah".split())
# "the second one": a position in the agent's last list of options (-1: its last)
ORDINALS_EN = {"first": 0, "second": 1, "third": 2, "fourth": 3, "fifth": 4}
ORDINALS_EN |= {"former": 0, "latter": -1, "last": -1}
# Words that ask about every option of the agent's list at once (English grammar: quantifiers
# over a set). "both", "either" and "neither" do wherever they stand but at a turn's end ("me
# either") or opening a short coordination ("both breakfast and dinner": ``_over_list``);
# "which", "any", "each" and "all" do before "of" or "one" ("which of them", "any of those",
# "which one").
PAIR_WORDS_EN = frozenset({"both", "either", "neither"})
QUANTIFIERS_EN = frozenset({"which", "any", "each", "all", "either", "neither"})
OF_SET_EN = frozenset({"of", "one", "ones"})
COORDINATION_WORDS = 3
# Plural pointers: said right after the agent listed options ("There are two, A and B." / "do
# they take reservations?"), they point at the list (DSTC11 hit@3 0.8314 -> 0.8333, spoken
# 0.8004 -> 0.8023; said later, "they" is as often one place, as English uses it).
PLURAL_EN = frozenset(
    "they them their theirs those these".split()
)  # "both X and": the "and" within this many words after "both"


class Source:
    """Where a folded-in referent came from (``TurnResponse.followup.source``)."""

    NONE = "none"
    ENTITY = "entity"
    # the agent's last list of options: one picked by position ("the second one") or as the
    # one not being talked about ("the other one"), or each of them searched ("which of them")
    OPTIONS = "options"
    AGENT_QUESTION = "agent_question"
    RECENT_TURNS = "recent_turns"


# The sources that fold one entity's name into the turn (the engine lifts its chunks).
ONE_ENTITY = frozenset({Source.ENTITY, Source.OPTIONS})


SHORT_TURN = 5  # words; a turn this short rarely names its own topic
RESTART_WORDS = (3, 2)  # a run this long said twice at once is a restart ("what about what about")
# nothing names what the recent turns are about: a guess, said as one, where the engine's two
# searches do not say better (``sidecar.turn.engine._agreement``: how well they agree)
RECENT_CONFIDENCE = 0.5
MAX_FOLDED_WORDS = 60  # of the agent's turns folded into an answer: the caller's words stay read
ANSWER_CONTENT_WORDS = 3  # an answer with more content words than this is its own question
FUZZY_MAX_TOKENS = 3  # misspelt names are short; longer spans only cost time
# A match is used when at least this share of the chunks holding its words are the entity's own:
# below it, the words are about as often ordinary text elsewhere in the base.
MIN_CONFIDENCE = 0.5
# The turn alone's top results that must all be the weakly named entity's to confirm it.
CONFIRM_DEPTH = 3
NEAR_KEPT = 4096  # spans whose near match a gazetteer remembers (each ~150 bytes)
PREFIX_KEPT = 4096  # words whose prefix lookup a gazetteer remembers (each ~120 bytes)
# chunks whose entity a gazetteer remembers (each ~200 bytes): a conversation's hits recur, and
# ``chunk_entity`` costs about a microsecond
ENTITIES_KEPT = 4096
NEAR_FACTOR = 0.8  # a match one edit away (a misspelling, a mishearing) is less sure than exact
AGENT_WEIGHT = 1.5  # the agent naming an entity outweighs a passing mention by the caller
# A content word at most this many chunks hold, all of one entity's, names that entity, weakly
# (a file name, a command, a form's number: "What is conhost.exe?"); the lexical index knows it.
KEYWORD_DOCS = 3
# A keyword's or a section's words are looked up in the postings, and the chunks holding them
# read, only while they are this rare: a per-turn cost bounded whatever the base's size (the
# rarest word's doc ids; then at most SECTION_CHUNKS chunks' breadcrumbs). Words held by more
# name no page.
RARE_POSTINGS = 16_384
SECTION_CHUNKS = 256
SPOKEN_DOT_EN = "dot"  # how a transcript writes a file name's dot: "conhost dot exe"
# A name word that no other name holds, said alone in an agent's turn ("sala find" of Sala
# Thong, the other word misheard): a naming this much less sure than the word's own rating.
WORD_FACTOR = 0.8
# A street word up to this many words after a name's word makes it a street's ("saint andrews
# street", "fifty six saint train give road": a street's name misheard too).
ADDRESS_WORDS = 3
# Short function words a recogniser runs into the word after them ("the gardenia" heard as
# "thegardenia"), looked for at the start of an agent turn's word that matches nothing.
GLUED_EN = frozenset(w for w in FUNCTION_WORDS_EN if len(w) <= 3 and w != "s")
GLUED_LETTERS = 3
GLUED_REST = 3  # letters left after it, at least: "theoak bistro" of The Oak Bistro
# Names whose words are looked up alone (``NameWords``): a base of more is not named by ear.
WORD_NAMES = 2_000
# A name of more tokens, or a word of more letters, is not looked up by its words: real names'
# longest hold 12 tokens (doc2dial's page titles) and their words a few dozen letters; a hostile
# snapshot's 10 MB of names took 29 s and 400 MB to rate (s13's second attack, A1).
WORD_NAME_TOKENS = 24
WORD_LETTERS = 32
_NO_WHOLE: dict[int, float] = {}  # ``Gazetteer._scan`` of a caller's turn: the keys as rated
ADDRESS = -2  # ``Gazetteer._match``: a partial name in an address ("clifton way cherry hinton")
FADE = 0.5  # per recorded turn: a caller's confident naming outweighs the agent's last turn's
# A tracked entity that no turn has named or confirmed in about the last STALE_TURNS recorded
# turns (user and agent: its weight, the naming's confidence, x AGENT_WEIGHT when the agent
# named it, halved each turn, fell below STALE_WEIGHT: after 7 to 9) is an earlier topic: it frames only a
# turn that points back at it ("is it open late?"); an answer to the agent's question is folded
# with the exchange, and a turn that does not point back is searched as said. A caller who
# talked about one page and then asked about another kept the first folded into every turn
# (doc2dial-switch: bench/README.md, "Topic switches, measured").
STALE_TURNS = 8
STALE_WEIGHT = FADE**STALE_TURNS


@dataclass(frozen=True, slots=True)
class FollowUp:
    """What a turn's query folded in (``used``), where it came from (``source``: a ``Source``),
    and how sure that was (``confidence``, 0 to 1)."""

    used: str = ""
    source: str = Source.NONE
    confidence: float = 0.0


NO_FOLLOWUP = FollowUp()  # searched as said


@dataclass(frozen=True, slots=True)
class Plan:
    """How to search one user turn: ``query``; when ``alone`` the turn alone is searched too and
    ranked with it (a new question is not bent to the conversation); with ``prior`` the pages
    the conversation has been on are lifted (``Session.pages``); ``named`` are the entities the
    turn names weakly, taken as its topic when its own search confirms one (``confirmed``)."""

    query: str
    followup: FollowUp
    alone: bool = False
    prior: bool = False  # the pages the conversation has been on get a small bonus
    named: tuple[Mention, ...] = ()  # weak matches the turn's own search may confirm
    refers: bool = False  # it leans on the conversation ("it", a few words): never kept alone
    # the options of the agent's list the turn asks about together ("which of them"): each
    # one's chunks ranked by ``asked`` (the turn's words, embedded once), its best answering
    each: tuple[str, ...] = ()
    asked: str = ""
    picked: Mention | None = None  # the option the turn picked ("the second one"): tracked
    # the turn says nothing but ``named[0]``: taken as its topic (``only_names``)
    names: bool = False
    # it folds the tracked entity or the recent exchange in by its length alone, no word of it
    # pointing back ("I forgot my password"): searched alone too, it keeps its own answer where
    # that is surely another page's (``sidecar.turn.engine._switched``)
    short: bool = False


# the entity whose chunks alone hold a word, when at most KEYWORD_DOCS do ("" otherwise)
Keyword = Callable[[str], str]
# whether a heading of one of an entity's chunks holds every one of the words (``section_of``)
Section = Callable[[str, Sequence[str]], bool]


class Gazetteer:
    """The entity names of one snapshot, found in text by full or distinctive partial name.

    A name is matched by its words joined without spaces ("A and B Guesthouse" matches "A AND B
    GUEST HOUSE"; a recogniser's "hob sons house" matches too), by its distinctive words alone
    ("the Lensfield" matches "THE LENSFIELD HOTEL": the words left after dropping function words
    and words shared by many names, like "hotel"), by its words less those most names hold
    ("windows tenal interaction settings", misheard, still says "interaction settings" of
    "Windows Terminal Interaction Settings" where most titles start "Windows Terminal"), and,
    for keys of seven letters or more, within
    one edit that keeps the first letter ("Goonville", "cityroomz"). A partial name shared by two
    entities matches neither; a one-word name or partial name that ``is_common`` calls an ordinary
    word ("worth" of "WORTH HOUSE", a docs page titled "Selection") is not used. ``confidence``
    (words, name) rates every key from the snapshot (``index.entities.EntityStats``); without it
    every key is sure. The keys and their ratings are ``index.entities.rate``'s, which a
    snapshot stores (``entities.bin``): ``Gazetteer.rated`` builds one from them. ``words``
    (``NameWords``, from a snapshot's statistics at load: ``Gazetteer.of``) are what an agent's
    turn is also matched by (``find(toks, words=True)``).
    """

    def __init__(
        self,
        names: Iterable[str],
        function_words: frozenset[str],
        is_common: Callable[[str, str], bool] | None = None,
        streets: frozenset[str] = frozenset(),
        confidence: Confidence | None = None,
    ) -> None:
        self._index(rate(names, function_words, is_common, confidence), function_words, streets)

    @classmethod
    def rated(cls, rated: Rated, streets: frozenset[str] = STREETS_EN) -> Gazetteer:
        """The gazetteer of keys already rated (by ``index.entities.rate``, with
        FUNCTION_WORDS_EN): what a snapshot's ``entities.bin`` holds."""
        gazetteer = cls.__new__(cls)
        gazetteer._index(rated, FUNCTION_WORDS_EN, streets)
        return gazetteer

    def _index(self, rated: Rated, function_words: frozenset[str], streets: frozenset[str]) -> None:
        """The tables ``find`` matches by, built from the rated keys."""
        keys = RatedKeys.of(rated.keys, rated.sure, rated.partial)
        tables = KeyTables.build(keys)
        self._use(tables, function_words, streets, rated)
        self.built_bytes += tables.nbytes + tables.prefixes.python_bytes + keys.nbytes

    @classmethod
    def of_tables(
        cls,
        tables: KeyTables,
        counts: Rated | EntityTable,
        streets: frozenset[str] = STREETS_EN,
        built_bytes: int = 0,
    ) -> Gazetteer:
        """The gazetteer of a snapshot's tables (``gazetteer.bin`` mapped, or built from
        ``entities.bin``'s keys: ``built_bytes`` they take in memory); ``counts`` gives its
        size, span and shared words."""
        gazetteer = cls.__new__(cls)
        gazetteer._use(tables, FUNCTION_WORDS_EN, streets, counts)
        gazetteer.built_bytes += built_bytes
        return gazetteer

    def _use(
        self,
        tables: KeyTables,
        function_words: frozenset[str],
        streets: frozenset[str],
        counts: Rated | EntityTable,
    ) -> None:
        self.tables = tables
        # every string prefix of every key (a span is extended only while it may still be one),
        # and the long keys' one-edit variants, hashed: arrays only, mapped from the snapshot's
        # gazetteer.bin when it has one (1M chunks, 249k keys: 250k prefixes, 1.5M variants)
        self._prefixes = tables.prefixes
        self._keys = KeyOwners(tables)  # key -> its name (None: shared), read from the tables
        self._key_ends = tables.rated.keys.parts()[1]  # where each key ends in the keys' bytes
        self._sure = KeySure(self._keys, tables)
        self._near = tables.near
        # one edit keeps the first letter and the length within one: most spans are not tried
        self._initials = tables.initials
        self._lengths = tables.lengths
        self._near_kept: dict[str, str] = {}  # span -> its near key ("": none)
        self._prefix_kept: dict[str, int] = {}  # word -> a key it starts (-1: none)
        self._streets = streets
        self._function_words = function_words
        self._span = counts.span
        self._entities: dict[str, str] = {}  # chunk id -> entity, for the chunks last asked about
        self._whole: dict[int, float] = {}  # a whole name's key -> its rating (``whole_names``)
        self._elided = Elided({})  # names said without their inner function words
        self._listed = Listed.nothing()  # the names' chunks (``labels_of``), from entities.bin
        self.size = counts.size
        self.shared = counts.shared
        owners = tables.rated
        count = len(owners.owners)
        names = (owners.owner_name(i) for i in range(count))
        # the names as a recogniser may hear them ("goal drive"), weak namings a turn's own
        # search may confirm (``heard``)
        self.sounds = SoundNames.of(names, function_words, self.shared, FILLERS_EN, count)
        self.words = NameWords({}, streets)  # filled from the snapshot's statistics (``of``)
        # what the tables built in memory take: the sound tables, and the key tables unless
        # they are mapped from the snapshot
        self.built_bytes = self.sounds.nbytes

    @classmethod
    def of(cls, snapshot: LoadedSnapshot) -> Gazetteer:
        """The gazetteer of a snapshot's entities: the tables its ``gazetteer.bin`` holds,
        mapped; for a snapshot without one, built from the keys its ``entities.bin`` holds,
        rated at build time; for a snapshot without those (format 4) or rated by other rules,
        rated here by the snapshot's own statistics (``EntityStats``: every chunk's entity read
        once, the names' words looked up in the lexical index's postings in one pass; linear in
        the chunks, seconds at 100k). No event loop needed."""
        table = snapshot.entities
        if table is not None and table.rules == RULES:
            mapped = snapshot.key_tables
            if mapped is not None:  # their arrays counted in their file's bytes
                found = cls.of_tables(mapped, table, built_bytes=mapped.python_bytes)
            else:
                tables = KeyTables.build(table.rated_keys())
                found = cls.of_tables(
                    tables, table, built_bytes=tables.nbytes + tables.prefixes.python_bytes
                )
            found._said_by_agents(snapshot.lexical, table)
            return found
        if table is not None:
            log.warning(
                "snapshot %s: its entities were rated by follow-up rules %d, this sidecar's are %d:"
                " rating them again at every load (seconds per 100k chunks, in every worker);"
                " index the base again to store them rated",
                snapshot.version,
                table.rules,
                RULES,
            )
        entity_of = chunk_entities(snapshot.chunks)[1]
        return cls.rated(EntityStats(snapshot.lexical, entity_of).rated())

    def _said_by_agents(self, lexical: LexicalIndex, table: EntityTable) -> None:
        """What an agent's turn is also matched by, from the snapshot's statistics at load: the
        names' words alone (``NameWords``), whole names longer ones hold (``whole_names``) and
        names said without their inner function words (``Elided``)."""
        self.words = NameWords.of_snapshot(lexical, table)
        self._whole = whole_names(lexical, table, self.tables)
        self._elided = Elided.of(table, self.tables, self._whole)
        self._listed = Listed.of(table)
        self.built_bytes += self.agent_bytes

    def labels_of(self, name: str) -> IntArray | None:
        """The labels of the chunks whose entity is ``name`` (a question over the agent's
        listed options ranks each one's: ``sidecar.turn.engine``); None where the snapshot's
        names are not indexed so (no ``entities.bin``, or more than WORD_NAMES names)."""
        return self._listed.labels_of(name)

    @property
    def agent_bytes(self) -> int:
        """What the tables an agent's turn is also matched by take (``_said_by_agents``), and
        the names' index of ``labels_of``."""
        words = self.words.nbytes + sys.getsizeof(self._whole) + self._elided.nbytes
        return words + self._listed.nbytes

    def entity_of(self, chunk: Chunk) -> str:
        """``chunk_entity(chunk)``, remembered for the ENTITIES_KEPT chunks last asked about
        (a conversation's hits recur), not held for every chunk of the snapshot in each process."""
        found = self._entities.get(chunk.chunk_id)
        if found is None:
            if len(self._entities) >= ENTITIES_KEPT:
                self._entities = {}  # a new dict: another thread may be reading the old one
            found = self._entities[chunk.chunk_id] = chunk_entity(chunk)
        return found

    def mentions(self, text: str) -> list[str]:
        """The entity names a text mentions confidently, in order of first mention."""
        return [m.name for m in self.find(tokens(text)) if m.confidence >= MIN_CONFIDENCE]

    def find(self, toks: Sequence[str], words: bool = False) -> tuple[Mention, ...]:
        """Every entity the tokens match, each once (its surest match), in order of first match;
        with ``words`` (an agent's turn: the agent names the place it offers), a name's word no
        other name holds said alone too (``NameWords``), a name said with a hesitation inside
        ("the cambridge chop uh house"), and a whole name that longer names hold rated without
        their chunks (``whole_names``: "nandos" of NANDOS beside NANDOS CITY CENTRE), and, when
        none of those is confident, the names said without their inner function words
        (``Elided``: "a b guest house" of A and B Guest House)."""
        if not words:
            return self._scan(toks, words=False)
        if not HESITATIONS_EN.isdisjoint(toks):
            toks = [t for t in toks if t not in HESITATIONS_EN]
        found = self._scan(toks, words=True)
        if any(m.confidence >= MIN_CONFIDENCE for m in found):
            return found
        return (*found, *self._elided.find(toks, {m.name for m in found}))

    def _scan(self, toks: Sequence[str], words: bool) -> tuple[Mention, ...]:
        """``find``'s one pass over the tokens: names by their keys, then, with ``words`` (an
        agent's turn), each key rated as a whole name where it is one (``whole_names``), and
        names by a word of theirs (``_alone``, which rates so too) where no key names one
        confidently."""
        alone = (self.words or None) if words else None
        whole = self._whole if words else _NO_WHOLE
        found: dict[str, float] = {}
        function_words, initials, kept = self._function_words, self._initials, self._prefix_kept
        heard: dict[str, float] = {}  # names by a word alone: only where no key names one
        i = 0
        while i < len(toks):
            tok = toks[i]
            starts = kept.get(tok)  # the words last asked about first (a turn's recur)
            if starts is None:
                starts = self._remember(tok)
            if starts < 0 and (tok in function_words or tok[:1] not in initials):
                # most words: no name starts with it, none is one edit from it
                i += 1 if alone is None else self._alone(toks, i, found, heard)
                continue
            span, at, near = self._match(toks, i)
            if at >= 0:
                self._mention(found, at, near, whole)
            elif alone is not None and at != ADDRESS:
                span = max(span, self._alone(toks, i, found, heard))
            i += span
        if heard and not any(sure >= MIN_CONFIDENCE for sure in found.values()):
            found |= {name: max(sure, found.get(name, 0.0)) for name, sure in heard.items()}
        return tuple(Mention(name, round(sure, 3)) for name, sure in found.items())

    def _alone(
        self, toks: Sequence[str], i: int, found: dict[str, float], heard: dict[str, float]
    ) -> int:
        """For a word no key matched at ``toks[i]``, in an agent's turn: a name's word said
        alone (``NameWords``) into ``heard``, or a short function word run into a name or its
        word ("thegardenia", "theoak bistro": the recogniser's word boundary misplaced) into
        ``found`` as a near match or ``heard``; the tokens consumed (1 but for a name of more
        words run into)."""
        tok = toks[i]
        if self.words.find(tok, toks, i, heard) or tok in self._function_words:
            return 1
        for n in range(1, min(GLUED_LETTERS, len(tok) - GLUED_REST) + 1):
            if tok[:n] not in GLUED_EN:
                continue
            rest = [tok[n:], *toks[i + 1 : i + self._span]]
            span, at = self._exact(rest, 0, len(rest))
            if at >= 0:
                self._mention(found, at, True, self._whole)
                return span
            if self.words.find(rest[0], toks, i, heard):
                return 1
        return 1

    def _mention(
        self, found: dict[str, float], at: int, near: bool, whole: dict[int, float]
    ) -> None:
        """Key ``at``'s name into ``found`` with its confidence (``whole``'s where it rates the
        key), when it names one name (read by the key's index: the key is not looked up
        again)."""
        rated = self.tables.rated
        owner = int(rated.owner[at])
        if owner >= 0:
            name = rated.owner_name(owner)
            sure = _key_rating(rated, whole, at) * (NEAR_FACTOR if near else 1.0)
            found[name] = max(found.get(name, 0.0), sure)

    def _match(self, toks: Sequence[str], i: int) -> tuple[int, int, bool]:
        """(tokens consumed, the index of the key matched, -1 or ADDRESS (a partial name that
        is an address's: its words name nothing alone either), whether it matched one edit
        away)."""
        longest = min(self._span, len(toks) - i)
        n, at = self._exact(toks, i, longest)
        if n:
            partial = bool(self.tables.rated.partial[at])
            if partial and i + n < len(toks) and toks[i + n] in self._streets:
                return n, ADDRESS, False  # "12 Bridge Street": an address, not Bridge Guest House
            if partial and i > 0 and toks[i - 1] in self._streets:
                return n, ADDRESS, False  # "clifton way cherry hinton": the area of an address
            return n, at, False
        if toks[i] in self._function_words:
            return 1, -1, False
        if toks[i][:1] in self._initials:
            for n in range(min(longest, FUZZY_MAX_TOKENS), 0, -1):
                key = self._near_match("".join(toks[i : i + n]))
                if key:
                    return n, self._keys.index(key), True
        return 1, -1, False

    def _exact(self, toks: Sequence[str], i: int, longest: int) -> tuple[int, int]:
        """The longest run of tokens from ``i`` (at most ``longest``) whose words joined are a
        key, as (tokens, the key's index), or (0, -1)."""
        ends = self._key_ends
        found, at = 0, -1
        joined = ""
        for n in range(1, longest + 1):
            joined += toks[i + n - 1]
            starts = self._starts(joined) if n == 1 else self._prefixes.find(joined)
            if starts < 0:
                break
            if ends[starts + 1] - ends[starts] == len(joined):  # the key's length, not decoded
                found, at = n, starts
        return found, at

    def _starts(self, word: str) -> int:
        """A key ``word`` starts (its index; -1: none), remembered for the PREFIX_KEPT words
        last asked about (a conversation's words recur; each lookup hashes the word and walks
        the mapped table's slots, a few microseconds in Python)."""
        found = self._prefix_kept.get(word)
        return self._remember(word) if found is None else found

    def _remember(self, word: str) -> int:
        """``_starts`` of a word not remembered: looked up, and remembered."""
        if len(self._prefix_kept) >= PREFIX_KEPT:
            self._prefix_kept = {}  # a new dict: another thread may be reading the old one
        found = self._prefix_kept[word] = self._prefixes.find(word)
        return found

    def _near_match(self, key: str) -> str:
        """The one name key within one edit of ``key`` (first letter kept), or "": remembered
        for the NEAR_KEPT spans last tried (a conversation's words recur; each try builds and
        looks up every deletion of the span)."""
        if not self._lengths[0] <= len(key) <= self._lengths[1]:
            return ""
        found = self._near_kept.get(key)
        if found is None:
            if len(self._near_kept) >= NEAR_KEPT:
                self._near_kept = {}  # a new dict: another thread may be reading the old one
            found = self._near_kept[key] = self._near_lookup(key)
        return found

    def _near_lookup(self, key: str) -> str:
        rated = self.tables.rated
        candidates = self._near.sharing_ids(key)  # hashed: each is checked here
        close = {(rated.keys[c], c) for c in candidates}
        close = {(k, c) for k, c in close if k[0] == key[0] and _one_edit(key, k)}
        owners = {int(rated.owner[c]) for _, c in close}
        return min(k for k, _ in close) if len(owners) == 1 and -1 not in owners else ""


def _one_edit(a: str, b: str) -> bool:
    """Whether ``a`` and ``b`` differ by one insertion, deletion, substitution or swap."""
    if a == b:
        return False
    if len(a) > len(b):
        a, b = b, a
    i = next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), len(a))
    if len(a) != len(b):
        return len(b) - len(a) == 1 and a[i:] == b[i + 1 :]
    if a[i + 1 :] == b[i + 1 :]:
        return True
    return i + 1 < len(a) and a[i] == b[i + 1] and a[i + 1] == b[i] and a[i + 2 :] == b[i + 2 :]


class NameWords:
    """The names' words no other name holds, each looked up alone: an agent's turn naming a
    place by one word of its name, the rest misheard ("sala find" of Sala Thong, "frankie and
    time nys" of Frankie and Bennys), which no key matches. Only a word of ``MIN_ALIAS_CHARS``
    letters or more that fewer than ``COMMON_ELSEWHERE`` chunks of other entities use (the
    rule a one-word partial key is kept by: "stop" of City Stop Restaurant, "coffee" of
    Stazione Restaurant and Coffee Bar are ordinary words), rated by the snapshot: the share
    of the chunks holding it that are the name's own, times ``WORD_FACTOR``."""

    def __init__(self, words: dict[str, tuple[str, float]], streets: frozenset[str]) -> None:
        self._words = words  # word -> (its name, how sure)
        self._streets = streets
        # counted in the searcher's memory (``held_bytes``), as the sound tables are; a name's
        # string is the table's, shared
        size = sys.getsizeof
        self.nbytes = size(words) + sum(size(w) + size(hit) for w, hit in words.items())

    def __bool__(self) -> bool:
        return bool(self._words)

    def __len__(self) -> int:
        return len(self._words)

    def find(self, word: str, toks: Sequence[str], i: int, found: dict[str, float]) -> bool:
        """Key the name ``word`` (said as ``toks[i]``) is a word of into ``found``
        (``Gazetteer.find``), unless it is a street's ("fifty six saint barnabas road"); whether
        it is a name's word."""
        hit = self._words.get(word)
        if hit is None:
            return False
        if self._streets.isdisjoint(toks[i + 1 : i + 1 + ADDRESS_WORDS]):
            name, sure = hit
            found[name] = max(found.get(name, 0.0), sure)
        return True

    @classmethod
    def of_snapshot(
        cls, lexical: LexicalIndex, table: EntityTable, streets: frozenset[str] = STREETS_EN
    ) -> NameWords:
        """The words of a snapshot's names (``entities.bin``: every chunk's entity), rated by
        its lexical postings; none for a base of more than WORD_NAMES names."""
        if len(table.names) > WORD_NAMES:
            return cls({}, streets)
        names = [table.names[i].strip() for i in range(len(table.names))]
        said = [_said_words(name) for name in names]
        held = Counter(w for name in names for w in set(tokens(name)))
        candidates = {
            w: at
            for at, name_words in enumerate(said)
            if len(name_words) <= WORD_NAME_TOKENS
            for w in name_words
            if held[w] == 1
            and MIN_ALIAS_CHARS <= len(w) <= WORD_LETTERS
            and w not in FUNCTION_WORDS_EN
        }
        words: dict[str, tuple[str, float]] = {}
        for (word, at), docs in zip(
            candidates.items(), lexical.postings(list(candidates)), strict=True
        ):
            owners = table.entity_of[docs]
            own = int(np.count_nonzero(owners == at))
            if own and len(docs) - own < COMMON_ELSEWHERE:  # in a chunk of its own name
                words[word] = (names[at], WORD_FACTOR * (own + 1.0) / (len(docs) + 1.0))
        return cls(words, streets)


class Listed:
    """The labels of each name's chunks (``Gazetteer.labels_of``), grouped once per snapshot:
    every chunk's label in the order of its entity's index in ``entities.bin`` (each group
    ascending), and where each group starts (4 bytes a chunk; a stable sort of one int16 per
    chunk at load, 18 ms at 1M chunks), for a base of at most WORD_NAMES names. A question over
    the agent's listed options reads each option's as a slice: it scanned every chunk's entity
    per option (0.3 ms each at 1M chunks)."""

    def __init__(
        self, order: IntArray | None, starts: npt.NDArray[np.int64], at: dict[str, int]
    ) -> None:
        self._order = order  # the chunks' labels, grouped by entity
        self._starts = starts  # entity i's labels: order[starts[i]:starts[i + 1]]
        self._at = at  # name -> its index in the names table
        size = sys.getsizeof
        grouped = (order.nbytes if order is not None else 0) + starts.nbytes
        self.nbytes = size(at) + sum(size(name) for name in at) + grouped

    def labels_of(self, name: str) -> IntArray | None:
        at = self._at.get(name)
        if self._order is None or at is None:
            return None
        return self._order[self._starts[at] : self._starts[at + 1]]

    @classmethod
    def nothing(cls) -> Listed:
        """No names indexed: ``labels_of`` answers None."""
        return cls(None, np.zeros(0, dtype=np.int64), {})

    @classmethod
    def of(cls, table: EntityTable) -> Listed:
        names = len(table.names)
        if names > WORD_NAMES:  # WORD_NAMES fits an int16: the sort is a radix sort
            return cls.nothing()
        entity_of = np.asarray(table.entity_of)
        order = np.argsort(entity_of.astype(np.int16), kind="stable").astype(np.int32)
        starts = np.zeros(names + 1, dtype=np.int64)
        np.cumsum(np.bincount(entity_of, minlength=names), out=starts[1:])
        at = {table.names[i].strip(): i for i in range(names)}
        return cls(order, starts, at)


class Elided:
    """Names said without the function words inside them ("a b guest house" of A and B Guest
    House, "frankie bennys"): a recogniser drops short words, a name's too. Each name's
    tokens ("the" first aside) less the function words after its first, joined, where that
    is no key and no other name's so; rated as the whole name, times NEAR_FACTOR."""

    def __init__(self, by_first: dict[str, list[tuple[str, int, str, float]]]) -> None:
        # first token -> (the tokens joined, how many, the name, how sure)
        self._by_first = by_first
        size = sys.getsizeof
        self.nbytes = size(by_first) + sum(
            size(w) + size(v) + sum(size(key) for key, _, _, _ in v) for w, v in by_first.items()
        )

    def find(self, toks: Sequence[str], named: AbstractSet[str]) -> tuple[Mention, ...]:
        """The names the tokens say so, but those in ``named``."""
        if not self._by_first or self._by_first.keys().isdisjoint(toks):
            return ()  # most turns
        found: dict[str, float] = {}
        for i, tok in enumerate(toks):
            for key, count, name, sure in self._by_first.get(tok, ()):
                if name not in named and _joined_at(toks, i, count, key):
                    found[name] = max(found.get(name, 0.0), sure)
        return tuple(Mention(name, round(sure, 3)) for name, sure in found.items())

    @classmethod
    def of(cls, table: EntityTable, tables: KeyTables, whole: dict[int, float]) -> Elided:
        """The names of ``entities.bin`` (at most WORD_NAMES, of at most WORD_NAME_TOKENS
        tokens) said without their inner function words, rated as the tables rate each whole
        name (``whole`` where it does)."""
        if len(table.names) > WORD_NAMES:
            return cls({})
        keys, rated = KeyOwners(tables), tables.rated
        elided: dict[str, list[tuple[str, int, str, float] | None]] = {}
        for i in range(len(table.names)):
            name = table.names[i].strip()
            toks = _stripped(tokens(name))
            said = toks[:1] + [t for t in toks[1:] if t not in FUNCTION_WORDS_EN]
            at = keys.index("".join(toks))
            if len(said) < 2 or said == toks or len(toks) > WORD_NAME_TOKENS or at < 0:
                continue
            key = "".join(said)
            sure = _key_rating(rated, whole, at) * NEAR_FACTOR
            taken = key in elided or keys.index(key) >= 0
            elided[key] = [None] if taken else [(key, len(said), name, sure)]
        by_first: dict[str, list[tuple[str, int, str, float]]] = {}
        for (hit,) in elided.values():
            if hit is not None and hit[3] >= MIN_CONFIDENCE:
                by_first.setdefault(_stripped(tokens(hit[2]))[0], []).append(hit)
        return cls(by_first)


def _stripped(toks: list[str]) -> list[str]:
    """A name's tokens, "the" first aside."""
    return toks[1:] if toks[:1] == ["the"] and len(toks) > 1 else toks


def _key_rating(rated: RatedKeys, whole: dict[int, float], at: int) -> float:
    """How sure key ``at`` names its name: ``whole``'s rating where it has one, else the
    snapshot's."""
    return whole.get(at) or float(rated.sure[at])


def _joined_at(toks: Sequence[str], i: int, most: int, key: str) -> bool:
    """Whether up to ``most`` tokens from ``i``, joined, are ``key`` (a recogniser may merge
    two: "a b guesthouse")."""
    joined = ""
    for tok in toks[i : i + most]:
        joined += tok
        if joined == key:
            return True
        if not key.startswith(joined):
            return False
    return False


def whole_names(lexical: LexicalIndex, table: EntityTable, tables: KeyTables) -> dict[int, float]:
    """The keys of whole names that longer names hold as a run of their words ("NANDOS" in
    "NANDOS CITY CENTRE", "PIZZA EXPRESS" in "PIZZA EXPRESS FEN DITTON"), rated by the share
    of the chunks holding the name's words that are its own, the longer names' chunks aside:
    those say the words as their own name, and a turn naming them says their other words too
    (the longest key matches). Where that rates the key higher than the snapshot did, key index
    -> the rating; none for a base of more than WORD_NAMES names."""
    if len(table.names) > WORD_NAMES:
        return {}
    runs = _name_runs([table.names[i].strip() for i in range(len(table.names))])
    keys, rated = KeyOwners(tables), tables.rated
    said = {owner: _content(run) or list(run) for owner, (run, _) in runs.items()}
    words = list(dict.fromkeys(w for ws in said.values() for w in ws))
    postings = dict(zip(words, lexical.postings(words), strict=True))  # the vocabulary read once
    found: dict[int, float] = {}
    for owner, (run, holders) in runs.items():
        at = keys.index("".join(run))
        if at < 0 or rated.owner_name(int(rated.owner[at])) != table.names[owner].strip():
            continue
        sure = _own_share([postings[w] for w in said[owner]], table, owner, holders)
        if sure > float(rated.sure[at]):
            found[at] = sure
    return found


def _name_runs(names: Sequence[str]) -> dict[int, tuple[tuple[str, ...], list[int]]]:
    """Each name (by index) whose tokens ("the" first aside) are a run of longer names' tokens
    (of at most WORD_NAME_TOKENS): its tokens and those names."""
    stripped = [tuple(_stripped(tokens(name))) for name in names]
    whole = {t: at for at, t in enumerate(stripped) if 0 < len(t) <= WORD_NAME_TOKENS}
    held: dict[int, tuple[tuple[str, ...], list[int]]] = {}
    for at, toks in enumerate(stripped):
        if len(toks) > WORD_NAME_TOKENS:
            continue
        for run in {toks[i:j] for i in range(len(toks)) for j in range(i + 1, len(toks) + 1)}:
            inner = whole.get(run)
            if inner is not None and inner != at and run != toks:
                held.setdefault(inner, (run, []))[1].append(at)
    return held


def _own_share(
    postings: Sequence[IntArray], table: EntityTable, owner: int, aside: list[int]
) -> float:
    """The share of the chunks in every one of ``postings`` (a name's words') that are
    ``owner``'s, the chunks of the entities ``aside`` left out (1 when none holds them; 0 when
    each word is in more than RARE_POSTINGS chunks: too common to tell, and a load's cost
    bounded whatever the base's size)."""
    held = sorted((p for p in postings if len(p)), key=len)  # a word no chunk holds tells nothing
    if not held:
        return 1.0
    if len(held[0]) > RARE_POSTINGS:
        return 0.0
    docs = held[0]
    for posting in held[1:]:
        docs = _within(docs, posting)
    owners = table.entity_of[docs]
    owners = owners[~np.isin(owners, aside)]
    return (int(np.count_nonzero(owners == owner)) + 1.0) / (len(owners) + 1.0)


def _said_words(name: str) -> list[str]:
    """A name's tokens but a function word's contraction ("can't", "you'll" of "... If You
    Can't Work", "Where You'll Go For Care": "cant", "youll", which any sentence says); a
    name's possessive ("Rosa's") is its own."""
    return [
        tok
        for word in words(name)
        if "'" not in word or word.split("'")[0] not in FUNCTION_WORDS_EN
        for tok in tokens(word)
    ]


_EMPTY = Gazetteer((), FUNCTION_WORDS_EN)
_DEFAULTS = FollowupConfig()


def gazetteer(snapshot: LoadedSnapshot) -> Gazetteer:
    """The snapshot's gazetteer, built anew: its searcher (``sidecar/snapshots/searcher.py``)
    builds it once, off the event loop, and holds it while the snapshot is served
    (``Gazetteer.of``: from the keys the snapshot stores, or rated here from its chunks)."""
    return Gazetteer.of(snapshot)


def keyword_of(
    lexical: LexicalIndex,
    chunks: Sequence[Chunk],
    entity_of: Callable[[Chunk], str],
    mask: npt.NDArray[np.bool_] | None = None,
) -> Keyword:
    """A ``plan``'s ``keyword``: the entity whose chunks alone hold a word, when one to
    KEYWORD_DOCS chunks do, read from the lexical index's postings; "" otherwise. With ``mask``
    (the call's filters: ``Allowed.mask``) only the chunks the call may reach count: what a
    hidden chunk holds never changes how a turn is searched."""

    def keyword(word: str) -> str:
        docs = lexical.matching(word)
        if len(docs) > RARE_POSTINGS:
            return ""  # no page's keyword, and the mask is not run over its postings
        if mask is not None:
            docs = docs[mask[docs]]
        if not 0 < len(docs) <= KEYWORD_DOCS:
            return ""
        about = {entity_of(chunks[int(doc)]) for doc in docs}
        return next(iter(about)) if len(about) == 1 else ""

    return keyword


def section_of(
    lexical: LexicalIndex,
    chunks: Sequence[Chunk],
    entity_of: Callable[[Chunk], str],
    mask: npt.NDArray[np.bool_] | None = None,
) -> Section:
    """A ``plan``'s ``section``: whether a chunk of ``entity`` holds every one of ``words`` in
    a heading below its page's title (its breadcrumbs): the page has a section of that name.
    The chunks holding all the words are read from the lexical index's postings; with ``mask``
    only the chunks the call may reach count."""

    def section(entity: str, said: Sequence[str]) -> bool:
        postings = sorted((lexical.matching(word) for word in said), key=len)
        if len(postings[0]) > RARE_POSTINGS:
            return False  # words too common to name one page's section (and a bounded turn)
        docs = postings[0]
        for other in postings[1:]:
            docs = _within(docs, other)
        if mask is not None:
            docs = docs[mask[docs]]
        if len(docs) > SECTION_CHUNKS:
            return False
        return any(_headed(chunks, int(doc), said, entity, entity_of) for doc in docs)

    return section


def _within(docs: IntArray, other: IntArray) -> IntArray:
    """The ``docs`` that ``other`` holds, both sorted: each looked up by bisection, so the cost
    follows the few ``docs`` (at most ``RARE_POSTINGS``), not a common word's postings."""
    if not len(docs) or not len(other):
        return docs[:0]
    at = np.minimum(np.searchsorted(other, docs), len(other) - 1)
    found: IntArray = docs[other[at] == docs]
    return found


def _headed(
    chunks: Sequence[Chunk],
    label: int,
    said: Sequence[str],
    entity: str,
    entity_of: Callable[[Chunk], str],
) -> bool:
    """Whether chunk ``label`` is ``entity``'s and a heading below its title holds every word:
    its breadcrumbs are read first, alone (a mapped table decodes no chunk for them)."""
    crumbs = (
        chunks.breadcrumbs(label) if isinstance(chunks, ChunkTable) else chunks[label].breadcrumbs
    )
    if len(crumbs) < 2 or not set(said) <= set(tokens(" ".join(crumbs[1:]))):
        return False
    return entity_of(chunks[label]) == entity


# -- the turn's plan --------------------------------------------------------------------------


def refers_back(utterance: Utterance) -> bool:
    """Whether a turn leans on the conversation: a pronoun, "the place", or a few words only.
    A referring word used otherwise ("is there a way", "at the same time", "a list that I
    can join", "is it possible to": ``_refers_at``) does not count."""
    toks = _spoken(utterance)
    return len(toks) <= SHORT_TURN or _points_back(toks)


def _points_back(toks: Sequence[str]) -> bool:
    """Whether the words point back at the conversation: a referring word used so
    (``_refers_at``), or an elliptic opening (``ELLIPTIC_OPENERS_EN``)."""
    return _opens_elliptic(toks) or _refers(toks)


def _elliptic_only(toks: Sequence[str]) -> bool:
    """Whether the words point back by an elliptic opening alone ("and for teams?", "what about
    on a Mac?"): no pronoun or other referring word says what they lean on, so they lean on
    what was just said."""
    return _opens_elliptic(toks) and not _refers(toks)


def _opens_elliptic(toks: Sequence[str]) -> bool:
    """Whether the words open with an elliptic opening (``ELLIPTIC_OPENERS_EN``)."""
    opening = tuple(_opening(toks))
    return any(opening[: len(e)] == e for e in ELLIPTIC_OPENERS_EN)


def _refers(toks: Sequence[str]) -> bool:
    """Whether any of the words refers back (``_refers_at``)."""
    return any(_refers_at(toks, i) for i in range(len(toks)))


def _refers_at(toks: Sequence[str], i: int) -> bool:
    """Whether ``toks[i]`` refers back: a referring word, unless its neighbours show it is used
    otherwise (``CLAUSE_THAT_EN``, ``DETERMINER_LIKE_EN``, ``EXISTENTIAL_THERE_EN``,
    ``CLAUSE_FINAL_EN``)."""
    word = toks[i]
    if word not in REFERRING_EN:
        return False
    before = toks[i - 1] if i > 0 else ""
    after = toks[i + 1] if i + 1 < len(toks) else ""
    if word in CLAUSE_THAT_EN:
        return not _is_content(before)
    if word in DETERMINER_LIKE_EN:
        return not _is_content(after)
    if word in EXISTENTIAL_THERE_EN:
        return before not in BE_EN and after not in BE_EN
    if word in CLAUSE_FINAL_EN:  # last but for function words: "... too please", "too or not"
        return not any(_is_content(w) for w in toks[i + 1 :])
    return not _expletive_it(toks, i)


def _expletive_it(toks: Sequence[str], i: int) -> bool:
    """Whether ``toks[i]`` is an "it" that stands for the clause after it (``CLAUSE_ADJECTIVES_EN``):
    "is it possible to", "would it be necessary that", "it is okay to", "it's true that"."""
    word = toks[i]
    if word == "it's":
        rest = toks[i + 1 : i + 3]
    elif word == "it":
        after = toks[i + 1 : i + 2]
        # "is it possible": the form of "be" before it; "it is", "would it be": after it
        skip = 2 if after and after[0] in BE_EN else 1
        if skip == 1 and (i == 0 or toks[i - 1] not in BE_EN):
            return False
        rest = toks[i + skip : i + skip + 2]
    else:
        return False
    return len(rest) == 2 and rest[0] in CLAUSE_ADJECTIVES_EN and rest[1] in CLAUSE_OPENERS_EN


def _is_content(word: str) -> bool:
    return bool(word) and bool(_content((word,)))


def _spoken(utterance: Utterance) -> tuple[str, ...]:
    """The turn's words without fillers ("uh", "umm"), worked out once per utterance
    (``Utterance.spoken``)."""
    if utterance.spoken is None:
        utterance.spoken = tuple([w for w in utterance.words if w not in FILLERS_EN])
    return utterance.spoken


def said_once(utterance: Utterance) -> str:
    """The turn's text with a restart said once: a run of ``RESTART_WORDS`` words said twice
    at once, fillers aside ("what about what uh about advanced options for it" -> "what uh about
    advanced options for it"; the repeat, folded with a name, leads a search astray). Anything
    else is the text as said."""
    toks = _spoken(utterance)
    if len(set(toks)) == len(toks):
        return utterance.text  # no word said twice: no restart (most turns)
    pieces = utterance.text.split()
    said = [(i, w) for i, piece in enumerate(pieces) for w in words(piece) if w not in FILLERS_EN]
    starts = {i: k for k, (i, _) in reversed(list(enumerate(said)))}  # a piece's first word
    for start, n in _restart(tuple(w for _, w in said)):
        first, again = said[start][0], said[start + n][0]
        if starts[first] == start and starts[again] == start + n:
            return " ".join(pieces[:first] + pieces[again:])
    return utterance.text


def _restart(toks: Sequence[str]) -> Iterator[tuple[int, int]]:
    """Where a run of ``RESTART_WORDS`` words is said twice at once: (its start, its length)."""
    for n in RESTART_WORDS:
        for i in range(len(toks) - 2 * n + 1):
            if toks[i : i + n] == toks[i + n : i + 2 * n]:
                yield i, n


def _content(toks: Iterable[str]) -> list[str]:
    """The words that carry content: not function words, reply words or contractions ("i'm")."""
    return [
        t for t in toks if t not in FUNCTION_WORDS_EN and t not in REPLY_OPENERS_EN and "'" not in t
    ]


def _opening(toks: Sequence[str]) -> Sequence[str]:
    """The words after any opening fillers and reply words ("uh yes does it ..." -> "does it")."""
    i = 0
    while i < len(toks) and (toks[i] in FILLERS_EN or toks[i] in REPLY_OPENERS_EN):
        i += 1
    return toks[i:]


def is_question(text: str) -> bool:
    """Whether a turn (its last sentence) asks something: a question mark, or (transcripts have
    no punctuation) a question word first, after any fillers and reply words."""
    return _asks(text, None)


def asks(utterance: Utterance) -> bool:
    """``is_question`` of a turn, worked out once per utterance (``Utterance.asks``)."""
    if utterance.asks is None:
        utterance.asks = _asks(utterance.text, utterance.words)
    return utterance.asks


def _asks(text: str, said: Sequence[str] | None) -> bool:
    """``is_question``; ``said`` is ``words(text)`` when already split (a text of one sentence
    is then not split again)."""
    if text.rstrip().endswith("?"):
        return True
    sentences = _SENTENCE_BREAK.split(text.strip())
    last = said if said is not None and len(sentences) == 1 else words(sentences[-1])
    rest = _opening(last)
    return bool(rest) and rest[0] in QUESTION_OPENERS_EN


def replies(utterance: Utterance) -> bool:
    """Whether a turn opens with a reply word ("yes", "no", "sure") after any fillers."""
    toks = _spoken(utterance)
    return bool(toks) and toks[0] in REPLY_OPENERS_EN


def answers(utterance: Utterance) -> bool:
    """Whether a turn reads as an answer rather than a request of its own: it asks nothing and
    carries few content words ("Yes, please tell me.", "I'm a noncitizen adult.")."""
    toks = _spoken(utterance)
    if not toks or asks(utterance):
        return False
    return len(_content(toks)) <= ANSWER_CONTENT_WORDS


def agent_question(session: Session) -> str:
    """What the agent said since the caller's last turn, when it ended on a question ("You need
    to prove your status. Do you want to know how?": the question alone may carry no content);
    else ""."""
    if not session.turns or session.turns[-1].speaker != Speaker.AGENT:
        return ""
    last = session.turns[-1]  # whether it asks was worked out when the engine recorded it
    if not (last.question if last.question is not None else is_question(last.text)):
        return ""
    said: list[str] = []
    for turn in reversed(session.turns):
        if turn.speaker != Speaker.AGENT:
            break
        said.append(turn.text.strip())
    return " ".join(" ".join(reversed(said)).split()[-MAX_FOLDED_WORDS:])


def plan(
    session: Session,
    utterance: Utterance,
    mentions: tuple[Mention, ...],
    config: FollowupConfig = _DEFAULTS,
    shared: frozenset[str] = frozenset(),
    keyword: Keyword | None = None,
    section: Section | None = None,
    sounds: SoundNames | None = None,
) -> Plan:
    """How to search this user turn, given the session so far, the turn's own ``mentions``,
    the words most of the snapshot's names share (``Gazetteer.shared``), the entity a word
    only a few chunks hold is about (``keyword``: ``keyword_of``), whether an entity's page
    has a section of a name (``section``: ``section_of``) and the names the turn's words sound
    like (``sounds``: ``Gazetteer.sounds``, ``heard``).

    Records nothing (an interim transcript may be planned and dropped): ``remember`` does, once
    the engine records the turn.
    """
    planned = _plan(session, utterance, mentions, config, shared, keyword, section)
    planned = _by_length(planned, utterance)
    if sounds is None or not config.enabled:
        return planned
    return heard(planned, utterance, mentions, sounds)


def _plan(
    session: Session,
    utterance: Utterance,
    mentions: tuple[Mention, ...],
    config: FollowupConfig,
    shared: frozenset[str],
    keyword: Keyword | None,
    section: Section | None,
) -> Plan:
    """``plan`` from the gazetteer's namings alone: a sure naming's plan; else a turn that
    names its own topic searched as said (``_OWN_TOPIC``, in order); else the folding
    choice (``_folded``)."""
    text = utterance.text
    if not config.enabled:
        return Plan(text, NO_FOLLOWUP)
    sure = next((m for m in mentions if m.confidence >= MIN_CONFIDENCE), None)
    if sure is not None:
        return _sure_plan(session, utterance, sure, section)
    question = agent_question(session) if answers(utterance) else ""
    only = None if question else only_names(utterance, mentions)
    if only is not None and not _points_back(_spoken(utterance)):
        # "Tell me about rclone check.": a naming, if weak, and nothing else ("What about
        # pricing?" points back, and "Pricing, yes." answers the agent: both stay folded)
        return Plan(text, NO_FOLLOWUP, named=(only,), names=True)
    listed = _listed(session, utterance)
    if len(listed) > 1:
        return _each_plan(utterance, listed, question)
    picked = listed[0] if listed else None
    entity = picked or session.entity
    turn = _Turn(session, utterance, mentions, question, refers_back(utterance), entity, picked)
    for own_topic in _OWN_TOPIC:
        named = own_topic(turn, shared, keyword)
        if named is not None:
            return Plan(text, NO_FOLLOWUP, named=named)
    return _folded(turn, config, shared)


@dataclass(frozen=True, slots=True)
class _Turn:
    """A user turn as ``_plan`` reads it past its namings: the agent's question it answers
    ("": none), whether it refers back, and the entity it would fold (an ordinal's, else the
    tracked one)."""

    session: Session
    utterance: Utterance
    mentions: tuple[Mention, ...]
    question: str
    refers: bool
    entity: Mention | None
    picked: Mention | None = None  # the option of the agent's list it picked, if any

    @property
    def tracked(self) -> bool:
        """It answers no question and would fold the tracked entity (no option it picked)."""
        return not self.question and self.entity is self.session.entity


def _moved_on_named(
    turn: _Turn, shared: frozenset[str], keyword: Keyword | None
) -> tuple[Mention, ...] | None:
    """It names its own topic, if weakly, away from the tracked one (``_moves_on``)."""
    if turn.tracked and _moves_on(turn.entity, turn.mentions, turn.utterance):
        return turn.mentions
    return None


def _keyword_named(
    turn: _Turn, shared: frozenset[str], keyword: Keyword | None
) -> tuple[Mention, ...] | None:
    """ "What is conhost.exe?": a word only another page's chunks use (``_keyword_topic``)."""
    if not turn.tracked or keyword is None:
        return None
    own = _keyword_topic(turn.entity, turn.utterance, keyword)
    return None if own is None else (*turn.mentions, own)


def _shared_named(
    turn: _Turn, shared: frozenset[str], keyword: Keyword | None
) -> tuple[Mention, ...] | None:
    """ "Windows Terminal" as a name of its own (``says_shared``)."""
    entity = turn.entity
    if entity is None or turn.refers or turn.question:
        return None
    return turn.mentions if says_shared(turn.utterance, entity, shared, turn.mentions) else None


# A turn that names its own topic is searched as said: these checks, in order, say so (the
# names it is searched with) or not (None).
_OWN_TOPIC: tuple[
    Callable[[_Turn, frozenset[str], Keyword | None], tuple[Mention, ...] | None], ...
] = (_moved_on_named, _keyword_named, _shared_named)


def _folded(turn: _Turn, config: FollowupConfig, shared: frozenset[str]) -> Plan:
    """The folding choice for a turn that names no topic of its own: the agent's question it
    answers, the entity it refers back to (or every turn's, with ``fold = "always"``), else
    the recent exchange, but for a turn of its own (searched as said)."""
    session, utterance, mentions = turn.session, turn.utterance, turn.mentions
    text, question, refers, entity = utterance.text, turn.question, turn.refers, turn.entity
    left = entity is not None and entity is session.entity and session.left
    stale = entity is not None and entity is session.entity and session.weight < STALE_WEIGHT
    if left and not question and _elliptic_only(_spoken(utterance)):
        entity = None  # "and for teams?" after the caller moved on: it leans on the last exchange
    if stale and question:
        entity = None  # the agent's question is about what was said since
    own = config.fold != "always" or left or stale  # a turn not pointing back is its own
    if entity is not None and not (refers or question) and own:
        entity = None
    picked = turn.picked
    if question:
        # the answer's topic: the tracked entity, else what the caller asked before the question
        used = f"{entity.name}: {question}" if entity is not None else _recent(session) or question
        said = said_once(utterance)
        folded = FollowUp(used, Source.AGENT_QUESTION, 1.0)
        return Plan(f"{used} {said}", folded, prior=True, picked=picked)
    if entity is not None:
        source = Source.OPTIONS if picked is not None else Source.ENTITY
        folded = FollowUp(entity.name, source, entity.confidence)
        # a turn that refers back ("do they take reservations") has no meaning alone
        query = f"{entity.name}: {said_once(utterance)}"
        return Plan(query, folded, alone=not refers, named=mentions, picked=picked)
    if not refers and (own or names_shared(utterance, shared)):
        return Plan(text, NO_FOLLOWUP, named=mentions)  # a turn of its own is searched as said
    if not refers and asks_after_fragment(session, utterance):
        return Plan(text, NO_FOLLOWUP, named=mentions)  # a new question, not the fragment's
    recent = _recent(session)
    if recent:
        joined = FollowUp(recent, Source.RECENT_TURNS, RECENT_CONFIDENCE)
        said = said_once(utterance)
        plan = Plan(f"{recent} {said}", joined, alone=True, prior=True, named=mentions)
        return replace(plan, refers=refers)
    return Plan(text, NO_FOLLOWUP, prior=True, named=mentions)


def _by_length(plan: Plan, utterance: Utterance) -> Plan:
    """``plan``, marked ``short`` where it folds the tracked entity or the recent exchange into
    a turn that leans on them by its length alone (``SHORT_TURN`` words or fewer, none pointing
    back: "I forgot my password", "Where is my data stored?"; not "and for teams?" or "do they
    have wifi"): such a turn rarely names its own topic, yet may ask a question of its own."""
    if plan.followup.source not in (Source.ENTITY, Source.RECENT_TURNS):
        return plan
    toks = _spoken(utterance)
    if len(toks) > SHORT_TURN or _points_back(toks):
        return plan
    return replace(plan, short=True)


def heard(
    plan: Plan, utterance: Utterance, mentions: Sequence[Mention], sounds: SoundNames
) -> Plan:
    """``plan`` with the names the turn's words sound like (``SoundNames.find``: "goal drive"
    of "Google Drive"), where the gazetteer found no confident naming: among the weak namings
    the turn's own search may confirm (``confirmed``), so that a short turn naming a page
    misheard is answered as said, if its own top results are all that page's, instead of being
    folded with the page before; and a turn that says nothing but a name heard so ("tell me
    about smb saves"), answering no question of the agent's and pointing back at nothing, is
    searched as said with it as its topic, as a weak name said alone is (``only_names``).
    Otherwise a name heard is no naming."""
    if plan.names or any(m.confidence >= MIN_CONFIDENCE for m in mentions):
        return plan
    found = sounds.find(utterance.named)
    if not found.runs:
        return plan  # most turns
    if plan.followup.source != Source.AGENT_QUESTION and not _points_back(_spoken(utterance)):
        only = found.only(_content)
        if only is not None:
            return Plan(utterance.text, NO_FOLLOWUP, named=(only,), names=True)
    named = {m.name for m in plan.named}
    new = tuple(m for m in found.mentions() if m.name not in named)
    return replace(plan, named=(*plan.named, *new)) if new else plan


def _sure_plan(
    session: Session, utterance: Utterance, sure: Mention, section: Section | None
) -> Plan:
    """A turn that names an entity confidently is searched as said, unless it asks about a
    section of the tracked entity's page (``_section_asked``): then it is folded with it."""
    tracked = session.entity
    if tracked is None or not _section_asked(tracked, sure, utterance, section):
        return Plan(utterance.text, NO_FOLLOWUP)
    folded = FollowUp(tracked.name, Source.ENTITY, tracked.confidence)
    return Plan(f"{tracked.name}: {said_once(utterance)}", folded, refers=True)


def _section_asked(
    tracked: Mention, sure: Mention, utterance: Utterance, section: Section | None
) -> bool:
    """Whether a turn naming ``sure`` asks about a section of the ``tracked`` entity's page of
    that name: it points back ("what about command line arguments for it") and a heading of
    the tracked page holds the words of the name the tracked one's name does not ("Command
    line arguments" in "Windows Terminal installation", where another page is named "Windows
    Terminal command line arguments"). A turn naming another place of a list ("what about the
    Gonville, does it have parking") names no heading of the place before."""
    if section is None or sure.name == tracked.name or not _points_back(_spoken(utterance)):
        return False
    name = set(tokens(tracked.name))
    own = [w for w in _content(tokens(sure.name)) if w not in name]
    return bool(own) and section(tracked.name, own)


def only_names(utterance: Utterance, mentions: Sequence[Mention]) -> Mention | None:
    """The weakly named entity whose name holds every content word the caller said ("Tell me
    about rclone check.", "pCloud?"; a recogniser's merged "rclonecheck" is the name's words
    run together), if any: the words then have no ordinary reading to fall back on ("the zip
    code is nine four one two two" says more than "Two Two Cafe")."""
    if not mentions:
        return None
    said = set(_content(t for t in utterance.tokens if t not in FILLERS_EN))
    if not said:
        return None
    return next((m for m in mentions if said <= _name_words(m.name)), None)


def _name_words(name: str) -> set[str]:
    """A name's words and every run of them written as one ("rclone copy": "rclone", "copy",
    "rclonecopy"), as a recogniser may merge them."""
    toks = tokens(name)
    return {"".join(toks[i:j]) for i in range(len(toks)) for j in range(i + 1, len(toks) + 1)}


def confirmed(named: Sequence[Mention], found: Sequence[str]) -> Mention | None:
    """The weakly named entity the entities of the turn's own top CONFIRM_DEPTH chunks
    (``found``, best first) all are, if any ("Tell me about pCloud." finds only pCloud's page;
    "I see one place by the park" does not find only Park Inn's)."""
    if not named or len(found) < CONFIRM_DEPTH:
        return None
    about = set(found[:CONFIRM_DEPTH])
    return next((m for m in named if about == {m.name}), None)


def confirm(session: Session, mention: Mention) -> None:
    """Track an entity the turn named and its own search confirmed, as a sure naming."""
    session.entity, session.weight, session.left = Mention(mention.name, 1.0), 1.0, False


def leave(session: Session) -> None:
    """The caller moved on from the tracked entity (a question its own words answered on other
    pages: ``sidecar.turn.engine``): it is folded only into turns that point back at it."""
    session.left = True


def _recent(session: Session) -> str:
    """The exchange this turn follows, for a turn that names nothing and follows no named
    entity: the caller's previous turn with content (not "Ok.") and everything said after it,
    oldest first, less the turns the skip policy passed over ("ok great thanks": no content,
    and folded in, its words lead the search astray)."""
    said: list[str] = []
    for turn in _unskipped(session):
        said.append(turn.text.strip())
        if turn.speaker != Speaker.AGENT and _has_content(turn):
            break
    return " ".join(" ".join(reversed(said)).split()[-MAX_FOLDED_WORDS:])


def asks_after_fragment(session: Session, utterance: Utterance) -> bool:
    """Whether a turn asks a question after a fragment of the caller's that leaned on the
    caller's own turn before it ("How do I change the font?" / "and the size?": the
    fragment ``refers_back``), nothing said by the agent since: the exchange ``_recent`` would
    fold in is the fragment alone, its words without the topic they leaned on, and a
    question put in full ("How do I split the window into panes?") asks anew. A fragment
    after an agent's turn (an answer to its question) is left folded in, as measured."""
    if not asks(utterance):
        return False
    turns = _unskipped(session)
    for turn in turns:
        if turn.speaker == Speaker.AGENT:
            return False
        if _has_content(turn):
            before = next(turns, None)
            if before is None or before.speaker == Speaker.AGENT:
                return False
            return refers_back(Utterance.of(turn.text))
    return False


def _has_content(turn: Said) -> bool:
    """Whether a turn says more than function words and reply words ("Ok.", "yes please"):
    the caller's previous turn with content is what ``_recent`` folds from and
    ``asks_after_fragment`` reads. Its words as said, fillers too: without them (``_spoken``)
    doc2dial's session hit@3 fell 0.5933 -> 0.5922."""
    return bool(_content(words(turn.text)))


def _unskipped(session: Session) -> Iterator[Said]:
    """The session's turns the skip policy did not pass over, newest first."""
    return (turn for turn in reversed(session.turns) if not turn.skipped)


def rewrite(
    session: Session, text: str, gazetteer: Gazetteer = _EMPTY, config: FollowupConfig = _DEFAULTS
) -> str:
    """The query ``plan`` would search for this user turn (the text only; records nothing)."""
    utterance = Utterance.of(text)
    mentions = gazetteer.find(utterance.named)
    return plan(
        session, utterance, mentions, config, gazetteer.shared, sounds=gazetteer.sounds
    ).query


def record(session: Session, speaker: str, text: str, gazetteer: Gazetteer = _EMPTY) -> None:
    """Record a turn with the entities it names and track them, as the engine does."""
    remember(
        session, session.record_turn(speaker, text, gazetteer.find(named_tokens(tokens(text))))
    )


def _listed(session: Session, utterance: Utterance) -> tuple[Mention, ...]:
    """The options of the agent's last list the turn is about: the one it picks by position
    ("the second one", ``ORDINALS_EN``) or as the one not being talked about ("what about the
    other one"), or those it asks about together ("which of them has parking", "do either of
    them", "is one better than the other": ``_over_list``; "do they take reservations" said
    right after the list: ``PLURAL_EN``); none when there is no list."""
    options = session.options
    if len(options) < 2:
        return ()
    toks = _spoken(utterance)
    index = _position(toks)
    if index is not None and index < len(options):
        return (Mention(options[index].name, 1.0),)
    other = _the_other(toks)
    if other == "than" or _over_list(toks):
        return options
    if not PLURAL_EN.isdisjoint(toks) and _just_listed(session):
        return options
    if other is None or session.entity is None:
        return ()
    rest = tuple(m for m in options if m.name != session.entity.name)
    if len(rest) == len(options):  # the one talked about is not on the list: no "other"
        return ()
    return rest if len(rest) > 1 else (Mention(rest[0].name, 1.0),)


def _position(toks: Sequence[str]) -> int | None:
    """The position in a list an ordinal said after "the" or before "one" names ("the second",
    "second one", "the latter"; ``ORDINALS_EN``), if any: "could you first confirm" and "at
    last" name none."""
    for i, tok in enumerate(toks):
        index = ORDINALS_EN.get(tok)
        if index is None:
            continue
        after = toks[i + 1] if i + 1 < len(toks) else ""
        if (i > 0 and toks[i - 1] == "the") or after in OF_SET_EN:
            return index
    return None


def _just_listed(session: Session) -> bool:
    """Whether the turn before this one is the agent's, naming several of its options (the
    list it just gave)."""
    if not session.turns or session.turns[-1].speaker != Speaker.AGENT:
        return False
    options = {m.name for m in session.options}
    named = {m.name for m in session.turns[-1].mentions if m.confidence >= MIN_CONFIDENCE}
    return len(named & options) > 1


def _the_other(toks: Sequence[str]) -> str | None:
    """How a turn says "the other": "than" where it compares with it ("better than the
    other": both are asked about), "the" where it points at it ("what about the other one");
    None where it does not."""
    for i in range(1, len(toks)):
        if toks[i] == "other" and toks[i - 1] == "the":
            return "than" if i > 1 and toks[i - 2] == "than" else "the"
    return None


def _over_list(toks: Sequence[str]) -> bool:
    """Whether the words ask about every option of a list at once (``PAIR_WORDS_EN``,
    ``QUANTIFIERS_EN``): "which of them", "do either of those", "are they both", "which one";
    not "me either", "both breakfast and dinner"."""
    last = len(toks) - 1
    for i, tok in enumerate(toks):
        if tok in QUANTIFIERS_EN and i < last and toks[i + 1] in OF_SET_EN:
            return True
        coordinates = tok == "both" and "and" in toks[i + 1 : i + 2 + COORDINATION_WORDS]
        if tok in PAIR_WORDS_EN and i < last and not coordinates:
            return True
    return False


def _each_plan(utterance: Utterance, listed: Sequence[Mention], question: str) -> Plan:
    """A turn asking about several options of the agent's list at once: each one's chunks are
    ranked by the turn's words (with the agent's question it answers, "Yes, both."), embedded
    once, and the best of each answers; as sure as the least sure naming of the list."""
    names = tuple(m.name for m in listed)
    asked = f"{question} {said_once(utterance)}" if question else said_once(utterance)
    used = " | ".join(names)
    sure = min(m.confidence for m in listed)
    return Plan(f"{used}: {asked}", FollowUp(used, Source.OPTIONS, sure), each=names, asked=asked)


def track_pick(session: Session, plan: Plan) -> None:
    """Track the option a just-recorded turn picked from the agent's list ("the second one"):
    the caller chose it, so it is the caller's sure naming ("do they take reservations" next
    asks about it)."""
    if plan.picked is not None:
        session.entity, session.weight, session.left = plan.picked, 1.0, False


def remember(session: Session, said: Said) -> None:
    """Track the entity a just-recorded turn names: the agent's naming outweighs the caller's
    passing mention, a confident naming outweighs a doubtful one, and older namings fade. An
    agent's turn naming several confidently lists options; a turn naming one outside the list
    leaves it."""
    session.weight *= FADE
    sure = [m for m in said.mentions if m.confidence >= MIN_CONFIDENCE]
    if not sure:
        return
    _keep_options(session, said.speaker, sure)
    best = sure[0]  # "Gonville or the Lensfield?": the first named retrieved best on DSTC11
    weight = best.confidence * (AGENT_WEIGHT if said.speaker == Speaker.AGENT else 1.0)
    if weight >= session.weight or session.left:
        session.entity, session.weight, session.left = best, weight, False


def _keep_options(session: Session, speaker: str, sure: Sequence[Mention]) -> None:
    """The agent's list of options after a turn naming ``sure`` confidently: an agent's turn
    naming several is a new list; a turn naming one on the list keeps it (the agent telling
    about one of them), one naming another leaves it."""
    named = dict.fromkeys(m.name for m in sure)
    if speaker == Speaker.AGENT and len(named) > 1:
        first = {m.name: m for m in reversed(sure)}  # each name as its first naming rated it
        session.options = tuple(first[name] for name in named)
    elif not named.keys() <= {m.name for m in session.options}:
        session.options = ()


def _keyword_topic(
    tracked: Mention | None, utterance: Utterance, keyword: Keyword
) -> Mention | None:
    """The entity a turn that points back at nothing names by a word of its own that only that
    entity's chunks hold (``keyword``: a file name, a command), if it is not the ``tracked``
    one; a weak naming, confirmed only by the turn's own search (``confirmed``)."""
    if tracked is None:
        return None
    written = _written_as_code(utterance.text) or _said_as_file_name(utterance.words)
    if not written or _points_back(_spoken(utterance)):
        return None  # most turns: no word written as code, and the words are not read again
    name = set(tokens(tracked.name))
    for word in dict.fromkeys(written):  # a word said many times is looked up once
        if word in name:
            continue
        entity = keyword(word)
        if entity and entity != tracked.name:
            return Mention(entity, WEAK_CONFIDENCE)
    return None


def _written_as_code(text: str) -> list[str]:
    """The content words of the turn's tokens written as no ordinary word is: a file name or
    path ("conhost.exe", "settings.json"), letters and digits mixed ("SF86", "md5"), a small
    letter before a capital ("PSReadLine", "pCloud"). Ordinary words a base happens to use
    rarely ("characteristics") are not names of anything; a transcript has none of these."""
    if not _CODE_SHAPED.search(text):
        return []  # most turns: one scan of the text
    return [
        word
        for written in _WRITTEN.findall(text)
        if _looks_like_code(written)
        for word in _content(tokens(written))
        if len(word) > 1  # "e.g.": the letters of an abbreviation
    ]


def _said_as_file_name(said: Sequence[str]) -> list[str]:
    """The content words of a file name said aloud, as a transcript writes it: words joined by
    "dot" ("conhost dot exe", "settings dot json"), the spoken form of ``_written_as_code``'s
    "conhost.exe" (a transcript has no other way to write one). A number said with its point
    ("four point five") is not one."""
    return [
        word
        for i in range(1, len(said) - 1)
        if said[i] == SPOKEN_DOT_EN
        for word in _content((said[i - 1], said[i + 1]))
        if len(word) > 1
    ]


_PATH = re.compile(r"\w[./]\w")  # "conhost.exe", "bin/rclone"
_DIGIT = re.compile(r"\d")
_LETTER = re.compile(r"[^\W\d_]")
_CAMEL = re.compile(r"[a-z][A-Z]")  # "PSReadLine", "pCloud"; not "Hotel", "VA"
_CODE_SHAPED = re.compile(r"\w[./]\w|\d|[a-z][A-Z]")  # any of the three, anywhere
# a word and its dots and slashes, linear: "[\w./]*\w" backtracked over a run of slashes at
# every start (a 4,000-character turn of them held the event loop half a second)
_WRITTEN = re.compile(r"\w+(?:[./]+\w+)*")


def _looks_like_code(written: str) -> bool:
    """Whether a written word is a file name or path, mixes letters and digits, or has a small
    letter before a capital (``_written_as_code``)."""
    if _PATH.search(written) or _CAMEL.search(written):
        return True
    return bool(_DIGIT.search(written)) and bool(_LETTER.search(written))


def says_shared(
    utterance: Utterance, entity: Mention, shared: frozenset[str], mentions: Sequence[Mention]
) -> bool:
    """Whether the turn says the tracked name's ``shared`` words (those most of the base's names
    hold) as a name, after no determiner, and does not name the tracked entity itself (its
    ``mentions``) ("what shells does Windows Terminal support" while "Windows Terminal Actions"
    is tracked, in a base where most titles start "Windows Terminal"; not "does the hotel have
    parking"): it then names its own topic, and what the tracked name adds ("Actions") is not
    what it asks about. A word the tracked name shares with other names ("profile" of "Windows
    Terminal Appearance Profile Settings", beside "... General Profile Settings") names none of
    them: the gazetteer matches no name by it."""
    name = set(tokens(entity.name))  # "the bed and breakfast": one run of the name's words
    if not name & shared or any(m.name == entity.name for m in mentions):
        return False
    return _said_as_name(utterance.tokens, name & shared, name)


def names_shared(utterance: Utterance, shared: frozenset[str]) -> bool:
    """Whether a turn says the words most of the base's names hold (``shared``) as a name,
    after no determiner ("Rclone gives ...", "... initialize a Windows Terminal profile ...";
    not "the terminal"), where no entity is tracked: the product or series every page is about,
    named, marks a question put in full, not one leaning on the exchange before it."""
    return bool(shared) and _said_as_name(utterance.tokens, shared, shared)


def _said_as_name(toks: Sequence[str], said: AbstractSet[str], run: AbstractSet[str]) -> bool:
    """Whether a word of ``said`` starts a run of ``run``'s words in ``toks`` with no
    determiner before it ("a" and "an" are none: they bring in something new)."""
    return any(
        tok in said and (i == 0 or (toks[i - 1] not in run and toks[i - 1] not in DETERMINERS_EN))
        for i, tok in enumerate(toks)
    )


def _moves_on(tracked: Mention | None, mentions: Sequence[Mention], utterance: Utterance) -> bool:
    """Whether a caller's turn leaves the ``tracked`` entity behind: it names others, if only
    weakly ("Tell me about Swift.", where the overview pages also say "Swift"), and points back
    at nothing. It is then not folded with the tracked entity, which stays tracked (the weak
    name may be ordinary words: "the zip code is nine four one two two" and "Two Two Cafe")."""
    if tracked is None or not mentions or any(m.name == tracked.name for m in mentions):
        return False
    return not _points_back(_spoken(utterance))
