"""The gRPC servicer: proto messages in, engine calls, proto messages out.

Every handler runs inside ``_errors``: one of our errors becomes the status ``status_for`` maps
it to, with its message; anything else is logged and becomes INTERNAL. No handler turns an error
into a successful reply.
"""

from __future__ import annotations

import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from functools import wraps
from typing import Any, TypeVar

import grpc

from index.config import named
from index.errors import VoxrecallError
from index.types import MetadataFilter
from sidecar import __version__
from sidecar.edge.addresses import load_requester
from sidecar.edge.interceptor import Call, abort
from sidecar.edge.lifecycle import Lifecycle
from sidecar.edge.limits import idle_limited, utf8_size, written_within
from sidecar.edge.messages import MESSAGES
from sidecar.edge.status import (
    abort_trailers,
    caller_message,
    internal_message,
    status_for,
)
from sidecar.edge.wire import (
    EncodedResponse,
    converse_response,
    search_response,
    turn_response,
)
from sidecar.errors import IdleTimeout, InvalidArgument, ResourceExhausted
from sidecar.functions.tools import PageReader, PageText, Toolbox
from sidecar.gen import retrieval_pb2 as pb
from sidecar.gen import retrieval_pb2_grpc as pb_grpc
from sidecar.snapshots.holder import SnapshotHolder
from sidecar.turn import sessions
from sidecar.turn.engine import (
    BasePolicy,
    Engine,
    SearchInput,
    Speaker,
    Timings,
    TurnInput,
)
from sidecar.turn.prefetch import Prefetcher

log = logging.getLogger("voxrecall.service")

_Req = TypeVar("_Req")
_Resp = TypeVar("_Resp")
Context = grpc.aio.ServicerContext[Any, Any]
Handler = Callable[["RetrievalService", _Req, Context], Awaitable[_Resp]]


def _errors(handler: Handler[_Req, _Resp]) -> Handler[_Req, _Resp]:
    @wraps(handler)
    async def wrapper(self: RetrievalService, request: _Req, context: Context) -> _Resp:
        try:
            return await handler(self, request, context)
        except VoxrecallError as exc:
            code = status_for(exc)
            if code is grpc.StatusCode.INTERNAL:
                log.error("%s failed: %s", handler.__name__, exc)
            await abort(context, code, caller_message(exc), abort_trailers(context, exc))
        except grpc.aio.AbortError:
            raise  # a status already set (a hook's refusal, the abort above)
        except Exception as exc:  # a bug: INTERNAL with the traceback logged, never UNKNOWN
            log.exception("%s failed", handler.__name__)
            await abort(context, status_for(exc), internal_message(exc))

    return wrapper


def set_timings(message: pb.Timings, timings: Timings) -> None:
    """``timings`` into a response's own ``Timings`` (no message made apart and copied in)."""
    message.embed_ms = timings.embed_ms
    message.search_ms = timings.search_ms
    message.total_ms = timings.total_ms


# A Status answer's bases at most, in bytes (and half of [sidecar] max_message_bytes): a client's
# default limit to receive is 4 MiB, and the rest are counted (``knowledge_bases_left_out``).
MAX_STATUS_BYTES = 1024 * 1024
STATUS_ENTRY_OVERHEAD = 4  # an entry's tag and length prefix in the repeated field
# ListToolsRequest.format -> the formats its answer fills in.
_TOOL_FORMATS = {
    pb.TOOL_FORMAT_UNSPECIFIED: frozenset({pb.REALTIME, pb.RESPONSES, pb.CHAT_COMPLETIONS}),
    pb.REALTIME: frozenset({pb.REALTIME}),
    pb.RESPONSES: frozenset({pb.RESPONSES}),
    pb.CHAT_COMPLETIONS: frozenset({pb.CHAT_COMPLETIONS}),
}
_SPEAKERS = {pb.SPEAKER_UNSPECIFIED: Speaker.USER, pb.USER: Speaker.USER, pb.AGENT: Speaker.AGENT}


def strings(field: Sequence[str]) -> tuple[str, ...]:
    """A repeated string field as a tuple; most calls send none, and no tuple is built then."""
    return tuple(field) if field else ()


def metadata_filters(messages: Sequence[pb.MetadataFilter]) -> tuple[MetadataFilter, ...]:
    if not messages:  # most calls: no generator to start
        return ()
    return tuple(MetadataFilter(m.field, tuple(m.any_of)) for m in messages)


def search_input(request: pb.SearchRequest) -> SearchInput:
    """The engine's input for a ``Search`` call."""
    return SearchInput(
        query=request.query,
        knowledge_base=request.knowledge_base,
        limit=request.limit,
        min_score=request.min_score,
        sources=strings(request.sources),
        session_id=request.session_id,
        context_url=request.context_url,
        vector=request.vector,
        filters=metadata_filters(request.filters),
        source_paths=strings(request.source_paths),
    )


def turn_input(request: pb.TurnRequest, session_id: str = "") -> TurnInput:
    """``session_id``, when given, stands in for an empty ``request.session_id`` (Converse)."""
    speaker = _SPEAKERS.get(request.speaker)
    if speaker is None:
        raise InvalidArgument(f"unknown speaker {request.speaker}: use USER or AGENT")
    return TurnInput(
        session_id=request.session_id or session_id,
        text=request.text,
        knowledge_base=request.knowledge_base,
        speaker=speaker,
        is_final=request.is_final,
        budget_ms=request.budget_ms,
        sources=strings(request.sources),
        context_url=request.context_url,
        filters=metadata_filters(request.filters),
        source_paths=strings(request.source_paths),
    )


def _other_session(stream: str, got: str) -> str:
    """What a Converse request naming another session than its stream's is told."""
    this = f"session {stream!r}" if stream else "no session (its first request named none)"
    return f"this stream is {this}; got {got!r}: open one Converse stream per session"


def policy_for(engine: Engine, kb: str) -> BasePolicy:
    """The policy of base ``kb`` (empty: the default base), whose words an answer carries."""
    return engine.policy(kb or engine.default_knowledge_base)


# A ReadPageResponse's bytes beyond its strings: eight fields' tags and lengths.
PAGE_FRAMING_BYTES = 64


def _check_fits(page: PageText, version: str, limit: int) -> None:
    """A page whose response would be over ``[sidecar] max_message_bytes`` is refused with
    its size and what to do, before the message is built (gRPC's own refusal of an over-long
    message says neither)."""
    texts = (page.text, page.title, page.source, page.source_path, page.url, version)
    # a text of more characters than the limit is counted as one byte each: over it already
    size = PAGE_FRAMING_BYTES + sum(utf8_size(text, limit) for text in texts)
    if size > limit:
        exact = all(len(text) <= limit for text in texts)
        raise ResourceExhausted(
            f"page {named([page.source_path])} is {'' if exact else 'at least '}"
            f"{size} bytes as a ReadPageResponse; the limit is {limit} bytes ([sidecar] "
            "max_message_bytes): read it in parts (set offset, 0 for the first), raise the "
            "limit, or search the page's chunks (Search with source_paths set to its path)"
        )


def page_part(page: PageText, version: str, offset: int, limit: int) -> tuple[str, bool]:
    """The part of ``page.text`` from ``offset`` (characters) that fits in a ReadPageResponse of
    ``limit`` bytes beside the page's other fields, cut between characters, and whether the
    page goes on after it. At most ``limit`` characters of the page are encoded."""
    head = (page.title, page.source, page.source_path, page.url, version)
    room = limit - PAGE_FRAMING_BYTES - sum(utf8_size(text, limit) for text in head)
    window = page.text[offset : offset + max(room, 0)]
    data = window.encode("utf-8", "surrogatepass")
    part = window if len(data) <= room else data[:room].decode("utf-8", "ignore")
    if not part and offset < len(page.text):
        raise ResourceExhausted(
            f"page {named([page.source_path])}'s title, path and URL alone are over "
            f"{limit} bytes ([sidecar] max_message_bytes): raise it"
        )
    return part, offset + len(part) < len(page.text)


class RetrievalService(pb_grpc.RetrievalServicer):
    def __init__(
        self,
        engine: Engine,
        holder: SnapshotHolder,
        lifecycle: Lifecycle,
        toolbox: Toolbox | None = None,
    ) -> None:
        self.engine = engine
        self.holder = holder
        self.lifecycle = lifecycle
        self.toolbox = toolbox if toolbox is not None else Toolbox((), 0)
        self.pages = PageReader()
        self.started = time.monotonic()

    @_errors
    async def Turn(self, request: pb.TurnRequest, context: Context) -> EncodedResponse:
        """Answers a ``TurnResponse``'s bytes, written from kept pieces as a Search's are."""
        self.lifecycle.check_accepting()
        turn = turn_input(request)
        return turn_response(await self.engine.turn(turn), self._policy(turn.knowledge_base))

    @_errors
    async def Converse(
        self, request_iterator: AsyncIterator[pb.ConverseRequest], context: Context
    ) -> None:
        """One stream per call. A user interim transcript may start a prefetch and gets no
        answer; every other request (a final user transcript, an agent turn) gets one, written
        as bytes (``converse_response``) as a Turn's is."""
        stable_ms = self.engine.config.prefetch_stable_ms
        prefetcher = Prefetcher(self.engine, stable_ms, load_requester(context.peer() or ""))
        session_id: str | None = None  # the first request's names the stream's (even "")
        try:
            # checked once: a call whose stream opened before a drain may finish within the grace
            self.lifecycle.check_accepting()
            idle_s = self.engine.config.stream_idle_s
            async for request in idle_limited(request_iterator, idle_s):
                if not request.HasField("turn"):  # a client bug: it would get no answer
                    raise InvalidArgument("a ConverseRequest carries its turn: set turn")
                turn = turn_input(request.turn, session_id or "")
                if session_id is not None and turn.session_id != session_id:
                    raise InvalidArgument(_other_session(session_id, turn.session_id))
                session_id = turn.session_id
                if turn.speaker == Speaker.USER and not turn.is_final:
                    prefetcher.interim(turn)
                    continue
                result = await self.engine.turn(turn, prefetch=prefetcher)
                if turn.speaker == Speaker.USER:
                    prefetcher.discard()  # e.g. a skipped final never took its prefetch
                policy = self._policy(turn.knowledge_base)
                answer = converse_response(result, policy, turn.text)
                try:
                    await written_within(context.write(answer), idle_s)
                except IdleTimeout as exc:  # abort would wait behind the answers left unread
                    context.set_code(status_for(exc))
                    context.set_details(caller_message(exc))
                    return
        finally:
            # a cancelled stream arrives here as CancelledError: nothing it started outlives it
            await prefetcher.aclose()

    @_errors
    async def Search(self, request: pb.SearchRequest, context: Context) -> EncodedResponse:
        """Answers a ``SearchResponse``'s bytes, written from kept pieces (sidecar/edge/wire.py),
        which the method's serializer sends as they are."""
        self.lifecycle.check_accepting()
        kb = request.knowledge_base
        if request.vector and not (
            request.query
            or request.session_id
            or request.sources
            or request.filters
            or request.source_paths
            or request.context_url
        ):  # the common call, in one step (``Engine.nearest_to``)
            found = self.engine.nearest_to(kb, request.vector, request.limit, request.min_score)
            if found is not None:
                return search_response(found, self._policy(kb))
        result = await self.engine.search(search_input(request))
        return search_response(result, self._policy(kb))

    def _policy(self, kb: str) -> BasePolicy:
        return policy_for(self.engine, kb)

    @_errors
    async def EndSession(
        self, request: pb.EndSessionRequest, context: Context
    ) -> pb.EndSessionResponse:
        if not request.session_id:
            raise InvalidArgument("session_id is empty")
        return pb.EndSessionResponse(existed=self.engine.end_session(request.session_id))

    @_errors
    async def Status(self, request: pb.StatusRequest, context: Context) -> pb.StatusResponse:
        limit = min(MAX_STATUS_BYTES, self.engine.config.max_message_bytes // 2)
        bases, left_out = self._base_statuses(time.time(), limit)
        info = self.engine.embedder.info
        usage = self.engine.sessions.usage(sessions.owner.get())  # the caller's own
        return pb.StatusResponse(
            state=self.lifecycle.state.name,
            knowledge_bases=bases,
            embedder=info.name,
            dimension=info.dimension,
            uptime_seconds=time.monotonic() - self.started,
            sessions=usage.sessions,
            version=__version__,
            session_bytes=usage.bytes,
            knowledge_bases_left_out=left_out,
        )

    def _base_statuses(self, now: float, limit: int) -> tuple[list[pb.KnowledgeBaseStatus], int]:
        """The statuses of the known bases the caller may use (its ``[sidecar.auth.caller]``
        knowledge_bases, read from the call at hand) by name,
        as many as fit in ``limit`` bytes, and how many of those were left out: 10,000 bases
        failing with long names and refusals made a 4 MB answer that gRPC refused to send. The
        caller's bases are chosen before the cut: a scoped caller saw none of its own where
        others' filled the answer, and a count of bases it may not know of."""
        call = sessions.at_hand.get()
        mine = call.caller.knowledge_bases if isinstance(call, Call) and call.caller else ()
        names = sorted(kb for kb in self.engine.known_bases if not mine or kb in mine)
        bases: list[pb.KnowledgeBaseStatus] = []
        size = 0
        for name in names:
            entry = self._base_status(name, now)
            size += entry.ByteSize() + STATUS_ENTRY_OVERHEAD
            if size > limit:
                break
            bases.append(entry)
        return bases, len(names) - len(bases)

    def _base_status(self, name: str, now: float) -> pb.KnowledgeBaseStatus:
        snap = self.holder.get(name)
        refusal = self.holder.last_refusal(name)
        return pb.KnowledgeBaseStatus(
            name=name,
            snapshot_version=snap.version if snap else "",
            chunks=len(snap.chunks) if snap else 0,
            pages=snap.manifest.pages if snap else 0,
            age_seconds=now - snap.manifest.created_at if snap else 0.0,
            last_refusal=str(refusal) if refusal else "",
        )

    # -- knowledge functions -------------------------------------------------------------------

    @_errors
    async def ListTools(
        self, request: pb.ListToolsRequest, context: Context
    ) -> pb.ListToolsResponse:
        wanted = _TOOL_FORMATS.get(request.format)
        if wanted is None:
            raise InvalidArgument(f"unknown tool format {request.format}")
        tools = []
        for fn in self.toolbox:
            snapshot = self.holder.get(fn.config.knowledge_base)
            realtime, responses, chat = self.toolbox.definitions_json(fn.name, snapshot)
            tools.append(
                pb.Tool(
                    name=fn.name,
                    description=fn.config.description,
                    knowledge_base=fn.config.knowledge_base,
                    sources=list(fn.searchable),
                    realtime_json=realtime if pb.REALTIME in wanted else "",
                    responses_json=responses if pb.RESPONSES in wanted else "",
                    chat_completions_json=chat if pb.CHAT_COMPLETIONS in wanted else "",
                    instructions=fn.policy.instructions,
                    fallback=fn.policy.fallback,
                )
            )
        return pb.ListToolsResponse(tools=tools)

    @_errors
    async def InvokeTool(
        self, request: pb.InvokeToolRequest, context: Context
    ) -> pb.InvokeToolResponse:
        self.lifecycle.check_accepting()
        result = await self.toolbox.invoke(
            self.engine, request.name, request.arguments_json, request.session_id
        )
        fn = self.toolbox.get(request.name)
        response = pb.InvokeToolResponse(
            output=result.output,
            is_error=result.is_error,
            call_id=request.call_id,
            fallback=result.fallback,
            instructions=fn.policy.instructions if fn is not None else "",
        )
        MESSAGES.fill(response, "chunks", result.hits)
        return response

    @_errors
    async def ReadPage(self, request: pb.ReadPageRequest, context: Context) -> pb.ReadPageResponse:
        self.lifecycle.check_accepting()
        kb = request.knowledge_base or self.engine.default_knowledge_base
        searcher = self.engine.searcher(kb)
        parts = request.HasField("offset")
        offset = request.offset if parts else 0
        page = await self.pages.read(searcher, kb, request.source_path, request.source, offset)
        limit = self.engine.config.max_message_bytes
        if parts:
            text, truncated = page_part(page, searcher.version, offset, limit)
        else:
            _check_fits(page, searcher.version, limit)
            text, truncated = page.text, False
        return pb.ReadPageResponse(
            title=page.title,
            text=text,
            source=page.source,
            source_path=page.source_path,
            url=page.url,
            snapshot_version=searcher.version,
            truncated=truncated,
            next_offset=offset + len(text) if truncated else 0,
        )
