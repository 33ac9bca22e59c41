"""A Search's response written straight out as protobuf's wire format (issue 19, 5).

A ``SearchResponse`` built per call (made, its hits merged from the kept chunk encodings of
``sidecar/edge/messages.py``, then serialized again by grpc) is written here as bytes from kept
pieces instead: per hit its field's tag, the chunk's kept encoding (for a plain Search's
``TableHits``, written from the chunk table's bytes) and the score's four bytes;
the timings as one packed field; the snapshot version, the base's policy words and the rerank
status as fields encoded once and kept. Fields go in the proto's order and parse as the message
protobuf would build (``tests/test_wire.py`` holds every field to it).

``EncodedResponse`` carries the bytes to the Search method's serializer, which passes them
through (``passing_through``, registered by ``sidecar.edge.server``), beside the timings (what
the metrics hook reads of every response). A hook that needs the message gets it parsed from the
bytes, once a call and only then (``EncodedResponse.message``; ``Hook.reads_encoded``); when a
hook has parsed it, the message is what is sent, so a hook that changes it is obeyed.
"""

from __future__ import annotations

import struct
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import grpc
from google.protobuf.message import Message

from sidecar.edge.messages import MESSAGES, field_key, string_field, varint
from sidecar.gen import retrieval_pb2 as pb
from sidecar.turn.hits import TableHits
from sidecar.turn.rerank import Status as RerankStatus

if TYPE_CHECKING:
    from sidecar.turn.engine import BasePolicy, SearchResult, Timings

_SEARCH = pb.SearchResponse.DESCRIPTOR
_LENGTH_DELIMITED, _FIXED32, _VARINT = 2, 5, 0
_CHUNKS = field_key(_SEARCH, "chunks", _LENGTH_DELIMITED)
_VERSION = field_key(_SEARCH, "snapshot_version", _LENGTH_DELIMITED)
_FALLBACK = field_key(_SEARCH, "fallback", _LENGTH_DELIMITED)
_INSTRUCTIONS = field_key(_SEARCH, "instructions", _LENGTH_DELIMITED)
_DEGRADED = field_key(_SEARCH, "degraded", _VARINT) + b"\x01"
# ``timings`` (three floats: each a one-byte key and four bytes) as one field of 15 bytes
_TIMINGS = field_key(_SEARCH, "timings", _LENGTH_DELIMITED) + b"\x0f"
_TIMING_KEYS = tuple(
    field_key(pb.Timings.DESCRIPTOR, name, _FIXED32)[0]
    for name in ("embed_ms", "search_ms", "total_ms")
)
_three_floats = struct.Struct("<BfBfBf").pack
# each rerank status's field (none for RERANK_NONE, the default; every number is one byte)
_RERANK = {
    status: field_key(_SEARCH, "rerank", _VARINT) + varint(number) if number else b""
    for status in RerankStatus
    for number in (pb.RerankStatus.Value(status.name),)
}


class EncodedResponse:
    """A response as the bytes sent, the message class they parse as, and its timings."""

    __slots__ = ("_message", "data", "kind", "timings")

    def __init__(self, data: bytes, kind: type[Message], timings: Timings) -> None:
        self.data = data
        self.kind = kind
        self.timings = timings
        self._message: Message | None = None

    def message(self) -> Any:
        """The message the bytes hold, parsed on the first call; what is sent from then on."""
        if self._message is None:
            self._message = self.kind.FromString(self.data)
        return self._message

    def wire(self) -> bytes:
        """The bytes to send: the message's, when a hook has read (and may have changed) it."""
        return self.data if self._message is None else self._message.SerializeToString()


def search_response(result: SearchResult, policy: BasePolicy) -> EncodedResponse:
    """``result`` as a ``SearchResponse``'s bytes, with ``policy``'s words beside it (the
    fallback only when nothing was found)."""
    hits = result.hits
    parts: list[bytes] = []
    if type(hits) is TableHits:  # a plain Search's: written from the chunk table
        MESSAGES.table_pieces(parts, _CHUNKS, hits)
    elif hits:
        MESSAGES.pieces(parts, _CHUNKS, hits)
    timings = result.timings
    parts += (
        _TIMINGS
        + _three_floats(
            _TIMING_KEYS[0],
            timings.embed_ms,
            _TIMING_KEYS[1],
            timings.search_ms,
            _TIMING_KEYS[2],
            timings.total_ms,
        ),
        string_field(_VERSION, result.snapshot_version),
    )
    if result.degraded:
        parts.append(_DEGRADED)
    if policy.fallback and not hits:
        parts.append(string_field(_FALLBACK, policy.fallback))
    if policy.instructions:
        parts.append(string_field(_INSTRUCTIONS, policy.instructions))
    parts.append(_RERANK[result.rerank])
    return EncodedResponse(b"".join(parts), pb.SearchResponse, timings)


Serializer = Callable[[Any], bytes]


def passing_through(handler: grpc.RpcMethodHandler) -> grpc.RpcMethodHandler:  # type: ignore[type-arg]
    """``handler`` with a serializer that sends an ``EncodedResponse``'s bytes as they are (and
    serializes a message as before)."""
    serializer: Serializer | None = handler.response_serializer

    def serialize(response: Any) -> bytes:
        if type(response) is EncodedResponse:
            return response.wire()
        return response if serializer is None else serializer(response)

    return handler._replace(response_serializer=serialize)  # type: ignore[attr-defined,no-any-return]
