"""A sidecar whose config names no base serves its store's: each poll lists the store again and
serves the bases published there since the start (those of its shard), loaded at that poll or,
under ``[sidecar] memory_budget_mb``, at their first call; a shard with no base yet is SERVING
(nothing to load) and takes its bases at the polls. The listing is bounded: a sidecar keeps at
most ``MAX_LISTED_BASES`` bases however many names a store lists, and a folder of more than
``MAX_LISTED_ENTRIES`` entries is refused, not read to its end.

Real parts: a real sidecar on 127.0.0.1 port 0 polling a real local store every 50 ms, real
snapshots (the hash embedder: nothing here measures quality), real hnswlib.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import shutil
import urllib.error
import urllib.request
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

import index.store
from index.embedders.base import HashEmbedder
from index.errors import StoreUnavailable
from index.store import LocalStore
from sidecar.edge import server
from sidecar.edge.server import Sidecar, create_server
from sidecar.gen import retrieval_pb2 as pb
from sidecar.gen import retrieval_pb2_grpc as pb_grpc
from sidecar.shards import shard_of
from sidecar.snapshots import refresh
from tests.bases_kit import LOAD_WAIT_S, answered, config, hint_ms, retried, search
from tests.conftest import eventually
from tests.hardening_kit import TOKEN_A, TOKEN_B
from tests.snapshot_kit import flip_a_byte, version_id, write_version
from tests.test_metrics import scraped, value

EMBEDDER = HashEmbedder(dimension=64)
POLL_S = 0.05


def names_of_shard(shard: int, shards: int, count: int) -> list[str]:
    """The first ``count`` names ``base-N`` of that shard."""
    found = (f"base-{i}" for i in range(10_000))
    return [n for n in found if shard_of(n, shards) == shard][:count]


def publish(store: Path, kb: str) -> None:
    write_version(store, version_id(1), EMBEDDER, "invoices", kb=kb)


@contextlib.asynccontextmanager
async def serving(
    store: Path, tmp_path: Path, poll_s: float = POLL_S, **sidecar: Any
) -> AsyncIterator[tuple[Sidecar, grpc.aio.Channel]]:
    cfg = config(store, tmp_path, poll_seconds=poll_s, cache_dir=str(tmp_path / "c"), **sidecar)
    running = await create_server(cfg, embedder=EMBEDDER)
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{running.port}") as channel:
            yield running, channel
    finally:
        await running.stop(0.5)


def stub_of(channel: grpc.aio.Channel) -> pb_grpc.RetrievalStub:
    return pb_grpc.RetrievalStub(channel)  # type: ignore[no-untyped-call]


async def health(channel: grpc.aio.Channel) -> int:
    check = await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest())
    return int(check.status)


@pytest.mark.parametrize("budget_mb", [0, 64], ids=["loaded", "lazy"])
async def test_a_base_published_after_the_start_is_served_from_the_next_poll(
    tmp_path: Path, budget_mb: int
) -> None:
    store = tmp_path / "store"
    publish(store, "help")
    async with serving(store, tmp_path, memory_budget_mb=budget_mb) as (sidecar, channel):
        stub = stub_of(channel)
        with pytest.raises(grpc.aio.AioRpcError) as before:
            await stub.Search(search("billing"), timeout=LOAD_WAIT_S)
        assert before.value.code() is grpc.StatusCode.NOT_FOUND
        publish(store, "billing")
        await eventually(lambda: "billing" in sidecar.engine.known_bases, "the poll")
        if not budget_mb:  # loaded by the poll that listed it: until then it has no snapshot
            await eventually(lambda: sidecar.engine.holder.get("billing") is not None, "its load")
        resp = await answered(stub, "billing")
        assert {c.knowledge_base for c in resp.chunks} == {"billing"}
        assert (await answered(stub, "help")).chunks  # the first base serves on


async def test_a_shard_takes_the_new_bases_of_its_shard_only(tmp_path: Path) -> None:
    mine, other = names_of_shard(0, 2, 2), names_of_shard(1, 2, 1)
    store = tmp_path / "store"
    publish(store, mine[0])
    shard_0 = {"shards": 2, "shard": 0, "memory_budget_mb": 64}
    async with serving(store, tmp_path, **shard_0) as (sidecar, channel):
        publish(store, other[0])
        publish(store, mine[1])
        await eventually(lambda: mine[1] in sidecar.engine.known_bases, "the poll")
        assert sidecar.engine.known_bases == frozenset(mine)
        assert (await answered(stub_of(channel), mine[1])).chunks
        with pytest.raises(grpc.aio.AioRpcError) as elsewhere:
            await stub_of(channel).Search(search(other[0]), timeout=LOAD_WAIT_S)
        assert elsewhere.value.code() is grpc.StatusCode.NOT_FOUND


async def test_an_empty_shard_is_serving_and_takes_its_bases_at_the_polls(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A StatefulSet's startupProbe restarted a shard with no base yet in a loop: it stayed
    LOADING, its log telling it to name bases with [[knowledge_base]]."""
    store = tmp_path / "store"
    for kb in names_of_shard(0, 2, 3):
        publish(store, kb)
    (theirs,) = names_of_shard(1, 2, 1)
    async with serving(store, tmp_path, shards=2, shard=1) as (sidecar, channel):
        assert await health(channel) == health_pb2.HealthCheckResponse.SERVING
        assert sidecar.engine.known_bases == frozenset()
        publish(store, theirs)
        await eventually(lambda: sidecar.holder.get(theirs) is not None, "the poll's load")
        assert (await answered(stub_of(channel), theirs)).chunks
        assert await health(channel) == health_pb2.HealthCheckResponse.SERVING
    warned = [r.getMessage() for r in caplog.records if r.name == "voxrecall.server"]
    assert any("no knowledge base of shard 1 of 2 in" in m for m in warned), warned
    assert not any("[[knowledge_base]]" in m for m in warned), warned


def counted_listings(monkeypatch: pytest.MonkeyPatch) -> list[frozenset[str]]:
    """Every listing the sidecar reads from its store, in order."""
    listings: list[frozenset[str]] = []
    listed = server.knowledge_base_names

    def counted(*args: Any) -> frozenset[str]:
        listings.append(listed(*args))
        return listings[-1]

    monkeypatch.setattr(server, "knowledge_base_names", counted)
    return listings


async def test_a_store_listing_ever_more_names_grows_no_sidecar_past_its_cap(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr(server, "MAX_LISTED_BASES", 3)
    listings = counted_listings(monkeypatch)
    store = tmp_path / "store"
    publish(store, "help")
    async with serving(store, tmp_path, memory_budget_mb=64) as (sidecar, _):
        for i in range(6):  # new names between polls, as a hostile store would list them
            (store / f"junk-{i}").mkdir()
        await eventually(lambda: len(sidecar.engine.known_bases) == 3, "the poll")
        (store / "junk-late").mkdir()
        seen = len(listings)
        await eventually(lambda: len(listings) >= seen + 2, "two more polls")
        assert "junk-late" in listings[-1]
        assert len(sidecar.engine.known_bases) == 3
        assert len(sidecar.refresher.knowledge_bases) == 3
    over = [r for r in caplog.records if "more bases than one sidecar serves" in r.getMessage()]
    assert len(over) == 1  # said once, not at every poll


def test_a_folder_of_more_entries_than_a_store_holds_is_refused_not_read_to_its_end(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(index.store, "MAX_LISTED_ENTRIES", 5)
    for i in range(5):
        (tmp_path / f"kb{i}").mkdir()
    assert len(LocalStore(tmp_path).knowledge_bases()) == 5
    (tmp_path / "kb5").mkdir()
    with pytest.raises(StoreUnavailable, match="over 5 entries"):
        LocalStore(tmp_path).knowledge_bases()


async def test_a_listing_that_fails_at_a_poll_keeps_what_is_served(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    store = tmp_path / "store"
    publish(store, "help")
    async with serving(store, tmp_path) as (sidecar, channel):
        monkeypatch.setattr(index.store, "MAX_LISTED_ENTRIES", 1)
        publish(store, "billing")  # two entries: the listing is refused from now on
        failed = "could not list the bases in the store again"
        await eventually(lambda: any(failed in r.getMessage() for r in caplog.records), "poll")
        assert (await answered(stub_of(channel), "help")).chunks
        assert sidecar.engine.known_bases == frozenset({"help"})
    assert sum(failed in r.getMessage() for r in caplog.records) == 1  # once per reason


async def test_a_store_listing_more_bases_than_a_sidecar_serves_at_start_is_cut_to_the_cap(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """The first bases by name are served, and the cut is said once: it was said at the start
    and again at the first poll (the start's cut was not noted)."""
    monkeypatch.setattr(server, "MAX_LISTED_BASES", 2)
    listings = counted_listings(monkeypatch)
    store = tmp_path / "store"
    for kb in ("c-base", "a-base", "b-base"):
        publish(store, kb)
    async with serving(store, tmp_path, memory_budget_mb=64) as (sidecar, _):
        assert sidecar.engine.known_bases == frozenset({"a-base", "b-base"})
        await eventually(lambda: len(listings) >= 3, "the start's listing and two polls'")
        assert sidecar.engine.known_bases == frozenset({"a-base", "b-base"})
    over = [
        r.getMessage() for r in caplog.records if "more bases than one sidecar" in r.getMessage()
    ]
    assert len(over) == 1, over
    assert "the store lists 3 bases" in over[0]


async def test_a_folder_of_the_store_that_is_not_a_base_holds_no_sidecar_loading(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """ "lost+found" (at the root of every fresh ext4 volume) was listed as a base with no
    snapshot: a sidecar with no memory budget stayed LOADING, its startupProbe restarting it."""
    store = tmp_path / "store"
    publish(store, "help")
    for odd in ("lost+found", "new\nline", "x" * 200, "caf\u00e9"):
        (store / odd).mkdir()
    async with serving(store, tmp_path) as (sidecar, channel):
        assert sidecar.engine.known_bases == frozenset({"help"})
        assert await health(channel) == health_pb2.HealthCheckResponse.SERVING
        listings = len([r for r in caplog.records if "not base names" in r.getMessage()])
        await sidecar.add_listed_bases()  # a poll's listing: the same skipped, not said again
    said = [r.getMessage() for r in caplog.records if "not base names" in r.getMessage()]
    assert listings == len(said) == 1, said
    assert "skipped 4 names" in said[0]
    assert "'lost+found'" in said[0]


async def test_a_listed_base_with_nothing_published_yet_holds_no_sidecar_loading(
    tmp_path: Path,
) -> None:
    """A base's folder made before its first publish (a valid name, no LATEST) held a sidecar
    with no memory budget LOADING for ever; it is served once published."""
    store = tmp_path / "store"
    publish(store, "help")
    (store / "pending").mkdir()
    async with serving(store, tmp_path) as (sidecar, channel):
        await eventually(
            lambda: sidecar.lifecycle.state.name == "SERVING", "SERVING without 'pending'"
        )
        assert await health(channel) == health_pb2.HealthCheckResponse.SERVING
        publish(store, "pending")
        await eventually(lambda: sidecar.holder.get("pending") is not None, "the poll's load")
        assert (await answered(stub_of(channel), "pending")).chunks


async def test_readyz_names_the_first_20_bases_it_waits_for_and_counts_them(
    tmp_path: Path,
) -> None:
    """The 503 body listed every base waited for: 1 MB at 5,000."""
    store = tmp_path / "store"
    for i in range(25):
        write_version(store, version_id(1), EMBEDDER, "invoices", kb=f"kb-{i:02d}")
        (store / f"kb-{i:02d}" / "LATEST").write_text("v-not-there\n")  # never loads
    cfg = config(
        store,
        tmp_path,
        poll_seconds=60,
        cache_dir=str(tmp_path / "c"),
        http={"listen": "127.0.0.1:0"},
    )
    running = await create_server(cfg, embedder=EMBEDDER)
    try:
        url = f"http://127.0.0.1:{running.http_port}/readyz"
        with pytest.raises(urllib.error.HTTPError) as answer:
            await asyncio.to_thread(urllib.request.urlopen, url, timeout=10)
        assert answer.value.code == 503
        body = json.loads(answer.value.read())
        assert body["waiting_for"] == [f"kb-{i:02d}" for i in range(20)]
        assert body["waiting_count"] == 25
    finally:
        await running.stop(0.5)


def readyz(port: int, token: str = "") -> tuple[int, dict[str, Any]]:
    """``/readyz``'s status and body, asked with ``token`` (none when empty)."""
    headers = {"authorization": f"Bearer {token}"} if token else {}
    request = urllib.request.Request(f"http://127.0.0.1:{port}/readyz", headers=headers)
    try:
        with urllib.request.urlopen(request, timeout=10) as answer:
            return answer.status, json.loads(answer.read())
    except urllib.error.HTTPError as refused:
        return refused.code, json.loads(refused.read())


async def test_readyz_names_the_bases_it_waits_for_only_to_a_token_that_may_use_them(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With auth, /readyz named the bases it waited for to any client, token or none (a base
    named for a deal not yet public, to anyone who could reach the port): a probe with no token
    (or a wrong one) gets the state and the count, a scoped token only its own bases' names and
    count."""
    store = tmp_path / "store"
    for i in range(25):
        write_version(store, version_id(1), EMBEDDER, "invoices", kb=f"kb-{i:02d}")
        (store / f"kb-{i:02d}" / "LATEST").write_text("v-not-there\n")  # never loads
    monkeypatch.setenv("VOX_T_ALL", TOKEN_A)
    monkeypatch.setenv("VOX_T_SCOPED", TOKEN_B)
    scoped = {"name": "scoped", "token_env": "VOX_T_SCOPED", "knowledge_bases": ["kb-21", "kb-03"]}
    auth = {"token_env": "VOX_T_ALL", "caller": [scoped]}
    http = {"listen": "127.0.0.1:0"}
    cfg = config(
        store, tmp_path, poll_seconds=60, cache_dir=str(tmp_path / "c"), http=http, auth=auth
    )
    running = await create_server(cfg, embedder=EMBEDDER)
    try:
        port = running.http_port
        unnamed = {"status": "not ready", "state": "LOADING", "waiting_count": 25}
        assert await asyncio.to_thread(readyz, port) == (503, unnamed)
        assert await asyncio.to_thread(readyz, port, "not-" + TOKEN_A) == (503, unnamed)
        status, body = await asyncio.to_thread(readyz, port, TOKEN_B)
        mine = {**unnamed, "waiting_count": 2, "waiting_for": ["kb-03", "kb-21"]}
        assert (status, body) == (503, mine)
        status, body = await asyncio.to_thread(readyz, port, TOKEN_A)
        assert body["waiting_for"] == [f"kb-{i:02d}" for i in range(20)]
        assert body["waiting_count"] == 25
    finally:
        await running.stop(0.5)


async def test_bases_gone_from_the_store_free_their_room_for_new_ones(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Folders made then deleted were kept as bases until a restart: the cap stayed full and
    the bases published since answered NOT_FOUND."""
    monkeypatch.setattr(server, "MAX_LISTED_BASES", 3)
    store = tmp_path / "store"
    publish(store, "help")
    async with serving(store, tmp_path, memory_budget_mb=64) as (sidecar, channel):
        for i in range(4):
            (store / f"junk-{i}").mkdir()
        await eventually(lambda: len(sidecar.engine.known_bases) == 3, "the junk listed")
        junk = sorted(sidecar.engine.known_bases - {"help"})[0]
        # what a base's calls and a held load leave behind, planted: forgetting it drops them
        sidecar.holder._calls[junk] = None  # type: ignore[assignment]
        sidecar.refresher._held[junk] = 0.0
        sidecar.refresher._held_bytes[junk] = ("v", 1)
        for i in range(4):
            (store / f"junk-{i}").rmdir()
        publish(store, "billing")
        await eventually(lambda: "billing" in sidecar.engine.known_bases, "the room freed")
        assert sidecar.engine.known_bases == frozenset({"help", "billing"})
        assert junk not in sidecar.holder._calls
        assert junk not in sidecar.refresher._held
        assert junk not in sidecar.refresher._held_bytes
        assert set(sidecar.refresher.knowledge_bases) == {"help", "billing"}
        assert (await answered(stub_of(channel), "billing")).chunks
        assert (await answered(stub_of(channel), "help")).chunks


async def test_only_bases_with_something_published_count_toward_the_cap(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Folders with nothing published (no LATEST) filled the cap: a base published beside them
    was never served."""
    monkeypatch.setattr(server, "MAX_LISTED_BASES", 3)
    store = tmp_path / "store"
    publish(store, "help")
    async with serving(store, tmp_path) as (sidecar, channel):
        for i in range(3):
            (store / f"junk-{i}").mkdir()
        junk = {f"junk-{i}" for i in range(3)}
        await eventually(lambda: junk <= sidecar.holder.unpublished, "the junk's pointers read")
        publish(store, "billing")
        await eventually(lambda: sidecar.holder.get("billing") is not None, "the poll's load")
        assert (await answered(stub_of(channel), "billing")).chunks
        assert await health(channel) == health_pb2.HealthCheckResponse.SERVING


async def test_a_poll_reads_many_pointers_in_a_few_jobs_and_downloads_only_what_changed(
    tmp_path: Path,
) -> None:
    """Each base's pointer was a job of its own on the poll's pool (10,000 bases: 10,000 jobs
    and future chains, the loop stalled up to a second each poll)."""
    store = tmp_path / "store"
    publish(store, "help")
    for i in range(60):
        (store / f"pending-{i:02d}").mkdir()
    cfg = config(store, tmp_path, poll_seconds=3600, cache_dir=str(tmp_path / "c"))
    sidecar = await create_server(cfg, embedder=EMBEDDER)  # polls only when told here
    try:
        refresher = sidecar.refresher
        pool, fetches = refresher._poll_pool, []
        submitted = 0
        submit, fetch = pool.submit, refresher.store.fetch

        def counted(*args: Any, **kwargs: Any) -> Any:
            nonlocal submitted
            submitted += 1
            return submit(*args, **kwargs)

        def fetched(kb: str, version: str) -> Path:
            fetches.append(kb)
            return fetch(kb, version)

        pool.submit = counted  # type: ignore[method-assign]
        refresher.store.fetch = fetched  # type: ignore[method-assign]
        assert await refresher.refresh() == []  # nothing new: pointers read, nothing fetched
        assert submitted <= refresh.POLL_DOWNLOADS
        assert fetches == []
        write_version(store, version_id(2), EMBEDDER, "invoices", kb="help")
        submitted = 0
        assert await refresher.refresh() == ["help"]
        assert submitted <= refresh.POLL_DOWNLOADS + 1
        assert set(fetches) == {"help"}  # downloaded, then opened by its load
        async with grpc.aio.insecure_channel(f"127.0.0.1:{sidecar.port}") as channel:
            assert (await answered(stub_of(channel), "help")).chunks
    finally:
        await sidecar.stop(0.5)


def break_pointer(store: Path, kb: str) -> None:
    """A LATEST no read can take (a folder where the file should be): an error, not absent."""
    (store / kb / "LATEST").mkdir(parents=True)


def pointer_said(caplog: pytest.LogCaptureFixture, kb: str) -> list[str]:
    """The log lines about ``kb``'s pointer failing or reading again."""
    said = (r.getMessage() for r in caplog.records if r.name == "voxrecall.refresh")
    return [m for m in said if f"the pointer of {kb}" in m]


@pytest.mark.parametrize(("budget_mb", "poll_s"), [(0, POLL_S), (64, 1.0)], ids=["loaded", "lazy"])
async def test_a_base_whose_pointer_cannot_be_read_holds_no_sidecar_loading(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, budget_mb: int, poll_s: float
) -> None:
    """A listed base whose LATEST could not be read (not absent: a store answering 500, a file
    that cannot be read) held a sidecar with no memory budget LOADING for ever, and its calls
    were told its version was refused, to publish a good one, with a hint not to retry."""
    caplog.set_level(logging.INFO, "voxrecall.refresh")
    store = tmp_path / "store"
    publish(store, "help")
    break_pointer(store, "broken")
    async with serving(store, tmp_path, poll_s, memory_budget_mb=budget_mb) as (sidecar, channel):
        stub = stub_of(channel)
        await eventually(lambda: sidecar.lifecycle.state.name == "SERVING", "SERVING")
        assert await health(channel) == health_pb2.HealthCheckResponse.SERVING
        assert (await answered(stub, "help")).chunks
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await retried(lambda: stub.Search(search("broken"), timeout=LOAD_WAIT_S))
        assert refused.value.code() is grpc.StatusCode.UNAVAILABLE
        said = str(refused.value.details())
        assert "'broken'" in said, said
        assert "pointer (LATEST) could not be read" in said, said
        assert "LATEST is not a regular file" in said, said
        assert hint_ms(refused.value) == round(poll_s * 1000)
        if not budget_mb:  # read again at every poll, said once
            seen = sidecar.holder.last_refusal("broken")
            assert seen is not None
            read_again = lambda: sidecar.holder.last_refusal("broken").at > seen.at  # noqa: E731
            await eventually(read_again, "another poll's read")
        assert len(pointer_said(caplog, "broken")) == 1, pointer_said(caplog, "broken")
        (store / "broken" / "LATEST").rmdir()
        publish(store, "broken")
        if budget_mb:  # tried again on a call past the hint
            await asyncio.sleep(hint_ms(refused.value) / 1000)
        else:
            await eventually(lambda: sidecar.holder.get("broken") is not None, "the poll's load")
        assert (await answered(stub, "broken")).chunks
        said_now = pointer_said(caplog, "broken")
        assert len(said_now) == 2, said_now
        assert "reads again" in said_now[1], said_now


async def test_a_lazy_base_whose_pointer_reads_again_naming_a_corrupt_version_is_refused(
    tmp_path: Path,
) -> None:
    """A base loading on demand whose pointer failed once and then read again, naming a corrupt
    version, stayed "pointer could not be read": its calls were told to retry (UNAVAILABLE) a
    version that no retry can fix, not to publish a good one (SnapshotNotFound, no retry)."""
    store = tmp_path / "store"
    publish(store, "help")
    break_pointer(store, "broken")
    async with serving(store, tmp_path, 0.2, memory_budget_mb=64) as (sidecar, channel):
        stub = stub_of(channel)
        with pytest.raises(grpc.aio.AioRpcError) as unread:
            await retried(lambda: stub.Search(search("broken"), timeout=LOAD_WAIT_S))
        assert "pointer (LATEST) could not be read" in str(unread.value.details())
        (store / "broken" / "LATEST").rmdir()
        write_version(store, version_id(1), EMBEDDER, "invoices", kb="broken", damage=flip_a_byte)
        await asyncio.sleep(hint_ms(unread.value) / 1000)  # tried again on a call past the hint
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await retried(lambda: stub.Search(search("broken"), timeout=LOAD_WAIT_S))
        said = str(refused.value.details())
        assert refused.value.code() is grpc.StatusCode.UNAVAILABLE, said
        assert hint_ms(refused.value) == -1, said  # not retried: a retry cannot fix it
        assert "corrupt" in said, said
        assert "publish a good one" in said, said
        assert "broken" not in sidecar.holder.unreadable


async def test_a_store_whose_every_pointer_fails_keeps_a_sidecar_loading(
    tmp_path: Path,
) -> None:
    """A broken base is not waited for once another serves: when none can, NOT_SERVING is
    true (the store is down, not one base)."""
    store = tmp_path / "store"
    break_pointer(store, "broken")
    async with serving(store, tmp_path) as (sidecar, channel):
        await eventually(lambda: sidecar.holder.last_refusal("broken") is not None, "its read")
        await sidecar.update_health()
        assert await health(channel) == health_pb2.HealthCheckResponse.NOT_SERVING


async def test_a_forgotten_base_leaves_no_refusal_status_nor_metric_behind(
    tmp_path: Path,
) -> None:
    """A base gone from the store kept its last refusal until a restart: a store listing new
    broken names at every poll grew the sidecar by one each."""
    store = tmp_path / "store"
    publish(store, "help")
    async with serving(store, tmp_path, metrics_listen="127.0.0.1:0") as (sidecar, channel):
        break_pointer(store, "junk")
        await eventually(lambda: sidecar.holder.last_refusal("junk") is not None, "its read")
        samples = await scraped(sidecar)
        assert value(samples, "voxrecall_snapshot_loaded", knowledge_base="help") == 1.0
        assert ("voxrecall_snapshot_loaded", frozenset({("knowledge_base", "junk")})) in samples
        (store / "junk" / "LATEST").rmdir()
        (store / "junk").rmdir()
        await eventually(lambda: "junk" not in sidecar.engine.known_bases, "forgotten")
        assert sidecar.holder.last_refusal("junk") is None
        samples = await scraped(sidecar)
        assert not [k for k in samples if ("knowledge_base", "junk") in k[1]]
        status = await stub_of(channel).Status(pb.StatusRequest(), timeout=LOAD_WAIT_S)
        assert [b.name for b in status.knowledge_bases] == ["help"]


async def test_a_loaded_base_deleted_from_the_store_serves_its_last_snapshot(
    tmp_path: Path,
) -> None:
    """Deliberate (docs/config.md, poll_seconds): a listing that names nothing for a moment (a
    store's glitch) must not unload every base, so a loaded base gone from the store serves on
    until a restart; one not loaded is forgotten (above)."""
    store = tmp_path / "store"
    publish(store, "help")
    async with serving(store, tmp_path) as (sidecar, channel):
        shutil.rmtree(store / "help")
        await eventually(lambda: "help" in sidecar.holder.unpublished, "a poll finding it gone")
        assert sidecar.engine.known_bases == frozenset({"help"})
        assert (await answered(stub_of(channel), "help")).chunks
        assert await health(channel) == health_pb2.HealthCheckResponse.SERVING
