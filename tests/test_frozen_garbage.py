"""The heap frozen at each swap (``freeze_heap``) keeps a bounded amount of garbage: a reference
cycle alive at a swap (a session's state) and garbage later is collected once the frozen heap
has grown past its bound, and the frozen heap stops growing however many swaps a process serves.

A session's state is stood for by a cycle of our own (an object holding itself and ``STATE``
lists), so a weak reference tells when it is freed without collecting anything."""

from __future__ import annotations

import gc
import weakref
from collections.abc import Iterator
from pathlib import Path

import pytest

from index.embedders.base import Embedder
from sidecar.snapshots import refresh
from tests.test_refresh import KB, Store, publish, running, sidecar_config

STATE = 2_000  # tracked objects in a session's cycle
SLACK = 10 * STATE


class Session:
    """A session's state: a reference cycle of ``STATE`` + 1 tracked objects."""

    def __init__(self) -> None:
        self.me = self
        self.state = [[i] for i in range(STATE)]


@pytest.fixture
def thawed() -> Iterator[None]:
    """Each test starts and ends with nothing frozen and no bound counted."""
    refresh.thaw_heap()
    yield
    refresh.thaw_heap()


async def test_a_session_alive_at_a_swap_is_collected_after_enough_swaps(
    tmp_path: Path, local_embedder: Embedder, monkeypatch: pytest.MonkeyPatch, thawed: None
) -> None:
    """A real sidecar swaps versions while a session lives, then swaps on as sessions come and
    go: the first session's cycle, frozen with the heap at its swap, is freed (it never was)."""
    monkeypatch.setattr(refresh, "FREEZE_GROWTH", 0.0, raising=False)
    monkeypatch.setattr(refresh, "FREEZE_SLACK", 3 * STATE, raising=False)
    root = tmp_path / "published"
    await publish(root, 1, local_embedder, "password")
    config = sidecar_config(Store(root, str(root)), tmp_path)
    async with running(config, local_embedder, poll=False) as sc:
        session = Session()
        first = weakref.ref(session)
        for n in range(2, 8):
            await publish(root, n, local_embedder, "roaming" if n % 2 else "password")
            assert await sc.refresher.refresh() == [KB]
            assert gc.get_freeze_count() > 0
            session = Session()  # the one before ends: garbage, in a cycle, frozen at this swap
        del session
        assert first() is None


def test_the_frozen_heap_stays_bounded_across_many_swaps(
    monkeypatch: pytest.MonkeyPatch, thawed: None
) -> None:
    """100 swaps, each freezing a live session that ends after it (200k objects of garbage in
    all), keep the frozen heap within its bound of its size at the first (here ``SLACK``
    allocator blocks: fewer objects than that): a full collection runs whenever it is passed."""
    monkeypatch.setattr(refresh, "FREEZE_GROWTH", 0.0, raising=False)
    monkeypatch.setattr(refresh, "FREEZE_SLACK", SLACK, raising=False)
    live: Session | None = None
    refresh.freeze_heap()
    start = largest = gc.get_freeze_count()
    for _ in range(100):
        live = Session()
        refresh.freeze_heap()
        largest = max(largest, gc.get_freeze_count())
    del live
    assert largest - start <= SLACK + 2 * (STATE + 1)  # the bound, the one alive, the one after
