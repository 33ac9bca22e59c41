"""The optional rerank stage: reorder a search's top candidates with a hosted reranker.

    reranker = Reranker(config.knowledge_base("help").rerank)
    order, status = await reranker.order("how do I split a pane", documents, deadline)

The API is Cohere's ``rerank`` shape, which Jina, Voyage and Hugging Face
text-embeddings-inference also speak: ``POST {base_url}/rerank`` with ``{model, query,
documents, top_n}`` answers ``{results: [{index, relevance_score}]}``. The call runs under the
turn's budget the way the query embedder does (``sidecar/turn/query_embedder.py``): a deadline of its
own (``asyncio.timeout_at``, which also bounds a body that trickles in), a call for the same
query and documents already in flight is joined, and a call that misses is left to finish in the
background, bounded (``LATE_CUTOFF_S``, at most ``MAX_LATE`` at once), so that its order lands
in the cache for the same question a moment later (the final transcript after an interim one).
On a miss or a failure (an HTTP error such as 429 or 500, a closed connection, a body that is
not the API's shape, or larger than ``max_response_bytes``) the caller keeps the vector order and
says so (``RerankStatus``); nothing here raises for the reranker's sake.
"""

from __future__ import annotations

import asyncio
import enum
import logging
from collections.abc import Sequence

import httpx2
import orjson
from cachetools import LRUCache

from index.config import RerankConfig
from index.json_count import json_containers

log = logging.getLogger("voxrecall.rerank")

# An order arriving this long after its caller gave up is for a turn long answered; past it a
# trickling response stops holding a connection.
LATE_CUTOFF_S = 2.0
MAX_LATE = 4  # late calls left running at once; beyond it a new call is not made
CACHE_SIZE = 1024  # (query, documents) orders kept: a few hundred bytes each
MAX_CONNECTIONS = 16  # a sidecar's turns in flight share these keep-alive connections
# An answer's JSON objects and arrays: two a document (its result, and the document a server
# may echo in it: Jina does by default), the brackets of the query and documents' texts (an
# echo holds them) and this many besides (the envelope, its list, Cohere's meta), counted as
# the bytes "[" and "{" before the parse: each is a Python object orjson builds on the event
# loop (256 KiB of "[]," are 87,000 of them; at max_response_bytes of 64 MiB, 22 million).
CONTAINERS_PER_DOCUMENT = 2
CONTAINERS_BESIDES = 64


class Status(enum.Enum):
    """Names match the proto's RerankStatus."""

    RERANK_NONE = 0
    RERANKED = 1
    RERANK_TIMED_OUT = 2
    RERANK_FAILED = 3


class RerankError(Exception):
    """The reranker answered wrongly or not at all; the message says how (for the log)."""


Key = tuple[str, tuple[str, ...]]


class Reranker:
    """One per base with a ``[knowledge_base.rerank]``; used from the event loop only."""

    def __init__(self, config: RerankConfig, client: httpx2.AsyncClient | None = None) -> None:
        self.config = config
        headers = {"authorization": f"Bearer {config.api_key}"} if config.api_key else {}
        self._client = client or httpx2.AsyncClient(
            headers=headers,
            timeout=httpx2.Timeout(LATE_CUTOFF_S),
            limits=httpx2.Limits(max_connections=MAX_CONNECTIONS),
        )
        self._cache: LRUCache[Key, tuple[int, ...]] = LRUCache(maxsize=CACHE_SIZE)
        self._inflight: dict[Key, asyncio.Task[tuple[int, ...]]] = {}
        self._late: set[asyncio.Task[tuple[int, ...]]] = set()
        self.counts: dict[Status, int] = dict.fromkeys(Status, 0)

    async def order(
        self, query: str, documents: Sequence[str], deadline: float
    ) -> tuple[tuple[int, ...] | None, Status]:
        """The documents' indexes best first (every index once), or None with why not."""
        key = (query, tuple(documents))
        cached = self._cache.get(key)
        if cached is not None:
            return self._counted(cached, Status.RERANKED)
        loop = asyncio.get_running_loop()
        task = self._inflight.get(key)
        if task is None:
            if deadline <= loop.time() or len(self._late) >= MAX_LATE:
                return self._counted(None, Status.RERANK_TIMED_OUT)
            task = self._submit(key)
        try:
            async with asyncio.timeout_at(deadline):
                found = await asyncio.shield(task)
        except TimeoutError:
            self._leave(task)
            log.warning("reranker missed its deadline: vector order")
            return self._counted(None, Status.RERANK_TIMED_OUT)
        except RerankError as exc:
            log.warning("reranker failed: %s: vector order", exc)
            return self._counted(None, Status.RERANK_FAILED)
        return self._counted(found, Status.RERANKED)

    async def aclose(self) -> None:
        tasks = list(self._inflight.values())
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await self._client.aclose()

    def _counted(
        self, found: tuple[int, ...] | None, status: Status
    ) -> tuple[tuple[int, ...] | None, Status]:
        self.counts[status] += 1
        return found, status

    def _submit(self, key: Key) -> asyncio.Task[tuple[int, ...]]:
        task = asyncio.get_running_loop().create_task(self._call(*key), name="voxrecall-rerank")
        self._inflight[key] = task

        def done(t: asyncio.Task[tuple[int, ...]]) -> None:
            self._late.discard(t)
            if self._inflight.get(key) is t:
                del self._inflight[key]
            if not t.cancelled() and t.exception() is None:
                self._cache[key] = t.result()

        task.add_done_callback(done)
        return task

    def _leave(self, task: asyncio.Task[tuple[int, ...]]) -> None:
        """The caller stops waiting; the call goes on for LATE_CUTOFF_S at most."""
        if task.done() or task in self._late:
            return
        self._late.add(task)
        asyncio.get_running_loop().call_later(LATE_CUTOFF_S, task.cancel)

    async def _call(self, query: str, documents: tuple[str, ...]) -> tuple[int, ...]:
        body: dict[str, object] = {"query": query, "documents": list(documents)}
        body["top_n"] = len(documents)
        if self.config.model:
            body["model"] = self.config.model
        url = f"{self.config.base_url}/rerank"
        try:
            async with self._client.stream("POST", url, content=orjson.dumps(body),
                                           headers={"content-type": "application/json"}) as resp:  # fmt: skip
                if resp.status_code != 200:
                    raise RerankError(f"{url} answered HTTP {resp.status_code}")
                data = await self._read(resp)
        except httpx2.HTTPError as exc:
            raise RerankError(f"{url}: {type(exc).__name__}: {exc}") from exc
        echoed = sum(json_containers(text) for text in (query, *documents))
        return parse_order(data, len(documents), echoed)

    async def _read(self, resp: httpx2.Response) -> bytes:
        limit = self.config.max_response_bytes
        parts: list[bytes] = []
        size = 0
        async for part in resp.aiter_bytes():
            size += len(part)
            if size > limit:
                raise RerankError(f"the answer is over {limit} bytes (max_response_bytes)")
            parts.append(part)
        return b"".join(parts)


def parse_order(data: bytes, count: int, echoed: int = 0) -> tuple[int, ...]:
    """The order of ``{results: [{index, relevance_score}]}``, best first; the documents it
    leaves out follow in vector order. RerankError when it is not that shape, or holds more
    JSON objects and arrays (brackets) than ``CONTAINERS_PER_DOCUMENT`` a document, the
    ``echoed`` brackets of the texts sent and ``CONTAINERS_BESIDES`` (not parsed)."""
    containers = json_containers(data)
    if containers > (most := CONTAINERS_PER_DOCUMENT * count + echoed + CONTAINERS_BESIDES):
        raise RerankError(
            f"the answer holds {containers} JSON objects and arrays; one for {count} documents "
            f"holds at most {most}"
        )
    try:
        raw = orjson.loads(data)
    except orjson.JSONDecodeError as exc:
        raise RerankError(f"the answer is not JSON: {exc}") from exc
    results = raw.get("results") if type(raw) is dict else None
    if type(results) is not list:
        raise RerankError("the answer has no 'results' list")
    scored: dict[int, float] = {}
    for item in results:
        index = item.get("index") if type(item) is dict else None
        score = item.get("relevance_score") if type(item) is dict else None
        if type(index) is not int or not 0 <= index < count or index in scored:
            raise RerankError(f"a result's index is not one of 0..{count - 1}, once each")
        if isinstance(score, bool) or not isinstance(score, int | float):
            raise RerankError("a result's relevance_score is not a number")
        scored[index] = float(score)
    ranked = sorted(scored, key=lambda i: (-scored[i], i))
    return (*ranked, *(i for i in range(count) if i not in scored))
