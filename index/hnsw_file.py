"""Checks an hnswlib index file against its manifest before hnswlib reads it.

hnswlib (0.8) trusts its file: an entry point past the last element or a top level above the
entry point's own sends the first search through memory it never allocated (a segfault, not an
exception). A checksum proves the file is the one published, not that it is well-formed, so
``check_hnsw_file`` reads the whole layout with numpy first and raises ``CorruptSnapshot`` for
anything hnswlib could not search safely: once per file, where a store's fetch hashes it
(``index.snapshot.verify_fetched``, recorded by the file's stats and ``CHECKS_VERSION``), or at
a load of a folder no store fetched; every load checks the header and size (``check_hnsw_head``). The layout, from ``hnswalg.h`` ``saveIndex``:

    header (96 bytes)   offsetLevel0_, max_elements_, cur_element_count, size_data_per_element_,
                        label_offset_, offsetData_ (size_t each), maxlevel_ (int32),
                        enterpoint_node_ (uint32), maxM_, maxM0_, M_ (size_t), mult_ (double),
                        ef_construction_ (size_t)
    level 0             per element: a uint32 whose low 16 bits count its links (byte 2 is the
                        "deleted" mark), maxM0_ uint32 neighbour ids, the vector (dim float32),
                        the label (uint64)
    upper levels        per element: a uint32 byte size (0, or level x (maxM_ + 1) x 4), then
                        per level a uint32 link count and maxM_ uint32 neighbour ids

A search descends from the entry point at ``maxlevel_`` and, at level ``l``, reads the level-``l``
list of every neighbour it meets: so every id must be an element, and every neighbour met at
level ``l`` must itself reach level ``l``.
"""

from __future__ import annotations

import bisect
import io
import mmap
import struct
from pathlib import Path

import hnswlib
import numpy as np
import numpy.typing as npt

from index.errors import CorruptSnapshot, GraphSearchFailed
from index.mapped import DONTNEED

HEADER = struct.Struct("<QQQQQQiIQQQdQ")  # the 13 fields saveIndex writes, 96 bytes
# hnswlib draws a level as -ln(u) / ln(M): past 64 even M = 2 would need u < 2^-64, which a
# double cannot hold, so a deeper level was not drawn by hnswlib.
MAX_LEVEL = 64
MAX_M = 4096  # hnswlib keeps a link count in 16 bits; beyond a few hundred nobody builds
_WORD = 4  # tableint and linklistsizeint are uint32
# The version of the checks below: raise it when one is added or made stricter, so a store's
# record of a graph checked by older code (``index.store.RECORD_CHECKS``) is not trusted.
CHECKS_VERSION = 4
# How far a stored vector's squared norm may be from 1: a build's float32 unit vectors are
# within 5e-7 of it (the most of ~95,000 rows of the graphs that tests and benches wrote), so
# 1e-3 refuses only a vector no build wrote.
UNIT_TOLERANCE = 1e-3
_LABEL = 8  # labeltype is size_t
_BLOCK = 1 << 16  # elements checked at once: ~10 MB of temporaries at M = 16
# elements whose labels ``vector_rows`` reads before it lets their pages go: 27 MB at 384-d
_LABEL_BLOCK = 1 << 14

U32 = npt.NDArray[np.uint32]


class _Header:
    """The header fields, checked against the manifest's count, dimension and M."""

    def __init__(self, data: bytes, where: str) -> None:
        if len(data) < HEADER.size:
            raise CorruptSnapshot(f"{where}: {len(data)} bytes, shorter than the hnswlib header")
        (
            self.offset_level0,
            self.max_elements,
            self.count,
            self.size_per_element,
            self.label_offset,
            self.offset_data,
            self.max_level,
            self.entry_point,
            self.max_m,
            self.max_m0,
            self.m,
            self.mult,
            self.ef_construction,
        ) = HEADER.unpack_from(data)


def check_hnsw_file(path: Path, *, count: int, dimension: int, m: int) -> None:
    """Raise CorruptSnapshot unless ``path`` is an hnswlib index hnswlib can load and search:
    ``count`` elements of ``dimension`` floats, labels 0..count-1, built with ``m`` links."""
    where = str(path)
    head, size = check_hnsw_head(path, count=count, dimension=dimension, m=m)
    if not count:
        return  # nothing for hnswlib to read: an empty snapshot never loads its index
    level0_bytes = count * head.size_per_element
    with path.open("rb") as f:
        f.seek(HEADER.size)
        _check_level0(f, head, where)
    tail = np.fromfile(path, dtype="<u4", offset=HEADER.size + level0_bytes)
    if (size - HEADER.size - level0_bytes) % _WORD:
        raise CorruptSnapshot(f"{where}: the upper levels are not whole 32-bit words")
    levels, starts = _upper_lists(tail, head, where)
    _check_levels(levels, head, where)
    _check_upper_links(tail, levels, starts, head, where)


def check_hnsw_head(path: Path, *, count: int, dimension: int, m: int) -> tuple[_Header, int]:
    """The header and the file's size checked (microseconds): what every load checks, even of a
    graph whose whole layout a store's fetch checked and recorded (``check_hnsw_file``), so a
    file changed since its record was written cannot hand hnswlib a header it would trust."""
    where = str(path)
    with path.open("rb") as f:
        head = _Header(f.read(HEADER.size), where)
    size = path.stat().st_size
    _check_header(head, where, count=count, dimension=dimension, m=m)
    if size < HEADER.size + count * head.size_per_element + count * _WORD:
        raise CorruptSnapshot(f"{where}: {size} bytes, too short for {count} elements")
    return head, size


def _check_header(head: _Header, where: str, *, count: int, dimension: int, m: int) -> None:
    if not 2 <= m <= MAX_M:
        raise CorruptSnapshot(f"{where}: M {m} is outside 2..{MAX_M}")
    links0 = _WORD + _WORD * head.max_m0
    expected = {
        "offsetLevel0_": (head.offset_level0, 0),
        "cur_element_count": (head.count, count),
        "M_": (head.m, m),
        "maxM_": (head.max_m, m),
        "maxM0_": (head.max_m0, 2 * m),
        "offsetData_": (head.offset_data, links0),
        "label_offset_": (head.label_offset, links0 + 4 * dimension),
        "size_data_per_element_": (head.size_per_element, links0 + 4 * dimension + _LABEL),
    }
    for name, (got, want) in expected.items():
        if got != want:
            raise CorruptSnapshot(f"{where}: {name} is {got}, the manifest implies {want}")
    if not 0 <= head.max_level <= MAX_LEVEL:
        raise CorruptSnapshot(f"{where}: top level {head.max_level} is outside 0..{MAX_LEVEL}")
    if count and head.entry_point >= count:
        raise CorruptSnapshot(f"{where}: entry point {head.entry_point} >= {count} elements")
    if not (np.isfinite(head.mult) and head.mult > 0) or head.ef_construction < 1:
        raise CorruptSnapshot(f"{where}: build parameters mult_/ef_construction_ are invalid")


def _check_level0(f: io.BufferedReader, head: _Header, where: str) -> None:
    """Level-0 link counts, neighbour ids and labels, vectorised, read in blocks of elements
    into one buffer (sequential reads: faster than a memory map, a bounded temporary)."""
    count = head.count
    seen = np.zeros(count, dtype=np.bool_)
    buffer = np.empty((min(count, _BLOCK), head.size_per_element), dtype=np.uint8)
    for start in range(0, count, _BLOCK):
        block = buffer[: min(_BLOCK, count - start)]
        if f.readinto(block.data) != block.size:
            raise CorruptSnapshot(f"{where}: the file ends inside level 0")
        _check_level0_links(block[:, : _WORD * (head.max_m0 + 1)], head, start, where)
        _check_vectors(block[:, head.offset_data : head.label_offset], start, where)
        labels = np.ascontiguousarray(block[:, head.label_offset : head.label_offset + _LABEL])
        flat = labels.view("<u8").ravel()
        if int(flat.max()) >= count:
            raise CorruptSnapshot(f"{where}: a label is past {count - 1}")
        seen[flat] = True
    if not seen.all():  # count labels below count, none missing: each once
        raise CorruptSnapshot(f"{where}: the labels are not 0..{count - 1}, each once")


def _check_vectors(raw: npt.NDArray[np.uint8], start: int, where: str) -> None:
    """Every vector of elements ``start``.. a unit vector's: a build writes unit vectors (its
    embedder's answers are checked and scaled, and the "ip" space stores them as given), so a
    NaN (near nothing) or a value far past 1 (near everything: 3e38 is finite and wins every
    inner product) was written by no build. A row of zeros passes: a build published before the
    answers were checked may hold them, they are near nothing, and the next build embeds them
    again (``index.build``)."""
    # a NaN makes its row's squared norm NaN, an infinity makes it inf: never within the tolerance.
    # Summing reads the rows in place: a third of the time of np.isfinite over a copy.
    rows = raw.view("<f4")
    squares = np.einsum("ij,ij->i", rows, rows)
    unit = (np.abs(squares - 1.0) <= UNIT_TOLERANCE) | (squares == 0.0)
    if not unit.all():
        element = int(np.argmin(unit))
        raise CorruptSnapshot(
            f"{where}: element {start + element}'s vector has squared norm {squares[element]}, "
            f"not a unit vector's (1 +- {UNIT_TOLERANCE}): a build writes unit vectors"
        )


def _check_level0_links(raw: npt.NDArray[np.uint8], head: _Header, start: int, where: str) -> None:
    """The level-0 lists of elements ``start``.. : counts within maxM0, ids elements, and each
    element linked to another. hnswlib links every element it adds to its nearest (pruning
    keeps the nearest), so in a graph of two or more a list with no other element is a
    tampered one: a search whose descent ends there finds that element alone and hnswlib
    raises for want of ``k`` results, at answer time."""
    lists = np.ascontiguousarray(raw).view("<u4")  # (elements, 1 + maxM0)
    header = lists[:, 0]
    if np.any(header >> 16):
        raise CorruptSnapshot(f"{where}: an element is marked deleted or its link count is garbled")
    sizes = header & 0xFFFF
    if int(sizes.max()) > head.max_m0:
        raise CorruptSnapshot(f"{where}: a level-0 link list is longer than maxM0 {head.max_m0}")
    used = np.arange(head.max_m0, dtype=np.uint32) < sizes[:, None]
    ids = lists[:, 1:]
    if int(np.where(used, ids, 0).max()) >= head.count:
        raise CorruptSnapshot(f"{where}: a level-0 link names an element past {head.count}")
    if head.count > 1:
        own = np.arange(start, start + len(lists), dtype=np.uint32)[:, None]
        alone = ~np.any(used & (ids != own), axis=1)
        if alone.any():
            element = start + int(np.argmax(alone))
            raise CorruptSnapshot(f"{where}: element {element} links to no other at level 0")


def _upper_lists(tail: U32, head: _Header, where: str) -> tuple[npt.NDArray[np.int64], list[int]]:
    """Each element's level and, for those above level 0, the word where its lists start.

    Records are a size word and that many bytes; most elements have none (one zero word), so
    the walk jumps over runs of zero words and loops in Python only over elements with upper
    levels (about 1 in M).
    """
    count = head.count
    per_level = _WORD * (head.max_m + 1)
    levels = np.zeros(count, dtype=np.int64)
    starts: list[int] = []
    nonzero = np.flatnonzero(tail).tolist()
    words = len(tail)
    pos = i = 0
    while i < count:
        k = bisect.bisect_left(nonzero, pos)
        nxt = nonzero[k] if k < len(nonzero) else words
        skip = min(nxt - pos, count - i)
        i += skip
        pos += skip
        if i == count:
            break
        if pos >= words:
            raise CorruptSnapshot(f"{where}: the upper levels end after {i} of {count} elements")
        size = int(tail[pos])
        level, rest = divmod(size, per_level)
        if rest or not 1 <= level <= MAX_LEVEL:
            raise CorruptSnapshot(f"{where}: element {i} has an upper-level list of {size} bytes")
        levels[i] = level
        starts.append(pos + 1)
        pos += 1 + size // _WORD
        i += 1
        if pos > words:
            raise CorruptSnapshot(f"{where}: element {i - 1}'s upper-level lists run past the end")
    if pos != words:
        raise CorruptSnapshot(f"{where}: {4 * (words - pos)} bytes past the last element's lists")
    return levels, starts


def _check_levels(levels: npt.NDArray[np.int64], head: _Header, where: str) -> None:
    if not levels.size:
        return
    top = int(levels.max())
    if top != head.max_level or int(levels[head.entry_point]) != head.max_level:
        raise CorruptSnapshot(
            f"{where}: top level {head.max_level}, but the highest element reaches {top} and "
            f"the entry point {levels[head.entry_point]}"
        )


def _check_upper_links(
    tail: U32, levels: npt.NDArray[np.int64], starts: list[int], head: _Header, where: str
) -> None:
    """Every upper-level list: count <= maxM, ids are elements that reach that level."""
    if not starts:
        return
    width = head.max_m + 1
    upper = levels[levels > 0]
    first = np.repeat(np.asarray(starts, dtype=np.int64), upper)
    within = np.arange(first.size) - np.repeat(np.cumsum(upper) - upper, upper)
    blocks = tail[(first + within * width)[:, None] + np.arange(width)]  # (lists, 1 + maxM)
    sizes = blocks[:, 0] & 0xFFFF
    if int(sizes.max()) > head.max_m:
        raise CorruptSnapshot(f"{where}: an upper-level link list is longer than maxM {head.max_m}")
    used = np.arange(head.max_m, dtype=np.uint32) < sizes[:, None]
    ids = blocks[:, 1:][used].astype(np.int64)
    if ids.size and int(ids.max()) >= head.count:
        raise CorruptSnapshot(f"{where}: an upper-level link names an element past {head.count}")
    level_of_list = np.repeat(within + 1, sizes.astype(np.int64))
    if np.any(levels[ids] < level_of_list):
        raise CorruptSnapshot(f"{where}: a link at some level names an element below that level")


def knn(
    index: hnswlib.Index, query: npt.NDArray[np.float32], k: int, where: object
) -> tuple[npt.NDArray[np.uint64], npt.NDArray[np.float32]]:
    """``index.knn_query(query, k=k)``, with hnswlib's RuntimeError (it found fewer than ``k``
    elements from where its descent entered level 0) raised as ``GraphSearchFailed`` naming the
    graph (``where``, made a string only then: a path joined on every search cost a Search ~5 us):
    the one place a graph is searched, so no hnswlib error reaches a caller as UNKNOWN.
    A graph whose level-0 lists let a search stop short is refused at load where that can be
    seen cheaply (``_check_level0_links``); a sparser reachability is only met here."""
    try:
        found: tuple[npt.NDArray[np.uint64], npt.NDArray[np.float32]] = index.knn_query(query, k=k)
    except RuntimeError as exc:
        raise GraphSearchFailed(f"{where}: a search for {k} found fewer ({exc})") from exc
    return found


def vector_rows(
    path: Path, *, count: int, dimension: int
) -> tuple[npt.NDArray[np.float32], npt.NDArray[np.int64]]:
    """The vectors of an hnswlib file ``check_hnsw_file`` has checked, memory-mapped (nothing
    copied: the pages are read when a search touches them), and each label's row in them:
    ``vectors[rows[label]]`` is the vector of ``label``. hnswlib's own ``get_items`` takes
    ~0.2 ms per vector; a row read here, microseconds.

    A label sits in every element's record, so reading them all touches every page of the file
    (1.7 GB at 1M x 384): each block's pages are let go once its labels are read
    (``MADV_DONTNEED``: clean pages of a file, still in the page cache), so the process keeps
    resident only the vectors searches read, not a second copy of the graph beside hnswlib's."""
    with path.open("rb") as f:
        head = _Header(f.read(HEADER.size), str(path))
        mapped = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    size = head.size_per_element
    raw = np.frombuffer(mapped, dtype=np.uint8, count=count * size, offset=HEADER.size)
    raw = raw.reshape(count, size)
    vectors = raw[:, head.offset_data : head.offset_data + 4 * dimension].view("<f4")
    labels = raw[:, head.label_offset : head.label_offset + _LABEL]
    return vectors, _rows(mapped, labels, count, str(path))


def _rows(
    mapped: mmap.mmap, labels: npt.NDArray[np.uint8], count: int, where: str
) -> npt.NDArray[np.int64]:
    """Each label's row, from the (count, 8) label bytes of the mapped records, a block at a
    time, dropping each block's pages from the process once read. A label past the end (a file
    changed under the record of its check) is CorruptSnapshot, not an IndexError."""
    rows = np.empty(count, dtype=np.int64)
    per_row = labels.strides[0]
    for start in range(0, count, _LABEL_BLOCK):
        stop = min(count, start + _LABEL_BLOCK)
        block = np.ascontiguousarray(labels[start:stop]).view("<u8")[:, 0]
        if len(block) and int(block.max()) >= count:  # a graph changed since it was checked
            raise CorruptSnapshot(f"{where}: a label is past {count - 1}")
        rows[block.astype(np.int64)] = np.arange(start, stop, dtype=np.int64)
        _let_go(mapped, HEADER.size + start * per_row, HEADER.size + stop * per_row)
    _let_go(mapped, 0, len(mapped))  # and what the kernel mapped around a fault (fault-around)
    return rows


def _let_go(mapped: mmap.mmap, start: int, stop: int) -> None:
    """Drop the process's pages of ``mapped`` over bytes ``start``..``stop`` (a page shared with
    the next block is read again from the page cache: a minor fault)."""
    if DONTNEED is None:
        return  # no madvise here (Windows): the pages stay mapped, as they would anyway
    first = start - start % mmap.PAGESIZE
    mapped.madvise(DONTNEED, first, stop - first)
