"""doc2dial-dev's session hit@3 on two halves of its dialogues, from a ``--per-turn`` run.

A change to the follow-ups measured on doc2dial-dev must help on dialogues it was not worked
out on: the first and last halves of the dialogues, in the order the set lists them, are
scored apart (issue 12). Read from the JSON that

    python -m bench.quality_conversations --sets doc2dial --per-turn [--out DIR]

wrote (``bench/results/quality_conversations.json`` by default):

    python -m bench.doc2dial_halves [RESULTS_JSON] [--data ../shared/data]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from bench.quality_conversations import DEFAULT_DATA, RESULTS


def halves(per_turn: list[dict[str, Any]], dialogue_ids: list[str]) -> list[dict[str, Any]]:
    """hit@3 of the session and of the baselines on each half of ``dialogue_ids`` (a judged
    turn's qid is its dialogue's id, "_", its turn's)."""
    middle = len(dialogue_ids) // 2
    half_of = {d: int(i >= middle) for i, d in enumerate(dialogue_ids)}
    counts: list[dict[str, int]] = [{}, {}]
    for row in per_turn:
        half = counts[half_of[row["qid"].rsplit("_", 1)[0]]]
        half["turns"] = half.get("turns", 0) + 1
        for mode, hit in row["hit_at_3"].items():
            half[mode] = half.get(mode, 0) + int(hit)
    return [
        {"turns": c["turns"], **{m: round(v / c["turns"], 4) for m, v in c.items() if m != "turns"}}
        for c in counts
    ]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("results", type=Path, nargs="?", default=RESULTS)
    parser.add_argument("--data", type=Path, default=DEFAULT_DATA)
    args = parser.parse_args(argv)
    lines = (args.data / "doc2dial-dev" / "dialogues.jsonl").read_text().splitlines()
    ids = [str(json.loads(line)["dial_id"]) for line in lines if line.strip()]
    per_turn = json.loads(args.results.read_text())["sets"]["doc2dial"]["per_turn"]
    for name, half in zip(("first half", "last half"), halves(per_turn, ids), strict=True):
        print(f"{name}: {json.dumps(half)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
