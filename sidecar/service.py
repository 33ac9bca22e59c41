"""The gRPC servicer: proto messages in, engine calls, proto messages out.

Every handler runs inside ``_errors``: one of our errors becomes the status ``status_for`` maps
it to, with its message; anything else is logged and becomes INTERNAL. No handler turns an error
into a successful reply.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Awaitable, Callable, Iterable
from functools import wraps
from typing import Any, TypeVar

import grpc

from index.errors import VoxrecallError
from sidecar import __version__
from sidecar.engine import Engine, SearchInput, Speaker, TurnInput
from sidecar.errors import InvalidArgument, status_for
from sidecar.gen import retrieval_pb2 as pb
from sidecar.gen import retrieval_pb2_grpc as pb_grpc
from sidecar.holder import SnapshotHolder
from sidecar.lifecycle import Lifecycle
from sidecar.sessions import Hit

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
            await context.abort(code, str(exc))
            raise AssertionError("unreachable: abort raises") from exc

    return wrapper


def chunk_message(hit: Hit) -> pb.Chunk:
    c = hit.chunk
    return pb.Chunk(
        chunk_id=c.chunk_id,
        knowledge_base=hit.knowledge_base,
        source=c.source,
        source_path=c.source_path,
        title=c.title,
        breadcrumbs=list(c.breadcrumbs),
        text=c.text,
        score=hit.score,
        url=c.url,
        metadata=dict(c.metadata),
    )


def _chunks(hits: Iterable[Hit]) -> list[pb.Chunk]:
    return [chunk_message(h) for h in hits]


_SPEAKERS = {pb.SPEAKER_UNSPECIFIED: Speaker.USER, pb.USER: Speaker.USER, pb.AGENT: Speaker.AGENT}


class RetrievalService(pb_grpc.RetrievalServicer):
    def __init__(self, engine: Engine, holder: SnapshotHolder, lifecycle: Lifecycle) -> None:
        self.engine = engine
        self.holder = holder
        self.lifecycle = lifecycle
        self.started = time.monotonic()

    @_errors
    async def Turn(self, request: pb.TurnRequest, context: Context) -> pb.TurnResponse:
        self.lifecycle.check_accepting()
        speaker = _SPEAKERS.get(request.speaker)
        if speaker is None:
            raise InvalidArgument(f"unknown speaker {request.speaker}: use USER or AGENT")
        result = await self.engine.turn(
            TurnInput(
                session_id=request.session_id,
                text=request.text,
                knowledge_base=request.knowledge_base,
                speaker=speaker,
                is_final=request.is_final,
                budget_ms=request.budget_ms,
                sources=tuple(request.sources),
                context_url=request.context_url,
            )
        )
        return pb.TurnResponse(
            chunks=_chunks(result.hits),
            context=_chunks(result.context),
            skipped=result.skipped.name,
            degraded=result.degraded,
            query=result.query,
            timings=pb.Timings(
                embed_ms=result.timings.embed_ms,
                search_ms=result.timings.search_ms,
                total_ms=result.timings.total_ms,
            ),
            snapshot_version=result.snapshot_version,
        )

    @_errors
    async def Search(self, request: pb.SearchRequest, context: Context) -> pb.SearchResponse:
        self.lifecycle.check_accepting()
        result = await self.engine.search(
            SearchInput(
                query=request.query,
                knowledge_base=request.knowledge_base,
                limit=request.limit,
                min_score=request.min_score,
                sources=tuple(request.sources),
                session_id=request.session_id,
                context_url=request.context_url,
                vector=request.vector,
            )
        )
        return pb.SearchResponse(
            chunks=_chunks(result.hits),
            timings=pb.Timings(
                embed_ms=result.timings.embed_ms,
                search_ms=result.timings.search_ms,
                total_ms=result.timings.total_ms,
            ),
            snapshot_version=result.snapshot_version,
            degraded=result.degraded,
        )

    @_errors
    async def EndSession(
        self, request: pb.EndSessionRequest, context: Context
    ) -> pb.EndSessionResponse:
        if not request.session_id:
            raise InvalidArgument("session_id is empty")
        return pb.EndSessionResponse(existed=self.engine.end_session(request.session_id))

    @_errors
    async def Status(self, request: pb.StatusRequest, context: Context) -> pb.StatusResponse:
        now = time.time()
        bases = []
        for name in sorted(self.engine.known_bases):
            snap = self.holder.get(name)
            refusal = self.holder.last_refusal(name)
            bases.append(
                pb.KnowledgeBaseStatus(
                    name=name,
                    snapshot_version=snap.version if snap else "",
                    chunks=len(snap.chunks) if snap else 0,
                    pages=snap.manifest.pages if snap else 0,
                    age_seconds=now - snap.manifest.created_at if snap else 0.0,
                    last_refusal=str(refusal) if refusal else "",
                )
            )
        info = self.engine.embedder.info
        return pb.StatusResponse(
            state=self.lifecycle.state.name,
            knowledge_bases=bases,
            embedder=info.name,
            dimension=info.dimension,
            uptime_seconds=time.monotonic() - self.started,
            sessions=len(self.engine.sessions),
            version=__version__,
        )
