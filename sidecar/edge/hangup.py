"""Closing a gRPC client's connection from outside gRPC: the one way to free what gRPC holds for
a client that stays connected and never reads.

grpc.aio gives a servicer no way to end a call once its handler has returned: a unary answer,
or a stream's last writes, wait in gRPC's core until the client's flow-control window lets them
out, whatever becomes of the handler's task (cancelling it ends the Python side only: the stream
stayed open, and its answer was still sent once the client opened its window). So a client that
never read kept every answer it had asked for in memory, while the call limits gave its slots
back after ``stream_idle_s`` and it asked again. ``Hangups`` finds the sockets of such clients'
connections among this process's descriptors (Linux's ``/proc/self/fd``: the socket accepted on
one of the gRPC server's ports whose peer is the call's) and shuts them down: gRPC's core sees
each connection closed and frees every call on it, as when a client goes. Elsewhere (not Linux,
a unix-socket listener, whose peers cannot be told apart) nothing is closed, and such answers
stay until their clients read them or go.
"""

from __future__ import annotations

import asyncio
import ipaddress
import logging
import os
import socket
from collections.abc import Collection, Iterable
from concurrent.futures import ThreadPoolExecutor
from urllib.parse import unquote

log = logging.getLogger("voxrecall.hangup")

FDS = "/proc/self/fd"
Endpoint = tuple[ipaddress.IPv4Address | ipaddress.IPv6Address, int]


def endpoint(peer: str) -> Endpoint | None:
    """gRPC's ``ipv4:10.0.0.7:51234`` or ``ipv6:%5B::1%5D:51234`` as (address, port); None
    for anything else (a unix socket has no peer to tell its connections apart)."""
    if not peer.startswith(("ipv4:", "ipv6:")):
        return None
    host, _, port = unquote(peer).partition(":")[2].rpartition(":")
    try:
        return _address(host.strip("[]")), int(port)
    except ValueError:
        return None


def _address(host: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address:
    """``host`` as an address, an IPv4-mapped one as its IPv4 address (a dual-stack socket's
    peer ``::ffff:10.0.0.7`` is gRPC's ``ipv4:10.0.0.7``)."""
    address = ipaddress.ip_address(host.partition("%")[0])
    mapped = getattr(address, "ipv4_mapped", None)
    return mapped or address


def hang_up(peers: Collection[str], ports: Collection[int]) -> int:
    """Shut down this process's TCP sockets accepted on one of ``ports`` whose peers are
    ``peers`` (calls' ``context.peer()``); how many (0 where ``/proc/self/fd`` cannot be read).
    It reads every descriptor's link: run it off the event loop."""
    wanted = {e for e in map(endpoint, peers) if e is not None}
    if not wanted or not ports:
        return 0
    try:
        names = os.listdir(FDS)
    except OSError:
        return 0
    return sum(_shut_down_if(int(name), wanted, ports) for name in names)


def _shut_down_if(fd: int, wanted: set[Endpoint], ports: Collection[int]) -> bool:
    """Shut down socket ``fd`` if it is one of ``wanted``'s connections to ``ports`` (through a
    duplicate: the descriptor stays gRPC's, which closes it as the connection ends)."""
    try:
        if not os.readlink(f"{FDS}/{fd}").startswith("socket:"):
            return False
        sock = socket.socket(fileno=os.dup(fd))
    except OSError:  # closed meanwhile, or not ours to read
        return False
    with sock:
        if sock.family not in (socket.AF_INET, socket.AF_INET6) or sock.type != socket.SOCK_STREAM:
            return False
        try:
            host, port = sock.getpeername()[:2]
            if sock.getsockname()[1] not in ports:  # one of ours to a server, or another door's
                return False
        except OSError:  # a listening socket, or one not connected
            return False
        if (_address(host), port) not in wanted:
            return False
        sock.shutdown(socket.SHUT_RDWR)
        return True


class Hangups:
    """The connections to close, closed by one scan at a time on a thread of its own (a scan
    reads every descriptor: ~90 ms at 5,000 sockets), the peers asked for meanwhile joining the
    next one; a line a scan. ``ports``: the gRPC server's, set once it is bound."""

    def __init__(self) -> None:
        self.ports: frozenset[int] = frozenset()
        self.hung_up = 0  # connections closed so far
        self._pending: set[str] = set()
        self._scanning = False
        self._thread: ThreadPoolExecutor | None = None
        self._closed = False

    def close(self) -> None:
        """No more scans (the server has stopped): the thread goes once its scan, if any, ends."""
        self._closed = True
        if self._thread is not None:
            self._thread.shutdown(wait=False, cancel_futures=True)
            self._thread = None

    def soon(self, peers: Iterable[str]) -> None:
        """Close the connections of ``peers`` (calls' ``context.peer()``) soon."""
        if self._closed:
            return
        self._pending.update(peers)
        if self._pending and not self._scanning:
            self._scan()

    def _scan(self) -> None:
        peers, self._pending = self._pending, set()
        if self._thread is None:
            self._thread = ThreadPoolExecutor(1, thread_name_prefix="voxrecall-hangup")
        self._scanning = True
        loop = asyncio.get_running_loop()
        future = loop.run_in_executor(self._thread, hang_up, peers, self.ports)
        future.add_done_callback(lambda done: self._scanned(done, len(peers)))

    def _scanned(self, done: asyncio.Future[int], asked: int) -> None:
        self._scanning = False
        if not done.cancelled() and (exc := done.exception()) is not None:
            log.warning("could not close the connections of clients that do not read: %s", exc)
        elif not done.cancelled():
            self.hung_up += done.result()
            log.info("closed %d of %d connections: their clients do not read", done.result(), asked)
        if self._pending and not self._closed:
            self._scan()
