"""The spoken set's misses by class, from a ``quality_conversations --per-turn`` dump.

    .venv/bin/python -m bench.spoken_misses RESULTS.json [--spoken SPEC] [--data ../shared/data]
                                            [--examples N]

``SPEC`` is the ``--spoken`` the dump was measured with (the set is drawn again to read each
judged turn's history). A judged turn the session missed (no relevant chunk in its top 3) is:

* **gold top-1, chunk missed**: the session's top-1 chunk is the gold entity's, its top 3 hold
  none of the relevant ones (the turn's own words, heard wrong, pick the wrong part of the page);
* **gold named as heard, lost**: the gold name is said whole, as written, in the turn or the
  turns before it (by the caller, the agent or both), and the session searched another entity;
* **gold never heard whole**: no turn so far says the gold name as written (misheard, split,
  run into a word, or never said: "the second one");

each split by whether the ceiling (the gold name prefixed to the turn) hit. The classes use the
gold name (``ConversationSet.gold``), which the session never sees: they say where the session
loses, not how it could know.
"""

from __future__ import annotations

import argparse
import json
import random
import re
from collections import Counter
from pathlib import Path
from typing import Any

from bench.conversations import ConversationSet, Dialogue
from bench.quality_conversations import DEFAULT_DATA, DIALOGUE_SETS, redraw_spoken
from sidecar.turn.engine import Speaker

SET = "dstc11-spoken"


def _plain(text: str) -> str:
    return " ".join(re.sub(r"[^a-z0-9 ]", " ", text.lower().replace("'", "")).split())


def miss_class(d: Dialogue, i: int, gold: str, row: dict[str, Any]) -> str:
    """The class of the missed judged turn ``d.turns[i]`` (the module docstring)."""
    name = _plain(gold)
    said = d.turns[: i + 1]
    by = [
        who
        for who, speaker in (("caller", Speaker.USER), ("agent", Speaker.AGENT))
        if any(name in _plain(t.text) for t in said if t.speaker == speaker)
    ]
    if row["top1_about"] == gold:
        kind = "gold top-1, chunk missed"
    elif by:
        kind = f"gold named as heard ({'+'.join(by)}), lost"
    else:
        kind = "gold never heard whole"
    ceiling = next(m for m in row["hit_at_3"] if m.startswith("gold_"))  # the set's ceiling
    return f"{kind}; ceiling {'hit' if row['hit_at_3'][ceiling] else 'missed'}"


def classify(cs: ConversationSet, rows: dict[str, dict[str, Any]]) -> dict[str, list[str]]:
    """Each class's missed qids."""
    out: dict[str, list[str]] = {}
    for d in cs.dialogues:
        for i, t in enumerate(d.turns):
            row = rows.get(t.qid) if t.qid else None
            if row is not None and not row["hit_at_3"]["session"]:
                out.setdefault(miss_class(d, i, cs.gold[t.qid], row), []).append(t.qid)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("results", type=Path, help="quality_conversations.json with --per-turn")
    parser.add_argument("--spoken", help="the --spoken the dump was measured with")
    parser.add_argument("--data", type=Path, default=DEFAULT_DATA)
    parser.add_argument("--examples", type=int, default=3, help="examples shown per class")
    args = parser.parse_args(argv)
    if args.spoken:
        redraw_spoken(args.spoken)
    cs = DIALOGUE_SETS[SET](args.data, False, False)
    dump = json.loads(args.results.read_text())["sets"][SET]["per_turn"]
    rows = {r["qid"]: r for r in dump}
    classes = classify(cs, rows)
    counts = Counter({kind: len(qids) for kind, qids in classes.items()})
    print(f"{len(rows)} judged turns, {sum(counts.values())} missed")
    draw = random.Random(0)
    for kind, n in counts.most_common():
        print(f"{n:5d}  {kind}")
        for qid in draw.sample(classes[kind], min(args.examples, n)):
            row = rows[qid]
            print(f"         gold {cs.gold[qid]!r}, top-1 {row['top1_about']!r}: {row['turn']!r}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
