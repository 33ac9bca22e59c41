"""The OpenAI provider against a real local HTTP server speaking the embeddings API."""

from __future__ import annotations

import asyncio
import re
from collections.abc import AsyncIterator, Iterator
from dataclasses import replace
from pathlib import Path

import grpc
import numpy as np
import pytest

from index.build import build_knowledge_base
from index.config import EmbedderConfig
from index.embedders import remote
from index.embedders.base import Embedder, HashEmbedder, unit_rows
from index.embedders.remote import OpenAIEmbedder
from index.errors import ConfigError, EmbedderError
from index.hnsw_file import HEADER, _Header
from index.snapshot import VECTORS, read_manifest
from index.store import LocalStore
from sidecar.config import Config
from sidecar.edge.server import create_server
from sidecar.gen import retrieval_pb2 as pb
from sidecar.gen import retrieval_pb2_grpc as pb_grpc
from tests.conftest import EXAMPLE_KB, make_config
from tests.openai_server import Behaviour, OpenAIServer
from tests.snapshot_kit import resign

DIMENSION = 64


@pytest.fixture
def server() -> Iterator[OpenAIServer]:
    srv = OpenAIServer(dimension=256).start()  # the request's `dimensions` must win over 256
    yield srv
    srv.stop()


def openai_config(server: OpenAIServer, **changes: object) -> EmbedderConfig:
    config = EmbedderConfig(
        provider="openai",
        model="text-embedding-3-small",
        base_url=server.base_url,
        dimensions=DIMENSION,
        batch_size=4,
        max_concurrency=3,
    )
    return replace(config, **changes)  # type: ignore[arg-type]


@pytest.fixture
async def embedder(server: OpenAIServer) -> AsyncIterator[OpenAIEmbedder]:
    emb = OpenAIEmbedder(openai_config(server), retries=2, backoff_s=0.01)
    yield emb
    await emb.aclose()


def expected(texts: list[str]) -> np.ndarray:
    return HashEmbedder(dimension=DIMENSION).embed_batch(texts)


async def test_dimensions_and_model_are_passed_through(
    server: OpenAIServer, embedder: OpenAIEmbedder
) -> None:
    assert isinstance(embedder, Embedder)
    assert embedder.info.name == "openai/text-embedding-3-small"
    assert embedder.info.dimension == DIMENSION
    vectors = await embedder.embed(["How do I split a pane?"])
    assert server.last_request["dimensions"] == DIMENSION
    assert server.last_request["model"] == "text-embedding-3-small"
    assert server.last_request["input"] == ["How do I split a pane?"]
    np.testing.assert_allclose(vectors, expected(["How do I split a pane?"]), atol=1e-6)


async def test_native_dimension_is_not_sent(server: OpenAIServer) -> None:
    emb = OpenAIEmbedder(openai_config(server, dimensions=0, model="text-embedding-3-small"))
    try:
        with pytest.raises(EmbedderError, match="expected 1536-d"):
            emb.embed_batch(["one text"])  # the server answers in its own 256 dimensions
        assert "dimensions" not in server.last_request
    finally:
        await emb.aclose()


async def test_bulk_sends_batches_side_by_side_and_keeps_order(
    server: OpenAIServer, embedder: OpenAIEmbedder
) -> None:
    texts = [f"chunk number {i} about panes and tabs" for i in range(22)]  # 6 batches of <= 4
    server.set(hold_until=3)  # no answer until three requests are in flight at once
    vectors = embedder.embed_batch(texts)
    np.testing.assert_allclose(vectors, expected(texts), atol=1e-6)
    assert server.requests == 6
    assert server.max_in_flight == 3  # max_concurrency, never more


async def test_bulk_requests_are_cut_at_the_byte_budget_too(
    server: OpenAIServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Up to the API's 2048 inputs a request, and never past MAX_REQUEST_BYTES of text (the
    API's 300k-token limit): here 100 bytes, so three 30-byte chunks a request."""
    monkeypatch.setattr(remote, "MAX_REQUEST_BYTES", 100)
    emb = OpenAIEmbedder(openai_config(server, batch_size=2048), retries=2, backoff_s=0.01)
    texts = [f"chunk {i:04d} about panes and tabs!"[:30] for i in range(10)]
    try:
        np.testing.assert_allclose(emb.embed_batch(texts), expected(texts), atol=1e-6)
    finally:
        await emb.aclose()
    assert server.requests == 4  # 3 + 3 + 3 + 1, sent side by side: any may come last


def test_request_batches_keep_order_and_both_limits() -> None:
    texts = ["a" * 10, "b" * 10, "c" * 95, "d", "e", "f", "g"]
    assert remote.request_batches(texts, 3, 100) == [
        ["a" * 10, "b" * 10],
        ["c" * 95, "d", "e"],
        ["f", "g"],
    ]
    assert remote.request_batches(["x" * 500], 3, 100) == [["x" * 500]]  # alone, not dropped


def test_a_batch_size_over_the_api_limit_is_refused(server: OpenAIServer) -> None:
    with pytest.raises(ConfigError, match="2048"):
        OpenAIEmbedder(openai_config(server, batch_size=2049))


async def test_bulk_retries_429_then_succeeds(
    server: OpenAIServer, embedder: OpenAIEmbedder
) -> None:
    server.set(fail_status=429, fail_times=2)
    vectors = embedder.embed_batch(["a", "b"])
    np.testing.assert_allclose(vectors, expected(["a", "b"]), atol=1e-6)
    assert server.requests == 3


@pytest.mark.parametrize("retry_after", ["-1", "nan", "-inf"])
async def test_bulk_retries_past_a_retry_after_no_sleep_takes(
    server: OpenAIServer, embedder: OpenAIEmbedder, retry_after: str
) -> None:
    """Attack s20: a 429's "Retry-After: -1" (or "nan") went to ``time.sleep`` as it was, which
    raised ValueError out of the build, no EmbedderError. Such a value is not a wait: the
    retry waits its own backoff."""
    server.set(fail_status=429, fail_times=1, retry_after=retry_after)
    vectors = embedder.embed_batch(["a", "b"])
    np.testing.assert_allclose(vectors, expected(["a", "b"]), atol=1e-6)
    assert server.requests == 2


def test_a_build_request_may_take_as_long_as_its_answer_cap_needs_at_a_slow_rate() -> None:
    """A review: 300 s for every request failed an honest build of 2,048 texts at 3,072
    dimensions (up to 200 MB of JSON) on a 10 Mbit/s link shared by max_concurrency requests."""
    assert remote.build_request_s(16, 384) == remote.BUILD_REQUEST_S
    cap = remote.response_cap(2048, 3072)
    assert remote.build_request_s(2048, 3072) == cap / remote.BUILD_MIN_BYTES_PER_S > 1500


@pytest.mark.parametrize("status", [429, 502, 503])
async def test_bulk_retries_an_error_whose_page_is_big(
    server: OpenAIServer, embedder: OpenAIEmbedder, status: int
) -> None:
    """A review: with an error's body capped at 16 KiB, a 429 or 5xx whose page was bigger (a
    gateway's HTML page runs to tens of KB) was refused by the cap and ended the build, where it
    was retried before. Its head is read and the status retried as any."""
    server.set(fail_status=status, fail_times=1, pad_bytes=40_000)
    vectors = embedder.embed_batch(["a", "b"])
    np.testing.assert_allclose(vectors, expected(["a", "b"]), atol=1e-6)
    assert server.requests == 2


async def test_bulk_gives_up_on_a_trickled_answer(
    server: OpenAIServer, embedder: OpenAIEmbedder, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Attack s20: the client's timeout bounds each read, so an answer trickled 16 bytes at a
    time (~16 s here, as long as the server liked) held a build's request for all of it; the
    request is now bounded whole (BUILD_REQUEST_S) and retried as a timeout is."""
    monkeypatch.setattr(remote, "BUILD_REQUEST_S", 0.5)
    monkeypatch.setattr(remote, "BUILD_MIN_BYTES_PER_S", 1 << 40)  # the floor, 0.5 s, rules
    server.set(trickle_s=0.2)
    with pytest.raises(EmbedderError, match="gave up after 3 tries: BuildRequestTimeout: no w"):
        embedder.embed_batch(["a"])
    assert server.requests == 3


@pytest.mark.parametrize(
    "behaviour", [Behaviour(fail_status=500, fail_times=-1), Behaviour(close=True)]
)
async def test_bulk_gives_up_after_the_retries(
    server: OpenAIServer, embedder: OpenAIEmbedder, behaviour: Behaviour
) -> None:
    server.set(behaviour)
    with pytest.raises(EmbedderError, match="gave up after 3 tries"):
        embedder.embed_batch(["a"])
    assert server.requests == 3


async def test_bulk_does_not_retry_a_bad_request(
    server: OpenAIServer, embedder: OpenAIEmbedder
) -> None:
    server.set(fail_status=400, fail_times=-1)
    with pytest.raises(EmbedderError, match="BadRequestError"):
        embedder.embed_batch(["a"])
    assert server.requests == 1


@pytest.mark.parametrize(
    "behaviour", [Behaviour(fail_status=429, fail_times=1), Behaviour(close=True)]
)
async def test_hot_path_never_retries(
    server: OpenAIServer, embedder: OpenAIEmbedder, behaviour: Behaviour
) -> None:
    server.set(behaviour)
    with pytest.raises(EmbedderError):
        await embedder.embed(["a"])
    assert server.requests == 1


async def test_snapshot_built_with_openai_is_refused_by_a_local_sidecar(
    tmp_path: Path, server: OpenAIServer, embedder: OpenAIEmbedder, local_embedder: Embedder
) -> None:
    config = make_config(
        tmp_path / "store",
        [{"name": "help-center", "type": "markdown", "path": str(EXAMPLE_KB)}],
    )
    summary = build_knowledge_base(config, config.knowledge_bases[0], embedder)
    assert summary.published
    assert summary.embedded > 0
    sidecar = await create_server(config, embedder=local_embedder, poll=False)
    try:
        refusal = sidecar.holder.last_refusal("docs")
        assert refusal is not None
        assert "openai/text-embedding-3-small" in refusal.reason
        assert sidecar.holder.get("docs") is None
        async with grpc.aio.insecure_channel(f"127.0.0.1:{sidecar.port}") as channel:
            client = pb_grpc.RetrievalStub(channel)
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await client.Turn(pb.TurnRequest(text="roaming prices", is_final=True), timeout=10)
            status = await client.Status(pb.StatusRequest(), timeout=10)
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE
        assert "openai/text-embedding-3-small" in status.knowledge_bases[0].last_refusal
    finally:
        await sidecar.stop(0.5)


async def test_values_too_large_for_float32_keep_their_direction(
    server: OpenAIServer, embedder: OpenAIEmbedder
) -> None:
    """Values of 1e39 and more (past float32's range: infinities, then NaN, when they were read
    as float32) are read as float64 and scaled before the norm: the same direction."""
    server.set(values="huge")
    got = await embedder.embed(["roaming prices", "reset my password"])
    np.testing.assert_allclose(got, expected(["roaming prices", "reset my password"]), atol=1e-6)


@pytest.mark.parametrize(
    ("behaviour", "says"),
    [
        (Behaviour(values="zero"), "every value zero"),
        (Behaviour(pad_bytes=2_000_000), "bytes"),
        (Behaviour(fail_status=400, fail_times=-1, pad_bytes=20_000_000), "Error code: 400"),
        (Behaviour(drop_mid_body=True), "RemoteProtocolError"),
        (
            Behaviour(fail_status=400, fail_times=-1, pad_bytes=50_000_000, gzip_error=True),
            "Content-Encoding 'gzip'",
        ),
        (Behaviour(shift_index=True), "indexes [1, 2]"),
        # Attack s20: within the byte caps, but each a Python object the parse builds on the
        # event loop (an answer's cap at 1,536 dimensions held 546,000: ~55 ms)
        (Behaviour(containers=20_000), "arrays; one of 2 vectors holds at most 68"),
        # an error's body: its first 16 KiB read, the rest left (the status says what failed)
        (Behaviour(fail_status=500, fail_times=-1, pad_bytes=60_000), "Error code: 500"),
        # and values: 1.6 MB of "0," in one vector were 819,000 numbers to parse (~20 ms)
        (Behaviour(values="long"), "more values than 2 vectors of 64 hold (at most 208)"),
    ],
    ids=[
        "zero",
        "2MB",
        "20MB-error",
        "dropped",
        "gzip-bomb-error",
        "index",
        "arrays",
        "60kB-error",
        "values",
    ],
)
async def test_an_answer_that_is_no_vectors_is_refused_by_name(
    server: OpenAIServer, embedder: OpenAIEmbedder, behaviour: Behaviour, says: str
) -> None:
    server.set(behaviour)
    with pytest.raises(EmbedderError, match=re.escape(says)):
        await embedder.embed(["roaming prices", "reset my password"])
    with pytest.raises(EmbedderError, match=re.escape(says)):
        await asyncio.to_thread(embedder.embed_batch, ["roaming prices", "reset my password"])


def test_a_build_refuses_vectors_with_no_direction_and_reuses_none(
    tmp_path: Path, server: OpenAIServer
) -> None:
    """A server answering zeros publishes nothing; a snapshot that already holds vectors of
    zeros (published before answers were checked) has them embedded again, not reused."""
    config = make_config(
        tmp_path / "store",
        [{"name": "help-center", "type": "markdown", "path": str(EXAMPLE_KB)}],
    )
    embedder = OpenAIEmbedder(openai_config(server), retries=0, backoff_s=0.01)
    try:
        _build_twice_over_zeros(config, embedder, server)
    finally:
        asyncio.run(embedder.aclose())


def _build_twice_over_zeros(config: Config, embedder: OpenAIEmbedder, server: OpenAIServer) -> None:
    kb = config.knowledge_bases[0]
    server.set(values="zero")
    with pytest.raises(EmbedderError, match="every value zero"):
        build_knowledge_base(config, kb, embedder)
    assert LocalStore(config.index.store).latest(kb.name) is None
    server.set(Behaviour())
    first = build_knowledge_base(config, kb, embedder)
    assert first.published
    _spoil_vectors(LocalStore(config.index.store).latest_dir(kb.name))
    again = build_knowledge_base(config, kb, embedder)
    assert again.published
    assert again.reused == 0
    assert again.embedded == first.embedded


def _spoil_vectors(folder: Path) -> None:
    """Overwrite a published snapshot's vectors with zeros in place (the graph kept), and write
    the file's new checksum into its manifest, as a store's writer could."""
    path = folder / VECTORS
    data = bytearray(path.read_bytes())
    head = _Header(bytes(data[: HEADER.size]), str(path))
    dimension = read_manifest(folder).embedder.dimension
    zeros = bytes(4 * dimension)
    for i in range(head.count):
        start = HEADER.size + i * head.size_per_element + head.offset_data
        data[start : start + len(zeros)] = zeros
    path.write_bytes(bytes(data))
    resign(folder, VECTORS)


def test_unit_rows_names_the_first_row_with_no_direction() -> None:
    np.testing.assert_allclose(unit_rows(np.array([[3e300, 4e300]])), [[0.6, 0.8]], atol=1e-7)
    for rows, says in (
        ([[1.0, 1.0], [np.nan, 1.0]], "vector 1 has a value that is not finite (1 of 2"),
        ([[np.inf, 0.0]], "vector 0 has a value that is not finite"),
        ([[1.0, 0.0], [0.0, 0.0], [0.0, 0.0]], "vector 1 has every value zero (2 of 3"),
    ):
        with pytest.raises(ValueError, match=re.escape(says)):
            unit_rows(np.array(rows))
    assert unit_rows(np.zeros((0, 4))).shape == (0, 4)
