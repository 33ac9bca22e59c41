"""The hooks' per-call paths, without a server: a ``Call`` starts and ends hooks in order on
both doors (a gRPC call's single pass, the HTTP door's two steps), a refusal ends only the hooks
that started; ``FieldLimits`` finds each message class's bytes fields apart; ``CallLog`` gives a
call without a usable ``x-call-id`` a fresh one, and sets one context variable; the limit counts
a caller apart only where it has a share; a method's calls count in one ``Tally``."""

from __future__ import annotations

import asyncio
import contextvars
from types import SimpleNamespace
from typing import Any

import grpc
import numpy as np
import pytest

from sidecar.edge import logs
from sidecar.edge.interceptor import NO_HOOKS, Call, Hook, Phases, _HookedCall
from sidecar.edge.lifecycle import Lifecycle
from sidecar.edge.limits import TEXT_BYTES, ConcurrencyLimit, FieldLimits
from sidecar.edge.logs import CallLog
from sidecar.edge.metrics import Metrics
from sidecar.edge.wire import EncodedResponse
from sidecar.errors import InvalidArgument, RequestError, ResourceExhausted
from sidecar.gen import retrieval_pb2 as pb
from sidecar.turn import sessions
from sidecar.turn.engine import Timings
from tests.conftest import eventually


class Recorded(Hook):
    """Writes ``start NAME`` and ``end NAME`` to a shared list; refuses at start if told to."""

    def __init__(self, name: str, seen: list[str], refuse: bool = False) -> None:
        self.name, self.seen, self.refuse = name, seen, refuse

    def start(self, call: Call) -> None:
        self.seen.append(f"start {self.name}")
        if self.refuse:
            raise ResourceExhausted("no room")

    def end(self, call: Call) -> None:
        self.seen.append(f"end {self.name}")


class StartsOnly(Hook):
    def start(self, call: Call) -> None:
        pass


def new_call(phases: Phases = NO_HOOKS) -> Call:
    return Call("Search", "voxrecall.v1.Retrieval", {}, None, phases, task=None)  # type: ignore[arg-type]


def hooks(seen: list[str], refused: str = "") -> list[Hook]:
    # a hook without an end among them: positions, not the end phase's index, decide
    return [
        Recorded("a", seen, refused == "a"),
        StartsOnly(),
        Recorded("b", seen, refused == "b"),
        Recorded("c", seen, refused == "c"),
    ]


@pytest.mark.parametrize("steps", [(None,), (2, None)], ids=["grpc", "http-two-steps"])
def test_every_started_hook_ends_once_last_first(steps: tuple[int | None, ...]) -> None:
    seen: list[str] = []
    run = new_call(Phases.of(hooks(seen)))
    for until in steps:
        run.start(until)
    run.end()
    run.end()  # once: a second end finds no hook started
    assert seen == ["start a", "start b", "start c", "end c", "end b", "end a"]


@pytest.mark.parametrize("steps", [(None,), (2, None)], ids=["grpc", "http-two-steps"])
@pytest.mark.parametrize("refused", ["a", "b", "c"])
def test_a_refusal_ends_only_the_hooks_before_it(
    steps: tuple[int | None, ...], refused: str
) -> None:
    seen: list[str] = []
    call = run = new_call(Phases.of(hooks(seen, refused)))
    *first, last = steps
    for until in first:  # the HTTP door's first step: refused there when "a" refuses
        if refused == "a":
            with pytest.raises(RequestError):
                run.start(until)
            break
        run.start(until)
    else:
        with pytest.raises(RequestError):
            run.start(last)
    run.end()
    started = ["a", "b", "c"][: ["a", "b", "c"].index(refused) + 1]
    ended = [f"end {n}" for n in reversed(started[:-1])]  # not the one that refused
    assert seen == [f"start {n}" for n in started] + ended
    assert call.code is grpc.StatusCode.RESOURCE_EXHAUSTED


def test_field_limits_find_each_message_classs_bytes_fields_apart() -> None:
    limits, call = FieldLimits(), new_call()
    vector = np.ones(1536, dtype="<f4").tobytes()  # 6 KiB of bytes: no text
    limits.request(call, pb.SearchRequest(query="panes", vector=vector))
    limits.request(call, pb.SearchRequest(query="x" * TEXT_BYTES, vector=vector))  # at the limit
    with pytest.raises(InvalidArgument, match="query is"):
        limits.request(call, pb.SearchRequest(query="x" * (TEXT_BYTES + 1), vector=vector))
    # another class, seen after SearchRequest's bytes field was found: none subtracted from it
    with pytest.raises(InvalidArgument, match="text is"):
        limits.request(call, pb.TurnRequest(text="x" * (TEXT_BYTES + 1)))
    with pytest.raises(InvalidArgument, match="session_id is"):
        limits.request(call, pb.TurnRequest(text="hi", session_id="s" * 2000))


class _Context:
    def __init__(self) -> None:
        self.trailers: Any = None

    def peer(self) -> str:
        return "ipv4:127.0.0.1:1"

    def set_trailing_metadata(self, metadata: Any) -> None:
        self.trailers = metadata


@pytest.mark.parametrize("given", [None, "", "bad id!", "agent-call-7"])
def test_a_call_keeps_a_usable_call_id_and_gets_a_fresh_one_otherwise(given: str | None) -> None:
    context = _Context()
    metadata = {} if given is None else {"x-call-id": given}
    call = Call("Search", "voxrecall.v1.Retrieval", metadata, context, task=None)  # type: ignore[arg-type]
    contextvars.copy_context().run(CallLog().start, call)  # its log ids stay in that copy
    if given == "agent-call-7":
        assert call.call_id == given
    else:
        assert len(call.call_id) == 16
        assert int(call.call_id, 16) >= 0
    assert context.trailers == (("x-call-id", call.call_id),)


def test_a_calls_metadata_is_read_as_grpc_gives_it() -> None:
    """A gRPC call's metadata is kept as its (key, value) pairs and read by the entry a hook
    asks for: the last one sent when one is sent twice (as the dict made of every entry kept),
    a binary entry's bytes never taken for text; the HTTP door's headers are a dict."""
    pairs = (
        ("user-agent", "grpc-python"),
        ("x-call-id", "first"),
        ("authorization-bin", b"\x00"),
        ("x-call-id", "second"),
    )
    call = Call("Search", "voxrecall.v1.Retrieval", pairs, None, task=None)  # type: ignore[arg-type]
    assert call.header("x-call-id") == "second"
    assert call.header("user-agent") == "grpc-python"
    assert call.header("authorization-bin") == ""
    assert call.header("authorization") == ""
    headers = Call("MCP", "http", {"authorization": "Bearer t"}, None, task=None)  # type: ignore[arg-type]
    assert headers.header("authorization") == "Bearer t"
    assert headers.header("x-call-id") == ""


def test_a_calls_start_sets_one_context_variable_the_log_and_a_lazy_load_read() -> None:
    """The log's ids and the connection a lazy load queues by are the same record, in one
    variable: one set a call, where two were."""
    call = Call("Search", "voxrecall.v1.Retrieval", {}, _Context(), task=None)  # type: ignore[arg-type]
    context = contextvars.Context()  # empty: what the start sets is all there is in it
    context.run(CallLog().start, call)
    assert len(context) == 1
    assert context.run(logs.current.get) is call
    assert context.run(sessions.connection) == "ipv4:127.0.0.1:1"
    assert sessions.connection() == ""  # outside the call


def test_a_limit_counts_callers_apart_only_where_they_have_a_share() -> None:
    limit = ConcurrencyLimit(4, shares={"agent": (1, 1)})
    anonymous, agent, again = new_call(), new_call(), new_call()
    agent.caller = again.caller = SimpleNamespace(name="agent")
    limit.start(anonymous)
    limit.start(agent)
    assert (limit.unary.in_flight, limit.unary.by_caller) == (2, {"agent": 1})
    with pytest.raises(ResourceExhausted, match="its share"):
        limit.start(again)
    limit.end(agent)
    limit.end(anonymous)
    assert (limit.unary.in_flight, limit.unary.by_caller) == (0, {})


class _Answering:
    """A gRPC call's context whose answer is held until ``send`` (what gRPC calls back then)."""

    def __init__(self) -> None:
        self.sent: list[Any] = []

    def done(self) -> bool:
        return False

    def peer(self) -> str:
        return "ipv4:127.0.0.1:5000"

    def add_done_callback(self, callback: Any) -> None:
        self.sent.append(callback)

    def send(self) -> None:
        self.sent.pop()(self)


class _HeldCall(Call):
    """A call whose answer its door leaves for gRPC to send (as a gRPC call's is)."""

    __slots__ = ()

    def answer_held(self) -> bool:
        return not self.context.done()


async def test_a_callers_answer_not_yet_sent_does_not_refuse_its_next_call() -> None:
    """Its client has the answer before gRPC is done with the call: a caller with one call at a
    time is never refused, while one that leaves its answers unread holds at most its share of
    them besides its share of running calls, and the other callers keep their room."""
    limit = ConcurrencyLimit(2, shares={"agent": (1, 1), "other": (1, 1)})
    calls = [
        _HeldCall("Search", "voxrecall.v1.Retrieval", {}, _Answering(), task=None) for _ in "abc"
    ]  # type: ignore[arg-type]
    for call in calls:
        call.caller = SimpleNamespace(name="agent")
    first, second, third = calls
    limit.start(first)
    limit.end(first)  # its handler is over, its answer not yet sent
    limit.start(second)  # the next call, once the client has the first answer
    assert (limit.unary.by_caller, limit.unary.held_by) == ({"agent": 1}, {"agent": 1})
    with pytest.raises(ResourceExhausted, match="has 1 calls in flight"):
        limit.start(third)
    limit.end(second)
    with pytest.raises(ResourceExhausted, match="has 2 answers unread"):
        limit.start(third)  # two answers held unread: past its share of them
    other = new_call()
    other.caller = SimpleNamespace(name="other")
    limit.start(other)  # its share, whatever the agent's held answers
    limit.end(other)
    first.context.send()
    limit.start(third)
    limit.end(third)
    second.context.send()
    third.context.send()
    assert (limit.unary.in_flight, limit.unary.held, limit.lingering) == (0, 0, 0)
    assert limit.unary.by_caller == limit.unary.held_by == {}
    limit._sweeping.cancel()  # type: ignore[union-attr]


async def test_the_limits_sweep_runs_in_no_calls_context() -> None:
    """The sweep is scheduled from a call's end, and ran in that call's context: its line about
    every connection it closed carried one call's ids (three clients' streams, one session id)."""
    limit = ConcurrencyLimit(2, unread_s=0.01)
    seen: list[object] = []
    limit._sweep = lambda: seen.append(logs.current.get())  # type: ignore[method-assign]
    call = _HeldCall("Search", "voxrecall.v1.Retrieval", {}, _Answering(), task=None)  # type: ignore[arg-type]
    logs.current.set(call)
    limit.start(call)
    limit.end(call)  # its answer held: the sweep is due
    await eventually(lambda: bool(seen), "the sweep")
    assert seen == [None]
    call.context.send()


class _Aborting(_Answering):
    """A gRPC call's context whose status goes out at ``abort``: it notes what ``limit`` counted
    of the caller's calls then, running and held, and is done (as gRPC's is once aborted)."""

    def __init__(self, limit: ConcurrencyLimit) -> None:
        super().__init__()
        self.limit = limit
        self.seen: Any = None

    def done(self) -> bool:
        return self.seen is not None

    def time_remaining(self) -> None:
        return None

    def trailing_metadata(self) -> tuple[()]:
        return ()

    async def abort(self, code: grpc.StatusCode, details: str, trailing_metadata: Any) -> None:
        self.seen = (code, dict(self.limit.unary.by_caller), dict(self.limit.unary.held_by))
        raise grpc.aio.AbortError(details)


async def _ended(call: _HookedCall, ending: str) -> None:
    """``call`` refused for its request's session_id (2,000 bytes), or cut off as it runs."""
    if ending == "refused":
        try:
            call.prepare(pb.EndSessionRequest(session_id="s" * 2000), stream_in=False)
        except RequestError as exc:
            await call.refuse(exc)
    call.prepare(pb.EndSessionRequest(session_id="s"), stream_in=False)
    call.cut = "the sidecar is draining"
    await call.close(asyncio.CancelledError())


@pytest.mark.parametrize("ending", ["refused", "cut"])
async def test_a_failed_calls_slot_is_held_apart_before_its_status_goes_out(ending: str) -> None:
    """A call refused by a hook after the limit gave it a slot (a field over its limit), or cut
    off by the drain: every hook has ended, its slot held apart as an answer's is, when its
    status goes out, so its client's next call is not refused for it; given back once gRPC is
    done with the call."""
    limit = ConcurrencyLimit(2, shares={"agent": (1, 1)})
    context = _Aborting(limit)
    phases = Phases.of([limit, FieldLimits()])
    call = _HookedCall("EndSession", "voxrecall.v1.Retrieval", (), context, phases)  # type: ignore[arg-type]
    call.caller = SimpleNamespace(name="agent")
    with pytest.raises(grpc.aio.AbortError):
        await _ended(call, ending)
    code = grpc.StatusCode.INVALID_ARGUMENT if ending == "refused" else grpc.StatusCode.UNAVAILABLE
    assert context.seen == (code, {}, {"agent": 1})
    assert call.code is code
    context.send()
    assert (limit.unary.in_flight, limit.unary.held, limit.lingering) == (0, 0, 0)
    limit._sweeping.cancel()  # type: ignore[union-attr]


class _Stuck(_Aborting):
    """A context whose abort waits (behind answers its client leaves unread), and refuses a
    second one, as gRPC does."""

    def __init__(self, limit: ConcurrencyLimit) -> None:
        super().__init__(limit)
        self.aborts = 0

    def done(self) -> bool:
        return False  # the status is not out: it waits behind the unread answers

    async def abort(self, code: grpc.StatusCode, details: str, trailing_metadata: Any) -> None:
        self.aborts += 1
        if self.aborts > 1:
            raise grpc.aio.UsageError("Abort already called!")
        await asyncio.Event().wait()  # until cancelled


async def test_a_call_cut_off_while_its_abort_waits_is_not_aborted_again() -> None:
    """A failed call's hooks end before its abort, so the limit holds it among the answers; the
    sweep (or the drain) may cut it off while its abort still waits: it ends there, with no
    second abort (gRPC refuses one, UsageError, and logs its traceback)."""
    limit = ConcurrencyLimit(2)
    context = _Stuck(limit)
    call = _HookedCall("Turn", "voxrecall.v1.Retrieval", (), context, Phases.of([limit]))  # type: ignore[arg-type]
    call.start()
    aborting = asyncio.ensure_future(call.abort(grpc.StatusCode.NOT_FOUND, "no such base", ()))
    call.task = aborting  # the call's own task, as a handler's is
    await asyncio.sleep(0)
    assert limit.lingering == 1  # its hooks ended: held apart
    call.cut_off("its answer was not read in time")
    with pytest.raises(asyncio.CancelledError):
        await aborting
    await call.close(asyncio.CancelledError())
    assert context.aborts == 1
    assert call.code is grpc.StatusCode.NOT_FOUND
    limit._sweeping.cancel()  # type: ignore[union-attr]


def test_a_methods_calls_count_in_one_tally_folded_in_at_scrape() -> None:
    """An OK call's end and its answer's stages count in its door's method's one record; a
    failed call by its code too; a scrape reads the families as the labelled children said."""
    metrics = Metrics(None, None, Lifecycle())  # type: ignore[arg-type]
    answer = EncodedResponse(b"", pb.SearchResponse, Timings(1.0, 2.0, 4.0))
    calls = [new_call() for _ in range(3)]
    for call in calls:
        metrics.response(call, answer)
        metrics.end(call)
    failed = new_call()
    failed.code = grpc.StatusCode.INVALID_ARGUMENT
    metrics.end(failed)
    assert len({id(call.tally) for call in [*calls, failed]}) == 1
    samples = {
        (sample.name, frozenset(sample.labels.items())): sample.value
        for family in (metrics.rpcs, metrics.rpc_seconds, metrics.stage_seconds, metrics.refusals)
        for metric in family.collect()
        for sample in metric.samples
    }

    def value(name: str, **labels: str) -> float:
        return samples[(name, frozenset(labels.items()))]

    search = {"door": "grpc", "method": "Search"}
    assert value("voxrecall_rpcs_total", code="OK", **search) == 3
    assert value("voxrecall_rpcs_total", code="INVALID_ARGUMENT", **search) == 1
    assert value("voxrecall_refusals_total", reason="invalid_argument") == 1
    assert value("voxrecall_rpc_seconds_count", **search) == 4
    for stage, seconds in (("embed", 0.001), ("search", 0.002), ("total", 0.004)):
        assert value("voxrecall_stage_seconds_count", rpc="Search", stage=stage) == 3
        total = value("voxrecall_stage_seconds_sum", rpc="Search", stage=stage)
        assert total == pytest.approx(3 * seconds)
        assert value("voxrecall_stage_seconds_bucket", rpc="Search", stage=stage, le="0.005") == 3
        within = value("voxrecall_stage_seconds_bucket", rpc="Search", stage=stage, le="0.001")
        assert within == (3 if stage == "embed" else 0)
