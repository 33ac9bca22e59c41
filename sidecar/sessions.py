"""Per-call memory: recent turns, the chunks recently retrieved, and the current topic.

Sessions live in a bounded TTL cache: memory stays bounded under any number of calls, and a
session nobody ends is forgotten ``ttl_s`` after its last turn.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass, field

from cachetools import TTLCache

from index.types import Chunk

RECENT_TURNS = 8  # turns remembered for follow-ups; a referent older than this is rarely meant


@dataclass(frozen=True, slots=True)
class Hit:
    """A chunk as one search returned it."""

    knowledge_base: str
    chunk: Chunk
    score: float


@dataclass(slots=True)
class Session:
    session_id: str
    context_turns: int
    turns: deque[tuple[str, str]] = field(default_factory=lambda: deque(maxlen=RECENT_TURNS))
    retained: deque[tuple[Hit, ...]] = field(init=False)
    topic: str = ""  # the title of the last top hit: a follow-up's fallback referent
    entities: tuple[str, ...] = ()  # the entities the conversation is about now (followups.py)
    subject: str = ""  # the content words of the caller's last self-contained turn
    turn_count: int = 0  # turns ever recorded; ``turns`` keeps only the recent ones
    scanned: int = 0  # turn_count when follow-ups last scanned the turns for entities

    def __post_init__(self) -> None:
        self.retained = deque(maxlen=max(1, self.context_turns))

    def record_turn(self, speaker: str, text: str) -> None:
        self.turns.append((speaker, text))
        self.turn_count += 1

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
    """A bounded, expiring map of session id -> Session. Used from the event loop only."""

    def __init__(self, max_sessions: int, ttl_s: float, context_turns: int) -> None:
        self._cache: TTLCache[str, Session] = TTLCache(maxsize=max_sessions, ttl=ttl_s)
        self._context_turns = context_turns

    def get(self, session_id: str) -> Session:
        """The session, created on first use; an empty id gets a throwaway session."""
        if not session_id:
            return Session(session_id="", context_turns=self._context_turns)
        session = self._cache.get(session_id)
        if session is None:
            session = Session(session_id=session_id, context_turns=self._context_turns)
        self._cache[session_id] = session  # re-inserting refreshes the TTL
        return session

    def end(self, session_id: str) -> bool:
        return self._cache.pop(session_id, None) is not None

    def __len__(self) -> int:
        self._cache.expire()
        return len(self._cache)
