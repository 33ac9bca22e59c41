"""Refusals a caller can act on, against a real sidecar on 127.0.0.1 port 0 (the s13 attack's
F5, F13, F14): an unknown base among a thousand is NOT_FOUND naming a few, a compressed HTTP body
is 415 naming its Content-Encoding, and a ConverseRequest without a turn is INVALID_ARGUMENT."""

from __future__ import annotations

import gzip
from collections.abc import AsyncIterator
from pathlib import Path

import grpc
import httpx2
import pytest

from index.config import NAMED
from index.embedders.base import Embedder
from sidecar.config import Config
from sidecar.edge.server import Sidecar
from sidecar.gen import retrieval_pb2 as pb
from sidecar.gen import retrieval_pb2_grpc as pb_grpc
from tests.bases_kit import config as bases_config
from tests.conftest import EXAMPLE_KB, make_config
from tests.hardening_kit import running

BASES = 1000  # names of 51 characters: 52 KB listed whole, over gRPC's 16 KiB of metadata


async def test_an_unknown_base_among_many_is_not_found_naming_a_few(tmp_path: Path) -> None:
    pages = tmp_path / "pages"
    pages.mkdir()
    (pages / "a.md").write_text("# A page\n\nSome words.\n", encoding="utf-8")
    source = [{"name": "s", "type": "markdown", "path": str(pages)}]
    names = [f"tenant-{i:05d}-" + "k" * 38 for i in range(BASES)]
    tables = {"knowledge_base": [{"name": n, "source": source} for n in reversed(names)]}
    config = bases_config(tmp_path / "store", tmp_path, tables=tables, memory_budget_mb=64)
    async with (
        running(config, _no_embedder()) as sidecar,
        grpc.aio.insecure_channel(f"127.0.0.1:{sidecar.port}") as channel,
    ):
        stub = pb_grpc.RetrievalStub(channel)  # type: ignore[no-untyped-call]
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await stub.Search(pb.SearchRequest(knowledge_base="nope", query="hi"))
    assert info.value.code() is grpc.StatusCode.NOT_FOUND
    details = info.value.details() or ""
    assert details.startswith("unknown knowledge base 'nope'; known: ")
    assert all(repr(n) in details for n in names[:NAMED])  # the first, sorted
    assert repr(names[NAMED]) not in details
    assert details.endswith(f"and {BASES - NAMED} more")


def _no_embedder() -> Embedder:
    from index.embedders.base import FakeEmbedder

    return FakeEmbedder(dimension=8)  # no base is loaded: the refusal comes first


@pytest.fixture
async def http_sidecar(example_config: Config, local_embedder: Embedder) -> AsyncIterator[Sidecar]:
    source = [{"name": "help-center", "type": "markdown", "path": str(EXAMPLE_KB)}]
    store = example_config.sidecar.store
    assert isinstance(store, Path)
    config = make_config(store, source, http={"listen": "127.0.0.1:0"})
    async with running(config, local_embedder) as sidecar:
        yield sidecar


@pytest.mark.parametrize("path", ["/mcp", "/vapi/knowledge-base", "/tools/search"])
async def test_a_compressed_http_body_is_415_naming_its_encoding(
    http_sidecar: Sidecar, path: str
) -> None:
    body = gzip.compress(b'{"jsonrpc": "2.0", "id": 1, "method": "ping"}')
    async with httpx2.AsyncClient() as http:
        reply = await http.post(
            f"http://127.0.0.1:{http_sidecar.http_port}{path}",
            content=body,
            headers={"content-type": "application/json", "content-encoding": "gzip"},
        )
    assert reply.status_code == 415
    error = reply.json()["error"]
    assert error["code"] == "INVALID_ARGUMENT"
    assert error["message"].startswith("Content-Encoding 'gzip' is not supported")


async def test_a_converse_request_without_a_turn_is_refused_naming_the_field(
    example_sidecar: Sidecar,
) -> None:
    async with grpc.aio.insecure_channel(f"127.0.0.1:{example_sidecar.port}") as channel:
        stub = pb_grpc.RetrievalStub(channel)  # type: ignore[no-untyped-call]
        stream = stub.Converse()
        await stream.write(pb.ConverseRequest())
        await stream.done_writing()
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await stream.read()
    assert info.value.code() is grpc.StatusCode.INVALID_ARGUMENT
    assert "turn" in (info.value.details() or "")
