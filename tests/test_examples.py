"""The runnable examples as a user starts them: what is missing is said in one line, exit 2."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from tests.hardening_kit import REPO

pytest.importorskip("websockets")  # the realtime-example extra (also in dev, through Pipecat)
REALTIME = REPO / "examples" / "openai_realtime_agent.py"


def run_realtime(**env: str) -> subprocess.CompletedProcess[str]:
    keep = {
        k: v
        for k, v in os.environ.items()
        if k != "OPENAI_API_KEY" and not k.startswith("VOXRECALL_")
    }
    return subprocess.run(
        [sys.executable, str(REALTIME), "How much is roaming?"],
        cwd=REPO, env=keep | {"PYTHONPATH": str(REPO)} | env,
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip


def test_realtime_example_without_an_api_key_says_what_to_set() -> None:
    out = run_realtime()
    assert out.returncode == 2
    assert out.stderr.strip().splitlines() == [
        "error: set OPENAI_API_KEY to an OpenAI API key (the Realtime API needs one)"
    ]


def test_realtime_example_reads_the_clients_variables() -> None:
    """A token bound for another machine in the clear is refused before anything connects."""
    out = run_realtime(
        OPENAI_API_KEY="sk-test", VOXRECALL_TARGET="sidecar:50051", VOXRECALL_TOKEN="t" * 32
    )
    assert out.returncode == 2
    (line,) = out.stderr.strip().splitlines()
    assert "in the clear to sidecar:50051" in line
    assert "VOXRECALL_TLS_CA" in line
