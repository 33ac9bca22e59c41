"""Chunking time and memory of hostile pages: ``python -m bench.hostile_pages``.

For each kind of Markdown page (single lines: prose with sentences, one run of dots, a heading
padded with spaces; shapes: one H2 of half the page over short paragraphs, a heading on every
line, "## hN\\nwN" sections, "a" on every line, "ab" paragraphs), at a small and a 5x larger
size (1 and 5 MB; ``--smoke``: 50 and 250 kB), ``chunk_page`` runs in a child process of its
own (at most ``CHILD_MAX_BYTES`` of address space), which reports its seconds, its peak RSS
(``resource.getrusage``), its chunks and the bytes of their strings a snapshot would write, or
the page's refusal (a per-page limit of the chunker). ``time_ratio`` is the larger size's
seconds over the smaller's, within this one run: about 5 is linear, about 25 quadratic. Writes
``bench/results/hostile_pages.json``; ``--smoke`` writes nothing unless ``--out`` is given, and
exists so CI can run it.
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

from bench.report import plain

RESULTS = Path(__file__).resolve().parent / "results" / "hostile_pages.json"
KINDS = (
    "prose", "dots", "spaces", "huge_heading", "headings", "sections", "short_lines",
    "short_paragraphs",
)  # fmt: skip
SIZES_MB = (1.0, 5.0)
SMOKE_SIZES_MB = (0.05, 0.25)
CHILD_TIMEOUT_S = 600  # a quadratic step at 5 MB runs for hours: report it as such, not hang
# A page whose chunks grow with its square (one huge heading copied into each) held 4 GB at
# 8 MB: on shared cores the child stops at this, reported as an error, not the machine's memory.
CHILD_MAX_BYTES = 3 << 30

_CHILD = """
import json, resource, sys, time
resource.setrlimit(resource.RLIMIT_AS, (int(sys.argv[3]),) * 2)  # a MemoryError past it
from index.chunker import chunk_page
from index.errors import SourceError
from index.types import Page

kind, size = sys.argv[1], int(sys.argv[2])
if kind == "prose":
    text = ("The quick brown fox jumps over the lazy dog. " * (size // 45 + 1))[:size]
elif kind == "dots":
    text = "." * size
elif kind == "spaces":
    text = "# Title" + " " * size + "end\\n\\nBody."
elif kind == "huge_heading":
    para = "The roaming password resets every ninety days for each invoice number.\\n\\n"
    text = "# Page\\n\\n## " + "word " * (size // 10) + "\\n\\n" + para * (size // 2 // len(para))
elif kind == "headings":
    text = "## h\\n" * (size // 5)
elif kind == "short_lines":
    text = "a\\n" * (size // 2)
elif kind == "short_paragraphs":
    text = "ab\\n\\n" * (size // 4)
else:
    text = "".join(f"## h{i}\\nw{i}\\n" for i in range(size // 12))
start = time.perf_counter()
refused = ""
try:
    chunks = chunk_page(Page("bench", "page.md", "Page", text))
except SourceError as exc:  # a per-page limit (index.chunker.PageOverLimit)
    chunks, refused = [], str(exc)
seconds = time.perf_counter() - start
rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux: KiB
strings = sum(
    len(s.encode()) for c in chunks for s in (c.title, c.text, c.embed_text, *c.breadcrumbs)
)
row = {"seconds": seconds, "chunks": len(chunks), "peak_rss_bytes": rss, "string_bytes": strings}
print(json.dumps(row | ({"refused": refused} if refused else {})))
"""


def measure(kind: str, size: int) -> dict[str, Any]:
    """One page chunked in a fresh child, its address space held to CHILD_MAX_BYTES: its
    seconds, chunks and peak RSS. The child sets its own limit: a ``preexec_fn`` would fork this
    process, whose gRPC threads (a test run's servers) then wrote into the child's stderr."""
    try:
        done = subprocess.run(
            [sys.executable, "-c", _CHILD, kind, str(size), str(CHILD_MAX_BYTES)],
            capture_output=True,
            text=True,
            timeout=CHILD_TIMEOUT_S,
            check=True,
        )
    except subprocess.TimeoutExpired:
        return {"bytes": size, "error": f"ran past {CHILD_TIMEOUT_S} s"}
    except subprocess.CalledProcessError as exc:  # MemoryError past CHILD_MAX_BYTES
        last = (exc.stderr or "").strip().splitlines()[-1:] or [f"exit {exc.returncode}"]
        return {"bytes": size, "error": last[0][:200]}
    row: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    return {"bytes": size, **row, "seconds": round(row["seconds"], 3)}


def bench_kind(kind: str, sizes_mb: tuple[float, float]) -> dict[str, Any]:
    small, large = (measure(kind, int(mb * 1_000_000)) for mb in sizes_mb)
    ratio = None
    if "error" not in small and "error" not in large and small["seconds"] > 0:
        ratio = round(large["seconds"] / small["seconds"], 2)
    return {"small": small, "large": large, "time_ratio": ratio}


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=plain(__doc__))
    parser.add_argument("--smoke", action="store_true", help="50 and 250 kB pages")
    parser.add_argument("--out", type=Path, default=None, help="a JSON to write")
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
