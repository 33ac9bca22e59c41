"""``python -m bench http``: what the HTTP door adds over gRPC for the same call, in one run.

A real ``voxrecall serve`` process (uvloop, the embedded model) serves the example help centre
on gRPC and HTTP. One client process sends the same knowledge query, interleaved, as:

- ``grpc InvokeTool``: the gRPC call (grpc.aio);
- ``http /tools``: the generic tool webhook (the same ``Toolbox.invoke`` behind it);
- ``mcp tools/call``: an MCP ``tools/call`` in an initialised session (the SDK's server);
- ``vapi``: a Vapi knowledge-base request of one user message (a whole turn: skip policy,
  follow-ups, search), each in a call of its own;
- ``grpc Turn``: the gRPC turn of the same words, for the Vapi row.

The HTTP client is a minimal keep-alive HTTP/1.1 client on asyncio streams, so the client's
own cost stays near grpc's C core. The query vector is cached after the first call: the rows
differ by the door, not the embedding. p50/p99 in ms and throughput (calls/s, 8 in flight) per
row; the goal is ``http /tools`` and ``mcp tools/call`` p50 within 1 ms of ``grpc InvokeTool``.
"""

from __future__ import annotations

import asyncio
import os
import random
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import orjson

from bench.measure import free_port, percentiles_ms
from index.build import build_knowledge_base
from index.embedders.local import LocalEmbedder
from sidecar.config import load_config
from sidecar.gen import retrieval_pb2 as pb
from sidecar.gen import retrieval_pb2_grpc as pb_grpc

REPO = Path(__file__).resolve().parents[1]
QUERY = "How much does roaming cost in Europe?"
START_S = 120.0  # how long the sidecar may take to load (a bound, not a measurement)
CONCURRENCY = 8
GOAL_MS = 1.0
CONFIG = """
[[knowledge_base]]
name = "help"
[[knowledge_base.source]]
name = "help-center"
type = "markdown"
path = "{kb}"
[[function]]
name = "knowledge_search"
description = "Northwind Mobile help: plans, prices, roaming."
knowledge_base = "help"
[index]
store = "{store}"
[sidecar]
listen = "127.0.0.1:{grpc}"
store = "{store}"
budget_ms = 2000
log_level = "WARNING"
max_concurrent_rpcs = 256
[sidecar.http]
listen = "127.0.0.1:{http}"
max_connections_per_ip = 0  # every client of the bench comes from 127.0.0.1
"""


class Http:
    """One keep-alive HTTP/1.1 connection: POST a body, read the answer's status and body."""

    def __init__(
        self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, port: int
    ) -> None:
        self.reader, self.writer, self.port = reader, writer, port

    @classmethod
    async def open(cls, port: int) -> Http:
        return cls(*await asyncio.open_connection("127.0.0.1", port), port)

    async def post(
        self, path: str, body: bytes, headers: str = ""
    ) -> tuple[int, dict[str, str], bytes]:
        self.writer.write(
            f"POST {path} HTTP/1.1\r\nhost: 127.0.0.1:{self.port}\r\ncontent-type: application/json\r\n"
            f"accept: application/json, text/event-stream\r\ncontent-length: {len(body)}\r\n"
            f"{headers}\r\n".encode()
            + body
        )
        status = int((await self.reader.readline()).split()[1])
        fields: dict[str, str] = {}
        while (line := await self.reader.readline()) not in (b"\r\n", b""):
            name, _, value = line.decode("latin-1").partition(":")
            fields[name.lower()] = value.strip()
        return status, fields, await self.reader.readexactly(int(fields["content-length"]))

    def close(self) -> None:
        self.writer.close()


Call = Callable[[], Awaitable[None]]


def _expect(ok: bool, answer: bytes) -> None:
    """A wrong answer stops the bench: a fast error is no measurement."""
    if not ok:
        raise RuntimeError(f"unexpected answer: {answer[:300]!r}")


async def _mcp_session(http: Http) -> str:
    init = {"jsonrpc": "2.0", "id": 1, "method": "initialize", "params": {
        "protocolVersion": "2025-06-18", "capabilities": {},
        "clientInfo": {"name": "bench", "version": "1"}}}  # fmt: skip
    status, fields, _ = await http.post("/mcp", orjson.dumps(init))
    _expect(status == 200, b"initialize: %d" % status)
    headers = f"mcp-session-id: {fields['mcp-session-id']}\r\nmcp-protocol-version: 2025-06-18\r\n"
    await http.post("/mcp", b'{"jsonrpc": "2.0", "method": "notifications/initialized"}', headers)
    return headers


async def _calls(grpc_port: int, http_port: int) -> tuple[dict[str, Call], Callable[[], None]]:
    """One client per row, each a zero-argument call that fails loudly on a wrong answer."""
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{grpc_port}")
    stub = pb_grpc.RetrievalStub(channel)  # type: ignore[no-untyped-call]
    tools, mcp, vapi = [await Http.open(http_port) for _ in range(3)]
    mcp_headers = await _mcp_session(mcp)
    arguments = orjson.dumps({"query": QUERY}).decode()
    tool_body = orjson.dumps({"args": {"query": QUERY}})
    mcp_body = orjson.dumps({"jsonrpc": "2.0", "id": 2, "method": "tools/call",
        "params": {"name": "knowledge_search", "arguments": {"query": QUERY}}})  # fmt: skip
    n = iter(range(10**9))

    async def grpc_tool() -> None:
        reply = await stub.InvokeTool(
            pb.InvokeToolRequest(name="knowledge_search", arguments_json=arguments)
        )
        _expect(not reply.is_error and bool(reply.chunks), reply.output.encode())

    async def grpc_turn() -> None:
        turn = pb.TurnRequest(session_id=f"g{next(n)}", text=QUERY, is_final=True)
        _expect(bool((await stub.Turn(turn)).chunks), b"a Turn found nothing")

    async def http_tool() -> None:
        status, _, body = await tools.post("/tools/knowledge_search", tool_body)
        _expect(status == 200 and b'"results":[{' in body, body)

    async def mcp_call() -> None:
        status, _, body = await mcp.post("/mcp", mcp_body, mcp_headers)
        _expect(status == 200 and b'"isError":false' in body, body)

    async def vapi_request() -> None:
        message = {"type": "knowledge-base-request", "call": {"id": f"v{next(n)}"},
                   "messages": [{"role": "user", "content": QUERY}]}  # fmt: skip
        status, _, body = await vapi.post(
            "/vapi/knowledge-base", orjson.dumps({"message": message})
        )
        _expect(status == 200 and b'"documents":[{' in body, body)

    def close() -> None:
        for client in (tools, mcp, vapi):
            client.close()

    rows = {"grpc InvokeTool": grpc_tool, "http /tools": http_tool, "mcp tools/call": mcp_call,
            "grpc Turn": grpc_turn, "vapi": vapi_request}  # fmt: skip
    return rows, close


async def _latencies(rows: dict[str, Call], rounds: int) -> dict[str, dict[str, float]]:
    """Each row once a round, in a shuffled order, so drift on the machine hits all alike."""
    samples: dict[str, list[int]] = {name: [] for name in rows}
    rng = random.Random(7)
    order = list(rows)
    for _ in range(rounds):
        rng.shuffle(order)
        for name in order:
            started = time.perf_counter_ns()
            await rows[name]()
            samples[name].append(time.perf_counter_ns() - started)
    return {name: percentiles_ms(np.array(s, dtype=np.int64)) for name, s in samples.items()}


async def _throughput(make: Callable[[], Awaitable[Call]], calls: int) -> float:
    """Calls per second with CONCURRENCY clients, each on its own connection."""
    clients = [await make() for _ in range(CONCURRENCY)]
    per = calls // CONCURRENCY

    async def loop(call: Call) -> None:
        for _ in range(per):
            await call()

    started = time.perf_counter()
    await asyncio.gather(*(loop(c) for c in clients))
    return round(per * CONCURRENCY / (time.perf_counter() - started), 1)


async def _measure(grpc_port: int, http_port: int, rounds: int) -> dict[str, Any]:
    rows, close = await _calls(grpc_port, http_port)
    try:
        for call in rows.values():  # warm: connections, the query vector, the caches
            for _ in range(20):
                await call()
        latency = await _latencies(rows, rounds)
    finally:
        close()
    closers: list[Callable[[], None]] = []

    def maker(name: str) -> Callable[[], Awaitable[Call]]:
        async def make() -> Call:
            own, close_own = await _calls(grpc_port, http_port)
            closers.append(close_own)
            return own[name]

        return make

    for name in rows:
        latency[name]["throughput_per_s"] = await _throughput(maker(name), rounds * 2)
    for close_own in closers:
        close_own()
    return latency


def _start(root: Path) -> tuple[subprocess.Popen[bytes], int, int]:
    grpc_port, http_port = free_port(), free_port()
    store = root / "store"
    config = root / "voxrecall.toml"
    config.write_text(
        CONFIG.format(kb=REPO / "examples" / "kb", store=store, grpc=grpc_port, http=http_port)
    )
    loaded = load_config(config)
    build_knowledge_base(loaded, loaded.knowledge_bases[0], LocalEmbedder())
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    proc = subprocess.Popen(
        [sys.executable, "-m", "sidecar.cli", "serve", "--config", str(config)],
        cwd=REPO, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    deadline = time.monotonic() + START_S
    while not _ready(http_port):
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            raise RuntimeError(f"the sidecar did not become ready (exit {proc.poll()})")
        time.sleep(0.1)
    return proc, grpc_port, http_port


def _ready(port: int) -> bool:
    import http.client

    try:
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=1)
        conn.request("GET", "/readyz")
        return conn.getresponse().status == 200
    except OSError:
        return False


def run(quick: bool = False) -> dict[str, Any]:
    rounds = 60 if quick else 1000
    root = Path(tempfile.mkdtemp(prefix="bench-http-"))
    proc, grpc_port, http_port = _start(root)
    try:
        rows = asyncio.run(_measure(grpc_port, http_port, rounds))
    finally:
        proc.terminate()
        proc.wait(30)
        shutil.rmtree(root, ignore_errors=True)
    base = rows["grpc InvokeTool"]["p50_ms"]
    goals = {}
    for name in ("http /tools", "mcp tools/call"):
        added = round(rows[name]["p50_ms"] - base, 4)
        goals[f"{name} p50 added over grpc InvokeTool (ms)"] = {
            "value": added, "goal": f"<= {GOAL_MS}", "met": added <= GOAL_MS}  # fmt: skip
    return {"suite": "http", "rounds": rounds, "concurrency": CONCURRENCY, "query": QUERY,
            "scenarios": rows, "goals": goals}  # fmt: skip
