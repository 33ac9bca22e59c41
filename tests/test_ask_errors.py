"""``voxrecall ask`` says what went wrong in words a person can act on: with no sidecar at the
address, which address was tried and what starts one; a sidecar's own refusal as it sent it."""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import socket
import sys
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from index.embedders.base import Embedder
from sidecar.cli import main
from sidecar.config import Config
from sidecar.edge.server import create_server
from tests.conftest import EXAMPLE_KB, make_config


def unused_address() -> str:
    with socket.socket() as sock:  # bound, then closed: nothing listens there
        sock.bind(("127.0.0.1", 0))
        return f"127.0.0.1:{sock.getsockname()[1]}"


def test_ask_with_no_sidecar_names_the_address_and_the_command_that_starts_one(
    capsys: pytest.CaptureFixture[str], caplog: pytest.LogCaptureFixture
) -> None:
    target = unused_address()
    assert main(["ask", "--target", target, "How do I reset my password?"]) == 1
    err = capsys.readouterr().err
    assert err == (
        f"error: no voxrecall sidecar answered at {target} (-v shows gRPC's reason): start one "
        "with `voxrecall serve --config voxrecall.toml`, or give its address with --target\n"
    )  # not gRPC's "UNAVAILABLE: ... UNKNOWN: ..." line first, read as the sidecar's status
    with caplog.at_level(logging.DEBUG, "voxrecall.cli"):  # what -v shows
        assert main(["-v", "ask", "--target", target, "How do I reset my password?"]) == 1
    assert caplog.messages[-1].startswith("error: UNAVAILABLE: ")


async def test_ask_shows_a_sidecars_own_unavailable_as_sent(
    tmp_path: Path, local_embedder: Embedder, capsys: pytest.CaptureFixture[str]
) -> None:
    config = make_config(
        tmp_path / "store", [{"name": "help-center", "type": "markdown", "path": str(EXAMPLE_KB)}]
    )
    sidecar = await create_server(config, embedder=local_embedder, poll=False)  # nothing built
    try:
        target = f"127.0.0.1:{sidecar.port}"
        code = await asyncio.to_thread(main, ["ask", "--target", target, "roaming prices"])
    finally:
        await sidecar.stop(0.5)
    err = capsys.readouterr().err
    assert code == 1
    assert "error: UNAVAILABLE: knowledge base 'docs' has no snapshot loaded yet" in err
    assert "no voxrecall sidecar answered" not in err  # one did: it has nothing to serve yet


async def test_ask_prints_the_answer(
    example_sidecar: Any, capsys: pytest.CaptureFixture[str]
) -> None:
    target = f"127.0.0.1:{example_sidecar.port}"
    question = "How much does roaming cost in Europe?"
    assert await asyncio.to_thread(main, ["ask", "--target", target, question]) == 0
    out = capsys.readouterr().out
    assert "roaming.md" in out


async def test_ask_prints_the_bases_fallback_when_nothing_was_found(
    example_config: Config, local_embedder: Embedder, capsys: pytest.CaptureFixture[str]
) -> None:
    """The base's ``fallback`` (what the agent says when nothing was found) came in the answer
    and ``ask`` left it out; it is printed under the line that says nothing was found."""
    fallback = "I don't have that information; let me transfer you."
    bases = tuple(replace(kb, fallback=fallback) for kb in example_config.knowledge_bases)
    config = replace(example_config, knowledge_bases=bases)
    sidecar = await create_server(config, embedder=local_embedder, poll=False)
    try:
        target = f"127.0.0.1:{sidecar.port}"
        asks = [
            ["ask", "--target", target, "the airspeed velocity of an unladen swallow"],
            ["ask", "--search", "--target", target, "the airspeed velocity of an unladen swallow"],
            ["ask", "--target", target, "How much does roaming cost in Europe?"],
        ]
        outs = []
        for argv in asks:
            assert await asyncio.to_thread(main, argv) == 0
            outs.append(capsys.readouterr().out.splitlines())
    finally:
        await sidecar.stop(0.5)
    for lines in outs[:2]:  # Turn and Search: nothing found
        assert lines[-3:-1] == ["no chunk scored above min_score", f"fallback: {fallback}"]
    assert not any(line.startswith("fallback:") for line in outs[2])  # something was found


async def test_ask_into_a_closed_pipe_stops_quietly(example_sidecar: Any) -> None:
    """``voxrecall ask "..." | head -3``: the reader gone, the command ends as a Unix tool does
    (the shell's status for SIGPIPE), not with a BrokenPipeError traceback."""
    read_end, write_end = os.pipe()
    os.close(read_end)  # the reader has gone before anything is written
    target = f"127.0.0.1:{example_sidecar.port}"
    args = ["-m", "sidecar.cli", "ask", "--target", target, "How much does roaming cost?"]
    proc = await asyncio.create_subprocess_exec(
        sys.executable, *args, stdout=write_end, stderr=asyncio.subprocess.PIPE
    )
    os.close(write_end)
    _, err = await proc.communicate()
    assert b"Traceback" not in err, err.decode()
    assert b"BrokenPipeError" not in err
    assert proc.returncode == 128 + signal.SIGPIPE
