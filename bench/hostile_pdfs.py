"""Extraction of hostile PDFs: ``python -m bench.hostile_pdfs``.

Builds small PDFs whose pages all draw one Flate-compressed content stream (a few kilobytes of
file, megabytes of text: the attack on ``index/sources/pdf.py``) and runs ``pdf_pages`` on each,
child process included: its seconds, the file's bytes, and the pages' text bytes and the pages
left out, or the reason it was skipped. ``--only NAME`` runs one; ``--smoke`` runs the quick
ones (the stream of numbers runs to the deadline, 20 s and more). Writes
``bench/results/hostile_pdfs.json``; ``--smoke`` writes nothing unless ``--out`` is given.
"""

from __future__ import annotations

import argparse
import json
import os
import time
import zlib
from pathlib import Path
from typing import Any

from bench.report import plain
from index.sources.pdf import pdf_pages

RESULTS = Path(__file__).resolve().parent / "results" / "hostile_pdfs.json"
_WORDS = b"BT /F1 12 Tf 10 10 Td (" + b"word " * 40 + b") Tj ET\n"
# name: (pages, what the shared stream holds, its decompressed bytes)
ATTACKS: dict[str, tuple[int, str, int]] = {
    "one_page_1mb": (1, "words", 1_000_000),
    "one_page_12mb": (1, "words", 12_000_000),
    "shared_20_pages_1mb": (20, "words", 1_000_000),
    "shared_8_pages_3mb": (8, "words", 3_000_000),
    "blank_stream_5mb": (1, "blank", 5_000_000),
    "numbers_20_pages_4mb": (20, "numbers", 4_000_000),
}
SLOW = ("numbers_20_pages_4mb",)  # left out of --smoke


def content(kind: str, size: int) -> bytes:
    if kind == "words":
        return _WORDS * (size // len(_WORDS) + 1)
    if kind == "numbers":
        return b"1 " * (size // 2)
    return b" " * size + b"BT /F1 12 Tf 10 10 Td (Hi) Tj ET\n"


def shared_stream_pdf(pages: int, stream: bytes) -> bytes:
    """A PDF of ``pages`` pages that all draw one Flate-compressed content stream."""
    packed = zlib.compress(stream, 9)
    kids = b" ".join(b"%d 0 R" % (5 + i) for i in range(pages))
    page = b"<< /Type /Page /Parent 2 0 R /MediaBox [0 0 612 792] "
    page += b"/Resources << /Font << /F1 3 0 R >> >> /Contents 4 0 R >>"
    objects = [
        b"<< /Type /Catalog /Pages 2 0 R >>",
        b"<< /Type /Pages /Kids [" + kids + b"] /Count %d >>" % pages,
        b"<< /Type /Font /Subtype /Type1 /BaseFont /Helvetica >>",
        b"<< /Length %d /Filter /FlateDecode >>\nstream\n" % len(packed) + packed + b"\nendstream",
        *[page] * pages,
    ]
    out, offsets = bytearray(b"%PDF-1.4\n"), []
    for number, body in enumerate(objects, 1):
        offsets.append(len(out))
        out += b"%d 0 obj\n" % number + body + b"\nendobj\n"
    xref = len(out)
    out += b"xref\n0 %d\n0000000000 65535 f \n" % (len(objects) + 1)
    out += b"".join(b"%010d 00000 n \n" % o for o in offsets)
    out += b"trailer\n<< /Size %d /Root 1 0 R >>\n" % (len(objects) + 1)
    return bytes(out + b"startxref\n%d\n%%%%EOF\n" % xref)


def measure(name: str) -> dict[str, Any]:
    """One attack PDF built and extracted: seconds (its child's start included), and what
    came of it."""
    pages, kind, size = ATTACKS[name]
    data = shared_stream_pdf(pages, content(kind, size))
    start = time.perf_counter()
    got = pdf_pages("bench", f"{name}.pdf", data, name)
    row: dict[str, Any] = {
        "file_bytes": len(data),
        "stream_bytes": size,
        "pages": pages,
        "seconds": round(time.perf_counter() - start, 3),
    }
    if isinstance(got, tuple):
        kept, left_out = got
        text_bytes = sum(len(p.text.encode()) for p in kept)
        return row | {"text_bytes": text_bytes, "left_out": [p.reason for p in left_out]}
    return row | {"skipped": got.reason}


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=plain(__doc__))
    parser.add_argument("--smoke", action="store_true", help="the quick attacks alone")
    parser.add_argument("--only", choices=sorted(ATTACKS), default=None, help="one attack")
    parser.add_argument("--out", type=Path, default=None, help="a JSON to write")
    args = parser.parse_args(argv)
    names = [args.only] if args.only else [n for n in ATTACKS if not (args.smoke and n in SLOW)]
    result: dict[str, Any] = {
        "cpus": os.cpu_count(),
        "load_average_at_start": [round(x, 2) for x in os.getloadavg()],
        "attacks": {name: measure(name) for name in names},
    }
    print(json.dumps(result, indent=2))
    out = args.out if args.out is not None else (None if args.smoke or args.only else RESULTS)
    if out is not None:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(result, indent=2) + "\n", encoding="utf-8")
    return result


if __name__ == "__main__":
    main()
