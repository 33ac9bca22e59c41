"""A LiveKit Agents voice agent that answers from the example knowledge base through voxrecall.

Run the sidecar first (README: "Run the example"), then, with a LiveKit server and OpenAI key:

    pip install -e '.[livekit-example]'
    LIVEKIT_URL=... LIVEKIT_API_KEY=... LIVEKIT_API_SECRET=... OPENAI_API_KEY=... \
        python examples/livekit_agent.py dev

The sidecar is at VOXRECALL_TARGET (default 127.0.0.1:50051); VOXRECALL_TOKEN, VOXRECALL_TLS_CA,
VOXRECALL_TLS_CERT and VOXRECALL_TLS_KEY reach one with ``[sidecar.auth]`` and TLS.

Interim transcripts are searched ahead into the agent's chat context, so preemptive generation
starts with the knowledge already there; ``on_user_turn_completed`` checks it against the final
turn and only then (when it differs) changes the context. The LLM may also call
``knowledge_search`` (the example config's ``[[function]]``) on its own.
"""

from __future__ import annotations

import os
import sys

from sidecar.adapters.client import Voxrecall
from sidecar.connection import Connection

# The commands that connect to a LiveKit server, and each variable's flag. LiveKit's CLI reads
# the variables itself, but without one it prints a traceback and exits 0: checked here first,
# so one line says what to set (before the extra is imported: it is not needed to say so).
SERVER_COMMANDS = {"dev", "start", "connect"}
SETTINGS = {
    "LIVEKIT_URL": "--url",
    "LIVEKIT_API_KEY": "--api-key",
    "LIVEKIT_API_SECRET": "--api-secret",
}


def unset_settings(argv: list[str]) -> list[str]:
    """The LiveKit variables a server command needs that neither the environment nor a flag gives."""
    if len(argv) > 1 and argv[1] in SERVER_COMMANDS and not {"-h", "--help"} & set(argv):
        given = {arg.split("=", 1)[0] for arg in argv[2:]}
        return [
            name
            for name, flag in SETTINGS.items()
            if not os.environ.get(name) and flag not in given
        ]
    return []


if __name__ == "__main__" and (unset := unset_settings(sys.argv)):
    print(f"error: set {', '.join(unset)} to your LiveKit server's URL, API key and secret "
          "(or pass --url, --api-key, --api-secret)", file=sys.stderr)  # fmt: skip
    raise SystemExit(2)

try:  # what the livekit-example extra installs; without it, one line says so
    from livekit.agents import (
        Agent,
        AgentServer,
        AgentSession,
        ChatContext,
        ChatMessage,
        JobContext,
        cli,
        llm,
    )
    from livekit.plugins import openai, silero

    from sidecar.adapters.livekit import LiveKitKnowledge, knowledge_tools
except ModuleNotFoundError as exc:
    print(
        f"error: {exc.name} is not installed: this example needs its extra, "
        "pip install -e '.[livekit-example]'",
        file=sys.stderr,
    )
    raise SystemExit(2) from None

INSTRUCTIONS = (
    "You are Northwind Mobile's phone assistant. Answer in one or two short spoken sentences, "
    "only from the knowledge you are given or that knowledge_search returns."
)

server = AgentServer()


class Assistant(Agent):
    def __init__(self, knowledge: LiveKitKnowledge, tools: list[llm.Tool | llm.Toolset]) -> None:
        super().__init__(instructions=INSTRUCTIONS, tools=tools)
        self.knowledge = knowledge

    async def on_user_turn_completed(self, turn_ctx: ChatContext, new_message: ChatMessage) -> None:
        await self.knowledge.on_user_turn_completed(turn_ctx, new_message)


@server.rtc_session()
async def entrypoint(ctx: JobContext) -> None:
    voxrecall = Voxrecall(Connection.from_env(os.environ))
    session_id = ctx.room.name  # one voxrecall session per room
    knowledge = LiveKitKnowledge(voxrecall, session_id=session_id)
    agent = Assistant(knowledge, [*await knowledge_tools(voxrecall, session_id=session_id)])
    session: AgentSession[None] = AgentSession(
        vad=silero.VAD.load(),
        stt=openai.STT(),
        llm=openai.LLM(model="gpt-4.1-mini"),
        tts=openai.TTS(),
        preemptive_generation=True,
    )
    knowledge.attach(session, agent)
    ctx.add_shutdown_callback(voxrecall.close)
    await session.start(agent=agent, room=ctx.room)


if __name__ == "__main__":
    cli.run_app(server)
