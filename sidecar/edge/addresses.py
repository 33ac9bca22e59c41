"""Whose share a client address counts against: one host, as a network hands hosts out.

A per-address share (HTTP connections, MCP sessions without auth, health watches) is only a
bound if one client cannot speak from as many addresses as it likes. An IPv4 client has one
address; an IPv6 client is routinely given a whole /64 (SLAAC, privacy addresses, a container
host's range) and can open each connection from another address in it, so an IPv6 address
counts against its /64. An IPv4 address in IPv6 form (``::ffff:10.0.0.7``, from a dual-stack
socket) is that IPv4 address. Anything else (a unix socket, a name) counts as itself.
"""

from __future__ import annotations

import ipaddress
from urllib.parse import unquote

# The prefix one IPv6 host may be given whole (RFC 4291's interface identifier: 64 bits).
IPV6_HOST_PREFIX = 64


def share_key(host: str) -> str:
    """The key ``host``'s share is counted under: an IPv4 address as it is, an IPv6 address as
    its /64 (``2001:db8:0:1::/64``), anything that is not an address unchanged."""
    try:
        address = ipaddress.ip_address(host.strip("[]").partition("%")[0])
    except ValueError:
        return host
    if isinstance(address, ipaddress.IPv6Address):
        if address.ipv4_mapped is not None:
            return str(address.ipv4_mapped)
        network = ipaddress.IPv6Network((address, IPV6_HOST_PREFIX), strict=False)
        return str(network)
    return str(address)


def grpc_peer_key(peer: str) -> str:
    """``share_key`` of a gRPC peer string: ``ipv4:10.0.0.7:51234`` -> ``10.0.0.7``,
    ``ipv6:%5B2001:db8::1%5D:51234`` (grpc percent-encodes the brackets) -> ``2001:db8::/64``;
    anything else (``unix:...``) as it is."""
    kind, _, address = unquote(peer).partition(":")
    if kind in ("ipv4", "ipv6"):
        return share_key(address.rpartition(":")[0])
    return peer
