"""``python -m bench.client_reconnect`` in smoke mode, so it cannot rot: it runs both clients
and writes its JSON. No time is asserted: tests/test_client_reconnect.py checks the options;
the bench measures what they buy (bench/README.md)."""

from __future__ import annotations

import json
from pathlib import Path

from bench import client_reconnect


def test_client_reconnect_runs_both_clients_and_each_is_answered(tmp_path: Path) -> None:
    out = tmp_path / "client_reconnect.json"
    assert client_reconnect.main(["--tries", "1", "--out", str(out)]) == 0
    modes = json.loads(out.read_text())["modes"]
    assert set(modes) == {"project", "grpc_default"}
    for mode in modes.values():
        assert mode["refused_tries"] >= 1
        assert mode["answered"]
