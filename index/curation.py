"""A knowledge base that people curate: sources proposed, approved or rejected.

``voxrecall source add`` records a proposed source (a URL or a file, from a person or from an
agent's research) as pending; only ``voxrecall source approve`` lets a build index it;
``voxrecall source reject`` keeps the refusal on record; ``voxrecall source list`` shows them all
with who proposed and decided, and when. The registry is one JSON file (``[index] registry``,
default ``sources.json`` beside the config), rewritten whole by temp file + fsync + rename under
an exclusive lock, so two commands at once never lose an entry:

    {"version": 1, "sources": [{"id": "3f2a9c1e07", "knowledge_base": "help-center",
      "location": "https://example.com/faq", "kind": "url", "status": "pending",
      "proposed_by": "ana", "proposed_at": "2026-12-01T14:20:00Z", "note": "",
      "decided_by": "", "decided_at": ""}, ...]}

A build adds a base's approved entries as two more sources: ``approved-urls`` (crawled like a
``url`` source) and ``approved-files`` (Markdown or text files, each read like a page of a folder
source).
"""

from __future__ import annotations

import dataclasses
import fcntl
import hashlib
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import orjson

from index.config import KnowledgeBaseConfig, SourceConfig
from index.errors import RegistryError
from index.snapshot import write_atomic
from index.sources import PageBytes, SkippedPage
from index.sources.folder import DEFAULT_MAX_PAGE_BYTES, read_file
from index.sources.markdown import MARKDOWN_SUFFIXES, markdown_page
from index.sources.text import TEXT_SUFFIXES, text_page
from index.types import Page

REGISTRY_VERSION = 1
APPROVED_URLS = "approved-urls"
APPROVED_FILES = "approved-files"
MAX_REGISTRY_BYTES = 16 << 20  # ~50,000 entries; past that it is not a list people read
Status = Literal["pending", "approved", "rejected"]
STATUSES: tuple[Status, ...] = ("pending", "approved", "rejected")


@dataclass(frozen=True, slots=True)
class Entry:
    id: str
    knowledge_base: str
    location: str  # a URL, or an absolute file path
    kind: Literal["url", "file"]
    status: Status
    proposed_by: str
    proposed_at: str
    note: str = ""
    decided_by: str = ""
    decided_at: str = ""


def now_iso(now: float | None = None) -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(time.time() if now is None else now))


def entry_id(knowledge_base: str, location: str) -> str:
    return hashlib.sha256(f"{knowledge_base}\x00{location}".encode()).hexdigest()[:10]


def normalise_location(location: str) -> tuple[str, Literal["url", "file"]]:
    """A URL as given, or a file's absolute path; RegistryError for anything else."""
    if location.startswith(("http://", "https://")):
        return location, "url"
    path = Path(location).expanduser().resolve()
    if not path.is_file():
        raise RegistryError(f"{location}: neither an http(s) URL nor a file")
    if path.suffix.lower() not in (*MARKDOWN_SUFFIXES, *TEXT_SUFFIXES):
        raise RegistryError(f"{location}: only Markdown (.md) and text (.txt) files can be added")
    return str(path), "file"


class Registry:
    """The registry file; every change is one locked read-modify-write."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def entries(self) -> list[Entry]:
        try:
            data = self.path.read_bytes()
        except FileNotFoundError:
            return []
        except OSError as exc:
            raise RegistryError(f"{self.path}: cannot read: {exc.strerror or exc}") from exc
        return _parse(data, self.path)

    @contextmanager
    def _locked(self) -> Iterator[list[Entry]]:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.path.with_name(f".{self.path.name}.lock"), "a+b") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            entries = self.entries()
            yield entries
            body = {
                "version": REGISTRY_VERSION,
                "sources": [dataclasses.asdict(e) for e in entries],
            }
            write_atomic(self.path, orjson.dumps(body, option=orjson.OPT_INDENT_2) + b"\n")

    def add(self, knowledge_base: str, location: str, by: str, note: str = "") -> Entry:
        where, kind = normalise_location(location)
        entry = Entry(
            id=entry_id(knowledge_base, where),
            knowledge_base=knowledge_base,
            location=where,
            kind=kind,
            status="pending",
            proposed_by=by,
            proposed_at=now_iso(),
            note=note,
        )
        with self._locked() as entries:
            known = next((e for e in entries if e.id == entry.id), None)
            if known is not None:
                raise RegistryError(
                    f"{where} is already proposed for {knowledge_base} ({known.id}, {known.status})"
                )
            entries.append(entry)
        return entry

    def decide(self, entry_id: str, status: Status, by: str) -> Entry:
        with self._locked() as entries:
            for i, entry in enumerate(entries):
                if entry.id == entry_id:
                    entries[i] = dataclasses.replace(
                        entry, status=status, decided_by=by, decided_at=now_iso()
                    )
                    return entries[i]
        raise RegistryError(f"{self.path}: no source {entry_id!r} (see `voxrecall source list`)")

    def approved(self, knowledge_base: str) -> list[Entry]:
        return [
            e
            for e in self.entries()
            if e.knowledge_base == knowledge_base and e.status == "approved"
        ]


def _parse(data: bytes, path: Path) -> list[Entry]:
    if len(data) > MAX_REGISTRY_BYTES:
        raise RegistryError(f"{path}: {len(data)} bytes, more than {MAX_REGISTRY_BYTES}")
    try:
        raw = orjson.loads(data)
        if raw.get("version") != REGISTRY_VERSION:
            raise RegistryError(f"{path}: registry version {raw.get('version')!r} is not 1")
        entries = [Entry(**item) for item in raw["sources"]]
    except (orjson.JSONDecodeError, AttributeError, KeyError, TypeError) as exc:
        raise RegistryError(f"{path}: not a sources registry: {exc}") from exc
    for e in entries:
        if e.status not in STATUSES or e.kind not in ("url", "file"):
            raise RegistryError(f"{path}: entry {e.id!r} has status {e.status!r}, kind {e.kind!r}")
    return entries


def approved_sources(registry: Path, kb: KnowledgeBaseConfig) -> tuple[SourceConfig, ...]:
    """The base's approved entries as sources: its URLs, and its files."""
    entries = Registry(registry).approved(kb.name)
    urls = [e.location for e in entries if e.kind == "url"]
    files = [e.location for e in entries if e.kind == "file"]
    out = []
    if urls:
        out.append(SourceConfig(name=APPROVED_URLS, type="url", options={"urls": urls}))
    if files:
        out.append(SourceConfig(name=APPROVED_FILES, type=APPROVED_FILES, options={"files": files}))
    return tuple(out)


def load_approved_files(
    source: SourceConfig, budget: PageBytes | None = None
) -> tuple[list[Page], list[SkippedPage]]:
    """Each approved file as one page (Markdown or text), its name as its source path (a name
    two files share: the second with a hash of its path; ``_served_name``); raises
    BaseTooLarge when the pages pass ``budget`` (default: this source's own)."""
    budget = budget or PageBytes(source.name)
    pages: list[Page] = []
    skipped: list[SkippedPage] = []
    taken: set[str] = set()
    for location in source.options["files"]:
        path = Path(location)
        data = read_file(location, path, DEFAULT_MAX_PAGE_BYTES)
        if isinstance(data, SkippedPage):
            skipped.append(data)
            continue
        got = _page(source.name, _served_name(path, taken), path, data)
        if isinstance(got, SkippedPage):
            skipped.append(got)
        else:
            budget.take(got)
            pages.append(got)
    return pages, skipped


def _served_name(path: Path, taken: set[str]) -> str:
    """An approved file's source path, as callers and models see it: its name, not the
    indexer's folders (``/home/ops/drafts/refunds.md`` answered every call with the path); a
    name already taken gets the first 8 hex digits of its path's sha256 ("refunds-1a2b3c4d.md")."""
    name = path.name
    if name in taken:
        digest = hashlib.sha256(str(path).encode("utf-8", "surrogateescape")).hexdigest()[:8]
        name = f"{path.stem}-{digest}{path.suffix}"
    taken.add(name)
    return name


def _page(source: str, location: str, path: Path, data: bytes) -> Page | SkippedPage:
    if path.suffix.lower() in MARKDOWN_SUFFIXES:
        return markdown_page(source, location, path, data)
    return text_page(source, location, path, data)
