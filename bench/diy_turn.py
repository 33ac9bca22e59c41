"""What a voice team builds instead of a ``Turn``: the DIY system of ``python -m bench turn``.

The same caller text embedded in the client with the same local model (``LocalEmbedder`` with the
config's intra-op threads, on one worker thread, as the sidecar runs it), then sent to PostgreSQL + pgvector
(``bench.peers.pgvector.Postgres``: loopback TCP, an HNSW index with the sidecar's M and
ef_construction) for the top ``max_results`` chunks with their title, text and url: what a
``Turn`` answers with. The table holds the very chunks and vectors of the snapshot the sidecar
serves. Every turn is embedded and searched (a DIY system has no skip policy and no cache);
the time is the client's, from the final transcript to the rows.
"""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from bench.peers import EF_CONSTRUCTION, M
from bench.peers.pgvector import Postgres
from index.embedders.local import LocalEmbedder
from index.snapshot import load_snapshot
from index.store import LocalStore
from sidecar.config import Config

QUERY = "SELECT id, title, text, url FROM chunks ORDER BY embedding <#> %s LIMIT %s"  # <#>: -ip


class Diy:
    """pgvector over the snapshot ``config``'s first knowledge base serves, and the client's
    embedder; ``turn`` is one caller turn end to end."""

    def __init__(self, config: Config, folder: Path) -> None:
        kb = config.knowledge_bases[0].name
        store = LocalStore(config.index.store)
        snapshot = load_snapshot(store.latest_dir(kb))
        self.version = snapshot.manifest.version
        self.limit = config.sidecar.max_results
        self.server = Postgres(folder / "pgdata")
        try:
            self._load(snapshot)
        except BaseException:
            self.server.stop()
            raise
        self.embedder = LocalEmbedder(threads=config.embedder.threads)

    def _load(self, snapshot: Any) -> None:
        """The table, unless it already holds this snapshot (a rerun measures queries only)."""
        with self.server.connect() as conn:
            conn.execute("CREATE TABLE IF NOT EXISTS built (version text)")
            row = conn.execute("SELECT version FROM built").fetchone()
            if row is not None and row[0] == self.version:
                return
            conn.execute("DROP TABLE IF EXISTS chunks")
            conn.execute(
                "CREATE TABLE chunks (id int4 PRIMARY KEY, title text, text text, url text, "
                "embedding vector(384))"
            )
            n = len(snapshot.chunks)
            vectors = np.asarray(snapshot.index.get_items(list(range(n))), dtype=np.float32)
            with (
                conn.cursor() as cur,
                cur.copy("COPY chunks (id, title, text, url, embedding) FROM STDIN") as copy,
            ):
                for i in range(n):
                    chunk = snapshot.chunks[i]
                    copy.write_row((i, chunk.title, chunk.text, chunk.url, vectors[i]))
            conn.execute(
                "CREATE INDEX ON chunks USING hnsw (embedding vector_ip_ops) "
                f"WITH (m = {M}, ef_construction = {EF_CONSTRUCTION})"
            )
            conn.execute("VACUUM ANALYZE chunks")
            conn.execute("DELETE FROM built")
            conn.execute("INSERT INTO built VALUES (%s)", (self.version,))

    async def connect(self) -> Any:
        """One caller's connection (an agent process holds one per call it serves)."""
        return await self.server.aconnect()

    async def turn(self, conn: Any, text: str) -> list[tuple[Any, ...]]:
        (vector,) = await self.embedder.embed([text])
        async with conn.cursor(binary=True) as cur:
            await cur.execute(QUERY, (vector, self.limit), prepare=True)
            rows: list[tuple[Any, ...]] = await cur.fetchall()
            return rows

    async def aclose(self) -> None:
        await self.embedder.aclose()
        await asyncio.to_thread(self.server.stop)


async def call(
    diy: Diy,
    conn: Any,
    session: str,
    turns: list[str],
    pause: Callable[[random.Random, str], float],
    out: list[tuple[str, float]],
) -> None:
    """One caller's turns, paced as ``bench.turn_latency``'s callers are: ``pause(rng, text)``
    seconds before each final transcript; (text, the client's milliseconds) per turn."""
    rng = random.Random(session)
    for text in turns:
        await asyncio.sleep(pause(rng, text))
        start = time.perf_counter()
        await diy.turn(conn, text)
        out.append((text, (time.perf_counter() - start) * 1000.0))


async def run_calls(
    diy: Diy,
    calls: list[list[str]],
    concurrency: int,
    pause: Callable[[random.Random, str], float],
) -> list[tuple[str, float]]:
    """Every call, ``concurrency`` at once, each in progress holding one of as many connections;
    after one warm-up turn."""
    out: list[tuple[str, float]] = []
    pool: asyncio.Queue[Any] = asyncio.Queue()
    for _ in range(concurrency):
        pool.put_nowait(await diy.connect())
    try:

        async def one(i: int, turns: list[str]) -> None:
            conn = await pool.get()
            try:
                await call(diy, conn, f"diy-{i}", turns, pause, out)
            finally:
                pool.put_nowait(conn)

        await one(-1, ["How do I open a new tab?"])  # warm-up: connections, model pages
        out.clear()
        await asyncio.gather(*(one(i, turns) for i, turns in enumerate(calls)))
    finally:
        while not pool.empty():
            await pool.get_nowait().close()
    return out
