"""``sidecar.edge.health.Held``: the calls of one kind held at once, shared out when full."""

from __future__ import annotations

import pytest

from sidecar.edge.health import Held, Refused


class End:
    """A held call's end, recorded."""

    def __init__(self) -> None:
        self.cancelled = False

    def __call__(self) -> None:
        self.cancelled = True


def _held(limit: int = 4, per_peer: int = 3) -> Held:
    return Held("checks are held", limit, per_peer, "read them")


def test_an_address_over_its_share_is_refused_and_nothing_is_taken() -> None:
    held = _held()
    for _ in range(3):
        held.take("a", End())
    with pytest.raises(Refused, match="3 checks are held from a, the limit for one address is 3"):
        held.take("a", End())
    assert held.total == 3
    assert held.by_peer == {"a": 3}
    assert held.ended == 0


def test_a_full_table_ends_the_oldest_call_of_the_address_holding_the_most() -> None:
    held = _held()
    tasks = [End() for _ in range(3)]
    holds = [held.take("a", task) for task in tasks]
    held.take("b", End())
    held.take("c", End())  # full, and c holds none: a's oldest ends for it
    assert [t.cancelled for t in tasks] == [True, False, False]
    assert held.by_peer == {"a": 2, "b": 1, "c": 1}
    assert held.total == 4
    assert held.ended == 1
    held.give(holds[0])  # its done callback, once gRPC ends it: given already, nothing again
    assert held.total == 4
    assert held.by_peer["a"] == 2
    held.give(holds[2])
    assert held.total == 3
    assert held.by_peer["a"] == 1


def test_a_full_table_refuses_an_address_that_holds_some() -> None:
    """Only an address holding none takes another's place: one that holds a call already is
    refused, however many another holds (an address cannot end calls one after another)."""
    held = _held(limit=4, per_peer=3)
    for _ in range(3):
        held.take("a", End())
    held.take("b", End())
    with pytest.raises(Refused, match="4 checks are held, the limit is 4: read them"):
        held.take("b", End())
    assert held.by_peer == {"a": 3, "b": 1}
    assert held.ended == 0
