"""faiss ``IndexHNSWFlat`` (inner product) in-process: ``pip install faiss-cpu``."""

from __future__ import annotations

import importlib
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from bench.corpus import F32, Corpus
from bench.measure import SearchFn, Unavailable, choose_ef
from bench.peers import EF_CONSTRUCTION, M


class FaissHnsw:
    name = "faiss-hnsw"

    def __init__(self, corpus: Corpus, cache: Path, target_recall: float) -> None:
        try:
            faiss: Any = importlib.import_module("faiss")
        except ImportError as exc:
            raise Unavailable(f"faiss-cpu is not installed ({exc})") from exc
        self.faiss = faiss
        self.k = corpus.spec.k
        path = cache / f"faiss-{corpus.spec.key}-m{M}-efc{EF_CONSTRUCTION}.index"
        self.setting: dict[str, Any] = {"m": M, "ef_construction": EF_CONSTRUCTION}
        if path.is_file():
            self.index = faiss.read_index(str(path))
        else:
            started = time.perf_counter()
            self.index = faiss.IndexHNSWFlat(corpus.spec.dim, M, faiss.METRIC_INNER_PRODUCT)
            self.index.hnsw.efConstruction = EF_CONSTRUCTION
            self.index.add(corpus.vectors)
            self.setting["build_s"] = round(time.perf_counter() - started, 1)
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = path.with_suffix(".tmp")
            faiss.write_index(self.index, str(tmp))
            tmp.replace(path)
        faiss.omp_set_num_threads(1)  # one query at a time: OpenMP would only add overhead
        self.ef = choose_ef(self._at, corpus, target_recall)
        self.setting["ef_search"] = self.ef
        self.params = faiss.SearchParametersHNSW(efSearch=self.ef)

    def _at(self, ef: int) -> SearchFn:
        params = self.faiss.SearchParametersHNSW(efSearch=ef)
        return lambda q: self._search(q, params)

    def _search(self, query: F32, params: Any) -> Sequence[int]:
        _, labels = self.index.search(query.reshape(1, -1), self.k, params=params)
        return labels[0].tolist()  # type: ignore[no-any-return]

    def search(self, query: F32) -> Sequence[int]:
        return self._search(query, self.params)

    def client(self) -> SearchFn:
        return self.search

    def close(self) -> None:
        return None


def open_system(corpus: Corpus, cache: Path, target_recall: float) -> FaissHnsw:
    return FaissHnsw(corpus, cache, target_recall)
