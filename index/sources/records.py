"""Record exports (``jsonl`` and ``csv``): one record per page, e.g. an FAQ or knowledge export.

The fields are named by the source's options: ``id_field`` (the page's ``source_path``, so a
result maps back to its record), ``title_field``, ``text_field``, ``context_fields`` (their values,
joined with " > ", become the contextual prefix embedded before the text, e.g. an entity name)
and ``metadata_fields`` (kept on every chunk as strings). A record that is malformed, lacks an id
or text, or repeats an id is skipped with its line number; the rest are indexed.
"""

from __future__ import annotations

import csv
import json
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType
from typing import Any

from index.errors import ConfigError, SourceError
from index.sources import SkippedPage
from index.sources.markdown import metadata_value
from index.types import Page

__all__ = ["RecordFields", "load_records"]

CONTEXT_SEPARATOR = " > "  # the same joint as heading breadcrumbs


@dataclass(frozen=True, slots=True)
class RecordFields:
    """Which record fields feed which part of a page."""

    id_field: str = "id"
    title_field: str = "title"
    text_field: str = "text"
    context_fields: tuple[str, ...] = ()
    metadata_fields: tuple[str, ...] = ()

    @classmethod
    def from_options(cls, source: str, options: Mapping[str, Any]) -> RecordFields:
        """Read the field options of a source; raises ConfigError naming a wrong one."""
        values: dict[str, Any] = {}
        for key in ("id_field", "title_field", "text_field"):
            if key in options:
                if not isinstance(options[key], str) or not options[key]:
                    raise ConfigError(f"source {source!r}: {key} must be a field name")
                values[key] = options[key]
        for key in ("context_fields", "metadata_fields"):
            if key in options:
                got = options[key]
                if not isinstance(got, list) or not all(isinstance(f, str) and f for f in got):
                    raise ConfigError(f"source {source!r}: {key} must be a list of field names")
                values[key] = tuple(got)
        return cls(**values)


def _scalar(value: object) -> str | None:
    """A field's value as text, or None when it is a list or mapping (not a usable text)."""
    if isinstance(value, list | dict):
        return None
    return metadata_value(value).strip()


def _page(source: str, record: Mapping[str, Any], fields: RecordFields) -> Page | str:
    """The page of one record, or the reason it is unusable."""
    rid = _scalar(record.get(fields.id_field))
    if not rid:
        return f"no {fields.id_field!r} (id_field)"
    raw_text = record.get(fields.text_field)
    text = _scalar(raw_text) if raw_text is not None else ""
    if text is None:
        return f"record {rid!r}: {fields.text_field!r} is a {type(raw_text).__name__}, not text"
    if not text:
        return f"record {rid!r}: no {fields.text_field!r} (text_field)"
    title = _scalar(record.get(fields.title_field)) or rid
    context_parts = (_scalar(record.get(f)) for f in fields.context_fields)
    metadata = {
        f: metadata_value(record[f]) for f in fields.metadata_fields if record.get(f) is not None
    }
    return Page(
        source=source,
        source_path=rid,
        title=title,
        text=text,
        kind="text",
        context=CONTEXT_SEPARATOR.join(p for p in context_parts if p),
        metadata=MappingProxyType(metadata),
    )


def _jsonl(path: Path) -> Iterator[tuple[int, Mapping[str, Any] | str]]:
    with path.open("rb") as f:
        for number, raw in enumerate(f, 1):
            try:
                line = raw.decode("utf-8").removeprefix("\ufeff").strip()
            except UnicodeDecodeError as exc:
                yield number, f"not valid UTF-8: {exc.reason} at byte {exc.start}"
                continue
            if not line:
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as exc:
                yield number, f"malformed JSON: {exc.msg} (column {exc.colno})"
                continue
            if not isinstance(record, dict):
                yield number, f"a JSON {type(record).__name__}, not an object"
                continue
            yield number, record


def _csv(path: Path, fields: RecordFields) -> Iterator[tuple[int, Mapping[str, Any] | str]]:
    try:
        f = path.open(encoding="utf-8-sig", newline="")
        with f:
            reader = csv.reader(f)
            header = next(reader, None)
            if header is None:
                return
            missing = [n for n in (fields.id_field, fields.text_field) if n not in header]
            if missing:
                raise SourceError(
                    f"{path.name}: no column {', '.join(map(repr, missing))} in the header "
                    f"({', '.join(header)})"
                )
            start = reader.line_num + 1
            while True:
                try:
                    row = next(reader)
                except StopIteration:
                    return
                except csv.Error as exc:
                    yield start, f"malformed CSV: {exc}"
                    start = reader.line_num + 1
                    continue
                line, start = start, reader.line_num + 1
                if not any(cell.strip() for cell in row):
                    continue
                if len(row) != len(header):
                    yield line, f"{len(row)} fields, the header has {len(header)}"
                    continue
                yield line, dict(zip(header, row, strict=True))
    except UnicodeDecodeError as exc:
        raise SourceError(f"{path.name}: not valid UTF-8: {exc.reason}") from exc


def load_records(
    source: str, path: Path, kind: str, fields: RecordFields
) -> tuple[list[Page], list[SkippedPage]]:
    """Read a ``jsonl`` or ``csv`` export; a bad record is skipped as ``<file>:<line>``.

    Raises SourceError when the file cannot be read at all (missing, or a CSV header without the
    id or text column).
    """
    if not path.is_file():
        raise SourceError(f"{kind} source {source!r}: {path} is not a file")
    records = _jsonl(path) if kind == "jsonl" else _csv(path, fields)
    pages: list[Page] = []
    skipped: list[SkippedPage] = []
    first_line: dict[str, int] = {}
    try:
        for line, record in records:
            where = f"{path.name}:{line}"
            page = record if isinstance(record, str) else _page(source, record, fields)
            if isinstance(page, str):
                skipped.append(SkippedPage(where, page))
            elif page.source_path in first_line:
                seen = first_line[page.source_path]
                skipped.append(
                    SkippedPage(where, f"duplicate id {page.source_path!r} (first at line {seen})")
                )
            else:
                first_line[page.source_path] = line
                pages.append(page)
    except OSError as exc:
        raise SourceError(f"{kind} source {source!r}: cannot read {path}: {exc}") from exc
    return pages, skipped
