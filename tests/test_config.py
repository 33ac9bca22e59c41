"""Config mistakes get a message a person can act on: a misspelt key names the key it is closest
to, at every table, and a source's misspelt ``type`` is named as the unknown key it is."""

from __future__ import annotations

from pathlib import Path
from typing import Any, get_type_hints

import pytest

from index.config import (
    MAX_SOURCE_NAMES_BYTES,
    ChunkingConfig,
    EmbedderConfig,
    HnswConfig,
    IndexConfig,
    LlmConfig,
    RerankConfig,
    quoted,
    unknown_names,
)
from index.errors import ConfigError
from sidecar.cli import main
from sidecar.config import (
    HttpConfig,
    SidecarConfig,
    SkipConfig,
    load_config,
    parse_config,
)

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


DOCS_BASE = '[[knowledge_base]]\nname = "docs"\n[[knowledge_base.source]]\n'


def _build_refused(path: Path, text: str, capsys: pytest.CaptureFixture[str]) -> str:
    """What ``voxrecall index build`` prints when refusing the config ``text``, written at
    ``path`` (it exits 2)."""
    path.write_text(text)
    with pytest.raises(ConfigError):
        load_config(path)
    assert main(["index", "build", "--config", str(path)]) == 2
    return capsys.readouterr().err


def test_the_cli_prints_the_guess_without_a_traceback(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "voxrecall.toml"
    err = _build_refused(path, DOCS_BASE + 'typ = "markdown"\npath = "kb"\n', capsys)
    assert "unknown key(s) typ (did you mean `type`?)" in err
    assert "Traceback" not in err


@pytest.mark.parametrize(
    ("text", "message"),
    [
        (DOCS_BASE.replace("[[knowledge_base.source]]", "[knowledge_base.source]")
         + 'type = "markdown"\npath = "kb"\n',
         "source must be an array of tables [[knowledge_base.source]]"),
        ('[[knowledge_base]]\nname = "docs"\nsource = "kb"\n',
         "source must be an array of tables [[knowledge_base.source]]"),
        ("knowledge_base = [1]\n", "#1: must be a table [[knowledge_base]], got 1"),
        ('[[knowledge_base]]\nname = "docs"\nsource = [1]\n',
         "source #1: must be a table [[knowledge_base.source]], got 1"),
        (DOCS_BASE + 'name = ["x"]\ntype = "markdown"\npath = "kb"\n',
         "source #1: name must be a string, got ['x']"),
        (DOCS_BASE + 'name = 5\ntype = "url"\nurls = ["http://127.0.0.1:9/x"]\n',
         "source #1: name must be a string, got 5"),
        (DOCS_BASE.replace('"docs"', '"../escaped"') + 'type = "markdown"\npath = "kb"\n',
         "name '../escaped' must be one folder's name (no '/' or NUL, not starting with '.', "
         "255 bytes at most): it names the base's folder in the store"),
        (DOCS_BASE + 'type = "markdown"\npath = "kb"\n'
         + "[knowledge_base.chunking]\ntarget_tokens = 8192\noverlap_tokens = 8191\n",
         "[chunking]: overlap_tokens (8191) must be at most half of target_tokens (8192)"),
        ("a = " + "[" * 5_000 + "]" * 5_000 + "\n",
         "not valid TOML: arrays or tables nested too deeply"),
        ("a = " + "{b=" * 5_000 + "1" + "}" * 5_000 + "\n",
         "not valid TOML: arrays or tables nested too deeply"),
    ],
)  # fmt: skip
def test_a_config_of_the_wrong_shape_is_refused_in_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], text: str, message: str
) -> None:
    # each was a traceback (AttributeError, TypeError, ValueError, RecursionError), and a base
    # named "../escaped" published its snapshot outside the store
    err = _build_refused(tmp_path / "voxrecall.toml", text, capsys)
    assert err.startswith("error: ")
    assert err.count("\n") == 1
    assert message in err
    assert not (tmp_path / "escaped").exists()


@pytest.mark.parametrize("url", ["http://[::1/x", "http://h:99999/x", "http://h:port/x"])
def test_a_url_source_s_url_that_cannot_be_parsed_is_refused_in_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], url: str
) -> None:
    # urlsplit's ValueError was a traceback
    path = tmp_path / "voxrecall.toml"
    path.write_text(DOCS_BASE + f'type = "url"\nurls = ["{url}"]\n')
    assert main(["index", "build", "--config", str(path)]) == 2
    assert capsys.readouterr().err == f"error: source 'url': {url!r} is not an http(s) URL\n"


@pytest.mark.parametrize("name", ["../escaped", "a/b", "..", ".embedding-cache", "é" * 128, "a\0b"])
def test_a_base_name_that_is_not_one_folder_s_name_is_refused(tmp_path: Path, name: str) -> None:
    with pytest.raises(ConfigError, match="must be one folder's name"):
        parse_config(kb_with(name=name), base=tmp_path)


def test_base_names_of_spaces_and_letters_of_any_script_stay_valid(tmp_path: Path) -> None:
    # bases named so built and published before the name was checked: still read
    names = ["support kb", "FAQ (en)", "café", "_internal"]
    raw = {"knowledge_base": [{"name": n, "source": [dict(SOURCE)]} for n in names]}
    assert [kb.name for kb in parse_config(raw, base=tmp_path).knowledge_bases] == names


def test_a_config_file_that_is_a_folder_or_not_utf8_is_refused_in_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    folder = tmp_path / "folder.toml"
    folder.mkdir()
    assert main(["index", "build", "--config", str(folder)]) == 2
    assert capsys.readouterr().err == (
        f"error: config file {folder} cannot be read: Is a directory\n"
    )
    (tmp_path / "latin.toml").write_bytes(b'a = "\xff"\n')
    assert main(["index", "build", "--config", str(tmp_path / "latin.toml")]) == 2
    err = capsys.readouterr().err
    assert err == f"error: {tmp_path / 'latin.toml'}: not UTF-8 (TOML is): byte 5\n"


def _numeric_keys(cls: type) -> list[str]:
    return [k for k, t in get_type_hints(cls).items() if t in (int, float)]


def _placed(table: str, key: str, value: object) -> dict[str, Any]:
    """A valid config with ``key = value`` in ``table`` (a dotted table name)."""
    if table == "knowledge_base.rerank":
        return kb_with(rerank={"base_url": "http://127.0.0.1:1", key: value})
    if table.startswith("knowledge_base."):
        return kb_with(**{table.split(".")[1]: {key: value}})
    if table == "index.llm":
        return config(index={"llm": {key: value}})
    if "." in table:
        outer, inner = table.split(".")
        return config(**{outer: {inner: {key: value}}})
    return config(**{table: {key: value}})


EVERY_NUMBER = [
    (table, key)
    for table, cls in (
        ("sidecar", SidecarConfig),
        ("sidecar.http", HttpConfig),
        ("sidecar.skip", SkipConfig),
        ("embedder", EmbedderConfig),
        ("index", IndexConfig),
        ("index.llm", LlmConfig),
        ("knowledge_base.chunking", ChunkingConfig),
        ("knowledge_base.hnsw", HnswConfig),
        ("knowledge_base.rerank", RerankConfig),
    )
    for key in _numeric_keys(cls)
]


@pytest.mark.parametrize(("table", "key"), EVERY_NUMBER)
@pytest.mark.parametrize("value", ["150ms", -(10**9), float("nan"), True])
def test_every_number_of_every_table_is_checked_where_the_file_is_read(
    tmp_path: Path, table: str, key: str, value: object
) -> None:
    """A wrong type or a value out of range stops the parse with the key's name, never later on
    the first call that reads it (``budget_ms = "150ms"`` served, then failed every Turn)."""
    with pytest.raises(ConfigError) as info:
        parse_config(_placed(table, key, value), base=tmp_path)
    assert f" {key} " in f" {info.value} "


@pytest.mark.parametrize(("table", "key"), EVERY_NUMBER)
@pytest.mark.parametrize("value", [2**63 - 1, 1e308])
def test_every_number_of_every_table_has_a_top(
    tmp_path: Path, table: str, key: str, value: object
) -> None:
    """Attack s17 F5: 2**63-1 and 1e308 were taken by most keys: ``threads = 100000`` grew a
    sidecar to 17,000 threads without serving, ``http_timeout_s = 1e308`` overflowed every
    request's timer. Every number is refused past a top, in one line naming the key."""
    with pytest.raises(ConfigError) as info:
        parse_config(_placed(table, key, value), base=tmp_path)
    assert f" {key} " in f" {info.value} "
    assert "\n" not in str(info.value)


@pytest.mark.parametrize(
    ("raw", "message"),
    [
        (
            config(embedder={"threads": 100_000}),
            "[embedder]: threads must be from 1 to 64 (threads per inference), got 100000",
        ),
        (
            config(embedder={"threads": 2**63 - 1}),
            "[embedder]: threads must be from 1 to 64 (threads per inference), "
            "got 9223372036854775807",
        ),
        (
            config(sidecar={"http_timeout_s": 1e308}),
            "[sidecar]: http_timeout_s must be > 0 and <= 3600 (seconds), got 1e+308",
        ),
        (
            config(sidecar={"http_download_timeout_s": 1e308}),
            "[sidecar]: http_download_timeout_s must be > 0 and <= 86400 (seconds), got 1e+308",
        ),
        (
            config(sidecar={"cache_dir": "\0"}),
            "[sidecar] cache_dir: a path cannot hold a NUL byte (\\u0000), got '\\x00'",
        ),
        (
            config(sidecar={"store": "http://127.0.0.1:1/\0"}),
            "[sidecar]: store cannot hold a NUL byte, got 'http://127.0.0.1:1/\\x00'",
        ),
        (
            config(index={"store": "st\0re"}),
            "[index] store: a path cannot hold a NUL byte (\\u0000), got 'st\\x00re'",
        ),
        (
            config(sidecar={"budget_ms": "x" * 5000}),
            f"[sidecar]: budget_ms must be a whole number, got '{'x' * 64}...'",
        ),
        (
            config(sidecar={"listen": "1" * 5000}),
            f"[sidecar]: listen must be host:port, e.g. 127.0.0.1:50051 or "
            f"unix:/run/voxrecall.sock, got '{'1' * 64}...'",
        ),
    ],
)
def test_the_attacks_values_are_refused_in_one_bounded_line(
    tmp_path: Path, raw: dict[str, Any], message: str
) -> None:
    """Attack s17 F5/F6: each was taken and then never served, ran away or ended in a
    traceback (a NUL byte: ``ValueError: embedded null byte``), or quoted a 5,000-character
    value whole."""
    with pytest.raises(ConfigError) as info:
        parse_config(raw, base=tmp_path, path=tmp_path / "t.toml")
    assert str(info.value) == f"{tmp_path / 't.toml'} {message}"


@pytest.mark.parametrize(
    ("table", "where"),
    [
        ("embedder", "[embedder]"),
        ("index.llm", "[index.llm]"),
        ("knowledge_base.rerank", "[rerank]"),
    ],
)
def test_an_api_key_in_the_file_is_refused_naming_its_env_key(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, table: str, where: str
) -> None:
    """docs/config.md: the key never goes in the file. It was taken, then replaced by the
    variable's (unset: no key) without a word."""
    monkeypatch.setenv("OPENAI_API_KEY", "sk-from-the-environment")
    with pytest.raises(ConfigError) as info:
        parse_config(_placed(table, "api_key", "sk-test-1234567890"), base=tmp_path)
    said = str(info.value)
    assert said.endswith(
        f"{where}: api_key: a secret never goes in the file: put it in an environment variable "
        "and name that with api_key_env"
    )
    assert "sk-" not in said


def test_an_openai_embedder_key_in_the_file_is_refused_in_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "voxrecall.toml"
    embedder = '[embedder]\nprovider = "openai"\napi_key = "sk-test-1234567890"\n'
    err = _build_refused(path, embedder + DOCS_BASE + 'type = "markdown"\npath = "kb"\n', capsys)
    assert err == (
        f"error: {path} [embedder]: api_key: a secret never goes in the file: put it in an "
        "environment variable and name that with api_key_env\n"
    )


@pytest.mark.parametrize(
    ("sidecar", "message"),
    [
        ({"budget_ms": "150ms"}, "[sidecar]: budget_ms must be a whole number, got '150ms'"),
        ({"budget_ms": -5}, "[sidecar]: budget_ms must be from 1 to 10000"),
        ({"min_score": 3}, "[sidecar]: min_score must be from -1 to 1"),
        ({"listen": "50051"}, "[sidecar]: listen must be host:port"),
        ({"log_format": "xml"}, '[sidecar]: log_format must be "json" or "text"'),
        ({"default_knowledge_base": "nope"}, "default_knowledge_base 'nope' is not a configured"),
        ({"s3_region": 5}, "[sidecar]: s3_region must be a string, got 5"),
    ],
)
def test_a_bad_sidecar_value_names_the_key_the_value_and_what_is_allowed(
    tmp_path: Path, sidecar: dict[str, Any], message: str
) -> None:
    with pytest.raises(ConfigError) as info:
        parse_config(config(sidecar=sidecar), base=tmp_path)
    assert message in str(info.value)


@pytest.mark.parametrize(
    ("raw", "message"),
    [
        (
            config(embedder={"provider": "locl"}),
            '[embedder]: provider must be "local" or "openai", got \'locl\'',
        ),
        (
            config(sidecar={"log_level": "debug"}),
            '[sidecar]: log_level must be "DEBUG" or "INFO" or "WARNING" or "ERROR", got \'debug\'',
        ),
        (
            config(sidecar={"workers": 0}),
            "[sidecar]: workers must be from 1 to 64 (processes, each holding every snapshot), "
            "got 0",
        ),
        (
            config(sidecar={"max_session_bytes": 1000}),
            "[sidecar]: max_session_bytes must be from 32768 to 67108864 (room for the longest turn), "
            "got 1000",
        ),
        (
            config(sidecar={"session_memory_bytes": 40000}),
            "[sidecar]: session_memory_bytes must be from 65536 to 68719476736 (at least "
            "max_session_bytes, so one session fits), got 40000",
        ),
        (
            config(sidecar={"tool_output_chars": 100}),
            "[sidecar]: tool_output_chars must be from 200 to 1000000 (characters), got 100",
        ),
        (
            config(sidecar={"http": {"max_body_bytes": 1000}}),
            "[sidecar.http]: max_body_bytes must be from 4096 to 67108864 (bytes), got 1000",
        ),
        (
            config(sidecar={"max_message_bytes": 10}),
            "[sidecar]: max_message_bytes must be from 65536 to 67108864, got 10",
        ),
    ],
)
def test_a_refusal_names_the_value_given_in_the_loaders_one_shape(
    tmp_path: Path, raw: dict[str, Any], message: str
) -> None:
    """docs/config.md: one line naming the key, the value and what is allowed, each as
    ``<file> [table]: key must be X, got Y`` (these said what was allowed only)."""
    with pytest.raises(ConfigError) as info:
        parse_config(raw, base=tmp_path, path=tmp_path / "t.toml")
    assert str(info.value) == f"{tmp_path / 't.toml'} {message}"


@pytest.mark.parametrize(
    "listen", ["unix:/run/voxrecall.sock", "unix:voxrecall.sock", "unix-abstract:voxrecall"]
)
def test_listen_on_a_unix_socket_is_accepted_from_the_file_and_the_flag(
    tmp_path: Path, listen: str
) -> None:
    """A pod-local sidecar on a unix socket, as gRPC binds it and connection.py dials it."""
    assert parse_config(config(sidecar={"listen": listen}), base=tmp_path).sidecar.listen == listen
    flagged = parse_config(config(), base=tmp_path).with_overrides(listen=listen)
    assert flagged.sidecar.listen == listen


@pytest.mark.parametrize(
    "listen", ["127.0.0.1:\u0665\u0660", "::1:50051", "unix:", "localhost:65536", "50051"]
)
def test_a_listen_grpc_cannot_bind_is_refused_from_the_file_and_the_flag(
    tmp_path: Path, listen: str
) -> None:
    """Another script's digits (``int`` reads them, gRPC does not), an unbracketed IPv6 host
    with a port, a socket without a path: refused at start, ``--listen`` as the file."""
    with pytest.raises(ConfigError, match="listen must be host:port"):
        parse_config(config(sidecar={"listen": listen}), base=tmp_path)
    with pytest.raises(ConfigError, match="--listen must be host:port"):
        parse_config(config(), base=tmp_path).with_overrides(listen=listen)


@pytest.mark.parametrize(("port", "workers"), [(65535, 2), (65530, 7)])
def test_every_workers_metrics_port_is_checked_at_load(
    tmp_path: Path, port: int, workers: int
) -> None:
    """Worker i serves metrics on the port + i: past 65535 is one error line at load, not a
    traceback from the last worker once it has loaded."""
    sidecar = {"metrics_listen": f"127.0.0.1:{port}", "workers": workers}
    with pytest.raises(ConfigError, match="over 65535 for the last of"):
        parse_config(config(sidecar=sidecar), base=tmp_path)
    sidecar["workers"] = workers - 1
    assert parse_config(config(sidecar=sidecar), base=tmp_path).sidecar.workers == workers - 1


@pytest.mark.parametrize("command", [["serve"], ["index", "build"]])
def test_serve_and_build_refuse_a_bad_value_in_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], command: list[str]
) -> None:
    path = tmp_path / "voxrecall.toml"
    path.write_text(
        '[[knowledge_base]]\nname = "docs"\n[[knowledge_base.source]]\ntype = "markdown"\n'
        'path = "kb"\n[sidecar]\nbudget_ms = "150ms"\n'
    )
    assert main([*command, "--config", str(path)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ")
    assert err.count("\n") == 1
    assert "budget_ms must be a whole number, got '150ms'" in err


@pytest.mark.parametrize(
    ("table", "line", "says"),
    [
        ("sidecar", 'cache_dir = "\\u0000"', "cache_dir: a path cannot hold a NUL byte"),
        ("embedder", "threads = 9223372036854775807", "threads must be from 1 to 64"),
    ],
)
def test_serve_refuses_the_attacks_start_values_in_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], table: str, line: str, says: str
) -> None:
    """Attack s17 F5: a NUL byte and 2**63-1 threads ended serve in a traceback (``embedded
    null byte``, onnxruntime's ``incompatible function arguments``). (100000 threads, which
    served nothing while the process grew without end, is checked on the parse alone: run
    through serve, a regression would not end.)"""
    path = tmp_path / "voxrecall.toml"
    path.write_text(
        '[[knowledge_base]]\nname = "docs"\n[[knowledge_base.source]]\ntype = "markdown"\n'
        f'path = "kb"\n[{table}]\n{line}\n'
    )
    assert main(["serve", "--config", str(path)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ")
    assert err.count("\n") == 1
    assert says in err


def test_no_config_file_says_to_pass_config(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    assert main(["serve"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: config file not found: voxrecall.toml: pass --config")


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"follow_symlinks": "yes"}, "follow_symlinks must be true or false, got 'yes'"),
        ({"max_page_bytes": "8MB"}, "max_page_bytes must be a whole number, got '8MB'"),
        ({"required_files": "a.md"}, "required_files must be a list of strings, got 'a.md'"),
        ({"clean": 1}, "clean must be true or false, got 1"),
    ],
)
def test_a_source_options_type_is_checked_where_the_file_is_read(
    tmp_path: Path, options: dict[str, Any], message: str
) -> None:
    """A folder's option is read by the build: ``follow_symlinks = "yes"`` was taken as true,
    and the sidecar, which reads no source, started with any of them."""
    with pytest.raises(ConfigError) as info:
        parse_config(source_with(**SOURCE, **options), base=tmp_path)
    assert message in str(info.value)


# A source type taking each numeric option, and what its refusal says is allowed.
SOURCE_NUMBERS = [
    ({"type": "markdown", "path": "kb"}, "max_page_bytes", "from 1 to 1073741824 (bytes)"),
    ({"type": "image", "path": "kb"}, "max_image_bytes", "from 1 to 1073741824 (bytes)"),
]


@pytest.mark.parametrize(("source", "key", "allowed"), SOURCE_NUMBERS)
@pytest.mark.parametrize("value", [2**63 - 1, -1])
def test_every_number_of_a_source_has_a_top_checked_where_the_file_is_read(
    tmp_path: Path, source: dict[str, Any], key: str, allowed: str, value: float
) -> None:
    """Attack s18: max_page_bytes and max_image_bytes were the numbers without a top (2**63-1
    taken), their low end checked only when a build read the source."""
    with pytest.raises(ConfigError) as info:
        parse_config(source_with(name="help", **source, **{key: value}), base=tmp_path)
    assert str(info.value) == (
        f"<config> [[knowledge_base]] #1: source 'help': {key} must be {allowed}, "
        f"got {quoted(value)}"
    )


def test_a_url_sources_refresh_has_no_top_and_is_refused_below_zero_where_the_file_is_read(
    tmp_path: Path,
) -> None:
    """``refresh`` has no top (nothing is sized by it; configs with years in it loaded before
    tops came); a negative one is refused when the file is read, not when a build reaches it."""
    url = {"type": "url", "urls": ["https://example.com/"]}
    parse_config(source_with(name="help", **url, refresh=2**63 - 1), base=tmp_path)
    with pytest.raises(ConfigError) as info:
        parse_config(source_with(name="help", **url, refresh=-1), base=tmp_path)
    assert str(info.value).endswith("source 'help': refresh must be >= 0 (seconds), got -1")


@pytest.mark.parametrize("value", [2**63 - 1, 0])
def test_a_bases_max_text_bytes_has_a_top_checked_where_the_file_is_read(
    tmp_path: Path, value: int
) -> None:
    with pytest.raises(ConfigError) as info:
        parse_config(kb_with(max_text_bytes=value), base=tmp_path)
    assert str(info.value) == (
        "<config> [[knowledge_base]] #1: max_text_bytes must be from 1 to 1099511627776 "
        f"(bytes), got {value}"
    )


def test_every_numeric_source_option_has_a_range() -> None:
    from index.config import OPTION_TYPES, SOURCE_OPTION_RANGES

    numbers = {k for k, t in OPTION_TYPES.items() if t in (int, float)}
    assert (
        numbers == set(SOURCE_OPTION_RANGES) == {key for _, key, _ in SOURCE_NUMBERS} | {"refresh"}
    )


def test_every_source_option_has_a_type_to_check() -> None:
    """``check_options`` types each option from OPTION_TYPES: an option added to a source type
    without one would be a KeyError at load (a review)."""
    from index.config import OPTION_TYPES, SOURCE_OPTIONS

    assert set().union(*SOURCE_OPTIONS.values()) <= set(OPTION_TYPES)


def test_a_base_whose_sources_names_would_overrun_its_manifest_is_refused(tmp_path: Path) -> None:
    """A snapshot's manifest lists its base's source names and is at most 256 KiB: 6,000
    sources of 40-character names built a snapshot every sidecar refused as corrupt."""
    sources = [dict(SOURCE, name=f"{i:05d}-" + "s" * 34) for i in range(1600)]
    with pytest.raises(ConfigError) as info:
        parse_config({"knowledge_base": [{"name": "docs", "source": sources}]}, base=tmp_path)
    assert "its 1600 sources' names come to" in str(info.value)
    assert f"the limit is {MAX_SOURCE_NAMES_BYTES}" in str(info.value)
    config = parse_config(
        {"knowledge_base": [{"name": "docs", "source": sources[:1000]}]}, base=tmp_path
    )
    assert len(config.knowledge_bases[0].sources) == 1000


def test_quoted_writes_a_few_levels_of_any_value() -> None:
    """A refusal quoting JSON a caller sent: nested 1,000 deep, ``repr`` raised RecursionError
    (a 500 with a traceback)."""
    deep: Any = []
    for _ in range(1000):
        deep = [deep]
    assert quoted(deep) == "[[[[...]]]]"
    assert quoted(list(range(100_000))).startswith("[0, 1, 2")
    assert len(quoted(list(range(100_000)))) <= 70
    assert quoted("x" * 100) == repr("x" * 64 + "...")
