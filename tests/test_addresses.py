"""Whose share an address counts against: an IPv6 client's whole /64, an IPv4 address alone."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from sidecar.edge.addresses import peer_key, share_key
from sidecar.errors import ResourceExhausted
from sidecar.http.door import _address_of
from sidecar.http.mcp import SessionShares


@pytest.mark.parametrize(
    ("host", "key"),
    [
        ("10.0.0.7", "10.0.0.7"),
        ("2001:db8:0:1::7", "2001:db8:0:1::/64"),
        ("2001:db8:0:1:ffff:ffff:ffff:ffff", "2001:db8:0:1::/64"),
        ("[2001:db8:0:1::7]", "2001:db8:0:1::/64"),
        ("fe80::1%eth0", "fe80::/64"),  # a link-local peer picks its own: its /64
        ("64:ff9b::a00:7", "10.0.0.7"),  # NAT64's well-known prefix: the IPv4 client
        ("64:ff9b::a00:8", "10.0.0.8"),
        ("2002:a00:7::1", "10.0.0.7"),  # 6to4
        ("2001:0:4136:e378:8000:63bf:f5ff:fff8", "10.0.0.7"),  # Teredo: the client's IPv4
        ("::ffff:10.0.0.7", "10.0.0.7"),
        ("::1", "::/64"),
        ("", ""),
        ("localhost", "localhost"),
    ],
)
def test_an_address_counts_against_its_host_s_share(host: str, key: str) -> None:
    assert share_key(host) == key


def test_two_ipv6_addresses_of_one_64_are_one_share_and_of_two_are_two() -> None:
    assert share_key("2001:db8:0:1::a") == share_key("2001:db8:0:1:1234::b")
    assert share_key("2001:db8:0:1::a") != share_key("2001:db8:0:2::a")
    assert share_key("10.0.0.7") != share_key("10.0.0.8")


@pytest.mark.parametrize(
    ("peer", "key"),
    [
        ("ipv4:10.0.0.7:51234", "10.0.0.7"),
        ("ipv6:%5B2001:db8:0:1::7%5D:51234", "2001:db8:0:1::/64"),  # as grpc writes it
        ("ipv6:[2001:db8:0:1::7]:51234", "2001:db8:0:1::/64"),
        ("ipv6:%5B::ffff:10.0.0.7%5D:51234", "10.0.0.7"),
        ("unix:/run/sock", "unix:/run/sock"),
        ("", ""),
    ],
)
def test_a_grpc_peer_counts_against_its_host_s_share(peer: str, key: str) -> None:
    assert peer_key(peer) == key


class _Transport(asyncio.Transport):
    def __init__(self, peername: Any) -> None:
        super().__init__()
        self._peername = peername

    def get_extra_info(self, name: str, default: Any = None) -> Any:
        return self._peername if name == "peername" else default


def test_the_http_door_counts_a_connection_under_its_host_s_share() -> None:
    """Connections from other addresses of one /64 fill one ``max_connections_per_ip``."""
    assert _address_of(_Transport(("2001:db8:0:1::a", 443, 0, 0))) == "2001:db8:0:1::/64"
    assert _address_of(_Transport(("10.0.0.7", 443))) == "10.0.0.7"
    assert _address_of(_Transport(None)) == ""


def test_mcp_sessions_from_one_64_share_one_address_s_share() -> None:
    shares = SessionShares({}, per_address=2)
    shares.take(share_key("2001:db8:0:1::a"))
    shares.take(share_key("2001:db8:0:1::b"))
    with pytest.raises(ResourceExhausted, match="address 2001:db8:0:1::/64"):
        shares.take(share_key("2001:db8:0:1::c"))
    shares.take(share_key("2001:db8:0:2::a"))  # another host's /64 has its own share
