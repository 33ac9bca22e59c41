"""The chunk and page stores of a format-4 snapshot, read in place from memory-mapped files.

``chunks.bin`` (kind ``voxrecall.chunks``) holds every string of every chunk in one table: chunk
``i``'s strings are ``first[i]`` up to ``first[i + 1]``, in the order id, path, title, text,
embed text, url, then ``crumbs[i]`` breadcrumbs, then the metadata: each entry its key, then
its value's strings. Chunk ``i``'s entries are ``meta_first[i]`` up to ``meta_first[i + 1]`` of
``meta_n``, which holds -1 for a string value (one string) or ``n`` for a list of ``n`` strings
(a frontmatter list stays a list: ``index/filters.py`` matches its elements). Its source is ``sources[source_of[i]]`` (the names are in the header), so the per-source arrays a
sidecar filters with are read, not rebuilt. ``pages.bin`` (kind ``voxrecall.pages``) holds the
page keys, sorted, and their texts in the same order: a page is found by binary search.

Opening either checks every array's extent and every offset (monotonic, within the tables,
counts that add up), in numpy over the offsets alone; the texts are not read until a caller asks
for one. A chunk is built on each access, in a few microseconds; a caller that writes UTF-8
(a Search's answer) may read a chunk's strings as bytes instead (``ChunkTable.utf8``), for
every chunk within its caps whose strings are valid UTF-8.
"""

from __future__ import annotations

import bisect
import itertools
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from types import MappingProxyType
from typing import Any, Final, TypeAlias, overload

import numpy as np
import numpy.typing as npt

from index.chunker import (
    MAX_CHUNK_BYTES,
    MAX_FIELD_BYTES,
    MAX_META_BYTES,
    MAX_META_STRINGS,
    bounded,
)
from index.mapped import ArraysFile, Parts, StringTable, arrays_parts, let_go
from index.types import Chunk, MetaValue

CHUNKS_KIND: Final = "voxrecall.chunks"
PAGES_KIND: Final = "voxrecall.pages"
FIXED: Final = 6  # a chunk's first strings: id, path, title, text, embed text, url
_FIXED: Final = FIXED
_NO_METADATA: Final[Mapping[str, MetaValue]] = MappingProxyType({})
_HEAD_BYTES: Final = 512  # of an embed text searched for its head first (``ChunkTable.heads``)
STRING_VALUE: Final = -1  # meta_n of a metadata value that is one string, not a list
_STRING: Final = STRING_VALUE
# Chunks decoded for calls are kept, up to this many bytes per snapshot (their strings' UTF-8
# and _KEPT_OVERHEAD each): the hits of recent calls come back (a follow-up, the same question
# asked again) and a decode costs as much as building the response. 2 MiB holds the hits of a
# few hundred distinct questions (bench search's 200 queries x 10 hits of ~500 bytes: ~1,700
# chunks); at 256 KiB those missed every time. Counted in the snapshot's memory_bytes.
CACHE_BYTES: Final = 1 << 21
# What a decoded chunk takes beyond its strings' bytes: the Chunk, nine str headers, a tuple and
# a dict (sys.getsizeof, Python 3.11: ~700 bytes), so that many tiny chunks cannot pass the bound.
_KEPT_OVERHEAD: Final = 768
# A chunk's text as read is at most MAX_CHUNK_BYTES (UTF-8), the chunker's cap: a snapshot built
# before the cap may hold larger ones (a whole page as one chunk), cut here at a character, so
# that no answer, tool output or rerank request carries more of one (the whole page is
# ReadPage's). A text of this many characters or fewer is within it whatever they are.
_SURE_CHARS: Final = MAX_CHUNK_BYTES // 4
# Every other string of a chunk is cut as read too, so that a snapshot holding a 5 MB title puts
# no 5 MB in every answer: the id, path, title, URL, each breadcrumb and each metadata key and
# value at MAX_FIELD_BYTES (PATH_MAX; a sitemap's URLs are at most 2,048 characters), the
# embedded text at the text's cap plus one field (its "Title > H2 > H3" prefix), at most
# MAX_CRUMBS breadcrumbs (the chunker writes the title and H1-H3), and metadata entries while
# their strings stay within MAX_META_BYTES and MAX_META_STRINGS. The caps are the chunker's
# (index/chunker.py), which cuts a chunk's strings to them as it builds them: a snapshot of
# this version's build is within all of it; only a chunk over one of them (an older build's,
# a hand-made one's) is read the slow way (``_over``, found at open in numpy over the offsets).
MAX_EMBED_BYTES: Final = MAX_CHUNK_BYTES + MAX_FIELD_BYTES
MAX_CRUMBS: Final = 16
_BLOCK: Final = 1 << 16  # chunks checked at a time at open (``_oversized``)
# A source path compared byte for byte with its neighbour's to find a page's run of chunks
# (``ChunkTable.page_runs``) up to this many bytes; a longer one is a run of its own chunk.
RUN_PATH_BYTES: Final = 512
_GATHER: Final = 1 << 21  # bytes of temporaries per block of path pairs compared at once
_WORD_BYTES: Final = 8
# _LOW_BYTES[k]: the mask of a little-endian word's first k bytes
_LOW_BYTES: Final = np.array([(1 << (8 * k)) - 1 for k in range(_WORD_BYTES + 1)], dtype=np.uint64)
# the cap of each fixed field: id, path, title, text, embed text, url
_CAPS: Final = (
    MAX_FIELD_BYTES, MAX_FIELD_BYTES, MAX_FIELD_BYTES, MAX_CHUNK_BYTES, MAX_EMBED_BYTES,
    MAX_FIELD_BYTES,
)  # fmt: skip


class ChunkTable(Sequence[Chunk]):
    """The chunks of one snapshot in label order; ``table[i]`` is chunk ``i``."""

    __slots__ = (
        "__weakref__", "_blob", "_cache", "_cached_bytes", "_crumbs", "_ends", "_first",
        "_meta_first", "_meta_n", "_over", "_source", "_source_of", "cache_bytes", "source_names",
        "source_of",
    )  # fmt: skip

    def __init__(
        self,
        strings: StringTable,
        first: npt.NDArray[np.uint64],
        crumbs: npt.NDArray[np.uint32],
        meta: tuple[npt.NDArray[np.uint64], npt.NDArray[np.int32]],
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
        self._meta_first, self._meta_n = meta[0].data, meta[1].data
        self._source_of = source_of.data
        self._source = list(source_names)
        self._cache: dict[int, Chunk] = {}
        self._cached_bytes = 0
        over = _oversized(np.asarray(self._ends), first, crumbs)
        self._over = over.data if over is not None else None  # 1: read with every cap
        # no more than every chunk decoded: a small base does not reserve what it cannot fill
        self.cache_bytes = min(CACHE_BYTES, len(self._blob) + len(crumbs) * _KEPT_OVERHEAD)

    @staticmethod
    def dump(chunks: Sequence[Chunk]) -> bytes:
        """The bytes of ``chunks.bin`` for these chunks."""
        return b"".join(ChunkTable.parts(chunks))

    @staticmethod
    def parts(chunks: Sequence[Chunk]) -> Parts:
        """The bytes of ``chunks.bin`` for these chunks, in pieces (``arrays_parts``)."""
        names = sorted({c.source for c in chunks})
        position = {name: i for i, name in enumerate(names)}
        strings: list[str] = []
        meta_n: list[int] = []
        first = np.zeros(len(chunks) + 1, dtype=np.uint64)
        meta_first = np.zeros(len(chunks) + 1, dtype=np.uint64)
        for i, c in enumerate(chunks):
            strings += (c.chunk_id, c.source_path, c.title, c.text, c.embed_text, c.url)
            strings += c.breadcrumbs
            for key, value in c.metadata.items():
                values = (value,) if isinstance(value, str) else value
                strings += (key, *values)
                meta_n.append(_STRING if isinstance(value, str) else len(value))
            first[i + 1] = len(strings)
            meta_first[i + 1] = len(meta_n)
        arrays: dict[str, npt.NDArray[Any]] = {
            **StringTable.of(strings).arrays("s_"),
            "first": first,
            "crumbs": np.asarray([len(c.breadcrumbs) for c in chunks], dtype=np.uint32),
            "meta_first": meta_first,
            "meta_n": np.asarray(meta_n, dtype=np.int32),
            "source_of": np.asarray([position[c.source] for c in chunks], dtype=np.int32),
        }
        return arrays_parts(CHUNKS_KIND, arrays, count=len(chunks), sources=names)

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
        meta = file.array("meta_first", "<u8"), file.array("meta_n", "<i4")
        source_of = file.array("source_of", "<i4")
        sizes = (first.size, crumbs.size, meta[0].size, source_of.size)
        if sizes != (count + 1, count, count + 1, count):
            raise ValueError(f"the per-chunk arrays do not all hold {count} chunks")
        _check_spans(first, crumbs, len(strings))
        _check_metadata(first, crumbs, *meta)
        if count and (int(source_of.min()) < 0 or int(source_of.max()) >= len(names)):
            raise ValueError("a chunk's source is outside the header's sources")
        return cls(strings, first, crumbs, meta, source_of, tuple(names))

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

    def column(self, field: int) -> list[str]:
        """Fixed field ``field`` (0 id, 1 source path, 2 title, 3 text, 4 embed text, 5 url) of
        every chunk in label order, read from the string table alone: no Chunk is built (a load
        reads every chunk's source path; decoding every chunk took most of a 100k load)."""
        if not 0 <= field < _FIXED:
            raise ValueError(f"field must be 0 to {_FIXED - 1}, got {field}")
        starts, stops = self._spans(field)
        blob, cap = self._blob, _CAPS[field]
        if self._over is None:  # every string within its cap (or a text cut as a chunk's is)
            out = [str(blob[a:b], "utf-8", "replace") for a, b in zip(starts, stops, strict=True)]
            return [t if len(t) <= _SURE_CHARS else _bounded(t) for t in out] if field == 3 else out
        return [_read(blob, a, b, cap) for a, b in zip(starts, stops, strict=True)]

    def let_go(self) -> None:
        """Drop this process's pages of the mapped file (``mapped.let_go``), after a scan."""
        let_go(self._blob)

    def page_runs(self) -> tuple[npt.NDArray[np.int64], list[tuple[str, str]]]:
        """The runs of consecutive chunks of one page: where each starts, in label order, then
        ``len(self)``; and each run's (source, source path), as ``column(1)`` reads the path.
        Found in numpy over the offsets and the paths' bytes, a path decoded once a run, not
        once a chunk (a build writes a page's chunks together: 1M chunks of 125k pages took 3.8 s
        a chunk at a time). A page whose chunks are apart is several runs, as is one whose path
        is over RUN_PATH_BYTES (a run a chunk): a reader keyed by page keeps its first run.
        Found anew each call: the filter index reads them once at a load and keeps its paths."""
        return self._find_runs()

    def _find_runs(self) -> tuple[npt.NDArray[np.int64], list[tuple[str, str]]]:
        n = len(self)
        if not n:
            return np.zeros(1, dtype=np.int64), []
        ends = np.asarray(self._ends)
        at = np.asarray(self._first)[:-1] + np.uint64(1)
        starts = ends[at].astype(np.int64)
        lengths = ends[at + np.uint64(1)].astype(np.int64) - starts
        same = (self.source_of[1:] == self.source_of[:-1]) & (lengths[1:] == lengths[:-1])
        same &= lengths[1:] <= RUN_PATH_BYTES
        blob = np.frombuffer(self._blob, dtype=np.uint8)
        pairs = np.flatnonzero(same)  # chunk pairs+1 whose paths may be equal: compare bytes
        same[pairs] = _equal_spans(blob, starts[pairs], starts[pairs + 1], lengths[pairs + 1])
        first = np.concatenate(([0], np.flatnonzero(~same) + 1)).astype(np.int64)
        bounds = np.append(first, n)
        bounds.setflags(write=False)
        return bounds, self._run_keys(first, starts, starts + lengths)

    def _run_keys(
        self,
        first: npt.NDArray[np.int64],
        starts: npt.NDArray[np.int64],
        stops: npt.NDArray[np.int64],
    ) -> list[tuple[str, str]]:
        """(source, path) of chunks ``first``, each path read as ``column(1)`` reads it."""
        blob, names = self._blob, self._source
        sources = self.source_of[first].tolist()
        spans = zip(starts[first].tolist(), stops[first].tolist(), strict=True)
        if self._over is None:
            paths = [str(blob[a:b], "utf-8", "replace") for a, b in spans]
        else:
            paths = [_read(blob, a, b, MAX_FIELD_BYTES) for a, b in spans]
        return [(names[s], path) for s, path in zip(sources, paths, strict=True)]

    def breadcrumbs(self, i: int) -> tuple[str, ...]:
        """Chunk ``i``'s breadcrumbs alone, as ``heads`` reads them: no Chunk is built."""
        at = int(self._first[i]) + _FIXED
        e = self._ends[at : at + min(int(self._crumbs[i]), MAX_CRUMBS) + 1].tolist()
        return tuple(_read(self._blob, a, b, MAX_FIELD_BYTES) for a, b in itertools.pairwise(e))

    def heads(self) -> Iterator[tuple[str, str, tuple[str, ...], str]]:
        """Every chunk's id, title, breadcrumbs and the head of its embed text (what comes
        before its first blank line, where the chunker writes a context or heading path; ""
        when it has none), without decoding its text: a scan of what each chunk is about
        (``sidecar.turn.followups``) reads a small part of the table, and builds no Chunk."""
        blob, ends, first, crumbs = self._blob, self._ends, self._first, self._crumbs
        ids, titles = self.column(0), self.column(2)
        starts, stops = self._spans(4)
        for i, (chunk_id, title, start, stop) in enumerate(
            zip(ids, titles, starts, stops, strict=True)
        ):
            at = first[i] + _FIXED
            e = ends[at : at + min(crumbs[i], MAX_CRUMBS) + 1].tolist()
            path = tuple(_read(blob, a, b, MAX_FIELD_BYTES) for a, b in itertools.pairwise(e))
            yield chunk_id, title, path, _head(blob, start, stop)

    def _spans(self, field: int) -> tuple[list[int], list[int]]:
        """Where fixed field ``field`` of every chunk starts and stops in the blob."""
        ends = np.asarray(self._ends)
        at = np.asarray(self._first)[:-1] + np.uint64(field)
        starts: list[int] = ends[at].tolist()
        stops: list[int] = ends[at + np.uint64(1)].tolist()
        return starts, stops

    def utf8(self, i: int) -> Utf8Chunk | None:
        """Chunk ``i``'s strings as the table holds them, when they are what ``table[i]``
        decodes (no string over its cap, each valid UTF-8): a caller writing UTF-8 (a Search's
        answer, sidecar/edge/messages.py) copies them without building a Chunk. None for a chunk
        to decode instead (``_over``, or bytes that decoding replaces)."""
        if self._over is not None and self._over[i]:
            return None
        ends = self._ends[self._first[i] : self._first[i + 1] + 1].tolist()
        if not _whole_characters(self._blob, ends):
            return None
        crumbs = self._crumbs[i]
        meta = (
            self._meta_n[self._meta_first[i] : self._meta_first[i + 1]].tolist()
            if len(ends) > _FIXED + crumbs + 1
            else []
        )
        return self._source[self._source_of[i]], ends, crumbs, meta

    @property
    def blob(self) -> memoryview:
        """The mapped bytes of every string, which ``utf8``'s offsets point into."""
        return self._blob

    def _kept(self, i: int, chunk: Chunk) -> Chunk:
        size = self._ends[self._first[i + 1]] - self._ends[self._first[i]] + _KEPT_OVERHEAD
        if self._cached_bytes + size > self.cache_bytes:
            self._cache = {}  # a new dict: a reader in another thread keeps the old one
            self._cached_bytes = 0
        self._cache[i] = chunk
        self._cached_bytes += size
        return chunk

    def _decode(self, i: int) -> Chunk:
        if self._over is not None and self._over[i]:
            return self._decode_bounded(i)
        s = self._strings(self._ends[self._first[i] : self._first[i + 1] + 1].tolist())
        crumbs_end = _FIXED + self._crumbs[i]
        # positional, in Chunk's field order (a keyword call costs more, on every hit)
        return Chunk(
            s[0],  # chunk_id
            self._source[self._source_of[i]],
            s[1],  # source_path
            s[2],  # title
            tuple(s[_FIXED:crumbs_end]),
            s[3] if len(s[3]) <= _SURE_CHARS else _bounded(s[3]),  # text
            s[4],  # embed_text
            s[5],  # url
            self._metadata(i, s, crumbs_end) if crumbs_end < len(s) else _NO_METADATA,
        )

    def _decode_bounded(self, i: int) -> Chunk:
        """Chunk ``i``, one of a string over its cap: each string read up to its cap, and no more
        breadcrumbs or metadata than the caps allow (the strings past them are not looked at)."""
        at, blob, crumbs = self._first[i], self._blob, self._crumbs[i]
        e = self._ends[at : at + _FIXED + min(crumbs, MAX_CRUMBS) + 1].tolist()
        s = [_read(blob, a, b, cap) for a, b, cap in zip(e, e[1:], _CAPS, strict=False)]
        path = tuple(_read(blob, a, b, MAX_FIELD_BYTES) for a, b in itertools.pairwise(e[_FIXED:]))
        return Chunk(
            s[0], self._source[self._source_of[i]], s[1], s[2], path, s[3], s[4], s[5],
            self._metadata_bounded(i, at + _FIXED + crumbs),
        )  # fmt: skip

    def _metadata_bounded(self, i: int, at: int) -> dict[str, MetaValue]:
        """Chunk ``i``'s metadata entries, whose strings start at string ``at``: of its first
        MAX_META_STRINGS entries, those whose strings fit in what is left of MAX_META_STRINGS
        and MAX_META_BYTES (each string cut at MAX_FIELD_BYTES), as the chunker writes them
        (``bounded_metadata``: an entry over a cap is left out, the ones after it still read)."""
        out: dict[str, MetaValue] = {}
        ends, budget, strings = self._ends, MAX_META_BYTES, MAX_META_STRINGS
        first = self._meta_first[i]
        for n in self._meta_n[first : min(first + MAX_META_STRINGS, self._meta_first[i + 1])]:
            width = 2 if n == _STRING else 1 + n
            if width > strings:
                at += width
                continue
            size = ends[at + width] - ends[at]
            if size <= budget:  # else left out, and the entries after it still looked at
                e = ends[at : at + width + 1].tolist()
                s = [_read(self._blob, a, b, MAX_FIELD_BYTES) for a, b in itertools.pairwise(e)]
                out[s[0]] = s[1] if n == _STRING else tuple(s[1:])
                budget -= size
            at, strings = at + width, strings - width
        return out

    def _strings(self, ends: list[int]) -> list[str]:
        """The strings between consecutive ``ends``: the span decoded at once and cut where it is
        ASCII (byte offsets are then character offsets), else each string decoded apart. Nine
        slices of one string cost a third of nine decodes of memoryview slices."""
        start = ends[0]
        whole = str(self._blob[start : ends[-1]], "utf-8", "replace")
        if whole.isascii():  # O(1) in CPython: a flag of the string
            return [whole[a - start : b - start] for a, b in itertools.pairwise(ends)]
        blob = self._blob
        return [str(blob[a:b], "utf-8", "replace") for a, b in itertools.pairwise(ends)]

    def _metadata(self, i: int, s: list[str], at: int) -> dict[str, MetaValue]:
        """Chunk ``i``'s metadata from its strings ``s``, whose entries start at ``at``."""
        out: dict[str, MetaValue] = {}
        for n in self._meta_n[self._meta_first[i] : self._meta_first[i + 1]].tolist():
            if n == _STRING:
                out[s[at]] = s[at + 1]
                at += 2
            else:
                out[s[at]] = tuple(s[at + 1 : at + 1 + n])
                at += 1 + n
        return out


# A chunk's strings in the mapped table (``ChunkTable.utf8``): its source, where each of its
# strings starts in ``ChunkTable.blob`` and then where the last ends (id, path, title, text,
# embed text, url, the breadcrumbs, then per metadata entry its key and values, the order
# ``ChunkTable.dump`` writes), its number of breadcrumbs and its metadata entries' ``meta_n``.
# A plain tuple: made for every hit of a plain Search (a NamedTuple's costs 0.35 us more).
Utf8Chunk: TypeAlias = tuple[str, list[int], int, list[int]]


def _whole_characters(blob: memoryview, ends: list[int]) -> bool:
    """Whether each string between consecutive ``ends`` is valid UTF-8: the span decodes
    strictly (ASCII, the common case, at memcpy speed), and no string starts inside a
    character (a valid span cut only where characters start leaves each piece valid)."""
    try:
        whole = str(blob[ends[0] : ends[-1]], "utf-8")
    except UnicodeDecodeError:
        return False
    stop = ends[-1]
    return whole.isascii() or all(a == stop or blob[a] & 0xC0 != 0x80 for a in ends)


def _bounded(text: str, cap: int = MAX_CHUNK_BYTES) -> str:
    """``text`` within ``cap`` bytes (UTF-8), cut at a character when over (the chunker's
    ``bounded``, at the text's cap by default)."""
    return bounded(text, cap)


def _read(blob: memoryview, start: int, stop: int, cap: int) -> str:
    """The string at ``blob[start:stop]``, at most ``cap`` bytes of UTF-8: no more than ``cap``
    bytes of it are decoded (a replaced byte may decode longer, so the result is cut again)."""
    if stop - start > cap:
        stop = start + cap
        while stop > start + cap - 3 and blob[stop] & 0xC0 == 0x80:  # inside a character
            stop -= 1
    text = str(blob[start:stop], "utf-8", "replace")
    return text if len(text) <= cap // 4 else _bounded(text, cap)


def _equal_spans(
    blob: npt.NDArray[np.uint8],
    a: npt.NDArray[np.int64],
    b: npt.NDArray[np.int64],
    lengths: npt.NDArray[np.int64],
) -> npt.NDArray[np.bool_]:
    """Whether ``blob[a[i]:a[i] + lengths[i]]`` equals ``blob[b[i]:b[i] + lengths[i]]``: eight
    bytes at a time, as 64-bit words read at any byte of the blob, over the pairs still equal;
    a block of pairs at a time (a few MiB of temporaries whatever the count)."""
    out = np.zeros(a.size, dtype=np.bool_)
    if blob.size < _WORD_BYTES:  # a few bytes: copied, with room for a word
        blob = np.concatenate((blob, np.zeros(_WORD_BYTES, dtype=np.uint8)))
    words = np.ndarray((blob.size - _WORD_BYTES + 1,), "<u8", blob, 0, (1,))  # words[i]: at i
    for lo in range(0, a.size, _GATHER // 8):
        hi = min(a.size, lo + _GATHER // 8)
        out[lo:hi] = _equal_block(blob, words, a[lo:hi], b[lo:hi], lengths[lo:hi])
    return out


def _equal_block(
    blob: npt.NDArray[np.uint8],
    words: npt.NDArray[np.uint64],
    a: npt.NDArray[np.int64],
    b: npt.NDArray[np.int64],
    lengths: npt.NDArray[np.int64],
) -> npt.NDArray[np.bool_]:
    same = np.ones(a.size, dtype=np.bool_)
    last = words.size - 1
    for at in range(0, int(lengths.max(initial=0)), _WORD_BYTES):
        left = np.clip(lengths - at, 0, _WORD_BYTES)  # bytes of each span in this word
        x, y = a + at, b + at
        tail = (np.maximum(x, y) > last) & (left > 0)  # a word from there runs past the blob
        diff = words[np.minimum(x, last)] ^ words[np.minimum(y, last)]
        same &= ((diff & _LOW_BYTES[left]) == 0) | tail
        for i in np.flatnonzero(tail).tolist():  # the blob's last bytes, compared apart
            p, q, k = int(x[i]), int(y[i]), int(left[i])
            same[i] &= bool(np.array_equal(blob[p : p + k], blob[q : q + k]))
    return same


def _oversized(
    ends: npt.NDArray[np.uint64], first: npt.NDArray[np.uint64], crumbs: npt.NDArray[np.uint32]
) -> npt.NDArray[np.uint8] | None:
    """1 for each chunk with a string over its cap, too many breadcrumbs or metadata strings,
    or breadcrumbs and metadata over MAX_META_BYTES together (only then may one of them be over
    its cap); None when no chunk has any. Over the offsets alone, a block of chunks at a time
    (a few MiB of arrays whatever the snapshot's size)."""
    if crumbs.size == 0:
        return None
    over = np.zeros(crumbs.size, dtype=np.bool_)
    caps = np.asarray(_CAPS, dtype=np.int64)
    steps = np.arange(_FIXED + 1, dtype=np.int64)
    signed = ends.view(np.int64)  # offsets within a file: far below 2**63
    for lo in range(0, crumbs.size, _BLOCK):
        hi = min(lo + _BLOCK, crumbs.size)
        spans = first[lo : hi + 1].view(np.int64)
        fields = signed[spans[:-1, None] + steps]  # each fixed field's bounds
        rest = signed[spans[1:]] - fields[:, -1]  # breadcrumbs and metadata
        n_crumbs = crumbs[lo:hi]
        block = over[lo:hi]
        np.any(np.diff(fields, axis=1) > caps, axis=1, out=block)
        block |= n_crumbs > MAX_CRUMBS
        block |= rest > MAX_META_BYTES
        block |= np.diff(spans) - n_crumbs > _FIXED + MAX_META_STRINGS
    return over.view(np.uint8) if bool(over.any()) else None


def _head(blob: memoryview, start: int, stop: int) -> str:
    """The text of ``blob[start:stop]`` before its first blank line, or "" when it has none;
    the first _HEAD_BYTES are searched first (a head is a title or a heading path)."""
    cut = bytes(blob[start : min(stop, start + _HEAD_BYTES)])
    at = cut.find(b"\n\n")
    if at < 0 and stop > start + _HEAD_BYTES:
        cut = bytes(blob[start : min(stop, start + MAX_EMBED_BYTES)])
        at = cut.find(b"\n\n")
    return str(cut[:at], "utf-8", "replace") if at > 0 else ""


def _check_spans(first: npt.NDArray[np.uint64], crumbs: npt.NDArray[np.uint32], total: int) -> None:
    """Each chunk's span of strings holds its six fields and its breadcrumbs, and the spans tile
    the string table."""
    if int(first[0]) != 0 or int(first[-1]) != total:
        raise ValueError("the chunks' string spans do not cover the string table")
    width = np.diff(first.astype(np.int64))
    if width.size and bool(np.any(width - _FIXED - crumbs.astype(np.int64) < 0)):
        raise ValueError("a chunk's string span does not fit its fields and breadcrumbs")


def _check_metadata(
    first: npt.NDArray[np.uint64],
    crumbs: npt.NDArray[np.uint32],
    meta_first: npt.NDArray[np.uint64],
    meta_n: npt.NDArray[np.int32],
) -> None:
    """Each chunk's metadata entries are in ``meta_n``, in order, and their keys and values
    fill exactly the strings its span has after its breadcrumbs."""
    if int(meta_first[0]) != 0 or int(meta_first[-1]) != meta_n.size:
        raise ValueError("the chunks' metadata entries do not cover meta_n")
    if bool(np.any(np.diff(meta_first.astype(np.int64)) < 0)):
        raise ValueError("the chunks' metadata entries are out of order")
    if meta_n.size and int(meta_n.min()) < _STRING:
        raise ValueError("a metadata value has a negative number of strings")
    n = meta_n.astype(np.int64)
    used = np.concatenate(([0], np.cumsum(1 + np.where(n == _STRING, 1, n))))
    need = used[meta_first[1:].astype(np.int64)] - used[meta_first[:-1].astype(np.int64)]
    have = np.diff(first.astype(np.int64)) - _FIXED - crumbs.astype(np.int64)
    if not np.array_equal(need, have):
        raise ValueError("a chunk's metadata does not fill the strings after its breadcrumbs")


class PageTable(Mapping[str, str]):
    """Page key -> whole page text, the keys sorted so that a lookup is a binary search."""

    __slots__ = ("_keys", "_texts")

    def __init__(self, keys: StringTable, texts: StringTable) -> None:
        self._keys = keys
        self._texts = texts

    @staticmethod
    def dump(pages: Mapping[str, str]) -> bytes:
        return b"".join(PageTable.parts(pages))

    @staticmethod
    def parts(pages: Mapping[str, str]) -> Parts:
        """The bytes of ``pages.bin`` for these pages, in pieces (``arrays_parts``)."""
        keys = sorted(pages)
        arrays = {
            **StringTable.of(keys).arrays("k_"),
            **StringTable.of(pages[k] for k in keys).arrays("t_"),
        }
        return arrays_parts(PAGES_KIND, arrays, count=len(keys))

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

    def size(self, key: str) -> int:
        """The bytes of page ``key``'s text (UTF-8), from its offsets: nothing is decoded."""
        i = self._find(key)
        if i < 0:
            raise KeyError(key)
        _, ends = self._texts.parts()
        return int(ends[i + 1] - ends[i])

    def __iter__(self) -> Iterator[str]:
        return iter(self._keys)

    def __len__(self) -> int:
        return len(self._keys)
