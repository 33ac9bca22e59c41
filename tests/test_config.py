"""Config mistakes get a message a person can act on: a misspelt key names the key it is closest
to, at every table, and a source's misspelt ``type`` is named as the unknown key it is."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from index.config import unknown_names
from index.errors import ConfigError
from sidecar.cli import main
from sidecar.config import load_config, parse_config

SOURCE = {"name": "help", "type": "markdown", "path": "kb"}


def config(**tables: Any) -> dict[str, Any]:
    """A valid config (one Markdown base) with ``tables`` merged in."""
    return {"knowledge_base": [{"name": "docs", "source": [dict(SOURCE)]}], **tables}


def kb_with(**keys: Any) -> dict[str, Any]:
    return {"knowledge_base": [{"name": "docs", "source": [dict(SOURCE)], **keys}]}


def source_with(**keys: Any) -> dict[str, Any]:
    return {"knowledge_base": [{"name": "docs", "source": [keys]}]}


def test_unknown_names_guess_the_closest_known_name_or_none() -> None:
    assert unknown_names(["max_result"], ["max_results", "min_score"]) == (
        "max_result (did you mean `max_results`?)"
    )
    assert unknown_names(["colour", "budgetms"], ["budget_ms"]) == (
        "colour, budgetms (did you mean `budget_ms`?)"
    )


@pytest.mark.parametrize(
    ("raw", "message"),
    [
        (
            config(sidecar={"max_result": 3}),
            "[sidecar]: unknown key(s) max_result (did you mean `max_results`?)",
        ),
        (config(sidcar={}), "unknown table(s) sidcar (did you mean `sidecar`?)"),
        (
            config(embedder={"batchsize": 8}),
            "[embedder]: unknown key(s) batchsize (did you mean `batch_size`?)",
        ),
        (
            config(index={"keep_version": 2}),
            "[index]: unknown key(s) keep_version (did you mean `keep_versions`?)",
        ),
        (
            config(sidecar={"skip": {"max_word": 3}}),
            "[sidecar.skip]: unknown key(s) max_word (did you mean `max_words`?)",
        ),
        (
            config(sidecar={"followups": {"enable": False}}),
            "[sidecar.followups]: unknown key(s) enable (did you mean `enabled`?)",
        ),
        (
            config(sidecar={"tls": {"cert": "c.pem"}}),
            "[sidecar.tls]: unknown key(s) cert (did you mean `cert_file`?)",
        ),
        (
            kb_with(hybird=True),
            "[[knowledge_base]] #1: unknown key(s) hybird (did you mean `hybrid`?)",
        ),
        (
            kb_with(sources=[]),  # the file's key is `source`, one table per source
            "[[knowledge_base]] #1: unknown key(s) sources (did you mean `source`?)",
        ),
        (
            kb_with(chunking={"target_token": 100}),
            "[chunking]: unknown key(s) target_token (did you mean `target_tokens`?)",
        ),
        (
            config(function=[{"name": "f", "description": "d", "knowledge_bas": "docs"}]),
            "[[function]] #1: unknown key(s) knowledge_bas (did you mean `knowledge_base`?)",
        ),
        (
            source_with(typ="markdown", path="kb"),
            "source #1: unknown key(s) typ (did you mean `type`?); type is required (one of "
            "markdown, ",
        ),
        (source_with(path="kb"), "source #1: type is required (one of markdown, "),
        (source_with(type="markdwn", path="kb"), "type 'markdwn' is not one of markdown, "),
        (
            source_with(type="jsonl", path="f.jsonl", text_feild="answer"),
            "unknown option(s) text_feild (did you mean `text_field`?) for type jsonl",
        ),
    ],
)
def test_a_config_typo_names_the_key_it_is_closest_to(
    tmp_path: Path, raw: dict[str, Any], message: str
) -> None:
    with pytest.raises(ConfigError) as info:
        parse_config(raw, base=tmp_path)
    assert message in str(info.value)


def test_the_cli_prints_the_guess_without_a_traceback(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "voxrecall.toml"
    path.write_text(
        '[[knowledge_base]]\nname = "docs"\n[[knowledge_base.source]]\ntyp = "markdown"\n'
        'path = "kb"\n'
    )
    with pytest.raises(ConfigError):
        load_config(path)
    assert main(["index", "build", "--config", str(path)]) == 2
    err = capsys.readouterr().err
    assert "unknown key(s) typ (did you mean `type`?)" in err
    assert "Traceback" not in err
