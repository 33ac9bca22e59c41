"""Hostile source documents (issue 14, items 12-15): each is skipped and named in the build's
report, and everything else of the base is indexed. Real files in tmp, real builds."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import tracemalloc
from http.server import BaseHTTPRequestHandler
from pathlib import Path
from typing import Any

import pytest

from bench.hostile_pdfs import shared_stream_pdf
from index.build import BuildSummary, build_knowledge_base
from index.chunker import MAX_FIELD_BYTES
from index.embedders.base import HashEmbedder
from index.errors import ConfigError
from index.snapshot import LoadedSnapshot, load_snapshot, page_key
from index.sources import PageBytes, SkippedPage, folder, image, pdf
from index.sources.folder import DEFAULT_MAX_PAGE_BYTES, list_files
from index.sources.records import MAX_SKIPS_NAMED
from index.sources.registry import LoadContext, load_source
from index.sources.url import Failed, Fetched, UrlOptions, crawl_urls, fetch, state_path
from index.store import LocalStore
from index.validate import ValidateOptions, validate_docs
from index.watch import local_fingerprint
from sidecar.config import parse_config
from tests.conftest import LIVENESS_S
from tests.local_http import LocalHttpServer, send_json
from tests.static_http import LIARS, StaticServer
from tests.test_sources import make_pdf
from tests.test_store_redirects import Server as RedirectingServer


def build(tmp_path: Path, sources: list[dict[str, Any]]) -> tuple[BuildSummary, LoadedSnapshot]:
    raw = {
        "knowledge_base": [{"name": "kb", "source": sources}],
        "index": {"store": str(tmp_path / "store")},
    }
    config = parse_config(raw, base=tmp_path)
    summary = build_knowledge_base(config, config.knowledge_bases[0], HashEmbedder())
    return summary, load_snapshot(LocalStore(config.index.store).latest_dir("kb"))


def reasons(summary: BuildSummary) -> dict[str, str]:
    return {s["path"]: s["reason"] for s in summary.skipped_pages}


def docs_folder(tmp_path: Path, name: str = "docs") -> Path:
    docs = tmp_path / name
    docs.mkdir()
    (docs / "billing.md").write_text("# Billing\n\nInvoices are sent on the first of the month.\n")
    return docs


# --- 12: jsonl nested 100,000 deep ------------------------------------------------------------


def test_a_jsonl_line_nested_100000_deep_is_skipped_as_file_line(tmp_path: Path) -> None:
    faq = tmp_path / "faq.jsonl"
    deep = "[" * 100_000 + "]" * 100_000
    lines = [
        {"id": "wifi", "text": "Restart the router to fix the wifi."},
        None,  # the hostile line
        {"id": "roam", "text": "Roaming is free in the EU."},
        {"id": "meta", "text": "Deep metadata.", "tags": json.loads("[" * 70 + "]" * 70)},
    ]
    faq.write_text(
        "\n".join(
            f'{{"id": "deep", "text": {deep}}}' if r is None else json.dumps(r) for r in lines
        )
    )
    docs = docs_folder(tmp_path)
    summary, snap = build(
        tmp_path,
        [
            {"name": "faq", "type": "jsonl", "path": str(faq), "metadata_fields": ["tags"]},
            {"name": "docs", "type": "markdown", "path": str(docs)},
        ],
    )
    assert summary.published
    assert reasons(summary) == {
        "faq:faq.jsonl:2": "nested too deeply (arrays or objects more than 64 levels deep)",
        "faq:faq.jsonl:4": "nested too deeply (arrays or objects more than 64 levels deep)",
    }
    assert {(c.source, c.source_path) for c in snap.chunks} == {
        ("faq", "wifi"),
        ("faq", "roam"),
        ("docs", "billing.md"),
    }


def test_a_jsonl_line_over_max_page_bytes_is_skipped_unread(tmp_path: Path) -> None:
    faq = tmp_path / "faq.jsonl"
    big = json.dumps({"id": "big", "text": "word " * 400})
    faq.write_text(f'{big}\n{{"id": "ok", "text": "Small."}}\n{big}')  # the last line: no newline
    source = {"type": "jsonl", "path": str(faq), "max_page_bytes": 1000}
    summary, snap = build(tmp_path, [source])
    assert [c.source_path for c in snap.chunks] == ["ok"]
    size = f"{len(big.encode()):,} bytes, over max_page_bytes (1,000 bytes)"
    assert {path: why.split(";")[0] for path, why in reasons(summary).items()} == {
        "faq.jsonl:1": size,
        "faq.jsonl:3": size,
    }


def test_a_jsonl_line_with_a_number_of_thousands_of_digits_is_skipped(tmp_path: Path) -> None:
    # int() refuses more than 4,300 digits: the ValueError stopped the whole build
    faq = tmp_path / "faq.jsonl"
    faq.write_text(
        f'{{"id": "big", "text": "Huge.", "n": {"9" * 5_000}}}\n{{"id": "ok", "text": "Fine."}}\n'
    )
    summary, snap = build(tmp_path, [{"type": "jsonl", "path": str(faq)}])
    assert reasons(summary) == {
        "faq.jsonl:1": "malformed JSON: a number of more digits than can be read (4,300)"
    }
    assert [c.source_path for c in snap.chunks] == ["ok"]


def test_a_jsonl_of_many_bad_lines_names_the_first_and_counts_the_rest(tmp_path: Path) -> None:
    # every bad line was held as a report entry until the build ended: 4M lines of "x" (8 MB)
    # took 1.85 GB
    faq = tmp_path / "faq.jsonl"
    faq.write_text("x\n" * (MAX_SKIPS_NAMED + 500) + '{"id": "ok", "text": "Fine."}\n' + "x\n")
    summary, snap = build(tmp_path, [{"type": "jsonl", "path": str(faq)}])
    got = reasons(summary)
    assert len(got) == MAX_SKIPS_NAMED + 1
    assert got[f"faq.jsonl:{MAX_SKIPS_NAMED}"].startswith("malformed JSON")
    assert got["faq.jsonl"] == "501 more records skipped, to line 1,502 (the first 1,000 are named)"
    assert [c.source_path for c in snap.chunks] == ["ok"]


# --- 13: a CSV quote left open ----------------------------------------------------------------


def test_a_csv_quote_left_open_is_reported_and_the_next_records_kept(tmp_path: Path) -> None:
    faq = tmp_path / "faq.csv"
    faq.write_text(
        "id,text\n"
        "1,Restart the router.\n"
        '2,"Roaming is free\n'  # line 3: its quote is closed by the first quote of line 5
        "3,Top up online.\n"
        '4,"A quoted answer\nover two lines."\n'
        '5,"A quote closed ""inside"" the field."\n'
        '6,"Broken again\n'  # line 8: closed by the quote of line 9
        '7,"Pay by card."\n'
        "8,Call us.\n"
        '9,"Never closed\n'  # line 11: no quote follows
        "10,Last answer.\n"
    )
    summary, snap = build(tmp_path, [{"type": "csv", "path": str(faq)}])
    texts = {c.source_path: c.text for c in snap.chunks}
    assert texts == {
        "1": "Restart the router.",
        "3": "Top up online.",
        "4": "A quoted answer\nover two lines.",
        "5": 'A quote closed "inside" the field.',
        "7": "Pay by card.",
        "8": "Call us.",
        "10": "Last answer.",
    }
    expected = "malformed CSV: ',' expected after '\"' (in a record from this line to line {}: "
    assert reasons(summary) == {
        "faq.csv:3": expected.format(5) + "an open quote?)",
        "faq.csv:8": expected.format(9) + "an open quote?)",
        "faq.csv:11": "malformed CSV: a quote opened in this record is never closed",
    }


def test_a_csv_record_that_is_not_utf8_is_skipped_alone(tmp_path: Path) -> None:
    faq = tmp_path / "faq.csv"
    faq.write_bytes(b"id,text\n1,Caf\xe9 menu.\n2,Tea menu.\n")
    summary, snap = build(tmp_path, [{"type": "csv", "path": str(faq)}])
    assert [c.source_path for c in snap.chunks] == ["2"]
    assert reasons(summary) == {"faq.csv:2": "not valid UTF-8 (line 2, character 6)"}


# --- 14: links out of the folder --------------------------------------------------------------

OUTSIDE = "a symbolic link to outside the source folder (set follow_symlinks = true to read it)"


def linked_docs(tmp_path: Path) -> Path:
    """A docs folder with links to a secret file and folder outside it, and one link inside."""
    secret = tmp_path / "secret"
    secret.mkdir()
    (secret / "passwd.md").write_text("# Secret\n\nThe admin password is hunter2.\n")
    docs = docs_folder(tmp_path)
    (docs / "leak.md").symlink_to(secret / "passwd.md")
    (docs / "leakdir").symlink_to(secret, target_is_directory=True)
    (docs / "sub").mkdir()
    (docs / "sub" / "alias.md").symlink_to(docs / "billing.md")
    (docs / "sub" / "up").symlink_to(docs, target_is_directory=True)  # a cycle
    return docs


def test_links_out_of_the_folder_are_not_indexed_nor_served(tmp_path: Path) -> None:
    docs = linked_docs(tmp_path)
    summary, snap = build(tmp_path, [{"type": "markdown", "path": str(docs)}])
    assert reasons(summary) == {"leak.md": OUTSIDE, "leakdir/": OUTSIDE}
    assert {c.source_path for c in snap.chunks} == {"billing.md", "sub/alias.md"}
    assert set(snap.pages) == {page_key("markdown", p) for p in ("billing.md", "sub/alias.md")}
    assert not any("hunter2" in text for text in snap.pages.values())


def test_follow_symlinks_reads_links_out_of_the_folder(tmp_path: Path) -> None:
    docs = linked_docs(tmp_path)
    summary, snap = build(
        tmp_path, [{"type": "markdown", "path": str(docs), "follow_symlinks": True}]
    )
    assert summary.skipped_pages == []
    assert {c.source_path for c in snap.chunks} == {
        "billing.md",
        "leak.md",
        "leakdir/passwd.md",
        "sub/alias.md",  # "sub/up" links back to the folder itself: a cycle, not walked
    }


def test_links_that_reach_one_folder_many_ways_walk_it_once(tmp_path: Path) -> None:
    # folders outside the source, each linking twice to the next (no cycle): the bottom one
    # was walked 2^(n-1) times with follow_symlinks (18 levels: 110 s, 262,144 copies of one
    # page); here 2,048 copies. A link to a folder inside the source reads its files where they
    # are, but for a folder the walk cannot reach (its name not UTF-8): read through the link.
    docs = docs_folder(tmp_path)
    chain = tmp_path / "outside"
    for i in range(12):
        (chain / f"d{i}").mkdir(parents=True)
    for i in range(11):
        for name in ("a", "b"):
            (chain / f"d{i}" / name).symlink_to(f"../d{i + 1}")
    (chain / "d11" / "bottom.md").write_text("# Bottom\n\nThe bottom page.\n")
    (docs / "ext").symlink_to(chain / "d0")
    (docs / "v2").mkdir()
    (docs / "v2" / "guide.md").write_text("# Guide\n\nVersion two.\n")
    (docs / "latest").symlink_to("v2")
    latin = os.path.join(os.fsencode(docs), b"caf\xe9")
    os.mkdir(latin)
    with open(os.path.join(latin, b"menu.md"), "wb") as f:
        f.write(b"# Menu\n\nCoffee.\n")
    (docs / "cafe").symlink_to(os.fsdecode(latin))
    summary, snap = build(
        tmp_path, [{"type": "markdown", "path": str(docs), "follow_symlinks": True}]
    )
    assert [s["reason"] for s in summary.skipped_pages] == [
        "the name is not UTF-8 (rename it to index it)"
    ]
    assert {c.source_path for c in snap.chunks} == {
        "billing.md",
        "ext/" + "a/" * 11 + "bottom.md",  # the first link in name order, once
        "v2/guide.md",  # where it is, not again through "latest"
        "cafe/menu.md",  # the folder's own name is not UTF-8: read through its link
    }


@pytest.mark.parametrize(
    ("type_", "name", "content"),
    [
        ("markdown", "page.md", b"# Secret\n\nhunter2\n"),
        ("text", "page.txt", b"Secret\n\nhunter2\n"),
        ("html", "page.html", b"<h1>Secret</h1><p>hunter2</p>"),
        ("pdf", "page.pdf", make_pdf([["Secret", "hunter2"]])),
    ],
)
def test_every_folder_source_refuses_links_out_of_its_folder(
    tmp_path: Path, type_: str, name: str, content: bytes
) -> None:
    (tmp_path / "secret").mkdir()
    (tmp_path / "secret" / name).write_bytes(content)
    docs = tmp_path / "docs"
    (docs / "real").mkdir(parents=True)
    (docs / "real" / name).write_bytes(content)
    (docs / name).symlink_to(tmp_path / "secret" / name)
    (docs / "dir").symlink_to(tmp_path / "secret", target_is_directory=True)
    (docs / "inside").symlink_to(docs / "real", target_is_directory=True)
    raw = {
        "knowledge_base": [{"name": "kb", "source": [{"type": type_, "path": str(docs)}]}],
        "index": {"store": str(tmp_path / "store")},
    }
    config = parse_config(raw, base=tmp_path)
    pages, skipped = load_source(config.knowledge_bases[0].sources[0], LoadContext("kb", tmp_path))
    assert {(s.path, s.reason) for s in skipped} == {(name, OUTSIDE), ("dir/", OUTSIDE)}
    # a folder link inside is not walked: its files are read where they are, once
    assert {p.source_path.split("#")[0] for p in pages} == {f"real/{name}"}


# --- 15: a page too large; files that are not files -------------------------------------------


def test_a_page_over_max_page_bytes_is_skipped_with_the_reason(tmp_path: Path) -> None:
    docs = docs_folder(tmp_path)
    (docs / "huge.md").write_text("word " * 10_000)  # 50,000 bytes on one line
    summary, snap = build(
        tmp_path, [{"type": "markdown", "path": str(docs), "max_page_bytes": 4096}]
    )
    assert reasons(summary) == {
        "huge.md": "50,000 bytes, over max_page_bytes (4,096 bytes); raise the source's "
        "max_page_bytes to index it"
    }
    assert {c.source_path for c in snap.chunks} == {"billing.md"}


def test_a_page_of_too_many_headings_is_skipped_with_the_limit_named(tmp_path: Path) -> None:
    docs = docs_folder(tmp_path)
    (docs / "headings.md").write_text("## h\n" * 20_001)  # 100 kB: no chunk, 20,001 sections
    summary, snap = build(tmp_path, [{"type": "markdown", "path": str(docs)}])
    assert reasons(summary) == {
        "headings.md": "more than 20,000 headings, over MAX_PAGE_HEADINGS (a page of headings "
        "a line or two apart): split the page to index it"
    }
    assert (summary.pages, summary.chunks) == (1, 1)
    assert set(snap.pages) == {page_key("markdown", "billing.md")}


def test_the_default_limit_skips_a_page_of_more_than_8_mib(tmp_path: Path) -> None:
    docs = docs_folder(tmp_path, "texts")
    (docs / "ok.txt").write_text("Fine\n\nA page of text.\n")
    with (docs / "dump.txt").open("wb") as f:
        f.truncate(50 << 20)  # 50 MiB, sparse: never read
    summary, snap = build(tmp_path, [{"type": "text", "path": str(docs)}])
    assert DEFAULT_MAX_PAGE_BYTES == 8 << 20
    assert reasons(summary)["dump.txt"].startswith(
        "52,428,800 bytes, over max_page_bytes (8,388,608 bytes)"
    )
    assert {c.source_path for c in snap.chunks} == {"ok.txt"}


def test_a_fifo_or_a_dangling_link_is_skipped_and_never_blocks(tmp_path: Path) -> None:
    docs = docs_folder(tmp_path)
    os.mkfifo(docs / "pipe.md")  # reading it would wait for a writer forever
    (docs / "via-link.md").symlink_to(docs / "pipe.md")
    (docs / "gone.md").symlink_to(docs / "missing.md")
    summary, snap = build(tmp_path, [{"type": "markdown", "path": str(docs)}])
    assert reasons(summary) == {
        "pipe.md": "not a regular file (a FIFO)",
        "via-link.md": "not a regular file (a FIFO)",
        "gone.md": "a symbolic link to nothing",
    }
    assert {c.source_path for c in snap.chunks} == {"billing.md"}


def test_an_html_page_of_unclosed_comments_is_read_in_linear_time(tmp_path: Path) -> None:
    docs = tmp_path / "site"
    docs.mkdir()
    # Python 3.11's HTMLParser retried each "<!--" against the whole rest: hours at this size.
    (docs / "hostile.html").write_text("<h1>Hostile</h1><p>Start" + "<!--" * 100_000)
    (docs / "deep.html").write_text("<div>" * 20_000 + "<p>Deep text.</p>" + "</div>" * 20_000)
    summary, snap = build(tmp_path, [{"type": "html", "path": str(docs)}])
    assert summary.skipped_pages == []
    deep = snap.pages[page_key("html", "deep.html")]
    assert deep == "Deep text.\n"
    assert snap.pages[page_key("html", "hostile.html")].startswith("# Hostile\n\nStart<!--<!--")


def test_an_html_page_of_unknown_marked_sections_is_read_as_html5_reads_them(
    tmp_path: Path,
) -> None:
    # "<![bogus[" or "<![ " raised the parser's AssertionError out of the build: every page lost
    docs = tmp_path / "site"
    docs.mkdir()
    (docs / "good.html").write_text("<h1>Good</h1><p>Good page.</p>")
    (docs / "marked.html").write_text(
        "<h1>Marked</h1><p>One <![bogus[ x ]]>two <![ y>three <![CDATA[z]]>four.</p>"
    )
    summary, snap = build(tmp_path, [{"type": "html", "path": str(docs)}])
    assert summary.skipped_pages == []
    # each a bogus comment to the next ">", as HTML5 reads one
    assert snap.pages[page_key("html", "marked.html")] == "# Marked\n\nOne two three four.\n"
    assert snap.pages[page_key("html", "good.html")] == "# Good\n\nGood page.\n"


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"follow_symlinks": "yes"}, "follow_symlinks must be true or false"),
        ({"max_page_bytes": 0}, "max_page_bytes must be from 1 to 1073741824 \\(bytes\\), got 0"),
        ({"max_page_bytes": "8MB"}, "max_page_bytes must be a whole number"),
    ],
)
def test_folder_options_are_checked(tmp_path: Path, options: dict[str, Any], message: str) -> None:
    docs = docs_folder(tmp_path)
    with pytest.raises(ConfigError, match=message):
        build(tmp_path, [{"type": "markdown", "path": str(docs), **options}])


def test_validate_reads_the_files_the_build_reads(tmp_path: Path) -> None:
    docs = linked_docs(tmp_path)
    report = validate_docs(docs)
    assert [(p.path, p.kind, p.message) for p in report.problems if p.kind == "unreadable"] == [
        ("leak.md", "unreadable", f"unreadable page: {OUTSIDE}"),
        ("leakdir/", "unreadable", f"unreadable page: {OUTSIDE}"),
    ]
    follow = ValidateOptions.from_options("docs", {"follow_symlinks": True})
    report = validate_docs(docs, follow)
    assert not [p for p in report.problems if p.kind == "unreadable"]
    assert {p.path for p in report.pages} == {
        "billing.md",
        "leak.md",
        "leakdir/passwd.md",
        "sub/alias.md",
    }


def test_a_pdf_over_max_page_bytes_is_skipped_unparsed(tmp_path: Path) -> None:
    docs = tmp_path / "pdfs"
    docs.mkdir()
    small, big = make_pdf([["Short manual."]]), make_pdf([["Long manual."] * 200])
    (docs / "small.pdf").write_bytes(small)
    (docs / "big.pdf").write_bytes(big)
    limit = len(small) + 100
    summary, snap = build(tmp_path, [{"type": "pdf", "path": str(docs), "max_page_bytes": limit}])
    assert reasons(summary)["big.pdf"].startswith(f"{len(big):,} bytes, over max_page_bytes")
    assert {c.source_path for c in snap.chunks} == {"small.pdf#page=1"}


def test_the_hostile_pdfs_bench_runs(tmp_path: Path) -> None:
    from bench import hostile_pdfs

    out = tmp_path / "hostile_pdfs.json"
    result = hostile_pdfs.main(["--only", "shared_20_pages_1mb", "--out", str(out)])
    assert json.loads(out.read_text()) == result
    row = result["attacks"]["shared_20_pages_1mb"]
    assert row["file_bytes"] < 10_000
    assert "PDF_MAX_PAGE_TEXT_BYTES" in row["skipped"]


def test_the_hostile_pages_bench_runs(tmp_path: Path) -> None:
    from bench import hostile_pages

    out = tmp_path / "hostile_pages.json"
    result = hostile_pages.main(["--smoke", "--out", str(out)])
    assert json.loads(out.read_text()) == result
    for kind in hostile_pages.KINDS:
        row = result["kinds"][kind]
        assert row["small"]["chunks"] >= (kind != "headings")  # bare headings: no chunk
        if kind in ("headings", "sections"):  # 250 kB of them: past MAX_PAGE_HEADINGS
            assert "MAX_PAGE_HEADINGS" in row["large"]["refused"]
        else:
            assert row["large"]["chunks"] >= row["small"]["chunks"]
        assert row["large"]["peak_rss_bytes"] > 0
        assert row["time_ratio"] is not None


def test_the_page_limits_bench_runs(tmp_path: Path) -> None:
    from bench import page_limits

    out = tmp_path / "page_limits.json"
    result = page_limits.main(["--sets", "examples", "--out", str(out)])
    assert json.loads(out.read_text()) == result
    row = result["sets"]["examples"]
    assert (row["pages"], row["skipped"]) == (4, [])
    assert 1 <= row["most_chunks_a_page"]["chunks"] <= row["chunks"]
    assert row["most_headings_a_page"]["headings"] >= 1


def test_a_folder_tree_nested_past_the_recursion_limit_is_walked(tmp_path: Path) -> None:
    docs = docs_folder(tmp_path)
    fd = os.open(docs, os.O_RDONLY)
    for _ in range(1_200):  # names of one letter: 2,400 characters, within PATH_MAX
        os.mkdir("d", dir_fd=fd)  # one level at a time: pathlib's mkdir(parents) recurses
        fd, parent = os.open("d", os.O_RDONLY, dir_fd=fd), fd
        os.close(parent)
    os.close(fd)
    bottom = docs / ("d/" * 1_200 + "bottom.md")
    bottom.write_text("# Bottom\n\nThe deepest page.\n")
    try:
        summary, snap = build(tmp_path, [{"type": "markdown", "path": str(docs)}])
        assert summary.skipped_pages == []
        assert {c.source_path for c in snap.chunks} == {"billing.md", "d/" * 1_200 + "bottom.md"}
        # and so does `index watch`'s change check (Path.rglob recursed: RecursionError, and
        # the watcher stopped rebuilding every base)
        kb = parse_config(
            {
                "knowledge_base": [
                    {"name": "kb", "source": [{"type": "markdown", "path": str(docs)}]}
                ]
            },
            base=tmp_path,
        ).knowledge_bases[0]
        before = local_fingerprint(kb)
        bottom.write_text("# Bottom\n\nThe deepest page, edited.\n")
        assert local_fingerprint(kb) != before
    finally:  # pytest's own clean-up (shutil.rmtree) recurses, and this tree is too deep for it
        bottom.unlink()
        for depth in range(1_200, 0, -1):
            os.rmdir(docs / ("d/" * depth))


# --- HTML that amplifies or backtracks ----------------------------------------------------------


def html_text(tmp_path: Path, markup: str) -> str:
    docs = tmp_path / "site"
    docs.mkdir(exist_ok=True)
    (docs / "page.html").write_text(markup)
    summary, snap = build(tmp_path, [{"type": "html", "path": str(docs)}])
    assert summary.skipped_pages == []
    return snap.pages[page_key("html", "page.html")]


def test_html_lists_nested_deep_are_written_in_bounded_size(tmp_path: Path) -> None:
    # each level indented every item line below it: 3,000 levels in 27 kB wrote 9 MB
    markup = "<ul><li>x" * 3_000
    text = html_text(tmp_path, markup)
    assert len(text) < 3 * len(markup)
    assert text.startswith("- x\n  - x\n    - x\n")
    assert text.count("- x") == 3_000


def test_html_ragged_tables_are_written_in_bounded_size(tmp_path: Path) -> None:
    # every row was padded to the widest: 2,000 cells over 2,000 short rows wrote 16 MB
    wide = "<tr>" + "<td>w" * 2_000
    markup = "<table>" + wide + "<tr><td>y" * 2_000 + "</table>"
    text = html_text(tmp_path, markup)
    assert len(text) < 3 * len(markup)
    lines = text.splitlines()
    assert lines[0] == "| " + " | ".join(["w"] * 2_000) + " |"
    assert lines[2:] == ["| y |"] * 2_000  # a cell whose end tag is left out keeps its text


def test_html_end_tags_in_skipped_or_table_markup_are_read_in_linear_time(tmp_path: Path) -> None:
    # an end tag looked for its element along the whole stack of skipped ones, and a cell
    # closed again re-read its whole text: quadratic, minutes at these sizes
    n = 100_000
    markup = "<h1>Kept</h1><svg>" + "<g>" * n + "</x>" * n + "</svg><table><tr><td>" + "x</td>" * n
    text = html_text(tmp_path, markup)
    assert text == "# Kept\n\n| " + " ".join(["x"] * n) + " |\n| --- |\n"


def test_an_html_page_whose_charset_fails_to_decode_is_skipped(tmp_path: Path) -> None:
    docs = docs_folder(tmp_path, "site")
    (docs / "odd.html").write_text('<meta charset="undefined"><p>Text.</p>')
    (docs / "ok.html").write_text("<h1>Fine</h1><p>Text.</p>")
    summary, snap = build(tmp_path, [{"type": "html", "path": str(docs)}])
    assert summary.published
    assert reasons(summary) == {
        "odd.html": "unsupported charset 'undefined' (not a web encoding; save the page as UTF-8)"
    }
    assert {c.source_path for c in snap.chunks} == {"ok.html"}


def test_a_character_reference_of_thousands_of_digits_is_a_replacement_character(
    tmp_path: Path,
) -> None:
    # the parser converts &#NNN; with int(), which refuses more than 4,300 digits: a ValueError
    # out of the parser stopped the whole build
    markup = "<h1>Refs</h1><p>&#" + "9" * 5_000 + "; &#" + "0" * 5_000 + "65; &#128222;</p>"
    assert html_text(tmp_path, markup) == "# Refs\n\n\ufffd A \U0001f4de\n"


# --- CSV that backtracks or holds a whole line --------------------------------------------------


def test_a_csv_of_lines_that_each_leave_a_quote_open_is_read_once(tmp_path: Path) -> None:
    # each line's record ran to the end of the file, then the next line's did: 20,000 lines
    # were 20,000 reads of the rest of the file (minutes)
    faq = tmp_path / "faq.csv"
    n = 20_000
    faq.write_text('id,text\n1,Kept.\n2,"Closed\nover two lines."\n' + 'a",b,"c\n' * n)
    summary, snap = build(tmp_path, [{"type": "csv", "path": str(faq)}])
    assert {c.source_path: c.text for c in snap.chunks} == {
        "1": "Kept.",
        "2": "Closed\nover two lines.",
    }
    never = "malformed CSV: a quote opened in this record is never closed"
    named = {f"faq.csv:{line}": never for line in range(5, 5 + MAX_SKIPS_NAMED)}
    more = f"{n - MAX_SKIPS_NAMED:,} more records skipped, to line {n + 4:,}"
    assert reasons(summary) == named | {"faq.csv": f"{more} (the first 1,000 are named)"}


def test_a_csv_line_over_max_page_bytes_is_read_past_not_held(tmp_path: Path) -> None:
    faq = tmp_path / "faq.csv"
    size = 20 << 20
    with faq.open("w") as f:
        f.write("id,text\n1,Kept.\n2,")
        f.write("x" * size)
        f.write('\n3,Kept too.\n4,"Open quote\n')
        f.write("".join(f"m{i},More.\n" for i in range(200)) + "6,After.\n")
    source = {"type": "csv", "path": str(faq), "max_page_bytes": 1000}
    tracemalloc.start()
    try:
        summary, snap = build(tmp_path, [source])
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < size // 4  # the line was held whole (and copied)
    over = "over max_page_bytes (1,000 bytes); raise the source's max_page_bytes to index it"
    assert reasons(summary) == {
        "faq.csv:3": f"{size + 2:,} bytes, {over}",
        # a quote left open is read to max_page_bytes, and not read again after it
        "faq.csv:5": f"1,004 bytes, {over} (a record from this line to line 105: an open quote?)",
    }
    kept = {"1", "3", *(f"m{i}" for i in range(100, 200)), "6"}  # m99 is line 105
    assert {c.source_path for c in snap.chunks} == kept


# --- a web page that trickles -------------------------------------------------------------------


class _TrickleServer(LocalHttpServer):
    """Answers every GET with a page of 2,000 bytes, 16 bytes every 50 ms (6 s in all)."""

    BODY = b"<h1>Slow</h1>" + b"<p>word</p>" * 180

    def __init__(self) -> None:
        stopping = self.stopping = threading.Event()
        body = self.BODY

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                send_json(self, 200, body, stopping, trickle_s=0.05)

            def log_message(self, format: str, *args: object) -> None:
                pass

        super().__init__(Handler, name="trickle-server")
        self.stopping = stopping


def test_a_url_that_trickles_is_given_up_at_the_download_deadline() -> None:
    # each wait on the socket was bounded, the download was not: a byte every few seconds
    # held the build for as long as the server liked
    server = _TrickleServer().start()
    try:
        got = fetch(f"http://127.0.0.1:{server.port}/slow.html", None, deadline_s=0.5)
    finally:
        server.stop()
    assert got == Failed("not downloaded within 0.5 s")  # not gone: a copy fetched before is kept


@pytest.mark.parametrize("lie", LIARS)
def test_a_url_whose_head_or_trailer_never_ends_is_given_up_at_the_deadline(
    tmp_path: Path, lie: str
) -> None:
    # the deadline bounded the body's reads only: headers trickled, ``100 Continue`` answers or
    # a chunked trailer without end (loops inside http.client) held the crawl, and the build
    # behind it, for as long as the server liked
    (tmp_path / "page.html").write_text("<h1>Page</h1><p>words</p>")
    server = StaticServer(tmp_path).start()
    server.hostile, server.hostile_suffix, server.trickle_s = lie, "/page.html", 0.05
    got: list[object] = []
    try:
        fetching = threading.Thread(
            target=lambda: got.append(fetch(f"{server.url}/page.html", None, deadline_s=1.0)),
            daemon=True,
        )
        fetching.start()
        fetching.join(LIVENESS_S)
        assert not fetching.is_alive(), f"{lie} held the fetch past its deadline"
        server.hostile = ""
        again = fetch(f"{server.url}/page.html", None, deadline_s=1.0)
    finally:
        server.stop()
    assert got == [Failed("not downloaded within 1 s")]
    assert isinstance(again, Fetched)
    assert b"words" in again.body


def test_an_image_url_is_fetched_within_a_deadline_and_its_limit(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # an image URL was read with urllib's per-read timeout alone: a head without end held the
    # build for as long as the server liked
    (tmp_path / "shot.png").write_bytes(b"\x89PNG\r\n\x1a\n" + b"\0" * 2000)
    server = StaticServer(tmp_path).start()
    monkeypatch.setattr(image, "FETCH_DEADLINE_S", 1.0)
    try:
        server.hostile, server.hostile_suffix, server.trickle_s = "headers", "/shot.png", 0.05
        held = image._fetch(f"{server.url}/shot.png", 10_000)
        server.hostile = ""
        over = image._fetch(f"{server.url}/shot.png", 1_000)
        fetched = image._fetch(f"{server.url}/shot.png", 10_000)
    finally:
        server.stop()
    assert held == SkippedPage(f"{server.url}/shot.png", "not downloaded within 1 s")
    assert over == SkippedPage(f"{server.url}/shot.png", "larger than 1,000 bytes")
    assert isinstance(fetched, image.ImageFile)
    assert (len(fetched.data), fetched.media_type) == (2008, "image/png")


def test_a_url_redirected_off_the_web_is_not_followed_and_its_reason_is_one_line() -> None:
    # a redirect to ftp:// was followed (a connect to whatever host and port it named); urllib's
    # redirect-loop error is three lines, which a build's report printed as three
    server = RedirectingServer().start()
    try:
        server.redirect_to = "ftp://127.0.0.1:9"
        off_the_web = fetch(f"{server.url}/page.html", None, deadline_s=5.0)
        server.redirect_to = "loop"
        looping = fetch(f"{server.url}/page.html", None, deadline_s=5.0)
    finally:
        server.stop()
    assert off_the_web == Failed(
        "HTTP 302 redirect to a ftp URL refused (only http and https are fetched): "
        "ftp://127.0.0.1:9/moved/page.html"
    )
    assert isinstance(looping, Failed)
    assert looping.reason.startswith("HTTP 302 ")
    assert "\n" not in looping.reason
    assert "infinite loop" in looping.reason


@pytest.mark.parametrize(
    "entry",
    [
        {"fetched_at": "yesterday"},
        [],
        {"fetched_at": 1e18, "pages": [{"path": "p"}]},
        {"fetched_at": 1.0, "pages": [{"path": "p", "title": "", "text": "", "kind": "html",
                                       "url": "u", "metadata": {"k": 1}}]},
        {"fetched_at": 1.0, "pages": [], "left_out": [1]},
        {"fetched_at": 1.0, "pages": [], "left_out": [{}]},
    ],
)  # fmt: skip
def test_a_crawl_state_entry_of_another_shape_is_crawled_afresh(
    tmp_path: Path, entry: object
) -> None:
    # valid JSON of another shape (a hand edit, a disk fault) stopped every later build with a
    # ValueError or KeyError
    url = "http://docs.example/page"
    state = state_path(tmp_path, "kb", "web")
    state.parent.mkdir(parents=True)
    state.write_bytes(json.dumps({"version": 1, "urls": {url: entry}}).encode())
    page = Fetched(b"<h1>Page</h1><p>Fresh.</p>", "text/html", "utf-8", "", "", url)
    pages, skipped, stats = crawl_urls("web", UrlOptions((url,)), state, 1e9, lambda u, p: page)
    assert (stats.requested, stats.downloaded, skipped) == (1, 1, [])
    assert [p.text for p in pages] == ["# Page\n\nFresh.\n"]


# --- frontmatter that YAML parses slowly --------------------------------------------------------


def test_frontmatter_too_large_or_too_deep_for_yaml_is_refused_unparsed(tmp_path: Path) -> None:
    # PyYAML took 6.7 s over 2,000 "[" (4 kB; more than quadratic), and minutes over megabytes
    docs = docs_folder(tmp_path)
    (docs / "deep.md").write_text("---\ntags: " + "[" * 2_000 + "\n---\n# Deep\n\nText.\n")
    (docs / "large.md").write_text("---\ntags: [" + "a, " * 20_000 + "]\n---\n# Large\n\nText.\n")
    (docs / "nested.md").write_text(
        "---\ntitle: Nested\nmeta: " + "[" * 64 + "]" * 64 + "\n---\nOK.\n"
    )
    summary, snap = build(tmp_path, [{"type": "markdown", "path": str(docs)}])
    assert reasons(summary) == {
        "deep.md": "malformed frontmatter: [ and { nested 2000 deep; the limit is 64",
        "large.md": "malformed frontmatter: 60,008 bytes; the limit is 32,768 (frontmatter is "
        "a few fields: put the text in the page)",
    }
    assert {c.source_path for c in snap.chunks} == {"billing.md", "nested.md"}


def test_frontmatter_aliases_that_expand_past_64_kib_are_refused_and_a_reused_list_kept(
    tmp_path: Path,
) -> None:
    # 26 kB of frontmatter, 9,000 values: one 223 MB metadata string on expansion
    docs = docs_folder(tmp_path)
    inner = "[" + ", ".join(["*s"] * 99) + "]"
    laughs = ", ".join(f"k{i}: *b" for i in range(90))
    (docs / "laughs.md").write_text(
        f'---\ns: &s "{"x" * 25_000}"\nb: &b {inner}\nc: {{{laughs}}}\n---\n# Laughs\n\nText.\n'
    )
    (docs / "reused.md").write_text(
        "---\ntags: &t [billing, refunds]\nalso: *t\n---\n# Reused\n\nText.\n"
    )
    summary, snap = build(tmp_path, [{"type": "markdown", "path": str(docs)}])
    assert reasons(summary) == {
        "laughs.md": "malformed frontmatter: more than 65,536 bytes once its YAML aliases are "
        "expanded (an alias counts each time it is used)",
    }
    assert {c.source_path for c in snap.chunks} == {"billing.md", "reused.md"}


# --- PDF text that decompresses far past its file ------------------------------------------------


def text_ops(size: int) -> bytes:
    line = b"BT /F1 12 Tf 10 10 Td (" + b"word " * 40 + b") Tj ET\n"
    return line * (size // len(line) + 1)


def test_pdf_text_past_a_page_or_a_document_limit_is_skipped_named(tmp_path: Path) -> None:
    # 7 kB of PDF held 17 MB of text, and pypdf's time is quadratic in a page's: 12 MB, 129 s
    docs = tmp_path / "pdfs"
    docs.mkdir()
    (docs / "manual.pdf").write_bytes(make_pdf([["Short manual."]]))
    (docs / "page.pdf").write_bytes(shared_stream_pdf(1, text_ops(400_000)))  # ~350 kB of text
    (docs / "pages.pdf").write_bytes(shared_stream_pdf(8, text_ops(200_000)))  # ~170 kB a page
    blank = b" " * (5 << 20) + b"BT /F1 12 Tf 10 10 Td (Hi) Tj ET\n"
    (docs / "stream.pdf").write_bytes(shared_stream_pdf(1, blank))  # 5 MiB decompressed
    source = {"type": "pdf", "path": str(docs), "max_page_bytes": 1_000_000}
    summary, snap = build(tmp_path, [source])
    assert reasons(summary) == {
        "page.pdf": "too much text to extract: page 1: its text passes 262,144 bytes "
        "(PDF_MAX_PAGE_TEXT_BYTES)",
        "pages.pdf": "too much text to extract: page 6: the document's text passes 1,000,000 "
        "bytes (PDF_MAX_TEXT_BYTES, or max_page_bytes if lower)",
        "stream.pdf": "a stream decompresses past 4,194,304 bytes (PDF_MAX_STREAM_BYTES)",
    }
    assert {c.source_path for c in snap.chunks} == {"manual.pdf#page=1"}


def test_a_pdf_page_past_its_text_limit_is_left_out_and_the_others_kept(tmp_path: Path) -> None:
    """A page of ~350 kB of text skipped its whole document (a manual of a hundred pages, for
    one page of a table dump); now that page is left out, named with the reason, and the pages
    before and after it are kept. A second such page still skips the document."""
    docs = tmp_path / "pdfs"
    docs.mkdir()
    dump = ["word " * 40] * 1_800  # ~360 kB of text on one page
    (docs / "manual.pdf").write_bytes(
        make_pdf([["Billing is monthly."], dump, ["Refunds take a week."]])
    )
    (docs / "two.pdf").write_bytes(make_pdf([["Intro."], dump, ["Middle."], dump]))
    summary, snap = build(tmp_path, [{"type": "pdf", "path": str(docs)}])
    assert reasons(summary) == {
        "manual.pdf#page=2": "too much text to extract: page 2: its text passes 262,144 bytes "
        "(PDF_MAX_PAGE_TEXT_BYTES); the page is left out, the document's other pages kept",
        "two.pdf": "too much text to extract: page 4: its text passes 262,144 bytes "
        "(PDF_MAX_PAGE_TEXT_BYTES), as 1 page(s) before it did (PDF_MAX_PAGES_OVER_TEXT is 1)",
    }
    texts = {c.source_path: c.text for c in snap.chunks}
    assert set(texts) == {"manual.pdf#page=1", "manual.pdf#page=3"}
    assert "Billing is monthly." in texts["manual.pdf#page=1"]
    assert "Refunds take a week." in texts["manual.pdf#page=3"]


@pytest.mark.skipif(not Path("/proc/self/environ").exists(), reason="needs Linux's /proc")
def test_a_link_into_the_machines_own_trees_is_never_read_even_followed(tmp_path: Path) -> None:
    """With follow_symlinks, ``env.md -> /proc/self/environ`` (a regular file) was indexed and
    served, and an image so linked sent to a model: the indexer's environment, its API keys."""
    docs = tmp_path / "docs"
    docs.mkdir()
    (docs / "guide.md").write_text("# Guide\n\nWords.\n")
    (docs / "env.md").symlink_to("/proc/self/environ")
    (docs / "kernel").symlink_to("/sys/kernel")
    (docs / "null.md").symlink_to("/dev/null")
    for follow in (True, False):
        listing = list_files(docs, (".md",), follow_symlinks=follow)
        assert [rel for rel, _ in listing.files] == ["guide.md"]
        reasons = {s.path: s.reason for s in listing.skipped}
        assert set(reasons) == {"env.md", "kernel/", "null.md"}
    assert reasons["env.md"].startswith("a symbolic link to outside")  # not followed
    listing = list_files(docs, (".md",), follow_symlinks=True)
    reasons = {s.path: s.reason for s in listing.skipped}
    said = "is the machine's own, reached through a symbolic link: never read as documents"
    assert reasons == {
        "env.md": f"/proc {said}",
        "kernel/": f"/sys {said}",
        "null.md": f"/dev {said}",
    }


def test_a_machine_tree_reached_inside_a_followed_folder_is_not_walked(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A link to "/" walked /proc, /sys and /dev as folders of its own: the trees are refused
    wherever a followed walk meets them (here a tree of the test's own stands for them)."""
    machine = tmp_path / "root" / "proc"
    machine.mkdir(parents=True)
    (machine / "environ.md").write_text("SECRET=1\n")
    (tmp_path / "root" / "notes.md").write_text("# Notes\n")
    docs = tmp_path / "docs"
    docs.mkdir()
    (docs / "everything").symlink_to(tmp_path / "root")
    monkeypatch.setattr(folder, "MACHINE_TREES", (machine,))
    listing = list_files(docs, (".md",), follow_symlinks=True)
    assert [rel for rel, _ in listing.files] == ["everything/notes.md"]
    assert [s.path for s in listing.skipped] == ["everything/proc/"]


@pytest.mark.skipif(not Path("/dev/shm").is_dir(), reason="needs /dev/shm")
def test_a_source_folder_under_dev_shm_reads_its_own_links() -> None:
    """The machine's trees are refused only outside the source's folder: one kept in /dev/shm
    (a RAM disk) read a link to its own file, and the first version of the rule skipped it."""
    import tempfile

    with tempfile.TemporaryDirectory(dir="/dev/shm") as folder:
        docs = Path(folder)
        (docs / "a.md").write_text("# A\n\nWords.\n")
        (docs / "b.md").symlink_to("a.md")
        for follow in (True, False):
            listing = list_files(docs, (".md",), follow_symlinks=follow)
            assert ([rel for rel, _ in listing.files], listing.skipped) == (["a.md", "b.md"], [])


def test_a_pdf_under_many_names_is_extracted_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each name of one document (hard links, symbolic links, copies) ran its own extraction:
    a 12 kB PDF that runs out its 20 s deadline, linked 1,000 times, held a build 5.5 hours."""
    docs = tmp_path / "pdfs"
    docs.mkdir()
    (docs / "manual.pdf").write_bytes(make_pdf([["Billing is monthly."]]))
    os.link(docs / "manual.pdf", docs / "hard.pdf")
    (docs / "soft.pdf").symlink_to("manual.pdf")
    (docs / "copy.pdf").write_bytes((docs / "manual.pdf").read_bytes())
    (docs / "other.pdf").write_bytes(make_pdf([["Refunds take a week."]]))
    extracted: list[int] = []
    extract = pdf._extract_apart
    monkeypatch.setattr(
        pdf,
        "_extract_apart",
        lambda data, limit: extracted.append(len(data)) or extract(data, limit),
    )
    pages, skipped = pdf.load_pdf("docs", docs)
    assert (len(extracted), skipped) == (2, [])
    by_path = {p.source_path: p.text for p in pages}
    assert set(by_path) == {f"{n}.pdf#page=1" for n in ("copy", "hard", "manual", "other", "soft")}
    assert by_path["soft.pdf#page=1"] == "Billing is monthly."


def test_a_pdf_title_of_megabytes_is_held_once_cut_not_counted_per_page(tmp_path: Path) -> None:
    """A 0.8 MB /Title over 5,500 pages was counted once a page against max_text_bytes (4.3 GB
    of a 1.7 MB file) and refused the whole base; the title is cut as the chunker cuts it."""
    docs = tmp_path / "pdfs"
    docs.mkdir()
    title = "Manual " * 30_000  # 210 kB
    (docs / "manual.pdf").write_bytes(make_pdf([[f"Step {n}."] for n in range(40)], title=title))
    budget = PageBytes("kb", limit=4_000_000)  # 40 pages x 210 kB passed it
    pages, skipped = pdf.load_pdf("docs", docs, budget=budget)
    assert (len(pages), skipped) == (40, [])
    assert len({id(p.title) for p in pages}) == 1
    assert len(pages[0].title.encode()) <= MAX_FIELD_BYTES
    assert pages[0].title.startswith("Manual Manual")
    assert budget.held < 1_000_000


def test_a_pdf_whose_extraction_runs_past_its_deadline_is_skipped_named(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # pypdf parses a shared stream of numbers anew for every page (20 pages of 4 MB: 248 s);
    # no count of text or operators sees it, so the child process that extracts is killed.
    # A deadline grows with the file: the good file, 1 MiB, has 12 s for a child that starts in
    # ~0.3 s; the slow one, 3 kB, has 2.0 s for 13 s of parsing.
    monkeypatch.setattr(pdf, "PDF_DEADLINE_S", 2.0)
    monkeypatch.setattr(pdf, "PDF_DEADLINE_S_PER_MIB", 10.0)
    docs = tmp_path / "pdfs"
    docs.mkdir()
    (docs / "manual.pdf").write_bytes(make_pdf([["Short manual."]], pad=1 << 20))
    (docs / "numbers.pdf").write_bytes(shared_stream_pdf(4, b"1 " * 500_000))
    summary, snap = build(tmp_path, [{"type": "pdf", "path": str(docs)}])
    assert reasons(summary) == {
        "numbers.pdf": "text extraction ran past its 2.0 s (PDF_DEADLINE_S, plus "
        "PDF_DEADLINE_S_PER_MIB of file)"
    }
    assert {c.source_path for c in snap.chunks} == {"manual.pdf#page=1"}


def failed_child(code: str) -> str:
    """The reason ``pdf`` gives for a real child process that ran ``code`` and gave no answer."""
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, check=False)
    assert done.returncode != 0
    return pdf._exit_reason(done.returncode, done.stderr, 1)


def test_a_pdf_child_that_fails_is_reported_by_how_it_failed() -> None:
    """Every exit was "past its CPU time or 4 GiB of memory", its stderr dropped: a child
    killed at its CPU limit says so, one out of memory says so, any other gives its exit and
    the last line it wrote, at most PDF_MAX_REASON_BYTES of it."""
    spin = "import resource\nresource.setrlimit(resource.RLIMIT_CPU, (1, 2))\nwhile True: pass"
    assert failed_child(spin) == (
        "text extraction was killed (SIGXCPU) past its 1 s of CPU time, or out of memory"
    )
    assert failed_child("raise MemoryError") == (
        "text extraction ran out of its 4,294,967,296 bytes of memory (PDF_MAX_MEMORY_BYTES)"
    )
    said = failed_child("import sys; print('noise', file=sys.stderr); raise OSError('x' * 5000)")
    assert said.startswith("text extraction failed (exit 1): ")
    assert said.endswith("x" * 100)
    assert len(said.encode()) < 40 + pdf.PDF_MAX_REASON_BYTES
    assert failed_child("import sys; sys.exit(3)") == (
        "text extraction failed (exit 3): nothing on stderr"
    )


def test_a_pdf_whose_parse_runs_out_of_memory_is_named_so(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A MemoryError in the child was "unreadable PDF: MemoryError"."""

    def exhausted(data: bytes, max_text_bytes: int) -> tuple[str, list[str], list[object]]:
        raise MemoryError

    monkeypatch.setattr(pdf, "_read", exhausted)
    assert pdf._extract(b"%PDF-1.4", 1_000) == (
        "text extraction ran out of its 4,294,967,296 bytes of memory (PDF_MAX_MEMORY_BYTES)"
    )


def test_a_pdf_child_is_not_run_from_the_builds_working_folder(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The second attack: ``python -m`` put the working folder first on the child's path, so a
    ``json.py`` in the folder a build ran from was imported (and ran) in the PDF child, and its
    empty answer raised ``JSONDecodeError`` out of the build. Now the child's path leaves the
    working folder out, and an answer that is not JSON skips the file."""
    marker = tmp_path / "ran"
    (tmp_path / "json.py").write_text(
        f"open({str(marker)!r}, 'w').write('x')\nraise SystemExit(0)\n"
    )
    monkeypatch.chdir(tmp_path)
    got = pdf.pdf_pages("docs", "manual.pdf", make_pdf([["Hello from page one"]]), "Manual")
    assert not marker.exists()
    assert isinstance(got, tuple)
    assert "Hello from page one" in got[0][0].text
    assert (
        pdf._answer(b"") == "text extraction gave no answer it could read (no JSON on its stdout)"
    )
    assert pdf._answer(b"[1, 2]") == "text extraction gave an answer of the wrong shape"


def test_a_pdf_child_flooding_stderr_is_stopped_at_its_bytes() -> None:
    """A child's stderr went whole into this process (``capture_output``): it goes to a file the
    child may not grow past PDF_MAX_STDERR_BYTES (its write past it fails), and only its tail is
    read back."""
    flood = (
        "import resource, sys\n"
        f"resource.setrlimit(resource.RLIMIT_FSIZE, ({pdf.PDF_MAX_STDERR_BYTES},) * 2)\n"
        "while True: sys.stderr.write('w' * 65536)\n"
    )
    command = [sys.executable, "-c", flood]
    returncode, _, tail, full = pdf._run_child(command, b"", dict(os.environ), 60.0)
    assert returncode != 0
    assert full
    assert len(tail) <= 4 * pdf.PDF_MAX_REASON_BYTES


# --- session 17, F2-F4: text that is not text, names that are not UTF-8, link loops, charsets ----

SURROGATE = "lone surrogate (U+D800 at character 0), which is not text"
NOT_A_WEB_ENCODING = "(not a web encoding; save the page as UTF-8)"


def test_a_frontmatter_escape_to_a_lone_surrogate_is_skipped_named(tmp_path: Path) -> None:
    # YAML's "\ud800" escape makes a lone surrogate: the chunk id's hash stopped the build
    docs = docs_folder(tmp_path)
    (docs / "odd.md").write_text('---\ntitle: "\\ud800 hi"\n---\nBody text.\n')
    (docs / "tag.md").write_text('---\ntags: ["ok", "\\udfff"]\n---\nBody text.\n')
    summary, snap = build(tmp_path, [{"type": "markdown", "path": str(docs)}])
    assert reasons(summary) == {
        "odd.md": f"title holds a {SURROGATE}: fix or remove the escape that wrote it",
        "tag.md": "metadata 'tags' holds a lone surrogate (U+DFFF at character 0), which is not "
        "text: fix or remove the escape that wrote it",
    }
    assert {c.source_path for c in snap.chunks} == {"billing.md"}
    report = validate_docs(docs)
    assert [(p.path, p.kind) for p in report.problems] == [
        ("odd.md", "unreadable"),
        ("tag.md", "unreadable"),
    ]


def test_a_jsonl_record_escaping_a_lone_surrogate_is_skipped_named(tmp_path: Path) -> None:
    faq = tmp_path / "faq.jsonl"
    faq.write_text(
        '{"id": "ok", "text": "Fine."}\n{"id": "bad", "text": "hello \\udfff"}\n'
        '{"id": "\\ud800", "text": "Its id is the surrogate."}\n'
    )
    summary, snap = build(tmp_path, [{"type": "jsonl", "path": str(faq)}])
    assert reasons(summary) == {
        "bad": "text holds a lone surrogate (U+DFFF at character 6), which is not text: "
        "fix or remove the escape that wrote it",
        "\\ud800": f"source_path holds a {SURROGATE}: fix or remove the escape that wrote it",
    }
    assert [c.source_path for c in snap.chunks] == ["ok"]


@pytest.mark.parametrize(
    ("kind", "name", "body"),
    [
        ("markdown", b"bad\xffname.md", b"# Bad\n\nContent.\n"),
        ("text", b"bad\xfe.txt", b"Bad\n\nContent.\n"),
        ("html", b"bad\xff.html", b"<h1>Bad</h1><p>Content.</p>"),
    ],
)
def test_a_file_or_folder_name_that_is_not_utf8_is_skipped_named(
    tmp_path: Path, kind: str, name: bytes, body: bytes
) -> None:
    # os.scandir reads such a name as surrogate escapes; as a source_path it stopped the build
    docs = docs_folder(tmp_path)
    (docs / "billing.md").unlink()
    suffix = {"markdown": ".md", "text": ".txt", "html": ".html"}[kind]
    (docs / f"ok{suffix}").write_bytes(body.replace(b"Bad", b"Fine"))
    with open(os.path.join(os.fsencode(docs), name), "wb") as f:
        f.write(body)
    folder = os.path.join(os.fsencode(docs), b"sub\xff")
    os.mkdir(folder)
    with open(os.path.join(folder, b"inner" + suffix.encode()), "wb") as f:
        f.write(body)
    summary, snap = build(tmp_path, [{"type": kind, "path": str(docs)}])
    why = "the name is not UTF-8 (rename it to index it)"
    printed = name.decode("ascii", "backslashreplace")
    assert reasons(summary) == {printed: why, "sub\\xff/": why}
    assert {c.source_path for c in snap.chunks} == {f"ok{suffix}"}


@pytest.mark.parametrize(
    ("charset", "content"),
    [
        ("unicode_escape", b"hello \\udc80 world"),  # decoded to a lone surrogate
        ("raw_unicode_escape", b"hello \\ud800 world"),
        ("utf-7", b"+2AA- hi"),
        ("punycode", b"roaming-" + ("\u00e9" * 200).encode("punycode")),  # quadratic to decode
        ("hz-gb-2312", b"hi"),  # a WHATWG label, but of the "replacement" encoding
    ],
)
def test_an_html_page_naming_a_charset_that_is_not_a_web_encoding_is_skipped(
    tmp_path: Path, charset: str, content: bytes
) -> None:
    docs = docs_folder(tmp_path, "site")
    (docs / "odd.html").write_bytes(b'<meta charset="' + charset.encode() + b'"><p>' + content)
    (docs / "sjis.html").write_bytes(
        b'<meta charset="Shift_JIS"><h1>Kana</h1><p>' + "\u30ab\u30ca".encode("cp932")
    )
    (docs / "latin.html").write_bytes(b'<meta charset="latin1"><p>caf\xe9 \x80 \x81</p>')
    summary, snap = build(tmp_path, [{"type": "html", "path": str(docs)}])
    assert reasons(summary) == {"odd.html": f"unsupported charset {charset!r} {NOT_A_WEB_ENCODING}"}
    assert snap.pages[page_key("html", "sjis.html")] == "# Kana\n\n\u30ab\u30ca\n"
    # latin1 is windows-1252 on the web (0x80 is the euro sign; 0x81, which it leaves
    # undefined, the C1 control character U+0081, as a browser reads it)
    assert snap.pages[page_key("html", "latin.html")] == "caf\u00e9 \u20ac \u0081\n"


def test_a_url_page_naming_a_charset_that_is_not_a_web_encoding_is_skipped(
    tmp_path: Path,
) -> None:
    from tests.pages_server import PagesServer, ServedPage

    with PagesServer() as server:
        server.pages["/esc.txt"] = ServedPage(
            b"Roaming\n\nhello \\ud800 world\n", "text/plain; charset=unicode_escape"
        )
        puny = b"<p>roaming</p>-" + ("\u00e9" * 200).encode("punycode")
        server.pages["/puny.html"] = ServedPage(puny, "text/html; charset=punycode")
        server.pages["/ok.txt"] = ServedPage(
            "Roaming\n\nRoaming costs 5 \u20ac.\n".encode("cp1252"),
            "text/plain; charset=windows-1252",
        )
        urls = [server.url(p) for p in ("/esc.txt", "/puny.html", "/ok.txt")]
        summary, snap = build(tmp_path, [{"type": "url", "urls": urls}])
        assert reasons(summary) == {
            urls[0]: f"unsupported charset 'unicode_escape' {NOT_A_WEB_ENCODING}",
            urls[1]: f"unsupported charset 'punycode' {NOT_A_WEB_ENCODING}",
        }
        assert snap.pages[page_key("url", urls[2])] == "Roaming costs 5 \u20ac.\n"
        # the crawl state was written: the next build reads it and reports the same
        again, _ = build(tmp_path, [{"type": "url", "urls": urls}])
        assert reasons(again) == reasons(summary)


def test_symbolic_link_loops_are_skipped_named_in_build_and_validate(tmp_path: Path) -> None:
    docs = docs_folder(tmp_path)
    (docs / "c").symlink_to("c")  # any name: it may have named a folder
    (docs / "a.md").symlink_to("b.md")
    (docs / "b.md").symlink_to("a.md")
    summary, snap = build(tmp_path, [{"type": "markdown", "path": str(docs)}])
    loop = "a symbolic link loop"
    assert reasons(summary) == {"a.md": loop, "b.md": loop, "c": loop}
    assert {c.source_path for c in snap.chunks} == {"billing.md"}
    report = validate_docs(docs)
    assert [(p.path, p.message) for p in report.problems if p.kind == "unreadable"] == [
        ("a.md", f"unreadable page: {loop}"),
        ("b.md", f"unreadable page: {loop}"),
        ("c", f"unreadable page: {loop}"),
    ]
