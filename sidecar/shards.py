"""Which sidecar shard serves a knowledge base: one pure function, used by both sides.

A fleet with thousands of bases splits them over ``shards`` groups of sidecar replicas. Each
replica of shard ``i`` loads only the bases with ``shard_of(base, shards) == i`` (``[sidecar]
shards`` and ``shard``, or ``voxrecall serve --shard I``); an agent's client sends each call to
the shard of its base (``ShardRouter``). Both compute the same function of the base's name, so
nothing else needs to be shared or kept in sync: no registry, no lookup service.

``shard_of`` is jump consistent hashing (Lamping and Veach, 2014) over the first 8 bytes of the
name's sha256: balanced (each shard gets 1/shards of the bases, within sampling noise), stable
across processes, versions and platforms (no Python ``hash``, which is salted per process), and
minimal when the fleet grows: from n to n+1 shards only the ~1/(n+1) of bases that move to the
new shard change place. Shards are numbered 0..n-1, as a StatefulSet numbers its pods; grow or
shrink at the end.

    >>> shard_of("acme-support", 8)
    0
    >>> router = ShardRouter([f"voxrecall-shard-{i}:50051" for i in range(8)])
    >>> client = router.client("acme-support")   # a Voxrecall of shard 0, bound to that base
"""

from __future__ import annotations

import asyncio
import hashlib
from collections.abc import Sequence

from sidecar.adapters.client import Voxrecall
from sidecar.connection import Connection

MAX_SHARDS = 1 << 16  # far past any fleet; keeps a typo (10000000) from passing silently
_JUMP = 2862933555777941757  # the linear congruential step of jump hashing (the paper's constant)
_MASK = (1 << 64) - 1


def shard_of(knowledge_base: str, shards: int) -> int:
    """The shard (0..shards-1) that serves ``knowledge_base``."""
    if not 1 <= shards <= MAX_SHARDS:
        raise ValueError(f"shards must be 1 to {MAX_SHARDS}, got {shards}")
    key = int.from_bytes(hashlib.sha256(knowledge_base.encode("utf-8")).digest()[:8], "big")
    bucket, j = -1, 0
    while j < shards:
        bucket = j
        key = (key * _JUMP + 1) & _MASK
        j = int((bucket + 1) * ((1 << 31) / ((key >> 33) + 1)))
    return bucket


def in_shard(knowledge_bases: frozenset[str], shard: int, shards: int) -> frozenset[str]:
    """The bases of ``knowledge_bases`` that shard ``shard`` of ``shards`` serves."""
    return frozenset(kb for kb in knowledge_bases if shard_of(kb, shards) == shard)


class ShardRouter:
    """Routes each base to its shard's sidecar: one channel per shard, and a ``Voxrecall`` client
    per base over its shard's channel, made on first use and kept (a base costs a small object,
    never a channel: thousands of bases, as many channels as shards). Routing a known base is
    one dict lookup.

    ``connections[i]`` reaches shard ``i`` (a Kubernetes Service per shard:
    ``voxrecall-shard-{i}:50051``, see deploy/README.md).
    """

    def __init__(self, connections: Sequence[Connection | str]) -> None:
        if not connections:
            raise ValueError("a ShardRouter needs one connection per shard, got none")
        self.connections = [c if isinstance(c, Connection) else Connection(c) for c in connections]
        self._shards = [Voxrecall(c) for c in self.connections]  # one channel each, opened on use
        self._clients: dict[str, Voxrecall] = {}

    @property
    def shards(self) -> int:
        return len(self.connections)

    def connection(self, knowledge_base: str) -> Connection:
        """Where ``knowledge_base`` is served."""
        return self.connections[shard_of(knowledge_base, self.shards)]

    def client(self, knowledge_base: str) -> Voxrecall:
        """The client of ``knowledge_base``'s shard, bound to that base."""
        client = self._clients.get(knowledge_base)
        if client is None:
            shard = self._shards[shard_of(knowledge_base, self.shards)]
            client = self._clients[knowledge_base] = shard.for_base(knowledge_base)
        return client

    async def close(self) -> None:
        """Close every shard's channel (each is tried, whichever fails)."""
        self._clients = {}
        results = await asyncio.gather(
            *(shard.close() for shard in self._shards), return_exceptions=True
        )
        for result in results:
            if isinstance(result, BaseException):
                raise result
