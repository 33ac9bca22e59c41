"""Index build times with the embedded default: ``python -m bench.index_build``.

For the rclone docs (193 Markdown pages, on a temporary copy) and the DSTC11 FAQ/review corpus
(10,882 jsonl records, ``context_fields = ["entity_name"]``): the first build's time and chunk
count, a second build with nothing changed (it embeds and publishes nothing), and for rclone a
build after editing one page. Ratios are taken within this one run. Writes
``bench/results/index_build.json``; ``--smoke`` builds a few pages and records only, writes
nothing unless ``--out`` is given, and exists so CI can run it.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import platform
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from bench.report import plain
from bench.shared_data import SHARED_DATA
from index.build import BuildSummary, build_knowledge_base
from index.config import EmbedderConfig
from index.embedders.base import Embedder
from index.embedders.factory import make_embedder
from sidecar.config import Config, parse_config

SHARED = SHARED_DATA
RCLONE = SHARED / "docs-rclone" / "docs"
DSTC = SHARED / "dstc11-faq-reviews" / "corpus.jsonl"
RESULTS = Path(__file__).resolve().parent / "results" / "index_build.json"
EDITED_PAGE = "content/faq.md"  # a mid-sized page with many sections
SMOKE_PAGES = 8
SMOKE_RECORDS = 200


def _config(work: Path, source: dict[str, Any]) -> Config:
    raw = {"knowledge_base": [{"name": "kb", "source": [source]}], "index": {"store": "store"}}
    return parse_config(raw, base=work)


def _timed(config: Config, embedder: Embedder) -> tuple[float, BuildSummary]:
    start = time.perf_counter()
    summary = build_knowledge_base(
        config, config.knowledge_bases[0], embedder, progress=lambda d, t: None
    )
    return time.perf_counter() - start, summary


def _row(seconds: float, s: BuildSummary) -> dict[str, Any]:
    return {
        "seconds": round(seconds, 2),
        "pages": s.pages,
        "chunks": s.chunks,
        "embedded": s.embedded,
        "reused": s.reused,
        "removed": s.removed,
        "published": s.published,
        "skipped_pages": len(s.skipped_pages),
        "phases": {k: round(v, 2) for k, v in s.seconds.items()},
    }


def bench_rclone(work: Path, embedder: Embedder, smoke: bool) -> dict[str, Any]:
    docs = work / "docs"
    if smoke:
        pages = sorted((RCLONE / "content").glob("*.md"))[:SMOKE_PAGES]
        (docs / "content").mkdir(parents=True)
        for page in pages:
            shutil.copy(page, docs / "content" / page.name)
        edited = f"content/{pages[0].name}"
    else:
        shutil.copytree(RCLONE, docs)
        edited = EDITED_PAGE
    for path in [docs, *docs.rglob("*")]:  # shared data is read-only; the copy must not be
        path.chmod(0o755 if path.is_dir() else 0o644)
    config = _config(work, {"type": "markdown", "path": "docs"})
    first = _timed(config, embedder)
    second = _timed(config, embedder)
    with (docs / edited).open("a", encoding="utf-8") as f:
        f.write("\nThis paragraph was added by the benchmark to change one section.\n")
    edit = _timed(config, embedder)
    return {
        "source": str(RCLONE),
        "edited_page": edited,
        "first": _row(*first),
        "unchanged": _row(*second),
        "after_editing_one_page": _row(*edit),
        "unchanged_over_first": round(second[0] / first[0], 4),
        "edit_over_first": round(edit[0] / first[0], 4),
    }


def bench_dstc(work: Path, embedder: Embedder, smoke: bool) -> dict[str, Any]:
    corpus = DSTC
    if smoke:
        corpus = work / "corpus.jsonl"
        with DSTC.open(encoding="utf-8") as f:
            corpus.write_text("".join(itertools.islice(f, SMOKE_RECORDS)), encoding="utf-8")
    source = {
        "type": "jsonl",
        "path": str(corpus),
        "id_field": "_id",
        "context_fields": ["entity_name"],
        "metadata_fields": ["doc_type", "domain", "entity_id"],
    }
    config = _config(work, source)
    first = _timed(config, embedder)
    second = _timed(config, embedder)
    return {
        "source": str(DSTC),
        "context_fields": ["entity_name"],
        "first": _row(*first),
        "unchanged": _row(*second),
        "unchanged_over_first": round(second[0] / first[0], 4),
    }


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=plain(__doc__))
    parser.add_argument("--smoke", action="store_true", help="a few pages and records only")
    parser.add_argument("--out", type=Path, default=None, help="a JSON to write")
    args = parser.parse_args(argv)
    for path in (RCLONE, DSTC):
        if not path.exists():
            sys.exit(f"shared data not present: {path}")
    embedder = make_embedder(EmbedderConfig(), parallel=os.cpu_count() or 1)
    with tempfile.TemporaryDirectory() as tmp:
        (Path(tmp) / "rclone").mkdir()
        (Path(tmp) / "dstc").mkdir()
        result = {
            "embedder": embedder.info.name,
            "machine": {
                "cpus": os.cpu_count(),
                "python": platform.python_version(),
                "processor": platform.processor() or platform.platform(),
            },
            "smoke": args.smoke,
            "load_average_at_start": [round(x, 2) for x in os.getloadavg()],
            "rclone_docs": bench_rclone(Path(tmp) / "rclone", embedder, args.smoke),
            "dstc11": bench_dstc(Path(tmp) / "dstc", embedder, args.smoke),
        }
    # other work on these shared cores slows every phase alike: read ratios, not seconds
    result["load_average_at_end"] = [round(x, 2) for x in os.getloadavg()]
    print(json.dumps(result, indent=2))
    out = args.out if args.out is not None else (None if args.smoke else RESULTS)
    if out is not None:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(result, indent=2) + "\n", encoding="utf-8")
    return result


if __name__ == "__main__":
    main()
