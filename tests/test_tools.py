"""Knowledge functions: config, definitions in three formats, calls, output budget, ReadPage.

Units use hand-made chunks; the end-to-end tests build a real snapshot (three sources of real
Markdown, the real embedded model) and call a real grpc.aio server on port 0.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import grpc
import orjson
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from openai.types.chat import ChatCompletionFunctionTool
from openai.types.realtime import RealtimeFunctionTool
from openai.types.responses import FunctionTool

from index.build import build_knowledge_base
from index.config import KnowledgeBaseConfig, SourceConfig
from index.embedders.base import Embedder
from index.errors import ConfigError
from index.types import Chunk, MetadataFilter
from sidecar.config import Config, FunctionConfig, parse_config
from sidecar.edge.server import create_server
from sidecar.errors import ToolCallError
from sidecar.functions.tools import (
    FILTER_NOT_ALLOWED,
    INVALID_ARGUMENTS,
    MAX_ENUM_VALUES,
    KnowledgeFunction,
    format_results,
    nested_past,
)
from sidecar.gen import retrieval_pb2 as pb
from sidecar.gen import retrieval_pb2_grpc as pb_grpc
from sidecar.turn.hits import Hit
from tests.conftest import REPO, shared

HELP_KB = REPO / "examples" / "kb"


# -- config ------------------------------------------------------------------------------------


def raw_config(functions: list[dict[str, Any]], **sidecar: Any) -> dict[str, Any]:
    return {
        "knowledge_base": [
            {
                "name": "docs",
                "source": [
                    {"name": "settings", "type": "markdown", "path": "a"},
                    {"name": "tutorials", "type": "markdown", "path": "b"},
                    {"name": "help", "type": "markdown", "path": "c"},
                ],
            },
            {"name": "other", "source": [{"name": "faq", "type": "markdown", "path": "d"}]},
        ],
        "function": functions,
        "sidecar": sidecar,
    }


def test_one_base_backs_several_functions_with_their_own_sources(tmp_path: Path) -> None:
    config = parse_config(
        raw_config(
            [
                {
                    "name": "search_terminal",
                    "description": "Windows Terminal settings and tutorials.",
                    "knowledge_base": "docs",
                    "sources": ["settings", "tutorials"],
                    "limit": 4,
                },
                {"name": "search_help", "description": "Phone plans.", "knowledge_base": "docs"},
            ],
            tool_output_chars=900,
        ),
        tmp_path,
    )
    assert config.functions == (
        FunctionConfig(
            "search_terminal",
            "Windows Terminal settings and tutorials.",
            "docs",
            ("settings", "tutorials"),
            4,
        ),
        FunctionConfig("search_help", "Phone plans.", "docs"),
    )
    assert config.sidecar.tool_output_chars == 900


@pytest.mark.parametrize(
    ("function", "message"),
    [
        ({"knowledge_base": "nope"}, "knowledge_base 'nope' is not a configured"),
        ({"sources": ["faq"]}, "source(s) faq not in knowledge base 'docs'"),
        ({"sources": "settings"}, "sources must be a list"),
        ({"sources": ["help", "help"]}, "sources must be unique"),
        ({"name": "search docs"}, "name must be 1-64"),
        ({"name": "x" * 65}, "name must be 1-64"),
        ({"description": " "}, "a description is required"),
        ({"limit": 51}, "limit must be 0..50"),
        ({"limit": -1}, "limit must be 0..50"),
        ({"limit": "3"}, "limit must be a whole number"),
        ({"knowledge": "docs"}, "unknown key(s) knowledge"),
    ],
)
def test_function_config_errors_name_the_problem(
    tmp_path: Path, function: dict[str, Any], message: str
) -> None:
    fn = {"name": "search", "description": "d", "knowledge_base": "docs", **function}
    with pytest.raises(ConfigError, match="function") as info:
        parse_config(raw_config([fn]), tmp_path)
    assert message in str(info.value)


def test_function_names_are_unique_and_output_budget_has_a_floor(tmp_path: Path) -> None:
    fn = {"name": "search", "description": "d", "knowledge_base": "docs"}
    with pytest.raises(ConfigError, match="names must be unique"):
        parse_config(raw_config([fn, fn]), tmp_path)
    with pytest.raises(ConfigError, match="tool_output_chars must be from 200 to "):
        parse_config(raw_config([fn], tool_output_chars=199), tmp_path)


# -- definitions and argument parsing ------------------------------------------------------------


TERMINAL = KnowledgeFunction(
    FunctionConfig("search_terminal", "Terminal docs.", "docs", ("settings", "tutorials")),
    ("settings", "tutorials"),
)
HELP = KnowledgeFunction(
    FunctionConfig("search_help", "Phone plans.", "docs", ("help",)), ("help",)
)
WHOLE_BASE = KnowledgeFunction(
    FunctionConfig("search_all", "Everything.", "docs"), ("settings", "tutorials", "help")
)
# filterable fields, one narrowed by a fixed filter the model cannot widen
FILTERED = KnowledgeFunction(
    FunctionConfig(
        "search_plans",
        "Plan features.",
        "docs",
        filters=(MetadataFilter("plan_scope", ("starter", "all")),),
        filterable=("plan_scope", "tags"),
    ),
    ("help",),
)
VALUES = {"plan_scope": ["all", "enterprise", "pro", "starter"], "tags": ["billing", "sso"]}


def assert_strict_schema(schema: dict[str, Any]) -> None:
    """OpenAI strict mode: every object closed, every property required (optional = nullable)."""
    if schema.get("type") == "object" or "properties" in schema:
        assert schema["additionalProperties"] is False
        assert sorted(schema["required"]) == sorted(schema["properties"])
        for sub in schema["properties"].values():
            assert_strict_schema(sub)
    if "items" in schema:
        assert_strict_schema(schema["items"])


@pytest.mark.parametrize("fn", [TERMINAL, HELP, WHOLE_BASE, FILTERED], ids=lambda f: f.name)
def test_definitions_match_the_openai_types(fn: KnowledgeFunction) -> None:
    realtime, responses, chat = fn.definitions(VALUES)
    for model, definition in (
        (RealtimeFunctionTool, realtime),
        (FunctionTool, responses),
        (ChatCompletionFunctionTool, chat),
    ):
        parsed = model.model_validate(definition)
        assert set(definition) <= set(model.model_fields), model  # no key the API does not know
        assert parsed.type == "function"
    assert realtime["name"] == responses["name"] == chat["function"]["name"] == fn.name
    assert responses["strict"] is True
    assert_strict_schema(responses["parameters"])
    assert realtime["parameters"]["required"] == ["query"]
    assert chat["function"]["parameters"] == realtime["parameters"]


@pytest.mark.parametrize("fn", [TERMINAL, HELP, WHOLE_BASE, FILTERED], ids=lambda f: f.name)
def test_an_argument_is_described_as_nullable_only_where_its_schema_allows_null(
    fn: KnowledgeFunction,
) -> None:
    """A model told "null or left out" may send null, and a client validating its arguments
    against the schema would refuse it: the words and the schema agree in every format."""
    realtime, responses, chat = fn.definitions(VALUES)
    for parameters in (
        realtime["parameters"],
        responses["parameters"],
        chat["function"]["parameters"],
    ):
        for name, prop in parameters["properties"].items():
            nullable = "null" in prop["type"]
            assert ("null" in prop.get("description", "")) == nullable, (name, prop)
            if name != "query":
                assert "left out" in prop["description"]


def test_sources_filter_is_offered_only_with_a_choice() -> None:
    terminal = TERMINAL.realtime()["parameters"]["properties"]
    assert terminal["sources"]["items"]["enum"] == ["settings", "tutorials"]
    assert TERMINAL.responses()["parameters"]["properties"]["sources"]["type"] == ["array", "null"]
    assert set(HELP.realtime()["parameters"]["properties"]) == {"query", "source_paths"}
    assert set(HELP.responses()["parameters"]["properties"]) == {"query", "source_paths"}


def test_filterable_fields_are_optional_arguments_with_the_snapshots_values() -> None:
    realtime, responses, _ = FILTERED.definitions(VALUES)
    props = realtime["parameters"]["properties"]
    # the fixed filter narrows the enum: a starter-plan function never offers "enterprise"
    assert props["plan_scope"]["items"]["enum"] == ["all", "starter"]
    assert props["tags"]["items"]["enum"] == ["billing", "sso"]
    assert props["source_paths"]["items"] == {"type": "string"}
    assert realtime["parameters"]["required"] == ["query"]
    strict = responses["parameters"]["properties"]
    assert strict["plan_scope"]["type"] == ["array", "null"]
    # without a snapshot's values (or with too many) the field takes free strings
    many = {"tags": [f"t{i}" for i in range(MAX_ENUM_VALUES + 1)]}
    assert "enum" not in FILTERED.realtime(many)["parameters"]["properties"]["tags"]["items"]
    assert "enum" not in FILTERED.realtime()["parameters"]["properties"]["plan_scope"]["items"]


def test_a_model_cannot_widen_a_fixed_filter() -> None:
    call = FILTERED.parse('{"query": "sso", "tags": "sso", "plan_scope": ["starter"]}')
    assert call.filters == (
        MetadataFilter("plan_scope", ("starter",)),
        MetadataFilter("tags", ("sso",)),
        MetadataFilter("plan_scope", ("starter", "all")),
    )
    with pytest.raises(ToolCallError) as info:
        FILTERED.parse('{"query": "sso", "plan_scope": ["enterprise"]}')
    assert info.value.type == FILTER_NOT_ALLOWED
    assert "'enterprise'" in info.value.message
    assert "'starter'" in info.value.message
    with pytest.raises(ToolCallError) as info:
        FILTERED.parse('{"query": "sso", "content_type": ["faq"]}')
    assert info.value.type == INVALID_ARGUMENTS  # not a field it may filter on: no such argument
    with pytest.raises(ToolCallError) as info:
        FILTERED.parse('{"query": "sso", "source_paths": [3]}')
    assert info.value.type == INVALID_ARGUMENTS
    assert FILTERED.parse('{"query": "x", "source_paths": "billing/"}').source_paths == (
        "billing/",
    )


@pytest.mark.parametrize(
    ("fn", "arguments", "query", "sources"),
    [
        (TERMINAL, '{"query": "font size"}', "font size", ("settings", "tutorials")),
        (
            TERMINAL,
            '{"query": "font size", "sources": null}',
            "font size",
            ("settings", "tutorials"),
        ),
        (TERMINAL, '{"query": "ssh", "sources": ["tutorials"]}', "ssh", ("tutorials",)),
        (TERMINAL, '{"query": "ssh", "sources": []}', "ssh", ("settings", "tutorials")),
        (HELP, '{"query": "roaming"}', "roaming", ("help",)),
        (WHOLE_BASE, '{"query": "roaming"}', "roaming", ()),
        (WHOLE_BASE, '{"query":"x","sources":["help","help"]}', "x", ("help",)),
    ],
)
def test_parse_never_widens_a_function(
    fn: KnowledgeFunction, arguments: str, query: str, sources: tuple[str, ...]
) -> None:
    call = fn.parse(arguments)
    assert (call.query, call.sources) == (query, sources)


@pytest.mark.parametrize(
    ("fn", "arguments", "error", "says"),
    [
        (TERMINAL, '{"query": "abc"', "invalid_json", "not valid JSON"),
        (TERMINAL, "[1, 2]", "invalid_arguments", "must be a JSON object"),
        (TERMINAL, "", "invalid_arguments", "query is required"),
        (TERMINAL, "{}", "invalid_arguments", "query is required"),
        (TERMINAL, '{"query": null}', "invalid_arguments", "query is required"),
        (TERMINAL, '{"query": "  "}', "invalid_arguments", "query is empty"),
        (TERMINAL, '{"query": 7}', "invalid_arguments", "must be a string"),
        (TERMINAL, json.dumps({"query": "a" * 16385}), "invalid_arguments", "keep it under"),
        (TERMINAL, '{"query": "x", "sources": ["help"]}', "filter_not_allowed", "cannot search"),
        (TERMINAL, '{"query": "x", "sources": "settings"}', "invalid_arguments", "list of source"),
        (
            TERMINAL,
            '{"query": "x", "knowledge_base": "other"}',
            "invalid_arguments",  # a misnamed argument, not a filter
            "does not take",
        ),
        (HELP, '{"query": "x", "sources": ["help"]}', "invalid_arguments", "takes only query"),
    ],
)
def test_parse_errors_say_what_to_change(
    fn: KnowledgeFunction, arguments: str, error: str, says: str
) -> None:
    with pytest.raises(ToolCallError) as info:
        fn.parse(arguments)
    assert info.value.type == error
    assert says in info.value.message


# -- output budget -----------------------------------------------------------------------------


def hit(i: int, text: str, title: str = "Page", score: float = 0.9) -> Hit:
    chunk = Chunk(
        chunk_id=f"c{i}",
        source="docs",
        source_path=f"p{i}.md",
        title=title,
        breadcrumbs=(title, f"Section {i}"),
        text=text,
        embed_text=text,
    )
    return Hit(knowledge_base="kb", chunk=chunk, score=score)


def test_output_fits_by_trimming_excerpts_before_dropping_results() -> None:
    hits = [hit(i, f"word{i} " * 200, score=0.9 - i / 10) for i in range(3)]
    whole = orjson.loads(format_results(hits, 100_000))
    assert len(whole["results"]) == 3
    assert "truncated" not in whole
    assert whole["results"][0] == {
        "title": "Page",
        "source": "docs",
        "path": "p0.md",
        "breadcrumbs": ["Page", "Section 0"],
        "excerpt": ("word0 " * 200).strip(),
        "score": 0.9,
    }

    trimmed = format_results(hits, 1200)
    body = orjson.loads(trimmed)
    assert len(trimmed) <= 1200
    assert body["truncated"] is True
    assert len(body["results"]) == 3  # room for three excerpts of >= 80 characters
    assert all(r["excerpt"].endswith("...") for r in body["results"])

    dropped = orjson.loads(format_results(hits, 300))
    assert [r["path"] for r in dropped["results"]] == ["p0.md"]  # the best result stays


def test_no_results_tells_the_model_not_to_guess() -> None:
    assert orjson.loads(format_results([], 200))["note"].startswith("Nothing in the knowledge base")


@settings(max_examples=150, deadline=None)
@given(
    texts=st.lists(st.text(min_size=0, max_size=600), min_size=0, max_size=6),
    title=st.text(max_size=120),
    budget=st.integers(min_value=200, max_value=3000),
)
def test_output_is_always_valid_json_within_budget(
    texts: list[str], title: str, budget: int
) -> None:
    hits = [hit(i, t, title) for i, t in enumerate(texts)]
    out = format_results(hits, budget)
    assert len(out) <= budget
    body = orjson.loads(out)
    paths = [r["path"] for r in body["results"]]
    assert paths == [f"p{i}.md" for i in range(len(paths))]  # a prefix: best results kept


# -- end to end --------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tools_config(tmp_path_factory: pytest.TempPathFactory, local_embedder: Embedder) -> Config:
    """One base of three real sources (and a copy of one), with functions over parts of it."""
    docs = shared("docs-windows-terminal", "docs")
    store = tmp_path_factory.mktemp("tools") / "store"
    raw = {
        "knowledge_base": [
            {
                "name": "docs",
                "source": [
                    {
                        "name": "settings",
                        "type": "markdown",
                        "path": str(docs / "customize-settings"),
                    },
                    {"name": "tutorials", "type": "markdown", "path": str(docs / "tutorials")},
                    {"name": "help", "type": "markdown", "path": str(HELP_KB)},
                    {"name": "help-copy", "type": "markdown", "path": str(HELP_KB)},
                ],
            }
        ],
        "function": [
            {
                "name": "search_terminal",
                "description": "Windows Terminal settings and tutorials.",
                "knowledge_base": "docs",
                "sources": ["settings", "tutorials"],
                "limit": 3,
            },
            {
                "name": "search_help",
                "description": "Northwind Mobile plans, roaming, voicemail and passwords.",
                "knowledge_base": "docs",
                "sources": ["help"],
                "limit": 5,
            },
        ],
        "index": {"store": str(store)},
        "sidecar": {"store": str(store), "listen": "127.0.0.1:0", "tool_output_chars": 1500},
    }
    config = parse_config(raw, base=store.parent)
    build_knowledge_base(config, config.knowledge_bases[0], local_embedder)
    return config


@pytest.fixture
async def client(
    tools_config: Config, local_embedder: Embedder
) -> AsyncIterator[pb_grpc.RetrievalStub]:
    sidecar = await create_server(tools_config, embedder=local_embedder, poll=False)
    async with grpc.aio.insecure_channel(f"127.0.0.1:{sidecar.port}") as channel:
        yield pb_grpc.RetrievalStub(channel)
    await sidecar.stop(0.5)


async def invoke(
    client: pb_grpc.RetrievalStub, name: str, arguments: str, session_id: str = ""
) -> tuple[pb.InvokeToolResponse, dict[str, Any]]:
    resp = await client.InvokeTool(
        pb.InvokeToolRequest(
            name=name, arguments_json=arguments, session_id=session_id, call_id="call_42"
        ),
        timeout=10,
    )
    assert resp.call_id == "call_42"
    return resp, orjson.loads(resp.output)


async def test_list_tools_in_every_format(client: pb_grpc.RetrievalStub) -> None:
    resp = await client.ListTools(pb.ListToolsRequest(), timeout=10)
    tools = {t.name: t for t in resp.tools}
    assert set(tools) == {"search_terminal", "search_help"}
    terminal = tools["search_terminal"]
    assert (terminal.knowledge_base, list(terminal.sources)) == ("docs", ["settings", "tutorials"])
    realtime = json.loads(terminal.realtime_json)
    responses = json.loads(terminal.responses_json)
    chat = json.loads(terminal.chat_completions_json)
    assert realtime["parameters"]["properties"]["sources"]["items"]["enum"] == [
        "settings",
        "tutorials",
    ]
    assert responses["strict"] is True
    assert chat["function"]["name"] == "search_terminal"
    assert (
        "sources" not in json.loads(tools["search_help"].realtime_json)["parameters"]["properties"]
    )

    only = await client.ListTools(pb.ListToolsRequest(format=pb.RESPONSES), timeout=10)
    assert all(
        t.responses_json and not t.realtime_json and not t.chat_completions_json for t in only.tools
    )


async def test_a_function_never_reaches_a_source_it_was_not_given(
    client: pb_grpc.RetrievalStub,
) -> None:
    # A terminal question to the help function: whatever comes back is from "help" only.
    resp, body = await invoke(client, "search_help", '{"query": "How do I change the font size?"}')
    assert not resp.is_error
    assert {c.source for c in resp.chunks} <= {"help"}
    assert {r["source"] for r in body["results"]} <= {"help"}

    resp, body = await invoke(client, "search_help", '{"query": "How much does roaming cost?"}')
    assert body["results"][0]["path"] == "roaming.md"
    assert body["results"][0]["source"] == "help"
    assert len(resp.chunks) <= 5

    resp, body = await invoke(
        client, "search_terminal", '{"query": "How much does roaming cost?", "sources": null}'
    )
    assert {c.source for c in resp.chunks} <= {"settings", "tutorials"}

    resp, body = await invoke(
        client, "search_terminal", '{"query": "connect with ssh", "sources": ["tutorials"]}'
    )
    assert resp.chunks
    assert {c.source for c in resp.chunks} == {"tutorials"}
    assert body["results"][0]["path"] == "ssh.md"


async def test_results_carry_what_the_model_needs_within_the_budget(
    client: pb_grpc.RetrievalStub,
) -> None:
    resp, body = await invoke(client, "search_terminal", '{"query": "change the color scheme"}')
    assert len(resp.output) <= 1500
    assert 1 <= len(body["results"]) <= 3
    for result, chunk in zip(body["results"], resp.chunks, strict=False):
        assert result["title"] == chunk.title
        assert result["path"] == chunk.source_path
        assert result["breadcrumbs"] == list(chunk.breadcrumbs)
        assert result["excerpt"]
        assert result["score"] == pytest.approx(chunk.score, abs=1e-3)


@pytest.mark.parametrize(
    ("name", "arguments", "error"),
    [
        ("search_terminal", '{"query": "font', "invalid_json"),
        ("search_wiki", '{"query": "font size"}', "unknown_function"),
        ("search_terminal", '{"sources": ["settings"]}', "invalid_arguments"),
        ("search_terminal", '{"query": ""}', "invalid_arguments"),
        ("search_terminal", '{"query": "font", "sources": ["help"]}', "filter_not_allowed"),
        ("search_help", '{"query": "font", "knowledge_base": "other"}', "invalid_arguments"),
    ],
)
async def test_bad_calls_come_back_as_outputs_the_model_can_read(
    client: pb_grpc.RetrievalStub, name: str, arguments: str, error: str
) -> None:
    resp, body = await invoke(client, name, arguments)
    assert resp.is_error
    assert not resp.chunks
    assert body["error"]["type"] == error
    assert body["error"]["message"]


async def test_a_call_in_a_session_joins_its_retained_context(
    client: pb_grpc.RetrievalStub,
) -> None:
    resp, _ = await invoke(client, "search_help", '{"query": "voicemail PIN"}', session_id="call-7")
    assert resp.chunks
    turn = await client.Turn(
        pb.TurnRequest(session_id="call-7", text="Let me check that.", speaker=pb.AGENT),
        timeout=10,
    )
    assert turn.skipped == pb.AGENT_TURN
    assert {c.chunk_id for c in resp.chunks} <= {c.chunk_id for c in turn.context}

    other = await client.Turn(
        pb.TurnRequest(session_id="call-8", text="Let me check.", speaker=pb.AGENT), timeout=10
    )
    assert not other.context  # a call without session_id, or another session, joins nothing


async def test_read_page_returns_a_whole_page_of_the_snapshot(
    client: pb_grpc.RetrievalStub,
) -> None:
    page = await client.ReadPage(
        pb.ReadPageRequest(knowledge_base="docs", source_path="roaming.md", source="help"),
        timeout=10,
    )
    assert page.title == "Using your phone abroad"
    assert page.source == "help"
    assert "Travel Pass" in page.text
    assert page.snapshot_version
    assert page.text.strip() in (HELP_KB / "roaming.md").read_text(encoding="utf-8")

    tutorial = await client.ReadPage(pb.ReadPageRequest(source_path="ssh.md"), timeout=10)
    assert tutorial.source == "tutorials"
    assert len(tutorial.text) > 500


@pytest.mark.parametrize(
    ("request_", "code"),
    [
        (pb.ReadPageRequest(source_path="../../etc/passwd"), grpc.StatusCode.NOT_FOUND),
        (pb.ReadPageRequest(source_path="/etc/passwd"), grpc.StatusCode.NOT_FOUND),
        (pb.ReadPageRequest(source_path="../kb/roaming.md"), grpc.StatusCode.NOT_FOUND),
        (pb.ReadPageRequest(source_path="help:roaming.md"), grpc.StatusCode.NOT_FOUND),
        (pb.ReadPageRequest(source_path="ssh.md", source="nope"), grpc.StatusCode.NOT_FOUND),
        (
            pb.ReadPageRequest(knowledge_base="nope", source_path="ssh.md"),
            grpc.StatusCode.NOT_FOUND,
        ),
        (pb.ReadPageRequest(source_path=""), grpc.StatusCode.INVALID_ARGUMENT),
        # two sources hold a page at this path: the caller must say which
        (pb.ReadPageRequest(source_path="roaming.md"), grpc.StatusCode.INVALID_ARGUMENT),
    ],
)
async def test_read_page_reads_nothing_outside_the_snapshot(
    client: pb_grpc.RetrievalStub, request_: pb.ReadPageRequest, code: grpc.StatusCode
) -> None:
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await client.ReadPage(request_, timeout=10)
    assert info.value.code() == code


async def test_a_base_without_a_snapshot_is_an_error_output_not_a_failed_call(
    tools_config: Config, local_embedder: Embedder
) -> None:
    later = KnowledgeBaseConfig("later", sources=(SourceConfig("help", "markdown", HELP_KB),))
    config = replace(
        tools_config,
        knowledge_bases=(*tools_config.knowledge_bases, later),
        functions=(FunctionConfig("search_later", "Not built yet.", "later"),),
    )
    sidecar = await create_server(config, embedder=local_embedder, poll=False)
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{sidecar.port}") as channel:
            resp, body = await invoke(
                pb_grpc.RetrievalStub(channel), "search_later", '{"query": "roaming"}'
            )
    finally:
        await sidecar.stop(0.5)
    assert resp.is_error
    assert body["error"]["type"] == "unavailable"


def test_nested_past_counts_lists_and_objects_not_values() -> None:
    def lists(depth: int) -> Any:
        value: Any = []
        for _ in range(depth - 1):
            value = [value]
        return value

    assert not nested_past(lists(32), 32)
    assert nested_past(lists(33), 32)
    assert not nested_past({"query": "x", "filters": {"plan": ["a", "b"]}}, 3)
    assert nested_past({"query": "x", "filters": {"plan": ["a", "b"]}}, 2)
    assert not nested_past("a string", 0)
    assert nested_past({}, 0)
