"""Which loader reads which ``type`` of ``[[knowledge_base.source]]``, and the options each takes."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from index.config import SOURCE_OPTIONS, SourceConfig, check_options
from index.errors import ConfigError
from index.sources import PageBytes, SkippedPage
from index.sources.folder import (
    DEFAULT_MAX_PAGE_BYTES,
    FolderOptions,
    max_page_bytes_option,
)
from index.sources.html import load_html
from index.sources.markdown import load_markdown
from index.sources.pdf import PDF_MAX_BYTES, load_pdf
from index.sources.records import RecordFields, load_records
from index.sources.text import load_text
from index.sources.url import UrlOptions, crawl_urls, state_path
from index.types import Page

__all__ = ["LOADERS", "SOURCE_OPTIONS", "LoadContext", "check_options", "load_source"]

Loaded = tuple[list[Page], list[SkippedPage]]
FolderLoader = Callable[[str, Path, FolderOptions, PageBytes | None], Loaded]


@dataclass(frozen=True, slots=True)
class LoadContext:
    """What a load needs beyond the source's own config: the base it belongs to, where state
    is cached (the crawl state of ``url`` sources), the time the load counts from, and the
    count of the bytes the base's pages hold (one for all its sources; None: this load's own)."""

    knowledge_base: str
    cache_dir: Path
    now: float = field(default_factory=time.time)
    budget: PageBytes | None = None


Loader = Callable[[SourceConfig, LoadContext], Loaded]


def _folder(load: FolderLoader, max_page_bytes: int = DEFAULT_MAX_PAGE_BYTES) -> Loader:
    def loader(source: SourceConfig, context: LoadContext) -> Loaded:
        assert source.path is not None  # check_options ran
        if not source.path.is_dir():
            raise ConfigError(f"source {source.name!r}: {source.path} is not a folder")
        options = FolderOptions.from_options(source.name, source.options, max_page_bytes)
        return load(source.name, source.path, options, context.budget)

    return loader


def _records(source: SourceConfig, context: LoadContext) -> Loaded:
    assert source.path is not None  # check_options ran
    fields = RecordFields.from_options(source.name, source.options)
    limit = max_page_bytes_option(source.options, DEFAULT_MAX_PAGE_BYTES)
    return load_records(source.name, source.path, source.type, fields, limit, context.budget)


def _url(source: SourceConfig, context: LoadContext) -> Loaded:
    options = UrlOptions.from_options(source.name, source.options)
    state = state_path(context.cache_dir, context.knowledge_base, source.name)
    pages, skipped, _ = crawl_urls(source.name, options, state, context.now, budget=context.budget)
    return pages, skipped


LOADERS: dict[str, Loader] = {
    "markdown": _folder(load_markdown),
    "text": _folder(load_text),
    "html": _folder(load_html),
    "pdf": _folder(load_pdf, PDF_MAX_BYTES),
    "url": _url,
    "jsonl": _records,
    "csv": _records,
}


def load_source(source: SourceConfig, context: LoadContext) -> Loaded:
    """Every page of one source, and the pages skipped with their reasons.

    Raises ConfigError for a wrong option or path, SourceError when the source as a whole
    cannot be read; a single bad page is only ever skipped.
    """
    check_options(source)
    return LOADERS[source.type](source, context)
