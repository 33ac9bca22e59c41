"""Shared fixtures: the real embedded model, real snapshots, a real grpc.aio server on port 0."""

from __future__ import annotations

import asyncio
import contextlib
import faulthandler
import os
import subprocess
import threading
import time
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from bench.shared_data import SHARED_DATA
from index.build import build_knowledge_base
from index.embedders.base import Embedder
from sidecar.config import Config, parse_config

REPO = Path(__file__).resolve().parents[1]
WT_DOCS = SHARED_DATA / "docs-windows-terminal" / "docs"
# The example help centre the README runs (four pages, in the repository): for tests that need
# some real Markdown, on any machine.
EXAMPLE_KB = REPO / "examples" / "kb"
# The default budget of the shared sidecars below: one no loaded machine misses, so that a test
# judging what is found never gets the lexical fallback because the machine was slow. A test of
# the budget itself gives its own budget_ms per call.
AMPLE_BUDGET_MS = 10_000


# A bound on one test, its set-up and tear-down: a regression that waits for ever where it should
# fail (a gRPC call with no deadline, a future never set, a process that should have stopped)
# ends the run, naming the test, with every thread's stack, instead of holding CI until its own
# limit. Far past the slowest test (a shared-data build on two busy cores; a build subprocess
# bounds itself at 300 s). No pytest-timeout (no new dependency): its "thread" method is this.
TEST_BOUND_S = 900.0
# faulthandler's own timer, a minute later, for a hang that holds the GIL (a C extension's loop):
# the watching thread below cannot run then; this one says no test name.
_GIL_HELD_S = 60.0
_STDERR: list[int] = []  # the terminal's stderr, kept before the tests capture it


def pytest_configure(config: pytest.Config) -> None:
    _STDERR.append(os.dup(2))


def _bound(nodeid: str, done: threading.Event) -> None:
    """Unless ``done`` within TEST_BOUND_S: name the test, dump every stack, end the run."""
    if done.wait(TEST_BOUND_S):
        return
    said = f"\n{nodeid} ran past TEST_BOUND_S ({TEST_BOUND_S:.0f} s): every thread's stack:\n"
    os.write(_STDERR[0], said.encode())
    faulthandler.dump_traceback(file=_STDERR[0])
    os._exit(1)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_protocol(item: pytest.Item) -> Iterator[None]:
    done = threading.Event()
    threading.Thread(
        target=_bound, args=(item.nodeid, done), name="test-bound", daemon=True
    ).start()
    faulthandler.dump_traceback_later(TEST_BOUND_S + _GIL_HELD_S, exit=True, file=_STDERR[0])
    try:
        return (yield)
    finally:
        faulthandler.cancel_dump_traceback_later()
        done.set()


def shared(*parts: str) -> Path:
    """A path under ../shared/data; the test is skipped where that data is absent."""
    path = SHARED_DATA.joinpath(*parts)
    if not path.exists():
        pytest.skip(f"shared data not present: {path}")
    return path


@pytest.fixture(autouse=True)
def clean_environ(monkeypatch: pytest.MonkeyPatch) -> None:
    """Tests never see the developer's API keys or proxies (httpx's habit)."""
    for key in list(os.environ):
        if key.endswith("_API_KEY") or key.lower().endswith("_proxy"):
            monkeypatch.delenv(key, raising=False)


@pytest.fixture(scope="session")
def moto_process() -> Iterator[Any]:
    """One real S3-compatible server (moto) for the session, in its own process."""
    pytest.importorskip("moto", reason="the S3 store's tests need the dev extra (moto[server])")
    from tests.s3_kit import MotoServer

    server = MotoServer().start()
    yield server
    server.stop()


@pytest.fixture
def moto_server(moto_process: Any, monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Any:
    """The moto server, with AWS credentials for it in the environment and nothing of the
    developer's AWS configuration (no profile files, no instance metadata)."""
    from tests.s3_kit import CREDENTIALS

    for key in list(os.environ):
        if key.startswith("AWS_"):
            monkeypatch.delenv(key)
    for key, value in CREDENTIALS.items():
        monkeypatch.setenv(key, value)
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "no-aws-config"))
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "no-aws-credentials"))
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
    return moto_process


@pytest.fixture(scope="session")
def local_embedder() -> Embedder:
    from index.embedders.local import LocalEmbedder

    return LocalEmbedder()


def make_config(
    store: Path, sources: list[dict[str, Any]], kb: str = "docs", **sidecar: Any
) -> Config:
    raw = {
        "knowledge_base": [{"name": kb, "source": sources}],
        "index": {"store": str(store)},
        "sidecar": {"store": str(store), "listen": "127.0.0.1:0", **sidecar},
    }
    return parse_config(raw, base=store.parent)


@pytest.fixture(scope="session")
def wt_config(tmp_path_factory: pytest.TempPathFactory, local_embedder: Embedder) -> Config:
    """A store holding a snapshot of the Windows Terminal docs, built once per test session."""
    docs = shared("docs-windows-terminal", "docs")
    store = tmp_path_factory.mktemp("wt") / "store"
    config = make_config(
        store,
        [{"name": "terminal-docs", "type": "markdown", "path": str(docs)}],
        budget_ms=AMPLE_BUDGET_MS,
    )
    build_knowledge_base(config, config.knowledge_bases[0], local_embedder)
    return config


@pytest.fixture(scope="session")
def example_config(tmp_path_factory: pytest.TempPathFactory, local_embedder: Embedder) -> Config:
    """A store holding a snapshot of the example help centre, built once per test session."""
    store = tmp_path_factory.mktemp("example") / "store"
    config = make_config(
        store,
        [{"name": "help-center", "type": "markdown", "path": str(EXAMPLE_KB)}],
        budget_ms=AMPLE_BUDGET_MS,
    )
    build_knowledge_base(config, config.knowledge_bases[0], local_embedder)
    return config


@pytest.fixture
async def example_sidecar(example_config: Config, local_embedder: Embedder) -> AsyncIterator[Any]:
    from sidecar.edge.server import create_server

    sidecar = await create_server(example_config, embedder=local_embedder, poll=False)
    yield sidecar
    await sidecar.stop(0.5)


@pytest.fixture
async def wt_sidecar(wt_config: Config, local_embedder: Embedder) -> AsyncIterator[Any]:
    from sidecar.edge.server import create_server

    sidecar = await create_server(wt_config, embedder=local_embedder, poll=False)
    yield sidecar
    await sidecar.stop(0.5)


LIVENESS_S = 10.0  # how long a test waits for background work before it fails: not a timing check


async def eventually(condition: Callable[[], bool], what: str = "background work") -> None:
    """Wait (a bounded while) until ``condition()`` holds; fails rather than hangs."""
    deadline = time.monotonic() + LIVENESS_S
    while not condition():
        assert time.monotonic() < deadline, f"{what} did not finish"
        await asyncio.sleep(0.01)


def eventually_here(
    condition: Callable[[], bool], what: str = "background work", within_s: float = LIVENESS_S
) -> None:
    """``eventually`` for a test with no event loop: this thread sleeps between looks."""
    deadline = time.monotonic() + within_s
    while not condition():
        assert time.monotonic() < deadline, f"{what} did not finish"
        time.sleep(0.01)


@contextlib.contextmanager
def small_tmpfs(tmp_path: Path, size: str) -> Iterator[Path]:
    """A tmpfs of ``size`` (mount's words: "256k", "1m"), where this machine lets the test
    mount one (root); else the test is skipped."""
    mount = tmp_path / "small-disk"
    mount.mkdir()
    done = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(mount)],
        capture_output=True,
        check=False,
    )
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {done.stderr.decode().strip()}")
    try:
        yield mount
    finally:
        subprocess.run(["umount", str(mount)], check=True)
