"""The follow-ups gazetteer's matching tables: numpy arrays the indexer writes (``gazetteer.bin``)
and the sidecar maps and reads in place (``sidecar.turn.followups.Gazetteer``).

A gazetteer extends a span of a turn's tokens while the words joined may still start a key
(``PrefixTable``), and matches a misheard name by the keys one edit away (``NearKeys``: symmetric
deletion, one letter dropped, never the first). Built as Python strings (every prefix, every
variant) these took 6 s and ~140 MB of a 1M-chunk load; built in numpy at load, 1 s and ~100 MB
of dicts in every worker process. Written by the indexer and mapped, a load reads a header, and
worker processes share the tables' pages through the page cache.

    PrefixTable   every distinct prefix of every key, once (the keys sorted: a key's prefixes no
                  longer than its common prefix with the key before it are that key's), in an
                  open-addressing table of its hash (its bytes as a number, mod a 55-bit prime:
                  hashed in C by Python's integers) -> a key it starts (the key itself when the
                  prefix is a key); linear probing from the top bits of the hash times a
                  constant (Fibonacci hashing), placed in order of home slot; a lookup first
                  asks a Python set of the keys' prefixes of at most three letters (built at
                  load: most words are refused there, ~0.1 us, not 1-3 us of hashing and slots)
    NearKeys      the long keys' one-letter deletions and the keys themselves as 64-bit hashes in
                  one sorted array (12 bytes a variant: the hash and its key), and a bitmap of the
                  hashes' top bits asked in Python first (a numpy call costs microseconds)

A hash says where to look, never what matches: every key a lookup finds is checked letter by
letter (a prefix against its key's bytes here, a near key by ``followups._one_edit``), so a
collision costs a comparison, never a wrong match. Each table draws its hash's seed when it is
built (at index time: the prefixes' prime, the near keys' base), kept in the file, so every
process reads the same tables and a knowledge base's names cannot be chosen to collide (a
collision would cost only comparisons).

``gazetteer.bin`` (kind ``voxrecall.gazetteer``) is optional in a format-5 snapshot: one without
it (or written by other table rules, ``TABLES``) has its tables built at load from
``entities.bin``'s keys. It names the sha256 of the ``entities.bin`` it indexes, and every array
is checked before a lookup reads it (the slots' keys within the keys, every slot within its probe
bound of its home, the variants sorted, the bitmap's size), so a hostile file is a ``ValueError``
(CorruptSnapshot at load), never an IndexError or a read past the mapping.

    prefix_hash, prefix_key   <u8, <i4 per slot: a prefix's hash and a key it starts (-1: empty)
    near_hash, near_key       <u8, <i4 per variant, sorted by hash: the key it is of
    near_filter               |u1: the bitmap of the variants' hashes' top bits
    header                    tables (TABLES), entities (the sha256 of entities.bin), keys (how
                              many), prefix_mod, prefix_bits, probe, near_base, near_shift
"""

from __future__ import annotations

import itertools
import secrets
import sys
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Final

import numpy as np
import numpy.typing as npt

from index.mapped import ArraysFile, StringTable, dump_arrays
from index.tables import MAX_EMBED_BYTES, _bounded

GAZETTEER_KIND: Final = "voxrecall.gazetteer"
# The tables' layout and hashing: a file of other rules is ignored and the tables built at load.
TABLES: Final = 1
_MASK = (1 << 64) - 1
_MIX = 0x9E3779B97F4A7C15  # 2^64 / the golden ratio, odd: Fibonacci hashing's multiplier
ROWS = 1 << 16  # keys compared at a time when sorting out the distinct prefixes (memory bound)
# A lookup first asks a bitmap of the variants' hashes' top bits, in Python (a numpy call costs
# microseconds): bits per variant, so that a span's 10-15 hashes rarely pass it by chance; at
# most 2^27 bits (16 MB: 1.5 million variants at 1M chunks)
FILTER_BITS_PER_VARIANT = 64
FILTER_MIN_LOG2 = 16
FILTER_MAX_LOG2 = 27
FUZZY_MIN_CHARS = 7  # one edit from a shorter name is often a word ("lovell" -> "lovely")
# Home slots per distinct prefix, at least (a load of at most a half: short probe runs)
SLOTS_PER_PREFIX = 2
# The farthest a prefix may sit from its home slot; a file claiming more is refused (a lookup
# walks at most this many slots). Linear probing at a half full: runs of a few dozen at most.
MAX_PROBE = 1 << 12
# The keys one hash's run gives a lookup at most: a form one edit from more keys than this names
# none of them as it is (several owners), and a file's run of one hash (a hostile file's, of a
# common word's deletion) costs each lookup no more than this
MAX_NEAR_RUN = 256
SLOT_BYTES = 12  # a slot's hash and key
# A prefix lookup first asks a Python set of the keys' distinct prefixes of at most SHORT_CHARS
# letters (an ordinary word no key starts with is refused without hashing it or walking the
# mapped slots: ~0.1 us, not 1-3), built at load from the keys' bytes; with more than SHORT_KEPT
# of them, the longest prefixes kept are one letter shorter (at most 36 + 36^2 + 16,384 strings:
# ~1.5 MB, counted in ``KeyTables.python_bytes``)
SHORT_CHARS = 3
SHORT_KEPT = 1 << 14
VARIANT_BYTES = 12  # a variant's hash and key


@dataclass(frozen=True, slots=True)
class RatedKeys:
    """The rated keys as arrays (``entities.bin``'s ``k_`` and ``g_`` tables, or built from
    ``index.entities.Rated``): key ``i`` is ``keys[i]``, its owner ``owners[owner[i]]`` (-1:
    two names share it, it names neither), its confidence ``sure[i]``, ``partial[i]`` 1 for a
    partial name."""

    keys: StringTable
    owner: npt.NDArray[np.int32]
    sure: npt.NDArray[np.float64]
    partial: npt.NDArray[np.uint8]
    owners: StringTable

    @classmethod
    def of(
        cls, keys: Mapping[str, str | None], sure: Mapping[str, float], partial: frozenset[str]
    ) -> RatedKeys:
        """The arrays of rated keys held as dicts (``index.entities.rate``'s)."""
        names = list(dict.fromkeys(n for n in keys.values() if n is not None))
        at = {name: i for i, name in enumerate(names)}
        ordered = list(keys)
        return cls(
            keys=StringTable.of(ordered),
            owner=np.asarray(
                [-1 if (n := keys[k]) is None else at[n] for k in ordered], dtype=np.int32
            ),
            sure=np.asarray([sure.get(k, 1.0) for k in ordered], dtype=np.float64),
            partial=np.asarray([k in partial for k in ordered], dtype=np.uint8),
            owners=StringTable.of(names),
        )

    def arrays(self) -> dict[str, npt.NDArray[Any]]:
        """The arrays ``entities.bin`` stores them as."""
        return {
            **self.owners.arrays("g_"),
            **self.keys.arrays("k_"),
            "key_owner": self.owner,
            "key_sure": self.sure,
            "key_partial": self.partial,
        }

    @property
    def nbytes(self) -> int:
        """The arrays' bytes (when built in memory: a snapshot's are mapped from entities.bin)."""
        tables = (self.keys.arrays(""), self.owners.arrays(""))
        strings = sum(int(a.nbytes) for t in tables for a in t.values())
        return strings + int(self.owner.nbytes + self.sure.nbytes + self.partial.nbytes)

    def owner_name(self, i: int) -> str:
        """Owner ``i``'s name, cut as a chunk's context is read (``index.tables``): a name is
        folded into queries, answers and sessions (a hostile owner of 20 MB behind a key of 14
        letters was). A name of at most a third of the cap in bytes is within it decoded (a
        byte replaced takes three)."""
        blob, ends = self.owners.parts()
        name = str(blob[ends[i] : ends[i + 1]], "utf-8", "replace")
        return name if (ends[i + 1] - ends[i]) * 3 <= MAX_EMBED_BYTES else _bounded(name)

    def lengths(self) -> npt.NDArray[np.int64]:
        offsets = np.asarray(self.keys.arrays("")["offsets"], dtype=np.int64)
        lengths: npt.NDArray[np.int64] = offsets[1:] - offsets[:-1]
        return lengths

    def long(self) -> npt.NDArray[np.int32]:
        """The keys matched within one edit: FUZZY_MIN_CHARS letters or more, owned."""
        chosen = (self.lengths() >= FUZZY_MIN_CHARS) & (self.owner >= 0)
        return np.flatnonzero(chosen).astype(np.int32)


def _hash_of(data: bytes, mod: int) -> int:
    """A prefix's hash: its bytes as a number, mod ``mod`` (a polynomial of base 256, computed
    by Python's integers in C: a loop a letter took 3x a set lookup), as ``_mod_hashes``."""
    return int.from_bytes(data, "big") % mod


def _mod_hashes(matrix: npt.NDArray[np.uint8], mod: int) -> npt.NDArray[np.uint64]:
    """Per row (keys of one length n), ``_hash_of`` its first 1..n letters (n columns): mod
    is below 2^55, so a hash times 256 plus a letter stays below 2^63."""
    n = matrix.shape[1]
    m = np.uint64(mod)
    out = np.zeros((matrix.shape[0], n), dtype=np.uint64)
    h = np.zeros(matrix.shape[0], dtype=np.uint64)
    for j in range(n):
        h = (h * np.uint64(256) + matrix[:, j].astype(np.uint64)) % m
        out[:, j] = h
    return out


def _random_prime(bits: int) -> int:
    """A prime of ``bits`` bits: the first from a random odd start (Miller-Rabin with the
    bases that decide every n < 3.3e24; primes near 2^55 lie a few dozen apart)."""
    n = secrets.randbelow(1 << (bits - 2)) * 2 + (1 << (bits - 1)) + 1
    while not _is_prime(n):
        n += 2
    return n


def _is_prime(n: int) -> bool:
    bases = (2, 3, 5, 7, 11, 13, 17, 19, 23, 29, 31, 37)
    if n in bases:
        return True
    if n < 2 or any(n % b == 0 for b in bases):
        return False
    d, r = n - 1, 0
    while not d & 1:
        d, r = d >> 1, r + 1
    for b in bases:
        x = pow(b, d, n)
        if x in (1, n - 1):
            continue
        for _ in range(r - 1):
            x = x * x % n
            if x == n - 1:
                break
        else:
            return False
    return True


def _matrix(keys: Sequence[str]) -> tuple[npt.NDArray[np.uint8], npt.NDArray[np.int64]]:
    """The keys' bytes, one zero-padded row each, and their lengths."""
    lengths = np.fromiter(map(len, keys), dtype=np.int64, count=len(keys))
    width = int(lengths.max()) if len(keys) else 0
    matrix = np.zeros((len(keys), width), dtype=np.uint8)
    matrix[np.arange(width) < lengths[:, None]] = np.frombuffer(
        "".join(keys).encode("ascii"), dtype=np.uint8
    )
    return matrix, lengths


def _prefix_hashes(matrix: npt.NDArray[np.uint8], base: int) -> npt.NDArray[np.uint64]:
    """Per row (keys of one length n), the hashes of its first 0..n letters (n + 1 columns)."""
    n = matrix.shape[1]
    b = np.uint64(base)
    prefix = np.zeros((matrix.shape[0], n + 1), dtype=np.uint64)
    with np.errstate(over="ignore"):  # arrays wrap around silently: mod 2^64
        for j in range(n):
            prefix[:, j + 1] = prefix[:, j] * b + matrix[:, j].astype(np.uint64)
    return prefix


def _by_length(keys: Sequence[str]) -> Iterator[tuple[npt.NDArray[np.intp], npt.NDArray[np.uint8]]]:
    """The keys a length at a time: their indexes, and their bytes as a matrix."""
    lengths = np.fromiter(map(len, keys), dtype=np.int64, count=len(keys))
    for length in np.unique(lengths).tolist():
        rows = np.flatnonzero(lengths == length)
        yield rows, _matrix([keys[i] for i in rows.tolist()])[0]


def _common_with_previous(ordered: list[str]) -> npt.NDArray[np.int64]:
    """The length of each key's common prefix with the key before it (0 for the first)."""
    common: list[int] = []
    for start in range(0, len(ordered), ROWS):
        block = ordered[max(start - 1, 0) : start + ROWS]
        matrix, lengths = _matrix(block)
        same = matrix[1:] == matrix[:-1]
        first_differ = np.where(same.all(axis=1), matrix.shape[1], same.argmin(axis=1))
        shared = np.minimum(first_differ, np.minimum(lengths[1:], lengths[:-1]))
        common.extend(([0] if start == 0 else []) + shared.tolist())
    return np.asarray(common[: len(ordered)], dtype=np.int64)


def prefix_slots(prefixes: int) -> int:
    """The home slots of a table of this many distinct prefixes (a power of two)."""
    return 1 << max(4, int(prefixes * SLOTS_PER_PREFIX - 1).bit_length())


class PrefixTable:
    """Every prefix of every key -> a key it starts: ``find(text)`` is that key's index, or -1
    when no key starts with ``text``; ``text`` is a key when that key is as long as it. A
    prefix's hash is its bytes as a number mod a prime drawn when the table is built
    (``_hash_of``), its home slot the top bits of that times _MIX."""

    __slots__ = ("_blob", "_chars", "_ends", "_hashes", "_keys", "_mod", "_probe", "_shift",
                 "_short", "_size", "hashes", "keys")  # fmt: skip

    def __init__(
        self,
        keys: StringTable,
        mod: int,
        bits: int,
        probe: int,
        hashes: npt.NDArray[np.uint64],
        key_of: npt.NDArray[np.int32],
    ) -> None:
        self.hashes, self.keys = hashes, key_of
        self._mod, self._shift, self._probe, self._size = mod, 64 - bits, probe, hashes.size
        self._blob, self._ends = keys.parts()
        self._hashes, self._keys = hashes.data, key_of.data  # Python ints on indexing
        self._short, self._chars = _short_prefixes(self._blob, self._ends)

    @classmethod
    def build(cls, keys: StringTable, mod: int | None = None) -> PrefixTable:
        """The table of these keys ([a-z0-9] strings)."""
        mod = _random_prime(MOD_BITS) if mod is None else mod
        strings = list(keys)
        order = sorted(range(len(strings)), key=strings.__getitem__)
        common = np.zeros(len(strings), dtype=np.int64)
        common[order] = _common_with_previous([strings[i] for i in order])
        hashes, owners = [np.zeros(0, np.uint64)], [np.zeros(0, np.int32)]
        for rows, matrix in _by_length(strings):
            n = matrix.shape[1]
            new = np.arange(1, n + 1) > common[rows][:, None]  # the prefixes first made here
            hashes.append(_mod_hashes(matrix, mod)[new])
            owners.append(np.repeat(rows.astype(np.int32), new.sum(axis=1)))
        found, key_of = np.concatenate(hashes), np.concatenate(owners)
        bits = prefix_slots(found.size).bit_length() - 1
        table_hash, table_key, probe = _place(found, key_of, bits)
        return cls(keys, mod, bits, probe, table_hash, table_key)

    def find(self, text: str) -> int:
        if text[: self._chars] not in self._short:
            return -1  # no key starts with its first letters
        data = text.encode("ascii", "replace")
        return self.find_hashed(data, int.from_bytes(data, "big") % self._mod)

    def find_hashed(self, data: bytes, h: int) -> int:
        """``find`` of ``data`` whose hash is ``h``: the slots from its home until an empty one,
        at most ``probe`` + 1 of them."""
        hashes, key_of, blob, ends = self._hashes, self._keys, self._blob, self._ends
        at = (h * _MIX & _MASK) >> self._shift
        end = min(at + self._probe + 1, self._size)
        n = len(data)
        while at < end:
            key = key_of[at]
            if key < 0:
                return -1
            if hashes[at] == h:
                start = ends[key]
                if ends[key + 1] - start >= n and blob[start : start + n] == data:
                    return int(key)
            at += 1
        return -1

    @property
    def mod(self) -> int:
        return self._mod

    @property
    def bits(self) -> int:
        return 64 - self._shift

    @property
    def probe(self) -> int:
        return self._probe

    @property
    def nbytes(self) -> int:
        return int(self.hashes.nbytes + self.keys.nbytes)

    @property
    def python_bytes(self) -> int:
        """What the set of short prefixes takes (held in each process, beside the arrays)."""
        return sys.getsizeof(self._short) + sum(map(sys.getsizeof, self._short))


def _short_prefixes(blob: memoryview, ends: memoryview) -> tuple[frozenset[str], int]:
    """The keys' distinct prefixes of at most n letters, and n: SHORT_CHARS, or fewer where
    the longer ones would pass SHORT_KEPT (the keys' bytes read in numpy, a length at a time)."""
    data = np.frombuffer(blob, dtype=np.uint8)
    offsets = np.asarray(ends, dtype=np.int64)
    starts, lengths = offsets[:-1], offsets[1:] - offsets[:-1]
    found: set[str] = set()
    for n in range(1, SHORT_CHARS + 1):
        rows = starts[lengths >= n]
        codes = np.zeros(rows.size, dtype=np.uint32)
        for j in range(n):
            codes = codes << np.uint32(8) | data[rows + j].astype(np.uint32)
        distinct = np.unique(codes).tolist()
        if n > 1 and len(distinct) > SHORT_KEPT:
            return frozenset(found), n - 1
        found.update(code.to_bytes(n, "big").decode("latin-1") for code in distinct)
    return frozenset(found), SHORT_CHARS


MAX_POWERS = 2 + 160  # index.entities.MAX_KEY_CHARS + 2: powers of the base a lookup needs
# A prefix table's modulus: a prime of this many bits (a hash times 256 fits in 63 bits)
MOD_BITS = 55


def _home(hashes: npt.NDArray[np.uint64], bits: int) -> npt.NDArray[np.int64]:
    """Each hash's home slot: the top bits of the hash times _MIX (keys that differ in their
    last letter hash a few units apart: their top bits alone would crowd one run of slots)."""
    with np.errstate(over="ignore"):
        mixed = hashes * np.uint64(_MIX)  # mod 2^64
    return (mixed >> np.uint64(64 - bits)).astype(np.int64)


def _place(
    hashes: npt.NDArray[np.uint64], key_of: npt.NDArray[np.int32], bits: int
) -> tuple[npt.NDArray[np.uint64], npt.NDArray[np.int32], int]:
    """Linear probing in numpy: the items in order of home slot, each at its home or just past
    the one before (position = i + the running max of home - i), the table long enough for the
    last; and the farthest an item sits from its home."""
    home = _home(hashes, bits)
    order = np.argsort(home, kind="stable")
    home = home[order]
    rank = np.arange(home.size, dtype=np.int64)
    at = np.maximum.accumulate(home - rank) + rank if home.size else rank
    size = max(1 << bits, int(at[-1]) + 1 if at.size else 0)
    table_hash = np.zeros(size, dtype=np.uint64)
    table_key = np.full(size, -1, dtype=np.int32)
    table_hash[at] = hashes[order]
    table_key[at] = key_of[order]
    probe = int((at - home).max()) if at.size else 0
    return table_hash, table_key, probe


def _filter_log2(variants: int) -> int:
    """The bits (log 2) of the bitmap of this many variants' hashes."""
    return min(
        FILTER_MAX_LOG2, max(FILTER_MIN_LOG2, int(variants * FILTER_BITS_PER_VARIANT).bit_length())
    )


def _bitmap(hashes: npt.NDArray[np.uint64]) -> tuple[npt.NDArray[np.uint8], int]:
    """A bitmap of the hashes' top bits, and the shift that leaves those bits of a hash."""
    log2 = _filter_log2(hashes.size)
    slots = (hashes >> np.uint64(64 - log2)).astype(np.int64)
    bits = np.zeros(1 << (log2 - 3), dtype=np.uint8)
    np.bitwise_or.at(bits, slots >> 3, np.left_shift(1, slots & 7).astype(np.uint8))
    return bits, 64 - log2


class NearKeys:
    """Keys by the hashes of their one-letter deletions (never the first letter) and of
    themselves: ``sharing(span)`` finds every key one edit away that keeps the first letter.
    ``NearKeys(keys)`` builds the table of every key of ``keys``, ``NearKeys(keys, ids)`` of
    those keys only (``sharing_ids`` answers indexes into ``keys``), with a hash base drawn
    here unless given."""

    def __init__(
        self, keys: Sequence[str], ids: Sequence[int] | None = None, base: int | None = None
    ) -> None:
        self.keys = keys
        self._base = secrets.randbits(64) | 1 if base is None else base
        chosen = list(range(len(keys))) if ids is None else [int(i) for i in ids]
        hashes, owners = self._variants([keys[i] for i in chosen])
        order = np.argsort(hashes, kind="stable")
        self._set(
            hashes[order], np.asarray(chosen, dtype=np.int32)[owners[order]], *_bitmap(hashes)
        )

    @classmethod
    def mapped(
        cls,
        keys: Sequence[str],
        base: int,
        hashes: npt.NDArray[np.uint64],
        owners: npt.NDArray[np.int32],
        bitmap: npt.NDArray[np.uint8],
        shift: int,
    ) -> NearKeys:
        """The table ``gazetteer.bin`` holds (checked by ``read``)."""
        near = cls.__new__(cls)
        near.keys, near._base = keys, base
        near._set(hashes, owners, bitmap, shift)
        return near

    def _set(
        self,
        hashes: npt.NDArray[np.uint64],
        owners: npt.NDArray[np.int32],
        bitmap: npt.NDArray[np.uint8],
        shift: int,
    ) -> None:
        self._hashes, self._owners, self._bitmap, self._shift = hashes, owners, bitmap, shift
        self._filter = bitmap.data  # Python ints on indexing
        self._powers = [pow(self._base, k, 1 << 64) for k in range(MAX_POWERS)]

    def _variants(self, keys: Sequence[str]) -> tuple[npt.NDArray[np.uint64], npt.NDArray[np.intp]]:
        """Every key's deletions' hashes, and the key each is of, a key length at a time."""
        hashes: list[npt.NDArray[np.uint64]] = [np.zeros(0, np.uint64)]
        owners: list[npt.NDArray[np.intp]] = [np.zeros(0, np.intp)]
        for rows, matrix in _by_length(keys):
            hashes.append(self._deletion_hashes(matrix).ravel())
            owners.append(np.repeat(rows, matrix.shape[1]))
        return np.concatenate(hashes), np.concatenate(owners)

    def _deletion_hashes(self, matrix: npt.NDArray[np.uint8]) -> npt.NDArray[np.uint64]:
        """Per row (keys of one length n), the hashes of its n - 1 deletions (letter 1 to n-1)
        and of the key itself:
        with P[j] the hash of the first j letters, dropping letter p leaves
        (P[p] - P[p+1]) * B^(n-1-p) + P[n] (mod 2^64, as ``_hashes_of`` computes)."""
        n = matrix.shape[1]
        base = np.uint64(self._base)
        prefix = _prefix_hashes(matrix, self._base)
        with np.errstate(over="ignore"):
            powers = np.ones(n, dtype=np.uint64)
            for k in range(1, n):
                powers[k] = powers[k - 1] * base
        dropped = np.arange(1, n)
        hashes: npt.NDArray[np.uint64] = (prefix[:, dropped] - prefix[:, dropped + 1]) * powers[
            n - 1 - dropped
        ] + prefix[:, n : n + 1]
        return np.hstack([hashes, prefix[:, n : n + 1]])  # arrays wrap around silently: mod 2^64

    def sharing(self, span: str) -> set[str]:
        """The keys one edit from ``span`` that keep its first letter, and perhaps a few more
        (hashed: the caller checks each): those having ``span`` as a deletion, those sharing a
        deletion with it (never its first letter), and those that are one of its deletions."""
        return {self.keys[i] for i in self.sharing_ids(span)}

    def sharing_ids(self, span: str) -> set[int]:
        """``sharing`` as indexes into ``keys``. Most spans hit nothing: a bitmap says so in
        Python."""
        bitmap, shift = self._filter, self._shift
        maybe = [
            h for h in self._hashes_of(span) if bitmap[h >> shift >> 3] >> (h >> shift & 7) & 1
        ]
        if not maybe:
            return set()  # no deletion of any key hashes so: most spans stop here, in Python
        table, size = self._hashes, self._hashes.size
        wanted = np.asarray(maybe, dtype=np.uint64)
        at = np.searchsorted(table, wanted)
        hit = at < size
        hit[hit] = table[at[hit]] == wanted[hit]
        found: set[int] = set()
        for i in at[hit].tolist():
            stop = int(np.searchsorted(table, table[i], side="right"))
            found.update(self._owners[i : min(stop, i + MAX_NEAR_RUN)].tolist())
        return found

    def _hashes_of(self, span: str) -> list[int]:
        """The hash of ``span`` and of each of its deletions (letter 1 to n-1), as
        ``_deletion_hashes`` computes them."""
        n, power = len(span), self._powers
        if n >= len(power):
            return []  # longer than any key by two: nothing is one edit from it
        prefix = [0]
        base = self._base
        for c in span.encode("ascii", "replace"):
            prefix.append((prefix[-1] * base + c) & _MASK)
        whole = prefix[n]
        dropped = [
            ((prefix[p] - prefix[p + 1]) * power[n - 1 - p] + whole) & _MASK for p in range(1, n)
        ]
        return [whole, *dropped]

    @property
    def nbytes(self) -> int:
        arrays = self._hashes.nbytes + self._owners.nbytes + self._bitmap.nbytes
        return int(arrays) + _list_bytes(self._powers)

    def __sizeof__(self) -> int:
        return object.__sizeof__(self) + self.nbytes

    def __len__(self) -> int:
        """How many hashes the table holds: each key's and its deletions' (a key's repeated
        deletions counted each time)."""
        return int(self._hashes.size)


@dataclass(frozen=True, slots=True)
class KeyTables:
    """Everything a gazetteer matches by: the rated keys, their prefixes, the long keys' one-edit
    variants, and what those long keys start with and how long they are."""

    rated: RatedKeys
    prefixes: PrefixTable
    near: NearKeys
    initials: frozenset[str]  # the long keys' first letters
    lengths: tuple[int, int]  # the lengths a span one edit from a long key may have

    @classmethod
    def build(cls, rated: RatedKeys, seeds: tuple[int, int] | None = None) -> KeyTables:
        """The tables, built in numpy (at index time, or at load for a snapshot without them),
        with their hashes' seeds drawn here unless given (the prefixes' modulus, the near keys'
        base)."""
        long = rated.long()
        prefix_mod, near_base = seeds or (None, None)
        prefixes = PrefixTable.build(rated.keys, prefix_mod)
        return cls._of(rated, prefixes, NearKeys(rated.keys, long.tolist(), near_base), long)

    @classmethod
    def _of(
        cls, rated: RatedKeys, prefixes: PrefixTable, near: NearKeys, long: npt.NDArray[np.int32]
    ) -> KeyTables:
        blob, _ = rated.keys.parts()
        offsets = np.asarray(rated.keys.arrays("")["offsets"], dtype=np.int64)
        firsts: list[int] = np.frombuffer(blob, dtype=np.uint8)[offsets[long]].tolist()
        lengths = (offsets[long + 1] - offsets[long]).tolist() or [0]
        return cls(
            rated=rated,
            prefixes=prefixes,
            near=near,
            initials=frozenset(map(chr, firsts)),
            lengths=(max(FUZZY_MIN_CHARS, min(lengths) - 1), max(lengths) + 1),
        )

    def dump(self, entities_sha256: str) -> bytes:
        """The bytes of ``gazetteer.bin`` for the ``entities.bin`` of this sha256."""
        near = self.near
        arrays: dict[str, npt.NDArray[Any]] = {
            "prefix_hash": self.prefixes.hashes,
            "prefix_key": self.prefixes.keys,
            "near_hash": near._hashes,
            "near_key": near._owners,
            "near_filter": near._bitmap,
        }
        return dump_arrays(
            GAZETTEER_KIND, arrays, tables=TABLES, entities=entities_sha256,
            keys=len(self.rated.keys), prefix_mod=self.prefixes.mod,
            prefix_bits=self.prefixes.bits, probe=self.prefixes.probe, near_base=near._base,
            near_shift=near._shift,
        )  # fmt: skip

    @classmethod
    def read(cls, file: ArraysFile, rated: RatedKeys) -> KeyTables:
        """The tables a ``gazetteer.bin`` holds for these keys, checked; ValueError naming what
        is wrong."""
        count = len(rated.keys)
        if file.integer("keys", 0, 1 << 40) != count:
            raise ValueError(f"it indexes {file.header.get('keys')} keys, not {count}")
        lengths = rated.lengths()
        prefixes = _read_prefixes(file, rated.keys, int(lengths.sum()))
        near = _read_near(file, rated, lengths >= FUZZY_MIN_CHARS)
        return cls._of(rated, prefixes, near, rated.long())

    @property
    def nbytes(self) -> int:
        """The tables' bytes (mapped or built), the keys' arrays left out (``entities.bin``)."""
        return self.prefixes.nbytes + self.near.nbytes

    @property
    def python_bytes(self) -> int:
        """What a process holds of mapped tables: the powers of the near keys' hash base, the
        set of short prefixes."""
        return _list_bytes(self.near._powers) + self.prefixes.python_bytes


def _list_bytes(values: list[int]) -> int:
    return sys.getsizeof(values) + sum(map(sys.getsizeof, values))


def tables_rules(file: ArraysFile) -> int:
    """The table rules a ``gazetteer.bin`` was written by (a file of others is not read)."""
    return file.integer("tables", 0, 1 << 16)


def _read_prefixes(file: ArraysFile, keys: StringTable, letters: int) -> PrefixTable:
    """The prefix table, no larger than the keys' ``letters`` (their prefixes, at most) allow
    and at most half full, as built (a full table would make every lookup walk MAX_PROBE)."""
    bits = file.integer("prefix_bits", 4, prefix_slots(letters).bit_length() - 1)
    probe = file.integer("probe", 0, MAX_PROBE)
    hashes = file.array("prefix_hash", "<u8")
    key_of = file.array("prefix_key", "<i4")
    if hashes.size != key_of.size or not (1 << bits) <= hashes.size <= (1 << bits) + probe + 1:
        raise ValueError(f"the prefix table is not 2^{bits} slots and their overflow")
    if key_of.size and (int(key_of.min()) < -1 or int(key_of.max()) >= len(keys)):
        raise ValueError("a prefix's key is outside the keys")
    at = np.flatnonzero(key_of >= 0)
    if at.size * SLOTS_PER_PREFIX > 1 << bits:
        raise ValueError(f"the prefix table holds {at.size} prefixes in 2^{bits} slots")
    home = _home(hashes[at], bits)
    if at.size and (bool(np.any(home > at)) or int((at - home).max()) > probe):
        raise ValueError(f"a prefix lies before its home slot or over {probe} slots past it")
    mod = file.integer("prefix_mod", 1 << (MOD_BITS - 1), (1 << MOD_BITS) - 1)
    return PrefixTable(keys, mod, bits, probe, hashes, key_of)


def _read_near(file: ArraysFile, rated: RatedKeys, long: npt.NDArray[np.bool_]) -> NearKeys:
    """The one-edit table: a variant per letter of each ``long`` key at most, each of a long
    key (a short key's one-edit matches are what FUZZY_MIN_CHARS keeps out), its bitmap the
    size the build gives that many."""
    shift = file.integer("near_shift", 64 - FILTER_MAX_LOG2, 64 - FILTER_MIN_LOG2)
    hashes = file.array("near_hash", "<u8")
    owners = file.array("near_key", "<i4")
    bitmap = file.array("near_filter", "|u1")
    if hashes.size > int(rated.lengths()[long].sum()):
        raise ValueError(f"{hashes.size} near keys, more than the long keys' letters")
    if hashes.size != owners.size or 64 - shift != _filter_log2(hashes.size):
        raise ValueError("the near keys' arrays do not agree in length")
    if bitmap.size != 1 << (64 - shift - 3):
        raise ValueError("the near keys' bitmap is not the size of its shift")
    if owners.size and (int(owners.min()) < 0 or int(owners.max()) >= len(rated.keys)):
        raise ValueError("a near key is outside the keys")
    if owners.size and not bool(long[owners].all()):
        raise ValueError("a near key is shorter than a one-edit match allows")
    if hashes.size > 1 and bool(np.any(hashes[1:] < hashes[:-1])):
        raise ValueError("the near keys' hashes are not sorted")
    return NearKeys.mapped(rated.keys, _base(file, "near_base"), hashes, owners, bitmap, shift)


def _base(file: ArraysFile, name: str) -> int:
    base = file.integer(name, 1, _MASK)
    if not base & 1:
        raise ValueError(f"header field {name!r} is not an odd number")
    return base


def tables_bytes(lengths: npt.NDArray[np.int64]) -> int:
    """What the tables of keys of these lengths take, at most: a prefix table as if every prefix
    were distinct (the bound a file's key lengths set), a variant per letter of each key long
    enough (and its own), and the variants' bitmap."""
    slots = prefix_slots(int(lengths.sum())) + MAX_PROBE
    variants = int(lengths[lengths >= FUZZY_MIN_CHARS].sum())
    log2 = _filter_log2(variants)
    return slots * SLOT_BYTES + variants * VARIANT_BYTES + (1 << (log2 - 3))


class KeyOwners(Mapping[str, "str | None"]):
    """key -> the name it names (None: shared by two names), read from the tables: the view a
    gazetteer's ``find`` reads a matched key's name by."""

    def __init__(self, tables: KeyTables) -> None:
        self._tables = tables

    def index(self, key: str) -> int:
        """The key's index, or -1 when it is not a key."""
        found = self._tables.prefixes.find(key)
        if found < 0 or len(self._tables.rated.keys[found]) != len(key):
            return -1
        return found

    def __getitem__(self, key: str) -> str | None:
        i = self.index(key)
        if i < 0:
            raise KeyError(key)
        owner = int(self._tables.rated.owner[i])
        return self._tables.rated.owner_name(owner) if owner >= 0 else None

    def __iter__(self) -> Iterator[str]:
        return iter(self._tables.rated.keys)

    def __len__(self) -> int:
        return len(self._tables.rated.keys)


class KeySure(Mapping[str, float]):
    """key -> its confidence, for the keys that name one name."""

    def __init__(self, owners: KeyOwners, tables: KeyTables) -> None:
        self._owners, self._tables = owners, tables

    def __getitem__(self, key: str) -> float:
        i = self._owners.index(key)
        if i < 0 or int(self._tables.rated.owner[i]) < 0:
            raise KeyError(key)
        return float(self._tables.rated.sure[i])

    def __iter__(self) -> Iterator[str]:
        owned = (self._tables.rated.owner >= 0).tolist()
        return itertools.compress(iter(self._tables.rated.keys), owned)

    def __len__(self) -> int:
        return int(np.count_nonzero(self._tables.rated.owner >= 0))
