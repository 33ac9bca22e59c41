"""A gRPC health probe for container HEALTHCHECKs and exec probes: exit 0 when SERVING.

    python -m sidecar.healthcheck --target 127.0.0.1:50051
    python -m sidecar.healthcheck --target sidecar:50051 --ca ca.pem [--cert c.pem --key k.pem]

Health needs no bearer token. With ``--ca`` the probe speaks TLS (and, given ``--cert`` and
``--key``, mutual TLS); it prints the status it got.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from index.errors import ConfigError
from sidecar.connection import Connection, open_blocking_channel


def check(connection: Connection, *, service: str = "", timeout_s: float = 3.0) -> str:
    """The health status name (``SERVING``, ``NOT_SERVING``, ...) of ``service`` at the target."""
    with open_blocking_channel(connection) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        reply = stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=timeout_s)
    return str(health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m sidecar.healthcheck", description=__doc__)
    p.add_argument("--target", default="127.0.0.1:50051", help="the sidecar's address")
    p.add_argument("--service", default="", help="the service to ask about (default: the server)")
    p.add_argument("--timeout", type=float, default=3.0, help="seconds to wait for the answer")
    p.add_argument("--ca", "--tls-ca", type=Path, help="speak TLS, trusting this CA (PEM)")
    p.add_argument(
        "--cert", "--tls-cert", type=Path, help="client certificate for mutual TLS (PEM)"
    )
    p.add_argument("--key", "--tls-key", type=Path, help="client key for mutual TLS (PEM)")
    p.add_argument(
        "--server-name",
        "--tls-server-name",
        default="",
        help="the name the server's certificate holds",
    )
    args = p.parse_args(argv)
    try:
        connection = Connection(
            args.target,
            ca_file=args.ca,
            cert_file=args.cert,
            key_file=args.key,
            server_name=args.server_name,
        )
        status = check(connection, service=args.service, timeout_s=args.timeout)
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except grpc.RpcError as exc:
        print(f"unhealthy: {exc.code().name}: {exc.details()}", file=sys.stderr)
        return 1
    print(status)
    return 0 if status == "SERVING" else 1


if __name__ == "__main__":
    raise SystemExit(main())
