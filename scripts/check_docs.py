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
# `sidecar/engine.py`, `index/`, `proto/voxrecall/v1/retrieval.proto`: code spans that look like repo paths
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


def main() -> int:
    problems = []
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
