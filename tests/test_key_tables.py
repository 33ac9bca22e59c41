"""The gazetteer's matching tables built in numpy: the same prefixes and one-edit matches as the
strings they replace, whatever the hash does."""

from __future__ import annotations

import random

import numpy as np
import pytest

from index import key_tables
from index.mapped import StringTable
from sidecar.turn import followups
from sidecar.turn.followups import FUNCTION_WORDS_EN, Gazetteer

LETTERS = "abcdefghijklmnopqrstuvwxyz0123456789"


def _keys(count: int, seed: int) -> list[str]:
    """Keys sharing prefixes (a few stems, as a base's names do), 1 to 16 letters."""
    rng = random.Random(seed)
    stems = ["", "document", "pizzahut", "the", "g"]
    out = set()
    while len(out) < count:
        tail = "".join(rng.choice(LETTERS[:6]) for _ in range(rng.randint(0, 8)))
        key = (rng.choice(stems) + tail)[:16]
        if key:
            out.add(key)
    return sorted(out, key=lambda _: rng.random())


def _deletions(key: str) -> set[str]:
    return {key[:i] + key[i + 1 :] for i in range(1, len(key))}


# keys compared a block at a time; the short prefixes asked first two letters long, not three
@pytest.mark.parametrize(("rows", "short"), [(3, key_tables.SHORT_KEPT), (key_tables.ROWS, 60)])
def test_prefixes_are_every_prefix_of_every_key(
    monkeypatch: pytest.MonkeyPatch, rows: int, short: int
) -> None:
    monkeypatch.setattr(key_tables, "ROWS", rows)
    monkeypatch.setattr(key_tables, "SHORT_KEPT", short)
    for keys in ([], ["a"], ["abc", "ab"], _keys(500, 1)):
        table = key_tables.PrefixTable.build(StringTable.of(keys))
        prefixes = {k[:i] for k in keys for i in range(1, len(k) + 1)}
        assert int((table.keys >= 0).sum()) == len(prefixes)  # each distinct prefix once
        for prefix in prefixes:
            found = table.find(prefix)
            assert keys[found].startswith(prefix)
            assert (keys[found] == prefix) == (prefix in keys)  # a key finds itself
        for other in ("z", "abd", "documentz", "g" * 20, "pizzahutf" + "a" * 9, "", "thé"):
            assert table.find(other) == -1 or other in prefixes
        assert table.python_bytes > 0  # the short prefixes' set, counted


def test_sharing_finds_every_key_with_a_common_deletion() -> None:
    keys = _keys(400, 2)
    near = key_tables.NearKeys(keys)
    assert len(near) == sum(map(len, keys))
    rng = random.Random(3)
    for span in [
        *keys[:50],
        *("".join(rng.choice(LETTERS[:6]) for _ in range(9)) for _ in range(50)),
    ]:
        wanted = {
            k
            for k in keys
            if span in _deletions(k) or k in _deletions(span) or _deletions(span) & _deletions(k)
        }
        assert wanted <= near.sharing(span)  # a hash collision may add a key: the caller checks


NAMES = ["GONVILLE HOTEL", "LLIVNOGE HOTEL", "CITYROOMZ", "CITYMOORZ", "LENSFIELD", "LENSFEILD"]
SAID = [
    "is the gonvile near cityroomz",
    "the goonville",
    "llivnoge or llivnog",
    "cityroomx",
    "the lensfeld",
    "lensfiled",
    "the onville",  # the first letter is never the edit
]


def test_colliding_hashes_match_no_other_name(monkeypatch: pytest.MonkeyPatch) -> None:
    """With a hash base of 1 a variant's hash is the sum of its letters: every anagram collides
    ("gonvillehotel", "llivnogehotel"). Each key found is checked letter by letter, so the
    names matched are those a random base gives."""
    expected = [_gazetteer().mentions(text) for text in SAID]
    monkeypatch.setattr(key_tables.secrets, "randbits", lambda bits: 0)  # base 0 | 1
    colliding = _gazetteer()
    assert colliding._near._base == 1
    assert "llivnogehotel" in colliding._near.sharing("gonvillehote")  # it does collide
    assert [colliding.mentions(text) for text in SAID] == expected
    assert expected == [
        ["GONVILLE HOTEL", "CITYROOMZ"],
        ["GONVILLE HOTEL"],
        ["LLIVNOGE HOTEL"],
        ["CITYROOMZ"],
        [],  # one edit from both LENSFIELD and LENSFEILD: neither
        ["LENSFIELD"],
        [],
    ]


def _gazetteer() -> Gazetteer:
    return Gazetteer(NAMES, FUNCTION_WORDS_EN, None, followups.STREETS_EN)


def test_a_run_of_one_hash_gives_a_lookup_a_bounded_number_of_keys() -> None:
    """A hostile table of one span's hash repeated (the file names its hash base): the lookup
    reads at most MAX_NEAR_RUN of the run, not all of it, each time the span is said."""
    keys = [f"document{i:05d}" for i in range(3000)]
    built = key_tables.NearKeys(keys)
    run = 8 * key_tables.MAX_NEAR_RUN
    span_hash = built._hashes_of("daughters")[0]
    hashes = np.full(run, span_hash, dtype=np.uint64)
    owners = np.arange(run, dtype=np.int32) % len(keys)
    near = key_tables.NearKeys.mapped(
        keys, built._base, hashes, owners, np.full(1 << 13, 0xFF, np.uint8), 48
    )
    found = near.sharing_ids("daughters")
    assert 1 < len(found) <= key_tables.MAX_NEAR_RUN
