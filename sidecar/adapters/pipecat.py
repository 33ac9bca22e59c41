"""Pipecat: retrieval on every user turn, and knowledge functions for the LLM.

Put ``VoxrecallRetrieval`` between the STT service and the user context aggregator::

    vr = Voxrecall("127.0.0.1:50051")
    retrieval = VoxrecallRetrieval(vr, session_id=call_id)
    pipeline = Pipeline([transport.input(), stt, retrieval, context_aggregator.user(), llm,
                         tts, transport.output(), context_aggregator.assistant()])

Interim transcriptions go ahead on the call's ``Converse`` stream (the sidecar prefetches); each
final ``TranscriptionFrame`` waits for its answer, whose chunks replace the knowledge message in
the LLM context (one message, for that turn) before the transcription reaches the aggregator.
``register_knowledge_functions`` serves the configured functions (``knowledge_search``) to an
LLM service through ``InvokeTool``. Requires ``pip install 'voxrecall[pipecat]'``.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

import grpc
import orjson
from pipecat.adapters.llm.schemas.function_schema import FunctionSchema
from pipecat.adapters.llm.schemas.tools_schema import ToolsSchema
from pipecat.frames.frames import (
    CancelFrame,
    EndFrame,
    Frame,
    InterimTranscriptionFrame,
    LLMMessagesTransformFrame,
    TranscriptionFrame,
)
from pipecat.processors.frame_processor import FrameDirection, FrameProcessor
from pipecat.services.llm_service import FunctionCallParams, LLMService

from sidecar.adapters.client import Voxrecall, call_tool, is_knowledge, knowledge_text
from sidecar.gen import retrieval_pb2 as pb

log = logging.getLogger("voxrecall.adapters.pipecat")

Messages = list[Any]  # pipecat's LLMContextMessage: OpenAI-style dicts and provider-specific ones


def replace_knowledge(messages: Messages, text: str, role: str = "system") -> Messages:
    """The messages without any earlier knowledge message, then ``text`` as one (if any)."""
    kept = [m for m in messages if not (isinstance(m, dict) and is_knowledge(m.get("content")))]
    if text:
        kept.append({"role": role, "content": text})
    return kept


class VoxrecallRetrieval(FrameProcessor):
    """On each final user transcription, a ``Turn``; its chunks go into the LLM context.

    A skipped turn ("yeah", "thanks") leaves the context as it was. When the sidecar does not
    answer in time, the transcription goes on without knowledge and a non-fatal error frame
    goes upstream: the call never stalls on retrieval.
    """

    def __init__(
        self,
        client: Voxrecall,
        session_id: str,
        *,
        sources: Sequence[str] = (),
        prefetch: bool = True,
        role: str = "system",
        **kwargs: Any,
    ) -> None:
        super().__init__(**kwargs)
        self.client = client
        self.session_id = session_id
        self.prefetch = prefetch
        self.role = role
        self.stream = client.turn_stream(session_id, sources=sources)
        self.last: pb.TurnResponse | None = None  # the last final's answer, for logs and tests
        self.prefetched_turns = 0

    async def process_frame(self, frame: Frame, direction: FrameDirection) -> None:
        await super().process_frame(frame, direction)
        if direction is FrameDirection.DOWNSTREAM:
            if isinstance(frame, InterimTranscriptionFrame) and self.prefetch:
                await self.stream.interim(frame.text)
            elif isinstance(frame, TranscriptionFrame):
                await self._answer(frame.text)
            elif isinstance(frame, (EndFrame, CancelFrame)):
                await self.stream.aclose()
        await self.push_frame(frame, direction)

    async def _answer(self, text: str) -> None:
        try:
            resp, prefetched = await self.stream.final(text)
        except (grpc.aio.AioRpcError, TimeoutError) as exc:
            await self.push_error(f"voxrecall: no knowledge for this turn: {exc}", exception=exc)
            return
        self.last = resp
        self.prefetched_turns += prefetched
        if resp.skipped != pb.NOT_SKIPPED:
            return
        knowledge = knowledge_text(resp.chunks)
        await self.push_frame(
            LLMMessagesTransformFrame(
                transform=lambda messages: replace_knowledge(messages, knowledge, self.role),
                run_llm=False,
            )
        )


def tools_schema(tools: Sequence[pb.Tool]) -> ToolsSchema:
    """Pipecat's tools for the configured knowledge functions (from ``Voxrecall.list_tools``)."""
    schemas = []
    for tool in tools:
        params = orjson.loads(tool.realtime_json)["parameters"]
        schemas.append(
            FunctionSchema(
                name=tool.name,
                description=tool.description,
                properties=params["properties"],
                required=params["required"],
            )
        )
    return ToolsSchema(standard_tools=schemas)


def knowledge_function(
    client: Voxrecall, session_id: str = ""
) -> Callable[[FunctionCallParams], Awaitable[None]]:
    """A function handler serving a knowledge function's calls through ``InvokeTool``.

    Pipecat hands over the arguments already parsed; they go back to JSON for the sidecar
    (``call_tool``: too large, they are refused unsent). The result is the sidecar's output
    (results, or an error the model can recover from).
    """

    async def handler(params: FunctionCallParams) -> None:
        out = await call_tool(
            client,
            params.function_name,
            json.dumps(dict(params.arguments)),
            session_id=session_id,
            call_id=params.tool_call_id,
        )
        await params.result_callback(orjson.loads(out.output))

    return handler


async def register_knowledge_functions(
    llm: LLMService[Any], client: Voxrecall, session_id: str = ""
) -> ToolsSchema:
    """Register a handler for every configured knowledge function; returns their tools schema.

    Give the schema to the ``LLMContext`` (``LLMContext(messages, tools=schema)``).
    """
    tools = await client.list_tools()
    handler = knowledge_function(client, session_id)
    for tool in tools:
        llm.register_function(tool.name, handler)
    return tools_schema(tools)
