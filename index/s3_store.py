"""Snapshots in S3 or any S3-compatible object store (MinIO, Ceph RGW, R2, GCS's XML API).

    s3://<bucket>/<prefix>/<kb>/LATEST                  the pointer, written last
    s3://<bucket>/<prefix>/<kb>/<version>/<file>        every file a manifest lists, then it

The same tree as a folder or an HTTP store, under a key prefix. Reading (``S3Store``) is the
HTTP store's code (``index.http_store``: ETag polling with ``If-None-Match``, downloads resumed
with ``Range``, retries with backoff, byte caps from the manifest, a total deadline per file,
``close`` cutting a blocked read), with each request signed by AWS Signature Version 4. So an
S3 store behaves exactly like the HTTP store the contract suite already holds it to, and boto3
lends only what it is the reference for: the credential chain (environment, profile, the web
identity token of an EKS service account, instance metadata) and the signature. Its own
downloader is not used: it retries on its own schedule and a read blocked in its streaming body
cannot be cut by another thread. Nor is its listing: it reads a page whole, however large, with
no deadline, so the bases (``knowledge_bases``) are listed by the same guarded GETs, signed, and
a listed name is kept only when it is one safe path component (it names a cache folder).

Writing (``S3Publisher``, ``voxrecall index publish --to s3://...``) is boto3's client: every
file (multipart above 8 MiB), the manifest last, then ``LATEST``; a reader never sees a version
before all of its files. Nothing is deleted: expire old versions with a lifecycle rule.

boto3 is the optional extra ``s3``: this module is imported only for an ``s3://`` store.
"""

from __future__ import annotations

import contextlib
import logging
import re
import threading
import time
import urllib.error
import urllib.parse
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from xml.etree import ElementTree

from index.errors import ConfigError, IncompleteSnapshot, SnapshotError, StoreUnavailable
from index.http_store import HttpOptions, HttpStore, _TooLong, _why
from index.snapshot import MANIFEST, verify_snapshot
from index.store import (
    LATEST,
    MAX_LISTED_ENTRIES,
    MAX_POINTER_BYTES,
    SkippedNames,
    SkippedTally,
    check_name,
    is_base_name,
    manifest_files,
    parse_pointer,
)

# an s3:// store is the only user of boto3 (the s3 extra): without it, one line says what to
# install, at the first use of such a store (publish or serve), not a traceback
NEEDS_EXTRA = (
    "an s3:// store needs boto3, the s3 extra: pip install 'voxrecall[s3]' "
    "(from a clone: pip install -e '.[s3]')"
)
try:
    import boto3
    import botocore.auth
    import botocore.awsrequest
    import botocore.config
    import botocore.credentials
    import botocore.exceptions
except ModuleNotFoundError as exc:
    raise ConfigError(f"{NEEDS_EXTRA}; {exc.name} is not installed") from None

log = logging.getLogger("voxrecall.store")

SCHEME = "s3://"
CREDENTIALS_LOOK_AGAIN_S = 60.0
DEFAULT_REGION = "us-east-1"  # what S3 assumes when none is given; any region for MinIO
_BUCKET = re.compile(r"[a-z0-9][a-z0-9.-]{1,61}[a-z0-9]")  # S3's bucket naming rules
_PREFIX = re.compile(r"[A-Za-z0-9._-]+(/[A-Za-z0-9._-]+)*")  # key parts that need no escaping
# Pages of a listing read at most (1000 names each): a prefix holds a handful of bases, and a
# store whose listing goes on past this is broken (or endless on purpose).
MAX_LIST_PAGES = 100
# One page's bytes at most: 1000 common prefixes of S3's longest keys (1024 bytes) and their
# tags; a page past this is not a listing.
MAX_LIST_PAGE_BYTES = 2 * 1024 * 1024
# One page's names at most: S3 sends at most 1,000 keys and common prefixes a page (MaxKeys); a
# page of 33,000 short prefixes fits in its bytes, and 100 of them were 3.3 M names to keep.
MAX_LIST_PAGE_NAMES = 1000
# A page's markup at most, counted as its "<" bytes before the parse (text holds none: it is
# "&lt;"): each tag is an element the tree builder makes holding the GIL, in a worker thread
# but the event loop's too (a 2 MiB page of 524,000 empty elements held the loop ~0.3 s). S3's
# page of 1,000 keys, each an object's <Contents> of a dozen elements, opened and closed, is
# within 28 a key.
MAX_LIST_PAGE_TAGS = 64 * MAX_LIST_PAGE_NAMES
# A continuation token's bytes at most: S3's are opaque, tens to hundreds of bytes (MinIO's
# hold the last key, of 1,024 bytes at most, in base64); the next page's URL carries it, and so
# does every retry's log line and refusal that names that URL.
MAX_CONTINUATION_TOKEN_BYTES = 4096
# What to do, said after botocore's words (one line, cut: ``http_store._why``), which may quote a
# credential_process's stderr or a server's message over several lines.
CREDENTIALS_HINT = (
    "fix the AWS credential chain (AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY, AWS_PROFILE and "
    "the AWS config files, or the instance's role)"
)
BUCKET_HINT = (
    "check that the bucket exists, that [index] s3_endpoint_url and s3_region name its server, "
    "and that the credentials may s3:PutObject and s3:GetObject on the prefix and s3:ListBucket "
    "on the bucket"
)
WRITE_HINT = (
    f"{BUCKET_HINT}; LATEST is written last, so nothing points at a version part uploaded: run "
    "`voxrecall index publish` again"
)


def _refusal(what: str, exc: BaseException, hint: str) -> str:
    """``what`` failed, botocore's words on one line and cut to ``MAX_REASON_BYTES``, and what
    to do: as the HTTP store's refusals read."""
    return f"{what}: {_why(exc)}; {hint}"


@dataclass(frozen=True, slots=True)
class S3Location:
    """``s3://bucket/prefix``, checked: a bucket name S3 accepts, a prefix of plain parts."""

    bucket: str
    prefix: str  # no leading or trailing "/"; may be empty

    @classmethod
    def parse(cls, url: str) -> S3Location:
        if not url.startswith(SCHEME):
            raise ConfigError(f"{url!r} is not an s3:// location")
        bucket, _, prefix = url[len(SCHEME) :].partition("/")
        prefix = prefix.strip("/")
        if not _BUCKET.fullmatch(bucket):
            raise ConfigError(f"{url!r}: {bucket!r} is not a valid S3 bucket name")
        if prefix and not _PREFIX.fullmatch(prefix):
            raise ConfigError(
                f"{url!r}: the prefix may hold letters, digits, '.', '_', '-' and '/' only"
            )
        return cls(bucket, prefix)

    def key(self, *parts: str) -> str:
        return "/".join([self.prefix, *parts] if self.prefix else parts)

    def __str__(self) -> str:
        return f"{SCHEME}{self.bucket}/{self.prefix}".rstrip("/")


@dataclass(frozen=True, slots=True)
class S3Options:
    """Where the S3 API is: ``endpoint_url`` empty is AWS itself (virtual-hosted URLs, the
    region's endpoint); set, it is an S3-compatible server addressed path-style
    (``<endpoint>/<bucket>/<key>``), as MinIO and most others expect. ``region`` empty: the AWS
    configuration's (``AWS_REGION``, the profile), else us-east-1."""

    endpoint_url: str = ""
    region: str = ""
    # the base names a listing reads at most (the first by name, as S3 lists them): a sidecar
    # asks for what it can serve, not every name of a prefix that holds millions
    max_names: int = MAX_LISTED_ENTRIES


def _session(options: S3Options) -> tuple[Any, str]:
    """A boto3 session and the region it signs for; reads no credentials yet. ConfigError when
    the AWS configuration names what is not there (``AWS_PROFILE`` of no profile)."""
    try:
        session = boto3.Session(region_name=options.region or None)
    except botocore.exceptions.BotoCoreError as exc:
        raise ConfigError(
            _refusal(
                "the AWS configuration cannot be read",
                exc,
                "check AWS_PROFILE and the AWS config files (AWS_CONFIG_FILE, ~/.aws/config)",
            )
        ) from exc
    return session, session.region_name or DEFAULT_REGION


def _bucket_url(location: S3Location, options: S3Options, region: str) -> str:
    if options.endpoint_url:
        return f"{options.endpoint_url.rstrip('/')}/{location.bucket}"
    return f"https://{location.bucket}.s3.{region}.amazonaws.com"


class S3Store(HttpStore):
    """A SnapshotStore in an S3 bucket: the HTTP store with every request signed (SigV4).

    >>> store = S3Store("s3://snapshots/prod", Path("/var/cache/voxrecall"))
    >>> version = store.latest("support")     # GET .../support/LATEST, If-None-Match: a 304
    >>> folder = store.fetch("support", version)

    Credentials are resolved on the first request (in the refresher's thread: instance metadata
    may take a second) and refreshed by botocore when they expire; none found, requests go
    unsigned (a public bucket). Needs s3:GetObject on the prefix and s3:ListBucket on the bucket
    (without it S3 answers 403, not 404, for a key not there yet).
    """

    def __init__(
        self,
        url: str,
        cache_dir: Path,
        options: HttpOptions | None = None,
        s3: S3Options | None = None,
    ) -> None:
        self.location = S3Location.parse(url)
        self.s3 = s3 or S3Options()
        self._session, self.region = _session(self.s3)
        self._bucket_url = _bucket_url(self.location, self.s3, self.region)
        base_url = f"{self._bucket_url}/{self.location.prefix}".rstrip("/")
        super().__init__(base_url, cache_dir, options)
        self._credentials: botocore.credentials.Credentials | None = None
        self._look_again_at = 0.0  # while no credentials are found: when to look again
        self._lock = threading.Lock()
        self.skipped = SkippedNames()  # the listing's names that are not bases, logged once
        self._cut_logged = False  # a listing past ``S3Options.max_names`` was said once

    def __repr__(self) -> str:
        return f"S3Store({str(self.location)!r}, cache={str(self.cache_dir)!r})"

    def knowledge_bases(self) -> frozenset[str]:
        """The bases under the prefix (ListObjectsV2 by "/", needs s3:ListBucket), read with
        the downloads' own guards: each page at most ``MAX_LIST_PAGE_BYTES`` and
        ``MAX_LIST_PAGE_NAMES``, the whole listing within ``download_timeout_s``, at most
        ``MAX_LIST_PAGES`` pages, each named by a token of at most
        ``MAX_CONTINUATION_TOKEN_BYTES``, no page declaring a document type, and only names that are one safe path component (a listing is
        not trusted to name folders of the cache). It stops at ``S3Options.max_names`` names,
        the first by name (as S3 lists), said once in the log."""
        deadline = time.monotonic() + self.options.download_timeout_s
        prefix = self.location.key("") if self.location.prefix else ""
        names: set[str] = set()
        skipped = self.skipped.tally()  # counted as read: a page's names are not kept past it
        token: str | None = ""
        pages = 0
        try:
            while token is not None and len(names) < self.s3.max_names:
                pages += 1
                if pages > MAX_LIST_PAGES:
                    raise StoreUnavailable(
                        f"the listing goes on past {MAX_LIST_PAGES} pages; a prefix holds a few "
                        "bases: point the store at the prefix that holds them"
                    )
                found, token = self._list_page(prefix, token, deadline)
                names.update(_base_names(found, prefix, skipped))
        except SnapshotError as exc:
            raise StoreUnavailable(f"{self.location}: cannot list the bases: {exc}") from exc
        self.skipped.note(str(self.location), skipped)
        return self._first_names(names, more=token is not None)

    def _first_names(self, names: set[str], more: bool) -> frozenset[str]:
        """The first ``max_names`` of ``names`` by name; a listing cut short is logged once."""
        if not more and len(names) <= self.s3.max_names:
            return frozenset(names)
        if not self._cut_logged:
            log.warning(
                "%s: the listing goes on past %d base names: the first %d by name are read; "
                "split the bases over shards ([sidecar] shards) or prefixes",
                self.location,
                self.s3.max_names,
                self.s3.max_names,
            )
            self._cut_logged = True
        return frozenset(sorted(names)[: self.s3.max_names])

    def _list_page(self, prefix: str, token: str, deadline: float) -> tuple[list[str], str | None]:
        """One page of the listing: its common prefixes, and the token of the next page (None
        at the end)."""
        query = {"list-type": "2", "delimiter": "/", "prefix": prefix}
        if token:
            query["continuation-token"] = token
        encoded = urllib.parse.urlencode(sorted(query.items()), quote_via=urllib.parse.quote)
        url = f"{self._bucket_url}?{encoded}"

        def attempt() -> bytes:
            with self._within(url, deadline):
                try:
                    resp = self._request(url, {})
                except IncompleteSnapshot as exc:  # a 404 here: the bucket is not there
                    raise StoreUnavailable(f"HTTP 404: no bucket {self.location.bucket}") from exc
                with resp:
                    try:
                        return self._read_all(resp, url, MAX_LIST_PAGE_BYTES, deadline)
                    except _TooLong as exc:
                        raise StoreUnavailable(
                            f"a page of the listing is over {MAX_LIST_PAGE_BYTES} bytes"
                        ) from exc

        return _parse_listing(self._with_retries(url, attempt))

    def _open(self, url: str, headers: dict[str, str]) -> Any:
        try:
            return super()._open(url, self._signed(url, headers))
        except urllib.error.HTTPError as exc:
            if exc.code != 403:
                raise
            exc.close()
            reason = (
                "Forbidden: the sidecar needs s3:GetObject on the prefix and s3:ListBucket on "
                f"the bucket {self.location.bucket} (credentials in region {self.region})"
            )
            raise urllib.error.HTTPError(url, 403, reason, exc.headers, None) from exc

    def _signed(self, url: str, headers: dict[str, str]) -> dict[str, str]:
        credentials = self._frozen_credentials()
        if credentials is None:
            return headers
        request = botocore.awsrequest.AWSRequest(method="GET", url=url, headers=dict(headers))
        botocore.auth.S3SigV4Auth(credentials, "s3", self.region).add_auth(request)
        return dict(request.headers.items())

    def _frozen_credentials(self) -> Any:
        """The credentials to sign with, found once; while there are none (a public bucket, or
        instance metadata not answering yet at start), looked for again every minute at most."""
        with self._lock:
            if self._credentials is None and time.monotonic() >= self._look_again_at:
                try:
                    self._credentials = self._session.get_credentials()
                except botocore.exceptions.BotoCoreError as exc:
                    raise StoreUnavailable(
                        _refusal(
                            f"{self.location}: no AWS credentials",
                            exc,
                            f"{CREDENTIALS_HINT}, or give none for a public bucket",
                        )
                    ) from exc
                if self._credentials is None:
                    if not self._look_again_at:
                        log.warning("%s: no AWS credentials found: requests go unsigned", self)
                    self._look_again_at = time.monotonic() + CREDENTIALS_LOOK_AGAIN_S
            credentials = self._credentials
        return None if credentials is None else credentials.get_frozen_credentials()


class _HasDoctype(Exception):
    """A listing declared a document type (``_NoDoctype``)."""


class _NoDoctype(ElementTree.TreeBuilder):
    """A tree builder that stops the parse at a document type declaration, before any entity
    it declares: S3 sends none, and expat's guard against entity bombs still lets one expand
    to 100 times its input (a page of 2 MiB held a name of 160 MB)."""

    def doctype(self, name: str, pubid: str | None, system: str | None) -> None:
        raise _HasDoctype(name)


def _parse_listing(data: bytes) -> tuple[list[str], str | None]:
    """A ListObjectsV2 answer's common prefixes and next continuation token (None: the last
    page). One of more than ``MAX_LIST_PAGE_TAGS`` tags is refused unparsed, and one that
    declares a document type before its entities are read (``_NoDoctype``); ElementTree
    resolves no external entity."""
    tags = data.count(b"<")
    if tags > MAX_LIST_PAGE_TAGS:
        raise StoreUnavailable(
            f"a page of the listing holds {tags} tags; S3's holds at most {MAX_LIST_PAGE_TAGS}: "
            "not an S3 listing"
        )
    parser = ElementTree.XMLParser(target=_NoDoctype())
    try:
        parser.feed(data)
        root = parser.close()
    except _HasDoctype as exc:
        raise StoreUnavailable(
            "the listing declares a document type (<!DOCTYPE>); S3 sends none: not an S3 listing"
        ) from exc
    except ElementTree.ParseError as exc:
        raise StoreUnavailable(f"the listing is not XML ({exc})") from exc
    found = [p.text or "" for p in root.iterfind("{*}CommonPrefixes/{*}Prefix")]
    if len(found) > MAX_LIST_PAGE_NAMES:
        raise StoreUnavailable(
            f"a page of the listing names {len(found)} prefixes; S3 sends at most "
            f"{MAX_LIST_PAGE_NAMES} a page: not an S3 listing"
        )
    truncated = (root.findtext("{*}IsTruncated") or "").strip() == "true"
    token = (root.findtext("{*}NextContinuationToken") or "").strip()
    if truncated and not token:
        raise StoreUnavailable("the listing is truncated but names no continuation token")
    if truncated and len(token.encode("utf-8", "replace")) > MAX_CONTINUATION_TOKEN_BYTES:
        raise StoreUnavailable(
            f"the listing's continuation token is over {MAX_CONTINUATION_TOKEN_BYTES} bytes; "
            "S3's are a few hundred: not an S3 listing"
        )
    return found, token if truncated else None


def _base_names(found: list[str], prefix: str, skipped: SkippedTally) -> list[str]:
    """The base names of a page's common prefixes (those directly under ``prefix`` that are one
    safe path component); the prefixes skipped ("a/../../x", a name with "/") are counted into
    ``skipped``."""
    names: list[str] = []
    for full in found:
        name = full[len(prefix) :].removesuffix("/") if full.startswith(prefix) else ""
        if is_base_name(name):  # one safe path component (a letter or digit first)
            names.append(name)
        elif name:
            skipped.add(full)
    return names


def _client_config(timeout_s: float) -> botocore.config.Config:
    return botocore.config.Config(
        connect_timeout=timeout_s,
        read_timeout=timeout_s,
        retries={"max_attempts": 4, "mode": "standard"},
    )


class S3Publisher:
    """Copies verified snapshot folders into a bucket (the indexer's side).

    Needs s3:PutObject and s3:GetObject on the prefix, s3:ListBucket on the bucket.
    """

    def __init__(self, url: str, s3: S3Options | None = None, timeout_s: float = 60.0) -> None:
        self.location = S3Location.parse(url)
        options = s3 or S3Options()
        session, region = _session(options)
        try:  # the credentials are read here
            self._client = session.client(
                "s3",
                region_name=region,
                endpoint_url=options.endpoint_url or None,
                config=_client_config(timeout_s),
            )
        except botocore.exceptions.BotoCoreError as exc:
            what = f"cannot publish to {self.location}: no AWS credentials"
            raise SnapshotError(_refusal(what, exc, CREDENTIALS_HINT)) from exc

    def __str__(self) -> str:
        return str(self.location)

    def latest(self, knowledge_base: str) -> str | None:
        key = self.location.key(knowledge_base, LATEST)
        try:
            answer = self._client.get_object(Bucket=self.location.bucket, Key=key)
            with contextlib.closing(answer["Body"]) as body:
                data = body.read(MAX_POINTER_BYTES + 1)
        except self._client.exceptions.NoSuchKey:
            return None
        except (botocore.exceptions.BotoCoreError, botocore.exceptions.ClientError) as exc:
            what = f"cannot read {SCHEME}{self.location.bucket}/{key}"
            raise SnapshotError(_refusal(what, exc, BUCKET_HINT)) from exc
        return parse_pointer(data, f"{SCHEME}{self.location.bucket}/{key}")

    def publish_copy(self, knowledge_base: str, source: Path) -> str | None:
        """Upload a verified snapshot and point LATEST at it; None when the bucket is as new.

        The files go first, the manifest after them, LATEST last."""
        manifest = verify_snapshot(source)
        check_name(knowledge_base, "knowledge base", str(source))
        if manifest.knowledge_base != knowledge_base:
            raise SnapshotError(f"{source} is a snapshot of {manifest.knowledge_base!r}")
        current = self.latest(knowledge_base)
        if current is not None and manifest.version <= current:
            return None
        for name in [*manifest_files(manifest, str(source)), MANIFEST]:
            self._upload(source / name, self.location.key(knowledge_base, manifest.version, name))
        self._put(self.location.key(knowledge_base, LATEST), f"{manifest.version}\n".encode())
        return (
            f"{SCHEME}{self.location.bucket}/{self.location.key(knowledge_base, manifest.version)}"
        )

    def _upload(self, path: Path, key: str) -> None:
        try:
            self._client.upload_file(str(path), self.location.bucket, key)
        except (
            botocore.exceptions.BotoCoreError,
            botocore.exceptions.ClientError,
            boto3.exceptions.S3UploadFailedError,
        ) as exc:
            what = f"cannot upload {path.name} to {SCHEME}{self.location.bucket}/{key}"
            # boto3's upload error repeats the path and key before the server's words (its
            # ClientError, the context it was raised in)
            upload = isinstance(exc, boto3.exceptions.S3UploadFailedError)
            said = exc.__context__ if upload and exc.__context__ is not None else exc
            raise SnapshotError(_refusal(what, said, WRITE_HINT)) from exc

    def _put(self, key: str, data: bytes) -> None:
        try:
            self._client.put_object(
                Bucket=self.location.bucket, Key=key, Body=data, CacheControl="no-cache"
            )
        except (botocore.exceptions.BotoCoreError, botocore.exceptions.ClientError) as exc:
            what = f"cannot write {SCHEME}{self.location.bucket}/{key}"
            raise SnapshotError(_refusal(what, exc, WRITE_HINT)) from exc
