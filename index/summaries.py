"""A snapshot's second view of its chunks: one vector per chunk of what question it answers.

A base built with ``summaries = true`` has two more files, listed (and checksummed) in its
manifest like every other:

    summaries.hnsw    hnswlib index of the summary vectors; label i = chunk i (as vectors.hnsw)
    summaries.json    the summary texts, in label order (what was embedded; read by people and
                      by the next build, which reuses the vectors of unchanged summaries)

The manifest's ``extra.summaries`` says which view wrote them: ``"model"`` ([index.llm]) or
``"heading"`` (the chunk's heading path and first sentence, no model). A snapshot without them
loads as before, and a reader that does not know them ignores them, so the format version is
unchanged. ``sidecar/turn/relevance.py`` fuses this prong with the content prong when it is there.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import hnswlib
import numpy as np
import orjson

from index.embedders.base import Vectors
from index.errors import CorruptSnapshot
from index.hnsw_file import check_hnsw_file, check_hnsw_head, knn
from index.types import Chunk

SUMMARY_VECTORS = "summaries.hnsw"
SUMMARY_TEXTS = "summaries.json"
SUMMARY_FILES = (SUMMARY_VECTORS, SUMMARY_TEXTS)
FIRST_SENTENCE_CHARS = 300  # a "sentence" longer than this is a list or a table: cut it
_SENTENCE_END = re.compile(r"(?<=[.!?])\s")
_MARKUP = re.compile(r"[#*_`>|\[\]]+")


def heading_summary(chunk: Chunk) -> str:
    """The offline view: the chunk's heading path, then the first sentence of its text."""
    path = " > ".join(chunk.breadcrumbs) or chunk.title
    return f"{path}\n{first_sentence(chunk.text)}".strip()


def first_sentence(text: str) -> str:
    flat = " ".join(_MARKUP.sub(" ", text).split())
    head = _SENTENCE_END.split(flat, maxsplit=1)[0]
    return head[:FIRST_SENTENCE_CHARS]


@dataclass(frozen=True, slots=True)
class SummaryIndex:
    """The summary vectors of a loaded snapshot (same labels as its chunks) and the view."""

    index: hnswlib.Index
    view: str
    count: int  # 0: hnswlib never loaded the index, and a query on it would crash the process

    def search(self, vector: Vectors, k: int) -> list[tuple[int, float]]:
        if k <= 0 or not self.count:
            return []
        labels, distances = knn(self.index, vector.reshape(1, -1), k, "the summaries' graph")
        return [
            (int(label), 1.0 - float(d)) for label, d in zip(labels[0], distances[0], strict=True)
        ]

    def scores(self, vector: Vectors, labels: list[int]) -> dict[int, float]:
        """The exact summary cosine of each label."""
        if not labels or not self.count:
            return {}
        rows = np.asarray(self.index.get_items(labels, return_type="numpy"), dtype=np.float32)
        values = np.einsum("ij,j->i", rows, vector)
        return {label: float(v) for label, v in zip(labels, values, strict=True)}


def has_summaries(files: Any) -> bool:
    return all(name in files for name in SUMMARY_FILES)


def read_summary_texts(path: Path, count: int) -> list[str]:
    try:
        texts = orjson.loads(path.read_bytes())
    except (OSError, orjson.JSONDecodeError) as exc:
        raise CorruptSnapshot(f"{path}: unreadable summaries: {exc}") from exc
    if type(texts) is not list or any(type(t) is not str for t in texts) or len(texts) != count:
        raise CorruptSnapshot(f"{path}: not a list of {count} summary texts")
    return texts


def load_summary_index(
    folder: Path, *, count: int, dimension: int, m: int, ef: int, view: str, checked: bool = False
) -> SummaryIndex:
    """The summary vectors, checked as the content vectors are before hnswlib reads them
    (``checked``: the store's fetch did, ``index.snapshot.verify_fetched``).

    ``summaries.json`` is not read: a query reads only the vectors, and the next build, which
    reads the texts, checks them then (``read_summary_texts``)."""
    path = folder / SUMMARY_VECTORS
    index = hnswlib.Index(space="ip", dim=dimension)
    if count:
        check = check_hnsw_head if checked else check_hnsw_file
        check(path, count=count, dimension=dimension, m=m)
        try:
            index.load_index(str(path), max_elements=count)
        except (RuntimeError, MemoryError) as exc:
            raise CorruptSnapshot(f"{path}: hnswlib cannot load it: {exc}") from exc
        index.set_ef(ef)
    return SummaryIndex(index=index, view=view, count=count)
