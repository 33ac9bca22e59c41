"""What ``python -m bench`` tells a reader: its tables, its verdicts, its help and its docs.

A benchmark engineer reads these before the JSON (the s13 newcomer's findings 8-20 and 26): each
suite's table with its headers apart, no goal judged by a smoke run, the comparison with pgvector
per metric, a peer that is not installed named with the line that installs it, and one list of
suites in the help and both READMEs. No timing is asserted.
"""

from __future__ import annotations

import argparse
import importlib
import inspect
import json
import logging
import os
import re
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest

from bench import __main__ as cli
from bench import embed_rate, report, search
from bench.fuzz_snapshot import FuzzResult

REPO = Path(__file__).resolve().parents[1]


def _row(p50: float, cold: float, qps: float, recall: float = 0.99) -> dict[str, object]:
    return {"p50_ms": p50, "cold_p50_ms": cold, "qps_concurrent_16": qps, "recall_at_10": recall}


def test_columns_never_run_together_and_a_systems_ef_is_shown() -> None:
    result = {
        "systems": {
            "voxrecall": {
                "cold_p99_ms": 1.5,
                "server_total_p50_ms": 0.4,
                "server_search_p50_ms": 0.3,
                "setting": {"m": 16, "ef_search": 32},
            },
            "pgvector": {"skipped": "pgserver not installed (pip install -e '.[bench]')"},
        }
    }
    header, rule, vox, pg, *_ = cli.table(result).splitlines()
    assert header.split() == ["systems", "ef", "cold_p99_ms", "server_total_p50_ms",
                              "server_search_p50_ms"]  # fmt: skip
    assert set(rule) == {"-"}
    assert vox.split() == ["voxrecall", "32", "1.5", "0.4", "0.3"]
    assert pg.endswith("skipped: pgserver not installed (pip install -e '.[bench]')")


def test_an_empty_section_or_a_goal_without_its_fields_prints_and_never_raises() -> None:
    """A section of no rows raised TypeError and a goal without ``met`` KeyError, after the
    suite's JSON was written: ``python -m bench all`` stopped at the first such table."""
    printed = cli.table({"systems": {"x": {}}, "goals": {"g": {"value": 1, "goal": "<= 2"}}})
    assert "goal g: 1 (goal <= 2): not judged" in printed
    assert report.grid("systems", {}) == ["systems", ""]


def test_suites_without_rows_print_a_table_too() -> None:
    index = {"chunks": 13, "chunks_per_s": {"single": 200.0, "parallel": 300.0},
             "cores_used": {"single": 1.0, "parallel": 1.9}}  # fmt: skip
    text = cli.table(index)
    assert "chunks: 13" in text
    assert re.search(r"chunks_per_s\s+cores_used", text)
    assert re.search(r"parallel\s+300\s+1\.9", text)
    fuzz = {"cases": 2, "crashes": 0, "by_file": {"chunks.bin": {"ok": 1, "refused": 1}}}
    text = cli.table(fuzz)
    assert "crashes: 0" in text
    assert re.search(r"chunks\.bin\s+1\s+1", text)


def test_a_quick_run_judges_no_goal_and_prints_its_table(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert cli.main(["filters", "--quick", "--out", str(tmp_path)]) == 0
    printed = capsys.readouterr().out
    goals = json.loads((tmp_path / "filters.json").read_text())["goals"]
    assert {goal["met"] for goal in goals.values()} == {None}
    for name, goal in goals.items():
        assert f"goal {name}: " in printed
        assert goal["verdict"] == "not judged (quick)"
    assert "MISSED" not in printed
    assert " met" not in printed
    assert re.search(r"^results\s+mean_us\s+p50_us", printed, re.M)  # its rows, not only goals
    full = {"goals": {"sidecar_share_ms": {"value": 0.47, "goal": "<= 0.08", "met": False}}}
    assert cli.table(full) == "goal sidecar_share_ms: 0.47 (goal <= 0.08): MISSED"


def test_pgvector_ahead_cold_and_under_load_is_said_beside_a_warm_p50_ahead() -> None:
    systems = {"voxrecall": _row(1.15, cold=1.368, qps=1364.0),
               "pgvector": _row(1.90, cold=1.046, qps=2515.0)}  # fmt: skip
    goals = search.check_goals(systems)
    assert goals["voxrecall_p50_over_pgvector"]["met"] is True
    assert goals["voxrecall_cold_p50_over_pgvector"]["met"] is False
    assert goals["voxrecall_qps_over_pgvector"]["met"] is False
    versus = search.versus_pgvector(systems)
    assert versus["warm p50 ms"]["better"] == "voxrecall"
    assert versus["cold p50 ms"]["better"] == "pgvector"
    assert versus["qps x16"]["better"] == "pgvector"
    assert "pgvector ahead on cold p50 ms, qps x16" in versus["verdict"]
    text = "\n".join(report.versus_lines({"versus_pgvector": versus}))
    assert re.search(r"cold p50 ms\s+1\.368\s+1\.046\s+1\.308\s+pgvector", text)
    assert search.versus_pgvector({"voxrecall": systems["voxrecall"]}) == {
        "skipped": "not measured: pgvector"
    }


def test_a_peer_not_installed_says_how_to_install_it_and_is_not_opened(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setitem(search.REQUIRES, "pgvector", ("voxrecall_no_such_package",))
    with caplog.at_level(logging.INFO, logger="bench.search"):
        row = search._open_peer("pgvector", None, Path())  # type: ignore[arg-type]
    assert row == {"skipped": "voxrecall_no_such_package not installed (pip install -e '.[bench]')"}
    assert "opening" not in caplog.text


def test_fuzz_json_counts_every_outcome_at_zero_too() -> None:
    outcomes = FuzzResult(cases=2, outcomes=Counter(ok=1, refused=1)).as_dict()["outcomes"]
    assert outcomes == {"ok": 1, "degraded": 0, "refused": 1, "bug": 0, "crash": 0, "hang": 0}


def test_too_few_chunks_project_no_million() -> None:
    few = embed_rate._projected(13, 2, {"parallel": 100.0, "single": 60.0}, 60.0)
    assert few == {"skipped": "13 chunks measured; 1M is projected from 100 or more (the rclone"
                   " docs in the shared data, without --quick)"}  # fmt: skip
    many = embed_rate._projected(320, 2, {"parallel": 100.0, "single": 60.0}, 60.0)
    assert many["2_cores_measured"] == round(1_000_000 / 100 / 3600, 2)
    source, texts = embed_rate.corpus(quick=True)
    assert source.startswith("examples/kb (--quick)")
    assert f"{len(texts)} chunks" in source


def test_the_help_and_both_readmes_name_every_suite_and_its_needs() -> None:
    assert tuple(cli.SUITE_HELP) == (*cli.SUITES, "fuzz_snapshot", "all")
    bench_readme = (REPO / "bench" / "README.md").read_text(encoding="utf-8")
    readme = (REPO / "README.md").read_text(encoding="utf-8")
    for suite in cli.SUITE_HELP:
        assert f"| `{suite}` |" in bench_readme or suite == "all", suite
        assert f"`{suite}`" in readme, suite
    for suite in ("turn", "quality", "policy"):  # the three a bare clone skips
        assert "../shared/data" in cli.SUITE_HELP[suite]
    usage = bench_readme.splitlines()[3]
    assert all(suite in usage for suite in cli.SUITE_HELP), usage


def test_help_has_no_markup_and_no_description_ends_mid_sentence(
    capsys: pytest.CaptureFixture[str],
) -> None:
    with pytest.raises(SystemExit):
        cli.main(["--help"])
    text = capsys.readouterr().out
    assert "``" not in text
    assert "default: bench/results" in text
    for suite, line in cli.SUITE_HELP.items():
        assert re.search(rf"^  {suite}\s+{re.escape(line)}$", text, re.M), suite


# the bench modules with a command line of their own; still to do: turn_cost, handler_cost,
# profile_turn, search_parts, doc2dial_halves, quality_conversations, spoken_misses
MODULES = (
    "build_memory", "embed_pair", "embedder_latency", "eval_lexical_scifact", "fair_share",
    "fuzz_snapshot", "grpc_floor", "guards_overhead", "hits_written", "hook_pressure", "hnsw_check",
    "hostile_grpc",
    "hostile_pages", "hostile_pdfs", "index_build", "many_bases", "metadata_filter", "page_limits",
    "policy_agreement", "profile_search", "quality_scifact", "quality_turns", "session_memory",
    "sidecar_proc", "soak", "source_filter", "summaries", "swap", "turn_breakdown",
    "turn_latency", "turn_text",
)  # fmt: skip


@pytest.mark.parametrize("name", MODULES)
def test_a_modules_help_is_plain_and_says_what_each_option_is(
    name: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    module = importlib.import_module(f"bench.{name}")
    parsers: list[argparse.ArgumentParser] = []

    def grab(self: argparse.ArgumentParser, *args: object, **kwargs: object) -> None:
        parsers.append(self)
        raise SystemExit(0)

    monkeypatch.setattr(argparse.ArgumentParser, "parse_args", grab)
    with pytest.raises(SystemExit):
        module.main(*([[]] if inspect.signature(module.main).parameters else []))
    (parser,) = parsers
    assert parser.description
    assert "``" not in parser.description
    assert parser.description.rstrip().endswith((".", ")")), parser.description
    for action in parser._actions:
        assert action.help, (name, action.dest)


class _Server:
    """The OpenAI-shaped server's process, not started."""

    def terminate(self) -> None: ...
    def wait(self, timeout: float) -> int:
        return 0


def test_the_turn_suite_prints_its_table_first_and_its_figures_only_to_the_json(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    caplog: pytest.LogCaptureFixture,
) -> None:
    """``python -m bench turn --quick`` printed each scenario's JSON on a line of its own before
    the table; a scenario's figures now go to the JSON file, and a line of them to the log. The
    sidecar runs are canned (one piece: the suite's loop and what it prints)."""
    from bench import turn_breakdown, turn_latency
    from sidecar.config import SidecarConfig

    data = tmp_path / "faq.json"
    data.write_text("[]")
    monkeypatch.setattr(turn_latency, "FAQ", data)
    monkeypatch.setattr(turn_latency, "DSTC11", data)
    monkeypatch.setattr(turn_latency, "workload", lambda quick: [["how do I split a pane"]])
    monkeypatch.setattr(turn_latency, "start_openai_server", lambda: (_Server(), 0))
    monkeypatch.setattr(turn_latency, "set_latency", lambda port, latency: None)
    config = argparse.Namespace(sidecar=SidecarConfig())
    monkeypatch.setattr(turn_latency, "write_config", lambda folder, name, port: config)
    monkeypatch.setattr(turn_latency, "build", lambda config, name: None)
    sample = turn_latency.Sample(12.0, 14.0, False, False, False, "how do I split a pane")

    async def canned(*_: object) -> turn_latency.Run:
        return turn_latency.Run([sample], [False])

    async def no_breakdown(quick: bool) -> dict[str, object]:
        return {"skipped": "not measured here"}

    monkeypatch.setattr(turn_latency, "run_scenario", canned)
    monkeypatch.setattr(turn_breakdown, "run", no_breakdown)
    with caplog.at_level(logging.INFO, logger="bench.turn_latency"):
        assert cli.main(["turn", "--quick", "--out", str(tmp_path)]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == "== turn (quick)"
    assert lines[-1].startswith(f"wrote {tmp_path / 'turn.json'}")
    assert not [line for line in lines if "{" in line], lines  # no JSON on stdout
    assert lines[1] == "calls: 1"  # the table comes first
    header = lines.index(next(line for line in lines if line.startswith("scenarios ")))
    assert lines[header + 2].split()[:3] == ["local_default", "local", "in"]
    logged = [r.getMessage() for r in caplog.records if r.name == "bench.turn_latency"]
    assert logged[0].startswith("local_default: 1 turns, p50 12.0 ms")
    saved = json.loads((tmp_path / "turn.json").read_text())
    assert saved["scenarios"]["local_default"]["p50_ms"] == 12.0


@pytest.mark.parametrize("suite", ["turn", "quality"])
def test_a_suite_without_its_data_prints_one_skipped_line(tmp_path: Path, suite: str) -> None:
    """As both READMEs say: one ``skipped: shared data not present: ...`` line (``turn`` printed
    ``scenarios: -`` and a blank line first, ``quality`` a line a part and a raw ``skip
    policy: {...}``)."""
    empty = tmp_path / "no-data"
    empty.mkdir()
    env = {**os.environ, "VOXRECALL_SHARED_DATA": str(empty)}
    run = subprocess.run(
        [sys.executable, "-m", "bench", suite, "--quick", "--out", str(tmp_path / "out")],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    lines = run.stdout.splitlines()
    assert lines[0] == f"== {suite} (quick)"
    assert lines[1].startswith(f"skipped: shared data not present: {empty}")
    assert lines[2].startswith("wrote ")
    assert len(lines) == 3, run.stdout


def test_a_list_of_counts_is_shown_whole_or_as_its_range_never_cut() -> None:
    """The shards table cut 16 shards' counts with ``~`` mid-number."""
    from bench import shards

    printed = cli.table({"balance": shards.balance()})
    for row in shards.balance().values():
        assert "[" + ", ".join(str(c) for c in row["counts"]) + "]" in printed
    assert "~" not in printed
    assert report.cell(list(range(1000))) == "1000 values, 0 to 999"
