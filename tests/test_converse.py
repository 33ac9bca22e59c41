"""Converse: interim transcripts searched ahead, finals answered from the prefetch when they
match. A real grpc.aio server on port 0, the real embedded model, the example help centre."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Sequence
from dataclasses import replace
from typing import Any

import grpc
import pytest

from index.embedders.base import Embedder, EmbedderInfo, Vectors
from index.types import MetadataFilter
from sidecar.config import Config
from sidecar.edge.lifecycle import State
from sidecar.edge.server import Sidecar, create_server
from sidecar.gen import retrieval_pb2 as pb
from sidecar.gen import retrieval_pb2_grpc as pb_grpc
from sidecar.turn.engine import MAX_READ_LATER, PlannedSearch, TurnInput
from sidecar.turn.prefetch import (
    PREFETCH_BURST,
    REFUSAL_LOG_BYTES,
    Prefetcher,
    normalise,
    words_match,
)
from tests.conftest import eventually

BUDGET_MS = 5000  # generous: these tests are about matching, not about the embedder's speed


def interim(text: str, session: str = "call", **fields: Any) -> pb.ConverseRequest:
    return pb.ConverseRequest(
        turn=pb.TurnRequest(session_id=session, text=text, is_final=False, **fields)
    )


def final(text: str, session: str = "", **fields: Any) -> pb.ConverseRequest:
    fields.setdefault("budget_ms", BUDGET_MS)
    return pb.ConverseRequest(
        turn=pb.TurnRequest(session_id=session, text=text, is_final=True, **fields)
    )


PASSWORD = "How do I reset my password?"


def prefetch_tasks() -> list[asyncio.Task[Any]]:
    return [t for t in asyncio.all_tasks() if t.get_name().startswith("voxrecall-prefetch")]


@pytest.fixture
async def stream(example_sidecar: Sidecar) -> AsyncIterator[Any]:
    async with grpc.aio.insecure_channel(f"127.0.0.1:{example_sidecar.port}") as channel:
        call = pb_grpc.RetrievalStub(channel).Converse(timeout=60)
        yield call
        call.cancel()


# -- the rules -------------------------------------------------------------------------------


def test_normalised_words_ignore_case_and_punctuation() -> None:
    assert normalise("How do I  split a PANE?") == ("how", "do", "i", "split", "a", "pane")
    assert normalise("Don’t close it.") == ("don't", "close", "it")


@pytest.mark.parametrize(
    ("ahead", "final_text", "match"),
    [
        ("How do I split a pane?", "how do i split a pane", True),
        (
            "how do I split a pane in windows terminal",
            "How do I split a pane in Windows Terminal please",
            True,
        ),
        ("split the pane", "split the pane in two", False),
        ("How do I split a pane?", "How do I change the color scheme?", False),
    ],
)
def test_close_enough(ahead: str, final_text: str, match: bool) -> None:
    assert words_match(normalise(ahead), normalise(final_text)) is match


# -- over the wire ---------------------------------------------------------------------------


async def plain_turn(
    sidecar: Sidecar, text: str, session: str = "plain", **fields: Any
) -> pb.TurnResponse:
    """What the Turn RPC answers for these words in a fresh session (or ``session``)."""
    async with grpc.aio.insecure_channel(f"127.0.0.1:{sidecar.port}") as channel:
        resp: pb.TurnResponse = await pb_grpc.RetrievalStub(channel).Turn(
            pb.TurnRequest(
                session_id=session, text=text, is_final=True, budget_ms=BUDGET_MS, **fields
            ),
            timeout=30,
        )
        return resp


async def test_final_is_answered_from_a_prefetched_pause(
    example_sidecar: Sidecar, stream: Any
) -> None:
    question = "How much does roaming cost in Europe?"
    await stream.write(interim("How much does"))
    await stream.write(interim(question))  # a pause: searched ahead at once
    await stream.write(final(question))
    resp = await stream.read()
    assert resp.prefetched
    assert resp.transcript == question
    assert not resp.turn.degraded
    plain = await plain_turn(example_sidecar, question)
    assert resp.turn.chunks
    assert [c.chunk_id for c in resp.turn.chunks] == [c.chunk_id for c in plain.chunks]
    assert example_sidecar.engine.counters.prefetch_started == 1
    assert example_sidecar.engine.counters.prefetched == 1


async def test_long_interims_on_many_streams_start_no_search_ahead(
    example_sidecar: Sidecar,
) -> None:
    """A flood's streams of long punctuated interims (the attack: each one embedded ahead on
    the worker, queueing other callers' finals) start no prefetch; a final on such a stream is
    searched as usual."""
    rambling = "How do I reset my password on my roaming plan and my voicemail " * 10 + "?"
    async with grpc.aio.insecure_channel(f"127.0.0.1:{example_sidecar.port}") as channel:
        calls = [pb_grpc.RetrievalStub(channel).Converse(timeout=60) for _ in range(4)]
        for i, call in enumerate(calls):
            for n in range(5):
                await call.write(interim(f"{n} {rambling}", session=f"flood{i}"))
        await calls[0].write(final(rambling, session="flood0"))
        resp = await calls[0].read()
        counters = example_sidecar.engine.counters
        # streams 1-3 have no final: the server reads their interims in its own time
        await eventually(lambda: counters.prefetch_too_long == 20, "every stream's interims")
        for call in calls:
            await call.done_writing()
    assert counters.prefetch_started == 0
    assert not resp.prefetched
    assert not resp.turn.degraded
    assert resp.turn.chunks


@pytest.fixture
async def slow_bound_sidecar(
    example_config: Config, local_embedder: Embedder
) -> AsyncIterator[Sidecar]:
    """The example sidecar with a prefetch window no test outlives: what its bound holds back
    is never started, however slowly the server reads a stream."""
    sidecar_config = replace(example_config.sidecar, prefetch_stable_ms=60_000)
    config = replace(example_config, sidecar=sidecar_config)
    sidecar = await create_server(config, embedder=local_embedder, poll=False)
    yield sidecar
    await sidecar.stop(0.5)


@pytest.mark.parametrize("final_filtered", [True, False])
async def test_refused_interims_are_planned_a_burst_and_said_once(
    slow_bound_sidecar: Sidecar, caplog: pytest.LogCaptureFixture, final_filtered: bool
) -> None:
    """50 punctuated interims filtered on a field the base has no index for (1 KiB of name):
    PREFETCH_BURST of them are planned (each planned and logged its 1.2 KB refusal at INFO), the
    refusal is said once at INFO, cut, and counted; the final answers as Turn would: its own
    INVALID_ARGUMENT with the filter, its pages without."""
    engine = slow_bound_sidecar.engine
    plans = 0
    real_plan = engine.plan

    def plan(req: TurnInput) -> PlannedSearch | None:
        nonlocal plans
        plans += 1
        return real_plan(req)

    engine.plan = plan  # type: ignore[method-assign]
    bad = [pb.MetadataFilter(field="x" * 1024, any_of=["y"])]
    caplog.set_level(logging.DEBUG, logger="voxrecall.prefetch")
    async with grpc.aio.insecure_channel(f"127.0.0.1:{slow_bound_sidecar.port}") as channel:
        call = pb_grpc.RetrievalStub(channel).Converse(timeout=60)
        for i in range(50):
            await call.write(interim(f"How do I reset my password, take {i}?", filters=bad))
        await call.write(final(PASSWORD, session="call", filters=bad if final_filtered else []))
        if final_filtered:
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await call.read()
            assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        else:
            resp = await call.read()
            assert "reset-password.md" in [c.source_path for c in resp.turn.chunks]
            await call.done_writing()
    said = [r for r in caplog.records if r.name == "voxrecall.prefetch"]
    assert plans == PREFETCH_BURST
    assert engine.counters.prefetch_refused == PREFETCH_BURST
    assert engine.counters.prefetch_started == 0
    assert [r.levelno for r in said] == [logging.INFO] + [logging.DEBUG] * (PREFETCH_BURST - 1)
    assert len(said[0].getMessage().encode()) <= REFUSAL_LOG_BYTES + len("no prefetch: ")


async def test_words_unchanged_for_a_while_are_prefetched(
    example_sidecar: Sidecar, stream: Any
) -> None:
    await stream.write(interim("how much does roaming cost in europe on my plan"))
    await eventually(lambda: example_sidecar.engine.counters.prefetch_started == 1)
    await stream.write(final("How much does roaming cost in Europe on my plan please"))
    resp = await stream.read()
    assert resp.prefetched
    assert "please" not in resp.turn.query  # what was searched: the prefetched words
    plain = await plain_turn(example_sidecar, "how much does roaming cost in europe on my plan")
    assert resp.turn.chunks
    assert [c.chunk_id for c in resp.turn.chunks] == [c.chunk_id for c in plain.chunks]


ROAMING = "How much does roaming cost in Europe?"
FOLLOW_UP = "and what about calls to my home country"  # folded with ROAMING, searched alone too


async def test_a_folded_final_reads_the_vectors_its_unpunctuated_interim_embedded(
    example_sidecar: Sidecar, stream: Any
) -> None:
    """A follow-up's final searches both its folded query and its words alone, so it is never
    answered from its prefetch; its interim said the same words without the "?" a recogniser
    adds to the final, and the final ranks both from the vectors the prefetch embedded for
    them, embedding nothing itself: answered as its interim's words would be."""
    engine = example_sidecar.engine
    await stream.write(final(ROAMING, session="call"))
    await stream.read()
    planned = engine.plan(TurnInput(session_id="call", text=FOLLOW_UP, is_final=False))
    assert planned is not None
    assert planned.alone == FOLLOW_UP  # folded, and searched alone too
    await stream.write(interim(FOLLOW_UP))
    await eventually(lambda: all(engine.vectors.cached(q) is not None for q in planned.queries))
    stats = replace(engine.vectors.stats)
    await stream.write(final(FOLLOW_UP + "?", session="call"))
    resp = await stream.read()
    assert not resp.prefetched  # a plan of two searches: the final ranks both itself
    assert resp.turn.query == planned.query + "?"  # its own words, as said
    assert not resp.turn.degraded
    assert engine.vectors.stats.misses == stats.misses  # neither query embedded again
    assert engine.vectors.stats.hits == stats.hits + 2
    assert engine.vectors.cached(FOLLOW_UP + "?") is None  # nothing cached under its words
    await plain_turn(example_sidecar, ROAMING, session="interim")
    as_interim = await plain_turn(example_sidecar, FOLLOW_UP, session="interim")
    assert resp.turn.chunks
    assert [c.chunk_id for c in resp.turn.chunks] == [c.chunk_id for c in as_interim.chunks]
    assert [c.score for c in resp.turn.chunks] == [c.score for c in as_interim.chunks]


async def test_a_turn_embeds_its_own_words_whatever_was_embedded_for_them_unpunctuated(
    example_sidecar: Sidecar,
) -> None:
    """A Turn's vectors are its own words' whatever other texts were embedded before: "x?"
    after "x" (another call's interim, or turn) is embedded itself, and cached apart."""
    vectors = example_sidecar.engine.vectors
    unpunctuated = ROAMING.rstrip("?")
    await plain_turn(example_sidecar, unpunctuated, session="first")
    said = vectors.cached(unpunctuated)
    assert said is not None
    misses = vectors.stats.misses
    await plain_turn(example_sidecar, ROAMING, session="second")
    assert vectors.stats.misses == misses + 1
    own = vectors.cached(ROAMING)
    assert own is not None
    assert not (own == said).all()  # the "?" is read: another vector, slightly


EXPORT_OFFER = "You can also export your data from Settings. Do you want to know how?"


async def test_a_final_answered_from_its_prefetch_gets_the_answer_it_would_searched(
    example_sidecar: Sidecar, stream: Any
) -> None:
    """Attack s23: "Yes, please tell me." after the agent's question is folded with the
    exchange and lifted by the conversation's pages; answered from its prefetch, it skipped
    that lift and the deeper search it needs (export.md 0.4865 where the same turn searched
    at its final got 0.5365). Now a prefetch searches as deep, and its final is lifted alike."""
    engine = example_sidecar.engine
    yes = "Yes, please tell me."
    agent = pb.TurnRequest(session_id="call", text=EXPORT_OFFER, speaker=pb.AGENT, is_final=True)
    await stream.write(final(PASSWORD, session="call"))
    await stream.read()
    await stream.write(pb.ConverseRequest(turn=agent))
    await stream.read()
    await eventually(lambda: engine.vectors.cached(EXPORT_OFFER) is not None)
    await stream.write(interim(yes))
    await eventually(lambda: engine.counters.prefetch_started == 1)
    await stream.write(final(yes, session="call"))
    resp = await stream.read()
    assert resp.prefetched
    await plain_turn(example_sidecar, PASSWORD, session="searched")
    await answered_as_searched(example_sidecar, resp, agent, yes)


VOICEMAIL_OFFER = "I can also help you set up your voicemail. Would you like to hear how?"


@pytest.mark.parametrize("background_full", [False, True])
async def test_an_answer_to_the_agents_opening_question_takes_its_prefetch(
    example_sidecar: Sidecar, stream: Any, background_full: bool
) -> None:
    """Review s23: the agent's turn, unread when the interim was planned, gave the final a page
    prior its prefetch had not searched for (not taken); and a final taking its prefetch read
    the agent's turn itself, a whole embedding on its path, where the background reads were
    full. The prefetch now searches as deep and embeds the agent's turn with its query."""
    engine = example_sidecar.engine
    if background_full:  # every background read taken: the agent's turn is left unembedded
        busy = [asyncio.create_task(asyncio.sleep(60)) for _ in range(MAX_READ_LATER)]
        engine._reading.update(busy)
    yes = "Yes, please tell me."
    agent = pb.TurnRequest(session_id="call", text=VOICEMAIL_OFFER, speaker=pb.AGENT, is_final=True)
    await stream.write(pb.ConverseRequest(turn=agent))
    await stream.read()
    planned = engine.plan(TurnInput(session_id="call", text=yes, is_final=False))
    assert planned is not None
    assert planned.reads == (VOICEMAIL_OFFER,)
    await stream.write(interim(yes))
    wanted = (*planned.queries, VOICEMAIL_OFFER)
    await eventually(lambda: all(engine.vectors.cached(q) is not None for q in wanted))
    misses = engine.vectors.stats.misses
    await stream.write(final(yes, session="call"))
    resp = await stream.read()
    assert resp.prefetched
    assert engine.vectors.stats.misses == misses  # nothing embedded on the final's path
    if background_full:
        for task in busy:
            task.cancel()
    await answered_as_searched(example_sidecar, resp, agent, yes)


async def answered_as_searched(
    sidecar: Sidecar, resp: Any, agent: pb.TurnRequest, said: str
) -> None:
    """``resp`` (a final's answer on a stream) is what session "searched" is answered over
    Turn when the agent's turn, then ``said``, come next: the same chunks, scores, follow-up."""
    as_agent = pb.TurnRequest()
    as_agent.CopyFrom(agent)
    as_agent.session_id = "searched"
    async with grpc.aio.insecure_channel(f"127.0.0.1:{sidecar.port}") as channel:
        await pb_grpc.RetrievalStub(channel).Turn(as_agent, timeout=30)
    searched = await plain_turn(sidecar, said, session="searched")
    assert resp.turn.followup.source == searched.followup.source
    assert resp.turn.chunks
    assert [(c.chunk_id, c.score) for c in resp.turn.chunks] == [
        (c.chunk_id, c.score) for c in searched.chunks
    ]


async def test_a_different_final_is_searched_normally(
    example_sidecar: Sidecar, stream: Any
) -> None:
    await stream.write(interim("How much does roaming cost in Europe?"))
    await stream.write(final("How do I change my voicemail greeting?"))
    resp = await stream.read()
    assert not resp.prefetched
    assert "voicemail" in resp.turn.query.lower()
    plain = await plain_turn(example_sidecar, "How do I change my voicemail greeting?")
    assert resp.turn.chunks
    assert [c.chunk_id for c in resp.turn.chunks] == [c.chunk_id for c in plain.chunks]
    assert example_sidecar.engine.counters.prefetch_started == 1
    assert example_sidecar.engine.counters.prefetched == 0


async def test_a_final_scoped_to_other_pages_than_its_interim_searches_itself(
    example_sidecar: Sidecar, stream: Any
) -> None:
    """An interim without paths, then its final with the same words limited to voicemail.md: the
    final is answered within its own paths, as Turn answers it (it took the interim's search,
    reset-password.md, a page it may not reach)."""
    await stream.write(interim(PASSWORD))
    await eventually(lambda: example_sidecar.engine.counters.prefetch_started == 1)
    await stream.write(final(PASSWORD, source_paths=["voicemail.md"]))
    resp = await stream.read()
    plain = await plain_turn(example_sidecar, PASSWORD, source_paths=["voicemail.md"])
    assert not resp.prefetched
    assert {c.source_path for c in resp.turn.chunks} == {"voicemail.md"}
    assert [c.chunk_id for c in resp.turn.chunks] == [c.chunk_id for c in plain.chunks]


async def test_a_final_wider_than_its_filtered_interim_searches_itself(
    example_sidecar: Sidecar, stream: Any
) -> None:
    """The reverse: an interim limited to voicemail.md, its final unlimited: the final finds the
    page Turn finds (it took the interim's search, voicemail.md only)."""
    await stream.write(interim(PASSWORD, source_paths=["voicemail.md"]))
    await eventually(lambda: example_sidecar.engine.counters.prefetch_started == 1)
    await stream.write(final(PASSWORD))
    resp = await stream.read()
    plain = await plain_turn(example_sidecar, PASSWORD)
    assert not resp.prefetched
    assert "reset-password.md" in [c.source_path for c in plain.chunks]
    assert [c.chunk_id for c in resp.turn.chunks] == [c.chunk_id for c in plain.chunks]


async def test_a_final_naming_its_interims_paths_in_another_order_takes_its_prefetch(
    example_sidecar: Sidecar, stream: Any
) -> None:
    """Paths are a set: the same two in the other order scope the same search."""
    pages = ["reset-password.md", "voicemail.md"]
    await stream.write(interim(PASSWORD, source_paths=pages))
    await eventually(lambda: example_sidecar.engine.counters.prefetch_started == 1)
    await stream.write(final(PASSWORD, session="call", source_paths=pages[::-1]))
    resp = await stream.read()
    assert resp.prefetched
    assert {c.source_path for c in resp.turn.chunks} <= set(pages)


async def test_a_turns_scope_is_its_sets_of_sources_paths_and_filters(
    example_sidecar: Sidecar,
) -> None:
    """What a final must share with its interim to take its prefetch: the same filters (each
    field's values as a set, the filters as a set), paths and sources, in any order."""
    scope = Prefetcher(example_sidecar.engine, stable_ms=200)._scope
    plan, tier = MetadataFilter("plan", ("basic", "pro")), MetadataFilter("tier", ("gold",))
    base = TurnInput("call", PASSWORD, filters=(plan, tier), source_paths=("a.md", "b.md"))
    reordered = replace(
        base,
        filters=(tier, MetadataFilter("plan", ("pro", "basic"))),
        source_paths=("b.md", "a.md"),
    )
    assert scope(reordered) == scope(base)
    for other in (
        replace(base, filters=(plan,)),
        replace(base, filters=(plan, MetadataFilter("tier", ("silver",)))),
        replace(base, filters=(MetadataFilter("plan", ("basic",)), tier)),
        replace(base, source_paths=("a.md",)),
        replace(base, sources=("help",)),
    ):
        assert scope(other) != scope(base)


async def test_a_prefetch_not_taken_by_its_final_is_dropped(
    example_sidecar: Sidecar, stream: Any
) -> None:
    await stream.write(interim("How much does roaming cost in Europe?"))
    await stream.write(final("Mm-hmm, okay."))  # skipped: never takes the prefetch
    await stream.write(final("How much does roaming cost in Europe?"))  # no interim this time
    ack, later = [await stream.read() for _ in range(2)]
    assert ack.turn.skipped == pb.BACKCHANNEL
    assert not later.prefetched
    assert later.turn.chunks
    assert example_sidecar.engine.counters.prefetch_started == 1


async def test_stream_answers_every_final_and_agent_turn(stream: Any) -> None:
    await stream.write(final("How much does roaming cost in Europe?", session="call"))
    await stream.write(
        pb.ConverseRequest(
            turn=pb.TurnRequest(
                text="Sure, a Travel Pass costs five dollars a day.", speaker=pb.AGENT
            )
        )
    )
    await stream.write(final("Mm-hmm, okay."))
    first, agent, ack = [await stream.read() for _ in range(3)]
    assert first.turn.chunks
    assert not first.prefetched
    assert agent.turn.skipped == pb.AGENT_TURN
    assert ack.turn.skipped == pb.BACKCHANNEL
    # one stream is one session: the acknowledgement still carries the first turn's context
    assert [c.chunk_id for c in ack.turn.context][: len(first.turn.chunks)] == [
        c.chunk_id for c in first.turn.chunks
    ]
    await stream.done_writing()
    assert await stream.read() == grpc.aio.EOF


async def test_a_bad_request_ends_the_stream_with_a_status(stream: Any) -> None:
    await stream.write(final("How do I reset my password?", session="a", budget_ms=-1))
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await stream.read()
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT


@pytest.mark.parametrize(
    ("first", "says"), [("a", "this stream is session 'a'"), ("", "this stream is no session")]
)
async def test_one_stream_is_one_session(stream: Any, first: str, says: str) -> None:
    """The first request names the stream's session, none too (attack s23: a stream opened with
    no session took one named later)."""
    await stream.write(final("How do I reset my password?", session=first))
    await stream.read()
    await stream.write(final("How do I set up voicemail?", session="b"))
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await stream.read()
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert says in (err.value.details() or "")
    assert "one Converse stream per session" in (err.value.details() or "")


# -- nothing outlives the stream -------------------------------------------------------------


class Hanging:
    """The real model's identity, but ``embed`` never returns: prefetches stay in flight."""

    def __init__(self, inner: Embedder) -> None:
        self.inner = inner

    @property
    def info(self) -> EmbedderInfo:
        return self.inner.info

    def embed_batch(self, texts: Sequence[str]) -> Vectors:
        return self.inner.embed_batch(texts)

    async def embed(self, texts: Sequence[str]) -> Vectors:
        await asyncio.Event().wait()
        raise AssertionError("unreachable")

    async def aclose(self) -> None:
        return None


@pytest.fixture
async def hanging_sidecar(
    example_config: Config, local_embedder: Embedder
) -> AsyncIterator[Sidecar]:
    sidecar = await create_server(example_config, embedder=Hanging(local_embedder), poll=False)
    yield sidecar
    await sidecar.stop(0.5)


@pytest.mark.parametrize("ending", ["cancel", "done_writing"])
async def test_a_prefetch_in_flight_ends_with_its_stream(
    hanging_sidecar: Sidecar, ending: str
) -> None:
    async with grpc.aio.insecure_channel(f"127.0.0.1:{hanging_sidecar.port}") as channel:
        call = pb_grpc.RetrievalStub(channel).Converse(timeout=60)
        await call.write(interim("How do I reset my password?"))
        await eventually(lambda: bool(prefetch_tasks()))
        if ending == "cancel":
            call.cancel()  # the server sees CancelledError
        else:
            await call.done_writing()
            assert await call.read() == grpc.aio.EOF
    await eventually(lambda: not prefetch_tasks())
    assert hanging_sidecar.engine.counters.prefetch_started == 1


async def test_a_prefetch_still_embedding_at_the_deadline_falls_back(
    hanging_sidecar: Sidecar,
) -> None:
    async with grpc.aio.insecure_channel(f"127.0.0.1:{hanging_sidecar.port}") as channel:
        call = pb_grpc.RetrievalStub(channel).Converse(timeout=60)
        await call.write(interim("How much does roaming cost in Europe?"))
        await call.write(final("How much does roaming cost in Europe?", budget_ms=150))
        resp = await call.read()
        await call.done_writing()
    assert resp.turn.degraded
    assert not resp.prefetched
    assert "roaming.md" in [c.source_path for c in resp.turn.chunks]
    # the final waited on the prefetch's embedding instead of asking the embedder again
    assert hanging_sidecar.engine.vectors.stats.misses == 1


async def test_a_stream_opened_before_a_drain_finishes_its_call(
    example_sidecar: Sidecar, stream: Any
) -> None:
    await stream.write(final("How do I reset my password?", session="drain"))
    assert (await stream.read()).turn.chunks
    example_sidecar.lifecycle.state = State.DRAINING  # what stop() sets first
    await stream.write(final("How do I change my plan?", session="drain"))
    answer = await stream.read()
    assert answer.turn.chunks, "a call already under way is answered during the drain"
    async with grpc.aio.insecure_channel(f"127.0.0.1:{example_sidecar.port}") as channel:
        late = pb_grpc.RetrievalStub(channel).Converse(timeout=10)  # type: ignore[no-untyped-call]
        # the server refuses the stream as it opens, before any request: awaiting its status
        # (rather than writing to a stream that may already have ended) cannot race that
        code, details = await late.code(), await late.details()
    assert code == grpc.StatusCode.UNAVAILABLE
    assert "shutting down" in details
