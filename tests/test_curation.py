"""A curated knowledge base: proposed sources are indexed only once approved (the CLI, the
registry file, real builds), and ``index watch`` rebuilds a base on an authenticated request."""

from __future__ import annotations

import hashlib
import http.client
import json
import logging
import socket
import sys
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from index import ingest
from index.build import build_knowledge_base
from index.config import NAME_CHARS, NAMED
from index.curation import Registry
from index.embedders.base import HashEmbedder
from index.errors import ConfigError, RegistryError
from index.ingest import RebuildListener
from index.snapshot import load_snapshot
from index.store import LocalStore
from index.watch import Watcher, WatchOptions
from sidecar.cli import main
from sidecar.config import Config, load_config

TOKEN = "t0k3n-for-the-docs-ci-0123456789"
LIVENESS_S = 20.0  # how long a test waits for the watcher's build: not a timing check


def setup(tmp_path: Path) -> tuple[Path, Path]:
    docs = tmp_path / "docs"
    docs.mkdir()
    (docs / "billing.md").write_text("# Billing\n\nInvoices are sent on the first of the month.\n")
    proposed = tmp_path / "research" / "warranty.md"
    proposed.parent.mkdir()
    proposed.write_text("# Warranty\n\nThe router has a two-year warranty.\n")
    config = tmp_path / "voxrecall.toml"
    config.write_text(
        '[index]\nstore = "store"\n\n[[knowledge_base]]\nname = "kb"\n\n'
        f'[[knowledge_base.source]]\ntype = "markdown"\npath = "{docs}"\n'
    )
    return config, proposed


def paths(config: Config, embedder: HashEmbedder) -> set[str]:
    build_knowledge_base(config, config.knowledge_bases[0], embedder)
    snap = load_snapshot(LocalStore(config.index.store).latest_dir("kb"), expected=embedder.info)
    return {c.source_path for c in snap.chunks}


def test_a_pending_source_is_indexed_only_once_approved(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path, proposed = setup(tmp_path)
    embedder = HashEmbedder(dimension=32)
    cfg = ["--config", str(path)]
    assert main(["source", "add", str(proposed), "--kb", "kb", "--by", "research-agent", *cfg]) == 0
    assert (
        main(["source", "add", "https://example.com/faq", "--kb", "kb", "--by", "ana", *cfg]) == 0
    )
    config = load_config(path)
    assert paths(config, embedder) == {"billing.md"}  # pending: not indexed
    [file_entry, url_entry] = Registry(config.index.registry).entries()
    assert main(["source", "reject", url_entry.id, "--by", "bo", *cfg]) == 0
    assert main(["source", "approve", file_entry.id, "--by", "bo", *cfg]) == 0
    # its name, never the indexer's folders, which callers and models would see
    assert paths(config, embedder) == {"billing.md", "warranty.md"}
    capsys.readouterr()
    assert main(["source", "list", "--json", *cfg]) == 0
    listed = {e["location"]: e for e in json.loads(capsys.readouterr().out)}
    assert listed[str(proposed.resolve())]["status"] == "approved"
    assert listed[str(proposed.resolve())]["proposed_by"] == "research-agent"
    assert listed["https://example.com/faq"]["status"] == "rejected"
    assert listed["https://example.com/faq"]["decided_by"] == "bo"
    assert all(e["proposed_at"].endswith("Z") for e in listed.values())
    assert main(["source", "list", "--status", "pending", *cfg]) == 0
    assert capsys.readouterr().out == ""


def test_approved_files_of_one_name_are_served_apart_without_their_folders(
    tmp_path: Path,
) -> None:
    path, proposed = setup(tmp_path)
    other = tmp_path / "drafts" / "warranty.md"
    other.parent.mkdir()
    other.write_text("# Warranty draft\n\nThe router's warranty may grow to three years.\n")
    cfg = ["--config", str(path)]
    for file in (proposed, other):
        assert main(["source", "add", str(file), "--kb", "kb", "--by", "ana", *cfg]) == 0
    config = load_config(path)
    for entry in Registry(config.index.registry).entries():
        assert main(["source", "approve", entry.id, "--by", "bo", *cfg]) == 0
    digest = hashlib.sha256(str(other.resolve()).encode()).hexdigest()[:8]
    served = paths(config, HashEmbedder(dimension=32))
    assert served == {"billing.md", "warranty.md", f"warranty-{digest}.md"}
    assert not any(str(tmp_path) in p for p in served)


def test_registry_mistakes_are_refused_with_a_reason(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path, proposed = setup(tmp_path)
    cfg = ["--config", str(path)]
    assert main(["source", "add", str(proposed), "--kb", "kb", *cfg]) == 0
    assert main(["source", "add", str(proposed), "--kb", "kb", *cfg]) == 2
    assert "already proposed" in capsys.readouterr().err
    assert main(["source", "approve", "0000000000", *cfg]) == 2
    assert "no source '0000000000'" in capsys.readouterr().err
    assert main(["source", "add", str(proposed), "--kb", "nope", *cfg]) == 2
    assert main(["source", "add", str(tmp_path / "missing.md"), "--kb", "kb", *cfg]) == 2
    registry = load_config(path).index.registry
    registry.write_text("{not json")
    with pytest.raises(RegistryError, match="not a sources registry"):
        Registry(registry).entries()


def request(port: int, method: str, path: str, token: str = TOKEN) -> tuple[int, dict[str, object]]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    try:
        conn.request(method, path, headers={"Authorization": f"Bearer {token}"} if token else {})
        response = conn.getresponse()
        return response.status, json.loads(response.read())
    finally:
        conn.close()


def wait_for(condition: Callable[[], bool], what: str) -> None:
    deadline = time.monotonic() + LIVENESS_S
    while not condition():
        assert time.monotonic() < deadline, f"{what} did not happen"
        time.sleep(0.02)


@pytest.fixture
def watching(tmp_path: Path) -> Iterator[tuple[Watcher, RebuildListener, Config]]:
    path, _ = setup(tmp_path)
    config = load_config(path)
    # an hour between polls: only the request can start the second build
    watcher = Watcher(config, HashEmbedder(dimension=32), WatchOptions(poll_s=3600))
    listener = RebuildListener("127.0.0.1:0", TOKEN, watcher, "VOXRECALL_REBUILD_TOKEN").start()
    thread = threading.Thread(target=watcher.run, daemon=True)
    thread.start()
    yield watcher, listener, config
    watcher.stop.set()
    watcher.wake.set()
    thread.join(timeout=LIVENESS_S)
    listener.stop()


def test_an_authenticated_request_rebuilds_one_base_now(
    watching: tuple[Watcher, RebuildListener, Config], tmp_path: Path
) -> None:
    _watcher, listener, config = watching
    store = LocalStore(config.index.store)
    wait_for(lambda: store.latest("kb") is not None, "the first build")
    first = store.latest("kb")
    (tmp_path / "docs" / "returns.md").write_text("# Returns\n\nReturn it within 30 days.\n")
    assert request(listener.port, "POST", "/rebuild/kb", token="")[0] == 401
    assert request(listener.port, "POST", "/rebuild/kb", token=TOKEN + "x")[0] == 401
    assert request(listener.port, "POST", "/rebuild/other") == (
        404,
        {"error": "no knowledge base 'other'; known: 'kb'"},  # named, as the sidecar's are
    )
    assert store.latest("kb") == first  # no build was asked by those
    status, body = request(listener.port, "POST", "/rebuild/kb")
    assert (status, body) == (202, {"knowledge_base": "kb", "queued": True})

    def built() -> bool:
        status, body = request(listener.port, "GET", "/rebuild/kb")
        assert status == 200
        last = body["last"]
        return isinstance(last, dict) and "request" in last["reasons"]

    wait_for(built, "the requested build")
    _, body = request(listener.port, "GET", "/rebuild/kb")
    assert body["last"]["summary"]["published"] is True  # type: ignore[index]
    assert store.latest("kb") != first
    assert first in store.versions("kb")  # the previous version stays: `index rollback` takes it


@pytest.fixture
def listening(tmp_path: Path) -> Iterator[tuple[Watcher, RebuildListener]]:
    """A listener over a watcher that does not run: a request only queues."""
    path, _ = setup(tmp_path)
    watcher = Watcher(load_config(path), HashEmbedder(dimension=32), WatchOptions(poll_s=3600))
    listener = RebuildListener("127.0.0.1:0", TOKEN, watcher, "VOXRECALL_REBUILD_TOKEN").start()
    yield watcher, listener
    listener.stop()


def closed_unanswered(sock: socket.socket) -> bool:
    """Whether the listener closed ``sock`` without a byte of answer."""
    sock.settimeout(LIVENESS_S)
    try:
        return sock.recv(1024) == b""
    except ConnectionResetError:  # closed with the request unread
        return True


def accepted(port: int) -> bool:
    try:
        return request(port, "POST", "/rebuild/kb")[0] == 202
    except (http.client.RemoteDisconnected, ConnectionResetError):
        return False


@pytest.fixture
def short_reads(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(ingest, "REQUEST_TIMEOUT_S", 0.2)


@pytest.mark.usefixtures("short_reads")
def test_a_stalled_rebuild_request_is_closed(
    listening: tuple[Watcher, RebuildListener],
) -> None:
    watcher, listener = listening
    with socket.create_connection(("127.0.0.1", listener.port)) as stalled:
        stalled.sendall(b"POST /rebuild/kb HTTP/1.1\r\nAuthorization: Bearer ")  # and no more
        assert closed_unanswered(stalled)
    assert watcher.last("kb")["queued"] is False
    assert request(listener.port, "POST", "/rebuild/kb")[0] == 202


@pytest.mark.usefixtures("short_reads")
def test_a_trickled_rebuild_request_is_closed_at_its_deadline(
    listening: tuple[Watcher, RebuildListener],
) -> None:
    """A byte at a time, each well within the per-read timeout: the whole request's deadline
    still closes it, long before this head is whole."""
    watcher, listener = listening
    head = f"POST /rebuild/kb HTTP/1.1\r\nAuthorization: Bearer {TOKEN}\r\nX-Pad: {'a' * 400}"
    closed = False
    with socket.create_connection(("127.0.0.1", listener.port)) as slow:
        for byte in head.encode():
            try:
                slow.sendall(bytes([byte]))
            except (BrokenPipeError, ConnectionResetError):
                closed = True
                break
            time.sleep(0.02)
    assert closed  # cut off while the head was still arriving
    assert watcher.last("kb")["queued"] is False
    assert request(listener.port, "POST", "/rebuild/kb")[0] == 202


@pytest.fixture
def two_connections(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(ingest, "MAX_CONNECTIONS", 2)
    monkeypatch.setattr(ingest, "REQUEST_TIMEOUT_S", 600.0)  # the idle ones hold their slots


@pytest.mark.usefixtures("two_connections")
def test_a_flood_of_rebuild_connections_is_bounded(
    listening: tuple[Watcher, RebuildListener],
) -> None:
    watcher, listener = listening
    idle = [socket.create_connection(("127.0.0.1", listener.port)) for _ in range(2)]
    with socket.create_connection(("127.0.0.1", listener.port)) as third:
        third.sendall(
            f"POST /rebuild/kb HTTP/1.1\r\nAuthorization: Bearer {TOKEN}\r\n\r\n".encode()
        )
        assert closed_unanswered(third)
    assert watcher.last("kb")["queued"] is False  # the refused request queued nothing
    for sock in idle:
        sock.close()
    wait_for(lambda: accepted(listener.port), "a free slot")
    assert watcher.last("kb")["queued"] is True


@pytest.fixture
def idle_holds(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(ingest, "REQUEST_TIMEOUT_S", 600.0)  # the idle ones hold their slots


other_loopbacks = pytest.mark.skipif(
    sys.platform != "linux", reason="binds 127.0.0.2-11, which only Linux routes to loopback"
)


@other_loopbacks
@pytest.mark.usefixtures("idle_holds")
def test_one_address_cannot_take_every_rebuild_slot(
    listening: tuple[Watcher, RebuildListener], clients: Clients
) -> None:
    """16 idle connections from a stranger (no token, nothing sent) held every slot, and the
    CI's POST was closed unread; now the stranger's address holds 2, and the CI is served."""
    watcher, listener = listening
    stranger = "127.0.0.2"  # another loopback address than the CI's 127.0.0.1
    for _ in range(ingest.MAX_CONNECTIONS - 1):
        clients.connect(stranger)
    one = clients.connect(stranger)
    one.sendall(f"POST /rebuild/kb HTTP/1.1\r\nAuthorization: Bearer {TOKEN}\r\n\r\n".encode())
    assert closed_unanswered(one)  # the stranger's third and later are closed unread
    assert watcher.last("kb")["queued"] is False
    assert request(listener.port, "POST", "/rebuild/kb")[0] == 202
    assert watcher.last("kb")["queued"] is True


@other_loopbacks
@pytest.mark.usefixtures("idle_holds")
def test_four_stranger_addresses_cannot_take_every_rebuild_slot(
    listening: tuple[Watcher, RebuildListener], clients: Clients
) -> None:
    """Four stranger addresses with 4 idle connections each held all 16 slots, and the CI's
    POST was closed unread; now each holds 2, eight slots stay free, and the CI is served."""
    watcher, listener = listening
    for n in range(2, 6):  # 127.0.0.2 .. 127.0.0.5, other loopback addresses than the CI's
        for _ in range(4):
            clients.connect(f"127.0.0.{n}")
    assert request(listener.port, "POST", "/rebuild/kb")[0] == 202
    assert watcher.last("kb")["queued"] is True


class Clients:
    """A test's connections to the listener, each from a loopback address of its choice (Linux
    routes all of 127.0.0.0/8 to loopback); every one is closed when the test ends."""

    def __init__(self, port: int) -> None:
        self.port = port
        self.made: list[socket.socket] = []

    def connect(self, address: str = "127.0.0.1") -> socket.socket:
        sock = socket.create_connection(("127.0.0.1", self.port), source_address=(address, 0))
        self.made.append(sock)
        return sock

    def strangers(self, count: int, first: int) -> list[socket.socket]:
        """``count`` connections that send nothing yet, ``MAX_CONNECTIONS_PER_ADDRESS`` (2)
        from each address from 127.0.0.``first`` on."""
        per = ingest.MAX_CONNECTIONS_PER_ADDRESS
        return [self.connect(f"127.0.0.{first + i // per}") for i in range(count)]


@pytest.fixture
def clients(listening: tuple[Watcher, RebuildListener]) -> Iterator[Clients]:
    made = Clients(listening[1].port)
    yield made
    for sock in made.made:
        sock.close()


def still_open(sock: socket.socket) -> bool:
    """Whether the listener still holds ``sock`` silently (not closed, nothing answered)."""
    sock.setblocking(False)
    try:
        sock.recv(1)  # b"": closed; a byte: answered
        return False
    except BlockingIOError:
        return True
    except OSError:
        return False


@other_loopbacks
@pytest.mark.usefixtures("idle_holds")
def test_eight_stranger_addresses_cannot_keep_the_ci_out(
    listening: tuple[Watcher, RebuildListener], clients: Clients
) -> None:
    """Eight stranger addresses with 2 idle connections each held all 16 slots, and the CI's
    POST was closed unread; now it pushes out the oldest connection without the token and is
    served, and the other strangers keep theirs."""
    watcher, listener = listening
    idle = clients.strangers(ingest.MAX_CONNECTIONS, 2)  # 127.0.0.2 .. 9
    assert request(listener.port, "POST", "/rebuild/kb")[0] == 202
    assert watcher.last("kb")["queued"] is True
    assert closed_unanswered(idle[0])  # the oldest was pushed out
    assert all(still_open(sock) for sock in idle[1:])


class HeldRebuilds:
    """The watcher, with each request held until ``go`` is set: requests with the token that
    are still in progress."""

    def __init__(self, watcher: Watcher) -> None:
        self._watcher = watcher
        self.go = threading.Event()
        self._arrived = threading.Condition()
        self.waiting = 0

    def bases(self) -> list[str]:
        return self._watcher.bases()

    def last(self, knowledge_base: str) -> dict[str, object]:
        return self._watcher.last(knowledge_base)

    def request(self, knowledge_base: str) -> None:
        with self._arrived:
            self.waiting += 1
            self._arrived.notify_all()
        self.go.wait(LIVENESS_S)
        self._watcher.request(knowledge_base)

    def wait_for(self, n: int) -> None:
        with self._arrived:
            assert self._arrived.wait_for(lambda: self.waiting >= n, LIVENESS_S), self.waiting


POST = f"POST /rebuild/kb HTTP/1.1\r\nAuthorization: Bearer {TOKEN}\r\n\r\n".encode()


def post_from(port: int, address: str) -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", port), source_address=(address, 0))
    sock.sendall(POST)
    return sock


def answer(sock: socket.socket) -> bytes:
    sock.settimeout(LIVENESS_S)
    with sock, sock.makefile("rb") as reader:
        return reader.readline()


@other_loopbacks
@pytest.mark.usefixtures("idle_holds")
def test_only_requests_with_the_token_keep_a_newcomer_out(tmp_path: Path) -> None:
    """15 requests with the token in progress and one idle stranger: the CI's POST pushes out
    the stranger (it was closed unread) and is served; with 16 requests with the token in
    progress, the next one is closed unread, and none of the 16 is pushed out."""
    path, _ = setup(tmp_path)
    watcher = Watcher(load_config(path), HashEmbedder(dimension=32), WatchOptions(poll_s=3600))
    held = HeldRebuilds(watcher)
    listener = RebuildListener("127.0.0.1:0", TOKEN, held, "VOXRECALL_REBUILD_TOKEN").start()
    addresses = [f"127.0.0.{n}" for n in range(2, 10) for _ in range(2)][:15]
    posts = [post_from(listener.port, address) for address in addresses]
    stranger = socket.socket()
    try:
        held.wait_for(15)
        stranger.bind(("127.0.0.10", 0))
        stranger.connect(("127.0.0.1", listener.port))  # sends nothing
        posts.append(post_from(listener.port, "127.0.0.1"))  # the CI
        held.wait_for(16)
        assert closed_unanswered(stranger)
        with post_from(listener.port, "127.0.0.11") as late:
            assert closed_unanswered(late)
        held.go.set()
        assert [answer(sock) for sock in posts] == [b"HTTP/1.1 202 Accepted\r\n"] * 16
    finally:
        held.go.set()
        stranger.close()
        for sock in posts:
            sock.close()
        listener.stop()


@other_loopbacks
@pytest.mark.usefixtures("idle_holds")
def test_refused_rebuild_connections_get_one_line_and_a_count(
    listening: tuple[Watcher, RebuildListener], caplog: pytest.LogCaptureFixture
) -> None:
    """A stranger re-opening connections past its 2 wrote a warning per refusal (153,379 lines
    in 6 s); now its first refusal gets one, and the rest one count (here written at stop)."""
    _, listener = listening
    stranger = ("127.0.0.2", 0)
    idle = [
        socket.create_connection(("127.0.0.1", listener.port), source_address=stranger)
        for _ in range(ingest.MAX_CONNECTIONS_PER_ADDRESS)
    ]
    try:
        with caplog.at_level(logging.WARNING, logger="voxrecall.index.ingest"):
            for _ in range(50):
                with socket.create_connection(
                    ("127.0.0.1", listener.port), source_address=stranger
                ) as one:
                    assert closed_unanswered(one)
            listener.stop()
    finally:
        for sock in idle:
            sock.close()
    lines = [r.getMessage() for r in caplog.records if r.name == "voxrecall.index.ingest"]
    assert len(lines) == 2, lines
    assert lines[0].startswith(
        "rebuild listener: closed a connection from 127.0.0.2 unread, 2 connections open from "
        "this address"
    )
    assert "closed 49 more connections from 127.0.0.2" in lines[1]


def handler_threads() -> set[threading.Thread]:
    return {t for t in threading.enumerate() if "process_request_thread" in t.name}


def held_with_bytes(listener: RebuildListener) -> int:
    """How many of the listener's connections it has heard bytes from (``_Held.first``)."""
    return sum(1 for held in list(listener._httpd._held.values()) if held.first)


@pytest.mark.usefixtures("two_connections")
def test_connections_pushed_out_mid_request_end_without_a_traceback(
    listening: tuple[Watcher, RebuildListener],
    capfd: pytest.CaptureFixture[str],
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Connections with half a request line, pushed out by the next: each one's handler read
    the half line, answered it 400 on the closed socket and socketserver printed the
    BrokenPipeError's traceback (15,590 in 10 s from 10 addresses); now they end quietly, and
    the refusals are one line per address."""
    _, listener = listening
    before = handler_threads()
    socks = []
    try:
        with caplog.at_level(logging.WARNING, logger="voxrecall.index.ingest"):
            for n in range(12):  # two addresses in turn; each newcomer pushes one out
                sock = socket.create_connection(
                    ("127.0.0.1", listener.port), source_address=(f"127.0.0.{2 + n % 2}", 0)
                )
                sock.sendall(b"GET /x H")
                socks.append(sock)
            for sock in socks:
                sock.close()
            wait_for(lambda: not handler_threads() - before, "the handlers' end")
            listener.stop()
    finally:
        for sock in socks:
            sock.close()
    err = capfd.readouterr().err
    assert "Traceback" not in err, err[:2000]
    lines = [r.getMessage() for r in caplog.records if r.name == "voxrecall.index.ingest"]
    assert 1 <= len(lines) <= 4, lines  # a line and a count per address
    assert not any("failed" in line for line in lines), lines


class BrokenRebuilds:
    """A watcher whose every call raises: an error no closed connection explains."""

    def bases(self) -> list[str]:
        raise RuntimeError("the watcher broke")

    def request(self, knowledge_base: str) -> None:
        raise RuntimeError("the watcher broke")

    def last(self, knowledge_base: str) -> dict[str, object]:
        raise RuntimeError("the watcher broke")


def test_an_unexpected_handler_error_is_one_counted_line(
    capfd: pytest.CaptureFixture[str], caplog: pytest.LogCaptureFixture
) -> None:
    """An error no closed connection explains is a line of the refusal lines, once per address
    a window, not a traceback per connection on stderr; its stack is at DEBUG, where a bug's
    can be found."""
    listener = RebuildListener("127.0.0.1:0", TOKEN, BrokenRebuilds(), "X").start()
    before = handler_threads()
    try:
        with caplog.at_level(logging.DEBUG, logger="voxrecall.index.ingest"):
            for _ in range(5):
                with pytest.raises((http.client.RemoteDisconnected, ConnectionResetError)):
                    request(listener.port, "POST", "/rebuild/kb")
            wait_for(lambda: not handler_threads() - before, "the handlers' end")
    finally:
        listener.stop()
    assert "Traceback" not in capfd.readouterr().err
    lines = [  # the listener's INFO start line too where an earlier test set INFO
        r.getMessage()
        for r in caplog.records
        if r.name == "voxrecall.index.ingest" and r.levelno >= logging.WARNING
    ]
    assert lines[0].startswith(
        "rebuild listener: a connection from 127.0.0.1 failed: RuntimeError: the watcher broke"
    )
    assert "closed 4 more connections from 127.0.0.1" in lines[1]
    assert len(lines) == 2, lines
    stacks = [
        r.exc_info
        for r in caplog.records
        if r.name == "voxrecall.index.ingest" and r.levelno == logging.DEBUG and r.exc_info
    ]
    assert [str(info[1]) for info in stacks] == ["the watcher broke"] * 5


class ManyBases:
    """A watcher of 200 bases of 200 characters each: an unknown base's error names 5, cut."""

    def bases(self) -> list[str]:
        return [f"{i:03d}" + "b" * 197 for i in range(200)]

    def request(self, knowledge_base: str) -> None:
        raise AssertionError("no rebuild is asked of an unknown base")

    def last(self, knowledge_base: str) -> dict[str, object]:
        raise AssertionError("no rebuild is asked of an unknown base")


def test_an_unknown_base_is_answered_with_a_few_known_ones_within_bounds() -> None:
    listener = RebuildListener("127.0.0.1:0", TOKEN, ManyBases(), "X").start()
    try:
        status, body = request(listener.port, "POST", "/rebuild/" + "n" * 500)
    finally:
        listener.stop()
    assert status == 404
    error = str(body["error"])
    assert error.startswith(f"no knowledge base {'n' * NAME_CHARS + '...'!r}; known: '000bbb")
    assert error.endswith(f"and {200 - NAMED} more")
    assert len(error.encode()) < (NAMED + 1) * (NAME_CHARS + 8) + 100


PLAUSIBLE_HEAD = b"POST /rebuild/kb HTTP/1.1\r\n"


@other_loopbacks
@pytest.mark.usefixtures("idle_holds")
def test_a_ci_request_keeps_its_slot_once_its_token_arrives(
    listening: tuple[Watcher, RebuildListener], clients: Clients
) -> None:
    """The CI's head in two writes: its request line and token, then the blank line. Strangers
    whose request lines look as the CI's fill the other 15 slots and one more arrives: the CI,
    the oldest without its head whole, was pushed out; now its token, read as it arrived,
    keeps its slot, the oldest stranger is pushed out and the CI is answered 202."""
    watcher, listener = listening
    ci = clients.connect()
    ci.sendall(f"POST /rebuild/kb HTTP/1.1\r\nAuthorization: Bearer {TOKEN}\r\n".encode())
    strangers = clients.strangers(15, 2)
    for sock in strangers:
        sock.sendall(PLAUSIBLE_HEAD)
    wait_for(lambda: held_with_bytes(listener) == 16, "the heads heard")
    clients.connect("127.0.0.10")  # the late one
    assert closed_unanswered(strangers[0])
    ci.sendall(b"\r\n")
    assert answer(ci) == b"HTTP/1.1 202 Accepted\r\n"
    assert watcher.last("kb")["queued"] is True
    assert all(still_open(sock) for sock in strangers[1:])


@other_loopbacks
@pytest.mark.usefixtures("idle_holds")
def test_strangers_whose_bytes_are_no_rebuild_request_are_pushed_out_first(
    listening: tuple[Watcher, RebuildListener], clients: Clients
) -> None:
    """The CI's request line half sent (no token yet), two connections sending ``GET /x H``
    and 13 whose request lines look as the CI's: a newcomer pushed out the CI, the oldest; now
    it pushes out a ``GET /x H`` one, and the CI, its head done, is answered 202."""
    _, listener = listening
    ci = clients.connect()
    ci.sendall(b"POST /rebuild/kb H")
    garbage = clients.strangers(2, 2)
    others = clients.strangers(13, 3)
    for sock in garbage:
        sock.sendall(b"GET /x H")
    for sock in others:
        sock.sendall(PLAUSIBLE_HEAD)
    wait_for(lambda: held_with_bytes(listener) == 16, "the first bytes heard")
    clients.connect("127.0.0.10")  # the late one
    assert closed_unanswered(garbage[0])
    assert all(still_open(sock) for sock in [garbage[1], *others])
    ci.sendall(f"TTP/1.1\r\nAuthorization: Bearer {TOKEN}\r\n\r\n".encode())
    assert answer(ci) == b"HTTP/1.1 202 Accepted\r\n"


def test_a_head_its_handler_has_not_read_yet_is_looked_at_before_a_push_out(
    listening: tuple[Watcher, RebuildListener],
) -> None:
    """The server's side of a connection whose handler has not read its head yet (a socket
    pair, no handler): about to be pushed out, its unread bytes are peeked, never waiting for
    more (the peek runs under the lock); with the token it is vouched for, without it not, and
    nothing is taken from what the handler will read."""
    _, listener = listening
    server = listener._httpd
    with ThreadPoolExecutor(max_workers=1) as pool:
        for head, shows in [(POST, True), (PLAUSIBLE_HEAD, False), (b"", False)]:
            ours, theirs = socket.socketpair()
            with ours, theirs:  # closing ``theirs`` ends a peek that waits: the pool can end
                ours.settimeout(None)  # a blocking socket: a peek that waits, waits for good
                theirs.sendall(head)
                with server._lock:
                    server._held[ours] = ingest._Held("127.0.0.9")
                    peek = pool.submit(server._token_unread, ours)
                    assert peek.result(timeout=30) is shows  # a bound on liveness, not a timing
                    assert server._held.pop(ours).vouched is shows
                if head:
                    assert ours.recv(len(head)) == head


def test_a_connection_is_pushed_out_by_what_it_sent() -> None:
    """``_Held.rank``: nothing sent first, then bytes that are no POST to the rebuild path,
    then ones that may be."""
    ranks = [
        ingest._Held("a", first=first).rank()
        for first in [b"", b"GET /x H", b"POST /x", b"P", b"POST /rebuild/"]
    ]
    assert ranks == [0, 1, 1, 2, 2]


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_refusal_lines_are_one_a_window_per_address_and_bounded(
    caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(ingest, "REFUSAL_ADDRESSES", 3)
    clock = Clock()
    lines = ingest.RefusalLines(clock)
    with caplog.at_level(logging.WARNING, logger="voxrecall.index.ingest"):
        for address in ["10.0.0.1", "10.0.0.2", "10.0.0.3", "10.0.0.4", "10.0.0.5"] * 10:
            lines.refused(address, "full")
        first = [r.getMessage() for r in caplog.records]
        caplog.clear()
        clock.now += ingest.REFUSAL_WINDOW_S / 2
        lines.refused("10.0.0.1", "full")  # still in its window: counted
        assert caplog.records == []
        clock.now += ingest.REFUSAL_WINDOW_S / 2
        lines.refused("10.0.0.9", "full")  # the window is over: every count, then its line
        later = [r.getMessage() for r in caplog.records]
    # three addresses told apart, the two past them are one
    assert [line.split("from ")[1].split(" unread")[0] for line in first] == [
        "10.0.0.1",
        "10.0.0.2",
        "10.0.0.3",
        "other addresses",
    ]
    counts = sorted(line.split("closed ")[1] for line in later if "more connections" in line)
    assert counts == [
        "10 more connections from 10.0.0.1 in 60 s",
        "19 more connections from other addresses in 60 s",
        "9 more connections from 10.0.0.2 in 60 s",
        "9 more connections from 10.0.0.3 in 60 s",
    ]
    assert "closed a connection from 10.0.0.9 unread, full" in later[-1]


def test_the_listener_needs_a_long_token() -> None:
    with pytest.raises(ConfigError, match="VOXRECALL_REBUILD_TOKEN"):
        RebuildListener("127.0.0.1:0", "short", None, "VOXRECALL_REBUILD_TOKEN")  # type: ignore[arg-type]


def test_approving_a_source_makes_the_watcher_rebuild(tmp_path: Path) -> None:
    path, proposed = setup(tmp_path)
    config = load_config(path)
    watcher = Watcher(config, HashEmbedder(dimension=32), WatchOptions(poll_s=0))
    assert [e.reasons for e in watcher.cycle()] == [("start",)]
    entry = Registry(config.index.registry).add("kb", str(proposed), "ana")
    assert watcher.cycle() == []  # pending: nothing to do
    Registry(config.index.registry).decide(entry.id, "approved", "bo")
    [event] = watcher.cycle()
    assert event.reasons == ("files",)
    assert event.summary is not None
    assert event.summary.published
