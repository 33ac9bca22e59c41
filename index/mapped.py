"""Files of named arrays that a reader memory-maps and reads in place (snapshot format 4).

    magic (8 bytes)  b"VXARR\\x00\\x01\\n"
    u32 LE           the header's length
    header           a JSON object: {"kind": ..., "arrays": {NAME: {"dtype", "length", "offset"}},
                     ...the kind's own fields}
    arrays           each at a 64-byte aligned offset, little-endian, one dimension

Opening one costs a header parse and an ``mmap``: the arrays are numpy views of the mapping, so
worker processes serving the same snapshot share its pages through the page cache, and nothing is
read until it is used. The reader trusts nothing it maps: every array's dtype, length and extent
are checked against the file's size before a view is made, and the string tables' offsets are
checked monotonic and within their blob (``StringTable.read``), so a hostile file is a
``ValueError`` naming what is wrong, never a read past the mapping.

A mapped file must not change while it is mapped (a truncation would be SIGBUS on the next read):
snapshot folders are written once and never modified, and a store deletes a version only after
the sidecar has moved off it.
"""

from __future__ import annotations

import mmap
import os
import struct
from array import array as typed_array
from collections.abc import Iterable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any, Final, overload

import numpy as np
import numpy.typing as npt
import orjson

MAGIC: Final = b"VXARR\x00\x01\n"
_HEADER_LEN: Final = struct.Struct("<I")
_ALIGN: Final = 64
MAX_HEADER_BYTES: Final = 1 << 20  # names, dtypes and a few counts: far below this
# The only dtypes a snapshot stores; anything else in a header is refused (no objects, no pickles).
DTYPES: Final = frozenset({"|u1", "<u2", "<i4", "<u4", "<i8", "<u8", "<f8"})

Buffer = bytes | mmap.mmap


def _padding(size: int) -> int:
    return -size % _ALIGN


Parts = list[bytes | memoryview]  # a file's bytes in pieces, as ``arrays_parts`` gives them


def arrays_parts(kind: str, arrays: Mapping[str, npt.NDArray[Any]], **fields: Any) -> Parts:
    """The bytes of one arrays file in pieces: the header, then each array's own memory (no
    copy of an array that is already little-endian and contiguous) and its padding. A writer
    writes them one after the other (``index.snapshot.write_atomic``), and a file of many
    megabytes is never held twice; ``fields`` are JSON values the kind keeps in its header."""
    specs: dict[str, dict[str, Any]] = {}
    views: list[memoryview] = []
    offset = 0
    for name, array in arrays.items():
        data = np.ascontiguousarray(array, dtype=array.dtype.newbyteorder("<"))
        if data.ndim != 1 or data.dtype.str not in DTYPES:
            raise ValueError(f"array {name!r}: one dimension of {sorted(DTYPES)}, not {data.dtype}")
        specs[name] = {"dtype": data.dtype.str, "length": int(data.size), "offset": offset}
        views.append(data.view(np.uint8).data)
        offset += data.nbytes + _padding(data.nbytes)
    head = orjson.dumps({"kind": kind, "arrays": specs, **fields})
    prefix = MAGIC + _HEADER_LEN.pack(len(head)) + head
    parts: Parts = [prefix + b"\0" * _padding(len(prefix))]
    for view in views:
        parts += [view, b"\0" * _padding(len(view))]
    return parts


def dump_arrays(kind: str, arrays: Mapping[str, npt.NDArray[Any]], **fields: Any) -> bytes:
    """The bytes of one arrays file (``arrays_parts`` joined)."""
    return b"".join(arrays_parts(kind, arrays, **fields))


# madvise's "drop these pages" where the platform has it (not on Windows)
DONTNEED: Final[int | None] = getattr(mmap, "MADV_DONTNEED", None)


def let_go(view: npt.NDArray[Any] | memoryview) -> None:
    """Drop this process's pages of the file ``view`` is a mapped view of (``MADV_DONTNEED``),
    after a scan at load read all of it: they are clean pages of a read-only mapping, kept in
    the page cache, and the next read maps them again (a minor fault). Without it the process
    holds, resident, every page a scan touched (at 1M chunks, 540 MB of chunks and postings) and
    not only those its calls read. Nothing when ``view`` is not of a mapping."""
    mapped = _mapping_of(view)
    if mapped is not None and DONTNEED is not None:
        mapped.madvise(DONTNEED)


def _mapping_of(view: object) -> mmap.mmap | None:
    for _ in range(8):  # a view of a view of ... the mapping: a few steps at most
        if isinstance(view, mmap.mmap):
            return view
        if isinstance(view, memoryview):
            view = view.obj
        elif isinstance(view, np.ndarray):
            view = view.base
        else:
            return None
    return None


class ArraysFile:
    """An arrays file opened over a buffer (an ``mmap`` of the file, or bytes): ``header`` and
    ``array(name, dtype)``. ValueError for anything that is not what ``dump_arrays`` writes."""

    def __init__(self, buffer: Buffer, kind: str) -> None:
        self.buffer = buffer
        size = len(buffer)
        start = len(MAGIC) + _HEADER_LEN.size
        if size < start or buffer[: len(MAGIC)] != MAGIC:
            raise ValueError(f"not a voxrecall {kind} file")
        (head_len,) = _HEADER_LEN.unpack(buffer[len(MAGIC) : start])
        if head_len > min(MAX_HEADER_BYTES, size - start):
            raise ValueError(f"header of {head_len} bytes in a file of {size}")
        try:
            header = orjson.loads(buffer[start : start + head_len])
        except orjson.JSONDecodeError as exc:
            raise ValueError(f"unreadable header: {exc}") from exc
        if type(header) is not dict or header.get("kind") != kind:
            raise ValueError(f"not a voxrecall {kind} file (its header names another kind)")
        if type(header.get("arrays")) is not dict:
            raise ValueError("the header lists no arrays")
        self.header: dict[str, Any] = header
        self._base = start + head_len + _padding(start + head_len)
        self._size = size

    @classmethod
    def open(cls, path: Path, kind: str) -> ArraysFile:
        """Map ``path`` read-only (an empty file is refused before ``mmap``, which cannot map it)."""
        with path.open("rb") as f:
            if os.fstat(f.fileno()).st_size == 0:
                raise ValueError(f"not a voxrecall {kind} file (empty)")
            return cls(mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ), kind)

    def _extent(self, name: str, dtype: str) -> tuple[int, int]:
        """Where the named array starts in the buffer and its length, checked against the file."""
        spec = self.header["arrays"].get(name)
        if type(spec) is not dict:
            raise ValueError(f"array {name!r} is missing")
        length, offset = spec.get("length"), spec.get("offset")
        if spec.get("dtype") != dtype:
            raise ValueError(f"array {name!r} is {spec.get('dtype')!r}, expected {dtype!r}")
        if type(length) is not int or type(offset) is not int or length < 0 or offset < 0:
            raise ValueError(f"array {name!r} has no valid length and offset")
        width = np.dtype(dtype).itemsize
        start = self._base + offset
        if start % width or start + length * width > self._size:
            raise ValueError(f"array {name!r} ({length} x {dtype}) lies outside the file")
        return start, length

    def array(self, name: str, dtype: str) -> npt.NDArray[Any]:
        """The named array, a read-only view of the buffer."""
        start, length = self._extent(name, dtype)
        view: npt.NDArray[Any] = np.frombuffer(self.buffer, dtype=dtype, count=length, offset=start)
        return view

    def blob(self, name: str) -> memoryview:
        """The named byte array as a memoryview: slicing it gives bytes in one copy."""
        start, length = self._extent(name, "|u1")
        return memoryview(self.buffer)[start : start + length]

    def integer(self, name: str, low: int = 0, high: int = 1 << 62) -> int:
        value = self.header.get(name)
        if type(value) is not int or not low <= value <= high:
            raise ValueError(f"header field {name!r} is missing or outside {low}..{high}")
        return value


class StringTable(Sequence[str]):
    """Strings ``0..n-1`` in one UTF-8 blob, string ``i`` at ``blob[offsets[i]:offsets[i + 1]]``.

    Decoding is with ``errors="replace"``: a byte changed inside a checksummed blob can alter a
    text but cannot make a read fail."""

    __slots__ = ("_blob", "_ends", "_offsets")

    def __init__(self, blob: memoryview, offsets: npt.NDArray[np.uint64]) -> None:
        self._blob = blob
        self._offsets = offsets
        self._ends = offsets.data  # Python ints on indexing, unlike numpy scalars

    @classmethod
    def of(cls, strings: Iterable[str]) -> StringTable:
        """A table in memory (what a build writes, or what a test reads): the strings encoded
        one at a time into one blob, no list of their encodings beside it."""
        blob = bytearray()
        ends = typed_array("Q", [0])
        for s in strings:
            blob += s.encode("utf-8")
            ends.append(len(blob))
        return cls(memoryview(blob).toreadonly(), np.frombuffer(ends, dtype=np.uint64))

    def arrays(self, prefix: str) -> dict[str, npt.NDArray[Any]]:
        """``{prefix}blob`` and ``{prefix}offsets``, for ``dump_arrays``."""
        blob = np.frombuffer(self._blob, dtype=np.uint8)
        return {f"{prefix}blob": blob, f"{prefix}offsets": np.asarray(self._offsets)}

    @classmethod
    def read(cls, file: ArraysFile, prefix: str) -> StringTable:
        """The table ``arrays`` wrote, checked: offsets start at 0, never decrease, end at the
        blob's size."""
        blob = file.blob(f"{prefix}blob")
        offsets = file.array(f"{prefix}offsets", "<u8")
        if offsets.size == 0 or int(offsets[0]) != 0 or int(offsets[-1]) != len(blob):
            raise ValueError(f"string table {prefix!r}: offsets do not span its blob")
        if offsets.size > 1 and bool(np.any(offsets[1:] < offsets[:-1])):
            raise ValueError(f"string table {prefix!r}: offsets decrease")
        return cls(blob, offsets)

    def __len__(self) -> int:
        return len(self._offsets) - 1

    def parts(self) -> tuple[memoryview, memoryview]:
        """The blob and the offsets as memoryviews, for a reader's own loop."""
        return self._blob, self._ends

    @overload
    def __getitem__(self, i: int) -> str: ...
    @overload
    def __getitem__(self, i: slice) -> list[str]: ...
    def __getitem__(self, i: int | slice) -> str | list[str]:
        if isinstance(i, slice):
            return [self[j] for j in range(*i.indices(len(self)))]
        if i < 0:
            i += len(self)
        if not 0 <= i < len(self):
            raise IndexError(i)
        return str(self._blob[self._ends[i] : self._ends[i + 1]], "utf-8", "replace")

    def __iter__(self) -> Iterator[str]:
        blob, ends = self._blob, self._ends
        for i in range(len(self)):
            yield str(blob[ends[i] : ends[i + 1]], "utf-8", "replace")
