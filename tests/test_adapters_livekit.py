"""The LiveKit Agents adapter with LiveKit's own objects, no network, against a real sidecar.

The preemptive-generation check is LiveKit's own: a preemptive reply is kept only when
``preemptive_chat_ctx.is_equivalent(turn_ctx)`` after ``on_user_turn_completed``.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import orjson
import pytest

pytest.importorskip("livekit.agents")

from livekit.agents import Agent, AgentSession, ChatMessage, RunContext, llm
from livekit.agents.voice.events import UserInputTranscribedEvent
from livekit.agents.voice.speech_handle import SpeechHandle

from sidecar.adapters.client import Voxrecall
from sidecar.adapters.livekit import (
    KNOWLEDGE_ID,
    LiveKitKnowledge,
    knowledge_tool,
    knowledge_tools,
)
from sidecar.edge.limits import MAX_ARGUMENTS_BYTES
from sidecar.gen import retrieval_pb2 as pb
from tests.adapters import ROAMING, VOICEMAIL, knowledge_sidecar_fixture  # noqa: F401


@pytest.fixture
async def vr(knowledge_sidecar: Any) -> AsyncIterator[Voxrecall]:
    async with Voxrecall(f"127.0.0.1:{knowledge_sidecar.port}", turn_timeout_s=10) as client:
        yield client


def user_says(text: str) -> ChatMessage:
    return ChatMessage(role="user", content=[text])


def knowledge_in(ctx: llm.ChatContext) -> str:
    item = ctx.get_by_id(KNOWLEDGE_ID)
    assert isinstance(item, ChatMessage)
    return item.text_content or ""


async def interim(session: AgentSession, knowledge: LiveKitKnowledge, text: str) -> None:
    session.emit(
        "user_input_transcribed", UserInputTranscribedEvent(transcript=text, is_final=False)
    )
    await knowledge.prefetched()


async def test_turn_completed_adds_this_turns_knowledge(vr: Voxrecall) -> None:
    agent = Agent(instructions="You are a helpful agent.")
    knowledge = LiveKitKnowledge(vr, session_id="lk-1")
    turn_ctx = agent.chat_ctx.copy()
    await knowledge.on_user_turn_completed(turn_ctx, user_says(ROAMING))
    assert "(help-center:roaming.md)" in knowledge_in(turn_ctx)
    assert knowledge.kept_prefetch == 0

    before = turn_ctx.copy()
    await knowledge.on_user_turn_completed(turn_ctx, user_says("yeah"))  # a backchannel
    assert turn_ctx.is_equivalent(before)


async def test_prefetched_knowledge_keeps_the_preemptive_generation(vr: Voxrecall) -> None:
    session: AgentSession = AgentSession()
    agent = Agent(instructions="You are a helpful agent.")
    knowledge = LiveKitKnowledge(vr, session_id="lk-2")
    knowledge.attach(session, agent)

    await interim(session, knowledge, "How much does roaming")
    await interim(session, knowledge, ROAMING)
    assert "(help-center:roaming.md)" in knowledge_in(agent.chat_ctx)

    # What LiveKit does next: the final transcript starts a preemptive generation with a copy
    # of the agent's context; the end of the turn runs the hook on another copy, then compares.
    preemptive_ctx = agent.chat_ctx.copy()
    turn_ctx = agent.chat_ctx.copy()
    await knowledge.on_user_turn_completed(turn_ctx, user_says(ROAMING))
    assert preemptive_ctx.is_equivalent(turn_ctx)
    assert knowledge.kept_prefetch == 1


async def test_stale_prefetched_knowledge_is_replaced(vr: Voxrecall) -> None:
    session: AgentSession = AgentSession()
    agent = Agent(instructions="You are a helpful agent.")
    knowledge = LiveKitKnowledge(vr, session_id="lk-3")
    knowledge.attach(session, agent)

    await interim(session, knowledge, VOICEMAIL)  # the caller then said something else
    preemptive_ctx = agent.chat_ctx.copy()
    turn_ctx = agent.chat_ctx.copy()
    await knowledge.on_user_turn_completed(turn_ctx, user_says(ROAMING))
    assert not preemptive_ctx.is_equivalent(turn_ctx)  # LiveKit regenerates with the right one
    assert "(help-center:roaming.md)" in knowledge_in(turn_ctx)
    assert len([i for i in turn_ctx.items if i.id == KNOWLEDGE_ID]) == 1


def run_context(session: AgentSession, name: str, call_id: str) -> RunContext[Any]:
    call = llm.FunctionCall(call_id=call_id, name=name, arguments="{}")
    return RunContext(session=session, speech_handle=SpeechHandle.create(), function_call=call)


@pytest.mark.parametrize(
    ("arguments", "is_error"),
    [
        (orjson.dumps({"query": ROAMING}).decode(), False),
        ('{"query": ""}', True),
    ],
)
async def test_knowledge_tool_runs_through_livekits_function_executor(
    vr: Voxrecall, arguments: str, is_error: bool
) -> None:
    tools = await knowledge_tools(vr, session_id="lk-4")
    (tool,) = tools
    assert tool.info.name == "knowledge_search"
    assert tool.info.raw_schema["parameters"]["required"] == ["query"]

    result = await llm.execute_function_call(
        llm.FunctionToolCall(name="knowledge_search", arguments=arguments, call_id="call_9"),
        llm.ToolContext(tools),
        call_ctx=run_context(AgentSession(), "knowledge_search", "call_9"),
    )
    out = result.fnc_call_out
    assert out is not None
    assert out.call_id == "call_9"
    assert out.is_error is is_error
    body = orjson.loads(out.output)
    if is_error:
        assert body["error"]["type"] == "invalid_arguments"
    else:
        assert "roaming.md" in [r["path"] for r in body["results"]]


@pytest.mark.parametrize("size", [100 * 1024, 5 * 1024 * 1024], ids=["100KiB", "5MiB"])
async def test_over_large_arguments_are_refused_unsent_as_the_sidecar_would(size: int) -> None:
    """Arguments over MAX_ARGUMENTS_BYTES: the model gets the sidecar's own refusal with the
    limit in bytes, and nothing is sent (this client reaches no sidecar)."""
    tool = pb.Tool(
        name="knowledge_search",
        description="Search.",
        realtime_json=orjson.dumps(
            {"name": "knowledge_search", "description": "Search.", "parameters": {"type": "object"}}
        ).decode(),
    )
    async with Voxrecall("127.0.0.1:9", tool_timeout_s=0.5) as absent:  # nothing listens on 9
        tools = [knowledge_tool(absent, tool)]
        result = await llm.execute_function_call(
            llm.FunctionToolCall(
                name="knowledge_search",
                arguments=orjson.dumps({"query": "x" * size}).decode(),
                call_id="call_10",
            ),
            llm.ToolContext(tools),
            call_ctx=run_context(AgentSession(), "knowledge_search", "call_10"),
        )
    out = result.fnc_call_out
    assert out is not None
    assert out.is_error
    error = orjson.loads(out.output)["error"]
    assert error["type"] == "invalid_arguments"
    assert f"the limit is {MAX_ARGUMENTS_BYTES}" in error["message"]
