"""Query vectors kept between benchmark runs: ``CachedEmbedder`` wraps the embedded model.

A quality run embeds tens of thousands of short queries (every turn, every baseline), the same
ones on every run of the same sets; on two cores that is most of a run's minutes. The vectors are
a pure function of the text (``LocalEmbedder`` embeds each text alone, unpadded), so they are
kept in ``bench/.cache/query-vectors-<embedder>.npz`` and read back by the next run. Bulk
``embed_batch`` (a snapshot build) is passed through uncached.

    embedder = CachedEmbedder(LocalEmbedder(), CachedEmbedder.default_path(name))
    ...
    embedder.save()  # also done by ``aclose``
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from bench.quality_turns import CACHE
from index.embedders.base import Embedder, EmbedderInfo, Vectors


class CachedEmbedder:
    """An ``Embedder`` answering ``embed`` from a text -> vector file before asking ``inner``."""

    def __init__(self, inner: Embedder, path: Path) -> None:
        self.inner = inner
        self.path = path
        self._vectors: dict[str, np.ndarray] = {}
        self._new = 0
        if path.is_file():
            with np.load(path, allow_pickle=False) as data:
                texts, vectors = data["texts"].tolist(), data["vectors"]
            self._vectors = dict(zip(texts, vectors, strict=True))

    @staticmethod
    def default_path(info: EmbedderInfo) -> Path:
        return CACHE / f"query-vectors-{re.sub(r'[^A-Za-z0-9.-]+', '_', info.name)}.npz"

    @property
    def info(self) -> EmbedderInfo:
        return self.inner.info

    async def embed(self, texts: Sequence[str]) -> Vectors:
        missing = [t for t in dict.fromkeys(texts) if t not in self._vectors]
        if missing:
            found = await self.inner.embed(missing)
            self._vectors.update(zip(missing, found, strict=True))
            self._new += len(missing)
        return np.stack([self._vectors[t] for t in texts]).astype(np.float32)

    def embed_batch(self, texts: Sequence[str]) -> Vectors:
        return self.inner.embed_batch(texts)

    def save(self) -> None:
        """Write the vectors when any are new (temp file + rename: a killed run loses nothing)."""
        if not self._new:
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)
        texts = np.array(list(self._vectors), dtype=str)
        vectors = np.stack(list(self._vectors.values())).astype(np.float32)
        tmp = self.path.with_suffix(".tmp.npz")
        np.savez(tmp, texts=texts, vectors=vectors)
        tmp.replace(self.path)
        self._new = 0

    async def aclose(self) -> None:
        self.save()
        await self.inner.aclose()
