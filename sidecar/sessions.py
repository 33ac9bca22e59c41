"""Per-call memory: recent turns, the chunks recently retrieved, and what the call is about.

Sessions live in a bounded TTL cache: memory stays bounded under any number of calls (at most
``max_sessions`` sessions of at most ``RECENT_TURNS`` turns and ``context_turns`` searches each),
the least recently used goes first when it is full, and a session nobody ends is forgotten
``ttl_s`` after its last turn.

With authentication on, sessions belong to the caller that made them: the store keys each by
``owner`` (the authenticated caller of the current call, set by ``sidecar.auth``) and its id, so
two agents that pick the same session id never share memory and one cannot end the other's.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Iterable
from contextvars import ContextVar
from dataclasses import dataclass, field

from cachetools import Cache, TTLCache

from index.types import Chunk

# The caller the current call belongs to ("": no authentication); set per call by sidecar.auth.
owner: ContextVar[str] = ContextVar("owner", default="")

RECENT_TURNS = 8  # turns remembered for follow-ups; a referent older than this is rarely meant


@dataclass(frozen=True, slots=True)
class Mention:
    """An entity a turn names, and how sure the match is (``sidecar.followups``)."""

    name: str
    confidence: float  # P(this entity | the matched words) from the snapshot's statistics


@dataclass(frozen=True, slots=True)
class Said:
    """One recorded turn: who said it, the words, and the entities it names (found once, when
    the turn is recorded), in the order they were said."""

    speaker: str
    text: str
    mentions: tuple[Mention, ...] = ()


@dataclass(frozen=True, slots=True)
class Hit:
    """A chunk as one search returned it."""

    knowledge_base: str
    chunk: Chunk
    score: float


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
    entity: Mention | None = None  # the entity the conversation is about now (followups.py)
    weight: float = 0.0  # how strongly ``entity`` was last named; fades with each turn
    options: tuple[str, ...] = ()  # the entities the agent last listed, in its order
    turn_count: int = 0  # turns ever recorded; ``turns`` keeps only the recent ones

    def __post_init__(self) -> None:
        self.retained = deque(maxlen=max(1, self.context_turns))

    def record_turn(self, speaker: str, text: str, mentions: tuple[Mention, ...] = ()) -> Said:
        said = Said(speaker, text, mentions)
        self.turns.append(said)
        self.turn_count += 1
        return said

    def retain(self, hits: Iterable[Hit]) -> None:
        hits = tuple(hits)
        if hits:
            self.retained.append(hits)

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


class SessionStore:
    """A bounded, expiring map of (owner, session id) -> Session, the owner being the current
    call's caller. Used from the event loop only."""

    def __init__(
        self,
        max_sessions: int,
        ttl_s: float,
        context_turns: int,
        timer: Callable[[], float] = time.monotonic,
    ) -> None:
        self._cache: TTLCache[tuple[str, str], Session] = TTLCache(
            maxsize=max_sessions, ttl=ttl_s, timer=timer
        )
        self._context_turns = context_turns

    def get(self, session_id: str) -> Session:
        """The session, created on first use; an empty id gets a throwaway session."""
        if not session_id:
            return Session(session_id="", context_turns=self._context_turns)
        key = (owner.get(), session_id)
        session = self._cache.get(key)
        if session is None:
            session = Session(session_id=session_id, context_turns=self._context_turns)
        self._cache[key] = session  # re-inserting refreshes the TTL
        return session

    def peek(self, session_id: str) -> Session | None:
        """The live session, if any, without refreshing its TTL or its place in the LRU order."""
        key = (owner.get(), session_id)
        if key not in self._cache:  # checks expiry, leaves the order alone
            return None
        return Cache.__getitem__(self._cache, key)  # TTLCache's own getitem reorders

    def end(self, session_id: str) -> bool:
        """Forget a session now; False when there was none (never seen, ended or expired)."""
        return self._cache.pop((owner.get(), session_id), None) is not None

    def __len__(self) -> int:
        self._cache.expire()
        return len(self._cache)
