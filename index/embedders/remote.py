"""OpenAI embeddings (``text-embedding-3-small`` by default) or any OpenAI-compatible server.

On the hot path (``embed``) the client makes no retries (they multiply waits) and the caller
bounds the call with its own deadline: the client's ``timeout`` applies per read, so it does not
bound a body that trickles in. Index builds (``embed_batch``) use a separate client, retry 429,
5xx, connection errors and a request not answered whole within ``build_request_s`` (a body
trickled) with exponential backoff, and send up to ``max_concurrency`` requests
side by side when given more than ``batch_size`` texts.

Responses are read raw, every body at most ``response_cap`` bytes of ``HOT_MAX_TEXTS`` texts,
or a build's ``batch_size`` (an honest answer's size with room to spare: a server answering more
is refused before it fills the heap; a response hook on each client), an error's at most
``ERROR_BODY_BYTES``. An answer is parsed with orjson into one numpy array (the client's own
parsing builds a pydantic object per float: ~5-10 ms of event-loop time for one 384-d vector,
which on the hot path delays every other turn's deadline), once it is seen to hold no more JSON
objects and arrays than its vectors need (``CONTAINERS_PER_VECTOR``), nor more values
(commas: ``COMMAS_PER_VECTOR_BESIDES``).
The vectors are checked as a caller's are (``unit_rows``: finite, with a direction), so a
server's overflow or zeros are an ``EmbedderError`` (a turn falls back, a build publishes
nothing), never a silent nothing.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx2
import numpy as np
import openai
import orjson

from index.config import OPENAI_MAX_INPUTS, EmbedderConfig
from index.embedders.base import EmbedderInfo, Vectors, unit_rows
from index.errors import ConfigError, EmbedderError
from index.json_count import json_containers

NATIVE_DIMENSIONS = {
    "text-embedding-3-small": 1536,
    "text-embedding-3-large": 3072,
    "text-embedding-ada-002": 1536,
}
BUILD_RETRIES = 6  # 429s under a bulk build are routine; six doublings from 0.5 s span ~30 s
BUILD_BACKOFF_S = 0.5  # the first wait; each retry doubles it, up to MAX_BACKOFF_S
MAX_BACKOFF_S = 16.0  # also caps a server's Retry-After, so one answer cannot stall a build
BUILD_TIMEOUT_S = 60.0  # a 16-text batch normally answers in well under a second
HOT_TIMEOUT_S = 10.0  # an outer bound only: the turn's budget cuts far earlier
# A build's request whole, its body's last byte included (BUILD_TIMEOUT_S bounds each read only,
# so a body trickled a byte at a time held a build for as long as the server liked): at least
# this long, and as long as its answer's cap takes at BUILD_MIN_BYTES_PER_S (2,048 vectors of
# 3,072 values may be 200 MB of indented JSON, and max_concurrency requests share the link).
# Past it, the request is retried as a timeout is.
BUILD_REQUEST_S = 300.0
BUILD_MIN_BYTES_PER_S = 256 * 1024
# A build request holds at most batch_size texts (<= OPENAI_MAX_INPUTS, 2048) and this many
# bytes of text: the API takes at most 300k tokens per request, and English text runs ~4 bytes
# a token (code ~3), so 600 kB stays under it with room to spare.
MAX_REQUEST_BYTES = 600_000
# Hot-path requests overlap on the server; this many still running past their turns' deadlines
# means the server is down or drowning, and the sidecar stops adding to it until one ends.
HOT_PARALLEL_CALLS = 8
# An honest answer writes a float in ~20 bytes of JSON ("-0.0123456789012345,"); this many a
# value, and this much besides (the envelope, usage, an error's message), is room to spare.
RESPONSE_BYTES_PER_VALUE = 64  # an indented answer takes ~34 (a review found 32 too few)
# The most texts one hot-path request holds (a turn embeds a query or two, a few side by side):
# the cap every hot answer's body is read under, an error's included.
HOT_MAX_TEXTS = 16
IDENTITY = {"Accept-Encoding": "identity"}  # a body's cap counts its bytes as sent: uncompressed
RESPONSE_BYTES_FLOOR = 64 * 1024
# An error's body is a message, under a kilobyte: this many bytes at most (the client parses it
# with json.loads on the event loop: 1.6 MB of "[]," held it ~55 ms).
ERROR_BODY_BYTES = 16 * 1024
# An answer's JSON objects and arrays: two a vector (its entry and its values) and this many
# besides (the envelope, usage and what a server adds), counted as the bytes "[" and "{"
# before the parse: each is a Python object orjson builds on the event loop, and an answer of
# 1.6 MB (16 texts at 1,536 dimensions) held 546,000 empty arrays, ~55 ms to parse.
CONTAINERS_PER_VECTOR = 2
CONTAINERS_BESIDES = 64
# An answer's JSON values at most, counted as its commas before the parse: a vector's values and
# a few keys beside them (object, index), and this many besides; within the byte cap 1.6 MB of
# "0," in one vector were 819,000 numbers, ~20 ms of the event loop to parse and convert before
# its length was seen to be wrong.
COMMAS_PER_VECTOR_BESIDES = 8
COMMAS_BESIDES = 64


class BuildRequestTimeout(Exception):
    """A build's request was not answered whole within ``build_request_s``."""


_RETRYABLE = (
    BuildRequestTimeout,
    openai.RateLimitError,
    openai.InternalServerError,
    openai.APIConnectionError,
    httpx2.TransportError,  # a connection dropped inside a body: the client does not wrap it
)


class OpenAIEmbedder:
    """The OpenAI embeddings API through the official client (``base_url`` for compatible servers).

    ``dimensions`` (config) is sent with every request and recorded in the snapshot, so vectors of
    one length are never compared with another's. ``retries`` and ``backoff_s`` shape the build
    path only.
    """

    def __init__(
        self,
        config: EmbedderConfig,
        *,
        retries: int = BUILD_RETRIES,
        backoff_s: float = BUILD_BACKOFF_S,
    ) -> None:
        if not config.api_key and not config.base_url:
            raise ConfigError(
                f'[embedder] provider = "openai" needs an API key in ${config.api_key_env} '
                "(or a base_url of a compatible server that needs none)"
            )
        dimension = config.dimensions or NATIVE_DIMENSIONS.get(config.model, 0)
        if dimension <= 0:
            raise ConfigError(f"[embedder] dimensions is required for model {config.model!r}")
        if config.batch_size < 1 or config.max_concurrency < 1:
            raise ConfigError("[embedder] batch_size and max_concurrency must be at least 1")
        if config.batch_size > OPENAI_MAX_INPUTS:
            raise ConfigError(
                f"[embedder] batch_size {config.batch_size} is over {OPENAI_MAX_INPUTS}, the most "
                "inputs the embeddings API takes in one request"
            )
        self._config = config
        self._retries = retries
        self._backoff_s = backoff_s
        self._info = EmbedderInfo(name=f"openai/{config.model}", dimension=dimension)
        key = config.api_key or "unused"
        base_url = config.base_url or None
        # every answer's body is capped where it is read, an error's too (the client reads an
        # error's body whole before raising): the hot path's few texts, a build's batch
        hot_cap = response_cap(HOT_MAX_TEXTS, dimension)
        self._hot = openai.AsyncOpenAI(
            api_key=key,
            base_url=base_url,
            max_retries=0,
            timeout=HOT_TIMEOUT_S,
            http_client=openai.DefaultAsyncHttpxClient(
                headers=IDENTITY, event_hooks={"response": [_async_capped(hot_cap)]}
            ),
        )
        bulk_cap = response_cap(config.batch_size, dimension)
        self._bulk = openai.OpenAI(
            api_key=key,
            base_url=base_url,
            max_retries=0,
            timeout=BUILD_TIMEOUT_S,
            http_client=openai.DefaultHttpxClient(
                headers=IDENTITY, event_hooks={"response": [_capped_hook(bulk_cap)]}
            ),
        )

    @property
    def info(self) -> EmbedderInfo:
        return self._info

    @property
    def parallel_calls(self) -> int:
        """How many hot-path calls may run side by side (see HOT_PARALLEL_CALLS)."""
        return HOT_PARALLEL_CALLS

    async def embed(self, texts: Sequence[str]) -> Vectors:
        """One request, no retries; bound it with a deadline (``asyncio.timeout``)."""
        if not texts:
            return np.zeros((0, self._info.dimension), dtype=np.float32)
        try:
            async with self._hot.embeddings.with_streaming_response.create(
                model=self._config.model,
                input=list(texts),
                encoding_format="float",
                dimensions=self._dimensions(),
            ) as response:
                body = b"".join([part async for part in response.iter_bytes()])  # capped: hook
        except (openai.OpenAIError, httpx2.HTTPError) as exc:
            raise EmbedderError(f"{self._info.name}: {type(exc).__name__}: {exc}") from exc
        return self._vectors(body, len(texts))

    def embed_batch(self, texts: Sequence[str]) -> Vectors:
        """Embed for a build: requests of up to ``batch_size`` texts and MAX_REQUEST_BYTES, up
        to ``max_concurrency`` in flight, each retried on 429, 5xx and connection errors (with
        backoff, or the server's ``Retry-After``); rows in input order."""
        if isinstance(texts, str):
            raise TypeError("embed_batch takes a sequence of texts, not one str")
        items = list(texts)
        if not items:
            return np.zeros((0, self._info.dimension), dtype=np.float32)
        batches = request_batches(items, self._config.batch_size, MAX_REQUEST_BYTES)
        if len(batches) == 1:
            return self._with_retries(batches[0])
        workers = min(self._config.max_concurrency, len(batches))
        with ThreadPoolExecutor(workers, thread_name_prefix="voxrecall-openai") as pool:
            return np.concatenate(list(pool.map(self._with_retries, batches)))

    async def aclose(self) -> None:
        await self._hot.close()
        await asyncio.to_thread(self._bulk.close)

    # -- helpers ---------------------------------------------------------------------------

    def _dimensions(self) -> int | openai.Omit:
        return self._config.dimensions or openai.omit

    def _vectors(self, body: bytes, count: int) -> Vectors:
        containers = json_containers(body)
        if containers > (most := CONTAINERS_PER_VECTOR * count + CONTAINERS_BESIDES):
            raise EmbedderError(
                f"{self._info.name}: the embeddings answer holds {containers} JSON objects and "
                f"arrays; one of {count} vectors holds at most {most}: not an embeddings answer"
            )
        commas = body.count(b",")
        per_vector = self._info.dimension + COMMAS_PER_VECTOR_BESIDES
        if commas > (most := per_vector * count + COMMAS_BESIDES):
            raise EmbedderError(
                f"{self._info.name}: the embeddings answer holds {commas} commas, more values "
                f"than {count} vectors of {self._info.dimension} hold (at most {most}): is "
                "[embedder] dimensions the model's, and does the server honour it?"
            )
        try:
            rows = sorted(orjson.loads(body)["data"], key=lambda e: int(e["index"]))
            indexes = [int(r["index"]) for r in rows]
            # float64: a value past float32's range is refused by name, not read as infinity
            out = np.asarray([r["embedding"] for r in rows], dtype=np.float64)
        except (orjson.JSONDecodeError, KeyError, TypeError, ValueError) as exc:
            raise EmbedderError(
                f"{self._info.name}: unreadable embeddings response: {exc}"
            ) from exc
        if len(rows) != count:
            raise EmbedderError(f"embedder returned {len(rows)} vectors for {count} texts")
        if indexes != list(range(count)):  # each text's vector once: none swapped in twice
            raise EmbedderError(f"embedder returned indexes {indexes[:8]} for {count} texts")
        if out.ndim != 2 or out.shape[1] != self._info.dimension:
            raise EmbedderError(
                f"embedder returned vectors of shape {out.shape}, expected {self._info.dimension}-d"
            )
        try:
            return unit_rows(out)
        except ValueError as exc:
            raise EmbedderError(f"{self._info.name}: {exc}") from exc

    def _with_retries(self, texts: list[str]) -> Vectors:
        delay = self._backoff_s
        for attempt in range(self._retries + 1):
            seconds = build_request_s(len(texts), self._info.dimension)
            deadline = time.monotonic() + seconds
            try:
                with self._bulk.embeddings.with_streaming_response.create(
                    model=self._config.model,
                    input=texts,
                    encoding_format="float",
                    dimensions=self._dimensions(),
                ) as response:
                    # capped by the client's hook; a trickle ends at the deadline
                    body = b"".join(_until(response.iter_bytes(), deadline, seconds))
                return self._vectors(body, len(texts))
            except _RETRYABLE as exc:
                if attempt == self._retries:
                    raise EmbedderError(
                        f"{self._info.name}: gave up after {attempt + 1} tries: "
                        f"{type(exc).__name__}: {exc}"
                    ) from exc
                time.sleep(min(retry_after(exc) or delay, MAX_BACKOFF_S))
                delay = min(delay * 2, MAX_BACKOFF_S)
            except (openai.OpenAIError, httpx2.HTTPError) as exc:
                raise EmbedderError(f"{self._info.name}: {type(exc).__name__}: {exc}") from exc
        raise AssertionError("unreachable")


def build_request_s(texts: int, dimension: int) -> float:
    """How long a build's request of ``texts`` texts may take, its answer's body whole."""
    return max(BUILD_REQUEST_S, response_cap(texts, dimension) / BUILD_MIN_BYTES_PER_S)


def _until(parts: Iterator[bytes], deadline: float, seconds: float) -> Iterator[bytes]:
    """``parts`` until ``deadline`` (``time.monotonic``), looked at between reads (each bounded
    by the client's timeout); BuildRequestTimeout past it (``seconds`` after the request)."""
    for part in parts:
        if time.monotonic() > deadline:
            raise BuildRequestTimeout(
                f"no whole answer within {seconds:.0f} s: a slow link or server; a smaller "
                "[embedder] batch_size or max_concurrency asks less of it"
            )
        yield part


def response_cap(texts: int, dimension: int) -> int:
    """The most bytes an embeddings answer of ``texts`` vectors may take (see
    RESPONSE_BYTES_PER_VALUE)."""
    return RESPONSE_BYTES_FLOOR + texts * dimension * RESPONSE_BYTES_PER_VALUE


def _async_capped(cap: int) -> Callable[[httpx2.Response], Awaitable[None]]:
    """A response hook (run before the body is read, an error's too: the client reads that
    whole before it raises) capping the body at ``cap`` bytes. A hook, not a transport, so the
    client's own transport (its proxies from the environment) stays as it is."""

    async def cap_body(response: httpx2.Response) -> None:
        response.stream = _AsyncCappedStream(response.stream, *_limit(response, cap))

    return cap_body


def _limit(response: httpx2.Response, cap: int) -> tuple[int, str | None]:
    """The bytes of ``response``'s body that may be read, and the error past them: ``cap``; an
    error status's first ``ERROR_BODY_BYTES``, the rest left unread (None: no error of its own,
    so a 429 or 5xx with a big page is retried as any is). The cap counts the bytes as sent: a
    compressed body (asked for identity, answered gzip anyway: 1.5 MB inflating to GBs) is
    refused at its first byte, before anything is inflated."""
    encoding = response.headers.get("content-encoding", "").strip().lower()
    if encoding not in ("", "identity"):
        return -1, f"the embeddings server answered with Content-Encoding {encoding[:32]!r}"
    if not response.is_success:  # its head is read, and the client raises its status error
        return ERROR_BODY_BYTES, None
    return cap, f"the embeddings server's answer is over {cap} bytes"


class _AsyncCappedStream(httpx2.AsyncByteStream):
    def __init__(self, inner: Any, cap: int, refusal: str | None) -> None:
        self._inner, self._cap, self._refusal = inner, cap, refusal

    async def __aiter__(self) -> AsyncIterator[bytes]:
        size = 0
        async for part in self._inner:
            size += len(part)
            if size > self._cap:
                await self.aclose()  # the connection is not reused half read
                yield _head(part, size, self._cap, self._refusal)
                return
            yield part

    async def aclose(self) -> None:
        await self._inner.aclose()


def _head(part: bytes, size: int, cap: int, refusal: str | None) -> bytes:
    """The last ``part`` of a body read to ``size`` bytes, over its ``cap``: cut to the cap
    (``refusal`` None: an error's head is all it needs), else EmbedderError ``refusal``."""
    if refusal is not None:
        raise EmbedderError(refusal)
    return part[: len(part) - (size - cap)]


def _capped_hook(cap: int) -> Callable[[httpx2.Response], None]:
    """``_async_capped`` for the build's blocking client."""

    def cap_body(response: httpx2.Response) -> None:
        response.stream = _CappedStream(response.stream, *_limit(response, cap))

    return cap_body


class _CappedStream(httpx2.SyncByteStream):
    def __init__(self, inner: Any, cap: int, refusal: str | None) -> None:
        self._inner, self._cap, self._refusal = inner, cap, refusal

    def __iter__(self) -> Iterator[bytes]:
        size = 0
        for part in self._inner:
            size += len(part)
            if size > self._cap:
                self.close()
                yield _head(part, size, self._cap, self._refusal)
                return
            yield part

    def close(self) -> None:
        self._inner.close()


def request_batches(texts: list[str], max_inputs: int, max_bytes: int) -> list[list[str]]:
    """``texts`` in order, cut into requests of at most ``max_inputs`` texts and ``max_bytes``
    bytes of UTF-8 (a text longer than that alone goes alone: the server judges it)."""
    batches: list[list[str]] = []
    current: list[str] = []
    size = 0
    for text in texts:
        n = len(text.encode("utf-8"))
        if current and (len(current) == max_inputs or size + n > max_bytes):
            batches.append(current)
            current, size = [], 0
        current.append(text)
        size += n
    if current:
        batches.append(current)
    return batches


def retry_after(exc: BaseException) -> float | None:
    """The server's ``Retry-After`` in seconds, when it sent one as a number of them: a finite
    one, not below zero (``time.sleep`` raises ValueError for "-1" and "nan")."""
    if not isinstance(exc, openai.APIStatusError):
        return None
    value = exc.response.headers.get("retry-after")
    try:
        seconds = float(value) if value is not None else None
    except ValueError:
        return None
    return seconds if seconds is not None and 0 <= seconds < math.inf else None
