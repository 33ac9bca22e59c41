"""What reading a turn's text costs at the text cap: ``python -m bench.turn_text``.

``Utterance.of`` (sidecar/turn/text.py: the turn's words and name tokens, on the event loop)
timed on a 16 KiB turn of ordinary words and on 16 KiB turns without whitespace (punctuation,
one long token, "a." repeated, "&" repeated, an accented letter repeated), each case's least
per-call time of ``--repeat`` repeats, in one run, with its ratio to the ordinary turn's. A run
without whitespace is read up to ``MAX_RUN_BYTES``, so no hostile turn should cost more than
the ordinary one. Writes ``bench/results/turn_text.json`` (``--out``).
"""

from __future__ import annotations

import argparse
import json
import random
import time
import timeit
from pathlib import Path

from bench.report import plain
from sidecar.turn.engine import MAX_TEXT_BYTES
from sidecar.turn.text import Utterance

RESULTS = Path(__file__).resolve().parent / "results" / "turn_text.json"
_VOCABULARY = (
    "the a hotel room booking cheap north centre please want like tell me about Hobson's B&B "
    "café is there parking near it"
).split()


def turns() -> dict[str, str]:
    """Each case's text, at most ``MAX_TEXT_BYTES``."""
    rng = random.Random(1)
    ordinary = " ".join(rng.choice(_VOCABULARY) for _ in range(MAX_TEXT_BYTES // 4))
    cap = MAX_TEXT_BYTES
    return {
        "ordinary_words": ordinary.encode()[:cap].decode("utf-8", "ignore").rpartition(" ")[0],
        "punctuation": "!" * cap,
        "one_token": "x" * cap,
        "a_dot_repeated": "a." * (cap // 2),
        "ampersands": "&" * cap,
        "accented_letter": "é" * (cap // 2),
    }


def measure(number: int, repeat: int) -> dict[str, object]:
    cases = turns()
    us = {name: _least_us(text, number, repeat) for name, text in cases.items()}
    ordinary = us["ordinary_words"]
    return {
        "bytes": {name: len(text.encode()) for name, text in cases.items()},
        "utterance_us": {name: round(t, 1) for name, t in us.items()},
        "over_ordinary": {name: round(t / ordinary, 3) for name, t in us.items()},
    }


def _least_us(text: str, number: int, repeat: int) -> float:
    """``Utterance.of(text)``'s least time a call of ``repeat`` repeats, this thread's CPU."""
    timed = timeit.repeat(
        lambda: Utterance.of(text), timer=time.thread_time, number=number, repeat=repeat
    )
    return min(timed) / number * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=plain(__doc__))
    parser.add_argument("--number", type=int, default=50, help="calls a repeat, per case")
    parser.add_argument("--repeat", type=int, default=7, help="repeats; the least is kept")
    parser.add_argument("--out", type=Path, default=RESULTS, help="the JSON written")
    args = parser.parse_args()
    result = measure(args.number, args.repeat)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n", encoding="utf-8")
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
