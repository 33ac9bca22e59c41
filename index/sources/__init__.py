"""Sources: each reads one kind of knowledge base input into pages (``index.types.Page``).

A page that cannot be read is never an exception for the build: the source returns it as a
``SkippedPage`` naming the reason, next to the pages it could read.

A page holding a lone surrogate (U+D800 to U+DFFF alone: a YAML or JSON escape such as
``"\\ud800"``) is skipped too: it is not text, cannot be written as UTF-8, and would stop the
build where the page's chunks are hashed or stored. ``sound_pages`` is the one check, made on
every source's pages (``index.build.collect_pages``) and on a crawled page before its crawl
state is written (``index.sources.url``).
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass

from index.types import Page, meta_values

__all__ = ["SkippedPage", "printable", "sound_pages"]

_SURROGATE = re.compile("[\ud800-\udfff]")


@dataclass(frozen=True, slots=True)
class SkippedPage:
    """A page a source could not use: its path inside the source, and why, for the build report."""

    path: str
    reason: str


def printable(name: str) -> str:
    """``name`` as UTF-8 text to report: a byte of a file name that is not UTF-8 (read by the
    OS as a surrogate escape) as ``\\xff``, any other lone surrogate as ``\\ud800``."""
    try:
        return name.encode("utf-8", "surrogateescape").decode("utf-8", "backslashreplace")
    except UnicodeEncodeError:  # a surrogate no file name decodes to
        return name.encode("utf-8", "backslashreplace").decode("utf-8")


def _fields(page: Page) -> Iterable[tuple[str, str]]:
    yield "source_path", page.source_path
    yield "title", page.title
    yield "text", page.text
    yield "url", page.url
    yield "context", page.context
    for key, value in page.metadata.items():
        yield "a metadata key", key
        for one in meta_values(value):
            yield f"metadata {printable(key)!r}", one


def _surrogate(page: Page) -> str:
    """Why ``page`` is not text (a lone surrogate, and where), or ""."""
    for name, value in _fields(page):
        found = _SURROGATE.search(value)
        if found:
            return (
                f"{name} holds a lone surrogate (U+{ord(found.group()):04X} at character "
                f"{found.start():,}), which is not text: fix or remove the escape that wrote it"
            )
    return ""


def sound_pages(pages: Iterable[Page]) -> tuple[list[Page], list[SkippedPage]]:
    """The pages that are text throughout, and those that are not, skipped with the reason."""
    kept: list[Page] = []
    skipped: list[SkippedPage] = []
    for page in pages:
        why = _surrogate(page)
        if why:
            skipped.append(SkippedPage(printable(page.source_path), why))
        else:
            kept.append(page)
    return kept, skipped
