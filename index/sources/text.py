"""A folder of plain-text files (``*.txt``), one page each.

A page's title is its first line when that line reads like a title (short, and followed by a blank
line or nothing), and the title line is then not repeated in the text; otherwise the title is the
file name's stem. A file that is not UTF-8 is skipped with the reason.
"""

from __future__ import annotations

from pathlib import Path

from index.errors import SourceError
from index.sources import PageBytes, SkippedPage
from index.sources.folder import DEFAULT_OPTIONS, FolderOptions, list_files, read_file
from index.types import Page

__all__ = ["TEXT_SUFFIXES", "decode_utf8", "load_text", "split_title_line"]

TEXT_SUFFIXES = (".txt",)
# A first line longer than this is a paragraph, not a title (titles run 3-12 words).
MAX_TITLE_CHARS = 120


def decode_utf8(rel: str, data: bytes) -> str | SkippedPage:
    """The text of a UTF-8 file with line endings normalised and a BOM dropped, or the reason
    it cannot be read."""
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        return SkippedPage(rel, f"not valid UTF-8: {exc.reason} at byte {exc.start}")
    return text.removeprefix("\ufeff").replace("\r\n", "\n").replace("\r", "\n")


def split_title_line(text: str) -> tuple[str, str]:
    """``(title, body)`` when the first non-blank line reads like a title, else ``("", text)``."""
    stripped = text.lstrip("\n")
    first, _, rest = stripped.partition("\n")
    title = " ".join(first.split())
    if not title or len(title) > MAX_TITLE_CHARS:
        return "", text
    if rest and rest.split("\n", 1)[0].strip():
        return "", text  # the next line continues a paragraph
    return title, rest.lstrip("\n")


def load_text(
    source: str,
    root: Path,
    options: FolderOptions = DEFAULT_OPTIONS,
    budget: PageBytes | None = None,
) -> tuple[list[Page], list[SkippedPage]]:
    """Read every ``.txt`` file under ``root`` (``index.sources.folder`` says which); a bad file
    is skipped, never raised.

    Raises SourceError only when ``root`` is not a folder, BaseTooLarge when the pages pass
    ``budget`` (``load_markdown``'s).
    """
    budget = budget or PageBytes(source)
    if not root.is_dir():
        raise SourceError(f"text source {source!r}: {root} is not a folder")
    listing = list_files(root, TEXT_SUFFIXES, follow_symlinks=options.follow_symlinks)
    pages: list[Page] = []
    skipped = listing.skipped
    for rel, path in listing.files:
        data = read_file(rel, path, options.max_page_bytes)
        page = data if isinstance(data, SkippedPage) else text_page(source, rel, path, data)
        if isinstance(page, SkippedPage):
            skipped.append(page)
        else:
            budget.take(page)
            pages.append(page)
    return pages, skipped


def text_page(source: str, rel: str, path: Path, data: bytes) -> Page | SkippedPage:
    """One plain-text file's page: its first line the title (else the file's name)."""
    text = decode_utf8(rel, data)
    if isinstance(text, SkippedPage):
        return text
    title, body = split_title_line(text)
    if not body.strip() and title:
        body = title  # a one-line file: its line is its content
    return Page(source=source, source_path=rel, title=title or path.stem, text=body, kind="text")
