"""Value types that flow through an index build: a source yields pages, a page yields chunks."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Literal

PageKind = Literal["markdown", "text"]

# A metadata value: a string, or a list of strings (frontmatter ``tags: [a, b]``), kept a list
# so that a filter can match any element of it (``index/filters.py``).
MetaValue = str | tuple[str, ...]

_EMPTY: Mapping[str, MetaValue] = MappingProxyType({})


def meta_values(value: MetaValue) -> tuple[str, ...]:
    """A metadata value as the strings a filter compares: a list's elements, or the string."""
    return (value,) if isinstance(value, str) else value


META_JOIN = ", "  # a list metadata value's strings, as one string


def meta_text(value: MetaValue) -> str:
    """A metadata value as one string (for display and the proto's string map): lists joined
    with ", ", as metadata was written before lists were kept."""
    return value if isinstance(value, str) else META_JOIN.join(value)


@dataclass(frozen=True, slots=True)
class Page:
    """One page of a knowledge base as its source read it, before chunking.

    ``source_path`` is the page's stable identity inside its source: a path relative to the source
    folder, a URL, or a record id of an export. ``context``, when set, replaces the title and
    breadcrumbs as the contextual prefix of every chunk (jsonl ``context_fields``).
    """

    source: str
    source_path: str
    title: str
    text: str
    kind: PageKind = "markdown"
    url: str = ""
    context: str = ""
    metadata: Mapping[str, MetaValue] = field(default_factory=lambda: _EMPTY)


@dataclass(frozen=True, slots=True)
class Chunk:
    """A retrievable piece of a page.

    ``text`` is what the agent is given; ``embed_text`` is the contextual prefix plus ``text``,
    which is what gets embedded. ``chunk_id`` depends only on the source, the page path, the
    breadcrumbs and the text, so an unchanged page always yields the same ids.
    """

    chunk_id: str
    source: str
    source_path: str
    title: str
    breadcrumbs: tuple[str, ...]
    text: str
    embed_text: str
    url: str = ""
    metadata: Mapping[str, MetaValue] = field(default_factory=lambda: _EMPTY)


@dataclass(frozen=True, slots=True)
class MetadataFilter:
    """A chunk passes when its ``field``, or any element of a list-valued one, equals one of
    ``any_of``; several filters all apply (``index/filters.py``)."""

    field: str
    any_of: tuple[str, ...]
