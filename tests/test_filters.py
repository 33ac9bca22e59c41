"""Metadata and path filters: the filter index, filtered search, and a real sidecar on port 0
whose starter-plan token never sees an enterprise-only chunk (Search, Turn, Converse,
InvokeTool, ReadPage)."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import grpc
import httpx2
import numpy as np
import orjson
import pytest
from mcp.client.session import ClientSession
from mcp.client.streamable_http import streamable_http_client
from openai.types.chat import ChatCompletionFunctionTool
from openai.types.realtime import RealtimeFunctionTool
from openai.types.responses import FunctionTool

from index.build import build_knowledge_base
from index.embedders.base import Embedder, EmbedderInfo
from index.errors import ConfigError, CorruptSnapshot
from index.filters import FILTERS, FilterIndex, build_filters, read_filters, search
from index.snapshot import HNSW_INDEX_BYTES, load_snapshot, sha256_file, write_snapshot
from index.types import Chunk, MetadataFilter
from sidecar.config import Config, parse_config
from sidecar.gen import retrieval_pb2 as pb
from sidecar.gen import retrieval_pb2_grpc as pb_grpc
from tests.hardening_kit import TOKEN_A, TOKEN_B, bearer, running

# -- the filter index on its own ---------------------------------------------------------------


def _chunk(i: int, path: str, **meta: Any) -> Chunk:
    metadata = {k: tuple(v) if isinstance(v, list) else v for k, v in meta.items()}
    return Chunk(f"c{i}", "docs", path, "t", ("t",), f"text {i}", f"text {i}", metadata=metadata)


CHUNKS = [
    _chunk(0, "billing/refunds.md", plan_scope="all", tags=["billing", "refunds"]),
    _chunk(1, "billing/invoices.md", plan_scope="all", tags=["billing"]),
    _chunk(2, "features/sso.md", plan_scope="enterprise", tags=["security"]),
    _chunk(3, "features/shared.md", plan_scope=["starter", "pro", "enterprise"]),
    _chunk(4, "features/api.md", plan_scope="pro"),
    _chunk(5, "billing/old/2019.md"),
]


def _index() -> FilterIndex:
    fields = read_filters(build_filters(CHUNKS, ["plan_scope", "tags"]), CHUNKS, "test")
    return FilterIndex(fields, CHUNKS)


def _passing(index: FilterIndex, filters: list[MetadataFilter], paths: list[str]) -> list[int]:
    allowed = index.allowed(filters, paths)
    assert allowed is not None
    assert allowed.count == int(allowed.mask.sum())
    return np.flatnonzero(allowed.mask).tolist()


def test_a_filter_passes_equal_values_and_any_element_of_a_list() -> None:
    index = _index()
    starter = MetadataFilter("plan_scope", ("starter", "all"))
    assert _passing(index, [starter], []) == [0, 1, 3]  # 3 lists starter among its plans
    tags = MetadataFilter("tags", ("refunds", "security"))
    assert _passing(index, [tags], []) == [0, 2]
    assert _passing(index, [starter, tags], []) == [0]  # several filters all apply
    assert _passing(index, [MetadataFilter("plan_scope", ("nobody",))], []) == []
    assert index.values("plan_scope") == ("all", "enterprise", "pro", "starter")
    assert index.unknown([starter, MetadataFilter("content_type", ("faq",))]) == ["content_type"]
    assert index.allowed([], []) is None


def test_path_patterns_are_a_prefix_a_glob_or_a_page() -> None:
    index = _index()
    assert _passing(index, [], ["billing/"]) == [0, 1, 5]
    assert _passing(index, [], ["billing"]) == []  # no "/": a page's path, and there is none
    assert _passing(index, [], ["features/s*.md"]) == [2, 3]
    assert _passing(index, [], ["billing/*.md"]) == [0, 1, 5]  # fnmatch's * crosses "/"
    assert _passing(index, [], ["features/api.md", "billing/old/"]) == [4, 5]
    all_plans = MetadataFilter("plan_scope", ("all",))
    assert _passing(index, [all_plans], ["billing/"]) == [0, 1]


@pytest.mark.parametrize(
    "data",
    [
        b"not json",
        b'{"fields": []}',
        b'{"fields": {"tags": {"billing": [1, 0]}}}',  # not ascending
        b'{"fields": {"tags": {"billing": [0, 6]}}}',  # past the last chunk
        b'{"fields": {"tags": {"billing": ["0"]}}}',
        b'{"fields": {"tags": {"billing": []}}}',
    ],
)
def test_a_malformed_filter_index_is_refused(data: bytes) -> None:
    with pytest.raises(ValueError, match="test"):
        read_filters(data, CHUNKS, "test")


def _clustered(n: int, dim: int, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    centres = rng.normal(size=(20, dim))
    vectors = centres[rng.integers(0, 20, n)] + rng.normal(scale=0.6, size=(n, dim))
    out = vectors.astype(np.float32)
    out /= np.linalg.norm(out, axis=1, keepdims=True)
    return out


@pytest.fixture(scope="module")
def filtered_snapshot(tmp_path_factory: pytest.TempPathFactory) -> Any:
    """2,000 chunks whose ``share`` field is 'half', 'tenth' or 'hundredth' of them (nested:
    a list), beside a 'plan' field; built and loaded as a real snapshot."""
    n, dim = 2000, 32
    rng = np.random.default_rng(3)
    draw = rng.random(n)
    chunks = []
    for i in range(n):
        shares = [s for s, p in (("half", 0.5), ("tenth", 0.1), ("hundredth", 0.01)) if draw[i] < p]
        meta = {"share": tuple(shares), "plan": "pro" if i % 3 else "starter"}
        chunks.append(Chunk(f"c{i}", "docs", f"p{i % 50}.md", "t", ("t",), "x", "x", metadata=meta))
    folder = tmp_path_factory.mktemp("filtered") / "v1"
    vectors = _clustered(n, dim, 5)
    write_snapshot(
        folder, knowledge_base="kb", version="v1", embedder=EmbedderInfo("test", dim),
        chunks=chunks, vectors=vectors, pages={}, page_count=50, hnsw_m=16,
        hnsw_ef_construction=100, target_recall=0.95, filterable=["share", "plan"],
    )  # fmt: skip
    return load_snapshot(folder), vectors


@pytest.mark.parametrize("share", ["half", "tenth", "hundredth"])
@pytest.mark.parametrize("with_plan", [False, True])
def test_filtered_search_finds_the_exact_filtered_top_10(
    filtered_snapshot: Any, share: str, with_plan: bool
) -> None:
    snapshot, vectors = filtered_snapshot
    filters = [MetadataFilter("share", (share,))]
    if with_plan:
        filters.append(MetadataFilter("plan", ("pro",)))
    allowed = snapshot.filters.allowed(filters, [])
    assert allowed.count > 0
    labels = np.flatnonzero(allowed.mask)
    queries = _clustered(30, vectors.shape[1], 9)
    recall = []
    for q in queries:
        found = search(snapshot.index, snapshot.filters, q, 10, allowed)
        assert all(allowed.mask[label] for label, _ in found)
        assert [s for _, s in found] == sorted((s for _, s in found), reverse=True)
        exact = labels[np.argsort(-(vectors[labels] @ q), kind="stable")[:10]]
        assert len(found) == min(10, labels.size)
        recall.append(len({label for label, _ in found} & set(exact.tolist())) / len(exact))
    assert float(np.mean(recall)) >= 0.95


def test_a_snapshots_bytes_count_its_filter_index(filtered_snapshot: Any) -> None:
    """memory_budget_mb evicts by ``memory_bytes``: beyond the files, the filter index's value
    labels, its value partitions' copies of their vectors, each label's row in the mapped
    vectors and its pages' labels."""
    snapshot, vectors = filtered_snapshot
    index = snapshot.filters
    assert index.partitions  # the half and tenth shares are partitioned: their vectors copied
    labels = sum(a.nbytes for values in index.fields.values() for a in values.values())
    copies = sum(p.size for p in index.partitions.values()) * vectors.shape[1] * 4
    rows = index.vectors[1].nbytes
    assert index.nbytes >= labels + copies + rows + 8 * len(snapshot.chunks)  # + pages' labels
    files = sum(snapshot.manifest.sizes.values()) + HNSW_INDEX_BYTES
    assert snapshot.memory_bytes >= files + index.nbytes


def test_a_snapshot_without_a_filter_index_loads_and_has_no_fields(tmp_path: Path) -> None:
    folder = tmp_path / "v1"
    vectors = _clustered(len(CHUNKS), 8, 1)
    write_snapshot(
        folder, knowledge_base="kb", version="v1", embedder=EmbedderInfo("test", 8),
        chunks=CHUNKS, vectors=vectors, pages={}, page_count=5, hnsw_m=8,
        hnsw_ef_construction=50, target_recall=0.9,
    )  # fmt: skip
    assert not (folder / FILTERS).exists()
    snapshot = load_snapshot(folder)
    assert snapshot.filters.fields == {}
    assert snapshot.chunks[3].metadata["plan_scope"] == ("starter", "pro", "enterprise")


def test_a_bad_filter_index_refuses_the_snapshot(tmp_path: Path) -> None:
    folder = tmp_path / "v1"
    vectors = _clustered(len(CHUNKS), 8, 1)
    write_snapshot(
        folder, knowledge_base="kb", version="v1", embedder=EmbedderInfo("test", 8),
        chunks=CHUNKS, vectors=vectors, pages={}, page_count=5, hnsw_m=8,
        hnsw_ef_construction=50, target_recall=0.9, filterable=["tags"],
    )  # fmt: skip
    # rewritten and re-signed, as someone able to write to the store could: still refused
    (folder / FILTERS).write_bytes(b'{"fields": {"tags": {"billing": [9]}}}')
    manifest = json.loads((folder / "manifest.json").read_text())
    manifest["files"][FILTERS] = sha256_file(folder / FILTERS)
    manifest["sizes"][FILTERS] = (folder / FILTERS).stat().st_size
    (folder / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(CorruptSnapshot, match="tags"):
        load_snapshot(folder)


def test_a_page_of_too_many_tags_keeps_its_other_fields_and_their_filters(
    tmp_path: Path, local_embedder: Embedder, caplog: pytest.LogCaptureFixture
) -> None:
    """s12's F7: 70 tags are over MAX_META_STRINGS; the tags are left out, the ``plan_scope``
    after them kept, in the chunks and in filters.json (it lost the page: a filter on it found
    half the pages), and the build says which page's metadata it cut."""
    tags = json.dumps([f"t{i}" for i in range(70)])
    for i in range(4):
        page = tmp_path / "pages" / f"p{i}.md"
        page.parent.mkdir(exist_ok=True)
        many = i % 2 == 0
        front = f"---\ntags: {tags if many else '[a, b]'}\nplan_scope: all\n---\n"
        page.write_text(f"{front}# Page {i}\n\nThe text of page {i}.\n", encoding="utf-8")
    raw = _raw(tmp_path)
    del raw["function"], raw["sidecar"]
    config = parse_config(raw, base=tmp_path)
    build_knowledge_base(config, config.knowledge_bases[0], local_embedder)
    [folder] = (tmp_path / "store" / "help").glob("2*")
    snapshot = load_snapshot(folder)
    fields = orjson.loads((folder / FILTERS).read_bytes())["fields"]
    assert fields["plan_scope"]["all"] == list(range(len(snapshot.chunks)))  # every page
    assert set(fields["tags"]) == {"a", "b"}
    assert sorted(c.metadata.get("plan_scope", "") for c in snapshot.chunks) == ["all"] * 4
    cut = [r.getMessage() for r in caplog.records if "metadata cut" in r.getMessage()]
    assert sorted(m.split(":")[0] for m in cut) == ["p0.md", "p2.md"]
    assert all("left out: 'tags'" in m for m in cut)


# -- a real sidecar ------------------------------------------------------------------------------

PAGES = {
    "billing/refunds.md": ("all", ["billing", "refunds"], "# Refunds\n\nA refund goes back to "
                           "the card that paid, within ten working days of the request.\n"),
    "billing/invoices.md": ("all", ["billing"], "# Invoices\n\nInvoices are emailed on the "
                            "first day of each month as a PDF.\n"),
    "features/sso.md": ("enterprise", ["security"], "# Single sign-on\n\nSet up single sign-on "
                        "with SAML under Admin > Security > SSO. Enterprise plan only.\n"),
    "features/audit-log.md": ("enterprise", ["security", "admin"], "# Audit log\n\nThe audit "
                              "log records every sign-in and settings change for a year.\n"),
    "features/shared-folders.md": (["starter", "pro", "enterprise"], ["sharing"], "# Shared "
                                   "folders\n\nShare a folder with your team from its menu: "
                                   "Share > Invite.\n"),
    "features/api-keys.md": ("pro", ["developers"], "# API keys\n\nCreate an API key under "
                             "Settings > Developers. Keys never expire until revoked.\n"),
}  # fmt: skip
SSO = "how do I set up single sign-on with SAML"
STARTER = {"plan_scope": ["starter", "all"]}


def _raw(root: Path) -> dict[str, Any]:
    return {
        "knowledge_base": [
            {
                "name": "help",
                "source": [{"name": "pages", "type": "markdown", "path": str(root / "pages")}],
                "filterable": ["plan_scope", "tags"],
                "fallback": "I don't have that information.",
                "instructions": "Answer only from the results; never promise a feature.",
            }
        ],
        "function": [
            {"name": "search_help", "description": "Help articles.", "knowledge_base": "help"},
            {
                "name": "search_public",
                "description": "Articles every plan may read.",
                "knowledge_base": "help",
                "filters": {"plan_scope": "all"},
                "filterable": ["tags"],
            },
        ],
        "index": {"store": str(root / "store")},
        "sidecar": {
            "store": str(root / "store"),
            "listen": "127.0.0.1:0",
            "min_score": 0.2,
            "auth": {
                "token_env": "VOX_TEST_TOKEN",
                "caller": [
                    {"name": "starter", "token_env": "VOX_TEST_STARTER", "filters": STARTER}
                ],
            },
        },
    }


@pytest.fixture(scope="module")
def filtered_store(tmp_path_factory: pytest.TempPathFactory, local_embedder: Embedder) -> Path:
    root = tmp_path_factory.mktemp("filtered-kb")
    for rel, (plan, tags, body) in PAGES.items():
        path = root / "pages" / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        front = f"---\nplan_scope: {json.dumps(plan)}\ntags: {json.dumps(tags)}\n---\n"
        path.write_text(front + body, encoding="utf-8")
    config = parse_config(_raw(root), base=root)
    build_knowledge_base(config, config.knowledge_bases[0], local_embedder)
    return root


@pytest.fixture
async def stub(
    filtered_store: Path, local_embedder: Embedder, monkeypatch: pytest.MonkeyPatch
) -> AsyncIterator[pb_grpc.RetrievalStub]:
    monkeypatch.setenv("VOX_TEST_TOKEN", TOKEN_A)
    monkeypatch.setenv("VOX_TEST_STARTER", TOKEN_B)
    config: Config = parse_config(_raw(filtered_store), base=filtered_store)
    async with (
        running(config, local_embedder) as sidecar,
        grpc.aio.insecure_channel(f"127.0.0.1:{sidecar.port}") as channel,
    ):
        yield pb_grpc.RetrievalStub(channel)  # type: ignore[no-untyped-call]


FULL, STARTER_MD = bearer(TOKEN_A), bearer(TOKEN_B)
ENTERPRISE_ONLY = {"features/sso.md", "features/audit-log.md"}


def _paths(chunks: Any) -> set[str]:
    return {c.source_path for c in chunks}


async def test_the_unscoped_token_finds_the_enterprise_page(stub: pb_grpc.RetrievalStub) -> None:
    resp = await stub.Search(pb.SearchRequest(query=SSO), metadata=FULL)
    assert resp.chunks[0].source_path == "features/sso.md"
    assert resp.chunks[0].metadata["plan_scope"] == "enterprise"
    assert resp.instructions.startswith("Answer only")
    assert resp.fallback == ""  # something was found


async def test_a_starter_token_never_sees_an_enterprise_only_chunk(
    stub: pb_grpc.RetrievalStub,
) -> None:
    questions = [SSO, "what does the audit log record", "share a folder with my team"]
    seen: set[str] = set()
    for q in questions:
        search = await stub.Search(pb.SearchRequest(query=q, min_score=-1), metadata=STARTER_MD)
        # asking for enterprise itself narrows further; it never widens the token's filters
        wide = pb.MetadataFilter(field="plan_scope", any_of=["enterprise"])
        widen = await stub.Search(pb.SearchRequest(query=q, filters=[wide]), metadata=STARTER_MD)
        # only what both pass: the one page listing starter among its plans
        assert _paths(widen.chunks) <= {"features/shared-folders.md"}
        assert widen.fallback == ("" if widen.chunks else "I don't have that information.")
        turn = await stub.Turn(
            pb.TurnRequest(session_id=f"t-{q}", text=q, is_final=True), metadata=STARTER_MD
        )
        tool = await stub.InvokeTool(
            pb.InvokeToolRequest(name="search_help", arguments_json=orjson.dumps(
                {"query": q, "plan_scope": ["enterprise", "starter"]}).decode()),
            metadata=STARTER_MD,
        )  # fmt: skip
        assert not tool.is_error, tool.output
        stream = stub.Converse(metadata=STARTER_MD)
        await stream.write(pb.ConverseRequest(turn=pb.TurnRequest(session_id=f"c-{q}", text=q,
                                                                  is_final=True)))  # fmt: skip
        converse = await stream.read()
        await stream.done_writing()
        for chunks in (search.chunks, turn.chunks, tool.chunks, converse.turn.chunks):
            assert not _paths(chunks) & ENTERPRISE_ONLY
            seen |= _paths(chunks)
        assert "features/sso.md" not in tool.output
    assert "features/shared-folders.md" in seen  # listed for starter among its plans
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await stub.ReadPage(pb.ReadPageRequest(source_path="features/sso.md"), metadata=STARTER_MD)
    assert info.value.code() is grpc.StatusCode.NOT_FOUND
    page = await stub.ReadPage(pb.ReadPageRequest(source_path="features/sso.md"), metadata=FULL)
    assert "SAML" in page.text


async def test_a_starter_tokens_search_by_a_vector_alone_is_filtered_too(
    stub: pb_grpc.RetrievalStub, local_embedder: Embedder
) -> None:
    """A Search given only its vector takes the one-step path (``Engine.nearest_to``), except
    for a caller with filters of its own: theirs still apply."""
    (vector,) = await local_embedder.embed([SSO])
    request = pb.SearchRequest(vector=np.asarray(vector, dtype="<f4").tobytes(), min_score=-1)
    full = await stub.Search(request, metadata=FULL)
    assert full.chunks[0].source_path == "features/sso.md"
    starter = await stub.Search(request, metadata=STARTER_MD)
    assert starter.chunks
    assert not _paths(starter.chunks) & ENTERPRISE_ONLY


async def test_path_filters_on_search_turn_and_the_tool(stub: pb_grpc.RetrievalStub) -> None:
    billing = await stub.Search(
        pb.SearchRequest(query=SSO, min_score=-1, limit=10, source_paths=["billing/"]),
        metadata=FULL,
    )
    assert _paths(billing.chunks) == {"billing/refunds.md", "billing/invoices.md"}
    glob = await stub.Search(
        pb.SearchRequest(query=SSO, min_score=-1, limit=10, source_paths=["features/s*.md"]),
        metadata=FULL,
    )
    assert _paths(glob.chunks) == {"features/sso.md", "features/shared-folders.md"}
    turn = await stub.Turn(
        pb.TurnRequest(session_id="p", text=SSO, is_final=True, source_paths=["billing/"]),
        metadata=FULL,
    )
    assert not turn.chunks  # nothing under billing/ is about SSO above min_score
    assert turn.fallback == "I don't have that information."
    tool = await stub.InvokeTool(
        pb.InvokeToolRequest(
            name="search_help",
            arguments_json=f'{{"query": "{SSO}", "source_paths": ["features/"]}}',
        ),
        metadata=FULL,
    )
    assert _paths(tool.chunks) <= {p for p in PAGES if p.startswith("features/")}
    assert tool.chunks[0].source_path == "features/sso.md"


@pytest.mark.parametrize("path", ["./billing/refunds.md", "/billing/refunds.md", "./billing/"])
async def test_a_path_written_from_a_root_is_refused_saying_how_results_give_it(
    stub: pb_grpc.RetrievalStub, path: str
) -> None:
    """No page's path begins with "./" or "/": such a path matched nothing, silently, and the
    answer was the fallback; it is refused naming the path as results give it."""
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await stub.Search(
            pb.SearchRequest(query=SSO, min_score=-1, source_paths=["features/", path]),
            metadata=FULL,
        )
    assert info.value.code() is grpc.StatusCode.INVALID_ARGUMENT
    given = path.removeprefix(".").removeprefix("/")
    assert f"source_paths[1] {path!r} begins with" in (info.value.details() or "")
    assert f"give it as results do, e.g. {given!r}" in (info.value.details() or "")
    tool = await stub.InvokeTool(
        pb.InvokeToolRequest(
            name="search_help",
            arguments_json=orjson.dumps({"query": SSO, "source_paths": [path]}).decode(),
        ),
        metadata=FULL,
    )
    assert tool.is_error
    assert orjson.loads(tool.output)["error"]["type"] == "invalid_arguments"


async def test_a_glob_of_many_wildcards_is_refused_before_it_is_compiled(
    stub: pb_grpc.RetrievalStub,
) -> None:
    # a glob is compiled on the event loop at a cost that grows with its wildcards: 16 fresh
    # globs of 512 wildcards (1 KiB each) held every other call for 2 s
    sixteen = "features/s" + "*" * 16 + ".md"  # features/s*.md, the most a glob may hold
    found = await stub.Search(
        pb.SearchRequest(query=SSO, min_score=-1, limit=10, source_paths=[sixteen]), metadata=FULL
    )
    assert _paths(found.chunks) == {"features/sso.md", "features/shared-folders.md"}
    many = ["billing/", "*a" * 512]
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await stub.Turn(pb.TurnRequest(text=SSO, is_final=True, source_paths=many), metadata=FULL)
    assert info.value.code() is grpc.StatusCode.INVALID_ARGUMENT
    assert info.value.details() == (
        "source_paths[1] has 512 wildcards (*, ?, [); the limit is 16: name a folder or a "
        "simpler glob"
    )
    tool = await stub.InvokeTool(
        pb.InvokeToolRequest(
            name="search_help",
            arguments_json=orjson.dumps({"query": SSO, "source_paths": ["?" * 17]}).decode(),
        ),
        metadata=FULL,
    )
    assert tool.is_error
    assert orjson.loads(tool.output)["error"]["type"] == "invalid_arguments"


async def test_a_field_that_is_not_filterable_is_a_clear_invalid_argument(
    stub: pb_grpc.RetrievalStub,
) -> None:
    bad = pb.MetadataFilter(field="content_type", any_of=["faq"])
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await stub.Search(pb.SearchRequest(query=SSO, filters=[bad]), metadata=FULL)
    assert info.value.code() is grpc.StatusCode.INVALID_ARGUMENT
    assert "'content_type'" in (info.value.details() or "")
    assert "plan_scope, tags" in (info.value.details() or "")
    empty = pb.MetadataFilter(field="tags")
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await stub.Turn(pb.TurnRequest(text=SSO, is_final=True, filters=[empty]), metadata=FULL)
    assert info.value.code() is grpc.StatusCode.INVALID_ARGUMENT
    assert "any_of" in (info.value.details() or "")


async def test_list_tools_offers_the_filterable_fields_with_the_snapshots_values(
    stub: pb_grpc.RetrievalStub,
) -> None:
    tools = {t.name: t for t in (await stub.ListTools(pb.ListToolsRequest(), metadata=FULL)).tools}
    assert tools["search_help"].instructions.startswith("Answer only")
    assert tools["search_help"].fallback == "I don't have that information."
    realtime = json.loads(tools["search_help"].realtime_json)
    props = realtime["parameters"]["properties"]
    assert props["plan_scope"]["items"]["enum"] == ["all", "enterprise", "pro", "starter"]
    assert "security" in props["tags"]["items"]["enum"]
    public = json.loads(tools["search_public"].responses_json)["parameters"]["properties"]
    assert set(public) == {"query", "source_paths", "tags"}  # plan_scope is fixed, not offered
    for tool in tools.values():
        RealtimeFunctionTool.model_validate_json(tool.realtime_json)
        FunctionTool.model_validate_json(tool.responses_json)
        ChatCompletionFunctionTool.model_validate_json(tool.chat_completions_json)
    refused = await stub.InvokeTool(
        pb.InvokeToolRequest(name="search_public", arguments_json=f'{{"query": "{SSO}"}}'),
        metadata=FULL,
    )
    assert not _paths(refused.chunks) & ENTERPRISE_ONLY  # its fixed filter: plan_scope all
    assert refused.fallback == ("" if refused.chunks else "I don't have that information.")


@pytest.mark.parametrize(
    ("patch", "message"),
    [
        ({"filterable": "tags"}, "filterable must be a list"),
        ({"fallback": 3}, "fallback must be a string"),
    ],
)
def test_base_policy_keys_are_checked(tmp_path: Path, patch: dict[str, Any], message: str) -> None:
    raw = _raw(tmp_path)
    raw["knowledge_base"][0].update(patch)
    with pytest.raises(ConfigError, match=message):
        parse_config(raw, base=tmp_path)


def test_a_function_filters_only_on_what_its_base_indexes(tmp_path: Path) -> None:
    raw = _raw(tmp_path)
    raw["function"][1]["filters"] = {"content_type": "faq"}
    with pytest.raises(ConfigError, match="content_type not in knowledge base 'help'"):
        parse_config(raw, base=tmp_path)
    raw = _raw(tmp_path)
    raw["sidecar"]["auth"]["caller"][0]["filters"] = {"plan_scope": []}
    with pytest.raises(ConfigError, match="plan_scope"):
        parse_config(raw, base=tmp_path)


async def test_a_starter_token_never_sees_an_enterprise_only_chunk_over_http(
    filtered_store: Path, local_embedder: Embedder, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The token's filters hold on the HTTP door too: an MCP tool call, the tool webhook and a
    Vapi knowledge-base request answer a starter caller from starter pages only, whatever the
    arguments ask for."""
    monkeypatch.setenv("VOX_TEST_TOKEN", TOKEN_A)
    monkeypatch.setenv("VOX_TEST_STARTER", TOKEN_B)
    raw = _raw(filtered_store)
    raw["sidecar"]["http"] = {"listen": "127.0.0.1:0", "read_page_bases": ["help"]}
    config = parse_config(raw, base=filtered_store)
    wide = {"plan_scope": ["enterprise", "starter"]}
    async with (
        running(config, local_embedder) as sc,
        httpx2.AsyncClient(headers={"authorization": f"Bearer {TOKEN_B}"}) as http,
        streamable_http_client(f"http://127.0.0.1:{sc.http_port}/mcp", http_client=http) as (
            read,
            write,
        ),
        ClientSession(read, write) as mcp,
    ):
        await mcp.initialize()
        for q in (SSO, "what does the audit log record"):
            called = await mcp.call_tool("search_help", {"query": q, **wide})
            assert not called.is_error
            first: Any = called.content[0]
            mcp_paths = {r["path"] for r in orjson.loads(first.text)["results"]}
            hook = await http.post(
                f"http://127.0.0.1:{sc.http_port}/tools/search_help",
                json={"args": {"query": q, **wide}},
            )
            assert hook.status_code == 200
            hook_paths = {r["path"] for r in hook.json()["results"]}
            vapi = await http.post(
                f"http://127.0.0.1:{sc.http_port}/vapi/knowledge-base",
                json={
                    "message": {
                        "type": "knowledge-base-request",
                        "messages": [{"role": "user", "content": q}],
                        "call": {"id": f"call-{len(q)}"},
                    }
                },
            )
            assert vapi.status_code == 200
            texts = " ".join(d["content"] for d in vapi.json()["documents"])
            assert not (mcp_paths | hook_paths) & ENTERPRISE_ONLY
            assert "SAML" not in texts
            assert "audit log records" not in texts
        page = await mcp.call_tool(  # nor reads an enterprise page whole
            "read_page", {"source_path": "features/sso.md", "knowledge_base": "help"}
        )
        assert page.is_error
        assert "no page" in str(page.content[0])
        refunds = await mcp.call_tool(  # a page its plan reaches, it reads
            "read_page", {"source_path": "billing/refunds.md", "knowledge_base": "help"}
        )
        assert not refunds.is_error
        assert "ten working days" in str(refunds.content[0])
        full = await http.post(  # the same call with the unscoped token does find it
            f"http://127.0.0.1:{sc.http_port}/tools/search_help",
            json={"args": {"query": SSO}},
            headers={"authorization": f"Bearer {TOKEN_A}"},
        )
        assert "features/sso.md" in {r["path"] for r in full.json()["results"]}
