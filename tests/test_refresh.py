"""The snapshot lifecycle end to end: a real grpc.aio sidecar polling a real store.

Each fault test checks the same three things: nothing is served wrong (every chunk comes from the
version the answer names), the last good snapshot keeps serving, and Status shows the refusal.
Stores are a local folder and the same folder behind a real HTTP server on 127.0.0.1; snapshots
are small, embedded with the real local model.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
import shutil
from collections import Counter
from collections.abc import AsyncIterator, Awaitable, Callable, Collection, Iterator, Sequence
from dataclasses import dataclass, replace
from functools import partial
from pathlib import Path
from typing import Any

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

import index.http_store
import index.snapshot
from index.embedders.base import Embedder, EmbedderInfo, HashEmbedder, Vectors
from index.embedders.local import NAME as LOCAL_NAME
from index.http_store import PARTIAL, HttpOptions
from index.snapshot import DATA_FILES, MANIFEST, VECTORS, LoadedSnapshot, sha256_file
from index.store import LocalStore, SnapshotStore
from sidecar.config import Config, parse_config
from sidecar.edge.server import Sidecar, create_server
from sidecar.gen import retrieval_pb2 as pb
from sidecar.gen import retrieval_pb2_grpc as pb_grpc
from tests.conftest import small_tmpfs
from tests.snapshot_kit import (
    KB,
    LEVEL0_LINK_PAST_THE_END,
    TAMPERED,
    DiskFullStore,
    flip_a_byte,
    point_at,
    version_id,
    write_version,
)
from tests.static_http import StaticServer

POLL_S = 0.1
WAIT_S = 60.0  # a liveness bound, not a timing claim: each wait normally ends within a second
# A turn held in flight (GatedEmbedder) across a refresh: its words are in the "password" topic
# (so even a lexical answer has chunks), and its budget is the largest allowed.
HELD_TURN = pb.TurnRequest(
    session_id="s", text="How long is a reset link valid?", is_final=True, budget_ms=10_000
)
SERVICE = "voxrecall.v1.Retrieval"
FAST = HttpOptions(timeout_s=5.0, attempts=3, backoff_s=0.01, max_backoff_s=0.02)


@dataclass
class Store:
    root: Path  # where the publisher writes
    location: str  # what [sidecar] store says
    server: StaticServer | None = None


@pytest.fixture(params=["local", "http"])
def store(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Store]:
    root = tmp_path / "published"
    root.mkdir()
    if request.param == "local":
        yield Store(root, str(root))
        return
    server = StaticServer(root).start()
    try:
        yield Store(root, server.url, server)
    finally:
        server.stop()


@pytest.fixture
def http_store(tmp_path: Path) -> Iterator[Store]:
    root = tmp_path / "published"
    root.mkdir()
    server = StaticServer(root).start()
    try:
        yield Store(root, server.url, server)
    finally:
        server.stop()


def sidecar_config(store: Store, tmp_path: Path, **sidecar: Any) -> Config:
    raw = {
        "knowledge_base": [
            {"name": KB, "source": [{"name": "faq", "type": "markdown", "path": str(tmp_path)}]}
        ],
        "index": {"store": str(store.root)},
        "sidecar": {
            "store": store.location,
            "listen": "127.0.0.1:0",
            "cache_dir": str(tmp_path / "cache"),
            "poll_seconds": POLL_S,
            "min_score": -1.0,  # always return the top chunks, so every answer can be checked
            "budget_ms": 5_000,  # a busy test machine must not turn a dense search lexical
            **sidecar,
        },
    }
    return parse_config(raw, base=tmp_path)


@contextlib.asynccontextmanager
async def running(
    config: Config,
    embedder: Embedder,
    *,
    poll: bool = True,
    store: SnapshotStore | None = None,
) -> AsyncIterator[Sidecar]:
    sidecar = await create_server(config, embedder=embedder, poll=poll, store=store)
    try:
        yield sidecar
    finally:
        await sidecar.stop(0.5)


async def publish(root: Path, n: int, embedder: Embedder, topic: str, **kw: Any) -> str:
    await asyncio.to_thread(write_version, root, version_id(n), embedder, topic, **kw)
    return version_id(n)


async def kb_status(port: int) -> pb.KnowledgeBaseStatus:
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
        client = pb_grpc.RetrievalStub(channel)  # type: ignore[no-untyped-call]
        resp = await client.Status(pb.StatusRequest(), timeout=10)
    (kb,) = resp.knowledge_bases
    status: pb.KnowledgeBaseStatus = kb
    return status


async def health(port: int) -> int:
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
        resp = await health_pb2_grpc.HealthStub(channel).Check(
            health_pb2.HealthCheckRequest(service=SERVICE), timeout=10
        )
    return int(resp.status)


async def search(port: int, query: str = "How do I reset my password?") -> pb.SearchResponse:
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
        client = pb_grpc.RetrievalStub(channel)  # type: ignore[no-untyped-call]
        resp: pb.SearchResponse = await client.Search(
            pb.SearchRequest(query=query, limit=3), timeout=10
        )
    return resp


def from_its_snapshot(resp: pb.SearchResponse | pb.TurnResponse) -> bool:
    """Every chunk comes from the snapshot the answer names (chunk ids start with the version)."""
    return all(c.chunk_id.startswith(f"{resp.snapshot_version}-") for c in resp.chunks)


def served_right(resp: pb.SearchResponse | pb.TurnResponse, version: str | None = None) -> bool:
    """Chunks came back, all from the snapshot the answer names, which is ``version`` if given."""
    if version is not None and resp.snapshot_version != version:
        return False
    return bool(resp.chunks) and from_its_snapshot(resp)


async def eventually(check: Callable[[], Awaitable[bool]], what: str) -> None:
    deadline = asyncio.get_running_loop().time() + WAIT_S
    while not await check():
        if asyncio.get_running_loop().time() > deadline:
            pytest.fail(f"never happened: {what}")
        await asyncio.sleep(0.05)


async def serving(port: int, version: str) -> bool:
    return (await kb_status(port)).snapshot_version == version


async def refused(port: int, version: str, kind: str) -> bool:
    return (await kb_status(port)).last_refusal.startswith(f"{version or 'store'}: {kind}: ")


async def assert_still_serving(sidecar: Sidecar, version: str) -> None:
    assert (await kb_status(sidecar.port)).snapshot_version == version
    assert served_right(await search(sidecar.port), version)
    assert await health(sidecar.port) == health_pb2.HealthCheckResponse.SERVING


# -- the normal life ---------------------------------------------------------------------------


async def test_an_empty_store_serves_not_serving_until_a_snapshot_arrives(
    store: Store, tmp_path: Path, local_embedder: Embedder
) -> None:
    async with running(sidecar_config(store, tmp_path), local_embedder) as sidecar:
        assert await health(sidecar.port) == health_pb2.HealthCheckResponse.NOT_SERVING
        assert (await kb_status(sidecar.port)).snapshot_version == ""
        v1 = await publish(store.root, 1, local_embedder, "password")
        await eventually(
            lambda: _is(health(sidecar.port), health_pb2.HealthCheckResponse.SERVING),
            "health SERVING after the first snapshot was published",
        )
        assert served_right(await search(sidecar.port), v1)
        status = await kb_status(sidecar.port)
        assert (status.snapshot_version, status.chunks, status.pages) == (v1, 3, 1)
        assert status.age_seconds > 0
        assert status.last_refusal == ""


async def test_new_versions_are_swapped_in_and_two_downloads_kept(
    store: Store, tmp_path: Path, local_embedder: Embedder
) -> None:
    await publish(store.root, 1, local_embedder, "password")
    async with running(sidecar_config(store, tmp_path), local_embedder) as sidecar:
        assert await serving(sidecar.port, version_id(1))
        for n, topic in ((2, "roaming"), (3, "voicemail")):
            version = await publish(store.root, n, local_embedder, topic)
            await eventually(partial(serving, sidecar.port, version), f"{version} served")
            resp = await search(sidecar.port, f"Tell me about {topic}")
            assert served_right(resp, version)
            assert resp.chunks[0].title == topic.title()
        assert sidecar.holder.refusals.total() == 0
        cache = tmp_path / "cache" / KB
        if store.server is not None:  # the current and the previous download are kept

            async def pruned() -> bool:
                return sorted(p.name for p in cache.iterdir()) == [version_id(2), version_id(3)]

            await eventually(pruned, "the cache pruned to the current and previous version")
        else:
            assert not cache.exists()
    assert sorted(p.name for p in (store.root / KB).iterdir() if p.is_dir()) == [
        version_id(n) for n in (1, 2, 3)
    ]


async def test_a_call_in_flight_finishes_on_the_snapshot_it_started_with(
    tmp_path: Path, local_embedder: Embedder
) -> None:
    root = tmp_path / "published"
    v1 = await publish(root, 1, local_embedder, "password")
    gated = GatedEmbedder(local_embedder)
    config = sidecar_config(Store(root, str(root)), tmp_path)
    async with (
        running(config, gated, poll=False) as sidecar,
        grpc.aio.insecure_channel(f"127.0.0.1:{sidecar.port}") as channel,
    ):
        client = pb_grpc.RetrievalStub(channel)  # type: ignore[no-untyped-call]
        v2 = await publish(root, 2, local_embedder, "roaming")  # not polled: served on refresh()
        gated.gate.clear()
        in_flight = asyncio.ensure_future(client.Turn(HELD_TURN, timeout=WAIT_S))
        await asyncio.wait_for(gated.entered.wait(), WAIT_S)  # the call holds its snapshot now
        assert await sidecar.refresher.refresh() == [KB]
        assert await serving(sidecar.port, v2)
        gated.gate.set()
        # answered from v1 (densely, or lexically where a loaded machine held the gate past the
        # budget: either way from the snapshot the call started with)
        assert served_right(await in_flight, v1)
        assert served_right(await search(sidecar.port), v2)


async def test_calls_during_swaps_never_fail_nor_mix_snapshots(
    tmp_path: Path, local_embedder: Embedder
) -> None:
    root = tmp_path / "published"
    published = [await publish(root, 1, local_embedder, "password")]
    config = sidecar_config(Store(root, str(root)), tmp_path)
    async with (
        running(config, local_embedder) as sidecar,
        grpc.aio.insecure_channel(f"127.0.0.1:{sidecar.port}") as channel,
    ):
        client = pb_grpc.RetrievalStub(channel)  # type: ignore[no-untyped-call]
        watch = asyncio.ensure_future(_watch_health(channel))
        stop = asyncio.Event()
        answers: list[list[pb.SearchResponse | pb.TurnResponse]] = [[] for _ in range(8)]
        failures: list[BaseException] = []

        async def caller(i: int) -> None:
            while not stop.is_set():
                try:
                    if i % 2:
                        resp: Any = await client.Search(
                            pb.SearchRequest(query=f"question {i} about plans"), timeout=10
                        )
                    else:
                        resp = await client.Turn(
                            pb.TurnRequest(
                                session_id=f"c{i}",
                                text=f"What about plan {i}?",
                                is_final=True,
                                budget_ms=5_000,
                            ),
                            timeout=10,
                        )
                    answers[i].append(resp)
                except grpc.aio.AioRpcError as exc:
                    failures.append(exc)

        callers = [asyncio.ensure_future(caller(i)) for i in range(8)]
        topics = ["roaming", "voicemail", "invoices", "password", "roaming"]
        for n, topic in enumerate(topics, start=2):
            published.append(await publish(root, n, local_embedder, topic))
            await eventually(partial(serving, sidecar.port, published[-1]), "swapped")
        stop.set()
        await asyncio.gather(*callers)
        watch.cancel()
        statuses = await asyncio.gather(watch, return_exceptions=True)
    assert failures == []
    for mine in answers:
        assert mine
        assert all(from_its_snapshot(a) for a in mine)
        versions = [a.snapshot_version for a in mine]
        assert versions == sorted(versions), "a caller saw an older snapshot after a newer one"
        assert set(versions) <= set(published)
    seen = {a.snapshot_version for mine in answers for a in mine}
    assert len(seen) >= 3
    # an answer may come back empty when the embedder misses the budget on a busy machine
    assert sum(bool(a.chunks) for mine in answers for a in mine) > 0
    (watched,) = statuses
    assert isinstance(watched, list)
    assert watched
    assert set(watched) == {health_pb2.HealthCheckResponse.SERVING}


async def test_one_refresh_runs_at_a_time(
    http_store: Store, tmp_path: Path, local_embedder: Embedder
) -> None:
    await publish(http_store.root, 1, local_embedder, "password")
    config = sidecar_config(http_store, tmp_path)
    async with running(config, local_embedder, poll=False) as sidecar:
        v2 = await publish(http_store.root, 2, local_embedder, "roaming")
        results = await asyncio.gather(sidecar.refresher.refresh(), sidecar.refresher.refresh())
        assert sorted(results) == [[], [KB]]
        assert await serving(sidecar.port, v2)
    assert http_store.server is not None
    assert len(http_store.server.requests(f"/{v2}/{MANIFEST}")) == 1


# -- faults --------------------------------------------------------------------------------


async def test_a_corrupted_file_is_refused_and_the_last_good_keeps_serving(
    store: Store, tmp_path: Path, local_embedder: Embedder, caplog: pytest.LogCaptureFixture
) -> None:
    v1 = await publish(store.root, 1, local_embedder, "password")
    async with running(sidecar_config(store, tmp_path), local_embedder) as sidecar:
        v2 = await publish(store.root, 2, local_embedder, "roaming", damage=flip_a_byte)
        with caplog.at_level(logging.ERROR, logger="voxrecall.refresh"):
            await eventually(lambda: refused(sidecar.port, v2, "corrupt"), "v2 refused")
        (line,) = [r.getMessage() for r in caplog.records if v2 in r.getMessage()]
        assert "corrupt" in line
        assert f"still serving {v1}" in line
        assert "sha256" in (await kb_status(sidecar.port)).last_refusal
        await assert_still_serving(sidecar, v1)
        await sidecar.refresher.refresh()
        assert sidecar.holder.refusals == {"corrupt": 1}  # refused once, not retried
        v3 = await publish(store.root, 3, local_embedder, "voicemail")
        await eventually(lambda: serving(sidecar.port, v3), "the next good version served")
        assert served_right(await search(sidecar.port), v3)


@pytest.mark.parametrize("attack", sorted(TAMPERED))
async def test_a_tampered_version_whose_checksums_match_is_refused_once_and_counted(
    attack: str,
    store: Store,
    tmp_path: Path,
    local_embedder: Embedder,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Issue 14 (1-3): a file that crashed hnswlib, or whose content broke every call (ReadPage,
    Turn) or escaped as a TypeError/BadZipFile/struct.error, is a counted refusal, logged once."""
    v1 = await publish(store.root, 1, local_embedder, "password")
    async with running(sidecar_config(store, tmp_path), local_embedder) as sidecar:
        with caplog.at_level(logging.INFO, logger="voxrecall.refresh"):
            v2 = await publish(store.root, 2, local_embedder, "roaming", damage=TAMPERED[attack])
            await eventually(lambda: refused(sidecar.port, v2, "corrupt"), "v2 refused")
            for _ in range(3):
                await sidecar.refresher.refresh()  # polls after the refusal: not tried again
        assert sidecar.holder.refusals == {"corrupt": 1}
        lines = [r for r in caplog.records if v2 in r.getMessage()]
        assert [r.levelno for r in lines] == [logging.ERROR]
        assert lines[0].exc_info is None  # a named refusal, not a traceback
        await assert_still_serving(sidecar, v1)


@pytest.mark.parametrize("attack", ["hnsw_entry_point_past_the_end", "chunk_span_past_the_table"])
async def test_a_tampered_latest_at_start_leaves_the_sidecar_up_and_not_serving(
    attack: str, store: Store, tmp_path: Path, local_embedder: Embedder
) -> None:
    """It exited 1 (or 139) and crash-looped; now it starts, says why, and serves the next good
    version when one is published."""
    v1 = await publish(store.root, 1, local_embedder, "password", damage=TAMPERED[attack])
    async with running(sidecar_config(store, tmp_path), local_embedder) as sidecar:
        assert await health(sidecar.port) == health_pb2.HealthCheckResponse.NOT_SERVING
        assert await refused(sidecar.port, v1, "corrupt")
        assert sidecar.holder.refusals == {"corrupt": 1}
        v2 = await publish(store.root, 2, local_embedder, "roaming")
        await eventually(
            lambda: _is(health(sidecar.port), health_pb2.HealthCheckResponse.SERVING),
            "health SERVING once the next good version is served",
        )
        assert served_right(await search(sidecar.port), v2)


async def test_a_half_uploaded_version_is_served_only_once_complete(
    store: Store, tmp_path: Path, local_embedder: Embedder
) -> None:
    v1 = await publish(store.root, 1, local_embedder, "password")
    async with running(sidecar_config(store, tmp_path), local_embedder) as sidecar:
        # files uploaded, pointer not yet written: nothing happens
        await publish(store.root, 2, local_embedder, "roaming", point=False)
        await sidecar.refresher.refresh()
        assert (await kb_status(sidecar.port)).last_refusal == ""
        await assert_still_serving(sidecar, v1)
        # the pointer written before the files: a version that is not there at all ...
        v3 = version_id(3)
        point_at(store.root, v3)
        await sidecar.refresher.refresh()
        assert await refused(sidecar.port, v3, "incomplete")
        await assert_still_serving(sidecar, v1)
        # ... then there but for one file ...
        held = tmp_path / "held-back.hnsw"
        await publish(
            store.root,
            3,
            local_embedder,
            "voicemail",
            damage=lambda folder: shutil.move(folder / VECTORS, held),
        )
        await sidecar.refresher.refresh()
        assert await refused(sidecar.port, v3, "incomplete")
        assert VECTORS in (await kb_status(sidecar.port)).last_refusal
        await assert_still_serving(sidecar, v1)
        assert sidecar.holder.refusals == {"incomplete": 1}  # one refusal, however many polls
        # ... then complete: served on a later poll
        shutil.move(held, store.root / KB / v3 / VECTORS)
        await eventually(lambda: serving(sidecar.port, v3), "v3 served once complete")
        assert served_right(await search(sidecar.port), v3)


@pytest.mark.parametrize(
    ("name", "dimension"),
    [("test/hash", 384), (LOCAL_NAME, 64)],
    ids=["another-embedder", "another-dimension"],
)
async def test_a_snapshot_of_another_embedder_is_refused(
    store: Store, tmp_path: Path, local_embedder: Embedder, name: str, dimension: int
) -> None:
    v1 = await publish(store.root, 1, local_embedder, "password")
    async with running(sidecar_config(store, tmp_path), local_embedder) as sidecar:
        other = HashEmbedder(dimension=dimension, name=name)
        v2 = await publish(store.root, 2, other, "roaming")
        await eventually(lambda: refused(sidecar.port, v2, "incompatible"), "v2 refused")
        refusal = (await kb_status(sidecar.port)).last_refusal
        assert f"{name} ({dimension}-d)" in refusal
        assert f"{LOCAL_NAME} (384-d)" in refusal
        await assert_still_serving(sidecar, v1)
        assert sidecar.holder.refusals == {"incompatible": 1}


async def test_refused_downloads_leave_the_cache_the_served_versions_and_one_partial(
    http_store: Store, tmp_path: Path, local_embedder: Embedder
) -> None:
    """Attack F7: a store offering a new version every poll that the sidecar refuses (another
    embedder's) leaves no copy of any of them in the cache, only the served one; and of partial
    downloads only the newest, newer than every served version, stays to be resumed."""
    v1 = await publish(http_store.root, 1, local_embedder, "password")
    other = HashEmbedder(dimension=384, name="test/hash")
    async with running(sidecar_config(http_store, tmp_path), local_embedder) as sidecar:
        for n in (2, 3, 4):
            version = await publish(http_store.root, n, other, "roaming")
            await eventually(partial(refused, sidecar.port, version, "incompatible"), "refused")
        await assert_still_serving(sidecar, v1)
        cache = tmp_path / "cache" / KB

        async def pruned() -> bool:
            return sorted(p.name for p in cache.iterdir()) == [v1]

        await eventually(pruned, "the refused downloads deleted")  # just after each refusal
        store = sidecar.refresher.store
        for n in (5, 6):
            (cache / f"{PARTIAL}{version_id(n)}").mkdir()
        await asyncio.to_thread(store.retain, KB, [v1])
        assert sorted(p.name for p in cache.iterdir()) == sorted([v1, f"{PARTIAL}{version_id(6)}"])


async def test_a_pointer_going_backwards_is_refused(
    store: Store, tmp_path: Path, local_embedder: Embedder
) -> None:
    await publish(store.root, 1, local_embedder, "password")
    v2 = await publish(store.root, 2, local_embedder, "roaming")
    async with running(sidecar_config(store, tmp_path), local_embedder) as sidecar:
        assert await serving(sidecar.port, v2)
        point_at(store.root, version_id(1))
        await sidecar.refresher.refresh()
        await sidecar.refresher.refresh()
        assert await refused(sidecar.port, version_id(1), "backwards")
        await assert_still_serving(sidecar, v2)
        assert sidecar.holder.refusals == {"backwards": 1}


async def test_a_pointer_flipping_among_refused_versions_fetches_each_once(
    store: Store, tmp_path: Path, local_embedder: Embedder
) -> None:
    """Attack s23: a pointer moving between a bad version and an older one (a stale CDN edge)
    had the bad one fetched and refused at every other poll, an ERROR line each time: only the
    last version refused was remembered. Each is refused once now."""
    v1 = await publish(store.root, 1, local_embedder, "password")
    v2 = await publish(store.root, 2, local_embedder, "roaming")
    async with running(sidecar_config(store, tmp_path), local_embedder) as sidecar:
        assert await serving(sidecar.port, v2)
        v3 = await publish(store.root, 3, HashEmbedder(dimension=384, name="test/hash"), "roaming")
        for pointed in (v3, v1) * 3:
            point_at(store.root, pointed)
            await sidecar.refresher.refresh()
        await assert_still_serving(sidecar, v2)
        assert sidecar.holder.refusals == {"incompatible": 1, "backwards": 1}


@pytest.mark.parametrize("fault", ["answers-500", "port-closed"])
async def test_an_unavailable_store_keeps_the_last_good_until_it_recovers(
    http_store: Store, tmp_path: Path, local_embedder: Embedder, fault: str
) -> None:
    server = http_store.server
    assert server is not None
    v1 = await publish(http_store.root, 1, local_embedder, "password")
    async with running(sidecar_config(http_store, tmp_path), local_embedder) as sidecar:
        if fault == "answers-500":
            server.fail_next = 10**9
        else:
            server.stop()
        v2 = await publish(http_store.root, 2, local_embedder, "roaming")
        await sidecar.refresher.refresh()
        assert await refused(sidecar.port, "", "unavailable")
        await assert_still_serving(sidecar, v1)
        if fault == "answers-500":
            server.fail_next = 0
        else:
            server.start()  # the same port again
        await eventually(lambda: serving(sidecar.port, v2), "v2 served after recovery")
        assert served_right(await search(sidecar.port), v2)


async def test_a_base_whose_pointer_the_store_fails_for_ever_holds_no_other_base_loading(
    http_store: Store, tmp_path: Path, local_embedder: Embedder
) -> None:
    """A base whose LATEST the store answered 500 for at every read held the sidecar LOADING
    (health NOT_SERVING) for ever, its other bases loaded and unreachable behind it."""
    server = http_store.server
    assert server is not None
    v1 = await publish(http_store.root, 1, local_embedder, "password")
    server.fail_suffix = "/broken/LATEST"
    config = sidecar_config(http_store, tmp_path)
    broken = replace(config.knowledge_bases[0], name="broken")
    config = replace(config, knowledge_bases=(*config.knowledge_bases, broken))
    store = index.http_store.HttpStore(http_store.location, tmp_path / "cache", FAST)
    async with running(config, local_embedder, store=store) as sidecar:
        await eventually(
            lambda: _is(health(sidecar.port), health_pb2.HealthCheckResponse.SERVING),
            "SERVING with 'broken' failing",
        )
        async with grpc.aio.insecure_channel(f"127.0.0.1:{sidecar.port}") as channel:
            client = pb_grpc.RetrievalStub(channel)  # type: ignore[no-untyped-call]
            found = await client.Search(pb.SearchRequest(knowledge_base=KB, query="password"))
            assert served_right(found, v1)
            with pytest.raises(grpc.aio.AioRpcError) as failed:
                await client.Search(pb.SearchRequest(knowledge_base="broken", query="password"))
        assert failed.value.code() is grpc.StatusCode.UNAVAILABLE
        said = str(failed.value.details())
        assert "'broken'" in said, said
        assert "pointer (LATEST) could not be read" in said, said
        assert "HTTP 500" in said, said
        pushback = dict(failed.value.trailing_metadata() or ())["grpc-retry-pushback-ms"]
        assert pushback == str(round(POLL_S * 1000))


async def test_a_download_cut_off_midway_is_resumed(
    http_store: Store, tmp_path: Path, local_embedder: Embedder
) -> None:
    server = http_store.server
    assert server is not None
    await publish(http_store.root, 1, local_embedder, "password")
    async with running(sidecar_config(http_store, tmp_path), local_embedder) as sidecar:
        server.cut_suffix, server.cut_next = f"/{VECTORS}", 1
        v2 = await publish(http_store.root, 2, local_embedder, "roaming")
        await eventually(lambda: serving(sidecar.port, v2), "v2 served")
        assert served_right(await search(sidecar.port), v2)
        assert (await kb_status(sidecar.port)).last_refusal == ""
    assert [r.status for r in server.requests(f"/{v2}/{VECTORS}")] == [200, 206]


async def test_a_full_disk_while_downloading_keeps_the_last_good_snapshot(
    http_store: Store, tmp_path: Path, local_embedder: Embedder
) -> None:
    v1 = await publish(http_store.root, 1, local_embedder, "password")
    cache = tmp_path / "cache"
    disk = DiskFullStore(http_store.location, cache, FAST)
    config = sidecar_config(http_store, tmp_path)
    # refreshed by hand: a poll retrying the download would have a partial folder of its own
    # while the cache is listed
    async with running(config, local_embedder, store=disk, poll=False) as sidecar:
        disk.full = True
        v2 = await publish(http_store.root, 2, local_embedder, "roaming")
        assert await sidecar.refresher.refresh() == []
        assert await refused(sidecar.port, v2, "disk_full")
        await assert_still_serving(sidecar, v1)
        assert sorted(p.name for p in (cache / KB).iterdir()) == [v1]  # the partial is gone
        disk.full = False  # space freed: the next refresh downloads it again
        assert await sidecar.refresher.refresh() == [KB]
        assert await serving(sidecar.port, v2)


@pytest.fixture
def small_disk(tmp_path: Path) -> Iterator[Path]:
    """A 256 KiB tmpfs (root only; else skipped)."""
    with small_tmpfs(tmp_path, "256k") as mount:
        yield mount


async def test_a_real_full_disk_while_downloading_keeps_the_last_good_snapshot(
    http_store: Store, tmp_path: Path, local_embedder: Embedder, small_disk: Path
) -> None:
    v1 = await publish(http_store.root, 1, local_embedder, "password")
    config = sidecar_config(http_store, tmp_path, cache_dir=str(small_disk))
    async with running(config, local_embedder, poll=False) as sidecar:  # no retry mid-listing
        v2 = await publish(http_store.root, 2, local_embedder, "roaming", page_bytes=1 << 20)
        assert await sidecar.refresher.refresh() == []
        assert await refused(sidecar.port, v2, "disk_full")
        await assert_still_serving(sidecar, v1)
        left = sorted(p.name for p in (small_disk / KB).iterdir())
        assert left == [v1]
        assert not any(n.startswith(PARTIAL) for n in left)


# -- helpers -------------------------------------------------------------------------------


async def _is(value: Awaitable[int], expected: int) -> bool:
    return await value == expected


async def _watch_health(channel: grpc.aio.Channel) -> list[int]:
    seen: list[int] = []
    stream = health_pb2_grpc.HealthStub(channel).Watch(
        health_pb2.HealthCheckRequest(service=SERVICE)
    )
    try:
        async for resp in stream:
            seen.append(int(resp.status))
    except asyncio.CancelledError:
        stream.cancel()
    return seen


class GatedEmbedder:
    """The real embedder behind a gate the test opens, to hold a call in flight."""

    def __init__(self, inner: Embedder) -> None:
        self.inner = inner
        self.gate = asyncio.Event()
        self.gate.set()
        self.entered = asyncio.Event()

    @property
    def info(self) -> EmbedderInfo:
        return self.inner.info

    async def embed(self, texts: Sequence[str]) -> Vectors:
        self.entered.set()
        await self.gate.wait()
        return await self.inner.embed(texts)

    def embed_batch(self, texts: Sequence[str]) -> Vectors:
        return self.inner.embed_batch(texts)

    async def aclose(self) -> None:
        return None


# -- the benchmark, in smoke mode --------------------------------------------------------------


def test_swap_benchmark_runs_without_failed_calls(tmp_path: Path) -> None:
    """bench/swap.py end to end, tiny: a real sidecar process, calls in flight, two swaps."""
    from bench import swap

    result = swap.under_load(chunks=300, swaps=2, period_s=1.0, warmup_s=0.5, cache=tmp_path)
    assert result["swaps_observed"] == 2
    assert result["calls"] > 0
    assert result["failed"] == 0
    assert result["unknown_version_answers"] == 0
    cost = swap.swap_cost(300, cache=tmp_path)
    assert cost["chunks"] == 300
    assert cost["peak_rss_during_swap_mb"] >= cost["rss_serving_one_mb"] > 0


class UnreadableStore(LocalStore):
    """A local store whose version folders this user may not read (root cannot chmod itself out)."""

    unreadable = True

    def fetch(self, knowledge_base: str, version: str) -> Path:
        if self.unreadable:
            raise PermissionError(
                13, "Permission denied", str(self.version_dir(knowledge_base, version))
            )
        return super().fetch(knowledge_base, version)


@contextlib.asynccontextmanager
async def over_unreadable(
    root: Path, tmp_path: Path, embedder: Embedder, *, unreadable: bool
) -> AsyncIterator[tuple[Sidecar, UnreadableStore]]:
    """A sidecar over a store at ``root`` holding version 1, unreadable from the start or not."""
    await asyncio.to_thread(root.mkdir)
    await publish(root, 1, embedder, "password")
    store = UnreadableStore(root)
    store.unreadable = unreadable
    async with running(
        sidecar_config(Store(root, str(root)), tmp_path), embedder, store=store
    ) as sidecar:
        yield sidecar, store


async def test_an_unreadable_version_is_refused_not_a_crash(
    tmp_path: Path, local_embedder: Embedder
) -> None:
    root = tmp_path / "published"
    async with over_unreadable(root, tmp_path, local_embedder, unreadable=False) as (
        sidecar,
        store,
    ):
        v1 = version_id(1)
        await eventually(lambda: serving(sidecar.port, v1), "v1 served")
        store.unreadable = True
        v2 = await publish(root, 2, local_embedder, "roaming")
        await eventually(lambda: refused(sidecar.port, v2, "unavailable"), "v2 refused: unreadable")
        await assert_still_serving(sidecar, v1)
        store.unreadable = False  # permissions fixed: the next poll serves it
        await eventually(lambda: serving(sidecar.port, v2), "v2 served once readable")


async def test_a_call_to_a_base_whose_version_could_not_be_fetched_says_so_not_build_one(
    tmp_path: Path, local_embedder: Embedder
) -> None:
    """A store the sidecar cannot read is not a bad snapshot: the call says the fetch failed and
    is tried again, rather than "publish a good one" or "run voxrecall index build"."""
    root = tmp_path / "published"
    async with over_unreadable(root, tmp_path, local_embedder, unreadable=True) as (sidecar, _):
        v1 = version_id(1)
        await eventually(lambda: refused(sidecar.port, v1, "unavailable"), "v1 unreadable")
        with pytest.raises(grpc.aio.AioRpcError) as failed:
            await search(sidecar.port)
        assert failed.value.code() is grpc.StatusCode.UNAVAILABLE
        details = str(failed.value.details())
        assert "fetching its newest version failed" in details
        assert "Permission denied" in details  # the cause, for the person fixing it
        assert "tried again on the next poll" in details


# -- what a swap costs the process ---------------------------------------------------------------


async def test_a_refresh_hashes_each_file_and_checks_the_graph_once(
    store: Store, tmp_path: Path, local_embedder: Embedder, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The store's fetch checks every file's sha256 and the graph's layout (a corrupted file is
    refused: above; a lying graph: tests/test_store_contract.py); the load that follows does
    neither again, which took seconds for a large snapshot."""
    hashed: Counter[str] = Counter()
    checked: Counter[str] = Counter()
    check = index.snapshot.check_hnsw_file

    def counting(path: Path) -> str:
        hashed[path.name] += 1
        return sha256_file(path)

    def counting_checks(path: Path, *, count: int, dimension: int, m: int) -> None:
        checked[path.name] += 1
        check(path, count=count, dimension=dimension, m=m)

    monkeypatch.setattr(index.snapshot, "sha256_file", counting)
    monkeypatch.setattr(index.http_store, "sha256_file", counting)
    monkeypatch.setattr(index.snapshot, "check_hnsw_file", counting_checks)
    v1 = await publish(store.root, 1, local_embedder, "password")
    hashed.clear()  # the build hashed them to write the manifest
    checked.clear()
    async with running(sidecar_config(store, tmp_path), local_embedder, poll=False) as sidecar:
        assert await serving(sidecar.port, v1)
        assert (hashed, checked) == (Counter(DATA_FILES), Counter({VECTORS: 1}))
        v2 = await publish(store.root, 2, local_embedder, "roaming")
        hashed.clear()
        checked.clear()
        assert await sidecar.refresher.refresh() == [KB]
        assert served_right(await search(sidecar.port), v2)
    assert (hashed, checked) == (Counter(DATA_FILES), Counter({VECTORS: 1}))
    hashed.clear()
    checked.clear()
    # the next start, on the same cache: what fetch recorded is neither hashed nor checked again
    async with running(sidecar_config(store, tmp_path), local_embedder, poll=False) as sidecar:
        assert await serving(sidecar.port, v2)
    assert (hashed, checked) == (Counter(), Counter())


class ShaOnlyStore:
    """A store of one's own written to the contract of before fetch checked the graphs: its
    fetch checks every file's sha256 only, and it does not say ``checks_graphs``."""

    def __init__(self, root: Path) -> None:
        self.local = LocalStore(root)

    def latest(self, knowledge_base: str) -> str | None:
        return self.local.latest(knowledge_base)

    def fetch(self, knowledge_base: str, version: str) -> Path:
        folder = self.local.version_dir(knowledge_base, version)
        index.snapshot.verify_snapshot(folder)
        return folder

    def retain(self, knowledge_base: str, versions: Collection[str]) -> None:
        pass

    def knowledge_bases(self) -> frozenset[str]:
        return self.local.knowledge_bases()

    def close(self) -> None:
        pass


async def test_a_store_that_checks_only_the_sha256_has_its_graphs_checked_at_load(
    tmp_path: Path, local_embedder: Embedder
) -> None:
    """A graph whose header is whole but whose links name elements past the end, its checksums
    matching: the load checks the whole layout when the store did not say it did, and the
    version is refused while the last good one serves (hnswlib would crash on a search)."""
    root = tmp_path / "published"
    store = Store(root, str(root))
    v1 = await publish(root, 1, local_embedder, "password")
    config = sidecar_config(store, tmp_path)
    async with running(config, local_embedder, poll=False, store=ShaOnlyStore(root)) as sidecar:
        assert await serving(sidecar.port, v1)
        v2 = await publish(root, 2, local_embedder, "roaming", damage=LEVEL0_LINK_PAST_THE_END)
        await sidecar.refresher.refresh()
        assert await refused(sidecar.port, v2, "corrupt")
        await assert_still_serving(sidecar, v1)


async def test_an_old_snapshot_is_freed_when_the_last_call_holding_it_ends(
    tmp_path: Path, local_embedder: Embedder
) -> None:
    """After a swap the heap is frozen (the collector stops walking the served snapshot), so an
    old snapshot must go by reference counting alone, with no reference cycle holding it."""
    root = tmp_path / "published"
    v1 = await publish(root, 1, local_embedder, "password")
    gated = GatedEmbedder(local_embedder)
    # the call waits at the gate through a publish and a refresh: its budget outlasts them on
    # any machine, so it is answered densely from the snapshot it started with (past the most a
    # file may give, MAX_BUDGET_MS: set on the parsed config)
    parsed = sidecar_config(Store(root, str(root)), tmp_path)
    config = replace(parsed, sidecar=replace(parsed.sidecar, budget_ms=int(WAIT_S * 1000)))
    async with (
        running(config, gated, poll=False) as sidecar,
        grpc.aio.insecure_channel(f"127.0.0.1:{sidecar.port}") as channel,
    ):
        client = pb_grpc.RetrievalStub(channel)  # type: ignore[no-untyped-call]
        v2 = await publish(root, 2, local_embedder, "roaming")  # not polled: served on refresh()
        gated.gate.clear()
        in_flight = asyncio.ensure_future(client.Turn(HELD_TURN, timeout=WAIT_S))
        await asyncio.wait_for(gated.entered.wait(), WAIT_S)
        assert await sidecar.refresher.refresh() == [KB]
        assert gc.get_freeze_count() > 0
        assert versions_alive(root) == {v1, v2}  # the call in flight still holds v1
        gated.gate.set()
        assert served_right(await in_flight, v1)

        async def v1_freed() -> bool:
            return versions_alive(root) == {v2}

        await eventually(v1_freed, "v1 freed once the call holding it ended")


def versions_alive(root: Path) -> set[str]:
    """The versions of ``root``'s snapshots in memory, found without collecting any garbage
    (frozen objects are invisible to ``gc.get_objects`` until unfrozen)."""
    gc.unfreeze()
    return {
        o.version
        for o in gc.get_objects()
        if isinstance(o, LoadedSnapshot) and o.folder.is_relative_to(root)
    }
