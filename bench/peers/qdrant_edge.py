"""Qdrant in-process: ``pip install qdrant-edge-py`` (no Qdrant server can be had here).

An ``EdgeShard`` in the cache folder, built with the same graph parameters as the other HNSW
systems and optimised into an indexed segment; queries pass ``hnsw_ef`` per request. The API
takes a vector as a list of floats, so each query pays ``tolist()`` as a caller would.
"""

from __future__ import annotations

import contextlib
import json
import shutil
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from bench.corpus import F32, Corpus
from bench.measure import SearchFn, Unavailable, choose_ef
from bench.peers import EF_CONSTRUCTION, M

UPSERT_BATCH = 1000


class QdrantEdge:
    name = "qdrant"

    def __init__(self, corpus: Corpus, cache: Path, target_recall: float) -> None:
        try:
            import qdrant_edge as qe
        except ImportError as exc:
            raise Unavailable(f"qdrant-edge-py is not installed ({exc})") from exc
        self.qe = qe
        self.k = corpus.spec.k
        folder = cache / f"qdrant-{corpus.spec.key}-m{M}-efc{EF_CONSTRUCTION}"
        marker = folder / "built.json"
        if marker.is_file():
            self.setting: dict[str, Any] = json.loads(marker.read_text())
            self.shard = qe.EdgeShard.load(str(folder / "shard"))
        else:
            shutil.rmtree(folder, ignore_errors=True)  # a build that did not finish
            folder.mkdir(parents=True)
            self.setting = {"m": M, "ef_construction": EF_CONSTRUCTION}
            self.setting["build_s"] = self._build(corpus, folder / "shard")
            marker.write_text(json.dumps(self.setting))
        try:
            self.ef = choose_ef(self._at, corpus, target_recall)
        except BaseException:
            self.close()
            raise
        self.setting["ef_search"] = self.ef
        self.params = qe.SearchParams(hnsw_ef=self.ef)

    def _build(self, corpus: Corpus, path: Path) -> float:
        qe = self.qe
        started = time.perf_counter()
        config = qe.EdgeConfig(
            vectors=qe.EdgeVectorParams(size=corpus.spec.dim, distance=qe.Distance.Dot),
            hnsw_config=qe.HnswIndexConfig(
                m=M, ef_construct=EF_CONSTRUCTION, full_scan_threshold=1
            ),
            # index every segment however small, into as few segments as it will make
            optimizers=qe.EdgeOptimizersConfig(indexing_threshold=1, default_segment_number=1),
            wal_enabled=False,
        )
        self.shard = qe.EdgeShard.create(str(path), config)
        for start in range(0, corpus.spec.n, UPSERT_BATCH):
            rows = corpus.vectors[start : start + UPSERT_BATCH]
            points = [qe.Point(start + i, row.tolist()) for i, row in enumerate(rows)]
            self.shard.update(qe.UpdateOperation.upsert_points(points))
        self.shard.optimize()
        self.shard.flush()
        return round(time.perf_counter() - started, 1)

    def _query(self, query: F32, params: Any) -> Sequence[int]:
        qe = self.qe
        request = qe.QueryRequest(
            limit=self.k, query=qe.Query.Nearest(query.tolist()), params=params
        )
        return [int(p.id) for p in self.shard.query(request)]

    def _at(self, ef: int) -> SearchFn:
        params = self.qe.SearchParams(hnsw_ef=ef)
        return lambda q: self._query(q, params)

    def search(self, query: F32) -> Sequence[int]:
        return self._query(query, self.params)

    def client(self) -> SearchFn:
        return self.search

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self.shard.close()


def open_system(corpus: Corpus, cache: Path, target_recall: float) -> QdrantEdge:
    return QdrantEdge(corpus, cache, target_recall)
