"""The HTTP door's bounds on the rest of a request (its body and a chunked body's trailer, read
or not) and on a head that comes in one read, against a real sidecar on 127.0.0.1 port 0 and
clients on raw sockets that misbehave.

The other bounds of the door (the head's deadline, pipelining, the connection caps) are in
tests/test_http_door.py.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import ssl
from collections.abc import AsyncIterator
from pathlib import Path

import orjson
import pytest

from index.embedders.base import Embedder
from sidecar.edge.server import Sidecar
from sidecar.http import door as http_door
from tests import test_http_door
from tests.hardening_kit import TOKEN_A, build_store, running, sidecar_config

LIVENESS_S = 20.0  # how long a raw exchange may wait for the door: not a timing check
SENT_CAP = 4 << 20  # 4 MiB: far past what a bounded door reads of a request's trailer


@pytest.fixture(scope="module")
def store(tmp_path_factory: pytest.TempPathFactory, local_embedder: Embedder) -> Path:
    return build_store(tmp_path_factory.mktemp("http-requests"), local_embedder)


@pytest.fixture
def long_keep_alive(monkeypatch: pytest.MonkeyPatch) -> None:
    # only the bounds under test close a connection, however slow the machine
    monkeypatch.setattr(http_door, "KEEP_ALIVE_S", 600)


@pytest.fixture
async def sidecar(
    store: Path, local_embedder: Embedder, long_keep_alive: None, monkeypatch: pytest.MonkeyPatch
) -> AsyncIterator[Sidecar]:
    """A door with a token on /mcp; the Vapi path needs none (it reads its body at once)."""
    monkeypatch.setenv("VOX_TEST_TOKEN", TOKEN_A)
    http = {"listen": "127.0.0.1:0", "read_page_bases": ["help"], "max_body_bytes": 16 * 1024}
    config = sidecar_config(store, auth={"token_env": "VOX_TEST_TOKEN"}, http=http)
    async with running(config, local_embedder) as sc:
        yield sc


async def connect(sc: Sidecar) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    return await asyncio.open_connection("127.0.0.1", sc.http_port)


async def answer(reader: asyncio.StreamReader) -> bytes:
    """One answer's head and body (every answer of the door has a content-length)."""
    async with asyncio.timeout(LIVENESS_S):
        head = await reader.readuntil(b"\r\n\r\n")
        length = next(
            int(line.split(b":")[1])
            for line in head.lower().split(b"\r\n")
            if line.startswith(b"content-length:")
        )
        return head + await reader.readexactly(length)


async def whole_answer(sc: Sidecar, data: bytes) -> bytes:
    """What the door answers to ``data`` on a connection of its own, read until it closes."""
    reader, writer = await connect(sc)
    try:
        writer.write(data)
        async with asyncio.timeout(LIVENESS_S):
            return await reader.read()
    finally:
        writer.close()


async def closed(reader: asyncio.StreamReader) -> bool:
    """Whether the door closes the connection (it sends nothing more before it does)."""
    with contextlib.suppress(ConnectionResetError):
        async with asyncio.timeout(LIVENESS_S):
            return await reader.read() == b""
    return True


def chunked(path: str, *headers: str, host: str = "x") -> bytes:
    lines = "".join(f"{h}\r\n" for h in headers)
    return f"POST {path} HTTP/1.1\r\nhost: {host}\r\n{lines}transfer-encoding: chunked\r\n\r\n".encode()


TRAILER = b"x-t: " + b"a" * 8000 + b"\r\n"


@pytest.mark.parametrize("path", ["/vapi/knowledge-base", "/healthz", "/mcp"])
async def test_trailer_fields_past_their_cap_close_the_connection_unkept(
    sidecar: Sidecar, path: str
) -> None:
    """A chunked body's trailer sent without end, to a path that reads its body (Vapi), one
    that answers without reading it (health) and one that refuses it unread (/mcp without a
    token): the connection is closed soon after MAX_TRAILER_BYTES, where the door kept every
    field in the request's headers (2.5 GB of them in 8 s) for as long as the client sent."""
    assert sidecar.http is not None
    _, writer = await connect(sidecar)
    writer.write(chunked(path, "content-type: application/json") + b"2\r\n{}\r\n0\r\n")
    sent = 0
    with contextlib.suppress(ConnectionError):
        async with asyncio.timeout(LIVENESS_S):
            while sent < SENT_CAP:
                writer.write(TRAILER * 64)
                await writer.drain()
                sent += len(TRAILER) * 64
    writer.close()
    assert sent < SENT_CAP, "the door read the trailer on without closing the connection"
    assert sidecar.http.admission.cut_total == 1


@pytest.mark.parametrize(
    "unended",
    [b"2\r\n{}\r\n0\r\nx-t: ", b"2\r\n{}\r\n0\r\nx-", b"2;x="],
    ids=["trailer-value", "trailer-name", "chunk-extension"],
)
async def test_a_line_that_never_ends_in_a_chunked_body_closes_the_connection(
    sidecar: Sidecar, unended: bytes
) -> None:
    """A chunked body's line sent without its end: a trailer field (its value, or a name with
    no colon), which the parser holds until the line ends, so it was never a field to count,
    and the door read on (106 MiB in 13 s, the event loop held for seconds by the parser's
    copies of it, every other caller stalled); or a chunk's extension, read on at ~1 GB/s for
    12 s. Now the connection is closed soon after MAX_TRAILER_BYTES of it."""
    assert sidecar.http is not None
    _, writer = await connect(sidecar)
    writer.write(chunked("/healthz") + unended)
    await writer.drain()
    sent = 0
    with contextlib.suppress(ConnectionError):
        async with asyncio.timeout(LIVENESS_S):
            while sent < SENT_CAP:
                writer.write(b"a" * 4096)
                await writer.drain()
                sent += 4096
    writer.close()
    assert sent < SENT_CAP, "the door read an endless trailer field without closing"
    assert sidecar.http.admission.cut_total == 1


async def test_a_chunk_whose_data_comes_in_many_reads_is_read_whole(sidecar: Sidecar) -> None:
    """A chunk larger than MAX_TRAILER_BYTES whose header comes in a read of its own and its
    data in many after it: each read after the header holds some of the chunk's data, which
    the parser hands on, so none counts as a read it made nothing of, and the body is read
    whole."""
    assert sidecar.http is not None
    reader, writer = await connect(sidecar)
    writer.write(chunked("/healthz") + b"3000\r\n")  # a chunk of 12 KiB
    await writer.drain()
    for _ in range(12):
        await asyncio.sleep(0.01)  # reads of their own, as far as the loop goes
        writer.write(b"a" * 1024)
        await writer.drain()
    writer.write(b"\r\n0\r\n\r\n")
    assert (await answer(reader)).startswith(b"HTTP/1.1 200 ")
    writer.close()
    assert sidecar.http.admission.cut_total == 0


INITIALIZE = orjson.dumps(test_http_door.INITIALIZE)


async def test_a_short_trailer_is_dropped_unseen_and_the_connection_kept(sidecar: Sidecar) -> None:
    """A trailer within MAX_TRAILER_BYTES is read and dropped: no path sees it as a header
    (an MCP session id sent as one made the door's initialize a 404 for an unknown session),
    and the connection serves on."""
    reader, writer = await connect(sidecar)
    request = chunked(
        "/mcp",
        "content-type: application/json",
        "accept: application/json, text/event-stream",
        f"authorization: Bearer {TOKEN_A}",
        host=f"127.0.0.1:{sidecar.http_port}",  # MCP's DNS-rebinding check
    )
    body = b"%x\r\n%b\r\n0\r\nmcp-session-id: not-a-session\r\n\r\n" % (len(INITIALIZE), INITIALIZE)
    writer.write(request + body)
    first = await answer(reader)
    assert first.startswith(b"HTTP/1.1 200 "), first
    assert b"connection: close" not in first.lower()
    writer.write(b"GET /healthz HTTP/1.1\r\nhost: x\r\n\r\n")  # the same connection serves on
    assert (await answer(reader)).startswith(b"HTTP/1.1 200 ")
    writer.close()


@pytest.mark.parametrize(
    ("request_head", "status"),
    [
        (chunked("/healthz"), b"200"),
        (chunked("/nowhere"), b"404"),
        (chunked("/mcp", "content-type: application/json"), b"401"),  # no token: never read
    ],
    ids=["health", "not-found", "refused"],
)
async def test_an_answer_before_its_request_is_whole_says_close_and_closes_at_its_end(
    sidecar: Sidecar, request_head: bytes, status: bytes
) -> None:
    """A path answers before the body is in: the answer says ``connection: close``, the rest
    of the body is read (so the client reads its answer, not a reset) and dropped, and the
    connection closes once the request is whole, where it was kept alive for the next one."""
    reader, writer = await connect(sidecar)
    writer.write(request_head + b"2\r\n{}\r\n")
    got = await answer(reader)
    assert got.startswith(b"HTTP/1.1 " + status), got
    assert b"connection: close" in got.lower()
    writer.write(b"5\r\nhello\r\n" * 100 + b"0\r\n\r\n")  # the rest of it, after the answer
    assert await closed(reader)
    writer.close()


async def test_a_body_over_the_limit_sent_on_anyway_gets_its_413_and_a_clean_close(
    sidecar: Sidecar,
) -> None:
    """A body of three times max_body_bytes, its first KiB sent with the head: the 413 comes
    from its Content-Length and says close; the rest the client sends on is read and dropped
    (a close with it unread would reset the connection), and the connection closes cleanly at
    its end, where it was kept alive after the 413."""
    body = b"x" * (3 * 16 * 1024)
    head = (
        "POST /vapi/knowledge-base HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
        f"authorization: Bearer {TOKEN_A}\r\ncontent-length: {len(body)}\r\n\r\n"
    ).encode()
    reader, writer = await connect(sidecar)
    writer.write(head + body[:1024])
    got = await answer(reader)
    assert got.startswith(b"HTTP/1.1 413 "), got
    assert b"connection: close" in got.lower()
    writer.write(body[1024:])
    await writer.drain()
    async with asyncio.timeout(LIVENESS_S):
        assert await reader.read() == b""  # closed, and not reset
    writer.close()


@pytest.mark.parametrize(
    "ahead", [b"", b"GET /readyz HTTP/1.1\r\nhost: x\r\n\r\n"], ids=["alone", "pipelined"]
)
async def test_a_request_whose_rest_trickles_past_its_deadline_is_closed(
    sidecar: Sidecar, monkeypatch: pytest.MonkeyPatch, ahead: bytes
) -> None:
    """A chunked body trickled to a path that answers without reading it (health), alone or
    pipelined behind another request (its deadline starts with its turn): the connection is
    closed at REQUEST_TIMEOUT_S, where a byte a second held it open for ever (past the head's,
    the body's and the keep-alive's limits)."""
    monkeypatch.setattr(http_door, "REQUEST_TIMEOUT_S", 0.2)
    reader, writer = await connect(sidecar)
    writer.write(ahead + chunked("/healthz") + b"1\r\na\r\n")
    if ahead:
        assert (await answer(reader)).startswith(b"HTTP/1.1 200 ")
    assert (await answer(reader)).startswith(b"HTTP/1.1 200 ")

    async def trickle() -> None:
        with contextlib.suppress(ConnectionError):
            while True:
                writer.write(b"1\r\na\r\n")
                await writer.drain()
                await asyncio.sleep(0.05)  # pacing, not a timing check

    trickling = asyncio.create_task(trickle())
    try:
        assert await closed(reader)
    finally:
        trickling.cancel()
        writer.close()


async def test_a_head_over_the_limit_in_one_read_is_431(sidecar: Sidecar) -> None:
    """A whole head of 100 KiB sent at once: 431, where one read holding it whole was
    answered as if within MAX_HEAD_BYTES (64 KiB)."""
    head = b"GET /healthz HTTP/1.1\r\nhost: x\r\nx-big: " + b"a" * (100 << 10) + b"\r\n\r\n"
    got = await whole_answer(sidecar, head)
    assert got.startswith(b"HTTP/1.1 431 "), got[:60]
    assert b"headers are over 65536 bytes" in got


async def test_a_head_of_too_many_fields_is_431_and_the_next_request_answered(
    sidecar: Sidecar,
) -> None:
    """13,000 empty fields fit in 64 KiB and cost the event loop 13 ms a request (four clients
    held another's calls 95 ms): past MAX_HEAD_FIELDS, 431. A head of the most is answered."""
    head = b"GET /healthz HTTP/1.1\r\nhost: x\r\n"
    got = await whole_answer(sidecar, head + b"x-a:\r\n" * 13_000 + b"\r\n")
    assert got.startswith(b"HTTP/1.1 431 "), got[:60]
    assert f"the request has over {http_door.MAX_HEAD_FIELDS} header fields".encode() in got
    most = b"x-a: 1\r\n" * (http_door.MAX_HEAD_FIELDS - 2)  # with host and connection
    got = await whole_answer(sidecar, head + b"connection: close\r\n" + most + b"\r\n")
    assert got.startswith(b"HTTP/1.1 200 "), got[:60]


async def test_a_request_with_a_body_asking_for_h2c_is_told_to_send_http_1_1(
    sidecar: Sidecar,
) -> None:
    """``curl --http2`` on http:// asks to upgrade to h2c: the parser handed the body to the
    upgrade, and the request was answered as if empty ("a zero-length document"). It is refused
    400 saying what to send; the same request without Upgrade is answered."""
    body = b'{"query": "reset my password"}'
    head = (
        b"POST /v1/search HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
        b"authorization: Bearer " + TOKEN_A.encode() + b"\r\n"
        b"connection: Upgrade, HTTP2-Settings\r\nupgrade: h2c\r\n"
        b"http2-settings: AAMAAABkAAQCAAAAAAIAAAAA\r\ncontent-length: %d\r\n\r\n" % len(body)
    )
    got = await whole_answer(sidecar, head + body)
    assert got.startswith(b"HTTP/1.1 400 "), got[:60]
    assert b"send it without Upgrade (curl --http1.1)" in got
    plain = head.replace(b"Upgrade, HTTP2-Settings\r\nupgrade: h2c", b"close")
    got = await whole_answer(sidecar, plain + body)
    assert got.startswith(b"HTTP/1.1 200 "), got[:60]


@pytest.mark.parametrize(
    ("fields", "status", "said"),
    [
        (b"transfer-encoding: gzip, chunked\r\n", b"501", b"is not chunked alone"),
        (b"transfer-encoding: gzip\r\ntransfer-encoding: chunked\r\n", b"501", b"chunked alone"),
        (
            b"authorization: Bearer wrong\r\nauthorization: Bearer %s\r\n" % TOKEN_A.encode(),
            b"400",
            b"more than one Authorization header",
        ),
    ],
)
async def test_a_head_the_door_cannot_read_as_meant_is_refused_saying_why(
    sidecar: Sidecar, fields: bytes, status: bytes, said: bytes
) -> None:
    """A body sent ``Transfer-Encoding: gzip, chunked`` was dechunked and read as JSON still
    gzipped (a 400 on its bytes); with two Authorization fields the last was taken, whichever a
    proxy before the door had checked. Each is refused saying why; one chunked body is read."""
    body = b'{"query": "reset my password"}'
    head = b"POST /v1/search HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
    chunked = b"%x\r\n%s\r\n0\r\n\r\n" % (len(body), body)
    token = b"authorization: Bearer %s\r\n" % TOKEN_A.encode()
    if b"authorization" not in fields:
        fields += token
    if b"transfer-encoding" not in fields:
        fields += b"transfer-encoding: chunked\r\n"
    got = await whole_answer(sidecar, head + fields + b"connection: close\r\n\r\n" + chunked)
    assert got.startswith(b"HTTP/1.1 " + status + b" "), got[:60]
    assert said in got
    assert (b'"UNIMPLEMENTED"' in got) is (status == b"501")
    for coding in (b"chunked", b"Chunked", b", chunked"):  # empty list elements are ignored
        plain = head + token + b"transfer-encoding: %s\r\nconnection: close\r\n\r\n" % coding
        got = await whole_answer(sidecar, plain + chunked)
        assert got.startswith(b"HTTP/1.1 200 "), got[:60]


BAD_REQUESTS = [  # each refused by the parser: a Content-Length it cannot read
    b"GET /healthz HTTP/1.1\r\nhost: x\r\ncontent-length: z\r\n\r\n",
    b"POST /mcp HTTP/1.1\r\nhost: x\r\ncontent-length: 99999999999999999999\r\n\r\n{}",
    b"POST /mcp HTTP/1.1\r\nhost: x\r\ncontent-length: " + b"1" * 60_000 + b"\r\n\r\n{}",
    "POST /mcp HTTP/1.1\r\nhost: x\r\ncontent-length: \u00b2\r\n\r\n{}".encode("latin-1"),
]
UPGRADE = b"GET /healthz HTTP/1.1\r\nhost: x\r\nconnection: upgrade\r\nupgrade: websocket\r\n\r\n"


def door_lines(caplog: pytest.LogCaptureFixture, level: int) -> list[str]:
    return [
        r.getMessage()
        for r in caplog.records
        if r.levelno == level and r.name in ("uvicorn.error", "voxrecall.http")
    ]


async def test_a_flood_of_bad_requests_is_answered_400_each_and_logged_once_per_many(
    sidecar: Sidecar, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """Requests the parser refuses still get uvicorn's 400 each, but are logged as the door's
    other refusals are: the first, then one per OVERRUN_LOG_EVERY, where uvicorn wrote a
    WARNING line for each (2,000 from one client in 0.6 s)."""
    caplog.set_level(logging.INFO)
    monkeypatch.setattr(http_door, "OVERRUN_LOG_EVERY", 10)
    for i in range(25):
        got = await test_http_door.exchange(sidecar, BAD_REQUESTS[i % len(BAD_REQUESTS)])
        assert got.startswith(b"HTTP/1.1 400 "), got[:60]
        assert got.endswith(b"\r\n\r\nInvalid HTTP request received.")
    said = door_lines(caplog, logging.WARNING)
    assert len(said) == 3, said  # the 1st, the 11th and the 21st
    assert "(21 such since the start)" in said[-1]


async def test_upgrade_requests_are_served_plain_and_logged_once_per_many(
    sidecar: Sidecar, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """A request asking for a WebSocket is answered as a plain request, and logged once per
    OVERRUN_LOG_EVERY at INFO: uvicorn wrote two WARNING lines for each, one of them advice to
    install a WebSocket library the door does not use."""
    caplog.set_level(logging.INFO)
    monkeypatch.setattr(http_door, "OVERRUN_LOG_EVERY", 10)
    for _ in range(12):
        reader, writer = await connect(sidecar)
        writer.write(UPGRADE)
        try:
            assert (await answer(reader)).startswith(b"HTTP/1.1 200 ")
        finally:
            writer.close()
    assert door_lines(caplog, logging.WARNING) == []
    said = door_lines(caplog, logging.INFO)
    assert len(said) == 2, said  # the 1st and the 11th
    assert "(11 such since the start)" in said[-1]


def client_hello() -> bytes:
    """The first bytes an https:// client sends: a real TLS ClientHello, made in memory."""
    incoming, outgoing = ssl.MemoryBIO(), ssl.MemoryBIO()
    context = ssl.create_default_context()
    tls = context.wrap_bio(incoming, outgoing, server_hostname="localhost")
    with contextlib.suppress(ssl.SSLWantReadError):
        tls.do_handshake()
    return outgoing.read()


async def test_an_https_client_at_the_plain_door_is_logged_as_one_once_per_many(
    sidecar: Sidecar, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """An https:// URL to the plain door: curl says only "wrong version number", and the log
    said only that a request was not valid HTTP. It says a TLS client came, and what to change
    (the first, then one per OVERRUN_LOG_EVERY); the answer stays the parser's 400."""
    caplog.set_level(logging.INFO)
    monkeypatch.setattr(http_door, "OVERRUN_LOG_EVERY", 10)
    hello = client_hello()
    assert hello[:2] == b"\x16\x03"  # a TLS record: a handshake
    for _ in range(12):
        got = await test_http_door.exchange(sidecar, hello)
        assert got.startswith(b"HTTP/1.1 400 "), got[:60]
    assert door_lines(caplog, logging.WARNING) == []  # not "not valid HTTP/1.1"
    said = door_lines(caplog, logging.INFO)
    assert len(said) == 2, said  # the 1st and the 11th
    assert "TLS (https://) client" in said[0]
    assert "send it to http://" in said[0]
    assert "[sidecar.tls]" in said[0]
    assert "(11 such since the start)" in said[-1]
    # a request that is merely bad is still logged as one
    await test_http_door.exchange(sidecar, BAD_REQUESTS[0])
    assert "not valid HTTP/1.1" in door_lines(caplog, logging.WARNING)[0]


CHUNK_BOUND = 1024  # max_chunks at this door's 16 KiB max_body_bytes (MIN_MAX_CHUNKS)


def in_chunks(body: bytes, size: int) -> bytes:
    pieces = (body[i : i + size] for i in range(0, len(body), size))
    return b"".join(b"%x\r\n%b\r\n" % (len(p), p) for p in pieces)


@pytest.mark.parametrize(
    ("request_head", "answered"),
    [
        (chunked("/mcp", "content-type: application/json"), b"HTTP/1.1 401 "),  # dropped
        (chunked("/vapi/knowledge-base", "content-type: application/json"), b""),  # read
    ],
    ids=["refused", "read"],
)
async def test_a_body_in_more_chunks_than_the_bound_is_cut_there(
    sidecar: Sidecar, monkeypatch: pytest.MonkeyPatch, request_head: bytes, answered: bytes
) -> None:
    """A body of 1-byte chunks, one more than the bound, to a path that refuses it unread
    (401) and one that reads it: the connection is cut at its last chunk, unanswered (or after
    the 401), where the door read it all (the parser calls Python once per chunk, and no limit
    in bytes counted its framing, 6 wire bytes for each body byte: a client with no token held
    the event loop over a second with 100 MB of them)."""
    assert sidecar.http is not None
    monkeypatch.setattr(http_door, "REQUEST_TIMEOUT_S", 600)  # only the bound closes it
    reader, writer = await connect(sidecar)
    writer.write(request_head)
    got = await answer(reader) if answered else b""  # the 401 goes out after the head
    writer.write(in_chunks(b"{" + b" " * CHUNK_BOUND, 1) + b"0\r\n\r\n")
    with contextlib.suppress(ConnectionResetError):
        async with asyncio.timeout(LIVENESS_S):
            got += await reader.read()
    assert got.startswith(answered) if answered else got == b"", got
    assert sidecar.http.admission.cut_total == 1
    writer.close()


@pytest.mark.parametrize(("size", "count"), [(1, CHUNK_BOUND), (1024, 16)], ids=["1B", "1KiB"])
async def test_a_body_within_the_chunk_bound_is_served_and_kept(
    sidecar: Sidecar, size: int, count: int
) -> None:
    """A body of exactly the bound's 1-byte chunks, and one of max_body_bytes in 1 KiB chunks:
    each is answered and its connection kept."""
    assert sidecar.http is not None
    messages = [{"role": "user", "content": "How do I export my data?"}]
    body = orjson.dumps(test_http_door.vapi_request(messages)).ljust(size * count)  # JSON's spaces
    reader, writer = await connect(sidecar)
    token = f"authorization: Bearer {TOKEN_A}"
    head = chunked("/vapi/knowledge-base", "content-type: application/json", token)
    writer.write(head + in_chunks(body, size) + b"0\r\n\r\n")
    got = await answer(reader)
    assert got.startswith(b"HTTP/1.1 200 "), got
    assert b"connection: close" not in got.lower()
    writer.write(b"GET /healthz HTTP/1.1\r\nhost: x\r\n\r\n")
    assert (await answer(reader)).startswith(b"HTTP/1.1 200 ")
    assert sidecar.http.admission.cut_total == 0
    writer.close()
