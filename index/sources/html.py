"""A folder of HTML files (``*.html``, ``*.htm``), reduced to their readable text.

Scripts, styles, navigation, headers, footers, asides, ``noscript``, templates, inline SVG and
elements marked ``hidden`` are dropped. Headings become Markdown headings (so the chunker splits
at them and carries them as breadcrumbs), lists become ``-`` items, ``<pre>`` becomes a fenced
block and tables become Markdown tables (kept whole by the chunker). The title is ``<title>``,
else the first ``<h1>``, else the file name's stem. Uses only the standard library's parser.
"""

from __future__ import annotations

import re
from html.parser import HTMLParser
from pathlib import Path

from index.errors import SourceError
from index.sources import PageBytes, SkippedPage
from index.sources.charsets import CharsetError, decode_web
from index.sources.folder import DEFAULT_OPTIONS, FolderOptions, list_files, read_file
from index.types import Page

__all__ = ["HTML_SUFFIXES", "decode_html", "html_to_markdown", "load_html"]

HTML_SUFFIXES = (".html", ".htm")
SKIP_TAGS = frozenset(
    {"script", "style", "nav", "header", "footer", "aside", "noscript", "template", "svg"}
)
_BLOCK_TAGS = frozenset(
    {
        "address", "article", "blockquote", "br", "dd", "details", "dialog", "div", "dl", "dt",
        "fieldset", "figcaption", "figure", "form", "hr", "li", "main", "ol", "p", "section",
        "summary", "ul", "body", "html",
    }
)  # fmt: skip
_HEADINGS = {f"h{n}": n for n in range(1, 7)}
_CELLS = frozenset({"td", "th"})
# Markdown reads a list nested this deep like any deeper one; each level costs two spaces on
# every item line, so an unbounded depth (2 million "<ul>" in 8 MB) writes terabytes.
MAX_LIST_INDENT_LEVELS = 8
# A charset declared in the first bytes of a document (HTML5 asks for it within 1024 bytes).
_META_CHARSET = re.compile(rb"""<meta[^>]+charset\s*=\s*["']?\s*([A-Za-z0-9_.:-]+)""", re.I)
_SNIFF_BYTES = 4096
_LONG_CHARREF = re.compile(r"&#([0-9]{64,})")
# A leading "#" or code fence in plain prose would turn into structure for the chunker.
_MARKDOWN_START = re.compile(r"^( {0,3})(#|`{3}|~{3})")


def _clean(text: str) -> str:
    return " ".join(text.split())


def _escape(text: str) -> str:
    return _MARKDOWN_START.sub(r"\1\\\2", text)


class _Reader(HTMLParser):
    """Collects readable blocks; ``blocks`` holds (markdown text, joins-to-previous-with-newline)."""

    def __init__(self) -> None:
        super().__init__(convert_charrefs=True)
        self.title = ""
        self.first_h1 = ""
        self.blocks: list[tuple[str, bool]] = []
        # the skipped elements still open, and how many of each: an end tag asks whether its
        # element is open, and a scan of a long stack per end tag was quadratic
        self._skip: list[str] = []
        self._skipping: dict[str, int] = {}
        self._in_title = False
        self._title_parts: list[str] = []
        self._inline: list[str] = []
        self._heading = 0
        self._list_depth = 0
        self._item = False
        self._pre: list[str] | None = None
        self._table_depth = 0
        # the outermost table's rows of cells, each cell the texts its end tags closed (cleaned
        # once, when the table is written: a cell closed a million times is not re-read each time)
        self._rows: list[list[list[str]]] = []

    # -- structure ---------------------------------------------------------------------------

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        if self._skip or tag in SKIP_TAGS or _hidden(attrs):
            if tag not in _VOID:
                self._skip.append(tag)
                self._skipping[tag] = self._skipping.get(tag, 0) + 1
            return
        if tag == "title" and not self.title:
            self._in_title = True
        elif self._pre is not None:
            return
        elif tag == "pre":
            self._flush()
            self._pre = []
        elif tag == "table" or self._table_depth:
            self._start_in_table(tag)
        else:
            self._start_block(tag)

    def _start_in_table(self, tag: str) -> None:
        """A table, or a tag inside one: the outermost table's rows and cells; any other tag
        in a table only separates words."""
        if tag == "table":
            self._table_depth += 1
            if self._table_depth == 1:
                self._flush()
                self._rows = []
        elif self._table_depth == 1 and tag == "tr":
            self._end_cell()  # a cell's end tag may be left out
            self._rows.append([])
        elif self._table_depth == 1 and tag in _CELLS:
            self._end_cell()
            if not self._rows:
                self._rows.append([])
            self._rows[-1].append([])
        else:
            self._inline.append(" ")

    def _start_block(self, tag: str) -> None:
        """A heading, a list or its item, or another block outside any table."""
        if tag in _HEADINGS:
            self._flush()
            self._heading = _HEADINGS[tag]
        elif tag in ("ul", "ol"):
            self._flush()
            self._list_depth += 1
        elif tag == "li":
            self._flush()
            self._item = True
        elif tag in _BLOCK_TAGS:
            self._flush()

    def handle_endtag(self, tag: str) -> None:
        if self._skip:
            if self._skipping.get(tag):
                self._end_skipped(tag)
            return
        if tag == "title" and self._in_title:
            self._in_title = False
            self.title = _clean("".join(self._title_parts))
        elif tag == "pre" and self._pre is not None:
            self._emit_pre("".join(self._pre))
            self._pre = None
        elif self._pre is not None:
            return
        elif tag == "table" and self._table_depth:
            self._table_depth -= 1
            if self._table_depth == 0:
                self._end_cell()
                self._emit_table()
        elif self._table_depth == 1 and tag in _CELLS:
            self._end_cell()
        elif self._table_depth:
            return
        elif tag in _HEADINGS or tag == "li":
            self._flush()
            self._heading, self._item = 0, False
        elif tag in ("ul", "ol"):
            self._flush()
            self._list_depth = max(0, self._list_depth - 1)
        elif tag in _BLOCK_TAGS:
            self._flush()

    def _end_skipped(self, tag: str) -> None:
        """Close the innermost open skipped ``tag`` and every skipped element inside it."""
        while True:
            top = self._skip.pop()
            self._skipping[top] -= 1
            if top == tag:
                return

    def handle_data(self, data: str) -> None:
        if self._skip:
            return
        if self._in_title:
            self._title_parts.append(data)
        elif self._pre is not None:
            self._pre.append(data)
        else:
            self._inline.append(data)

    def parse_marked_section(self, i: int, report: bool = True) -> int:
        """A marked section the parser knows (``<![CDATA[``, an MS Office ``<![if``) read as it
        reads them; any other ``<![`` is, as HTML5 reads it, a bogus comment to the next ``>``,
        where the parser's own raised AssertionError out of the build."""
        try:
            return super().parse_marked_section(i, report)
        except AssertionError:
            end = self.rawdata.find(">", i + 3)
            return -1 if end < 0 else end + 1

    def close(self) -> None:
        super().close()
        if self._pre is not None:
            self._emit_pre("".join(self._pre))
            self._pre = None
        if self._table_depth:
            self._end_cell()
            self._emit_table()
            self._table_depth = 0
        self._flush()

    # -- output ------------------------------------------------------------------------------

    def _flush(self) -> None:
        text = _clean("".join(self._inline))
        self._inline = []
        if not text:
            return  # an empty block keeps a pending heading or list item for the text inside
        level, self._heading = self._heading, 0
        item, self._item = self._item, False
        if level:
            if level == 1 and not self.first_h1:
                self.first_h1 = text
            self.blocks.append((f"{'#' * level} {text}", False))
        elif item:
            indent = "  " * min(max(0, self._list_depth - 1), MAX_LIST_INDENT_LEVELS)
            self.blocks.append((f"{indent}- {text}", True))
        else:
            self.blocks.append((_escape(text), False))

    def _emit_pre(self, raw: str) -> None:
        body = raw.strip("\n")
        if not body.strip():
            return
        longest = max((len(m) for m in re.findall(r"`+", body)), default=0)
        fence = "`" * max(3, longest + 1)
        self.blocks.append((f"{fence}\n{body}\n{fence}", False))

    def _end_cell(self) -> None:
        if self._rows and self._rows[-1]:
            self._rows[-1][-1].append("".join(self._inline))
        self._inline = []

    def _emit_table(self) -> None:
        cells = ([_clean(" ".join(c)).replace("|", "\\|") for c in r] for r in self._rows)
        rows = [r for r in cells if any(r)]
        self._rows = []
        if not rows:
            return
        # Only the header row is padded to the widest row: padding every row would write rows
        # times width cells (a row of a million cells over a million short rows: terabytes).
        width = max(len(r) for r in rows)
        header = rows[0] + [""] * (width - len(rows[0]))
        lines = ["| " + " | ".join(r) + " |" for r in [header, ["---"] * width, *rows[1:]]]
        self.blocks.append(("\n".join(lines), False))


_VOID = frozenset(
    {
        "area",
        "base",
        "br",
        "col",
        "embed",
        "hr",
        "img",
        "input",
        "link",
        "meta",
        "source",
        "track",
        "wbr",
    }
)


def _hidden(attrs: list[tuple[str, str | None]]) -> bool:
    for name, value in attrs:
        if name == "hidden" or (name == "aria-hidden" and (value or "").lower() == "true"):
            return True
    return False


def _text_tail(markup: str) -> str:
    """``markup`` with every ``<`` after its last ``>`` written as ``&lt;``.

    No tag, comment or declaration can end there, so the parser reads that tail as text either
    way; but Python 3.11's ``HTMLParser`` tries each such ``<`` against the whole rest of the
    document first, which is quadratic: 20,000 ``<!--`` took 24 s.
    """
    end = markup.rfind(">") + 1
    tail = markup[end:]
    return markup if "<" not in tail else markup[:end] + tail.replace("<", "&lt;")


def _short_charrefs(markup: str) -> str:
    """``markup`` with each decimal character reference of 64 digits or more written short.

    The parser converts ``&#NNN;`` with ``int()``, which refuses more than 4,300 digits: one
    such reference raised ValueError out of the parser and stopped the build. Past its leading
    zeros a reference of more than 7 digits is no character, and the parser writes U+FFFD for
    it: so does this, without the digits."""

    def short(match: re.Match[str]) -> str:
        digits = match.group(1).lstrip("0") or "0"
        return "&#" + (digits if len(digits) <= 7 else "65533")

    return _LONG_CHARREF.sub(short, markup)


def html_to_markdown(markup: str) -> tuple[str, str]:
    """``(title, text)``: the document's title (``<title>``, else the first ``<h1>``, else "")
    and its readable text as Markdown."""
    reader = _Reader()
    reader.feed(_text_tail(_short_charrefs(markup)))
    reader.close()
    parts: list[str] = []
    for text, tight in reader.blocks:
        if parts:
            parts.append("\n" if tight and parts[-1].lstrip().startswith("- ") else "\n\n")
        parts.append(text)
    return reader.title or reader.first_h1, "".join(parts) + ("\n" if parts else "")


def decode_html(data: bytes, declared: str | None = None) -> str:
    """Decode a document by its byte-order mark, else the declared charset (an HTTP header),
    else a ``<meta charset>``, else UTF-8; only a web encoding is read
    (``index.sources.charsets``). Raises CharsetError."""
    charset = declared
    if not charset:
        match = _META_CHARSET.search(data[:_SNIFF_BYTES])
        charset = match.group(1).decode("ascii") if match else "utf-8"
    return decode_web(data, charset)


def html_page_text(
    rel: str, data: bytes, declared: str | None = None
) -> tuple[str, str] | SkippedPage:
    """``(title, markdown text)`` of an HTML document, or why it cannot be used."""
    try:
        markup = decode_html(data, declared)
    except CharsetError as exc:
        return SkippedPage(rel, str(exc))
    title, text = html_to_markdown(markup.replace("\r\n", "\n").replace("\r", "\n"))
    if not text.strip():
        return SkippedPage(rel, "no readable text (only scripts, navigation or markup)")
    return title, text


def load_html(
    source: str,
    root: Path,
    options: FolderOptions = DEFAULT_OPTIONS,
    budget: PageBytes | None = None,
) -> tuple[list[Page], list[SkippedPage]]:
    """Read every HTML file under ``root`` (``index.sources.folder`` says which); a bad file is
    skipped, never raised.

    Raises SourceError only when ``root`` is not a folder, BaseTooLarge when the pages pass
    ``budget`` (``load_markdown``'s).
    """
    budget = budget or PageBytes(source)
    if not root.is_dir():
        raise SourceError(f"html source {source!r}: {root} is not a folder")
    listing = list_files(root, HTML_SUFFIXES, follow_symlinks=options.follow_symlinks)
    pages: list[Page] = []
    skipped = listing.skipped
    for rel, path in listing.files:
        data = read_file(rel, path, options.max_page_bytes)
        got = data if isinstance(data, SkippedPage) else html_page_text(rel, data)
        if isinstance(got, SkippedPage):
            skipped.append(got)
            continue
        title, text = got
        page = Page(source=source, source_path=rel, title=title or path.stem, text=text)
        budget.take(page)
        pages.append(page)
    return pages, skipped
