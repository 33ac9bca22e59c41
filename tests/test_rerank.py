"""The rerank stage against a real local server that speaks the Cohere rerank API: correct,
slow, trickling, 429, 500, closed, malformed; and through a real sidecar on port 0."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Iterator
from dataclasses import replace
from pathlib import Path

import grpc
import numpy as np
import pytest

from index.config import RerankConfig
from index.embedders.base import Embedder
from sidecar.config import Config
from sidecar.gen import retrieval_pb2 as pb
from sidecar.gen import retrieval_pb2_grpc as pb_grpc
from sidecar.turn.rerank import Reranker, RerankError, Status, parse_order
from tests.hardening_kit import build_store, running, sidecar_config, uses_of
from tests.rerank_server import RerankServer

DOCUMENTS = ["roaming prices in Europe", "reset your password", "turn roaming on in the app"]
FAR = 30.0  # a deadline no healthy local answer comes near (not a timing assertion)
NEAR = 0.05  # a deadline a server holding its answer for seconds is sure to miss


@pytest.fixture
def server() -> Iterator[RerankServer]:
    server = RerankServer().start()
    yield server
    server.stop()


@pytest.fixture
async def reranker(server: RerankServer) -> AsyncIterator[Reranker]:
    reranker = Reranker(RerankConfig(base_url=server.base_url, model="rerank-v3.5",
                                     api_key="k" * 20, max_response_bytes=4096))  # fmt: skip
    yield reranker
    await reranker.aclose()


def _deadline(seconds: float) -> float:
    return asyncio.get_running_loop().time() + seconds


async def test_a_correct_answer_orders_the_documents(
    server: RerankServer, reranker: Reranker
) -> None:
    order, status = await reranker.order("how much is roaming", DOCUMENTS, _deadline(FAR))
    assert status is Status.RERANKED
    assert order == (0, 2, 1)  # the roaming documents first, by the words they share
    sent = server.requests[-1]
    assert sent == {"model": "rerank-v3.5", "query": "how much is roaming",
                    "documents": DOCUMENTS, "top_n": 3}  # fmt: skip
    server.set(order="reverse")
    order, _ = await reranker.order("other words", DOCUMENTS, _deadline(FAR))
    assert order == (2, 1, 0)


async def test_a_slow_answer_misses_and_lands_in_the_cache_later(
    server: RerankServer, reranker: Reranker
) -> None:
    server.set(order="reverse", latency_s=0.3)
    order, status = await reranker.order("q", DOCUMENTS, _deadline(NEAR))
    assert (order, status) == (None, Status.RERANK_TIMED_OUT)
    # the call goes on in the background, bounded: its order answers the same question next
    await asyncio.wait(list(reranker._inflight.values()))
    server.set(fail_status=500)
    order, status = await reranker.order("q", DOCUMENTS, _deadline(FAR))
    assert (order, status) == ((2, 1, 0), Status.RERANKED)


async def test_a_trickling_body_is_cut_at_the_deadline(
    server: RerankServer, reranker: Reranker
) -> None:
    server.set(trickle_s=0.2)
    order, status = await reranker.order("q", DOCUMENTS, _deadline(NEAR))
    assert (order, status) == (None, Status.RERANK_TIMED_OUT)


@pytest.mark.parametrize(
    "behaviour",
    [
        {"fail_status": 429},
        {"fail_status": 500},
        {"close": True},
        {"body": b"<html>oops</html>"},
        {"body": b'{"results": [{"index": 7, "relevance_score": 0.9}]}'},
        {"body": b'{"results": [{"index": 0, "relevance_score": "high"}]}'},
        {"body": b'{"results": [{"index": 0, "relevance_score": 1}, {"index": 0, "relevance_score": 1}]}'},
        {"body": b'{"data": []}'},
        {"body": b'{"results": [], "pad": "' + b"x" * 5000 + b'"}'},  # over max_response_bytes
    ],
    ids=["429", "500", "closed", "not-json", "bad-index", "bad-score", "repeated", "no-results",
         "too-large"],
)  # fmt: skip
async def test_a_failure_keeps_the_vector_order_and_says_so(
    server: RerankServer, reranker: Reranker, behaviour: dict[str, object]
) -> None:
    server.set(**behaviour)
    order, status = await reranker.order("q", DOCUMENTS, _deadline(FAR))
    assert (order, status) == (None, Status.RERANK_FAILED)


async def test_no_time_left_makes_no_call(server: RerankServer, reranker: Reranker) -> None:
    order, status = await reranker.order("q", DOCUMENTS, _deadline(0.0))
    assert (order, status) == (None, Status.RERANK_TIMED_OUT)
    assert server.requests == []


def test_documents_the_answer_leaves_out_follow_in_vector_order() -> None:
    assert parse_order(b'{"results": [{"index": 2, "relevance_score": 0.5}]}', 4) == (2, 0, 1, 3)


def test_an_answer_of_more_containers_than_its_documents_need_is_refused_unparsed() -> None:
    """Attack s20: within max_response_bytes (256 KiB by default, up to 64 MiB) an answer held
    87,000 empty arrays, each a Python object orjson builds on the event loop. One holding
    more objects and arrays than one a document and ``CONTAINERS_BESIDES`` is refused."""
    results = b'{"results": [{"index": 1, "relevance_score": 0.9}], "meta": {"billed_units": {}}}'
    assert parse_order(results, 3) == (1, 0, 2)
    padded = results[:-1] + b', "padding": [' + b"[]," * 200 + b"[]]}"
    with pytest.raises(RerankError, match="objects and arrays; one for 3 documents holds at most"):
        parse_order(padded, 3)


async def test_an_answer_echoing_documents_of_code_is_read(
    server: RerankServer, reranker: Reranker
) -> None:
    """Jina echoes each document ({"document": {"text": ...}}) by default: brackets in the texts
    sent (code) are allowed for, as the answer may hold them again."""
    code = [f"config = {{'a': [{i}], 'b': {{}}}}" * 20 for i in range(3)]
    server.set(echo=True)
    order, status = await reranker.order("q", code, _deadline(FAR))
    assert status == Status.RERANKED
    assert sorted(order or ()) == [0, 1, 2]


# -- through a sidecar ----------------------------------------------------------------------


@pytest.fixture(scope="module")
def store(tmp_path_factory: pytest.TempPathFactory, local_embedder: Embedder) -> Path:
    return build_store(tmp_path_factory.mktemp("rerank"), local_embedder)


def reranked_help(store: Path, server: RerankServer) -> Config:
    """The store's sidecar, base "help" reranked by ``server``."""
    config = sidecar_config(store, budget_ms=5000, min_score=-1.0)
    rerank = RerankConfig(base_url=server.base_url, candidates=10)
    bases = tuple(
        replace(kb, rerank=rerank) if kb.name == "help" else kb for kb in config.knowledge_bases
    )
    return replace(config, knowledge_bases=bases)


@pytest.fixture
async def stub(
    store: Path, local_embedder: Embedder, server: RerankServer
) -> AsyncIterator[pb_grpc.RetrievalStub]:
    async with (
        running(reranked_help(store, server), local_embedder) as sidecar,
        grpc.aio.insecure_channel(f"127.0.0.1:{sidecar.port}") as channel,
    ):
        yield pb_grpc.RetrievalStub(channel)  # type: ignore[no-untyped-call]


def _ids(chunks: object) -> list[str]:
    return [c.chunk_id for c in chunks]  # type: ignore[attr-defined]


async def test_search_and_turn_answer_in_the_rerankers_order(
    stub: pb_grpc.RetrievalStub, server: RerankServer
) -> None:
    request = pb.SearchRequest(query="how do I reset my password", limit=3, min_score=-1)
    server.set(fail_status=500)
    vector = await stub.Search(request)
    assert vector.rerank == pb.RERANK_FAILED
    assert vector.chunks[0].title == "Reset your password"
    server.set(order="reverse")
    reranked = await stub.Search(request)
    assert reranked.rerank == pb.RERANKED
    assert len(server.requests[-1]["documents"]) == 3  # the base's every candidate (3 pages)
    assert _ids(reranked.chunks) == _ids(vector.chunks)[::-1]
    turn = await stub.Turn(pb.TurnRequest(session_id="r", text="how can I export my notes and "
                                          "photos", is_final=True))  # fmt: skip
    assert turn.rerank == pb.RERANKED
    server.set(latency_s=2.0)
    late = await stub.Turn(
        pb.TurnRequest(session_id="s", text="add a new phone", is_final=True, budget_ms=300)
    )
    assert late.rerank == pb.RERANK_TIMED_OUT
    assert late.chunks[0].title == "Add a device"  # vector order


async def test_a_base_without_rerank_says_none(stub: pb_grpc.RetrievalStub) -> None:
    resp = await stub.Search(pb.SearchRequest(query="refund", knowledge_base="billing"))
    assert resp.rerank == pb.RERANK_NONE


async def test_a_search_by_a_vector_alone_uses_a_reranked_base_once(
    store: Path, local_embedder: Embedder, server: RerankServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A vector alone on a base with a rerank stage goes the general way (``nearest_to`` gives
    it up before using the base): used once, as a call is, not three times in microseconds,
    which would mark it as a caller's working set that another's loads may not evict."""
    (vector,) = await local_embedder.embed(["how do I reset my password"])
    request = pb.SearchRequest(
        knowledge_base="help", vector=np.asarray(vector, dtype="<f4").tobytes(), limit=3
    )
    async with (
        running(reranked_help(store, server), local_embedder) as sidecar,
        grpc.aio.insecure_channel(f"127.0.0.1:{sidecar.port}") as channel,
    ):
        used = uses_of(sidecar, monkeypatch)
        stub = pb_grpc.RetrievalStub(channel)  # type: ignore[no-untyped-call]
        answer = await stub.Search(request, timeout=10)
    assert used == ["help"]
    assert answer.chunks[0].title == "Reset your password"


async def test_a_turn_searched_once_hands_the_reranker_its_candidates(
    example_config: Config, local_embedder: Embedder, server: RerankServer
) -> None:
    """A first turn, searched once (no page prior, no entity), searched only ``max_results``
    deep: the rerank stage reordered 3 chunks where it asks for ``candidates`` (8 here, of the
    example help centre's 13)."""
    rerank = RerankConfig(base_url=server.base_url, candidates=8)
    bases = tuple(replace(kb, rerank=rerank) for kb in example_config.knowledge_bases)
    config = replace(example_config, knowledge_bases=bases)
    config = replace(config, sidecar=replace(config.sidecar, max_results=3, min_score=-1.0))
    async with (
        running(config, local_embedder) as sidecar,
        grpc.aio.insecure_channel(f"127.0.0.1:{sidecar.port}") as channel,
    ):
        turn = await pb_grpc.RetrievalStub(channel).Turn(
            pb.TurnRequest(session_id="r", text="How do I reset my password?", is_final=True)
        )
    assert turn.rerank == pb.RERANKED
    assert len(turn.chunks) == 3
    assert len(server.requests[-1]["documents"]) == 8
