"""A small synchronous client for the command line (``voxrecall ask``) and scripts."""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field

from sidecar.connection import Connection, open_blocking_channel
from sidecar.gen import retrieval_pb2 as pb
from sidecar.gen import retrieval_pb2_grpc as pb_grpc

ASK_TIMEOUT_S = 10.0  # generous: the first call after start may wait for the channel to connect


@dataclass(frozen=True, slots=True)
class AskOptions:
    connection: Connection = field(default_factory=Connection)
    knowledge_base: str = ""
    session_id: str = ""
    limit: int = 0
    search: bool = False  # Search instead of Turn (no skip policy, no follow-up handling)
    budget_ms: int = 0


def ask(question: str, options: AskOptions) -> pb.TurnResponse | pb.SearchResponse:
    metadata = options.connection.metadata
    with open_blocking_channel(options.connection) as channel:
        stub = pb_grpc.RetrievalStub(channel)  # type: ignore[no-untyped-call]
        resp: pb.TurnResponse | pb.SearchResponse
        if options.search:
            resp = stub.Search(
                pb.SearchRequest(
                    knowledge_base=options.knowledge_base,
                    query=question,
                    limit=options.limit,
                    session_id=options.session_id,
                ),
                metadata=metadata,
                timeout=ASK_TIMEOUT_S,
            )
        else:
            resp = stub.Turn(
                pb.TurnRequest(
                    session_id=options.session_id or f"ask-{uuid.uuid4().hex[:8]}",
                    knowledge_base=options.knowledge_base,
                    text=question,
                    speaker=pb.USER,
                    is_final=True,
                    budget_ms=options.budget_ms,
                ),
                metadata=metadata,
                timeout=ASK_TIMEOUT_S,
            )
        return resp


def format_response(resp: pb.TurnResponse | pb.SearchResponse, width: int = 100) -> str:
    lines: list[str] = []
    skipped = isinstance(resp, pb.TurnResponse) and resp.skipped != pb.NOT_SKIPPED
    if isinstance(resp, pb.TurnResponse):
        if skipped:
            lines.append(
                f"skipped: {pb.SkipReason.Name(resp.skipped)} (nothing searched; "
                f"{len(resp.context)} chunks of retained context)"
            )
        if resp.query:
            lines.append(f"query: {resp.query}")
        if resp.followup.used:
            f = resp.followup
            lines.append(f"followup: {f.used!r} from {f.source} (confidence {f.confidence:.2f})")
    if not resp.chunks and not skipped:
        lines.append("no chunk scored above min_score")
    if resp.fallback:
        lines.append(f"fallback: {resp.fallback}")
    for i, chunk in enumerate(resp.chunks, 1):
        crumbs = " > ".join(chunk.breadcrumbs) or chunk.title
        lines.append(f"{i}. [{chunk.score:.3f}] {crumbs}  ({chunk.source}:{chunk.source_path})")
        text = " ".join(chunk.text.split())
        lines.append(f"   {text[: width - 6]}{'...' if len(text) > width - 6 else ''}")
    t = resp.timings
    flags = " degraded (lexical fallback)" if resp.degraded else ""
    lines.append(
        f"snapshot {resp.snapshot_version}; embed {t.embed_ms:.1f} ms, search {t.search_ms:.2f} ms, "
        f"total {t.total_ms:.1f} ms (server){flags}"
    )
    return "\n".join(lines)
