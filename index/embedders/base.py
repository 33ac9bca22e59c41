"""The embedder interface, and a deterministic fake (``FakeEmbedder``) for tests."""

from __future__ import annotations

import asyncio
import hashlib
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import numpy as np
import numpy.typing as npt

from index.errors import EmbedderError

Vectors = npt.NDArray[np.float32]


@dataclass(frozen=True, slots=True)
class EmbedderInfo:
    """What a snapshot records about the model that made its vectors.

    Two embedders are interchangeable only when ``name`` and ``dimension`` are both equal: the
    sidecar refuses a snapshot whose info differs from its own embedder's.
    """

    name: str
    dimension: int


@runtime_checkable
class Embedder(Protocol):
    """Turns texts into L2-normalised float32 row vectors of shape ``(len(texts), dimension)``."""

    @property
    def info(self) -> EmbedderInfo: ...

    async def embed(self, texts: Sequence[str]) -> Vectors:
        """Embed on the hot path without blocking the event loop; callers bound it with a deadline."""
        ...

    def embed_batch(self, texts: Sequence[str]) -> Vectors:
        """Embed in bulk from a worker thread (index builds)."""
        ...

    async def aclose(self) -> None: ...


@runtime_checkable
class TokenLimited(Protocol):
    """An embedder that cuts its input at a token limit (the embedded model does, at 256)."""

    def truncates(self, text: str) -> bool:
        """Whether ``text`` is longer than the embedder reads."""
        ...


@runtime_checkable
class Deferrable(Protocol):
    """An embedder with a background lane, where work never queues ahead of ``embed``'s (the
    embedded model: a thread of its own beside the worker the callers' texts go to)."""

    async def embed_later(self, texts: Sequence[str]) -> Vectors:
        """Embed as ``embed`` does (the same vectors), off the callers' path."""
        ...


# A vector whose squared norm is within this range is scaled to unit length at once
# (``unit_vector``); outside it (a NaN, an infinity, components so large or small that the scale
# would not fit a float32) it takes the careful way, which names the fault or scales in two steps.
SQUARED_NORM_RANGE = (1e-30, 1e30)


class NoDirection(ValueError):
    """A vector ``unit_rows`` cannot scale to unit length: ``row``, and ``at``, its first value
    that is not finite (None when every value is zero)."""

    def __init__(self, rows: npt.NDArray[np.float64], bad: npt.NDArray[np.intp]) -> None:
        self.row = int(bad[0])
        finite = np.isfinite(rows[self.row])
        self.at = None if finite.all() else int(np.argmin(finite))
        why = "every value zero" if self.at is None else "a value that is not finite"
        super().__init__(f"vector {self.row} has {why} ({bad.size} of {len(rows)} such)")


def unit_rows(vectors: npt.NDArray[np.floating]) -> Vectors:
    """Each row scaled to unit length, or NoDirection (a ValueError) naming the first row that
    has no direction to scale: a value that is not finite, or every value zero. An embedder's
    answer is checked this way, and a caller's vector (``unit_vector``): a row of NaN or zeros
    finds nothing, silently.
    """
    rows = np.asarray(vectors, dtype=np.float64)
    finite = np.isfinite(rows).all(axis=1)
    peaks = np.max(np.abs(rows), axis=1) if rows.size else np.zeros(len(rows))
    bad = np.flatnonzero(~finite | (peaks == 0.0))
    if bad.size:
        raise NoDirection(rows, bad)
    scaled = rows / peaks[:, None]  # in [-1, 1]: the norm cannot overflow, however large
    return normalise(scaled)


def unit_vector(values: Vectors) -> Vectors:
    """One float32 vector scaled to unit length (``unit_rows``, NoDirection): the common case,
    a squared norm in ``SQUARED_NORM_RANGE``, in a few steps (a NaN or an infinity makes it
    NaN or infinite, so out of range)."""
    vector = values.astype(np.float64)  # float32 squares cannot overflow in float64
    squares = float(vector.dot(vector))  # half the cost of ``@`` on two vectors
    if SQUARED_NORM_RANGE[0] < squares < SQUARED_NORM_RANGE[1]:
        # a Python float scales a float32 array as a float32 would (NEP 50), and is not made
        unit: Vectors = values * (1.0 / math.sqrt(squares))
    else:
        unit = unit_rows(vector[None, :])[0]
    return unit


def normalise(vectors: npt.NDArray[np.floating]) -> Vectors:
    """Scale each row to unit length so inner product equals cosine similarity."""
    out = np.asarray(vectors, dtype=np.float32)
    norms = np.linalg.norm(out, axis=1, keepdims=True)
    norms[norms == 0] = 1.0
    return np.ascontiguousarray(out / norms, dtype=np.float32)


class FakeEmbedder:
    """A fake embedder for tests: bag of hashed words, deterministic, instant unless told otherwise.

    Texts that share words get similar vectors, which is enough to exercise search plumbing and the
    turn engine (``tests.turns.run_turns``). It is never a default and never used by end-to-end
    tests. ``delay`` (seconds) slows every ``embed`` call, ``hang`` makes it never return (until
    cancelled), ``fail`` makes it raise ``EmbedderError``: a slow, stuck or broken model.

    >>> vectors = FakeEmbedder(dimension=8).embed_batch(["parking at the hotel"])
    >>> vectors.shape
    (1, 8)
    """

    def __init__(
        self,
        dimension: int = 64,
        name: str = "test/hash",
        *,
        delay: float = 0.0,
        hang: bool = False,
        fail: bool = False,
    ) -> None:
        self._info = EmbedderInfo(name=name, dimension=dimension)
        self.delay = delay
        self.hang = hang
        self.fail = fail
        self.calls: list[tuple[str, ...]] = []  # the texts of every ``embed`` call, in order

    @property
    def info(self) -> EmbedderInfo:
        return self._info

    def embed_batch(self, texts: Sequence[str]) -> Vectors:
        out = np.zeros((len(texts), self._info.dimension), dtype=np.float32)
        for row, text in enumerate(texts):
            for word in text.lower().split():
                digest = hashlib.blake2b(word.strip(".,?!:;\"'()").encode(), digest_size=8).digest()
                out[row, int.from_bytes(digest[:4], "little") % self._info.dimension] += 1.0
        return normalise(out)

    async def embed(self, texts: Sequence[str]) -> Vectors:
        self.calls.append(tuple(texts))
        if self.hang:
            await asyncio.Event().wait()  # until cancelled
        await asyncio.sleep(self.delay)
        if self.fail:
            raise EmbedderError("the fake embedder was told to fail")
        return self.embed_batch(texts)

    async def aclose(self) -> None:
        return None


# The name it had before it could be slow, stuck or broken; the tests of single pieces use it.
HashEmbedder = FakeEmbedder
