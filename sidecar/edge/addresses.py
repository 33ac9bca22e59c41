"""Whose share a client address counts against: one host, as a network hands hosts out.

A per-address share (HTTP connections, MCP sessions without auth, health watches) is only a
bound if one client cannot speak from as many addresses as it likes. An IPv4 client has one
address; an IPv6 client is routinely given a whole /64 (SLAAC, privacy addresses, a container
host's range) and can open each connection from another address in it, so an IPv6 address
counts against its /64. An IPv4 host carried in IPv6 form (``::ffff:10.0.0.7`` from a
dual-stack socket, NAT64's ``64:ff9b::a00:7``, Teredo, 6to4) is that IPv4 address, so clients
behind one translator are not one. Anything else (a unix socket, a name) counts as itself.
"""

from __future__ import annotations

import ipaddress
from urllib.parse import unquote

# The prefix one IPv6 host may be given whole (RFC 4291's interface identifier: 64 bits).
IPV6_HOST_PREFIX = 64


def share_key(host: str) -> str:
    """The key ``host``'s share is counted under: an IPv4 address as it is, an IPv6 address as
    its /64 (``2001:db8:0:1::/64``), anything that is not an address unchanged."""
    address = _address(host)
    return host if address is None else _key(address)


def _address(host: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address | None:
    """``host`` (brackets and an IPv6 zone allowed) as an address, or None when it is not one."""
    try:
        return ipaddress.ip_address(host.strip("[]").partition("%")[0])
    except ValueError:
        return None


def _key(address: ipaddress.IPv4Address | ipaddress.IPv6Address) -> str:
    if isinstance(address, ipaddress.IPv6Address):
        return _ipv6_key(address)
    return str(address)


def _ipv6_key(address: ipaddress.IPv6Address) -> str:
    """An IPv6 address's share key: the IPv4 host it carries (IPv4-mapped, NAT64's well-known
    prefix, Teredo's client, 6to4), else its /64."""
    carried = address.ipv4_mapped or _nat64(address) or address.sixtofour
    if address.teredo is not None:
        carried = address.teredo[1]
    if carried is not None:
        return str(carried)
    return str(ipaddress.IPv6Network((address, IPV6_HOST_PREFIX), strict=False))


_NAT64 = ipaddress.IPv6Network("64:ff9b::/96")  # RFC 6052's well-known prefix


def _nat64(address: ipaddress.IPv6Address) -> ipaddress.IPv4Address | None:
    """The IPv4 client a NAT64 gateway translated into ``address``, if it did."""
    if address not in _NAT64:
        return None
    return ipaddress.IPv4Address(int(address) & 0xFFFFFFFF)


def peer_key(peer: str) -> str:
    """``share_key`` of a call's peer as either door gives it: gRPC's ``ipv4:10.0.0.7:51234``
    -> ``10.0.0.7`` and ``ipv6:%5B2001:db8::1%5D:51234`` (grpc percent-encodes the brackets)
    -> ``2001:db8::/64``, the HTTP door's ``10.0.0.7:51234`` or ``::1:51234``; a unix socket's
    and an empty one as they are."""
    if peer.startswith(("unix:", "unix-abstract:")) or ":" not in peer:
        return peer
    return share_key(_host(peer))


def load_requester(peer: str) -> str:
    """Whose turn a lazy load is queued under (``Refresher.want``), from a call's peer (gRPC's
    ``ipv4:10.0.0.7:51234``, the HTTP door's ``10.0.0.7:51234``): a remote client's host
    (``share_key``), so its share of the loads is not its count of connections; on the
    loopback, where a sidecar's own agents run as several processes of one host, the
    connection itself (each agent process its own share), as for anything not an address."""
    address = _address(_host(peer))
    if address is None:
        return peer
    mapped = getattr(address, "ipv4_mapped", None)
    return peer if (mapped or address).is_loopback else _key(address)


def _host(peer: str) -> str:
    """The host of a call's peer as either door gives it: the part before its port."""
    if peer.startswith(("ipv4:", "ipv6:")):
        peer = unquote(peer).partition(":")[2]
    return peer.rpartition(":")[0]
