"""A folder of Markdown files (``*.md``, ``*.markdown``) with optional YAML frontmatter.

Each file is one page: ``source_path`` is its POSIX path relative to the folder, its frontmatter
keys become the page's metadata (a list as a list of strings, any other value as a string), and its title is the frontmatter
``title``, else the first H1, else the file name's stem. A file that is not UTF-8, or whose
frontmatter is not a YAML mapping, is skipped with the reason.
"""

from __future__ import annotations

import datetime as dt
import json
import re
import sys
from collections.abc import Mapping
from pathlib import Path
from types import MappingProxyType

import yaml

from index.chunker import first_h1
from index.errors import SourceError
from index.sources import PageBytes, SkippedPage
from index.sources.folder import DEFAULT_OPTIONS, FolderOptions, list_files, read_file
from index.sources.text import decode_utf8
from index.types import MetaValue, Page

__all__ = [
    "MARKDOWN_SUFFIXES",
    "FrontmatterError",
    "load_markdown",
    "markdown_page",
    "split_frontmatter",
]

MARKDOWN_SUFFIXES = (".md", ".markdown")

_FENCE = "---"
_BRACKETS_RE = re.compile(r"[\[\]{}]")
_CLOSERS = ("---", "...")
# Frontmatter is a few fields. YAML aliases can make a few lines expand to billions of values
# ("billion laughs") or into a cycle; metadata_value would walk either until memory runs out.
MAX_FRONTMATTER_VALUES = 10_000
# ... and a few aliases of a long string expand into hundreds of megabytes in few values: 26 kB of
# frontmatter became one 223 MB metadata string (RSS 445 MiB per page; load_markdown holds every
# page). Its scalars, aliases expanded, are counted in bytes too (the chunker's MAX_META_BYTES cuts
# only once the page is in memory). Twice MAX_FRONTMATTER_BYTES: room for a tag list reused by
# alias, never a page's worth of text. Aliases stay allowed: they are ordinary YAML.
MAX_FRONTMATTER_EXPANDED_BYTES = 64 * 1024
# PyYAML is pure Python: 200 kB of frontmatter took 14 s to parse, the 8 MiB a page may hold
# ten minutes. Frontmatter is a few fields; its size is checked before it is parsed.
MAX_FRONTMATTER_BYTES = 32 * 1024
# PyYAML's scanner slows down more than quadratically with nested flow collections: 1,000
# "[" took 0.65 s, 2,000 took 6.7 s (before the recursion limit stopped it). Frontmatter nests
# a level or two; brackets are counted (quoted or not: a conservative count) before parsing.
MAX_FRONTMATTER_DEPTH = 64


class FrontmatterError(SourceError):
    """The frontmatter is unterminated, not valid YAML, or not a mapping; the message says which."""


def split_frontmatter(raw: str) -> tuple[dict[str, object] | None, str, int]:
    """Split a Markdown text into its YAML frontmatter and its body.

    Returns ``(mapping, body, lines)``: ``mapping`` is None when the text does not start with a
    ``---`` line (then ``body`` is the whole text and ``lines`` is 0); otherwise it is the parsed
    frontmatter (``{}`` when empty), ``body`` is the text after the closing ``---`` (or ``...``)
    line and ``lines`` counts the frontmatter's lines, both fence lines included, so body line
    ``n`` is file line ``n + lines``. Raises FrontmatterError when the closing line is missing,
    the YAML is malformed, or it is not a mapping.
    """
    text = raw.removeprefix("\ufeff")
    opening, _, rest = text.partition("\n")
    if opening.rstrip() != _FENCE:
        return None, text, 0
    at, close = _closing_line(rest)
    source = rest[: max(0, at - 1)]
    _check_text(source)
    try:
        data = yaml.safe_load(source)
    except yaml.MarkedYAMLError as exc:
        problem = exc.problem or str(exc).strip().split("\n", 1)[0]
        where = f" (line {exc.problem_mark.line + 2})" if exc.problem_mark is not None else ""
        raise FrontmatterError(f"malformed frontmatter: {problem}{where}") from exc
    except (yaml.YAMLError, ValueError, TypeError, OverflowError, RecursionError) as exc:
        first = str(exc).strip().split("\n", 1)[0] or type(exc).__name__
        raise FrontmatterError(f"malformed frontmatter: {first}") from exc
    if data is None:
        data = {}
    _check_size(data)
    if not isinstance(data, dict):
        raise FrontmatterError(
            f"malformed frontmatter: not a mapping (a YAML {type(data).__name__})"
        )
    end = rest.find("\n", at)  # of the closing line
    body = rest[end + 1 :] if end >= 0 else ""
    return {str(k): v for k, v in data.items()}, body, close + 1


def _closing_line(rest: str) -> tuple[int, int]:
    """Where the frontmatter's closing line starts in ``rest`` (the text after the opening
    line), and its line index in the whole text; the lines are looked at one at a time, not
    split all at once (a page of 8 MiB of short lines was a list of 1.7 million strings)."""
    at, close = 0, 1
    while True:
        nl = rest.find("\n", at)
        if (rest[at:] if nl < 0 else rest[at:nl]).rstrip() in _CLOSERS:
            return at, close
        if nl < 0:
            raise FrontmatterError("malformed frontmatter: no closing '---' line")
        at, close = nl + 1, close + 1


def _check_text(source: str) -> None:
    """Raise FrontmatterError when the YAML text is too large or nests too deep to parse."""
    size = len(source.encode("utf-8", "surrogatepass"))
    if size > MAX_FRONTMATTER_BYTES:
        raise FrontmatterError(
            f"malformed frontmatter: {size:,} bytes; the limit is {MAX_FRONTMATTER_BYTES:,} "
            "(frontmatter is a few fields: put the text in the page)"
        )
    depth = deepest = 0
    for bracket in _BRACKETS_RE.findall(source):
        depth = depth + 1 if bracket in "[{" else max(0, depth - 1)
        deepest = max(deepest, depth)
    if deepest > MAX_FRONTMATTER_DEPTH:
        raise FrontmatterError(
            f"malformed frontmatter: [ and {{ nested {deepest} deep; the limit is "
            f"{MAX_FRONTMATTER_DEPTH}"
        )


def _check_size(data: object) -> None:
    """Raise FrontmatterError when ``data``, aliases expanded, holds too many values (a cycle
    holds infinitely many) or too many bytes; an alias counts each time it is used, and is
    never expanded. The walk stops at either limit, so it is cheap either way."""
    todo, seen, size = [data], 0, 0
    sizes: dict[int, int] = {}  # id -> UTF-8 bytes of a scalar, measured once however shared
    while todo:
        value = todo.pop()
        seen += 1
        if seen > MAX_FRONTMATTER_VALUES:
            raise FrontmatterError(
                f"malformed frontmatter: more than {MAX_FRONTMATTER_VALUES} values once its "
                "YAML aliases are expanded (or an alias refers to itself)"
            )
        if isinstance(value, Mapping):
            todo.extend(value.keys())
            todo.extend(value.values())
        elif isinstance(value, list | tuple | set | frozenset):
            todo.extend(value)
        else:
            size += _scalar_bytes(value, sizes)
            _check_expanded(size)


def _scalar_bytes(value: object, sizes: dict[int, int]) -> int:
    """The UTF-8 bytes of one scalar as metadata writes it, plus 2 for its separator."""
    got = sizes.get(id(value))
    if got is None:
        got = sizes[id(value)] = len(_scalar_text(value).encode("utf-8", "surrogatepass")) + 2
    return got


def _scalar_text(value: object) -> str:
    """``metadata_value`` of one scalar, or FrontmatterError when it cannot be written as text:
    YAML reads a hex, octal, binary or sexagesimal integer of any length, but Python writes no integer
    of more than ``sys.get_int_max_str_digits()`` decimal digits. Every scalar goes through
    here before the page's metadata and title are written, so those conversions cannot fail."""
    try:
        return metadata_value(value)
    except ValueError as exc:
        raise FrontmatterError(
            f"malformed frontmatter: a number of more than {sys.get_int_max_str_digits():,} "
            "digits (too long to write as text)"
        ) from exc


def _check_expanded(size: int) -> None:
    if size > MAX_FRONTMATTER_EXPANDED_BYTES:
        raise FrontmatterError(
            f"malformed frontmatter: more than {MAX_FRONTMATTER_EXPANDED_BYTES:,} bytes once "
            "its YAML aliases are expanded (an alias counts each time it is used)"
        )


def _json_default(value: object) -> str:
    if isinstance(value, dt.date | dt.time):
        return value.isoformat()
    return str(value)


def _str_keys(value: object) -> object:
    """``value`` with every mapping's keys written as ``metadata_value`` writes a value: YAML
    keys may be dates, numbers or bytes (``2024-01-01: launch``), which json.dumps refuses."""
    if isinstance(value, Mapping):
        return {metadata_value(k): _str_keys(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_str_keys(v) for v in value]
    return value


def metadata_value(value: object) -> str:
    """One frontmatter value as a metadata string: lists joined with ", ", dates in ISO format,
    mappings as compact JSON, booleans as YAML writes them, None as ""."""
    if value is None:
        return ""
    if isinstance(value, str):
        return value
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, dt.date | dt.time):
        return value.isoformat()
    if isinstance(value, list | tuple | set | frozenset):
        return ", ".join(metadata_value(v) for v in value)
    if isinstance(value, Mapping):
        keyed = _str_keys(value)
        return json.dumps(keyed, ensure_ascii=False, separators=(",", ":"), default=_json_default)
    if isinstance(value, bytes):
        return value.decode("utf-8", errors="replace")
    return str(value)


def metadata_entry(value: object) -> MetaValue:
    """One frontmatter value as page metadata: a list stays a list (of strings, each as
    ``metadata_value`` writes it), so a filter can match any of its elements; anything else is
    ``metadata_value``'s string."""
    if isinstance(value, list | tuple):
        return tuple(metadata_value(v) for v in value)
    return metadata_value(value)


def _title(frontmatter: Mapping[str, object], body: str, path: Path) -> str:
    title = metadata_value(frontmatter.get("title")).strip()
    return title or first_h1(body) or path.stem


def load_markdown(
    source: str,
    root: Path,
    options: FolderOptions = DEFAULT_OPTIONS,
    budget: PageBytes | None = None,
) -> tuple[list[Page], list[SkippedPage]]:
    """Read every Markdown file under ``root`` (recursively, sorted by relative path;
    ``index.sources.folder`` says which files).

    Returns the pages and the files skipped with their reasons; a bad file never raises.
    Raises SourceError only when ``root`` is not a folder, BaseTooLarge when the pages pass
    ``budget`` (default: this source's own, at the default limit).
    """
    budget = budget or PageBytes(source)
    if not root.is_dir():
        raise SourceError(f"markdown source {source!r}: {root} is not a folder")
    listing = list_files(root, MARKDOWN_SUFFIXES, follow_symlinks=options.follow_symlinks)
    pages: list[Page] = []
    skipped = listing.skipped
    for rel, path in listing.files:
        data = read_file(rel, path, options.max_page_bytes)
        got = data if isinstance(data, SkippedPage) else markdown_page(source, rel, path, data)
        if isinstance(got, SkippedPage):
            skipped.append(got)
        else:
            budget.take(got)
            pages.append(got)
    return pages, skipped


def markdown_page(source: str, rel: str, path: Path, data: bytes) -> Page | SkippedPage:
    """The page of one Markdown file, or why it cannot be used."""
    raw = decode_utf8(rel, data)
    if isinstance(raw, SkippedPage):
        return raw
    try:
        frontmatter, body, _ = split_frontmatter(raw)
    except FrontmatterError as exc:
        return SkippedPage(rel, str(exc))
    fm = frontmatter or {}
    return Page(
        source=source,
        source_path=rel,
        title=_title(fm, body, path),
        text=body,
        kind="markdown",
        metadata=MappingProxyType({k: metadata_entry(v) for k, v in fm.items()}),
    )
