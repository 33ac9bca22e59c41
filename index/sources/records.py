"""Record exports (``jsonl`` and ``csv``): one record per page, e.g. an FAQ or knowledge export.

The fields are named by the source's options: ``id_field`` (the page's ``source_path``, so a
result maps back to its record), ``title_field``, ``text_field``, ``context_fields`` (their values,
joined with " > ", become the contextual prefix embedded before the text, e.g. an entity name)
and ``metadata_fields`` (kept on every chunk as strings, a list as a list of strings). A record that is malformed, lacks an id
or text, or repeats an id is skipped with its line number; the rest are indexed.
"""

from __future__ import annotations

import csv
import json
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType
from typing import Any, BinaryIO, TextIO

from index.errors import ConfigError, SourceError
from index.sources import PageBytes, SkippedPage
from index.sources.folder import DEFAULT_MAX_PAGE_BYTES, too_large
from index.sources.markdown import metadata_entry, metadata_value
from index.types import Page

__all__ = ["RecordFields", "load_records"]

CONTEXT_SEPARATOR = " > "  # the same joint as heading breadcrumbs
# A record is an object of fields; values nested deeper than this are not knowledge, and walking
# them (metadata_value) recurses once per level. The JSON parser itself stops at Python's
# recursion limit (about 1,000 levels), which depends on the caller's stack: this one does not.
MAX_JSON_DEPTH = 64
# Skipped records a file's report names one by one; past them they are counted (``_Skips``).
MAX_SKIPS_NAMED = 1_000
_TOO_DEEP = f"nested too deeply (arrays or objects more than {MAX_JSON_DEPTH} levels deep)"


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
        """Read the field options of a source (their types checked at load: a string, a list
        of strings); raises ConfigError naming an empty name."""
        values: dict[str, Any] = {}
        for key in ("id_field", "title_field", "text_field"):
            if key in options:
                if not options[key]:
                    raise ConfigError(f"source {source!r}: {key} must be a field name")
                values[key] = options[key]
        for key in ("context_fields", "metadata_fields"):
            if key in options:
                if not all(options[key]):
                    raise ConfigError(f"source {source!r}: {key} must be a list of field names")
                values[key] = tuple(options[key])
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
        f: metadata_entry(record[f]) for f in fields.metadata_fields if record.get(f) is not None
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


# (the line a record starts on, the record or why it is unusable)
Read = tuple[int, Mapping[str, Any] | str]


def _binary_lines(f: BinaryIO, limit: int) -> Iterator[tuple[int, bytes | int]]:
    """(line number, line) of a binary file; for a line over ``limit`` bytes (its newline not
    counted), (line number, its size): such a line is read past, never held whole."""
    number = 0
    while raw := f.readline(limit + 1):
        number += 1
        if len(raw) <= limit or (len(raw) == limit + 1 and raw.endswith(b"\n")):
            yield number, raw
            continue
        size = len(raw)
        while not raw.endswith(b"\n") and (raw := f.readline(1 << 20)):
            size += len(raw)
        yield number, size - raw.endswith(b"\n")


def _json_record(raw: bytes) -> Mapping[str, Any] | str | None:
    """The object on one jsonl line, None for a blank line, or why the line is unusable."""
    try:
        line = raw.decode("utf-8").removeprefix("\ufeff").strip()
    except UnicodeDecodeError as exc:
        return f"not valid UTF-8: {exc.reason} at byte {exc.start}"
    if not line:
        return None
    try:
        record = json.loads(line)
    except json.JSONDecodeError as exc:
        return f"malformed JSON: {exc.msg} (column {exc.colno})"
    except RecursionError:
        return _TOO_DEEP
    except ValueError:  # int() refuses a number of more than 4,300 digits
        return "malformed JSON: a number of more digits than can be read (4,300)"
    if not isinstance(record, dict):
        return f"a JSON {type(record).__name__}, not an object"
    return _TOO_DEEP if _deeper_than(record, MAX_JSON_DEPTH) else record


def _deeper_than(value: object, limit: int) -> bool:
    """Whether a parsed JSON value nests arrays or objects more than ``limit`` levels deep."""
    todo: list[tuple[object, int]] = [(value, 1)]
    while todo:
        item, depth = todo.pop()
        if not isinstance(item, dict | list):
            continue
        if depth > limit:
            return True
        children = item.values() if isinstance(item, dict) else item
        todo.extend((child, depth + 1) for child in children)
    return False


def _jsonl(path: Path, limit: int) -> Iterator[Read]:
    with path.open("rb") as f:
        for number, raw in _binary_lines(f, limit):
            got = too_large(raw, limit) if isinstance(raw, int) else _json_record(raw)
            if got is not None:
                yield number, got


class _Repeated(csv.Error):
    """A record that runs on into the lines of a record refused before it.

    Every line of that record but its last ended inside a quoted field, and the parser carries
    nothing else from one line to the next, so a record that goes on past one of those lines
    reads the rest alike and ends with the same error on the same line: ``cause`` at line
    ``end``, known without reading those lines again (reading them again for each of them was
    quadratic: a file of lines that each leave a quote open). Not for a field over the field
    limit, which depends on where the field began.
    """

    def __init__(self, cause: csv.Error, start: int, end: int) -> None:
        super().__init__(str(cause))
        self.cause, self.start, self.end = cause, start, end


class _TooLarge(csv.Error):
    """The record being read holds more than ``max_page_bytes``: it is read no further."""

    def __init__(self, size: int) -> None:
        super().__init__(f"{size} bytes")
        self.size = size


class _HeldLines:
    """The lines of a file for ``csv.reader``, holding those of the record being read: when a
    record turns out broken, the lines after its first are read again as records of their own,
    so an unclosed quote costs one line, not every record up to the next quote.

    A record is held to ``limit`` bytes as it is read: one over it (a line, or a quote left open
    for megabytes) is refused as too large, and its lines are not read again."""

    def __init__(self, f: TextIO, limit: int) -> None:
        self._file = f
        self._limit = limit
        self._again: list[str] = []  # reversed: the next line to read again is last
        self._refused: _Repeated | None = None  # the last record refused over several lines
        self._held_chars = 0
        self.held: list[str] = []
        self.number = 0  # of the last line handed out

    def __iter__(self) -> _HeldLines:
        return self

    def __next__(self) -> str:
        refused = self._refused
        if self.held and refused is not None and refused.start <= self.number < refused.end:
            raise refused
        line = self._again.pop() if self._again else self._read_line()
        self.number += 1
        self._held_chars += len(line)
        if self._held_chars > self._limit:  # a character is at least a byte
            raise _TooLarge(sum(map(_utf8_size, self.held)) + _utf8_size(line))
        self.held.append(line)
        return line

    def _read_line(self) -> str:
        """The next line of the file; one over the limit is read past, never held whole."""
        line = self._file.readline(self._limit + 1)
        if not line:
            raise StopIteration
        if len(line) <= self._limit or line.endswith(("\n", "\r")):
            return line
        size = _utf8_size(line)
        while line and not line.endswith(("\n", "\r")):
            line = self._file.readline(1 << 20)
            size += _utf8_size(line)
        self.number += 1  # the line read past
        raise _TooLarge(size - line.endswith(("\n", "\r")))  # its newline not counted

    def next_record(self) -> int:
        """Start a record: forget the lines held; returns the number of its first line."""
        self.held.clear()
        self._held_chars = 0
        return self.number + 1

    def refuse(self, exc: csv.Error, start: int) -> tuple[csv.Error, int]:
        """The record from line ``start`` is broken by ``exc``: ``(the error, its last line)``.
        The lines after its first are read again, unless it was too large."""
        if isinstance(exc, _Repeated):
            self.held.clear()
            return exc.cause, exc.end
        end, again = self.number, self.held[1:]
        self.held.clear()
        if isinstance(exc, _TooLarge):
            return exc, end
        self._again.extend(reversed(again))
        self.number -= len(again)
        if again and not str(exc).startswith("field larger than field limit"):
            self._refused = _Repeated(exc, start, end)
        return exc, end


def _utf8_size(line: str) -> int:
    return len(line.encode("utf-8", "surrogateescape"))


def _csv_error(exc: csv.Error, start: int, end: int, limit: int) -> str:
    if isinstance(exc, _TooLarge):
        where = f" (a record from this line to line {end}: an open quote?)" if end > start else ""
        return too_large(exc.size, limit) + where
    if str(exc).startswith("unexpected end of data"):
        return "malformed CSV: a quote opened in this record is never closed"
    if end > start:
        return f"malformed CSV: {exc} (in a record from this line to line {end}: an open quote?)"
    return f"malformed CSV: {exc}"


def _csv_held_problem(lines: _HeldLines, start: int, limit: int) -> str:
    """Why the lines of a parsed record are unusable (not UTF-8, too large), or ""."""
    size = 0
    for number, line in enumerate(lines.held, start):
        try:
            size += len(line.encode("utf-8"))
        except UnicodeEncodeError as exc:  # a byte surrogateescape kept
            return f"not valid UTF-8 (line {number}, character {exc.start + 1})"
    return too_large(size, limit) if size > limit else ""


def _csv_header(reader: Iterator[list[str]], path: Path, fields: RecordFields) -> list[str] | None:
    try:
        header = next(reader, None)
    except csv.Error as exc:
        raise SourceError(f"{path.name}: malformed CSV header: {exc}") from exc
    if header is None:
        return None
    if any("\udc80" <= c <= "\udcff" for name in header for c in name):
        raise SourceError(f"{path.name}: the header is not valid UTF-8")
    missing = [n for n in (fields.id_field, fields.text_field) if n not in header]
    if missing:
        raise SourceError(
            f"{path.name}: no column {', '.join(map(repr, missing))} in the header "
            f"({', '.join(header)})"
        )
    return header


def _csv_rows(
    reader: Iterator[list[str]], lines: _HeldLines, header: list[str], limit: int
) -> Iterator[Read]:
    while True:
        start = lines.next_record()
        try:
            row = next(reader)
        except StopIteration:
            return
        except csv.Error as exc:
            cause, end = lines.refuse(exc, start)
            yield start, _csv_error(cause, start, end, limit)
            continue
        problem = _csv_held_problem(lines, start, limit)
        if problem:
            yield start, problem
        elif not any(cell.strip() for cell in row):
            continue
        elif len(row) != len(header):
            yield start, f"{len(row)} fields, the header has {len(header)}"
        else:
            yield start, dict(zip(header, row, strict=True))


def _csv(path: Path, fields: RecordFields, limit: int) -> Iterator[Read]:
    # strict: a character after a closing quote is an error, not glued to the field; a byte
    # that is not UTF-8 is kept as a surrogate and reported with the record that holds it.
    with path.open(encoding="utf-8-sig", errors="surrogateescape", newline="") as f:
        lines = _HeldLines(f, limit)
        reader = csv.reader(lines, strict=True)
        header = _csv_header(reader, path, fields)
        if header is not None:
            yield from _csv_rows(reader, lines, header, limit)


def load_records(
    source: str,
    path: Path,
    kind: str,
    fields: RecordFields,
    max_page_bytes: int = DEFAULT_MAX_PAGE_BYTES,
    budget: PageBytes | None = None,
) -> tuple[list[Page], list[SkippedPage]]:
    """Read a ``jsonl`` or ``csv`` export; a bad record (malformed, nested too deeply, over
    ``max_page_bytes``, ...) is skipped as ``<file>:<line>``.

    Raises SourceError when the file cannot be read at all (missing, or a CSV header without the
    id or text column), BaseTooLarge when the pages pass ``budget`` (default: this source's own).
    """
    budget = budget or PageBytes(source)
    if not path.is_file():
        raise SourceError(f"{kind} source {source!r}: {path} is not a file")
    records = (
        _jsonl(path, max_page_bytes) if kind == "jsonl" else _csv(path, fields, max_page_bytes)
    )
    pages: list[Page] = []
    skipped = _Skips(path.name)
    first_line: dict[str, int] = {}
    try:
        for line, record in records:
            page = record if isinstance(record, str) else _page(source, record, fields)
            if isinstance(page, str):
                skipped.add(line, page)
            elif page.source_path in first_line:
                seen = first_line[page.source_path]
                skipped.add(line, f"duplicate id {page.source_path!r} (first at line {seen})")
            else:
                first_line[page.source_path] = line
                budget.take(page)
                pages.append(page)
    except OSError as exc:
        raise SourceError(f"{kind} source {source!r}: cannot read {path}: {exc}") from exc
    return pages, skipped.listed()


class _Skips:
    """A file's skipped records for the report: the first MAX_SKIPS_NAMED by line, the rest
    counted in one entry after them. Each named one is held to the end of the build, and an
    export of millions of bad lines (``x`` on each) held ~460 bytes a line: 1.85 GB for 8 MB."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.named: list[SkippedPage] = []
        self.more = 0
        self.last = 0

    def add(self, line: int, reason: str) -> None:
        if len(self.named) < MAX_SKIPS_NAMED:
            self.named.append(SkippedPage(f"{self.name}:{line}", reason))
        else:
            self.more += 1
            self.last = line

    def listed(self) -> list[SkippedPage]:
        if not self.more:
            return self.named
        named = f"the first {MAX_SKIPS_NAMED:,} are named"
        why = f"{self.more:,} more records skipped, to line {self.last:,} ({named})"
        return [*self.named, SkippedPage(self.name, why)]
