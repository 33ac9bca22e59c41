"""One policy for auto-search and the knowledge tool: the same question in the same scope gets
the same chunks, or the base's same fallback, from ``Turn`` (a fresh session) and ``InvokeTool``;
on a small base built here, and on slices of DSTC11 and doc2dial-dev when ``../shared/data`` is
present (``bench.policy_agreement``)."""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import replace
from pathlib import Path

import grpc
import orjson
import pytest

from bench.policy_agreement import FALLBACK, measure
from index.embedders.base import Embedder
from sidecar.gen import retrieval_pb2 as pb
from sidecar.gen import retrieval_pb2_grpc as pb_grpc
from tests.conftest import shared
from tests.hardening_kit import build_store, running, sidecar_config

QUESTIONS = [
    "how do I reset my password",
    "can I use the app on a second phone",
    "export all my photos",
    "what's the weather in Lisbon tomorrow",  # nothing passes: the fallback, both ways
    "who won the match last night",
]
INSTRUCTIONS = "Answer only from the results."


@pytest.fixture(scope="module")
def store(tmp_path_factory: pytest.TempPathFactory, local_embedder: Embedder) -> Path:
    return build_store(tmp_path_factory.mktemp("policy"), local_embedder)


@pytest.fixture
async def stub(store: Path, local_embedder: Embedder) -> AsyncIterator[pb_grpc.RetrievalStub]:
    config = sidecar_config(store, budget_ms=5000)
    bases = tuple(
        replace(kb, fallback=FALLBACK, instructions=INSTRUCTIONS) for kb in config.knowledge_bases
    )
    async with (
        running(replace(config, knowledge_bases=bases), local_embedder) as sidecar,
        grpc.aio.insecure_channel(f"127.0.0.1:{sidecar.port}") as channel,
    ):
        yield pb_grpc.RetrievalStub(channel)  # type: ignore[no-untyped-call]


async def test_turn_and_tool_agree_on_chunks_and_fallback(stub: pb_grpc.RetrievalStub) -> None:
    found = empty = 0
    for i, q in enumerate(QUESTIONS):
        turn = await stub.Turn(pb.TurnRequest(session_id=f"s{i}", text=q, is_final=True))
        args = orjson.dumps({"query": q}).decode()
        tool = await stub.InvokeTool(pb.InvokeToolRequest(name="search_help", arguments_json=args))
        assert [c.chunk_id for c in turn.chunks] == [c.chunk_id for c in tool.chunks], q
        assert turn.fallback == tool.fallback, q
        assert turn.instructions == tool.instructions == INSTRUCTIONS
        if turn.chunks:
            found += 1
            assert turn.fallback == ""
        else:
            empty += 1
            assert turn.fallback == FALLBACK
            assert orjson.loads(tool.output)["note"] == FALLBACK  # what the model reads
    assert found >= 3
    assert empty >= 1
    tools = await stub.ListTools(pb.ListToolsRequest())
    assert {(t.instructions, t.fallback) for t in tools.tools} == {(INSTRUCTIONS, FALLBACK)}


async def test_a_skipped_turn_is_not_given_the_fallback(stub: pb_grpc.RetrievalStub) -> None:
    turn = await stub.Turn(pb.TurnRequest(session_id="ack", text="okay thanks", is_final=True))
    assert turn.skipped != pb.NOT_SKIPPED
    assert turn.fallback == ""  # nothing was searched: nothing was missing
    assert turn.instructions == INSTRUCTIONS


async def test_standalone_questions_of_the_conversation_sets_agree(
    local_embedder: Embedder,
) -> None:
    data = shared()
    shared("dstc11-faq-reviews")
    shared("doc2dial-dev")
    result = await measure(data, tiny=True, embedder=local_embedder)
    for name, kinds in result.items():
        alone = kinds["standalone"]
        assert alone["questions"] > 0, name
        assert alone["agree_share"] == 1.0, (name, alone["disagreements"])
        assert kinds["followups"]["questions"] > 0, name  # measured, no goal
