"""The hard latency budget: a slow, trickling, failing or dead embedder never costs the answer.

Real servers throughout: the sidecar on port 0, and the OpenAI provider pointed at a local HTTP
server speaking the embeddings API (tests/openai_server.py) that is made to misbehave. Every
assertion is about behaviour ("answered and degraded"), never about a duration.
"""

from __future__ import annotations

import asyncio
import socket
import threading
import time
from collections.abc import AsyncIterator, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from typing import Any

import grpc
import pytest

from index.build import build_knowledge_base
from index.config import EmbedderConfig
from index.embedders.base import Embedder, EmbedderInfo, Vectors
from index.embedders.remote import HOT_PARALLEL_CALLS, OpenAIEmbedder
from sidecar.config import Config
from sidecar.edge.server import Sidecar, create_server
from sidecar.gen import retrieval_pb2 as pb
from sidecar.gen import retrieval_pb2_grpc as pb_grpc
from sidecar.turn import query_embedder
from sidecar.turn.budget import FALLBACK_RESERVE_MS, Budget
from tests.conftest import EXAMPLE_KB, eventually, make_config
from tests.openai_server import Behaviour, OpenAIServer

QUESTION = "How much does roaming cost in Europe?"
PAGE = "roaming.md"  # the example help centre's page that answers it, densely or lexically
WAIT_S = 10.0  # how long a test waits for background work before it fails (not a timing check)
# a budget no loaded machine misses: for the turns that must be answered by the embedder, so
# that "not degraded" checks the embedder's behaviour, not this machine's speed
AMPLE_MS = 10_000


# -- the Budget value ------------------------------------------------------------------------


def test_reserve_is_at_most_a_third_of_the_budget() -> None:
    assert Budget.start(150).reserve_ms == FALLBACK_RESERVE_MS
    assert Budget.start(30).reserve_ms == pytest.approx(10.0)
    with pytest.raises(ValueError, match="positive"):
        Budget.start(0)


async def test_a_spent_budget_leaves_no_time_to_embed() -> None:
    spent = Budget(total_ms=150, started=time.monotonic() - 1.0)
    assert spent.remaining_ms() == 0.0
    assert spent.embed_deadline() <= asyncio.get_running_loop().time()


async def test_embedding_deadline_keeps_the_reserve() -> None:
    budget = Budget.start(150)
    left_s = budget.embed_deadline() - asyncio.get_running_loop().time()
    assert left_s <= (150 - FALLBACK_RESERVE_MS) / 1000.0


# -- the OpenAI provider against a misbehaving server ------------------------------------------


@pytest.fixture(scope="module")
def server() -> Iterator[OpenAIServer]:
    srv = OpenAIServer().start()
    yield srv
    srv.stop()


def with_openai(config: Config, base_url: str) -> Config:
    embedder = EmbedderConfig(
        provider="openai", model="text-embedding-3-small", base_url=base_url, dimensions=64
    )
    return replace(config, embedder=embedder)


@pytest.fixture(scope="module")
def openai_config(tmp_path_factory: pytest.TempPathFactory, server: OpenAIServer) -> Config:
    """The example help centre, embedded through the local OpenAI server."""
    store = tmp_path_factory.mktemp("example-openai") / "store"
    source = {"name": "help-center", "type": "markdown", "path": str(EXAMPLE_KB)}
    config = with_openai(
        make_config(store, [source]),
        server.base_url,
    )
    embedder = OpenAIEmbedder(config.embedder)
    build_knowledge_base(config, config.knowledge_bases[0], embedder)
    asyncio.run(embedder.aclose())
    return config


@pytest.fixture
async def openai_sidecar(openai_config: Config, server: OpenAIServer) -> AsyncIterator[Sidecar]:
    server.set(Behaviour())
    embedder = OpenAIEmbedder(openai_config.embedder)
    sidecar = await create_server(openai_config, embedder=embedder, poll=False)
    yield sidecar
    await sidecar.stop(0.5)
    await embedder.aclose()
    server.set(Behaviour())


async def turn(sidecar: Sidecar, text: str, budget_ms: int = 150, session: str = "") -> Any:
    async with grpc.aio.insecure_channel(f"127.0.0.1:{sidecar.port}") as channel:
        return await pb_grpc.RetrievalStub(channel).Turn(
            pb.TurnRequest(session_id=session, text=text, is_final=True, budget_ms=budget_ms),
            timeout=30,
        )


@pytest.mark.parametrize(
    "behaviour",
    [
        Behaviour(hang=True),
        Behaviour(trickle_s=0.05),
        Behaviour(latency="1500"),
        Behaviour(fail_status=500, fail_times=-1),
        Behaviour(fail_status=429, fail_times=-1),
        Behaviour(close=True),
        Behaviour(values="zero"),
        Behaviour(pad_bytes=4_000_000),
        Behaviour(shift_index=True),
    ],
    ids=["hang", "trickle", "slow", "500", "429", "closed", "zero", "4MB", "index"],
)
async def test_misbehaving_embedder_is_answered_lexically_and_degraded(
    openai_sidecar: Sidecar, server: OpenAIServer, behaviour: Behaviour
) -> None:
    server.set(behaviour)
    before = server.requests
    resp = await turn(openai_sidecar, QUESTION)
    assert resp.degraded
    assert resp.skipped == pb.NOT_SKIPPED
    assert PAGE in [c.source_path for c in resp.chunks]
    await eventually(lambda: server.requests > before)
    assert server.requests == before + 1  # no retries on the hot path


async def test_a_plain_search_whose_embedder_fails_is_answered_lexically(
    openai_sidecar: Sidecar, server: OpenAIServer
) -> None:
    """A Search with a query and a limit alone (the engine's short way) falls back as a turn
    does: the same base searched by BM25, within the limit, saying degraded."""
    server.set(Behaviour(fail_status=500, fail_times=-1))
    async with grpc.aio.insecure_channel(f"127.0.0.1:{openai_sidecar.port}") as channel:
        resp = await pb_grpc.RetrievalStub(channel).Search(
            pb.SearchRequest(query=QUESTION, limit=3), timeout=30
        )
    assert resp.degraded
    assert 0 < len(resp.chunks) <= 3
    assert PAGE in [c.source_path for c in resp.chunks]


async def test_embedder_down_is_answered_and_degraded(openai_config: Config) -> None:
    with socket.socket() as sock:  # a port nobody listens on
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    config = with_openai(openai_config, f"http://127.0.0.1:{port}/v1")
    embedder = OpenAIEmbedder(config.embedder)
    sidecar = await create_server(config, embedder=embedder, poll=False)
    try:
        resp = await turn(sidecar, QUESTION)
    finally:
        await sidecar.stop(0.5)
        await embedder.aclose()
    assert resp.degraded
    assert PAGE in [c.source_path for c in resp.chunks]
    assert sidecar.engine.vectors.stats.failed == 1


async def test_embedder_recovers_after_failures(
    openai_sidecar: Sidecar, server: OpenAIServer
) -> None:
    server.set(fail_status=500, fail_times=1)
    assert (await turn(openai_sidecar, QUESTION)).degraded
    resp = await turn(openai_sidecar, "How do I reset my password?", budget_ms=AMPLE_MS)
    assert not resp.degraded


async def test_a_vector_with_no_direction_is_not_kept(
    openai_sidecar: Sidecar, server: OpenAIServer
) -> None:
    """An answer of zeros fails the turn over to the lexical side and is not cached: the same
    question once the server is honest is searched densely."""
    server.set(values="zero")
    assert (await turn(openai_sidecar, QUESTION, budget_ms=AMPLE_MS)).degraded
    server.set(Behaviour())
    resp = await turn(openai_sidecar, QUESTION, budget_ms=AMPLE_MS)
    assert not resp.degraded
    assert PAGE in [c.source_path for c in resp.chunks]


async def test_repeated_query_hits_the_embedding_cache(
    openai_sidecar: Sidecar, server: OpenAIServer
) -> None:
    before = server.requests
    first = await turn(openai_sidecar, QUESTION, budget_ms=AMPLE_MS, session="a")
    second = await turn(openai_sidecar, QUESTION, session="b")  # a cache hit needs no time
    assert not first.degraded
    assert not second.degraded
    assert server.requests == before + 1
    stats = openai_sidecar.engine.vectors.stats
    assert (stats.hits, stats.misses) == (1, 1)
    assert [c.chunk_id for c in first.chunks] == [c.chunk_id for c in second.chunks]


async def test_a_late_vector_lands_in_the_cache(
    openai_sidecar: Sidecar, server: OpenAIServer
) -> None:
    server.set(latency="400")
    assert (await turn(openai_sidecar, QUESTION, budget_ms=100)).degraded
    await eventually(lambda: openai_sidecar.engine.vectors.cached(QUESTION) is not None)
    requests = server.requests
    again = await turn(openai_sidecar, QUESTION, budget_ms=100)
    assert not again.degraded
    assert server.requests == requests


async def test_late_calls_are_bounded(openai_sidecar: Sidecar, server: OpenAIServer) -> None:
    server.set(hang=True)
    for i in range(HOT_PARALLEL_CALLS + 2):
        assert (await turn(openai_sidecar, f"{QUESTION} ({i})")).degraded
    stats = openai_sidecar.engine.vectors.stats
    assert stats.late == HOT_PARALLEL_CALLS  # each still hangs on the server
    assert stats.busy == 2  # so these two were never sent


# -- a thread-backed embedder whose single worker is stuck -------------------------------------


class StuckWorker:
    """The real embedded model behind one worker thread that waits for ``release`` first."""

    def __init__(self, inner: Embedder) -> None:
        self.inner = inner
        self.release = threading.Event()
        self.submitted: list[str] = []
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="stuck-embed")

    @property
    def info(self) -> EmbedderInfo:
        return self.inner.info

    def embed_batch(self, texts: Sequence[str]) -> Vectors:
        return self.inner.embed_batch(texts)

    async def embed(self, texts: Sequence[str]) -> Vectors:
        self.submitted.extend(texts)
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._pool, self._after_release, list(texts))

    def _after_release(self, texts: list[str]) -> Vectors:
        self.release.wait(WAIT_S)
        return self.inner.embed_batch(texts)

    async def aclose(self) -> None:
        self.release.set()
        await asyncio.to_thread(self._pool.shutdown, wait=True)


async def test_a_busy_worker_is_not_given_more_work(
    example_config: Config, local_embedder: Embedder
) -> None:
    stuck = StuckWorker(local_embedder)
    sidecar = await create_server(example_config, embedder=stuck, poll=False)
    try:
        first = await turn(sidecar, QUESTION)
        second = await turn(sidecar, "How do I reset my password?")
        assert first.degraded
        assert second.degraded
        assert PAGE in [c.source_path for c in first.chunks]
        assert stuck.submitted == [QUESTION]  # the second turn did not queue behind the first
        assert sidecar.engine.vectors.stats.busy == 1

        stuck.release.set()
        await eventually(lambda: sidecar.engine.vectors.cached(QUESTION) is not None)
        again = await turn(sidecar, QUESTION)
        assert not again.degraded
        assert stuck.submitted == [QUESTION]
    finally:
        await sidecar.stop(0.5)
        await stuck.aclose()


async def test_a_turn_whose_caller_hangs_up_still_holds_the_worker(
    example_config: Config, local_embedder: Embedder, monkeypatch: pytest.MonkeyPatch
) -> None:
    # a call cancelled by its client left its job queued for LATE_CUTOFF_S, uncounted: a client
    # that sends turns and hangs up at once queued a job per call ahead of every other caller
    monkeypatch.setattr(query_embedder, "LATE_CUTOFF_S", 60.0)  # not cut off during the test
    stuck = StuckWorker(local_embedder)
    sidecar = await create_server(example_config, embedder=stuck, poll=False)
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{sidecar.port}") as channel:
            stub = pb_grpc.RetrievalStub(channel)
            request = pb.TurnRequest(text=QUESTION, is_final=True, budget_ms=AMPLE_MS)
            with pytest.raises(grpc.aio.AioRpcError) as hung_up:
                await stub.Turn(request, timeout=0.5)
            assert hung_up.value.code() is grpc.StatusCode.DEADLINE_EXCEEDED
        guards = sidecar.guards
        assert guards is not None
        await eventually(lambda: guards.limit.in_flight == 0)
        other = await turn(sidecar, "How do I reset my password?")
        assert other.degraded
        assert stuck.submitted == [QUESTION]  # the other turn did not queue behind it
        assert sidecar.engine.vectors.stats.busy == 1
    finally:
        await sidecar.stop(0.5)
        await stuck.aclose()
