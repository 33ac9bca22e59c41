"""A build holds every page of its base at once: past the base's ``max_text_bytes`` it is
refused as its sources read, in one line, and nothing is published (attack s18: a source folder
or URL list of any size grew the indexer without a byte bound)."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest

from index.build import build_knowledge_base
from index.embedders.base import HashEmbedder
from index.errors import BaseTooLarge
from index.sources import PAGE_BYTES
from index.sources.url import MAX_WORKERS, state_path
from index.store import LocalStore
from sidecar.cli import main
from sidecar.config import parse_config
from tests.pages_server import PagesServer, ServedPage

LIMIT = 20_000
PAGE = "a" * 2000
REFUSAL = re.compile(
    r"knowledge base 'kb': its pages hold ([\d,]+) bytes by source '(\w+)' page '([^']+)', "
    r"over max_text_bytes \(20,000\): raise the base's max_text_bytes if the indexer has the "
    r"memory \(a build holds about 5 times it at its peak\), or split its sources into several "
    r"bases; nothing was published"
)


def build(tmp_path: Path, source: dict[str, Any], **kb: Any) -> str:
    """Build base ``kb`` of ``source``; the version published."""
    raw = {
        "knowledge_base": [{"name": "kb", "source": [source], **kb}],
        "index": {"store": str(tmp_path / "store")},
    }
    config = parse_config(raw, base=tmp_path)
    return build_knowledge_base(config, config.knowledge_bases[0], HashEmbedder()).version


def refused(tmp_path: Path, source: dict[str, Any]) -> re.Match[str]:
    with pytest.raises(BaseTooLarge) as info:
        build(tmp_path, source, max_text_bytes=LIMIT)
    said = REFUSAL.fullmatch(str(info.value))
    assert said, str(info.value)
    held = int(said.group(1).replace(",", ""))
    assert LIMIT < held <= LIMIT + PAGE_BYTES + 4 * len(PAGE)  # refused at the page passing it
    return said


def test_a_folder_past_max_text_bytes_is_refused_as_read_and_the_last_version_serves(
    tmp_path: Path,
) -> None:
    docs = tmp_path / "docs"
    docs.mkdir()
    (docs / "a.md").write_text("# Billing\n\nInvoices go out monthly.\n")
    published = build(tmp_path, {"type": "markdown", "path": str(docs)}, max_text_bytes=LIMIT)
    for i in range(40):
        (docs / f"p{i:02d}.md").write_text(PAGE)
    said = refused(tmp_path, {"type": "markdown", "path": str(docs)})
    assert said.group(2) == "markdown"
    assert said.group(3) < "p39.md"  # the files after the one passing the limit are not read
    store = LocalStore(tmp_path / "store")
    assert store.latest("kb") == published
    assert [p.name for p in (tmp_path / "store" / "kb").iterdir() if p.is_dir()] == [published]


def test_a_jsonl_export_past_max_text_bytes_is_refused(tmp_path: Path) -> None:
    faq = tmp_path / "faq.jsonl"
    faq.write_text("".join(f'{{"id": "r{i:02d}", "text": "{PAGE}"}}\n' for i in range(40)))
    said = refused(tmp_path, {"type": "jsonl", "path": str(faq)})
    assert said.group(3) < "r39"


def test_a_url_list_past_max_text_bytes_stops_fetching_and_keeps_no_crawl_state(
    tmp_path: Path,
) -> None:
    with PagesServer() as server:
        for i in range(40):
            server.pages[f"/p{i:02d}"] = ServedPage(PAGE.encode(), "text/plain; charset=utf-8")
        urls = [server.url(f"/p{i:02d}") for i in range(40)]
        refused(tmp_path, {"name": "web", "type": "url", "urls": urls})
        # fetched a window (MAX_WORKERS) at a time: the windows after the refusal never start
        assert len(server.log) <= 2 * MAX_WORKERS < len(urls)
    cache = tmp_path / "store" / ".embedding-cache"
    assert not state_path(cache, "kb", "web").exists()


def test_index_build_refuses_in_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    (tmp_path / "kb").mkdir()
    for i in range(40):
        (tmp_path / "kb" / f"p{i:02d}.md").write_text(PAGE)
    path = tmp_path / "voxrecall.toml"
    path.write_text(
        f'[[knowledge_base]]\nname = "kb"\nmax_text_bytes = {LIMIT}\n'
        '[[knowledge_base.source]]\ntype = "markdown"\npath = "kb"\n'
    )
    assert main(["index", "build", "--config", str(path)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1
    assert REFUSAL.fullmatch(err.removeprefix("error: ").rstrip("\n")), err
    assert LocalStore(tmp_path / "store").latest("kb") is None
