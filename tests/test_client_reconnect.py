"""An agent whose channel tried to connect before its sidecar listened connects within seconds
of the sidecar serving (``sidecar.connection``'s reconnect backoff, at most 2 s), not after
gRPC's default backoff (1 s growing 1.6x a try to 120 s: minutes, for a pod whose agent and
sidecar start together).

Real parts: the project's client over a real channel; a real socket on 127.0.0.1 that accepts
each connection and closes it at once (a port where nothing serves gRPC yet, which counts the
client's tries), then a real sidecar on that same port over a real local store.
"""

from __future__ import annotations

import asyncio
import contextlib
from pathlib import Path

import grpc

from index.embedders.base import HashEmbedder
from sidecar.adapters.client import Voxrecall
from sidecar.edge.server import create_server
from tests.bases_kit import config, search
from tests.snapshot_kit import version_id, write_version

EMBEDDER = HashEmbedder(dimension=64)
# After its 8th failed try, gRPC's default backoff waits 1 s x 1.6^7 (+-20%): at least 21 s,
# and its 8 tries take at least 34 s; the bounded one waits at most 2.4 s, its 8 take about 5 s.
TRIES = 8
TRIES_WITHIN_S = 30.0
SERVED_WITHIN_S = 15.0


class Refuser:
    """A port that takes each connection and closes it unanswered, counting them."""

    def __init__(self, tries: int) -> None:
        self.tries = 0
        self.enough = asyncio.Event()
        self._wanted = tries

    async def refuse(self, _reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.tries += 1
        writer.close()
        if self.tries >= self._wanted:
            self.enough.set()


async def fail_until_tried(client: Voxrecall, refuser: Refuser) -> list[grpc.StatusCode]:
    """The agent's calls while nothing serves (each refused at once); until the channel has
    tried ``TRIES`` times, or ``TRIES_WITHIN_S`` have passed."""
    loop = asyncio.get_running_loop()
    give_up = loop.time() + TRIES_WITHIN_S
    refused: list[grpc.StatusCode] = []
    while not refuser.enough.is_set() and loop.time() < give_up:
        try:
            await client.search("reset my password")
        except grpc.aio.AioRpcError as exc:
            refused.append(exc.code())
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(refuser.enough.wait(), timeout=1.0)
    return refused


async def test_an_agent_started_before_its_sidecar_connects_soon_after_it_serves(
    tmp_path: Path,
) -> None:
    """It waited out gRPC's default backoff: after 8 refused tries, at least 21 s more."""
    refuser = Refuser(TRIES)
    listener = await asyncio.start_server(refuser.refuse, "127.0.0.1", 0)
    port = listener.sockets[0].getsockname()[1]
    client = Voxrecall(f"127.0.0.1:{port}", knowledge_base="help")
    try:
        refused = await fail_until_tried(client, refuser)
        listener.close()
        await listener.wait_closed()
        assert refuser.tries >= TRIES, (
            f"the channel tried to connect {refuser.tries} times in {TRIES_WITHIN_S} s: "
            "its backoff grows as gRPC's default"
        )
        assert set(refused) == {grpc.StatusCode.UNAVAILABLE}  # each call, at once

        store = tmp_path / "store"
        write_version(store, version_id(1), EMBEDDER, "password", kb="help")
        cfg = config(store, tmp_path, cache_dir=str(tmp_path / "cache"))
        sidecar = await create_server(
            cfg, embedder=EMBEDDER, poll=False, listen=f"127.0.0.1:{port}"
        )
        try:
            found = await client.stub.Search(
                search("help"), timeout=SERVED_WITHIN_S, wait_for_ready=True
            )
        finally:
            await sidecar.stop(0.5)
    finally:
        await client.close()
    assert found.chunks
