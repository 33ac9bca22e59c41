"""The real pages against the chunker's per-page limits: ``python -m bench.page_limits``.

Builds each document set of the evaluation data (docs-rclone's and docs-windows-terminal's
Markdown, the DSTC11, doc2dial and SciFact corpora as jsonl records) and the example base
(``examples/kb``) as ``voxrecall index build`` does (sources, chunker, snapshot; the hash
embedder, so no model runs), reads each snapshot back, and reports per set: its pages, chunks,
pages skipped and the seconds of the build's chunk phase, the most headings and the most chunks
on one page (against ``MAX_PAGE_HEADINGS`` and ``MAX_PAGE_CHUNKS``), the longest title,
breadcrumb, URL and metadata of a chunk (against the reader's caps), and a digest of every
chunk's strings as read back and of the pages' texts: the same digests on two branches mean
their builds of that set are the same. Writes ``bench/results/page_limits.json``; a set whose
data is absent is left out (``--sets`` names the ones to build).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import tempfile
from collections import Counter
from pathlib import Path
from typing import Any

from bench.report import plain
from bench.shared_data import SHARED_DATA
from index.build import build_knowledge_base
from index.chunker import MAX_PAGE_CHUNKS, MAX_PAGE_HEADINGS, markdown_headings
from index.embedders.base import HashEmbedder
from index.snapshot import load_snapshot
from index.store import LocalStore
from index.types import meta_values
from sidecar.config import parse_config

RESULTS = Path(__file__).resolve().parent / "results" / "page_limits.json"
EXAMPLES = Path(__file__).resolve().parents[1] / "examples" / "kb"
_RECORDS = {"id_field": "_id", "title_field": "title", "text_field": "text"}
SETS: dict[str, dict[str, Any]] = {
    "docs-rclone": {"type": "markdown", "path": SHARED_DATA / "docs-rclone" / "docs"},
    "docs-windows-terminal": {
        "type": "markdown",
        "path": SHARED_DATA / "docs-windows-terminal" / "docs",
    },
    "examples": {"type": "markdown", "path": EXAMPLES},
    "dstc11": {"type": "jsonl", "path": SHARED_DATA / "dstc11-faq-reviews" / "corpus.jsonl"}
    | _RECORDS,
    "doc2dial": {"type": "jsonl", "path": SHARED_DATA / "doc2dial-dev" / "corpus.jsonl"} | _RECORDS,
    "scifact": {"type": "jsonl", "path": SHARED_DATA / "scifact" / "corpus.jsonl"} | _RECORDS,
}


def _utf8(text: str) -> int:
    return len(text.encode("utf-8", "surrogatepass"))


def measure(source: dict[str, Any], work: Path) -> dict[str, Any]:
    """One set built into ``work`` and read back: its counts, its largest, its digests."""
    raw = {
        "knowledge_base": [{"name": "kb", "source": [source | {"path": str(source["path"])}]}],
        "index": {"store": str(work / "store")},
    }
    config = parse_config(raw, base=work)
    summary = build_knowledge_base(config, config.knowledge_bases[0], HashEmbedder())
    snap = load_snapshot(LocalStore(config.index.store).latest_dir("kb"))
    chunks, digest = Counter[str](), hashlib.sha256()
    longest = Counter[str]()
    for c in snap.chunks:
        chunks[c.source_path] += 1
        meta = [s for k, v in c.metadata.items() for s in (k, *meta_values(v))]
        strings = [c.chunk_id, c.title, *c.breadcrumbs, c.text, c.embed_text, c.url, *meta]
        digest.update(json.dumps([c.source_path, strings]).encode())
        for name, size in (
            ("title", _utf8(c.title)),
            ("breadcrumb", max(map(_utf8, c.breadcrumbs), default=0)),
            ("url", _utf8(c.url)),
            ("metadata", sum(map(_utf8, meta))),
        ):
            longest[name] = max(longest[name], size)
    headings = {  # a page's key is "source:path"
        key.partition(":")[2]: len(markdown_headings(text))
        for key, text in snap.pages.items()
        if source["type"] == "markdown"
    }
    pages = hashlib.sha256(json.dumps(sorted(snap.pages.items())).encode())
    most_chunks = chunks.most_common(1)[0] if chunks else ("", 0)
    most_headings = max(headings.items(), key=lambda kv: kv[1], default=("", 0))
    return {
        "pages": summary.pages,
        "chunks": summary.chunks,
        "chunk_seconds": round(summary.seconds.get("chunk", 0.0), 3),  # the build's chunk phase
        "skipped": summary.skipped_pages,
        "most_chunks_a_page": {"page": most_chunks[0], "chunks": most_chunks[1]},
        "most_headings_a_page": {"page": most_headings[0], "headings": most_headings[1]},
        "longest_bytes": dict(longest),
        "chunks_digest": digest.hexdigest()[:16],
        "pages_digest": pages.hexdigest()[:16],
    }


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=plain(__doc__))
    parser.add_argument("--out", type=Path, default=RESULTS, help="the JSON written")
    parser.add_argument(
        "--sets", nargs="+", choices=sorted(SETS), default=list(SETS), help="default: all"
    )
    args = parser.parse_args(argv)
    result: dict[str, Any] = {
        "limits": {"MAX_PAGE_HEADINGS": MAX_PAGE_HEADINGS, "MAX_PAGE_CHUNKS": MAX_PAGE_CHUNKS},
        "sets": {},
    }
    for name in args.sets:
        source = SETS[name]
        if not Path(source["path"]).exists():
            continue
        with tempfile.TemporaryDirectory() as tmp:
            result["sets"][name] = row = measure(source, Path(tmp))
        print(name, json.dumps(row), flush=True)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n", encoding="utf-8")
    return result


if __name__ == "__main__":
    main()
