"""LiveKit Agents: knowledge in ``on_user_turn_completed``, ready before the turn completes.

LiveKit's preemptive generation starts the LLM on the final transcript with a copy of the
agent's chat context, and throws that generation away when ``on_user_turn_completed`` changes
the context. So the knowledge has to be in the context *before* the turn completes:

1. ``attach(session, agent)`` listens to ``user_input_transcribed``. Each interim transcript
   is searched ahead (``Search``, outside the session) and the result is written into the
   agent's chat context as one message with a fixed id, replacing the previous one.
2. The preemptive generation copies that context, knowledge included.
3. ``on_user_turn_completed`` sends the final transcript as a ``Turn`` (follow-ups, skips, the
   session). When its chunks are the ones already in the context, it changes nothing and the
   preemptive generation is kept; otherwise it writes the right ones into ``turn_ctx``, and
   LiveKit regenerates: never a reply from stale knowledge.

``knowledge_tools`` makes a ``function_tool`` of each configured knowledge function, served
through ``InvokeTool``. Requires ``pip install 'voxrecall[livekit]'``.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Sequence
from typing import Any

import grpc
import orjson
from livekit.agents import Agent, AgentSession, ChatContext, ChatMessage, RunContext, ToolError
from livekit.agents.llm import ChatRole, RawFunctionTool, function_tool
from livekit.agents.voice.events import UserInputTranscribedEvent

from sidecar.adapters.client import Voxrecall, call_tool, knowledge_text
from sidecar.gen import retrieval_pb2 as pb

log = logging.getLogger("voxrecall.adapters.livekit")

KNOWLEDGE_ID = "voxrecall_knowledge"  # the id of the one knowledge message in a chat context


def put_knowledge(ctx: ChatContext, text: str, role: ChatRole = "system") -> bool:
    """Make ``text`` the context's knowledge message (none when empty); whether it changed."""
    index = ctx.index_by_id(KNOWLEDGE_ID)
    current = ctx.items[index] if index is not None else None
    if isinstance(current, ChatMessage) and current.text_content == text:
        return False
    if current is None and not text:
        return False
    if index is not None:
        del ctx.items[index]
    if text:
        ctx.add_message(role=role, content=text, id=KNOWLEDGE_ID)
    return True


class LiveKitKnowledge:
    """Retrieval for one LiveKit ``AgentSession``: prefetch on interims, a ``Turn`` per turn.

    Usage::

        class Assistant(Agent):
            def __init__(self, knowledge: LiveKitKnowledge) -> None:
                super().__init__(instructions="...")
                self.knowledge = knowledge

            async def on_user_turn_completed(self, turn_ctx, new_message) -> None:
                await self.knowledge.on_user_turn_completed(turn_ctx, new_message)

        knowledge = LiveKitKnowledge(Voxrecall(), session_id=ctx.room.name)
        agent = Assistant(knowledge)
        knowledge.attach(session, agent)
        await session.start(agent=agent, room=ctx.room)
    """

    def __init__(
        self,
        client: Voxrecall,
        session_id: str,
        *,
        sources: Sequence[str] = (),
        role: ChatRole = "system",
    ) -> None:
        self.client = client
        self.session_id = session_id
        self.sources = tuple(sources)
        self.role: ChatRole = role
        self.last: pb.TurnResponse | None = None
        self.kept_prefetch = 0  # turns whose prefetched knowledge was already right
        self._agent: Agent | None = None
        self._prefetch: asyncio.Task[None] | None = None

    def attach(self, session: AgentSession[Any], agent: Agent) -> None:
        """Search each interim transcript of ``session`` ahead, into ``agent``'s chat context."""
        self._agent = agent
        session.on("user_input_transcribed", self._on_transcribed)

    def _on_transcribed(self, event: UserInputTranscribedEvent) -> None:
        if event.is_final or not event.transcript.strip() or self._agent is None:
            return
        if self._prefetch is not None:
            self._prefetch.cancel()  # a newer interim supersedes it
        self._prefetch = asyncio.create_task(self.prefetch(self._agent, event.transcript))

    async def prefetched(self) -> None:
        """Wait for the prefetch in flight, if any (tests, and agents that want to)."""
        if self._prefetch is not None:
            await asyncio.gather(self._prefetch, return_exceptions=True)

    async def prefetch(self, agent: Agent, text: str) -> None:
        """Search ``text`` and write the result into ``agent``'s chat context."""
        try:
            resp = await self.client.search(text, sources=self.sources)
        except (grpc.aio.AioRpcError, TimeoutError) as exc:
            log.warning("prefetch failed: %s", exc)
            return
        ctx = agent.chat_ctx.copy()
        if put_knowledge(ctx, knowledge_text(resp.chunks), self.role):
            await agent.update_chat_ctx(ctx)

    async def on_user_turn_completed(self, turn_ctx: ChatContext, new_message: ChatMessage) -> None:
        """Call from ``Agent.on_user_turn_completed``: this turn's knowledge into ``turn_ctx``.

        Leaves ``turn_ctx`` untouched when the prefetched knowledge is already right (LiveKit
        keeps its preemptive generation), or when the turn searched nothing (a backchannel).
        """
        text = new_message.text_content or ""
        try:
            resp = await self.client.turn(self.session_id, text, sources=self.sources)
        except (grpc.aio.AioRpcError, TimeoutError) as exc:
            log.warning("no knowledge for this turn: %s", exc)
            return
        self.last = resp
        if resp.skipped != pb.NOT_SKIPPED:
            return
        if put_knowledge(turn_ctx, knowledge_text(resp.chunks), self.role):
            log.debug("knowledge changed at the end of the turn: preemptive generation dropped")
        else:
            self.kept_prefetch += 1


def knowledge_tool(
    client: Voxrecall, tool: pb.Tool, *, session_id: str = ""
) -> RawFunctionTool[..., Any]:
    """A LiveKit ``function_tool`` for one knowledge function, served through ``InvokeTool``.

    Its schema is the sidecar's own; an error output (bad arguments, say, or too large to send:
    ``call_tool``) is raised as ``ToolError``, which LiveKit hands the model as an error it can
    recover from.
    """
    definition = orjson.loads(tool.realtime_json)

    async def call(raw_arguments: dict[str, object], context: RunContext[Any]) -> str:
        out = await call_tool(
            client,
            tool.name,
            json.dumps(raw_arguments),
            session_id=session_id,
            call_id=context.function_call.call_id,
        )
        if out.is_error:
            raise ToolError(out.output)
        return out.output

    return function_tool(
        call,
        raw_schema={
            "name": definition["name"],
            "description": definition["description"],
            "parameters": definition["parameters"],
        },
    )


async def knowledge_tools(
    client: Voxrecall, *, session_id: str = ""
) -> list[RawFunctionTool[..., Any]]:
    """A ``function_tool`` for every configured knowledge function (``Agent(tools=...)``)."""
    return [
        knowledge_tool(client, tool, session_id=session_id) for tool in await client.list_tools()
    ]
