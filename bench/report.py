"""The table ``python -m bench`` prints after a suite: every suite's JSON, read the same way.

Suites return different shapes (rows of systems, sizes or scenarios; per-variant figures as
parallel dicts; a few scalars), so the table is derived from the shape, not written per suite:

- a dict of dicts (``systems``, ``scenarios``, ``by_file``, ``results``) is a grid, one row per
  key; a row's nested dicts become rows of their own (``half filtered``), except ``setting``,
  shown as its ``ef_search`` (the ``ef`` column every search table in bench/README.md has);
- dicts of scalars with the same keys (``index``'s ``chunks_per_s``, ``cores_used``, ...) are one
  grid with a column each;
- anything else is a ``name: value`` line.

Columns are as wide as their widest cell, so headers never run together. Goals print their
verdict, or "not judged (quick)": ``--quick`` checks that a suite runs, never a timing.
"""

from __future__ import annotations

import json
from typing import Any

# what every JSON carries (bench/__main__.py) or a section printed its own way below
META = {"suite", "command", "machine", "quick", "elapsed_s", "goals", "env", "failures"}
OWN_WAY = {"conversations", "conversations_detail", "skip", "skipped", "versus_pgvector"}
CELL = 40  # a longer cell (a skip reason) is cut here: the JSON has it whole
# A list of numbers (a shard's counts) is shown whole up to this many characters (16 shards'
# counts of 10,000 names: ~100), and past them as its length and range, never cut mid-number.
NUMBERS_CELL = 120
NOT_JUDGED = "not judged (quick)"


def plain(doc: str | None) -> str:
    """A module docstring's first paragraph as a ``--help`` description: one sentence or more,
    without reST's double backquotes (argparse prints them raw)."""
    first = (doc or "").strip().split("\n\n")[0]
    return " ".join(first.replace("``", "").split())


def cell(value: Any, limit: int = CELL) -> str:
    """A value as a table shows it: floats to 4 digits, lists of numbers likewise, a setting as
    its ef, anything longer than ``limit`` cut (a grid's cells; a line of its own is not)."""
    if isinstance(value, float):
        return f"{value:.4g}"
    if isinstance(value, dict):  # a system's setting: its ef, if it has one
        return str(value.get("ef_search", "-"))
    if isinstance(value, list | tuple) and value and all(isinstance(v, float | int) for v in value):
        return _numbers(value, max(limit, NUMBERS_CELL))
    text = "-" if value is None else str(value)
    return text if len(text) <= limit else text[: limit - 1] + "~"


def _numbers(values: list[Any] | tuple[Any, ...], limit: int) -> str:
    """A list of numbers whole, or, longer than ``limit``, its length and range."""
    text = "[" + ", ".join(cell(v) for v in values) + "]"
    if len(text) <= limit:
        return text
    return f"{len(values)} values, {cell(min(values))} to {cell(max(values))}"


def grid(title: str, rows: dict[str, dict[str, Any]]) -> list[str]:
    """Rows under a header, each column as wide as its widest cell plus two spaces."""
    cols: list[str] = []
    for row in rows.values():
        cols += [c for c in row if c not in cols and not _skip_only(row)]
    if "setting" in cols:  # first, as the README's tables have it
        cols.remove("setting")
        cols.insert(0, "setting")
    heads = ["ef" if c == "setting" else c for c in cols]
    cells = {name: [cell(row.get(c)) for c in cols] for name, row in rows.items()}
    if not rows:  # a section of no rows prints its title alone
        return [title, ""]
    first = max(len(title), *(len(name) for name in rows)) + 2
    body = [cells[name] for name, row in rows.items() if not _skip_only(row)]
    widths = [max([len(h), *(len(c[i]) for c in body)]) + 2 for i, h in enumerate(heads)]
    lines = [f"{title:<{first}}" + "".join(f"{h:>{w}}" for h, w in zip(heads, widths, strict=True))]
    lines.append("-" * (first + sum(widths)))
    for name, row in rows.items():
        if _skip_only(row):
            lines.append(f"{name:<{first}}skipped: {row['skipped']}")
        else:
            values = zip(cells[name], widths, strict=True)
            lines.append(f"{name:<{first}}" + "".join(f"{v:>{w}}" for v, w in values))
    return [*lines, ""]


def _skip_only(row: dict[str, Any]) -> bool:
    return "skipped" in row and len(row) == 1


def _rows(section: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """A section's rows, a row's nested dicts (but ``setting``) as rows of their own."""
    rows: dict[str, dict[str, Any]] = {}
    for name, row in section.items():
        if not isinstance(row, dict):
            continue
        own = {k: v for k, v in row.items() if k == "setting" or not isinstance(v, dict)}
        if own:
            rows[str(name)] = own
        for sub, value in row.items():
            if sub != "setting" and isinstance(value, dict):
                rows[f"{name} {sub}"] = value
    return rows


def sections(result: dict[str, Any]) -> list[str]:
    """Every part of a result but the goals, as grids and ``name: value`` lines."""
    lines: list[str] = []
    scalars: list[str] = []
    parallel: dict[tuple[str, ...], dict[str, dict[str, Any]]] = {}
    for key, value in result.items():
        if key in META or key in OWN_WAY:
            continue
        if isinstance(value, dict) and isinstance(value.get("skipped"), str):
            lines.append(f"{key}: skipped: {value['skipped']}")
        elif isinstance(value, dict) and any(isinstance(v, dict) for v in value.values()):
            lines += grid(key, _rows(value))
        elif isinstance(value, dict) and value:
            parallel.setdefault(tuple(value), {})[key] = value
        elif not isinstance(value, list):
            scalars.append(f"{key}: {cell(value, limit=200)}")
    for keys, group in parallel.items():
        if len(group) > 1:  # the same keys: one grid, a column per dict
            lines += grid("", {k: {name: d[k] for name, d in group.items()} for k in keys})
        else:
            ((name, d),) = group.items()
            pairs = ", ".join(f"{k} {cell(v)}" for k, v in d.items())
            scalars.append(f"{name}: {pairs}")
    return scalars + ([""] if scalars else []) + lines


def unjudged(goals: dict[str, Any]) -> dict[str, Any]:
    """The goals of a ``--quick`` run, each with its value and ``met: null``: a smoke run's
    small sizes and short timings judge nothing (the JSON says so as the table does)."""
    return {
        name: goal if "met" not in goal else {**goal, "met": None, "verdict": NOT_JUDGED}
        for name, goal in goals.items()
    }


def goal_lines(result: dict[str, Any]) -> list[str]:
    """One line a goal: its value, the goal and the verdict (none for a quick run's)."""
    lines = []
    for name, goal in result.get("goals", {}).items():
        if goal.get("skipped"):
            lines.append(f"goal {name}: {goal['skipped']}")
            continue
        verdict = goal.get("verdict") or _verdict(goal.get("met"))
        lines.append(f"goal {name}: {cell(goal.get('value'))} (goal {goal.get('goal')}): {verdict}")
    return lines


def _verdict(met: object) -> str:
    return "not judged" if met is None else "met" if met else "MISSED"


def versus_lines(result: dict[str, Any]) -> list[str]:
    """The search suite's per-metric answer to "is it faster than pgvector here?"."""
    versus = result.get("versus_pgvector")
    if not isinstance(versus, dict):
        return []
    if "skipped" in versus:
        return [f"versus pgvector: {versus['skipped']}"]
    rows = {metric: row for metric, row in versus.items() if isinstance(row, dict)}
    quick = " (quick: a smoke run, not a measurement)" if result.get("quick") else ""
    title = f"versus pgvector ({versus['compared']})"
    return [*grid(title, rows), f"versus pgvector: {versus['verdict']}{quick}", ""]


def skip_lines(result: dict[str, Any]) -> list[str]:
    lines = []
    skip = result.get("skip")
    if isinstance(skip, dict) and "skipped" not in skip:  # skipped: the dstc11 line says so
        lines.append(f"skip policy: {json.dumps(skip)[:200]}")
    if "skipped" in result:
        lines.append(f"skipped: {result['skipped']}")
    return lines
