"""``run_turns``: a conversation through a real ``Engine`` over a small base the test describes.

Like pipecat's ``run_test``: give it the base (entity -> its chunks' texts, one page each) and
the turns ((speaker, text), oldest first); get back each turn's ``TurnResult``. The snapshot is
real (hnswlib, the lexical index, the gazetteer); the embedder is ``FakeEmbedder`` unless given,
so engine behaviour is tested without ``../shared/data`` or the model.

    results = await run_turns(
        {"HARBOR GRILL": ["Harbor Grill serves fish."], "BLUE DOOR CAFE": ["..."]},
        [("agent", "It's called Blue Door Cafe."), ("user", "Do they take reservations?")],
        tmp_path,
    )
    assert results[-1].followup.used == "BLUE DOOR CAFE"
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

from index.chunker import chunk_page
from index.embedders.base import Embedder, FakeEmbedder
from index.snapshot import load_snapshot, write_pages_snapshot
from index.store import new_version_id
from index.types import MetaValue, Page
from sidecar.config import SidecarConfig
from sidecar.snapshots.holder import SnapshotHolder
from sidecar.snapshots.searcher import Searcher
from sidecar.turn.engine import Engine, TurnInput, TurnResult
from sidecar.turn.sessions import SessionStore

KB = "base"
SESSION = "call"


def base_pages(
    base: Mapping[str, Sequence[str]],
    kind: str = "text",
    metadata: Mapping[str, Mapping[str, MetaValue]] | None = None,
) -> list[Page]:
    """One jsonl-like page per chunk text, its entity as the context every chunk is embedded
    with (as a ``context_fields`` source does); ``kind="markdown"`` reads a text's headings
    (its chunk's breadcrumbs, below the entity as the page's title); ``metadata``: an entity's
    pages' metadata (``related_urls``)."""
    metadata = metadata or {}
    return [
        Page(
            source=KB,
            source_path=f"{entity}-{i}",
            title=entity,
            text=text,
            kind=kind,
            context=entity if kind == "text" else "",  # markdown: the breadcrumbs
            metadata=dict(metadata.get(entity, {})),
        )
        for entity, texts in base.items()
        for i, text in enumerate(texts)
    ]


def build_engine(
    base: Mapping[str, Sequence[str]],
    folder: Path,
    *,
    embedder: Embedder | None = None,
    kind: str = "text",
    metadata: Mapping[str, Mapping[str, MetaValue]] | None = None,
    **config: Any,
) -> Engine:
    """An engine serving a snapshot of ``base`` (its pages of ``kind`` and ``metadata``:
    ``base_pages``) written under ``folder``; ``config`` overrides ``SidecarConfig`` keys."""
    embedder = embedder or FakeEmbedder()
    pages = base_pages(base, kind, metadata)
    chunks = [c for p in pages for c in chunk_page(p)]
    vectors = embedder.embed_batch([c.embed_text for c in chunks])  # ``delay`` etc. spare it
    version = new_version_id("turns")
    target = folder / version
    write_pages_snapshot(
        target,
        knowledge_base=KB,
        version=version,
        embedder=embedder.info,
        pages=pages,
        chunks=chunks,
        vectors=vectors,
        sources=[KB],
    )
    holder = SnapshotHolder()
    holder.publish(Searcher.build(load_snapshot(target)))
    settings = replace(SidecarConfig(), **{"budget_ms": 5_000, "min_score": 0.0, **config})
    sessions = SessionStore(max_sessions=16, ttl_s=600, context_turns=settings.context_turns)
    return Engine(settings, embedder, holder, frozenset({KB}), sessions, default_knowledge_base=KB)


async def run_turns(
    base: Mapping[str, Sequence[str]] | Engine,
    turns: Sequence[tuple[str, str]],
    folder: Path | None = None,
    **config: Any,
) -> list[TurnResult]:
    """Each turn's result, the turns fed in order into one session (speaker "user"/"agent")."""
    if isinstance(base, Engine):
        engine = base
    else:
        assert folder is not None, "a base to build needs a folder to write its snapshot to"
        engine = build_engine(base, folder, **config)
    try:
        return [
            await engine.turn(TurnInput(session_id=SESSION, text=text, speaker=speaker))
            for speaker, text in turns
        ]
    finally:
        if not isinstance(base, Engine):
            await engine.aclose()
