"""`voxrecall index watch`: bounded cycles with a controlled clock, and a real process stopped by
SIGTERM / SIGINT."""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from pathlib import Path

import pytest

from index.embedders.base import Embedder, EmbedderInfo, Vectors
from index.store import LocalStore
from index.watch import Watcher, WatchOptions
from sidecar.config import Config, parse_config
from tests.conftest import REPO
from tests.pages_server import PagesServer, ServedPage

INTERVAL = 600.0


class Clock:
    def __init__(self) -> None:
        self.now = time.time()

    def __call__(self) -> float:
        return self.now


def config_for(tmp_path: Path, sources: list[dict[str, object]]) -> Config:
    raw = {"knowledge_base": [{"name": "kb", "source": sources}], "index": {"store": "store"}}
    return parse_config(raw, base=tmp_path)


def test_rebuilds_on_start_file_change_and_schedule_only(
    tmp_path: Path, local_embedder: Embedder
) -> None:
    docs = tmp_path / "docs"
    docs.mkdir()
    (docs / "a.md").write_text("# A\n\nAlpha.\n")
    config = config_for(tmp_path, [{"type": "markdown", "path": "docs"}])
    clock = Clock()
    watcher = Watcher(config, local_embedder, WatchOptions(INTERVAL, poll_s=0), clock=clock)
    store = LocalStore(config.index.store)

    (start,) = watcher.run(max_cycles=1)
    assert start.reasons == ("start",)
    assert start.summary is not None
    assert start.summary.published
    first = store.latest("kb")

    assert watcher.run(max_cycles=3) == []  # nothing changed, nothing due

    (docs / "b.md").write_text("# B\n\nBeta.\n")
    (edit,) = watcher.run(max_cycles=2)
    assert edit.reasons == ("files",)
    assert edit.summary is not None
    assert (edit.summary.published, edit.summary.embedded) == (True, 1)
    assert store.latest("kb") != first

    clock.now += INTERVAL
    (scheduled,) = watcher.run(max_cycles=2)
    assert scheduled.reasons == ("schedule",)
    assert scheduled.summary is not None
    assert (scheduled.summary.published, scheduled.summary.embedded) == (False, 0)
    assert len(store.versions("kb")) == 2


def test_recrawls_urls_when_refresh_is_due(tmp_path: Path, local_embedder: Embedder) -> None:
    with PagesServer() as server:
        server.pages["/faq"] = ServedPage(b"<title>FAQ</title><p>Open at nine.</p>", etag='"1"')
        source = {"type": "url", "urls": [server.url("/faq")], "refresh": 60}
        config = config_for(tmp_path, [source])
        clock = Clock()
        watcher = Watcher(config, local_embedder, WatchOptions(INTERVAL, poll_s=0), clock=clock)

        assert [e.reasons for e in watcher.run(max_cycles=1)] == [("start",)]
        assert server.statuses() == [200]
        clock.now += 30
        assert watcher.run(max_cycles=2) == []
        assert server.statuses() == [200]  # not due: not even a conditional request

        clock.now += 31
        (due,) = watcher.run(max_cycles=1)
        assert due.reasons == ("urls",)
        assert server.statuses() == [200, 304]
        assert due.summary is not None
        assert (due.summary.published, due.summary.embedded) == (False, 0)

        server.pages["/faq"] = ServedPage(b"<title>FAQ</title><p>Open at ten.</p>", etag='"2"')
        clock.now += 61
        (changed,) = watcher.run(max_cycles=1)
        assert server.statuses() == [200, 304, 200]
        assert changed.summary is not None
        assert (changed.summary.published, changed.summary.embedded) == (True, 1)


class StopWhileEmbedding:
    """The real embedder, but the watcher is asked to stop as soon as embedding starts."""

    def __init__(self, inner: Embedder, stop: threading.Event) -> None:
        self.inner, self.stop = inner, stop

    @property
    def info(self) -> EmbedderInfo:
        return self.inner.info

    def embed_batch(self, texts: Sequence[str]) -> Vectors:
        self.stop.set()
        return self.inner.embed_batch(texts)

    async def embed(self, texts: Sequence[str]) -> Vectors:
        return await self.inner.embed(texts)

    async def aclose(self) -> None:
        return None


def two_bases(tmp_path: Path) -> Config:
    for name in ("good", "bad"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "a.md").write_text(f"# {name}\n\nThe {name} base.\n")
    raw = {
        "knowledge_base": [
            {"name": name, "source": [{"type": "markdown", "path": name}]}
            for name in ("good", "bad")
        ],
        "index": {"store": "store"},
    }
    return parse_config(raw, base=tmp_path)


def test_a_file_named_in_bytes_that_are_not_utf8_is_skipped_and_watching_goes_on(
    tmp_path: Path, local_embedder: Embedder
) -> None:
    # the name's surrogate escapes stopped the watcher's poll (and so every base's rebuilds)
    config = two_bases(tmp_path)
    watcher = Watcher(config, local_embedder, WatchOptions(INTERVAL, poll_s=0), clock=Clock())
    assert [(e.knowledge_base, e.reasons) for e in watcher.run(max_cycles=1)] == [
        ("good", ("start",)),
        ("bad", ("start",)),
    ]
    with open(os.path.join(os.fsencode(tmp_path / "bad"), b"n\xff.md"), "wb") as f:
        f.write(b"# N\n\nA name in latin-1.\n")
    (tmp_path / "bad" / "loop").symlink_to("loop")
    (bad,) = watcher.run(max_cycles=1)
    assert (bad.knowledge_base, bad.reasons, bad.error) == ("bad", ("files",), "")
    assert bad.summary is not None
    assert bad.summary.skipped_pages == [
        {"path": "loop", "reason": "a symbolic link loop"},
        {"path": "n\\xff.md", "reason": "the name is not UTF-8 (rename it to index it)"},
    ]

    (tmp_path / "good" / "b.md").write_text("# B\n\nStill watched.\n")
    (edit,) = watcher.run(max_cycles=1)
    assert (edit.knowledge_base, edit.reasons) == ("good", ("files",))
    assert edit.summary is not None
    assert (edit.summary.published, edit.summary.embedded) == (True, 1)


class FailsOn:
    """The real embedder, but a bug (RuntimeError) for any text holding ``word``."""

    def __init__(self, inner: Embedder, word: str) -> None:
        self.inner, self.word = inner, word

    @property
    def info(self) -> EmbedderInfo:
        return self.inner.info

    def embed_batch(self, texts: Sequence[str]) -> Vectors:
        if any(self.word in t for t in texts):
            raise RuntimeError(f"cannot embed {self.word!r}")
        return self.inner.embed_batch(texts)

    async def embed(self, texts: Sequence[str]) -> Vectors:
        return await self.inner.embed(texts)

    async def aclose(self) -> None:
        return None


def test_a_build_that_raises_anything_is_logged_and_the_other_bases_still_built(
    tmp_path: Path, local_embedder: Embedder, caplog: pytest.LogCaptureFixture
) -> None:
    config = two_bases(tmp_path)
    embedder = FailsOn(local_embedder, "poison")
    watcher = Watcher(config, embedder, WatchOptions(INTERVAL, poll_s=0), clock=Clock())
    watcher.run(max_cycles=1)
    (tmp_path / "bad" / "p.md").write_text("# P\n\nA poison page.\n")
    (tmp_path / "good" / "b.md").write_text("# B\n\nStill watched.\n")
    with caplog.at_level("ERROR", logger="voxrecall.index.watch"):
        good, bad = watcher.run(max_cycles=1)
    assert (bad.knowledge_base, bad.summary, bad.error) == (
        "bad",
        None,
        "RuntimeError: cannot embed 'poison'",
    )
    # the ERROR lines alone: a test before may have left other loggers' INFO reaching caplog
    errors = [r for r in caplog.records if r.levelno >= logging.ERROR]
    assert [r.getMessage() for r in errors] == ["bad: build failed (files)"]
    assert errors[0].exc_info is not None
    assert good.summary is not None
    assert (good.knowledge_base, good.summary.published) == ("good", True)
    (tmp_path / "good" / "c.md").write_text("# C\n\nWatched still.\n")
    assert [e.knowledge_base for e in watcher.run(max_cycles=1)] == ["good"]


def test_stop_during_a_build_publishes_nothing(tmp_path: Path, local_embedder: Embedder) -> None:
    docs = tmp_path / "docs"
    docs.mkdir()
    for n in range(3):
        (docs / f"p{n}.md").write_text(f"# Page {n}\n\nText {n}.\n")
    config = config_for(tmp_path, [{"type": "markdown", "path": "docs"}])
    stop = threading.Event()
    # batch_size * max_concurrency = 64 > 3 chunks: one slice, then the stop check
    watcher = Watcher(config, StopWhileEmbedding(local_embedder, stop), WatchOptions(), stop=stop)
    assert watcher.run(max_cycles=5) == []
    assert LocalStore(config.index.store).latest("kb") is None

    stop.clear()
    watcher = Watcher(config, local_embedder, WatchOptions(), stop=stop)
    stop.set()
    assert watcher.run() == []  # stopped before the first cycle: returns at once


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
def test_watch_process_stops_cleanly_on_signal(tmp_path: Path, signum: int) -> None:
    docs = tmp_path / "docs"
    docs.mkdir()
    (docs / "a.md").write_text("# A\n\nAlpha.\n")
    config = tmp_path / "voxrecall.toml"
    config.write_text(
        '[[knowledge_base]]\nname = "kb"\n[[knowledge_base.source]]\ntype = "markdown"\n'
        'path = "docs"\n[index]\nstore = "store"\n'
    )
    env = {k: v for k, v in os.environ.items() if not k.endswith("_API_KEY")}
    proc = subprocess.Popen(
        [sys.executable, "-m", "sidecar.cli", "index", "watch", "--config", str(config),
         "--interval", "3600", "--poll", "0.2"],
        cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        latest = tmp_path / "store" / "kb" / "LATEST"
        deadline = time.monotonic() + 120  # model load + first build on 2 busy cores
        while not latest.exists() and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.1)
        assert latest.exists(), proc.stderr.read() if proc.poll() is not None else "no build"
        proc.send_signal(signum)
        _, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode == 0, err
    assert f"{signal.Signals(signum).name} received: stopping" in err
    assert "watch stopped after 1 build(s)" in err
