"""The project's own clients against a sidecar that wants a bearer token, and one that also wants
mutual TLS: ``voxrecall ask`` (settings from flags, the environment, a config's ``listen``), the
adapters' ``Voxrecall`` on every RPC, and each adapter (Pipecat, LiveKit, OpenAI Realtime)."""

from __future__ import annotations

import asyncio
import json
import logging
import os
import shutil
import sys
import warnings
from collections.abc import AsyncIterator
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import grpc
import orjson
import pytest

from index.embedders.base import Embedder
from index.errors import ConfigError
from sidecar.adapters.client import Voxrecall
from sidecar.adapters.openai_realtime import RealtimeToolBridge
from sidecar.cli import main
from sidecar.config import Config
from sidecar.connection import NAMES, Connection, target_for_listen
from tests.conftest import EXAMPLE_KB, make_config
from tests.hardening_kit import (
    TOKEN_A,
    build_store,
    make_certs,
    running,
    sidecar_config,
    toml_config,
)

pytestmark = pytest.mark.skipif(shutil.which("openssl") is None, reason="needs the openssl CLI")

QUESTION = "how do I reset my password"
REPO = Path(__file__).resolve().parents[1]
AUTH = {"token_env": "VOX_TEST_TOKEN"}


@pytest.fixture(scope="module")
def store(tmp_path_factory: pytest.TempPathFactory, local_embedder: Embedder) -> Path:
    return build_store(tmp_path_factory.mktemp("client-auth"), local_embedder)


@pytest.fixture(scope="module")
def certs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_certs(tmp_path_factory.mktemp("certs"))


@pytest.fixture(autouse=True)
def clean_environ(monkeypatch: pytest.MonkeyPatch) -> None:
    """No VOXRECALL_* variable from the machine running the tests."""
    for env, _ in NAMES.values():
        monkeypatch.delenv(env, raising=False)


def _sidecar_keys(setup: str, certs: Path) -> dict[str, Any]:
    keys: dict[str, Any] = {"auth": AUTH}
    if setup == "mutual-tls":
        keys["tls"] = {
            "cert_file": str(certs / "server.pem"),
            "key_file": str(certs / "server.key"),
            "client_ca_file": str(certs / "ca.pem"),
        }
    return keys


def _connection(setup: str, certs: Path, port: int) -> Connection:
    if setup == "token":
        return Connection(f"127.0.0.1:{port}", token=TOKEN_A)
    return Connection(
        f"127.0.0.1:{port}",
        token=TOKEN_A,
        ca_file=certs / "ca.pem",
        cert_file=certs / "client.pem",
        key_file=certs / "client.key",
    )


@pytest.fixture(params=["token", "mutual-tls"])
async def secured(
    request: pytest.FixtureRequest,
    store: Path,
    certs: Path,
    local_embedder: Embedder,
    monkeypatch: pytest.MonkeyPatch,
) -> AsyncIterator[Connection]:
    """A real sidecar on port 0 wanting TOKEN_A (and, for mutual-tls, a client certificate);
    yields everything a client needs to reach it."""
    monkeypatch.setenv("VOX_TEST_TOKEN", TOKEN_A)
    config = sidecar_config(store, **_sidecar_keys(request.param, certs))
    async with running(config, local_embedder) as sidecar:
        yield _connection(request.param, certs, sidecar.port)


def _export(connection: Connection, monkeypatch: pytest.MonkeyPatch) -> None:
    """The connection as the VOXRECALL_* variables an agent's pod would set."""
    values = {
        "target": connection.target,
        "token": connection.token,
        "ca_file": connection.ca_file,
        "cert_file": connection.cert_file,
        "key_file": connection.key_file,
    }
    for name, value in values.items():
        if value:
            monkeypatch.setenv(NAMES[name][0], str(value))


async def _ask(*argv: str) -> int:
    """``voxrecall ask`` (blocking gRPC) in a worker thread, so the sidecar keeps serving."""
    return await asyncio.to_thread(main, ["ask", *argv])


# -- voxrecall ask ---------------------------------------------------------------------------


async def test_ask_takes_target_token_and_tls_from_the_environment(
    secured: Connection, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    _export(secured, monkeypatch)
    assert await _ask(QUESTION) == 0
    assert "Reset your password" in capsys.readouterr().out


async def test_ask_without_the_token_is_unauthenticated(
    secured: Connection, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    _export(replace(secured, token=""), monkeypatch)
    assert await _ask(QUESTION) == 1
    said = capsys.readouterr().err
    assert "UNAUTHENTICATED" in said
    assert "reads the token from VOXRECALL_TOKEN, which is unset" in said
    monkeypatch.setenv("VOXRECALL_TOKEN", "z" * 32)  # not the sidecar's
    assert await _ask(QUESTION) == 1
    said = capsys.readouterr().err
    assert "UNAUTHENTICATED" in said
    assert "sent the token in VOXRECALL_TOKEN" in said


async def test_ask_flags_win_over_the_environment(
    secured: Connection, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("VOXRECALL_TARGET", "127.0.0.1:9")  # nothing listens there
    monkeypatch.setenv("VOXRECALL_TOKEN", secured.token)
    flags = ["--target", secured.target]
    for flag, value in (
        ("--tls-ca", secured.ca_file),
        ("--tls-cert", secured.cert_file),
        ("--tls-key", secured.key_file),
    ):
        flags += [flag, str(value)] if value else []
    assert await _ask(QUESTION, "--search", *flags) == 0
    assert "Reset your password" in capsys.readouterr().out


async def test_ask_config_asks_at_the_configs_listen(
    secured: Connection,
    store: Path,
    certs: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    setup = "mutual-tls" if secured.tls else "token"
    config = tmp_path / "voxrecall.toml"
    keys = _sidecar_keys(setup, certs)
    config.write_text(toml_config(store, listen=secured.target, **keys), encoding="utf-8")
    _export(replace(secured, target="127.0.0.1:9"), monkeypatch)  # the config's listen wins
    assert await _ask(QUESTION, "--config", str(config)) == 0
    assert "Reset your password" in capsys.readouterr().out
    if secured.tls:  # the config says TLS: asking without a CA is stopped before any call
        monkeypatch.delenv("VOXRECALL_TLS_CA")
        monkeypatch.delenv("VOXRECALL_TLS_CERT")
        monkeypatch.delenv("VOXRECALL_TLS_KEY")
        assert await _ask(QUESTION, "--config", str(config)) == 2
        assert "--tls-ca or VOXRECALL_TLS_CA" in capsys.readouterr().err


# -- the adapters' client, every RPC ---------------------------------------------------------


async def test_the_async_client_sends_the_token_on_every_rpc(
    secured: Connection, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, "voxrecall.adapters")
    async with Voxrecall(secured, turn_timeout_s=10, tool_timeout_s=10) as vr:
        turn = await vr.turn("c1", QUESTION)
        assert turn.chunks[0].title == "Reset your password"
        assert (await vr.search(QUESTION, limit=1)).chunks[0].title == "Reset your password"
        assert {t.name for t in await vr.list_tools()} == {"search_help", "search_billing"}
        tool = await vr.invoke_tool("search_help", json.dumps({"query": QUESTION}), call_id="x")
        assert not tool.is_error
        assert "password.md" in tool.output
        stream = vr.turn_stream("c2")
        await stream.interim("how do I reset")
        answer, _ = await stream.final(QUESTION)
        await stream.aclose()
        assert answer.chunks[0].title == "Reset your password"
        assert await vr.end_session("c1")
        status = await vr.status()
        assert {b.name for b in status.knowledge_bases} == {"help", "billing"}
        page = await vr.for_base("help").read_page("password.md")
        assert page.title == "Reset your password"
        assert "within five minutes" in page.text
        part = await vr.for_base("help").read_page("password.md", offset=7)
        assert part.text == page.text[7:]
    assert "Converse stream broke" not in caplog.text  # the stream carried the token too


async def test_the_async_client_without_the_token_is_unauthenticated(secured: Connection) -> None:
    async with Voxrecall(replace(secured, token=""), turn_timeout_s=10) as vr:
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await vr.turn("c1", QUESTION)
    assert info.value.code() is grpc.StatusCode.UNAUTHENTICATED


async def test_mutual_tls_without_a_client_certificate_cannot_connect(
    store: Path, certs: Path, local_embedder: Embedder, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("VOX_TEST_TOKEN", TOKEN_A)
    config = sidecar_config(store, **_sidecar_keys("mutual-tls", certs))
    async with running(config, local_embedder) as sidecar:
        full = _connection("mutual-tls", certs, sidecar.port)
        async with Voxrecall(replace(full, cert_file=None, key_file=None)) as vr:
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await vr.turn("c1", QUESTION)
    assert info.value.code() is grpc.StatusCode.UNAVAILABLE


# -- each adapter ----------------------------------------------------------------------------


async def test_the_openai_realtime_bridge_answers_a_call(secured: Connection) -> None:
    async with Voxrecall(secured, tool_timeout_s=10) as vr:
        bridge = await RealtimeToolBridge.create(vr, session_id="rt")  # ListTools
        sent = await bridge.handle(
            {
                "type": "response.function_call_arguments.done",
                "name": "search_help",
                "call_id": "call_1",
                "arguments": json.dumps({"query": QUESTION}),
            }
        )
    (item,) = sent
    output = orjson.loads(item["item"]["output"])
    assert "password.md" in [r["path"] for r in output["results"]]


async def test_the_livekit_adapter_adds_knowledge_and_tools(secured: Connection) -> None:
    pytest.importorskip("livekit.agents")
    from livekit.agents import Agent, ChatMessage

    from sidecar.adapters.livekit import KNOWLEDGE_ID, LiveKitKnowledge, knowledge_tools

    async with Voxrecall(secured, turn_timeout_s=10, tool_timeout_s=10) as vr:
        knowledge = LiveKitKnowledge(vr, session_id="lk")
        turn_ctx = Agent(instructions="You help.").chat_ctx.copy()
        await knowledge.on_user_turn_completed(
            turn_ctx, ChatMessage(role="user", content=[QUESTION])
        )
        tools = await knowledge_tools(vr, session_id="lk")
    item = turn_ctx.get_by_id(KNOWLEDGE_ID)
    assert isinstance(item, ChatMessage)
    assert "password.md" in (item.text_content or "")
    assert sorted(t.info.name for t in tools) == ["search_billing", "search_help"]


async def test_the_pipecat_adapter_puts_knowledge_in_the_context(
    secured: Connection, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, "voxrecall.adapters")
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "'audioop' is deprecated", DeprecationWarning)
        pytest.importorskip("pipecat")
        from pipecat.frames.frames import LLMMessagesTransformFrame, TranscriptionFrame
        from pipecat.tests.utils import run_test

        from sidecar.adapters.pipecat import VoxrecallRetrieval, register_knowledge_functions

    class NoLLM:  # what register_knowledge_functions needs of an LLM service
        def __init__(self) -> None:
            self.handlers: dict[str, Any] = {}

        def register_function(self, name: str, handler: Any, **kwargs: Any) -> None:
            self.handlers[name] = handler

    results: list[Any] = []

    async def result_callback(result: Any) -> None:
        results.append(result)

    call = SimpleNamespace(
        function_name="search_help",
        arguments={"query": QUESTION},
        tool_call_id="call_1",
        result_callback=result_callback,
    )

    said = TranscriptionFrame(text=QUESTION, user_id="caller", timestamp="2026-01-01T00:00:00Z")
    async with Voxrecall(secured, turn_timeout_s=10, tool_timeout_s=10) as vr:
        retrieval = VoxrecallRetrieval(vr, session_id="pc")
        await run_test(
            retrieval,
            frames_to_send=[said],
            expected_down_frames=[LLMMessagesTransformFrame, TranscriptionFrame],
        )
        llm = NoLLM()
        tools = await register_knowledge_functions(llm, vr, session_id="pc")  # ListTools
        await llm.handlers["search_help"](call)  # what Pipecat runs on the model's call
    assert retrieval.last is not None
    assert retrieval.last.chunks[0].title == "Reset your password"
    assert "Converse stream broke" not in caplog.text  # answered over the call's stream
    assert sorted(llm.handlers) == ["search_billing", "search_help"]
    assert len(tools.standard_tools) == 2
    assert "password.md" in [r["path"] for r in results[0]["results"]]


# -- the settings themselves -----------------------------------------------------------------


def test_arguments_win_over_the_environment_which_wins_over_defaults(tmp_path: Path) -> None:
    env = {"VOXRECALL_TARGET": "10.0.0.1:1", "VOXRECALL_TOKEN": " t0ken\n"}
    env |= {"VOXRECALL_TLS_CA": str(tmp_path / "ca.pem"), "VOXRECALL_TLS_SERVER_NAME": "sidecar"}
    connection = Connection.from_env(env, target="10.0.0.2:2", server_name=None)
    assert connection == Connection(
        "10.0.0.2:2", token="t0ken", ca_file=tmp_path / "ca.pem", server_name="sidecar"
    )
    assert connection.metadata == (("authorization", "Bearer t0ken"),)
    assert TOKEN_A not in repr(Connection(token=TOKEN_A))
    assert Connection.from_env({}) == Connection("127.0.0.1:50051")
    assert Connection().metadata == ()


@pytest.mark.parametrize(
    ("settings", "message"),
    [
        ({"target": "sidecar:50051", "token": TOKEN_A}, "in the clear to sidecar:50051"),
        ({"cert_file": Path("c.pem")}, "needs both --tls-cert / VOXRECALL_TLS_CERT and"),
        ({"cert_file": Path("c.pem"), "key_file": Path("c.key")}, "need TLS"),
        ({"server_name": "sidecar"}, "need TLS"),
        ({"token": "two words"}, "one word"),
        ({"target": " "}, "address is empty"),
    ],
)
def test_settings_that_cannot_work_are_refused_with_what_to_set(
    settings: dict[str, Any], message: str
) -> None:
    with pytest.raises(ConfigError, match=message):
        Connection(**settings)


def test_a_token_may_go_in_the_clear_only_to_this_machine() -> None:
    for target in ("127.0.0.1:1", "localhost:1", "[::1]:1", "unix:/run/voxrecall.sock"):
        assert Connection(target, token=TOKEN_A).metadata
    assert Connection("sidecar:1", token=TOKEN_A, ca_file=Path("ca.pem")).tls


def test_a_missing_or_bad_pem_file_names_the_variable(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"VOXRECALL_TLS_CA .*nope\.pem"):
        Connection(ca_file=tmp_path / "nope.pem").credentials()
    (tmp_path / "junk.pem").write_text("junk")
    with pytest.raises(ConfigError, match="not a PEM file"):
        Connection(ca_file=tmp_path / "junk.pem").credentials()


@pytest.mark.parametrize(
    ("listen", "target"),
    [
        ("127.0.0.1:50051", "127.0.0.1:50051"),
        ("0.0.0.0:7000", "127.0.0.1:7000"),
        ("[::]:7000", "[::1]:7000"),
        ("sidecar.local:7000", "sidecar.local:7000"),
    ],
)
def test_ask_dials_a_listen_address_from_this_machine(listen: str, target: str) -> None:
    assert target_for_listen(listen, "f.toml") == target


def test_a_listen_with_port_zero_cannot_be_asked() -> None:
    with pytest.raises(ConfigError, match="use --target"):
        target_for_listen("127.0.0.1:0", "f.toml")


def readme_client() -> str:
    """The README's Python client snippet, as written."""
    readme = (REPO / "README.md").read_text(encoding="utf-8")
    after = readme.split("From Python, the async client", 1)[1]
    return after.split("```python\n", 1)[1].split("```", 1)[0]


async def run_readme_client(port: int, token: str) -> tuple[int, str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("VOXRECALL_")}
    env["VOXRECALL_TARGET"] = f"127.0.0.1:{port}"
    if token:
        env["VOXRECALL_TOKEN"] = token
    process = await asyncio.create_subprocess_exec(
        sys.executable, "-c", readme_client(),
        cwd=REPO, env=env,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
    )  # fmt: skip
    out, err = await asyncio.wait_for(process.communicate(), timeout=120)
    return await process.wait(), out.decode(), err.decode()


async def test_the_readmes_client_without_the_token_says_so_in_one_line_not_a_traceback(
    example_config: Config, local_embedder: Embedder, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("VOX_README_TOKEN", TOKEN_A)
    store = example_config.index.store
    config = make_config(
        store,
        [{"name": "help-center", "type": "markdown", "path": str(EXAMPLE_KB)}],
        auth={"token_env": "VOX_README_TOKEN"},
    )
    async with running(config, local_embedder) as sidecar:
        code, out, err = await run_readme_client(sidecar.port, "")
        assert (code, out) == (1, "")
        assert err == (
            "error: UNAUTHENTICATED: no credentials: send `authorization: Bearer <token>` (gRPC "
            "metadata, or an HTTP header; `voxrecall ask` and `Connection.from_env` read it from "
            "VOXRECALL_TOKEN)\n"
        )
        code, out, err = await run_readme_client(sidecar.port, TOKEN_A)
    assert code == 0, err
    assert "Traceback" not in err
    assert out.count("\n") == 3  # the snippet's three prints
