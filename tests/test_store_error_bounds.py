"""A store's error text is bounded wherever it goes (the s15 attack's D and E): a store whose
LATEST answers ``500 Internal EEE...`` with a reason phrase of 60,000 characters is refused
UNAVAILABLE naming the status, not RESOURCE_EXHAUSTED for a status too large for its trailing
metadata, and ``Status`` answers within its byte bound however many bases fail, counting those
it leaves out.

Real parts: a real sidecar on 127.0.0.1 port 0, a real static HTTP server that misbehaves
(tests/static_http.py), real gRPC clients.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import grpc
import pytest

from index.embedders.base import HashEmbedder
from sidecar.config import Config, parse_config
from sidecar.edge import service
from sidecar.edge.server import Sidecar, create_server
from sidecar.edge.status import MAX_STATUS_MESSAGE_BYTES, caller_message
from sidecar.errors import Unavailable
from sidecar.gen import retrieval_pb2 as pb
from sidecar.gen import retrieval_pb2_grpc as pb_grpc
from sidecar.snapshots.holder import MAX_REFUSAL_BYTES, SnapshotHolder
from tests.hardening_kit import TOKEN_A, TOKEN_B, bearer
from tests.static_http import StaticServer

EMBEDDER = HashEmbedder(dimension=32)
REASON = "Internal " + "E" * 60_000  # http.client reads a status line of up to 64 KiB
GRPC_METADATA_LIMIT = 16 * 1024  # a gRPC client's hard limit on a response's metadata


@pytest.fixture
def failing(tmp_path: Path) -> Iterator[StaticServer]:
    """A static server answering every request 500 with a reason phrase of 60,000 characters."""
    root = tmp_path / "published"
    root.mkdir()
    server = StaticServer(root).start()
    server.fail_next, server.fail_reason = 10**9, REASON
    try:
        yield server
    finally:
        server.stop()


def _config(store: str, tmp_path: Path, names: list[str], **sidecar: object) -> Config:
    pages = tmp_path / "pages"
    pages.mkdir(exist_ok=True)
    source = [{"name": "faq", "type": "markdown", "path": str(pages)}]
    raw = {
        "knowledge_base": [{"name": n, "source": source} for n in names],
        "index": {"store": str(tmp_path / "built")},
        "sidecar": {
            "store": store,
            "listen": "127.0.0.1:0",
            "cache_dir": str(tmp_path / "cache"),
            "http_timeout_s": 5.0,
            **sidecar,
        },
    }
    return parse_config(raw, base=tmp_path)


@contextlib.asynccontextmanager
async def _stub(config: Config) -> AsyncIterator[tuple[Sidecar, pb_grpc.RetrievalStub]]:
    sidecar = await create_server(config, embedder=EMBEDDER, poll=False)
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{sidecar.port}") as channel:
            yield sidecar, pb_grpc.RetrievalStub(channel)  # type: ignore[no-untyped-call]
    finally:
        await sidecar.stop(0.5)


async def test_a_store_answering_a_huge_reason_phrase_is_unavailable_with_a_short_message(
    failing: StaticServer, tmp_path: Path
) -> None:
    async with _stub(_config(failing.url, tmp_path, ["support"])) as (_sidecar, stub):
        for _ in range(3):  # the attack's searches 2-4 failed RESOURCE_EXHAUSTED
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await stub.Search(
                    pb.SearchRequest(knowledge_base="support", query="hi"), timeout=10
                )
            assert info.value.code() is grpc.StatusCode.UNAVAILABLE
            details = info.value.details() or ""
            assert "support" in details
            assert "HTTP 500 Internal EEE" in details
            assert "cut from" in details  # the phrase is marked as cut, not silently dropped
            assert len(details.encode()) <= MAX_STATUS_MESSAGE_BYTES
        status = await stub.Status(pb.StatusRequest(), timeout=10)
    (base,) = status.knowledge_bases
    assert base.last_refusal.startswith("store: unavailable: ")
    assert "HTTP 500 Internal EEE" in base.last_refusal
    assert len(base.last_refusal.encode()) <= MAX_REFUSAL_BYTES + 64  # kind and time around it


def test_a_refusal_is_kept_and_a_status_message_sent_within_their_bytes() -> None:
    """Each layer bounds what it keeps or sends, whatever the layer below let through."""
    holder = SnapshotHolder()
    holder.refuse("support", "", "unavailable", "é" * 100_000)  # two bytes a character
    refusal = holder.last_refusal("support")
    assert refusal is not None
    assert len(refusal.reason.encode()) <= MAX_REFUSAL_BYTES
    assert refusal.reason.startswith("éé")
    assert refusal.reason.endswith("[... cut from 200000 bytes]")
    message = caller_message(Unavailable("x" * 100_000))
    assert len(message.encode()) <= MAX_STATUS_MESSAGE_BYTES < GRPC_METADATA_LIMIT // 3
    assert message.startswith("xxx")
    assert message.endswith("[... cut from 100000 bytes]")


async def test_status_answers_within_its_bytes_and_counts_the_bases_left_out(
    failing: StaticServer, tmp_path: Path
) -> None:
    """10,000 failing bases with 128-character names made a 4 MB Status that gRPC refused to
    send (over [sidecar] max_message_bytes); the same at the smallest max_message_bytes: the
    first bases by name within half of it, and a count of the rest."""
    limit = 64 * 1024
    names = [f"{i:03d}" + "k" * 125 for i in range(200)]  # with their refusals: over 64 KiB
    config = _config(failing.url, tmp_path, names[::-1], max_message_bytes=limit)
    async with _stub(config) as (_sidecar, stub):
        status = await stub.Status(pb.StatusRequest(), timeout=10)
    listed = [b.name for b in status.knowledge_bases]
    assert 0 < len(listed) < len(names)
    assert listed == names[: len(listed)]  # the first by name
    assert status.knowledge_bases_left_out == len(names) - len(listed)
    assert all(b.last_refusal.startswith("store: unavailable: ") for b in status.knowledge_bases)
    assert status.ByteSize() <= min(service.MAX_STATUS_BYTES, limit // 2) + 1024


async def test_a_scoped_callers_status_lists_its_own_bases_and_counts_only_those_left_out(
    failing: StaticServer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Status was cut to its bytes before the caller's scope was applied: a caller scoped to a
    base late in the order saw none of its bases, and ``knowledge_bases_left_out`` counted the
    bases of the whole sidecar, which it may not know of."""
    limit = 64 * 1024
    names = [f"{i:03d}" + "k" * 125 for i in range(200)]  # with their refusals: over 64 KiB
    monkeypatch.setenv("VOX_TEST_TOKEN", TOKEN_A)
    monkeypatch.setenv("VOX_TEST_LAST", TOKEN_B)
    scoped = {"name": "last", "token_env": "VOX_TEST_LAST", "knowledge_bases": [names[-1]]}
    auth = {"token_env": "VOX_TEST_TOKEN", "caller": [scoped]}
    config = _config(failing.url, tmp_path, names, max_message_bytes=limit, auth=auth)
    async with _stub(config) as (_sidecar, stub):
        everyone = await stub.Status(pb.StatusRequest(), metadata=bearer(TOKEN_A), timeout=10)
        status = await stub.Status(pb.StatusRequest(), metadata=bearer(TOKEN_B), timeout=10)
    assert names[-1] not in [b.name for b in everyone.knowledge_bases]  # the cut leaves it out
    assert [b.name for b in status.knowledge_bases] == [names[-1]]
    assert status.knowledge_bases_left_out == 0


async def test_a_store_down_at_a_poll_is_one_log_line_naming_a_count_and_a_few_bases(
    failing: StaticServer, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A store outage failed every listed base's pointer: one ERROR line each (10,000 lines at
    the first poll); now one line a poll, the same failures at the next poll not again."""
    names = [f"kb{i:02d}" for i in range(30)]
    with caplog.at_level(logging.ERROR, logger="voxrecall"):
        async with _stub(_config(failing.url, tmp_path, names)) as (sidecar, stub):
            await sidecar.refresher.refresh()  # the same refusals: nothing logged again
            status = await stub.Status(pb.StatusRequest(), timeout=10)
    lines = [r.getMessage() for r in caplog.records if "pointer" in r.getMessage()]
    assert len(lines) == 1
    assert lines[0].startswith("cannot read the pointers of 30 bases (30 unavailable): ")
    assert "kb00" in lines[0]
    assert "and 25 more" in lines[0]
    assert "HTTP 500 Internal EEE" in lines[0]
    assert len(status.knowledge_bases) == 30  # each base's refusal is still in Status
    assert all(b.last_refusal.startswith("store: unavailable") for b in status.knowledge_bases)
