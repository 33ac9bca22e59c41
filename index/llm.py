"""The indexer's calls to a chat model (``[index.llm]``): clean-up, summaries, image descriptions.

Only an index build calls this (never the sidecar, never a caller's turn). One ``ModelCaller``
serves one build of one base:

- **cache**: every answer is kept on disk under a key of (model, prompt name and version, sha256
  of the input), so unchanged text never costs a second call, across builds;
- **concurrency**: at most ``max_concurrency`` requests in flight;
- **retries**: 429, 5xx, timeouts and dropped connections are retried with exponential backoff
  (a server's ``Retry-After`` is honoured up to ``MAX_BACKOFF_S``); the indexer can wait;
- **deadline**: each request is bounded whole by ``timeout_s`` (``asyncio.timeout``): the
  client's own ``timeout`` applies per read and does not bound an answer that trickles in;
- **spend cap**: the tokens the server reports (prompt + completion) are added up per build;
  at ``max_build_tokens`` no further request starts and the build stops with
  ``SpendCapReached``: nothing is published, the answers so far stay cached for the next try;
- **bounded answers**: an answer is read in pieces, at most ``answer_limit`` bytes (what
  ``max_output_tokens`` can hold, with room to spare); a larger one is malformed;
- **counters**: calls, cache hits, tokens and failures, for the build's ``--json`` summary.

A request that still fails after its retries, or whose answer is malformed (no text, or cut
off at ``max_output_tokens``), is a failure: its caller keeps what it had (a page its original
text) and the failure is named in the build summary.

Answers are read raw and parsed with orjson, as ``index/embedders/remote.py`` does.
"""

from __future__ import annotations

import asyncio
import base64
import hashlib
import logging
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import openai
import orjson

from index.config import LlmConfig
from index.embedders.remote import retry_after
from index.errors import ConfigError, SpendCapReached
from index.prompts import Prompt

__all__ = ["Ask", "LlmUsage", "ModelCaller", "answer_key"]

log = logging.getLogger("voxrecall.index.llm")

BACKOFF_S = 0.5  # the first wait after a 429 or 5xx; each retry doubles it
MAX_BACKOFF_S = 30.0  # also caps a server's Retry-After, so one answer cannot stall a build
# When the server reports no usage: ~4 characters a token (English prose with a BPE tokenizer).
CHARS_PER_TOKEN = 4
# An answer's body is at most this many bytes a token it may hold (a token is a few characters;
# JSON may escape each as \uXXXX), plus the envelope: past that it is not an answer.
ANSWER_BYTES_PER_TOKEN = 64
ANSWER_ENVELOPE_BYTES = 64 * 1024
IMAGE_TOKENS = 1000  # a guess for one image when the server reports no usage (a 1024px tile set)
_RETRYABLE = (
    openai.RateLimitError,
    openai.InternalServerError,
    openai.APIConnectionError,  # APITimeoutError is one
    TimeoutError,  # our own whole-request deadline
)


@dataclass(frozen=True, slots=True)
class Ask:
    """One question for the model: text, or an image (bytes and MIME type) with no text.

    ``label`` names it in failures (a page's path, a chunk's id)."""

    prompt: Prompt
    text: str = ""
    image: bytes = b""
    image_type: str = ""
    label: str = ""

    def input_hash(self) -> str:
        data = self.image if self.image else self.text.encode("utf-8")
        return hashlib.sha256(data).hexdigest()


@dataclass(slots=True)
class LlmUsage:
    """What one build spent: requests answered, answers from the cache, tokens, failures."""

    calls: int = 0
    cache_hits: int = 0
    tokens: int = 0
    failures: int = 0
    failed: list[dict[str, str]] = field(default_factory=list)  # label, task, reason

    def as_dict(self) -> dict[str, int]:
        return {
            "calls": self.calls,
            "cache_hits": self.cache_hits,
            "tokens": self.tokens,
            "failures": self.failures,
        }


def answer_key(model: str, ask: Ask) -> str:
    """The cache key: (model, prompt name and version, sha256 of the input)."""
    parts = f"{model}\x00{ask.prompt.name}\x00{ask.prompt.version}\x00{ask.input_hash()}"
    return hashlib.sha256(parts.encode()).hexdigest()


class AnswerCache:
    """Answers on disk, one small JSON file each, written atomically (temp file + rename)."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder

    def _path(self, key: str) -> Path:
        return self.folder / key[:2] / f"{key}.json"

    def get(self, key: str) -> str | None:
        try:
            raw = orjson.loads(self._path(key).read_bytes())
        except (OSError, orjson.JSONDecodeError):
            return None  # absent, or damaged: asked again
        text = raw.get("text") if isinstance(raw, dict) else None
        return text if isinstance(text, str) else None

    def put(self, key: str, text: str) -> None:
        from index.snapshot import write_atomic  # the snapshot module imports config, not us

        path = self._path(key)
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            write_atomic(path, orjson.dumps({"text": text}))
        except OSError as exc:
            log.warning("answer cache %s not written: %s", self.folder, exc)


class _Failed(Exception):
    """One ask failed for good (after its retries, or a malformed answer)."""


class ModelCaller:
    """Asks a chat model for one build; ``ask_all`` blocks (it runs its own event loop)."""

    def __init__(self, config: LlmConfig, *, backoff_s: float = BACKOFF_S) -> None:
        if not config.api_key and not config.base_url:
            raise ConfigError(
                f"[index.llm] needs an API key in ${config.api_key_env} "
                "(or a base_url of a compatible server that needs none)"
            )
        self.config = config
        self.usage = LlmUsage()
        self._cache = AnswerCache(config.cache_dir)
        self._backoff_s = backoff_s
        self._failed: set[str] = set()  # the keys of inputs this build asked and could not

    def ask_all(self, asks: Sequence[Ask]) -> list[str | None]:
        """Each ask's answer, in order; None where it failed (counted and named in ``usage``).
        Asks of the same input (one image under many names, a page copied) are asked once a
        build: one that failed is not asked again in a later call (an image source's next batch).

        Raises SpendCapReached when the build's token budget runs out (no request after it)."""
        keys = [answer_key(self.config.model, ask) for ask in asks]
        answers: list[str | None] = [None] * len(asks)
        todo: dict[str, int] = {}  # an input's key -> the first ask of it
        for i, key in enumerate(keys):
            if key in self._failed:
                continue  # None: asked before in this build, and it failed
            cached = self._cache.get(key)
            if cached is None:
                todo.setdefault(key, i)
            else:
                answers[i] = cached
                self.usage.cache_hits += 1
        if todo:
            got = asyncio.run(self._run([asks[i] for i in todo.values()]))
            by_key = dict(zip(todo, got, strict=True))
            self._failed.update(key for key, answer in by_key.items() if answer is None)
            for i, key in enumerate(keys):
                if answers[i] is None:
                    answers[i] = by_key.get(key)
        return answers

    async def _run(self, asks: list[Ask]) -> list[str | None]:
        client = openai.AsyncOpenAI(
            api_key=self.config.api_key or "unused",
            base_url=self.config.base_url or None,
            max_retries=0,
            timeout=self.config.timeout_s,
        )
        gate = asyncio.Semaphore(self.config.max_concurrency)
        try:
            async with asyncio.TaskGroup() as group:
                tasks = [group.create_task(self._one(client, gate, ask)) for ask in asks]
        except BaseExceptionGroup as group:
            capped = [e for e in group.exceptions if isinstance(e, SpendCapReached)]
            if capped:
                raise capped[0] from None
            raise
        finally:
            await client.close()
        return [task.result() for task in tasks]

    async def _one(
        self, client: openai.AsyncOpenAI, gate: asyncio.Semaphore, ask: Ask
    ) -> str | None:
        async with gate:
            try:
                text = await self._with_retries(client, ask)
            except _Failed as exc:
                self.usage.failures += 1
                self.usage.failed.append(
                    {"label": ask.label, "task": ask.prompt.name, "reason": str(exc)}
                )
                log.warning("%s %s: %s", ask.prompt.name, ask.label, exc)
                return None
        self._cache.put(answer_key(self.config.model, ask), text)
        return text

    def _check_budget(self) -> None:
        cap = self.config.max_build_tokens
        if self.usage.tokens >= cap:
            raise SpendCapReached(
                f"[index.llm] max_build_tokens = {cap} reached ({self.usage.tokens} tokens in "
                f"{self.usage.calls} calls): the build stopped and published nothing. The "
                "answers so far are cached: raise the cap (or lower the work: fewer clean = "
                "true sources, summaries off) and build again"
            )

    async def _with_retries(self, client: openai.AsyncOpenAI, ask: Ask) -> str:
        delay = self._backoff_s
        for attempt in range(self.config.retries + 1):
            self._check_budget()
            try:
                async with asyncio.timeout(self.config.timeout_s):
                    body = await self._request(client, ask)
            except _RETRYABLE as exc:
                if attempt == self.config.retries:
                    raise _Failed(f"gave up after {attempt + 1} tries: {_describe(exc)}") from exc
                await asyncio.sleep(min(retry_after(exc) or delay, MAX_BACKOFF_S))
                delay = min(delay * 2, MAX_BACKOFF_S)
                continue
            except openai.OpenAIError as exc:
                raise _Failed(_describe(exc)) from exc
            self.usage.calls += 1
            return self._answer(body, ask)
        raise AssertionError("unreachable")

    async def _request(self, client: openai.AsyncOpenAI, ask: Ask) -> bytes:
        """The answer's body, read in pieces up to ``answer_limit`` bytes."""
        limit = answer_limit(self.config.max_output_tokens)
        async with client.chat.completions.with_streaming_response.create(
            model=self.config.model,
            messages=_messages(ask),  # type: ignore[arg-type]
            max_tokens=self.config.max_output_tokens,
            temperature=0,
        ) as response:
            body = bytearray()
            async for piece in response.iter_bytes():
                body += piece
                if len(body) > limit:
                    self.usage.tokens += self.config.max_output_tokens  # it was spent
                    raise _Failed(
                        f"malformed answer: over {limit} bytes, more than max_output_tokens = "
                        f"{self.config.max_output_tokens} can hold"
                    )
            return bytes(body)

    def _answer(self, body: bytes, ask: Ask) -> str:
        """The answer's text; its tokens counted (even when malformed: they were spent)."""
        try:
            raw = orjson.loads(body)
        except orjson.JSONDecodeError as exc:
            self.usage.tokens += _estimate(ask, "")
            raise _Failed(f"malformed answer (not JSON): {exc}") from exc
        text, finish = _first_choice(raw)
        self.usage.tokens += _reported_tokens(raw) or _estimate(ask, text or "")
        if text is None or not text.strip():
            raise _Failed("malformed answer: no text in choices[0].message.content")
        if finish == "length":
            raise _Failed(f"answer cut off at max_output_tokens = {self.config.max_output_tokens}")
        return text.strip()


def answer_limit(max_output_tokens: int) -> int:
    """The most bytes an answer of ``max_output_tokens`` tokens is read to."""
    return ANSWER_ENVELOPE_BYTES + ANSWER_BYTES_PER_TOKEN * max_output_tokens


def _messages(ask: Ask) -> list[dict[str, Any]]:
    if not ask.image:
        user: Any = ask.text
    else:
        data = base64.b64encode(ask.image).decode("ascii")
        user = [
            {"type": "text", "text": ask.text or "Describe this image."},
            {"type": "image_url", "image_url": {"url": f"data:{ask.image_type};base64,{data}"}},
        ]
    return [{"role": "system", "content": ask.prompt.system}, {"role": "user", "content": user}]


def _first_choice(raw: object) -> tuple[str | None, str]:
    """(text, finish_reason) of the first choice; (None, "") when the shape is wrong."""
    try:
        choice = raw["choices"][0]  # type: ignore[index]
        text = choice["message"]["content"]
        finish = choice.get("finish_reason") or ""
    except (KeyError, IndexError, TypeError, AttributeError):
        return None, ""
    return (text if isinstance(text, str) else None), str(finish)


def _reported_tokens(raw: object) -> int:
    usage = raw.get("usage") if isinstance(raw, dict) else None
    total = usage.get("total_tokens") if isinstance(usage, dict) else None
    return total if isinstance(total, int) and not isinstance(total, bool) and total > 0 else 0


def _estimate(ask: Ask, answer: str) -> int:
    chars = len(ask.prompt.system) + len(ask.text) + len(answer)
    return chars // CHARS_PER_TOKEN + (IMAGE_TOKENS if ask.image else 0) + 1


def _describe(exc: BaseException) -> str:
    if isinstance(exc, TimeoutError):
        return "no complete answer within timeout_s"
    return f"{type(exc).__name__}: {exc}"
