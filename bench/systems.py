"""The in-process floors: exact search by numpy, and hnswlib over voxrecall's own graph."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import hnswlib
import numpy as np

from bench.corpus import F32, Corpus
from bench.measure import SearchFn
from index.snapshot import VECTORS, read_manifest


class NumpyExact:
    """Exact top-k: one matrix-vector product and a partial sort. Recall 1 by construction."""

    name = "numpy-exact"

    def __init__(self, corpus: Corpus) -> None:
        self.vectors = corpus.vectors
        self.k = corpus.spec.k
        self.setting: dict[str, Any] = {"exact": True}

    def search(self, query: F32) -> Sequence[int]:
        scores = self.vectors @ query
        part = np.argpartition(-scores, self.k - 1)[: self.k]
        return part[np.argsort(-scores[part], kind="stable")].tolist()  # type: ignore[no-any-return]

    def client(self) -> SearchFn:
        return self.search

    def close(self) -> None:
        return None


class Hnswlib:
    """hnswlib in-process, loading the very graph file of the voxrecall snapshot, at its ef.

    The same index and the same ef as the sidecar serves, so the difference between this row
    and ``voxrecall`` is exactly what the service and the transport add.
    """

    name = "hnswlib"

    def __init__(self, corpus: Corpus, snapshot: Path) -> None:
        manifest = read_manifest(snapshot)
        self.k = corpus.spec.k
        self.index = hnswlib.Index(space="ip", dim=corpus.spec.dim)
        self.index.load_index(str(snapshot / VECTORS), max_elements=corpus.spec.n)
        self.index.set_ef(manifest.hnsw.ef)
        self.index.set_num_threads(1)  # one query at a time: threads would only add overhead
        self.setting = {"m": manifest.hnsw.m, "ef_construction": manifest.hnsw.ef_construction}
        self.setting["ef_search"] = manifest.hnsw.ef

    def search(self, query: F32) -> Sequence[int]:
        labels, _ = self.index.knn_query(query.reshape(1, -1), k=self.k)
        return labels[0].tolist()  # type: ignore[no-any-return]

    def at(self, ef: int) -> SearchFn:
        """Search at another ef (the index's ef changes until the next call of ``at``)."""
        self.index.set_ef(ef)
        return self.search

    def client(self) -> SearchFn:
        return self.search

    def close(self) -> None:
        return None
