"""TLS and mutual TLS from the PEM files ``[sidecar.tls]`` names (gRPC's credentials, the HTTP
door's context), and the loopback check.

A sidecar talks to its own pod over 127.0.0.1 in the clear; listening anywhere wider should be
TLS (``cert_file``, ``key_file``), and with ``client_ca_file`` mutual TLS: a client without a
certificate signed by that CA cannot even complete the handshake.
"""

from __future__ import annotations

import ipaddress
import logging
import ssl
from collections.abc import Callable
from pathlib import Path

import grpc

from index.errors import CannotListen, ConfigError
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
    """The server's credentials; files are read and checked now (as the HTTP door's context
    loads them: gRPC says only that it could not add the port), so a bad one stops the start
    with the key that named it."""
    server_context(tls)
    cert, key, ca = _pems(tls)
    return grpc.ssl_server_credentials(
        [(key, cert)], root_certificates=ca, require_client_auth=ca is not None
    )


def server_context(tls: TlsConfig) -> ssl.SSLContext:
    """The HTTP door's TLS context from the same files (Python's server defaults: TLS 1.2 or
    newer); with ``client_ca_file``, a client must present a certificate it signed. The files
    are read now, so a bad one stops the start with the key that named it."""
    _pems(tls)  # each file a PEM, or the key that named it
    (cert, key), ca = _pair(tls), tls.client_ca_file
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    _loading(f"cert_file {cert} holds no certificate", _certificates, cert)
    _loading(
        f"key_file {key} is not an unencrypted private key of cert_file {cert}",
        _key_pair(context),
        cert,
        key,
    )
    if ca is not None:
        _loading(f"client_ca_file {ca} holds no CA certificate", _certificates, ca)
        context.load_verify_locations(cafile=ca)
        context.verify_mode = ssl.CERT_REQUIRED
    return context


def _certificates(path: Path) -> None:
    """Parse the certificates of ``path`` (ssl's error for a file of none)."""
    ssl.create_default_context().load_verify_locations(cafile=path)


def _key_pair(context: ssl.SSLContext) -> Callable[[Path, Path], None]:
    """``context.load_cert_chain`` of a certificate and its key, with no passphrase: OpenSSL
    would otherwise ask for one of an encrypted key on the terminal, and gRPC reads none."""

    def load(cert: Path, key: Path) -> None:
        context.load_cert_chain(cert, key, password=lambda: b"")

    return load


def _loading(what: str, load: Callable[..., None], *paths: Path) -> None:
    """``load(*paths)``; its error (ssl's words, which name no file) as a ConfigError that says
    ``what`` was wrong."""
    try:
        load(*paths)
    except (ssl.SSLError, OSError) as exc:
        raise ConfigError(f"[sidecar.tls] {what}: {exc}") from exc


def _pems(tls: TlsConfig) -> tuple[bytes, bytes, bytes | None]:
    """The certificate's, the key's and the client CA's bytes (None: no client CA), each named
    by its key when it cannot be read or is not a PEM file."""
    cert_file, key_file = _pair(tls)
    cert = read_pem(cert_file, "[sidecar.tls] cert_file")
    key = read_pem(key_file, "[sidecar.tls] key_file")
    ca = (
        read_pem(tls.client_ca_file, "[sidecar.tls] client_ca_file") if tls.client_ca_file else None
    )
    return cert, key, ca


def _pair(tls: TlsConfig) -> tuple[Path, Path]:
    if tls.cert_file is None or tls.key_file is None:
        raise ConfigError("[sidecar.tls] cert_file and key_file are both needed for TLS")
    return tls.cert_file, tls.key_file


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
        try:
            port = server.add_secure_port(listen, server_credentials(tls))
        except RuntimeError as exc:
            raise CannotListen(
                listen, LISTEN_KEY, "the address is in use or cannot be bound"
            ) from exc
    else:
        if not is_loopback(listen):
            log.warning(
                "listening on %s without TLS: anyone who can reach it can read the traffic; "
                "set [sidecar.tls] cert_file and key_file",
                listen,
            )
        port = _insecure_port(server, listen)
    if port == 0:
        raise CannotListen(listen, LISTEN_KEY, "the address cannot be bound")
    return port


LISTEN_KEY = "[sidecar] listen, or --listen"


def _insecure_port(server: grpc.aio.Server, listen: str) -> int:
    try:
        return server.add_insecure_port(listen)
    except RuntimeError as exc:  # grpc's "Failed to bind to address ...": in use, most often
        raise CannotListen(listen, LISTEN_KEY, "the address is in use or cannot be bound") from exc
