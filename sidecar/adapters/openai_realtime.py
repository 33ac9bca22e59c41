"""OpenAI Realtime: answer a session's knowledge function calls from its server events.

Feed every server event of a Realtime session, in order, to ``RealtimeToolBridge.handle``; send
back the client events it returns. For a ``function_call`` of a knowledge function (seen in
``response.function_call_arguments.done`` or ``response.output_item.done``, answered once) it
returns a ``conversation.item.create`` holding the ``function_call_output``; at that response's
``response.done`` it returns the ``response.create`` that lets the model speak the answer (sent
earlier, it would collide with the response still in progress). Other events, and calls of
functions that are not voxrecall's (the app's own tools), return nothing; the first call of each
such name is logged at INFO (``voxrecall.adapters.openai_realtime``), so a knowledge function
misnamed in the session's tools is seen rather than silently unanswered. Each call runs through
``sidecar.adapters.client.call_tool``: arguments over the sidecar's limit are answered with its
own refusal, never sent, and a refused call is an error output the model can act on. Needs no
extra: only the core client.

    bridge = await RealtimeToolBridge.create(Voxrecall(), session_id=call_id)
    await ws.send(json.dumps(bridge.session_update()))
    async for message in ws:
        for event in await bridge.handle(json.loads(message)):
            await ws.send(json.dumps(event))
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from typing import Any

import orjson

from sidecar.adapters.client import Voxrecall, call_tool
from sidecar.gen import retrieval_pb2 as pb

log = logging.getLogger("voxrecall.adapters.openai_realtime")

CALLS_REMEMBERED = 256  # call ids answered, so the second event of the same call is ignored
# Responses with an answered call awaiting their response.done (one a turn): the oldest are
# forgotten past this many, so a server that never sends response.done cannot grow them.
RESPONSES_AWAITED = 256
# Names of other tools already logged (once each): an app has a few tools, but a model can call
# any name, so past this many the rest go unlogged rather than growing the set.
OTHER_NAMES_LOGGED = 64


class RealtimeToolBridge:
    """Turns a Realtime session's knowledge function calls into the client events answering them."""

    def __init__(
        self, client: Voxrecall, tools: Sequence[pb.Tool], *, session_id: str = ""
    ) -> None:
        self.client = client
        self.tools = list(tools)
        self.session_id = session_id
        self._names = {t.name for t in tools}
        self._answered: OrderedDict[str, None] = OrderedDict()
        self._responses: OrderedDict[str, None] = OrderedDict()  # awaiting their response.done
        self._others: set[str] = set()  # other tools' names already logged

    @classmethod
    async def create(cls, client: Voxrecall, *, session_id: str = "") -> RealtimeToolBridge:
        """A bridge for every knowledge function the sidecar has configured."""
        return cls(client, await client.list_tools(), session_id=session_id)

    def session_update(self, **session: Any) -> dict[str, Any]:
        """The ``session.update`` that offers the knowledge functions (merge in your own keys)."""
        tools = [orjson.loads(t.realtime_json) for t in self.tools]
        return {
            "type": "session.update",
            "session": {"type": "realtime", "tools": tools, "tool_choice": "auto", **session},
        }

    async def handle(self, event: Mapping[str, Any]) -> list[dict[str, Any]]:
        """The client events to send back for one server event (usually none; a malformed one,
        a field of another type than the API's, is passed over as one of no interest)."""
        if not isinstance(event, Mapping):
            return []
        kind = event.get("type")
        if kind == "response.done":
            response_id = _text(_object(event.get("response")), "id")
            if response_id not in self._responses:
                return []
            del self._responses[response_id]
            return [{"type": "response.create"}]
        call = _function_call(event)
        if call is None:
            return []
        name, call_id, arguments = call
        if name not in self._names:
            self._log_other(name)
            return []
        if not call_id or call_id in self._answered:
            return []
        _remember(self._answered, call_id, CALLS_REMEMBERED)
        output = await self._invoke(name, arguments, call_id)
        response_id = _text(event, "response_id")
        if response_id:  # (an output item's done event names none: its response.done is seen)
            _remember(self._responses, response_id, RESPONSES_AWAITED)
        return [
            {
                "type": "conversation.item.create",
                "item": {"type": "function_call_output", "call_id": call_id, "output": output},
            }
        ]

    def _log_other(self, name: str) -> None:
        """Say once per name that a call of a tool not voxrecall's is left to the app."""
        if name in self._others or len(self._others) >= OTHER_NAMES_LOGGED:
            return
        self._others.add(name)
        log.info(
            "function %r is not a knowledge function (%s): left to the app to answer",
            name,
            ", ".join(sorted(self._names)) or "none",
        )

    async def _invoke(self, name: str, arguments: str, call_id: str) -> str:
        out = await call_tool(
            self.client, name, arguments, session_id=self.session_id, call_id=call_id
        )
        return out.output


def _function_call(event: Mapping[str, Any]) -> tuple[str, str, str] | None:
    """(name, call_id, arguments) of a finished function call event, else None. A name or call
    id that is not a string is none (the call is not answered: its id could not be echoed);
    arguments that are not a string are sent as written, for the sidecar to refuse as JSON."""
    kind = event.get("type")
    item = _object(event.get("item"))
    if kind == "response.function_call_arguments.done":
        source: Mapping[str, Any] = event
    elif kind == "response.output_item.done" and item.get("type") == "function_call":
        source = item
    else:
        return None
    arguments = source.get("arguments", "")
    return (
        _text(source, "name"),
        _text(source, "call_id"),
        arguments if isinstance(arguments, str) else str(arguments),
    )


def _object(value: Any) -> Mapping[str, Any]:
    """``value`` when it is a JSON object, else an empty one."""
    return value if isinstance(value, Mapping) else {}


def _text(source: Mapping[str, Any], key: str) -> str:
    """``source[key]`` when it is a string, else ""."""
    value = source.get(key)
    return value if isinstance(value, str) else ""


def _remember(seen: OrderedDict[str, None], key: str, limit: int) -> None:
    """``key`` kept among the newest ``limit`` of ``seen``."""
    seen[key] = None
    seen.move_to_end(key)
    while len(seen) > limit:
        seen.popitem(last=False)
