"""Attack s13 F9: an HTTP store's fetch is bounded per version, not only per file, a
manifest's file count and total size are checked before any of its files is downloaded, and a
lazy sidecar loads other bases while one base's download goes on.

Real parts: a real static HTTP server on 127.0.0.1 (``tests/static_http.py``) serving real
snapshots written by the indexer's writer, the real HttpStore and its cache.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import shutil
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import BinaryIO, TypeVar, cast

import grpc
import pytest

from index import http_store
from index.embedders.base import HashEmbedder
from index.errors import CacheWriteError, CorruptSnapshot, StoreUnavailable
from index.http_store import (
    MAX_VERSION_FILES,
    PARTIAL,
    HttpOptions,
    HttpStore,
    _Promise,
    _Room,
)
from index.snapshot import MANIFEST, MAX_MANIFEST_BYTES, MAX_MANIFEST_CONTAINERS
from sidecar.config import Config, parse_config
from sidecar.edge.server import create_server
from sidecar.gen import retrieval_pb2_grpc as pb_grpc
from sidecar.snapshots import refresh
from sidecar.snapshots.refresh import refusal_kind
from tests.bases_kit import LOAD_WAIT_S, answered, own_channel, search
from tests.conftest import eventually, eventually_here, small_tmpfs
from tests.snapshot_kit import KB, version_id, write_version
from tests.static_http import StaticServer

EMBEDDER = HashEmbedder(dimension=64)
T = TypeVar("T")


@pytest.fixture
def server(tmp_path: Path) -> Iterator[StaticServer]:
    root = tmp_path / "published"
    root.mkdir()
    server = StaticServer(root).start()
    try:
        yield server
    finally:
        server.stop()


def with_extra_files(folder: Path, count: int, size: int = 4, claimed: int | None = None) -> None:
    """Add ``count`` files beside the snapshot's, each listed in its manifest with its true
    sha256 (and its true size, or ``claimed``)."""
    manifest = json.loads((folder / MANIFEST).read_text())
    for i in range(count):
        name = f"pad{i:04d}.bin"
        data = bytes([i % 256]) * size
        (folder / name).write_bytes(data)
        manifest["files"][name] = hashlib.sha256(data).hexdigest()
        manifest["sizes"][name] = size if claimed is None else claimed
    (folder / MANIFEST).write_text(json.dumps(manifest))


def requested_files(server: StaticServer) -> list[str]:
    return [e.path for e in server.log if "/pad" in e.path]


def test_a_manifest_listing_too_many_files_is_refused_before_any_download(
    server: StaticServer, tmp_path: Path
) -> None:
    version = version_id(1)
    write_version(
        server.root, version, EMBEDDER, damage=lambda f: with_extra_files(f, MAX_VERSION_FILES)
    )
    store = HttpStore(server.url, tmp_path / "cache", HttpOptions(attempts=1))
    with pytest.raises(CorruptSnapshot, match=f"a snapshot has at most {MAX_VERSION_FILES}"):
        store.fetch(KB, version)
    assert requested_files(server) == []


def with_nested_padding(folder: Path, count: int) -> None:
    """Add ``count`` empty JSON arrays to the manifest's ``extra`` (every file still matches)."""
    manifest = json.loads((folder / MANIFEST).read_text())
    manifest["extra"]["padding"] = [[] for _ in range(count)]
    (folder / MANIFEST).write_text(json.dumps(manifest))


def test_a_manifest_of_more_containers_than_a_snapshots_is_refused_unparsed(
    server: StaticServer, tmp_path: Path
) -> None:
    """Attack s20: a manifest within its (then) 4 MiB of "[]," is 1.4 million Python objects, which
    orjson builds holding the GIL: the refresher's worker thread held the event loop ~0.5 s.
    One of more than ``MAX_MANIFEST_CONTAINERS`` objects and arrays is refused unparsed."""
    version = version_id(1)
    count = MAX_MANIFEST_CONTAINERS
    write_version(server.root, version, EMBEDDER, damage=lambda f: with_nested_padding(f, count))
    store = HttpStore(server.url, tmp_path / "cache", HttpOptions(attempts=1))
    with pytest.raises(CorruptSnapshot, match="JSON objects and arrays; a snapshot's holds a few"):
        store.fetch(KB, version)


def test_a_manifest_of_numbers_past_its_bytes_is_refused_unparsed(
    server: StaticServer, tmp_path: Path
) -> None:
    """Attack s20's leftover: a manifest of half a million numbers in one array is one
    container, under their count, and orjson parsed its 4 MiB holding the GIL 20-40 ms. A
    manifest is about 1.2 KiB: one over ``MAX_MANIFEST_BYTES`` (256 KiB) is refused unread."""

    def with_numbers(folder: Path) -> None:
        manifest = json.loads((folder / MANIFEST).read_text())
        manifest["extra"]["padding"] = [1] * (MAX_MANIFEST_BYTES // 2)
        (folder / MANIFEST).write_text(json.dumps(manifest, separators=(",", ":")))

    version = version_id(1)
    write_version(server.root, version, EMBEDDER, damage=with_numbers)
    store = HttpStore(server.url, tmp_path / "cache", HttpOptions(attempts=1))
    with pytest.raises(CorruptSnapshot, match=f"manifest over {MAX_MANIFEST_BYTES} bytes"):
        store.fetch(KB, version)


def test_a_content_length_of_a_digit_int_refuses_is_no_count(
    server: StaticServer, tmp_path: Path
) -> None:
    """Attack s20: http.client reads headers as ISO-8859-1, and "\xb2" (a superscript two) is a
    digit to ``str.isdigit`` that ``int`` refuses: a Content-Length of it made ``latest`` and
    ``fetch`` raise a bare ValueError. It is no count (as http.client itself reads it): the
    body is read to the close, and checked against the manifest as any."""
    version = version_id(1)
    write_version(server.root, version, EMBEDDER)
    server.length_header = "\xb2"
    store = HttpStore(server.url, tmp_path / "cache", HttpOptions(attempts=1))
    assert store.latest(KB) == version
    assert (store.fetch(KB, version) / MANIFEST).is_file()


def test_a_manifest_claiming_more_than_the_disk_holds_is_refused_before_any_download(
    server: StaticServer, tmp_path: Path
) -> None:
    version = version_id(1)
    write_version(
        server.root, version, EMBEDDER, damage=lambda f: with_extra_files(f, 1, claimed=2**60)
    )
    store = HttpStore(server.url, tmp_path / "cache", HttpOptions(attempts=1))
    with pytest.raises(CacheWriteError, match="free space") as refused:
        store.fetch(KB, version)
    assert refusal_kind(refused.value) == ("disk_full", True)
    assert requested_files(server) == []


@pytest.fixture
def small_disk(tmp_path: Path) -> Iterator[Path]:
    """A 1 MiB tmpfs (root only; else skipped)."""
    with small_tmpfs(tmp_path, "1m") as mount:
        yield mount


def test_downloads_in_flight_together_cannot_promise_more_than_the_disk_holds(
    server: StaticServer, small_disk: Path
) -> None:
    """A second attack's R1: two versions of 600 kB each, a 1 MiB cache. The first one's
    download is in flight (its file sends nothing yet, within the pace its version's deadline,
    a long one, needs); the second is refused ``disk_full`` before any of its files is
    downloaded, the first one's bytes counted as taken (on main each download checked the free
    space alone, and the two together would have overrun the disk)."""
    version = version_id(1)
    for kb in ("first", "second"):
        write_version(
            server.root, version, EMBEDDER, kb=kb,
            damage=lambda f: with_extra_files(f, 1, size=600_000),
        )  # fmt: skip
    trickle(server, "first/" + version + "/pad0000.bin")
    store = HttpStore(server.url, small_disk, HttpOptions(attempts=1, version_timeout_s=1e9))
    failed: list[BaseException] = []

    def fetch_first() -> None:
        try:
            store.fetch("first", version)
        except StoreUnavailable as exc:  # cut by close() below
            failed.append(exc)

    first = threading.Thread(target=fetch_first)
    first.start()
    try:
        pad = "first/" + version + "/pad0000.bin"
        eventually_here(lambda: bool(server.requests(pad)), "its download", within_s=LOAD_WAIT_S)
        with pytest.raises(CacheWriteError, match="promised to downloads in progress") as refused:
            store.fetch("second", version)
        assert refusal_kind(refused.value) == ("disk_full", True)
        assert server.requests("second/" + version + "/pad0000.bin") == []
    finally:
        store.close()
        first.join()
    assert len(failed) == 1
    again = HttpStore(server.url, small_disk, HttpOptions(attempts=1))
    assert again.fetch("second", version).is_dir()  # the first's promise ended with it


def first_file(folder: Path, size: int) -> None:
    """Add a file of ``size`` bytes that a download fetches before the snapshot's (its name
    sorts first), listed in the manifest with its true sha256 and size."""
    manifest = json.loads((folder / MANIFEST).read_text())
    data = b"x" * size
    (folder / "0claim.bin").write_bytes(data)
    manifest["files"]["0claim.bin"] = hashlib.sha256(data).hexdigest()
    manifest["sizes"]["0claim.bin"] = size
    (folder / MANIFEST).write_text(json.dumps(manifest))


async def test_a_trickled_downloads_claim_on_the_cache_goes_to_another_callers_download(
    server: StaticServer, small_disk: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Attack s15 C: caller A's base claims (in its manifest) nearly all of the cache's free
    space, and the store trickles its file, a byte every 0.2 s (its read timeout never passes).
    Caller B's base, which fits beside what the hog really wrote, downloads and is answered:
    the hog's promise, behind the pace its version's deadline needs, is released for it and its
    download cut, refused ``unavailable`` (on main B was refused ``disk_full`` for as long as
    the trickle went on, up to ``http_version_timeout_s``)."""
    monkeypatch.setattr(http_store, "PACE_GRACE_S", 0.0)  # judged at once: no timing here
    monkeypatch.setattr(http_store, "START_GRACE_S", 0.0)
    version = version_id(1)
    write_version(server.root, version, EMBEDDER, kb="fast")
    base = sum(f.stat().st_size for f in (server.root / "fast" / version).iterdir())
    claim = shutil.disk_usage(small_disk).free - base - base // 2  # the hog's fits alone
    write_version(server.root, version, EMBEDDER, kb="hog", damage=lambda f: first_file(f, claim))
    hog_file = "hog/" + version + "/0claim.bin"
    server.hostile, server.hostile_suffix, server.trickle_s = "trickle", hog_file, 0.2
    config = lazy_config(server, tmp_path, ["hog", "fast"], cache=small_disk)
    sidecar = await create_server(config, embedder=EMBEDDER, poll=False)
    try:
        async with own_channel(sidecar.port) as a_ch, own_channel(sidecar.port) as b_ch:
            a = pb_grpc.RetrievalStub(a_ch)  # type: ignore[no-untyped-call]
            b = pb_grpc.RetrievalStub(b_ch)  # type: ignore[no-untyped-call]
            await refused_loading(a, "hog")
            await eventually(lambda: bool(server.requests(hog_file)), "the hog's trickle")
            room = cast(HttpStore, sidecar.refresher.store)._room

            def hog_behind() -> bool:
                now = time.monotonic()
                return any(p.behind(now) for p in list(room._promises.values()))

            await eventually(hog_behind, "the hog's download behind its pace")
            resp = await answered(b, "fast")
            assert {c.knowledge_base for c in resp.chunks} == {"fast"}

            def hog_cut() -> bool:
                refusal = sidecar.holder.last_refusal("hog")
                return refusal is not None and "its room in cache_dir" in refusal.reason

            await eventually(hog_cut, "the hog's download cut")
            refusal = sidecar.holder.last_refusal("hog")
            assert refusal is not None
            assert (refusal.kind, refusal.retried) == ("unavailable", True)
            assert sidecar.holder.get("hog") is None
    finally:
        await sidecar.stop(0.5)


def test_a_file_downloaded_again_from_zero_counts_only_its_new_bytes_as_taken(
    server: StaticServer, tmp_path: Path
) -> None:
    """A partial file of 40 kB (of 100 kB) and a server that ignores ``Range`` (a 200, the
    whole file): the file is written again from zero, and the download's promise of the cache's
    free space shrinks only by the bytes past the 40 kB it held (on main by every byte written,
    the rewritten ones counted twice: the promise ran out 40 kB early, and downloads running
    beside it could take bytes it still needed)."""
    version = version_id(1)
    write_version(
        server.root, version, EMBEDDER, damage=lambda f: with_extra_files(f, 1, size=100_000)
    )
    pad = server.root / KB / version / "pad0000.bin"
    partial = tmp_path / "cache" / KB / f"{PARTIAL}{version}"
    partial.mkdir(parents=True)
    (partial / pad.name).write_bytes(pad.read_bytes()[:40_000])
    server.ignore_range = True
    store = HttpStore(server.url, tmp_path / "cache", HttpOptions(attempts=1))
    seen: list[tuple[int, int]] = []  # the pad's bytes written, the promise left, at each write
    write = store._write

    def promise() -> int:
        promised = store._room._promises.get(threading.get_ident())
        return promised.left if promised is not None else 0

    def watched(f: BinaryIO, data: bytes) -> None:
        if not f.name.endswith(pad.name):
            return write(f, data)
        if not seen:
            seen.append((0, promise()))
        write(f, data)
        seen.append((seen[-1][0] + len(data), promise()))

    store._write = watched  # type: ignore[method-assign]
    assert store.fetch(KB, version).is_dir()
    assert [e.status for e in server.requests(pad.name)] == [200]  # Range asked, ignored
    assert seen[-1][0] == 100_000
    start = seen[0][1]
    assert [left for _, left in seen] == [start - max(0, w - 40_000) for w, _ in seen]


def test_a_download_counts_the_others_promises_as_taken_until_they_are_released() -> None:
    """``_Room``, where no tmpfs can be mounted: with 1,000 bytes free, one download promised
    600, another is refused 500 (told the 600 promised) and given 400; the first asking again
    counts only the other's promise; a released promise frees its bytes (a still clock: no
    promise is behind its pace)."""
    room = _Room(lambda: 0.0)
    with ThreadPoolExecutor(1) as other:  # one thread: a promise is its thread's

        def elsewhere(call: Callable[..., T], *args: float) -> T:
            return other.submit(call, *args).result()

        assert room.take(600, free=1_000, until=60.0) is None
        assert elsewhere(room.take, 500, 1_000, 60.0) == 600
        assert elsewhere(room.take, 400, 1_000, 60.0) is None
        assert room.take(700, free=1_000, until=60.0) == 400  # its own 600 is not in the way
        assert room.take(600, free=1_000, until=60.0) is None
        elsewhere(room.release)
        assert room.take(1_000, free=1_000, until=60.0) is None
        assert elsewhere(room.take, 1, 1_000, 60.0) == 1_000


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_a_promise_behind_its_pace_goes_to_a_download_that_needs_its_room() -> None:
    """``_Room`` with 1,000 bytes free (its clock driven): a promise of 600 to be written in a
    minute, nothing written past ``START_GRACE_S``, is released for a download of 500, and its
    thread told why (``cut``); a promise on its pace is not, and neither is one behind when
    releasing it would not make room."""
    clock = Clock()
    room = _Room(clock)
    with ThreadPoolExecutor(1) as other, ThreadPoolExecutor(1) as third:

        def on(pool: ThreadPoolExecutor, call: Callable[..., T], *args: object) -> T:
            return pool.submit(call, *args).result()

        assert on(other, room.take, 600, 1_000, clock.now + 60.0) is None
        assert on(third, room.take, 300, 1_000, clock.now + 60.0) is None
        on(third, room.wrote, 150)  # on its pace: 150 of 300 at once
        clock.now += http_store.START_GRACE_S + 1.0  # the 600 have no first byte: behind
        until = clock.now + 60.0
        assert room.take(900, free=1_000, until=until) == 750  # releasing 600 would not do
        assert on(other, room.cut) is None
        assert room.take(100, free=1_000, until=until) is None  # fits without releasing any
        assert room.take(500, free=1_000, until=until) is None  # the 600 behind go for it
        assert "its room in cache_dir was given to another download" in str(on(other, room.cut))
        assert on(third, room.cut) is None
        assert on(third, room.take, 600, 1_000, until) == 500  # the new 500 are taken, kept
        on(other, room.release)
        assert on(other, room.cut) is None  # a new download on that thread starts afresh


MIB = 2**20


def test_a_slow_first_byte_keeps_its_promise_and_a_trickled_claim_does_not() -> None:
    """``_Promise`` of 100 MiB to write within 60 s (clocks given, no timing): an honest
    download whose first byte took 1.6 s (a cold object, a retry's backoff) then writing
    10 MiB/s was behind at 1.6 s and cut for another's claim; now its pace counts from its
    first byte, and it is never behind. A claim trickled (its first byte at once, then 1 KiB a
    second) is behind a second or so after its first byte, and one that never sends a byte
    after ``START_GRACE_S``."""
    honest = _Promise(100 * MIB, 100 * MIB, since=0.0, until=60.0)
    assert not honest.behind(1.6)
    now = 1.6
    while honest.left:
        honest.wrote(MIB, now)
        now += 0.1
        assert not honest.behind(now), now
    trickle = _Promise(100 * MIB, 100 * MIB, since=0.0, until=60.0)
    trickle.wrote(1, 0.1)
    for second in range(1, 4):
        trickle.wrote(1024, 0.1 + second)
    assert trickle.behind(3.2)
    silent = _Promise(100 * MIB, 100 * MIB, since=0.0, until=60.0)
    assert not silent.behind(http_store.START_GRACE_S)
    assert silent.behind(http_store.START_GRACE_S + 0.1)


def test_a_download_waiting_for_its_first_byte_keeps_its_room() -> None:
    """``_Room``: a download that took its promise and has not written yet, its first byte
    still on the way past ``PACE_GRACE_S`` (it was cut then), is not cut for another
    download's take, and the other is refused, told the bytes promised (its clock driven)."""
    clock = Clock()
    room = _Room(clock)
    with ThreadPoolExecutor(1) as other:
        assert other.submit(room.take, 600, 1_000, clock.now + 60.0).result() is None
        clock.now += http_store.PACE_GRACE_S + 0.1  # well within START_GRACE_S
        assert room.take(500, free=1_000, until=clock.now + 60.0) == 600
        assert other.submit(room.cut).result() is None


def test_a_version_trickled_file_by_file_ends_at_the_version_deadline(
    server: StaticServer, tmp_path: Path
) -> None:
    """Files trickled a byte at a time: the version's deadline (half a second) ends the fetch
    long before a file's (a minute), and the refusal names its key."""
    version = version_id(1)
    write_version(server.root, version, EMBEDDER, damage=lambda f: with_extra_files(f, 2))
    server.hostile, server.hostile_suffix, server.trickle_s = "trickle", ".bin", 0.05
    options = HttpOptions(attempts=1, download_timeout_s=60.0, version_timeout_s=0.5)
    store = HttpStore(server.url, tmp_path / "cache", options)
    with pytest.raises(StoreUnavailable, match="http_version_timeout_s"):
        store.fetch(KB, version)


def test_a_trickled_manifest_ends_at_the_version_deadline(
    server: StaticServer, tmp_path: Path
) -> None:
    """The version's deadline covered its files, not its manifest: a trickled manifest ran to
    the download deadline (600 s by default; a second attack's R2)."""
    version = version_id(1)
    write_version(server.root, version, EMBEDDER)
    server.hostile, server.hostile_suffix, server.trickle_s = "trickle", "/manifest.json", 0.05
    options = HttpOptions(attempts=1, download_timeout_s=60.0, version_timeout_s=0.5)
    store = HttpStore(server.url, tmp_path / "cache", options)
    with pytest.raises(StoreUnavailable, match="http_version_timeout_s"):
        store.fetch(KB, version)


def lazy_config(
    server: StaticServer, tmp_path: Path, bases: Iterable[str], cache: Path | None = None
) -> Config:
    """A lazy sidecar's configuration serving ``bases`` from ``server`` into ``cache`` (reads
    allowed ten minutes, so a trickle holds its download for the whole test)."""
    cache = cache or tmp_path / "cache"
    keys = {"store": server.url, "listen": "127.0.0.1:0", "cache_dir": str(cache)}
    source = [{"name": "faq", "type": "markdown", "path": str(tmp_path)}]
    raw = {
        "knowledge_base": [{"name": kb, "source": source} for kb in bases],
        "sidecar": {
            **keys,
            "memory_budget_mb": 64,
            "http_timeout_s": 600,
            "min_score": -1.0,
            "budget_ms": 5_000,
        },
    }
    return parse_config(raw, base=tmp_path)


def trickle(server: StaticServer, suffix: str) -> None:
    """Answers for paths ending in ``suffix``: the headers, then silence until the server stops."""
    server.hostile, server.hostile_suffix, server.trickle_s = "trickle", suffix, 0.0


async def refused_loading(stub: pb_grpc.RetrievalStub, kb: str) -> str:
    """A call to ``kb`` not loaded: UNAVAILABLE at once; its details."""
    with pytest.raises(grpc.aio.AioRpcError) as loading:
        await stub.Search(search(kb), timeout=LOAD_WAIT_S)
    assert loading.value.code() is grpc.StatusCode.UNAVAILABLE
    return str(loading.value.details())


def slow_and_fast_bases(server: StaticServer, count: int) -> list[str]:
    """``count`` bases whose one extra file the store trickles (headers, then nothing), and a
    base ``fast`` that downloads at once; the slow ones' names."""
    version = version_id(1)
    slow = [f"slow{i}" for i in range(count)]
    for kb in slow:
        write_version(
            server.root, version, EMBEDDER, kb=kb, damage=lambda f: with_extra_files(f, 1)
        )
    write_version(server.root, version, EMBEDDER, kb="fast")
    trickle(server, "/" + version + "/pad0000.bin")
    return slow


# more slow bases than the two download threads of storefix's fix (review s13 #15)
@pytest.mark.parametrize("slow_bases", [1, 3])
async def test_bases_still_downloading_do_not_hold_another_bases_first_load(
    server: StaticServer, tmp_path: Path, slow_bases: int
) -> None:
    """Each slow base's file sends its headers, then nothing (each read allowed ten minutes); a
    call to another base, made after them, is answered while those downloads go on (on main one
    held every other base's load until it ended; with two download threads, two did)."""
    slow = slow_and_fast_bases(server, slow_bases)
    sidecar = await create_server(
        lazy_config(server, tmp_path, [*slow, "fast"]), embedder=EMBEDDER, poll=False
    )
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{sidecar.port}") as channel:
            stub = pb_grpc.RetrievalStub(channel)  # type: ignore[no-untyped-call]
            for kb in slow:
                await refused_loading(stub, kb)
            resp = await answered(stub, "fast")
            assert {c.knowledge_base for c in resp.chunks} == {"fast"}
            for kb in slow:
                assert sidecar.holder.get(kb) is None  # still downloading
                assert "is loading" in await refused_loading(stub, kb)
    finally:
        await sidecar.stop(0.5)


async def test_one_callers_trickling_downloads_do_not_hold_another_callers_first_load(
    server: StaticServer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Attack s15 B: caller A asks for more bases than there are download threads (4 here, 32
    in production), each of whose files the store trickles; caller B then asks for a base that
    downloads at once. B's pointer read and download start beside A's (at most half the threads
    are A's) and B is answered while A's go on (on main A's jobs took every thread and queued
    the rest ahead of B's in one FIFO pool: B waited for A's downloads' timeouts)."""
    monkeypatch.setattr(refresh, "MAX_DOWNLOADS", 4)
    monkeypatch.setattr(refresh, "DOWNLOAD_WAIT_S", 0.05)  # the loader goes through A's fast
    slow = slow_and_fast_bases(server, 6)
    sidecar = await create_server(
        lazy_config(server, tmp_path, [*slow, "fast"]), embedder=EMBEDDER, poll=False
    )
    try:
        async with own_channel(sidecar.port) as a_ch, own_channel(sidecar.port) as b_ch:
            a = pb_grpc.RetrievalStub(a_ch)  # type: ignore[no-untyped-call]
            b = pb_grpc.RetrievalStub(b_ch)  # type: ignore[no-untyped-call]
            for kb in slow:
                await refused_loading(a, kb)
            downloads = sidecar.refresher._downloads
            await eventually(lambda: set(downloads) == set(slow), "A's bases all offered")
            await eventually(lambda: bool(requested_files(server)), "A's downloads trickling")
            async with asyncio.timeout(LOAD_WAIT_S):
                resp = await answered(b, "fast")
            assert {c.knowledge_base for c in resp.chunks} == {"fast"}
            assert all(sidecar.holder.get(kb) is None for kb in slow)  # still trickling
            assert len(server.requests("fast/LATEST")) == 1
    finally:
        await sidecar.stop(0.5)


async def test_a_poll_downloading_a_new_version_does_not_hold_another_bases_first_load(
    server: StaticServer, tmp_path: Path
) -> None:
    """A loaded base's new version trickles while a poll fetches it: a call to another base is
    answered meanwhile (the poll downloaded under the load lock, holding every first load until
    the download ended), and the old version serves until the new one is in."""
    first, second = version_id(1), version_id(2)
    for kb in ("polled", "fast"):
        write_version(server.root, first, EMBEDDER, kb=kb)
    sidecar = await create_server(
        lazy_config(server, tmp_path, ["polled", "fast"]), embedder=EMBEDDER, poll=False
    )
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{sidecar.port}") as channel:
            stub = pb_grpc.RetrievalStub(channel)  # type: ignore[no-untyped-call]
            await answered(stub, "polled")
            write_version(
                server.root, second, EMBEDDER, kb="polled", damage=lambda f: with_extra_files(f, 1)
            )
            trickle(server, "polled/" + second + "/pad0000.bin")
            poll = asyncio.create_task(sidecar.refresher.refresh())
            await asyncio.sleep(0)  # the poll runs to its first wait (on main, in the lock)
            resp = await answered(stub, "fast")
            assert {c.knowledge_base for c in resp.chunks} == {"fast"}
            assert not poll.done()
            await eventually(lambda: bool(requested_files(server)))  # its download is going on
            served = sidecar.holder.get("polled")
            assert served is not None
            assert served.version == first
            poll.cancel()
    finally:
        await sidecar.stop(0.5)


async def test_a_trickled_pointer_does_not_hold_another_bases_first_load(
    server: StaticServer, tmp_path: Path
) -> None:
    """A second attack's R3: one base's ``LATEST`` sends its headers, then nothing (each read
    allowed ten minutes); a call to another base, made after it, is answered while that read
    goes on (on main the loader read each pointer in turn, the download alone on a thread)."""
    version = version_id(1)
    for kb in ("slow", "fast"):
        write_version(server.root, version, EMBEDDER, kb=kb)
    trickle(server, "slow/LATEST")
    sidecar = await create_server(
        lazy_config(server, tmp_path, ["slow", "fast"]), embedder=EMBEDDER, poll=False
    )
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{sidecar.port}") as channel:
            stub = pb_grpc.RetrievalStub(channel)  # type: ignore[no-untyped-call]
            await refused_loading(stub, "slow")
            resp = await answered(stub, "fast")
            assert {c.knowledge_base for c in resp.chunks} == {"fast"}
            assert sidecar.holder.get("slow") is None  # its pointer still trickles
            assert "is loading" in await refused_loading(stub, "slow")
    finally:
        await sidecar.stop(0.5)


async def test_a_base_loaded_on_demand_reads_its_pointer_once(
    server: StaticServer, tmp_path: Path
) -> None:
    """The download read ``LATEST``, then the load read it again under the load lock."""
    write_version(server.root, version_id(1), EMBEDDER, kb="fast")
    sidecar = await create_server(
        lazy_config(server, tmp_path, ["fast"]), embedder=EMBEDDER, poll=False
    )
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{sidecar.port}") as channel:
            stub = pb_grpc.RetrievalStub(channel)  # type: ignore[no-untyped-call]
            await answered(stub, "fast")
            assert len(server.requests("/fast/LATEST")) == 1
    finally:
        await sidecar.stop(0.5)


async def test_a_poll_serves_each_base_as_its_download_ends_not_after_a_trickling_one(
    server: StaticServer, tmp_path: Path
) -> None:
    """Two loaded bases get new versions; the first one's trickles. The poll downloads them
    side by side and serves the second's as soon as it is in (on main it downloaded them in
    turn, the second waiting for the first's whole download)."""
    first, second = version_id(1), version_id(2)
    for kb in ("slow", "fast"):
        write_version(server.root, first, EMBEDDER, kb=kb)
    sidecar = await create_server(
        lazy_config(server, tmp_path, ["slow", "fast"]), embedder=EMBEDDER, poll=False
    )
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{sidecar.port}") as channel:
            stub = pb_grpc.RetrievalStub(channel)  # type: ignore[no-untyped-call]
            for kb in ("slow", "fast"):
                await answered(stub, kb)
            write_version(
                server.root, second, EMBEDDER, kb="slow", damage=lambda f: with_extra_files(f, 1)
            )
            write_version(server.root, second, EMBEDDER, kb="fast")
            trickle(server, "slow/" + second + "/pad0000.bin")
            poll = asyncio.create_task(sidecar.refresher.refresh())

            def fast_swapped() -> bool:
                served = sidecar.holder.get("fast")
                return served is not None and served.version == second

            await eventually(fast_swapped)
            assert not poll.done()
            slow = sidecar.holder.get("slow")
            assert slow is not None
            assert slow.version == first  # the old version serves until the new one is in
            poll.cancel()
    finally:
        await sidecar.stop(0.5)


async def test_a_poll_whose_downloads_fail_leaves_one_partial_not_one_per_version(
    server: StaticServer, tmp_path: Path
) -> None:
    """Two new versions in turn whose file is always cut off: each poll's download fails
    (``unavailable``, resumed later), and the cache keeps the served version and the newest
    partial only (the refused downloads were pruned after a load, not after a download)."""
    first = version_id(1)
    write_version(server.root, first, EMBEDDER, kb="polled")
    sidecar = await create_server(
        lazy_config(server, tmp_path, ["polled"]), embedder=EMBEDDER, poll=False
    )
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{sidecar.port}") as channel:
            stub = pb_grpc.RetrievalStub(channel)  # type: ignore[no-untyped-call]
            await answered(stub, "polled")
            server.cut_suffix, server.cut_next = "pad0000.bin", 1000
            for n in (2, 3):
                write_version(
                    server.root, version_id(n), EMBEDDER, kb="polled",
                    damage=lambda f: with_extra_files(f, 1, size=100_000),
                )  # fmt: skip
                assert await sidecar.refresher.refresh() == []
                refusal = sidecar.holder.last_refusal("polled")
                assert refusal is not None
                assert (refusal.version, refusal.kind) == (version_id(n), "unavailable")
            cache = sorted(p.name for p in (tmp_path / "cache" / "polled").iterdir())
            assert cache == sorted([first, f"{PARTIAL}{version_id(3)}"])
    finally:
        await sidecar.stop(0.5)


def test_a_huge_etag_is_not_kept_and_the_pointer_is_read_again(
    server: StaticServer, tmp_path: Path
) -> None:
    """A store answering 60,000-byte ETags: each base's was kept whole for its next
    ``If-None-Match`` (http.client reads a header line of up to 64 KiB: 600 MB for 10,000
    bases). Now it is not kept, and each poll reads the pointer, as with no ETag; an ETag of
    the usual size is kept and answered 304 again."""
    version = version_id(1)
    write_version(server.root, version, EMBEDDER)
    store = HttpStore(server.url, tmp_path / "cache", HttpOptions(attempts=1))
    server.etag_pad = 60_000
    assert [store.latest(KB), store.latest(KB)] == [version, version]
    server.etag_pad = 0
    assert [store.latest(KB), store.latest(KB)] == [version, version]
    assert [e.status for e in server.requests(f"/{KB}/LATEST")] == [200, 200, 200, 304]
