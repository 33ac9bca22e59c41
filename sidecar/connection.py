"""How a client reaches a sidecar: one value built once, one function that opens the channel.

    connection = Connection.from_env(os.environ, target=args.target)  # arguments > env > defaults
    channel = open_channel(connection)                                 # grpc.aio
    await stub.Turn(request, metadata=connection.metadata, timeout=1.0)

Every client of the project (``voxrecall ask``, the adapters' ``Voxrecall``, the examples) takes
the same settings under the same names; only entry points read the environment:

    VOXRECALL_TARGET           host:port of the sidecar (default 127.0.0.1:50051)
    VOXRECALL_TOKEN            bearer token, sent as ``authorization: Bearer <token>``
    VOXRECALL_TLS_CA           PEM of the CA that signed the sidecar's certificate: turns TLS on
    VOXRECALL_TLS_CERT         client certificate (PEM) for mutual TLS, with VOXRECALL_TLS_KEY
    VOXRECALL_TLS_KEY          its private key (PEM)
    VOXRECALL_TLS_SERVER_NAME  the name the sidecar's certificate holds, when the target's differs

The token travels as call metadata (no thread per call, unlike gRPC's call-credential plugins),
so nothing stops it going out in the clear but this module: a token is refused over plaintext to
anything but a loopback address, as gRPC refuses call credentials on an insecure channel.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from pathlib import Path

import grpc

from index.errors import ConfigError
from sidecar.edge.tls import is_loopback, read_pem

DEFAULT_TARGET = "127.0.0.1:50051"

# Every channel of the project's clients (``open_channel``, ``open_blocking_channel``) retries a
# call refused UNAVAILABLE (gRFC A6): a base loading under ``[sidecar] memory_budget_mb`` (after
# the sidecar's ``grpc-retry-pushback-ms`` hint: the last load's time), a sidecar starting or
# draining (after a backoff of 50 ms doubling to 400 ms, jittered). At most RETRY_ATTEMPTS
# attempts in all, every one within the call's own deadline (a turn's 1 s), which ends them. A
# refusal whose hint is negative is not retried (a base with no snapshot: none comes in a turn;
# a base loading whose hint would not leave the call time for its retry: the message at once;
# a sidecar draining: another instance answers).
RETRY_ATTEMPTS = 4
RETRY_POLICY = {
    "maxAttempts": RETRY_ATTEMPTS,
    "initialBackoff": "0.05s",
    "maxBackoff": "0.4s",
    "backoffMultiplier": 2,
    "retryableStatusCodes": ["UNAVAILABLE"],
}
SERVICE_CONFIG = json.dumps(
    {
        "methodConfig": [
            {"name": [{"service": "voxrecall.v1.Retrieval"}], "retryPolicy": RETRY_POLICY}
        ]
    }
)

# Every channel of the project's clients tries to connect again, after a failed try, within
# RECONNECT_MAX_BACKOFF_MS (gRPC's default grows 1 s by 1.6x a try to 120 s: an agent started
# with its sidecar, whose first tries were refused while the sidecar loaded, could connect
# minutes after the sidecar served). A sidecar is on this machine or in this cluster: a refused
# try costs a SYN, so 100 ms growing 1.6x (jittered) to 2 s costs nothing and finds it within
# about 2 s of serving. gRPC reads ``min_reconnect_backoff_ms`` as the least time one try is
# given to connect (TCP, TLS, HTTP/2; default 20 s), not as a backoff: a try's deadline is the
# larger of it and the backoff, so at 1 s a sidecar reached over a slow link whose handshake
# takes over 2 s would never connect; 5 s is far more than a near sidecar's handshake needs,
# while a try that hangs (a dropped SYN) is still given up soon.
RECONNECT_INITIAL_BACKOFF_MS = 100
RECONNECT_MIN_CONNECT_MS = 5_000
RECONNECT_MAX_BACKOFF_MS = 2_000
RECONNECT_OPTIONS: tuple[tuple[str, int], ...] = (
    ("grpc.initial_reconnect_backoff_ms", RECONNECT_INITIAL_BACKOFF_MS),
    ("grpc.min_reconnect_backoff_ms", RECONNECT_MIN_CONNECT_MS),
    ("grpc.max_reconnect_backoff_ms", RECONNECT_MAX_BACKOFF_MS),
)

# field -> (environment variable, command-line flag): the names every client and doc uses
NAMES: dict[str, tuple[str, str]] = {
    "target": ("VOXRECALL_TARGET", "--target"),
    "token": ("VOXRECALL_TOKEN", ""),  # no flag: a token on a command line is in ps and history
    "ca_file": ("VOXRECALL_TLS_CA", "--tls-ca"),
    "cert_file": ("VOXRECALL_TLS_CERT", "--tls-cert"),
    "key_file": ("VOXRECALL_TLS_KEY", "--tls-key"),
    "server_name": ("VOXRECALL_TLS_SERVER_NAME", "--tls-server-name"),
}


def _named(name: str) -> str:
    env, flag = NAMES[name]
    return f"{flag} / {env}" if flag else env


@dataclass(frozen=True, slots=True)
class Connection:
    """Where the sidecar is and how to prove who we are; checked when made.

    Usage::

        Connection()                                            # 127.0.0.1:50051, plaintext
        Connection("sidecar:50051", token=t, ca_file=Path("ca.pem"))         # TLS and a token
        Connection.from_env(os.environ)                          # the VOXRECALL_* variables
    """

    target: str = DEFAULT_TARGET
    token: str = field(default="", repr=False)
    ca_file: Path | None = None
    cert_file: Path | None = None
    key_file: Path | None = None
    server_name: str = ""

    def __post_init__(self) -> None:
        object.__setattr__(self, "token", self.token.strip())
        if not self.target.strip():
            raise ConfigError(f"{_named('target')}: the sidecar's address is empty")
        self._check_tls()
        self._check_token()

    def _check_tls(self) -> None:
        if (self.cert_file is None) != (self.key_file is None):
            raise ConfigError(
                f"mutual TLS needs both {_named('cert_file')} and {_named('key_file')}"
            )
        if not self.tls and (self.cert_file is not None or self.server_name):
            raise ConfigError(
                f"{_named('cert_file')} and {_named('server_name')} need TLS: "
                f"give the CA that signed the sidecar's certificate ({_named('ca_file')})"
            )

    def _check_token(self) -> None:
        if any(c in self.token for c in " \t\r\n\0"):
            raise ConfigError(f"{_named('token')}: a token is one word without spaces")
        if self.token and not self.tls and not _is_local(self.target):
            raise ConfigError(
                f"refusing to send the bearer token in the clear to {self.target}: give the "
                f"sidecar's CA ({_named('ca_file')}) or connect over 127.0.0.1"
            )

    @classmethod
    def from_env(cls, environ: Mapping[str, str], **given: str | Path | None) -> Connection:
        """Each setting from ``given`` when set, else its environment variable, else the default."""
        unknown = set(given) - set(NAMES)
        if unknown:
            raise TypeError(f"Connection has no setting {', '.join(sorted(unknown))}")
        values: dict[str, str | Path] = {}
        for f in fields(cls):
            value = given.get(f.name)
            if value is None or value == "":
                value = environ.get(NAMES[f.name][0], "")
            if value != "":
                values[f.name] = Path(value) if f.name.endswith("_file") else str(value)
        return cls(**values)  # type: ignore[arg-type]

    @property
    def tls(self) -> bool:
        return self.ca_file is not None

    @property
    def metadata(self) -> tuple[tuple[str, str], ...]:
        """What every call carries: the bearer token, when there is one."""
        return (("authorization", f"Bearer {self.token}"),) if self.token else ()

    def credentials(self) -> grpc.ChannelCredentials | None:
        """TLS credentials (files read now, so a bad one fails here), or None for plaintext."""
        if self.ca_file is None:
            return None
        return grpc.ssl_channel_credentials(
            root_certificates=read_pem(self.ca_file, _named("ca_file")),
            private_key=read_pem(self.key_file, _named("key_file")) if self.key_file else None,
            certificate_chain=(
                read_pem(self.cert_file, _named("cert_file")) if self.cert_file else None
            ),
        )

    def options(self) -> list[tuple[str, str | int]]:
        """The channel's options: the retry policy, the reconnect backoff, and the TLS name to
        check, if given."""
        options: list[tuple[str, str | int]] = [
            ("grpc.enable_retries", 1),
            ("grpc.service_config", SERVICE_CONFIG),
            *RECONNECT_OPTIONS,
        ]
        if self.server_name:
            options.append(("grpc.ssl_target_name_override", self.server_name))
        return options


def _is_local(target: str) -> bool:
    return target.startswith("unix:") or is_loopback(target)


def open_channel(connection: Connection) -> grpc.aio.Channel:
    """A ``grpc.aio`` channel to the sidecar: TLS when a CA is given, else plaintext."""
    credentials = connection.credentials()
    if credentials is None:
        return grpc.aio.insecure_channel(connection.target, options=connection.options())
    return grpc.aio.secure_channel(connection.target, credentials, options=connection.options())


def open_blocking_channel(connection: Connection) -> grpc.Channel:
    """The same as ``open_channel`` for blocking callers (``voxrecall ask``, the health probe)."""
    credentials = connection.credentials()
    if credentials is None:
        return grpc.insecure_channel(connection.target, options=connection.options())
    return grpc.secure_channel(connection.target, credentials, options=connection.options())


def target_for_listen(listen: str, where: str) -> str:
    """The address a client on this machine dials for a server's ``listen`` (``0.0.0.0:P`` and
    ``[::]:P`` listen on every interface, loopback included)."""
    host, _, port = listen.rpartition(":")
    if not port.isdigit() or int(port) == 0:
        raise ConfigError(
            f"{where}: [sidecar] listen {listen!r} names no port to ask: use --target"
        )
    if host in ("", "0.0.0.0"):
        host = "127.0.0.1"
    elif host == "[::]":
        host = "[::1]"
    return f"{host}:{port}"
