"""``deploy/build-image.sh``'s choices before it builds anything: the Debian mirror comes from the
host's own apt sources (the script names no host), and ``--smoke`` says first what it needs.
Nothing here runs podman, debootstrap or apt: every case stops before them."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

from tests.hardening_kit import REPO

SCRIPT = REPO / "deploy" / "build-image.sh"
MAIN = "http://mirror.internal.test/debian"  # the host's (made-up) mirror in these tests

pytestmark = pytest.mark.skipif(shutil.which("bash") is None, reason="needs bash")


def run(*args: str, script: Path = SCRIPT, **env: str) -> subprocess.CompletedProcess[str]:
    environ = {k: v for k, v in os.environ.items() if k != "MIRROR"} | env
    return subprocess.run(
        ["bash", str(script), *args], env=environ, capture_output=True, text=True, timeout=30
    )


def apt_etc(tmp_path: Path, files: dict[str, str]) -> Path:
    for name, text in files.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text, encoding="utf-8")
    return tmp_path


DEB822 = f"""\
Types: deb
URIs: http://security.internal.test/debian-security
Suites: bookworm-security
Components: main

Types: deb-src
URIs: http://src.internal.test/debian
Suites: bookworm
Components: main

Enabled: no
Types: deb
URIs: http://disabled.internal.test/debian
Suites: bookworm

Types: deb
# a comment between fields
URIs: {MAIN}
Suites: bookworm bookworm-updates
Components: main
"""


@pytest.mark.parametrize(
    "files",
    [
        {"sources.list.d/debian.sources": DEB822},
        {
            "sources.list": f"# deb http://old.internal.test/debian bookworm main\ndeb {MAIN} bookworm main\n"
        },
        {"sources.list.d/x.list": f"deb [arch=amd64 signed-by=/k.gpg] {MAIN} bookworm main\n"},
        {  # a one-line list of another suite does not count; the deb822 file does
            "sources.list": "deb http://other.internal.test/ubuntu jammy main\n",
            "sources.list.d/debian.sources": DEB822,
        },
    ],
)
def test_the_mirror_is_the_one_the_hosts_apt_uses(tmp_path: Path, files: dict[str, str]) -> None:
    out = run("--print-mirror", APT_ETC=str(apt_etc(tmp_path, files)))
    assert (out.returncode, out.stdout) == (0, MAIN + "\n"), out.stderr


def test_mirror_in_the_environment_wins(tmp_path: Path) -> None:
    etc = apt_etc(tmp_path, {"sources.list.d/debian.sources": DEB822})
    out = run("--print-mirror", APT_ETC=str(etc), MIRROR="http://given.internal.test/debian")
    assert out.stdout == "http://given.internal.test/debian\n"


def test_no_mirror_anywhere_says_what_to_set(tmp_path: Path) -> None:
    etc = apt_etc(tmp_path, {"sources.list": "deb http://other.internal.test/ubuntu jammy main\n"})
    out = run(APT_ETC=str(etc))
    assert out.returncode == 2
    assert "MIRROR=" in out.stderr
    assert "podman" not in out.stderr  # stopped before installing anything


def test_smoke_on_a_fresh_clone_says_what_to_run_before_building(tmp_path: Path) -> None:
    clone = tmp_path / "clone"  # no .venv in it
    (clone / "deploy").mkdir(parents=True)
    script = clone / "deploy" / "build-image.sh"
    shutil.copy(SCRIPT, script)
    etc = apt_etc(tmp_path / "apt", {"sources.list.d/debian.sources": DEB822})
    out = run("--smoke", script=script, APT_ETC=str(etc))
    assert out.returncode == 2
    assert "python3.11 -m venv .venv && .venv/bin/pip install -e '.[dev]'" in out.stderr
    assert "== installing" not in out.stderr


def test_an_unknown_argument_is_refused() -> None:
    out = run("--smoek")
    assert out.returncode == 2
    assert "usage:" in out.stderr


def test_the_script_names_no_debian_host() -> None:
    text = SCRIPT.read_text(encoding="utf-8")
    assert "deb.debian.org" not in text
    assert "http://" not in text
