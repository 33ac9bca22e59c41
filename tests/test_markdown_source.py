"""The Markdown folder source: frontmatter, titles, skipped files, and the real docs sets."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import pytest

from index.chunker import MAX_CHUNK_BYTES, chunk_page, count_tokens
from index.errors import SourceError
from index.sources import SkippedPage
from index.sources.markdown import FrontmatterError, load_markdown, split_frontmatter
from tests.conftest import shared


def write(root: Path, rel: str, content: str | bytes) -> None:
    path = root / rel
    path.parent.mkdir(parents=True, exist_ok=True)
    if isinstance(content, bytes):
        path.write_bytes(content)
    else:
        path.write_text(content, encoding="utf-8")


def test_frontmatter_becomes_string_and_list_metadata(tmp_path: Path) -> None:
    write(
        tmp_path,
        "billing.md",
        """---
title: Billing FAQ
content_type: faq
product_area: billing
plan_scope: [pro, enterprise]
tags:
  - invoices
  - refunds
related_urls:
  - https://example.com/a
  - https://example.com/b
updated: 2024-05-01
reviewed_at: 2024-05-01T10:30:00
priority: 3
ratio: 0.5
draft: false
owner: null
extra:
  team: payments
  since: 2023-01-02
---
# Billing

How refunds work.
""",
    )
    pages, skipped = load_markdown("kb", tmp_path)
    assert skipped == []
    (page,) = pages
    assert page.title == "Billing FAQ"
    assert page.source == "kb"
    assert page.source_path == "billing.md"
    assert page.kind == "markdown"
    assert page.text == "# Billing\n\nHow refunds work.\n"
    assert dict(page.metadata) == {
        "title": "Billing FAQ",
        "content_type": "faq",
        "product_area": "billing",
        # lists stay lists of strings, so a filter can match any element (index/filters.py)
        "plan_scope": ("pro", "enterprise"),
        "tags": ("invoices", "refunds"),
        "related_urls": ("https://example.com/a", "https://example.com/b"),
        "updated": "2024-05-01",
        "reviewed_at": "2024-05-01T10:30:00",
        "priority": "3",
        "ratio": "0.5",
        "draft": "false",
        "owner": "",
        "extra": '{"team":"payments","since":"2023-01-02"}',
    }
    assert json.loads(page.metadata["extra"]) == {"team": "payments", "since": "2023-01-02"}
    assert all(
        isinstance(v, str) or all(isinstance(x, str) for x in v) for v in page.metadata.values()
    )
    # the chunker copies it onto every chunk
    (chunk,) = chunk_page(page)
    assert chunk.metadata["content_type"] == "faq"
    assert chunk.breadcrumbs == (
        "Billing FAQ",
    )  # the first H1 is the page heading: the title stands for it


def test_title_falls_back_to_first_h1_then_stem(tmp_path: Path) -> None:
    write(tmp_path, "a-from-h1.md", "```\n# not this\n```\n\n## Not an H1\n\n# Real Title #\n")
    write(tmp_path, "b-empty-title.md", "---\ntitle: ''\n---\n# From H1\n")
    write(tmp_path, "c-plain-stem.md", "No headings at all.\n")
    write(tmp_path, "d-only-fm.markdown", "---\ndescription: x\n---\n")
    pages, skipped = load_markdown("kb", tmp_path)
    assert skipped == []
    assert [(p.source_path, p.title) for p in pages] == [
        ("a-from-h1.md", "Real Title"),
        ("b-empty-title.md", "From H1"),
        ("c-plain-stem.md", "c-plain-stem"),
        ("d-only-fm.markdown", "d-only-fm"),
    ]
    assert dict(pages[2].metadata) == {}
    # an H1 that became the title is not repeated in the breadcrumbs
    assert chunk_page(pages[1]) == []
    assert [c.breadcrumbs for c in chunk_page(pages[0])] == [("Real Title",)]  # the fence


def test_walk_is_recursive_sorted_and_posix(tmp_path: Path) -> None:
    write(tmp_path, "z.md", "z\n")
    write(tmp_path, "guides/setup/install.md", "install\n")
    write(tmp_path, "guides/b.MD", "upper-case suffix\n")
    write(tmp_path, "guides/a.markdown", "a\n")
    write(tmp_path, "notes.txt", "not markdown\n")
    (tmp_path / "folder.md").mkdir()  # a folder named like a page is not a page
    pages, _ = load_markdown("kb", tmp_path)
    assert [p.source_path for p in pages] == [
        "guides/a.markdown",
        "guides/b.MD",
        "guides/setup/install.md",
        "z.md",
    ]


def test_bad_files_are_skipped_with_a_reason(tmp_path: Path) -> None:
    write(tmp_path, "good.md", "---\ntitle: Good\n---\nfine\n")
    write(tmp_path, "latin1.md", "caf\xe9\n".encode("latin-1"))
    write(tmp_path, "malformed.md", "---\ntitle: [unclosed\n---\nbody\n")
    write(tmp_path, "badmap.md", "---\ntitle: a\n  nested: b\n---\nbody\n")
    write(tmp_path, "list.md", "---\n- a\n- b\n---\nbody\n")
    write(tmp_path, "unterminated.md", "---\ntitle: x\n\nbody without a closing line\n")
    pages, skipped = load_markdown("kb", tmp_path)
    assert [p.source_path for p in pages] == ["good.md"]
    reasons = {s.path: s.reason for s in skipped}
    assert all(isinstance(s, SkippedPage) for s in skipped)
    assert sorted(reasons) == [
        "badmap.md",
        "latin1.md",
        "list.md",
        "malformed.md",
        "unterminated.md",
    ]
    assert reasons["latin1.md"].startswith("not valid UTF-8")
    assert reasons["malformed.md"].startswith("malformed frontmatter: ")
    assert "\n" not in reasons["malformed.md"]
    assert reasons["badmap.md"] == (
        "malformed frontmatter: mapping values are not allowed here (line 3)"
    )
    assert reasons["list.md"] == "malformed frontmatter: not a mapping (a YAML list)"
    assert "no closing" in reasons["unterminated.md"]


def test_a_number_too_long_to_write_as_text_skips_its_page(tmp_path: Path) -> None:
    # YAML reads hex, octal, binary and sexagesimal integers of any length, but Python refuses to write
    # one of more than 4,300 decimal digits as text: the page is skipped, the build goes on
    write(tmp_path, "good.md", "---\ntitle: Good\n---\nfine\n")
    write(tmp_path, "hex.md", "---\nn: 0x" + "f" * 8_000 + "\n---\nbody\n")
    write(tmp_path, "octal.md", "---\nn: 0" + "7" * 8_000 + "\n---\nbody\n")
    write(tmp_path, "sexagesimal.md", "---\nn: 1" + ":59" * 3_000 + "\n---\nbody\n")
    write(tmp_path, "key.md", "---\n? 0x" + "f" * 8_000 + "\n: v\n---\nbody\n")
    write(tmp_path, "title.md", "---\ntitle: 0b" + "1" * 20_000 + "\n---\nbody\n")
    pages, skipped = load_markdown("kb", tmp_path)
    assert [p.source_path for p in pages] == ["good.md"]
    reasons = {s.path: s.reason for s in skipped}
    assert sorted(reasons) == ["hex.md", "key.md", "octal.md", "sexagesimal.md", "title.md"]
    for reason in reasons.values():
        assert reason == (
            f"malformed frontmatter: a number of more than {sys.get_int_max_str_digits():,} "
            "digits (too long to write as text)"
        )
    with pytest.raises(FrontmatterError, match="digits"):
        split_frontmatter("---\nn: 0x" + "f" * 8_000 + "\n---\n")


def test_bom_and_crlf(tmp_path: Path) -> None:
    write(tmp_path, "win.md", b"\xef\xbb\xbf---\r\ntitle: Win\r\n---\r\n# H\r\n\r\nBody.\r\n")
    (page,), _ = load_markdown("kb", tmp_path)
    assert page.title == "Win"
    assert page.text == "# H\n\nBody.\n"


def test_missing_root_is_an_error(tmp_path: Path) -> None:
    with pytest.raises(SourceError, match="not a folder"):
        load_markdown("kb", tmp_path / "nope")


def test_frontmatter_mappings_keyed_by_dates_numbers_or_bytes_are_metadata(tmp_path: Path) -> None:
    # json.dumps refused a date or bytes key inside a mapping: a TypeError out of the build
    # and of `index validate`, every page lost
    write(
        tmp_path,
        "dated.md",
        "---\nextra:\n  2024-01-01: launch\n  7: [{!!binary aGk=: 10:30}]\n---\n# Dated\n",
    )
    write(tmp_path, "plain.md", "# Plain\n\nText.\n")
    pages, skipped = load_markdown("kb", tmp_path)
    assert skipped == []
    dated = next(p for p in pages if p.source_path == "dated.md")
    assert json.loads(dated.metadata["extra"]) == {"2024-01-01": "launch", "7": [{"hi": 630}]}
    assert {p.source_path for p in pages} == {"dated.md", "plain.md"}


def test_split_frontmatter() -> None:
    assert split_frontmatter("# No frontmatter\n") == (None, "# No frontmatter\n", 0)
    assert split_frontmatter("---\n---\nbody") == ({}, "body", 2)
    assert split_frontmatter("---\na: 1\nb: [x, y]\n...\nbody\n") == (
        {"a": 1, "b": ["x", "y"]},
        "body\n",
        4,
    )
    assert split_frontmatter("\ufeff---\n1: one\n---\n") == ({"1": "one"}, "", 3)
    with pytest.raises(FrontmatterError, match="malformed frontmatter: "):
        split_frontmatter("---\n: :\n  - [\n---\n")
    with pytest.raises(FrontmatterError, match="not a mapping"):
        split_frontmatter("---\njust a string\n---\n")
    # the frontmatter error is a SourceError, which is a VoxrecallError
    assert issubclass(FrontmatterError, SourceError)


@pytest.mark.parametrize(
    ("name", "min_pages"), [("docs-windows-terminal", 30), ("docs-rclone", 150)]
)
def test_real_docs_folder(name: str, min_pages: int) -> None:
    root = shared(name, "docs")
    pages, skipped = load_markdown(name, root)
    assert len(pages) > min_pages
    assert all(p.title.strip() for p in pages)
    assert len({p.source_path for p in pages}) == len(pages)
    started = time.perf_counter()
    chunks = [c for p in pages for c in chunk_page(p)]
    seconds = time.perf_counter() - started
    tokens = [count_tokens(c.text) for c in chunks]
    print(
        f"\n{name}: {len(pages)} pages, {len(skipped)} skipped, {len(chunks)} chunks, "
        f"max {max(tokens)} tokens, chunked in {seconds:.2f}s"
    )
    assert len(chunks) >= len(pages)
    assert len({c.chunk_id for c in chunks}) == len(chunks)
    previous = None
    for c, n in zip(chunks, tokens, strict=True):
        assert c.text.strip()
        assert c.breadcrumbs[0] == c.title
        assert len(c.text.encode()) <= MAX_CHUNK_BYTES
        # only an atomic fence or table may exceed the target, or the rest of one cut at
        # MAX_CHUNK_BYTES (each slice but the last is over half of it)
        cut = previous is not None and len(previous.text.encode()) > MAX_CHUNK_BYTES // 2
        if n > 256 and not cut:
            assert c.text.lstrip().startswith(("```", "~~~", "|")), (c.source_path, c.breadcrumbs)
        previous = c
