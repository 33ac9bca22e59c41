"""An OpenAI Realtime session whose knowledge function calls are answered by voxrecall.

Run the sidecar first (README: "Run the example"), then:

    pip install -e '.[realtime-example]'
    OPENAI_API_KEY=... python examples/openai_realtime_agent.py "How much does roaming cost?"

It asks its question as text (a voice app streams audio instead: the events are the same),
lets the model call ``knowledge_search``, and prints the answer. The sidecar is at
VOXRECALL_TARGET (default 127.0.0.1:50051); VOXRECALL_TOKEN, VOXRECALL_TLS_CA, VOXRECALL_TLS_CERT
and VOXRECALL_TLS_KEY reach one with ``[sidecar.auth]`` and TLS.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys

try:  # what the realtime-example extra installs; without it, one line says so
    import websockets
    from websockets.asyncio.client import ClientConnection
    from websockets.exceptions import InvalidHandshake
except ModuleNotFoundError as exc:
    print(
        f"error: {exc.name} is not installed: this example needs its extra, "
        "pip install -e '.[realtime-example]'",
        file=sys.stderr,
    )
    raise SystemExit(2) from None

from index.errors import ConfigError
from sidecar.adapters.client import Voxrecall
from sidecar.adapters.openai_realtime import RealtimeToolBridge
from sidecar.connection import Connection

URL = "wss://api.openai.com/v1/realtime?model=gpt-realtime"
# How long the Realtime API's connection may take to open (websockets' own default, named).
OPEN_TIMEOUT_S = 10
INSTRUCTIONS = (
    "You are Northwind Mobile's phone assistant. Before answering a question about the "
    "caller's phone service, call knowledge_search; answer in one or two sentences."
)


class Unreachable(Exception):
    """The Realtime API could not be reached or refused the connection: one line, no traceback."""


async def connect(api_key: str) -> ClientConnection:
    """The Realtime API's websocket, or ``Unreachable`` saying why (offline, a proxy needed, a
    key refused)."""
    headers = {"Authorization": f"Bearer {api_key}"}
    try:
        return await websockets.connect(
            URL, additional_headers=headers, open_timeout=OPEN_TIMEOUT_S
        )
    except (OSError, TimeoutError, InvalidHandshake) as exc:
        raise Unreachable(f"cannot reach {URL}: {exc or type(exc).__name__}") from None


async def main(question: str, api_key: str, connection: Connection) -> None:
    async with Voxrecall(connection) as voxrecall, await connect(api_key) as ws:
        bridge = await RealtimeToolBridge.create(voxrecall, session_id="realtime-demo")
        update = bridge.session_update(instructions=INSTRUCTIONS, output_modalities=["text"])
        await ws.send(json.dumps(update))
        await ws.send(json.dumps({
            "type": "conversation.item.create",
            "item": {"type": "message", "role": "user", "content": [{"type": "input_text", "text": question}]},
        }))  # fmt: skip
        await ws.send(json.dumps({"type": "response.create"}))
        async for message in ws:
            event = json.loads(message)
            for reply in await bridge.handle(event):  # the knowledge function's answer
                await ws.send(json.dumps(reply))
            if event["type"] == "response.output_text.done":
                print(event["text"])
                return
            if event["type"] == "error":
                sys.exit(event["error"]["message"])


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("question", nargs="*", help="what to ask (default: about roaming)")
    args = parser.parse_args()
    api_key = os.environ.get("OPENAI_API_KEY", "")
    if not api_key:
        print("error: set OPENAI_API_KEY to an OpenAI API key (the Realtime API needs one)",
              file=sys.stderr)  # fmt: skip
        sys.exit(2)
    try:
        connection = Connection.from_env(os.environ)
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        sys.exit(2)
    question = " ".join(args.question) or "How much does roaming cost in Europe?"
    try:
        asyncio.run(main(question, api_key, connection))
    except Unreachable as exc:
        print(f"error: {exc}", file=sys.stderr)
        sys.exit(1)
