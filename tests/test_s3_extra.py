"""Without boto3 (the ``s3`` extra), an s3:// store stops ``voxrecall index publish`` and
``voxrecall serve`` with one line naming the extra, from PyPI and from a clone; it was a
traceback ending in ``ModuleNotFoundError: No module named 'boto3'``.

Real parts: the ``voxrecall`` command in a child process, boto3 made unimportable there (None in
``sys.modules``, as where it is not installed); nothing is built or reached.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
CONFIG = REPO / "examples" / "voxrecall.toml"
WITHOUT_BOTO3 = (
    "import sys; sys.modules['boto3'] = None; from sidecar.cli import main; "
    "raise SystemExit(main(sys.argv[1:]))"
)


@pytest.mark.parametrize(
    "command",
    [
        ["index", "publish", "--config", str(CONFIG), "--to", "s3://acme-snapshots/prod"],
        ["serve", "--config", str(CONFIG), "--store", "s3://acme-snapshots/prod",
         "--listen", "127.0.0.1:0"],
    ],
    ids=["publish", "serve"],
)  # fmt: skip
def test_an_s3_store_without_boto3_says_which_extra_to_install(
    command: list[str], tmp_path: Path
) -> None:
    out = subprocess.run(
        [sys.executable, "-c", WITHOUT_BOTO3, *command],
        cwd=tmp_path, env={**os.environ, "PYTHONPATH": str(REPO)},
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert out.returncode == 2, out.stderr
    assert "Traceback" not in out.stderr
    (error,) = [line for line in out.stderr.splitlines() if line.startswith("error:")]
    assert "an s3:// store needs boto3" in error
    assert "pip install 'voxrecall[s3]'" in error
    assert "pip install -e '.[s3]'" in error
