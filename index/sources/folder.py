"""Listing and reading the files of a source folder: the one place the ``markdown``, ``text``,
``html`` and ``pdf`` sources (and ``voxrecall index validate``) find and read their files.

A file is listed when its suffix (any case) is one the source reads. What is found and not used
is reported as a ``SkippedPage``, never raised:

- a symbolic link whose target is outside the source folder (a file, or a folder: reported as
  ``name/``), unless the source sets ``follow_symlinks = true``. A link to a file inside the folder
  is read; a link to a folder inside it is not walked (its files are read where they are), so a
  page is never read twice under two names;
- a name that is not a regular file (a FIFO, a socket, a device: reading one can block forever,
  or never end), a link to nothing, a link loop (whatever its suffix: it may name a folder) or
  a name that cannot be looked at (an ``OSError``);
- a file or folder whose name is not UTF-8 (named in the report with its odd bytes as ``\xff``):
  a page's ``source_path`` is text;
- a file larger than ``max_page_bytes``: the work one page costs (chunks, embeddings, memory)
  grows with its size, so one huge file could hold up the whole build.

With ``follow_symlinks = true`` every link is followed, folders included; a link back to a folder
being walked (a cycle) is not walked again.
"""

from __future__ import annotations

import errno
import os
import stat
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from index.sources import SkippedPage, printable

__all__ = [
    "DEFAULT_MAX_PAGE_BYTES",
    "DEFAULT_OPTIONS",
    "FolderOptions",
    "Listing",
    "list_files",
    "max_page_bytes_option",
    "read_file",
    "too_large",
]

# A Markdown or HTML page of 8 MiB is a book; a larger one is a generated dump or a mistake. Its
# cost grows with its size: 5 MB of prose on one line is ~5,000 chunks to embed and ~10 s to
# chunk; the 50 MB page ran past 600 s. The limit bounds one page's share of a build.
DEFAULT_MAX_PAGE_BYTES = 8 << 20
# Opening a FIFO for reading waits for a writer; non-blocking, the open returns at once and the
# fstat below refuses it before anything is read.
_OPEN_FLAGS = os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_CLOEXEC", 0)
_NOT_UTF8 = "the name is not UTF-8 (rename it to index it)"
_OUTSIDE = "a symbolic link to outside the source folder (set follow_symlinks = true to read it)"
# The kernel's own trees: a link into one is never read, followed or not (``/proc/self/environ``
# is a regular file holding the indexer's environment, its API keys among it).
MACHINE_TREES = (Path("/proc"), Path("/sys"), Path("/dev"))
_MACHINE_LINK = "{} is the machine's own, reached through a symbolic link: never read as documents"


def max_page_bytes_option(options: Mapping[str, Any], default: int) -> int:
    """A source's ``max_page_bytes``, else ``default``: its type and range, as every option's,
    were checked at load (``index.config.check_options``)."""
    value: int = options.get("max_page_bytes", default)
    return value


def too_large(size: int, limit: int) -> str:
    """The skip reason of a page over ``max_page_bytes``."""
    return (
        f"{size:,} bytes, over max_page_bytes ({limit:,} bytes); raise the source's "
        "max_page_bytes to index it"
    )


@dataclass(frozen=True, slots=True)
class FolderOptions:
    """The options every folder source takes: ``follow_symlinks`` and ``max_page_bytes``."""

    follow_symlinks: bool = False
    max_page_bytes: int = DEFAULT_MAX_PAGE_BYTES

    @classmethod
    def from_options(
        cls, source: str, options: Mapping[str, Any], default_max: int = DEFAULT_MAX_PAGE_BYTES
    ) -> FolderOptions:
        """Read the options of a source (their types and ranges checked at load)."""
        follow = options.get("follow_symlinks", False)
        return cls(follow, max_page_bytes_option(options, default_max))


DEFAULT_OPTIONS = FolderOptions()


@dataclass(slots=True)
class Listing:
    """The files of a folder to read, as (POSIX path relative to the folder, path), sorted by
    relative path so builds are deterministic; and what was found and not used."""

    files: list[tuple[str, Path]] = field(default_factory=list)
    skipped: list[SkippedPage] = field(default_factory=list)


@dataclass(frozen=True, slots=True)
class _Walk:
    real_root: Path
    suffixes: tuple[str, ...] | None
    follow_symlinks: bool
    listing: Listing
    # folders still to read: (folder, its relative path + "/", its real path). A stack, not
    # recursion: a tree nested thousands of folders deep is still walked.
    todo: list[tuple[Path, str, Path]] = field(default_factory=list)
    # the real folders walked or queued: each is walked once, however many links lead to it
    # (a chain of folders each linking twice to the next was walked 2^depth times), and a
    # link back up to one is never followed
    seen: set[Path] = field(default_factory=set)
    # links to folders inside the root, walked once the walk is done, each whose folder it did
    # not reach (one whose own name is not UTF-8, say), by the first link to it
    links_in: list[tuple[Path, str, Path]] = field(default_factory=list)


def list_files(
    root: Path, suffixes: tuple[str, ...] | None, *, follow_symlinks: bool = False
) -> Listing:
    """The files under ``root`` (recursively) with one of ``suffixes`` (None: every file), and
    the names skipped."""
    real_root = Path(os.path.realpath(root))
    walk = _Walk(real_root, suffixes, follow_symlinks, Listing(), [(root, "", real_root)])
    walk.seen.add(real_root)
    while walk.todo:
        while walk.todo:
            _walk_folder(walk, *walk.todo.pop())
        _links_not_reached(walk)
    walk.listing.files.sort()
    walk.listing.skipped.sort(key=lambda s: s.path)
    return walk.listing


def _walk_folder(walk: _Walk, folder: Path, prefix: str, real: Path) -> None:
    try:
        with os.scandir(folder) as it:
            entries = sorted(it, key=lambda e: e.name)
    except OSError as exc:
        walk.listing.skipped.append(
            SkippedPage(prefix or "./", f"unreadable folder: {exc.strerror or exc}")
        )
        return
    for entry in entries:
        _visit(walk, entry, prefix + entry.name, real)


def _visit(walk: _Walk, entry: os.DirEntry[str], rel: str, parent: Path) -> None:
    try:
        is_dir = entry.is_dir()  # follows a link
    except OSError as exc:  # a link loop (what it names is unknown: named whatever its suffix)
        walk.listing.skipped.append(SkippedPage(printable(rel), _unreadable(exc)))
        return
    if not is_dir and not _wanted(entry.name, walk.suffixes):
        return
    if not _utf8(entry.name):
        walk.listing.skipped.append(
            SkippedPage(printable(rel) + ("/" if is_dir else ""), _NOT_UTF8)
        )
        return
    if entry.is_symlink():
        _visit_link(walk, entry, rel, is_dir, parent)
    elif is_dir:
        _visit_folder(walk, entry, rel, parent)
    else:
        _add_file(walk, entry, rel)


def _visit_folder(walk: _Walk, entry: os.DirEntry[str], rel: str, parent: Path) -> None:
    """A folder, or a link to one being followed: queued once per real folder. A link to a
    folder inside the root waits for the walk's end (its files are read where they are, as
    when links are not followed, unless the walk never reached them); one outside it is
    walked by the first link to it."""
    if not entry.is_symlink():
        real = parent / entry.name  # ``parent`` is real: no realpath, a call per component
        if _in_machine_tree(walk, real, rel + "/"):  # reached through a followed link to "/"
            return
    else:
        real = Path(os.path.realpath(entry.path))
        if real.is_relative_to(walk.real_root):
            walk.links_in.append((Path(entry.path), rel + "/", real))
            return
    _queue(walk, Path(entry.path), rel + "/", real)


def _in_machine_tree(walk: _Walk, real: Path, shown: str) -> bool:
    """Whether ``real``, outside the source's folder, is in one of the machine's own trees
    (``MACHINE_TREES``): then skipped as ``shown``, named."""
    if real.is_relative_to(walk.real_root):  # a source folder under /dev/shm reads its own
        return False
    machine = next((tree for tree in MACHINE_TREES if real.is_relative_to(tree)), None)
    if machine is not None:
        walk.listing.skipped.append(SkippedPage(shown, _MACHINE_LINK.format(machine)))
    return machine is not None


def _queue(walk: _Walk, folder: Path, prefix: str, real: Path) -> None:
    if real not in walk.seen:
        walk.seen.add(real)
        walk.todo.append((folder, prefix, real))


def _links_not_reached(walk: _Walk) -> None:
    """Queue the links to folders inside the root whose folders the walk did not reach."""
    links = list(walk.links_in)
    walk.links_in.clear()
    for folder, prefix, real in links:
        _queue(walk, folder, prefix, real)


def _wanted(name: str, suffixes: tuple[str, ...] | None) -> bool:
    return suffixes is None or Path(name).suffix.lower() in suffixes


def _visit_link(walk: _Walk, entry: os.DirEntry[str], rel: str, is_dir: bool, parent: Path) -> None:
    """A link: when links are not followed, only one to a file inside the folder is read;
    when they are, any but one into the machine's own trees (``MACHINE_TREES``)."""
    real = Path(os.path.realpath(entry.path))
    shown = rel + "/" if is_dir else rel
    if not walk.follow_symlinks and not real.is_relative_to(walk.real_root):
        walk.listing.skipped.append(SkippedPage(shown, _OUTSIDE))
    elif _in_machine_tree(walk, real, shown):
        return
    elif not is_dir:
        _add_file(walk, entry, rel)
    elif walk.follow_symlinks:  # a link to a folder inside, not followed: its files are read there
        _visit_folder(walk, entry, rel, parent)


def _add_file(walk: _Walk, entry: os.DirEntry[str], rel: str) -> None:
    problem = _not_regular(entry)
    if problem:
        walk.listing.skipped.append(SkippedPage(rel, problem))
    else:
        walk.listing.files.append((rel, Path(entry.path)))


def _utf8(name: str) -> bool:
    try:
        name.encode("utf-8")
    except UnicodeEncodeError:  # os.scandir gave its bytes as surrogate escapes
        return False
    return True


def _unreadable(exc: OSError) -> str:
    if exc.errno == errno.ELOOP:
        return "a symbolic link loop"
    return f"unreadable: {exc.strerror or exc}"


def _not_regular(entry: os.DirEntry[str]) -> str:
    try:
        mode = entry.stat().st_mode  # follows a link
    except FileNotFoundError:
        return "a symbolic link to nothing"
    except OSError as exc:
        return _unreadable(exc)
    return "" if stat.S_ISREG(mode) else f"not a regular file ({_kind(mode)})"


def _kind(mode: int) -> str:
    if stat.S_ISFIFO(mode):
        return "a FIFO"
    if stat.S_ISSOCK(mode):
        return "a socket"
    if stat.S_ISCHR(mode) or stat.S_ISBLK(mode):
        return "a device"
    return "not a file"


def read_file(rel: str, path: Path, limit: int) -> bytes | SkippedPage:
    """The bytes of a regular file of at most ``limit`` bytes, or why it is not read.

    The file is checked again once open (it may have changed since it was listed): a FIFO is
    refused without waiting for a writer, and a file that grew past ``limit`` is read no further.
    """
    try:
        fd = os.open(path, _OPEN_FLAGS)
    except OSError as exc:
        return SkippedPage(rel, f"unreadable: {exc.strerror or exc}")
    try:
        with open(fd, "rb", closefd=True) as f:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode):
                return SkippedPage(rel, f"not a regular file ({_kind(st.st_mode)})")
            if st.st_size > limit:
                return SkippedPage(rel, too_large(st.st_size, limit))
            data = f.read(st.st_size + 1)  # read(n) allocates n bytes up front: not the limit
            if len(data) > st.st_size:  # it grew since: read on, up to the limit
                data += f.read(limit + 1 - len(data))
    except OSError as exc:
        return SkippedPage(rel, f"unreadable: {exc.strerror or exc}")
    if len(data) > limit:
        return SkippedPage(rel, too_large(len(data), limit))
    return data
