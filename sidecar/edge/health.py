"""``grpc.health.v1.Health``, bounded: what grpcio's reference servicer answers, for a caller
that may be hostile.

Health is exempt from auth and from the call limits (``sidecar.edge.interceptor``): a kubelet or
grpc-health-probe checking a busy sidecar must see SERVING, not RESOURCE_EXHAUSTED. So it bounds
what a caller can hold itself, each kind of call in total and per client address (its host,
whatever the port; an IPv6 client's /64), one more RESOURCE_EXHAUSTED saying which limit:

- a ``Check`` is counted until gRPC is done with it, its answer sent: one whose client never
  reads it (a flow-control window left shut, PINGs answered) is held in gRPC's memory, ~22-25 KB
  (20,000 of them took 441 MiB), until the client reads or goes. At most ``MAX_CHECKS`` are
  held (1,024 took 25 MiB) and ``MAX_CHECKS_PER_PEER`` from one address (~1.6 MiB), so a probe
  from any other address is still answered; a Check that is read is counted for a moment only;
- ``Watch`` holds a stream for as long as the client likes: at most ``MAX_WATCHES`` are open
  (~25 MB) and ``MAX_WATCHES_PER_PEER`` from one address;
- a full table of either still takes an address that holds none: the oldest call of the
  address holding the most is ended to make room (``Held``; a watch RESOURCE_EXHAUSTED, saying
  so), so however many addresses hold the rest, a probe from another is answered (16 addresses
  holding their 64 unread Checks each took every slot, and a kubelet's probe was refused). A
  Check ended so has its connection closed too, which alone frees the answer gRPC holds for a
  client that does not read (``sidecar.edge.hangup``: every call on that connection ends); a
  watch is only ended;
- a call's metadata is held to ``MAX_METADATA_BYTES`` (``sidecar.edge.limits``), as the hooks
  hold every other call's: gRPC's core does not hold a connection's first stream to it;
- only the names the sidecar reports on (``""`` and ``voxrecall.v1.Retrieval``) can be asked
  for; any other is NOT_FOUND at once (grpcio's servicer kept a stream, and the name, for each
  watch: 20,000 watches took 490 MB, 300 naming a 3 MB service 2.9 GB);
- a name over ``MAX_SERVICE_BYTES`` bytes of UTF-8 is INVALID_ARGUMENT before it is looked up.

A change wakes every watcher through one event, and none holds a lock while it writes, so a
watcher that never reads delays no other (grpcio's servicer dropped a name's condition when any
one of its watchers left, and the others then never heard of a change).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from sidecar.edge.addresses import peer_key
from sidecar.edge.hangup import Hangups
from sidecar.edge.interceptor import metadata_of
from sidecar.edge.limits import check_metadata
from sidecar.errors import InvalidArgument

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
# A Check whose answer is left unread costs ~22-25 KB (the call in grpc's core, its answer and
# task) until its client reads or goes: 1,024 of them took 25 MiB. A Check that is read is done
# within a moment, so even a busy prober has a few at once; one address's share is as generous
# as Watch's.
MAX_CHECKS = 1024
MAX_CHECKS_PER_PEER = 64


class Refused(Exception):
    """A call one more of which would pass a limit: why, in words a caller can act on."""


@dataclass(eq=False, slots=True)
class Hold:
    """One call held: its client address (``peer_key``), and what ends it."""

    peer: str
    end: Callable[[], object]
    ended: bool = False  # ended to make room for another address's (``Held._end_oldest``)


class Held:
    """The calls of one kind held at once, capped in total and per client address
    (``peer_key``). A full table still takes an address that holds none: the oldest call of
    the address holding the most is ended for it, so a probe from a new address is answered
    however many addresses hold the rest; an address that holds some is refused."""

    def __init__(self, what: str, limit: int, per_peer: int, advice: str) -> None:
        self.what = what  # "health watches are open": how a refusal counts them
        self.limit = limit
        self.per_peer = per_peer
        self.advice = advice  # what a refused caller can do
        self.total = 0
        self.calls: dict[str, dict[Hold, None]] = {}  # by address, oldest first
        self.ended = 0  # calls ended to make room (``_end_oldest``)

    @property
    def by_peer(self) -> dict[str, int]:
        return {peer: len(calls) for peer, calls in self.calls.items()}

    def take(self, peer: str, end: Callable[[], object]) -> Hold:
        """One more held for ``peer`` (given back by ``give``), or ``Refused`` saying which
        limit it is over (and nothing is taken)."""
        held = len(self.calls.get(peer, ()))
        if held >= self.per_peer:
            raise Refused(
                f"{held} {self.what} from {peer}, the limit for one address is "
                f"{self.per_peer}: {self.advice}"
            )
        if self.total >= self.limit:
            if held:
                raise Refused(f"{self.total} {self.what}, the limit is {self.limit}: {self.advice}")
            self._end_oldest()
        hold = Hold(peer, end)
        self.calls.setdefault(peer, {})[hold] = None
        self.total += 1
        return hold

    def give(self, hold: Hold) -> None:
        """``hold`` given back; nothing for one already ended to make room (``_end_oldest``)."""
        calls = self.calls.get(hold.peer)
        if calls is None or hold not in calls:
            return
        del calls[hold]
        if not calls:
            del self.calls[hold.peer]
        self.total -= 1

    def _end_oldest(self) -> None:
        """End the oldest call of the address that holds the most, counted given at once."""
        most = max(self.calls.values(), key=len)
        oldest = next(iter(most))
        self.give(oldest)
        self.ended += 1
        oldest.ended = True
        oldest.end()


class Health(health_pb2_grpc.HealthServicer):  # type: ignore[misc]
    """The sidecar's health service: ``set`` a name's status, ``enter_graceful_shutdown`` on a
    drain (every name NOT_SERVING from then on), ``Check`` and a bounded ``Watch``."""

    def __init__(self, hangups: Hangups | None = None) -> None:
        # the connections of clients that read nothing closed (the server's ports set once bound)
        self.hangups = Hangups() if hangups is None else hangups
        self.statuses: dict[str, Status] = {"": health_pb2.HealthCheckResponse.SERVING}
        self.checks = Held(
            "health check answers are unread",
            MAX_CHECKS,
            MAX_CHECKS_PER_PEER,
            "read those before checking again",
        )
        self.watches = Held(
            "health watches are open", MAX_WATCHES, MAX_WATCHES_PER_PEER, "close one, or use Check"
        )
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
        """The name's status; the call counted (``checks``) until gRPC is done with it, its
        answer read or its client gone."""
        status = await self._status(request, context)
        checks = self.checks
        hold = await self._take(checks, context)
        # (grpc-stubs type the callback as a class of its own, not a callable)
        context.add_done_callback(lambda _: checks.give(hold))  # type: ignore[arg-type]
        return health_pb2.HealthCheckResponse(status=status)

    async def Watch(self, request: health_pb2.HealthCheckRequest, context: Context) -> None:
        """The name's status now, then each time it changes, until the client goes."""
        status = await self._status(request, context)
        hold = await self._take(self.watches, context)
        try:
            await context.write(health_pb2.HealthCheckResponse(status=status))
            while True:
                changed = self._changed  # read before the status: no change is missed
                if self.statuses[request.service] == status:
                    await changed.wait()
                    continue
                status = self.statuses[request.service]
                await context.write(health_pb2.HealthCheckResponse(status=status))
        except asyncio.CancelledError:
            if hold.ended:  # said, where a bare cancel would answer CANCELLED, as a client's own
                await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, self._made_room())
            raise
        finally:
            self.watches.give(hold)

    def _made_room(self) -> str:
        watches = self.watches
        return (
            f"this health watch was ended to make room for one from another address: at most "
            f"{watches.limit} are open, and this address held the most; watch again, or use Check"
        )

    async def _status(self, request: health_pb2.HealthCheckRequest, context: Context) -> Status:
        """The status of the name asked for, or the call aborted saying why it has none."""
        try:  # (health is not hooked: its metadata is counted here)
            check_metadata(metadata_of(context))
        except InvalidArgument as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
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

    async def _take(self, held: Held, context: Context) -> Hold:
        """One more of ``held`` for the call's client address, or the call aborted
        RESOURCE_EXHAUSTED saying which limit it is over."""
        peer = context.peer() or ""
        hangups = self.hangups if held is self.checks else None
        try:
            return held.take(peer_key(peer), _ender(peer, hangups))
        except Refused as exc:
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, str(exc))
            raise AssertionError("unreachable: abort raises") from exc


def _ender(peer: str, hangups: Hangups | None) -> Callable[[], None]:
    """What ends the call at hand (a Check or Watch held, from ``peer``) to make room: its
    task cancelled; a Check's connection closed too (``hangups``), as a held Check is one whose
    answer its client has not read (a read one is done within a moment), and only a closed
    connection frees it (``sidecar.edge.hangup``). A Watch is held open, read or not: it is only
    ended, and a client that reads keeps its connection."""
    task = asyncio.current_task()

    def end() -> None:
        if task is not None:
            task.cancel()
        if hangups is not None:
            hangups.soon((peer,))

    return end
