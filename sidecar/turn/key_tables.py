"""The follow-ups gazetteer's matching tables, built from its keys in numpy (``followups.Gazetteer``).

A gazetteer extends a span of a turn's tokens while the words joined may still start a key
(``prefixes``), and matches a misheard name by the keys one edit away (``NearKeys``: symmetric
deletion, one letter dropped, never the first). Built in Python, one string per prefix generated
and one string per variant, these took 6 s of a 1M-chunk load (249,000 keys: 2.3 million
prefixes generated for 250,000 distinct ones, and 911,111 one-edit variants held as ~150 MB of
strings). Here each distinct prefix is made once (the keys sorted: a key's prefixes no longer
than its common prefix with the key before it are that key's), and the variants are kept as
64-bit hashes in one sorted array (12 bytes a variant: the hash and its key's index), computed a key length at a time.

A hash says where to look, never what matches: every key a lookup finds is checked letter by
letter by the caller (``followups._one_edit``), so a collision costs a comparison, never a wrong
match. Each table draws its own hash base, so a file cannot be made to collide its keys in
every process (and a collision would cost only comparisons).
"""

from __future__ import annotations

import secrets
from collections.abc import Sequence

import numpy as np
import numpy.typing as npt

_MASK = (1 << 64) - 1
ROWS = 1 << 16  # keys compared at a time when sorting out the distinct prefixes (memory bound)
# A lookup first asks a bitmap of the variants' hashes' top bits, in Python (a numpy call costs
# microseconds): bits per variant, so that a span's 10-15 hashes rarely pass it by chance; at
# most 2^27 bits (16 MB: 1.5 million variants at 1M chunks)
FILTER_BITS_PER_VARIANT = 64
FILTER_MAX_LOG2 = 27


def prefixes(keys: Sequence[str]) -> frozenset[str]:
    """Every string prefix of every key (``[a-z0-9]`` keys), each made once."""
    ordered = sorted(keys)
    common = _common_with_previous(ordered)
    return frozenset(
        [
            key[:i]
            for key, c in zip(ordered, common, strict=True)
            for i in range(c + 1, len(key) + 1)
        ]
    )


def _common_with_previous(ordered: list[str]) -> list[int]:
    """The length of each key's common prefix with the key before it (0 for the first)."""
    common: list[int] = []
    for start in range(0, len(ordered), ROWS):
        block = ordered[max(start - 1, 0) : start + ROWS]
        matrix, lengths = _matrix(block)
        same = matrix[1:] == matrix[:-1]
        first_differ = np.where(same.all(axis=1), matrix.shape[1], same.argmin(axis=1))
        shared = np.minimum(first_differ, np.minimum(lengths[1:], lengths[:-1]))
        common.extend(([0] if start == 0 else []) + shared.tolist())
    return common[: len(ordered)]


def _matrix(keys: Sequence[str]) -> tuple[npt.NDArray[np.uint8], npt.NDArray[np.int64]]:
    """The keys' bytes, one zero-padded row each, and their lengths."""
    lengths = np.fromiter(map(len, keys), dtype=np.int64, count=len(keys))
    width = int(lengths.max()) if len(keys) else 0
    matrix = np.zeros((len(keys), width), dtype=np.uint8)
    matrix[np.arange(width) < lengths[:, None]] = np.frombuffer(
        "".join(keys).encode("ascii"), dtype=np.uint8
    )
    return matrix, lengths


def _bitmap(hashes: npt.NDArray[np.uint64]) -> tuple[bytes, int]:
    """A bitmap of the hashes' top bits, and the shift that leaves those bits of a hash."""
    log2 = min(FILTER_MAX_LOG2, max(16, int(hashes.size * FILTER_BITS_PER_VARIANT).bit_length()))
    slots = (hashes >> np.uint64(64 - log2)).astype(np.int64)
    bits = np.zeros(1 << (log2 - 3), dtype=np.uint8)
    np.bitwise_or.at(bits, slots >> 3, np.left_shift(1, slots & 7).astype(np.uint8))
    return bits.tobytes(), 64 - log2


class NearKeys:
    """The keys by the hashes of their one-letter deletions (never the first letter) and of
    themselves: ``sharing(span)`` finds every key one edit away that keeps the first letter."""

    def __init__(self, keys: Sequence[str]) -> None:
        self.keys = tuple(keys)
        self._base = secrets.randbits(64) | 1
        longest = max(map(len, self.keys), default=0)
        self._powers = [pow(self._base, k, 1 << 64) for k in range(longest + 2)]
        hashes, owners = self._variants()
        order = np.argsort(hashes)
        self._hashes: npt.NDArray[np.uint64] = hashes[order]
        self._owners: npt.NDArray[np.int32] = owners[order]
        self._filter, self._shift = _bitmap(self._hashes)

    def _variants(self) -> tuple[npt.NDArray[np.uint64], npt.NDArray[np.int32]]:
        """Every key's deletions' hashes, and the key each is of, a key length at a time."""
        lengths = np.fromiter(map(len, self.keys), dtype=np.int64, count=len(self.keys))
        hashes: list[npt.NDArray[np.uint64]] = [np.zeros(0, np.uint64)]
        owners: list[npt.NDArray[np.int32]] = [np.zeros(0, np.int32)]
        for length in np.unique(lengths).tolist():
            rows = np.flatnonzero(lengths == length)
            matrix = _matrix([self.keys[i] for i in rows.tolist()])[0]
            hashes.append(self._deletion_hashes(matrix).ravel())
            owners.append(np.repeat(rows.astype(np.int32), length))
        return np.concatenate(hashes), np.concatenate(owners)

    def _deletion_hashes(self, matrix: npt.NDArray[np.uint8]) -> npt.NDArray[np.uint64]:
        """Per row (keys of one length n), the hashes of its n - 1 deletions (letter 1 to n-1)
        and of the key itself:
        with P[j] the hash of the first j letters, dropping letter p leaves
        (P[p] - P[p+1]) * B^(n-1-p) + P[n] (mod 2^64, as ``_hashes_of`` computes)."""
        n = matrix.shape[1]
        base = np.uint64(self._base)
        prefix = np.zeros((matrix.shape[0], n + 1), dtype=np.uint64)
        with np.errstate(over="ignore"):
            for j in range(n):
                prefix[:, j + 1] = prefix[:, j] * base + matrix[:, j].astype(np.uint64)
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
        deletion with it (never its first letter), and those that are one of its deletions. Most
        spans hit nothing: a bitmap says so in Python."""
        table, size, bitmap, shift = self._hashes, self._hashes.size, self._filter, self._shift
        maybe = [
            h for h in self._hashes_of(span) if bitmap[h >> shift >> 3] >> (h >> shift & 7) & 1
        ]
        if not maybe:
            return set()  # no deletion of any key hashes so: most spans stop here, in Python
        wanted = np.asarray(maybe, dtype=np.uint64)
        at = np.searchsorted(table, wanted)
        hit = at < size
        hit[hit] = table[at[hit]] == wanted[hit]
        found: set[str] = set()
        for i, h in zip(at[hit].tolist(), wanted[hit].tolist(), strict=True):
            while i < size and int(table[i]) == h:
                found.add(self.keys[int(self._owners[i])])
                i += 1
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

    def __sizeof__(self) -> int:
        tables = self._hashes.nbytes + self._owners.nbytes + len(self._filter)
        return object.__sizeof__(self) + tables

    def __len__(self) -> int:
        """How many hashes the table holds: each key's and its deletions' (a key's repeated
        deletions counted each time)."""
        return int(self._hashes.size)
