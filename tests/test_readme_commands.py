"""The README's commands work as written against examples/voxrecall.toml: each base a command
names is one of its bases, and the Commands table gives every flag of the commands it lists
whole."""

from __future__ import annotations

import argparse
import re
from pathlib import Path

import pytest

from sidecar.cli import parser
from sidecar.config import load_config

REPO = Path(__file__).resolve().parents[1]
README = (REPO / "README.md").read_text(encoding="utf-8")
TABLE = README.split("\n## Commands", 1)[1].split("\n## ", 1)[0]
# Rows that give every flag (ask's points at the connection settings above it instead).
WHOLE_ROWS = ["serve", "index build", "index validate", "index watch", "index rollback"]


def named_bases() -> set[str]:
    """The bases the README's commands name: ``--kb NAME``, ``/rebuild/NAME``, ``store/NAME/``
    (placeholders in capitals left out)."""
    found = re.findall(r"--kb ([a-z0-9][a-z0-9._-]*)", README)
    found += re.findall(r"/rebuild/([a-z0-9][a-z0-9._-]*)", README)
    found += re.findall(r"\bstore/([a-z0-9][a-z0-9._-]*)/", README)
    return set(found)


def test_every_base_the_readme_names_is_one_of_the_example_configs() -> None:
    bases = {kb.name for kb in load_config(REPO / "examples" / "voxrecall.toml").knowledge_bases}
    named = named_bases()
    assert named, "the README names no base: the pattern went stale"
    assert named <= bases, f"the README names {sorted(named - bases)}; the example has {bases}"


def subparser(command: str) -> argparse.ArgumentParser:
    found = parser()
    for word in command.split():
        (action,) = (a for a in found._actions if isinstance(a, argparse._SubParsersAction))
        found = action.choices[word]
    return found


@pytest.mark.parametrize("command", WHOLE_ROWS)
def test_the_commands_table_gives_every_flag(command: str) -> None:
    (row,) = [line for line in TABLE.splitlines() if line.startswith(f"| `voxrecall {command} ")]
    flags = [
        option
        for action in subparser(command)._actions
        for option in action.option_strings
        if option.startswith("--") and option != "--help"
    ]
    missing = [flag for flag in flags if not re.search(rf"{flag}\b(?!-)", row)]
    assert not missing, f"README's row of `voxrecall {command}` lacks {missing}"
