"""``Turn`` and ``Search`` as plain HTTP calls: ``POST /v1/turn`` and ``POST /v1/search``.

A call after an idle pause (every caller turn is one) costs gRPC Python its thread hops (issue
19, 5: ~1.4-1.9 ms on loopback, where an HTTP/1.1 POST to a bare uvicorn app took ~0.55 ms from a
lean asyncio client and ~1.15 from aiohttp): these paths are the same methods over the HTTP door,
for a client that holds an HTTP connection (aiohttp, which Pipecat and LiveKit Agents carry, or
httpx). End to end a turn gains little by it (bench/README.md, "Turn over HTTP against DIY,
session 18").

The body is the method's request in proto3's JSON mapping, read by protobuf's own parser
(``json_format.ParseDict``: the proto's field names or their lowerCamelCase, enums by name or
number, ``vector`` as base64; an unknown field is refused, as the mapping's parsers refuse it by
default) once orjson has read the JSON (``read_request``); a body that is not one is a 400
saying what is wrong. The answer is the method's
response in the same mapping with the proto's field names: the content of
``json_format.MessageToDict(response, preserving_proto_field_name=True)`` for the response the
gRPC method gives (fields at their defaults left out, enums by name, floats as protobuf writes a
``float``), written here with orjson from what the engine answered (``turn_json``,
``search_json``; tests/test_http_rpc.py holds every field to protobuf's): a turn of six chunks
in 10 us, where parsing its wire bytes and ``MessageToDict`` took 51 and a walk of the parsed
message by hand 28. Everything else is the gRPC method's: the request is checked by the same hooks
(``HttpCall.check``: the caller's scope, the byte limits of each field), the same input builders
(``sidecar.edge.service.turn_input``, ``search_input``) feed the same engine call, the hooks see
the same ``EncodedResponse`` (the metrics read its timings), and a session id names the same
session on either door.
"""

from __future__ import annotations

import math
import struct
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, TypeVar

import orjson
from google.protobuf import json_format
from google.protobuf.message import Message

from index.types import meta_text
from sidecar.edge.lifecycle import Lifecycle
from sidecar.edge.limits import MAX_REPEATED
from sidecar.edge.service import policy_for, search_input, turn_input
from sidecar.edge.wire import EncodedResponse, search_response, turn_response
from sidecar.errors import FilterRefused, InvalidArgument
from sidecar.gen import retrieval_pb2 as pb
from sidecar.http.webhooks import Reply
from sidecar.turn.engine import BasePolicy, Engine, SearchResult, Timings, TurnResult
from sidecar.turn.hits import Hit
from sidecar.turn.rerank import Status as RerankStatus
from sidecar.turn.scope import MAX_FILTERS
from sidecar.turn.skip import Skip

if TYPE_CHECKING:
    from sidecar.http.door import HttpCall

TURN_PATH = "/v1/turn"
SEARCH_PATH = "/v1/search"
EXAMPLES = {
    pb.TurnRequest: '{"session_id": "call-1", "text": "How do I reset my password?", "is_final": true}',
    pb.SearchRequest: '{"query": "reset password", "limit": 3}',
}
# A parser's complaint quotes the value it could not read: at most this many characters of it
# go into the 400's message (a body may be 256 KiB).
MAX_COMPLAINT = 300

_Req = TypeVar("_Req", bound=Message)


def read_request(body: bytes, kind: type[_Req]) -> _Req:
    """``body`` read as ``kind`` in proto3's JSON mapping, or ``InvalidArgument`` (400) saying
    what is wrong and what to send. The JSON is read by orjson (C, nested at most 1,024 deep; a
    key sent twice, the last), each list the message can hold is held to ``MAX_REPEATED``
    entries (``filters`` to ``MAX_FILTERS``), as the hooks and the engine hold them, and only
    then does protobuf's parser (``ParseDict``, Python, a few microseconds an entry) walk it: a
    body of 65,000 one-letter ``sources`` (254 KB) held the event loop 101 ms there."""
    try:
        value = orjson.loads(body)
    except orjson.JSONDecodeError as exc:
        raise _not_a(kind, f"not JSON: {exc}") from None
    if not isinstance(value, dict):  # protobuf's parser takes [] as {}
        raise _not_a(kind, "a message is a JSON object")
    _check_lists(value)
    try:
        return json_format.ParseDict(value, kind())
    except RecursionError:  # a value ~1,000 deep where a text or list goes: its repr recursed
        raise _not_a(kind, "a value nested too deep for its field") from None
    except json_format.ParseError as exc:
        complaint = str(exc)
        if len(complaint) > MAX_COMPLAINT:
            complaint = complaint[:MAX_COMPLAINT] + "..."
        raise _not_a(kind, complaint) from None


def _check_lists(value: dict[str, Any]) -> None:
    """Every list where a request can hold one (a repeated field; a filter's ``any_of``) within
    ``MAX_REPEATED`` entries, and ``filters`` within ``MAX_FILTERS``: refused as ``FieldLimits``
    and the engine refuse them, before the parser walks them (256 filters of 256 values each,
    in 250 KB, held the loop ~100 ms in protobuf's parser)."""
    for key, field in value.items():
        if not isinstance(field, list):
            continue
        _check_entries(key, field)
        if key == "filters" and len(field) > MAX_FILTERS:
            raise FilterRefused(f"{len(field)} filters; the limit is {MAX_FILTERS}")
        for entry in field:
            if isinstance(entry, dict):
                for inner_key, inner in entry.items():
                    if isinstance(inner, list):
                        _check_entries(f"{key}.{inner_key}", inner)


def _check_entries(name: str, entries: list[Any]) -> None:
    if len(entries) > MAX_REPEATED:
        raise InvalidArgument(f"{name} has {len(entries)} entries; the limit is {MAX_REPEATED}")


def _not_a(kind: type[Message], complaint: str) -> InvalidArgument:
    return InvalidArgument(
        f"the body is not a {kind.DESCRIPTOR.name} in proto3's JSON mapping ({complaint}): send "
        f"one, e.g. {EXAMPLES[kind]}"
    )


class PlainCalls:
    """The handlers of ``TURN_PATH`` and ``SEARCH_PATH``, run inside the door's ``HttpCall``
    (its hooks started and the body read: ``HttpDoor._posted``)."""

    def __init__(self, engine: Engine, lifecycle: Lifecycle) -> None:
        self.engine = engine
        self.lifecycle = lifecycle

    async def turn(self, call: HttpCall, headers: dict[str, str], body: bytes) -> Reply:
        request = read_request(body, pb.TurnRequest)
        call.check(request)
        self.lifecycle.check_accepting()
        turn = turn_input(request)
        result = await self.engine.turn(turn)
        policy = policy_for(self.engine, turn.knowledge_base)
        return answered(call, turn_response(result, policy), lambda: turn_json(result, policy))

    async def search(self, call: HttpCall, headers: dict[str, str], body: bytes) -> Reply:
        request = read_request(body, pb.SearchRequest)
        call.check(request)
        self.lifecycle.check_accepting()
        result = await self.engine.search(search_input(request))
        policy = policy_for(self.engine, request.knowledge_base)
        return answered(call, search_response(result, policy), lambda: search_json(result, policy))


def answered(call: HttpCall, encoded: EncodedResponse, written: Callable[[], bytes]) -> Reply:
    """The hooks see ``encoded`` as on gRPC; the answer is ``written()``, or, where a hook
    parsed the message (and may have changed it), that message in the mapping."""
    call.sent(encoded)
    message = encoded.parsed
    if message is not None:
        return 200, orjson.dumps(as_dict(message)), []
    return 200, written(), []


def as_dict(message: Message) -> dict[str, Any]:
    """``message`` as protobuf writes it in the JSON mapping, with the proto's field names."""
    return json_format.MessageToDict(message, preserving_proto_field_name=True)


# -- the answers, written from the engine's results ---------------------------------------------

_F32 = struct.Struct("<f")
_ZERO = bytes(4)
# protobuf's ToShortestFloat: the fewest digits, from 6, that read back as the same float32 (9
# always do)
_DIGITS = tuple(f".{n}g" for n in range(6, 10))


def json_float(value: float) -> float | str | None:
    """A ``float`` field holding ``value`` as ``MessageToDict`` writes it: rounded to float32,
    then the shortest of 6 to 9 significant digits that reads back as it (protobuf's
    ``ToShortestFloat``); ``NaN``, ``Infinity``, ``-Infinity`` as strings; None where protobuf
    leaves the field out (zero; -0.0 is written)."""
    packed = _F32.pack(value)
    if packed == _ZERO:
        return None
    exact: float = _F32.unpack(packed)[0]
    if math.isnan(exact):
        return "NaN"
    if math.isinf(exact):
        return "Infinity" if exact > 0 else "-Infinity"
    for digits in _DIGITS:
        rounded = float(format(exact, digits))
        if _F32.unpack(_F32.pack(rounded))[0] == exact:
            return rounded
    return float(exact)  # not reached: nine digits name every float32


def _chunk(hit: Hit) -> dict[str, Any]:
    """A ``Chunk`` field's value: its fields in the proto's order, those at their defaults left
    out."""
    chunk = hit.chunk
    metadata = chunk.metadata
    return _set(
        (
            ("chunk_id", chunk.chunk_id),
            ("knowledge_base", hit.knowledge_base),
            ("source", chunk.source),
            ("source_path", chunk.source_path),
            ("title", chunk.title),
            ("breadcrumbs", chunk.breadcrumbs),
            ("text", chunk.text),
            ("score", json_float(hit.score)),
            ("url", chunk.url),
            ("metadata", {key: meta_text(value) for key, value in metadata.items()}),
        )
    )


def _set(fields: Sequence[tuple[str, Any]]) -> dict[str, Any]:
    """The fields not at their defaults (an empty text, list or map; a float ``json_float``
    leaves out), as protobuf's JSON mapping writes them; -0.0, a float, is kept."""
    return {name: value for name, value in fields if value or type(value) is float}


def _timings(timings: Timings) -> dict[str, Any]:
    """The ``timings`` field (always sent: ``{}`` when all three are zero)."""
    return _set(
        (
            ("embed_ms", json_float(timings.embed_ms)),
            ("search_ms", json_float(timings.search_ms)),
            ("total_ms", json_float(timings.total_ms)),
        )
    )


def _put_hits(out: dict[str, Any], name: str, hits: Sequence[Hit]) -> None:
    if hits:  # a plain Search's TableHits decode their chunks here
        out[name] = [_chunk(hit) for hit in hits]


def _put_policy(out: dict[str, Any], policy: BasePolicy, fallback: bool) -> None:
    if fallback and policy.fallback:
        out["fallback"] = policy.fallback
    if policy.instructions:
        out["instructions"] = policy.instructions


def turn_json(result: TurnResult, policy: BasePolicy) -> bytes:
    """A ``TurnResponse`` in the JSON mapping, as ``MessageToDict`` writes the message
    ``sidecar.edge.wire.turn_response`` encodes (the fallback only when the turn searched and
    found nothing)."""
    out: dict[str, Any] = {}
    _put_hits(out, "chunks", result.hits)
    _put_hits(out, "context", result.context)
    searched = result.skipped is Skip.NOT_SKIPPED
    if not searched:
        out["skipped"] = result.skipped.name
    if result.degraded:
        out["degraded"] = True
    if result.query:
        out["query"] = result.query
    out["timings"] = _timings(result.timings)
    if result.snapshot_version:
        out["snapshot_version"] = result.snapshot_version
    if result.truncated:
        out["truncated"] = True
    out["followup"] = _followup(result)
    _put_policy(out, policy, searched and not result.hits)
    if result.rerank is not RerankStatus.RERANK_NONE:
        out["rerank"] = result.rerank.name
    return orjson.dumps(out)


def _followup(result: TurnResult) -> dict[str, Any]:
    """The ``followup`` field (always sent, as protobuf's was)."""
    followup = result.followup
    return _set(
        (
            ("used", followup.used),
            ("source", followup.source),
            ("confidence", json_float(followup.confidence)),
        )
    )


def search_json(result: SearchResult, policy: BasePolicy) -> bytes:
    """A ``SearchResponse`` in the JSON mapping, as ``MessageToDict`` writes the message
    ``sidecar.edge.wire.search_response`` encodes (the fallback only when nothing was found)."""
    out: dict[str, Any] = {}
    _put_hits(out, "chunks", result.hits)
    out["timings"] = _timings(result.timings)
    if result.snapshot_version:
        out["snapshot_version"] = result.snapshot_version
    if result.degraded:
        out["degraded"] = True
    _put_policy(out, policy, not result.hits)
    if result.rerank is not RerankStatus.RERANK_NONE:
        out["rerank"] = result.rerank.name
    return orjson.dumps(out)
