"""What one caller can make the log say, against a real sidecar on 127.0.0.1 port 0 (the s13
attack's F3, F12, F4, F10): a refused session id cut on every line, a failing caller's lines
bounded per window with a count of the rest, short secrets left alone, and no line per embedding
request from the HTTP client library."""

from __future__ import annotations

import io
import logging
import os
import socket
import subprocess
import sys
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import grpc
import orjson
import pytest

from index.config import EmbedderConfig
from index.embedders.remote import OpenAIEmbedder
from sidecar.config import load_config
from sidecar.edge import addresses, logs
from sidecar.edge.interceptor import Call
from sidecar.edge.server import Sidecar
from sidecar.gen import retrieval_pb2 as pb
from sidecar.gen import retrieval_pb2_grpc as pb_grpc
from tests.conftest import EXAMPLE_KB, LIVENESS_S, REPO, eventually
from tests.hardening_kit import TOKEN_A
from tests.openai_server import OpenAIServer

HUGE_SESSION = "S" * 100_000 + '\n{"level": "ERROR", "msg": "forged"}'


@pytest.fixture
def log_stream() -> Iterator[io.StringIO]:
    """The lines the sidecar writes, in the format the test sets with ``logs.configure``."""
    stream = io.StringIO()
    root = logging.getLogger()
    saved = root.level, list(root.handlers)
    yield stream
    root.setLevel(saved[0])
    root.handlers[:] = saved[1]


@pytest.fixture
async def stub(example_sidecar: Sidecar) -> AsyncIterator[pb_grpc.RetrievalStub]:
    async with grpc.aio.insecure_channel(f"127.0.0.1:{example_sidecar.port}") as channel:
        yield pb_grpc.RetrievalStub(channel)  # type: ignore[no-untyped-call]


async def _refused(call: Any) -> grpc.StatusCode:
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await call
    code: grpc.StatusCode = info.value.code()
    return code


def _said(stream: io.StringIO, text: str) -> bool:
    """Whether a line says ``text``: a call's end is logged after its status is sent."""
    return text in stream.getvalue()


def _json_lines(stream: io.StringIO) -> list[dict[str, Any]]:
    return [orjson.loads(line) for line in stream.getvalue().splitlines()]


@pytest.mark.parametrize("fmt", ["json", "text"])
async def test_a_refused_session_id_is_cut_on_its_line(
    stub: pb_grpc.RetrievalStub, log_stream: io.StringIO, fmt: str
) -> None:
    logs.configure("DEBUG", fmt, stream=log_stream)
    turn = pb.TurnRequest(session_id=HUGE_SESSION, text="hello", is_final=True)
    assert await _refused(stub.Turn(turn)) is grpc.StatusCode.INVALID_ARGUMENT
    at_limit = pb.TurnRequest(session_id="f" * 256, knowledge_base="nope", text="hi")
    assert await _refused(stub.Turn(at_limit)) is grpc.StatusCode.NOT_FOUND
    await eventually(lambda: _said(log_stream, "Turn NOT_FOUND in"), "the second call's line")
    lines = log_stream.getvalue().splitlines()
    assert any("Turn INVALID_ARGUMENT in" in line for line in lines)
    assert max(len(line.encode()) for line in lines) < logs.MAX_FIELD_BYTES
    assert not any("forged" in line for line in lines)
    if fmt == "json":
        ids = [x["session_id"] for x in _json_lines(log_stream) if "session_id" in x]
        assert {i[:8] for i in ids} == {"SSSSSSSS", "ffffffff"}
        assert all(len(i.encode()) < logs.MAX_ID_BYTES + 40 for i in ids)
        assert any("100036 characters" in i for i in ids)  # its length is still said


@pytest.fixture
def frozen(monkeypatch: pytest.MonkeyPatch) -> list[float]:
    """The failure lines' clock, moved by the test alone: ``now[0] += ...``."""
    import time

    now = [time.monotonic()]
    monkeypatch.setattr(logs, "monotonic", lambda: now[0], raising=False)  # main: none
    return now


async def test_a_failing_caller_gets_the_first_lines_of_a_kind_and_then_a_count(
    stub: pb_grpc.RetrievalStub, log_stream: io.StringIO, frozen: list[float]
) -> None:
    logs.configure("INFO", "json", stream=log_stream)
    calls = logs.FAILURE_LINES + 25
    for i in range(calls):
        unknown = pb.TurnRequest(session_id=f"s{i}", knowledge_base="nope", text="hi")
        assert await _refused(stub.Turn(unknown)) is grpc.StatusCode.NOT_FOUND
    search = pb.SearchRequest(knowledge_base="nope", query="hi")
    assert await _refused(stub.Search(search)) is grpc.StatusCode.NOT_FOUND
    await eventually(lambda: _said(log_stream, "Search NOT_FOUND in"), "the Search's line")
    lines = _json_lines(log_stream)
    turns = [x for x in lines if x["msg"].startswith("Turn NOT_FOUND in")]
    assert [x["session_id"] for x in turns] == [f"s{i}" for i in range(logs.FAILURE_LINES)]
    assert [x for x in lines if x["msg"].startswith("Search NOT_FOUND in")]  # its own first
    assert not [x for x in lines if "suppressed" in x["msg"]]

    frozen[0] += logs.FAILURE_WINDOW_S  # the window is over: the next call's end says so
    await stub.Status(pb.StatusRequest())
    await eventually(lambda: _said(log_stream, "suppressed"), "the count")
    (count,) = [x for x in _json_lines(log_stream) if "suppressed" in x["msg"]]
    assert count["msg"].startswith("Turn NOT_FOUND: 25 more like this suppressed")
    assert count["level"] == "INFO"
    assert "session_id" not in count  # no one call's
    assert count["client"] == "127.0.0.1"
    unknown = pb.TurnRequest(session_id="again", knowledge_base="nope", text="hi")
    assert await _refused(stub.Turn(unknown)) is grpc.StatusCode.NOT_FOUND
    await eventually(lambda: _said(log_stream, '"again"'), "a new window's first line")


def test_a_secret_too_short_to_be_one_is_left_in_the_lines(log_stream: io.StringIO) -> None:
    logs.configure("INFO", "json", secrets=["x", "EMPTY", TOKEN_A], stream=log_stream)
    logging.getLogger("voxrecall.test").info("voxrecall expected 64-d; key EMPTY; %s", TOKEN_A)
    (line,) = _json_lines(log_stream)
    assert line["msg"] == f"voxrecall expected 64-d; key EMPTY; {logs.REDACTED}"


def test_a_secret_that_begins_another_leaves_none_of_the_longer(log_stream: io.StringIO) -> None:
    """Scrubbed in the order given, the shorter secret left the longer's rest in the line."""
    short, longer = "sk-live-0123", "sk-live-0123-and-the-rest-of-it"
    logs.configure("INFO", "json", secrets=[short, longer], stream=log_stream)
    logging.getLogger("voxrecall.test").info("keys %s and %s", longer, short)
    (line,) = _json_lines(log_stream)
    assert line["msg"] == f"keys {logs.REDACTED} and {logs.REDACTED}"


async def test_an_embedding_request_writes_no_line_of_the_http_client(
    log_stream: io.StringIO,
) -> None:
    server = OpenAIServer().start()
    config = EmbedderConfig(provider="openai", base_url=server.base_url, dimensions=64)
    embedder = OpenAIEmbedder(config)
    try:
        logs.configure("INFO", "json", stream=log_stream)
        await embedder.embed(["how do I reset my password"])
    finally:
        await embedder.aclose()
        server.stop()
    assert server.requests >= 1
    assert "HTTP Request" not in log_stream.getvalue()


@pytest.mark.parametrize(
    ("peer", "key"),
    [
        ("ipv4:10.0.0.7:51234", "10.0.0.7"),
        ("ipv6:%5B2001:db8::1%5D:51234", "2001:db8::/64"),
        ("10.0.0.7:51234", "10.0.0.7"),  # the HTTP door's
        ("2001:db8::1:51234", "2001:db8::/64"),
        ("unix:/run/vr.sock", "unix:/run/vr.sock"),
        ("", ""),
    ],
)
def test_a_failure_line_counts_against_its_client_host_from_either_door(
    peer: str, key: str
) -> None:
    assert addresses.peer_key(peer) == key


def test_every_secret_the_file_names_is_redacted(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, log_stream: io.StringIO
) -> None:
    """The HTTP door's Vapi and signing secrets and a reranker's key were written to the logs
    as they were (only callers' tokens and the embedder's key were redacted)."""
    values = {f"VOX_SECRET_{i}": f"s3cret-value-number-{i}" for i in range(3)}
    for name, value in values.items():
        monkeypatch.setenv(name, value)
    path = tmp_path / "voxrecall.toml"
    path.write_text(
        f"""
[[knowledge_base]]
name = "help"
[[knowledge_base.source]]
name = "kb"
type = "markdown"
path = "{tmp_path}"
[knowledge_base.rerank]
base_url = "http://127.0.0.1:9/v1"
api_key_env = "VOX_SECRET_0"
[sidecar.http]
listen = "127.0.0.1:0"
vapi_secret_env = "VOX_SECRET_1"
webhook_secret_env = "VOX_SECRET_2"
""",
        encoding="utf-8",
    )
    config = load_config(path)
    assert sorted(config.secrets) == sorted(values.values())
    logs.configure(level="INFO", fmt="text", secrets=config.secrets, stream=log_stream)
    logging.getLogger("voxrecall.test").info("keys %s", " ".join(values.values()))
    assert not any(value in log_stream.getvalue() for value in values.values())
    assert log_stream.getvalue().count("[redacted]") == 3


QUOTED_SECRET = 's3cr"et\\value-with-both'  # a `"` and a `\`: JSON escapes both


@pytest.mark.parametrize("fmt", ["json", "text"])
def test_a_secret_is_redacted_before_its_field_is_escaped_or_cut(
    log_stream: io.StringIO, fmt: str
) -> None:
    """Redaction ran on the written line: JSON had escaped a secret's `"` and `\\` so it no
    longer matched, and a field cut through a secret kept the secret's head."""
    cut_secret = "ABCDEFGHIJKLMNOPQRSTUVWX"
    logs.configure("INFO", fmt, secrets=[QUOTED_SECRET, cut_secret], stream=log_stream)
    at_the_cut = "x" * (logs.MAX_FIELD_BYTES - 11) + cut_secret
    call = Call("Search", "voxrecall.v1.Retrieval", {}, None, task=None)  # type: ignore[arg-type]
    call.session_id = f"sess-{QUOTED_SECRET}"
    token = logs.current.set(call)
    try:
        log = logging.getLogger("voxrecall.test")
        log.info("key %s", QUOTED_SECRET, extra={"detail": at_the_cut})
        log.info("%s", at_the_cut)
        try:
            raise ValueError(f"refused {QUOTED_SECRET}")
        except ValueError:
            log.exception("failed")
    finally:
        logs.current.reset(token)
    written = log_stream.getvalue()
    for secret in (QUOTED_SECRET, cut_secret):
        for form in (secret, orjson.dumps(secret).decode()[1:-1], secret[:11]):
            assert form not in written, form
    assert written.count(logs.REDACTED) >= 5


CLI = "from sidecar.cli import main; raise SystemExit(main())"


def test_an_index_build_writes_no_line_of_the_http_client(tmp_path: Path) -> None:
    """`voxrecall index build` over an OpenAI-compatible server wrote httpx's INFO line per
    embedding request (the sidecar's logging quieted it; the other commands' did not)."""
    server = OpenAIServer().start()
    try:
        path = tmp_path / "voxrecall.toml"
        path.write_text(
            f"""
[embedder]
provider = "openai"
base_url = "{server.base_url}"
dimensions = 64
[[knowledge_base]]
name = "help"
[[knowledge_base.source]]
name = "kb"
type = "markdown"
path = "{EXAMPLE_KB}"
[index]
store = "{tmp_path / "store"}"
""",
            encoding="utf-8",
        )
        run = subprocess.run(
            [sys.executable, "-c", CLI, "index", "build", "--config", str(path)],
            capture_output=True,
            text=True,
            timeout=120,
            env={**os.environ, "OPENAI_API_KEY": "unused-by-the-local-server"},
        )
    finally:
        server.stop()
    assert run.returncode == 0, run.stderr
    assert server.requests >= 1
    assert "HTTP Request" not in run.stderr


def test_failures_from_many_addresses_are_lines_for_a_bounded_few(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """65,536 /64s of one /48 each got their own first lines: a flood of one line per failure.
    Past FAILURE_KINDS kinds in a window, the other clients are one kind."""
    monkeypatch.setattr(logs, "monotonic", lambda: 1000.0)  # one window, however slow the run
    lines = logs.FailureLines()
    admitted = sum(
        lines.admit(f"2001:db8:0:{i:x}::/64", "Turn", "INVALID_ARGUMENT") for i in range(5_000)
    )
    assert admitted == logs.FAILURE_KINDS + logs.FAILURE_LINES
    assert lines.admit("10.0.0.1", "Search", "NOT_FOUND")  # another method's first line: kept


def _core_line(message: str, error: str = 'Failed "execute_batch": (...)') -> logging.LogRecord:
    """A line as gRPC's aio server writes it: ERROR, its traceback (of ``error``) attached."""
    try:
        raise RuntimeError(error)
    except RuntimeError:
        exc_info = sys.exc_info()
    return logging.LogRecord(logs.GRPC_CORE_LOGGER, logging.ERROR, "", 0, message, (), exc_info)


def test_grpc_lines_for_answers_not_sent_are_failure_lines_and_others_pass(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """gRPC's ERROR line with a traceback for each answer it could not send becomes an INFO
    line naming the method, without the traceback, the first FAILURE_LINES of a window; its
    other lines pass untouched; where INFO is left out, so is the line."""
    monkeypatch.setattr(logs, "FAILURE_WINDOW_S", 3600.0)  # one window, however slow the loop
    grpc_logger = logging.getLogger(logs.GRPC_CORE_LOGGER)
    level = grpc_logger.level
    try:
        grpc_logger.setLevel(logging.INFO)
        core = logs.CoreBatchErrors()
        batch = (
            "ExecuteBatchError raised in core by servicer method [/voxrecall.v1.Retrieval/Search]"
        )
        lines = (_core_line(batch) for _ in range(3 * logs.FAILURE_LINES))
        kept = [r for r in lines if core.filter(r)]
        assert len(kept) == logs.FAILURE_LINES
        assert {(r.levelno, r.levelname, r.exc_info, r.exc_text) for r in kept} == {
            (logging.INFO, "INFO", None, None)
        }
        assert kept[0].getMessage().startswith("Search ANSWER_NOT_SENT: the call was over")
        refused = "Failed grpc_call_start_batch: 8 with grpc_call_error value: TOO_MANY_OPERATIONS"
        others = (
            _core_line("Unexpected [ValueError] raised by servicer method [/x/Y]"),
            _core_line(batch, refused),  # core refused the batch: the server's fault, kept
        )
        for other in others:
            assert core.filter(other)
            assert other.levelno == logging.ERROR
            assert other.exc_info
        long = _core_line(batch.replace("Search", "S" * 10_000))
        assert core.filter(long)
        assert len(long.getMessage()) < 2 * logs.MAX_ID_BYTES + 200
        grpc_logger.setLevel(logging.WARNING)  # logging at WARNING: left out, and not counted
        fresh = logs.CoreBatchErrors()
        assert not fresh.filter(_core_line(batch))
        assert not fresh.failures.kinds
    finally:
        grpc_logger.setLevel(level)


CHILD = """
import asyncio, logging, resource, sys
from sidecar.edge import logs
logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(levelname)s %(message)s")
resource.setrlimit(resource.RLIMIT_NOFILE, (64, resource.getrlimit(resource.RLIMIT_NOFILE)[1]))

async def main():
    logs.quiet_loop_errors()
    held = []
    async def keep(reader, writer):
        held.append(writer)  # every connection held: the descriptors run out
    server = await asyncio.start_server(keep, "127.0.0.1", 0, backlog=2048)
    print(server.sockets[0].getsockname()[1], flush=True)
    await asyncio.sleep(float(sys.argv[1]))

asyncio.run(main())
"""


def test_accepts_past_the_open_file_limit_are_a_few_lines_not_a_flood() -> None:
    """The event loop wrote its line and traceback for every accept that failed for want of
    file descriptors: 173,573 of them (217 MB) in 20 s of a flood of connections. Now the
    first few a window, without the traceback."""
    child = subprocess.Popen(
        [sys.executable, "-c", CHILD, "3"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, cwd=REPO, text=True,
    )  # fmt: skip
    assert child.stdout is not None
    port = int(child.stdout.readline())
    clients = []
    try:
        for _ in range(300):  # past the child's 64 descriptors, each left open
            clients.append(socket.create_connection(("127.0.0.1", port), timeout=LIVENESS_S))
        _, err = child.communicate(timeout=LIVENESS_S + 3)
    finally:
        for client in clients:
            client.close()
        child.kill()
    lines = [line for line in err.splitlines() if "out of system resource" in line]
    assert lines, err[-2000:]  # the descriptors did run out
    # the first FAILURE_LINES a FAILURE_WINDOW_S, and a count of the rest: 4 s at most here
    assert len(lines) <= logs.FAILURE_LINES * 4 / logs.FAILURE_WINDOW_S
    assert all(line.startswith("WARNING ") for line in lines)
    assert "Too many open files: connections are refused until some close" in lines[0]
    assert "more like this suppressed" in err
    assert "Traceback" not in err


def test_only_a_refused_accept_is_quieted_by_the_loop_s_handler() -> None:
    """A task failing with ENOMEM (an mmap of a snapshot, say) was written as a refused accept,
    without its traceback: only the listening socket's accepts are counted."""

    class Loop:
        def __init__(self) -> None:
            self.defaults: list[dict[str, Any]] = []

        def default_exception_handler(self, context: dict[str, Any]) -> None:
            self.defaults.append(context)

    loop, handler = Loop(), logs.LoopErrors()
    task = {"message": "Task exception was never retrieved", "exception": OSError(12, "ENOMEM")}
    handler(loop, task)  # type: ignore[arg-type]
    other = {"message": "boom", "exception": ValueError("x")}
    handler(loop, other)  # type: ignore[arg-type]
    assert loop.defaults == [task, other]
