"""Chroma's HTTP server (``chroma run`` from ``pip install chromadb``) and its Python client.

The server is started on 127.0.0.1 with its data folder in the cache and stopped by ``close``.
Chroma reads ``ef_search`` when it loads a collection, so each ef tried while choosing the
setting is applied by ``modify`` and a server restart; the chosen one is kept with the cache.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from bench.corpus import F32, Corpus
from bench.measure import SearchFn, Unavailable, choose_ef, free_port
from bench.peers import EF_CONSTRUCTION, M

COLLECTION = "bench"
MAX_BODY_BYTES = 8_000_000  # a float is ~12 bytes of JSON; 1536-d rows then go ~430 at a time
STARTUP_TIMEOUT_S = 120.0  # a restart loads the whole collection's index from disk


class Chroma:
    name = "chroma"

    def __init__(self, corpus: Corpus, cache: Path, target_recall: float) -> None:
        try:
            import chromadb
            from chromadb.config import Settings
        except ImportError as exc:
            raise Unavailable(f"chromadb is not installed ({exc})") from exc
        self.chromadb = chromadb
        self.settings = Settings
        self.exe = Path(sys.executable).parent / "chroma"
        if not self.exe.is_file():
            raise Unavailable(f"no chroma server executable at {self.exe}")
        self.k = corpus.spec.k
        self.folder = cache / f"chroma-{corpus.spec.key}-m{M}-efc{EF_CONSTRUCTION}"
        self.proc: subprocess.Popen[bytes] | None = None
        marker = self.folder / "built.json"
        try:
            if marker.is_file():
                self.setting: dict[str, Any] = json.loads(marker.read_text())
                self._start()
            else:
                shutil.rmtree(self.folder, ignore_errors=True)  # a build that did not finish
                self.folder.mkdir(parents=True)
                self._start()
                self.setting = {"m": M, "ef_construction": EF_CONSTRUCTION}
                self.setting["build_s"] = self._build(corpus)
                self.setting["ef_search"] = choose_ef(self._restarted_at, corpus, target_recall)
                self._restarted_at(self.setting["ef_search"])
                marker.write_text(json.dumps(self.setting))
            self.collection = self._client().get_collection(COLLECTION)
        except BaseException:
            self.close()
            raise

    def _client(self) -> Any:
        # a fresh Settings each time: the client writes the port into the one it is given
        settings = self.settings(anonymized_telemetry=False)
        return self.chromadb.HttpClient(host="127.0.0.1", port=self.port, settings=settings)

    def _start(self) -> None:
        self.port = free_port()
        env = {**os.environ, "ANONYMIZED_TELEMETRY": "False"}
        self.proc = subprocess.Popen(
            [
                str(self.exe),
                "run",
                "--host",
                "127.0.0.1",
                "--port",
                str(self.port),
                "--path",
                str(self.folder / "data"),
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            env=env,
        )
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        while True:
            try:
                self._client().heartbeat()
                return
            except Exception as exc:
                if self.proc.poll() is not None or time.monotonic() > deadline:
                    raise Unavailable(f"chroma server did not start: {exc}") from exc
                time.sleep(0.2)

    def _stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.proc = None

    def _build(self, corpus: Corpus) -> float:
        started = time.perf_counter()
        client = self._client()
        collection = client.create_collection(
            COLLECTION,
            configuration={
                "hnsw": {"space": "ip", "max_neighbors": M, "ef_construction": EF_CONSTRUCTION}
            },
            embedding_function=None,
        )
        # rows per request: the server refuses JSON bodies of more than a few tens of MB
        batch = min(client.get_max_batch_size(), max(1, MAX_BODY_BYTES // (corpus.spec.dim * 12)))
        for start in range(0, corpus.spec.n, batch):
            rows = corpus.vectors[start : start + batch]
            collection.add(ids=[str(i) for i in range(start, start + len(rows))], embeddings=rows)
        return round(time.perf_counter() - started, 1)

    def _restarted_at(self, ef: int) -> SearchFn:
        self._client().get_collection(COLLECTION).modify(configuration={"hnsw": {"ef_search": ef}})
        self._stop()
        self._start()
        self.collection = self._client().get_collection(COLLECTION)
        return self.search

    def search(self, query: F32) -> Sequence[int]:
        return self._query(self.collection, query)

    def _query(self, collection: Any, query: F32) -> Sequence[int]:
        result = collection.query(query_embeddings=[query], n_results=self.k, include=[])
        return [int(i) for i in result["ids"][0]]

    def client(self) -> SearchFn:
        collection = self._client().get_collection(COLLECTION)
        return lambda q: self._query(collection, q)

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self._stop()


def open_system(corpus: Corpus, cache: Path, target_recall: float) -> Chroma:
    return Chroma(corpus, cache, target_recall)
