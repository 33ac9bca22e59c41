"""The embedded default embedder: all-MiniLM-L6-v2, int8 ONNX, on onnxruntime's CPU provider.

The model ships inside the ``index`` package (``index/model/``, written once by
``scripts/export_model.py``), so the sidecar embeds queries with no network and no torch. The
graph pools and normalises itself: it maps ``input_ids``, ``attention_mask`` and
``token_type_ids`` to ``sentence_embedding`` of shape ``(batch, 384)``.

Nothing is loaded at import time; the constructor verifies both files against the sha256 pinned
here before it loads them.
"""

from __future__ import annotations

import asyncio
import hashlib
import importlib.resources
import re
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import onnxruntime as ort
from tokenizers import Encoding, Tokenizer

from index.embedders.base import EmbedderInfo, Vectors, normalise
from index.errors import EmbedderError

MODEL_FILE = "all-MiniLM-L6-v2-int8.onnx"
TOKENIZER_FILE = "tokenizer.json"
MODEL_SHA256 = "be7b87ab6d8e88275fac5486d94ac7155a7f1842af4e9526e1efa62478a35b32"
TOKENIZER_SHA256 = "be50c3628f2bf5bb5e3a7f17b1f74611b2561a3a27eeab05e5aa30f411572037"
NAME = "local/all-MiniLM-L6-v2-int8"
DIMENSION = 384
MAX_POSITIONS = 512  # the model's position embeddings: a hard limit on max_tokens
_OUTPUT = "sentence_embedding"
# Texts handed to one of the ``parallel`` threads at a time: one, so a thread that finishes
# early takes the next text and the threads finish together whatever the lengths (slices of 4
# left a core idle at the end of each call: 1.78 cores used, 1.66x single; one: 1.92, 1.83x;
# ``python -m bench index`` on a quiet 2-core machine).
PARALLEL_SLICE = 1
# An ``embed`` call of at most this many texts (a turn's folded query and the turn alone, sent
# together by the sidecar's QueryEmbedder.get_many) runs them side by side, one thread each,
# each text alone through the graph as always: on two free cores the pair takes about the time
# of one text rather than two.
SIDE_BY_SIDE = 2


def default_model_dir() -> Path:
    """The ``model/`` folder shipped inside the installed ``index`` package."""
    return Path(str(importlib.resources.files("index").joinpath("model")))


def _read_verified(path: Path, expected_sha256: str, constant: str) -> bytes:
    try:
        data = path.read_bytes()
    except OSError as exc:
        raise EmbedderError(
            f"cannot read the embedder file {path.name} ({path}): {exc}; reinstall voxrecall, "
            "or regenerate index/model/ with `python scripts/export_model.py`"
        ) from exc
    actual = hashlib.sha256(data).hexdigest()
    if actual != expected_sha256:
        raise EmbedderError(
            f"embedder file {path.name} ({path}) has sha256 {actual}, expected {expected_sha256}: "
            "the file is corrupt or from another export; reinstall voxrecall, or regenerate "
            f"index/model/ with `python scripts/export_model.py` and update {constant} in "
            "index/embedders/local.py"
        )
    return data


_WHITESPACE = re.compile(r"\s")  # where the tokenizer splits a text first
# where it splits for certain: BERT's whitespace (Unicode Zs and \t\n\r), which its normaliser
# keeps as a space; \s also matches control characters it drops
_SPLITS = re.compile("[ \t\n\r\u00a0\u1680\u2000-\u200a\u202f\u205f\u3000]")


def _tokenizer(data: bytes, max_tokens: int) -> Tokenizer:
    """The model's tokenizer, unpadded and truncated at ``max_tokens``."""
    tokenizer = Tokenizer.from_str(data.decode("utf-8"))
    # the shipped tokenizer.json pads every input to 128 tokens: wrong here, and 10x slower
    tokenizer.no_padding()
    tokenizer.enable_truncation(max_length=max_tokens)
    return tokenizer


def _session(model: bytes, threads: int) -> ort.InferenceSession:
    """An ONNX Runtime session of the model on ``threads`` CPU threads, its output checked."""
    options = ort.SessionOptions()
    options.intra_op_num_threads = threads
    options.inter_op_num_threads = 1
    options.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    # the arena keeps the peak of the largest input ever seen (~1.5 GB after a 64-chunk
    # batch); with one unpadded text per run it buys nothing measurable, so leave it off
    options.enable_cpu_mem_arena = False
    options.log_severity_level = 3
    session = ort.InferenceSession(model, sess_options=options, providers=["CPUExecutionProvider"])
    outputs = {o.name: o.shape for o in session.get_outputs()}
    if _OUTPUT not in outputs or outputs[_OUTPUT][-1] != DIMENSION:
        raise EmbedderError(f"{MODEL_FILE} has outputs {outputs}, expected {_OUTPUT} x 384")
    return session


class LocalEmbedder:
    """all-MiniLM-L6-v2 (int8) in process: 384-d unit vectors, ~2 ms for a short query.

    ``threads`` is onnxruntime's intra-op thread count (1 keeps a sidecar's CPU use flat and is
    enough for one short query). ``max_tokens`` truncates long texts, counting [CLS] and [SEP].

    Each text runs through the model on its own, unpadded. The int8 graph quantises activations
    dynamically with one scale per tensor, so a row embedded in a padded batch depends on its
    batchmates (cosine ~0.993 to the same text alone); one text at a time makes a vector a pure
    function of its text, whichever batch it came in, and on one thread it is also faster than
    padded batches (~0.6x the time for 16 chunks of 80-160 tokens). ``batch_size`` is the unit of
    work: ``embed`` hands texts to the worker ``batch_size`` at a time, so a cancelled call stops
    within one slice.

    ``embed_batch`` runs in the calling thread (index builds, from worker threads); ``embed`` runs
    on a dedicated single worker thread so the event loop never blocks, but for a call of
    ``SIDE_BY_SIDE`` texts, whose second runs beside the first on a thread of its own.

    ``embed_later`` runs on a third thread of its own (the background lane): background work (an
    agent's turn) never queues ahead of a caller's text on the worker. It runs at the worker's
    priority: at nice 19 a loaded machine's other processes starved it, and the next user turn,
    which reads the agent's turn, then waited for it (``python -m bench.turn_breakdown --agent``).

    ``parallel`` > 1 (index builds: one per core) runs ``embed_batch`` on that many threads, each
    running one text at a time through the shared session (onnxruntime releases the GIL in
    ``run``; with one intra-op thread a run stays on its caller's thread), so every vector is
    the one a single-text call makes. Measured on 2 cores against the alternatives (``python -m
    bench index``): intra-op threads on one text at a time lose to one thread (threads spin
    waiting for each other's share of a small graph), and batches of texts of one token length
    neither run faster nor keep the vectors (cosine 0.976-0.984 to the single-text ones: the
    per-tensor activation scale is shared by the batch).
    """

    def __init__(
        self,
        model_dir: Path | None = None,
        *,
        threads: int = 1,
        max_tokens: int = 256,
        batch_size: int = 16,
        parallel: int = 1,
    ) -> None:
        if threads < 1 or parallel < 1:
            raise ValueError(f"threads and parallel must be >= 1, got {threads}, {parallel}")
        if not 2 <= max_tokens <= MAX_POSITIONS:
            raise ValueError(f"max_tokens must be in [2, {MAX_POSITIONS}], got {max_tokens}")
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        folder = default_model_dir() if model_dir is None else Path(model_dir)
        # verify and load the same bytes, so nothing can change between the check and the load
        model_bytes = _read_verified(folder / MODEL_FILE, MODEL_SHA256, "MODEL_SHA256")
        tokenizer_bytes = _read_verified(
            folder / TOKENIZER_FILE, TOKENIZER_SHA256, "TOKENIZER_SHA256"
        )

        self._tokenizer = _tokenizer(tokenizer_bytes, max_tokens)
        self._max_tokens = max_tokens
        self._session = _session(model_bytes, threads)

        self._info = EmbedderInfo(name=NAME, dimension=DIMENSION)
        self._batch_size = batch_size
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="voxrecall-embed")
        self._beside = ThreadPoolExecutor(
            max_workers=SIDE_BY_SIDE - 1, thread_name_prefix="voxrecall-embed-beside"
        )
        self._later = ThreadPoolExecutor(max_workers=1, thread_name_prefix="voxrecall-embed-later")
        self._parallel = (
            ThreadPoolExecutor(max_workers=parallel, thread_name_prefix="voxrecall-embed-build")
            if parallel > 1
            else None
        )
        self._closed = False

    @property
    def info(self) -> EmbedderInfo:
        return self._info

    def truncates(self, text: str) -> bool:
        """Whether ``text`` has more tokens than the model reads (embedding cuts it there)."""
        return self._cut(text) is not None

    def _cut(self, text: str) -> int | None:
        """Where a whitespace-cut prefix of ``text`` holds more tokens than the model reads, or
        None when the whole text fits."""
        # WordPiece makes at most one token of an ASCII character (a piece covers one at least;
        # a word too long for it is one [UNK]) and ~4 of another (NFD splits a Hangul syllable
        # into its jamo), so a text this short cannot reach the limit and skips the tokenizer.
        # Every Turn asks, on the event loop: tokenizing a question of 64-254 characters there
        # was ~50 us of a cached Turn's ~300 us of CPU (``bench/README.md``, the first-turn gap).
        per_char = 1 if text.isascii() else 4
        room = self._max_tokens - 2
        if len(text) * per_char <= room:
            return None
        # A longer text is counted a slice at a time, stopping once the count is past the
        # limit: the tokenizer splits at whitespace before anything else, so a text's tokens
        # are its whitespace-cut slices' tokens added up. Encoding a 4,000-character turn whole
        # held the event loop ~5 ms; its first slices past the limit are a few hundred.
        counted, start = 0, 0
        while start < len(text):
            # past the room, at whitespace, or where a text without any (CJK, a pasted blob) has
            # a few times the room: CJK is split a character a token anyway, and a longer word
            # is one [UNK]
            gap = _WHITESPACE.search(text, start + room, start + 4 * room)
            end = min(len(text), gap.start() if gap else start + 4 * room)
            piece = self._tokenizer.encode(text[start:end], add_special_tokens=False)
            counted += len(piece.ids)  # one cut at the limit is past it: enough
            if counted > room:
                return end
            start = end
        return None

    def embed_batch(self, texts: Sequence[str]) -> Vectors:
        """Embed synchronously in the calling thread; safe to call from several threads."""
        if isinstance(texts, str):
            raise TypeError("embed_batch takes a sequence of texts, not one str")
        items = list(texts)
        if self._parallel is None or len(items) <= PARALLEL_SLICE:
            return self._embed_rows(items)
        slices = [items[i : i + PARALLEL_SLICE] for i in range(0, len(items), PARALLEL_SLICE)]
        return np.concatenate(list(self._parallel.map(self._embed_rows, slices)))

    async def embed(self, texts: Sequence[str]) -> Vectors:
        """Embed on the dedicated worker thread, ``batch_size`` texts per hand-off."""
        if self._closed:
            raise EmbedderError("LocalEmbedder is closed")
        if isinstance(texts, str):
            raise TypeError("embed takes a sequence of texts, not one str")
        items = list(texts)
        if 1 < len(items) <= SIDE_BY_SIDE:
            return await self._side_by_side(items)
        if len(items) <= self._batch_size:
            return await self._on_worker(items)
        parts = [
            await self._on_worker(items[start : start + self._batch_size])
            for start in range(0, len(items), self._batch_size)
        ]
        return np.concatenate(parts)

    async def embed_later(self, texts: Sequence[str]) -> Vectors:
        """Embed on the background lane (a thread of its own), one hand-off."""
        if self._closed:
            raise EmbedderError("LocalEmbedder is closed")
        if isinstance(texts, str):
            raise TypeError("embed_later takes a sequence of texts, not one str")
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._later, self._embed_rows, list(texts))

    async def aclose(self) -> None:
        """Stop the worker: queued calls are cancelled, a running one finishes off the loop."""
        if self._closed:
            return
        self._closed = True
        await asyncio.to_thread(self._executor.shutdown, wait=True, cancel_futures=True)
        await asyncio.to_thread(self._beside.shutdown, wait=True, cancel_futures=True)
        await asyncio.to_thread(self._later.shutdown, wait=True, cancel_futures=True)
        if self._parallel is not None:
            await asyncio.to_thread(self._parallel.shutdown, wait=True, cancel_futures=True)

    async def _on_worker(self, texts: list[str]) -> Vectors:
        # cancelling the await cancels the hand-off too when the worker has not started it
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._executor, self._embed_rows, texts)

    async def _side_by_side(self, texts: list[str]) -> Vectors:
        """The first text on the worker, each other on a thread beside it; cancelling the await
        cancels the hand-offs not started (as ``_on_worker``)."""
        loop = asyncio.get_running_loop()
        first = loop.run_in_executor(self._executor, self._embed_rows, texts[:1])
        others = [loop.run_in_executor(self._beside, self._embed_rows, [t]) for t in texts[1:]]
        return np.concatenate(await asyncio.gather(first, *others))

    def _embed_rows(self, texts: list[str]) -> Vectors:
        out = np.empty((len(texts), DIMENSION), dtype=np.float32)
        for row, text in enumerate(texts):
            out[row] = self._embed_one(text)
        return normalise(out)

    def _encode(self, text: str) -> Encoding:
        """The tokens the model reads of ``text``: those of its head when that holds them all.

        The tokenizer holds the GIL (the event loop with it) for all it is given, ~7 ms for a
        16 KiB turn, and the model reads a few hundred tokens. The head ends where the tokenizer
        splits (its own whitespace), so its tokens are the whole text's first ones; a head that
        falls short of the limit (control characters the count split at and the tokenizer
        drops) gives way to the whole text.
        """
        end = self._cut(text)
        gap = None if end is None else _SPLITS.search(text, end)
        if gap is None:
            return self._tokenizer.encode(text)
        encoding = self._tokenizer.encode(text[: gap.start()])
        if len(encoding.ids) < self._max_tokens:
            return self._tokenizer.encode(text)
        return encoding

    def _embed_one(self, text: str) -> Vectors:
        encoding = self._encode(text)
        ids = np.asarray([encoding.ids], dtype=np.int64)
        feeds = {
            "input_ids": ids,
            "attention_mask": np.ones_like(ids),
            "token_type_ids": np.asarray([encoding.type_ids], dtype=np.int64),
        }
        (vectors,) = self._session.run([_OUTPUT], feeds)
        return np.asarray(vectors, dtype=np.float32)
