"""The OpenAI provider against a real local HTTP server speaking the embeddings API."""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator
from dataclasses import replace
from pathlib import Path

import grpc
import numpy as np
import pytest

from index.build import build_knowledge_base
from index.config import EmbedderConfig
from index.embedders import remote
from index.embedders.base import Embedder, HashEmbedder
from index.embedders.remote import OpenAIEmbedder
from index.errors import ConfigError, EmbedderError
from sidecar.edge.server import create_server
from sidecar.gen import retrieval_pb2 as pb
from sidecar.gen import retrieval_pb2_grpc as pb_grpc
from tests.conftest import EXAMPLE_KB, make_config
from tests.openai_server import Behaviour, OpenAIServer

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
