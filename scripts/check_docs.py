"""Check that every relative link and every `path` named in the Markdown docs exists.

    python scripts/check_docs.py

Architecture documents that name files which no longer exist mislead the next engineer; this
keeps ARCHITECTURE.md, README.md and docs/ true.
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DOCS = [
    "README.md",
    "ARCHITECTURE.md",
    "CHANGELOG.md",
    *sorted(str(p.relative_to(ROOT)) for p in (ROOT / "docs").glob("*.md")),
    "bench/README.md",
]
LINK = re.compile(r"\[[^\]]*\]\(([^)#\s]+)(?:#[^)]*)?\)")
# `sidecar/turn/engine.py`, `index/`, `proto/voxrecall/v1/retrieval.proto`: code spans that look like repo paths
CODE_PATH = re.compile(
    r"`((?:index|sidecar|proto|bench|tests|scripts|examples|docs|deploy|\.ci)/[\w./-]*)`"
)


def ignored(target: str) -> bool:
    """Outputs the project writes but never commits (bench/results/, caches) may be named."""
    rel = target.lstrip("/").rstrip("/")
    for candidate in (rel, f"{rel}/"):  # a folder pattern ("x/") matches only with the slash
        if (
            subprocess.run(
                ["git", "check-ignore", "-q", candidate], cwd=ROOT, check=False
            ).returncode
            == 0
        ):
            return True
    return False


# a row of ARCHITECTURE.md's folder table: | `sidecar/turn/` | ... `engine.py` ... |
TABLE_ROW = re.compile(r"^\| `((?:index|sidecar)(?:/[\w]+)*/)` \|(.*)\|$")


def folder_table_problems() -> list[str]:
    """Every package folder of index/ and sidecar/ has a row naming each of its modules."""
    rows = {}
    for line in (ROOT / "ARCHITECTURE.md").read_text(encoding="utf-8").splitlines():
        if m := TABLE_ROW.match(line):
            rows[m.group(1)] = m.group(2)
    problems = []
    for package in ("index", "sidecar"):
        for init in sorted((ROOT / package).rglob("__init__.py")):
            folder = init.parent.relative_to(ROOT).as_posix() + "/"
            if folder == "sidecar/gen/":
                continue
            if folder not in rows:
                problems.append(f"ARCHITECTURE.md: no row for `{folder}` in the folder table")
                continue
            for module in sorted(init.parent.glob("*.py")):
                if module.name != "__init__.py" and f"`{module.name}`" not in rows[folder]:
                    problems.append(
                        f"ARCHITECTURE.md: the `{folder}` row does not name `{module.name}`"
                    )
    return problems


def main() -> int:
    problems = folder_table_problems()
    for name in DOCS:
        doc = ROOT / name
        if not doc.is_file():
            continue
        text = doc.read_text(encoding="utf-8")
        for lineno, line in enumerate(text.splitlines(), 1):
            targets = [m.group(1) for m in LINK.finditer(line) if "://" not in m.group(1)]
            targets += [m.group(1) for m in CODE_PATH.finditer(line)]
            for target in targets:
                if "*" in target:
                    continue
                path = (
                    (doc.parent / target)
                    if not target.startswith("/")
                    else ROOT / target.lstrip("/")
                )
                if not path.exists() and not (ROOT / target).exists() and not ignored(target):
                    problems.append(f"{name}:{lineno}: {target} does not exist")
    for problem in problems:
        print(problem)
    print(f"docs: {len(problems)} broken reference(s)")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
