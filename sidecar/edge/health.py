"""``grpc.health.v1.Health``, bounded: what grpcio's reference servicer answers, for a caller
that may be hostile.

Health is exempt from auth and from the call limits (``sidecar.edge.interceptor``): a kubelet or
grpc-health-probe checking a busy sidecar must see SERVING, not RESOURCE_EXHAUSTED. ``Check`` is
one small answer and stays so. ``Watch`` holds a stream for as long as the client likes, so it
is bounded here instead:

- only the names the sidecar reports on (``""`` and ``voxrecall.v1.Retrieval``) can be watched;
  any other is NOT_FOUND at once (grpcio's servicer kept a stream, and the name, for each:
  20,000 watches took 490 MB, 300 naming a 3 MB service 2.9 GB);
- a name over ``MAX_SERVICE_BYTES`` bytes of UTF-8 is INVALID_ARGUMENT before it is looked up;
- at most ``MAX_WATCHES`` watches are open at once, and ``MAX_WATCHES_PER_PEER`` from one client
  address (its host, whatever the port): one more is RESOURCE_EXHAUSTED saying which.

A change wakes every watcher through one event, and none holds a lock while it writes, so a
watcher that never reads delays no other (grpcio's servicer dropped a name's condition when any
one of its watchers left, and the others then never heard of a change).
"""

from __future__ import annotations

import asyncio
from typing import Any

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from sidecar.edge.addresses import peer_key

Status = int  # a HealthCheckResponse.ServingStatus value
Context = grpc.aio.ServicerContext[Any, Any]

# A service name is a protobuf full name ("voxrecall.v1.Retrieval"); anything this long is not one.
MAX_SERVICE_BYTES = 256
# A watch costs ~25 KB (a stream in grpc's core, its task and buffers): 1,024 of them ~25 MB. A
# client with health checking on watches once per connection; an agent process has a handful.
MAX_WATCHES = 1024
# One address's share, so one host cannot take every watch; generous, as callers behind one
# proxy or node address share it.
MAX_WATCHES_PER_PEER = 64


class Health(health_pb2_grpc.HealthServicer):  # type: ignore[misc]
    """The sidecar's health service: ``set`` a name's status, ``enter_graceful_shutdown`` on a
    drain (every name NOT_SERVING from then on), ``Check`` and a bounded ``Watch``."""

    def __init__(
        self, max_watches: int = MAX_WATCHES, max_per_peer: int = MAX_WATCHES_PER_PEER
    ) -> None:
        self.statuses: dict[str, Status] = {"": health_pb2.HealthCheckResponse.SERVING}
        self.max_watches = max_watches
        self.max_per_peer = max_per_peer
        self.watching = 0
        self.by_peer: dict[str, int] = {}
        self._changed = asyncio.Event()  # set, and replaced, on every change
        self._shutting_down = False

    async def set(self, service: str, status: Status) -> None:
        """The status of ``service`` (a name that can be watched from now on); ignored once the
        sidecar drains."""
        if not self._shutting_down:
            await self._set(service, status)

    async def enter_graceful_shutdown(self) -> None:
        """Every name NOT_SERVING for good: later ``set`` calls are ignored."""
        self._shutting_down = True
        for service in list(self.statuses):
            await self._set(service, health_pb2.HealthCheckResponse.NOT_SERVING)

    async def _set(self, service: str, status: Status) -> None:
        self.statuses[service] = status
        changed, self._changed = self._changed, asyncio.Event()
        changed.set()

    async def Check(
        self, request: health_pb2.HealthCheckRequest, context: Context
    ) -> health_pb2.HealthCheckResponse:
        return health_pb2.HealthCheckResponse(status=await self._status(request, context))

    async def Watch(self, request: health_pb2.HealthCheckRequest, context: Context) -> None:
        """The name's status now, then each time it changes, until the client goes."""
        status = await self._status(request, context)
        peer = peer_key(context.peer() or "")
        await self._take(peer, context)
        try:
            await context.write(health_pb2.HealthCheckResponse(status=status))
            while True:
                changed = self._changed  # read before the status: no change is missed
                if self.statuses[request.service] == status:
                    await changed.wait()
                    continue
                status = self.statuses[request.service]
                await context.write(health_pb2.HealthCheckResponse(status=status))
        finally:
            self._give(peer)

    async def _status(self, request: health_pb2.HealthCheckRequest, context: Context) -> Status:
        """The status of the name asked for, or the call aborted saying why it has none."""
        service = request.service
        size = len(service.encode())  # a limit in bytes: a character may be four
        if size > MAX_SERVICE_BYTES:
            await context.abort(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"service is {size} bytes; the limit is {MAX_SERVICE_BYTES}: send a service "
                'name, or "" for the whole sidecar',
            )
        status = self.statuses.get(service)
        if status is None:
            await context.abort(
                grpc.StatusCode.NOT_FOUND,
                f"no health status for service {service[:80]!r}: ask for one of "
                f"{', '.join(map(repr, sorted(self.statuses)))}",
            )
        assert status is not None  # abort raises
        return status

    async def _take(self, peer: str, context: Context) -> None:
        held = self.by_peer.get(peer, 0)
        if held >= self.max_per_peer:
            await context.abort(
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                f"{held} health watches are open from {peer}, the limit for one address is "
                f"{self.max_per_peer}: close one, or use Check",
            )
        if self.watching >= self.max_watches:
            await context.abort(
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                f"{self.watching} health watches are open, the limit is {self.max_watches}: "
                "close one, or use Check",
            )
        self.watching += 1
        self.by_peer[peer] = held + 1

    def _give(self, peer: str) -> None:
        self.watching -= 1
        held = self.by_peer[peer] - 1
        if held:
            self.by_peer[peer] = held
        else:
            del self.by_peer[peer]
