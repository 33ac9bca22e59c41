"""The hardening benchmarks in smoke mode, so they cannot rot: they run and write their JSON.

No timing or memory figure is asserted; ``python -m bench.soak`` and
``python -m bench.guards_overhead`` measure those.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench import guards_overhead, soak


@pytest.mark.slow
def test_soak_runs_a_real_sidecar_process_and_writes_its_samples(tmp_path: Path) -> None:
    out = tmp_path / "soak.json"
    assert soak.main(["--duration", "4", "--workers", "2", "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    summary = result["summary"]
    assert summary["turns"] > 0
    assert summary["errors"] == {}
    assert summary["exit_code_after_sigterm"] == 0
    assert all(s["rss_mb"] > 0 for s in result["samples"])


def test_guards_overhead_compares_both_servers(tmp_path: Path) -> None:
    out = tmp_path / "guards.json"
    assert guards_overhead.main(["--calls", "100", "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    for rpc in ("Status", "Turn"):
        assert result[rpc]["guarded"]["calls"] == result[rpc]["bare"]["calls"] == 100
