"""The per-call fast paths (issue 19, 5) keep the rules they skip work for.

``FieldLimits`` walks only a request larger than ``SMALL_MESSAGE_BYTES``: a smaller one cannot
hold a string over any limit nor a repeated field over ``MAX_REPEATED`` entries.
"""

from __future__ import annotations

import pytest

from sidecar.edge.limits import (
    FIELD_BYTES,
    MAX_REPEATED,
    NAME_BYTES,
    SMALL_MESSAGE_BYTES,
    FieldLimits,
)
from sidecar.errors import InvalidArgument
from sidecar.gen import retrieval_pb2 as pb


def check(message: pb.SearchRequest | pb.TurnRequest) -> None:
    FieldLimits().request(None, message)  # type: ignore[arg-type]  # the hook reads no call


def test_the_small_message_bound_is_below_every_limit() -> None:
    limits = [NAME_BYTES, *(limit for limit in FIELD_BYTES.values() if limit)]
    assert min(limits) >= SMALL_MESSAGE_BYTES
    assert SMALL_MESSAGE_BYTES <= 2 * MAX_REPEATED  # an entry takes two bytes at least


def test_too_many_empty_entries_are_refused_though_each_is_tiny() -> None:
    at_limit = pb.SearchRequest(sources=[""] * MAX_REPEATED)
    check(at_limit)
    over = pb.SearchRequest(sources=[""] * (MAX_REPEATED + 1))
    assert over.ByteSize() > SMALL_MESSAGE_BYTES  # so the fast path cannot let it through
    with pytest.raises(InvalidArgument, match="sources has 257 entries"):
        check(over)


def test_a_name_one_byte_over_its_limit_is_refused() -> None:
    check(pb.TurnRequest(text="hello", session_id="s" * NAME_BYTES))
    with pytest.raises(InvalidArgument, match="session_id is at least 1025 bytes"):
        check(pb.TurnRequest(text="hello", session_id="s" * (NAME_BYTES + 1)))


def test_a_query_vector_does_not_count_toward_the_text_bound_but_its_text_does() -> None:
    vector = b"\x00" * 4 * 1536  # far over SMALL_MESSAGE_BYTES, and no string
    check(pb.SearchRequest(vector=vector, knowledge_base="kb"))
    with pytest.raises(InvalidArgument, match="knowledge_base is at least 1025 bytes"):
        check(pb.SearchRequest(vector=vector, knowledge_base="k" * (NAME_BYTES + 1)))
    with pytest.raises(InvalidArgument, match="sources has 257 entries"):
        check(pb.SearchRequest(vector=vector, sources=[""] * (MAX_REPEATED + 1)))
