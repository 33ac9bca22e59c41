"""Index builds with the real embedded model on small folders: incremental embedding, removed and
bad pages, strict mode through the CLI, pruning, and the JSON summary."""

from __future__ import annotations

import json
import logging
import os
import stat
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from index.build import build_knowledge_base, embed_chunks, text_key
from index.embedders.base import Embedder, HashEmbedder, Vectors
from index.progress import EmbedProgress
from index.snapshot import LoadedSnapshot, load_snapshot
from index.store import LocalStore
from index.types import Chunk
from sidecar.cli import main
from sidecar.config import Config, parse_config
from tests.conftest import REPO

GUIDE = """---
title: Router guide
product_area: networking
---
# Router guide

## Installing

Plug the router into the wall socket and wait for the green light.

## Resetting

Hold the reset button for ten seconds until the light blinks.

## Updating

Open the app, choose Settings, then Firmware, then Update now.
"""


def docs_folder(root: Path) -> Path:
    docs = root / "docs"
    docs.mkdir(parents=True)
    (docs / "guide.md").write_text(GUIDE)
    (docs / "billing.md").write_text("# Billing\n\nInvoices are sent on the first of each month.\n")
    (docs / "returns.md").write_text("# Returns\n\nYou can return a router within 30 days.\n")
    return docs


def config_for(tmp_path: Path, docs: Path, **index: Any) -> Config:
    raw = {
        "knowledge_base": [{"name": "kb", "source": [{"type": "markdown", "path": str(docs)}]}],
        "index": {"store": str(tmp_path / "store"), **index},
    }
    return parse_config(raw, base=tmp_path)


def build(config: Config, embedder: Embedder, **kwargs: Any) -> Any:
    return build_knowledge_base(config, config.knowledge_bases[0], embedder, **kwargs)


def latest(config: Config) -> LoadedSnapshot:
    return load_snapshot(LocalStore(config.index.store).latest_dir("kb"))


def vectors_by_id(snap: LoadedSnapshot) -> dict[str, Vectors]:
    stored = np.asarray(snap.index.get_items(np.arange(len(snap.chunks))), dtype=np.float32)
    return {c.chunk_id: stored[i] for i, c in enumerate(snap.chunks)}


def test_unchanged_base_embeds_and_publishes_nothing(
    tmp_path: Path, local_embedder: Embedder
) -> None:
    config = config_for(tmp_path, docs_folder(tmp_path))
    first = build(config, local_embedder)
    assert first.published
    assert first.embedded == first.chunks == 5
    second = build(config, local_embedder)
    assert (second.published, second.embedded, second.reused) == (False, 0, 5)
    assert second.version == first.version
    assert LocalStore(config.index.store).versions("kb") == [first.version]


def test_editing_one_page_reembeds_only_its_changed_chunks(
    tmp_path: Path, local_embedder: Embedder
) -> None:
    docs = docs_folder(tmp_path)
    config = config_for(tmp_path, docs)
    build(config, local_embedder)
    before = vectors_by_id(latest(config))

    (docs / "guide.md").write_text(GUIDE.replace("ten seconds", "fifteen seconds"))
    summary = build(config, local_embedder)
    assert summary.published
    assert (summary.embedded, summary.reused, summary.removed) == (1, 4, 1)
    after = latest(config)
    changed = [c for c in after.chunks if c.chunk_id not in before]
    assert [c.breadcrumbs for c in changed] == [("Router guide", "Resetting")]
    for chunk_id, vector in vectors_by_id(after).items():
        if chunk_id in before:
            assert np.array_equal(vector, before[chunk_id])  # reused, not recomputed


def test_removed_page_disappears_from_the_next_snapshot(
    tmp_path: Path, local_embedder: Embedder
) -> None:
    docs = docs_folder(tmp_path)
    config = config_for(tmp_path, docs)
    build(config, local_embedder)
    (docs / "returns.md").unlink()
    summary = build(config, local_embedder)
    assert (summary.published, summary.pages, summary.removed, summary.embedded) == (True, 2, 1, 0)
    snap = latest(config)
    assert "returns.md" not in {c.source_path for c in snap.chunks}
    assert set(snap.pages) == {"markdown:guide.md", "markdown:billing.md"}


def test_bad_pages_are_skipped_with_reasons_while_the_rest_indexes(
    tmp_path: Path, local_embedder: Embedder
) -> None:
    docs = docs_folder(tmp_path)
    (docs / "latin1.md").write_bytes(b"# Caf\xe9\n\nMenu.\n")
    (docs / "front.md").write_text("---\ntitle: [oops\n---\n# Front\n\nText.\n")
    config = config_for(tmp_path, docs)
    summary = build(config, local_embedder)
    assert summary.published
    assert summary.pages == 3
    reasons = {s["path"]: s["reason"] for s in summary.skipped_pages}
    assert set(reasons) == {"latin1.md", "front.md"}
    assert reasons["latin1.md"].startswith("not valid UTF-8")
    assert reasons["front.md"].startswith("malformed frontmatter")
    assert {c.source_path for c in latest(config).chunks} == {
        "guide.md",
        "billing.md",
        "returns.md",
    }


def write_config(tmp_path: Path, docs: Path, extra: str = "") -> Path:
    path = tmp_path / "voxrecall.toml"
    path.write_text(
        f'[[knowledge_base]]\nname = "kb"\n[[knowledge_base.source]]\ntype = "markdown"\n'
        f'path = "{docs}"\n[index]\nstore = "store"\n{extra}'
    )
    return path


@pytest.mark.parametrize(("strict", "code"), [(True, 1), (False, 0)])
def test_strict_build_exits_non_zero_when_a_page_was_skipped(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], strict: bool, code: int
) -> None:
    docs = docs_folder(tmp_path)
    (docs / "bad.md").write_bytes(b"\xff\xfe not utf-8")
    config = write_config(tmp_path, docs, f"strict = {str(strict).lower()}\n")
    assert main(["index", "build", "--config", str(config), "--json"]) == code
    captured = capsys.readouterr()
    (summary,) = json.loads(captured.out)
    keys = {"knowledge_base", "version", "pages", "chunks", "embedded", "reused", "removed"}
    assert keys | {"skipped_pages", "seconds"} <= set(summary)
    assert summary["skipped_pages"] == [
        {"path": "bad.md", "reason": "not valid UTF-8: invalid start byte at byte 0"}
    ]
    assert (summary["pages"], summary["chunks"], summary["embedded"]) == (3, 5, 5)
    assert {"load", "chunk", "embed", "write"} <= set(summary["seconds"])
    assert ("[index] strict: 1 page(s) skipped" in captured.err) is strict
    assert (tmp_path / "store" / "kb" / "LATEST").is_file()  # strict still publishes the rest


def test_a_build_that_finds_no_chunk_is_not_published_over_the_served_one(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # an export corrupted (every line skipped) or a folder emptied (a volume not mounted)
    # published a snapshot of no chunks over the good one, exit 0: every call answered nothing
    docs = docs_folder(tmp_path)
    config = write_config(tmp_path, docs)
    assert main(["index", "build", "--config", str(config)]) == 0
    store = LocalStore(tmp_path / "store")
    good = store.latest("kb")
    for page in docs.iterdir():
        page.write_bytes(b"\xff\xfe not utf-8")
    (docs / "evil\n  skipped billing.md: forged.md").write_bytes(b"\xff")
    assert main(["index", "build", "--config", str(config)]) == 2
    every = capsys.readouterr().err
    for page in list(docs.iterdir()):
        page.unlink()
    assert main(["index", "build", "--config", str(config)]) == 2
    none = capsys.readouterr().err
    assert store.latest("kb") == good
    assert store.versions("kb") == [good]
    assert every.startswith("error: kb: every page was skipped (4: ")
    assert "evil\\n  skipped billing.md: forged.md: not valid UTF-8" in every  # one line
    assert f"so nothing is published over {good}, which keeps serving" in every
    assert none.startswith("error: kb: its sources gave no chunk (an empty folder or export")


def test_a_base_empty_on_purpose_builds_again_under_another_embedder(tmp_path: Path) -> None:
    # only a build that would empty a base of chunks is refused: an empty one published before
    # is not, whatever changed (its content hash is its embedder's name alone)
    docs = tmp_path / "docs"
    docs.mkdir()
    config = config_for(tmp_path, docs)
    assert build(config, HashEmbedder(dimension=8)).published
    again = build(config, HashEmbedder(dimension=16, name="other/model"))
    assert again.published
    assert again.chunks == 0


def test_a_skipped_page_s_name_is_reported_on_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # a file name holding a line break printed report lines of its own
    docs = docs_folder(tmp_path)
    (docs / "evil\n  skipped billing.md: forged reason\n.md").write_bytes(b"\xff")
    assert main(["index", "build", "--config", str(write_config(tmp_path, docs))]) == 0
    skipped = [line for line in capsys.readouterr().out.splitlines() if "skipped" in line]
    assert skipped == [
        "  skipped evil\\n  skipped billing.md: forged reason\\n.md: "
        "not valid UTF-8: invalid start byte at byte 0"
    ]


def test_pruning_keeps_keep_versions(tmp_path: Path, local_embedder: Embedder) -> None:
    docs = docs_folder(tmp_path)
    config = config_for(tmp_path, docs, keep_versions=2)
    versions = []
    for n in range(4):
        (docs / "billing.md").write_text(f"# Billing\n\nInvoices go out on day {n + 1}.\n")
        versions.append(build(config, local_embedder).version)
    store = LocalStore(config.index.store)
    assert store.versions("kb") == versions[-2:]
    assert store.latest("kb") == versions[-1]


@pytest.mark.parametrize("umask", [0o022, 0o077])
def test_a_published_store_is_readable_by_every_user_whatever_the_umask(
    tmp_path: Path, local_embedder: Embedder, umask: int
) -> None:
    """The image runs as uid 10001 over a read-only mount of a store another user built."""
    docs = docs_folder(tmp_path)
    config = config_for(tmp_path, docs, store=str(tmp_path / "var" / "store"))
    previous = os.umask(umask)
    try:
        summary = build(config, local_embedder)
        copy = LocalStore(tmp_path / "published").publish_copy(
            "kb", LocalStore(config.index.store).latest_dir("kb")
        )  # what `voxrecall index publish --to DIR` writes
    finally:
        os.umask(previous)
    assert copy is not None
    for root in (config.index.store, tmp_path / "published"):
        version = root / "kb" / summary.version
        folders = [root, root / "kb", version]
        files = [root / "kb" / "LATEST", *version.iterdir()]
        assert {oct(stat.S_IMODE(p.stat().st_mode)) for p in folders} == {"0o755"}, root
        assert {oct(stat.S_IMODE(p.stat().st_mode)) for p in files} == {"0o644"}, root


def test_a_build_abandoned_while_embedding_publishes_nothing(
    tmp_path: Path, local_embedder: Embedder
) -> None:
    config = config_for(tmp_path, docs_folder(tmp_path))

    def stop(done: int, total: int) -> None:
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        build(config, local_embedder, progress=stop)
    store = LocalStore(config.index.store)
    assert store.latest("kb") is None
    assert store.versions("kb") == []


class RecordingEmbedder(HashEmbedder):
    """The fake, recording how many texts each embed_batch call got."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[int] = []

    def embed_batch(self, texts: Sequence[str]) -> Vectors:
        self.calls.append(len(texts))
        return super().embed_batch(texts)


def test_embed_chunks_hands_batch_size_times_concurrency_texts_per_call() -> None:
    embedder = RecordingEmbedder()
    chunks = [Chunk(f"c{i}", "s", "p", "t", (), f"text {i}", f"text {i}") for i in range(25)]
    cached = embedder.embed_batch(["text 3"])[0]
    embedder.calls.clear()
    seen: list[tuple[int, int]] = []
    vectors, embedded = embed_chunks(
        embedder,
        chunks,
        {text_key(embedder.info, "text 3"): cached},
        batch_size=4,
        max_concurrency=3,
        progress=lambda done, total: seen.append((done, total)),
    )
    assert embedder.calls == [12, 12]
    assert embedded == 24
    assert seen == [(0, 24), (12, 24), (24, 24)]
    assert np.allclose(vectors, embedder.embed_batch([c.embed_text for c in chunks]))


# -- progress, in a terminal and in a log ------------------------------------------------------


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_progress_in_a_log_is_a_line_per_interval_with_rate_and_time_left(
    caplog: pytest.LogCaptureFixture,
) -> None:
    clock = Clock()
    progress = EmbedProgress("kb", pages=193, chunks=4110, every_s=10.0, tty=False, clock=clock)
    with caplog.at_level(logging.INFO, logger="voxrecall.index"):
        progress(0, 4000)
        for done in range(100, 4001, 100):  # a slice every 2.5 s: 100 s in all
            clock.now += 2.5
            progress(done, 4000)
    lines = [r.getMessage() for r in caplog.records]
    assert lines[0] == "kb: 193 pages read, 4110 chunks: embedding 4000 (110 reused)"
    assert lines[1] == "kb: embedded 400 of 4000 chunks (10%), 40.0 chunks/s, 1 min 30 s left"
    assert len(lines) == 1 + 10  # one line per 10 s, the last at the end
    assert lines[-1] == "kb: embedded 4000 of 4000 chunks (100%), 40.0 chunks/s, in 1 min 40 s"


def test_progress_on_a_terminal_is_one_bar(capsys: pytest.CaptureFixture[str]) -> None:
    clock = Clock()
    progress = EmbedProgress("kb", pages=3, chunks=5, tty=True, clock=clock)
    progress(0, 5)
    clock.now += 1.0
    progress(2, 5)
    clock.now += 1.0
    progress(5, 5)
    err = capsys.readouterr().err
    assert err.count("\r") == 2
    assert err.endswith("\n")
    assert "[############..................] embedded 2 of 5 chunks (40%), 2.0 chunks/s" in err
    assert "2 s left" in err


def test_a_build_writing_to_a_file_logs_what_it_read_and_embedded(tmp_path: Path) -> None:
    docs = docs_folder(tmp_path)
    config = tmp_path / "voxrecall.toml"
    config.write_text(
        f'[[knowledge_base]]\nname = "kb"\n[[knowledge_base.source]]\ntype = "markdown"\n'
        f'path = "{docs}"\n[index]\nstore = "{tmp_path / "store"}"\n'
    )
    log_file = tmp_path / "build.log"
    with log_file.open("wb") as out:
        proc = subprocess.run(
            [sys.executable, "-m", "sidecar.cli", "index", "build", "--config", str(config)],
            stdout=out,
            stderr=subprocess.STDOUT,
            cwd=REPO,
            timeout=300,
            check=False,
        )
    text = log_file.read_text()
    assert proc.returncode == 0, text
    assert "kb: no snapshot published yet: every chunk is embedded" in text
    assert "run `voxrecall index build`" not in text  # the command being run
    assert "kb: 3 pages read, 5 chunks: embedding 5 (0 reused)" in text
    assert "kb: embedded 5 of 5 chunks (100%)" in text
    assert "\r" not in text  # no terminal bar in a file
