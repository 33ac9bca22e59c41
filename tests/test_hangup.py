"""``sidecar.edge.hangup``: a client's connection closed from outside gRPC, by its peer."""

from __future__ import annotations

import asyncio
import ipaddress
import socket

import pytest

from sidecar.edge.hangup import endpoint, hang_up
from tests.conftest import LIVENESS_S, eventually


@pytest.mark.parametrize(
    ("peer", "found"),
    [
        ("ipv4:10.0.0.7:51234", ("10.0.0.7", 51234)),
        ("ipv6:%5B2001:db8::1%5D:443", ("2001:db8::1", 443)),
        ("ipv6:[::ffff:10.0.0.7]:8", ("10.0.0.7", 8)),  # a dual-stack socket's IPv4 client
        ("ipv6:%5Bfe80::1%25eth0%5D:9", ("fe80::1", 9)),
        ("unix:/run/voxrecall.sock", None),
        ("ipv4:not-an-address:1", None),
        ("", None),
    ],
)
def test_a_calls_peer_is_read_as_its_address_and_port(
    peer: str, found: tuple[str, int] | None
) -> None:
    expected = None if found is None else (ipaddress.ip_address(found[0]), found[1])
    assert endpoint(peer) == expected


@pytest.mark.parametrize("family", [socket.AF_INET, socket.AF_INET6])
async def test_the_socket_connected_to_a_peer_is_shut_down_and_no_other(family: int) -> None:
    """A real listener with two clients: the one named loses its connection (it reads the end
    of the stream), the other keeps it; the listener, and the clients' own ends (their peer is
    the listener), are untouched."""
    host = "127.0.0.1" if family == socket.AF_INET else "::1"
    accepted: list[asyncio.StreamWriter] = []

    async def serve(_: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        accepted.append(writer)

    server = await asyncio.start_server(serve, host, 0, family=family)
    port = server.sockets[0].getsockname()[1]
    try:
        named, other = [await asyncio.open_connection(host, port) for _ in range(2)]
        await eventually(lambda: len(accepted) == 2, "both connections accepted")
        local = named[1].get_extra_info("sockname")
        kind = "ipv4" if family == socket.AF_INET else "ipv6"
        peer = (
            f"{kind}:{local[0]}:{local[1]}" if kind == "ipv4" else f"ipv6:[{local[0]}]:{local[1]}"
        )
        # on another port (another door's, or a server of ours) it is not looked for
        assert await asyncio.to_thread(hang_up, [peer], {port + 1}) == 0
        # only the server's end, on its port, has the client for its peer: one socket
        assert await asyncio.to_thread(hang_up, [peer], {port}) == 1
        async with asyncio.timeout(LIVENESS_S):
            assert await named[0].read() == b""  # the server's end shut down: end of stream
        other[1].write(b"still here")
        await other[1].drain()
        assert not other[0].at_eof()
        assert hang_up(["unix:/run/x.sock", "ipv4:192.0.2.1:1"], {port}) == 0
        for _, writer in (named, other):
            writer.close()
    finally:
        for writer in accepted:
            writer.close()
        server.close()
        await server.wait_closed()
