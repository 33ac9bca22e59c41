"""One contract for every SnapshotStore (tantivy's directory tests), then the faults the HTTP and
S3 stores are both held to, then what only HTTP does.

The local store reads a folder in place; the HTTP store reads the same folder through a real
HTTP server on 127.0.0.1 and downloads into a cache; the S3 store reads it from a bucket of a
real S3-compatible server (moto, its own process on 127.0.0.1), which the folder is mirrored
into before each call. All must answer the same way (tests/test_s3_store.py has what only S3
does). Snapshots here use the HashEmbedder: these are tests of the store alone, not of
retrieval.
"""

from __future__ import annotations

import fcntl
import json
import threading
import time
from collections.abc import Callable, Collection, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

import pytest

import index.snapshot
import index.store
from index.embedders.base import HashEmbedder
from index.errors import (
    CacheWriteError,
    CorruptSnapshot,
    IncompatibleSnapshot,
    IncompleteSnapshot,
    SnapshotError,
    StoreUnavailable,
)
from index.http_store import PARTIAL, HttpOptions, HttpStore
from index.snapshot import CHUNKS, MANIFEST, VECTORS, load_snapshot, verify_snapshot
from index.store import LocalStore, SnapshotStore
from sidecar.cli import main
from tests.s3_kit import FaultProxy, Mirror, new_bucket, s3_client
from tests.snapshot_kit import (
    KB,
    TAMPERED,
    DiskFullStore,
    flip_a_byte,
    point_at,
    version_id,
    write_version,
)
from tests.static_http import LIARS, StaticServer

EMBEDDER = HashEmbedder(dimension=32)
FAST = HttpOptions(timeout_s=5.0, attempts=3, backoff_s=0.01, max_backoff_s=0.02)


@dataclass
class Env:
    root: Path  # where the publisher writes
    store: SnapshotStore
    server: StaticServer | None = None
    cache: Path | None = None  # where a downloading store keeps its copies


@pytest.fixture(params=["local", "http", "s3"])
def env(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Env]:
    root = tmp_path / "published"
    root.mkdir()
    if request.param == "local":
        yield Env(root, LocalStore(root))
        return
    if request.param == "s3":
        s3_extra()
        moto = request.getfixturevalue("moto_server")
        yield Env(
            root, mirrored_s3_store(root, moto.url, tmp_path / "cache"), None, tmp_path / "cache"
        )
        return
    server = StaticServer(root).start()
    try:
        yield Env(root, HttpStore(server.url, tmp_path / "cache", FAST), server, tmp_path / "cache")
    finally:
        server.stop()


def s3_extra() -> None:
    """Skip the S3 case where the `s3` extra (boto3) is not installed."""
    pytest.importorskip("boto3", reason="the S3 store is the `s3` extra")


class MirroredS3Store:
    """An S3Store whose bucket is made to hold the published folder before each call (the
    contract's tests publish, damage and repair snapshots in a folder)."""

    def __init__(self, mirror: Mirror, store: SnapshotStore) -> None:
        self.mirror, self.store = mirror, store

    def latest(self, knowledge_base: str) -> str | None:
        self.mirror.sync()
        return self.store.latest(knowledge_base)

    def fetch(self, knowledge_base: str, version: str) -> Path:
        self.mirror.sync()
        return self.store.fetch(knowledge_base, version)

    def retain(self, knowledge_base: str, versions: Collection[str]) -> None:
        self.store.retain(knowledge_base, versions)

    def knowledge_bases(self) -> frozenset[str]:
        self.mirror.sync()
        return self.store.knowledge_bases()

    def close(self) -> None:
        self.store.close()


def mirrored_s3_store(root: Path, endpoint: str, cache: Path) -> MirroredS3Store:
    from index.s3_store import S3Options, S3Store

    client = s3_client(endpoint)
    bucket = new_bucket(client)
    store = S3Store(f"s3://{bucket}/snapshots", cache, FAST, S3Options(endpoint_url=endpoint))
    return MirroredS3Store(Mirror(root, client, bucket, "snapshots"), store)


@dataclass
class Downloading:
    """A published folder, a downloading store's server with its fault switches (``fail_next``,
    ``cut_next``, ``hostile``, ``trickle_s``, ``requests``: tests/static_http.py's
    ``StaticServer``, or tests/s3_kit.py's ``FaultProxy`` in front of moto), and stores that
    read the folder through it."""

    root: Path
    server: Any
    open: Callable[[HttpOptions], HttpStore]
    sync: Callable[[], None]  # what the folder holds, into the bucket (S3)

    def publish(self, n: int = 1, topic: str = "password") -> Path:
        folder = write_version(self.root, version_id(n), EMBEDDER, topic)
        self.sync()
        return folder


@pytest.fixture(params=["http", "s3"])
def downloading(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Downloading]:
    """The HTTP store and the S3 store (signed requests through a proxy to moto), for the faults
    both are held to."""
    root = tmp_path / "published"
    root.mkdir()
    cache = tmp_path / "cache"
    if request.param == "http":
        server = StaticServer(root).start()
        try:
            yield Downloading(root, server, lambda o: HttpStore(server.url, cache, o), _nothing)
        finally:
            server.stop()
        return
    s3_extra()
    from index.s3_store import S3Options, S3Store

    moto = request.getfixturevalue("moto_server")
    client = s3_client(moto.url)
    bucket = new_bucket(client)
    proxy = FaultProxy(moto.port)
    via_proxy = S3Options(endpoint_url=proxy.url)
    try:
        yield Downloading(
            root,
            proxy,
            lambda o: S3Store(f"s3://{bucket}/snapshots", cache, o, via_proxy),
            Mirror(root, client, bucket, "snapshots").sync,
        )
    finally:
        proxy.stop()


def _nothing() -> None:
    pass


@pytest.fixture
def http(tmp_path: Path) -> Iterator[tuple[Path, StaticServer, HttpStore]]:
    root = tmp_path / "published"
    root.mkdir()
    server = StaticServer(root).start()
    try:
        yield root, server, HttpStore(server.url, tmp_path / "cache", FAST)
    finally:
        server.stop()


# -- the contract ----------------------------------------------------------------------------


def test_latest_is_none_when_nothing_is_published(env: Env) -> None:
    assert env.store.latest(KB) is None
    (env.root / KB).mkdir()
    assert env.store.latest(KB) is None


def test_latest_names_the_newest_published_version(env: Env) -> None:
    write_version(env.root, version_id(1), EMBEDDER, "password")
    assert env.store.latest(KB) == version_id(1)
    write_version(env.root, version_id(2), EMBEDDER, "roaming")
    assert env.store.latest(KB) == version_id(2)


def test_fetched_folder_holds_the_published_files(env: Env) -> None:
    published = write_version(env.root, version_id(1), EMBEDDER, "roaming")
    folder = env.store.fetch(KB, version_id(1))
    for name in (MANIFEST, VECTORS, CHUNKS):
        assert (folder / name).read_bytes() == (published / name).read_bytes()
    assert verify_snapshot(folder, EMBEDDER.info).version == version_id(1)
    snapshot = load_snapshot(folder, EMBEDDER.info)
    assert next(c.chunk_id for c in snapshot.chunks) == f"{version_id(1)}-0"


def test_a_pointer_at_a_version_that_is_not_there_is_incomplete(env: Env) -> None:
    (env.root / KB).mkdir()
    point_at(env.root, version_id(9))
    assert env.store.latest(KB) == version_id(9)
    with pytest.raises(IncompleteSnapshot):
        env.store.fetch(KB, version_id(9))


def test_a_version_missing_a_file_is_incomplete_until_the_file_arrives(env: Env) -> None:
    folder = write_version(env.root, version_id(1), EMBEDDER)
    kept = (folder / VECTORS).read_bytes()
    (folder / VECTORS).unlink()
    with pytest.raises(IncompleteSnapshot, match=VECTORS):
        env.store.fetch(KB, version_id(1))
    (folder / VECTORS).write_bytes(kept)
    assert verify_snapshot(env.store.fetch(KB, version_id(1))).version == version_id(1)


def test_a_corrupted_file_is_never_exposed(env: Env, tmp_path: Path) -> None:
    write_version(env.root, version_id(1), EMBEDDER, damage=flip_a_byte)
    with pytest.raises(CorruptSnapshot, match="sha256"):
        env.store.fetch(KB, version_id(1))
    if env.cache is not None:
        assert list((env.cache / KB).iterdir()) == []  # nothing kept, not even partial


def test_a_graph_that_lies_under_matching_checksums_is_never_exposed(env: Env) -> None:
    """An entry point past the last element, the manifest re-signed: hnswlib would crash on it
    (tests/test_snapshot_fuzz.py), and a load trusts what fetch checked, so fetch refuses it."""
    damage = TAMPERED["hnsw_entry_point_past_the_end"]
    write_version(env.root, version_id(1), EMBEDDER, damage=damage)
    with pytest.raises(CorruptSnapshot, match="entry point"):
        env.store.fetch(KB, version_id(1))
    if env.cache is not None:
        assert list((env.cache / KB).iterdir()) == []  # nothing kept, not even partial


def test_a_pointer_going_backwards_is_reported_as_written(env: Env) -> None:
    """The store does not judge the pointer; the refresher refuses a step back (test_refresh)."""
    write_version(env.root, version_id(1), EMBEDDER)
    write_version(env.root, version_id(2), EMBEDDER, "roaming")
    assert env.store.latest(KB) == version_id(2)
    point_at(env.root, version_id(1))
    assert env.store.latest(KB) == version_id(1)
    assert env.store.fetch(KB, version_id(1)).name == version_id(1)


@pytest.mark.parametrize("pointer", ["../../etc", "a/b", "x" * 300, ".hidden"])
def test_a_garbled_pointer_is_corrupt(env: Env, pointer: str) -> None:
    (env.root / KB).mkdir()
    (env.root / KB / "LATEST").write_text(pointer)
    with pytest.raises(CorruptSnapshot):
        env.store.latest(KB)


def test_retain_keeps_the_named_versions(env: Env) -> None:
    for n, topic in ((1, "password"), (2, "roaming"), (3, "voicemail")):
        write_version(env.root, version_id(n), EMBEDDER, topic)
        env.store.fetch(KB, version_id(n))
    env.store.retain(KB, [version_id(2), version_id(3)])
    for n in (2, 3):
        assert verify_snapshot(env.store.fetch(KB, version_id(n))).version == version_id(n)


# -- downloading stores: HTTP, and S3 where a test takes `downloading` ------------------------


def test_an_unchanged_pointer_costs_one_304(downloading: Downloading) -> None:
    store = downloading.open(FAST)
    downloading.publish(1)
    assert store.latest(KB) == version_id(1)
    assert store.latest(KB) == version_id(1)
    downloading.publish(2, "roaming")
    assert store.latest(KB) == version_id(2)
    assert [r.status for r in downloading.server.requests("/LATEST")] == [200, 304, 200]


def test_retain_deletes_downloads_not_named(http: tuple[Path, StaticServer, HttpStore]) -> None:
    root, _, store = http
    for n in (1, 2, 3):
        write_version(root, version_id(n), EMBEDDER)
        store.fetch(KB, version_id(n))
    store.retain(KB, [version_id(2), version_id(3)])
    assert sorted(p.name for p in (store.cache_dir / KB).iterdir()) == [
        version_id(2),
        version_id(3),
    ]


def test_a_cached_version_is_not_downloaded_again(
    http: tuple[Path, StaticServer, HttpStore],
) -> None:
    root, server, store = http
    write_version(root, version_id(1), EMBEDDER)
    first = store.fetch(KB, version_id(1))
    assert store.fetch(KB, version_id(1)) == first
    assert len(server.requests(f"/{VECTORS}")) == 1


def test_a_cached_version_is_verified_once_until_a_file_of_it_changes(
    http: tuple[Path, StaticServer, HttpStore], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The next start (another store on the same cache) neither hashes a cached copy nor checks
    its graph again; a copy whose graph was changed since (its manifest re-signed to match) is
    verified again, found damaged and downloaded anew."""
    root, server, store = http
    write_version(root, version_id(1), EMBEDDER)
    store.fetch(KB, version_id(1))
    verified: list[str] = []
    real = index.snapshot.verify_fetched
    monkeypatch.setattr(
        index.store, "verify_fetched", lambda folder: verified.append(folder.name) or real(folder)
    )
    again = HttpStore(server.url, store.cache_dir, FAST)
    folder = again.fetch(KB, version_id(1))
    assert verified == []
    TAMPERED["hnsw_entry_point_past_the_end"](folder)
    assert again.fetch(KB, version_id(1)) == folder
    assert verified == [version_id(1)]
    assert len(server.requests(f"/{VECTORS}")) == 2
    assert load_snapshot(folder, fetched=True).version == version_id(1)


def test_answers_500_for_a_while_are_retried(downloading: Downloading) -> None:
    store, server = downloading.open(FAST), downloading.server
    downloading.publish()
    server.fail_next = FAST.attempts - 1
    assert store.fetch(KB, version_id(1)).name == version_id(1)
    assert [r.status for r in server.requests(f"/{MANIFEST}")] == [500, 500, 200]


def test_answers_500_beyond_the_retries_are_unavailable_then_recover(
    http: tuple[Path, StaticServer, HttpStore],
) -> None:
    root, server, store = http
    write_version(root, version_id(1), EMBEDDER)
    server.fail_next = 1000
    with pytest.raises(StoreUnavailable, match="500"):
        store.latest(KB)
    with pytest.raises(StoreUnavailable, match="3 attempts"):
        store.fetch(KB, version_id(1))
    server.fail_next = 0
    assert store.fetch(KB, version_id(1)).name == version_id(1)


def test_a_closed_port_is_unavailable(tmp_path: Path) -> None:
    server = StaticServer(tmp_path).start()
    server.stop()  # the port is closed now: connection refused
    store = HttpStore(server.url, tmp_path / "cache", FAST)
    with pytest.raises(StoreUnavailable):
        store.latest(KB)
    with pytest.raises(StoreUnavailable):
        store.fetch(KB, version_id(1))


def test_a_body_cut_off_midway_is_resumed_with_range(downloading: Downloading) -> None:
    store, server = downloading.open(FAST), downloading.server
    downloading.publish()
    server.cut_suffix, server.cut_next = f"/{VECTORS}", 1
    folder = store.fetch(KB, version_id(1))
    assert verify_snapshot(folder).version == version_id(1)
    first, second = server.requests(f"/{VECTORS}")
    assert (first.status, first.range) == (200, "")
    assert second.status == 206
    assert second.range.startswith("bytes=")
    assert second.range != "bytes=0-"


def test_a_download_broken_off_resumes_on_the_next_fetch(tmp_path: Path) -> None:
    root = tmp_path / "published"
    root.mkdir()
    server = StaticServer(root).start()
    try:
        store = HttpStore(server.url, tmp_path / "cache", HttpOptions(attempts=1, timeout_s=5))
        write_version(root, version_id(1), EMBEDDER)
        server.cut_suffix, server.cut_next = f"/{VECTORS}", 1
        with pytest.raises(StoreUnavailable, match="cut off"):
            store.fetch(KB, version_id(1))
        assert (store.cache_dir / KB / f"{PARTIAL}{version_id(1)}" / VECTORS).is_file()
        assert verify_snapshot(store.fetch(KB, version_id(1))).version == version_id(1)
        assert server.requests(f"/{VECTORS}")[-1].status == 206
    finally:
        server.stop()


LIVENESS_S = 60.0  # a bound on waiting for a fetch to return, not a timing claim


def fetch_in_thread(store: HttpStore, version: str) -> tuple[threading.Thread, list[BaseException]]:
    errors: list[BaseException] = []

    def fetch() -> None:
        try:
            store.fetch(KB, version)
        except BaseException as exc:  # handed to the test
            errors.append(exc)

    thread = threading.Thread(target=fetch, daemon=True)
    thread.start()
    return thread, errors


def counted_writes(store: HttpStore, monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The size of every write to ``store``'s cache (the ``_write`` seam), as it happens."""
    sizes: list[int] = []
    write = store._write

    def counted(f: BinaryIO, data: bytes) -> None:
        sizes.append(len(data))
        write(f, data)

    monkeypatch.setattr(store, "_write", counted)
    return sizes


@pytest.mark.parametrize(
    ("downloading", "hostile"),
    [("http", "unbounded"), ("http", "oversize"), ("s3", "oversize")],
    indirect=["downloading"],
)
def test_a_file_served_past_its_manifest_size_is_cut_at_that_size_and_refused(
    downloading: Downloading, hostile: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Issue 14 (10): with no Content-Length, 501 MB reached the cache before the checksum
    failed. Now nothing past the manifest's size is written, and the version is corrupt."""
    store, server = downloading.open(FAST), downloading.server
    written = counted_writes(store, monkeypatch)
    folder = downloading.publish()
    server.hostile, server.hostile_suffix = hostile, f"/{VECTORS}"
    with pytest.raises(CorruptSnapshot, match="manifest"):
        store.fetch(KB, version_id(1))
    assert sum(written) <= sum(p.stat().st_size for p in folder.iterdir())
    assert not (store.cache_dir / KB / version_id(1)).exists()
    assert not (store.cache_dir / KB / f"{PARTIAL}{version_id(1)}").exists()
    server.hostile = ""  # the store mends: the same version downloads
    assert verify_snapshot(store.fetch(KB, version_id(1))).version == version_id(1)


def test_a_manifest_without_file_sizes_is_refused_before_any_download(
    http: tuple[Path, StaticServer, HttpStore],
) -> None:
    root, server, store = http
    folder = write_version(root, version_id(1), EMBEDDER)
    manifest = json.loads((folder / MANIFEST).read_text())
    del manifest["sizes"]
    (folder / MANIFEST).write_text(json.dumps(manifest))
    with pytest.raises(CorruptSnapshot, match="sizes"):
        store.fetch(KB, version_id(1))
    assert server.requests(f"/{VECTORS}") == []


@pytest.mark.parametrize("path", [f"/{MANIFEST}", "/LATEST"])
def test_an_endless_manifest_or_pointer_is_cut_at_its_cap(
    path: str, http: tuple[Path, StaticServer, HttpStore]
) -> None:
    root, server, store = http
    write_version(root, version_id(1), EMBEDDER)
    server.hostile, server.hostile_suffix = "unbounded", path
    with pytest.raises(CorruptSnapshot, match="over"):
        store.latest(KB) if path == "/LATEST" else store.fetch(KB, version_id(1))


def test_a_trickling_download_ends_at_its_deadline_and_resumes_later(
    downloading: Downloading,
) -> None:
    """A byte every 0.05 s never trips the per-read timeout; the download's deadline ends it,
    and what came is kept for the next poll."""
    # the deadline is per file: 2 s, so the small files before the trickled one finish within
    # theirs on a loaded machine (at 0.5 s one did not, under a load average of 14)
    options = HttpOptions(timeout_s=5.0, download_timeout_s=2.0, attempts=2, backoff_s=0.01)
    store, server = downloading.open(options), downloading.server
    downloading.publish()
    server.hostile, server.hostile_suffix, server.trickle_s = "trickle", f"/{VECTORS}", 0.05
    thread, errors = fetch_in_thread(store, version_id(1))
    thread.join(LIVENESS_S)
    assert not thread.is_alive(), "the trickle held the download past its deadline"
    (error,) = errors
    assert isinstance(error, StoreUnavailable)
    assert "http_download_timeout_s" in str(error)
    assert len(server.requests(f"/{VECTORS}")) == 1  # the deadline is not retried
    partial = store.cache_dir / KB / f"{PARTIAL}{version_id(1)}" / VECTORS
    assert partial.stat().st_size > 0
    server.hostile = ""
    assert verify_snapshot(store.fetch(KB, version_id(1))).version == version_id(1)
    assert server.requests(f"/{VECTORS}")[-1].status == 206  # resumed


@pytest.mark.parametrize("lie", LIARS)
def test_an_answer_whose_head_or_trailer_never_ends_ends_at_the_deadline(
    downloading: Downloading, lie: str
) -> None:
    """Endless ``100 Continue`` answers, a chunked trailer without end, headers trickled: loops
    inside http.client, where no read times out and the deadline between reads never came.
    The pointer and a file each end StoreUnavailable naming the deadline (not the corrupt
    answer the cut could leave), and the store reads on once the server tells the truth."""
    options = HttpOptions(timeout_s=5.0, download_timeout_s=2.0, attempts=2, backoff_s=0.01)
    store, server = downloading.open(options), downloading.server
    downloading.publish()
    server.hostile, server.trickle_s = lie, 0.05
    for suffix, read in (("/LATEST", lambda: store.latest(KB)),
                         (f"/{VECTORS}", lambda: store.fetch(KB, version_id(1)))):  # fmt: skip
        server.hostile_suffix = suffix
        errors: list[BaseException] = []
        thread = threading.Thread(target=_caught, args=(read, errors), daemon=True)
        thread.start()
        thread.join(LIVENESS_S)
        assert not thread.is_alive(), f"{lie} held {suffix} past its deadline"
        (error,) = errors
        assert isinstance(error, StoreUnavailable), error
        assert "not downloaded within 2 s ([sidecar] http_download_timeout_s)" in str(error)
        assert len(server.requests(suffix)) == 1  # the deadline is not retried
    server.hostile = ""
    assert store.latest(KB) == version_id(1)
    assert verify_snapshot(store.fetch(KB, version_id(1))).version == version_id(1)


def _caught(read: Callable[[], object], errors: list[BaseException]) -> None:
    try:
        read()
    except BaseException as exc:
        errors.append(exc)


def test_close_cuts_a_download_blocked_on_a_silent_server(downloading: Downloading) -> None:
    """The server sends headers, then nothing; a read would wait an hour. ``close`` (what a
    drain calls) shuts the socket down and the fetch returns StoreUnavailable at once."""
    store = downloading.open(HttpOptions(timeout_s=3600.0, download_timeout_s=3600.0))
    server = downloading.server
    downloading.publish()
    server.hostile, server.hostile_suffix, server.trickle_s = "trickle", f"/{VECTORS}", 0.0
    thread, errors = fetch_in_thread(store, version_id(1))
    deadline = time.monotonic() + LIVENESS_S
    while not server.requests(f"/{VECTORS}"):
        assert time.monotonic() < deadline, "the download never started"
        time.sleep(0.01)
    store.close()
    thread.join(LIVENESS_S)
    assert not thread.is_alive(), "close did not cut the blocked read"
    (error,) = errors
    assert isinstance(error, StoreUnavailable)
    assert "closed" in str(error)


def test_a_full_disk_is_a_cache_write_error_and_frees_the_partial(tmp_path: Path) -> None:
    root = tmp_path / "published"
    root.mkdir()
    server = StaticServer(root).start()
    try:
        store = DiskFullStore(server.url, tmp_path / "cache", FAST)
        write_version(root, version_id(1), EMBEDDER)
        served = store.fetch(KB, version_id(1))
        write_version(root, version_id(2), EMBEDDER, "roaming")
        store.full = True
        with pytest.raises(CacheWriteError, match="disk full") as err:
            store.fetch(KB, version_id(2))
        assert isinstance(err.value.__cause__, OSError)
        assert sorted(p.name for p in (tmp_path / "cache" / KB).iterdir()) == [version_id(1)]
        assert verify_snapshot(served).version == version_id(1)
        store.full = False
        assert store.fetch(KB, version_id(2)).name == version_id(2)
    finally:
        server.stop()


# -- publishing to a folder an HTTP server serves, and verifying -----------------------------


def _config_file(tmp_path: Path) -> Path:
    path = tmp_path / "voxrecall.toml"
    path.write_text(
        f"""
[[knowledge_base]]
name = "{KB}"
[[knowledge_base.source]]
type = "markdown"
path = "docs"

[index]
store = "{tmp_path / "built"}"
""",
        encoding="utf-8",
    )
    return path


def test_index_publish_copies_to_a_folder_an_http_store_reads(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    config = _config_file(tmp_path)
    write_version(tmp_path / "built", version_id(1), EMBEDDER)
    served = tmp_path / "served"
    assert main(["index", "publish", "--config", str(config), "--to", str(served)]) == 0
    assert main(["index", "publish", "--config", str(config), "--to", str(served)]) == 0
    out = capsys.readouterr().out
    assert "published" in out
    assert "already has" in out
    server = StaticServer(served).start()
    try:
        store = HttpStore(server.url, tmp_path / "cache", FAST)
        assert store.latest(KB) == version_id(1)
        assert verify_snapshot(store.fetch(KB, version_id(1))).version == version_id(1)
    finally:
        server.stop()


def test_index_publish_refuses_a_corrupted_snapshot(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    config = _config_file(tmp_path)
    write_version(tmp_path / "built", version_id(1), EMBEDDER, damage=flip_a_byte)
    served = tmp_path / "served"
    assert main(["index", "publish", "--config", str(config), "--to", str(served)]) == 2
    assert "sha256" in capsys.readouterr().err
    assert LocalStore(served).latest(KB) is None


def test_snapshot_verify_checks_the_embedder_when_given_a_config(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    folder = write_version(tmp_path / "built", version_id(1), EMBEDDER)
    assert main(["snapshot", "verify", str(folder)]) == 0
    config = _config_file(tmp_path)
    assert main(["snapshot", "verify", str(folder), "--config", str(config)]) == 2
    assert "test/hash (32-d)" in capsys.readouterr().err


def test_verifying_without_hashing_still_checks_the_rest(tmp_path: Path) -> None:
    """What a load after ``fetch`` skips is the hashing alone (fetch hashed every file)."""
    folder = write_version(tmp_path, version_id(1), EMBEDDER)
    other = HashEmbedder(dimension=16).info
    with pytest.raises(IncompatibleSnapshot, match="embedder"):
        load_snapshot(folder, other, checksums=False)
    (folder / CHUNKS).unlink()
    with pytest.raises(CorruptSnapshot, match=f"{CHUNKS} is missing"):
        load_snapshot(folder, EMBEDDER.info, checksums=False)


# -- two publishers of one base -----------------------------------------------------------------


def test_a_publisher_waits_for_another_and_never_moves_latest_back(tmp_path: Path) -> None:
    """A publish that read LATEST before another publisher wrote a newer one would leave LATEST
    naming the older version: one publisher of a base at a time, the check made inside."""
    root = tmp_path / "published"
    write_version(root, version_id(1), EMBEDDER)
    store = LocalStore(root)
    older = store.staging_dir(KB)
    (older / MANIFEST).write_bytes(b"{}")  # publish moves folders; it reads no manifest
    outcome: list[BaseException | Path] = []
    with open(root / KB / index.store.PUBLISH_LOCK, "a+b") as held:
        fcntl.flock(held, fcntl.LOCK_EX)  # another publisher, mid-publish
        waiting = threading.Thread(target=_publish_into, args=(store, older, outcome))
        waiting.start()
        waiting.join(0.3)
        assert waiting.is_alive()  # waits for the lock,
        assert not outcome  # having published nothing
        write_version(root, version_id(3), EMBEDDER)  # what the other publisher wrote
    waiting.join(10)
    assert store.latest(KB) == version_id(3)
    [refusal] = outcome
    assert isinstance(refusal, SnapshotError)
    assert f"{version_id(2)} is not newer than the published {version_id(3)}" in str(refusal)


def _publish_into(store: LocalStore, staging: Path, outcome: list[BaseException | Path]) -> None:
    try:
        outcome.append(store.publish(KB, staging, version_id(2)))
    except SnapshotError as exc:
        outcome.append(exc)


def test_a_lock_that_cannot_be_taken_is_refused_in_one_line_and_nothing_moves(
    tmp_path: Path,
) -> None:
    root = tmp_path / "published"
    write_version(root, version_id(1), EMBEDDER)
    store = LocalStore(root)
    (root / KB / index.store.PUBLISH_LOCK).mkdir()  # not a file anyone can lock
    staging = store.staging_dir(KB)
    (staging / MANIFEST).write_bytes(b"{}")
    with pytest.raises(SnapshotError) as refused:
        store.publish(KB, staging, version_id(2))
    assert "cannot lock it to publish" in str(refused.value)
    assert "\n" not in str(refused.value)
    assert store.latest(KB) == version_id(1)
    assert staging.is_dir()  # the build's folder is left for its caller to clean
