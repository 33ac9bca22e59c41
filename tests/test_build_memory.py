"""What a build holds while it writes a snapshot (session 19, bench/build_memory.py): the tables
are written from their arrays without a copy of the file in memory, the lexical index gathers
its postings in typed arrays, and the ef calibration scores its queries a block at a time. Each
bound is on tracemalloc's count of bytes, never on time; the files' bytes are pinned by the
sha256 the code before wrote for fixed inputs."""

from __future__ import annotations

import hashlib
import random
import tracemalloc
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import index.snapshot
from bench.build_memory import _hnsw_found
from index.lexical import LexicalIndex
from index.mapped import Parts
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


# A few fixed inputs, each file's sha256 as the code before session 19 wrote it (a list of
# encodings joined, each array's ``tobytes`` padded and joined): the pieces must be those bytes.
FIXED_CHUNKS = [
    Chunk(
        chunk_id="c0",
        source="wiki",
        source_path="a/b.md",
        title="Café",
        breadcrumbs=("Café", "Menu"),
        text="Espresso costs 2 €; a latte costs 3 €.",
        embed_text="Café > Menu\n\nEspresso costs 2 €; a latte costs 3 €.",
        url="https://example.com/a/b",
        metadata={"lang": "en", "tags": ("drinks", "prices")},
    ),
    Chunk(
        chunk_id="c1",
        source="docs",
        source_path="x.md",
        title="",
        breadcrumbs=(),
        text="",
        embed_text="",
    ),
    Chunk(
        chunk_id="c2",
        source="wiki",
        source_path="a/b.md",
        title="Café",
        breadcrumbs=("Café", "Hours", "日曜日"),
        text="Open daily, 7 to 19; closed on 日曜日.",
        embed_text="Café > Hours > 日曜日\n\nOpen daily, 7 to 19; closed on 日曜日.",
        metadata={"lang": "en"},
    ),
]
FIXED_PAGES = {
    "wiki:a/b.md": "# Café\n\n## Menu\nEspresso costs 2 €.\n",
    "docs:x.md": "",
    "docs:y/z.md": "日曜日 " * 50,
}
FIXED_TEXTS = [
    "The running runners ran; the runner runs and runs again.",
    "",
    "Café crème, café noir: 2 € each, 日曜日 closed.",
    "and the of to",  # stopwords only
    "runs " * 70_000,  # a term frequency past the uint16 cap
]
GOLDEN = {
    "chunks": "6274736452c72d1cba2ab694147956ed8cb8837f76b66c090ba46ae8b1c63069",
    "chunks-empty": "bcd379d68968bc9c10347cd85543f5a84b3f2911f18f94d159ed9de3cb59f358",
    "pages": "cb42a5185bd58101f670b6c5ab30c8a6f94de3c7e73b62110f087d3818283858",
    "pages-empty": "1fe94d584f2970edf1ef659f2c35d2d718be702af100585f3f427c421604c106",
    "lexical": "eb5d92120480219eb3d4d3acdc501756361cdaebf964c3861a42b23b1b6c4453",
    "lexical-empty": "ec9c9d2d342571171540b44931f252cfe88ee830bddfa3a0a9c36a0fd97d44ea",
}


def _golden_files() -> dict[str, Callable[[], tuple[bytes, Parts]]]:
    """Each fixed file's bytes whole (``dump``, ``to_bytes``) and in pieces (``parts``)."""

    def lexical(texts: list[str]) -> tuple[bytes, Parts]:
        built = LexicalIndex.build(iter(texts))
        return built.to_bytes(), built.to_parts()

    return {
        "chunks": lambda: (ChunkTable.dump(FIXED_CHUNKS), ChunkTable.parts(FIXED_CHUNKS)),
        "chunks-empty": lambda: (ChunkTable.dump([]), ChunkTable.parts([])),
        "pages": lambda: (PageTable.dump(FIXED_PAGES), PageTable.parts(FIXED_PAGES)),
        "pages-empty": lambda: (PageTable.dump({}), PageTable.parts({})),
        "lexical": lambda: lexical(FIXED_TEXTS),
        "lexical-empty": lambda: lexical([]),
    }


@pytest.mark.parametrize("name", sorted(GOLDEN))
def test_a_file_written_in_pieces_has_the_bytes_it_had(tmp_path: Path, name: str) -> None:
    """The tables and the lexical index, written whole or piece by piece, hash to what the code
    before session 19 wrote for the same input: a snapshot's files and their sha256 are as
    they were."""
    whole, parts = _golden_files()[name]()
    path = tmp_path / "file.bin"
    write_atomic(path, parts)
    assert hashlib.sha256(whole).hexdigest() == GOLDEN[name]
    assert hashlib.sha256(path.read_bytes()).hexdigest() == GOLDEN[name]


@pytest.mark.parametrize(
    ("parts", "arg"),
    [
        (ChunkTable.parts, lambda: _chunks(3_000)),
        (
            PageTable.parts,
            lambda: {f"docs:page-{i}.md": t for i, t in enumerate(_texts(800, 500))},
        ),
    ],
    ids=["chunks", "pages"],
)
def test_a_table_is_written_without_its_file_held_in_memory(
    tmp_path: Path, parts: Callable[[Any], Parts], arg: Callable[[], Any]
) -> None:
    """Before, a table's strings were encoded into a list, joined, copied per array, padded,
    joined again and prefixed: about five copies of the file at once."""
    value = arg()
    path = tmp_path / "table.bin"
    with _traced() as grown:
        write_atomic(path, parts(value))
    size = path.stat().st_size
    assert grown["peak"] < 1.4 * size, (grown["peak"], size)


def test_the_lexical_index_gathers_postings_in_typed_arrays() -> None:
    """Before, three lists held 8-byte pointers a posting beside the arrays made of them: 64
    bytes a posting at the peak of this build, 23 since."""
    texts = _texts(3_000, 150)
    with _traced() as grown:
        built = LexicalIndex.build(iter(texts))
    postings = sum(len(docs) for docs in built.postings(WORDS))  # a (term, doc) each
    assert grown["peak"] < 40 * postings, (grown["peak"], postings)


def test_the_ef_calibration_scores_a_block_of_queries_at_a_time(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Before, 200 queries' scores and sort order over every chunk were held at once (48 MB
    here, 2.4 GB at 1M chunks); a block at a time, the ef chosen here is the same (a block's
    product may differ from the whole one's in the last bits, so it is not so for every
    near-tie)."""
    rng = np.random.default_rng(3)
    vectors = rng.normal(size=(20_000, 16)).astype(np.float32)
    vectors /= np.linalg.norm(vectors, axis=1, keepdims=True)
    graph = index.snapshot.build_hnsw(vectors, 16, 100)
    whole = choose_ef(graph, vectors, 0.95)
    monkeypatch.setattr(index.snapshot, "EXACT_BLOCK_BYTES", 1 << 20)
    with _traced() as grown:
        blocked = choose_ef(graph, vectors, 0.95)
    assert blocked == whole
    assert grown["peak"] < 8 << 20, grown["peak"]


def test_two_builds_compared_say_whether_their_manifests_hnsw_is_the_same() -> None:
    """``--compare`` read the manifests' counts and file names but never the ef the calibration
    chose nor the recall it measured."""
    a = {"m": 16, "ef_construction": 200, "ef": 64, "measured_recall_at_10": 0.955}
    assert _hnsw_found(a, dict(a)) == (
        "same m 16, ef_construction 200, ef 64, measured_recall_at_10 0.955"
    )
    b = {**a, "ef": 96, "measured_recall_at_10": 0.97}
    assert _hnsw_found(a, b) == "differs: ef 64 -> 96, measured_recall_at_10 0.955 -> 0.97"
