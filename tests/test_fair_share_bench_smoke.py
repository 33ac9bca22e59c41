"""The issue-14 benchmarks in smoke mode, so they cannot rot: they run and write their JSON.

No memory or share figure is asserted here beyond what must hold at any size: the tests in
tests/test_fair_share.py check the behaviour; ``python -m bench.session_memory`` and
``python -m bench.fair_share`` measure it.
"""

from __future__ import annotations

import json
from pathlib import Path

from bench import fair_share, session_memory


def test_session_memory_runs_both_modes(tmp_path: Path) -> None:
    out = tmp_path / "session_memory.json"
    assert session_memory.main(["--sessions", "20", "--out", str(out)]) == 0
    modes = json.loads(out.read_text())["modes"]
    for mode in ("unbounded", "bounded"):
        assert modes[mode]["sessions_held"] == 20
        assert modes[mode]["rss_after_mb"] > 0
    assert modes["bounded"]["session_bytes"] < modes["unbounded"]["session_bytes"]


def test_fair_share_runs_and_the_victim_is_answered(tmp_path: Path) -> None:
    out = tmp_path / "fair_share.json"
    assert fair_share.main(["--duration", "2", "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    assert result["hog_streams_held"] == 32  # its half of max_streams
    assert result["victim_calls"].get("RESOURCE_EXHAUSTED", 0) == 0
