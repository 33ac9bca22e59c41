"""The README's "Hosted voice platforms" section, run: each `curl` it gives is sent to a real
HTTP door over examples/voxrecall.toml, configured as its `[sidecar.http]` snippet says, exactly
as written (only the host and token differ) and answered 200 with what it found; signed by its signing
snippet, each is answered with the webhook secret on too; and the Retell
parameters schema it prints is the one ``ListTools`` gives. A newcomer writes their platform's
requests from these, so they must be what the code takes."""

from __future__ import annotations

import hashlib
import hmac
import json
import re
import shlex
import time
import tomllib
from pathlib import Path
from typing import Any

import httpx2
import pytest

from index.build import build_knowledge_base
from index.embedders.base import Embedder
from sidecar.config import Config, parse_config
from sidecar.functions.tools import Toolbox
from tests.hardening_kit import TOKEN_A, running

REPO = Path(__file__).resolve().parents[1]
README = (REPO / "README.md").read_text(encoding="utf-8")
SECTION = README.split("## Hosted voice platforms", 1)[1].split("\n## ", 1)[0]
CALLING = README.split("## Call it from anything", 1)[1].split("\n## ", 1)[0]
VAPI_SECRET = "vapi-secret-for-readme-0001"
WEBHOOK_SECRET = "webhook-secret-for-readme-0001"


def blocks(language: str, section: str = SECTION) -> list[str]:
    return re.findall(rf"```{language}\n(.*?)```", section, flags=re.DOTALL)


def curls(section: str = SECTION) -> list[list[str]]:
    """Each `curl` of the section's shell blocks, as its arguments (continued lines joined)."""
    commands = []
    for block in blocks("sh", section):
        for command in block.replace("\\\n", " ").splitlines():
            if command.startswith("curl "):
                commands.append(shlex.split(command)[1:])
    return commands


def request(args: list[str]) -> tuple[str, dict[str, str], bytes]:
    """A curl's URL path, headers and body (-H, -d), its placeholder `TOKEN` the test's token
    (tokens are at least 16 characters)."""
    path, headers, body = "", {}, b""
    it = iter(args)
    for arg in it:
        if arg == "-H":
            name, _, value = next(it).partition(":")
            headers[name.strip().lower()] = value.strip().replace(
                "Bearer TOKEN", f"Bearer {TOKEN_A}"
            )
        elif arg == "-d":
            body = next(it).encode()
        else:
            path = "/" + arg.split("://", 1)[1].split("/", 1)[1]
    return path, headers, body


def door_snippets() -> list[dict[str, Any]]:
    """The section's `[sidecar.http]` snippets: the door's, then the signing paragraph's."""
    return [tomllib.loads(block)["sidecar"]["http"] for block in blocks("toml")]


@pytest.fixture(scope="module")
def example_raw(
    tmp_path_factory: pytest.TempPathFactory, local_embedder: Embedder
) -> dict[str, Any]:
    """examples/voxrecall.toml with its store in a temporary folder (built), the token on and
    the HTTP door configured as the README's first snippet says (on a port of its own)."""
    raw: dict[str, Any] = tomllib.loads((REPO / "examples" / "voxrecall.toml").read_text())
    store = tmp_path_factory.mktemp("readme") / "store"
    raw["index"]["store"] = str(store)
    raw["sidecar"] |= {"store": str(store), "listen": "127.0.0.1:0"}
    config = parse_config(raw, base=REPO / "examples")
    build_knowledge_base(config, config.knowledge_bases[0], local_embedder)
    door = door_snippets()[0] | {"listen": "127.0.0.1:0"}
    raw["sidecar"] |= {"auth": {"token_env": "VOX_README_TOKEN"}, "http": door}
    return raw


@pytest.fixture
def environment(monkeypatch: pytest.MonkeyPatch) -> None:
    """The token and the secrets the snippets name (Vapi's the placeholder the curl sends)."""
    monkeypatch.setenv("VOX_README_TOKEN", TOKEN_A)
    monkeypatch.setenv("VAPI_SECRET", "VAPI_SECRET")
    monkeypatch.setenv("RETELL_API_KEY", WEBHOOK_SECRET)


@pytest.fixture
def example_config(example_raw: dict[str, Any], environment: None) -> Config:
    return parse_config(example_raw, base=REPO / "examples")


@pytest.fixture
def signing_config(example_raw: dict[str, Any], environment: None) -> Config:
    """The door with the signing paragraph's snippet added."""
    raw = example_raw | {"sidecar": dict(example_raw["sidecar"])}
    raw["sidecar"]["http"] = raw["sidecar"]["http"] | door_snippets()[1]
    return parse_config(raw, base=REPO / "examples")


def signed(body: bytes) -> dict[str, str]:
    """The headers the README's signing snippet computes for ``body``, run as written."""
    (snippet,) = (b for b in blocks("python") if "X-Voxrecall-Signature" in b)
    scope: dict[str, Any] = {"time": time, "hmac": hmac, "hashlib": hashlib}
    scope |= {"secret": WEBHOOK_SECRET.encode(), "body": body}
    exec(snippet, scope)
    headers: dict[str, str] = scope["headers"]
    return headers


def test_the_readme_gives_a_request_for_each_platform() -> None:
    paths = [request(args)[0] for args in curls()]
    assert paths == ["/vapi/knowledge-base", "/tools/knowledge_search", "/tools/knowledge_search"]


def test_the_signing_snippet_adds_only_the_webhook_secret() -> None:
    first, signing = door_snippets()
    assert "webhook_secret_env" not in first
    assert set(signing) == {"webhook_secret_env"}


async def test_each_readme_request_is_answered_as_written(
    example_config: Config, local_embedder: Embedder
) -> None:
    """Sent as the README writes it, to the README's door: only the host and token differ."""
    async with running(example_config, local_embedder) as sc, httpx2.AsyncClient() as http:
        commands = curls()
        assert commands
        for args in commands:
            path, headers, body = request(args)
            reply = await http.post(
                f"http://127.0.0.1:{sc.http_port}{path}", content=body, headers=headers
            )
            assert reply.status_code == 200, (path, reply.text)
            assert "x-voxrecall-tool-error" not in reply.headers
            answer = reply.json()
            found = answer.get("documents") or answer.get("results")
            assert found, (path, answer)


async def test_with_the_webhook_secret_a_tool_call_signed_as_the_readme_shows_is_answered(
    signing_config: Config, local_embedder: Embedder
) -> None:
    """The signing paragraph: an unsigned `/tools/` curl is refused, the same one signed by the
    README's snippet is answered; Vapi's knowledge base is not a tool webhook and needs none."""
    async with running(signing_config, local_embedder) as sc, httpx2.AsyncClient() as http:
        for args in curls():
            path, headers, body = request(args)
            url = f"http://127.0.0.1:{sc.http_port}{path}"
            if path.startswith("/tools/"):
                refused = await http.post(url, content=body, headers=headers)
                assert refused.status_code == 401, (path, refused.text)
                headers |= signed(body)
            reply = await http.post(url, content=body, headers=headers)
            assert reply.status_code == 200, (path, reply.text)
            answer = reply.json()
            assert answer.get("documents") or answer.get("results"), (path, answer)


def test_the_readmes_retell_schema_is_what_list_tools_gives(example_config: Config) -> None:
    (schema,) = (json.loads(b) for b in blocks("json"))
    (function,) = Toolbox.from_config(example_config)
    assert schema == function.realtime()["parameters"]


async def test_the_plain_turn_curl_is_answered_as_written(
    example_config: Config, local_embedder: Embedder
) -> None:
    """The curl to ``/v1/turn`` in "Call it from anything", with the token its sentence names:
    the example base's answer, in the response's JSON mapping."""
    (args,) = curls(CALLING)
    path, headers, body = request(args)
    assert path == "/v1/turn"
    headers["authorization"] = f"Bearer {TOKEN_A}"
    async with running(example_config, local_embedder) as sc, httpx2.AsyncClient() as http:
        reply = await http.post(
            f"http://127.0.0.1:{sc.http_port}{path}", content=body, headers=headers
        )
    assert reply.status_code == 200, reply.text
    assert reply.json()["chunks"][0]["source_path"] == "reset-password.md"
