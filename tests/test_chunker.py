"""Heading-aware chunking: properties over generated Markdown, and worked examples."""

from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass
from itertools import pairwise

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from index import chunker
from index.chunker import ChunkOptions, chunk_page, count_tokens, markdown_headings
from index.errors import SourceError
from index.tables import MAX_EMBED_BYTES, MAX_FIELD_BYTES, MAX_META_BYTES, MAX_META_STRINGS
from index.types import Chunk, MetaValue, Page, meta_values

TITLE = "Guide"

# --- a Markdown document generator -----------------------------------------------------------

WORDS = (
    "pane tab profile shell window key binding split focus theme font color "
    "remote sync copy mount cache flag option backend bucket token retry "
    "the a of to and in is for with on"
).split()


@dataclass(frozen=True)
class Element:
    kind: str  # heading, para, fence, table, list
    text: str
    level: int = 0  # headings
    title: str = ""  # headings: the title the breadcrumbs must show


@st.composite
def sentences(draw: st.DrawFn) -> str:
    words = draw(st.lists(st.sampled_from(WORDS), min_size=1, max_size=14))
    words[0] = words[0].capitalize()
    return " ".join(words) + draw(st.sampled_from([".", ".", "!", "?", ","]))


@st.composite
def paragraphs(draw: st.DrawFn) -> Element:
    sents = draw(st.lists(sentences(), min_size=1, max_size=8))
    breaks = draw(st.lists(st.booleans(), min_size=len(sents), max_size=len(sents)))
    text = sents[0]
    for s, br in zip(sents[1:], breaks, strict=False):
        text += ("\n" if br else " ") + s
    return Element("para", text)


@st.composite
def fences(draw: st.DrawFn, uid: int) -> Element:
    char = draw(st.sampled_from("`~"))
    length = draw(st.integers(3, 5))
    other = "~" if char == "`" else "`"
    content = draw(
        st.lists(
            st.sampled_from(
                [
                    "# comment that looks like a heading",
                    "## also not a heading",
                    "### nor this",
                    "echo $HOME",
                    "",
                    "| not | a table |",
                    "- not a list",
                    other * 3,
                    char * (length - 1) if length > 3 else "plain",
                ]
            ),
            max_size=8,
        )
    )
    close = char * (length + draw(st.integers(0, 1)))
    lines = [f"{char * length}sh uid{uid}x", *content, close]
    return Element("fence", "\n".join(lines))


@st.composite
def tables(draw: st.DrawFn, uid: int) -> Element:
    rows = draw(st.lists(st.lists(st.sampled_from(WORDS), min_size=2, max_size=2), max_size=4))
    lines = [f"| col uid{uid}x | value |", "|---|---|", *(f"| {a} | {b} |" for a, b in rows)]
    return Element("table", "\n".join(lines))


@st.composite
def lists(draw: st.DrawFn) -> Element:
    items = draw(st.lists(st.lists(st.sampled_from(WORDS), min_size=1, max_size=6), min_size=1))
    ordered = draw(st.booleans())
    lines = []
    for n, words in enumerate(items, 1):
        marker = f"{n}." if ordered else "-"
        nested = n > 1 and draw(st.booleans())
        lines.append(("  - " if nested else f"{marker} ") + " ".join(words))
    return Element("list", "\n".join(lines))


@st.composite
def blocks(draw: st.DrawFn, uid: int) -> Element:
    kind = draw(st.sampled_from(["para", "para", "fence", "table", "list"]))
    if kind == "fence":
        return draw(fences(uid))
    if kind == "table":
        return draw(tables(uid))
    if kind == "list":
        return draw(lists())
    return draw(paragraphs())


@st.composite
def headings(draw: st.DrawFn, uid: int) -> Element:
    level = draw(st.integers(1, 4))
    words = " ".join(draw(st.lists(st.sampled_from(WORDS), min_size=1, max_size=3)))
    title = f"Topic{uid} {words}"
    style = draw(st.sampled_from(["plain", "closed", "anchor"]))
    suffix = {"plain": "", "closed": " " + "#" * level, "anchor": f" {{#topic-{uid}}}"}[style]
    return Element("heading", f"{'#' * level} {title}{suffix}", level, title)


@st.composite
def documents(draw: st.DrawFn) -> list[Element]:
    n = draw(st.integers(0, 30))
    out: list[Element] = []
    for uid in range(n):
        is_heading = draw(st.integers(0, 3)) == 0
        out.append(draw(headings(uid)) if is_heading else draw(blocks(uid)))
    return out


options_strategy = st.builds(
    ChunkOptions,
    target_tokens=st.integers(8, 300),
    overlap_tokens=st.integers(0, 48),
    heading_levels=st.integers(1, 4),
)


def render(elements: list[Element]) -> str:
    return "\n\n".join(e.text for e in elements) + "\n"


def is_split(e: Element, options: ChunkOptions) -> bool:
    return e.kind == "heading" and e.level <= options.heading_levels


def page_of(text: str, title: str = TITLE, **kw: str) -> Page:
    return Page(source="docs", source_path="guide.md", title=title, text=text, **kw)  # type: ignore[arg-type]


PROPERTY_SETTINGS = settings(
    max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)


# --- properties ----------------------------------------------------------------------------------


@PROPERTY_SETTINGS
@given(documents(), options_strategy)
def test_no_text_lost(elements: list[Element], options: ChunkOptions) -> None:
    chunks = chunk_page(page_of(render(elements)), options)
    texts = [c.text for c in chunks]
    for e in elements:
        if is_split(e, options):
            continue
        # only a block over the target is cut (never a fence or table): then its words all survive
        whole_lines = e.kind in ("fence", "table") or count_tokens(e.text) <= options.target_tokens
        for line in e.text.split("\n"):
            if not line.strip():
                continue
            if whole_lines:
                assert any(line.strip() in t for t in texts), line
            else:
                for word in line.split():
                    assert any(word in t for t in texts), word


def _occurrences(text: str, part: str) -> int:
    """How many times ``part`` occurs in ``text``, overlapping ones too ("a a. a a. a a." holds
    "a a. a a." twice, which ``str.count`` counts once)."""
    return sum(1 for _ in re.finditer(f"(?={re.escape(part)})", text))


@PROPERTY_SETTINGS
@given(documents(), options_strategy)
def test_chunks_cover_the_body_verbatim(elements: list[Element], options: ChunkOptions) -> None:
    text = render(elements)
    chunks = chunk_page(page_of(text), options)
    if any(_occurrences(text, c.text) != 1 for c in chunks):
        return  # a chunk text that occurs twice in the page cannot be placed unambiguously
    covered = bytearray(len(text))
    previous = -1
    for c in chunks:
        start = text.find(c.text)  # every chunk is a verbatim slice of the page ...
        assert start > previous  # ... and chunks come in page order
        covered[start : start + len(c.text)] = b"\x01" * len(c.text)
        previous = start
    heading_lines = {e.text for e in elements if is_split(e, options)}
    offset = 0
    for line in text.split("\n"):
        if line not in heading_lines:
            for k, ch in enumerate(line):
                assert ch.isspace() or covered[offset + k], line
        offset += len(line) + 1


@PROPERTY_SETTINGS
@given(documents(), options_strategy)
def test_nothing_duplicated_beyond_overlap(elements: list[Element], options: ChunkOptions) -> None:
    chunks = chunk_page(page_of(render(elements)), options)
    body = "\n".join(e.text for e in elements if not is_split(e, options))
    total = sum(count_tokens(c.text) for c in chunks)
    slack = 0  # the token estimate is additive over whitespace, so the bound is exact
    assert total <= count_tokens(body) + max(0, len(chunks) - 1) * options.overlap_tokens + slack


@PROPERTY_SETTINGS
@given(documents(), options_strategy)
def test_sizes_within_target_except_atomic_blocks(
    elements: list[Element], options: ChunkOptions
) -> None:
    atomic = {e.text for e in elements if e.kind in ("fence", "table")}
    for c in chunk_page(page_of(render(elements)), options):
        assert c.text.strip(), "no empty chunks"
        assert count_tokens(c.text) <= options.target_tokens or c.text in atomic


@PROPERTY_SETTINGS
@given(documents(), options_strategy)
def test_fences_and_tables_never_split(elements: list[Element], options: ChunkOptions) -> None:
    chunks = chunk_page(page_of(render(elements)), options)
    for e in elements:
        if e.kind not in ("fence", "table"):
            continue
        marker = e.text.split("\n", 1)[0]  # holds the block's unique uid
        holders = [c for c in chunks if marker in c.text]
        assert holders, e.text
        for c in holders:
            assert e.text in c.text, "a chunk holds part of a fence or table"
        if len(holders) > 1:  # only an overlap repeats a block, and overlaps are bounded
            assert count_tokens(e.text) <= options.overlap_tokens


@PROPERTY_SETTINGS
@given(documents(), options_strategy)
def test_headings_inside_fences_never_split(elements: list[Element], options: ChunkOptions) -> None:
    chunks = chunk_page(page_of(render(elements)), options)
    expected = {e.title for e in elements if is_split(e, options)}
    seen = {crumb for c in chunks for crumb in c.breadcrumbs[1:]}
    assert seen <= expected
    assert not any("comment that looks like a heading" in crumb for crumb in seen)


@PROPERTY_SETTINGS
@given(documents(), options_strategy, st.data())
def test_ids_stable_and_local(
    elements: list[Element], options: ChunkOptions, data: st.DataObject
) -> None:
    page = page_of(render(elements))
    first = chunk_page(page, options)
    assert [c.chunk_id for c in first] == [c.chunk_id for c in chunk_page(page, options)]
    assert len({c.chunk_id for c in first}) == len(first)

    # edit one section: append a paragraph at its end
    starts = [i for i, e in enumerate(elements) if is_split(e, options)]
    if not starts:
        return
    k = data.draw(st.sampled_from(starts))
    end = next((i for i in range(k + 1, len(elements)) if is_split(elements[i], options)), None)
    end = len(elements) if end is None else end
    edited = [*elements[:end], Element("para", "Zebra changed here."), *elements[end:]]
    second = chunk_page(page_of(render(edited)), options)

    target = next(c.breadcrumbs for c in second if "Zebra changed here." in c.text)
    first_h1 = next((e for e in elements if e.kind == "heading" and e.level == 1), None)
    # the page's first H1 is the page's own heading: the title stands for it
    expected = TITLE if elements[k] is first_h1 else elements[k].title
    assert target[-1] == expected

    def others(chunks: list[Chunk]) -> list[str]:
        return [c.chunk_id for c in chunks if c.breadcrumbs != target]

    assert others(first) == others(second)
    before = {c.chunk_id for c in first if c.breadcrumbs == target}
    after = {c.chunk_id for c in second if c.breadcrumbs == target}
    assert after - before


@PROPERTY_SETTINGS
@given(documents(), options_strategy)
def test_chunk_fields(elements: list[Element], options: ChunkOptions) -> None:
    page = page_of(render(elements), url="https://example.com/guide")
    for c in chunk_page(page, options):
        assert c.breadcrumbs[0] == TITLE
        assert c.embed_text == " > ".join(c.breadcrumbs) + "\n\n" + c.text
        assert c.url == page.url
        assert c.metadata is page.metadata
        assert (c.title, c.source, c.source_path) == (TITLE, "docs", "guide.md")


# --- examples ------------------------------------------------------------------------------------

PANES = """\
# Panes

Panes let you run several shells side by side.

## Creating a new pane

### Using the keyboard

Press Alt+Shift+D.

```bash
# split the pane
wt split-pane
```

#### Keyboard tips

Bind your own keys.

### Using the mouse

Alt+click the new tab button.

## Closing a pane {#close}

Press Ctrl+Shift+W.
"""


def test_breadcrumbs_follow_headings_and_skip_an_h1_equal_to_the_title() -> None:
    chunks = chunk_page(page_of(PANES, title="Panes"))
    assert [c.breadcrumbs for c in chunks] == [
        ("Panes",),
        ("Panes", "Creating a new pane", "Using the keyboard"),
        ("Panes", "Creating a new pane", "Using the mouse"),
        ("Panes", "Closing a pane"),
    ]
    keyboard = chunks[1]
    assert keyboard.text.startswith("Press Alt+Shift+D.")
    assert "# split the pane" in keyboard.text  # a heading inside a fence is code
    assert "#### Keyboard tips\n\nBind your own keys." in keyboard.text  # H4 stays in the text
    assert "### Using the keyboard" not in keyboard.text  # the heading line is in the breadcrumbs
    assert keyboard.embed_text == (
        "Panes > Creating a new pane > Using the keyboard\n\n" + keyboard.text
    )


def test_first_h1_is_the_page_heading_and_a_later_h1_is_kept() -> None:
    text = "Intro words.\n\n# Panes in Windows Terminal\n\nBody.\n\n### Deep\n\nMore.\n\n# Appendix\n\nEnd.\n"
    chunks = chunk_page(page_of(text, title="Windows Terminal Panes"))
    assert [c.breadcrumbs for c in chunks] == [
        ("Windows Terminal Panes",),
        ("Windows Terminal Panes",),
        ("Windows Terminal Panes", "Deep"),
        ("Windows Terminal Panes", "Appendix"),
    ]
    assert [c.text for c in chunks] == ["Intro words.", "Body.", "More.", "End."]


def test_heading_without_body_gives_no_chunk() -> None:
    chunks = chunk_page(page_of("## Parent\n### Child\nChild text.\n## Empty\n\n"))
    assert [(c.breadcrumbs, c.text) for c in chunks] == [
        ((TITLE, "Parent", "Child"), "Child text.")
    ]


def test_heading_levels_option() -> None:
    text = "## A\n\nalpha\n\n### B\n\nbeta\n"
    one = chunk_page(page_of(text), ChunkOptions(heading_levels=2))
    assert [c.breadcrumbs for c in one] == [(TITLE, "A")]
    assert one[0].text == "alpha\n\n### B\n\nbeta"
    assert chunk_page(page_of(text), ChunkOptions(heading_levels=0))[0].breadcrumbs == (TITLE,)


@pytest.mark.parametrize(
    "fence",
    [
        "```\n# not a heading\n```",
        "~~~python\n# not a heading\n~~~",
        "````md\n```\n# not a heading\n```\n````",  # a shorter fence does not close
        "```\n# not a heading\n~~~\n## still code\n```",  # nor does the other character
        "~~~\n# not a heading\n~~~~~~",  # a longer one of the same character does
    ],
)
def test_headings_inside_fences_are_code(fence: str) -> None:
    text = f"## Real\n\n{fence}\n\nafter\n"
    chunks = chunk_page(page_of(text))
    assert len(chunks) == 1
    assert chunks[0].breadcrumbs == (TITLE, "Real")
    assert chunks[0].text == f"{fence}\n\nafter"
    assert [h.title for h in markdown_headings(text)] == ["Real"]


def test_unclosed_fence_runs_to_the_end() -> None:
    text = "## A\n\n```\n## inside\n\nstill code\n"
    chunks = chunk_page(page_of(text))
    assert [c.breadcrumbs for c in chunks] == [(TITLE, "A")]


def test_long_paragraph_splits_at_sentences_with_bounded_overlap() -> None:
    sentences = [f"Sentence number {i} talks about panes." for i in range(60)]
    text = "## Long\n\n" + " ".join(sentences) + "\n"
    options = ChunkOptions(target_tokens=40, overlap_tokens=10)
    chunks = chunk_page(page_of(text), options)
    assert len(chunks) > 5
    for c in chunks:
        assert count_tokens(c.text) <= 40
        assert c.text.startswith("Sentence")
        assert c.text.endswith(".")
    for a, b in pairwise(chunks):
        last = a.text.rsplit("Sentence", 1)[1]
        assert b.text.startswith("Sentence" + last)  # one whole sentence (7 tokens) carried over
    assert (
        sum(count_tokens(c.text) for c in chunks) <= count_tokens(text) - 3 + (len(chunks) - 1) * 10
    )


def test_no_overlap_when_no_whole_block_fits() -> None:
    paras = [" ".join(["word"] * 30) + "." for _ in range(4)]
    text = "\n\n".join(paras)
    chunks = chunk_page(page_of(text), ChunkOptions(target_tokens=40, overlap_tokens=20))
    assert [c.text for c in chunks] == paras


def test_overlap_carries_trailing_small_blocks() -> None:
    # 6, 4 and 5 tokens
    text = "First para has five tokens.\n\nSecond one here.\n\nThird one here now.\n"
    chunks = chunk_page(page_of(text), ChunkOptions(target_tokens=10, overlap_tokens=4))
    assert [c.text for c in chunks] == [
        "First para has five tokens.\n\nSecond one here.",
        "Second one here.\n\nThird one here now.",
    ]
    chunks = chunk_page(page_of(text), ChunkOptions(target_tokens=10, overlap_tokens=3))
    assert [c.text for c in chunks] == [
        "First para has five tokens.\n\nSecond one here.",
        "Third one here now.",
    ]


def test_overlong_word_and_sentence_are_cut() -> None:
    word = "-".join(["x"] * 50)  # one whitespace-free run of 99 tokens
    chunks = chunk_page(page_of(word), ChunkOptions(target_tokens=20, overlap_tokens=0))
    assert all(count_tokens(c.text) <= 20 for c in chunks)
    assert "".join(c.text for c in chunks) == word
    sentence = " ".join(["alpha"] * 50)
    chunks = chunk_page(page_of(sentence), ChunkOptions(target_tokens=20, overlap_tokens=0))
    assert [count_tokens(c.text) for c in chunks] == [20, 20, 10]


def test_large_fence_and_table_stay_whole() -> None:
    fence = "```\n" + "\n".join(f"line {i} of code" for i in range(100)) + "\n```"
    table = "| a | b |\n|---|---|\n" + "\n".join(f"| {i} | x |" for i in range(100))
    text = f"## Code\n\nIntro.\n\n{fence}\n\n{table}\n\nOutro.\n"
    chunks = chunk_page(page_of(text), ChunkOptions(target_tokens=50, overlap_tokens=8))
    assert [c.text for c in chunks] == ["Intro.", fence, table, "Outro."]


def test_long_list_splits_at_items() -> None:
    items = [f"- item {i} " + " ".join(["word"] * 10) for i in range(10)]
    text = "\n".join(items) + "\n"
    chunks = chunk_page(page_of(text), ChunkOptions(target_tokens=30, overlap_tokens=0))
    assert [c.text for c in chunks] == ["\n".join(items[i : i + 2]) for i in range(0, 10, 2)]


def test_deeper_heading_moves_to_the_chunk_it_introduces() -> None:
    text = "## A\n\n" + "one two three four five six.\n\n#### Sub\n\nseven eight nine ten.\n"
    chunks = chunk_page(page_of(text), ChunkOptions(target_tokens=12, overlap_tokens=0))
    assert [c.text for c in chunks] == [
        "one two three four five six.",
        "#### Sub\n\nseven eight nine ten.",
    ]


def test_a_run_of_bare_headings_is_packed_not_a_chunk_per_heading() -> None:
    # a heading before a heading moved with it, so each chunk took one new heading and carried
    # the rest forward: 2,000 headings made 2,000 chunks of the target's size (50x the page)
    text = "#### Step\n\n" * 2_000 + "The last step's text.\n"
    options = ChunkOptions(target_tokens=100, overlap_tokens=10)
    chunks = chunk_page(page_of(text), options)
    tokens = count_tokens(text)
    assert len(chunks) <= 2 * tokens // (options.target_tokens - options.overlap_tokens) + 1
    assert sum(len(c.text) for c in chunks) < 2 * len(text)
    assert chunks[-1].text.endswith("#### Step\n\nThe last step's text.")


def test_no_chunk_is_over_max_chunk_bytes() -> None:
    # a table is kept whole and a word of any length is one token: a table of 4 MB was a chunk
    # of 4 MB, sent in every answer that found it, past max_message_bytes
    table = "| a | b |\n|---|---|\n" + "".join(f"| row {i} | {'x' * 40} |\n" for i in range(3000))
    body = f"{table}\nA {'y' * 100_000} word.\n"
    chunks = chunk_page(page_of(f"# Big\n\n{body}"))
    assert all(len(c.text.encode()) <= chunker.MAX_CHUNK_BYTES for c in chunks)
    assert len(chunks) == 10  # 160 kB of table in 6 slices, 100 kB of word in 4
    assert chunks[0].text.startswith("| a | b |\n|---|---|\n| row 0 |")
    assert all(c.text.endswith(" |") for c in chunks[:6])  # the table is cut between rows
    assert "".join("".join(c.text.split()) for c in chunks) == "".join(body.split())


def test_text_pages_have_no_headings() -> None:
    text = "# not a heading\n\nSecond paragraph.\n\n```\nno fence\n```\n"
    page = Page(source="s", source_path="a.txt", title="Notes", text=text, kind="text")
    chunks = chunk_page(page)
    assert [(c.breadcrumbs, c.text) for c in chunks] == [(("Notes",), text.strip())]
    small = chunk_page(page, ChunkOptions(target_tokens=4, overlap_tokens=0))
    # no atomic fences in plain text: an oversized paragraph is cut at lines
    assert [c.text for c in small] == [
        "# not a heading",
        "Second paragraph.",
        "```",
        "no fence",
        "```",
    ]


def test_context_replaces_breadcrumbs_in_embed_text() -> None:
    page = page_of("## A\n\nBody.\n", context="Hotel Alpha, FAQ")
    (chunk,) = chunk_page(page)
    assert chunk.breadcrumbs == (TITLE, "A")
    assert chunk.embed_text == "Hotel Alpha, FAQ\n\nBody."


def test_chunk_id_formula_and_duplicates() -> None:
    text = "## Same\n\nRepeated body.\n\n## Same\n\nRepeated body.\n\n## Same\n\nRepeated body.\n"
    chunks = chunk_page(page_of(text))
    key = "\x00".join(["docs", "guide.md", TITLE, "Same", "Repeated body."])
    base = hashlib.sha256(key.encode()).hexdigest()[:16]
    assert [c.chunk_id for c in chunks] == [base, f"{base}-2", f"{base}-3"]
    other = chunk_page(Page(source="docs", source_path="other.md", title=TITLE, text=text))
    assert other[0].chunk_id != base


def test_empty_page_gives_no_chunks() -> None:
    assert chunk_page(page_of("")) == []
    assert chunk_page(page_of("\n\n   \n# Only a heading\n")) == []


def test_crlf_text() -> None:
    chunks = chunk_page(page_of("## A\r\n\r\nBody line.\r\n\r\n## B\r\nMore.\r\n"))
    assert [(c.breadcrumbs[-1], c.text) for c in chunks] == [("A", "Body line."), ("B", "More.")]


def test_count_tokens() -> None:
    assert count_tokens("") == 0
    assert count_tokens("Hello, world!") == 4
    assert count_tokens("wt.exe split-pane -H") == 8
    assert count_tokens("naïve café") == 2


@pytest.mark.parametrize(
    "kwargs",
    [{"target_tokens": 0}, {"overlap_tokens": -1}, {"heading_levels": 7}],
)
def test_options_are_validated(kwargs: dict[str, int]) -> None:
    with pytest.raises(ValueError, match="must be"):
        ChunkOptions(**kwargs)


# --- hostile lines: linear time ----------------------------------------------------------------

# The patterns the chunker had before they were made linear; the new ones must agree with them.
_QUADRATIC = {
    "_ATX_CLOSE_RE": r"(?:^|[ \t]+)#+[ \t]*$",
    "_HEADING_ATTRS_RE": r"[ \t]*\{[#.][^{}]*\}[ \t]*$",
    "_SENTENCE_END_RE": r"[.!?]+[\"')\]]*(?=\s)",
}


@settings(max_examples=300, deadline=None)
@given(st.text(alphabet=" \t#.!?{})\"'x\n", max_size=40))
def test_linear_patterns_match_what_the_old_ones_matched(text: str) -> None:
    for name, old in _QUADRATIC.items():
        new = getattr(chunker, name)
        assert [m.span() for m in new.finditer(text)] == [
            m.span() for m in re.finditer(old, text)
        ], name
        assert new.sub("", text) == re.sub(old, "", text), name


SPACES = " " * 200_000


@pytest.mark.parametrize(
    ("text", "heading"),
    [
        # each took minutes at this size (quadratic backtracking); now milliseconds
        ("# Title" + SPACES + "end ##\n\nBody.", "Title" + SPACES + "end"),
        ("# Title" + SPACES + "{#anchor\n\nBody.", "Title" + SPACES + "{#anchor"),
        ("# Title" + SPACES + "{#anchor}\n\nBody.", "Title"),
    ],
    ids=["heading-spaces", "heading-open-attrs", "heading-attrs"],
)
def test_hostile_headings_are_parsed(text: str, heading: str) -> None:
    assert [h.title for h in markdown_headings(text)] == [heading]
    assert [c.text for c in chunk_page(page_of(text))] == ["Body."]


def test_a_run_of_dots_is_cut_between_tokens() -> None:
    text = "Dots " + "." * 200_000 + " end."
    chunks = chunk_page(page_of(text), ChunkOptions(target_tokens=256, overlap_tokens=0))
    assert all(count_tokens(c.text) <= 256 for c in chunks)
    assert "".join(c.text for c in chunks).replace(" ", "") == text.replace(" ", "")
    assert len(chunks) > 200_000 // 256


# --- a chunk's strings within the reader's caps; a page's headings and chunks bounded ---------


def _utf8(text: str) -> int:
    return len(text.encode("utf-8"))


def test_a_huge_heading_is_cut_to_the_readers_field_cap_in_every_chunk() -> None:
    heading = "word " * 100_000  # 500 kB: every chunk of its section carried a copy
    body = "The roaming password resets every ninety days.\n\n" * 200
    chunks = chunk_page(page_of(f"# Guide\n\n## {heading}\n\n{body}"))
    assert len(chunks) > 5
    cut = heading.strip()[:MAX_FIELD_BYTES]
    for chunk in chunks:
        assert chunk.breadcrumbs == (TITLE, cut)
        assert _utf8(chunk.embed_text) <= _utf8(chunk.text) + MAX_FIELD_BYTES
        assert chunk.embed_text.startswith(f"{TITLE} > word word")


def test_a_long_title_and_context_are_cut_at_a_character() -> None:
    title = "é" * 10_000  # 20,000 bytes: the cut falls inside none of them
    chunks = chunk_page(page_of("Some text.", title=title, context="ü" * 10_000))
    [chunk] = chunks
    assert chunk.title == chunk.breadcrumbs[0] == "é" * (MAX_FIELD_BYTES // 2)
    prefix = chunk.embed_text.removesuffix("\n\nSome text.")
    assert prefix == "ü" * ((MAX_FIELD_BYTES - 2) // 2)
    assert _utf8(chunk.embed_text) <= MAX_EMBED_BYTES


def test_metadata_is_written_as_the_reader_keeps_it() -> None:
    metadata: dict[str, MetaValue] = {"plan": "x" * 10_000, "tags": ("a", "b" * 5_000)}
    metadata |= {f"k{i}": "v" * 1_000 for i in range(40)}  # 40 kB: past MAX_META_BYTES
    [chunk] = chunk_page(page_of("Some text.", metadata=metadata))  # type: ignore[arg-type]
    kept = chunk.metadata
    assert kept["plan"] == "x" * MAX_FIELD_BYTES
    assert kept["tags"] == ("a", "b" * MAX_FIELD_BYTES)
    strings = [s for k, v in kept.items() for s in (k, *meta_values(v))]
    assert sum(map(_utf8, strings)) <= MAX_META_BYTES
    assert len(strings) <= MAX_META_STRINGS
    assert len(kept) < len(metadata)
    assert list(kept) == list(metadata)[: len(kept)]  # in order, none skipped before the cut


def test_an_entry_over_the_string_cap_is_left_out_and_the_ones_after_it_kept() -> None:
    """s12's F7: 70 tags are over MAX_META_STRINGS; the ``lang`` after them was lost too."""
    tags = tuple(f"t{i}" for i in range(70))
    metadata: dict[str, MetaValue] = {"tags": tags, "lang": "en", "more": tags, "plan": "all"}
    [chunk] = chunk_page(page_of("Some text.", metadata=metadata))  # type: ignore[arg-type]
    assert dict(chunk.metadata) == {"lang": "en", "plan": "all"}
    many = {f"k{i}": tags for i in range(10_000)} | {"lang": "en"}  # past the entries looked at
    [chunk] = chunk_page(page_of("Some text.", metadata=many))  # type: ignore[arg-type]
    assert dict(chunk.metadata) == {}


def test_of_two_keys_the_cut_makes_one_the_first_is_kept() -> None:
    """Two keys alike in their first MAX_FIELD_BYTES are one key once cut: the second was
    written over the first (and both counted against the caps)."""
    long = "k" * MAX_FIELD_BYTES
    metadata: dict[str, MetaValue] = {f"{long}-first": "1", "lang": "en", f"{long}-second": "2"}
    [chunk] = chunk_page(page_of("Some text.", metadata=metadata))  # type: ignore[arg-type]
    assert dict(chunk.metadata) == {long: "1", "lang": "en"}


def test_ordinary_metadata_is_passed_on_as_it_was() -> None:
    metadata = {"title": "Guide", "tags": ("a", "b")}
    [chunk] = chunk_page(page_of("Some text.", metadata=metadata))  # type: ignore[arg-type]
    assert chunk.metadata is metadata


def test_a_page_of_more_headings_than_a_page_may_have_is_refused() -> None:
    with pytest.raises(SourceError, match="over MAX_PAGE_HEADINGS"):
        chunk_page(page_of("## h\n" * 20_001))
    with pytest.raises(SourceError, match="over MAX_PAGE_HEADINGS"):
        chunk_page(page_of("#### h\n" * 20_001), ChunkOptions(heading_levels=4))
    assert chunk_page(page_of("## h\nw\n" * 2_000))  # far within it


def test_headings_below_the_split_levels_are_not_counted_against_the_cap() -> None:
    """s12's F10: a glossary of 21,000 H4 terms (650 kB) under heading_levels 3 makes no
    section of them; it is chunked as text, not refused for its headings."""
    glossary = "# Glossary\n\n" + "".join(
        f"#### term{i}\n\nWhat term {i} means.\n\n" for i in range(21_000)
    )
    chunks = chunk_page(page_of(glossary))
    assert len(chunks) > 100
    assert "#### term20999" in chunks[-1].text


def test_a_page_of_more_chunks_than_a_page_may_have_is_refused() -> None:
    one_each = ChunkOptions(target_tokens=1, overlap_tokens=0)
    with pytest.raises(SourceError, match="over MAX_PAGE_CHUNKS"):
        chunk_page(page_of("w " * 50_001, kind="text"), one_each)
    assert len(chunk_page(page_of("w " * 50_000, kind="text"), one_each)) == 50_000


def test_a_long_url_is_cut_and_a_long_path_refused() -> None:
    [chunk] = chunk_page(page_of("Some text.", url="https://x/" + "a" * 10_000))
    assert chunk.url == ("https://x/" + "a" * 10_000)[:MAX_FIELD_BYTES]
    long_id = Page("records", "r" * (MAX_FIELD_BYTES + 1), "T", "Some text.", kind="text")
    with pytest.raises(SourceError, match="over MAX_FIELD_BYTES"):
        chunk_page(long_id)
    assert chunk_page(Page("records", "r" * MAX_FIELD_BYTES, "T", "Some text.", kind="text"))


@settings(max_examples=500, deadline=None)
@given(st.text(alphabet="ab\r\n", max_size=40), st.integers(1, 7))
def test_lines_one_at_a_time_are_the_pages_lines(text: str, block: int) -> None:
    assert list(chunker._each_line(text, block)) == chunker._Lines(text).texts
