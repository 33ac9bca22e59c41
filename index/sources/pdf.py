"""A folder of PDF files: each PDF page with text becomes one page of the knowledge base.

A PDF page's ``source_path`` is ``<file>#page=<n>`` (the fragment PDF viewers open at), its
title is the document's title (its metadata, else the file name's stem), and its metadata holds
``page`` and ``pages``. A PDF that cannot be parsed, is encrypted, or has no text layer at all
(a scan) is skipped with the reason. Text is extracted with pypdf (pure Python).

A few kilobytes of PDF can hold megabytes of text (one compressed content stream shared by every
page) and pypdf's extraction takes time quadratic in a page's text (12 MB of it: 129 s). So a
page whose text passes ``PDF_MAX_PAGE_TEXT_BYTES`` is left out, its extraction stopped there, and
named with the reason (the document's other pages are kept); a document is skipped with the
reason once a second page passes it (``PDF_MAX_PAGES_OVER_TEXT``: no printed document has two
such pages, and every page of an attack that shares one stream does), a page or the document
runs ``PDF_MAX_OPERATORS`` content-stream operators, a stream decompresses past
``PDF_MAX_STREAM_BYTES``, or the document's text passes ``PDF_MAX_TEXT_BYTES`` (or a folder's
lower ``max_page_bytes``).
"""

from __future__ import annotations

import hashlib
import io
import json
import logging
import os
import resource
import signal
import subprocess
import sys
import tempfile
from pathlib import Path
from types import MappingProxyType

from pypdf import PageObject, PdfReader, apply_configuration
from pypdf.errors import LimitReachedError

from index.chunker import MAX_FIELD_BYTES, bounded
from index.errors import SourceError
from index.sources import PageBytes, SkippedPage
from index.sources.folder import DEFAULT_MAX_PAGE_BYTES, FolderOptions, list_files, read_file
from index.types import Page

__all__ = [
    "PDF_DEADLINE_S",
    "PDF_DEADLINE_S_PER_MIB",
    "PDF_MAX_BYTES",
    "PDF_MAX_MEMORY_BYTES",
    "PDF_MAX_OPERATORS",
    "PDF_MAX_PAGES_OVER_TEXT",
    "PDF_MAX_PAGE_TEXT_BYTES",
    "PDF_MAX_REASON_BYTES",
    "PDF_MAX_STREAM_BYTES",
    "PDF_MAX_TEXT_BYTES",
    "PDF_OPTIONS",
    "PDF_SUFFIXES",
    "load_pdf",
    "pdf_pages",
]

PDF_SUFFIXES = (".pdf",)
# A PDF file's default max_page_bytes: manuals with pictures run to tens of MiB, and pypdf holds
# the whole file and its parsed objects in memory.
PDF_MAX_BYTES = 64 << 20
PDF_OPTIONS = FolderOptions(max_page_bytes=PDF_MAX_BYTES)
# A printed page holds a few kilobytes of text; pypdf's extraction is quadratic in a page's text
# (1 MB: 1 s, 2 MB: 3 s, 4 MB: 12 s), so a page's text is bounded well under a second of it: a
# page past it is left out, the document's other pages kept (it skipped the whole file) ...
PDF_MAX_PAGE_TEXT_BYTES = 256 << 10
# ... for this many pages a document: one more skips the document, so that a stream shared by
# every page costs what it did when the first such page skipped the document (each page past
# the cap costs its stream's parse and a cap's extraction).
PDF_MAX_PAGES_OVER_TEXT = 1
# A document's text, all pages told (a 1,000-page manual holds ~3 MB); the file may be 64 MiB of
# pictures, its text is held to what any other page may be (max_page_bytes, if lower).
PDF_MAX_TEXT_BYTES = DEFAULT_MAX_PAGE_BYTES
# Operators run in one document, forms included (a form may be drawn 5,000 times a page): a
# dense page of text runs a few thousand, a detailed drawing some hundreds of thousands; pypdf
# runs ~300,000 a second.
PDF_MAX_OPERATORS = 5_000_000
# One stream, decompressed (pypdf's default is 75 MB): a content stream is parsed whole before a
# single operator runs, ~2 MB a second.
PDF_MAX_STREAM_BYTES = 4 << 20
# What else a document may cost, in a child process of its own: pypdf parses a content stream of
# numbers at ~0.3 MB a second, a stream it parses anew for each page that draws it (20 pages
# sharing a 4 MB stream: 248 s), which no count of text or operators sees. The child is killed
# past its deadline (PDF_DEADLINE_S, plus PDF_DEADLINE_S_PER_MIB of file: a 1,000-page manual
# takes pypdf ~30 s) and runs in at most PDF_MAX_MEMORY_BYTES.
PDF_DEADLINE_S = 20.0
PDF_DEADLINE_S_PER_MIB = 10.0
PDF_MAX_MEMORY_BYTES = 4 << 30
_OUT_OF_MEMORY = f"text extraction ran out of its {PDF_MAX_MEMORY_BYTES:,} bytes of memory (PDF_MAX_MEMORY_BYTES)"
# The most of a failed child's last stderr line a skip's reason quotes.
PDF_MAX_REASON_BYTES = 300
# The most the child may write on stderr (a file: RLIMIT_FSIZE kills it past this).
PDF_MAX_STDERR_BYTES = 1 << 20
_STREAM_LIMITS = (
    "zlib_maximum_output_length",
    "lzw_maximum_output_length",
    "run_length_maximum_output_length",
    "brotli_maximum_output_length",
    "array_based_stream_maximum_output_length",
)

# pypdf logs every recoverable oddity of a damaged file; the build reports what matters.
logging.getLogger("pypdf").setLevel(logging.ERROR)


class _TextBudgetSpent(MemoryError):
    """A page or document ran past a text or operator limit. A MemoryError, because pypdf lets
    MemoryError through where it logs and skips any other error (a form, a font); extraction
    must stop at once, not go on to the next of 5,000 forms."""


class _PageTextSpent(_TextBudgetSpent):
    """A page's text ran past ``PDF_MAX_PAGE_TEXT_BYTES``: the page is left out."""


class _Budget:
    """What one page's extraction may still write and run; pypdf's visitors call it."""

    def __init__(self, page: int, doc_left: int, doc_limit: int, operators: int) -> None:
        self.page, self.operators = page, operators  # run so far in the document
        self.spent: type[_TextBudgetSpent]  # what passing ``left`` raises
        if doc_left >= PDF_MAX_PAGE_TEXT_BYTES:
            self.left, self.spent = PDF_MAX_PAGE_TEXT_BYTES, _PageTextSpent
            self.over = (
                f"its text passes {PDF_MAX_PAGE_TEXT_BYTES:,} bytes (PDF_MAX_PAGE_TEXT_BYTES)"
            )
        else:
            self.left, self.spent = doc_left, _TextBudgetSpent
            self.over = (
                f"the document's text passes {doc_limit:,} bytes "
                "(PDF_MAX_TEXT_BYTES, or max_page_bytes if lower)"
            )

    def text(self, text: str, *_: object) -> None:
        self.left -= len(text.encode("utf-8", "surrogatepass"))
        if self.left < 0:
            raise self.spent(f"page {self.page}: {self.over}")

    def operator(self, *_: object) -> None:
        self.operators += 1
        if self.operators > PDF_MAX_OPERATORS:
            raise _TextBudgetSpent(
                f"page {self.page}: the document runs more than {PDF_MAX_OPERATORS:,} "
                "operators (PDF_MAX_OPERATORS)"
            )


# What a document's extraction answers: its title, each page's text ("" for one left out), and
# the pages left out with the reason.
_Extracted = tuple[str, list[str], list[tuple[int, str]]]


def _read(data: bytes, max_text_bytes: int) -> _Extracted:
    limits = dict.fromkeys(_STREAM_LIMITS, PDF_MAX_STREAM_BYTES)
    with apply_configuration(None, stream_parsing_work_maximum_count=PDF_MAX_OPERATORS, **limits):
        reader = PdfReader(io.BytesIO(data))
        if reader.is_encrypted and not reader.decrypt(""):
            raise ValueError("encrypted with a password")
        meta = reader.metadata
        title = " ".join(str(meta.title).split()) if meta is not None and meta.title else ""
        texts: list[str] = []
        left_out: list[tuple[int, str]] = []
        left, operators = max_text_bytes, 0
        for n, page in enumerate(reader.pages, 1):
            budget = _Budget(n, left, max_text_bytes, operators)
            texts.append(_page_text(page, budget, left_out))
            left -= len(texts[-1].encode("utf-8", "surrogatepass"))
            operators = budget.operators
    texts = [t.replace("\r\n", "\n").replace("\r", "\n").strip() for t in texts]
    return title, texts, left_out


def _page_text(page: PageObject, budget: _Budget, left_out: list[tuple[int, str]]) -> str:
    """One page's text, or "" for a page past ``PDF_MAX_PAGE_TEXT_BYTES`` (noted in
    ``left_out``; one past ``PDF_MAX_PAGES_OVER_TEXT`` of them raises for the document)."""
    try:
        text = page.extract_text(visitor_text=budget.text, visitor_operand_before=budget.operator)
    except _PageTextSpent as exc:
        if len(left_out) >= PDF_MAX_PAGES_OVER_TEXT:
            raise _TextBudgetSpent(
                f"{exc}, as {len(left_out)} page(s) before it did (PDF_MAX_PAGES_OVER_TEXT is "
                f"{PDF_MAX_PAGES_OVER_TEXT})"
            ) from None
        left_out.append((budget.page, str(exc)))
        return ""
    return (text or "").replace("\x00", "")


def _limit_reason(exc: LimitReachedError) -> str:
    """Which of the limits set on pypdf a document ran past (else pypdf's own words)."""
    if "decompress" in str(exc).lower():
        return f"a stream decompresses past {PDF_MAX_STREAM_BYTES:,} bytes (PDF_MAX_STREAM_BYTES)"
    return f"over a limit of pypdf's (PDF_MAX_OPERATORS is {PDF_MAX_OPERATORS:,}): {exc}"


def _extract(data: bytes, max_text_bytes: int) -> _Extracted | str:
    """The document's title and page texts, or why there are none."""
    try:
        return _read(data, max_text_bytes)
    except _TextBudgetSpent as exc:
        return f"too much text to extract: {exc}"
    except LimitReachedError as exc:
        return _limit_reason(exc)
    except MemoryError:
        return _OUT_OF_MEMORY
    # A damaged PDF can make a pure-Python parser raise almost anything; any failure here is a
    # property of this one file, reported with its type, and never stops the build.
    except Exception as exc:
        return f"unreadable PDF: {type(exc).__name__}: {exc}"


def _exit_reason(returncode: int, stderr: bytes, cpu_s: int) -> str:
    """Why the child exited without an answer: killed at its CPU time (SIGXCPU, then SIGKILL
    at the hard limit), out of memory, or else its exit and the last line it wrote."""
    said = _last_line(stderr)
    if returncode in (-signal.SIGXCPU, -signal.SIGKILL):
        name = signal.Signals(-returncode).name
        return (
            f"text extraction was killed ({name}) past its {cpu_s} s of CPU time, or out of memory"
        )
    if said.startswith("MemoryError"):
        return _OUT_OF_MEMORY
    return f"text extraction failed (exit {returncode}): {said or 'nothing on stderr'}"


def _last_line(stderr: bytes) -> str:
    """The last line the child wrote on stderr, at most ``PDF_MAX_REASON_BYTES`` of it."""
    lines = stderr.rstrip().rsplit(b"\n", 1)
    last = lines[-1][-PDF_MAX_REASON_BYTES:] if lines else b""
    return last.decode("utf-8", "replace").strip()


def _child() -> None:
    """``python -m index.sources.pdf MAX_TEXT_BYTES CPU_S``: the PDF on stdin, ``_extract``'s
    answer as JSON on stdout."""
    max_text_bytes, cpu_s = int(sys.argv[1]), int(sys.argv[2])
    resource.setrlimit(resource.RLIMIT_CPU, (cpu_s, cpu_s + 1))
    resource.setrlimit(resource.RLIMIT_AS, (PDF_MAX_MEMORY_BYTES, PDF_MAX_MEMORY_BYTES))
    resource.setrlimit(resource.RLIMIT_FSIZE, (PDF_MAX_STDERR_BYTES, PDF_MAX_STDERR_BYTES))
    got = _extract(sys.stdin.buffer.read(), max_text_bytes)
    sys.stdout.write(json.dumps(got))


def _extract_apart(data: bytes, max_text_bytes: int) -> _Extracted | str:
    """``_extract`` in a child process, killed past the document's deadline (a process of its
    own: nothing of pypdf's can be stopped in this one, and a fork of a threaded process is
    unsafe). Starting it costs ~0.3 s a document."""
    deadline = PDF_DEADLINE_S + PDF_DEADLINE_S_PER_MIB * len(data) / (1 << 20)
    root = str(Path(__file__).resolve().parents[2])  # where ``index`` is imported from
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")])),
    }
    command = [
        sys.executable,
        "-P",  # not the build's working folder first on the child's path: a json.py there ran
        "-m",
        "index.sources.pdf",
        str(max_text_bytes),
        str(int(deadline) + 1),
    ]
    try:
        done = _run_child(command, data, env, deadline)
    except subprocess.TimeoutExpired:
        return f"text extraction ran past its {deadline:.1f} s (PDF_DEADLINE_S, plus PDF_DEADLINE_S_PER_MIB of file)"
    returncode, stdout, stderr, stderr_full = done
    if stderr_full:
        return f"text extraction wrote {PDF_MAX_STDERR_BYTES:,} bytes of warnings or more (PDF_MAX_STDERR_BYTES)"
    if returncode != 0:
        return _exit_reason(returncode, stderr, int(deadline) + 1)
    return _answer(stdout)


def _run_child(
    command: list[str], data: bytes, env: dict[str, str], deadline: float
) -> tuple[int, bytes, bytes, bool]:
    """Run the child: its exit, its answer, the tail of what it wrote on stderr, and whether
    that reached ``PDF_MAX_STDERR_BYTES``. Its stderr goes to a file it may not grow past that
    (``RLIMIT_FSIZE``, set in the child: Python ignores SIGXFSZ, so a write past it fails), so
    a flood of warnings never reaches this process."""
    with tempfile.TemporaryFile() as err:
        done = subprocess.run(
            command, input=data, stdout=subprocess.PIPE, stderr=err, timeout=deadline, env=env,
            check=False,
        )  # fmt: skip
        size = err.seek(0, os.SEEK_END)
        err.seek(max(0, size - PDF_MAX_REASON_BYTES * 4))
        return done.returncode, done.stdout, err.read(), size >= PDF_MAX_STDERR_BYTES


def _answer(stdout: bytes) -> _Extracted | str:
    """The child's answer: a reason (a string) or the title, the pages' texts and the pages left
    out; anything else (a child that wrote no JSON, or not that shape) a reason too."""
    try:
        got = json.loads(stdout)
    except ValueError:
        return "text extraction gave no answer it could read (no JSON on its stdout)"
    if isinstance(got, str):
        return got
    if isinstance(got, list) and len(got) == 3 and isinstance(got[0], str):
        texts, left_out = _texts(got[1]), _left_out(got[2])
        if texts is not None and left_out is not None:
            return got[0], texts, left_out
    return "text extraction gave an answer of the wrong shape"


def _texts(got: object) -> list[str] | None:
    if isinstance(got, list) and all(isinstance(t, str) for t in got):
        return got
    return None


def _left_out(got: object) -> list[tuple[int, str]] | None:
    if not isinstance(got, list):
        return None
    pairs = [p for p in got if isinstance(p, list) and len(p) == 2]
    out = [(n, why) for n, why in pairs if isinstance(n, int) and isinstance(why, str)]
    return out if len(out) == len(got) else None


def pdf_pages(
    source: str,
    rel: str,
    data: bytes,
    fallback_title: str,
    url: str = "",
    max_text_bytes: int = PDF_MAX_TEXT_BYTES,
    done: dict[bytes, _Extracted | str] | None = None,
) -> tuple[list[Page], list[SkippedPage]] | SkippedPage:
    """The pages of one PDF document with text and the pages left out (``<rel>#page=<n>``, past
    ``PDF_MAX_PAGE_TEXT_BYTES``), or why the document cannot be used (among the reasons, text
    past ``max_text_bytes`` all told, or past a limit of this module). ``done``: the
    extractions made before, by the document's digest (``_extract_once``)."""
    got = _extract_once(data, max_text_bytes, done)
    if isinstance(got, str):
        return SkippedPage(rel, got)
    title, texts, left_out = got
    if not any(texts):
        if left_out:  # its one page of text was left out
            return SkippedPage(rel, f"too much text to extract: {left_out[0][1]}")
        return SkippedPage(rel, f"no text layer in {len(texts)} page(s) (a scanned PDF?)")
    # every page holds the one title (cut as the chunker cuts it), not a copy each: a title of
    # megabytes counted per page refused a whole base
    pages = _pages(source, rel, bounded(title or fallback_title, MAX_FIELD_BYTES), texts, url)
    kept = "; the page is left out, the document's other pages kept"
    return pages, [
        SkippedPage(f"{rel}#page={n}", f"too much text to extract: {why}{kept}")
        for n, why in left_out
    ]


def _extract_once(
    data: bytes, max_text_bytes: int, done: dict[bytes, _Extracted | str] | None
) -> _Extracted | str:
    """``_extract_apart(data)``, or what it answered for the same bytes before (``done``, one
    source's): a document under many names (links, copies) is extracted once, where each name
    could cost the whole deadline."""
    if done is None:
        return _extract_apart(data, max_text_bytes)
    key = hashlib.sha256(data).digest()
    if key not in done:
        done[key] = _extract_apart(data, max_text_bytes)
    return done[key]


def _pages(source: str, rel: str, title: str, texts: list[str], url: str) -> list[Page]:
    total = str(len(texts))
    return [
        Page(
            source=source,
            source_path=f"{rel}#page={n}",
            title=title,
            text=text,
            kind="text",
            url=f"{url}#page={n}" if url else "",
            metadata=MappingProxyType({"page": str(n), "pages": total}),
        )
        for n, text in enumerate(texts, 1)
        if text
    ]


def load_pdf(
    source: str,
    root: Path,
    options: FolderOptions = PDF_OPTIONS,
    budget: PageBytes | None = None,
) -> tuple[list[Page], list[SkippedPage]]:
    """Read every PDF under ``root`` (``index.sources.folder`` says which); a bad file is
    skipped, never raised. ``max_page_bytes`` bounds a PDF file, and its text
    if under PDF_MAX_TEXT_BYTES.

    Raises SourceError only when ``root`` is not a folder, BaseTooLarge when the pages pass
    ``budget`` (``load_markdown``'s).
    """
    budget = budget or PageBytes(source)
    if not root.is_dir():
        raise SourceError(f"pdf source {source!r}: {root} is not a folder")
    listing = list_files(root, PDF_SUFFIXES, follow_symlinks=options.follow_symlinks)
    pages: list[Page] = []
    skipped = listing.skipped
    done: dict[bytes, _Extracted | str] = {}
    for rel, path in listing.files:
        data = read_file(rel, path, options.max_page_bytes)
        if isinstance(data, SkippedPage):
            got: tuple[list[Page], list[SkippedPage]] | SkippedPage = data
        else:
            max_text_bytes = min(options.max_page_bytes, PDF_MAX_TEXT_BYTES)
            got = pdf_pages(source, rel, data, path.stem, max_text_bytes=max_text_bytes, done=done)
        if isinstance(got, SkippedPage):
            skipped.append(got)
        else:
            budget.take(*got[0])
            pages.extend(got[0])
            skipped.extend(got[1])
    return pages, skipped


if __name__ == "__main__":
    _child()
