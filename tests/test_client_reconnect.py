"""Every channel the project's clients open to a sidecar (``Voxrecall`` and so ``ShardRouter``,
``voxrecall ask``, the health probe; plaintext and TLS) tries to connect again within 2 s of a
failed try (``sidecar.connection.RECONNECT_OPTIONS``), not after gRPC's default backoff (1 s
growing 1.6x a try to 120 s): an agent started with its sidecar, refused while the sidecar
loaded, connected minutes after it served.

Checked on the real channel-making functions: gRPC's channel constructors are wrapped to note
the options each channel is made with, and still make it. No figure of time here: how soon a
client started before its sidecar is answered, against gRPC's default options, is measured by
``python -m bench.client_reconnect`` (bench/README.md).
"""

from __future__ import annotations

import socket
from collections.abc import Callable
from pathlib import Path
from typing import Any

import grpc
import pytest

from sidecar import client, healthcheck
from sidecar.adapters.client import Voxrecall
from sidecar.connection import Connection, open_blocking_channel, open_channel
from tests.hardening_kit import make_certs

MAX_BACKOFF_MS = 2_000  # the longest an agent may wait between tries for a sidecar nearby

Made = list[dict[str, int | str]]


@pytest.fixture
def made(monkeypatch: pytest.MonkeyPatch) -> Made:
    """The options of every channel gRPC is asked to make, in order (each still made)."""
    seen: Made = []

    def noting(make: Callable[..., Any]) -> Callable[..., Any]:
        def wrapped(*args: Any, options: Any = None, **kwargs: Any) -> Any:
            seen.append(dict(options or ()))
            return make(*args, options=options, **kwargs)

        return wrapped

    for module in (grpc, grpc.aio):
        for name in ("insecure_channel", "secure_channel"):
            monkeypatch.setattr(module, name, noting(getattr(module, name)))
    return seen


def closed_port() -> str:
    """An address on this machine where nothing listens: every try is refused at once."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return f"127.0.0.1:{sock.getsockname()[1]}"


def assert_bounded(options: dict[str, int | str]) -> None:
    assert 0 < int(options["grpc.max_reconnect_backoff_ms"]) <= MAX_BACKOFF_MS, options
    initial = int(options["grpc.initial_reconnect_backoff_ms"])
    assert 0 < initial <= int(options["grpc.max_reconnect_backoff_ms"]), options


@pytest.fixture(scope="module")
def ca(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_certs(tmp_path_factory.mktemp("certs")) / "ca.pem"


@pytest.mark.parametrize("tls", [False, True], ids=["plaintext", "tls"])
async def test_every_channel_a_connection_opens_reconnects_within_2_s(
    made: Made, ca: Path, tls: bool
) -> None:
    connection = Connection(closed_port(), ca_file=ca if tls else None)
    async with open_channel(connection):
        pass
    with open_blocking_channel(connection):
        pass
    assert len(made) == 2
    for options in made:
        assert_bounded(options)


async def test_the_agent_client_reconnects_within_2_s(made: Made) -> None:
    agent = Voxrecall(closed_port(), knowledge_base="help")
    try:
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await agent.search("reset my password")
    finally:
        await agent.close()
    assert refused.value.code() is grpc.StatusCode.UNAVAILABLE
    (options,) = made
    assert_bounded(options)


def test_the_command_line_and_the_health_probe_reconnect_within_2_s(made: Made) -> None:
    connection = Connection(closed_port())
    with pytest.raises(grpc.RpcError):
        healthcheck.check(connection, timeout_s=5.0)
    with pytest.raises(grpc.RpcError):
        client.ask("reset my password", client.AskOptions(connection=connection))
    assert len(made) == 2
    for options in made:
        assert_bounded(options)
