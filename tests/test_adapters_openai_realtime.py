"""The OpenAI Realtime bridge on a recorded-shaped event sequence, against a real sidecar.

Every server event fed in and every client event produced is validated against the ``openai``
package's own Realtime event types, so the shapes are the API's, not ours.
"""

from __future__ import annotations

import json
import logging
from collections.abc import AsyncIterator
from typing import Any

import orjson
import pydantic
import pytest
from openai.types.realtime import RealtimeClientEvent, RealtimeServerEvent

from sidecar.adapters.client import Voxrecall
from sidecar.adapters.openai_realtime import RESPONSES_AWAITED, RealtimeToolBridge
from sidecar.edge.limits import MAX_ARGUMENTS_BYTES
from sidecar.gen import retrieval_pb2 as pb
from tests.adapters import ROAMING, knowledge_sidecar_fixture  # noqa: F401

SERVER_EVENT: pydantic.TypeAdapter[Any] = pydantic.TypeAdapter(RealtimeServerEvent)
CLIENT_EVENT: pydantic.TypeAdapter[Any] = pydantic.TypeAdapter(RealtimeClientEvent)


@pytest.fixture
async def vr(knowledge_sidecar: Any) -> AsyncIterator[Voxrecall]:
    async with Voxrecall(f"127.0.0.1:{knowledge_sidecar.port}", tool_timeout_s=10) as client:
        yield client


def function_call_turn(
    response_id: str, name: str, call_id: str, arguments: str
) -> list[dict[str, Any]]:
    """The server events of one response whose only output is a function call, as sent."""
    item_id = f"item_{call_id}"
    item = {
        "id": item_id,
        "object": "realtime.item",
        "type": "function_call",
        "status": "in_progress",
        "name": name,
        "call_id": call_id,
        "arguments": "",
    }
    done_item = {**item, "status": "completed", "arguments": arguments}
    half = len(arguments) // 2
    where = {"response_id": response_id, "item_id": item_id, "output_index": 0}
    return [
        {"type": "input_audio_buffer.speech_started", "event_id": "e1", "audio_start_ms": 120, "item_id": "item_u1"},
        {"type": "input_audio_buffer.speech_stopped", "event_id": "e2", "audio_end_ms": 2300, "item_id": "item_u1"},
        {"type": "input_audio_buffer.committed", "event_id": "e3", "item_id": "item_u1", "previous_item_id": None},
        {
            "type": "response.created",
            "event_id": "e4",
            "response": {"id": response_id, "object": "realtime.response", "status": "in_progress", "output": []},
        },
        {"type": "response.output_item.added", "event_id": "e5", "response_id": response_id, "output_index": 0, "item": item},
        {"type": "response.function_call_arguments.delta", "event_id": "e6", "call_id": call_id, "delta": arguments[:half], **where},
        {"type": "response.function_call_arguments.delta", "event_id": "e7", "call_id": call_id, "delta": arguments[half:], **where},
        {
            "type": "response.function_call_arguments.done",
            "event_id": "e8",
            "call_id": call_id,
            "name": name,
            "arguments": arguments,
            **where,
        },
        {"type": "response.output_item.done", "event_id": "e9", "response_id": response_id, "output_index": 0, "item": done_item},
        {
            "type": "response.done",
            "event_id": "e10",
            "response": {"id": response_id, "object": "realtime.response", "status": "completed", "output": [done_item]},
        },
    ]  # fmt: skip


async def replay(bridge: RealtimeToolBridge, events: list[dict[str, Any]]) -> list[list[Any]]:
    """What the bridge sends back after each server event."""
    sent = []
    for event in events:
        SERVER_EVENT.validate_python(event)  # a real server event shape
        out = await bridge.handle(event)
        for client_event in out:
            parsed = CLIENT_EVENT.validate_python(client_event)
            assert set(client_event) <= set(type(parsed).model_fields)  # no key the API lacks
        sent.append(out)
    return sent


async def test_a_knowledge_call_is_answered_then_a_response_requested(vr: Voxrecall) -> None:
    bridge = await RealtimeToolBridge.create(vr, session_id="rt-1")
    events = function_call_turn(
        "resp_1", "knowledge_search", "call_1", json.dumps({"query": ROAMING})
    )
    sent = await replay(bridge, events)

    answered_at = [i for i, out in enumerate(sent) if out]
    assert [events[i]["type"] for i in answered_at] == [
        "response.function_call_arguments.done",  # answered once, not again at output_item.done
        "response.done",
    ]
    (item_create,) = sent[answered_at[0]]
    assert item_create["type"] == "conversation.item.create"
    assert item_create["item"]["type"] == "function_call_output"
    assert item_create["item"]["call_id"] == "call_1"
    output = orjson.loads(item_create["item"]["output"])
    assert "roaming.md" in [r["path"] for r in output["results"]]
    assert sent[answered_at[1]] == [{"type": "response.create"}]


async def test_only_the_second_event_of_a_call_is_enough(vr: Voxrecall) -> None:
    """A client that does not subscribe to argument events still gets its answer."""
    bridge = await RealtimeToolBridge.create(vr)
    events = function_call_turn("resp_2", "knowledge_search", "call_2", '{"query": "voicemail"}')
    events = [e for e in events if not e["type"].startswith("response.function_call_arguments")]
    sent = await replay(bridge, events)
    assert [e["type"] for out in sent for e in out] == [
        "conversation.item.create",
        "response.create",
    ]


async def test_bad_arguments_get_an_error_output_the_model_can_read(vr: Voxrecall) -> None:
    bridge = await RealtimeToolBridge.create(vr)
    sent = await replay(bridge, function_call_turn("resp_3", "knowledge_search", "call_3", '{"q":'))
    item = next(e for out in sent for e in out if e["type"] == "conversation.item.create")["item"]
    assert orjson.loads(item["output"])["error"]["type"] == "invalid_json"
    assert sent[-1] == [{"type": "response.create"}]  # the model gets to recover


@pytest.mark.parametrize(
    "event",
    [
        {"type": "response.done", "response": "resp_1"},
        {"type": "response.done", "response": {"id": ["resp_1"]}},
        {"type": "response.output_item.done", "item": ["function_call"]},
        {"type": "response.function_call_arguments.done", "name": "knowledge_search",
         "call_id": ["c"], "arguments": '{"query": "roaming"}', "response_id": "r"},
        {"type": "response.function_call_arguments.done", "name": {"n": 1}, "call_id": "c"},
        ["not", "an", "event"],
    ],
)  # fmt: skip
async def test_a_malformed_server_event_is_passed_over(vr: Voxrecall, event: Any) -> None:
    """Attack s23: a field of another type than the API's raised AttributeError or TypeError
    out of ``handle`` (the app's websocket loop ended), or a call id ["c"] was answered as
    "['c']", an id the server never sent. Each is an event of no interest now."""
    bridge = await RealtimeToolBridge.create(vr)
    assert await bridge.handle(event) == []


async def test_responses_awaiting_their_done_are_bounded(vr: Voxrecall) -> None:
    """Attack s23: a server that never sent response.done grew the responses awaited by one a
    call; and a call event naming no response made an unrelated response.done ask for one."""
    bridge = await RealtimeToolBridge.create(vr)
    arguments = '{"query": "roaming"}'
    for i in range(RESPONSES_AWAITED + 40):
        done = {"type": "response.function_call_arguments.done", "name": "knowledge_search",
                "call_id": f"c{i}", "arguments": arguments, "response_id": f"r{i}"}  # fmt: skip
        assert len(await bridge.handle(done)) == 1
    assert await bridge.handle({"type": "response.done", "response": {"id": "r0"}}) == []
    last = f"r{RESPONSES_AWAITED + 39}"
    assert await bridge.handle({"type": "response.done", "response": {"id": last}}) == [
        {"type": "response.create"}
    ]
    unnamed = {"type": "response.function_call_arguments.done", "name": "knowledge_search",
               "call_id": "c-none", "arguments": arguments}  # fmt: skip
    assert len(await bridge.handle(unnamed)) == 1
    assert await bridge.handle({"type": "response.done", "response": {}}) == []


async def test_other_functions_are_left_to_the_app(
    vr: Voxrecall, caplog: pytest.LogCaptureFixture
) -> None:
    """Left alone, and said once per name (a misnamed knowledge function is seen in the log)."""
    bridge = await RealtimeToolBridge.create(vr)
    caplog.set_level(logging.INFO, logger="voxrecall.adapters.openai_realtime")
    sent = await replay(bridge, function_call_turn("resp_4", "transfer_call", "call_4", "{}"))
    sent += await replay(bridge, function_call_turn("resp_5", "transfer_call", "call_5", "{}"))
    assert sent == [[] for _ in sent]
    said = [r.getMessage() for r in caplog.records if "transfer_call" in r.getMessage()]
    assert len(said) == 1
    assert "left to the app" in said[0]


async def test_session_update_offers_the_knowledge_functions(vr: Voxrecall) -> None:
    bridge = await RealtimeToolBridge.create(vr)
    update = bridge.session_update(instructions="You are a helpful agent.")
    parsed = CLIENT_EVENT.validate_python(update)
    assert parsed.type == "session.update"
    (tool,) = update["session"]["tools"]
    assert tool["type"] == "function"
    assert tool["name"] == "knowledge_search"
    assert tool["parameters"]["required"] == ["query"]


async def test_an_absent_sidecar_still_answers_the_call() -> None:
    async with Voxrecall("127.0.0.1:9", tool_timeout_s=0.5) as absent:  # nothing listens on 9
        tool = pb.Tool(name="knowledge_search", realtime_json="{}")
        bridge = RealtimeToolBridge(absent, [tool], session_id="rt-2")
        sent = await replay(bridge, function_call_turn("resp_5", "knowledge_search", "c5", "{}"))
    item = next(e for out in sent for e in out if e["type"] == "conversation.item.create")["item"]
    assert orjson.loads(item["output"])["error"]["type"] == "unavailable"


@pytest.mark.parametrize("size", [100 * 1024, 5 * 1024 * 1024], ids=["100KiB", "5MiB"])
async def test_over_large_arguments_are_said_to_be_too_large(vr: Voxrecall, size: int) -> None:
    """Past the sidecar's message limit (4 MiB) gRPC itself would refuse them, which the model
    used to hear as "unavailable": both sizes get the limit in bytes, as an error output."""
    bridge = await RealtimeToolBridge.create(vr)
    arguments = '{"query": "' + "x" * size + '"}'
    sent = await replay(bridge, function_call_turn("resp_6", "knowledge_search", "c6", arguments))
    item = next(e for out in sent for e in out if e["type"] == "conversation.item.create")["item"]
    error = orjson.loads(item["output"])["error"]
    assert error["type"] == "invalid_arguments"
    assert f"the limit is {MAX_ARGUMENTS_BYTES}" in error["message"]
    assert sent[-1] == [{"type": "response.create"}]


async def test_a_call_the_sidecar_refuses_gets_its_code_and_message_not_unavailable(
    vr: Voxrecall,
) -> None:
    """A call id over the sidecar's 256 characters is refused INVALID_ARGUMENT: the model reads
    that code and the sidecar's message (as on MCP), not "the knowledge base did not answer"."""
    bridge = await RealtimeToolBridge.create(vr)
    call_id = "c" * 300
    arguments = '{"query": "roaming"}'
    sent = await replay(
        bridge, function_call_turn("resp_7", "knowledge_search", call_id, arguments)
    )
    item = next(e for out in sent for e in out if e["type"] == "conversation.item.create")["item"]
    error = orjson.loads(item["output"])["error"]
    assert error == {
        "type": "invalid_arguments",
        "message": "call_id is at least 300 bytes; the limit is 256",
    }
