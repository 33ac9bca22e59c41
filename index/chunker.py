"""Heading-aware chunking of pages into retrievable chunks.

Markdown pages are cut at ATX headings (``#`` .. ``###`` by default), each heading section is its
own chunk unless it is larger than the target, in which case it is packed from whole blocks
(paragraphs, lists, fenced code, tables) with a bounded overlap of trailing blocks. Fenced code
and tables are atomic: they are never split, even when larger than the target. A paragraph larger
than the target is split at sentence boundaries, then line breaks, then words.

Every chunk's text is a verbatim slice of the page text, so Markdown is kept as it was written.
Whatever the structure, no chunk's text is over ``MAX_CHUNK_BYTES`` (UTF-8): a larger one (a
huge table or code block, or a "word" of megabytes, which counts as one token) is cut into
consecutive slices, at a line break where there is one.

Every other string a chunk carries is cut to what the sidecar reads of it (``index/tables.py``
cuts a snapshot's strings to these caps as it reads them): each breadcrumb, the title and the
URL at ``MAX_FIELD_BYTES``, the contextual prefix of ``embed_text`` within the same field, the
metadata within ``MAX_META_BYTES`` and ``MAX_META_STRINGS``. A chunk is then its text plus a
constant, however long a page's headings, title or frontmatter: a heading of megabytes was
copied into every chunk of its section (quadratic in the page), and the build wrote what the
reader threw away. A page with more than ``MAX_PAGE_HEADINGS`` headings at the split levels
(deeper ones are text) or ``MAX_PAGE_CHUNKS`` chunks, or a path (its key, not cut) over ``MAX_FIELD_BYTES``, is refused whole
(``PageOverLimit``, the build skips it with the reason).
"""

from __future__ import annotations

import hashlib
import re
from array import array
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from itertools import islice, pairwise
from types import MappingProxyType

from index.errors import SourceError
from index.types import Chunk, MetaValue, Page, meta_values

__all__ = [
    "ChunkOptions",
    "Heading",
    "PageOverLimit",
    "bounded",
    "chunk_page",
    "count_tokens",
    "first_h1",
    "markdown_headings",
]

_TOKEN_RE = re.compile(r"\w+|[^\w\s]")
_ATX_RE = re.compile(r" {0,3}(#{1,6})(?=[ \t]|$)(.*)")
# The three patterns below are searched (not anchored at the start), so each starts only where
# a run of its leading characters starts (the lookbehind) and never gives back what a possessive
# quantifier took: a line of 100,000 spaces or dots costs linear time, not quadratic.
_ATX_CLOSE_RE = re.compile(r"(?:^|(?<![ \t])[ \t]++)#++[ \t]*+$")
_HEADING_ATTRS_RE = re.compile(r"(?<![ \t])[ \t]*+\{[#.][^{}]*+\}[ \t]*+$")
_FENCE_OPEN_RE = re.compile(r"[ \t]*(`{3,}|~{3,})(.*)")
_FENCE_CLOSE_RE = re.compile(r"[ \t]*(`{3,}|~{3,})[ \t]*")
_LIST_ITEM_RE = re.compile(r"([ \t]*)(?:[-*+]|\d{1,9}[.)])(?:[ \t]|$)")
_SENTENCE_END_RE = re.compile(r"(?<![.!?])[.!?]++[\"')\]]*+(?=\s)")
_NON_SPACE_RE = re.compile(r"\S+")
# A chunk is sent whole in every answer that finds it (and again in the session's context), and
# an answer is at most [sidecar] max_message_bytes (4 MiB by default): a 4 MB table kept whole
# failed every Turn that found it, and the session's next turns too. 50 results of 32 KiB fit.
MAX_CHUNK_BYTES = 32 * 1024
# What a snapshot's reader keeps of a chunk's other strings (index/tables.py), and so what the
# chunker writes: each breadcrumb, the title (and the id, path, URL, metadata strings) at
# MAX_FIELD_BYTES (PATH_MAX; a sitemap's URLs are at most 2,048 characters), the metadata's
# entries whose strings fit within MAX_META_BYTES and MAX_META_STRINGS together (one over is
# left out, the next still kept: ``bounded_metadata``).
MAX_FIELD_BYTES = 4096
MAX_META_BYTES = 16 * 1024
MAX_META_STRINGS = 64
# A page's sections and chunks are held at once, and each chunk is a vector and a row of every
# table: "## h\n" on every line of an 8 MiB page was 1.7 million headings (14 s, 724 MB, to yield
# no chunk), "## hN\nwN\n" 524,032 chunks of 7 bytes. The real pages measured are 100 times below
# both (the most: rclone's s3.md, 183 headings; its changelog.md, 454 chunks: bench/README.md,
# "Pages bounded"). An 8 MiB page of prose is ~6,000 chunks of 256 tokens, of punctuation ~33,000.
# Only headings that start a section count: a deeper one is a line of text (8 MiB of "#### h"
# lines under heading_levels 3 cost what 8 MiB of punctuation does, bench/README.md, "F7, F10").
MAX_PAGE_HEADINGS = 20_000
MAX_PAGE_CHUNKS = 50_000
_CRUMB_JOIN = " > "
_PREFIX_GAP = "\n\n"  # between embed_text's prefix and the text: the prefix is a field with it


class PageOverLimit(SourceError):
    """A page with more headings or chunks than a page may have, or a path longer than a field
    may be; the message says which."""


@dataclass(frozen=True)
class ChunkOptions:
    """How pages are cut: the token target, the overlap carried between pieces of one section, and
    the deepest heading level that starts a new section (deeper headings stay inside the text)."""

    target_tokens: int = 256
    overlap_tokens: int = 32
    heading_levels: int = 3

    def __post_init__(self) -> None:
        if self.target_tokens < 1:
            raise ValueError(f"target_tokens must be >= 1, got {self.target_tokens}")
        if self.overlap_tokens < 0:
            raise ValueError(f"overlap_tokens must be >= 0, got {self.overlap_tokens}")
        if not 0 <= self.heading_levels <= 6:
            raise ValueError(f"heading_levels must be in 0..6, got {self.heading_levels}")


_DEFAULT_OPTIONS = ChunkOptions()


def count_tokens(text: str) -> int:
    """Offline token estimate: runs of word characters and single punctuation marks.

    Close enough to a BPE tokenizer's count for sizing chunks, and needs no model files.
    """
    return len(_TOKEN_RE.findall(text))


def _count(text: str, start: int, end: int) -> int:
    return len(_TOKEN_RE.findall(text, start, end))


# --- Markdown line classification ------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Heading:
    """An ATX heading found outside fenced code: its level, its cleaned title and its line index."""

    level: int
    title: str
    line: int


def _atx(line: str) -> tuple[int, str] | None:
    """Level and title of an ATX heading line, or None. Closing ``#``s and ``{#id}`` go."""
    m = _ATX_RE.fullmatch(line)
    if m is None:
        return None
    title = _ATX_CLOSE_RE.sub("", m.group(2).strip())
    title = _HEADING_ATTRS_RE.sub("", title).strip()
    return len(m.group(1)), title


def _fence_open(line: str) -> tuple[str, int] | None:
    m = _FENCE_OPEN_RE.fullmatch(line)
    if m is None:
        return None
    marker = m.group(1)
    if marker[0] == "`" and "`" in m.group(2):
        return None  # an info string may not contain backticks: this is inline code
    return marker[0], len(marker)


def _fence_closes(line: str, fence: tuple[str, int]) -> bool:
    m = _FENCE_CLOSE_RE.fullmatch(line)
    if m is None:
        return False
    marker = m.group(1)
    return marker[0] == fence[0] and len(marker) >= fence[1]


def _is_table(line: str) -> bool:
    return line.lstrip(" \t").startswith("|")


def _indented(line: str) -> bool:
    return line[:1] in (" ", "\t")


class _Lines:
    """The page text cut at ``\\n``, with each line's offsets (the ``\\r`` of CRLF is dropped).

    The offsets are arrays of machine integers: as lists of ints they took 72 bytes a line, more
    than most lines' text (a page of 8 MiB of "## h" lines: 250 MB held, 131 MB now)."""

    __slots__ = ("ends", "starts", "texts")

    def __init__(self, text: str) -> None:
        self.starts = array("q")
        self.ends = array("q")
        self.texts: list[str] = text.split("\n")
        pos = 0
        for i, piece in enumerate(self.texts):
            end = pos + len(piece)
            if piece.endswith("\r"):
                self.texts[i] = piece[:-1]
                self.ends.append(end - 1)
            else:
                self.ends.append(end)
            self.starts.append(pos)
            pos = end + 1


def _each_line(text: str, block: int = 1 << 16) -> Iterator[str]:
    """The lines of ``text`` as ``_Lines`` cuts them, one at a time: split ``block`` characters
    at a time, at C speed, holding one block's lines (found a line at a time in Python, 8 million
    empty lines took 4.2 s; 1.9 s this way, load 6-7)."""
    head: list[str] = []  # the start of a line that runs on past the block before
    for pos in range(0, len(text), block):
        lines = text[pos : pos + block].split("\n")
        head.append(lines[0])
        if len(lines) == 1:
            continue
        lines[0] = "".join(head)
        head = [lines.pop()]
        for line in lines:
            yield line[:-1] if line.endswith("\r") else line
    last = "".join(head)
    yield last[:-1] if last.endswith("\r") else last


def _fence_end(texts: Sequence[str], i: int, hi: int, fence: tuple[str, int]) -> int:
    """Index one past the closing line of the fence opened at line ``i`` (``hi`` if unclosed)."""
    j = i + 1
    while j < hi:
        if _fence_closes(texts[j], fence):
            return j + 1
        j += 1
    return hi


def markdown_headings(text: str) -> list[Heading]:
    """Every ATX heading of a Markdown text that is not inside fenced code, in order."""
    return list(_headings(_each_line(text)))


def first_h1(text: str) -> str:
    """The title of a Markdown text's first H1 that has one, else "": found without holding
    the headings before it (a page of a million of them)."""
    return next((h.title for h in _headings(_each_line(text)) if h.level == 1 and h.title), "")


def _headings(texts: Iterable[str]) -> Iterator[Heading]:
    fence: tuple[str, int] | None = None
    for i, line in enumerate(texts):
        if fence is not None:
            if _fence_closes(line, fence):
                fence = None
            continue
        fence = _fence_open(line)
        if fence is not None:
            continue
        h = _atx(line)
        if h is not None:
            yield Heading(h[0], h[1], i)


def _page_headings(lines: _Lines, levels: int) -> list[Heading]:
    """The page's headings down to ``levels``, those that start a section; raises PageOverLimit
    past MAX_PAGE_HEADINGS of them, holding no more. A deeper heading is only a line of its
    section's text (a glossary of H4 terms under heading_levels 3 is packed like prose), so it
    is neither held nor counted."""
    out: list[Heading] = []
    for heading in _headings(lines.texts):
        if heading.level > levels:
            continue
        if len(out) == MAX_PAGE_HEADINGS:
            raise PageOverLimit(
                f"more than {MAX_PAGE_HEADINGS:,} headings, over MAX_PAGE_HEADINGS (a page "
                "of headings a line or two apart): split the page to index it"
            )
        out.append(heading)
    return out


# --- blocks and units ------------------------------------------------------------------------

_FENCE, _TABLE, _HEADING, _LIST, _ITEM, _PARA = "fence", "table", "heading", "list", "item", "para"


@dataclass(frozen=True, slots=True)
class _Block:
    kind: str
    lo: int  # first line
    hi: int  # one past the last line


@dataclass(frozen=True, slots=True)
class _Unit:
    """The smallest piece the packer moves: a slice of the page text."""

    start: int
    end: int
    tokens: int
    sticky: bool = False  # a heading line: keep it with what follows


def _list_end(texts: Sequence[str], i: int, hi: int) -> int:
    j = i + 1
    while j < hi:
        line = texts[j]
        if not line.strip():
            k = j + 1
            while k < hi and not texts[k].strip():
                k += 1
            if k < hi and (_LIST_ITEM_RE.match(texts[k]) or _indented(texts[k])):
                j = k
                continue
            return j
        fence = _fence_open(line)
        if fence is not None:
            if not _indented(line):
                return j
            j = _fence_end(texts, j, hi, fence)
            continue
        if _atx(line) is not None or (_is_table(line) and not _indented(line)):
            return j
        j += 1
    return hi


def _parse_blocks(
    texts: Sequence[str], lo: int, hi: int, *, markdown: bool, lists: bool
) -> Iterator[_Block]:
    """Cut lines ``lo:hi`` into blocks, one at a time (a page of 8 MiB of two-letter paragraphs
    is 2 million of them). Text pages only know blank-line paragraphs."""
    i = lo
    while i < hi:
        line = texts[i]
        if not line.strip():
            i += 1
            continue
        if not markdown:
            j = i + 1
            while j < hi and texts[j].strip():
                j += 1
            yield _Block(_PARA, i, j)
            i = j
            continue
        fence = _fence_open(line)
        if fence is not None:
            j = _fence_end(texts, i, hi, fence)
            yield _Block(_FENCE, i, j)
        elif _is_table(line):
            j = i + 1
            while j < hi and _is_table(texts[j]):
                j += 1
            yield _Block(_TABLE, i, j)
        elif _atx(line) is not None:
            j = i + 1
            yield _Block(_HEADING, i, j)
        elif lists and _LIST_ITEM_RE.match(line):
            j = _list_end(texts, i, hi)
            yield _Block(_LIST, i, j)
        else:
            j = i + 1
            while j < hi:
                nxt = texts[j]
                if (
                    not nxt.strip()
                    or _fence_open(nxt) is not None
                    or _is_table(nxt)
                    or _atx(nxt) is not None
                ):
                    break
                j += 1
            yield _Block(_PARA, i, j)
        i = j


def _list_items(texts: Sequence[str], block: _Block) -> list[_Block]:
    """The top-level items of a list block (lines inside fences never start an item)."""
    m = _LIST_ITEM_RE.match(texts[block.lo])
    base = len(m.group(1).expandtabs(4)) if m else 0
    starts: list[int] = []
    j = block.lo
    while j < block.hi:
        line = texts[j]
        fence = _fence_open(line)
        if fence is not None:
            j = _fence_end(texts, j, block.hi, fence)
            continue
        m = _LIST_ITEM_RE.match(line)
        if m is not None and len(m.group(1).expandtabs(4)) <= base:
            starts.append(j)
        j += 1
    if not starts or starts[0] != block.lo:
        starts.insert(0, block.lo)
    bounds = [*starts, block.hi]
    return [_Block(_ITEM, a, b) for a, b in pairwise(bounds)]


class _Splitter:
    """Turns blocks into units no larger than the target (atomic blocks excepted)."""

    def __init__(self, text: str, lines: _Lines, target: int) -> None:
        self.text = text
        self.lines = lines
        self.target = target

    def _range(self, block: _Block) -> tuple[int, int] | None:
        texts = self.lines.texts
        lo, hi = block.lo, block.hi
        while lo < hi and not texts[lo].strip():
            lo += 1
        while hi > lo and not texts[hi - 1].strip():
            hi -= 1
        if lo >= hi:
            return None
        start = self.lines.starts[lo]
        end = self.lines.ends[hi - 1]
        while end > start and self.text[end - 1].isspace():
            end -= 1
        return start, end

    def units(self, blocks: Iterable[_Block]) -> Iterator[_Unit]:
        for block in blocks:
            yield from self._block_units(block)

    def _block_units(self, block: _Block) -> Iterator[_Unit]:
        rng = self._range(block)
        if rng is None:
            return
        start, end = rng
        tokens = _count(self.text, start, end)
        if block.kind == _HEADING and tokens <= self.target:
            yield _Unit(start, end, tokens, sticky=True)
        elif block.kind in (_FENCE, _TABLE) or tokens <= self.target:
            yield _Unit(start, end, tokens)
        elif block.kind == _LIST:
            for item in _list_items(self.lines.texts, block):
                yield from self._block_units(item)
        elif block.kind == _ITEM:
            inner = list(
                _parse_blocks(self.lines.texts, block.lo, block.hi, markdown=True, lists=False)
            )
            if len(inner) == 1 and inner[0].kind == _PARA:
                yield from self._split_text(start, end, 0)
            else:
                yield from self.units(inner)
        else:
            yield from self._split_text(start, end, 0)

    def _pieces(self, start: int, end: int, level: int) -> Iterator[tuple[int, int]]:
        text = self.text
        if level == 0:  # sentences
            pos = start
            for m in _SENTENCE_END_RE.finditer(text, start, end):
                yield pos, m.end()
                pos = m.end()
                while pos < end and text[pos].isspace():
                    pos += 1
            if pos < end:
                yield pos, end
        elif level == 1:  # lines
            pos = start
            while pos < end:
                nl = text.find("\n", pos, end)
                stop = end if nl < 0 else nl
                if text[pos:stop].strip():
                    yield pos, stop
                pos = stop + 1
        else:  # words
            for m in _NON_SPACE_RE.finditer(text, start, end):
                yield m.start(), m.end()

    def _token_groups(self, start: int, end: int) -> Iterator[_Unit]:
        """Units of ``target`` tokens; the matches are not all held at once (a 5 MB run of
        punctuation is 5 million of them)."""
        count = first = last = 0
        for m in _TOKEN_RE.finditer(self.text, start, end):
            if count == 0:
                first = m.start()
            last, count = m.end(), count + 1
            if count == self.target:
                yield _Unit(first, last, count)
                count = 0
        if count:
            yield _Unit(first, last, count)

    def _split_text(self, start: int, end: int, level: int) -> Iterator[_Unit]:
        if level > 2:  # a single "word" with more tokens than the target: cut between tokens
            yield from self._token_groups(start, end)
            return
        for a, b in self._pieces(start, end, level):
            while b > a and self.text[b - 1].isspace():
                b -= 1
            while a < b and self.text[a].isspace():
                a += 1
            if a >= b:
                continue
            tokens = _count(self.text, a, b)
            if tokens <= self.target:
                yield _Unit(a, b, tokens)
            else:
                yield from self._split_text(a, b, level + 1)


class _Units:
    """A section's units as arrays (start, end, tokens, sticky): a unit object and its ints took
    ~110 bytes, 2 million of them for a page of 8 MiB of two-letter lines; ~25 bytes here."""

    __slots__ = ("ends", "starts", "sticky", "tokens")

    def __init__(self, units: Iterable[_Unit]) -> None:
        self.starts, self.ends, self.tokens = array("q"), array("q"), array("q")
        self.sticky = bytearray()
        for unit in units:
            self.starts.append(unit.start)
            self.ends.append(unit.end)
            self.tokens.append(unit.tokens)
            self.sticky.append(unit.sticky)


def _pack(
    tokens: Sequence[int], sticky: Sequence[int], target: int, overlap: int
) -> list[tuple[int, int]]:
    """Group consecutive units (their ``tokens`` and whether each is ``sticky``) into chunks as
    ``[first, last)`` unit index ranges.

    A chunk takes units while they fit in ``target``; the next chunk starts with the trailing whole
    units of the previous one that fit in ``overlap`` (dropped from the front when they would push
    the chunk past the target). A unit larger than the target forms a chunk of its own. A sticky
    unit (a heading line) at the end of a chunk moves to the next one, with what it introduces;
    a heading that introduces another heading stays (a page of a million bare headings would
    otherwise move nearly a whole chunk forward per heading: a chunk per heading, each of the
    target's size).
    """
    out: list[tuple[int, int]] = []
    first = 0  # first unit of the current chunk
    fresh = 0  # first unit of the current chunk that no earlier chunk holds
    total = 0  # tokens of units[first:i]
    for i, t in enumerate(tokens):
        if fresh == i:  # only overlap so far: make room, then always take the unit
            while first < i and total + t > target:
                total -= tokens[first]
                first += 1
            total += t
            continue
        if total + t <= target:
            total += t
            continue
        cut = i
        while cut > fresh + 1 and sticky[cut - 1] and not sticky[i]:
            cut -= 1
        tail = sum(tokens[cut:i])
        if cut == i or tail + t > target:
            cut, tail = i, 0
        out.append((first, cut))
        # trailing whole units of the emitted chunk, up to the overlap budget
        ov_first, ov_tokens = cut, 0
        while ov_first > first and ov_tokens + tokens[ov_first - 1] <= overlap:
            ov_first -= 1
            ov_tokens += tokens[ov_first]
        first, fresh, total = ov_first, cut, ov_tokens + tail
        while first < cut and total + t > target:
            total -= tokens[first]
            first += 1
        total += t
    if fresh < len(tokens):
        out.append((first, len(tokens)))
    return out


# --- sections and chunks -----------------------------------------------------------------------


def _norm(title: str) -> str:
    return " ".join(title.split()).casefold()


def _sections(
    page: Page, title: str, lines: _Lines, levels: int
) -> list[tuple[tuple[str, ...], int, int]]:
    """(breadcrumbs, first body line, one past the last body line) of each heading section;
    ``title`` is the page's, cut.

    Each breadcrumb is cut at MAX_FIELD_BYTES once here; the chunks of a section share one tuple
    of them, however many they are."""
    base: tuple[str, ...] = (title,) if title else ()
    n = len(lines.texts)
    if page.kind != "markdown":
        return [(base, 0, n)]
    sections: list[tuple[tuple[str, ...], int, int]] = []
    stack: dict[int, str] = {}
    crumbs, body_lo = base, 0
    headings = _page_headings(lines, levels)
    # The page's first H1 is its own heading: the title stands for it in the breadcrumbs, even
    # when the two are worded differently ("Panes in Windows Terminal" vs "Windows Terminal Panes").
    first = next((h.title for h in headings if h.level == 1), None)
    h1 = bounded(first, MAX_FIELD_BYTES) if first is not None else None
    for h in headings:
        sections.append((crumbs, body_lo, h.line))
        stack = {lvl: t for lvl, t in stack.items() if lvl < h.level}
        stack[h.level] = bounded(h.title, MAX_FIELD_BYTES)
        trail = [
            t
            for lvl, t in sorted(stack.items())
            if t and not (lvl == 1 and (_norm(t) == _norm(title) or t == h1))
        ]
        crumbs, body_lo = base + tuple(trail), h.line + 1
    sections.append((crumbs, body_lo, n))
    return sections


def _chunk_id(page: Page, breadcrumbs: tuple[str, ...], text: str) -> str:
    key = "\x00".join((page.source, page.source_path, *breadcrumbs, text))
    return hashlib.sha256(key.encode("utf-8")).hexdigest()[:16]


def chunk_page(page: Page, options: ChunkOptions = _DEFAULT_OPTIONS) -> list[Chunk]:
    """Cut one page into chunks, in page order.

    Each Markdown heading section (down to ``options.heading_levels``) is its own chunk, or several
    when it is larger than ``options.target_tokens``; a section without body text gives none.
    Breadcrumbs are the page title followed by the headings above the section (the page's first
    H1, and any H1 equal to the title, are not repeated). ``embed_text`` is ``page.context`` (or the breadcrumbs joined with
    " > ") followed by a blank line and the text. Identical chunks of one page get ids suffixed
    "-2", "-3", ... in page order. The title, URL, each breadcrumb, the prefix and the metadata
    are cut to the reader's caps (the module's docstring). Raises PageOverLimit for a page of
    more than MAX_PAGE_HEADINGS headings down to ``options.heading_levels`` or MAX_PAGE_CHUNKS
    chunks, or whose path is over
    MAX_FIELD_BYTES.
    """
    _check_path(page.source_path)
    text = page.text
    markdown = page.kind == "markdown"
    lines = _Lines(text)
    splitter = _Splitter(text, lines, options.target_tokens)
    title = bounded(page.title, MAX_FIELD_BYTES)
    url = bounded(page.url, MAX_FIELD_BYTES)
    metadata = bounded_metadata(page.metadata)
    chunks: list[Chunk] = []
    seen: dict[str, int] = {}
    for crumbs, lo, hi in _sections(page, title, lines, options.heading_levels):
        blocks = _parse_blocks(lines.texts, lo, hi, markdown=markdown, lists=markdown)
        units = _Units(splitter.units(blocks))
        if not units.tokens:
            continue
        prefix = _prefix(page.context or _CRUMB_JOIN.join(crumbs))
        for a, b in _pack(
            units.tokens, units.sticky, options.target_tokens, options.overlap_tokens
        ):
            for start, end in _within_bytes(text, units.starts[a], units.ends[b - 1]):
                if len(chunks) == MAX_PAGE_CHUNKS:
                    raise PageOverLimit(
                        f"more than {MAX_PAGE_CHUNKS:,} chunks, over MAX_PAGE_CHUNKS: split "
                        "the page (or raise the base's target_tokens) to index it"
                    )
                body = text[start:end]
                cid = _chunk_id(page, crumbs, body)
                count = seen.get(cid, 0) + 1
                seen[cid] = count
                chunks.append(
                    Chunk(
                        chunk_id=cid if count == 1 else f"{cid}-{count}",
                        source=page.source,
                        source_path=page.source_path,
                        title=title,
                        breadcrumbs=crumbs,
                        text=body,
                        embed_text=f"{prefix}{_PREFIX_GAP}{body}" if prefix else body,
                        url=url,
                        metadata=metadata,
                    )
                )
    return chunks


def _check_path(path: str) -> None:
    """Raise PageOverLimit for a path over MAX_FIELD_BYTES (a record's id, a folder nested
    deep): it is the key of the page and of each chunk's, so it is refused, not cut (a cut key
    finds no page), and never written into every chunk for the reader to cut."""
    if len(path) <= MAX_FIELD_BYTES // 4:
        return
    size = len(path.encode("utf-8", "surrogatepass"))
    if size > MAX_FIELD_BYTES:
        raise PageOverLimit(
            f"a path (or record id) of {size:,} bytes, over MAX_FIELD_BYTES ({MAX_FIELD_BYTES:,})"
        )


def _prefix(context: str) -> str:
    """``embed_text``'s prefix: with the blank line after it, one field (MAX_FIELD_BYTES)."""
    return bounded(context, MAX_FIELD_BYTES - len(_PREFIX_GAP))


def bounded(text: str, cap: int) -> str:
    """``text`` within ``cap`` bytes (UTF-8), cut at a character when over."""
    if len(text) <= cap // 4:  # within it whatever the characters are
        return text
    data = text.encode("utf-8", "surrogatepass")
    if len(data) <= cap:
        return text
    return data[:cap].decode("utf-8", "ignore")


def bounded_metadata(metadata: Mapping[str, MetaValue]) -> Mapping[str, MetaValue]:
    """``metadata`` as the reader keeps it (index/tables.py): each key and string cut at
    MAX_FIELD_BYTES; of the first MAX_META_STRINGS entries, in order, those whose strings fit
    in what is left of MAX_META_STRINGS and MAX_META_BYTES. An entry over either is left out
    and the ones after it still looked at: a record's 70 tags cost the tags, not the ``lang``
    after them (s12's F7: a filter ``lang = "en"`` lost such records). Of two keys the cut
    makes one, the first is kept and the second left out (the build names it), not written over
    the first. No more entries are looked at than could be kept (each kept one is a string at
    least). The mapping itself when it is within every cap, as nearly all are."""
    out: dict[str, MetaValue] = {}
    budget, strings = MAX_META_BYTES, MAX_META_STRINGS
    for key, value in islice(metadata.items(), MAX_META_STRINGS):
        values = meta_values(value)
        cut = [bounded(s, MAX_FIELD_BYTES) for s in (key, *values)]
        if 1 + len(values) > strings or cut[0] in out:
            continue
        strings -= 1 + len(values)
        size = sum(len(s.encode("utf-8", "surrogatepass")) for s in cut)
        if size <= budget:
            out[cut[0]] = cut[1] if isinstance(value, str) else tuple(cut[1:])
            budget -= size
    if len(out) == len(metadata) and all(out.get(k) == v for k, v in metadata.items()):
        return metadata
    return MappingProxyType(out)


def _within_bytes(text: str, start: int, end: int) -> Iterator[tuple[int, int]]:
    """``text[start:end]`` as consecutive slices of at most MAX_CHUNK_BYTES (UTF-8), cut at the
    last line break of a slice's second half where there is one; whitespace at a cut is left
    out. Most chunks are one slice, known from their length alone."""
    if 4 * (end - start) <= MAX_CHUNK_BYTES or _utf8(text, start, end) <= MAX_CHUNK_BYTES:
        yield start, end
        return
    while start < end:
        stop = _longest_slice(text, start, end)
        if stop < end:
            line = text.rfind("\n", start + (stop - start) // 2, stop)
            stop = line if line > start else stop
        piece_end = stop
        while piece_end > start and text[piece_end - 1].isspace():
            piece_end -= 1
        if piece_end > start:
            yield start, piece_end
        start = stop
        while start < end and text[start].isspace():
            start += 1


def _longest_slice(text: str, start: int, end: int) -> int:
    """The end of the longest slice from ``start`` within MAX_CHUNK_BYTES (at least one
    character)."""
    stop = min(end, start + MAX_CHUNK_BYTES)
    while stop > start + 1 and _utf8(text, start, stop) > MAX_CHUNK_BYTES:
        over = _utf8(text, start, stop) - MAX_CHUNK_BYTES
        stop -= max(1, over // 4)  # a character is at most 4 bytes: never below the longest
    return stop


def _utf8(text: str, start: int, end: int) -> int:
    return len(text[start:end].encode("utf-8", "surrogatepass"))
