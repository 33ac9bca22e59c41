"""voxrecall as a caller sees it: a real snapshot, a sidecar process, its Search RPC on loopback.

``build_snapshot`` writes the synthetic corpus as a snapshot with ``write_snapshot`` (the build
picks ``ef`` by measured recall, as a real build does) and publishes it in a cached store.
``SidecarProcess`` runs ``bench.sidecar_proc`` on it. ``Voxrecall`` sends each query as
``SearchRequest.vector`` (float32 little-endian bytes); ``GrpcEcho`` sends the same request to a
method that answers with the same bytes and searches nothing.
"""

from __future__ import annotations

import contextlib
import json
import subprocess
import sys
from collections.abc import AsyncIterator, Sequence
from functools import partial
from pathlib import Path
from typing import Any

import grpc
import numpy as np

from bench.corpus import CACHE, F32, Corpus, digest
from bench.measure import AsyncSearchFn, free_port
from index.config import HnswConfig
from index.embedders.base import EmbedderInfo
from index.snapshot import FORMAT_VERSION, write_snapshot
from index.store import LocalStore, new_version_id
from index.types import Chunk
from sidecar.gen import retrieval_pb2 as pb
from sidecar.gen import retrieval_pb2_grpc as pb_grpc

KB = "bench"
SOURCE = "synthetic"
EMBEDDER_PREFIX = "bench/synthetic"  # the snapshot's embedder name; queries arrive as vectors
CHUNKS_PER_PAGE = 8
HNSW = HnswConfig()  # the product's defaults: M, ef_construction and the recall target
STARTUP_TIMEOUT_S = 600.0  # loading a 1M-chunk snapshot verifies hundreds of MB of checksums
CALL_TIMEOUT_S = 5.0  # far above any search; a stuck call fails the run instead of hanging it
# ~200 characters a chunk, so that a top-10 response is a few KB as with real chunks
FILLER = (
    "This synthetic passage stands in for a help-centre chunk: its words do not matter to a "
    "vector search, only its size on the wire."
)


def embedder_info(corpus: Corpus) -> EmbedderInfo:
    return EmbedderInfo(name=f"{EMBEDDER_PREFIX}-{corpus.spec.dim}", dimension=corpus.spec.dim)


def _chunks(n: int) -> list[Chunk]:
    out = []
    for i in range(n):
        page = i // CHUNKS_PER_PAGE
        title = f"Document {page}"
        crumbs = (title, f"Section {i % CHUNKS_PER_PAGE}")
        text = f"Chunk {i}. {FILLER}"
        out.append(
            Chunk(
                chunk_id=f"c{i:08d}",
                source=SOURCE,
                source_path=f"doc-{page}.md",
                title=title,
                breadcrumbs=crumbs,
                text=text,
                embed_text=f"{' > '.join(crumbs)}\n{text}",
            )
        )
    return out


def store_root(corpus: Corpus, cache: Path = CACHE) -> Path:
    """The cached store of this corpus; a new snapshot format or hnsw default makes a new one."""
    name = f"voxrecall-{corpus.spec.key}-f{FORMAT_VERSION}-m{HNSW.m}-efc{HNSW.ef_construction}"
    return cache / name / "store"


def build_snapshot(corpus: Corpus, cache: Path = CACHE) -> tuple[Path, bool]:
    """The published snapshot folder of this corpus, and whether it was built just now."""
    store = LocalStore(store_root(corpus, cache))
    if store.latest(KB) is not None:
        return store.latest_dir(KB), False
    chunks = _chunks(corpus.spec.n)
    pages = {
        f"{SOURCE}:doc-{p}.md": f"Document {p}" for p in range(-(-len(chunks) // CHUNKS_PER_PAGE))
    }
    version = new_version_id(digest(corpus.vectors))
    staging = store.staging_dir(KB)
    write_snapshot(
        staging,
        knowledge_base=KB,
        version=version,
        embedder=embedder_info(corpus),
        chunks=chunks,
        vectors=corpus.vectors,
        pages=pages,
        page_count=len(pages),
        hnsw_m=HNSW.m,
        hnsw_ef_construction=HNSW.ef_construction,
        target_recall=HNSW.target_recall,
        sources=[SOURCE],
    )
    return store.publish(KB, staging, version), True


class SidecarProcess:
    """``bench.sidecar_proc`` as child processes: one, or ``workers`` sharing one port as
    ``voxrecall serve`` runs its workers; ``close`` ends them (also when startup fails)."""

    def __init__(
        self, store: Path, info: EmbedderInfo, ef_search: int = 0, workers: int = 1
    ) -> None:
        listen = f"127.0.0.1:{free_port()}" if workers > 1 else "127.0.0.1:0"
        args = [
            sys.executable, "-m", "bench.sidecar_proc", "--store", str(store),
            "--dim", str(info.dimension), "--embedder", info.name,
            "--ef-search", str(ef_search), "--listen", listen, "--workers", str(workers),
        ]  # fmt: skip
        self.procs: list[subprocess.Popen[str]] = []
        try:
            infos = []
            for _ in range(workers):
                proc = subprocess.Popen(
                    args, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                    cwd=Path(__file__).resolve().parents[1], text=True,
                )  # fmt: skip
                self.procs.append(proc)
                assert proc.stdout is not None
                line = proc.stdout.readline()
                if not line:
                    raise RuntimeError(f"sidecar process exited with {proc.wait(5)}")
                infos.append(json.loads(line))
            self.infos: list[dict[str, Any]] = infos
            self.info: dict[str, Any] = dict(infos[0])
            self.info["load_s"] = max(i["load_s"] for i in infos)
        except BaseException:
            self.close()
            raise

    @property
    def proc(self) -> subprocess.Popen[str]:
        """The first worker's process (the only one with ``workers=1``)."""
        return self.procs[0]

    @property
    def port(self) -> int:
        return int(self.info["port"])

    @property
    def echo_port(self) -> int:
        return int(self.info["echo_port"])

    def close(self) -> None:
        """Close their stdin (they drain and exit), wait, and kill any that will not stop."""
        for proc in self.procs:
            assert proc.stdin is not None
            assert proc.stdout is not None
            proc.stdin.close()
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
            proc.stdout.close()


# A channel of its own connection: channels of one process otherwise share one (gRPC's global
# subchannel pool), and a worker serves a connection for as long as it lasts.
OWN_CONNECTION = (("grpc.use_local_subchannel_pool", 1),)


def _request(query: F32) -> pb.SearchRequest:
    return pb.SearchRequest(
        knowledge_base=KB,
        vector=np.asarray(query, dtype="<f4").tobytes(),
        limit=10,
        min_score=-1.0,
    )


class Voxrecall:
    """The sidecar's Search RPC over a grpc.aio channel on 127.0.0.1."""

    def __init__(self, port: int, setting: dict[str, Any], name: str = "voxrecall") -> None:
        self.name = name
        self.target = f"127.0.0.1:{port}"
        self.channel = grpc.aio.insecure_channel(self.target)
        self.stub = pb_grpc.RetrievalStub(self.channel)  # type: ignore[no-untyped-call]
        self.setting = setting
        self.server_ms: list[tuple[float, float]] = []  # (total_ms, search_ms) the server reports

    async def asearch(self, query: F32) -> Sequence[int]:
        resp: pb.SearchResponse = await self.stub.Search(_request(query), timeout=CALL_TIMEOUT_S)
        self.server_ms.append((resp.timings.total_ms, resp.timings.search_ms))
        return [int(c.chunk_id[1:]) for c in resp.chunks]

    @contextlib.asynccontextmanager
    async def clients(self, n: int) -> AsyncIterator[list[AsyncSearchFn]]:
        async with _channels(self.target, n) as channels:
            stubs = [pb_grpc.RetrievalStub(c) for c in channels]  # type: ignore[no-untyped-call]
            yield [partial(_search_on, stub.Search) for stub in stubs]

    def server_timings(self, last: int) -> dict[str, float]:
        """p50 of what the engine itself timed, over the last ``last`` sequential calls."""
        total, search = zip(*self.server_ms[-last:], strict=True)
        return {
            "server_total_p50_ms": round(float(np.median(total)), 4),
            "server_search_p50_ms": round(float(np.median(search)), 4),
        }

    async def aclose(self) -> None:
        await self.channel.close(None)


class GrpcEcho:
    """The same request and response bytes over the same kind of channel, with no search; or,
    as ``grpc-knn`` (``method="Knn"``), with the sidecar's own graph searched in a bare method
    of its process (``bench.sidecar_proc``): the floor of a Python server's Search."""

    def __init__(
        self, port: int, response_bytes: int, method: str = "Search", name: str = "grpc-echo"
    ) -> None:
        self.name = name
        self.method = f"/bench.Echo/{method}"
        self.target = f"127.0.0.1:{port}"
        self.channel = grpc.aio.insecure_channel(self.target)
        self.call = _echo_call(self.channel, self.method)
        self.setting: dict[str, Any] = {"response_bytes": response_bytes}

    async def asearch(self, query: F32) -> Sequence[int]:
        return await _search_on(self.call, query)

    @contextlib.asynccontextmanager
    async def clients(self, n: int) -> AsyncIterator[list[AsyncSearchFn]]:
        async with _channels(self.target, n) as channels:
            yield [partial(_search_on, _echo_call(c, self.method)) for c in channels]

    async def aclose(self) -> None:
        await self.channel.close(None)


def _echo_call(channel: grpc.aio.Channel, method: str) -> Any:
    return channel.unary_unary(
        method,
        request_serializer=pb.SearchRequest.SerializeToString,
        response_deserializer=pb.SearchResponse.FromString,
    )


async def _search_on(call: Any, query: F32) -> Sequence[int]:
    resp: pb.SearchResponse = await call(_request(query), timeout=CALL_TIMEOUT_S)
    return [int(c.chunk_id[1:]) for c in resp.chunks]


@contextlib.asynccontextmanager
async def _channels(target: str, n: int) -> AsyncIterator[list[grpc.aio.Channel]]:
    channels = [grpc.aio.insecure_channel(target, options=OWN_CONNECTION) for _ in range(n)]
    try:
        yield channels
    finally:
        for channel in channels:
            await channel.close(None)
