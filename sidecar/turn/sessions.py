"""Per-call memory: recent turns, the chunks recently retrieved, and what the call is about.

Sessions live in a bounded, expiring store: a session nobody ends is forgotten ``ttl_s`` after
its last use, and memory stays bounded in bytes under any number of calls. A session keeps at
most ``max_bytes`` (``[sidecar] max_session_bytes``): past that its oldest retained searches,
then its oldest turns, are dropped, the newest of each kept (a turn is what a follow-up reads;
a newest search over the whole bound on its own costs no turn, and leaves the session over its
bound until the next search replaces it). What it keeps is accounted as the bytes the session itself
allocates: its turns' text, its mentions' names and its retained chunks' strings
(``text_bytes``: 1 to 4 bytes a character, and a non-ASCII string's UTF-8 copy, which CPython
keeps in it once C code reads it so), what a door keeps of the call (``door_state``), and a fixed cost per turn, per entity
mention, per page the follow-ups count, per retained hit and chunk, and per session
(``TURN_BYTES``, ``MENTION_BYTES``, ``PAGE_BYTES``, ``HIT_BYTES``, ``CHUNK_BYTES``,
``SESSION_BYTES``, measured with tracemalloc in tests/test_sessions.py). A retained chunk is
counted whole: a snapshot's chunk table decodes a chunk of its own for each call and shares only
its last few MiB of them (``index.tables.CACHE_BYTES``), so a session keeping a hit may be the
only holder of its chunk (sessions over chunks of 27 KB held 44x what they counted as references).

With authentication on, sessions belong to the caller that made them: the store keys each by
``owner`` (the authenticated caller of the current call, set by ``sidecar.edge.auth``) and its id, so
two agents that pick the same session id never share memory and one cannot end the other's.
Each owner has its own quota of sessions and bytes (``[sidecar.auth.caller] max_sessions`` and
``session_memory_bytes``; without authentication the one owner has the whole store's): an owner
over its quota loses its own least recently used sessions, never another owner's. What an owner
holds outside its sessions for its calls (its MCP sessions, ``reserve``) counts in its bytes too.
"""

from __future__ import annotations

import re
import sys
import time
from collections import OrderedDict, deque
from collections.abc import Callable, Iterable, Mapping
from contextvars import ContextVar
from dataclasses import dataclass, field
from typing import Protocol

from index.types import Chunk, MetaValue
from sidecar.turn.hits import Hit

# The caller the current call belongs to ("": no authentication); set per call by sidecar.edge.auth.
owner: ContextVar[str] = ContextVar("owner", default="")


class Peered(Protocol):
    """What the turn layer reads of the call at hand: the connection it came by."""

    def peer(self) -> str: ...


# The call at hand (sidecar.edge.interceptor.Call), set once a call by sidecar.edge.logs, whose
# log lines read their ids from it (``logs.current`` is this variable), and where a handler's
# abort finds the call to end first (``sidecar.edge.interceptor.abort``). Lazy loads queue per
# connection (sidecar.snapshots.refresh.LoadQueue), so one client asking for many bases cannot
# hold back another's: its ``peer`` is read only when a load is queued (most calls never need it).
at_hand: ContextVar[Peered | None] = ContextVar("call", default=None)


def connection() -> str:
    """The peer address of the call at hand ("" outside a call)."""
    call = at_hand.get()
    return "" if call is None else call.peer()


RECENT_TURNS = 8  # turns remembered for follow-ups; a referent older than this is rarely meant
# Bytes, measured with tracemalloc (tests/test_sessions.py keeps them honest): a Session with
# its deques and its place in the store; a turn's (speaker, text) tuple beyond the text; a hit
# and its slot in the retained tuple (the chunk is the snapshot's).
SESSION_BYTES = 2048
TURN_BYTES = 64
HIT_BYTES = 96
CHUNK_BYTES = 200  # a decoded Chunk beyond its strings: its slots, the breadcrumbs' tuple
MENTION_BYTES = 64  # a Mention, beyond its name (decoded from the snapshot for each turn)
PAGE_BYTES = 100  # a page's slot in ``Session.pages`` and its float, beyond the name


class Speaker:
    """Who said a turn (``Said.speaker``; the engine's ``TurnInput.speaker``)."""

    USER = "user"
    AGENT = "agent"


@dataclass(frozen=True, slots=True)
class Mention:
    """An entity a turn names, and how sure the match is (``sidecar.turn.followups``)."""

    name: str
    confidence: float  # P(this entity | the matched words) from the snapshot's statistics


@dataclass(frozen=True, slots=True)
class Said:
    """One recorded turn: who said it, the words, and the entities it names (found once, when
    the turn is recorded), in the order they were said."""

    speaker: str
    text: str
    mentions: tuple[Mention, ...] = ()
    # whether it asks something (``followups.asks``), worked out when the engine recorded an
    # agent's turn, for the caller's turns after it; None: not worked out
    question: bool | None = None
    # the skip policy passed it over ("okay", "ok great thanks"): it asks nothing, and no
    # later turn is folded with its words (it still counts as a turn: a tracked entity fades)
    skipped: bool = False


@dataclass(slots=True)
class Session:
    """One call's memory: its recent turns (user and agent), the hits of its last
    ``context_turns`` searches, and the entity and topic follow-ups fold in."""

    session_id: str
    context_turns: int
    turns: deque[Said] = field(default_factory=lambda: deque(maxlen=RECENT_TURNS))
    retained: deque[tuple[Hit, ...]] = field(init=False)
    pages: dict[str, float] = field(default_factory=dict)  # entity -> how much turns found it
    unread: list[str] = field(default_factory=list)  # agent turns not yet counted in ``pages``
    # (each the str of one of ``turns``: it goes when its turn goes, see ``keep_unread``)
    entity: Mention | None = None  # the entity the conversation is about now (followups.py)
    weight: float = 0.0  # how strongly ``entity`` was last named; fades with each turn
    # the caller moved on from ``entity`` (``followups.leave``): folded only into a turn that
    # points back at it, until a turn names an entity again
    left: bool = False
    # the entities the agent last listed, in its order, each as sure as its naming was: kept
    # while the conversation names none outside them (``followups.remember``)
    options: tuple[Mention, ...] = ()
    turn_count: int = 0  # turns ever recorded; ``turns`` keeps only the recent ones
    # what a door keeps of the call beside its turns (the Vapi door: how much of the platform's
    # message list was fed, ``sidecar.http.webhooks.Fed``), counted in ``size`` as it says
    # (``keep_door_state``): so it is the owner's, under its quota, and goes when the session goes
    door_state: object | None = None
    max_bytes: int = 0  # what it may keep (0: no bound); see the module docstring
    size: int = 0  # the bytes it keeps now, as accounted
    # told (session, change in bytes) when ``size`` changes: the store's accounting
    on_resize: Callable[[Session, int], None] | None = field(default=None, repr=False)

    _page_bytes: int = field(default=0, init=False, repr=False)  # ``pages``' share of ``size``
    # ``turns``' share, counted when they change (as ``measure`` counts them), and ``retained``'s
    _turn_bytes: int = field(default=0, init=False, repr=False)
    _turn_sizes: deque[int] = field(init=False, repr=False)  # each turn's, in ``turns``' order
    _hit_bytes: int = field(default=0, init=False, repr=False)
    _door_bytes: int = field(default=0, init=False, repr=False)  # ``door_state``'s share
    # each retained search's bytes as counted when it was retained: what a search added is what
    # its drop takes off, whatever its strings hold by then
    _counted: deque[int] = field(init=False, repr=False)

    def __post_init__(self) -> None:
        self.retained = deque(maxlen=max(1, self.context_turns))
        self._counted = deque(maxlen=self.retained.maxlen)
        self._turn_sizes = deque(map(_said_bytes, self.turns), maxlen=self.turns.maxlen)
        self._turn_bytes = sum(self._turn_sizes)
        self.size = self.measure()

    def count_pages(self, found: Iterable[tuple[str, float]], keep: int) -> None:
        """Add what one search found (page, score) to ``pages``, keeping the ``keep`` pages most
        found; the pages count in the session's bytes (counted here, as they change)."""
        pages = self.pages
        for page, score in found:
            if page not in pages:
                pages[page] = 0.0
                self._page_bytes += PAGE_BYTES + text_bytes(page)
            pages[page] += score
        if len(pages) > keep:
            self.pages = dict(sorted(pages.items(), key=lambda kv: -kv[1])[:keep])
            self._page_bytes = _bytes_of_pages(self.pages)
        self.fit()

    def record_turn(
        self,
        speaker: str,
        text: str,
        mentions: tuple[Mention, ...] = (),
        question: bool | None = None,
        skipped: bool = False,
    ) -> Said:
        said = Said(speaker, text, mentions, question, skipped)
        size, sizes = _said_bytes(said), self._turn_sizes
        if len(sizes) == sizes.maxlen:  # the appends drop the oldest
            self._turn_bytes -= sizes[0]
        self.turns.append(said)
        sizes.append(size)
        self._turn_bytes += size
        self.turn_count += 1
        self.fit()
        return said

    def keep_unread(self, text: str, most: int) -> None:
        """Keep an agent turn's text (the last ``most`` of them; ``text`` is the str of a turn
        just recorded) to count the pages it is about at the next user turn, while its turn is
        kept."""
        self.unread = [*self.unread[-most + 1 :], text] if most > 1 else [text]
        self.fit()

    def keep_door_state(self, state: object, size: int) -> None:
        """Keep a door's ``state`` of the call (replacing the one kept), counted as ``size``
        bytes."""
        self.door_state, self._door_bytes = state, size
        self.fit()

    def retain(self, hits: Iterable[Hit]) -> None:
        hits = tuple(hits)
        if hits:
            counted = _hits_bytes(hits)
            if len(self._counted) == self._counted.maxlen:  # the appends drop the oldest
                self._hit_bytes -= self._counted[0]
            self.retained.append(hits)
            self._counted.append(counted)
            self._hit_bytes += counted
            self.fit()

    def measure(self) -> int:
        """The bytes the session keeps, as accounted (the module docstring says how), counted
        anew; ``fit`` keeps the same sum as the session changes (``_held``)."""
        turns = sum(map(_said_bytes, self.turns))
        hits = sum(self._counted)
        return SESSION_BYTES + turns + self._page_bytes + hits + self._door_bytes

    def _held(self) -> int:
        """``measure()`` from the shares counted as they change: a search or a page count
        walks no turn."""
        held = SESSION_BYTES + self._turn_bytes + self._page_bytes + self._hit_bytes
        return held + self._door_bytes

    def fit(self) -> None:
        """Drop the oldest searches, then the oldest turns, past ``max_bytes`` (``_shrunk``);
        then tell the store what changed."""
        size = self._held()
        if self.max_bytes and size > self.max_bytes:
            size = self._shrunk()
        if self.unread:
            self._unread_only_of_turns()
        change, self.size = size - self.size, size
        if change and self.on_resize is not None:
            self.on_resize(self, change)

    def _shrunk(self) -> int:
        """Drop the oldest searches (the newest stays: it is the turn's context), then the
        oldest turns (the newest stays), until within ``max_bytes``; the bytes then held. A
        newest search over the whole bound on its own costs no turn (one search of big chunks
        dropped every turn a follow-up reads): the session is over its bound by that search
        until the next replaces it."""
        turns, retained = self.turns, self.retained
        while len(retained) > 1 and self._held() > self.max_bytes:
            retained.popleft()
            self._hit_bytes -= self._counted.popleft()
        alone = self._counted[-1] if self._counted else 0
        spared = alone if alone > self.max_bytes else 0
        while len(turns) > 1 and self._held() - spared > self.max_bytes:
            turns.popleft()
            self._turn_bytes -= self._turn_sizes.popleft()
        return self._held()

    def _unread_only_of_turns(self) -> None:
        """An unread text is its turn's own str, counted with the turn: one whose turn was
        dropped goes with it (4 agent turns of 16 kB outlived their turns, uncounted)."""
        held = {id(said.text) for said in self.turns}
        if not all(id(text) in held for text in self.unread):
            self.unread = [text for text in self.unread if id(text) in held]

    def context(self, limit: int) -> list[Hit]:
        """Retained chunks, newest turn first, each chunk once (its newest occurrence)."""
        seen: set[tuple[str, str]] = set()
        out: list[Hit] = []
        for hits in reversed(self.retained):
            for hit in hits:
                key = (hit.knowledge_base, hit.chunk.chunk_id)
                if key not in seen:
                    seen.add(key)
                    out.append(hit)
        return out[:limit]


def _said_bytes(said: Said) -> int:
    """One recorded turn's share of a session's bytes: its text, its slot, its mentions with
    their names (each a string of its own: a snapshot's owner names may be 36 KiB long)."""
    mentions = sum(MENTION_BYTES + text_bytes(m.name) for m in said.mentions)
    return TURN_BYTES + text_bytes(said.text) + mentions


def _hits_bytes(hits: tuple[Hit, ...]) -> int:
    """A retained search's share of a session's bytes: each hit, and its chunk whole."""
    return sum([HIT_BYTES + _chunk_bytes(hit.chunk) for hit in hits])


def _chunk_bytes(chunk: Chunk) -> int:
    """A decoded chunk's strings and metadata (its source name is the table's, shared)."""
    size = text_bytes
    held = (
        size(chunk.chunk_id) + size(chunk.source_path) + size(chunk.title) + size(chunk.text)
        + size(chunk.embed_text) + size(chunk.url) + CHUNK_BYTES
    )  # fmt: skip
    for crumb in chunk.breadcrumbs:
        held += size(crumb)
    if chunk.metadata:
        held += sum([size(k) + _value_bytes(v) for k, v in chunk.metadata.items()])
    return held


def _value_bytes(value: MetaValue) -> int:
    """A metadata value's bytes: a string, or a tuple of them."""
    if isinstance(value, tuple):
        return sys.getsizeof(value) + sum(map(text_bytes, value))
    return text_bytes(value)


def _bytes_of_pages(pages: Mapping[str, float]) -> int:
    return PAGE_BYTES * len(pages) + sum(map(text_bytes, pages))


# A non-ASCII str's header (CPython's compact form), read off a fresh one of two characters and
# no UTF-8 copy: its size is this plus (length + 1) x its kind (1, 2 or 4 bytes a character).
_COMPACT_HEADER = sys.getsizeof("\u00e9" * 2) - 3
_WIDE = re.compile("[\u0100-\U0010ffff]")  # a character of 2 bytes or more as CPython holds it
_ASTRAL = re.compile("[\U00010000-\U0010ffff]")  # one of 4


def text_bytes(text: str) -> int:
    """What ``text`` holds, with the UTF-8 copy CPython keeps in a non-ASCII str once C code
    reads it so (protobuf writing a response, orjson, the tokenizer), made or not yet: the
    same count before and after. ``sys.getsizeof`` counts that copy only once it is there, and
    a session counting a turn before it was made grew past its count (a 16 KB turn of 4-byte
    characters, by 15,971 bytes). An ASCII str's UTF-8 is its own bytes. Its kind is read by a
    scan in C (``max(text)`` made a str a character: 0.7 ms for a 16 KB turn)."""
    if text.isascii():
        return sys.getsizeof(text)
    wide = _WIDE.search(text)
    kind = 1 if wide is None else 4 if _ASTRAL.search(text, wide.start()) else 2
    utf8 = len(text.encode("utf-8", "surrogatepass")) + 1
    return _COMPACT_HEADER + (len(text) + 1) * kind + utf8


@dataclass(frozen=True, slots=True)
class Usage:
    sessions: int
    bytes: int


class _Shelf:
    """One owner's sessions, least recently used first, with when each expires, and its quota."""

    def __init__(self, max_sessions: int, max_bytes: int) -> None:
        self.max_sessions = max_sessions
        self.max_bytes = max_bytes
        self.sessions: OrderedDict[str, tuple[Session, float]] = OrderedDict()
        self.bytes = 0  # its sessions' and what is held outside them (``reserved``)
        self.reserved = 0  # counted by ``SessionStore.reserve``: never evicted


class SessionStore:
    """A bounded, expiring map of (owner, session id) -> Session, the owner being the current
    call's caller. Used from the event loop only; ``count`` and ``bytes`` are plain ints another
    thread may read (the metrics endpoint)."""

    def __init__(
        self,
        max_sessions: int,
        ttl_s: float,
        context_turns: int,
        timer: Callable[[], float] = time.monotonic,
        *,
        max_session_bytes: int = 0,
        max_bytes: int = sys.maxsize,
        quotas: Mapping[str, tuple[int, int]] | None = None,
    ) -> None:
        """``quotas`` maps an owner to its (sessions, bytes); any other owner may use the
        whole store's (``max_sessions``, ``max_bytes``)."""
        self._ttl = ttl_s
        self._timer = timer
        self._context_turns = context_turns
        self._max_session_bytes = max_session_bytes
        self._default = (max_sessions, max_bytes)
        self._quotas = dict(quotas or {})
        self._shelves: dict[str, _Shelf] = {}
        self.count = 0  # sessions held, expired ones not yet dropped included
        self.bytes = 0  # what they keep, as accounted, and what ``reserve`` holds

    def get(self, session_id: str) -> Session:
        """The session, created on first use; an empty id gets a throwaway session."""
        if not session_id:
            return self._new("")
        self.expire()
        shelf = self._shelf(owner.get())
        entry = shelf.sessions.pop(session_id, None)
        session = entry[0] if entry is not None else self._adopt(shelf, self._new(session_id))
        shelf.sessions[session_id] = (session, self._timer() + self._ttl)  # the newest now
        self._evict(shelf, keep=session)
        return session

    def peek(self, session_id: str) -> Session | None:
        """The live session, if any, without refreshing its TTL or its place in the LRU order."""
        shelf = self._shelves.get(owner.get())
        entry = shelf.sessions.get(session_id) if shelf is not None else None
        if entry is None or entry[1] <= self._timer():
            return None
        return entry[0]

    def end(self, session_id: str) -> bool:
        """Forget a session now; False when there was none (never seen, ended or expired)."""
        self.expire()
        shelf = self._shelves.get(owner.get())
        return shelf is not None and self._drop(shelf, session_id)

    def usage(self, of: str | None = None) -> Usage:
        """Sessions and bytes held: of one owner, or (None) of all."""
        self.expire()
        if of is None:
            return Usage(self.count, self.bytes)
        shelf = self._shelves.get(of)
        return Usage(len(shelf.sessions), shelf.bytes) if shelf else Usage(0, 0)

    def reserve(self, of: str, size: int) -> bool:
        """Count ``size`` bytes held outside the sessions (an MCP session's, which the SDK
        keeps) in owner ``of``'s bytes, if they fit in its share beside what it holds. False,
        nothing counted, when they do not: a reservation never evicts a session (without auth
        every MCP session's goes to the one owner "", whose sessions are every live call's)."""
        shelf = self._shelf(of)
        if shelf.bytes + size > shelf.max_bytes:
            return False
        self._resize(shelf, size)
        return True

    def release(self, of: str, size: int) -> None:
        """Give back ``size`` bytes ``reserve`` counted."""
        self._resize(self._shelf(of), -size)

    def _resize(self, shelf: _Shelf, change: int) -> None:
        shelf.reserved += change
        shelf.bytes += change
        self.bytes += change

    def __len__(self) -> int:
        self.expire()
        return self.count

    def expire(self) -> None:
        """Drop every session past its TTL (the oldest of each shelf come first)."""
        now = self._timer()
        for shelf in self._shelves.values():
            while shelf.sessions:
                sid, (_, expires) = next(iter(shelf.sessions.items()))
                if expires > now:
                    break
                self._drop(shelf, sid)

    # -- accounting ----------------------------------------------------------------------------

    def _new(self, session_id: str) -> Session:
        return Session(session_id, self._context_turns, max_bytes=self._max_session_bytes)

    def _shelf(self, name: str) -> _Shelf:
        shelf = self._shelves.get(name)
        if shelf is None:
            shelf = self._shelves[name] = _Shelf(*self._quotas.get(name, self._default))
        return shelf

    def _adopt(self, shelf: _Shelf, session: Session) -> Session:
        def resized(changed: Session, change: int) -> None:
            entry = shelf.sessions.get(changed.session_id)
            if entry is None or entry[0] is not changed:
                return  # evicted or ended while a call still held it: no longer counted
            shelf.bytes += change
            self.bytes += change
            self._evict(shelf, keep=changed)

        session.on_resize = resized
        shelf.bytes += session.size
        self.bytes += session.size
        self.count += 1
        return session

    def _drop(self, shelf: _Shelf, session_id: str) -> bool:
        entry = shelf.sessions.pop(session_id, None)
        if entry is None:
            return False
        shelf.bytes -= entry[0].size
        self.bytes -= entry[0].size
        self.count -= 1
        return True

    def _evict(self, shelf: _Shelf, keep: Session | None) -> None:
        """The owner's least recently used sessions go while it is over its quota; never
        ``keep`` (the one in use), never another owner's."""
        while shelf.sessions and (
            len(shelf.sessions) > shelf.max_sessions or shelf.bytes > shelf.max_bytes
        ):
            oldest = next(iter(shelf.sessions))
            if shelf.sessions[oldest][0] is keep:
                if len(shelf.sessions) == 1:
                    return
                shelf.sessions.move_to_end(oldest)
                continue
            self._drop(shelf, oldest)
