"""What a build holds while it writes a snapshot (session 19, bench/build_memory.py): the tables
are written from their arrays without a copy of the file in memory, the lexical index gathers
its postings in typed arrays, and the ef calibration scores its queries a block at a time. Each
bound is on tracemalloc's count of bytes, never on time."""

from __future__ import annotations

import random
import tracemalloc
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import index.snapshot
from index.lexical import LexicalIndex
from index.snapshot import choose_ef, write_atomic
from index.tables import ChunkTable, PageTable
from index.types import Chunk

WORDS = [f"w{i}x" for i in range(20_000)]  # words no stemmer shortens, few stopwords among them


def _texts(n: int, words: int, seed: int = 1) -> list[str]:
    rng = random.Random(seed)
    return [" ".join(rng.choices(WORDS, k=words)) for _ in range(n)]


def _chunks(n: int) -> list[Chunk]:
    texts = _texts(n, 120)
    return [
        Chunk(
            chunk_id=f"c{i}",
            source="docs",
            source_path=f"page-{i // 4}.md",
            title=f"Page {i // 4}",
            breadcrumbs=(f"Page {i // 4}", f"Section {i % 4}"),
            text=text,
            embed_text=f"Page {i // 4} > Section {i % 4}\n\n{text}",
        )
        for i, text in enumerate(texts)
    ]


@contextmanager
def _traced() -> Iterator[dict[str, int]]:
    """The peak bytes tracemalloc counts inside the block, above what was held at its start."""
    grown: dict[str, int] = {}
    tracemalloc.start()
    try:
        start, _ = tracemalloc.get_traced_memory()
        tracemalloc.reset_peak()
        yield grown
        grown["peak"] = tracemalloc.get_traced_memory()[1] - start
    finally:
        tracemalloc.stop()


@pytest.mark.parametrize(
    ("parts", "dump", "arg"),
    [
        (ChunkTable.parts, ChunkTable.dump, lambda: _chunks(3_000)),
        (
            PageTable.parts,
            PageTable.dump,
            lambda: {f"docs:page-{i}.md": t for i, t in enumerate(_texts(800, 500))},
        ),
    ],
    ids=["chunks", "pages"],
)
def test_a_table_is_written_without_its_file_held_in_memory(
    tmp_path: Path,
    parts: Callable[[Any], Any],
    dump: Callable[[Any], bytes],
    arg: Callable[[], Any],
) -> None:
    """Before, a table's strings were encoded into a list, joined, copied per array, padded,
    joined again and prefixed: about five copies of the file at once."""
    value = arg()
    path = tmp_path / "table.bin"
    with _traced() as grown:
        write_atomic(path, parts(value))
    size = path.stat().st_size
    assert path.read_bytes() == dump(value)  # the same bytes as the table's dump
    assert grown["peak"] < 1.4 * size, (grown["peak"], size)


def test_the_lexical_index_gathers_postings_in_typed_arrays() -> None:
    """Before, three lists held 8-byte pointers a posting beside the arrays made of them: 64
    bytes a posting at the peak of this build, 23 since."""
    texts = _texts(3_000, 150)
    reference = LexicalIndex.build(list(texts))
    postings = sum(len(docs) for docs in reference.postings(WORDS))  # a (term, doc) each
    with _traced() as grown:
        built = LexicalIndex.build(iter(texts))
    assert built.to_bytes() == reference.to_bytes()
    assert grown["peak"] < 40 * postings, (grown["peak"], postings)


def test_the_ef_calibration_scores_a_block_of_queries_at_a_time(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Before, 200 queries' scores and sort order over every chunk were held at once (48 MB
    here, 2.4 GB at 1M chunks); a block at a time, the exact neighbours, and so the ef chosen,
    are as they were."""
    rng = np.random.default_rng(3)
    vectors = rng.normal(size=(20_000, 16)).astype(np.float32)
    vectors /= np.linalg.norm(vectors, axis=1, keepdims=True)
    graph = index.snapshot.build_hnsw(vectors, 16, 100)
    whole = choose_ef(graph, vectors, 0.95)
    monkeypatch.setattr(index.snapshot, "EXACT_BLOCK_BYTES", 1 << 20, raising=False)
    with _traced() as grown:
        blocked = choose_ef(graph, vectors, 0.95)
    assert blocked == whole
    assert grown["peak"] < 8 << 20, grown["peak"]
