"""Closing a gRPC client's connection from outside gRPC: the one way to free what gRPC holds for
a client that stays connected and never reads.

grpc.aio gives a servicer no way to end a call once its handler has returned: a unary answer,
or a stream's last writes, wait in gRPC's core until the client's flow-control window lets them
out, whatever becomes of the handler's task (cancelling it ends the Python side only: the stream
stayed open, and its answer was still sent once the client opened its window). So a client that
never read kept every answer it had asked for in memory, while the call limits gave its slots
back after ``stream_idle_s`` and it asked again. ``hang_up`` finds the sockets connected to the
calls' peers among this process's descriptors (Linux's ``/proc/self/fd``) and shuts them down:
gRPC's core sees each connection closed and frees every call on it, as when a client goes. Run
it off the event loop (it reads every descriptor's link): ``hang_up_soon``.
"""

from __future__ import annotations

import asyncio
import ipaddress
import logging
import os
import socket
from collections.abc import Collection
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


def hang_up(peers: Collection[str]) -> int:
    """Shut down this process's sockets connected to ``peers`` (calls' ``context.peer()``);
    how many (0 where ``/proc/self/fd`` cannot be read: not Linux)."""
    wanted = {e for e in map(endpoint, peers) if e is not None}
    if not wanted:
        return 0
    try:
        names = os.listdir(FDS)
    except OSError:
        return 0
    return sum(_shut_down_if(int(name), wanted) for name in names)


def _shut_down_if(fd: int, wanted: set[Endpoint]) -> bool:
    """Shut down socket ``fd`` if its peer is one of ``wanted`` (through a duplicate: the
    descriptor stays gRPC's, which closes it as the connection ends)."""
    try:
        if not os.readlink(f"{FDS}/{fd}").startswith("socket:"):
            return False
        sock = socket.socket(fileno=os.dup(fd))
    except OSError:  # closed meanwhile, or not ours to read
        return False
    with sock:
        if sock.family not in (socket.AF_INET, socket.AF_INET6):
            return False
        try:
            host, port = sock.getpeername()[:2]
        except OSError:  # a listening socket, or one not connected
            return False
        if (_address(host), port) not in wanted:
            return False
        sock.shutdown(socket.SHUT_RDWR)
        return True


def hang_up_soon(peers: Collection[str], why: str) -> None:
    """``hang_up`` on a worker thread, logged once done (``why``: what the clients did)."""
    if not peers:
        return
    future = asyncio.get_running_loop().run_in_executor(None, hang_up, tuple(peers))
    future.add_done_callback(lambda done: _logged(done, len(peers), why))


def _logged(done: asyncio.Future[int], asked: int, why: str) -> None:
    if done.cancelled():
        return
    if (exc := done.exception()) is not None:
        log.warning("could not close the connections of clients that %s: %s", why, exc)
        return
    log.info("closed %d of %d connections: their clients %s", done.result(), asked, why)
