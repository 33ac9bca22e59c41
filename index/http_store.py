"""Snapshots served over HTTP(S) by any static server, CDN or object-store endpoint.

    GET <base>/<kb>/LATEST                    polled with If-None-Match: unchanged costs one 304
    GET <base>/<kb>/<version>/manifest.json   first, kept in memory until the end
    GET <base>/<kb>/<version>/<file>          each file the manifest lists; resumed with Range

A version is downloaded into ``<cache>/<kb>/.partial-<version>/``; each file is checked against
the manifest's sha256, the manifest is written last, and the folder is renamed to
``<cache>/<kb>/<version>/``. So a version-named folder in the cache is always complete and
verified, and a broken download leaves at most a ``.partial-`` folder that the next try resumes.

Blocking (urllib, stdlib only): the refresher calls it from a worker thread. Proxies from the
environment are not used: nothing below the entry point reads the environment.
"""

from __future__ import annotations

import errno
import http.client
import logging
import os
import shutil
import threading
import urllib.error
import urllib.request
from collections.abc import Callable, Collection
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO, TypeVar
from urllib.parse import quote

from index.errors import (
    CacheWriteError,
    CorruptSnapshot,
    IncompleteSnapshot,
    StoreUnavailable,
)
from index.snapshot import MANIFEST, Manifest, fsync_dir, sha256_file, verify_snapshot
from index.store import (
    LATEST,
    MAX_POINTER_BYTES,
    check_name,
    is_version,
    manifest_files,
    parse_pointer,
)

log = logging.getLogger("voxrecall.store")

PARTIAL = ".partial-"
MAX_MANIFEST_BYTES = 4 << 20  # a manifest is a few KiB; a bigger answer is not one
_MISSING = frozenset({404, 410})  # the file is not there (yet): a half-uploaded version
_RETRYABLE = frozenset({408, 425, 429, 500, 502, 503, 504})
_T = TypeVar("_T")


@dataclass(frozen=True, slots=True)
class HttpOptions:
    """Timeouts and retries of an HttpStore.

    ``timeout_s`` bounds each connect and each read: a static server answers in milliseconds, so
    ten seconds of silence is a dead connection, not a slow one. A file is tried ``attempts``
    times with backoff ``backoff_s`` doubling up to ``max_backoff_s``: the defaults ride out
    about seven seconds of errors within one poll; longer outages are retried on the next poll.
    """

    timeout_s: float = 10.0
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


class HttpStore:
    """A SnapshotStore over HTTP(S) with a local cache of verified downloads.

    >>> store = HttpStore("https://cdn.example.com/snapshots", Path("/var/cache/voxrecall"))
    >>> version = store.latest("support")          # one small request; a 304 when unchanged
    >>> folder = store.fetch("support", version)   # downloaded, verified, then exposed
    """

    def __init__(self, base_url: str, cache_dir: Path, options: HttpOptions | None = None) -> None:
        self.base_url = base_url.rstrip("/")
        self.cache_dir = cache_dir
        self.options = options or HttpOptions()
        self._pointers: dict[str, _Pointer] = {}
        self._closed = threading.Event()
        self._opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))

    def __repr__(self) -> str:
        return f"HttpStore({self.base_url!r}, cache={str(self.cache_dir)!r})"

    # -- SnapshotStore ----------------------------------------------------------------------

    def latest(self, knowledge_base: str) -> str | None:
        url = self._url(knowledge_base, LATEST)
        known = self._pointers.get(knowledge_base)
        # no-cache: a CDN in between must revalidate the pointer, not answer from its copy
        headers = {"Cache-Control": "no-cache"}
        if known is not None:
            headers["If-None-Match"] = known.etag
        try:
            with self._open(url, headers) as resp:
                data = resp.read(MAX_POINTER_BYTES + 1)
                etag = resp.headers.get("ETag")
        except urllib.error.HTTPError as exc:
            exc.close()
            if exc.code == 304 and known is not None:
                return known.version
            if exc.code in _MISSING:
                self._pointers.pop(knowledge_base, None)
                return None
            raise StoreUnavailable(f"{url}: HTTP {exc.code} {exc.reason}") from exc
        except (OSError, http.client.HTTPException) as exc:
            raise StoreUnavailable(f"{url}: {_why(exc)}") from exc
        version = parse_pointer(data, url)
        if etag:
            self._pointers[knowledge_base] = _Pointer(etag, version)
        else:
            self._pointers.pop(knowledge_base, None)
        return version

    def fetch(self, knowledge_base: str, version: str) -> Path:
        check_name(version, "version", self.base_url)
        base = self.cache_dir / knowledge_base
        done = base / version
        if done.is_dir():
            try:
                verify_snapshot(done)
                return done
            except CorruptSnapshot as exc:
                log.warning("cached %s is damaged (%s): downloading it again", done, exc)
                shutil.rmtree(done, ignore_errors=True)
        partial = base / f"{PARTIAL}{version}"
        try:
            partial.mkdir(parents=True, exist_ok=True)
            self._download_version(knowledge_base, version, partial)
            partial.rename(done)
            fsync_dir(base)
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
        """Delete cached versions not named, and leftover partial downloads of older versions."""
        base = self.cache_dir / knowledge_base
        if not base.is_dir():
            return
        newest = max(versions, default="")
        for entry in base.iterdir():
            if entry.name.startswith(PARTIAL):
                if entry.name[len(PARTIAL) :] <= newest:
                    shutil.rmtree(entry, ignore_errors=True)
            elif is_version(entry.name) and entry.name not in versions:
                shutil.rmtree(entry, ignore_errors=True)

    def knowledge_bases(self) -> frozenset[str]:
        """Empty: a static HTTP server cannot be listed; name the bases in the config."""
        return frozenset()

    def close(self) -> None:
        self._closed.set()

    # -- downloading ------------------------------------------------------------------------

    def _download_version(self, kb: str, version: str, partial: Path) -> None:
        url = self._url(kb, version, MANIFEST)
        raw = self._with_retries(url, lambda: self._get_small(url))
        manifest = Manifest.from_json(raw, url)
        if manifest.version != version or manifest.knowledge_base != kb:
            raise CorruptSnapshot(
                f"{url}: manifest is of {manifest.knowledge_base} {manifest.version}, "
                f"not {kb} {version}"
            )
        for name in manifest_files(manifest, url):
            self._download_file(self._url(kb, version, name), partial / name, manifest.files[name])
        self._write_file(partial / MANIFEST, raw)
        fsync_dir(partial)

    def _download_file(self, url: str, dest: Path, sha256: str) -> None:
        """Download (resuming what a broken try left), then verify; a mismatch is retried once
        from zero when part of the file came from an earlier try, else CorruptSnapshot."""
        if dest.is_file() and sha256_file(dest) == sha256:
            return  # finished by an earlier fetch of this version
        resumed = self._with_retries(url, lambda: self._get_to_file(url, dest))
        got = sha256_file(dest)
        if got != sha256 and resumed:
            log.warning("%s: resumed download fails its checksum; downloading it whole", url)
            dest.unlink()
            self._with_retries(url, lambda: self._get_to_file(url, dest))
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

    def _get_small(self, url: str) -> bytes:
        with self._request(url, {}) as resp:
            data = resp.read(MAX_MANIFEST_BYTES + 1)
            _check_length(resp, len(data))
        if len(data) > MAX_MANIFEST_BYTES:
            raise CorruptSnapshot(f"{url}: manifest over {MAX_MANIFEST_BYTES} bytes")
        return data

    def _get_to_file(self, url: str, dest: Path) -> bool:
        """One attempt: append from where ``dest`` ends (Range) or start over; True if resumed."""
        offset = dest.stat().st_size if dest.is_file() else 0
        headers = {"Range": f"bytes={offset}-"} if offset else {}
        with self._request(url, headers) as resp:
            if resp.status == 206 and _range_start(resp) != offset:
                dest.unlink(missing_ok=True)
                raise _Retry(f"asked for bytes from {offset}, got {resp.headers['Content-Range']}")
            resumed = resp.status == 206  # else a 200: the whole file, from the start
            received = 0
            try:
                f = dest.open("ab" if resumed else "wb")
            except OSError as exc:
                raise _cache_error(dest, exc) from exc
            with f:
                while block := self._read(resp, url):
                    try:
                        self._write(f, block)
                    except OSError as exc:
                        raise _cache_error(dest, exc) from exc
                    received += len(block)
                try:
                    f.flush()
                    os.fsync(f.fileno())
                except OSError as exc:
                    raise _cache_error(dest, exc) from exc
            _check_length(resp, received)
        return resumed

    def _read(self, resp: http.client.HTTPResponse, url: str) -> bytes:
        if self._closed.is_set():
            raise StoreUnavailable(f"{url}: store closed during the download")
        try:
            return resp.read(self.options.block_bytes)
        except (OSError, http.client.HTTPException) as exc:
            raise _Retry(f"download broke off: {_why(exc)}") from exc

    def _request(self, url: str, headers: dict[str, str]) -> http.client.HTTPResponse:
        """An open 2xx response; _Retry for what may pass, IncompleteSnapshot for a 404."""
        try:
            return self._open(url, headers)
        except urllib.error.HTTPError as exc:
            exc.close()
            if exc.code in _MISSING:
                raise IncompleteSnapshot(f"{url}: HTTP {exc.code}: not uploaded (yet)") from exc
            if exc.code in _RETRYABLE or exc.code == 416:
                raise _Retry(f"HTTP {exc.code} {exc.reason}") from exc
            raise StoreUnavailable(f"{url}: HTTP {exc.code} {exc.reason}") from exc
        except (OSError, http.client.HTTPException) as exc:
            raise _Retry(_why(exc)) from exc

    def _open(self, url: str, headers: dict[str, str]) -> http.client.HTTPResponse:
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

    def _write(self, f: BinaryIO, data: bytes) -> None:
        """Every byte written to the cache goes through here (a seam to inject disk errors)."""
        f.write(data)

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
    if expected is not None and expected.isdigit() and received < int(expected):
        raise _Retry(f"body cut off after {received} of {expected} bytes")


def _cache_error(path: Path, exc: OSError) -> CacheWriteError:
    if exc.errno == errno.ENOSPC:
        return CacheWriteError(
            f"disk full writing {path}: free space in [sidecar] cache_dir or lower keep_downloaded"
        )
    return CacheWriteError(f"cannot write {path}: {exc.strerror or exc}")


def _why(exc: BaseException) -> str:
    reason = getattr(exc, "reason", None)
    return str(reason or exc) or type(exc).__name__
