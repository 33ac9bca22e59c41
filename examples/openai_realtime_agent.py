"""An OpenAI Realtime session whose knowledge function calls are answered by voxrecall.

Run the sidecar first (README: "Run the example"), then:

    pip install -e . websockets
    OPENAI_API_KEY=... python examples/openai_realtime_agent.py "How much does roaming cost?"

It asks its question as text (a voice app streams audio instead: the events are the same),
lets the model call ``knowledge_search``, and prints the answer.
"""

from __future__ import annotations

import asyncio
import json
import os
import sys

import websockets

from sidecar.adapters.client import Voxrecall
from sidecar.adapters.openai_realtime import RealtimeToolBridge

URL = "wss://api.openai.com/v1/realtime?model=gpt-realtime"
INSTRUCTIONS = (
    "You are Northwind Mobile's phone assistant. Before answering a question about the "
    "caller's phone service, call knowledge_search; answer in one or two sentences."
)


async def main(question: str) -> None:
    headers = {"Authorization": f"Bearer {os.environ['OPENAI_API_KEY']}"}
    async with (
        Voxrecall("127.0.0.1:50051") as voxrecall,
        websockets.connect(URL, additional_headers=headers) as ws,
    ):
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
    asyncio.run(main(" ".join(sys.argv[1:]) or "How much does roaming cost in Europe?"))
