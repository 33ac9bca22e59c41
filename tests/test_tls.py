"""TLS and mutual TLS from config files, with certificates made by openssl in the test."""

from __future__ import annotations

import asyncio
import shutil
import subprocess
from pathlib import Path

import grpc
import pytest

from index.embedders.base import Embedder
from index.errors import ConfigError
from sidecar.config import parse_config
from sidecar.connection import Connection
from sidecar.edge.server import create_server
from sidecar.edge.tls import is_loopback
from sidecar.gen import retrieval_pb2 as pb
from sidecar.gen import retrieval_pb2_grpc as pb_grpc
from sidecar.healthcheck import check
from tests.hardening_kit import build_store, make_certs, running, sidecar_config

pytestmark = pytest.mark.skipif(shutil.which("openssl") is None, reason="needs the openssl CLI")
TURN = pb.TurnRequest(session_id="t", text="how do I reset my password", is_final=True)


@pytest.fixture(scope="module")
def store(tmp_path_factory: pytest.TempPathFactory, local_embedder: Embedder) -> Path:
    return build_store(tmp_path_factory.mktemp("tls"), local_embedder)


@pytest.fixture(scope="module")
def certs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_certs(tmp_path_factory.mktemp("certs"))


def _credentials(certs: Path, client: str | None = None) -> grpc.ChannelCredentials:
    return grpc.ssl_channel_credentials(
        root_certificates=(certs / "ca.pem").read_bytes(),
        private_key=(certs / f"{client}.key").read_bytes() if client else None,
        certificate_chain=(certs / f"{client}.pem").read_bytes() if client else None,
    )


async def _turn(port: int, credentials: grpc.ChannelCredentials | None) -> pb.TurnResponse:
    target = f"127.0.0.1:{port}"
    channel = (
        grpc.aio.secure_channel(target, credentials)
        if credentials is not None
        else grpc.aio.insecure_channel(target)
    )
    async with channel:
        stub = pb_grpc.RetrievalStub(channel)  # type: ignore[no-untyped-call]
        resp: pb.TurnResponse = await stub.Turn(TURN, timeout=10)
        return resp


async def test_tls_serves_a_client_that_trusts_the_ca_and_refuses_plaintext(
    store: Path, certs: Path, local_embedder: Embedder
) -> None:
    tls = {"cert_file": str(certs / "server.pem"), "key_file": str(certs / "server.key")}
    async with running(sidecar_config(store, tls=tls), local_embedder) as sidecar:
        resp = await _turn(sidecar.port, _credentials(certs))
        assert resp.chunks[0].title == "Reset your password"
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await _turn(sidecar.port, None)
        assert info.value.code() is grpc.StatusCode.UNAVAILABLE
        # the image's HEALTHCHECK probe speaks TLS when given the CA
        status = await _probe(sidecar.port, certs, None)
        assert status == "SERVING"


async def test_mutual_tls_needs_a_client_certificate_from_the_ca(
    store: Path, certs: Path, local_embedder: Embedder
) -> None:
    tls = {
        "cert_file": str(certs / "server.pem"),
        "key_file": str(certs / "server.key"),
        "client_ca_file": str(certs / "ca.pem"),
    }
    async with running(sidecar_config(store, tls=tls), local_embedder) as sidecar:
        resp = await _turn(sidecar.port, _credentials(certs, "client"))
        assert resp.chunks
        for client in (None, "rogue"):  # no certificate; a self-signed one
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await _turn(sidecar.port, _credentials(certs, client))
            assert info.value.code() is grpc.StatusCode.UNAVAILABLE
        assert await _probe(sidecar.port, certs, "client") == "SERVING"


async def _probe(port: int, certs: Path, client: str | None) -> str:
    """The health probe (blocking grpc) from a worker thread, so the server keeps running."""
    connection = Connection(
        f"127.0.0.1:{port}",
        ca_file=certs / "ca.pem",
        cert_file=certs / f"{client}.pem" if client else None,
        key_file=certs / f"{client}.key" if client else None,
    )
    return await asyncio.to_thread(check, connection, timeout_s=10)


async def test_a_missing_or_bad_certificate_file_stops_the_start(
    store: Path, certs: Path, local_embedder: Embedder, tmp_path: Path
) -> None:
    missing = {"cert_file": str(tmp_path / "nope.pem"), "key_file": str(certs / "server.key")}
    with pytest.raises(ConfigError, match=r"nope\.pem"):
        await create_server(sidecar_config(store, tls=missing), embedder=local_embedder)
    (tmp_path / "junk.pem").write_text("not a certificate")
    junk = {"cert_file": str(tmp_path / "junk.pem"), "key_file": str(certs / "server.key")}
    with pytest.raises(ConfigError, match="not a PEM file"):
        await create_server(sidecar_config(store, tls=junk), embedder=local_embedder)


async def test_a_certificate_or_key_that_does_not_load_is_named_not_taken_for_a_bound_port(
    store: Path, certs: Path, local_embedder: Embedder, tmp_path: Path
) -> None:
    """gRPC says only that it could not add the port: a PEM of junk, or a key of another
    certificate, stopped the start with "the address is in use or cannot be bound"."""
    armored = tmp_path / "armored.pem"
    armored.write_text("-----BEGIN CERTIFICATE-----\nbm90IGEgY2VydA==\n-----END CERTIFICATE-----\n")
    cases = {
        "holds no certificate": {"cert_file": armored, "key_file": certs / "server.key"},
        "is not an unencrypted private key": {
            "cert_file": certs / "server.pem",
            "key_file": certs / "client.key",
        },
        "client_ca_file .* holds no CA certificate": {
            "cert_file": certs / "server.pem",
            "key_file": certs / "server.key",
            "client_ca_file": armored,
        },
    }
    encrypted = tmp_path / "encrypted.key"  # OpenSSL asked for its passphrase on the terminal
    command = ["openssl", "pkey", "-in", str(certs / "server.key"), "-aes256", "-passout",
               "pass:x", "-out", str(encrypted)]  # fmt: skip
    await asyncio.to_thread(subprocess.run, command, check=True, capture_output=True)
    cases["is not an unencrypted private key of cert_file"] = {
        "cert_file": certs / "server.pem",
        "key_file": encrypted,
    }
    for said, files in cases.items():
        tls = {key: str(path) for key, path in files.items()}
        with pytest.raises(ConfigError, match=said) as refused:
            await create_server(sidecar_config(store, tls=tls), embedder=local_embedder)
        assert "[sidecar.tls]" in str(refused.value)


def test_the_config_wants_cert_and_key_together(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="go together"):
        parse_config({"sidecar": {"tls": {"cert_file": "a.pem"}}}, tmp_path)
    with pytest.raises(ConfigError, match="mutual TLS"):
        parse_config({"sidecar": {"tls": {"client_ca_file": "ca.pem"}}}, tmp_path)
    tls = parse_config({"sidecar": {"tls": {"cert_file": "a.pem", "key_file": "a.key"}}}, tmp_path)
    assert tls.sidecar.tls.cert_file == tmp_path / "a.pem"  # relative to the config's folder


@pytest.mark.parametrize(
    ("listen", "loopback"),
    [
        ("127.0.0.1:50051", True),
        ("[::1]:50051", True),
        ("localhost:1", True),
        ("0.0.0.0:50051", False),
        ("[::]:50051", False),
        ("10.1.2.3:50051", False),
    ],
)
def test_loopback_addresses(listen: str, loopback: bool) -> None:
    assert is_loopback(listen) is loopback
