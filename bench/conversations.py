"""The conversation sets of ``bench.quality_conversations``: dialogues, their judged turns, and the
written knowledge base each is asked against.

Every set is a list of dialogues, each a sequence of user and agent turns in the order they were
said; some user turns are judged (``qid``), with the chunks (by ``source_path``) that answer them
and the gold name the ceiling prefixes to the turn. One session per dialogue; every judged turn
is scored on the engine's answer to that very Turn, then the dialogue goes on.

* ``dstc11``: the DSTC11 validation dialogues (``../shared/data/dstc11-faq-reviews``). Every
  judged query there carries its own history, so each is one dialogue ending in its judged turn,
  as ``bench.quality_turns`` measures them (and with its snapshot: the same cache). Ceiling: the
  gold entity prefixed ("entity: turn").
* ``dstc11-spoken``: the same dialogues with every user turn as speech recognition would write it
  (``bench.spoken``); agent turns stay written (they are the agent's own text, given to TTS, never
  transcribed). The knowledge base is the same written one.
* ``doc2dial``: 300 typed dialogues over US government-service help pages
  (``../shared/data/doc2dial-dev``), fed whole, the 900 judged turns scored as they come. Ceiling:
  the dialogue's page title prefixed (``doc_title``: never an input to the session).
* ``doc2dial-switch`` and ``dstc11-switch`` (``switched``): the same judged turns, each dialogue
  preceded in its session by the whole of an earlier dialogue of the set about another page or
  place (unjudged): a caller who had a conversation about something else first, as a call that
  changes topic does. Neither set changes topic inside a dialogue; these do, once.

The doc2dial base: one record per section (2,026), as a docs base built from those help pages
would hold them. Each is a page titled with its ``doc_title`` whose text is the section (which
starts with its own headings), so a chunk's contextual prefix is the page title followed by the
section's headings, as a Markdown page's breadcrumbs ("Page title > heading") would give, and
the entity the follow-ups see for a chunk is the page title (``index.entities.chunk_entity``), as on a
Markdown base. The section headings (``title`` in the corpus) stay in the text rather than in a
``context`` of their own: a Markdown base's entity is its page title, not each section's path.
"""

from __future__ import annotations

import csv
import hashlib
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import orjson

from bench import quality_turns
from index.embedders.base import Embedder
from index.snapshot import FORMAT_VERSION
from index.types import Page
from sidecar.turn.engine import Speaker

DOC2DIAL = "doc2dial"
QUICK_DSTC_TURNS = 150  # judged DSTC11 turns in --quick (over quality_turns' four entities)
QUICK_DOC2DIAL_DIALOGUES = 40  # of 300: ~120 judged turns, over the full 2,026-section base
# ``tiny``: the smoke test's slices, each over a base cut to what its dialogues are about (one
# DSTC11 entity; the doc2dial dialogues' own pages), so a test embeds a hundred chunks or so
TINY_DSTC_TURNS = 12
TINY_DOC2DIAL_DIALOGUES = 4


@dataclass(frozen=True, slots=True)
class Said:
    """One turn of a dialogue; ``qid`` is set on judged user turns."""

    speaker: str  # Speaker.USER or Speaker.AGENT
    text: str
    qid: str = ""


@dataclass(frozen=True, slots=True)
class Dialogue:
    dialogue_id: str
    turns: tuple[Said, ...]
    # where its own conversation begins in ``turns``: after the one ``switched`` put before it
    opens: int = 0


@dataclass(frozen=True, slots=True)
class ConversationSet:
    """A set's dialogues, its judgments, and how to get a store holding its base."""

    name: str
    knowledge_base: str
    dialogues: list[Dialogue]
    qrels: dict[str, frozenset[str]]  # qid -> the source paths that answer it
    gold: dict[str, str]  # qid -> the name the ceiling prefixes ("gold: turn")
    ceiling: str  # what the ceiling row is called: "gold_entity" or "gold_title"
    store: Callable[[Embedder], Path]  # builds (or reads from the cache) the base's store
    notes: str = ""

    @property
    def judged(self) -> int:
        return sum(1 for d in self.dialogues for t in d.turns if t.qid)


def first_after_switch(d: Dialogue, i: int) -> bool:
    """Whether turn ``i`` is the caller's first of ``d``'s own conversation, after another
    (``switched``): the turn a session must not read as a follow-up of what came before."""
    own = d.turns[d.opens : i]
    return d.opens > 0 and i >= d.opens and all(t.speaker != Speaker.USER for t in own)


def after_agent_question(turns: tuple[Said, ...], i: int) -> bool:
    """Whether turn ``i`` comes right after an agent turn ending with a question mark."""
    if i == 0:
        return False
    before = turns[i - 1]
    return before.speaker == Speaker.AGENT and before.text.rstrip().endswith("?")


# -- DSTC11 ---------------------------------------------------------------------------------------


def dstc11(data_dir: Path, quick: bool, tiny: bool = False) -> ConversationSet:
    data = quality_turns.load_dstc(data_dir / "dstc11-faq-reviews", quick or tiny)
    if tiny:
        data = _one_entity(data)
    queries = data.queries[:QUICK_DSTC_TURNS] if quick else data.queries
    dialogues, gold = [], {}
    for q in queries:
        history = tuple(
            Said(Speaker.USER if h["speaker"] == "U" else Speaker.AGENT, str(h["text"]))
            for h in q["history"]
        )
        dialogues.append(
            Dialogue(str(q["_id"]), (*history, Said(Speaker.USER, q["text"], q["_id"])))
        )
        gold[q["_id"]] = data.gold_entity(q["_id"])
    return ConversationSet(
        name="dstc11",
        knowledge_base=quality_turns.KB,
        dialogues=dialogues,
        qrels={q["_id"]: frozenset(data.qrels[q["_id"]]) for q in queries},
        gold=gold,
        ceiling="gold_entity",
        store=lambda embedder: quality_turns.dstc_store(data, embedder),
        notes=f"{len(data.records)} snippets; one dialogue per judged query (its own history)",
    )


def _one_entity(data: quality_turns.Dstc) -> quality_turns.Dstc:
    """The most judged entity's snippets and the first judged turns about it alone."""
    judged = Counter(data.entity[d] for q in data.queries for d in data.qrels[q["_id"]])
    (keep, _), *_ = judged.most_common(1)
    queries = [q for q in data.queries if {data.entity[d] for d in data.qrels[q["_id"]]} == {keep}]
    records = [r for r in data.records if r["entity_name"] == keep]
    return quality_turns.Dstc(records, queries[:TINY_DSTC_TURNS], data.qrels, data.entity)


# -- topic switches -------------------------------------------------------------------------------


def switched(cs: ConversationSet, name: str) -> ConversationSet:
    """``cs`` with each dialogue preceded by the nearest earlier one (wrapping around) of another
    conversation about other gold entities or pages, its turns unjudged: every judged turn is
    the same, asked after a whole conversation about something else."""
    dialogues = []
    for i, dialogue in enumerate(cs.dialogues):
        j = _before(cs, i)
        before = () if j is None else tuple(Said(t.speaker, t.text) for t in cs.dialogues[j].turns)
        dialogues.append(Dialogue(dialogue.dialogue_id, (*before, *dialogue.turns), len(before)))
    return replace(
        cs, name=name, dialogues=dialogues, notes=f"{cs.notes}; each after another's dialogue"
    )


def _before(cs: ConversationSet, i: int) -> int | None:
    """The nearest dialogue before ``i`` (wrapping around) that opens otherwise (not the same
    conversation cut elsewhere, as DSTC11's judged turns of one dialogue would be) and shares
    no gold with it."""
    dialogues = cs.dialogues
    gold = {cs.gold[t.qid] for t in dialogues[i].turns if t.qid}
    for step in range(1, len(dialogues)):
        j = (i - step) % len(dialogues)
        other = dialogues[j]
        if other.turns[0].text != dialogues[i].turns[0].text and not gold & {
            cs.gold[t.qid] for t in other.turns if t.qid
        }:
            return j
    return None


def dstc11_switch(data_dir: Path, quick: bool, tiny: bool = False) -> ConversationSet:
    return switched(dstc11(data_dir, quick, tiny), "dstc11-switch")


def doc2dial_switch(data_dir: Path, quick: bool, tiny: bool = False) -> ConversationSet:
    return switched(doc2dial(data_dir, quick, tiny), "doc2dial-switch")


# -- doc2dial -------------------------------------------------------------------------------------


def doc2dial_pages(records: list[dict[str, Any]]) -> list[Page]:
    """One page per section, titled with its help page's title (see the module docstring)."""
    return [
        Page(
            source=DOC2DIAL,
            source_path=str(r["_id"]),
            title=str(r["doc_title"]),
            text=str(r["text"]),
            kind="text",
        )
        for r in records
    ]


def read_qrels(path: Path) -> dict[str, frozenset[str]]:
    qrels: dict[str, set[str]] = {}
    with path.open(newline="") as f:
        reader = csv.reader(f, delimiter="\t")
        next(reader)
        for qid, did, score in reader:
            if int(score) > 0:
                qrels.setdefault(qid, set()).add(did)
    return {q: frozenset(d) for q, d in qrels.items()}


def doc2dial(data_dir: Path, quick: bool, tiny: bool = False) -> ConversationSet:
    folder = data_dir / "doc2dial-dev"
    records = [orjson.loads(line) for line in (folder / "corpus.jsonl").read_bytes().splitlines()]
    rows = [orjson.loads(line) for line in (folder / "dialogues.jsonl").read_bytes().splitlines()]
    if quick:
        rows = rows[:QUICK_DOC2DIAL_DIALOGUES]
    if tiny:
        rows = rows[:TINY_DOC2DIAL_DIALOGUES]
        titles = {row["doc_title"] for row in rows}
        records = [r for r in records if r["doc_title"] in titles]
    pages = doc2dial_pages(records)
    digest = hashlib.sha256(f"{DOC2DIAL}\x00{FORMAT_VERSION}".encode())
    for p in pages:
        digest.update("\x00".join((p.source_path, p.title, p.text, p.kind, "\x01")).encode())
    dialogues, gold = [], {}
    for row in rows:
        turns = tuple(
            Said(
                Speaker.USER if t["speaker"] == "user" else Speaker.AGENT,
                str(t["text"]),
                str(t.get("qid", "")),
            )
            for t in row["turns"]
        )
        dialogues.append(Dialogue(str(row["dial_id"]), turns))
        gold.update({t.qid: str(row["doc_title"]) for t in turns if t.qid})
    qrels = read_qrels(folder / "qrels.tsv")

    def store(embedder: Embedder) -> Path:
        key = digest.copy()
        key.update(embedder.info.name.encode())
        return quality_turns.pages_store(DOC2DIAL, key.hexdigest(), pages, embedder)

    return ConversationSet(
        name="doc2dial",
        knowledge_base=DOC2DIAL,
        dialogues=dialogues,
        qrels={q: qrels[q] for q in gold},
        gold=gold,
        ceiling="gold_title",
        store=store,
        notes=f"{len(pages)} sections of {len({p.title for p in pages})} pages",
    )
