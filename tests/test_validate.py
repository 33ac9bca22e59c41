"""`voxrecall index validate` on small crafted docs folders, one problem of each kind."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from index.errors import shortened
from index.validate import (
    MANIFEST_NAME,
    MAX_SHOWN_TARGET,
    ValidateOptions,
    validate_docs,
    write_manifest,
)
from sidecar.cli import main
from tests.conftest import shared


def write(root: Path, files: dict[str, str | bytes]) -> Path:
    for rel, content in files.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        if isinstance(content, bytes):
            path.write_bytes(content)
        else:
            path.write_text(content, encoding="utf-8")
    return root


WIKI: dict[str, str | bytes] = {
    "_Sidebar.md": "- [Setup](Setup)\n- [Gone](Gone-Page)\n- [[Billing FAQ]]\n- [[Other Missing]]\n",
    "Setup.md": (
        "---\ntitle: Setup\n---\nLast updated: 2024-05-01\n\n"
        "See [billing](Billing-FAQ.md#refunds), [the guide](guide/), [home](/Setup),\n"
        "[site](https://example.com/x.md), [mail](mailto:a@b.c), [top](#setup),\n"
        "a [logo](/img/logo.svg) and [missing](nope.md).\n\n"
        "```\n[not a link](fenced.md)\n```\n\nInline `[code](code.md)` is not a link.\n"
    ),
    "Billing-FAQ.md": (
        "# Billing FAQ\n\n*Last updated: 2024-13-01*\n\nSee [setup](./Setup) and "
        "![diagram](img/diagram.png).\n\n[ref]: guide/missing-page\n"
    ),
    "guide/_index.md": "---\nlast_updated: 2024-02-02\n---\n# setup\n\nUp: [setup](../Setup.md).\n",
    "Notes.md": "# Notes\n\nNo date here.\n",
    "bad.md": b"# Bad\n\ncaf\xe9\n",
    "broken-front.md": "---\ntitle: [unclosed\n---\nBody.\n",
}


def lines(problems: list[object]) -> list[str]:
    return [str(p) for p in problems]


def test_each_problem_kind_with_file_and_line(tmp_path: Path) -> None:
    root = write(tmp_path / "wiki", WIKI)
    options = ValidateOptions(("Home.md", "_Sidebar.md"), require_last_updated=True)
    report = validate_docs(root, options)
    assert lines(report.problems) == [
        "Billing-FAQ.md:3: 'Last updated' date '2024-13-01' is not YYYY-MM-DD",
        "Billing-FAQ.md:5: broken link: img/diagram.png (no such file)",
        "Billing-FAQ.md:7: broken link: guide/missing-page (no such page)",
        "Home.md:1: required file is missing",
        "Notes.md:1: missing 'Last updated: YYYY-MM-DD'",
        "Setup.md:8: broken link: nope.md (no such page)",
        "_Sidebar.md:2: sidebar links to a missing page: Gone-Page (no such page)",
        "_Sidebar.md:4: sidebar links to a missing page: Other Missing (no such page)",
        "bad.md:1: unreadable page: not valid UTF-8: invalid continuation byte at byte 10",
        "broken-front.md:2: unreadable page: malformed frontmatter: expected ',' or ']', "
        "but got '<stream end>' (line 2)",
        "guide/_index.md:4: duplicate title 'setup' (also Setup.md)",
    ]
    assert report.counts() == {
        "last-updated": 2,
        "broken-link": 3,
        "required-file": 1,
        "sidebar-link": 2,
        "unreadable": 2,
        "duplicate-title": 1,
    }
    dates = {p.path: p.last_updated for p in report.pages}
    assert dates == {
        "Billing-FAQ.md": None,
        "Notes.md": None,
        "Setup.md": "2024-05-01",
        "guide/_index.md": "2024-02-02",
    }


def test_nothing_required_means_fewer_problems(tmp_path: Path) -> None:
    root = write(tmp_path / "wiki", WIKI)
    kinds = validate_docs(root).counts()
    assert "required-file" not in kinds
    assert kinds["last-updated"] == 1  # a malformed date is always a problem


def test_stale_manifest(tmp_path: Path) -> None:
    root = write(tmp_path / "docs", {"a.md": "# A\n", "b.md": "# B\n", "c.md": "# C\n"})
    written = write_manifest(root, validate_docs(root).pages)
    manifest = json.loads(written.read_text())
    assert manifest["generated_at"].endswith("Z")
    assert [p["path"] for p in manifest["pages"]] == ["a.md", "b.md", "c.md"]
    assert manifest["pages"][0] == {
        "path": "a.md",
        "title": "A",
        "fingerprint": manifest["pages"][0]["fingerprint"],
        "last_updated": None,
    }
    assert len(manifest["pages"][0]["fingerprint"]) == 12
    assert validate_docs(root).problems == []

    (root / "a.md").write_text("# A\n\nEdited.\n")
    (root / "c.md").unlink()
    (root / "d.md").write_text("# D\n")
    text = written.read_text().split("\n")
    a_line = next(i for i, line in enumerate(text, 1) if '"path": "a.md"' in line)
    c_line = next(i for i, line in enumerate(text, 1) if '"path": "c.md"' in line)
    assert lines(validate_docs(root).problems) == [
        f"{MANIFEST_NAME}:1: stale manifest: d.md is not listed",
        f"{MANIFEST_NAME}:{a_line}: stale manifest: a.md changed since it was written (fingerprint)",
        f"{MANIFEST_NAME}:{c_line}: stale manifest: lists c.md, which no longer exists",
    ]


def test_hugo_site_links(tmp_path: Path) -> None:
    root = write(
        tmp_path / "docs",
        {
            "content/flags.md": "# Flags\n",
            "content/commands/copy.md": "# copy\n\nSee [flags](/flags/) and [sync](../sync/).\n",
            "content/commands/sync.md": "# sync\n",
            "content/a.md": (
                '# A\n\n[ok](/commands/copy/) [asset](/img/x.png) {{< img src="/gone/" >}}\n'
                "[hugo-relative](commands/copy/) [file-relative](commands/copy.md)\n"
            ),
        },
    )
    assert lines(validate_docs(root).problems) == [
        "content/a.md:4: broken link: commands/copy/ (no such page: Hugo resolves it from /a/)"
    ]


def test_cli_exit_codes_and_manifest(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    root = write(tmp_path / "wiki", WIKI)
    assert main(["index", "validate", str(root), "--require", "Home.md", "_Sidebar.md"]) == 1
    out = capsys.readouterr().out.splitlines()
    assert f"{root}/Home.md:1: required file is missing" in out
    assert all(line.startswith(f"{root}/") and line.count(":") >= 2 for line in out)

    clean = write(tmp_path / "clean", {"Home.md": "# Home\n\nLast updated: 2025-01-31\n"})
    assert main(["index", "validate", str(clean), "--require-last-updated"]) == 0
    assert main(["index", "validate", str(clean), "--write-manifest"]) == 0
    assert (clean / MANIFEST_NAME).is_file()
    (clean / "Home.md").write_text("# Home\n\nLast updated: 2025-02-01\n")
    assert main(["index", "validate", str(clean)]) == 1
    assert "stale manifest: Home.md changed" in capsys.readouterr().out
    assert main(["index", "validate", str(clean), "--write-manifest"]) == 0


def test_cli_reads_options_from_the_config(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    docs = write(tmp_path / "docs", {"Home.md": "# Home\n"})
    config = tmp_path / "voxrecall.toml"
    config.write_text(
        '[[knowledge_base]]\nname = "kb"\n[[knowledge_base.source]]\ntype = "markdown"\n'
        'path = "docs"\nrequired_files = ["_Sidebar.md"]\nrequire_last_updated = true\n'
    )
    assert main(["index", "validate", "--config", str(config)]) == 1
    out = capsys.readouterr().out
    assert "_Sidebar.md:1: required file is missing" in out
    assert "Home.md:1: missing 'Last updated: YYYY-MM-DD'" in out
    assert main(["index", "validate", str(docs)]) == 0  # without the config: nothing required


def test_rclone_docs(tmp_path: Path) -> None:
    """The real rclone docs (a Hugo site): its few genuinely broken links are found."""
    docs = shared("docs-rclone", "docs")
    report = validate_docs(docs)
    assert len(report.pages) == 193
    broken = {(p.path, p.line) for p in report.problems if p.kind == "broken-link"}
    assert ("content/bisync.md", 326) in broken  # [--check-filename](--check-filename)
    assert ("content/webdav.md", 488) in broken  # relative link that Hugo serves under /webdav/
    assert set(report.counts()) <= {"broken-link", "duplicate-title"}


def test_lines_that_made_the_link_patterns_backtrack_are_read_in_linear_time(
    tmp_path: Path,
) -> None:
    # a line of backticks backtracked in cubic time (1,000 took 15 s), shortcode openings and
    # link targets with no ")" after them in quadratic time (minutes at these sizes)
    hostile = [
        "x " + "`" * 3_000,  # (at the start of a line, a fence)
        "`a" * 50_000,
        "{{<" * 50_000,
        "[a](x" * 50_000,
        "[a](" + "<" * 100_000,
    ]
    page = "# Hostile\n\n" + "\n".join(hostile) + "\n\nSee [gone](gone.md) and `[code](code.md)`.\n"
    root = write(tmp_path / "docs", {"hostile.md": page, "ok.md": "# OK\n\nFine.\n"})
    report = validate_docs(root)
    assert lines(report.problems) == ["hostile.md:9: broken link: gone.md (no such page)"]


@pytest.mark.parametrize(
    ("line", "links"),
    [
        ("`[a](a.md)` [b](b.md)", ["b.md"]),
        ("``[a](a.md)`` [b](b.md) ``", ["b.md"]),
        ("``[a](a.md)` [b](b.md)", ["a.md", "b.md"]),  # a run of two is closed by two only
        ("`x``[a](a.md)``y` [b](b.md)", ["b.md"]),  # the span holds the run of two
        ("{{< ref [a](a.md) >}} [b](b.md) {{% x %}}", ["b.md"]),
        (">}} {{< [b](b.md)", ["b.md"]),  # a closing before the opening closes nothing
    ],
)
def test_code_spans_and_shortcodes_hide_their_links(
    tmp_path: Path, line: str, links: list[str]
) -> None:
    root = write(tmp_path / "docs", {"page.md": f"# Page\n\n{line}\n"})
    report = validate_docs(root)
    assert sorted(p.message.split(": ")[1].split(" ")[0] for p in report.problems) == links


def test_a_manifest_nested_past_the_recursion_limit_is_reported_stale(tmp_path: Path) -> None:
    # json.loads recursed once per level: RecursionError, which is no ValueError, escaped
    root = write(tmp_path / "docs", {"a.md": "# A\n\nText.\n", MANIFEST_NAME: "[" * 100_000})
    report = validate_docs(root)
    assert [(p.path, p.kind) for p in report.problems] == [(MANIFEST_NAME, "stale-manifest")]
    assert report.problems[0].message.startswith("stale manifest: unreadable (maximum recursion")


def test_a_link_target_too_long_for_a_file_name_is_a_broken_link_shown_short(
    tmp_path: Path,
) -> None:
    # the file system's "File name too long" (which pathlib's is_file does not swallow) stopped
    # the validation with a traceback; the problem line carried the 5,000 characters
    target = "a" * 5_000 + ".md"
    root = write(tmp_path / "docs", {"two.md": f"# Two\n\n[x]({target})\n"})
    shown = shortened(target, MAX_SHOWN_TARGET)
    assert shown.endswith(" [... cut from 5003 bytes]")
    assert lines(validate_docs(root).problems) == [
        f"two.md:3: broken link: {shown} (no such page (File name too long))"
    ]


def test_a_hugo_site_s_page_outside_content_has_its_links_checked(tmp_path: Path) -> None:
    # its link's base is not under content/: relative_to's ValueError stopped the validation
    root = write(
        tmp_path / "docs",
        {"content/x.md": "# X\n", "other/y.md": "# Y\n\n[gone](nothere)\n"},
    )
    assert lines(validate_docs(root).problems) == [
        "other/y.md:3: broken link: nothere (no such page)"
    ]


def test_each_of_thousands_of_stale_manifest_entries_is_named_at_its_line(tmp_path: Path) -> None:
    # each stale entry's line was found by scanning the file again (10,000 took 11 s): now
    # read once, every entry still at its own line
    root = write(tmp_path / "docs", {"a.md": "# A\n"})
    pages = [{"path": f"gone/{i}.md", "title": "", "fingerprint": "", "last_updated": None}
             for i in range(20_000)]  # fmt: skip
    (root / MANIFEST_NAME).write_text(json.dumps({"pages": pages}, indent=2))
    problems = validate_docs(root).problems
    stale = {p.message: p.line for p in problems if "no longer exists" in p.message}
    assert len(stale) == 20_000
    assert stale["stale manifest: lists gone/0.md, which no longer exists"] == 4
    assert stale["stale manifest: lists gone/19999.md, which no longer exists"] == 4 + 6 * 19_999
