"""Validation of a Markdown docs folder, and its manifest (``voxrecall index validate``).

Checks, each reported as ``path:line: message``:

    required-file    a configured file (e.g. Home.md, _Sidebar.md) is missing
    unreadable       a page is not UTF-8 or its frontmatter is malformed (the build skips it)
    duplicate-title  two pages share a title (compared case- and space-insensitively)
    last-updated     no ``Last updated: YYYY-MM-DD`` line (or frontmatter ``last_updated``)
                     when required, or one whose date is not a real YYYY-MM-DD date
    broken-link      a relative link to a page or file that does not exist
    sidebar-link     a link in a ``_Sidebar.md`` to a page that does not exist
    stale-manifest   ``docs-manifest.json`` disagrees with the pages

Links are resolved the way a docs site serves them: ``page.md`` and ``page`` (or ``page/``)
both name ``page.md`` (or ``page/_index.md``, ``page/index.md``, ``page/README.md``) relative to
the linking page's folder; a link starting with ``/`` is relative to the site root, which is the
folder itself or, for a Hugo site, its ``content/`` folder; such a root link to a non-page file
(``/img/logo.svg``) is a static asset that lives outside the docs and is not checked. External
links (any ``scheme:``), pure ``#anchors`` and Hugo shortcodes (``{{< ... >}}``) are not checked.
Links inside code fences and inline code are not links. ``[[Wiki links]]`` are checked in a
GitHub wiki (a folder with ``_Sidebar.md`` or ``Home.md``), where they name a page anywhere.
"""

from __future__ import annotations

import bisect
import contextlib
import datetime as dt
import hashlib
import json
import os
import re
import urllib.parse
from collections import Counter
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath
from typing import Any

from index.errors import ConfigError, SourceError, shortened
from index.snapshot import write_atomic
from index.sources import sound_pages
from index.sources.folder import DEFAULT_OPTIONS, FolderOptions, list_files
from index.sources.markdown import (
    MARKDOWN_SUFFIXES,
    FrontmatterError,
    load_markdown,
    split_frontmatter,
)
from index.types import MetaValue, meta_text

__all__ = [
    "MANIFEST_NAME",
    "DocsReport",
    "Problem",
    "ValidateOptions",
    "build_manifest",
    "validate_docs",
    "write_manifest",
]

MANIFEST_NAME = "docs-manifest.json"
SIDEBAR = "_sidebar.md"
# GitHub wiki chrome: shown around every page, not pages themselves.
CHROME = frozenset({"_sidebar.md", "_footer.md", "_header.md"})
FINGERPRINT_CHARS = 12  # 48 bits: no accidental collision in any docs set
MAX_SHOWN_TARGET = 200  # of a broken link's target, in its problem line
_INDEX_NAMES = ("_index.md", "index.md", "README.md")

_FENCE_RE = re.compile(r" {0,3}(`{3,}|~{3,})")
_BACKTICKS_RE = re.compile(r"`+")
_SHORTCODE_RE = re.compile(r"\{\{[<%].*?[>%]\}\}")
_INLINE_LINK_RE = re.compile(r"!?\[(?:[^\[\]]|\[[^\[\]]*\])*\]\(\s*(<[^>]*>|[^)\s]+)[^)]*\)")
_REF_DEF_RE = re.compile(r" {0,3}\[[^\]]+\]:\s*(<[^>]*>|\S+)")
_WIKI_LINK_RE = re.compile(r"\[\[([^\[\]|]+)(?:\|([^\[\]]+))?\]\]")
_SCHEME_RE = re.compile(r"[A-Za-z][A-Za-z0-9+.-]*:")
_LAST_UPDATED_RE = re.compile(r"last updated[*_]*\s*:\s*[*_]*\s*([^\s*_]*)", re.IGNORECASE)
_DATE_RE = re.compile(r"\d{4}-\d{2}-\d{2}")
_TITLE_KEY_RE = re.compile(r"title\s*:")
_REASON_LINE_RE = re.compile(r"\(line (\d+)\)$")  # the frontmatter error's line


@dataclass(frozen=True, slots=True)
class Problem:
    """One finding: where it is (path relative to the docs folder, 1-based line), its kind and
    what is wrong."""

    path: str
    line: int
    kind: str
    message: str

    def __str__(self) -> str:
        return f"{self.path}:{self.line}: {self.message}"


@dataclass(frozen=True, slots=True)
class ValidateOptions:
    """What a docs folder must have beyond well-formed pages."""

    required_files: tuple[str, ...] = ()
    require_last_updated: bool = False
    folder: FolderOptions = DEFAULT_OPTIONS  # which files are pages, as the build reads them

    @classmethod
    def from_options(cls, source: str, options: Mapping[str, Any]) -> ValidateOptions:
        """Read the ``required_files`` and ``require_last_updated`` options of a source, and
        the folder options it is built with."""
        files = options.get("required_files", [])  # the types checked at load (check_options)
        if not all(files):
            raise ConfigError(f"source {source!r}: required_files must be a list of file names")
        required = options.get("require_last_updated", False)
        folder = FolderOptions.from_options(source, options)
        return cls(tuple(files), required, folder)

    def merged(self, other: ValidateOptions) -> ValidateOptions:
        """Both sets of requirements (command-line flags added to the config's, whose folder
        options are kept)."""
        files = tuple(dict.fromkeys(self.required_files + other.required_files))
        required = self.require_last_updated or other.require_last_updated
        return ValidateOptions(files, required, self.folder)


@dataclass(frozen=True, slots=True)
class PageEntry:
    """A page as the manifest records it, with the line its title is on."""

    path: str
    title: str
    fingerprint: str
    last_updated: str | None
    title_line: int = 1


@dataclass(slots=True)
class DocsReport:
    """The result of validating a folder: its pages and the problems found, in file order."""

    root: Path
    pages: list[PageEntry] = field(default_factory=list)
    problems: list[Problem] = field(default_factory=list)

    def counts(self) -> dict[str, int]:
        return dict(Counter(p.kind for p in self.problems))


# --- scanning one page -------------------------------------------------------------------------


def _content_lines(lines: Sequence[str], first: int) -> Iterator[tuple[int, str]]:
    """(1-based file line, text without inline code) of every line outside fenced code."""
    fence: tuple[str, int] | None = None
    for i, line in enumerate(lines, first):
        m = _FENCE_RE.match(line)
        if fence is not None:
            if m and m.group(1)[0] == fence[0] and len(m.group(1)) >= fence[1]:
                fence = None if not line[m.end() :].strip() else fence
            continue
        if m and not (m.group(1)[0] == "`" and "`" in line[m.end() :]):
            fence = (m.group(1)[0], len(m.group(1)))
            continue
        yield i, _without_code_spans(line)


def _without_code_spans(line: str) -> str:
    """``line`` less its code spans: a run of backticks through the next run of the same length
    (CommonMark's rule; a run with no such closer is text). Each run is looked up once: the
    pattern this replaces backtracked in cubic time (a line of 1,000 backticks took 15 s)."""
    runs = [(m.start(), m.end()) for m in _BACKTICKS_RE.finditer(line)]
    if len(runs) < 2:
        return line
    by_length: dict[int, list[int]] = {}
    for index, (start, end) in enumerate(runs):
        by_length.setdefault(end - start, []).append(index)
    kept: list[str] = []
    pos = i = 0
    while i < len(runs):
        start, end = runs[i]
        same = by_length[end - start]
        after = bisect.bisect_right(same, i)
        if after == len(same):
            i += 1
            continue
        closer = same[after]
        kept.append(line[pos:start])
        pos, i = runs[closer][1], closer + 1
    kept.append(line[pos:])
    return "".join(kept)


def _links(text: str, wiki: bool) -> Iterator[tuple[str, bool]]:
    """(target, is_wiki_link) of each link on a line."""
    text = _without_shortcodes(text)
    # Every inline link ends in ")": past the last one the pattern can only fail, and each try
    # that scans to the end of the line fails slowly (quadratic over a line of "[a](x").
    for m in _INLINE_LINK_RE.finditer(text, 0, text.rfind(")") + 1):
        yield m.group(1).strip("<>"), False
    ref = _REF_DEF_RE.match(text)
    if ref:
        yield ref.group(1).strip("<>"), False
    if wiki:
        for w in _WIKI_LINK_RE.finditer(text):
            yield (w.group(2) or w.group(1)).strip(), True


def _without_shortcodes(text: str) -> str:
    """``text`` less its ``{{< ... >}}`` and ``{{% ... %}}`` shortcodes. Only the text up to
    the last closing ``>}}`` or ``%}}`` is searched: an opening with no closing after it scans
    to the end of the line, and a line of openings did so for each (quadratic)."""
    end = max(text.rfind(">}}"), text.rfind("%}}")) + 3
    if end < 3:
        return text
    return _SHORTCODE_RE.sub("", text[:end]) + text[end:]


def _last_updated(lines: Iterator[tuple[int, str]]) -> tuple[int, str] | None:
    for number, line in lines:
        m = _LAST_UPDATED_RE.search(line)
        if m:
            return number, m.group(1)
    return None


def _valid_date(value: str) -> bool:
    if not _DATE_RE.fullmatch(value):
        return False
    try:
        dt.date.fromisoformat(value)
    except ValueError:
        return False
    return True


# --- link resolution ---------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class _Site:
    root: Path
    link_root: Path  # what "/x" is relative to
    stems: frozenset[str]  # lower-cased page stems, for wiki links
    wiki: bool
    hugo: bool

    @classmethod
    def of(cls, root: Path, paths: Sequence[str]) -> _Site:
        content = root / "content"
        hugo = content.is_dir() and not any("/" not in p for p in paths)
        stems = frozenset(PurePosixPath(p).stem.lower() for p in paths)
        wiki = (root / "_Sidebar.md").is_file() or (root / "Home.md").is_file()
        return cls(root, content if hugo else root, stems, wiki, hugo)

    def _base(self, page: str, rooted: bool, pretty: bool) -> Path:
        if rooted:
            return self.link_root
        folder = (self.root / page).parent
        stem = PurePosixPath(page).stem
        if self.hugo and pretty and stem not in ("_index", "index"):
            return folder / stem  # Hugo serves content/a.md at /a/: "b/" from it is /a/b/
        return folder

    def missing(self, page: str, target: str, wiki_link: bool) -> str | None:
        """Why ``target`` linked from ``page`` is broken, or None when it resolves (or is not
        checked)."""
        if wiki_link:
            name = target.replace(" ", "-").lower().removesuffix(".md")
            return None if name in self.stems else "no such page"
        if not target or target.startswith(("#", "//")) or _SCHEME_RE.match(target):
            return None
        path = urllib.parse.unquote(target.split("#", 1)[0].split("?", 1)[0])
        if not path:
            return None
        rooted = path.startswith("/")
        suffix = PurePosixPath(path.rstrip("/")).suffix.lower()
        pretty = not suffix or path.endswith("/")
        base = self._base(page, rooted, pretty)
        candidate = Path(os.path.normpath(base / path.lstrip("/")))
        try:
            return self._on_disk(candidate, base, suffix, rooted, pretty)
        except OSError as exc:  # a target of thousands of characters: no file has that name
            return f"no such page ({exc.strerror or exc})"

    def _on_disk(
        self, candidate: Path, base: Path, suffix: str, rooted: bool, pretty: bool
    ) -> str | None:
        """``missing``'s answer for a link resolved to ``candidate`` (from ``base``)."""
        if suffix in MARKDOWN_SUFFIXES:
            return None if candidate.is_file() else "no such page"
        if not pretty:
            if rooted:
                return None  # a static asset: served from outside the docs folder
            return None if candidate.exists() else "no such file"
        options = [candidate.with_name(candidate.name + s) for s in MARKDOWN_SUFFIXES]
        options += [candidate / name for name in _INDEX_NAMES]
        if candidate.exists() or any(o.is_file() for o in options):
            return None
        if self.hugo and not rooted and base.is_relative_to(self.link_root):
            served = "/" + base.relative_to(self.link_root).as_posix().strip(".") + "/"
            return f"no such page: Hugo resolves it from {served.replace('//', '/')}"
        return "no such page"  # a page outside content/ is not served by Hugo at all


# --- the folder --------------------------------------------------------------------------------


def _fingerprint(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()[:FINGERPRINT_CHARS]


def validate_docs(root: Path, options: ValidateOptions = ValidateOptions()) -> DocsReport:
    """Check a docs folder; never raises for a bad page (that is a problem in the report).

    Raises SourceError only when ``root`` is not a folder.
    """
    if not root.is_dir():
        raise SourceError(f"{root} is not a folder")
    report = DocsReport(root=root)
    for name in options.required_files:
        if not (root / name).is_file():
            report.problems.append(Problem(name, 1, "required-file", "required file is missing"))
    pages, skipped = load_markdown("docs", root, options.folder)
    pages, unsound = sound_pages(pages)  # as the build skips them
    for s in skipped + unsound:
        at = _REASON_LINE_RE.search(s.reason)
        line = int(at.group(1)) if at else 1
        report.problems.append(Problem(s.path, line, "unreadable", f"unreadable page: {s.reason}"))
    titles = {p.source_path: p for p in pages}
    files = list_files(
        root, MARKDOWN_SUFFIXES, follow_symlinks=options.folder.follow_symlinks
    ).files
    site = _Site.of(root, [rel for rel, _ in files])
    for rel, path in files:
        page = titles.get(rel)
        if page is not None:
            _check_page(report, site, options, rel, path.read_bytes(), page.title, page.metadata)
    _check_titles(report)
    _check_manifest(report)
    report.problems.sort(key=lambda p: (p.path, p.line))
    return report


def _check_page(
    report: DocsReport,
    site: _Site,
    options: ValidateOptions,
    rel: str,
    data: bytes,
    title: str,
    metadata: Mapping[str, MetaValue],
) -> None:
    text = data.decode("utf-8").removeprefix("\ufeff").replace("\r\n", "\n").replace("\r", "\n")
    try:
        frontmatter, _, offset = split_frontmatter(text)
    except FrontmatterError:  # load_markdown already reported it
        return
    lines = text.split("\n")
    name = PurePosixPath(rel).name.lower()
    _check_links(report, site, rel, lines, offset, sidebar=name == SIDEBAR)
    chrome = name in CHROME
    date = _check_last_updated(report, options, rel, lines, offset, metadata, chrome=chrome)
    if not chrome:
        report.pages.append(
            PageEntry(
                path=rel,
                title=title,
                fingerprint=_fingerprint(data),
                last_updated=date if _valid_date(date) else None,
                title_line=_title_line(lines, offset, frontmatter),
            )
        )


def _check_links(
    report: DocsReport, site: _Site, rel: str, lines: list[str], offset: int, *, sidebar: bool
) -> None:
    """A problem for every link to a page the site lacks (a sidebar's named as such)."""
    for number, line in _content_lines(lines[offset:], offset + 1):
        for target, wiki_link in _links(line, site.wiki):
            why = site.missing(rel, target, wiki_link)
            if why is None:
                continue
            if sidebar:
                problem = Problem(
                    rel,
                    number,
                    "sidebar-link",
                    f"sidebar links to a missing page: {target} ({why})",
                )
            else:
                problem = Problem(
                    rel,
                    number,
                    "broken-link",
                    f"broken link: {shortened(target, MAX_SHOWN_TARGET)} ({why})",
                )
            report.problems.append(problem)


def _check_last_updated(
    report: DocsReport,
    options: ValidateOptions,
    rel: str,
    lines: list[str],
    offset: int,
    metadata: Mapping[str, MetaValue],
    *,
    chrome: bool,
) -> str:
    """The page's 'Last updated' date (its text's, else its metadata's), checked."""
    found = _last_updated(_content_lines(lines[offset:], offset + 1))
    date = found[1] if found else meta_text(metadata.get("last_updated", ""))
    if found and not _valid_date(found[1]):
        report.problems.append(
            Problem(
                rel, found[0], "last-updated", f"'Last updated' date {found[1]!r} is not YYYY-MM-DD"
            )
        )
    elif options.require_last_updated and not chrome and not _valid_date(date):
        report.problems.append(
            Problem(rel, 1, "last-updated", "missing 'Last updated: YYYY-MM-DD'")
        )
    return date


def _title_line(lines: list[str], offset: int, frontmatter: Mapping[str, object] | None) -> int:
    """The line a page's title is on: its front matter's title key, else its first H1."""
    if frontmatter and "title" in frontmatter:
        return next((i + 1 for i in range(1, offset) if _TITLE_KEY_RE.match(lines[i])), 1)
    for number, line in _content_lines(lines[offset:], offset + 1):
        if re.match(r" {0,3}#[ \t]", line):
            return number
    return 1


def _check_titles(report: DocsReport) -> None:
    first: dict[str, PageEntry] = {}
    for page in report.pages:
        key = " ".join(page.title.split()).casefold()
        if key in first:
            report.problems.append(
                Problem(
                    page.path,
                    page.title_line,
                    "duplicate-title",
                    f"duplicate title {page.title!r} (also {first[key].path})",
                )
            )
        else:
            first[key] = page


# --- the manifest ------------------------------------------------------------------------------


def build_manifest(pages: Sequence[PageEntry], now: dt.datetime | None = None) -> dict[str, Any]:
    """The manifest of a docs folder: generation time, and per page its title, path, short
    content fingerprint and last-updated date."""
    when = (now or dt.datetime.now(dt.UTC)).replace(microsecond=0)
    return {
        "generated_at": when.isoformat().replace("+00:00", "Z"),
        "pages": [
            {
                "path": p.path,
                "title": p.title,
                "fingerprint": p.fingerprint,
                "last_updated": p.last_updated,
            }
            for p in sorted(pages, key=lambda p: p.path)
        ],
    }


def write_manifest(root: Path, pages: Sequence[PageEntry]) -> Path:
    """Write ``docs-manifest.json`` into ``root`` atomically; raises SourceError on failure."""
    path = root / MANIFEST_NAME
    data = json.dumps(build_manifest(pages), indent=2, ensure_ascii=False) + "\n"
    try:
        write_atomic(path, data.encode("utf-8"))
    except OSError as exc:
        raise SourceError(f"cannot write {path}: {exc.strerror or exc}") from exc
    return path


def _path_lines(text: str) -> dict[str, int]:
    """The line of each page's ``"path": ...`` in a manifest as ``write_manifest`` writes it,
    read once (a scan of the file for each of 10,000 pages took 11 s)."""
    lines: dict[str, int] = {}
    for i, line in enumerate(text.split("\n"), 1):
        _, found, rest = line.partition('"path": ')
        if found:
            with contextlib.suppress(ValueError):
                lines.setdefault(str(json.loads(rest.rstrip().removesuffix(","))), i)
    return lines


def _check_manifest(report: DocsReport) -> None:
    path = report.root / MANIFEST_NAME
    if not path.is_file():
        return
    try:
        text = path.read_text(encoding="utf-8")
        listed = {str(e["path"]): e for e in json.loads(text)["pages"]}
    except (OSError, UnicodeDecodeError, ValueError, KeyError, TypeError, RecursionError) as exc:
        report.problems.append(  # RecursionError: arrays nested past the parser's recursion
            Problem(MANIFEST_NAME, 1, "stale-manifest", f"stale manifest: unreadable ({exc})")
        )
        return
    lines = _path_lines(text)

    def line_of(page: str) -> int:
        return lines.get(page, 1)

    current = {p.path: p for p in report.pages}
    for rel, page in current.items():
        entry = listed.get(rel)
        if entry is None:
            report.problems.append(
                Problem(MANIFEST_NAME, 1, "stale-manifest", f"stale manifest: {rel} is not listed")
            )
            continue
        changed = [
            key
            for key, now in (
                ("fingerprint", page.fingerprint),
                ("title", page.title),
                ("last_updated", page.last_updated),
            )
            if entry.get(key) != now
        ]
        if changed:
            report.problems.append(
                Problem(
                    MANIFEST_NAME,
                    line_of(rel),
                    "stale-manifest",
                    f"stale manifest: {rel} changed since it was written ({', '.join(changed)})",
                )
            )
    for rel in listed.keys() - current.keys():
        report.problems.append(
            Problem(
                MANIFEST_NAME,
                line_of(rel),
                "stale-manifest",
                f"stale manifest: lists {rel}, which no longer exists",
            )
        )
