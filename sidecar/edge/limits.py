"""Limits that protect the sidecar as a whole: calls in flight, and the embedder's input.

``ConcurrencyLimit`` refuses a call over its limit at once with RESOURCE_EXHAUSTED instead of
queueing it: a voice turn answered late is worth nothing, and the caller can retry elsewhere.
Unary calls (``[sidecar] max_concurrent_rpcs``) and Converse streams (``max_streams``; a stream
holds its slot for as long as it is open) are counted apart, so neither kind can starve the
other; with authentication each caller may hold only its share of each
(``[sidecar.auth.caller]``), so no caller can lock the others out. A call holds its slot until
gRPC is done with it, not only its handler (``end``): an answer its client leaves unread stays in
gRPC's memory, so the slots bound those answers too, in calls and so in bytes, and for at most
``stream_idle_s`` (then the call is ended and its connection closed, which alone frees the
answer: ``_sweep``). A caller's calls whose answers are held are counted apart from those whose
handlers run (``Pool.hold``): its client may have its answer (or a failed call's status: the
call's hooks end before it is aborted, ``_HookedCall.abort``) before gRPC is done with the call,
and its next call, on either door, is not refused for it; so a caller holds at most its share of
each, twice its share in all. The HTTP door writes its own answers: its slot is given back
before it does, and its unread answers are bounded by its connections (``[sidecar.http]
max_connections``). Server reflection streams
(grpcurl's) are a third kind, with a small fixed limit (``REFLECTION_STREAMS``), so that idle
reflection streams cannot take Converse's slots; a refusal names the method refused and the kind
that is full. ``idle_limited`` ends a request stream that sends nothing for ``stream_idle_s``.
``DrainGate`` refuses new calls with UNAVAILABLE once the sidecar drains, ``wait_idle`` tells
the drain when the calls in flight are done, and ``cut_off`` ends those still running when the
grace period is over, with UNAVAILABLE (clients retry it; CANCELLED they do not).
"""

from __future__ import annotations

import asyncio
import contextvars
from collections.abc import AsyncIterator, Awaitable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

from google.protobuf.message import Message

from sidecar.edge.hangup import Hangups
from sidecar.edge.interceptor import MAX_METADATA_ENTRIES, OK, Call, Hook
from sidecar.edge.lifecycle import Lifecycle
from sidecar.errors import IdleTimeout, InvalidArgument, ResourceExhausted
from sidecar.turn.engine import MAX_SESSION_ID, MAX_TEXT_BYTES

_T = TypeVar("_T")

# gRPC's own hard limit on a call's metadata (``grpc.absolute_max_metadata_size``'s default). Its
# core holds a connection's later streams to it but not the first, whose metadata came in at 4 to
# 8 MiB: 1,024 health watches of 1 MiB each, each the first stream of its connection, held
# 1.35 GB. So every call's is counted here too (``check_metadata``).
MAX_METADATA_BYTES = 16 * 1024
# ... and at most ``MAX_METADATA_ENTRIES`` entries (``sidecar.edge.interceptor``).

REFLECTION_SERVICE = "grpc.reflection.v1alpha.ServerReflection"
# The context the limit's sweep runs in, made before any call's: scheduled from a call's end, it
# would carry that call's (its log ids: a line about three clients' connections named one's call).
NO_CALL = contextvars.copy_context()
# grpcurl opens one reflection stream per command and closes it within a second; a few at once
# are plenty, and with authentication each caller may hold REFLECTION_SHARE of them.
REFLECTION_STREAMS = 4
REFLECTION_SHARE = 2


class Pool:
    """One kind of call: its limit, how many are in flight, and each caller's share of them."""

    def __init__(self, key: str, what: str, limit: int, shares: Mapping[str, int]) -> None:
        if limit < 1:
            raise ValueError(f"{key} must be >= 1, got {limit}")
        self.key = key  # the config key that sets the limit (and a caller's share); "": fixed
        self.what = what  # "calls in flight", as a refusal names them
        self.limit = limit
        self.shares = dict(shares)
        self.in_flight = 0  # every call holding a slot, its answer held or its handler running
        # the calls whose handlers run, of each caller with a share (the others are not counted
        # apart: without authentication, none); a plain dict: a Counter's misses and deletes are
        # Python calls, on every call
        self.by_caller: dict[str, int] = {}
        # the calls of each caller with a share whose handlers are over, their answers held
        # (``hold``), and how many in all: the limit counts the others, as each caller's share
        # bounds these
        self.held_by: dict[str, int] = {}
        self.held = 0

    def take(self, caller: str, method: str) -> None:
        """A slot for ``caller``'s call of ``method``, or ResourceExhausted naming both the
        method refused and what is full."""
        share = self.shares.get(caller)
        if share is not None:
            self._within_share(caller, share, method)
        counted = self.in_flight - self.held
        if counted >= self.limit:
            where = f" ([sidecar] {self.key})" if self.key else ""
            raise ResourceExhausted(
                f"{method} refused: {counted} {self.what}, the limit is {self.limit}"
                f"{where}: retry with backoff"
            )
        self.in_flight += 1
        if share is not None:
            self.by_caller[caller] = self.by_caller.get(caller, 0) + 1

    def _within_share(self, caller: str, share: int, method: str) -> None:
        """Under ``share`` calls running, and at most ``share`` answers held: a caller whose last
        answer gRPC has not yet finished sending (its client may have read it) is not refused."""
        running = self.by_caller.get(caller, 0)
        if running >= share:
            raise ResourceExhausted(
                f"{method} refused: caller {caller!r} has {running} {self.what}, its share "
                f"({self._share(share)}): finish one, or retry with backoff"
            )
        held = self.held_by.get(caller, 0)
        if held > share:
            raise ResourceExhausted(
                f"{method} refused: caller {caller!r} has {held} answers unread, held until its "
                f"client reads them, over its share ({self._share(share)}): read them, or retry "
                "with backoff"
            )

    def _share(self, share: int) -> str:
        return f"[sidecar.auth.caller] {self.key} = {share}" if self.key else str(share)

    def hold(self, caller: str) -> None:
        """``caller``'s call's handler is over, its answer held: counted apart until ``give``."""
        if caller not in self.shares:
            return
        _less(self.by_caller, caller)
        self.held_by[caller] = self.held_by.get(caller, 0) + 1
        self.held += 1

    def give(self, caller: str, held: bool = False) -> None:
        """The slot of ``caller``'s call, its handler running, or its answer ``held``."""
        self.in_flight -= 1
        if caller not in self.shares:
            return
        if held:
            self.held -= 1
            _less(self.held_by, caller)
        else:
            _less(self.by_caller, caller)


def _less(counts: dict[str, int], caller: str) -> None:
    """One call fewer of ``caller`` in ``counts``; none: its entry gone."""
    left = counts[caller] - 1
    if left:
        counts[caller] = left
    else:
        del counts[caller]


# How long a call's answer may wait unread once its handler is over ([sidecar] stream_idle_s, the
# same bound a stream's unread answers get), and what the ended call is told.
UNREAD_S = 60.0
NEVER = float("-inf")  # a connection on which no held answer has gone out
# How many times ``unread_s`` a slow answer may keep its slot on a connection whose client reads
# its other answers: then it is ended, and its connection closed, all the same.
KEEP_READING = 2
UNREAD = "its answer was not read in time ([sidecar] stream_idle_s): call again and read it"


@dataclass(frozen=True, slots=True)
class HeldAnswer:
    """A call whose handler has ended while gRPC still holds its answer: since when, the slot
    it keeps, and its peer (its connection)."""

    since: float
    slot: Pool
    peer: str
    answered: bool  # its handler answered (not an error's bare status)


class ConcurrencyLimit(Hook):
    """Counts calls in flight, unary and streaming apart; used from the event loop only, so
    plain ints are enough. ``shares`` maps a caller's name to its (unary, streams) share."""

    def __init__(
        self,
        limit: int,
        max_streams: int | None = None,
        shares: Mapping[str, tuple[int, int]] | None = None,
        unread_s: float = UNREAD_S,
        hangups: Hangups | None = None,
    ) -> None:
        shares = shares or {}
        self.unread_s = unread_s  # how long an answer may be held unread before the call ends
        # the connections of clients that read none of their answers, closed (``_sweep``)
        self.hangups = Hangups() if hangups is None else hangups
        self.unary = Pool(
            "max_concurrent_rpcs",
            "calls in flight",
            limit,
            {name: unary for name, (unary, _) in shares.items()},
        )
        self.streams = Pool(
            "max_streams",
            "Converse streams open",
            limit if max_streams is None else max_streams,
            {name: streams for name, (_, streams) in shares.items()},
        )
        self.reflection = Pool(
            "",
            "server reflection streams open",
            REFLECTION_STREAMS,
            dict.fromkeys(shares, REFLECTION_SHARE),
        )
        self.refused = 0
        # calls whose handler has ended while gRPC still holds their answers, oldest first, with
        # when it ended and the slot it keeps (so their bytes stay bounded) until its client
        # reads them or goes, or ``unread_s`` passes (``_sweep``)
        self._held: dict[Call, HeldAnswer] = {}
        # each connection's (a call's peer's) calls held, and when an answer of one last went out
        # while others were held: its client reads (bounded by the slots: a peer's entries go
        # with its last held call)
        self._held_on: dict[str, int] = {}
        self._read_at: dict[str, float] = {}
        self._sweeping: asyncio.TimerHandle | None = None  # the one sweep due, if any
        self._calls: set[Call] = set()  # the calls holding a slot
        self._idle: asyncio.Event | None = None  # made on the loop, when a drain waits

    @property
    def lingering(self) -> int:
        """Calls whose handler has ended, their answers not yet sent."""
        return len(self._held)

    @property
    def limit(self) -> int:
        return self.unary.limit

    @property
    def in_flight(self) -> int:
        """Calls in flight, of every kind."""
        return self.unary.in_flight + self.streams.in_flight + self.reflection.in_flight

    async def wait_idle(self, deadline: float) -> bool:
        """Wait until no call is in flight or ``deadline`` (``loop.time()``) passes; whether
        the calls finished."""
        if self.in_flight == 0:
            return True
        self._idle = asyncio.Event()
        try:
            async with asyncio.timeout_at(deadline):
                await self._idle.wait()
        except TimeoutError:
            return False
        return True

    def cut_off(self, reason: str) -> int:
        """End every call in flight with UNAVAILABLE ``reason``; how many there were."""
        calls = list(self._calls)
        for call in calls:
            call.cut_off(reason)
        return len(calls)

    def start(self, call: Call) -> None:
        pool = self.unary
        if call.streaming:
            pool = self.reflection if call.service == REFLECTION_SERVICE else self.streams
        caller = "" if call.caller is None else call.caller.name  # no AttributeError made
        try:
            pool.take(caller, call.method)
        except ResourceExhausted:
            self.refused += 1
            raise
        call.slot = pool
        self._calls.add(call)

    def end(self, call: Call) -> None:
        """The call's handler is over: its slot is given back once gRPC is done with the call
        too, its answer read (a unary answer, or a stream's ended unread, ``written_within``,
        is held until its client reads it or goes, or ``unread_s`` passes and the call is ended):
        so the answers a client leaves unread are bounded by the slots, in calls and bytes, and
        in time. A caller's held answers are counted apart from its running calls
        (``Pool.hold``)."""
        slot: Pool | None = call.slot
        if slot is None:
            return
        call.slot = None
        if not call.answer_held():
            self._give(call, slot)
            return
        # a dict entry a call, and one timer for them all: a timer a call cost ~2 us of every one
        loop = asyncio.get_running_loop()
        slot.hold("" if call.caller is None else call.caller.name)
        # its peer read now: gRPC's call may be gone by the time it is done (``_lingered``)
        held = HeldAnswer(loop.time(), slot, call.peer(), call.code is OK)
        self._held[call] = held
        self._held_on[held.peer] = self._held_on.get(held.peer, 0) + 1
        if self._sweeping is None:  # run in no call's context: its lines are no call's
            self._sweeping = loop.call_later(self.unread_s, self._sweep, context=NO_CALL)
        # (grpc-stubs type the callback as a class of its own, not a callable)
        call.context.add_done_callback(lambda _: self._lingered(call))  # type: ignore[arg-type]

    def _lingered(self, call: Call) -> None:
        held = self._held.pop(call)
        self._give(call, held.slot, held=True)
        peer = held.peer
        left = self._held_on[peer] - 1
        if not left:
            del self._held_on[peer]
            self._read_at.pop(peer, None)
            return
        self._held_on[peer] = left
        if held.answered:  # (gone with the status alone, or cancelled, is no sign of reading)
            self._read_at[peer] = asyncio.get_running_loop().time()

    def _sweep(self) -> None:
        """End the calls whose answers have been held unread for ``unread_s`` (a client that
        stays connected and never reads would hold their slots for good: with no
        [sidecar.auth], every slot) and close their connections, which alone frees the answers
        gRPC holds (``sidecar.edge.hangup``); but where an answer went out on the same
        connection within ``unread_s``, the client reads its other calls, so its connection and
        the call's slot are kept, until ``KEEP_READING`` times ``unread_s`` (a client that
        cancels its calls looks like one that reads). Then sweep again when the next is due."""
        loop = asyncio.get_running_loop()
        now = loop.time()
        self._sweeping = None
        gone: set[str] = set()
        wait = self.unread_s
        for call, held in list(self._held.items()):
            if now - held.since < self.unread_s:
                wait = held.since + self.unread_s - now
                break
            reading = now - self._read_at.get(held.peer, NEVER) < self.unread_s
            if reading and now - held.since < KEEP_READING * self.unread_s:
                continue  # its client reads: only this answer is slow (the slot bounds it)
            call.cut_off(UNREAD)  # its slot comes back as gRPC ends the call (``_lingered``)
            gone.add(held.peer)
        self.hangups.soon(gone)
        if self._held:
            self._sweeping = loop.call_later(wait, self._sweep)

    def close(self) -> None:
        """The sidecar has stopped: no sweep is due, and the hang-ups' thread goes."""
        if self._sweeping is not None:
            self._sweeping.cancel()
            self._sweeping = None
        self.hangups.close()

    def _give(self, call: Call, pool: Pool, held: bool = False) -> None:
        pool.give("" if call.caller is None else call.caller.name, held)  # as it was taken
        self._calls.discard(call)
        if self._idle is not None and self.in_flight == 0:  # a drain waits (seldom): then count
            self._idle.set()


# What a Converse stream's idle refusal names: the setting, and how to go on.
STREAM_IDLE = "[sidecar] stream_idle_s"
CONVERSE_AGAIN = "open a new stream with the same session_id to go on"


async def idle_limited(
    requests: AsyncIterator[_T],
    idle_s: float,
    setting: str = STREAM_IDLE,
    again: str = CONVERSE_AGAIN,
) -> AsyncIterator[_T]:
    """``requests``, ended with ``IdleTimeout`` (DEADLINE_EXCEEDED) when the next one does not
    come within ``idle_s`` (``setting`` names where it is set, ``again`` how to go on): an
    abandoned stream gives its slot back."""
    iterator = aiter(requests)
    while True:
        try:
            async with asyncio.timeout(idle_s):
                request = await anext(iterator)
        except StopAsyncIteration:
            return
        except TimeoutError:
            raise IdleTimeout(
                f"no request on this stream for {idle_s:g} s ({setting}): it is closed; {again}"
            ) from None
        yield request


async def written_within(
    write: Awaitable[None],
    idle_s: float,
    setting: str = STREAM_IDLE,
    again: str = CONVERSE_AGAIN,
) -> None:
    """One answer of a stream written, ended with ``IdleTimeout`` (DEADLINE_EXCEEDED) when the
    client has not read enough of the answers before it to make room within ``idle_s``: a stream
    that sends and never reads would otherwise hold its slot once flow control is full."""
    try:
        async with asyncio.timeout(idle_s):
            await write
    except TimeoutError:
        raise IdleTimeout(
            f"this stream's answers were not read for {idle_s:g} s ({setting}): it is closed; "
            f"read each answer, and {again}"
        ) from None


# The most bytes (UTF-8) one text field of a request may hold, checked on every call before
# any work: a spoken turn is a few hundred characters (4000 at most, of up to 4 bytes each);
# names, ids and URLs are short. ``arguments_json`` is the model's, bounded by sidecar.functions.tools so
# that a model's mistake comes back to it as an error output.
TEXT_BYTES = MAX_TEXT_BYTES  # the engine's, so both say the same limit
MAX_PAGE_PATH = 4096  # a page's path or URL, as ReadPage and read_page take it
MAX_CALL_ID = 256  # InvokeTool's call_id: an API's call ids are a few dozen characters
FIELD_BYTES: dict[str, int | None] = {
    "text": TEXT_BYTES,
    "query": TEXT_BYTES,
    "source_path": MAX_PAGE_PATH,
    "context_url": 8 * 1024,
    "call_id": MAX_CALL_ID,
    "arguments_json": None,
    # InvokeTool's tool name: the model's, as its arguments are; one the toolbox does not know,
    # however long, comes back as an error output quoting its start (sidecar.functions.tools)
    "name": None,
}
NAME_BYTES = 1024  # any other string field: a name, an id
# A query is 4000 characters at most; a model's arguments larger than this are a runaway
# generation, refused before orjson builds objects from them (by sidecar.functions.tools, as an
# error output; by the adapters before they are sent).
MAX_ARGUMENTS_BYTES = 64 * 1024
MAX_REPEATED = 256  # entries of a repeated string field (sources: a base has a handful)
# A message this small (serialized, less its bytes fields: a query vector) has no field over
# any limit: a string is at most those bytes, and a repeated entry takes at least two (its tag
# and its length). Most requests are; only the larger ones are walked field by field.
SMALL_MESSAGE_BYTES = min(
    NAME_BYTES, 2 * MAX_REPEATED, *(limit for limit in FIELD_BYTES.values() if limit)
)


def utf8_size(text: str, limit: int) -> int:
    """The UTF-8 size of ``text``, or only a lower bound over ``limit`` when it is that long: a
    str of n characters is n to 4n bytes, so it is encoded only when the count cannot decide."""
    if len(text) > limit or 4 * len(text) <= limit:
        return len(text)
    return len(text.encode("utf-8", "surrogatepass"))


def arguments_too_large(size: int) -> str:
    """What a model is told of its arguments over ``MAX_ARGUMENTS_BYTES`` (``size``: their
    bytes, or a lower bound): the limit, and what to send instead."""
    return (
        f"arguments are {size} bytes or more; the limit is {MAX_ARGUMENTS_BYTES}: send an "
        'object like {"query": "how do I reset my password"}'
    )


def check_metadata(metadata: Sequence[tuple[str, Any]]) -> None:
    """InvalidArgument for a gRPC call's metadata of over ``MAX_METADATA_ENTRIES`` entries or
    ``MAX_METADATA_BYTES`` (keys and values; a value is ASCII, or bytes for a ``-bin`` key)."""
    if len(metadata) > MAX_METADATA_ENTRIES:
        raise InvalidArgument(
            f"the call's metadata has {len(metadata)} entries; the limit is "
            f"{MAX_METADATA_ENTRIES}: send fewer headers"
        )
    size = sum(len(key) + len(value) for key, value in metadata)
    if size > MAX_METADATA_BYTES:
        raise InvalidArgument(
            f"the call's metadata is {size} bytes; the limit is {MAX_METADATA_BYTES}: send "
            "fewer or smaller headers"
        )


def check_session_header(call_id: str, field: str) -> None:
    """Refuse a call id an HTTP caller sent for its session (a header, a webhook's field) longer
    than a session id may be (``MAX_SESSION_ID`` characters, within the hooks' byte limit on any
    id) before it is kept, naming ``field``, the one the caller sent it in: a request that feeds
    no turn (no messages, or none with words) is otherwise never checked, a session's entry
    would hold as much as a whole body, and the engine's refusal would name ``session_id``,
    which no platform sends (over MCP, as a tool error to the model, which sent no id)."""
    if len(call_id) > MAX_SESSION_ID:
        raise InvalidArgument(
            f"{field} is {len(call_id)} characters; the limit is {MAX_SESSION_ID}: send the "
            "platform's call id"
        )


class FieldLimits(Hook):
    """Refuses a gRPC call whose metadata is over ``MAX_METADATA_BYTES``, and a request with a
    text field over its byte limit (INVALID_ARGUMENT, naming it). (The HTTP door bounds its
    requests' heads itself.)"""

    def start(self, call: Call) -> None:
        if call.door == "grpc":
            check_metadata(call.metadata)  # type: ignore[arg-type]  # a gRPC call's are pairs

    def request(self, call: Call, message: Any) -> None:
        if _text_bytes(message) > SMALL_MESSAGE_BYTES:
            check_fields(message)


def _text_bytes(message: Message) -> int:
    """A bound on the bytes of any string in ``message`` (and on twice the entries of any
    repeated field): its serialized size less the values of its top-level bytes fields."""
    size: int = message.ByteSize()
    kind = type(message)
    names = _BYTES_FIELDS.get(kind)
    if names is None:
        names = _BYTES_FIELDS[kind] = _bytes_fields(kind)
    for name in names:
        size -= len(getattr(message, name))
    return size


# A message class's top-level bytes fields, found once per class: looked up by the class, where
# a cache keyed by its descriptor hashed the descriptor on every request (~0.6 us a Search).
_BYTES_FIELDS: dict[type[Message], tuple[str, ...]] = {}


def _bytes_fields(kind: type[Message]) -> tuple[str, ...]:
    return tuple(
        fd.name for fd in kind.DESCRIPTOR.fields if fd.type == fd.TYPE_BYTES and not fd.is_repeated
    )


def check_fields(message: Message, prefix: str = "") -> None:
    """Every string field of ``message`` (and of the messages in it) within its limit."""
    for fd, value in message.ListFields():
        name = prefix + fd.name
        repeated = fd.is_repeated
        if fd.type == fd.TYPE_MESSAGE:
            for inner in value if repeated else (value,):
                check_fields(inner, name + ".")
        elif fd.type == fd.TYPE_STRING:
            _check_strings(
                name, FIELD_BYTES.get(fd.name, NAME_BYTES), value if repeated else (value,)
            )


def _check_strings(name: str, limit: int | None, values: Sequence[str]) -> None:
    if len(values) > MAX_REPEATED:
        raise InvalidArgument(f"{name} has {len(values)} entries; the limit is {MAX_REPEATED}")
    if limit is None:
        return
    for text in values:
        size = utf8_size(text, limit)
        if size > limit:
            raise InvalidArgument(
                f"{name} is {'at least ' if len(text) > limit else ''}{size} bytes; the limit is "
                f"{limit}"
            )


class DrainGate(Hook):
    """Refuses every new call once the sidecar is draining (health checks are never hooked)."""

    def __init__(self, lifecycle: Lifecycle) -> None:
        self.lifecycle = lifecycle

    def start(self, call: Call) -> None:
        self.lifecycle.check_accepting()
