"""A port in use (gRPC's ``listen``, the HTTP door's, metrics') stops ``voxrecall serve`` with
one ``error:`` line naming the address and the setting, exit 2, no traceback."""

from __future__ import annotations

import socket
from collections.abc import Iterator
from pathlib import Path

import pytest

from sidecar.cli import main
from tests.conftest import EXAMPLE_KB


@pytest.fixture
def taken() -> Iterator[str]:
    """A loopback address some other program listens on."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen()
        yield f"127.0.0.1:{sock.getsockname()[1]}"


def _config(tmp_path: Path, sidecar: str) -> Path:
    path = tmp_path / "voxrecall.toml"
    path.write_text(
        f'[[knowledge_base]]\nname = "docs"\n[[knowledge_base.source]]\ntype = "markdown"\n'
        f'path = "{EXAMPLE_KB}"\n[sidecar]\nstore = "{tmp_path / "store"}"\n{sidecar}'
    )
    return path


@pytest.mark.parametrize(
    ("sidecar", "flags", "setting"),
    [
        ("", ["--listen", "{taken}"], "[sidecar] listen, or --listen"),
        ('listen = "{taken}"\n', [], "[sidecar] listen, or --listen"),
        (
            'listen = "127.0.0.1:0"\n[sidecar.http]\nlisten = "{taken}"\n',
            [],
            "[sidecar.http] listen",
        ),
        ('listen = "127.0.0.1:0"\nmetrics_listen = "{taken}"\n', [], "[sidecar] metrics_listen"),
    ],
)
def test_a_port_in_use_is_one_error_line_naming_the_setting(
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    taken: str,
    sidecar: str,
    flags: list[str],
    setting: str,
) -> None:
    path = _config(tmp_path, sidecar.format(taken=taken))
    argv = ["serve", "--config", str(path), *(f.format(taken=taken) for f in flags)]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert f"error: cannot listen on {taken} ({setting}): " in err
    assert "Traceback" not in err
    assert sum(line.startswith("error:") for line in err.splitlines()) == 1
