"""Sources: each reads one kind of knowledge base input into pages (``index.types.Page``).

A page that cannot be read is never an exception for the build: the source returns it as a
``SkippedPage`` naming the reason, next to the pages it could read.

A page holding a lone surrogate (U+D800 to U+DFFF alone: a YAML or JSON escape such as
``"\\ud800"``) is skipped too: it is not text, cannot be written as UTF-8, and would stop the
build where the page's chunks are hashed or stored. ``sound_pages`` is the one check, made on
every source's pages (``index.build.collect_pages``) and on a crawled page before its crawl
state is written (``index.sources.url``).

A build holds every page of its base at once: ``PageBytes`` counts them as the sources read
them, and refuses the build (``BaseTooLarge``) once they pass the base's ``max_text_bytes``.
"""

from __future__ import annotations

import re
import sys
from collections.abc import Iterable
from dataclasses import dataclass

from index.config import DEFAULT_MAX_TEXT_BYTES, quoted
from index.errors import BaseTooLarge
from index.types import Page, meta_values

__all__ = ["PageBytes", "SkippedPage", "printable", "sound_pages"]

# What a page costs beside its strings: the Page, its listing entry, and its chunk's objects.
# tracemalloc: 20,000 one-byte Markdown pages held 710 bytes each once chunked, 163 of them the
# strings counted below.
PAGE_BYTES = 550

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


class PageBytes:
    """The bytes a build's pages hold, counted as its sources read them (each string as Python
    holds it, 1 to 4 bytes a character, and ``PAGE_BYTES`` a page): past ``limit`` the build is
    refused, before it holds more. One per build of a base, shared by its sources."""

    def __init__(self, knowledge_base: str, limit: int = DEFAULT_MAX_TEXT_BYTES) -> None:
        self.knowledge_base = knowledge_base
        self.limit = limit
        self.held = 0

    def take(self, *pages: Page) -> None:
        """Count ``pages``; raises BaseTooLarge once the base's pages pass the limit."""
        for page in pages:
            self.held += PAGE_BYTES + sum(sys.getsizeof(value) for _, value in _fields(page))
            if self.held > self.limit:
                raise BaseTooLarge(
                    f"knowledge base {quoted(self.knowledge_base)}: its pages hold {self.held:,} "
                    f"bytes by source {quoted(page.source)} page {quoted(page.source_path)}, over "
                    f"max_text_bytes ({self.limit:,}): raise the base's max_text_bytes if the "
                    "indexer has the memory (a build holds about 5 times it at its peak), or "
                    "split its sources into several bases; nothing was published"
                )


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
