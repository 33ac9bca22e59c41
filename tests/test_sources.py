"""Every source type against real files (and a real local HTTP server for ``url``)."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from index.build import build_knowledge_base
from index.chunker import chunk_page, markdown_headings
from index.config import SourceConfig
from index.embedders.base import Embedder
from index.errors import ConfigError, SourceError
from index.snapshot import load_snapshot
from index.sources.html import html_to_markdown
from index.sources.registry import LoadContext, load_source
from index.store import LocalStore
from sidecar.config import parse_config
from tests.conftest import make_config, shared
from tests.pages_server import PagesServer, ServedPage


def load(
    tmp_path: Path, type_: str, path: Path | None = None, **options: Any
) -> tuple[list[Any], list[Any]]:
    source = SourceConfig(name=type_, type=type_, path=path, options=options)
    return load_source(source, LoadContext("kb", tmp_path / "cache"))


# --- text --------------------------------------------------------------------------------------


def test_text_title_is_first_line_or_file_name(tmp_path: Path) -> None:
    docs = tmp_path / "docs"
    (docs / "sub").mkdir(parents=True)
    (docs / "reset.txt").write_text("Reset your password\n\nOpen Settings, then Security.\n")
    (docs / "sub" / "notes.TXT").write_text("A paragraph that starts at once\nand goes on.\n")
    (docs / "bad.txt").write_bytes(b"caf\xe9\n")
    (docs / "ignored.md").write_text("# not a text file\n")
    pages, skipped = load(tmp_path, "text", docs)
    by_path = {p.source_path: p for p in pages}
    assert set(by_path) == {"reset.txt", "sub/notes.TXT"}
    assert by_path["reset.txt"].title == "Reset your password"
    assert by_path["reset.txt"].text == "Open Settings, then Security.\n"
    assert by_path["reset.txt"].kind == "text"
    assert by_path["sub/notes.TXT"].title == "notes"
    assert by_path["sub/notes.TXT"].text.startswith("A paragraph that starts at once\nand")
    assert [(s.path, "UTF-8" in s.reason) for s in skipped] == [("bad.txt", True)]


def test_folder_source_needs_an_existing_folder(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="not a folder"):
        load(tmp_path, "text", tmp_path / "missing")
    with pytest.raises(ConfigError, match="needs a path"):
        load(tmp_path, "html")
    with pytest.raises(ConfigError, match=r"unknown option\(s\) urls"):
        load(tmp_path, "text", tmp_path, urls=["http://x"])


@pytest.mark.parametrize(
    ("source", "message"),
    [
        (
            {"type": "jsonl", "path": "faq.jsonl", "text_feild": "answer"},
            r"unknown option\(s\) text_feild",
        ),
        ({"type": "url", "path": "docs"}, "takes urls, not a path"),
        ({"type": "markdown"}, "needs a path"),
    ],
)
def test_a_wrong_source_option_is_refused_when_the_config_is_read(
    tmp_path: Path, source: dict[str, object], message: str
) -> None:
    # before anything is loaded or embedded, and by a sidecar reading the same file
    raw = {"knowledge_base": [{"name": "help", "source": [{"name": "faq", **source}]}]}
    with pytest.raises(ConfigError, match=message) as info:
        parse_config(raw, base=tmp_path)
    assert "[[knowledge_base]] #1" in str(info.value)


# --- html --------------------------------------------------------------------------------------

PAGE = """<!doctype html><html><head><title>Billing help</title>
<style>.x { color: red }</style><script>var tracking = "SCRIPT-TEXT";</script></head>
<body><header><h1>Acme</h1><nav><a href="/">NAV-TEXT</a></nav></header>
<aside>ASIDE-TEXT</aside><noscript>NOSCRIPT-TEXT</noscript><template><p>TEMPLATE-TEXT</p></template>
<main><h1>Billing help</h1><p>Invoices are sent   on the <b>first</b> of the month.</p>
<h2>Refunds</h2><p>Refunds take five days.</p><ul><li>Card: instant</li><li>Bank: 5 days</li></ul>
<h3>Refund codes</h3><pre><code>REFUND-01
  REFUND-02</code></pre>
<table><tr><th>Plan</th><th>Price</th></tr><tr><td>Pro</td><td>$5</td></tr></table>
<div hidden>HIDDEN-TEXT</div></main><footer>FOOTER-TEXT</footer></body></html>"""


def test_html_keeps_readable_text_and_headings(tmp_path: Path) -> None:
    docs = tmp_path / "site"
    docs.mkdir()
    (docs / "billing.html").write_text(PAGE)
    pages, skipped = load(tmp_path, "html", docs)
    assert skipped == []
    (page,) = pages
    assert page.title == "Billing help"
    for dropped in ("SCRIPT", "NAV", "ASIDE", "NOSCRIPT", "TEMPLATE", "HIDDEN", "FOOTER", "color"):
        assert dropped not in page.text
    assert "Invoices are sent on the first of the month." in page.text
    assert "## Refunds" in page.text
    assert "### Refund codes" in page.text
    assert "- Card: instant\n- Bank: 5 days" in page.text
    assert "```\nREFUND-01\n  REFUND-02\n```" in page.text
    assert "| Plan | Price |\n| --- | --- |\n| Pro | $5 |" in page.text
    crumbs = [c.breadcrumbs for c in chunk_page(page)]
    assert ("Billing help", "Refunds") in crumbs
    assert ("Billing help", "Refunds", "Refund codes") in crumbs


def test_html_title_falls_back_to_h1_then_file_name(tmp_path: Path) -> None:
    docs = tmp_path / "site"
    docs.mkdir()
    (docs / "a.html").write_text("<body><h1>From the heading</h1><p>Text.</p></body>")
    (docs / "b.htm").write_text("<body><p>No title here.</p></body>")
    (docs / "latin.html").write_bytes(
        '<meta charset="iso-8859-1"><p>Café au lait</p>'.encode("latin-1")
    )
    (docs / "empty.html").write_text("<html><script>app()</script><nav>menu</nav></html>")
    (docs / "bad.html").write_bytes(b"<p>caf\xe9</p>")
    pages, skipped = load(tmp_path, "html", docs)
    titles = {p.source_path: p.title for p in pages}
    assert titles == {"a.html": "From the heading", "b.htm": "b", "latin.html": "latin"}
    assert "Café au lait" in next(p.text for p in pages if p.source_path == "latin.html")
    reasons = {s.path: s.reason for s in skipped}
    assert "no readable text" in reasons["empty.html"]
    assert "not valid utf-8" in reasons["bad.html"]


def test_html_text_that_looks_like_markdown_is_not_structure() -> None:
    _, text = html_to_markdown("<p># of seats</p><p>``` not a fence</p>")
    assert text == "\\# of seats\n\n\\``` not a fence\n"
    assert markdown_headings(text) == []


# --- pdf ---------------------------------------------------------------------------------------


def make_pdf(pages: list[list[str]], title: str = "", pad: int = 0) -> bytes:
    """A minimal valid PDF: Helvetica text, one line per string, one PDF page per list, and
    ``pad`` bytes of a string no page uses (a larger file, no more to extract)."""

    def esc(s: str) -> str:
        return s.replace("\\", "\\\\").replace("(", "\\(").replace(")", "\\)")

    objects = [b"<< /Type /Catalog /Pages 2 0 R >>"]
    kids = " ".join(f"{4 + 2 * i} 0 R" for i in range(len(pages)))
    objects.append(f"<< /Type /Pages /Kids [{kids}] /Count {len(pages)} >>".encode())
    objects.append(b"<< /Type /Font /Subtype /Type1 /BaseFont /Helvetica >>")
    for i, lines in enumerate(pages):
        ops = " ".join(f"({esc(line)}) Tj T*" for line in lines)
        content = f"BT /F1 12 Tf 14 TL 72 720 Td {ops} ET".encode()
        objects.append(
            f"<< /Type /Page /Parent 2 0 R /MediaBox [0 0 612 792] "
            f"/Resources << /Font << /F1 3 0 R >> >> /Contents {5 + 2 * i} 0 R >>".encode()
        )
        objects.append(b"<< /Length %d >>\nstream\n" % len(content) + content + b"\nendstream")
    info = ""
    if title:
        objects.append(f"<< /Title ({esc(title)}) >>".encode())
        info = f" /Info {len(objects)} 0 R"
    if pad:
        objects.append(b"(" + b"x" * pad + b")")
    out = b"%PDF-1.4\n"
    offsets = []
    for number, body in enumerate(objects, 1):
        offsets.append(len(out))
        out += f"{number} 0 obj\n".encode() + body + b"\nendobj\n"
    xref = len(out)
    out += f"xref\n0 {len(objects) + 1}\n0000000000 65535 f \n".encode()
    out += b"".join(f"{o:010d} 00000 n \n".encode() for o in offsets)
    out += f"trailer\n<< /Size {len(objects) + 1} /Root 1 0 R{info} >>\n".encode()
    return out + f"startxref\n{xref}\n%%EOF\n".encode()


def test_pdf_text_per_page_and_unreadable_skipped(tmp_path: Path) -> None:
    docs = tmp_path / "pdfs"
    docs.mkdir()
    (docs / "guide.pdf").write_bytes(
        make_pdf(
            [["Installing the router", "Plug in the power cable."], ["Resetting", "Hold reset."]],
            title="Router guide",
        )
    )
    (docs / "notitle.pdf").write_bytes(make_pdf([["Just one page of text."]]))
    (docs / "broken.pdf").write_bytes(b"this is not a PDF at all")
    (docs / "scan.pdf").write_bytes(make_pdf([[]]))
    pages, skipped = load(tmp_path, "pdf", docs)
    by_path = {p.source_path: p for p in pages}
    assert set(by_path) == {"guide.pdf#page=1", "guide.pdf#page=2", "notitle.pdf#page=1"}
    first = by_path["guide.pdf#page=1"]
    assert first.title == "Router guide"
    assert "Installing the router" in first.text
    assert "Plug in the power cable." in first.text
    assert "Hold reset." in by_path["guide.pdf#page=2"].text
    assert "Hold reset." not in first.text
    assert dict(first.metadata) == {"page": "1", "pages": "2"}
    assert by_path["notitle.pdf#page=1"].title == "notitle"
    reasons = {s.path: s.reason for s in skipped}
    assert set(reasons) == {"broken.pdf", "scan.pdf"}
    assert reasons["broken.pdf"].startswith("unreadable PDF")
    assert "no text layer" in reasons["scan.pdf"]


# --- jsonl and csv -----------------------------------------------------------------------------

RECORD_OPTIONS = {
    "id_field": "_id",
    "title_field": "name",
    "text_field": "answer",
    "context_fields": ["entity", "city"],
    "metadata_fields": ["kind", "tags"],
}


def test_jsonl_records_with_context_and_bad_lines_skipped(tmp_path: Path) -> None:
    lines = [
        {"_id": "q1", "name": "Parking", "answer": "Parking is free.", "entity": "Hotel A",
         "city": "Cambridge", "kind": "faq", "tags": ["car", "free"]},
        {"_id": 2, "answer": "Check-in at 3pm.", "entity": "Hotel B", "kind": "faq"},
        {"_id": "q1", "answer": "A duplicate id."},
        {"name": "no id", "answer": "x"},
        {"_id": "q4", "answer": ""},
        {"_id": "q5", "answer": ["a", "list"]},
    ]  # fmt: skip
    text = "\n".join(json.dumps(x) for x in lines[:2]) + "\n{not json\n\n[1, 2]\n"
    text += "\n".join(json.dumps(x) for x in lines[2:]) + "\n"
    path = tmp_path / "faq.jsonl"
    path.write_text(text)
    pages, skipped = load(tmp_path, "jsonl", path, **RECORD_OPTIONS)
    assert [p.source_path for p in pages] == ["q1", "2"]
    q1, q2 = pages
    assert (q1.title, q1.text, q1.kind) == ("Parking", "Parking is free.", "text")
    assert q1.context == "Hotel A > Cambridge"
    assert dict(q1.metadata) == {"kind": "faq", "tags": ("car", "free")}  # a list stays one
    assert (q2.title, q2.context) == ("2", "Hotel B")  # no title field: the id
    (chunk,) = chunk_page(q1)
    assert chunk.embed_text == "Hotel A > Cambridge\n\nParking is free."
    assert chunk.text == "Parking is free."
    where = {s.path: s.reason for s in skipped}
    assert list(where) == [f"faq.jsonl:{n}" for n in (3, 5, 6, 7, 8, 9)]
    assert where["faq.jsonl:3"].startswith("malformed JSON")
    assert "not an object" in where["faq.jsonl:5"]
    assert "duplicate id 'q1' (first at line 1)" in where["faq.jsonl:6"]
    assert "no '_id'" in where["faq.jsonl:7"]
    assert "no 'answer'" in where["faq.jsonl:8"]
    assert "is a list" in where["faq.jsonl:9"]


def test_csv_records_with_line_numbers(tmp_path: Path) -> None:
    path = tmp_path / "faq.csv"
    path.write_text(
        "_id,name,answer,entity,kind\n"
        'a1,Wifi,"Wifi is free.\nAsk the desk for the code.",Hotel A,faq\n'
        "a2,Pets,No pets.,Hotel B\n"
        "a3,Late,Late check-out costs extra.,Hotel C,faq\n",
        encoding="utf-8",
    )
    pages, skipped = load(tmp_path, "csv", path, **{**RECORD_OPTIONS, "metadata_fields": ["kind"]})
    assert [p.source_path for p in pages] == ["a1", "a3"]
    assert pages[0].text == "Wifi is free.\nAsk the desk for the code."
    assert pages[0].context == "Hotel A"
    assert [(s.path, s.reason) for s in skipped] == [("faq.csv:4", "4 fields, the header has 5")]
    with pytest.raises(SourceError, match="no column 'id'"):
        load(tmp_path, "csv", path)


def test_record_options_are_checked(tmp_path: Path) -> None:
    path = tmp_path / "x.jsonl"
    path.write_text('{"id": "1", "text": "t"}\n')
    with pytest.raises(ConfigError, match="context_fields must be a list"):
        load(tmp_path, "jsonl", path, context_fields="entity_name")
    with pytest.raises(ConfigError, match="unknown option"):
        load(tmp_path, "jsonl", path, text_fields=["text"])
    with pytest.raises(SourceError, match="is not a file"):
        load(tmp_path, "jsonl", tmp_path)


def test_dstc11_corpus_loads_with_entity_context(tmp_path: Path) -> None:
    corpus = shared("dstc11-faq-reviews", "corpus.jsonl")
    pages, skipped = load(
        tmp_path, "jsonl", corpus, id_field="_id", context_fields=["entity_name"],
        metadata_fields=["doc_type", "domain"],
    )  # fmt: skip
    assert skipped == []
    assert len(pages) == 10_882
    assert all(p.context and p.kind == "text" for p in pages)
    first = pages[0]
    assert first.source_path == "hotel|0|faq|0"
    assert first.context == "A AND B GUEST HOUSE"
    assert chunk_page(first)[0].embed_text.startswith("A AND B GUEST HOUSE\n\nQ: ")
    assert {p.metadata["doc_type"] for p in pages} >= {"faq"}


# --- url ---------------------------------------------------------------------------------------


@pytest.fixture
def server() -> Iterator[PagesServer]:
    with PagesServer() as s:
        yield s


def html(title: str, *paragraphs: str) -> bytes:
    body = "".join(f"<p>{p}</p>" for p in paragraphs)
    return f"<html><head><title>{title}</title></head><body><nav>MENU</nav>{body}</body></html>".encode()


def url_config(tmp_path: Path, server: PagesServer, paths: list[str], refresh: float) -> Any:
    urls = [server.url(p) for p in paths]
    source = {"name": "web", "type": "url", "urls": urls, "refresh": refresh}
    return make_config(tmp_path / "store", [source], kb="web")


def test_url_unchanged_pages_answer_304_and_embed_nothing(
    tmp_path: Path, server: PagesServer, local_embedder: Embedder
) -> None:
    server.pages["/billing"] = ServedPage(html("Billing", "Invoices go out monthly."), etag='"b1"')
    server.pages["/returns"] = ServedPage(html("Returns", "Returns within 30 days."), etag='"r1"')
    server.pages["/notes.txt"] = ServedPage(
        b"Opening hours\n\nWe open at nine.", "text/plain; charset=utf-8",
        last_modified="Wed, 01 Jan 2025 00:00:00 GMT",
    )  # fmt: skip
    config = url_config(tmp_path, server, ["/billing", "/returns", "/notes.txt"], refresh=0)
    kb = config.knowledge_bases[0]

    first = build_knowledge_base(config, kb, local_embedder)
    assert first.published
    assert first.pages == 3
    assert first.embedded == first.chunks > 0
    assert server.statuses() == [200, 200, 200]
    snap = load_snapshot(LocalStore(config.index.store).latest_dir("web"))
    billing = next(c for c in snap.chunks if c.source_path == server.url("/billing"))
    assert billing.title == "Billing"
    assert "MENU" not in billing.text
    assert billing.url == server.url("/billing")

    second = build_knowledge_base(config, kb, local_embedder)
    assert server.statuses(3) == [304, 304, 304]
    assert (second.published, second.embedded, second.version) == (False, 0, first.version)

    server.pages["/returns"] = ServedPage(html("Returns", "Returns within 60 days."), etag='"r2"')
    third = build_knowledge_base(config, kb, local_embedder)
    assert sorted(server.statuses(6)) == [200, 304, 304]
    assert third.published
    assert third.embedded == 1
    assert third.reused == third.chunks - 1


def test_url_not_due_is_not_requested_and_failures_are_handled(
    tmp_path: Path, server: PagesServer, local_embedder: Embedder
) -> None:
    server.pages["/a"] = ServedPage(html("A", "Alpha text."), etag='"a"')
    server.pages["/b"] = ServedPage(html("B", "Beta text."), etag='"b"')
    config = url_config(tmp_path, server, ["/a", "/b", "/missing"], refresh=3600)
    kb = config.knowledge_bases[0]
    first = build_knowledge_base(config, kb, local_embedder)
    assert first.pages == 2
    assert [s["path"] for s in first.skipped_pages] == [server.url("/missing")]
    assert first.skipped_pages[0]["reason"] == "HTTP 404 Not Found"
    requests = len(server.log)

    build_knowledge_base(config, kb, local_embedder)
    assert len(server.log) == requests  # nothing due within the refresh interval

    # due again: /a fails with a server error (its last copy is kept), /b is gone
    server.pages["/a"] = ServedPage(b"", status=503)
    del server.pages["/b"]
    later = build_knowledge_base(config, kb, local_embedder, now=time.time() + 3601)
    assert len(server.log) == requests + 3
    assert later.pages == 1
    assert later.published
    snap = load_snapshot(LocalStore(config.index.store).latest_dir("web"))
    assert {c.source_path for c in snap.chunks} == {server.url("/a")}
    assert {s["path"] for s in later.skipped_pages} == {server.url("/b"), server.url("/missing")}


def test_url_options_are_checked(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="needs urls"):
        load(tmp_path, "url")
    with pytest.raises(ConfigError, match="not an http"):
        load(tmp_path, "url", urls=["ftp://example.com/x"])
    with pytest.raises(ConfigError, match="refresh must be"):
        load(tmp_path, "url", urls=["http://127.0.0.1:9/x"], refresh=-1)


def test_url_content_types(tmp_path: Path, server: PagesServer) -> None:
    server.pages["/manual.pdf"] = ServedPage(
        make_pdf([["Page one text."], ["Page two text."]], title="Manual"), "application/pdf"
    )
    server.pages["/notes.md"] = ServedPage(
        b"# Release notes\n\n## 2.0\n\nFaster.\n", "text/markdown"
    )
    server.pages["/logo.png"] = ServedPage(b"\x89PNG", "image/png")
    urls = [server.url(p) for p in ("/manual.pdf", "/notes.md", "/logo.png")]
    pages, skipped = load(tmp_path, "url", urls=urls, refresh=0)
    assert [(p.source_path, p.title, p.kind) for p in pages] == [
        (f"{urls[0]}#page=1", "Manual", "text"),
        (f"{urls[0]}#page=2", "Manual", "text"),
        (urls[1], "Release notes", "markdown"),
    ]
    assert pages[1].url == f"{urls[0]}#page=2"
    assert [(s.path, s.reason) for s in skipped] == [
        (urls[2], "unsupported content type image/png")
    ]
    # a second load answers from the crawl state; the skipped page stays reported
    assert load(tmp_path, "url", urls=urls, refresh=3600) == (pages, skipped)
    assert len(server.log) == 3


def test_a_url_pdf_page_past_its_text_limit_is_left_out_and_reported(
    tmp_path: Path, server: PagesServer
) -> None:
    """A page of ~360 kB of text skipped the whole fetched PDF; now that page is left out,
    named with why in the skipped pages (only logged before, where a ``pdf`` folder's was
    reported), at the fetch and at a load from the crawl state, and the pages before and after
    it are kept."""
    dump = ["word " * 40] * 1_800
    server.pages["/manual.pdf"] = ServedPage(
        make_pdf([["Page one text."], dump, ["Page three text."]]), "application/pdf"
    )
    url = server.url("/manual.pdf")
    pages, skipped = load(tmp_path, "url", urls=[url], refresh=0)
    assert [(p.source_path, p.text) for p in pages] == [
        (f"{url}#page=1", "Page one text."),
        (f"{url}#page=3", "Page three text."),
    ]
    assert [(s.path, s.reason) for s in skipped] == [
        (
            f"{url}#page=2",
            "too much text to extract: page 2: its text passes 262,144 bytes "
            "(PDF_MAX_PAGE_TEXT_BYTES); the page is left out, the document's other pages kept",
        )
    ]
    assert load(tmp_path, "url", urls=[url], refresh=3600) == (pages, skipped)
    assert len(server.log) == 1  # the second load answered from the crawl state
