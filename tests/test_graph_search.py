"""A loaded graph that cannot answer a search (s12's F5): hnswlib's RuntimeError ("Cannot return
the results in a contiguous 2D array": it found fewer than k elements) is ``GraphSearchFailed``
where the graph is queried, never an UNKNOWN status; a turn or a search with text is answered by
the lexical index, degraded, counted and logged once per snapshot; a search by a vector alone,
with no text to fall back on, is INTERNAL."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import grpc
import hnswlib
import numpy as np
import pytest

from index.errors import GraphSearchFailed
from index.hnsw_file import knn
from sidecar.edge.status import status_for
from sidecar.turn.engine import Engine, SearchInput, TurnInput
from tests.turns import KB, build_engine

PLACES = {
    "HARBOR GRILL": ["Harbor Grill serves fish by the water.", "Harbor Grill opens at noon."],
    "BLUE DOOR CAFE": ["Blue Door Cafe bakes bread every morning."],
}


class ShortGraph:
    """The snapshot's hnswlib index, asked for more elements than it holds on every search:
    hnswlib's own RuntimeError, as a graph whose search stops short raises it."""

    def __init__(self, index: hnswlib.Index) -> None:
        self.index = index

    def knn_query(self, query: Any, k: int = 1, **kwargs: Any) -> Any:
        return self.index.knn_query(query, k=self.index.get_current_count() + 1, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.index, name)


def short_graph_engine(tmp_path: Path) -> Engine:
    engine = build_engine(PLACES, tmp_path)
    snapshot = engine.searcher(KB).snapshot
    snapshot.index = ShortGraph(snapshot.index)  # type: ignore[assignment]
    return engine


def test_knn_names_the_graph_hnswlib_could_not_search() -> None:
    graph = hnswlib.Index(space="ip", dim=4)
    graph.init_index(max_elements=2)
    graph.add_items(np.eye(4, dtype=np.float32)[:2], [0, 1])
    with pytest.raises(GraphSearchFailed, match=r"the graph: a search for 3 found fewer"):
        knn(graph, np.ones((1, 4), dtype=np.float32), 3, "the graph")


async def test_a_search_the_graph_cannot_answer_is_answered_lexically_and_logged_once(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    engine = short_graph_engine(tmp_path)
    try:
        with caplog.at_level(logging.ERROR, logger="voxrecall.engine"):
            first = await engine.search(SearchInput(query="when does harbor grill open"))
            turn = await engine.turn(TurnInput(session_id="s", text="Does Blue Door Cafe bake?"))
    finally:
        await engine.aclose()
    assert first.degraded
    assert turn.degraded
    assert first.hits[0].chunk.title == "HARBOR GRILL"
    assert turn.hits[0].chunk.title == "BLUE DOOR CAFE"
    assert engine.counters.graph_failures >= 2
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 1, lines  # once per snapshot, not once per search
    assert "vectors.hnsw" in lines[0]
    assert "lexically" in lines[0]


async def test_a_search_by_a_vector_alone_the_graph_cannot_answer_is_internal(
    tmp_path: Path,
) -> None:
    engine = short_graph_engine(tmp_path)
    vector = np.ones(engine.embedder.info.dimension, dtype=np.float32).tobytes()
    try:
        with pytest.raises(GraphSearchFailed) as failed:
            await engine.search(SearchInput(query="", vector=vector))
    finally:
        await engine.aclose()
    assert status_for(failed.value) == grpc.StatusCode.INTERNAL
