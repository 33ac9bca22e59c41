"""Where snapshots are published, and the one interface a sidecar reads them through.

A store is laid out as (a local folder, a shared volume, the same tree behind HTTP or in S3)

    <root>/<knowledge_base>/LATEST            the current version id, written last
    <root>/<knowledge_base>/<version>/        an immutable snapshot folder
    <root>/<knowledge_base>/.staging-*/       a build in progress, invisible to readers
    <root>/<knowledge_base>/.publish.lock     held by the one publisher of the base at a time

Version ids sort by creation time, so "newer" is a string comparison. ``SnapshotStore`` is what
the sidecar's refresher needs: the pointer, and a local folder of one version whose files match
its manifest. ``LocalStore`` reads the folder in place; ``index.http_store.HttpStore`` downloads
it into a local cache first, and ``index.s3_store.S3Store`` does the same from a bucket.
"""

from __future__ import annotations

import bisect
import dataclasses
import fcntl
import hashlib
import logging
import os
import shutil
import tempfile
import time
from collections.abc import Collection, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Protocol, runtime_checkable

import orjson

from index.config import SAFE_NAME, named
from index.errors import (
    CorruptSnapshot,
    IncompleteSnapshot,
    SnapshotError,
    SnapshotNotFound,
    StoreUnavailable,
    unreadable,
)
from index.hnsw_file import CHECKS_VERSION
from index.snapshot import (
    MANIFEST,
    Manifest,
    fsync_dir,
    read_manifest,
    read_small,
    verify_fetched,
    verify_snapshot,
    write_atomic,
)

log = logging.getLogger("voxrecall.store")

LATEST = "LATEST"
# A store is read by sidecars running as other users (the image's uid 10001, a read-only mount),
# so what a build publishes is readable by everyone whatever the umask; keep a store private by
# where it lives (a 0700 parent folder), never by its own modes.
READABLE_DIR = 0o755
READABLE_FILE = 0o644
# The entries a store's listing is read for at most: S3's 100 pages of 1,000 names
# (index/s3_store.py), and as many entries of a folder.
MAX_LISTED_ENTRIES = 100_000
# Held by the one publisher of a base at a time (``LocalStore._publishing``); a dot-file, which
# no listing of versions or bases reads.
PUBLISH_LOCK = ".publish.lock"
MAX_POINTER_BYTES = 256  # a version id is ~33 characters; anything longer is not a pointer


def new_version_id(content_hash: str, now: float | None = None) -> str:
    """A sortable id: UTC time to the microsecond, then a short content hash."""
    now = time.time() if now is None else now
    stamp = time.strftime("%Y%m%dT%H%M%S", time.gmtime(now))
    return f"{stamp}{int(now % 1 * 1e6):06d}Z-{content_hash[:8]}"


def check_name(name: str, what: str, where: str) -> str:
    """``name`` when it is one safe path component; else CorruptSnapshot (never a path escape)."""
    if not SAFE_NAME.fullmatch(name):
        raise CorruptSnapshot(f"{where}: {what} {name[:80]!r} is not a valid name")
    return name


def parse_pointer(data: bytes, where: str) -> str | None:
    """The version a LATEST file names, None when it is empty; CorruptSnapshot when garbled."""
    if len(data) > MAX_POINTER_BYTES:
        raise CorruptSnapshot(f"{where}: {LATEST} is {len(data)} bytes, not a version id")
    try:
        text = data.decode("ascii").strip()
    except UnicodeDecodeError as exc:
        raise CorruptSnapshot(f"{where}: {LATEST} is not ASCII") from exc
    return check_name(text, "version", where) if text else None


def manifest_files(manifest: Manifest, where: str) -> list[str]:
    """The files a manifest lists, each checked to be a plain name inside the version folder."""
    return [check_name(name, "file", where) for name in sorted(manifest.files)]


@runtime_checkable
class SnapshotStore(Protocol):
    """A store the sidecar reads: blocking calls (disk, network), made from a worker thread.

    Errors are ``SnapshotError``s: ``StoreUnavailable`` and ``IncompleteSnapshot`` may clear by
    the next poll; ``CorruptSnapshot`` does not for that version; ``CacheWriteError`` is local.
    """

    def latest(self, knowledge_base: str) -> str | None:
        """The version LATEST names, or None when nothing is published; as written, not judged."""
        ...

    def fetch(self, knowledge_base: str, version: str) -> Path:
        """A local folder of ``version`` whose every file matches its manifest's sha256 and
        whose hnswlib graphs hnswlib can read safely (``index.snapshot.verify_fetched``): a
        load trusts both (``load_snapshot(..., fetched=True)``) where the store says so:
        ``checks_graphs = True`` (a store of one's own written before fetch checked the graphs,
        without it, has them checked at every load, as then)."""
        ...

    def retain(self, knowledge_base: str, versions: Collection[str]) -> None:
        """Let go of local copies of every version but these (a no-op where nothing is copied)."""
        ...

    def knowledge_bases(self) -> frozenset[str]:
        """The bases the store holds, where it can list them (empty where it cannot)."""
        ...

    def close(self) -> None:
        """Abandon waits in progress (retry backoff) so a stopping sidecar is not held up."""
        ...


class LocalStore:
    """A snapshot store on a local or shared file system; the sidecar reads folders in place."""

    checks_graphs = True  # fetch checks the graphs' layout too (``Verified``)

    def __init__(self, root: Path, verified_dir: Path | None = None) -> None:
        self.root = root
        # what fetch verified, by each file's stats (``Stats``): a version fetched again (a
        # base evicted and loaded anew) is not verified again. With ``verified_dir`` (a
        # sidecar's cache_dir) the record is also kept on disk, so that the next start, or
        # another worker, need not hash or check the same unchanged files either.
        self.verified = Verified(verified_dir)
        self.skipped = SkippedNames()  # the listing's names that are not bases, logged once

    def __repr__(self) -> str:
        return f"LocalStore({str(self.root)!r})"

    def base_dir(self, knowledge_base: str) -> Path:
        return self.root / knowledge_base

    def staging_dir(self, knowledge_base: str) -> Path:
        """A fresh folder to write a snapshot into before ``publish``."""
        base = self.base_dir(knowledge_base)
        _mkdir_readable(base)
        return Path(tempfile.mkdtemp(prefix=".staging-", dir=base))

    def latest(self, knowledge_base: str) -> str | None:
        """The published version id, or None when nothing is published yet."""
        pointer = self.base_dir(knowledge_base) / LATEST
        try:
            data = read_small(pointer, MAX_POINTER_BYTES, LATEST)
        except FileNotFoundError:
            return None
        except OSError as exc:
            raise unreadable(f"{pointer}: unreadable ({exc.strerror})", exc) from exc
        return parse_pointer(data, str(pointer))

    def version_dir(self, knowledge_base: str, version: str) -> Path:
        return self.base_dir(knowledge_base) / version

    def latest_dir(self, knowledge_base: str) -> Path:
        version = self.latest(knowledge_base)
        if version is None:
            raise SnapshotNotFound(
                f"no snapshot of {knowledge_base!r} in {self.root}: run `voxrecall index build`"
            )
        return self.version_dir(knowledge_base, version)

    def versions(self, knowledge_base: str) -> list[str]:
        base = self.base_dir(knowledge_base)
        if not base.is_dir():
            return []
        return sorted(
            p.name
            for p in base.iterdir()
            if p.is_dir() and not p.name.startswith(".") and (p / MANIFEST).is_file()
        )

    def fetch(self, knowledge_base: str, version: str) -> Path:
        """The version's folder in place, once its manifest and every file are there and match."""
        folder = self.version_dir(knowledge_base, check_name(version, "version", str(self.root)))
        if not (folder / MANIFEST).is_file():
            raise IncompleteSnapshot(
                f"{folder}: {LATEST} names {version} but it has no {MANIFEST} (half-uploaded?)"
            )
        manifest = read_manifest(folder)
        missing = [n for n in manifest_files(manifest, str(folder)) if not (folder / n).is_file()]
        if missing:
            raise IncompleteSnapshot(f"{folder}: missing {', '.join(missing)} (half-uploaded?)")
        self.verified.ensure(folder, manifest, knowledge_base, version)
        return folder

    def retain(self, knowledge_base: str, versions: Collection[str]) -> None:
        """Deletes nothing (a sidecar never deletes from a shared store; builds prune it:
        ``keep_versions``); forgets in memory what it verified of the other versions."""
        self.verified.keep_only(knowledge_base, versions)

    def knowledge_bases(self) -> frozenset[str]:
        """The folders under the root named as a base can be (``is_base_name``, as an S3
        store's listing): dot-folders and others ("lost+found" at the root of a fresh volume)
        are skipped, summed up in one log line when they change; a root of more than
        ``MAX_LISTED_ENTRIES`` entries is refused (StoreUnavailable) when the next is read, so
        a folder of millions holds no more than that many names (255 bytes each at most)."""
        if not self.root.is_dir():
            return frozenset()
        names: set[str] = set()
        skipped = self.skipped.tally()
        for i, p in enumerate(self.root.iterdir()):
            if i == MAX_LISTED_ENTRIES:
                raise StoreUnavailable(
                    f"{self.root}: over {MAX_LISTED_ENTRIES} entries, more than a store holds: "
                    "point the store at the folder that holds the bases"
                )
            if p.name.startswith(".") or not p.is_dir():
                continue
            if is_base_name(p.name):
                names.add(p.name)
            else:
                skipped.add(p.name)
        self.skipped.note(str(self.root), skipped)
        return frozenset(names)

    def close(self) -> None:
        """Nothing to abandon: local reads do not wait."""

    def publish(self, knowledge_base: str, staging: Path, version: str, keep: int = 3) -> Path:
        """Move a finished staging folder into place, then point LATEST at it, then prune."""
        if not (staging / MANIFEST).is_file():
            raise SnapshotError(f"{staging}: refusing to publish a snapshot with no manifest")
        with self._publishing(knowledge_base):
            current = self.latest(knowledge_base)
            if current is not None and version <= current:
                raise SnapshotError(f"version {version} is not newer than the published {current}")
            target = self.version_dir(knowledge_base, version)
            _make_readable(staging)  # mkdtemp made it 0700
            staging.rename(target)
            fsync_dir(target.parent)
            write_atomic(target.parent / LATEST, f"{version}\n".encode(), mode=READABLE_FILE)
            self.prune(knowledge_base, keep)
        return target

    @contextmanager
    def _publishing(self, knowledge_base: str) -> Iterator[None]:
        """One publisher of a base at a time, across processes (a build, ``index watch``, a
        rollback, ``index publish``): LATEST is read, checked older and written in one step.
        Two publishers that both read the same LATEST could otherwise leave it naming the older
        of their two versions, which every sidecar then refuses as a stale store's answer."""
        base = self.base_dir(knowledge_base)
        _mkdir_readable(base)
        with _locked(base / PUBLISH_LOCK):
            yield

    def publish_copy(self, knowledge_base: str, source: Path, keep: int = 3) -> Path | None:
        """Copy a verified snapshot folder in and publish it; None when this store is as new.

        The files are copied first, the manifest last, then the folder is renamed into place and
        LATEST written, so a reader polling this store (or an HTTP server over it) never sees a
        version before all of its files.
        """
        manifest = verify_snapshot(source)
        if manifest.knowledge_base != knowledge_base:
            raise SnapshotError(f"{source} is a snapshot of {manifest.knowledge_base!r}")
        current = self.latest(knowledge_base)
        if current is not None and manifest.version <= current:
            return None
        return self._publish_files(knowledge_base, source, manifest, keep)

    def roll_back(self, knowledge_base: str, version: str, keep: int = 3) -> Path:
        """Publish the content of ``version``, a kept older version, as a new version: its
        files copied (``verify_fetched`` first), under a manifest naming the new version id
        (``rolled_back_from`` in its ``extra``), LATEST pointed at it. A roll forward: a
        sidecar refuses a pointer that goes back (a stale store's answer), and takes this as
        any new build; ``index publish`` carries it on to other stores."""
        kept = self.versions(knowledge_base)
        if version not in kept:
            newest_first = kept[::-1]
            raise SnapshotError(
                f"no version {version[:80]!r} of {knowledge_base!r} in {self.root} (pruned, or "
                f"never built); kept: {named(newest_first)}"
            )
        current = self.latest(knowledge_base)
        if version == current:
            raise SnapshotError(f"{knowledge_base}: {version} is the published version already")
        source = self.version_dir(knowledge_base, version)
        manifest = self._servable_as(knowledge_base, version, current)
        again = dataclasses.replace(
            manifest,
            version=new_version_id(version.rsplit("-", 1)[-1]),
            created_at=time.time(),
            extra={**manifest.extra, "rolled_back_from": version},
        )
        return self._publish_files(knowledge_base, source, again, keep, again.to_json())

    def _servable_as(self, knowledge_base: str, version: str, current: str | None) -> Manifest:
        """``version``'s manifest, verified, of ``knowledge_base`` and made by the embedder the
        published ``current`` was (the sidecars serving it refuse any other); else
        SnapshotError saying which."""
        try:
            manifest = verify_fetched(self.version_dir(knowledge_base, version))
        except SnapshotError as exc:
            raise SnapshotError(f"{knowledge_base} {version} fails verification: {exc}") from exc
        if manifest.knowledge_base != knowledge_base:
            raise SnapshotError(f"{version} is a snapshot of {manifest.knowledge_base!r}")
        if current is not None:
            served = read_manifest(self.version_dir(knowledge_base, current)).embedder
            if manifest.embedder != served:
                raise SnapshotError(
                    f"{knowledge_base} {version} was embedded by {manifest.embedder.name} "
                    f"({manifest.embedder.dimension}-d), {current} by {served.name} "
                    f"({served.dimension}-d): sidecars serving {current} would refuse it"
                )
        return manifest

    def _publish_files(
        self,
        knowledge_base: str,
        source: Path,
        manifest: Manifest,
        keep: int,
        manifest_json: bytes | None = None,
    ) -> Path:
        """Copy the files ``manifest`` lists from ``source`` into a staging folder, then the
        manifest (``manifest_json``, else ``source``'s), and publish it as ``manifest.version``."""
        staging = self.staging_dir(knowledge_base)
        try:
            for name in manifest_files(manifest, str(source)):
                _copy_durably(source / name, staging / name)
            if manifest_json is None:
                _copy_durably(source / MANIFEST, staging / MANIFEST)
            else:
                write_atomic(staging / MANIFEST, manifest_json)
            fsync_dir(staging)
            return self.publish(knowledge_base, staging, manifest.version, keep)
        except OSError as exc:
            shutil.rmtree(staging, ignore_errors=True)
            raise SnapshotError(f"cannot copy {source} into {self.root}: {exc}") from exc
        except SnapshotError:  # not newer than the published version: nothing left behind
            shutil.rmtree(staging, ignore_errors=True)
            raise

    def prune(self, knowledge_base: str, keep: int) -> list[str]:
        """Delete all but the newest ``keep`` versions (never the published one) and stale staging."""
        published = self.latest(knowledge_base)
        versions = self.versions(knowledge_base)
        doomed = [v for v in versions[: max(0, len(versions) - keep)] if v != published]
        for version in doomed:
            shutil.rmtree(self.version_dir(knowledge_base, version), ignore_errors=True)
        day_ago = time.time() - 86_400
        for stale in self.base_dir(knowledge_base).glob(".staging-*"):
            if stale.stat().st_mtime < day_ago:
                shutil.rmtree(stale, ignore_errors=True)
        return doomed


# (name, size, mtime_ns, ctime_ns, inode, device) per file: a file written again, replaced, or
# given its old mtime back (``touch -r``, ``cp -p``, ``rsync -t``: the ctime still moves) differs.
Stats = tuple[tuple[str, int, int, int, int, int], ...]
# What a record says was proved of the files it lists (``verify_fetched``): each one's sha256,
# then the hnswlib graphs' layout by the checks of this version (``CHECKS_VERSION``). A record of
# fewer or older checks is not one: its folder is verified again, once.
RECORD_CHECKS = ["sha256", f"hnsw_layout:{CHECKS_VERSION}"]


class Verified:
    """What a store's ``fetch`` verified (``index.snapshot.verify_fetched``), by each file's
    ``Stats``: in memory (one entry per version, dropped with it), and with ``folder`` on disk
    too (one small JSON file per version), so that the next start or another worker verifies
    nothing unchanged. A file replaced or rewritten since has other stats: its folder is
    verified again. (What stats cannot see, a disk's own corruption under a file, the load
    still meets at the graph's header: ``check_hnsw_head``.)"""

    def __init__(self, folder: Path | None) -> None:
        self.folder = folder
        self._seen: dict[tuple[str, str], Stats] = {}

    def ensure(self, snapshot: Path, manifest: Manifest, knowledge_base: str, version: str) -> None:
        """Verify ``snapshot`` unless a record says these very files were; then record it."""
        try:
            seen = file_stats(snapshot, manifest)
        except OSError as exc:
            raise unreadable(f"{snapshot}: cannot read: {exc}", exc) from exc
        record = self.record(knowledge_base, version)
        if self._seen.get((knowledge_base, version)) != seen and _read_record(record) != seen:
            verify_fetched(snapshot)
            _write_record(record, seen)
        self._seen[knowledge_base, version] = seen

    def remember(
        self, snapshot: Path, manifest: Manifest, knowledge_base: str, version: str
    ) -> None:
        """Record ``snapshot`` as verified: its caller just did (a download's checks). Best
        effort: unrecorded, the next fetch verifies it again."""
        try:
            seen = file_stats(snapshot, manifest)
        except OSError as exc:
            log.warning("could not record the verification of %s: %s", snapshot, exc)
            return
        _write_record(self.record(knowledge_base, version), seen)
        self._seen[knowledge_base, version] = seen

    def forget(self, knowledge_base: str, version: str) -> None:
        """Drop the record of a version whose copy was deleted (best effort)."""
        self._seen.pop((knowledge_base, version), None)
        record = self.record(knowledge_base, version)
        if record is not None:
            record.unlink(missing_ok=True)

    def keep_only(self, knowledge_base: str, versions: Collection[str]) -> None:
        """Forget in memory the versions of ``knowledge_base`` not in ``versions`` (their
        records on disk stay: the next fetch of one is not verified again)."""
        for key in [k for k in self._seen if k[0] == knowledge_base and k[1] not in versions]:
            del self._seen[key]

    def record(self, knowledge_base: str, version: str) -> Path | None:
        if self.folder is None:
            return None
        return self.folder / knowledge_base / f"{version}.json"


def file_stats(folder: Path, manifest: Manifest) -> Stats:
    """``Stats`` of the manifest and every file it lists."""
    names = [MANIFEST, *manifest_files(manifest, str(folder))]
    stats = [(name, (folder / name).stat()) for name in names]
    return tuple(
        (name, st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_ino, st.st_dev)
        for name, st in stats
    )


def _read_record(record: Path | None) -> Stats | None:
    """The stats a verification recorded; None when there is none, it is unreadable or it
    records fewer checks than ``RECORD_CHECKS``."""
    if record is None:
        return None
    try:
        raw = orjson.loads(record.read_bytes())
        if raw.get("checks") != RECORD_CHECKS:
            return None
        return tuple(
            (str(n), int(a), int(b), int(c), int(d), int(e)) for n, a, b, c, d, e in raw["files"]
        )
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return None


def _write_record(record: Path | None, stats: Stats) -> None:
    """Record that these files passed ``RECORD_CHECKS`` (best effort: a failure only means the
    next start verifies them again)."""
    if record is None:
        return
    try:
        record.parent.mkdir(parents=True, exist_ok=True)
        data = {"checks": RECORD_CHECKS, "files": [list(s) for s in stats]}
        write_atomic(record, orjson.dumps(data))
    except OSError as exc:
        log.warning("could not record the verification of %s: %s", record.parent, exc)


@contextmanager
def _locked(path: Path) -> Iterator[None]:
    """``path`` held with ``flock`` (released when the file closes, or the process ends); a
    file that cannot be made or locked is a one-line SnapshotError saying so."""
    try:
        lock = open(path, "a+b")  # noqa: SIM115 - closed by the with below
    except OSError as exc:
        raise SnapshotError(_cannot_lock(path, exc)) from exc
    with lock:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX)
        except OSError as exc:
            raise SnapshotError(_cannot_lock(path, exc)) from exc
        yield


def _cannot_lock(path: Path, exc: OSError) -> str:
    return (
        f"{path}: cannot lock it to publish ({exc.strerror or exc}): the publisher needs to "
        "write the base's folder, on a file system that has flock"
    )


def _mkdir_readable(path: Path) -> None:
    """Make ``path`` and its missing parents, each readable by every user whatever the umask."""
    missing = []
    folder = path
    while not folder.exists():
        missing.append(folder)
        folder = folder.parent
    path.mkdir(parents=True, exist_ok=True)
    for made in missing:
        made.chmod(READABLE_DIR)


def _make_readable(staging: Path) -> None:
    """A version about to be published: its folder and files readable by every user."""
    staging.chmod(READABLE_DIR)
    for entry in staging.rglob("*"):
        entry.chmod(READABLE_DIR if entry.is_dir() else READABLE_FILE)


def _copy_durably(source: Path, target: Path) -> None:
    shutil.copyfile(source, target)
    with target.open("rb") as f:
        os.fsync(f.fileno())


def is_url(location: Path | str) -> bool:
    return isinstance(location, str) and location.startswith(("http://", "https://"))


def open_store(
    location: Path | str,
    *,
    cache_dir: Path,
    timeout_s: float = 10.0,
    download_timeout_s: float = 600.0,
    version_timeout_s: float = 1800.0,
    s3_endpoint_url: str = "",
    s3_region: str = "",
    max_listed: int = MAX_LISTED_ENTRIES,
) -> SnapshotStore:
    """The store a sidecar reads: an http(s) or s3 URL downloads into ``cache_dir``; else a
    folder. boto3 (the ``s3`` extra) is imported only for an s3:// store, whose listing stops at
    ``max_listed`` names (the first by name)."""
    if isinstance(location, str) and location.startswith("s3://"):
        from index.http_store import HttpOptions
        from index.s3_store import S3Options, S3Store

        options = HttpOptions(timeout_s, download_timeout_s, version_timeout_s)
        s3 = S3Options(s3_endpoint_url, s3_region, max_listed)
        return S3Store(location, cache_dir, options, s3)
    if is_url(location):
        from index.http_store import HttpOptions, HttpStore

        options = HttpOptions(timeout_s, download_timeout_s, version_timeout_s)
        return HttpStore(str(location), cache_dir, options)
    return LocalStore(Path(location), verified_dir=cache_dir / "verified")


def is_base_name(name: str) -> bool:
    """Whether a listed folder name can be a base: one safe path component, as a version's."""
    return is_version(name)


class SkippedTally:
    """The names one listing skipped, in a fixed size however many and however long they are:
    how many, the first ``shown`` by name (cut to ``CUT`` characters) and an order-free digest
    of them all, to tell a listing that skipped the same names from one that did not."""

    CUT = 80  # characters of a name quoted in the log

    def __init__(self, shown: int) -> None:
        self.count = 0
        self.first: list[str] = []  # sorted, at most ``shown``
        self._shown = shown
        self._sum = 0  # the names' 128-bit hashes summed modulo 2**128: order-free

    def add(self, name: str) -> None:
        self.count += 1
        data = name.encode("utf-8", "surrogatepass")  # a local name may hold lone surrogates
        digest = hashlib.blake2b(data, digest_size=16).digest()
        self._sum = (self._sum + int.from_bytes(digest, "big")) % (1 << 128)
        if len(self.first) < self._shown or name < self.first[-1]:  # as its cut would compare
            bisect.insort(self.first, name[: self.CUT])
            del self.first[self._shown :]

    @property
    def key(self) -> tuple[int, int]:
        """Equal for two listings that skipped the same names (in any order)."""
        return self.count, self._sum


class SkippedNames:
    """What a store's listing skipped (names that are not base names: "lost+found", a name
    with a newline): one summary line, only when the names change, not one line per name at
    every poll. A listing's names are counted into a ``SkippedTally`` as they are read, so a
    listing of many long names holds none of them (a hostile listing's 100,000 names of 2 KB
    were held whole, then a set of them kept until the next listing)."""

    SHOWN = 5  # names quoted in the line (``SkippedTally.CUT`` characters each at most)

    def __init__(self) -> None:
        self._last: tuple[int, int] = (0, 0)

    def tally(self) -> SkippedTally:
        """A new listing's tally, to ``add`` each skipped name to, then ``note``."""
        return SkippedTally(self.SHOWN)

    def note(self, where: str, tally: SkippedTally) -> None:
        if tally.count and tally.key != self._last:
            shown = ", ".join(repr(n) for n in tally.first)
            more = (
                f" and {tally.count - len(tally.first)} more"
                if tally.count > len(tally.first)
                else ""
            )
            log.warning(
                "%s: skipped %d names in the listing that are not base names (a letter or "
                "digit, then letters, digits, '.', '_' or '-', 128 at most): %s%s",
                where,
                tally.count,
                shown,
                more,
            )
        self._last = tally.key


def is_version(name: str) -> bool:
    """Whether a folder name can be a version id (not a dot-folder, not LATEST)."""
    return bool(SAFE_NAME.fullmatch(name)) and name != LATEST
