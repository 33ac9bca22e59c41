"""Snapshots served over HTTP(S) by any static server, CDN or object-store endpoint.

    GET <base>/<kb>/LATEST                    polled with If-None-Match: unchanged costs one 304
    GET <base>/<kb>/<version>/manifest.json   first, kept in memory until the end
    GET <base>/<kb>/<version>/<file>          each file the manifest lists; resumed with Range

A version is downloaded into ``<cache>/<kb>/.partial-<version>/``; each file is checked against
the manifest's sha256, the manifest is written last, and the folder is renamed to
``<cache>/<kb>/<version>/``. So a version-named folder in the cache is always complete and
verified, and a broken download leaves at most a ``.partial-`` folder that the next try resumes.

Before a version's files are downloaded, the bytes it still needs are promised to it out of
the cache's free space (``_Room``), less what the other downloads in flight still have to
write: downloads running together cannot together overrun the disk (``disk_full``). A promise
is kept only at the pace that writes it by the version's deadline, counted from its first byte
(``START_GRACE_S`` for that byte to come): a download that needs room
held by downloads behind that pace (a manifest claiming much, its bytes trickled) takes it, and
those downloads are cut (StoreUnavailable, tried again), so claims cannot hold the disk.

Every answer is capped: a file at the size its manifest records, the manifest at
``MAX_MANIFEST_BYTES``, the pointer at ``MAX_POINTER_BYTES``; more is a CorruptSnapshot, and no
byte past the cap is written. Every download has a total deadline
(``HttpOptions.download_timeout_s``) besides the per-read timeout, so a server trickling a byte
at a time cannot hold a refresh: a timer shuts the request's socket down when it passes, so it
also ends what http.client reads in loops of its own (the status line and headers, endless
``100 Continue`` answers, a chunked body's trailer), and the request fails StoreUnavailable,
whatever the cut made http.client raise or return. ``close()`` cuts the downloads in progress
the same way, so a drain never waits for one.

A redirect is followed only within the store's own scheme, host and port: one elsewhere would
hand the request's headers (an S3 store's signature) to another host, or send them in clear
text; it is refused as the store being unavailable, naming where it led.

Blocking (urllib, stdlib only): the refresher calls it from a worker thread. Proxies from the
environment are not used: nothing below the entry point reads the environment.
"""

from __future__ import annotations

import contextlib
import errno
import http.client
import io
import logging
import os
import shutil
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable, Collection, Iterator
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import BinaryIO, TypeVar
from urllib.parse import quote

from index.errors import (
    CacheWriteError,
    CorruptSnapshot,
    IncompleteSnapshot,
    StoreUnavailable,
    one_line,
    shortened,
)
from index.http_bounds import Connections, SameOrigin, opener
from index.snapshot import (
    MANIFEST,
    MAX_MANIFEST_BYTES,
    Manifest,
    check_graphs,
    fsync_dir,
    read_manifest,
    sha256_file,
)
from index.store import (
    LATEST,
    MAX_POINTER_BYTES,
    Verified,
    check_name,
    is_version,
    manifest_files,
    parse_pointer,
)

log = logging.getLogger("voxrecall.store")

PARTIAL = ".partial-"
# The cache's records of what fetch verified (``index.store.Verified``): no base's name starts
# with a dot, so no base's folder is this one.
VERIFIED = ".verified"
_MISSING = frozenset({404, 410})  # the file is not there (yet): a half-uploaded version
_RETRYABLE = frozenset({408, 425, 429, 500, 502, 503, 504})
# Files one version may list: a build writes DATA_FILES and a few beside them (summaries,
# originals); a manifest listing thousands (its 256 KiB hold ~2,500) is not a snapshot,
# and each would be one more download (and deadline) before the version could be refused.
MAX_VERSION_FILES = 64
# What a store's own words (an HTTP reason phrase, a connection error's text) keep in a message:
# a phrase is a word or two; http.client reads a status line of up to 64 KiB, and a message that
# carries it whole goes into every refusal, Status answer, gRPC status and log line.
MAX_REASON_BYTES = 200
# The longest ETag a store's pointer is remembered by (for ``If-None-Match``): a server's is a
# hash or a size and time, tens of bytes; http.client reads a header line of up to 64 KiB, and one
# kept per base (10,000 bases from a listing) could hold 640 MB. One longer is not kept: that
# base's next poll reads its pointer's body, as for a store that sends no ETag. (http.client
# reads headers as ISO-8859-1: one character a byte.)
MAX_ETAG_BYTES = 256
_T = TypeVar("_T")


@dataclass(frozen=True, slots=True)
class HttpOptions:
    """Timeouts and retries of an HttpStore.

    ``timeout_s`` bounds each connect and each read: a static server answers in milliseconds, so
    ten seconds of silence is a dead connection, not a slow one. ``download_timeout_s`` bounds
    each download as a whole, from the connection's set-up to the body's last byte (a timer shuts
    the socket down when it passes; the connect and, for https, the TLS handshake are bounded by
    ``timeout_s`` each, so the deadline may be passed by up to ``timeout_s`` an address tried).
    A file is tried ``attempts``
    times with backoff ``backoff_s`` doubling up to ``max_backoff_s``: the defaults ride out
    about seven seconds of errors within one poll; longer outages are retried on the next poll.
    """

    timeout_s: float = 10.0
    # A whole file, every attempt included: a 2 GB vectors file at 4 MB/s. A server that sends
    # a byte every few seconds passes every per-read timeout; this ends it.
    download_timeout_s: float = 600.0
    # A whole version, every file included: without it a version of N files trickled could hold
    # a refresh for N x download_timeout_s.
    version_timeout_s: float = 1800.0
    attempts: int = 4
    backoff_s: float = 0.5
    max_backoff_s: float = 8.0
    block_bytes: int = 1 << 20


@dataclass(frozen=True, slots=True)
class _Pointer:
    etag: str
    version: str | None


class _Retry(Exception):
    """One attempt failed in a way the next attempt may not (5xx, reset, cut-off body)."""


class _TooLong(Exception):
    """An answer went past its cap; the caller names what was capped."""


# A download's promise of the cache's free space must be kept at the pace its version's
# deadline needs (``_Promise.behind``), measured from its first byte written: its first byte
# may take this long (a request's connect, a cold object's first byte, the backoff of a retry
# or two: 0.5 s, then 1 s at the defaults) ...
START_GRACE_S = 10.0
# ... and from that byte on, the pace counts after this long to get going (a file's first
# bytes). One behind is released when another download needs its room (``_Room.take``).
PACE_GRACE_S = 1.0


@dataclass(slots=True)
class _Promise:
    """One download's promise: ``need`` bytes at ``since`` (monotonic), ``left`` still to write,
    ``again`` deleted to be written again; ``until``: its version's deadline (monotonic);
    ``first``: when its first byte was written (None: not yet)."""

    need: int
    left: int
    since: float
    until: float
    again: int = 0
    first: float | None = None

    def behind(self, now: float) -> bool:
        """Whether it wrote no byte within ``START_GRACE_S``, or since its first byte (less
        ``PACE_GRACE_S``) less than its share of ``need`` at the pace that writes all of it by
        ``until``: a trickle's promise, which its download cannot keep. A slow first byte
        costs an honest download nothing; a claim trickled is behind a second after its first
        byte, one never sent after ``START_GRACE_S``."""
        if self.first is None:
            return now - self.since > START_GRACE_S
        going = now - self.first - PACE_GRACE_S
        if going <= 0:
            return False
        span = max(self.until - self.first - PACE_GRACE_S, 1e-3)  # the pace's time
        due = int(self.need * min(1.0, going / span))
        return self.need - self.left < due

    def wrote(self, count: int, now: float) -> None:
        """``count`` bytes written at ``now``: those past ``again`` are new."""
        if count and self.first is None:
            self.first = now
        again = min(count, self.again)
        self.again -= again
        self.left = max(0, self.left - (count - again))

    def cut_reason(self, now: float) -> str:
        return (
            f"cut after {now - self.since:.1f} s, {self.need - self.left} of the {self.need} "
            "bytes its manifest claims written: behind the pace that ends by "
            "[sidecar] http_version_timeout_s, its room in cache_dir was given to another "
            "download; tried again on a later call"
        )


class _Room:
    """The cache's bytes promised to the downloads in flight, one per thread (a fetch is one
    thread's): what each still has to write, by its manifest's sizes. A download's check of the
    free space counts the others' as taken, so downloads running together (up to 48 bases at
    once: 32 first loads', 16 a poll's) cannot together overrun the disk; each promise shrinks as
    its new bytes are written: a file deleted to be written again from zero (``rewrites``) takes
    no more of the disk until its bytes pass its old size.

    A manifest may claim any sizes, and a store may trickle the bytes: a promise kept only by
    its deadline held its room for that long (claims of 2^35..2^12 bytes, trickled, took a
    disk's free space; every other base was refused ``disk_full``). So a download that needs
    room held by downloads behind their pace (``_Promise.behind``) takes it: those promises are
    released at once, largest first, and their downloads fail (``cut``: StoreUnavailable, tried
    again) at their next read or write."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._lock = threading.Lock()
        self._promises: dict[int, _Promise] = {}  # thread -> its download's promise
        self._cut: dict[int, str] = {}  # thread -> why its promise was released

    def take(self, need: int, free: int, until: float) -> int | None:
        """Promise ``need`` bytes to this thread's download, to be written by ``until``
        (the clock's), when ``free`` minus the others' promises holds them, once
        those behind their pace are released if that makes room (None); else the bytes
        promised to the others."""
        with self._lock:
            me = threading.get_ident()
            now = self._clock()
            others = {t: p for t, p in self._promises.items() if t != me}
            taken = sum(p.left for p in others.values())
            if need > free - taken:
                released = self._behind(others, need - (free - taken), now)
                if released is None:
                    return taken
                for thread in released:
                    self._cut[thread] = self._promises.pop(thread).cut_reason(now)
            self._promises[me] = _Promise(need, need, now, until)
            return None

    @staticmethod
    def _behind(others: dict[int, _Promise], short: int, now: float) -> list[int] | None:
        """The threads whose promises, behind their pace, release at least ``short`` bytes,
        largest first; None when all of them would not."""
        behind = sorted(
            (t for t, p in others.items() if p.behind(now)), key=lambda t: -others[t].left
        )
        released: list[int] = []
        for thread in behind:
            if short <= 0:
                break
            released.append(thread)
            short -= others[thread].left
        return released if short <= 0 else None

    def cut(self) -> str | None:
        """Why this thread's promise was released for another download's (None: it was not)."""
        with self._lock:
            return self._cut.get(threading.get_ident())

    def rewrites(self, count: int) -> None:
        """This thread's download deleted ``count`` bytes it writes again: not new bytes."""
        with self._lock:
            promise = self._promises.get(threading.get_ident())
            if promise is not None:
                promise.again += count

    def wrote(self, count: int) -> None:
        with self._lock:
            promise = self._promises.get(threading.get_ident())
            if promise is not None:
                promise.wrote(count, self._clock())

    def release(self) -> None:
        with self._lock:
            self._promises.pop(threading.get_ident(), None)
            self._cut.pop(threading.get_ident(), None)


class HttpStore:
    """A SnapshotStore over HTTP(S) with a local cache of verified downloads.

    >>> store = HttpStore("https://cdn.example.com/snapshots", Path("/var/cache/voxrecall"))
    >>> version = store.latest("support")          # one small request; a 304 when unchanged
    >>> folder = store.fetch("support", version)   # downloaded, verified, then exposed
    """

    checks_graphs = True  # fetch checks the graphs' layout too (``Verified``)

    def __init__(self, base_url: str, cache_dir: Path, options: HttpOptions | None = None) -> None:
        self.base_url = base_url.rstrip("/")
        self.cache_dir = cache_dir
        self.options = options or HttpOptions()
        self.verified = Verified(cache_dir / VERIFIED)  # a cached version is not hashed again
        self._pointers: dict[str, _Pointer] = {}
        self._closed = threading.Event()
        self._fetch_locks: dict[str, threading.Lock] = {}
        self._locks_lock = threading.Lock()
        self._connections = Connections()
        self._room = _Room()
        self._opener = opener(self._connections, SameOrigin())

    def __repr__(self) -> str:
        return f"HttpStore({self.base_url!r}, cache={str(self.cache_dir)!r})"

    # -- SnapshotStore ----------------------------------------------------------------------

    def latest(self, knowledge_base: str) -> str | None:
        check_name(knowledge_base, "knowledge base", self.base_url)  # it names a cache folder
        url = self._url(knowledge_base, LATEST)
        known = self._pointers.get(knowledge_base)
        # no-cache: a CDN in between must revalidate the pointer, not answer from its copy
        headers = {"Cache-Control": "no-cache"}
        if known is not None:
            headers["If-None-Match"] = known.etag
        deadline = time.monotonic() + self.options.download_timeout_s
        try:
            with self._within(url, deadline), self._open(url, headers) as resp:
                data = self._read_all(resp, url, MAX_POINTER_BYTES, deadline)
                etag = resp.headers.get("ETag")
        except _TooLong as exc:
            raise CorruptSnapshot(f"{url}: over {MAX_POINTER_BYTES} bytes, not a pointer") from exc
        except _Retry as exc:
            raise StoreUnavailable(f"{url}: {exc}") from exc
        except urllib.error.HTTPError as exc:
            exc.close()
            if exc.code == 304 and known is not None:
                return known.version
            if exc.code in _MISSING:
                self._pointers.pop(knowledge_base, None)
                return None
            raise StoreUnavailable(f"{url}: {_status(exc)}") from exc
        except (OSError, http.client.HTTPException) as exc:
            raise StoreUnavailable(f"{url}: {_why(exc)}") from exc
        version = parse_pointer(data, url)
        if etag and len(etag) <= MAX_ETAG_BYTES:
            self._pointers[knowledge_base] = _Pointer(etag, version)
        else:
            self._pointers.pop(knowledge_base, None)
        return version

    def fetch(self, knowledge_base: str, version: str) -> Path:
        """One fetch of a base at a time (the refresher may download a base in the background
        while a poll fetches another version of it): both would write one partial folder."""
        check_name(knowledge_base, "knowledge base", self.base_url)
        check_name(version, "version", self.base_url)
        with self._locks_lock:
            lock = self._fetch_locks.setdefault(knowledge_base, threading.Lock())
        with lock:
            try:
                return self._fetch(knowledge_base, version)
            finally:
                self._room.release()  # what it promised itself of the cache (``_sizes``)

    def _fetch(self, knowledge_base: str, version: str) -> Path:
        base = self.cache_dir / knowledge_base
        done = base / version
        if done.is_dir():
            try:
                self.verified.ensure(done, read_manifest(done), knowledge_base, version)
                return done
            except CorruptSnapshot as exc:
                log.warning("cached %s is damaged (%s): downloading it again", done, exc)
                shutil.rmtree(done, ignore_errors=True)
        partial = base / f"{PARTIAL}{version}"
        try:
            partial.mkdir(parents=True, exist_ok=True)
            manifest = self._download_version(knowledge_base, version, partial)
            check_graphs(partial, manifest)  # every sha256 matched as it downloaded
            partial.rename(done)
            fsync_dir(base)
            self.verified.remember(done, manifest, knowledge_base, version)
        except CacheWriteError:
            shutil.rmtree(partial, ignore_errors=True)  # free the space for what still serves
            raise
        except OSError as exc:
            shutil.rmtree(partial, ignore_errors=True)
            raise _cache_error(partial, exc) from exc
        except CorruptSnapshot:
            shutil.rmtree(partial, ignore_errors=True)  # never resume from bytes that lied
            raise
        return done

    def retain(self, knowledge_base: str, versions: Collection[str]) -> None:
        """Delete cached versions not named (a refused one too), and every partial download
        but the newest one's, when it is newer than them all (the next poll resumes it): so the
        cache holds ``versions`` and one download in progress, whatever the store offers."""
        base = self.cache_dir / check_name(knowledge_base, "knowledge base", self.base_url)
        if not base.is_dir():
            return
        partials = sorted(
            e.name[len(PARTIAL) :] for e in base.iterdir() if e.name.startswith(PARTIAL)
        )
        resumed = partials[-1] if partials and partials[-1] > max(versions, default="") else None
        for entry in base.iterdir():
            if entry.name.startswith(PARTIAL):
                if entry.name[len(PARTIAL) :] != resumed:
                    shutil.rmtree(entry, ignore_errors=True)
            elif is_version(entry.name) and entry.name not in versions:
                shutil.rmtree(entry, ignore_errors=True)
                self.verified.forget(knowledge_base, entry.name)

    def knowledge_bases(self) -> frozenset[str]:
        """Empty: a static HTTP server cannot be listed; name the bases in the config."""
        return frozenset()

    def close(self) -> None:
        """Abandon every wait and cut every download in progress (a drain)."""
        self._closed.set()
        self._connections.close()

    # -- downloading ------------------------------------------------------------------------

    def _download_version(self, kb: str, version: str, partial: Path) -> Manifest:
        url = self._url(kb, version, MANIFEST)
        deadline = time.monotonic() + self.options.version_timeout_s  # the manifest's too
        try:
            raw = self._with_retries(url, lambda: self._get_small(url, deadline))
            manifest = Manifest.from_json(raw, url)
            if manifest.version != version or manifest.knowledge_base != kb:
                raise CorruptSnapshot(
                    f"{url}: manifest is of {manifest.knowledge_base} {manifest.version}, "
                    f"not {kb} {version}"
                )
            sizes = self._sizes(manifest, url, partial, deadline)
            for name, size in sizes.items():
                self._download_file(
                    self._url(kb, version, name), partial / name, manifest.files[name], size,
                    deadline,
                )  # fmt: skip
        except StoreUnavailable as exc:
            if time.monotonic() < deadline:
                raise
            raise StoreUnavailable(
                f"{kb} {version}: not downloaded within {self.options.version_timeout_s:g} s "
                "([sidecar] http_version_timeout_s); tried again on the next poll"
            ) from exc
        self._write_file(partial / MANIFEST, raw)
        fsync_dir(partial)
        return manifest

    def _sizes(
        self, manifest: Manifest, url: str, partial: Path, deadline: float
    ) -> dict[str, int]:
        """Each file's size to cap its download at, checked before any download: at most
        ``MAX_VERSION_FILES`` files, and the bytes still to download within the cache's free
        space, promised to this download until ``deadline`` at the latest (a manifest may claim
        any sizes: it is refused, not downloaded until the disk fills; a trickled one's promise
        goes to the next download that needs its room: ``_Room``)."""
        names = manifest_files(manifest, url)
        if len(names) > MAX_VERSION_FILES:
            raise CorruptSnapshot(
                f"{url}: lists {len(names)} files; a snapshot has at most {MAX_VERSION_FILES}"
            )
        sizes: dict[str, int] = {}
        for name in names:
            size = manifest.sizes.get(name)
            if size is None:
                raise CorruptSnapshot(f"{url}: no size for {name}: nothing to cap its download at")
            sizes[name] = size
        have = sum(p.stat().st_size for p in partial.iterdir() if p.is_file())
        self._promise(sum(sizes.values()) - have, url, partial.parent, deadline)
        return sizes

    def _promise(self, need: int, url: str, folder: Path, deadline: float) -> None:
        """Take ``need`` bytes of ``folder``'s free space for this download, to be written by
        ``deadline`` (``_Room``), or refuse the version (CacheWriteError, ENOSPC:
        ``disk_full``) before any of its files."""
        free = shutil.disk_usage(folder).free
        others = self._room.take(need, free, deadline)
        if others is None:
            return
        taken = f", {others} of them promised to downloads in progress" if others else ""
        raise CacheWriteError(
            f"{url}: the version needs {need} bytes more, {folder} has {free} free{taken}: "
            "free space in [sidecar] cache_dir"
        ) from OSError(errno.ENOSPC, "no room for the version")

    def _download_file(
        self, url: str, dest: Path, sha256: str, size: int, version_deadline: float
    ) -> None:
        """Download (resuming what a broken try left) at most ``size`` bytes within the
        download deadline (and the version's), then verify; a mismatch is retried once from
        zero when part of the file came from an earlier try, else CorruptSnapshot."""
        if dest.is_file() and dest.stat().st_size == size and sha256_file(dest) == sha256:
            return  # finished by an earlier fetch of this version
        deadline = min(time.monotonic() + self.options.download_timeout_s, version_deadline)
        resumed = self._with_retries(url, lambda: self._get_to_file(url, dest, size, deadline))
        got = sha256_file(dest)
        if got != sha256 and resumed:
            log.warning("%s: resumed download fails its checksum; downloading it whole", url)
            self._restart(dest)
            self._with_retries(url, lambda: self._get_to_file(url, dest, size, deadline))
            got = sha256_file(dest)
        if got != sha256:
            raise CorruptSnapshot(f"{url}: sha256 {got[:12]} != manifest {sha256[:12]}")

    def _with_retries(self, url: str, attempt: Callable[[], _T]) -> _T:
        last: Exception | None = None
        delay = self.options.backoff_s
        for i in range(self.options.attempts):
            if i:
                log.info("retrying %s in %.1f s after: %s", url, delay, last)
                if self._closed.wait(delay):
                    raise StoreUnavailable(f"{url}: store closed while retrying after: {last}")
                delay = min(delay * 2, self.options.max_backoff_s)
            try:
                return attempt()
            except _Retry as exc:
                last = exc
        raise StoreUnavailable(f"{url}: {last} ({self.options.attempts} attempts)") from last

    def _get_small(self, url: str, version_deadline: float) -> bytes:
        deadline = min(time.monotonic() + self.options.download_timeout_s, version_deadline)
        with self._within(url, deadline), self._request(url, {}) as resp:
            try:
                return self._read_all(resp, url, MAX_MANIFEST_BYTES, deadline)
            except _TooLong as exc:
                raise CorruptSnapshot(f"{url}: manifest over {MAX_MANIFEST_BYTES} bytes") from exc

    def _read_all(
        self, resp: http.client.HTTPResponse, url: str, cap: int, deadline: float
    ) -> bytes:
        """A small answer whole, at most ``cap`` bytes (else _TooLong)."""
        buf = io.BytesIO()
        received = self._copy(resp, url, cap, deadline, buf.write)
        _check_length(resp, received)
        return buf.getvalue()

    def _get_to_file(self, url: str, dest: Path, size: int, deadline: float) -> bool:
        """One attempt: append from where ``dest`` ends (Range) or start over; True if resumed.
        At most ``size`` bytes end up in ``dest``: an answer with more is CorruptSnapshot."""
        offset = dest.stat().st_size if dest.is_file() else 0
        if offset >= size:  # whole but wrong (it failed its checksum), or longer than it may be
            self._restart(dest)
            offset = 0
        headers = {"Range": f"bytes={offset}-"} if offset else {}
        with self._within(url, deadline), self._request(url, headers) as resp:
            if resp.status == 206 and _range_start(resp) != offset:
                self._restart(dest)
                raise _Retry(f"asked for bytes from {offset}, got {resp.headers['Content-Range']}")
            resumed = resp.status == 206  # else a 200: the whole file, from the start
            start = offset if resumed else 0
            if not resumed:
                self._room.rewrites(offset)  # its bytes so far are written again
            announced = resp.headers.get("Content-Length", "")
            if _is_count(announced) and start + int(announced) > size:
                raise CorruptSnapshot(f"{url}: announces {announced} bytes from {start}, "
                                      f"the manifest says the file is {size}")  # fmt: skip
            try:
                f = dest.open("ab" if resumed else "wb")
            except OSError as exc:
                raise _cache_error(dest, exc) from exc
            with f:
                try:
                    received = self._copy(
                        resp, url, size - start, deadline, partial(self._write, f)
                    )
                except _TooLong as exc:
                    raise CorruptSnapshot(
                        f"{url}: sent more than the {size} bytes the manifest says; "
                        f"kept {size - start} of them"
                    ) from exc
                except OSError as exc:
                    raise _cache_error(dest, exc) from exc
                try:
                    f.flush()
                    os.fsync(f.fileno())
                except OSError as exc:
                    raise _cache_error(dest, exc) from exc
            _check_length(resp, received)
        return resumed

    def _copy(
        self,
        resp: http.client.HTTPResponse,
        url: str,
        cap: int,
        deadline: float,
        sink: Callable[[bytes], object],
    ) -> int:
        """Pass the body to ``sink`` block by block, never more than ``cap`` bytes (_TooLong
        when there are more), giving up at ``deadline``; the bytes passed on."""
        received = 0
        while block := self._read(resp, url, deadline):
            if received + len(block) > cap:
                sink(block[: cap - received])
                raise _TooLong(url)
            sink(block)
            received += len(block)
        return received

    def _read(self, resp: http.client.HTTPResponse, url: str, deadline: float) -> bytes:
        """What the socket has (``read1``: a trickle returns as it comes, so the deadline and
        ``close`` are looked at between reads), up to ``block_bytes``."""
        if self._closed.is_set():
            raise StoreUnavailable(f"{url}: store closed during the download")
        if (why := self._room.cut()) is not None:
            raise StoreUnavailable(f"{url}: {why}")
        if time.monotonic() > deadline:
            raise self._late(url)
        try:
            block = resp.read1(self.options.block_bytes)
        except (OSError, http.client.HTTPException) as exc:
            raise _Retry(f"download broke off: {_why(exc)}") from exc
        if not block and self._closed.is_set():  # our own shutdown looks like the end
            raise StoreUnavailable(f"{url}: store closed during the download")
        return block

    @contextlib.contextmanager
    def _within(self, url: str, deadline: float) -> Iterator[None]:
        """The request made inside ends by ``deadline``: its socket is shut down then, and
        whatever that made http.client raise (a reset, a status line cut off) or return (a
        head or trailer ended early, a body cut short) is this StoreUnavailable instead."""
        with self._connections.bounded(deadline) as request:
            try:
                yield
            except Exception as exc:
                if request.passed:
                    raise self._late(url) from exc
                raise
            if request.passed:
                raise self._late(url)

    def _late(self, url: str) -> StoreUnavailable:
        return StoreUnavailable(
            f"{url}: not downloaded within {self.options.download_timeout_s:g} s "
            "([sidecar] http_download_timeout_s); tried again on the next poll"
        )

    def _request(self, url: str, headers: dict[str, str]) -> http.client.HTTPResponse:
        """An open 2xx response; _Retry for what may pass, IncompleteSnapshot for a 404."""
        try:
            return self._open(url, headers)
        except urllib.error.HTTPError as exc:
            exc.close()
            if exc.code in _MISSING:
                raise IncompleteSnapshot(f"{url}: HTTP {exc.code}: not uploaded (yet)") from exc
            if exc.code in _RETRYABLE or exc.code == 416:
                raise _Retry(_status(exc)) from exc
            raise StoreUnavailable(f"{url}: {_status(exc)}") from exc
        except (OSError, http.client.HTTPException) as exc:
            raise _Retry(_why(exc)) from exc

    def _open(self, url: str, headers: dict[str, str]) -> http.client.HTTPResponse:
        if self._closed.is_set():
            raise StoreUnavailable(f"{url}: store closed")
        request = urllib.request.Request(url, headers={"User-Agent": "voxrecall", **headers})
        resp: http.client.HTTPResponse = self._opener.open(request, timeout=self.options.timeout_s)
        return resp

    def _write_file(self, path: Path, data: bytes) -> None:
        try:
            with path.open("wb") as f:
                self._write(f, data)
                f.flush()
                os.fsync(f.fileno())
        except OSError as exc:
            raise _cache_error(path, exc) from exc

    def _restart(self, dest: Path) -> None:
        """Delete ``dest`` to download it from zero: its bytes are written again, not added to
        the cache (``_Room.rewrites``)."""
        self._room.rewrites(dest.stat().st_size if dest.is_file() else 0)
        dest.unlink(missing_ok=True)

    def _write(self, f: BinaryIO, data: bytes) -> None:
        """Every byte written to the cache goes through here (a seam to inject disk errors);
        none once this download's promise went to another (``_Room``)."""
        if (why := self._room.cut()) is not None:
            raise StoreUnavailable(f"{f.name}: {why}")
        f.write(data)
        self._room.wrote(len(data))

    def _url(self, *parts: str) -> str:
        return "/".join([self.base_url, *(quote(p, safe="") for p in parts)])


def _range_start(resp: http.client.HTTPResponse) -> int:
    """The first byte a 206 answer holds, from ``Content-Range: bytes START-END/SIZE``."""
    value = resp.headers.get("Content-Range", "")
    try:
        return int(value.split()[1].split("-")[0])
    except (IndexError, ValueError):
        return -1


def _check_length(resp: http.client.HTTPResponse, received: int) -> None:
    # http.client's read(n) returns b"" on a closed connection: count the bytes ourselves
    expected = resp.headers.get("Content-Length")
    if expected is not None and _is_count(expected) and received < int(expected):
        raise _Retry(f"body cut off after {received} of {expected} bytes")


def _is_count(value: str) -> bool:
    """Whether a header's value is a count ``int`` reads: ASCII digits (http.client reads
    headers as ISO-8859-1, where "\xb2", a superscript two, is a digit to ``str.isdigit`` that
    ``int`` refuses: a ValueError out of ``latest`` and ``fetch``)."""
    return value.isascii() and value.isdigit()


def _cache_error(path: Path, exc: OSError) -> CacheWriteError:
    if exc.errno == errno.ENOSPC:
        return CacheWriteError(
            f"disk full writing {path}: free space in [sidecar] cache_dir or lower keep_downloaded"
        )
    return CacheWriteError(f"cannot write {path}: {exc.strerror or exc}")


def _why(exc: BaseException) -> str:
    """What went wrong with a request, on one line and cut to ``MAX_REASON_BYTES`` (http.client's
    errors quote the line the server sent)."""
    reason = getattr(exc, "reason", None)
    return shortened(one_line(str(reason or exc).strip() or type(exc).__name__), MAX_REASON_BYTES)


def _status(exc: urllib.error.HTTPError) -> str:
    """An error answer's status: its code and its reason phrase (urllib's own text for a
    redirect loop, three lines), on one line and cut to ``MAX_REASON_BYTES``."""
    return f"HTTP {exc.code} {shortened(one_line(str(exc.reason)), MAX_REASON_BYTES)}"
