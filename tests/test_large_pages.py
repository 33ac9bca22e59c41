"""Pages and chunks larger than what a call may answer with: a ReadPage over
``max_message_bytes`` is refused with our own message, MCP's ``read_page`` answers within
``tool_output_chars`` in parts a model can read on through.

A real grpc.aio sidecar with its HTTP door on 127.0.0.1 port 0, the MCP SDK's own client, a
real local store of a small real snapshot whose page is padded past the limits.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import grpc
import httpx2
import orjson
import pytest
from mcp.client.session import ClientSession
from mcp.client.streamable_http import streamable_http_client

from index.chunker import MAX_CHUNK_BYTES
from index.embedders.base import Embedder
from index.snapshot import load_snapshot, page_key
from index.tables import MAX_FIELD_BYTES
from sidecar.config import SidecarConfig
from sidecar.edge.server import Sidecar, create_server
from sidecar.edge.service import PAGE_FRAMING_BYTES, page_part
from sidecar.functions import tools
from sidecar.functions.tools import PageText
from sidecar.gen import retrieval_pb2 as pb
from sidecar.gen import retrieval_pb2_grpc as pb_grpc
from sidecar.http.mcp import page_output
from tests.bases_kit import config
from tests.snapshot_kit import KB, TOPICS, version_id, write_version

MESSAGE_BYTES = 64 * 1024  # the smallest max_message_bytes
PAGE_PAD = 100_000  # the page: the topic's texts, then this many spaces
OUTPUT_CHARS = 2000


@asynccontextmanager
async def serving(
    tmp_path: Path, embedder: Embedder, written: dict[str, Any], **sidecar: Any
) -> AsyncIterator[Sidecar]:
    """A sidecar over one version of the base (``write_version`` with ``written``), its source
    "faq", and the knowledge function ``search_faq``."""
    root = tmp_path / "store"
    root.mkdir()
    await asyncio.to_thread(write_version, root, version_id(1), embedder, **written)
    source = {"name": "faq", "type": "markdown", "path": str(tmp_path)}
    tables = {
        "knowledge_base": [{"name": KB, "source": [source]}],
        "function": [{"name": "search_faq", "description": "The FAQ.", "knowledge_base": KB}],
    }
    sc = await create_server(
        config(root, tmp_path, tables=tables, **sidecar), embedder=embedder, poll=False
    )
    try:
        yield sc
    finally:
        await sc.stop(0.5)


@pytest.fixture
async def sidecar(tmp_path: Path, local_embedder: Embedder) -> AsyncIterator[Sidecar]:
    async with serving(
        tmp_path,
        local_embedder,
        {"page_bytes": PAGE_PAD},
        max_message_bytes=MESSAGE_BYTES,
        tool_output_chars=OUTPUT_CHARS,
        http={"listen": "127.0.0.1:0", "read_page_bases": [KB]},
    ) as sc:
        yield sc


@asynccontextmanager
async def mcp_session(sc: Sidecar) -> AsyncIterator[ClientSession]:
    async with (
        httpx2.AsyncClient() as http,
        streamable_http_client(f"http://127.0.0.1:{sc.http_port}/mcp", http_client=http) as (
            read,
            write,
        ),
        ClientSession(read, write) as session,
    ):
        await session.initialize()
        yield session


async def test_a_page_over_the_message_limit_is_refused_with_its_size_and_what_to_do(
    sidecar: Sidecar,
) -> None:
    async with grpc.aio.insecure_channel(f"127.0.0.1:{sidecar.port}") as channel:
        stub = pb_grpc.RetrievalStub(channel)  # type: ignore[no-untyped-call]
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            await stub.ReadPage(pb.ReadPageRequest(source_path="password.md"), timeout=30)
    assert caught.value.code() is grpc.StatusCode.RESOURCE_EXHAUSTED
    details = str(caught.value.details())
    assert "page 'password.md' is" in details
    assert f"the limit is {MESSAGE_BYTES} bytes ([sidecar] max_message_bytes)" in details
    assert "source_paths" in details  # what to do instead
    assert "set offset" in details


async def test_grpc_read_page_with_an_offset_answers_in_parts_within_the_message_limit(
    sidecar: Sidecar,
) -> None:
    """The page over max_message_bytes, read with offset set: each answer within the limit, cut
    between characters, the parts together the page; past its end INVALID_ARGUMENT naming it."""
    page = " ".join(TOPICS["password"]) + " " * PAGE_PAD
    read, offset, parts = "", 0, 0
    async with grpc.aio.insecure_channel(f"127.0.0.1:{sidecar.port}") as channel:
        stub = pb_grpc.RetrievalStub(channel)  # type: ignore[no-untyped-call]
        while True:
            answer = await stub.ReadPage(
                pb.ReadPageRequest(source_path="password.md", offset=offset), timeout=30
            )
            assert answer.ByteSize() <= MESSAGE_BYTES
            assert answer.source_path == "password.md"
            read += answer.text
            parts += 1
            if not answer.truncated:
                assert answer.next_offset == 0
                break
            assert answer.next_offset == offset + len(answer.text)
            offset = answer.next_offset
        assert read == page
        assert parts == 2  # 100 KB in 64 KiB answers
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            await stub.ReadPage(
                pb.ReadPageRequest(source_path="password.md", offset=len(page)), timeout=30
            )
    assert caught.value.code() is grpc.StatusCode.INVALID_ARGUMENT
    assert f"offset {len(page)} is past the page's end" in str(caught.value.details())


async def test_a_page_over_the_read_cap_is_refused_with_its_size_on_both_doors(
    sidecar: Sidecar, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A page over MAX_PAGE_BYTES (32 MiB; 1,000 bytes here) is never decoded: gRPC answers
    RESOURCE_EXHAUSTED with its size, MCP a tool error saying the same."""
    monkeypatch.setattr(tools, "MAX_PAGE_BYTES", 1000)
    async with grpc.aio.insecure_channel(f"127.0.0.1:{sidecar.port}") as channel:
        stub = pb_grpc.RetrievalStub(channel)  # type: ignore[no-untyped-call]
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            await stub.ReadPage(pb.ReadPageRequest(source_path="password.md", offset=0))
    assert caught.value.code() is grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "pages are read up to 1000 bytes" in str(caught.value.details())
    async with mcp_session(sidecar) as session:
        result = await session.call_tool("read_page", {"source_path": "password.md"})
    assert result.is_error
    error = orjson.loads(result.content[0].text)["error"]  # type: ignore[union-attr]
    assert error["type"] == "resource_exhausted"
    assert "pages are read up to 1000 bytes" in error["message"]
    assert sidecar.http is not None
    assert sidecar.http.mcp.pages.decoded == 0


def test_a_grpc_page_part_is_cut_between_wide_characters() -> None:
    """Characters of 2 to 4 bytes: each part within the room, and the parts are the page."""
    text = "café 日本語 🎙️ " * 500
    page = PageText(title="T", text=text, source="faq", source_path="q.md", url="")
    limit = PAGE_FRAMING_BYTES + 1000
    read, offset = "", 0
    while True:
        part, more = page_part(page, "v1", offset, limit)
        assert 0 < len(part.encode()) <= 1000 - len("Tfaqq.mdv1")
        read, offset = read + part, offset + len(part)
        if not more:
            break
    assert read == text


async def test_mcp_read_page_answers_in_parts_within_tool_output_chars(sidecar: Sidecar) -> None:
    page = " ".join(TOPICS["password"]) + " " * PAGE_PAD
    read, offset, parts = "", 0, 0
    async with mcp_session(sidecar) as session:
        while True:
            arguments: dict[str, Any] = {"source_path": "password.md", "offset": offset}
            result = await session.call_tool("read_page", arguments)
            assert not result.is_error
            text = result.content[0].text  # type: ignore[union-attr]
            assert len(text) <= OUTPUT_CHARS
            body = orjson.loads(text)
            assert body["path"] == "password.md"
            read += body["text"]
            parts += 1
            if not body.get("truncated"):
                break
            assert f"offset {body['next_offset']}" in body["note"]
            offset = body["next_offset"]
        assert read == page  # every part, in order, and nothing lost between them
        assert parts > len(page) // OUTPUT_CHARS
        assert sidecar.http is not None
        assert sidecar.http.mcp.pages.decoded == 1  # the page decoded once, not once a part

        for bad in (-1, "5", 1.5, True, False, "", 10**30):  # each a tool error naming it
            wrong = await session.call_tool(
                "read_page", {"source_path": "password.md", "offset": bad}
            )
            assert wrong.is_error, bad
            assert "offset" in wrong.content[0].text  # type: ignore[union-attr]
        past = await session.call_tool("read_page", {"source_path": "password.md", "offset": 10**9})
        assert past.is_error
        assert "past the page's end" in orjson.loads(past.content[0].text)["error"]["message"]  # type: ignore[union-attr]


@pytest.mark.parametrize("max_chars", [200, 333, 2000])
def test_page_output_cuts_escapes_and_wide_characters_without_losing_any(max_chars: int) -> None:
    """Every character JSON escapes (quotes, backslashes, newlines, control characters) and
    characters of 2 to 4 UTF-8 bytes: each part fits, and the parts put together are the page."""
    text = ('He said "ok"\\\n\t\x01 café 日本語 🎙️ ' * 60).strip()
    head = {"title": "Quotes", "source": "faq", "path": "q.md"}
    read, offset = "", 0
    while True:
        out = page_output(head, text, offset, max_chars)
        assert out is not None
        assert len(out) <= max_chars
        body = orjson.loads(out)
        read += body["text"]
        if not body.get("truncated"):
            break
        assert body["next_offset"] > offset  # always progress
        offset = body["next_offset"]
    assert read == text
    assert page_output({"title": "x" * 500}, text, 0, 200) is None  # a head with no room


# -- chunks of a snapshot built before the chunker's cap ------------------------------------------

CHUNK_PAD = 250_000  # " filler" words: 1.75 MB a chunk, three over the 4 MiB message limit


@pytest.fixture
async def old_sidecar(tmp_path: Path, local_embedder: Embedder) -> AsyncIterator[Sidecar]:
    written = {"chunk_pad": CHUNK_PAD}
    async with serving(tmp_path, local_embedder, written, tool_output_chars=OUTPUT_CHARS) as sc:
        yield sc


async def test_a_huge_chunk_of_an_old_snapshot_is_answered_cut_to_the_chunk_cap(
    old_sidecar: Sidecar,
) -> None:
    """Three chunks of 1.75 MB: Search and Turn answer with each cut to MAX_CHUNK_BYTES (at a
    character), within the message limit, and a tool call within tool_output_chars."""
    question = "How do I reset my password?"
    found, turn, tool = await _three_ways(old_sidecar.port, question, "reset password")
    for chunks in (found.chunks, turn.chunks, turn.context):
        assert len(chunks) == 3
        for chunk in chunks:
            assert len(chunk.text.encode()) <= MAX_CHUNK_BYTES
            assert len(chunk.text.encode()) > MAX_CHUNK_BYTES - 8  # cut, not dropped
            assert chunk.text.split(" filler")[0] in TOPICS["password"]
    assert not tool.is_error
    assert len(tool.output) <= OUTPUT_CHARS
    assert orjson.loads(tool.output)["results"]


async def _three_ways(
    port: int, question: str, tool_query: str
) -> tuple[pb.SearchResponse, pb.TurnResponse, pb.InvokeToolResponse]:
    """A question asked as a Search, a Turn and a knowledge tool call (``search_faq``)."""
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
        stub = pb_grpc.RetrievalStub(channel)  # type: ignore[no-untyped-call]
        found = await stub.Search(pb.SearchRequest(query=question, limit=3), timeout=60)
        turn = await stub.Turn(
            pb.TurnRequest(session_id="s", text=question, is_final=True), timeout=60
        )
        arguments = orjson.dumps({"query": tool_query}).decode()
        tool = await stub.InvokeTool(
            pb.InvokeToolRequest(name="search_faq", arguments_json=arguments), timeout=60
        )
    return found, turn, tool


# -- a hostile snapshot's huge titles, breadcrumbs, URLs and metadata -----------------------------

FIELD_PAD = 2_000_000  # characters added to each chunk's title, breadcrumb, URL, embedded text...


async def test_a_snapshot_with_huge_titles_and_urls_answers_with_them_cut(
    tmp_path: Path, local_embedder: Embedder
) -> None:
    """Three chunks each with a 2 MB title, breadcrumb, URL, embedded text and metadata value
    (6 MB of them in one answer, over the 4 MiB message limit): the snapshot is served, and
    Search, Turn and a tool call answer with each string cut to its cap (MAX_FIELD_BYTES)."""
    question = "How do I reset my password?"
    async with serving(tmp_path, local_embedder, {"field_pad": FIELD_PAD}) as sc:
        found, turn, tool = await _three_ways(sc.port, question, "password")
    for chunks in (found.chunks, turn.chunks, turn.context):
        assert len(chunks) == 3
        for chunk in chunks:
            assert chunk.title.startswith("Passwordxx")
            assert MAX_FIELD_BYTES - 8 < len(chunk.title.encode()) <= MAX_FIELD_BYTES
            assert len(chunk.url.encode()) <= MAX_FIELD_BYTES
            assert [len(c.encode()) <= MAX_FIELD_BYTES for c in chunk.breadcrumbs] == [True]
            assert chunk.metadata["lang"] == "en"
            assert len(chunk.metadata["note"].encode()) <= MAX_FIELD_BYTES
    assert not tool.is_error  # within tool_output_chars: no room for a result of such titles
    assert len(tool.output) <= SidecarConfig().tool_output_chars
    assert orjson.loads(tool.output)["truncated"] is True


async def test_a_large_page_asked_for_at_once_is_decoded_once(
    tmp_path: Path, local_embedder: Embedder
) -> None:
    """Eight calls at once for a page over a MiB (decoded off the event loop): one decodes it,
    the others wait for it and take it from those kept; decoding never holds more than one
    large page's bytes, however many calls come."""
    folder = await asyncio.to_thread(
        write_version, tmp_path, version_id(1), local_embedder, page_bytes=tools.OFF_LOOP_BYTES
    )
    snapshot = await asyncio.to_thread(load_snapshot, folder)
    reader = tools.PageReader()
    key = page_key("faq", "password.md")
    texts = await asyncio.gather(*(reader._text(snapshot, key) for _ in range(8)))
    assert len(texts[0]) > tools.OFF_LOOP_BYTES
    assert all(text == texts[0] for text in texts)
    assert reader.decoded == 1
