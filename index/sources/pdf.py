"""A folder of PDF files: each PDF page with text becomes one page of the knowledge base.

A PDF page's ``source_path`` is ``<file>#page=<n>`` (the fragment PDF viewers open at), its
title is the document's title (its metadata, else the file name's stem), and its metadata holds
``page`` and ``pages``. A PDF that cannot be parsed, is encrypted, or has no text layer at all
(a scan) is skipped with the reason. Text is extracted with pypdf (pure Python).
"""

from __future__ import annotations

import io
import logging
from pathlib import Path
from types import MappingProxyType

from pypdf import PdfReader

from index.errors import SourceError
from index.sources import SkippedPage
from index.sources.folder import FolderOptions, list_files, read_file
from index.types import Page

__all__ = ["PDF_MAX_BYTES", "PDF_OPTIONS", "PDF_SUFFIXES", "load_pdf", "pdf_pages"]

PDF_SUFFIXES = (".pdf",)
# A PDF file's default max_page_bytes: manuals with pictures run to tens of MiB, and pypdf holds
# the whole file and its parsed objects in memory.
PDF_MAX_BYTES = 64 << 20
PDF_OPTIONS = FolderOptions(max_page_bytes=PDF_MAX_BYTES)

# pypdf logs every recoverable oddity of a damaged file; the build reports what matters.
logging.getLogger("pypdf").setLevel(logging.ERROR)


def _read(data: bytes) -> tuple[str, list[str]]:
    reader = PdfReader(io.BytesIO(data))
    if reader.is_encrypted and not reader.decrypt(""):
        raise ValueError("encrypted with a password")
    meta = reader.metadata
    title = " ".join(str(meta.title).split()) if meta is not None and meta.title else ""
    texts = [(page.extract_text() or "").replace("\x00", "") for page in reader.pages]
    return title, [t.replace("\r\n", "\n").replace("\r", "\n").strip() for t in texts]


def pdf_pages(
    source: str, rel: str, data: bytes, fallback_title: str, url: str = ""
) -> list[Page] | SkippedPage:
    """The pages of one PDF document with text, or why the document cannot be used."""
    try:
        title, texts = _read(data)
    # A damaged PDF can make a pure-Python parser raise almost anything; any failure here is a
    # property of this one file, reported with its type, and never stops the build.
    except Exception as exc:
        return SkippedPage(rel, f"unreadable PDF: {type(exc).__name__}: {exc}")
    if not any(texts):
        return SkippedPage(rel, f"no text layer in {len(texts)} page(s) (a scanned PDF?)")
    title = title or fallback_title
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
    source: str, root: Path, options: FolderOptions = PDF_OPTIONS
) -> tuple[list[Page], list[SkippedPage]]:
    """Read every PDF under ``root`` (``index.sources.folder`` says which); a bad file is
    skipped, never raised. ``max_page_bytes`` bounds a PDF file.

    Raises SourceError only when ``root`` is not a folder.
    """
    if not root.is_dir():
        raise SourceError(f"pdf source {source!r}: {root} is not a folder")
    listing = list_files(root, PDF_SUFFIXES, follow_symlinks=options.follow_symlinks)
    pages: list[Page] = []
    skipped = listing.skipped
    for rel, path in listing.files:
        data = read_file(rel, path, options.max_page_bytes)
        got = data if isinstance(data, SkippedPage) else pdf_pages(source, rel, data, path.stem)
        if isinstance(got, SkippedPage):
            skipped.append(got)
        else:
            pages.extend(got)
    return pages, skipped
