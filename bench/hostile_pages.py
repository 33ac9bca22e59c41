"""Chunking time and memory of hostile single-line pages: ``python -m bench.hostile_pages``.

For each kind of single-line Markdown page (prose with sentences, one run of dots, a heading
padded with spaces), at a small and a 5x larger size (1 and 5 MB; ``--smoke``: 50 and 250 kB),
``chunk_page`` runs in a child process of its own, which reports its seconds and its peak RSS
(``resource.getrusage``). ``time_ratio`` is the larger size's seconds over the smaller's, within
this one run: about 5 is linear, about 25 quadratic. Writes ``bench/results/hostile_pages.json``;
``--smoke`` writes nothing unless ``--out`` is given, and exists so CI can run it.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
from pathlib import Path
from typing import Any

RESULTS = Path(__file__).resolve().parent / "results" / "hostile_pages.json"
KINDS = ("prose", "dots", "spaces")
SIZES_MB = (1.0, 5.0)
SMOKE_SIZES_MB = (0.05, 0.25)
CHILD_TIMEOUT_S = 600  # a quadratic step at 5 MB runs for hours: report it as such, not hang

_CHILD = """
import json, resource, sys, time
from index.chunker import chunk_page
from index.types import Page

kind, size = sys.argv[1], int(sys.argv[2])
if kind == "prose":
    text = ("The quick brown fox jumps over the lazy dog. " * (size // 45 + 1))[:size]
elif kind == "dots":
    text = "." * size
else:
    text = "# Title" + " " * size + "end\\n\\nBody."
start = time.perf_counter()
chunks = chunk_page(Page("bench", "page.md", "Page", text))
seconds = time.perf_counter() - start
rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux: KiB
print(json.dumps({"seconds": seconds, "chunks": len(chunks), "peak_rss_bytes": rss}))
"""


def measure(kind: str, size: int) -> dict[str, Any]:
    """One page chunked in a fresh child: its seconds, chunks and peak RSS."""
    try:
        done = subprocess.run(
            [sys.executable, "-c", _CHILD, kind, str(size)],
            capture_output=True,
            text=True,
            timeout=CHILD_TIMEOUT_S,
            check=True,
        )
    except subprocess.TimeoutExpired:
        return {"bytes": size, "error": f"ran past {CHILD_TIMEOUT_S} s"}
    row: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    return {"bytes": size, **row, "seconds": round(row["seconds"], 3)}


def bench_kind(kind: str, sizes_mb: tuple[float, float]) -> dict[str, Any]:
    small, large = (measure(kind, int(mb * 1_000_000)) for mb in sizes_mb)
    ratio = None
    if "error" not in small and "error" not in large and small["seconds"] > 0:
        ratio = round(large["seconds"] / small["seconds"], 2)
    return {"small": small, "large": large, "time_ratio": ratio}


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true", help="50 and 250 kB pages")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    sizes = SMOKE_SIZES_MB if args.smoke else SIZES_MB
    result: dict[str, Any] = {
        "machine": {
            "cpus": os.cpu_count(),
            "python": platform.python_version(),
            "processor": platform.processor() or platform.platform(),
        },
        "smoke": args.smoke,
        "sizes_mb": list(sizes),
        "load_average_at_start": [round(x, 2) for x in os.getloadavg()],
        "kinds": {kind: bench_kind(kind, sizes) for kind in KINDS},
    }
    # other work on these shared cores slows both sizes alike: read the ratios, not seconds
    result["load_average_at_end"] = [round(x, 2) for x in os.getloadavg()]
    print(json.dumps(result, indent=2))
    out = args.out if args.out is not None else (None if args.smoke else RESULTS)
    if out is not None:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(result, indent=2) + "\n", encoding="utf-8")
    return result


if __name__ == "__main__":
    main()
