"""TLS and mutual TLS from the PEM files ``[sidecar.tls]`` names, and the loopback check.

A sidecar talks to its own pod over 127.0.0.1 in the clear; listening anywhere wider should be
TLS (``cert_file``, ``key_file``), and with ``client_ca_file`` mutual TLS: a client without a
certificate signed by that CA cannot even complete the handshake.
"""

from __future__ import annotations

import ipaddress
import logging
from pathlib import Path

import grpc

from index.errors import ConfigError
from sidecar.config import TlsConfig

log = logging.getLogger("voxrecall.tls")


def read_pem(path: Path, what: str) -> bytes:
    """A PEM file's bytes, or a ConfigError naming ``what`` (the key or flag that gave it)."""
    try:
        data = path.read_bytes()
    except OSError as exc:
        raise ConfigError(f"{what} {path}: {exc.strerror or exc}") from exc
    if b"-----BEGIN" not in data:
        raise ConfigError(f"{what} {path} is not a PEM file")
    return data


def server_credentials(tls: TlsConfig) -> grpc.ServerCredentials:
    """The server's credentials; files are read now, so a bad one stops the start."""
    if tls.cert_file is None or tls.key_file is None:
        raise ConfigError("[sidecar.tls] cert_file and key_file are both needed for TLS")
    cert = read_pem(tls.cert_file, "[sidecar.tls] cert_file")
    key = read_pem(tls.key_file, "[sidecar.tls] key_file")
    ca = (
        read_pem(tls.client_ca_file, "[sidecar.tls] client_ca_file") if tls.client_ca_file else None
    )
    return grpc.ssl_server_credentials(
        [(key, cert)], root_certificates=ca, require_client_auth=ca is not None
    )


def is_loopback(listen: str) -> bool:
    """Whether ``host:port`` only accepts connections from this machine."""
    host = listen.rpartition(":")[0].strip("[]")
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False  # a name, or an empty host (every interface)


def add_port(server: grpc.aio.Server, listen: str, tls: TlsConfig) -> int:
    """Bind ``listen`` with TLS when configured; the bound port (``listen`` may say 0)."""
    if tls.enabled:
        port = server.add_secure_port(listen, server_credentials(tls))
    else:
        if not is_loopback(listen):
            log.warning(
                "listening on %s without TLS: anyone who can reach it can read the traffic; "
                "set [sidecar.tls] cert_file and key_file",
                listen,
            )
        port = server.add_insecure_port(listen)
    if port == 0:
        raise OSError(f"cannot listen on {listen}")
    return port
