"""A port in use (gRPC's ``listen``, the HTTP door's, metrics') stops ``voxrecall serve`` with
one ``error:`` line naming the address and the setting, exit 2, no traceback. A real process,
bounded: a regression that serves fails the test rather than holding it for ever."""

from __future__ import annotations

import os
import socket
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.conftest import EXAMPLE_KB
from tests.hardening_kit import serve_refused


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
    tmp_path: Path, taken: str, sidecar: str, flags: list[str], setting: str
) -> None:
    path = _config(tmp_path, sidecar.format(taken=taken))
    args = [f.format(taken=taken) for f in flags]
    done = serve_refused(path, {"PATH": os.environ.get("PATH", "")}, *args)
    err = done.stderr
    assert done.returncode == 2, err
    assert f"error: cannot listen on {taken} ({setting}): " in err
    assert "Traceback" not in err
    assert sum(line.startswith("error:") for line in err.splitlines()) == 1
