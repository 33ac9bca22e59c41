"""A Search's and a Turn's response written straight out as protobuf's wire format (issue 19, 5).

A ``SearchResponse`` (or a ``TurnResponse``) built per call (made, its hits merged from the kept chunk encodings of
``sidecar/edge/messages.py``, then serialized again by grpc) is written here as bytes from kept
pieces instead: per hit its field's tag, the chunk's kept encoding (for a plain Search's
``TableHits``, written from the chunk table's bytes) and the score's four bytes;
the timings as one packed field; the snapshot version, the base's policy words and the rerank
status as fields encoded once and kept. Fields go in the proto's order and parse as the message
protobuf would build (``tests/test_wire.py`` holds every field to it). A Turn's response is
written alike (``turn_response``): its hits and the session's context chunks are the snapshot's
chunks, whose encodings are kept; its query and follow-up words, new on most calls, are encoded
there and not kept. A Converse stream's answer (``converse_response``) is those bytes as its
``turn`` field, beside the prefetch flag and the transcript: nothing parsed and serialized again.

``EncodedResponse`` carries the bytes to the method's serializer, which passes them through
(``passing_through``, registered by ``sidecar.edge.server`` for Search, Turn and Converse),
beside the timings and whether the call searched (what the metrics hook reads of every
response). A hook that needs the message gets it parsed from the bytes, once a call and only
then (``EncodedResponse.message``; ``Hook.reads_encoded``); when a hook has parsed it, the
message is what is sent, so a hook that changes it is obeyed.
"""

from __future__ import annotations

import struct
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import grpc
from google.protobuf.message import Message

from sidecar.edge.messages import MESSAGES, field_key, string_field, utf8_field, varint
from sidecar.gen import retrieval_pb2 as pb
from sidecar.turn.hits import Hit, TableHits
from sidecar.turn.rerank import Status as RerankStatus
from sidecar.turn.skip import Skip

if TYPE_CHECKING:
    from sidecar.turn.engine import BasePolicy, SearchResult, Timings, TurnResult
    from sidecar.turn.followups import FollowUp

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
    """A response as the bytes sent, the message class they parse as, its timings, and
    whether the call searched (a skipped turn did not: its embed and search stages are not
    observed)."""

    __slots__ = ("_message", "data", "kind", "searched", "timings")

    def __init__(
        self, data: bytes, kind: type[Message], timings: Timings, searched: bool = True
    ) -> None:
        self.data = data
        self.kind = kind
        self.timings = timings
        self.searched = searched
        self._message: Message | None = None

    def message(self) -> Any:
        """The message the bytes hold, parsed on the first call; what is sent from then on."""
        if self._message is None:
            self._message = self.kind.FromString(self.data)
        return self._message

    @property
    def parsed(self) -> Any:
        """The message a hook parsed (and may have changed), or None where none did."""
        return self._message

    def wire(self) -> bytes:
        """The bytes to send: the message's, when a hook has read (and may have changed) it."""
        return self.data if self._message is None else self._message.SerializeToString()


def search_response(result: SearchResult, policy: BasePolicy) -> EncodedResponse:
    """``result`` as a ``SearchResponse``'s bytes, with ``policy``'s words beside it (the
    fallback only when nothing was found)."""
    hits = result.hits
    parts: list[bytes] = []
    _put_hits(parts, _CHUNKS, hits)
    timings = result.timings
    parts += (_timings(_TIMINGS, timings), string_field(_VERSION, result.snapshot_version))
    if result.degraded:
        parts.append(_DEGRADED)
    if policy.fallback and not hits:
        parts.append(string_field(_FALLBACK, policy.fallback))
    if policy.instructions:
        parts.append(string_field(_INSTRUCTIONS, policy.instructions))
    if result.rerank is not RerankStatus.RERANK_NONE:  # most calls: none, and no lookup (an
        parts.append(_RERANK[result.rerank])  # Enum hashes in Python, a call a lookup)
    return EncodedResponse(b"".join(parts), pb.SearchResponse, timings)


def _put_hits(parts: list[bytes], key: bytes, hits: Sequence[Hit]) -> None:
    """``hits`` as ``Chunk`` fields of key ``key``, from their kept encodings."""
    if type(hits) is TableHits:  # a plain search's: written from the chunk table
        MESSAGES.table_pieces(parts, key, hits)
    elif hits:
        MESSAGES.pieces(parts, key, hits)


def _timings(field: bytes, timings: Timings) -> bytes:
    """``timings`` as the field ``field`` (its key and length): three floats, zeros written too
    (they parse as protobuf's defaults)."""
    embed, search, total = _TIMING_KEYS
    return field + _three_floats(
        embed, timings.embed_ms, search, timings.search_ms, total, timings.total_ms
    )


_TURN = pb.TurnResponse.DESCRIPTOR
_TURN_CHUNKS, _TURN_CONTEXT = (field_key(_TURN, name) for name in ("chunks", "context"))
_TURN_QUERY, _TURN_VERSION, _TURN_FOLLOWUP = (
    field_key(_TURN, name) for name in ("query", "snapshot_version", "followup")
)
_TURN_FALLBACK, _TURN_INSTRUCTIONS = (field_key(_TURN, n) for n in ("fallback", "instructions"))
_TURN_TIMINGS = field_key(_TURN, "timings") + b"\x0f"
_TURN_DEGRADED = field_key(_TURN, "degraded", _VARINT) + b"\x01"
_TURN_TRUNCATED = field_key(_TURN, "truncated", _VARINT) + b"\x01"
# each skip's field (none for NOT_SKIPPED, the default), and each rerank status's
_SKIPPED = {
    skip: field_key(_TURN, "skipped", _VARINT) + varint(number) if number else b""
    for skip in Skip
    for number in (pb.SkipReason.Value(skip.name),)  # by name, as protobuf reads it
}
_TURN_RERANK = {
    status: field_key(_TURN, "rerank", _VARINT) + varint(number) if number else b""
    for status in RerankStatus
    for number in (pb.RerankStatus.Value(status.name),)
}
_FOLLOWUP = pb.FollowUp.DESCRIPTOR
_USED, _SOURCE = field_key(_FOLLOWUP, "used"), field_key(_FOLLOWUP, "source")
_CONFIDENCE = field_key(_FOLLOWUP, "confidence", _FIXED32)
_float32 = struct.Struct("<f").pack


def turn_response(result: TurnResult, policy: BasePolicy) -> EncodedResponse:
    """``result`` as a ``TurnResponse``'s bytes, with ``policy``'s words beside it (the
    fallback only when the turn searched and found nothing)."""
    searched = result.skipped is Skip.NOT_SKIPPED
    data = _turn_bytes(result, policy, searched)
    return EncodedResponse(data, pb.TurnResponse, result.timings, searched)


_CONVERSE = pb.ConverseResponse.DESCRIPTOR
_CONVERSE_TURN, _TRANSCRIPT = (field_key(_CONVERSE, name) for name in ("turn", "transcript"))
_PREFETCHED = field_key(_CONVERSE, "prefetched", _VARINT) + b"\x01"


def converse_response(result: TurnResult, policy: BasePolicy, transcript: str) -> EncodedResponse:
    """A Converse stream's answer to one turn as a ``ConverseResponse``'s bytes: the turn's, as
    ``turn_response`` writes them, as its ``turn`` field (present however short, as protobuf
    writes a message field set), whether a prefetch answered it, and the final ``transcript``
    (new on every call: not kept)."""
    searched = result.skipped is Skip.NOT_SKIPPED
    turn = _turn_bytes(result, policy, searched)
    data = b"".join(
        (
            _CONVERSE_TURN,
            varint(len(turn)),
            turn,
            _PREFETCHED if result.prefetched else b"",
            utf8_field(_TRANSCRIPT, transcript),
        )
    )
    return EncodedResponse(data, pb.ConverseResponse, result.timings, searched)


def _turn_bytes(result: TurnResult, policy: BasePolicy, searched: bool) -> bytes:
    """A ``TurnResponse``'s fields, in the proto's order."""
    hits = result.hits
    parts: list[bytes] = []
    _put_hits(parts, _TURN_CHUNKS, hits)
    _put_hits(parts, _TURN_CONTEXT, result.context)
    parts += (_SKIPPED[result.skipped], _TURN_DEGRADED if result.degraded else b"")
    parts += (
        utf8_field(_TURN_QUERY, result.query),  # new on most calls: not kept
        _timings(_TURN_TIMINGS, result.timings),
        string_field(_TURN_VERSION, result.snapshot_version),
        _TURN_TRUNCATED if result.truncated else b"",
        _followup(result.followup),
    )
    if searched and policy.fallback and not hits:
        parts.append(string_field(_TURN_FALLBACK, policy.fallback))
    if policy.instructions:
        parts.append(string_field(_TURN_INSTRUCTIONS, policy.instructions))
    parts.append(_TURN_RERANK[result.rerank])
    return b"".join(parts)


def _followup(followup: FollowUp) -> bytes:
    """The ``followup`` field, present (if empty) on every response, as protobuf's was."""
    body = utf8_field(_USED, followup.used) + string_field(_SOURCE, followup.source)
    if followup.confidence:
        body += _CONFIDENCE + _float32(followup.confidence)
    return _TURN_FOLLOWUP + varint(len(body)) + body


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
