"""Hypothesis against the RPC surface of a real server and against the indexer's parsers.

Every call ends with a status a person can act on (never INTERNAL, UNKNOWN, or a deadline the
server ran into on its own), answers keep their limits, and the parsers never raise for a bad
page, never hang and never take memory out of proportion to their input.
"""

from __future__ import annotations

import asyncio
import json
import signal
import string
import threading
import tracemalloc
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from types import FrameType

import grpc
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from index.chunker import chunk_page
from index.embedders.base import Embedder
from index.sources.markdown import load_markdown
from index.sources.records import RecordFields, load_records
from sidecar.config import MAX_LIMIT
from sidecar.edge.server import Sidecar, create_server
from sidecar.gen import retrieval_pb2 as pb
from sidecar.gen import retrieval_pb2_grpc as pb_grpc
from tests.hardening_kit import PAGES, build_store, sidecar_config

CALL_TIMEOUT_S = 30.0  # a hang detector, far above any answer; DEADLINE_EXCEEDED fails the test
HANG_S = 20  # a parser taking this long on a few KB of text is hung
# Parsing N bytes may hold a few copies of them (lines, blocks, chunks) but never more than this
# multiple plus a fixed allowance: "billion laughs" frontmatter would be thousands of times more.
MEMORY_FACTOR, MEMORY_FLOOR = 64, 8 * 1024 * 1024
ACTIONABLE = {grpc.StatusCode.OK, grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.NOT_FOUND}
MAX_RESULTS = 3
TOOL_OUTPUT_CHARS = 2000
RPC_SETTINGS = settings(
    max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)

# -- a real server on its own event loop, so Hypothesis drives it with a blocking client --------


@pytest.fixture(scope="module")
def stub(
    tmp_path_factory: pytest.TempPathFactory, local_embedder: Embedder
) -> Iterator[pb_grpc.RetrievalStub]:
    root = build_store(tmp_path_factory.mktemp("fuzz"), local_embedder)
    config = sidecar_config(root, max_results=MAX_RESULTS, tool_output_chars=TOOL_OUTPUT_CHARS)
    loop = asyncio.new_event_loop()
    started: list[Sidecar] = []
    ready = threading.Event()

    def run() -> None:
        asyncio.set_event_loop(loop)
        started.append(
            loop.run_until_complete(create_server(config, embedder=local_embedder, poll=False))
        )
        ready.set()
        loop.run_forever()

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    assert ready.wait(120), "the server did not start"
    sidecar = started[0]
    with grpc.insecure_channel(f"127.0.0.1:{sidecar.port}") as channel:
        yield pb_grpc.RetrievalStub(channel)  # type: ignore[no-untyped-call]
    asyncio.run_coroutine_threadsafe(sidecar.stop(0.5), loop).result(60)
    loop.call_soon_threadsafe(loop.stop)
    thread.join(60)
    loop.close()


def call(method: object, request: object) -> object | None:
    """The answer, or None after checking the error is one a caller can act on."""
    try:
        answer: object = method(request, timeout=CALL_TIMEOUT_S)  # type: ignore[operator]
        return answer
    except grpc.RpcError as exc:
        error = exc
    check_error(error)
    return None


def check_error(error: grpc.RpcError) -> None:
    code, details = error.code(), error.details()
    assert code in ACTIONABLE, f"{code}: {details}"
    assert details, "an error without a message"


# -- strategies --------------------------------------------------------------------------------

texts = st.one_of(
    st.text(max_size=200),
    st.sampled_from(["how do I reset my password", "yeah", "thanks, bye", "refund?", " "]),
    st.text(alphabet=string.ascii_letters + " ", min_size=3000, max_size=5000),  # long, cut
)
bases = st.one_of(st.sampled_from(["", "help", "billing", "nope"]), st.text(max_size=20))
enums = st.integers(-3, 12)  # unknown enum values arrive as plain numbers (proto3 open enums)
source_lists = st.lists(
    st.one_of(st.sampled_from(["help-pages", "billing-pages"]), st.text(max_size=12)), max_size=3
)
session_ids = st.one_of(st.text(max_size=40), st.text(min_size=250, max_size=300))


@st.composite
def turn_requests(draw: st.DrawFn) -> pb.TurnRequest:
    return pb.TurnRequest(
        session_id=draw(session_ids),
        knowledge_base=draw(bases),
        text=draw(texts),
        speaker=draw(enums),  # type: ignore[arg-type]
        is_final=draw(st.booleans()),
        budget_ms=draw(st.integers(-1000, 20_000)),
        sources=draw(source_lists),
        context_url=draw(st.text(max_size=60)),
    )


def _vector(values: list[float]) -> bytes:
    return np.asarray(values, dtype="<f4").tobytes()


vectors = st.one_of(
    st.just(b""),
    st.binary(max_size=2000),
    st.lists(st.floats(width=32), min_size=384, max_size=384).map(_vector),
)
json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=30),
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4)
    ),
    max_leaves=12,
)
tool_arguments = st.one_of(
    st.text(max_size=300),
    json_values.map(json.dumps),
    st.fixed_dictionaries(
        {"query": st.one_of(texts, json_values)},
        optional={"sources": st.one_of(source_lists, json_values), "limit": json_values},
    ).map(json.dumps),
)


# -- the RPC surface ---------------------------------------------------------------------------


@RPC_SETTINGS
@given(request=turn_requests())
def test_turn(stub: pb_grpc.RetrievalStub, request: pb.TurnRequest) -> None:
    resp = call(stub.Turn, request)
    if isinstance(resp, pb.TurnResponse):
        assert len(resp.chunks) <= MAX_RESULTS
        assert not (resp.skipped and resp.chunks)
        # only a long query is cut: the one searched, which a follow-up may have lengthened with
        # the session's topic (sessions outlive an example, so not the request's text alone)
        assert not resp.truncated or len(resp.query) > 60


@RPC_SETTINGS
@given(
    query=texts,
    knowledge_base=bases,
    limit=st.integers(-5, MAX_LIMIT + 20),
    min_score=st.floats(width=32),
    sources=source_lists,
    session_id=session_ids,
    vector=vectors,
)
def test_search(
    stub: pb_grpc.RetrievalStub,
    query: str,
    knowledge_base: str,
    limit: int,
    min_score: float,
    sources: list[str],
    session_id: str,
    vector: bytes,
) -> None:
    request = pb.SearchRequest(
        query=query,
        knowledge_base=knowledge_base,
        limit=limit,
        min_score=min_score,
        sources=sources,
        session_id=session_id,
        vector=vector,
    )
    resp = call(stub.Search, request)
    if isinstance(resp, pb.SearchResponse):
        assert 1 <= (limit or MAX_RESULTS) <= MAX_LIMIT
        assert len(resp.chunks) <= (limit or MAX_RESULTS)


@RPC_SETTINGS
@given(
    name=st.one_of(st.sampled_from(["search_help", "search_billing", "nope", ""]), st.text()),
    arguments=tool_arguments,
    session_id=session_ids,
    call_id=st.one_of(st.text(max_size=40), st.text(min_size=300, max_size=320)),
)
def test_invoke_tool(
    stub: pb_grpc.RetrievalStub, name: str, arguments: str, session_id: str, call_id: str
) -> None:
    request = pb.InvokeToolRequest(
        name=name, arguments_json=arguments, session_id=session_id, call_id=call_id
    )
    resp = call(stub.InvokeTool, request)
    if isinstance(resp, pb.InvokeToolResponse):
        assert resp.call_id == call_id
        assert len(resp.output) <= TOOL_OUTPUT_CHARS
        output = json.loads(resp.output)  # always JSON the model can read
        if resp.is_error:
            assert set(output["error"]) >= {"type", "message"}


@RPC_SETTINGS
@given(
    knowledge_base=bases,
    source_path=st.one_of(
        st.sampled_from(
            ["password.md", "refunds.md", "../../../etc/passwd", "/etc/passwd", "..", "."]
        ),
        st.text(max_size=60),
    ),
    source=st.one_of(st.just(""), source_lists.map(lambda s: s[0] if s else "")),
)
def test_read_page(
    stub: pb_grpc.RetrievalStub, knowledge_base: str, source_path: str, source: str
) -> None:
    request = pb.ReadPageRequest(
        knowledge_base=knowledge_base, source_path=source_path, source=source
    )
    resp = call(stub.ReadPage, request)
    if isinstance(resp, pb.ReadPageResponse):
        assert resp.source_path in {p for pages in PAGES.values() for p in pages}


@RPC_SETTINGS
@given(session_id=session_ids)
def test_end_session(stub: pb_grpc.RetrievalStub, session_id: str) -> None:
    call(stub.EndSession, pb.EndSessionRequest(session_id=session_id))


@settings(RPC_SETTINGS, max_examples=25)
@given(turns=st.lists(turn_requests(), min_size=1, max_size=4))
def test_converse(stub: pb_grpc.RetrievalStub, turns: list[pb.TurnRequest]) -> None:
    requests = iter([pb.ConverseRequest(turn=t) for t in turns])
    try:
        answers = list(stub.Converse(requests, timeout=CALL_TIMEOUT_S))
    except grpc.RpcError as exc:
        check_error(exc)
        return
    assert len(answers) <= len(turns)
    assert all(len(a.turn.chunks) <= MAX_RESULTS for a in answers)


@RPC_SETTINGS
@given(format_=enums)
def test_list_tools(stub: pb_grpc.RetrievalStub, format_: int) -> None:
    request = pb.ListToolsRequest(format=format_)  # type: ignore[arg-type]
    resp = call(stub.ListTools, request)
    if isinstance(resp, pb.ListToolsResponse):
        assert {t.name for t in resp.tools} == {"search_help", "search_billing"}


# -- the parsers -------------------------------------------------------------------------------


@contextmanager
def bounded(input_bytes: int) -> Iterator[None]:
    """Fails the example when it runs HANG_S (hung) or allocates out of proportion."""

    def hung(signum: int, frame: FrameType | None) -> None:
        raise TimeoutError(f"a parser ran {HANG_S} s on {input_bytes} bytes")

    previous = signal.signal(signal.SIGALRM, hung)
    signal.alarm(HANG_S)
    tracemalloc.start()
    try:
        yield
        peak = tracemalloc.get_traced_memory()[1]
        assert peak <= MEMORY_FLOOR + MEMORY_FACTOR * input_bytes, f"{peak} bytes for {input_bytes}"
    finally:
        tracemalloc.stop()
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)


markdown_lines = st.one_of(
    st.text(max_size=80),
    st.builds(lambda n, t: "#" * n + " " + t, st.integers(1, 8), st.text(max_size=30)),
    st.sampled_from(["```", "```python", "~~~", "| a | b |", "|---|---|", "- item", "1. step",
                     "    code", "---", "...", "> quote", "", "\r", "\x00", "\ufeff", "<div>"]),
)  # fmt: skip
frontmatters = st.one_of(
    st.just(""),
    st.lists(st.text(max_size=40), max_size=6).map(lambda ls: "---\n" + "\n".join(ls) + "\n---\n"),
    st.sampled_from([
        "---\ntitle: T\ntags: [a, b]\ndate: 2024-01-02\n---\n",
        "---\na: &a [*a]\n---\n",                       # an alias that refers to itself
        "---\n" + "".join(f"l{i}: &l{i} [{', '.join([f'*l{i - 1}'] * 9)}]\n" for i in range(1, 9))
        .replace("*l0", "x") + "---\n",                 # "billion laughs"
        "---\n!!python/object:os.system x\n---\n",
        "---\n- not\n- a mapping\n---\n",
        "---\nunclosed: true\n",
        "---\n" + "k: " + "[" * 500 + "]" * 500 + "\n---\n",  # deep nesting
    ]),
)  # fmt: skip


@settings(max_examples=150, deadline=None)
@given(
    frontmatter=frontmatters,
    body=st.lists(markdown_lines, max_size=80).map("\n".join),
    raw=st.binary(max_size=300),
)
def test_markdown_pages_never_crash_hang_or_balloon(
    tmp_path_factory: pytest.TempPathFactory, frontmatter: str, body: str, raw: bytes
) -> None:
    folder = tmp_path_factory.mktemp("md", numbered=True)
    (folder / "page.md").write_text(frontmatter + body, encoding="utf-8", errors="surrogatepass")
    (folder / "raw.md").write_bytes(raw)  # not necessarily UTF-8
    size = len((frontmatter + body).encode("utf-8", "surrogatepass")) + len(raw)
    with bounded(size):
        pages, skipped = load_markdown("fuzz", folder)
        for page in pages:
            chunks = chunk_page(page)
            assert all(c.text.strip() for c in chunks)
    assert len(pages) + len(skipped) == 2  # every file is either a page or a reason


record_values = st.one_of(json_values, st.text(max_size=60))


@settings(max_examples=100, deadline=None)
@given(
    lines=st.lists(
        st.one_of(
            st.fixed_dictionaries(
                {"id": record_values, "text": record_values},
                optional={"title": record_values, "extra": record_values},
            ).map(json.dumps),
            json_values.map(json.dumps),
            st.text(max_size=80),
        ),
        max_size=30,
    ),
)
def test_jsonl_records_never_crash_hang_or_balloon(
    tmp_path_factory: pytest.TempPathFactory, lines: list[str]
) -> None:
    path = tmp_path_factory.mktemp("jsonl", numbered=True) / "export.jsonl"
    text = "\n".join(line.replace("\n", " ") for line in lines)
    path.write_text(text, encoding="utf-8", errors="surrogatepass")
    fields = RecordFields(metadata_fields=("extra",))
    with bounded(len(text.encode("utf-8", "surrogatepass"))):
        pages, _ = load_records("fuzz", path, "jsonl", fields)
        for page in pages:
            chunk_page(page)
    assert len({p.source_path for p in pages}) == len(pages)  # a repeated id is skipped


def test_billion_laughs_frontmatter_is_skipped_with_a_reason(tmp_path: Path) -> None:
    laughs = "".join(f"l{i}: &l{i} [{', '.join([f'*l{i - 1}'] * 9)}]\n" for i in range(1, 10))
    text = "---\nl0: &l0 [x, x, x, x, x, x, x, x, x]\n" + laughs + "---\n# Title\n\nBody.\n"
    (tmp_path / "laughs.md").write_text(text, encoding="utf-8")
    with bounded(len(text)):
        pages, skipped = load_markdown("fuzz", tmp_path)
    assert not pages
    assert "aliases" in skipped[0].reason
