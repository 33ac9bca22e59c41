"""Sessions: retained context, a bounded expiring store, and EndSession."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import grpc
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from index.types import Chunk
from sidecar.gen import retrieval_pb2 as pb
from sidecar.gen import retrieval_pb2_grpc as pb_grpc
from sidecar.sessions import RECENT_TURNS, Hit, Session, SessionStore


def hit(chunk_id: str, kb: str = "kb") -> Hit:
    chunk = Chunk(
        chunk_id=chunk_id,
        source="s",
        source_path=f"{chunk_id}.md",
        title=chunk_id,
        breadcrumbs=(chunk_id,),
        text=chunk_id,
        embed_text=chunk_id,
    )
    return Hit(knowledge_base=kb, chunk=chunk, score=0.5)


def ids(hits: list[Hit]) -> list[str]:
    return [h.chunk.chunk_id for h in hits]


def test_context_is_the_newest_turns_chunks_each_once() -> None:
    session = Session("s", context_turns=2)
    session.retain([hit("a"), hit("b")])
    session.retain([])  # a search that found nothing keeps what was retained
    session.retain([hit("c"), hit("a")])
    assert ids(session.context(10)) == ["c", "a", "b"]
    assert ids(session.context(2)) == ["c", "a"]
    session.retain([hit("d")])  # the first search falls out: two turns' worth
    assert ids(session.context(10)) == ["d", "c", "a"]
    session.retain([hit("d", kb="other")])  # same id in another base is another chunk
    assert [(h.knowledge_base, h.chunk.chunk_id) for h in session.context(10)] == [
        ("other", "d"),
        ("kb", "d"),
    ]


def test_turns_are_bounded_but_counted() -> None:
    session = Session("s", context_turns=3)
    for i in range(RECENT_TURNS + 5):
        session.record_turn("user", f"turn {i}")
    assert len(session.turns) == RECENT_TURNS
    assert (session.turns[-1].speaker, session.turns[-1].text) == (
        "user",
        f"turn {RECENT_TURNS + 4}",
    )
    assert session.turn_count == RECENT_TURNS + 5


# -- model-based: SessionStore + Session against a plain-dict model --------------------------------

TTL = 10.0
MAX_SESSIONS = 3
CONTEXT_TURNS = 2
SESSION_IDS = st.sampled_from(["a", "b", "c", "d", "e"])
CHUNK_IDS = st.lists(st.sampled_from(["x", "y", "z", "w"]), max_size=3)


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


@dataclass
class ModelSession:
    touched: float
    turns: list[str] = field(default_factory=list)
    searches: list[list[str]] = field(default_factory=list)


class SessionStoreMachine(RuleBasedStateMachine):
    """Sessions expire TTL after their last use; when full, the least recently used goes."""

    @initialize()
    def start(self) -> None:
        self.clock = Clock()
        self.store = SessionStore(MAX_SESSIONS, TTL, CONTEXT_TURNS, timer=self.clock)
        self.model: dict[str, ModelSession] = {}  # insertion order = least recently used first

    def _expire(self) -> None:
        for sid in [s for s, m in self.model.items() if self.clock.now >= m.touched + TTL]:
            del self.model[sid]

    @rule(seconds=st.floats(min_value=0, max_value=2 * TTL))
    def wait(self, seconds: float) -> None:
        self.clock.now += seconds

    @rule(sid=SESSION_IDS, text=st.text(max_size=5), chunks=CHUNK_IDS)
    def turn(self, sid: str, text: str, chunks: list[str]) -> None:
        session = self.store.get(sid)
        session.record_turn("user", text)
        session.retain(hit(c) for c in chunks)

        self._expire()
        entry = self.model.pop(sid, None) or ModelSession(touched=self.clock.now)
        if len(self.model) == MAX_SESSIONS:
            del self.model[next(iter(self.model))]
        entry.touched = self.clock.now
        entry.turns.append(text)
        if chunks:
            entry.searches.append(chunks)
        self.model[sid] = entry

    @rule(sid=SESSION_IDS)
    def end(self, sid: str) -> None:
        self._expire()
        assert self.store.end(sid) == (self.model.pop(sid, None) is not None)

    @rule(text=st.text(max_size=5))
    def anonymous_turn(self, text: str) -> None:
        session = self.store.get("")
        session.record_turn("user", text)
        assert len(session.turns) == 1  # a throwaway, never stored

    @invariant()
    def agrees_with_the_model(self) -> None:
        self._expire()
        assert len(self.store) == len(self.model) <= MAX_SESSIONS
        assert all(self.store.peek(sid) is None for sid in "abcde" if sid not in self.model)
        for sid, entry in self.model.items():
            session = self.store.peek(sid)
            assert session is not None
            assert [said.text for said in session.turns] == entry.turns[-RECENT_TURNS:]
            expected: list[str] = []
            for chunks in reversed(entry.searches[-CONTEXT_TURNS:]):
                for c in chunks:
                    if c not in expected:
                        expected.append(c)
            assert ids(session.context(100)) == expected
            assert ids(session.context(2)) == expected[:2]


TestSessionStore = SessionStoreMachine.TestCase
TestSessionStore.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)


# -- through a real server -------------------------------------------------------------------------


async def test_context_survives_a_skipped_turn_and_end_session_frees_it(wt_sidecar: Any) -> None:
    async with grpc.aio.insecure_channel(f"127.0.0.1:{wt_sidecar.port}") as channel:
        client = pb_grpc.RetrievalStub(channel)

        async def say(text: str, sid: str = "ctx") -> Any:
            request = pb.TurnRequest(session_id=sid, text=text, is_final=True)
            return await client.Turn(request, timeout=10)

        first = await say("How do I change the color scheme?")
        second = await say("How do I open a new tab?")
        thanks = await say("Thank you very much.")
        assert first.chunks
        assert second.chunks
        assert thanks.skipped == pb.CLOSING
        assert not thanks.chunks
        retained = [c.chunk_id for c in thanks.context]
        newer = [c.chunk_id for c in second.chunks]
        assert retained == newer + [c.chunk_id for c in first.chunks if c.chunk_id not in newer]
        other = await say("Thank you very much.", sid="someone-else")
        assert not other.context

        ended = await client.EndSession(pb.EndSessionRequest(session_id="ctx"), timeout=10)
        again = await client.EndSession(pb.EndSessionRequest(session_id="ctx"), timeout=10)
        assert ended.existed
        assert not again.existed
        assert not (await say("Thank you very much.")).context
