"""PostgreSQL + pgvector with an HNSW index, over psycopg 3 on 127.0.0.1 TCP.

``pip install pgserver psycopg[binary] pgvector``: pgserver bundles PostgreSQL with pgvector and
initialises a data folder (as root it runs the server as its own ``pgserver`` user). The server
is then started here on 127.0.0.1 only, no Unix socket, so every query crosses loopback TCP as a
gRPC call does; ``close`` stops it. Queries use the binary protocol and prepared statements
(psycopg prepares a statement after a few executions), as a tuned client would.
"""

from __future__ import annotations

import contextlib
import importlib
import json
import os
import shutil
import subprocess
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from bench.corpus import F32, Corpus
from bench.measure import SearchFn, Unavailable, choose_ef, free_port
from bench.peers import EF_CONSTRUCTION, M

SHARED_BUFFERS = "2GB"  # holds a 100k x 1536 table and its index, as a tuned server would
CONNECT_TIMEOUT_S = 30
QUERY = "SELECT id FROM items ORDER BY embedding <#> %s LIMIT %s"  # <#>: negative inner product


class Postgres:
    """A PostgreSQL server with pgvector in ``pgdata`` (initialised on first use), listening on
    127.0.0.1 TCP only; ``connect`` opens a connection with the vector type registered."""

    def __init__(self, pgdata: Path) -> None:
        try:
            pgserver: Any = importlib.import_module("pgserver")
            import psycopg
            from pgvector.psycopg import register_vector
        except ImportError as exc:
            raise Unavailable(f"pgserver, psycopg or pgvector is not installed ({exc})") from exc
        self.psycopg = psycopg
        self.register_vector = register_vector
        self.pgdata = pgdata
        self.bin = Path(pgserver.__file__).parent / "pginstall" / "bin"
        self.user = "pgserver" if os.geteuid() == 0 else None
        if not (pgdata / "PG_VERSION").is_file():
            shutil.rmtree(pgdata, ignore_errors=True)  # an initdb that did not finish
            pgdata.mkdir(parents=True)
            # initdb (and, as root, the server's own user and folder permissions), then stop:
            # pgserver serves on a Unix socket only, and we want loopback TCP
            pgserver.get_server(pgdata, cleanup_mode="stop").cleanup()
        self.port = free_port()
        self._pg_ctl(
            "-w", "-t", "120", "-l", str(pgdata / "log"), "start", "-o",
            f"-h 127.0.0.1 -p {self.port} -k '' -c shared_buffers={SHARED_BUFFERS}",
        )  # fmt: skip

    def _pg_ctl(self, *args: str) -> None:
        subprocess.run(
            [str(self.bin / "pg_ctl"), "-D", str(self.pgdata), *args],
            check=True,
            user=self.user,
            stdout=subprocess.DEVNULL,
            timeout=180,
        )

    def connect(self) -> Any:
        conn = self.psycopg.connect(
            host="127.0.0.1",
            port=self.port,
            user="postgres",
            dbname="postgres",
            autocommit=True,
            connect_timeout=CONNECT_TIMEOUT_S,
        )
        conn.execute("CREATE EXTENSION IF NOT EXISTS vector")
        self.register_vector(conn)
        return conn

    async def aconnect(self) -> Any:
        """An asyncio connection (``psycopg.AsyncConnection``), the vector type registered."""
        from pgvector.psycopg import register_vector_async

        conn = await self.psycopg.AsyncConnection.connect(
            host="127.0.0.1",
            port=self.port,
            user="postgres",
            dbname="postgres",
            autocommit=True,
            connect_timeout=CONNECT_TIMEOUT_S,
        )
        await register_vector_async(conn)
        return conn

    def stop(self) -> None:
        with contextlib.suppress(subprocess.SubprocessError):
            self._pg_ctl("-w", "-m", "fast", "stop")


class PgVector:
    name = "pgvector"

    def __init__(self, corpus: Corpus, cache: Path, target_recall: float) -> None:
        self.k = corpus.spec.k
        self.folder = cache / f"pgvector-{corpus.spec.key}-m{M}-efc{EF_CONSTRUCTION}"
        self.clients: list[Any] = []
        marker = self.folder / "built.json"
        if not marker.is_file():
            shutil.rmtree(self.folder, ignore_errors=True)  # a build that did not finish
        self.server = Postgres(self.folder / "pgdata")
        try:
            self.conn = self.server.connect()
            if marker.is_file():
                self.setting: dict[str, Any] = json.loads(marker.read_text())
            else:
                self.setting = {"m": M, "ef_construction": EF_CONSTRUCTION}
                self.setting["build_s"] = self._build(corpus)
                marker.write_text(json.dumps(self.setting))
            self.ef = choose_ef(self._at, corpus, target_recall)
            self.setting["ef_search"] = self.ef
            self.setting["transport"] = "tcp 127.0.0.1"
            self.conn.execute(f"SET hnsw.ef_search = {self.ef}")
        except BaseException:
            self.close()
            raise

    def _build(self, corpus: Corpus) -> float:
        started = time.perf_counter()
        dim = corpus.spec.dim
        self.conn.execute(f"CREATE TABLE items (id int4 PRIMARY KEY, embedding vector({dim}))")
        with (
            self.conn.cursor() as cur,
            cur.copy("COPY items (id, embedding) FROM STDIN WITH (FORMAT BINARY)") as copy,
        ):
            copy.set_types(["int4", "vector"])
            for i, row in enumerate(corpus.vectors):
                copy.write_row((i, row))
        self.conn.execute("SET maintenance_work_mem = '4GB'")  # the graph is built in memory
        self.conn.execute(f"SET max_parallel_maintenance_workers = {os.cpu_count() or 1}")
        self.conn.execute(
            "CREATE INDEX ON items USING hnsw (embedding vector_ip_ops) "
            f"WITH (m = {M}, ef_construction = {EF_CONSTRUCTION})"
        )
        self.conn.execute("VACUUM ANALYZE items")
        return round(time.perf_counter() - started, 1)

    def _at(self, ef: int) -> SearchFn:
        self.conn.execute(f"SET hnsw.ef_search = {ef}")
        return self.search

    def search(self, query: F32) -> Sequence[int]:
        rows = self.conn.execute(QUERY, (query, self.k), binary=True).fetchall()
        return [r[0] for r in rows]

    def client(self) -> SearchFn:
        conn = self.server.connect()
        conn.execute(f"SET hnsw.ef_search = {self.ef}")
        self.clients.append(conn)

        def search(query: F32) -> Sequence[int]:
            return [r[0] for r in conn.execute(QUERY, (query, self.k), binary=True).fetchall()]

        return search

    def close(self) -> None:
        for conn in [*self.clients, getattr(self, "conn", None)]:
            with contextlib.suppress(Exception):
                conn.close()
        self.server.stop()


def open_system(corpus: Corpus, cache: Path, target_recall: float) -> PgVector:
    return PgVector(corpus, cache, target_recall)
