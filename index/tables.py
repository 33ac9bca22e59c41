"""The chunk and page stores of a format-4 snapshot, read in place from memory-mapped files.

``chunks.bin`` (kind ``voxrecall.chunks``) holds every string of every chunk in one table: chunk
``i``'s strings are ``first[i]`` up to ``first[i + 1]``, in the order id, path, title, text,
embed text, url, then ``crumbs[i]`` breadcrumbs, then the metadata as key, value pairs. Its
source is ``sources[source_of[i]]`` (the names are in the header), so the per-source arrays a
sidecar filters with are read, not rebuilt. ``pages.bin`` (kind ``voxrecall.pages``) holds the
page keys, sorted, and their texts in the same order: a page is found by binary search.

Opening either checks every array's extent and every offset (monotonic, within the tables,
counts that add up), in numpy over the offsets alone; the texts are not read until a caller asks
for one. A chunk is built on each access, in a few microseconds.
"""

from __future__ import annotations

import bisect
import itertools
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any, Final, overload

import numpy as np
import numpy.typing as npt

from index.mapped import ArraysFile, StringTable, dump_arrays
from index.types import Chunk

CHUNKS_KIND: Final = "voxrecall.chunks"
PAGES_KIND: Final = "voxrecall.pages"
_FIXED: Final = 6  # id, path, title, text, embed text, url
# Chunks decoded for calls are kept, up to this many bytes of their text per snapshot: the hits
# of recent calls come back (a follow-up, the same question asked again) and a decode costs
# more than building the response. Counted in the snapshot's memory_bytes.
CACHE_BYTES: Final = 1 << 18


class ChunkTable(Sequence[Chunk]):
    """The chunks of one snapshot in label order; ``table[i]`` is chunk ``i``."""

    __slots__ = (
        "_blob", "_cache", "_cached_bytes", "_crumbs", "_ends", "_first", "_source", "_source_of",
        "source_names", "source_of",
    )  # fmt: skip

    def __init__(
        self,
        strings: StringTable,
        first: npt.NDArray[np.uint64],
        crumbs: npt.NDArray[np.uint32],
        source_of: npt.NDArray[np.int32],
        source_names: tuple[str, ...],
    ) -> None:
        self.source_of = source_of
        self.source_names = source_names
        # Read per chunk through memoryviews: indexing one gives a Python int in a fraction of
        # what a numpy scalar costs, and a chunk is read on every hit of every call.
        self._blob, self._ends = strings.parts()
        self._first = first.data
        self._crumbs = crumbs.data
        self._source_of = source_of.data
        self._source = list(source_names)
        self._cache: dict[int, Chunk] = {}
        self._cached_bytes = 0

    @staticmethod
    def dump(chunks: Sequence[Chunk]) -> bytes:
        """The bytes of ``chunks.bin`` for these chunks."""
        names = sorted({c.source for c in chunks})
        position = {name: i for i, name in enumerate(names)}
        strings: list[str] = []
        first = np.zeros(len(chunks) + 1, dtype=np.uint64)
        for i, c in enumerate(chunks):
            strings += (c.chunk_id, c.source_path, c.title, c.text, c.embed_text, c.url)
            strings += c.breadcrumbs
            for key, value in c.metadata.items():
                strings += (key, value)
            first[i + 1] = len(strings)
        arrays: dict[str, npt.NDArray[Any]] = {
            **StringTable.of(strings).arrays("s_"),
            "first": first,
            "crumbs": np.asarray([len(c.breadcrumbs) for c in chunks], dtype=np.uint32),
            "source_of": np.asarray([position[c.source] for c in chunks], dtype=np.int32),
        }
        return dump_arrays(CHUNKS_KIND, arrays, count=len(chunks), sources=names)

    @classmethod
    def open(cls, path: Path) -> ChunkTable:
        """Map and check ``chunks.bin``; ValueError naming what is wrong."""
        return cls.read(ArraysFile.open(path, CHUNKS_KIND))

    @classmethod
    def read(cls, file: ArraysFile) -> ChunkTable:
        count = file.integer("count", 0, 1 << 32)
        names = file.header.get("sources")
        if type(names) is not list or any(type(n) is not str for n in names):
            raise ValueError("the header's sources are not a list of names")
        strings = StringTable.read(file, "s_")
        first = file.array("first", "<u8")
        crumbs = file.array("crumbs", "<u4")
        source_of = file.array("source_of", "<i4")
        if (first.size, crumbs.size, source_of.size) != (count + 1, count, count):
            raise ValueError(f"the per-chunk arrays do not all hold {count} chunks")
        _check_spans(first, crumbs, len(strings))
        if count and (int(source_of.min()) < 0 or int(source_of.max()) >= len(names)):
            raise ValueError("a chunk's source is outside the header's sources")
        return cls(strings, first, crumbs, source_of, tuple(names))

    def __len__(self) -> int:
        return len(self._crumbs)

    @overload
    def __getitem__(self, i: int) -> Chunk: ...
    @overload
    def __getitem__(self, i: slice) -> list[Chunk]: ...
    def __getitem__(self, i: int | slice) -> Chunk | list[Chunk]:
        if isinstance(i, slice):
            return [self._decode(j) for j in range(*i.indices(len(self)))]
        chunk = self._cache.get(i)
        if chunk is not None:
            return chunk
        if i < 0:
            return self[i + len(self)]
        if not 0 <= i < len(self):
            raise IndexError(i)
        return self._kept(i, self._decode(i))

    def __iter__(self) -> Iterator[Chunk]:
        """Every chunk, decoded (a scan does not pass through the cache)."""
        for i in range(len(self)):
            yield self._decode(i)

    def _kept(self, i: int, chunk: Chunk) -> Chunk:
        size = self._ends[self._first[i + 1]] - self._ends[self._first[i]]
        if self._cached_bytes + size > CACHE_BYTES:
            self._cache = {}  # a new dict: a reader in another thread keeps the old one
            self._cached_bytes = 0
        self._cache[i] = chunk
        self._cached_bytes += size
        return chunk

    def _decode(self, i: int) -> Chunk:
        ends = self._ends[self._first[i] : self._first[i + 1] + 1].tolist()
        blob = self._blob
        s = [str(blob[a:b], "utf-8", "replace") for a, b in itertools.pairwise(ends)]
        crumbs_end = _FIXED + self._crumbs[i]
        meta = s[crumbs_end:]
        return Chunk(
            chunk_id=s[0],
            source=self._source[self._source_of[i]],
            source_path=s[1],
            title=s[2],
            breadcrumbs=tuple(s[_FIXED:crumbs_end]),
            text=s[3],
            embed_text=s[4],
            url=s[5],
            metadata=dict(zip(meta[::2], meta[1::2], strict=True)),
        )


def _check_spans(first: npt.NDArray[np.uint64], crumbs: npt.NDArray[np.uint32], total: int) -> None:
    """Each chunk's span of strings holds its six fields, its breadcrumbs and whole key-value
    pairs, and the spans tile the string table."""
    if int(first[0]) != 0 or int(first[-1]) != total:
        raise ValueError("the chunks' string spans do not cover the string table")
    width = np.diff(first.astype(np.int64))
    extra = width - _FIXED - crumbs.astype(np.int64)
    if width.size and (bool(np.any(extra < 0)) or bool(np.any(np.remainder(extra, 2)))):
        raise ValueError("a chunk's string span does not fit its fields and breadcrumbs")


class PageTable(Mapping[str, str]):
    """Page key -> whole page text, the keys sorted so that a lookup is a binary search."""

    __slots__ = ("_keys", "_texts")

    def __init__(self, keys: StringTable, texts: StringTable) -> None:
        self._keys = keys
        self._texts = texts

    @staticmethod
    def dump(pages: Mapping[str, str]) -> bytes:
        keys = sorted(pages)
        arrays = {
            **StringTable.of(keys).arrays("k_"),
            **StringTable.of([pages[k] for k in keys]).arrays("t_"),
        }
        return dump_arrays(PAGES_KIND, arrays, count=len(keys))

    @classmethod
    def open(cls, path: Path) -> PageTable:
        """Map and check ``pages.bin``; ValueError naming what is wrong. Keys out of order are
        not looked for (a lookup may miss them), never a failure."""
        file = ArraysFile.open(path, PAGES_KIND)
        count = file.integer("count", 0, 1 << 40)
        keys, texts = StringTable.read(file, "k_"), StringTable.read(file, "t_")
        if len(keys) != count or len(texts) != count:
            raise ValueError(f"the page keys and texts do not both hold {count} pages")
        return cls(keys, texts)

    def _find(self, key: str) -> int:
        i = bisect.bisect_left(self._keys, key)
        return i if i < len(self._keys) and self._keys[i] == key else -1

    def __getitem__(self, key: str) -> str:
        i = self._find(key) if type(key) is str else -1
        if i < 0:
            raise KeyError(key)
        return self._texts[i]

    def __contains__(self, key: object) -> bool:
        return type(key) is str and self._find(key) >= 0

    def __iter__(self) -> Iterator[str]:
        return iter(self._keys)

    def __len__(self) -> int:
        return len(self._keys)
