"""A source the serving snapshot does not have, named by a call (Search, Turn, Converse, a
knowledge function): INVALID_ARGUMENT naming it and the sources the snapshot has, bounded, and
a tool call's error output; also after a hot swap that dropped the source a session named.

A real grpc.aio sidecar on 127.0.0.1 port 0 over a real local store of small real snapshots.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import grpc
import orjson
import pytest

from index.config import NAME_CHARS, NAMED
from index.embedders.base import Embedder
from sidecar.edge.server import Sidecar, create_server
from sidecar.gen import retrieval_pb2 as pb
from sidecar.gen import retrieval_pb2_grpc as pb_grpc
from tests.bases_kit import config as bases_config
from tests.snapshot_kit import KB, version_id, write_version

QUESTION = "How do I reset my password?"


def config(root: Path, tmp_path: Path) -> Any:
    """One base with the sources "faq" and "guides"; a function that searches only "faq", and
    one that searches both."""
    sources = [
        {"name": name, "type": "markdown", "path": str(tmp_path)} for name in ("faq", "guides")
    ]
    tables = {
        "knowledge_base": [{"name": KB, "source": sources}],
        "function": [
            {
                "name": "search_faq",
                "description": "Answers from the FAQ.",
                "knowledge_base": KB,
                "sources": ["faq"],
            },
            {
                "name": "search_both",
                "description": "Answers from the FAQ and the guides.",
                "knowledge_base": KB,
                "sources": ["faq", "guides"],
            },
        ],
    }
    return bases_config(root, tmp_path, tables=tables)


@pytest.fixture
async def sidecar(tmp_path: Path, local_embedder: Embedder) -> AsyncIterator[Sidecar]:
    root = tmp_path / "store"
    root.mkdir()
    await asyncio.to_thread(write_version, root, version_id(1), local_embedder, source="faq")
    sc = await create_server(config(root, tmp_path), embedder=local_embedder, poll=False)
    try:
        yield sc
    finally:
        await sc.stop(0.5)


@pytest.fixture
async def stub(sidecar: Sidecar) -> AsyncIterator[Any]:
    async with grpc.aio.insecure_channel(f"127.0.0.1:{sidecar.port}") as channel:
        yield pb_grpc.RetrievalStub(channel)  # type: ignore[no-untyped-call]


def turn(session: str, sources: list[str]) -> pb.TurnRequest:
    return pb.TurnRequest(session_id=session, text=QUESTION, is_final=True, sources=sources)


async def refusal(call: Any) -> grpc.aio.AioRpcError:
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await call
    return caught.value


async def test_an_unknown_source_is_invalid_argument_naming_it_and_the_known_ones(
    stub: Any,
) -> None:
    for call in (
        stub.Search(pb.SearchRequest(query=QUESTION, sources=["faq", "nope"]), timeout=30),
        stub.Turn(turn("s1", ["nope"]), timeout=30),
    ):
        exc = await refusal(call)
        assert exc.code() is grpc.StatusCode.INVALID_ARGUMENT
        details = str(exc.details())
        assert "no source 'nope'" in details
        assert "its sources: 'faq'" in details
    # the known one alone still answers
    found = await stub.Search(pb.SearchRequest(query=QUESTION, sources=["faq"]), timeout=30)
    assert found.chunks
    assert {c.source for c in found.chunks} == {"faq"}


async def test_the_refusal_of_many_long_unknown_sources_is_bounded(stub: Any) -> None:
    names = [f"{i:03d}" + "x" * 1000 for i in range(200)]  # within the field limits
    exc = await refusal(stub.Search(pb.SearchRequest(query=QUESTION, sources=names), timeout=30))
    details = str(exc.details())
    assert exc.code() is grpc.StatusCode.INVALID_ARGUMENT
    assert f"and {200 - NAMED} more" in details
    assert len(details) < NAMED * (NAME_CHARS + 8) + 400
    assert "'000" in details
    assert "'005" not in details


async def test_a_hot_swap_that_drops_a_source_refuses_the_calls_naming_it(
    sidecar: Sidecar, stub: Any, tmp_path: Path, local_embedder: Embedder
) -> None:
    """A session (and a Converse stream) that named "faq" before the swap gets a clear
    INVALID_ARGUMENT after it, and the function restricted to "faq" an error output the model
    can read; the sidecar serves on, and the session too, without the source. A function whose
    configured sources the snapshot has only some of searches those (no mistake of the model's)."""
    before = await stub.Turn(turn("call-1", ["faq"]), timeout=30)
    assert before.chunks
    tool = pb.InvokeToolRequest(name="search_faq", arguments_json='{"query": "reset password"}')
    assert not (await stub.InvokeTool(tool, timeout=30)).is_error
    both = pb.InvokeToolRequest(name="search_both", arguments_json='{"query": "reset password"}')
    assert not (await stub.InvokeTool(both, timeout=30)).is_error  # "guides" is not built yet

    stream = stub.Converse(timeout=30)
    await stream.write(pb.ConverseRequest(turn=turn("call-2", ["faq"])))
    assert (await stream.read()).turn.chunks

    v2 = version_id(2)
    root = tmp_path / "store"
    await asyncio.to_thread(write_version, root, v2, local_embedder, source="guides")
    assert await sidecar.refresher.refresh() == [KB]

    exc = await refusal(stub.Turn(turn("call-1", ["faq"]), timeout=30))
    assert exc.code() is grpc.StatusCode.INVALID_ARGUMENT
    assert f"no source 'faq' (snapshot {v2}); its sources: 'guides'" in str(exc.details())

    await stream.write(pb.ConverseRequest(turn=turn("call-2", ["faq"])))
    exc = await refusal(stream.read())
    assert exc.code() is grpc.StatusCode.INVALID_ARGUMENT
    assert "no source 'faq'" in str(exc.details())

    answer = await stub.InvokeTool(tool, timeout=30)
    assert answer.is_error
    error = orjson.loads(answer.output)["error"]
    assert error["type"] == "unavailable"  # the model can do nothing about it
    assert "has none of 'faq' right now" in error["message"]
    answer = await stub.InvokeTool(both, timeout=30)
    assert not answer.is_error, answer.output  # the guides it still has
    assert "guides" in answer.output

    after = await stub.Turn(turn("call-1", []), timeout=30)  # the session goes on
    assert after.chunks
    assert after.snapshot_version == v2
