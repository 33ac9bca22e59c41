"""A thousand bases behind one sidecar under ``[sidecar] memory_budget_mb`` (issue 19, 2), and the
order of a lazy load: verified before it evicts, fair between callers, a new base kept for the
caller that asked for it.

Real parts: a real sidecar on 127.0.0.1 port 0, real snapshots in a real local store, real
hnswlib. One small base is written by the indexer's snapshot writer with the hash embedder, then
published under each other name the way a publisher would (``bench.many_bases.publish_copies``:
its files linked into a staging folder, its manifest written again naming the new base, the only
place a snapshot names its base, so every file's sha256 and size stay true). The hash
embedder keeps the building cheap; nothing here measures quality.

Each caller has its own connection (``grpc.use_local_subchannel_pool``: channels to one target
otherwise share a connection), as separate agent processes would.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import threading
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from types import SimpleNamespace
from typing import cast

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from bench.many_bases import publish_copies
from index.embedders.base import HashEmbedder
from index.store import LocalStore
from sidecar.config import parse_config
from sidecar.edge.addresses import load_requester
from sidecar.edge.server import Sidecar, create_server
from sidecar.gen import retrieval_pb2 as pb
from sidecar.gen import retrieval_pb2_grpc as pb_grpc
from sidecar.snapshots.fair_pool import FairPool
from sidecar.snapshots.holder import SnapshotHolder
from sidecar.snapshots.refresh import LoadQueue, Refresher
from sidecar.snapshots.searcher import Searcher
from tests.bases_kit import LOAD_WAIT_S, hint_ms, own_channel, retried, search
from tests.conftest import eventually
from tests.snapshot_kit import version_id, write_version

BASES = 1000
CALLERS = 8
BUDGET_MB = 16  # holds about six of these bases (hnswlib's fixed 2.5 MiB each, and little more)
EMBEDDER = HashEmbedder(dimension=64)
CALL_S = 30.0  # a bound on one call


def kb_name(i: int) -> str:
    return f"kb{i:04d}"


@pytest.fixture(scope="module")
def store(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("many") / "store"
    version = version_id(1)
    write_version(root, version, EMBEDDER, "password", kb=kb_name(0))
    publish_copies(root, kb_name(0), version, (kb_name(i) for i in range(1, BASES)))
    # a base this sidecar must refuse: its checksums match, its embedder is not the sidecar's;
    # its files (a 4 MiB page) would need room that only evicting loaded bases could make
    other = HashEmbedder(dimension=64, name="test/other")
    write_version(root, version, other, kb="broken", page_bytes=4 * 2**20)
    return root


@contextlib.asynccontextmanager
async def serving(
    store: Path, tmp_path: Path, budget_mb: int = BUDGET_MB
) -> AsyncIterator[Sidecar]:
    raw = {
        "sidecar": {
            "store": str(store),
            "listen": "127.0.0.1:0",
            "memory_budget_mb": budget_mb,
            "min_score": -1.0,
            "budget_ms": 5_000,
            "cache_dir": str(tmp_path / "cache"),
        }
    }
    sidecar = await create_server(parse_config(raw, base=tmp_path), embedder=EMBEDDER, poll=False)
    try:
        yield sidecar
    finally:
        await sidecar.stop(0.5)


async def answered(stub: pb_grpc.RetrievalStub, kb: str) -> tuple[pb.SearchResponse, int]:
    """Search ``kb``, retrying after the hint while it loads: its answer, and how many calls
    were refused UNAVAILABLE (each with a hint) before it."""
    refused: list[grpc.aio.AioRpcError] = []
    resp: pb.SearchResponse = await retried(
        lambda: stub.Search(search(kb), timeout=CALL_S), refused
    )
    return resp, len(refused)


def loaded(sidecar: Sidecar) -> set[str]:
    """The bases served now (``get`` marks nothing used, unlike a call's ``use``)."""
    return {kb for kb in sidecar.engine.known_bases if sidecar.holder.get(kb) is not None}


def published(sidecar: Sidecar, then: Callable[[], None] | None = None) -> list[str]:
    """Every base the holder is given from now on, in order (the real holder, watched);
    ``then`` runs on the loop's next step after each (once the load has made room)."""
    order: list[str] = []
    publish = sidecar.holder.publish
    loop = asyncio.get_running_loop()

    def watched(searcher: Searcher, requester: str = "") -> None:
        publish(searcher, requester)
        order.append(searcher.snapshot.manifest.knowledge_base)
        if then is not None:
            loop.call_soon(then)

    sidecar.holder.publish = watched  # type: ignore[method-assign]
    return order


async def test_a_thousand_bases_answer_within_the_budget_for_concurrent_callers(
    store: Path, tmp_path: Path
) -> None:
    """Every call answers (OK, or UNAVAILABLE with a hint while its base loads, then OK), the
    bytes the holder counts never pass the budget, bases are evicted, health stays SERVING."""
    budget = BUDGET_MB * 2**20
    async with serving(store, tmp_path) as sidecar:
        holder = sidecar.holder
        over: list[int] = []
        health: list[int] = []

        def within_budget() -> None:
            if holder.loaded_bytes() > budget:
                over.append(holder.loaded_bytes())

        order = published(sidecar, then=within_budget)

        async def caller(c: int) -> int:
            async with own_channel(sidecar.port) as ch:
                stub = pb_grpc.RetrievalStub(ch)  # type: ignore[no-untyped-call]
                probe = health_pb2_grpc.HealthStub(ch)
                refused = 0
                for i in range(c, BASES, CALLERS):  # the callers' bases interleave
                    resp, n = await answered(stub, kb_name(i))
                    assert resp.chunks
                    assert {ch.knowledge_base for ch in resp.chunks} == {kb_name(i)}
                    refused += n
                    within_budget()
                    if i % 50 == c:
                        check = await probe.Check(health_pb2.HealthCheckRequest(), timeout=CALL_S)
                        health.append(check.status)
                return refused

        refusals = await asyncio.gather(*(caller(c) for c in range(CALLERS)))
        assert len(order) >= BASES
        assert over == []
        assert set(health) == {health_pb2.HealthCheckResponse.SERVING}
        assert sum(refusals) >= BASES  # each base's first call found it not loaded
        assert holder.loaded_bytes() <= budget
        left = len(loaded(sidecar))
        assert 1 < left < BASES // 100  # the budget holds a few
        assert holder.evictions >= BASES - left
        # the last load prunes the cache after its base is served
        await eventually(lambda: sidecar.refresher.waiting == 0, "the last load")


async def test_a_version_that_fails_to_load_evicts_nothing(store: Path, tmp_path: Path) -> None:
    """The budget is full and ``kb0000`` is the least recently used: a call to a base whose
    snapshot this sidecar refuses (another embedder) leaves every loaded base in place."""
    async with serving(store, tmp_path) as sidecar, own_channel(sidecar.port) as ch:
        stub = pb_grpc.RetrievalStub(ch)  # type: ignore[no-untyped-call]
        await answered(stub, kb_name(0))
        fits = BUDGET_MB * 2**20 // sidecar.holder.loaded_bytes()
        for i in range(1, fits):
            await answered(stub, kb_name(i))
        full = loaded(sidecar)
        assert full == {kb_name(i) for i in range(fits)}
        assert sidecar.holder.evictions == 0

        with pytest.raises(grpc.aio.AioRpcError) as first:
            await stub.Search(search("broken"), timeout=CALL_S)
        assert first.value.code() is grpc.StatusCode.UNAVAILABLE
        with pytest.raises(grpc.aio.AioRpcError) as refused:  # retried until the load failed
            await answered(stub, "broken")
        assert refused.value.code() is grpc.StatusCode.UNAVAILABLE
        details = str(refused.value.details())
        assert "has no snapshot loaded: its newest version was refused" in details
        assert "incompatible" in details  # why, so a person can act on it
        refusal = sidecar.holder.last_refusal("broken")
        assert refusal is not None
        assert refusal.kind == "incompatible"
        assert loaded(sidecar) == full
        assert sidecar.holder.evictions == 0
        await answered(stub, kb_name(fits))  # a good one still makes room as before
        assert loaded(sidecar) == full - {kb_name(0)} | {kb_name(fits)}


async def test_a_caller_with_many_bases_queued_does_not_hold_back_another(
    store: Path, tmp_path: Path
) -> None:
    """One caller asks for 40 bases at once (40 loads queued); another caller's one base loads
    next but one, not after the 40: the queues are served in turn."""
    many = [kb_name(i) for i in range(100, 140)]
    async with (
        serving(store, tmp_path) as sidecar,
        own_channel(sidecar.port) as first_ch,
        own_channel(sidecar.port) as second_ch,
    ):
        order = published(sidecar)
        first = pb_grpc.RetrievalStub(first_ch)  # type: ignore[no-untyped-call]
        second = pb_grpc.RetrievalStub(second_ch)  # type: ignore[no-untyped-call]
        async with sidecar.refresher._lock:  # no load starts until both callers have asked
            sidecar.refresher.load_ms = 60_000.0  # as if each load took a minute
            for kb in many:
                with pytest.raises(grpc.aio.AioRpcError) as refused:
                    await first.Search(search(kb), timeout=CALL_S)
                assert refused.value.code() is grpc.StatusCode.UNAVAILABLE
            # the 40th is told to come back while a base loaded for it still waits for it
            assert 0 < hint_ms(refused.value) <= sidecar.holder.fresh_s * 1000
            sidecar.refresher.load_ms = 0.0
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                await second.Search(search(kb_name(999)), timeout=CALL_S)
            assert refused.value.code() is grpc.StatusCode.UNAVAILABLE
            assert sidecar.refresher.waiting == len(many) + 1
        resp, _ = await answered(second, kb_name(999))
        assert {c.knowledge_base for c in resp.chunks} == {kb_name(999)}
        # the first caller's first base (taken before the second asked), its second, then
        # the second caller's: not after the other 38
        assert order.index(kb_name(999)) == 2
        assert order[:2] == many[:2]


async def test_a_new_base_is_kept_for_its_caller_while_another_cycles_through_bases(
    store: Path, tmp_path: Path
) -> None:
    """Caller B's base loads; before B comes back, caller A goes through more bases than the
    budget holds. B's base was loaded, not used: it stays, and B's next call answers from it."""
    async with (
        serving(store, tmp_path) as sidecar,
        own_channel(sidecar.port) as a_ch,
        own_channel(sidecar.port) as b_ch,
    ):
        sidecar.holder.fresh_s = 3600.0  # however slow the machine, B is "about to come back"
        b_loaded = asyncio.Event()
        order = published(sidecar, then=lambda: b_loaded.set() if kb_name(500) in order else None)
        a = pb_grpc.RetrievalStub(a_ch)  # type: ignore[no-untyped-call]
        b = pb_grpc.RetrievalStub(b_ch)  # type: ignore[no-untyped-call]
        await answered(a, kb_name(300))
        fits = BUDGET_MB * 2**20 // sidecar.holder.loaded_bytes()
        with pytest.raises(grpc.aio.AioRpcError):
            await b.Search(search(kb_name(500)), timeout=CALL_S)
        async with asyncio.timeout(LOAD_WAIT_S):
            await b_loaded.wait()
        for i in range(301, 301 + 2 * fits):
            await answered(a, kb_name(i))
        assert sidecar.holder.evictions >= fits
        resp = await b.Search(search(kb_name(500)), timeout=CALL_S)  # no retry: it is there
        assert {c.knowledge_base for c in resp.chunks} == {kb_name(500)}
        assert order.count(kb_name(500)) == 1


async def test_a_caller_asking_for_bases_it_never_calls_evicts_its_own_not_a_used_one(
    store: Path, tmp_path: Path
) -> None:
    """Attack F6: caller A asks once for each of more bases than the budget holds and never
    comes back for them; caller B's base, used, stays loaded and answers B's next call at once.
    A's bases, loaded and not called, are evicted instead (its newest one kept for it)."""
    async with (
        serving(store, tmp_path) as sidecar,
        own_channel(sidecar.port) as a_ch,
        own_channel(sidecar.port) as b_ch,
    ):
        sidecar.holder.fresh_s = 3600.0  # however slow the machine, A's bases are all fresh
        a = pb_grpc.RetrievalStub(a_ch)  # type: ignore[no-untyped-call]
        b = pb_grpc.RetrievalStub(b_ch)  # type: ignore[no-untyped-call]
        await answered(b, kb_name(700))
        fits = BUDGET_MB * 2**20 // sidecar.holder.loaded_bytes()
        last = kb_name(700 + 2 * fits)
        all_in = asyncio.Event()
        order = published(sidecar, then=lambda: all_in.set() if last in order else None)
        for i in range(701, 701 + 2 * fits):
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                await a.Search(search(kb_name(i)), timeout=CALL_S)
            assert refused.value.code() is grpc.StatusCode.UNAVAILABLE
        async with asyncio.timeout(LOAD_WAIT_S * 2):
            await all_in.wait()
        assert sidecar.holder.evictions >= fits
        assert kb_name(700) in loaded(sidecar)
        resp = await b.Search(search(kb_name(700)), timeout=CALL_S)  # no retry: it is there
        assert {c.knowledge_base for c in resp.chunks} == {kb_name(700)}
        assert last in loaded(sidecar)  # A's newest, kept for A


async def working_set(stub: pb_grpc.RetrievalStub, bases: list[str]) -> None:
    """Call each of ``bases`` twice (a caller coming back to them: its working set)."""
    for kb in bases:
        await answered(stub, kb)
        await stub.Search(search(kb), timeout=CALL_S)


async def fill_with_working_set(sidecar: Sidecar, stub: pb_grpc.RetrievalStub) -> list[str]:
    """The caller of ``stub`` fills the budget with its working set (every base it holds called
    twice): the bases, ``kb0600`` on."""
    await working_set(stub, [kb_name(600)])
    fits = BUDGET_MB * 2**20 // sidecar.holder.loaded_bytes()
    mine = [kb_name(600 + i) for i in range(fits)]
    await working_set(stub, mine[1:])
    return mine


async def test_a_caller_cycling_through_bases_from_new_connections_keeps_off_anothers_working_set(
    store: Path, tmp_path: Path
) -> None:
    """A second attack's H1: caller B keeps coming back to two bases; caller A then goes
    through twice as many bases as the budget holds, each from a connection of its own (on the
    loopback each connection is a requester of its own), calling each once. B's bases stay
    loaded and answer B's next calls at once (on main A's loads evicted them, the least
    recently used); A's loads evict A's bases."""
    async with serving(store, tmp_path) as sidecar, own_channel(sidecar.port) as b_ch:
        sidecar.holder.reuse_s = 3600.0  # however slow the machine, B is still coming back
        b = pb_grpc.RetrievalStub(b_ch)  # type: ignore[no-untyped-call]
        mine = [kb_name(800), kb_name(801)]
        await working_set(b, mine)
        fits = BUDGET_MB * 2**20 // (sidecar.holder.loaded_bytes() // len(mine))
        for i in range(900, 900 + 2 * fits):
            async with own_channel(sidecar.port) as a_ch:
                a = pb_grpc.RetrievalStub(a_ch)  # type: ignore[no-untyped-call]
                await answered(a, kb_name(i))
        assert sidecar.holder.evictions >= fits
        for kb in mine:
            resp = await b.Search(search(kb), timeout=CALL_S)  # no retry: it is there
            assert {c.knowledge_base for c in resp.chunks} == {kb}


async def test_calling_anothers_working_set_does_not_make_it_evictable_for_ones_own_loads(
    store: Path, tmp_path: Path
) -> None:
    """Attack s15 G: B keeps coming back to its base; A calls that base too (now one of its
    callers), then goes through twice as many bases as the budget holds on its own connection.
    B's base stays loaded and answers B's next call at once (on main A's call made A one of its
    working set's requesters, and A's loads evicted it, the least recently used)."""
    async with (
        serving(store, tmp_path) as sidecar,
        own_channel(sidecar.port) as a_ch,
        own_channel(sidecar.port) as b_ch,
    ):
        sidecar.holder.reuse_s = 3600.0  # however slow the machine, B is still coming back
        a = pb_grpc.RetrievalStub(a_ch)  # type: ignore[no-untyped-call]
        b = pb_grpc.RetrievalStub(b_ch)  # type: ignore[no-untyped-call]
        theirs = kb_name(810)
        await working_set(b, [theirs])
        await a.Search(search(theirs), timeout=CALL_S)  # loaded: no retry
        await a.Search(search(theirs), timeout=CALL_S)
        fits = BUDGET_MB * 2**20 // sidecar.holder.loaded_bytes()
        for i in range(910, 910 + 2 * fits):
            await answered(a, kb_name(i))
        assert sidecar.holder.evictions >= fits
        resp = await b.Search(search(theirs), timeout=CALL_S)  # no retry: it is there
        assert {c.knowledge_base for c in resp.chunks} == {theirs}


async def test_a_load_that_could_only_evict_anothers_working_set_waits_with_a_hint(
    store: Path, tmp_path: Path
) -> None:
    """B's working set fills the budget: A's base is loaded, not served (nothing of B's is
    evicted), and A's calls get UNAVAILABLE with a retry hint, not a refusal."""
    async with (
        serving(store, tmp_path) as sidecar,
        own_channel(sidecar.port) as a_ch,
        own_channel(sidecar.port) as b_ch,
    ):
        sidecar.holder.reuse_s = 3600.0
        a = pb_grpc.RetrievalStub(a_ch)  # type: ignore[no-untyped-call]
        b = pb_grpc.RetrievalStub(b_ch)  # type: ignore[no-untyped-call]
        mine = await fill_with_working_set(sidecar, b)
        assert loaded(sidecar) == set(mine)
        refused: list[grpc.aio.AioRpcError] = []
        for _ in range(3):
            with pytest.raises(grpc.aio.AioRpcError) as waits:
                await a.Search(search(kb_name(650)), timeout=CALL_S)
            refused.append(waits.value)
            await eventually(lambda: sidecar.refresher.waiting == 0, "the load of kb0650")
        assert all(r.code() is grpc.StatusCode.UNAVAILABLE for r in refused)
        assert all("is loading" in str(r.details()) for r in refused)
        assert all(hint_ms(r) > 0 for r in refused)
        assert loaded(sidecar) == set(mine)
        assert sidecar.holder.evictions == 0
        assert sidecar.holder.refusals == {}  # waiting for room is not a refusal
        for kb in mine:
            await b.Search(search(kb), timeout=CALL_S)  # no retry: every one is there


async def test_a_load_held_for_room_is_built_once_then_served_when_room_is_made(
    store: Path, tmp_path: Path
) -> None:
    """B's working set fills the budget and B keeps it (its wait for room ends at once, B still
    there): A's retries of a base held back for room do not build it again (on main each retry
    built it in full and threw it away, under the load lock: 26-52 s at 1M chunks); once B's
    set lapses, A's next call builds it and it is served."""
    async with (
        serving(store, tmp_path) as sidecar,
        own_channel(sidecar.port) as a_ch,
        own_channel(sidecar.port) as b_ch,
    ):
        sidecar.holder.reuse_s = 3600.0
        a = pb_grpc.RetrievalStub(a_ch)  # type: ignore[no-untyped-call]
        b = pb_grpc.RetrievalStub(b_ch)  # type: ignore[no-untyped-call]
        mine = await fill_with_working_set(sidecar, b)
        sidecar.holder.room_in = lambda requester: 0.0  # type: ignore[method-assign]
        builds: list[str] = []
        load = sidecar.refresher._load

        async def counted(kb: str, version: str) -> Searcher:
            builds.append(kb)
            return await load(kb, version)

        sidecar.refresher._load = counted  # type: ignore[method-assign]
        for _ in range(3):
            with pytest.raises(grpc.aio.AioRpcError):
                await a.Search(search(kb_name(650)), timeout=CALL_S)
            await eventually(lambda: sidecar.refresher.waiting == 0, "the load of kb0650")
        assert builds == [kb_name(650)]
        assert loaded(sidecar) == set(mine)
        sidecar.holder.reuse_s = 0.0  # B's working set lapses
        await answered(a, kb_name(650))
        assert builds == [kb_name(650)] * 2
        assert kb_name(650) in loaded(sidecar)


def test_a_base_loaded_and_never_called_goes_first_once_its_wait_is_over() -> None:
    """Eviction order: a fresh base (loaded, not called yet) goes after every used one while
    its caller may still come back (``fresh_s``), before them once that wait is over."""
    holder = SnapshotHolder()
    for kb in ("used", "fresh"):
        manifest = SimpleNamespace(knowledge_base=kb)
        holder.publish(cast(Searcher, SimpleNamespace(snapshot=SimpleNamespace(manifest=manifest))))
    holder.use("used")
    now = time.monotonic()
    assert holder.eviction_order(now) == ["used", "fresh"]
    assert holder.eviction_order(now + holder.fresh_s + 1) == ["fresh", "used"]
    holder.use("fresh")  # its caller came: it is used like any other now
    assert holder.eviction_order(now + holder.fresh_s + 1) == ["used", "fresh"]


def test_a_load_leaves_other_callers_working_sets_out() -> None:
    """Eviction order for a load of B's: A's working set (called twice) is left out, B's own
    and the bases called once go, least recently used first; a poll's order holds every base."""
    holder = SnapshotHolder()
    a, b = "ipv4:127.0.0.1:1000", "ipv4:127.0.0.1:2000"
    for kb in ("a_set", "once", "b_set"):
        manifest = SimpleNamespace(knowledge_base=kb)
        holder.publish(cast(Searcher, SimpleNamespace(snapshot=SimpleNamespace(manifest=manifest))))
    for kb, peer in (("b_set", b), ("a_set", a), ("b_set", b), ("once", a), ("a_set", a)):
        holder.use(kb, peer)
    now = time.monotonic()
    assert holder.eviction_order(now, requester=load_requester(b)) == ["b_set", "once"]
    assert holder.eviction_order(now, requester=load_requester(a)) == ["once", "a_set"]
    assert holder.eviction_order(now) == ["b_set", "once", "a_set"]
    later = now + holder.reuse_s + 1  # nobody came back: no working sets
    assert holder.eviction_order(later, requester=load_requester(b)) == ["b_set", "once", "a_set"]


def holding(*bases: str) -> SnapshotHolder:
    """A holder serving ``bases`` (stand-in searchers: the order alone is tested)."""
    holder = SnapshotHolder()
    for kb in bases:
        manifest = SimpleNamespace(knowledge_base=kb)
        holder.publish(cast(Searcher, SimpleNamespace(snapshot=SimpleNamespace(manifest=manifest))))
    return holder


def test_a_base_two_agent_processes_keep_calling_is_their_working_set() -> None:
    """Two agent processes on the loopback (each a requester) take turns calling one base: it
    is in their working set, left out of a third requester's load and of each one's own loads
    while the other still calls it (attack s15 G), evictable by either once the other's calls
    lapse."""
    holder = holding("shared", "other")
    p1, p2, third = "ipv4:127.0.0.1:1000", "ipv4:127.0.0.1:2000", "ipv4:127.0.0.1:4000"
    for _ in range(3):
        holder.use("shared", p1)
        holder.use("shared", p2)
    holder.use("other", third)
    now = time.monotonic()
    assert holder.eviction_order(now, requester=load_requester(third)) == ["other"]
    assert holder.eviction_order(now, requester=load_requester(p1)) == ["other"]
    holder._calls["shared"].by[load_requester(p2)] = now - holder.reuse_s - 1  # p2 went away
    assert holder.eviction_order(now, requester=load_requester(p1)) == ["shared", "other"]
    assert holder.eviction_order(now, requester=load_requester(p2)) == ["other"]


def test_one_call_by_another_requester_leaves_a_working_set_in_place() -> None:
    """A keeps calling its base; B calls it once: it stays A's working set, left out of a third
    requester's load (on main B's one call stripped it, A's next call not following A's own)
    and of B's (attack s15 G: on main B's call made it B's too, evictable for B's loads)."""
    holder = holding("a_set", "x")
    a, b, c = "ipv4:10.0.0.1:1000", "ipv4:10.0.0.2:2000", "ipv4:10.0.0.3:3000"
    for peer in (a, a, a, b, a):
        holder.use("a_set", peer)
    holder.use("x", c)
    now = time.monotonic()
    assert holder.eviction_order(now, requester=load_requester(c)) == ["x"]
    assert holder.eviction_order(now, requester=load_requester(b)) == ["x"]
    later = now + holder.reuse_s / 2
    holder._calls["a_set"].by[load_requester(b)] = now - holder.reuse_s  # B's call lapses
    holder._calls["a_set"].at = later
    assert holder.eviction_order(later, requester=load_requester(a)) == ["a_set", "x"]


def taken(queue: LoadQueue) -> list[str]:
    """The bases ``queue`` gives, in order, until it is empty."""
    order: list[str] = []
    while (next_one := queue.take()) is not None:
        order.append(next_one[0])
    return order


def test_the_load_queue_takes_requesters_in_turn_each_base_once() -> None:
    queue = LoadQueue()
    for kb in ("a1", "a2", "a3"):
        queue.add(kb, "first")
    queue.add("b1", "second")
    queue.add("a2", "second")  # queued already: not twice, and still the first's
    assert len(queue) == 4
    assert taken(queue) == ["a1", "b1", "a2", "a3"]
    assert queue.take() is None


def test_the_load_queue_says_how_many_loads_come_before_each_base() -> None:
    """``ahead`` (the retry hint's count) against the order ``take`` really gives, on random
    queues."""
    rng = random.Random(19)
    for _ in range(200):
        queue = LoadQueue()
        bases: set[str] = set()
        for _ in range(rng.randrange(1, 30)):
            kb = f"kb{rng.randrange(40)}"
            queue.add(kb, f"r{rng.randrange(4)}")
            bases.add(kb)
        ahead = {kb: queue.ahead(kb) for kb in bases}
        order = taken(queue)
        assert ahead == {kb: i for i, kb in enumerate(order)}


async def test_the_load_queue_counts_a_remote_client_once_whatever_its_connections(
    tmp_path: Path,
) -> None:
    """Attack F11: a remote host's connections share one turn of the queue (its address, as
    every per-address share counts it), so its 40 connections' bases do not come before
    another host's one; on the loopback each connection is its own caller (local agents)."""
    refresher = Refresher(LocalStore(tmp_path), SnapshotHolder(), EMBEDDER, [], budget_bytes=1)
    async with refresher._lock:  # nothing loads while the callers ask
        for c in range(40):
            refresher.want(f"a{c}", f"ipv4:10.0.0.7:{5000 + c}")
        refresher.want("victim", "10.0.0.8:6000")  # the HTTP door's form of a peer
        await asyncio.sleep(0)  # the loader takes a0 and waits for the lock
        assert refresher._queue.ahead("victim") == 0  # the other host had its turn: a0
        refresher.close()
    assert load_requester("ipv6:%5B2001:db8::1%5D:1") == load_requester("[2001:db8::2]:2")
    assert load_requester("ipv4:127.0.0.1:1") != load_requester("ipv4:127.0.0.1:2")


async def test_a_poll_does_not_bring_back_a_base_evicted_while_its_pointer_was_read(
    store: Path, tmp_path: Path
) -> None:
    """A poll reads B's base's pointer slowly; meanwhile C's working set fills the budget and
    evicts B's base. The poll does not load that base again (evicting C's working set to fit
    it: a poll protects nobody's): a poll refreshes only the bases still loaded."""
    async with (
        serving(store, tmp_path) as sidecar,
        own_channel(sidecar.port) as b_ch,
        own_channel(sidecar.port) as c_ch,
    ):
        sidecar.holder.reuse_s = 3600.0
        b = pb_grpc.RetrievalStub(b_ch)  # type: ignore[no-untyped-call]
        c = pb_grpc.RetrievalStub(c_ch)  # type: ignore[no-untyped-call]
        target = kb_name(700)
        await answered(b, target)  # loaded, called once: in nobody's working set
        fits = BUDGET_MB * 2**20 // sidecar.holder.loaded_bytes()
        reading, gate = threading.Event(), threading.Event()
        real = sidecar.refresher.store.latest

        def latest(kb: str) -> str | None:
            if kb == target:
                reading.set()
                gate.wait(CALL_S)
            return real(kb)

        sidecar.refresher.store.latest = latest  # type: ignore[method-assign]
        poll = asyncio.create_task(sidecar.refresher.refresh())
        await eventually(reading.is_set, "the poll's read of the pointer")
        mine = [kb_name(710 + i) for i in range(fits)]
        await working_set(c, mine)
        assert target not in loaded(sidecar)
        before = loaded(sidecar)
        gate.set()
        assert await poll == []
        assert loaded(sidecar) == before


async def test_a_first_load_does_not_wait_behind_a_polls_pointer_reads(
    store: Path, tmp_path: Path
) -> None:
    """40 loaded bases whose pointers the store holds (more than the download threads): a
    poll's reads of them hold none of a first call's load, which is served while they hang (on
    the shared pool the poll's reads took every thread and the first load queued behind them)."""
    async with serving(store, tmp_path, budget_mb=400) as sidecar, own_channel(sidecar.port) as ch:
        s = pb_grpc.RetrievalStub(ch)  # type: ignore[no-untyped-call]
        for i in range(40):
            await answered(s, kb_name(i))
        slow = loaded(sidecar)
        reads: list[str] = []
        gate = threading.Event()
        real = sidecar.refresher.store.latest

        def latest(kb: str) -> str | None:
            if kb in slow:
                reads.append(kb)
                gate.wait(2 * LOAD_WAIT_S)  # past the caller's patience
            return real(kb)

        sidecar.refresher.store.latest = latest  # type: ignore[method-assign]
        poll = asyncio.create_task(sidecar.refresher.refresh())
        try:
            await eventually(lambda: len(reads) >= 16, "the poll's reads of the pointers")
            await answered(s, kb_name(500))  # served while every read of the poll hangs
            assert kb_name(500) in loaded(sidecar)
        finally:
            gate.set()
            await poll


async def test_a_job_submitted_after_the_pool_shut_down_is_refused_holding_no_thread() -> None:
    """A job submitted after ``shutdown`` counted a thread busy and a job running for its
    requester before the executor refused it: neither was given back."""
    pool = FairPool(1, "test-fair-shut")
    pool.shutdown()
    with pytest.raises(RuntimeError):
        pool.submit("late", str, "x")
    assert (pool.running("late"), pool.queued("late")) == (0, 0)
    assert pool.may_start("another")  # its one thread is not counted busy


async def test_the_download_pool_shares_its_threads_between_requesters() -> None:
    """``FairPool`` with 4 threads: a requester alone takes half of them, however many jobs it
    queues; another's first job starts at once beside them, a third's on the last free thread;
    the last free thread waits for a requester with nothing running, which starts at once."""
    pool = FairPool(4, "test-fair")
    gates = {name: threading.Event() for name in ("a", "b", "c", "d")}

    def job(name: str) -> str:
        gates[name].wait(LOAD_WAIT_S)
        return name

    try:
        a_jobs = [pool.submit("a", job, "a") for _ in range(6)]
        assert (pool.running("a"), pool.queued("a")) == (2, 4)
        b_jobs = [pool.submit("b", job, "b") for _ in range(2)]
        assert (pool.running("b"), pool.queued("b")) == (1, 1)
        c_job = pool.submit("c", job, "c")
        assert pool.running("c") == 1
        gates["c"].set()
        assert await c_job == "c"
        # the thread c freed is kept for a requester with nothing running: a and b hold more
        assert (pool.running("a"), pool.running("b")) == (2, 1)
        d_job = pool.submit("d", job, "d")
        assert pool.running("d") == 1  # a newcomer starts at once, whatever a and b queued
        gates["d"].set()
        gates["a"].set()
        gates["b"].set()
        assert await asyncio.gather(*a_jobs, *b_jobs, d_job) == ["a"] * 6 + ["b"] * 2 + ["d"]
        assert (pool.running("a"), pool.queued("a"), pool.running("b")) == (0, 0, 0)
    finally:
        for gate in gates.values():
            gate.set()
        pool.shutdown()
