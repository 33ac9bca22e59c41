"""Small real knowledge bases for the hardening tests (auth, TLS, limits, metrics, fuzz, SIGTERM).

    store = build_store(tmp_path, local_embedder)           # two bases, "help" and "billing"
    config = sidecar_config(store, auth={"token_env": "T"}, max_concurrent_rpcs=2)

The pages are written by the test, built with the real embedder into a real store; each test
then parses its own ``[sidecar]`` keys over the same store.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import threading
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import pytest

from index.build import build_knowledge_base
from index.embedders.base import Embedder
from sidecar.config import Config, parse_config
from sidecar.edge.server import Sidecar, create_server

PAGES: dict[str, dict[str, str]] = {
    "help": {
        "password.md": "# Reset your password\n\nOpen Settings, choose Account, then Reset "
        "password. A link arrives by email within five minutes; it works once.\n",
        "devices.md": "# Add a device\n\nSign in on the new phone with the same account. Up to "
        "five devices can be signed in at once.\n",
        "export.md": "# Export your data\n\nSettings > Privacy > Export builds a zip of every "
        "note and photo. Large accounts take up to a day.\n",
    },
    "billing": {
        "refunds.md": "# Refunds\n\nA refund goes back to the card that paid, within ten "
        "working days of the request.\n",
        "plans.md": "# Change your plan\n\nUpgrade or downgrade under Billing > Plan. The new "
        "price applies from the next invoice.\n",
    },
}
FUNCTIONS = [
    {
        "name": "search_help",
        "description": "Find help-centre answers about the app: accounts, devices, data.",
        "knowledge_base": "help",
    },
    {
        "name": "search_billing",
        "description": "Find answers about billing: refunds, plans, invoices.",
        "knowledge_base": "billing",
    },
]
TOKEN_A = "a" * 12 + "-token-for-tests-0001"
TOKEN_B = "b" * 12 + "-token-for-tests-0002"


def _raw(root: Path, sidecar: dict[str, Any], embedder: dict[str, Any] | None) -> dict[str, Any]:
    return {
        "embedder": embedder or {},
        "knowledge_base": [
            {
                "name": kb,
                "source": [{"name": f"{kb}-pages", "type": "markdown", "path": str(root / kb)}],
            }
            for kb in PAGES
        ],
        "function": FUNCTIONS,
        "index": {"store": str(root / "store")},
        "sidecar": {
            "store": str(root / "store"),
            "listen": "127.0.0.1:0",
            "default_knowledge_base": "help",
            **sidecar,
        },
    }


def build_store(root: Path, embedder: Embedder, provider: dict[str, Any] | None = None) -> Path:
    """Write the pages under ``root`` and build both bases into ``root/store``; returns root.
    ``provider`` is the ``[embedder]`` table ``embedder`` was made from (default: local)."""
    for kb, pages in PAGES.items():
        folder = root / kb
        folder.mkdir(parents=True, exist_ok=True)
        for name, text in pages.items():
            (folder / name).write_text(text, encoding="utf-8")
    config = sidecar_config(root, embedder=provider)
    for base in config.knowledge_bases:
        build_knowledge_base(config, base, embedder)
    return root


def sidecar_config(root: Path, *, embedder: dict[str, Any] | None = None, **sidecar: Any) -> Config:
    """The config over ``build_store(root)``'s store with these ``[sidecar]`` keys."""
    return parse_config(_raw(root, sidecar, embedder), base=root)


def toml_config(root: Path, *, embedder: dict[str, Any] | None = None, **sidecar: Any) -> str:
    """The same config as TOML text, for a real ``voxrecall serve`` process."""

    def value(v: Any) -> str:
        return json.dumps(v)  # TOML basic strings, numbers, booleans and arrays read the same

    lines = ["[embedder]", *(f"{k} = {value(v)}" for k, v in (embedder or {}).items())]
    for kb in PAGES:
        lines += [
            "[[knowledge_base]]",
            f"name = {value(kb)}",
            "[[knowledge_base.source]]",
            f"name = {value(kb + '-pages')}",
            'type = "markdown"',
            f"path = {value(str(root / kb))}",
        ]
    lines += ["[index]", f"store = {value(str(root / 'store'))}", "[sidecar]"]
    settings = {"store": str(root / "store"), "default_knowledge_base": "help", **sidecar}
    tables = {k: v for k, v in settings.items() if isinstance(v, dict)}
    lines += [f"{k} = {value(v)}" for k, v in settings.items() if k not in tables]
    for name, table in tables.items():
        lines.append(f"[sidecar.{name}]")
        lines += [f"{k} = {value(v)}" for k, v in table.items()]
    return "\n".join(lines) + "\n"


def make_certs(folder: Path) -> Path:
    """In ``folder``: a CA (ca.pem), a server cert for 127.0.0.1/localhost (server.pem,
    server.key), a client cert from that CA (client.*) and a self-signed one (rogue.*)."""
    folder.mkdir(parents=True, exist_ok=True)

    def run(*args: str) -> None:
        subprocess.run(["openssl", *args], cwd=folder, check=True, capture_output=True)

    run("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "2", "-subj", "/CN=test-ca",
        "-keyout", "ca.key", "-out", "ca.pem",
        "-addext", "basicConstraints=critical,CA:TRUE", "-addext", "keyUsage=keyCertSign")  # fmt: skip
    for name, ext in (
        ("server", "subjectAltName=IP:127.0.0.1,DNS:localhost\nextendedKeyUsage=serverAuth"),
        ("client", "extendedKeyUsage=clientAuth"),
        ("rogue", "extendedKeyUsage=clientAuth"),
    ):
        (folder / f"{name}.ext").write_text(ext + "\n")
        run("req", "-newkey", "rsa:2048", "-nodes", "-subj", f"/CN={name}",
            "-keyout", f"{name}.key", "-out", f"{name}.csr")  # fmt: skip
        if name == "rogue":  # self-signed: not from the CA the server trusts
            run("x509", "-req", "-in", f"{name}.csr", "-signkey", f"{name}.key", "-days", "2",
                "-extfile", f"{name}.ext", "-out", f"{name}.pem")  # fmt: skip
        else:
            run("x509", "-req", "-in", f"{name}.csr", "-CA", "ca.pem", "-CAkey", "ca.key",
                "-CAcreateserial", "-days", "2", "-extfile", f"{name}.ext", "-out", f"{name}.pem")  # fmt: skip
    return folder


@asynccontextmanager
async def running(config: Config, embedder: Embedder) -> AsyncIterator[Sidecar]:
    """A started sidecar on port 0, drained at the end."""
    sidecar = await create_server(config, embedder=embedder, poll=False)
    try:
        yield sidecar
    finally:
        await sidecar.stop(0.5)


def uses_of(sidecar: Sidecar, monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The bases the sidecar's calls use from now on (``SnapshotHolder.use``), in order: a base
    used twice by one call looks like a caller's working set under a memory budget."""
    used: list[str] = []
    use = sidecar.holder.use

    def counted(kb: str, peer: str = "") -> Any:
        used.append(kb)
        return use(kb, peer)

    monkeypatch.setattr(sidecar.holder, "use", counted)
    return used


def bearer(token: str) -> tuple[tuple[str, str]]:
    return (("authorization", f"Bearer {token}"),)


REPO = Path(__file__).resolve().parents[1]
PROCESS_WAIT_S = 60.0  # a bound on waiting for a process (imports, snapshot loads), not a timing


def serve_refused(
    config: Path, env: dict[str, str], *args: str
) -> subprocess.CompletedProcess[str]:
    """``voxrecall serve --config CONFIG [ARGS]`` that a test expects to stop by itself (a
    refusal at start): run to its end, or failed with its log if it still runs after
    PROCESS_WAIT_S (a regression that serves would otherwise hold the test for ever)."""
    command = [sys.executable, "-m", "sidecar.cli", "serve", "--config", str(config), *args]
    try:
        return subprocess.run(
            command, cwd=REPO, env=env, capture_output=True, text=True, timeout=PROCESS_WAIT_S
        )
    except subprocess.TimeoutExpired as exc:
        err = exc.stderr.decode(errors="replace") if isinstance(exc.stderr, bytes) else exc.stderr
        raise AssertionError(
            f"voxrecall serve still ran after {PROCESS_WAIT_S:.0f} s, where it should have "
            f"stopped (killed):\n{err or ''}"
        ) from None


class ServeProcess:
    """``voxrecall serve --config CONFIG [ARGS]`` as a child process, its stderr collected line
    by line (its log)."""

    def __init__(self, config: Path, env: dict[str, str], *args: str) -> None:
        self.lines: list[str] = []
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "sidecar.cli", "serve", "--config", str(config), *args],
            cwd=REPO, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
        )  # fmt: skip
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.proc.stderr is not None
        for line in self.proc.stderr:
            self.lines.append(line)

    def log(self) -> str:
        return "".join(self.lines)

    def wait_for(self, pattern: str, count: int = 1) -> re.Match[str]:
        """The ``count``-th log line matching ``pattern`` (with workers, each worker logs its
        own: ``count`` = workers waits for them all); fails if the process exits first."""
        deadline = time.monotonic() + PROCESS_WAIT_S
        while time.monotonic() < deadline:
            found = [m for m in (re.search(pattern, line) for line in list(self.lines)) if m]
            if len(found) >= count:
                return found[count - 1]
            assert self.proc.poll() is None, self.log()
            time.sleep(0.05)
        raise AssertionError(f"no log line matched {pattern!r}:\n{self.log()}")

    def stop(self) -> None:
        """Whatever a test left running: SIGTERM (a drain), then SIGKILL if it will not stop."""
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(PROCESS_WAIT_S)
            except subprocess.TimeoutExpired:
                self.proc.kill()
        self.proc.wait()
        self._reader.join(PROCESS_WAIT_S)
        if self.proc.stderr is not None:
            self.proc.stderr.close()
