"""What only the S3 store does, against a real S3-compatible server (moto, its own process).

The contract it shares with the folder and HTTP stores is in tests/test_store_contract.py.
Here: `voxrecall index publish --to s3://bucket/prefix`, signed requests (checked by a moto
that verifies signatures and the IAM policies docs/config.md gives each side), listing the
bases, and a sidecar serving an s3 store. The faults the HTTP store is held to (500s, a body cut
off, an object past its manifest size, a trickle, a close mid-read), injected by a proxy between
the store and moto, are the contract's too (its `downloading` fixture).
"""

from __future__ import annotations

import json
import logging
import os
import re
import threading
import time
import tracemalloc
import urllib.parse
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any, ClassVar

import grpc
import pytest

from index.embedders.base import HashEmbedder
from index.errors import ConfigError, StoreUnavailable
from index.http_store import HttpOptions
from index.snapshot import MANIFEST, verify_snapshot
from index.store import open_store
from sidecar.cli import main
from sidecar.config import parse_config
from sidecar.edge.server import MAX_LISTED_BASES, create_server, sidecar_store
from sidecar.gen import retrieval_pb2 as pb
from sidecar.gen import retrieval_pb2_grpc as pb_grpc
from tests.s3_kit import FaultProxy, Mirror, MotoServer, new_bucket, s3_client
from tests.snapshot_kit import KB, version_id, write_version

boto3 = pytest.importorskip("boto3", reason="the S3 store is the `s3` extra")

import botocore.credentials  # noqa: E402

from index import s3_store  # noqa: E402
from index.s3_store import S3Location, S3Options, S3Store  # noqa: E402

EMBEDDER = HashEmbedder(dimension=32)
FAST = HttpOptions(timeout_s=5.0, attempts=3, backoff_s=0.01, max_backoff_s=0.02)
LIVENESS_S = 60.0  # a bound on waiting for a fetch to return, not a timing claim
PREFIX = "snapshots/prod"


@pytest.fixture
def bucket(moto_server: Any) -> tuple[Any, str]:
    client = s3_client(moto_server.url)
    return client, new_bucket(client)


@pytest.fixture
def faulty(
    moto_server: Any, bucket: tuple[Any, str], tmp_path: Path
) -> Iterator[tuple[Mirror, FaultProxy, S3Store]]:
    """A published folder mirrored into the bucket, and an S3Store reading it via the proxy."""
    client, name = bucket
    root = tmp_path / "published"
    root.mkdir()
    proxy = FaultProxy(moto_server.port)
    try:
        store = S3Store(
            f"s3://{name}/{PREFIX}", tmp_path / "cache", FAST, S3Options(endpoint_url=proxy.url)
        )
        yield Mirror(root, client, name, PREFIX), proxy, store
    finally:
        proxy.stop()


def _publish(mirror: Mirror, n: int = 1, topic: str = "password") -> Path:
    folder = write_version(mirror.root, version_id(n), EMBEDDER, topic)
    mirror.sync()
    return folder


# -- locations and config ----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("url", "bucket", "prefix"),
    [("s3://kb-snapshots", "kb-snapshots", ""), ("s3://b.x-1/a/b/", "b.x-1", "a/b")],
)
def test_an_s3_url_names_a_bucket_and_a_prefix(url: str, bucket: str, prefix: str) -> None:
    assert S3Location.parse(url) == S3Location(bucket, prefix)


@pytest.mark.parametrize("url", ["s3://", "s3://UPPER/x", "s3://ok-bucket/a b", "s3://ok/../x"])
def test_a_bad_s3_url_is_a_config_error(url: str) -> None:
    with pytest.raises(ConfigError):
        S3Location.parse(url)


def test_the_sidecar_config_takes_an_s3_store(tmp_path: Path) -> None:
    raw = {
        "knowledge_base": [{"name": KB, "source": [{"type": "markdown", "path": "docs"}]}],
        "sidecar": {
            "store": "s3://kb-snapshots/prod/",
            "s3_endpoint_url": "http://minio:9000",
            "s3_region": "eu-west-1",
        },
    }
    sidecar = parse_config(raw, base=tmp_path).sidecar
    assert sidecar.store == "s3://kb-snapshots/prod"
    store = open_store(
        sidecar.store,
        cache_dir=tmp_path,
        s3_endpoint_url=sidecar.s3_endpoint_url,
        s3_region=sidecar.s3_region,
    )
    assert isinstance(store, S3Store)
    assert store.base_url == "http://minio:9000/kb-snapshots/prod"
    assert store.region == "eu-west-1"


def test_on_aws_the_bucket_is_addressed_virtual_hosted(tmp_path: Path) -> None:
    store = S3Store("s3://kb-snapshots/prod", tmp_path, s3=S3Options(region="eu-west-1"))
    assert store.base_url == "https://kb-snapshots.s3.eu-west-1.amazonaws.com/prod"


# -- signed requests, listing, publishing ------------------------------------------------------


def test_requests_are_signed_with_sigv4(faulty: tuple[Mirror, FaultProxy, S3Store]) -> None:
    mirror, _, store = faulty
    _publish(mirror)
    seen: list[dict[str, str]] = []
    original = store._signed

    def spy(url: str, headers: dict[str, str]) -> dict[str, str]:
        signed = original(url, headers)
        seen.append(signed)
        return signed

    store._signed = spy  # type: ignore[method-assign]
    assert store.latest(KB) == version_id(1)
    (headers,) = seen
    assert headers["Authorization"].startswith("AWS4-HMAC-SHA256 Credential=testing/")
    assert "/us-east-1/s3/aws4_request" in headers["Authorization"]
    assert "X-Amz-Date" in headers


def test_a_huge_etag_is_not_kept_and_the_pointer_is_read_again(
    faulty: tuple[Mirror, FaultProxy, S3Store],
) -> None:
    """As for an http(s) store (the same ``latest``): an S3-compatible server answering
    60,000-byte ETags had each base's kept whole; now each poll reads the pointer, and an ETag
    of the usual size is still answered 304."""
    mirror, proxy, store = faulty
    _publish(mirror)
    proxy.etag_pad = 60_000
    assert [store.latest(KB), store.latest(KB)] == [version_id(1)] * 2
    proxy.etag_pad = 0
    assert [store.latest(KB), store.latest(KB)] == [version_id(1)] * 2
    assert [e.status for e in proxy.requests(f"/{KB}/LATEST")] == [200, 200, 200, 304]


def test_the_bases_under_the_prefix_are_listed(
    moto_server: Any, bucket: tuple[Any, str], tmp_path: Path
) -> None:
    client, name = bucket
    root = tmp_path / "published"
    for kb in ("billing", "support"):
        write_version(root, version_id(1), EMBEDDER, kb=kb)
    Mirror(root, client, name, PREFIX).sync()
    client.put_object(Bucket=name, Key="elsewhere/other/LATEST", Body=b"x")
    options = S3Options(endpoint_url=moto_server.url)
    store = S3Store(f"s3://{name}/{PREFIX}", tmp_path / "cache", FAST, options)
    assert store.knowledge_bases() == {"billing", "support"}


def test_a_missing_bucket_is_unavailable_not_empty(moto_server: Any, tmp_path: Path) -> None:
    options = S3Options(endpoint_url=moto_server.url)
    store = S3Store("s3://no-such-bucket-here/x", tmp_path / "cache", FAST, options)
    with pytest.raises(StoreUnavailable, match=r"HTTP 404|NoSuchBucket"):
        store.knowledge_bases()


class _HostileListing(BaseHTTPRequestHandler):
    """An S3-compatible endpoint whose bucket listing is endless (each page truncated, with a
    new continuation token; it would end after ``ENDLESS_PAGES``), not XML, names bases that
    are paths out of the cache (``escape``), is one page of ``HUGE_BYTES`` (``huge``), or
    sends its headers and then a byte every ``TRICKLE_S`` (``trickle``), or is pages of
    ``PAGE_NAMES`` short prefixes each (``stuffed``: S3 sends at most 1,000 a page), or of
    ``PAGE_NAMES`` prefixes of ``LONG`` ``TILDE`` characters, not base names (``long``), or
    names its base through an entity its document type declares (``entities``), or names the
    next page by a token of 5,001 bytes (``long_token``), or holds 80,000 tags (``tags``);
    ``pages`` counts the pages asked for."""

    ENDLESS_PAGES = 40
    PAGE_NAMES = 1000
    pages: ClassVar[list[int]] = []
    HUGE_BYTES = 64 * 1024 * 1024
    TRICKLE_S = 0.05
    LONG = 2000
    TILDE = "~"
    ESCAPES = ("a/../../evil", "x/y", "..", ".hidden", "spaced name", "é")
    mode = "endless"

    def log_message(self, format: str, *args: Any) -> None:
        pass

    def do_GET(self) -> None:
        query = urllib.parse.parse_qs(urllib.parse.urlsplit(self.path).query)
        page = int(query.get("continuation-token", ["0"])[0])
        self.pages.append(page)
        if self.mode in ("huge", "trickle"):
            self._hostile_body(query.get("prefix", [""])[0])
            return
        if self.mode == "escape":
            names = [*self.ESCAPES, "support"]
            body = (
                '<ListBucketResult xmlns="http://s3.amazonaws.com/doc/2006-03-01/">'
                "<IsTruncated>false</IsTruncated>"
                + "".join(
                    f"<CommonPrefixes><Prefix>prod/{n}/</Prefix></CommonPrefixes>" for n in names
                )
                + "</ListBucketResult>"
            ).encode()
        elif self.mode in ("stuffed", "long"):
            body = self._stuffed(page)
        elif self.mode == "long_token":  # page 1's token, padded with zeros past S3's
            more = page == 0
            token = "0" * 5000 + "1"
            body = (
                '<ListBucketResult xmlns="http://s3.amazonaws.com/doc/2006-03-01/">'
                f"<IsTruncated>{str(more).lower()}</IsTruncated>"
                f"<CommonPrefixes><Prefix>prod/kb{page}/</Prefix></CommonPrefixes>"
                + (f"<NextContinuationToken>{token}</NextContinuationToken>" if more else "")
                + "</ListBucketResult>"
            ).encode()
        elif self.mode == "tags":  # 20,000 objects' entries: 80,000 tags in 760 kB
            body = (
                b'<ListBucketResult xmlns="http://s3.amazonaws.com/doc/2006-03-01/">'
                b"<IsTruncated>false</IsTruncated>"
                b"<CommonPrefixes><Prefix>prod/support/</Prefix></CommonPrefixes>"
                + b"<Contents><Key>prod/x</Key></Contents>" * 20_000
                + b"</ListBucketResult>"
            )
        elif self.mode == "entities":
            body = (
                b'<?xml version="1.0"?><!DOCTYPE ListBucketResult [<!ENTITY kb "support">]>'
                b'<ListBucketResult xmlns="http://s3.amazonaws.com/doc/2006-03-01/">'
                b"<IsTruncated>false</IsTruncated>"
                b"<CommonPrefixes><Prefix>prod/&kb;/</Prefix></CommonPrefixes>"
                b"</ListBucketResult>"
            )
        elif self.mode == "endless":
            more = page + 1 < self.ENDLESS_PAGES
            body = (
                '<?xml version="1.0" encoding="UTF-8"?>'
                '<ListBucketResult xmlns="http://s3.amazonaws.com/doc/2006-03-01/">'
                f"<Name>b</Name><Prefix></Prefix><KeyCount>1</KeyCount><MaxKeys>1000</MaxKeys>"
                f"<Delimiter>/</Delimiter><IsTruncated>{str(more).lower()}</IsTruncated>"
                f"<CommonPrefixes><Prefix>kb{page}/</Prefix></CommonPrefixes>"
                + (f"<NextContinuationToken>{page + 1}</NextContinuationToken>" if more else "")
                + "</ListBucketResult>"
            ).encode()
        else:
            body = b"<ListBucketResult><CommonPrefixes><Prefix>kb/</Prefix></Common"
        self.send_response(200)
        self.send_header("Content-Type", "application/xml")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def _stuffed(self, page: int) -> bytes:
        more = page + 1 < self.ENDLESS_PAGES
        tail = self.TILDE * self.LONG if self.mode == "long" else ""
        return (
            '<ListBucketResult xmlns="http://s3.amazonaws.com/doc/2006-03-01/">'
            f"<IsTruncated>{str(more).lower()}</IsTruncated>"
            + "".join(
                f"<CommonPrefixes><Prefix>prod/{page:02d}{i:05d}{tail}/</Prefix></CommonPrefixes>"
                for i in range(self.PAGE_NAMES)
            )
            + (f"<NextContinuationToken>{page + 1}</NextContinuationToken>" if more else "")
            + "</ListBucketResult>"
        ).encode()

    def _hostile_body(self, prefix: str) -> None:
        self.send_response(200)
        self.send_header("Content-Type", "application/xml")
        self.send_header("Content-Length", str(self.HUGE_BYTES))
        self.end_headers()
        entry = f"<CommonPrefixes><Prefix>{prefix}kb/</Prefix></CommonPrefixes>".encode()
        block = entry * (64 * 1024 // len(entry)) if self.mode == "huge" else b" "
        try:
            self.wfile.write(b'<ListBucketResult xmlns="http://s3.amazonaws.com/doc/2006-03-01/">')
            for _ in range(self.HUGE_BYTES // len(block)):
                self.wfile.write(block)
                if self.mode == "trickle":
                    time.sleep(self.TRICKLE_S)
        except OSError:
            pass  # the store hung up: what it should do


@pytest.fixture
def hostile_s3(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Iterator[str]:
    for key in list(os.environ):
        if key.startswith("AWS_"):
            monkeypatch.delenv(key)
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "testing")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "testing")
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "no-aws-config"))
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "no-aws-credentials"))
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
    server = ThreadingHTTPServer(("127.0.0.1", 0), _HostileListing)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


def test_an_endless_listing_is_unavailable_not_read_forever(
    hostile_s3: str, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setattr(s3_store, "MAX_LIST_PAGES", 5)
    store = S3Store("s3://snaps/prod", tmp_path / "cache", FAST, S3Options(endpoint_url=hostile_s3))
    with pytest.raises(StoreUnavailable, match="past 5 pages"):
        store.knowledge_bases()


# A listing page the store cannot read is refused, with what was wrong, before the parse where
# the parse itself is the attack (attack s20):
LISTINGS_REFUSED = [
    ("broken", "cannot list the bases"),  # not XML
    # within its 2 MiB, 524,000 elements of "<a/>", which the tree builder makes holding the
    # GIL: the worker thread listing the store held the event loop ~0.3 s
    ("tags", "holds 80008 tags; S3's holds at most 64000"),
    # expat's guard against entity bombs lets an entity expand to 100 times the input (a 1.9 MB
    # page held a name of 160 MB, ~360 MB to parse); S3 declares no document type
    ("entities", r"cannot list the bases: .*document type"),
]


@pytest.mark.parametrize(
    ("mode", "refusal"), LISTINGS_REFUSED, ids=[m for m, _ in LISTINGS_REFUSED]
)
def test_a_listing_page_the_store_cannot_read_is_refused(
    hostile_s3: str, monkeypatch: pytest.MonkeyPatch, tmp_path: Path, mode: str, refusal: str
) -> None:
    monkeypatch.setattr(_HostileListing, "mode", mode)
    store = S3Store("s3://snaps/prod", tmp_path / "cache", FAST, S3Options(endpoint_url=hostile_s3))
    with pytest.raises(StoreUnavailable, match=refusal):
        store.knowledge_bases()


def test_a_listing_with_a_huge_continuation_token_is_refused(
    hostile_s3: str, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """Attack s20: a token of 1.5 MB went into the next page's URL, so into each retry's log
    line and the refusal that named it (a 1.5 MB message). S3's tokens are a few hundred
    bytes: one over ``MAX_CONTINUATION_TOKEN_BYTES`` is refused before the next page."""
    monkeypatch.setattr(_HostileListing, "mode", "long_token")
    monkeypatch.setattr(_HostileListing, "pages", [])
    store = S3Store("s3://snaps/prod", tmp_path / "cache", FAST, S3Options(endpoint_url=hostile_s3))
    with pytest.raises(StoreUnavailable, match="continuation token is over 4096 bytes") as refused:
        store.knowledge_bases()
    assert len(str(refused.value)) < 300
    assert _HostileListing.pages == [0]


def test_a_listing_names_only_bases_never_paths_out_of_the_cache(
    hostile_s3: str, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """A name from the listing becomes a folder of the cache (and of ``retain``'s deletes): a
    store that lists "a/../../evil" must not name a folder outside it."""
    monkeypatch.setattr(_HostileListing, "mode", "escape")
    store = S3Store("s3://snaps/prod", tmp_path / "cache", FAST, S3Options(endpoint_url=hostile_s3))
    assert store.knowledge_bases() == {"support"}


def test_a_listing_page_of_more_names_than_s3_sends_is_refused_naming_the_store(
    hostile_s3: str, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """100 pages of 33,000 short prefixes each fit the pages' bytes: 3.3 M names were kept."""
    monkeypatch.setattr(_HostileListing, "mode", "stuffed")
    # within MAX_LIST_PAGE_BYTES and MAX_LIST_PAGE_TAGS (four tags a name)
    monkeypatch.setattr(_HostileListing, "PAGE_NAMES", 15_000)
    monkeypatch.setattr(_HostileListing, "pages", [])
    store = S3Store("s3://snaps/prod", tmp_path / "cache", FAST, S3Options(endpoint_url=hostile_s3))
    with pytest.raises(StoreUnavailable) as info:
        store.knowledge_bases()
    assert str(info.value).startswith("s3://snaps/prod: cannot list the bases: ")
    assert "names 15000 prefixes; S3 sends at most 1000 a page" in str(info.value)
    assert _HostileListing.pages == [0]  # not one page more


def test_a_listing_stops_at_the_names_a_sidecar_reads_the_first_by_name(
    hostile_s3: str, monkeypatch: pytest.MonkeyPatch, tmp_path: Path, caplog: Any
) -> None:
    monkeypatch.setattr(_HostileListing, "mode", "stuffed")
    monkeypatch.setattr(_HostileListing, "pages", [])
    options = S3Options(endpoint_url=hostile_s3, max_names=2500)
    store = S3Store("s3://snaps/prod", tmp_path / "cache", FAST, options)
    with caplog.at_level(logging.WARNING, logger="voxrecall.store"):
        names = store.knowledge_bases()
        assert store.knowledge_bases() == names
    assert _HostileListing.pages == [0, 1, 2, 0, 1, 2]  # 3 of the 40 pages, each time
    assert names == frozenset(
        f"{p:02d}{i:05d}" for p in range(3) for i in range(1000)[: 2500 - 1000 * p]
    )
    cut = [r.getMessage() for r in caplog.records if "goes on past 2500" in r.getMessage()]
    assert len(cut) == 1  # said once, not at every poll


def test_a_listing_of_many_long_names_that_are_not_bases_holds_none_of_them(
    hostile_s3: str, monkeypatch: pytest.MonkeyPatch, tmp_path: Path, caplog: Any
) -> None:
    """A listing of 100 pages of 1,000 prefixes of 2,000 bytes that are not bases (each page
    within the limits) peaked at 237 MB: every name was held whole until the listing ended,
    then a set of them (200 characters each) kept until the next listing, at every poll."""
    monkeypatch.setattr(_HostileListing, "mode", "long")
    monkeypatch.setattr(_HostileListing, "ENDLESS_PAGES", 20)
    page_bytes = _HostileListing.PAGE_NAMES * _HostileListing.LONG  # 2 MB of names a page
    store = S3Store("s3://snaps/prod", tmp_path / "cache", FAST, S3Options(endpoint_url=hostile_s3))
    with caplog.at_level(logging.WARNING, logger="voxrecall.store"):
        tracemalloc.start()
        try:
            before = tracemalloc.get_traced_memory()[0]
            assert store.knowledge_bases() == frozenset()
            held, peak = tracemalloc.get_traced_memory()
        finally:
            tracemalloc.stop()
        assert store.knowledge_bases() == frozenset()  # the same names: not said again
        monkeypatch.setattr(_HostileListing, "TILDE", "!")  # as many names, not the same
        assert store.knowledge_bases() == frozenset()
    assert peak - before < 8 * page_bytes  # about a page at a time, not the 20 of the listing
    assert held - before < page_bytes // 4  # none of the 20,000 names kept (a client's own state)
    said = [r.getMessage() for r in caplog.records if "not base names" in r.getMessage()]
    assert len(said) == 2, [line[:200] for line in said]
    for line, mark in zip(said, "~!", strict=True):
        assert "skipped 20000 names" in line
        assert repr(f"prod/0000000{mark * 68}") + ", " in line  # the first by name, cut to 80
        assert line.endswith(" and 19995 more")
        assert len(line) < 1000


def test_a_sidecar_reads_of_an_s3_listing_what_its_shard_may_serve(tmp_path: Path) -> None:
    raw = {"sidecar": {"store": "s3://snaps/prod", "shards": 4, "shard": 1}}
    store = sidecar_store(parse_config(raw, base=tmp_path))
    assert isinstance(store, S3Store)
    assert store.s3.max_names == 2 * MAX_LISTED_BASES * 4


@pytest.mark.parametrize(
    ("mode", "deadline_s", "refusal"),
    [
        ("huge", LIVENESS_S, "over 2097152 bytes"),  # refused by its size, long before this
        ("trickle", 0.5, "not downloaded within 0.5 s"),  # every read well within timeout_s
    ],
)
def test_a_listing_too_big_or_too_slow_is_unavailable_not_read_on(
    hostile_s3: str,
    monkeypatch: pytest.MonkeyPatch,
    tmp_path: Path,
    mode: str,
    deadline_s: float,
    refusal: str,
) -> None:
    monkeypatch.setattr(_HostileListing, "mode", mode)
    options = HttpOptions(timeout_s=5.0, download_timeout_s=deadline_s, attempts=1)
    store = S3Store(
        "s3://snaps/prod", tmp_path / "cache", options, S3Options(endpoint_url=hostile_s3)
    )
    with pytest.raises(StoreUnavailable, match=refusal):
        store.knowledge_bases()


def _config_file(tmp_path: Path, endpoint: str) -> Path:
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
s3_endpoint_url = "{endpoint}"
""",
        encoding="utf-8",
    )
    return path


def test_index_publish_to_s3_uploads_what_an_s3_store_reads(
    moto_server: Any,
    bucket: tuple[Any, str],
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    _, name = bucket
    config = _config_file(tmp_path, moto_server.url)
    write_version(tmp_path / "built", version_id(1), EMBEDDER)
    to = f"s3://{name}/{PREFIX}"
    assert main(["index", "publish", "--config", str(config), "--to", to]) == 0
    assert main(["index", "publish", "--config", str(config), "--to", to]) == 0
    out = capsys.readouterr().out
    assert f"published {version_id(1)} to s3://{name}/{PREFIX}/{KB}/{version_id(1)}" in out
    assert "already has" in out
    options = S3Options(endpoint_url=moto_server.url)
    store = S3Store(to, tmp_path / "cache", FAST, options)
    assert store.latest(KB) == version_id(1)
    assert verify_snapshot(store.fetch(KB, version_id(1))).version == version_id(1)
    write_version(tmp_path / "built", version_id(2), EMBEDDER, "roaming")
    assert main(["index", "publish", "--config", str(config), "--to", to]) == 0
    assert store.latest(KB) == version_id(2)


async def test_a_sidecar_serves_the_bases_of_an_s3_store(
    moto_server: Any, bucket: tuple[Any, str], tmp_path: Path
) -> None:
    """`[sidecar] store = "s3://..."` end to end: the bases listed from the bucket, downloaded,
    verified, loaded and searched over gRPC."""
    client, name = bucket
    root = tmp_path / "published"
    for kb in ("billing", "support"):
        write_version(root, version_id(1), EMBEDDER, "roaming", kb=kb)
    Mirror(root, client, name, PREFIX).sync()
    raw = {
        "sidecar": {
            "store": f"s3://{name}/{PREFIX}",
            "s3_endpoint_url": moto_server.url,
            "cache_dir": str(tmp_path / "cache"),
            "listen": "127.0.0.1:0",
            "min_score": -1.0,
            "budget_ms": 5_000,
        }
    }
    sidecar = await create_server(parse_config(raw, base=tmp_path), embedder=EMBEDDER, poll=False)
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{sidecar.port}") as channel:
            stub = pb_grpc.RetrievalStub(channel)  # type: ignore[no-untyped-call]
            status = await stub.Status(pb.StatusRequest(), timeout=10)
            versions = {kb.name: kb.snapshot_version for kb in status.knowledge_bases}
            assert versions == {"billing": version_id(1), "support": version_id(1)}
            resp = await stub.Search(
                pb.SearchRequest(knowledge_base="support", query="roaming abroad"), timeout=10
            )
            assert resp.chunks
    finally:
        await sidecar.stop(0.5)
    assert (tmp_path / "cache" / "support" / version_id(1) / MANIFEST).is_file()


def _policy(bucket: str, actions: list[str]) -> str:
    """docs/config.md "S3 permissions": the objects under the prefix, and listing the bucket."""
    return json.dumps(
        {
            "Version": "2012-10-17",
            "Statement": [
                {
                    "Effect": "Allow",
                    "Action": actions,
                    "Resource": f"arn:aws:s3:::{bucket}/{PREFIX}/*",
                },
                {
                    "Effect": "Allow",
                    "Action": ["s3:ListBucket"],
                    "Resource": f"arn:aws:s3:::{bucket}",
                },
            ],
        }
    )


def _user(iam: Any, name: str, policy: str) -> dict[str, str]:
    iam.create_user(UserName=name)
    iam.put_user_policy(UserName=name, PolicyName=name, PolicyDocument=policy)
    key = iam.create_access_key(UserName=name)["AccessKey"]
    return {
        "AWS_ACCESS_KEY_ID": key["AccessKeyId"],
        "AWS_SECRET_ACCESS_KEY": key["SecretAccessKey"],
    }


def test_signatures_and_the_documented_permissions_hold_against_a_checking_server(
    moto_server: Any,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """A second moto that checks every signature and IAM policy (after the 7 set-up calls):
    the indexer publishes with the writer's policy, a sidecar reads with the reader's, which
    cannot write; a wrong secret is a 403 that names the permissions."""
    checking = MotoServer({"INITIAL_NO_AUTH_ACTION_COUNT": "7"}).start()
    try:
        admin = s3_client(checking.url)
        iam = boto3.session.Session(
            aws_access_key_id="testing", aws_secret_access_key="testing", region_name="us-east-1"
        ).client("iam", endpoint_url=checking.url)
        name = new_bucket(admin)
        reader = _user(iam, "reader", _policy(name, ["s3:GetObject"]))
        writer = _user(iam, "writer", _policy(name, ["s3:GetObject", "s3:PutObject"]))

        for key, value in writer.items():
            monkeypatch.setenv(key, value)
        config = _config_file(tmp_path, checking.url)
        write_version(tmp_path / "built", version_id(1), EMBEDDER)
        to = f"s3://{name}/{PREFIX}"
        assert main(["index", "publish", "--config", str(config), "--to", to]) == 0, (
            capsys.readouterr().err
        )

        for key, value in reader.items():
            monkeypatch.setenv(key, value)
        options = S3Options(endpoint_url=checking.url)
        store = S3Store(to, tmp_path / "cache", FAST, options)
        assert verify_snapshot(store.fetch(KB, store.latest(KB) or "")).version == version_id(1)
        assert store.knowledge_bases() == {KB}  # the listing is signed as the server checks
        assert main(["index", "publish", "--config", str(config), "--to", to]) == 0  # as new
        write_version(tmp_path / "built", version_id(2), EMBEDDER, "roaming")
        assert main(["index", "publish", "--config", str(config), "--to", to]) == 2
        assert "AccessDenied" in capsys.readouterr().err  # the reader may not write

        monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "not-the-secret")
        wrong = S3Store(to, tmp_path / "cache2", FAST, options)
        with pytest.raises(StoreUnavailable, match=r"403 .*s3:GetObject"):
            wrong.latest(KB)
    finally:
        checking.stop()


def test_credentials_missing_at_start_are_looked_for_again(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Instance metadata slow at start must not leave every request unsigned until a restart:
    with none found, the chain is asked again a minute later (and not on every request)."""
    store = S3Store("s3://kb-snapshots/prod", tmp_path, s3=S3Options(region="eu-west-1"))
    answers: list[Any] = [None, None]
    asked: list[int] = []

    class Chain:
        def get_credentials(self) -> Any:
            asked.append(1)
            if answers:
                return answers.pop(0)
            return botocore.credentials.Credentials("AKIDEXAMPLE", "secret")

    monkeypatch.setattr(store, "_session", Chain())
    clock = [1000.0]
    monkeypatch.setattr(s3_store.time, "monotonic", lambda: clock[0])
    assert store._frozen_credentials() is None
    assert store._frozen_credentials() is None  # within the minute: not asked again
    assert len(asked) == 1
    clock[0] += s3_store.CREDENTIALS_LOOK_AGAIN_S
    assert store._frozen_credentials() is None
    clock[0] += s3_store.CREDENTIALS_LOOK_AGAIN_S
    assert store._frozen_credentials().access_key == "AKIDEXAMPLE"
    assert len(asked) == 3


async def test_a_base_missing_from_an_s3_store_says_to_publish_it_there(
    moto_server: Any, bucket: tuple[Any, str], tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """The LOADING line said to run `voxrecall index build` (which publishes to a local folder
    the sidecar never reads): a remote store is written by `voxrecall index publish --to`."""
    _, name = bucket
    raw = {
        "knowledge_base": [{"name": KB, "source": [{"type": "markdown", "path": "docs"}]}],
        "sidecar": {
            "store": f"s3://{name}/prod",
            "s3_endpoint_url": moto_server.url,
            "listen": "127.0.0.1:0",
            "cache_dir": str(tmp_path / "cache"),
        },
    }
    config = parse_config(raw, base=tmp_path)
    sidecar = await create_server(config, embedder=HashEmbedder(dimension=64), poll=False)
    await sidecar.stop(0.5)
    (waiting,) = [r.getMessage() for r in caplog.records if r.getMessage().startswith("LOADING")]
    assert f"waiting for a snapshot of '{KB}' in s3://{name}/prod" in waiting
    assert f"then `voxrecall index publish --to s3://{name}/prod` to publish it there" in waiting
    assert "it publishes to" not in waiting


def test_the_names_a_listing_skips_are_one_line_and_only_when_they_change(
    moto_server: Any, bucket: tuple[Any, str], tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Each name that is not a base was one warning at every poll: 3,000 of them, 734 KB of
    log per listing."""
    client, name = bucket
    for i in range(30):
        client.put_object(Bucket=name, Key=f"{PREFIX}/_odd-{i}/LATEST", Body=b"x")
    client.put_object(Bucket=name, Key=f"{PREFIX}/help/LATEST", Body=b"x")
    options = S3Options(endpoint_url=moto_server.url)
    store = S3Store(f"s3://{name}/{PREFIX}", tmp_path / "cache", FAST, options)
    with caplog.at_level(logging.WARNING, logger="voxrecall.store"):
        assert store.knowledge_bases() == {"help"}
        assert store.knowledge_bases() == {"help"}  # the same skipped: not said again
        client.put_object(Bucket=name, Key=f"{PREFIX}/_odd-new/LATEST", Body=b"x")
        assert store.knowledge_bases() == {"help"}
    said = [r.getMessage() for r in caplog.records if "skipped" in r.getMessage()]
    assert len(said) == 2, said
    assert "skipped 30 names" in said[0]
    assert "and 25 more" in said[0]
    assert "skipped 31 names" in said[1]


# -- refusals: one line, saying what to do (attack s18) -----------------------------------------

# A credential_process failing as `aws sso` helpers do: its stderr, over two lines, is what
# botocore's error quotes.
FAILING_PROCESS = """[default]
credential_process = sh -c "echo 'token expired' >&2; echo 'run: aws sso login' >&2; exit 1"
"""


def _one_line(err: str) -> str:
    """The refusal `main` printed, last: one line (log lines, botocore's INFO among them, may
    come before it)."""
    refusal = err[re.search("^error: ", err, re.MULTILINE).start() :]  # type: ignore[union-attr]
    assert refusal.count("\n") == 1, err
    return refusal


def test_credentials_failing_over_several_lines_are_refused_in_one_line_saying_what_to_do(
    moto_server: Any,
    bucket: tuple[Any, str],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """botocore's CredentialRetrievalError quotes the process's stderr whole: `index publish`
    ended in a traceback, and the store's StoreUnavailable (its log line, Status) ran over
    three lines."""
    _, name = bucket
    (tmp_path / "aws-config").write_text(FAILING_PROCESS)
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "aws-config"))
    monkeypatch.delenv("AWS_ACCESS_KEY_ID")
    monkeypatch.delenv("AWS_SECRET_ACCESS_KEY")
    config = _config_file(tmp_path, moto_server.url)
    write_version(tmp_path / "built", version_id(1), EMBEDDER)
    to = f"s3://{name}/x"
    assert main(["index", "publish", "--config", str(config), "--to", to]) == 2
    err = _one_line(capsys.readouterr().err)
    assert f"cannot publish to {to}: no AWS credentials: " in err
    assert "token expired\\nrun: aws sso login; fix the AWS credential chain" in err
    store = S3Store(to, tmp_path / "cache", FAST, S3Options(endpoint_url=moto_server.url))
    with pytest.raises(StoreUnavailable) as info:
        store.latest(KB)
    said = str(info.value)
    assert "\n" not in said
    assert said.startswith(f"{to}: no AWS credentials: ")
    assert said.endswith("fix the AWS credential chain (AWS_ACCESS_KEY_ID and "
                         "AWS_SECRET_ACCESS_KEY, AWS_PROFILE and the AWS config files, or the "
                         "instance's role), or give none for a public bucket")  # fmt: skip


@pytest.mark.parametrize("command", ["publish", "serve"])
def test_an_aws_profile_that_is_not_there_is_refused_in_one_line(
    moto_server: Any,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    command: str,
) -> None:
    """botocore's ProfileNotFound came out of the session's making: a traceback from both."""
    monkeypatch.setenv("AWS_PROFILE", "nowhere")
    config = _config_file(tmp_path, moto_server.url)
    if command == "publish":
        write_version(tmp_path / "built", version_id(1), EMBEDDER)
        argv = ["index", "publish", "--config", str(config), "--to", "s3://kb-snapshots/x"]
    else:
        argv = ["serve", "--config", str(config), "--store", "s3://kb-snapshots/x",
                "--listen", "127.0.0.1:0"]  # fmt: skip
    assert main(argv) == 2
    err = _one_line(capsys.readouterr().err)
    assert err == (
        "error: the AWS configuration cannot be read: The config profile (nowhere) could not be "
        "found; check AWS_PROFILE and the AWS config files (AWS_CONFIG_FILE, ~/.aws/config)\n"
    )


def test_a_publish_the_bucket_refuses_says_what_to_do_in_one_line(
    moto_server: Any, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    config = _config_file(tmp_path, moto_server.url)
    write_version(tmp_path / "built", version_id(1), EMBEDDER)
    to = "s3://no-such-bucket-here/x"
    assert main(["index", "publish", "--config", str(config), "--to", to]) == 2
    err = _one_line(capsys.readouterr().err)
    assert f"cannot read {to}/{KB}/LATEST: An error occurred (NoSuchBucket)" in err
    assert err.endswith(
        "; check that the bucket exists, that [index] s3_endpoint_url and s3_region name its "
        "server, and that the credentials may s3:PutObject and s3:GetObject on the prefix and "
        "s3:ListBucket on the bucket\n"
    )
