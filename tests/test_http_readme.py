"""The README's "Hosted voice platforms" section, run: each `curl` it gives is sent to a real
HTTP door over examples/voxrecall.toml and answered 200 with what it found, and the Retell
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
VAPI_SECRET = "vapi-secret-for-readme-0001"
WEBHOOK_SECRET = "webhook-secret-for-readme-0001"


def blocks(language: str) -> list[str]:
    return re.findall(rf"```{language}\n(.*?)```", SECTION, flags=re.DOTALL)


def curls() -> list[list[str]]:
    """Each `curl` of the section's shell blocks, as its arguments (continued lines joined)."""
    commands = []
    for block in blocks("sh"):
        for command in block.replace("\\\n", " ").splitlines():
            if command.startswith("curl "):
                commands.append(shlex.split(command)[1:])
    return commands


def request(args: list[str]) -> tuple[str, dict[str, str], bytes]:
    """A curl's URL path, headers and body (-H, -d)."""
    path, headers, body = "", {}, b""
    it = iter(args)
    for arg in it:
        if arg == "-H":
            name, _, value = next(it).partition(":")
            headers[name.strip().lower()] = value.strip()
        elif arg == "-d":
            body = next(it).encode()
        else:
            path = "/" + arg.split("://", 1)[1].split("/", 1)[1]
    return path, headers, body


@pytest.fixture(scope="module")
def example_raw(
    tmp_path_factory: pytest.TempPathFactory, local_embedder: Embedder
) -> dict[str, Any]:
    """examples/voxrecall.toml with its store in a temporary folder (built) and the HTTP door on."""
    raw: dict[str, Any] = tomllib.loads((REPO / "examples" / "voxrecall.toml").read_text())
    store = tmp_path_factory.mktemp("readme") / "store"
    raw["index"]["store"] = str(store)
    raw["sidecar"] |= {"store": str(store), "listen": "127.0.0.1:0"}
    config = parse_config(raw, base=REPO / "examples")
    build_knowledge_base(config, config.knowledge_bases[0], local_embedder)
    raw["sidecar"] |= {
        "auth": {"token_env": "VOX_README_TOKEN"},
        "http": {
            "listen": "127.0.0.1:0",
            "vapi_secret_env": "VOX_README_VAPI",
            "webhook_secret_env": "VOX_README_WEBHOOK",
        },
    }
    return raw


@pytest.fixture
def example_config(example_raw: dict[str, Any], monkeypatch: pytest.MonkeyPatch) -> Config:
    """Its config, with the token and the secrets in the environment."""
    monkeypatch.setenv("VOX_README_TOKEN", TOKEN_A)
    monkeypatch.setenv("VOX_README_VAPI", VAPI_SECRET)
    monkeypatch.setenv("VOX_README_WEBHOOK", WEBHOOK_SECRET)
    return parse_config(example_raw, base=REPO / "examples")


def test_the_readme_gives_a_request_for_each_platform() -> None:
    paths = [request(args)[0] for args in curls()]
    assert paths == ["/vapi/knowledge-base", "/tools/knowledge_search", "/tools/knowledge_search"]


async def test_each_readme_request_is_answered_with_what_it_found(
    example_config: Config, local_embedder: Embedder
) -> None:
    async with running(example_config, local_embedder) as sc, httpx2.AsyncClient() as http:
        commands = curls()
        assert commands
        for args in commands:
            path, headers, body = request(args)
            assert headers.pop("authorization") == "Bearer TOKEN"
            headers["authorization"] = f"Bearer {TOKEN_A}"
            if "x-vapi-secret" in headers:
                headers["x-vapi-secret"] = VAPI_SECRET
            if path.startswith("/tools/"):  # signed as the README's "Signing" paragraph says
                stamp = str(int(time.time()))
                digest = hmac.new(
                    WEBHOOK_SECRET.encode(), stamp.encode() + b"." + body, hashlib.sha256
                ).hexdigest()
                headers |= {
                    "x-voxrecall-timestamp": stamp,
                    "x-voxrecall-signature": f"sha256={digest}",
                }
            reply = await http.post(
                f"http://127.0.0.1:{sc.http_port}{path}", content=body, headers=headers
            )
            assert reply.status_code == 200, (path, reply.text)
            assert "x-voxrecall-tool-error" not in reply.headers
            answer = reply.json()
            found = answer.get("documents") or answer.get("results")
            assert found, (path, answer)


def test_the_readmes_retell_schema_is_what_list_tools_gives(example_config: Config) -> None:
    (schema,) = (json.loads(b) for b in blocks("json"))
    (function,) = Toolbox.from_config(example_config)
    assert schema == function.realtime()["parameters"]
