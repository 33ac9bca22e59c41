"""The Pipecat adapter in Pipecat's own offline harness (``run_test``) against a real sidecar."""

from __future__ import annotations

import asyncio
import logging
import warnings
from collections.abc import AsyncIterator
from typing import Any

import pytest

with warnings.catch_warnings():
    # pipecat.audio imports audioop (deprecated in 3.11); pytest turns warnings into errors.
    warnings.filterwarnings("ignore", "'audioop' is deprecated", DeprecationWarning)
    pytest.importorskip("pipecat")
    from pipecat.frames.frames import (
        EndFrame,
        ErrorFrame,
        Frame,
        FunctionCallFromLLM,
        FunctionCallInProgressFrame,
        FunctionCallResultFrame,
        FunctionCallsStartedFrame,
        InterimTranscriptionFrame,
        LLMContextFrame,
        LLMMessagesTransformFrame,
        TranscriptionFrame,
    )
    from pipecat.pipeline.pipeline import Pipeline
    from pipecat.processors.aggregators.llm_context import LLMContext
    from pipecat.processors.aggregators.llm_response_universal import LLMContextAggregatorPair
    from pipecat.processors.frame_processor import FrameDirection
    from pipecat.services.llm_service import LLMService
    from pipecat.services.settings import LLMSettings
    from pipecat.tests.utils import SleepFrame, run_test

    from sidecar.adapters.client import KNOWLEDGE_HEADER, Voxrecall
    from sidecar.adapters.pipecat import (
        VoxrecallRetrieval,
        knowledge_function,
        register_knowledge_functions,
        replace_knowledge,
    )
    from sidecar.edge.limits import MAX_ARGUMENTS_BYTES
    from tests.adapters import (  # noqa: F401
        PASSWORD,
        ROAMING,
        VOICEMAIL,
        knowledge_sidecar_fixture,
    )


def said(text: str) -> TranscriptionFrame:
    return TranscriptionFrame(text=text, user_id="caller", timestamp="2026-01-01T00:00:00Z")


def saying(text: str) -> InterimTranscriptionFrame:
    return InterimTranscriptionFrame(text=text, user_id="caller", timestamp="2026-01-01T00:00:00Z")


@pytest.fixture
async def vr(knowledge_sidecar: Any) -> AsyncIterator[Voxrecall]:
    async with Voxrecall(f"127.0.0.1:{knowledge_sidecar.port}", turn_timeout_s=10) as client:
        yield client


def knowledge_messages(context: LLMContext) -> list[str]:
    return [
        m["content"]
        for m in context.get_messages()
        if isinstance(m, dict) and str(m.get("content", "")).startswith(KNOWLEDGE_HEADER)
    ]


async def test_final_transcription_puts_its_chunks_into_the_context(vr: Voxrecall) -> None:
    retrieval = VoxrecallRetrieval(vr, session_id="pipecat-1")
    down, _ = await run_test(
        retrieval,
        frames_to_send=[
            saying("How much does"),
            saying("How much does roaming cost"),
            said(ROAMING),
            said("yeah"),
        ],
        expected_down_frames=[
            InterimTranscriptionFrame,
            InterimTranscriptionFrame,
            LLMMessagesTransformFrame,  # lands before the transcription it answers
            TranscriptionFrame,
            TranscriptionFrame,  # a backchannel: searched nothing, context left alone
        ],
    )
    assert retrieval.last is not None
    assert retrieval.last.skipped != 0  # the last turn, "yeah", was skipped
    assert retrieval.stream.streaming  # answered over the call's Converse stream

    context = LLMContext([{"role": "system", "content": "You are a helpful agent."}])
    transform = next(f for f in down if isinstance(f, LLMMessagesTransformFrame))
    context.transform_messages(transform.transform)
    (knowledge,) = knowledge_messages(context)
    assert "(help-center:roaming.md)" in knowledge
    assert context.get_messages()[0]["content"] == "You are a helpful agent."


async def test_the_knowledge_reaches_the_llm_context_through_the_real_aggregator(
    vr: Voxrecall,
) -> None:
    context = LLMContext([{"role": "system", "content": "You are a helpful agent."}])
    user = LLMContextAggregatorPair(context).user()
    pipeline = Pipeline([VoxrecallRetrieval(vr, session_id="pipecat-2"), user])
    first, second = PASSWORD, VOICEMAIL
    # The aggregator interrupts on each new user turn, which drops frames still queued: the
    # pause lets the first turn finish, as a caller's pause would.
    await run_test(pipeline, frames_to_send=[said(first), SleepFrame(1.0), said(second)])

    messages = [(m["role"], m["content"]) for m in context.messages]
    (knowledge,) = knowledge_messages(context)  # one message: the last turn's, not both
    assert messages == [
        ("system", "You are a helpful agent."),
        ("user", first),
        ("system", knowledge),
        ("user", second),
    ]
    assert "(help-center:voicemail.md)" in knowledge
    assert "reset-password.md" not in knowledge


def test_replace_knowledge_keeps_everything_else() -> None:
    history: list[Any] = [
        {"role": "system", "content": "rules"},
        {"role": "user", "content": "hi"},
        {"role": "system", "content": KNOWLEDGE_HEADER + "\n\n[1] old"},
        {"role": "assistant", "content": "hello"},
    ]
    new = replace_knowledge(history, KNOWLEDGE_HEADER + "\n\n[1] new")
    assert [m["content"] for m in new] == ["rules", "hi", "hello", KNOWLEDGE_HEADER + "\n\n[1] new"]
    assert replace_knowledge(new, "") == history[:2] + history[3:]


async def test_an_absent_sidecar_costs_the_turn_its_knowledge_not_the_call() -> None:
    async with Voxrecall("127.0.0.1:9", turn_timeout_s=0.5) as absent:  # nothing listens on 9
        _, up = await run_test(
            VoxrecallRetrieval(absent, session_id="pipecat-3"),
            frames_to_send=[said(ROAMING)],
            expected_down_frames=[TranscriptionFrame],
        )
    assert any(isinstance(f, ErrorFrame) and not f.fatal for f in up)


class ScriptedLLM(LLMService):  # type: ignore[misc]
    """An LLM service whose model always calls one function: Pipecat's real function-call path.

    It holds the EndFrame until the call's result went out, so the run ends after the call.
    """

    def __init__(self, call: FunctionCallFromLLM) -> None:
        unsupported = dict.fromkeys(
            "model system_instruction temperature max_tokens top_p top_k frequency_penalty "
            "presence_penalty seed filter_incomplete_user_turns user_turn_completion_config".split()
        )
        super().__init__(settings=LLMSettings(**unsupported))
        self.call = call
        self.answered = asyncio.Event()

    async def process_frame(self, frame: Frame, direction: FrameDirection) -> None:
        await super().process_frame(frame, direction)
        if isinstance(frame, LLMContextFrame):
            await self.run_function_calls([self.call])
            return
        if isinstance(frame, EndFrame):
            await asyncio.wait_for(self.answered.wait(), timeout=10)
        await self.push_frame(frame, direction)

    async def push_frame(
        self, frame: Frame, direction: FrameDirection = FrameDirection.DOWNSTREAM
    ) -> None:
        await super().push_frame(frame, direction)
        if isinstance(frame, FunctionCallResultFrame):
            self.answered.set()


@pytest.mark.parametrize(
    ("arguments", "expect"),
    [
        ({"query": ROAMING}, "results"),
        ({"query": ""}, "error"),
    ],
)
async def test_knowledge_search_calls_are_served_through_invoke_tool(
    vr: Voxrecall, arguments: dict[str, Any], expect: str
) -> None:
    context = LLMContext()
    llm = ScriptedLLM(FunctionCallFromLLM("knowledge_search", "call_1", arguments, context))
    tools = await register_knowledge_functions(llm, vr, session_id="pipecat-4")
    assert [t.name for t in tools.standard_tools] == ["knowledge_search"]
    down, _ = await run_test(llm, frames_to_send=[LLMContextFrame(context)])
    (result,) = [f for f in down if isinstance(f, FunctionCallResultFrame)]
    assert result.tool_call_id == "call_1"
    assert expect in result.result
    if expect == "results":
        assert "roaming.md" in [r["path"] for r in result.result["results"]]
    assert any(isinstance(f, FunctionCallsStartedFrame) for f in down)
    assert any(isinstance(f, FunctionCallInProgressFrame) for f in down)


@pytest.mark.parametrize("size", [100 * 1024, 5 * 1024 * 1024], ids=["100KiB", "5MiB"])
async def test_over_large_arguments_are_refused_unsent_as_the_sidecar_would(size: int) -> None:
    """Arguments over MAX_ARGUMENTS_BYTES get the sidecar's own refusal, with the limit in
    bytes, and are never sent: the client here reaches no sidecar, yet the model is told to
    shorten them, not that the knowledge base is down."""
    context = LLMContext()
    arguments = {"query": "x" * size}
    llm = ScriptedLLM(FunctionCallFromLLM("knowledge_search", "call_2", arguments, context))
    async with Voxrecall("127.0.0.1:9", tool_timeout_s=0.5) as absent:  # nothing listens on 9
        llm.register_function("knowledge_search", knowledge_function(absent))
        down, _ = await run_test(llm, frames_to_send=[LLMContextFrame(context)])
    (result,) = [f for f in down if isinstance(f, FunctionCallResultFrame)]
    assert result.result["error"]["type"] == "invalid_arguments"
    assert f"the limit is {MAX_ARGUMENTS_BYTES}" in result.result["error"]["message"]


async def test_an_interruption_mid_turn_leaves_the_converse_stream_open(
    vr: Voxrecall, caplog: pytest.LogCaptureFixture
) -> None:
    """The aggregator starts a user turn on the interim and interrupts upstream while the final
    waits for its answer: Pipecat cancels that frame (the first turn is its to drop), and the
    call's Converse stream must outlive it. It was cancelled with the frame (grpc.aio cancels an
    RPC whose read is cancelled), so the next final logged "Converse stream broke" and went
    through Turn."""
    caplog.set_level(logging.WARNING, logger="voxrecall.adapters")
    context = LLMContext([{"role": "system", "content": "You are a helpful agent."}])
    user = LLMContextAggregatorPair(context).user()
    pipeline = Pipeline([VoxrecallRetrieval(vr, session_id="pipecat-5"), user])
    frames = [saying("How much does roaming"), said(ROAMING), SleepFrame(1.0), said(VOICEMAIL)]
    await run_test(pipeline, frames_to_send=frames)

    assert [r.getMessage() for r in caplog.records] == []
    (knowledge,) = knowledge_messages(context)
    assert "(help-center:voicemail.md)" in knowledge
    assert context.messages[-1] == {"role": "user", "content": VOICEMAIL}
