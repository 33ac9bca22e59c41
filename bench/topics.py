"""Topic switches: unrelated stand-alone questions and real follow-ups in one session.

Built from a real product's docs (``../shared/data/docs-rclone``, ``docs-windows-terminal``), each
its own Markdown base (``index.build.build_knowledge_base``, as a user would build it; cached
under ``bench/.cache/`` by the hash of every file of the folder, the embedder and the snapshot
format). A base's sessions mix, in a seeded order:

* **stand-alone questions**: the questions of the docs' own FAQ (``faq_questions.json``);
* **follow-up pairs**: an opener naming one page, "Tell me about {page title}.", then a follow-up
  that refers back to it with a pronoun, "What about {heading} for it?", where the heading is a
  section heading of that page which also heads a section of at least ``MIN_HEADING_PAGES`` - 1
  other pages (rclone's "Limitations", "Modification times and hashes"): asked alone it is
  ambiguous, so it is answered right only if the session knows what "it" is. One pair per page,
  for up to ``PAIRS_PER_QUESTION`` x the FAQ's questions pages, drawn with the seed among the pages
  whose title names only that page and which hold such a heading (headings with a link, code or
  markup in them, and the navigation headings of ``NAVIGATION``, are never used). The pairs are
  built from the snapshot's chunks (titles and breadcrumbs), so they depend on the chunker only,
  never on the engine measured.

Sessions are user turns only (as a typed search box or a caller who asks and listens), about
``SESSION_TURNS`` each. Reported:

* ``standalone_same_top1``: the share of stand-alone turns (FAQ questions and openers) whose top-1
  chunk inside the session is the top-1 of the same turn asked in a fresh session (goal >= 0.95);
* ``followup_hit_at_3``: the share of follow-ups whose top 3 hold a chunk of the page the opener
  named, beside the follow-up searched alone and joined with its opener (the naive baselines);
* ``opener_hit_at_3``: the same for the openers themselves (the base finds the page it names).

A second draw checks that a result does not hang on one ordering or on written questions: the
pairs and the interleaving drawn with another seed (``SECOND_SEED``), as written (``topics-2``,
``SECOND``) and with every turn said as a voice caller would say it (``topics-spoken``,
``SPOKEN``), through
``bench.spoken.Speech`` (lower case, no punctuation, numbers as words, names misheard, fillers
and restarts), a file name's dots said ("settings dot json"). Its vocabulary (which words are
names, what they sound like) is the base's chunk texts and the session's turns; each turn is
drawn with a seed of its own (``SECOND_SEED``, the base, the session, the turn's index) and a
name is heard alike through a session. A stand-alone turn is asked alone as heard in its
session, so the two are the same words. A third draw said aloud (``topics-spoken-2``,
``SPOKEN_2``: seed ``THIRD_SEED``, other pairs, another interleaving, other mishearings) judges
the goal on a fourth ordering; any other seed is as valid (``Draw(seed, spoken)``).
"""

from __future__ import annotations

import hashlib
import random
import re
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import orjson

from bench import quality_turns, spoken
from bench.quality_turns import EVAL_BUDGET_MS, EVAL_DEPTH
from index.build import build_knowledge_base
from index.embedders.base import Embedder
from index.snapshot import FORMAT_VERSION, LoadedSnapshot
from index.store import LocalStore
from sidecar.config import parse_config
from sidecar.turn.engine import Engine, SearchInput, TurnInput, TurnResult
from sidecar.turn.skip import Skip

SEED = "voxrecall-topics-1"
SECOND_SEED = "voxrecall-topics-spoken-1"  # the second draw: other pairs and order
THIRD_SEED = "voxrecall-topics-spoken-2"  # the third: other pairs and order again, said aloud
SESSION_TURNS = 10  # the docs session: ten questions
MIN_HEADING_PAGES = 2  # a follow-up's heading heads sections of at least this many pages
PAIRS_PER_QUESTION = 0.5  # follow-up pairs per FAQ question (rclone: 18 questions, 9 pairs)
MAX_HEADING_WORDS = 5
NAVIGATION = frozenset({"see also", "synopsis", "options", "parameters", "example", "examples",
                        "resources", "prerequisites", "overview", "introduction", "next steps"})  # fmt: skip
BASES = {"rclone": "docs-rclone", "terminal": "docs-windows-terminal"}
QUICK_BASES = ("terminal",)  # rclone's ~4,100 chunks take minutes to embed on two cores


@dataclass(frozen=True, slots=True)
class Asked:
    """One user turn of a topic session: a stand-alone question, an opener, or a follow-up."""

    kind: str  # "faq", "opener" or "followup"
    text: str
    page: str = ""  # opener and follow-up: the source_path of the page the opener names
    opener: str = ""  # follow-up: its opener's text


def docs_store(name: str, docs: Path, embedder: Embedder) -> Path:
    """A store holding a Markdown base of ``docs``, built once and cached by its files' hash."""
    digest = hashlib.sha256(f"{embedder.info.name}\x00{FORMAT_VERSION}".encode())
    for path in sorted(p for p in docs.rglob("*") if p.is_file()):
        digest.update(str(path.relative_to(docs)).encode() + b"\x00" + path.read_bytes())
    store_dir = quality_turns.CACHE / f"topics-{name}-{digest.hexdigest()[:16]}" / "store"
    if LocalStore(store_dir).latest(name) is not None:
        return store_dir
    source = {"name": name, "type": "markdown", "path": str(docs)}
    config = parse_config(
        {
            "knowledge_base": [{"name": name, "source": [source]}],
            "index": {"store": str(store_dir), "cache_dir": str(store_dir.parent / "cache")},
        },
        base=store_dir.parent,
    )
    summary = build_knowledge_base(config, config.knowledge_bases[0], embedder)
    print(f"  {name}: {summary.pages} pages, {summary.chunks} chunks")
    return store_dir


def faq_questions(folder: Path) -> list[str]:
    data = orjson.loads((folder / "faq_questions.json").read_bytes())
    rows = data["faq"] if isinstance(data, dict) else data
    return [str(r["question"]) for r in rows]


def _speakable(heading: str) -> bool:
    words = heading.split()
    return (
        bool(re.fullmatch(r"[A-Za-z][A-Za-z0-9 ,']*", heading))
        and 1 <= len(words) <= MAX_HEADING_WORDS
        and heading.casefold() not in NAVIGATION
    )


def followup_pairs(snapshot: LoadedSnapshot, count: int, rng: random.Random) -> list[Asked]:
    """Up to ``count`` opener + follow-up pairs from the snapshot's pages (module docstring)."""
    titles: dict[str, str] = {}
    headings: dict[str, set[str]] = defaultdict(set)  # page -> its speakable section headings
    for chunk in snapshot.chunks:
        titles[chunk.source_path] = chunk.title
        if len(chunk.breadcrumbs) > 1 and _speakable(chunk.breadcrumbs[-1]):
            headings[chunk.source_path].add(chunk.breadcrumbs[-1])
    pages_with: dict[str, set[str]] = defaultdict(set)
    for page, hs in headings.items():
        for h in hs:
            pages_with[h.casefold()].add(page)
    title_pages: dict[str, int] = defaultdict(int)
    for title in titles.values():
        title_pages[title.casefold()] += 1
    candidates = []
    for page in sorted(headings):
        shared = sorted(
            h for h in headings[page] if len(pages_with[h.casefold()]) >= MIN_HEADING_PAGES
        )
        title = titles[page]
        if shared and title and title_pages[title.casefold()] == 1:
            candidates.append((page, title, shared))
    out: list[Asked] = []
    for page, title, shared in rng.sample(candidates, min(count, len(candidates))):
        opener = f"Tell me about {title}."
        out.append(Asked("opener", opener, page))
        out.append(
            Asked("followup", f"What about {rng.choice(shared).lower()} for it?", page, opener)
        )
    return out


def sessions(
    questions: Sequence[str], pairs: Sequence[Asked], rng: random.Random
) -> list[list[Asked]]:
    """The FAQ questions and the pairs (kept together, in order) shuffled into sessions."""
    units: list[list[Asked]] = [[Asked("faq", q)] for q in questions]
    units += [list(pairs[i : i + 2]) for i in range(0, len(pairs), 2)]
    rng.shuffle(units)
    out: list[list[Asked]] = [[]]
    for unit in units:
        if len(out[-1]) + len(unit) > SESSION_TURNS and out[-1]:
            out.append([])
        out[-1].extend(unit)
    return out


@dataclass(frozen=True, slots=True)
class Draw:
    """One topic-switch set of a base: its seed, and whether the turns are said aloud."""

    seed: str = SEED
    spoken: bool = False


WRITTEN = Draw()
SECOND = Draw(SECOND_SEED)  # ``topics-2``: the second draw as written
SPOKEN = Draw(SECOND_SEED, spoken=True)  # ``topics-spoken``: the second draw said aloud
SPOKEN_2 = Draw(THIRD_SEED, spoken=True)  # ``topics-spoken-2``: a third draw, said aloud
_DOT = re.compile(r"(?<=\w)\.(?=\w)")  # "settings.json": said "settings dot json"


def said_aloud(
    runs: Sequence[Sequence[Asked]], texts: Sequence[str], seed: str, name: str
) -> list[list[Asked]]:
    """The sessions with every turn as a voice caller says it (``bench.spoken.Speech``, its
    vocabulary ``texts`` and the turns), a follow-up's opener as heard in its session."""
    said = [_DOT.sub(" dot ", a.text) for run in runs for a in run]
    speech = spoken.Speech([*texts, *said])
    out: list[list[Asked]] = []
    for s, run in enumerate(runs):
        heard: dict[str, str] = {}  # a name is heard alike through one call
        session: list[Asked] = []
        for i, asked in enumerate(run):
            rng = random.Random(f"{seed}\x00{name}\x00{s}\x00{i}")
            text = speech.transcribe(_DOT.sub(" dot ", asked.text), rng, heard)
            opener = session[-1].text if asked.kind == "followup" else ""
            session.append(Asked(asked.kind, text, asked.page, opener))
        out.append(session)
    return out


class Tally:
    def __init__(self) -> None:
        self.n = 0
        self.hits = 0

    def add(self, hit: bool) -> None:
        self.n += 1
        self.hits += hit

    def share(self) -> float | None:
        return round(self.hits / self.n, 4) if self.n else None


async def topic_quality(
    name: str, folder: Path, engine: Engine, draw: Draw = WRITTEN, per_turn: bool = False
) -> dict[str, Any]:
    """Every session of one docs base through ``engine``: the figures of the module docstring;
    with ``per_turn`` every turn (its kind, what was folded in, its top-1 in the session and
    alone) under ``per_turn``, to list the misses by."""
    snapshot = engine.snapshot(name)
    rng = random.Random(f"{draw.seed}\x00{name}")
    questions = faq_questions(folder)
    pairs = followup_pairs(snapshot, round(PAIRS_PER_QUESTION * len(questions)), rng)
    runs = sessions(questions, pairs, rng)
    if draw.spoken:
        runs = said_aloud(runs, [c.text for c in snapshot.chunks], draw.seed, name)
        pairs = [a for run in runs for a in run if a.kind != "faq"]

    async def turn(sid: str, text: str) -> TurnResult:
        return await engine.turn(
            TurnInput(session_id=sid, text=text, knowledge_base=name, budget_ms=EVAL_BUDGET_MS)
        )

    async def search(text: str) -> list[str]:
        found = await engine.search(SearchInput(query=text, knowledge_base=name, limit=EVAL_DEPTH))
        return [h.chunk.source_path for h in found.hits]

    same, same_faq, opener, followup = Tally(), Tally(), Tally(), Tally()
    alone_followup, joined_followup = Tally(), Tally()
    changed: list[dict[str, str]] = []
    turns: list[dict[str, Any]] = []
    empty = 0  # turns searched that found nothing at or above min_score
    for s, run in enumerate(runs):
        sid = f"topics-{name}-{s}"
        for i, asked in enumerate(run):
            result = await turn(sid, asked.text)
            hits = result.hits
            empty += result.skipped is Skip.NOT_SKIPPED and not hits
            turns.append(_turn_row(s, asked, result))
            if asked.kind == "followup":
                followup.add(asked.page in [h.chunk.source_path for h in hits[:3]])
                alone_followup.add(asked.page in (await search(asked.text))[:3])
                joined_followup.add(
                    asked.page in (await search(f"{asked.opener} {asked.text}"))[:3]
                )
                continue
            alone_sid = f"{sid}-alone-{i}"
            alone = (await turn(alone_sid, asked.text)).hits
            engine.end_session(alone_sid)
            top = hits[0].chunk.chunk_id if hits else ""
            same_top = top == (alone[0].chunk.chunk_id if alone else "")
            same.add(same_top)
            turns[-1] |= {"alone_top1": _where(alone), "same_top1": same_top}
            if asked.kind == "faq":
                same_faq.add(same_top)
            else:
                opener.add(asked.page in [h.chunk.source_path for h in hits[:3]])
            if not same_top and len(changed) < 6:
                changed.append({"turn": asked.text, "in_session_top1": _where(hits)})
        engine.end_session(sid)
    return {
        "standalone_same_top1": same.share(),
        "standalone_turns": same.n,
        "faq_same_top1": same_faq.share(),
        "faq_questions": same_faq.n,
        "followup_hit_at_3": followup.share(),
        "followup_alone_hit_at_3": alone_followup.share(),
        "followup_joined_hit_at_3": joined_followup.share(),
        "followups": followup.n,
        "empty_turns": empty,
        "opener_hit_at_3": opener.share(),
        "sessions": len(runs),
        "chunks": len(snapshot.chunks),
        "pairs": [
            {"opener": a.text, "followup": b.text, "page": a.page}
            for a, b in zip(pairs[::2], pairs[1::2], strict=True)
        ],
        "standalone_changed": changed,
        **({"per_turn": turns} if per_turn else {}),
    }


def _turn_row(session: int, asked: Asked, result: TurnResult) -> dict[str, Any]:
    """One turn as ``per_turn`` lists it: what it was, what was folded in, where it landed."""
    followup = result.followup
    return {
        "session": session,
        "kind": asked.kind,
        "turn": asked.text,
        "query": result.query,
        "followup": [followup.used, followup.source, followup.confidence],
        "top1": _where(result.hits),
        "degraded": result.degraded,
    }


def _where(hits: Sequence[Any]) -> str:
    if not hits:
        return ""
    chunk = hits[0].chunk
    return " > ".join(chunk.breadcrumbs) or chunk.source_path
