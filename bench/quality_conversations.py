"""Follow-ups on every kind of conversation: hit@3 and MRR@10 of judged user turns, per set.

    .venv/bin/python -m bench.quality_conversations [--quick] [--sets dstc11,doc2dial,...]
                                        [--per-turn] [--data ../shared/data] [--out DIR]
                                        [--no-vector-cache] [--spoken SEED[,NAME_ERR[,FILLER]]]
                                        [--min-score MIN_SCORE] [--fold always|referring]
                                        [--spoken voxrecall-asr-N[,RARE_ERROR[,both|caller]]]

Every dialogue is driven turn by turn through the real ``sidecar.turn.engine.Engine`` in-process
(one session per dialogue; user turns as ``Speaker.USER``, agent turns as ``Speaker.AGENT``, in
the order they were said; a budget so large that the embedder never misses it). A judged user
turn is scored on the engine's answer to that Turn (``session``), and beside it, through the same
engine's Search and so measured the same way:

* ``last_turn``: the judged turn alone;
* ``joined3``: the last three turns (user and agent alike) joined with spaces;
* the set's ceiling: the gold entity or page title prefixed ("gold: turn"), never an input to
  the session;
* ``best_naive = max(last_turn, joined3)`` and ``session - best_naive``.

Each figure is also given for the judged turns right after an agent question (the agent's
previous turn ends with "?"), where the content is often in that question, and on a set that
switches (``-switch``) for the caller's first judged turn of each conversation after the other
(``first_after_switch``; ``switch_*`` in the table): the turn that must not be read as a
follow-up. ``gold_top1``: how
often the session's top-1 chunk is about the gold entity or page (its contextual prefix), and
the session's hit@3 then. The sets are in ``bench.conversations`` (``dstc11``, ``doc2dial``, and
each after another dialogue of its own set, ``dstc11-switch`` and ``doc2dial-switch``),
``bench.spoken`` (``dstc11-spoken``; ``--spoken voxrecall-asr-N`` draws it through
``bench.asr``'s second recogniser instead, both sides of a call heard) and ``bench.topics`` (``topics``: stand-alone questions and
follow-ups in one session; ``topics-2``: another draw of them; ``topics-spoken``: that draw said
aloud; ``topics-spoken-2``: a third draw, said aloud); ``cast`` is ``bench.quality_turns``' TREC CAsT rewrite closeness,
reported beside them.

As a library, with a variant of the engine and no snapshot rebuilt (each set's snapshot is
cached under ``bench/.cache/`` by the hash of what shapes it)::

    from bench.quality_conversations import measure
    result = asyncio.run(measure(data_dir, sets=("doc2dial",),
                                 sidecar={"followups": {"fold": "referring"}}))

From the command line the query vectors are kept between runs (``bench.vector_cache``), so a
second run embeds only the queries an engine change made new.

``sidecar`` is merged into the ``[sidecar]`` table of the evaluation config (so it is validated
as a user's would be); ``serve`` replaces how an ``Engine`` is made from that config.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import platform
import sys
import time
from collections.abc import AsyncIterator, Callable, Iterator, Sequence
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench import asr, conversations, quality_turns, spoken, topics
from bench.conversations import ConversationSet, Dialogue
from bench.quality_turns import EVAL_BUDGET_MS, EVAL_DEPTH, Ranking, eval_config
from bench.vector_cache import CachedEmbedder
from index.embedders.base import Embedder
from sidecar.config import Config
from sidecar.turn.engine import MAX_TEXT_CHARS, Engine, SearchInput, Speaker, TurnInput, TurnResult
from sidecar.turn.skip import Skip

ROOT = Path(__file__).resolve().parent
RESULTS = ROOT / "results" / "quality_conversations.json"
DEFAULT_DATA = quality_turns.DEFAULT_DATA
JOINED = 3  # turns joined for the joined3 baseline, the judged one included
EXAMPLES = 6  # judged turns per set kept in the JSON to read the session's queries by eye
BASELINES = ("last_turn", "joined3")

Serve = Callable[[Config, Embedder], AbstractAsyncContextManager[Engine]]


@asynccontextmanager
async def served(config: Config, embedder: Embedder) -> AsyncIterator[Engine]:
    """The engine of a real sidecar built from ``config`` (``create_server``, port 0)."""
    from sidecar.edge.server import create_server

    sidecar = await create_server(config, embedder=embedder, poll=False)
    try:
        yield sidecar.engine
    finally:
        await sidecar.stop(0.5)


# -- scoring ------------------------------------------------------------------------------------


class Scores:
    """The rankings of one bucket of judged turns: the session, the baselines, the ceiling."""

    def __init__(self, ceiling: str) -> None:
        self.ceiling = ceiling
        self.modes = {name: Ranking() for name in ("session", *BASELINES, ceiling)}
        self.skipped = 0
        self.degraded = 0
        self.empty = 0  # searched, and nothing at or above min_score: an honest nothing or a miss
        self.gold_top1 = 0  # the session's top-1 chunk is about the gold entity or page
        self.gold_top1_hits = 0  # ... and the session's top 3 hold a relevant chunk

    def as_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {name: r.as_dict() for name, r in self.modes.items()}
        n = self.modes["session"].n
        out["session"] |= {
            "skipped": self.skipped,
            "degraded": self.degraded,
            "empty": self.empty,
            "gold_top1": round(self.gold_top1 / n, 4) if n else None,
            "hit_at_3_when_gold_top1": (
                round(self.gold_top1_hits / self.gold_top1, 4) if self.gold_top1 else None
            ),
        }
        if not self.modes["session"].n:
            return out
        best = max(BASELINES, key=lambda m: (out[m]["hit_at_3"], out[m]["mrr_at_10"]))
        out["best_naive"] = {"mode": best, **out[best]}
        out["session_minus_best_naive"] = {
            k: round(out["session"][k] - out[best][k], 4) for k in ("hit_at_3", "mrr_at_10")
        }
        return out


def _paths(hits: Sequence[Any]) -> list[str]:
    return [h.chunk.source_path for h in hits]


def about(hits: Sequence[Any]) -> str:
    """What the top chunk is about: its contextual prefix (a DSTC11 snippet's entity, a doc2dial
    section's page title), as the sets' gold names are written."""
    if not hits:
        return ""
    prefix, _, _ = hits[0].chunk.embed_text.partition("\n\n")
    return prefix


def joined(turns: Sequence[conversations.Said], i: int) -> str:
    """The last ``JOINED`` turns up to ``i`` joined, cut at the front to what a query may hold."""
    text = " ".join(t.text for t in turns[max(0, i - JOINED + 1) : i + 1])
    return text[-MAX_TEXT_CHARS:]


class Runner:
    """Drives a set's dialogues through one engine and scores the judged turns."""

    def __init__(self, cs: ConversationSet, engine: Engine, per_turn: bool = False) -> None:
        self.cs = cs
        self.engine = engine
        self.per_turn: list[dict[str, Any]] | None = [] if per_turn else None
        self.all = Scores(cs.ceiling)
        self.after_question = Scores(cs.ceiling)
        self.after_switch = Scores(cs.ceiling)
        self.examples: list[dict[str, Any]] = []

    async def search(self, query: str) -> list[str]:
        if not query.strip():
            return []
        result = await self.engine.search(
            SearchInput(query=query, knowledge_base=self.cs.knowledge_base, limit=EVAL_DEPTH)
        )
        return _paths(result.hits)

    async def dialogue(self, d: Dialogue) -> None:
        sid = f"{self.cs.name}-{d.dialogue_id}"
        for i, said in enumerate(d.turns):
            result = await self.engine.turn(
                TurnInput(
                    session_id=sid,
                    text=said.text[:MAX_TEXT_CHARS],
                    knowledge_base=self.cs.knowledge_base,
                    speaker=said.speaker,
                    budget_ms=EVAL_BUDGET_MS,
                )
            )
            if said.qid and said.speaker == Speaker.USER:
                await self.judged(d, i, result)
        self.engine.end_session(sid)

    async def judged(self, d: Dialogue, i: int, result: TurnResult) -> None:
        said = d.turns[i]
        ranked = {"session": _paths(result.hits)} | await self.baselines(d, i)
        buckets = [self.all]
        if conversations.after_agent_question(d.turns, i):
            buckets.append(self.after_question)
        if conversations.first_after_switch(d, i):
            buckets.append(self.after_switch)
        relevant = set(self.cs.qrels[said.qid])
        on_gold = about(result.hits) == self.cs.gold[said.qid]
        for bucket in buckets:
            for mode, paths in ranked.items():
                bucket.modes[mode].add(paths, relevant)
            bucket.skipped += result.skipped is not Skip.NOT_SKIPPED
            bucket.degraded += result.degraded
            bucket.empty += result.skipped is Skip.NOT_SKIPPED and not result.hits
            bucket.gold_top1 += on_gold
            bucket.gold_top1_hits += on_gold and any(p in relevant for p in ranked["session"][:3])
        if self.per_turn is not None:
            hits = {m: any(p in relevant for p in paths[:3]) for m, paths in ranked.items()}
            followup = {"source": result.followup.source, "confidence": result.followup.confidence}
            self.per_turn.append({"qid": said.qid, "turn": said.text, "query": result.query,
                                  "top1_about": about(result.hits), "hit_at_3": hits,
                                  "followup": followup})  # fmt: skip
        if len(self.examples) < EXAMPLES and result.query != said.text:
            self.examples.append({"turn": said.text, "query": result.query})

    async def baselines(self, d: Dialogue, i: int) -> dict[str, list[str]]:
        said = d.turns[i]
        return {
            "last_turn": await self.search(said.text),
            "joined3": await self.search(joined(d.turns, i)),
            self.cs.ceiling: await self.search(f"{self.cs.gold[said.qid]}: {said.text}"),
        }

    def as_dict(self) -> dict[str, Any]:
        return {
            **self.all.as_dict(),
            "after_agent_question": self.after_question.as_dict(),
            **self._switch(),
            "dialogues": len(self.cs.dialogues),
            "base": self.cs.notes,
            "examples": self.examples,
            **({"per_turn": self.per_turn} if self.per_turn is not None else {}),
        }

    def _switch(self) -> dict[str, Any]:
        """The caller's first judged turn of each conversation after another, on a set that
        switches (``conversations.switched``)."""
        if not any(d.opens for d in self.cs.dialogues):
            return {}
        return {"first_after_switch": self.after_switch.as_dict()}


async def score_set(cs: ConversationSet, engine: Engine, per_turn: bool = False) -> dict[str, Any]:
    """Every dialogue of ``cs`` through ``engine``: the figures of the module docstring, and with
    ``per_turn`` each judged turn's query, top-1 entity and hits (to diff two engines by)."""
    runner = Runner(cs, engine, per_turn)
    for d in cs.dialogues:
        await runner.dialogue(d)
    return runner.as_dict()


# -- the sets -----------------------------------------------------------------------------------


def dstc11_spoken(data_dir: Path, quick: bool, tiny: bool = False) -> ConversationSet:
    return spoken.spoken(conversations.dstc11(data_dir, quick, tiny))


def dstc11_recognised(data_dir: Path, quick: bool, tiny: bool = False) -> ConversationSet:
    return asr.recognised(conversations.dstc11(data_dir, quick, tiny))


def redraw_spoken(spec: str) -> None:
    """``--spoken``: a seed under ``asr.PREFIX`` measures ``dstc11-spoken`` through the second
    recogniser (``bench.asr``, both sides of a call); any other is ``bench.spoken``'s redraw."""
    if spec.startswith(asr.PREFIX):
        asr.redraw(spec)
        DIALOGUE_SETS["dstc11-spoken"] = dstc11_recognised
    else:
        spoken.redraw(spec)


DIALOGUE_SETS: dict[str, Callable[[Path, bool, bool], ConversationSet]] = {
    "dstc11": conversations.dstc11,
    "dstc11-spoken": dstc11_spoken,
    "doc2dial": conversations.doc2dial,
    "dstc11-switch": conversations.dstc11_switch,
    "doc2dial-switch": conversations.doc2dial_switch,
}
TOPIC_DRAWS = {
    "topics": topics.WRITTEN,
    "topics-2": topics.SECOND,
    "topics-spoken": topics.SPOKEN,
    "topics-spoken-2": topics.SPOKEN_2,
}
SETS = (*DIALOGUE_SETS, *TOPIC_DRAWS, "cast")


@dataclass(frozen=True, slots=True)
class Options:
    """How ``measure`` runs each set (its keyword arguments, less the embedder)."""

    quick: bool = False
    tiny: bool = False
    sidecar: dict[str, Any] | None = None
    serve: Serve = served
    per_turn: bool = False


async def measure(
    data_dir: Path,
    *,
    sets: Sequence[str] = SETS,
    quick: bool = False,
    sidecar: dict[str, Any] | None = None,
    serve: Serve = served,
    embedder: Embedder | None = None,
    per_turn: bool = False,
    tiny: bool = False,
) -> dict[str, Any]:
    """Every figure of ``sets`` as a dict (``{"sets": {NAME: ...}, "table": {NAME: ...}}``).

    ``per_turn`` adds each judged turn's query, top-1 entity and hits to the dialogue sets;
    ``tiny`` is the smoke test's: a dozen judged turns a set over bases cut to them.
    """
    unknown = [s for s in sets if s not in SETS]
    if unknown:
        raise ValueError(f"unknown conversation sets {unknown}; known: {', '.join(SETS)}")
    options = Options(quick or tiny, tiny, sidecar, serve, per_turn)
    own_embedder = embedder is None
    if embedder is None:
        from index.embedders.local import LocalEmbedder

        embedder = LocalEmbedder()
    out: dict[str, Any] = {}
    try:
        for name in sets:
            started = time.perf_counter()
            out[name] = await _one_set(name, data_dir, options, embedder)
            out[name]["seconds"] = round(time.perf_counter() - started, 1)
            for row_name, row in _rows({name: out[name]}):
                print(f"{row_name}: {json.dumps(row)}", flush=True)
    finally:
        if own_embedder:
            await embedder.aclose()
    return {"sets": out, "table": dict(_rows(out))}


async def _one_set(name: str, data_dir: Path, options: Options, embedder: Embedder) -> Any:
    if name == "cast":
        path = data_dir / "followups-trec-cast" / "followup_turns.jsonl"
        return await asyncio.to_thread(quality_turns.cast_quality, path, embedder, options.quick)
    if name in TOPIC_DRAWS:
        return await _topics(data_dir, options, embedder, TOPIC_DRAWS[name])
    cs = DIALOGUE_SETS[name](data_dir, options.quick, options.tiny)
    store_dir = await asyncio.to_thread(cs.store, embedder)
    async with options.serve(eval_config(store_dir, options.sidecar), embedder) as engine:
        return await score_set(cs, engine, options.per_turn)


async def _topics(
    data_dir: Path, options: Options, embedder: Embedder, draw: topics.Draw
) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for base in topics.QUICK_BASES if options.quick else tuple(topics.BASES):
        folder = data_dir / topics.BASES[base]
        store_dir = await asyncio.to_thread(topics.docs_store, base, folder / "docs", embedder)
        async with options.serve(eval_config(store_dir, options.sidecar), embedder) as engine:
            out[base] = await topics.topic_quality(base, folder, engine, draw, options.per_turn)
    return out


def summary_row(result: dict[str, Any]) -> dict[str, Any]:
    """One line of the table: hit@3 of each mode, the gain over the best naive baseline."""
    if "session" not in result or "best_naive" not in result:
        return {k: v for k, v in result.items() if not isinstance(v, dict | list)}
    ceiling = next(k for k in result if k.startswith("gold_"))
    after = result["after_agent_question"]
    return {
        "session": result["session"]["hit_at_3"],
        "last_turn": result["last_turn"]["hit_at_3"],
        "joined3": result["joined3"]["hit_at_3"],
        "best_naive": result["best_naive"]["hit_at_3"],
        "gain": result["session_minus_best_naive"]["hit_at_3"],
        "ceiling": result[ceiling]["hit_at_3"],
        "session_mrr": result["session"]["mrr_at_10"],
        "gold_top1": result["session"].get("gold_top1"),
        "turns": result["session"]["turns"],
        "afterq_session": after["session"]["hit_at_3"],
        "afterq_best": after.get("best_naive", {}).get("hit_at_3"),
        "afterq_turns": after["session"]["turns"],
        **_switch_columns(result),
        "degraded": result["session"].get("degraded", 0),
        "empty": result["session"].get("empty", 0),
    }


def _switch_columns(result: dict[str, Any]) -> dict[str, Any]:
    """A switching set's first turns after the switch: the session's hit@3, the best naive
    baseline's, how many."""
    switch = result.get("first_after_switch")
    if switch is None:
        return {}
    return {
        "switch_session": switch["session"]["hit_at_3"],
        "switch_best": switch.get("best_naive", {}).get("hit_at_3"),
        "switch_turns": switch["session"]["turns"],
    }


def table(rows: dict[str, dict[str, Any]]) -> str:
    """The summary rows as plain-text tables: the dialogue sets (hit@3 of each mode) first, then
    each other kind of row (topics, cast) under its own header."""
    groups: dict[tuple[str, ...], list[str]] = {}
    for name, row in rows.items():
        groups.setdefault(tuple(row), []).append(name)
    blocks = []
    for cols, names in groups.items():
        title = "hit@3" if "session" in cols else names[0].split("-")[0]
        width = max(16, *(len(name) + 1 for name in names))
        lines = [f"{title:<{width}}" + "".join(f" {c:>14.14}" for c in cols)]
        for name in names:
            cells = "".join(f" {_cell(rows[name][c]):>14}" for c in cols)
            lines.append(f"{name:<{width}}" + cells)
        blocks.append("\n".join(lines))
    return "\n\n".join(blocks)


def _cell(value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:+.3f}" if value < 0 else f"{value:.3f}"
    return str(value)


def _rows(sets: dict[str, Any]) -> Iterator[tuple[str, dict[str, Any]]]:
    """The table's rows: one a dialogue set, one a topics base, one for cast."""
    for name, result in sets.items():
        if name in TOPIC_DRAWS:
            for base, row in result.items():
                if isinstance(row, dict):
                    yield f"{name}-{base}", topics_row(row)
        elif name == "cast":
            yield name, cast_row(result)
        else:
            yield name, summary_row(result)


def topics_row(result: dict[str, Any]) -> dict[str, Any]:
    """One base's line: stand-alone questions kept as asked alone, follow-ups resolved."""
    return {
        "same_top1": result["standalone_same_top1"],
        "standalone": result["standalone_turns"],
        "followup_hit3": result["followup_hit_at_3"],
        "alone_hit3": result["followup_alone_hit_at_3"],
        "joined_hit3": result["followup_joined_hit_at_3"],
        "followups": result["followups"],
        "empty": result.get("empty_turns", 0),
    }


def cast_row(result: dict[str, Any]) -> dict[str, Any]:
    """Closeness to the human rewrite; the cosine is the measure (a joined query holds more of the
    rewrite's words, and more besides), judged against the better naive baseline."""
    best_naive = max(result["raw_turn"]["cosine"], result["joined3"]["cosine"])
    return {
        "turns": result["turns"],
        "raw_recall": result["raw_turn"]["content_recall"],
        "session_recall": result["session"]["content_recall"],
        "joined3_recall": result["joined3"]["content_recall"],
        "raw_cosine": result["raw_turn"]["cosine"],
        "session_cosine": result["session"]["cosine"],
        "joined3_cosine": result["joined3"]["cosine"],
        "cosine_gain": round(result["session"]["cosine"] - best_naive, 4),
    }


# -- main ---------------------------------------------------------------------------------------


async def run(
    data_dir: Path, quick: bool, sets: Sequence[str] = SETS, **kwargs: Any
) -> dict[str, Any]:
    """``python -m bench quality``'s entry point: every set, or why none ran."""
    if not await asyncio.to_thread(data_dir.is_dir):
        print(f"conversations: skipped: shared data not present: {data_dir}")
        return {"skipped": f"shared data not present: {data_dir}"}
    started = time.perf_counter()
    result = await measure(data_dir, sets=sets, quick=quick, **kwargs)
    return {
        "quick": quick,
        "python": platform.python_version(),
        **result,
        "seconds": round(time.perf_counter() - started, 1),
    }


async def _run_cached(
    data_dir: Path,
    quick: bool,
    sets: Sequence[str],
    per_turn: bool,
    cache: bool,
    sidecar: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """``run`` with the embedded model, its query vectors kept between runs when ``cache``, and
    ``sidecar`` over the evaluation's ``[sidecar]`` (``eval_config``)."""
    from index.embedders.local import LocalEmbedder

    embedder: Embedder = LocalEmbedder()
    if cache:
        embedder = CachedEmbedder(embedder, CachedEmbedder.default_path(embedder.info))
    try:
        return await run(
            data_dir, quick, sets, per_turn=per_turn, embedder=embedder, sidecar=sidecar
        )
    finally:
        await embedder.aclose()


def _sidecar(min_score: float, fold: str) -> dict[str, Any] | None:
    """The ``[sidecar]`` keys the command line sets over the evaluation's (None: none)."""
    keys: dict[str, Any] = {"min_score": min_score} if min_score else {}
    if fold != "always":
        keys["followups"] = {"fold": fold}
    return keys or None


def _warn_degraded(rows: dict[str, dict[str, Any]]) -> None:
    """A turn that fell back (the embedder late or busy: the machine's load, not the engine)
    scores the fallback, not the follow-ups: say so, so that such a run is not compared."""
    fell = {name: row["degraded"] for name, row in rows.items() if row.get("degraded")}
    if fell:
        print(
            f"WARNING: judged turns fell back to lexical search ({fell}): this run measured "
            "the machine's load; rerun it on a quieter machine (vectors embedded now are kept)",
            file=sys.stderr,
        )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="small slices (smoke mode)")
    parser.add_argument("--sets", default=",".join(SETS), help=f"of {','.join(SETS)}")
    parser.add_argument("--data", type=Path, default=DEFAULT_DATA)
    parser.add_argument("--out", type=Path, help="folder for quality_conversations.json")
    parser.add_argument("--per-turn", action="store_true", help="every judged turn in the JSON")
    parser.add_argument(
        "--no-vector-cache",
        action="store_true",
        help="embed every query afresh (by default they are kept in bench/.cache between runs)",
    )
    parser.add_argument(
        "--spoken",
        metavar="SEED[,NAME_ERR[,FILLER]]",
        help="draw the spoken set with another seed (and name-error and filler rates); a seed "
        f"{asr.PREFIX}N draws it with the second recogniser (bench.asr)",
    )
    parser.add_argument(
        "--min-score",
        type=float,
        default=0.0,
        help="the sidecar's min_score for every set (0.0: the ranking alone, as the figures are "
        "measured; 0.3 is the production default): what a threshold costs, and which turns "
        "end with no hits ('empty')",
    )
    parser.add_argument(
        "--fold",
        choices=("always", "referring"),
        default="always",
        help="the sidecar's [sidecar.followups] fold for every set (docs/config.md: 'always', "
        "the default, or 'referring')",
    )
    args = parser.parse_args(argv)
    if args.spoken:
        redraw_spoken(args.spoken)
    sets = tuple(s for s in args.sets.split(",") if s)
    result = asyncio.run(
        _run_cached(
            args.data,
            args.quick,
            sets,
            args.per_turn,
            not args.no_vector_cache,
            _sidecar(args.min_score, args.fold),
        )
    )
    if "skipped" in result:
        return 0
    print(table(result["table"]))
    _warn_degraded(result["table"])
    path = args.out / RESULTS.name if args.out else RESULTS
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {path} in {result['seconds']} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
