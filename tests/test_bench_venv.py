"""``python -m bench`` run by a Python without the project's packages (a system ``python``, not
``.venv/bin/python``) says so in one line and exits 2, instead of the first import's traceback."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
# the bench entry point with grpc unimportable, as under a Python that lacks it
WITHOUT_GRPC = (
    "import runpy, sys; sys.modules['grpc'] = None; "
    "sys.argv = ['bench', *sys.argv[1:]]; runpy.run_module('bench', run_name='__main__')"
)


def test_a_python_without_the_projects_packages_is_told_to_use_the_venv(tmp_path: Path) -> None:
    run = subprocess.run(
        [sys.executable, "-c", WITHOUT_GRPC, "search", "--quick", "--out", str(tmp_path)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert run.returncode == 2, run.stderr
    assert "Traceback" not in run.stderr
    (line,) = run.stderr.strip().splitlines()
    assert "cannot import grpc" in line
    assert "`.venv/bin/python -m bench ...`" in line
    assert run.stdout == ""
    assert not list(tmp_path.iterdir())
