"""The follow-ups' entities stored in the snapshot (format 5, ``entities.bin``; issue 19, 1): a
gazetteer read from the stored keys answers exactly as one rated from the chunks at load, an old
snapshot without them is still read, and a hostile file is refused by name."""

from __future__ import annotations

import json
import logging
import mmap
import shutil
from pathlib import Path

import numpy as np
import pytest

from index.entities import (
    ENTITIES_KIND,
    RULES,
    EntityStats,
    EntityTable,
    chunk_entities,
    chunk_entity,
)
from index.errors import CorruptSnapshot
from index.key_tables import GAZETTEER_KIND, KeyTables, RatedKeys
from index.mapped import ArraysFile, StringTable, _mapping_of, dump_arrays
from index.snapshot import (
    ENTITIES,
    GAZETTEER,
    MANIFEST,
    LoadedSnapshot,
    gazetteer_tables,
    load_snapshot,
    write_pages_snapshot,
)
from index.tables import MAX_EMBED_BYTES
from index.types import Page
from sidecar.snapshots.searcher import Searcher
from sidecar.turn import followups
from sidecar.turn.followups import FUNCTION_WORDS_EN, STREETS_EN, Gazetteer
from tests.snapshot_kit import _header, _item, resign

DIM = 16
# name -> what its page says: partial names ("the Lensfield"), names one edit away when misheard
# ("Gonvile", "cityroomz"), a name whose word other entities use ("worth"), names that share
# words ("Pizza Hut ..."), one on a street ("Bridge"), a one-word page name others mention.
PAGES = {
    "THE LENSFIELD HOTEL": "A quiet hotel with parking and a gym. Worth the price.",
    "HOBSONS HOUSE": "A guest house with free wifi. Well worth a visit, they say.",
    "ACORN GUEST HOUSE": "A guest house on Chesterton road, worth it for the breakfast.",
    "GONVILLE HOTEL": "A hotel near the park with a restaurant.",
    "WORTH HOUSE": "A cheap guest house in the north with parking.",
    "BRIDGE GUEST HOUSE": "A guest house on Hills road near the station.",
    "PIZZA HUT CHERRY HINTON": "Pizza and pasta in Cherry Hinton; Selection of salads.",
    "PIZZA HUT FEN DITTON": "Pizza in Fen Ditton, open late. Selection of desserts.",
    "PIZZA EXPRESS FEN DITTON": "Pizza and wine in Fen Ditton. A selection of wines.",
    "CITYROOMZ": "Rooms in the city centre, cheap.",
    "Selection": "How to select text in the terminal.",
    "ALEXANDER HOTEL": "A hotel in the centre with a bar.",
    "ALEXANDER GUEST HOUSE": "A guest house by the river.",
}
SAID = [
    "is the lensfield quiet",
    "what about the gonvile hotel and cityroomz",
    "the gonvile near cityroomz or the lensfeld",
    "12 bridge street please",
    "bridge guest house has parking?",
    "is it worth the price at hobsons",
    "worth house then",
    "pizza hut in fen ditton or cherry hinton",
    "fen ditton pizza express",
    "the selection of desserts",
    "tell me about selection",
    "nothing here names anything",
    "is the alexander by the river",
]


def write_base(folder: Path) -> Path:
    pages = [
        Page("hotels", f"{i}.md", name, text, "text", context=name)
        for i, (name, text) in enumerate(PAGES.items())
    ]
    from index.chunker import chunk_page

    chunks = [c for p in pages for c in chunk_page(p)]
    rng = np.random.default_rng(3)
    vectors = rng.normal(size=(len(chunks), DIM)).astype(np.float32)
    vectors /= np.linalg.norm(vectors, axis=1, keepdims=True)
    from index.embedders.base import EmbedderInfo

    write_pages_snapshot(
        folder,
        knowledge_base="hotels",
        version="v1",
        embedder=EmbedderInfo("fake", DIM),
        pages=pages,
        chunks=chunks,
        vectors=vectors,
    )
    return folder


@pytest.fixture(scope="module")
def base(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_base(tmp_path_factory.mktemp("entities") / "v1")


def from_the_chunks(snapshot: LoadedSnapshot) -> Gazetteer:
    """The gazetteer as the sidecar built it before format 5: every chunk read, rated here."""
    entity_of = [chunk_entity(c) for c in snapshot.chunks]
    stats = EntityStats(snapshot.lexical, entity_of)
    return Gazetteer(stats.names, FUNCTION_WORDS_EN, stats.is_common, STREETS_EN, stats.confidence)


def assert_same_answers(stored: Gazetteer, built: Gazetteer, snapshot: LoadedSnapshot) -> None:
    for text in SAID:
        toks = followups.tokens(text)
        assert stored.find(toks) == built.find(toks), text
        assert stored.mentions(text) == built.mentions(text), text
    assert stored.shared == built.shared
    assert stored.size == built.size
    assert [stored.entity_of(c) for c in snapshot.chunks] == [
        chunk_entity(c) for c in snapshot.chunks
    ]


def test_a_gazetteer_read_from_the_snapshot_answers_as_one_rated_from_its_chunks(
    base: Path,
) -> None:
    snapshot = load_snapshot(base)
    assert snapshot.entities is not None
    stored, built = Gazetteer.of(snapshot), from_the_chunks(snapshot)
    assert_same_answers(stored, built, snapshot)
    assert stored._keys == built._keys
    assert stored._sure == built._sure
    # the base exercises what it is meant to: partial and one-edit matches, a weak one-word
    # name, an address that is not a name, keys two names share
    found = {m.name: m.confidence for m in stored.find(followups.tokens(" ".join(SAID)))}
    assert {"THE LENSFIELD HOTEL", "GONVILLE HOTEL", "CITYROOMZ"} <= set(found)
    assert stored.mentions("12 bridge street please") == []
    assert found["Selection"] <= 0.25
    assert stored._keys["alexander"] is None  # two names' partial name: it names neither
    table = snapshot.entities
    assert [table.entity(i) for i in range(len(snapshot.chunks))] == chunk_entities(
        snapshot.chunks
    )[1]


def test_a_format_4_snapshot_is_read_and_rated_at_load(base: Path, tmp_path: Path) -> None:
    folder = tmp_path / "v4"
    shutil.copytree(base, folder)
    manifest = json.loads((folder / MANIFEST).read_bytes())
    manifest["format_version"] = 4
    del manifest["files"][ENTITIES], manifest["sizes"][ENTITIES]
    (folder / ENTITIES).unlink()
    (folder / MANIFEST).write_text(json.dumps(manifest))
    snapshot = load_snapshot(folder)
    assert snapshot.entities is None
    assert_same_answers(Searcher.build(snapshot).gazetteer, from_the_chunks(snapshot), snapshot)


def test_keys_rated_by_other_rules_are_rated_again(
    base: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    snapshot = load_snapshot(base)
    monkeypatch.setattr(followups, "RULES", followups.RULES + 1)
    rated = []
    monkeypatch.setattr(EntityStats, "rated", lambda self: rated.append(1) or rate_of(self))
    with caplog.at_level(logging.WARNING, logger=followups.__name__):
        gazetteer = Gazetteer.of(snapshot)
    assert rated == [1]
    assert_same_answers(gazetteer, from_the_chunks(snapshot), snapshot)
    # the operator is told what it costs and what ends it
    assert snapshot.version in caplog.text
    assert "index the base again" in caplog.text


def rate_of(stats: EntityStats) -> followups.Rated:
    return followups.rate(stats.names, FUNCTION_WORDS_EN, stats.is_common, stats.confidence)


def test_a_chunks_entity_is_remembered_within_a_bound(
    base: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(followups, "ENTITIES_KEPT", 3)
    snapshot = load_snapshot(base)
    gazetteer = Gazetteer.of(snapshot)
    for chunk in [*snapshot.chunks, *snapshot.chunks]:
        assert gazetteer.entity_of(chunk) == chunk_entity(chunk)
        assert len(gazetteer._entities) <= 3


def patched(folder: Path, array: str, i: int, raw: bytes) -> None:
    path = folder / ENTITIES
    data = bytearray(path.read_bytes())
    file = ArraysFile(bytes(data), ENTITIES_KIND)
    spec = file.header["arrays"][array]
    width = np.dtype(spec["dtype"]).itemsize
    at = file._extent(array, spec["dtype"])[0] + i * width
    data[at : at + len(raw)] = raw
    path.write_bytes(bytes(data))
    resign(folder, ENTITIES)


def header_changed(folder: Path, key: str, value: object) -> None:
    path = folder / ENTITIES
    data = path.read_bytes()
    file = ArraysFile(data, ENTITIES_KIND)
    header = json.dumps({**file.header, key: value}, separators=(",", ":")).encode()
    start = 12
    length = int.from_bytes(data[8:12], "little")
    padded = header + b" " * (length - len(header))  # JSON allows trailing blanks
    assert len(padded) == length, "the test's header grew"
    path.write_bytes(data[:start] + padded + data[start + length :])
    resign(folder, ENTITIES)


def owner_grown(folder: Path) -> None:
    """The file rewritten whole with a key's owner grown by 5 MB of punctuation: the same tokens,
    so the key still matches it, and the name would be folded into every query."""
    table = load_snapshot(folder).entities
    assert table is not None
    owners = list(table.owners)
    owners[owners.index("GONVILLE HOTEL")] += " !" * (5 << 19)
    arrays = {
        **StringTable.of(list(table.names)).arrays("n_"),
        "entity_of": np.asarray(table.entity_of),
        **StringTable.of(owners).arrays("g_"),
        **StringTable.of(list(table.keys)).arrays("k_"),
        "key_owner": np.asarray(table.key_owner),
        "key_sure": np.asarray(table.key_sure),
        "key_partial": np.asarray(table.key_partial),
    }
    held = len(table.entity_of)
    raw = dump_arrays(
        ENTITIES_KIND, arrays, count=held, rules=RULES, names=table.size, span=table.span,
        shared=sorted(table.shared),
    )  # fmt: skip
    (folder / ENTITIES).write_bytes(raw)
    resign(folder, ENTITIES)
    (folder / GAZETTEER).write_bytes(gazetteer_tables(raw, held))  # the tables of these keys
    resign(folder, GAZETTEER)


ATTACKS = {
    "entity_of_past_the_names": lambda f: patched(
        f, "entity_of", 0, (1 << 30).to_bytes(4, "little")
    ),
    "key_owner_past_the_names": lambda f: patched(f, "key_owner", 0, (999).to_bytes(4, "little")),
    "key_sure_nan": lambda f: patched(f, "key_sure", 0, np.float64("nan").tobytes()),
    "key_sure_above_one": lambda f: patched(f, "key_sure", 0, np.float64(7.0).tobytes()),
    "key_with_a_capital": lambda f: patched(f, "k_blob", 0, b"Z"),
    "key_partial_not_a_flag": lambda f: patched(f, "key_partial", 0, b"\x05"),
    "chunk_count_differs": lambda f: header_changed(f, "count", 3),
    "shared_words_not_a_list": lambda f: header_changed(f, "shared", 5),
    "cut_in_half": lambda f: (
        (f / ENTITIES).write_bytes((f / ENTITIES).read_bytes()[:700]),
        resign(f, ENTITIES),
    ),
}


def test_a_hostile_owner_of_megabytes_is_matched_cut_to_the_chunk_context_cap(
    base: Path, tmp_path: Path
) -> None:
    """A key's owner grown by 5 MB of punctuation (the same tokens: the key still matches it) is
    read cut to a chunk context's cap, as a chunk's own fields are: never megabytes in a query."""
    folder = tmp_path / "grown"
    shutil.copytree(base, folder)
    owner_grown(folder)
    gazetteer = Gazetteer.of(load_snapshot(folder))
    named = [m.name for m in gazetteer.find(followups.tokens("about the gonville hotel"))]
    assert named
    assert all(len(name.encode()) <= MAX_EMBED_BYTES for name in named)
    assert named[0].startswith("GONVILLE HOTEL !")


@pytest.mark.parametrize("attack", sorted(ATTACKS))
def test_a_hostile_entities_file_is_refused_by_name(
    attack: str, base: Path, tmp_path: Path
) -> None:
    folder = tmp_path / attack
    shutil.copytree(base, folder)
    ATTACKS[attack](folder)
    with pytest.raises(CorruptSnapshot, match=r"entities\.bin"):
        load_snapshot(folder)


def test_keys_that_would_blow_memory_are_refused_before_they_are_read(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every prefix of every key is kept in memory: the reader bounds that by the keys'
    lengths, in bytes, before building anything."""
    from index import entities

    lexical_chunks = load_snapshot(write_base(tmp_path / "v"))
    path = tmp_path / "v" / ENTITIES
    table = EntityTable.open(path, len(lexical_chunks.chunks))
    lengths = np.diff(np.asarray(table.keys.parts()[1], dtype=np.int64))
    monkeypatch.setattr(entities, "MAX_GAZETTEER_BYTES", entities.gazetteer_bytes(lengths) - 1)
    with pytest.raises(ValueError, match="bytes in memory"):
        EntityTable.open(path, len(lexical_chunks.chunks))
    long_name = "a" * (entities.MAX_KEY_CHARS + 1)
    assert followups.Gazetteer([long_name, "Gonville"], FUNCTION_WORDS_EN).size == 1


def test_the_mapped_tables_are_the_tables_built_from_its_keys(base: Path) -> None:
    """gazetteer.bin holds what the sidecar would build from entities.bin's keys (given the
    file's hash bases), mapped, not copied; a gazetteer on them answers as one rated from the
    chunks (test above) and as one built at load."""
    snapshot = load_snapshot(base)
    mapped, table = snapshot.key_tables, snapshot.entities
    assert mapped is not None
    assert table is not None
    assert isinstance(_mapping_of(mapped.prefixes.hashes), mmap.mmap)
    built = KeyTables.build(table.rated_keys(), (mapped.prefixes.mod, mapped.near._base))
    assert len(built.near) > 0  # the base has long keys: the variants are compared too
    for a, b in [
        (mapped.prefixes.hashes, built.prefixes.hashes),
        (mapped.prefixes.keys, built.prefixes.keys),
        (mapped.near._hashes, built.near._hashes),
        (mapped.near._owners, built.near._owners),
        (mapped.near._bitmap, built.near._bitmap),
    ]:
        np.testing.assert_array_equal(a, b)
    assert (mapped.initials, mapped.lengths) == (built.initials, built.lengths)
    gazetteer = Gazetteer.of(snapshot)
    assert gazetteer.tables is mapped
    # the arrays are the file's; the sound tables are built at load
    # (and what an agent's turn is also matched by: the name words looked up alone,
    # ``NameWords``, whole names' ratings, names without their inner function words)
    assert gazetteer.agent_bytes > gazetteer.words.nbytes
    assert gazetteer.built_bytes == (
        mapped.python_bytes + gazetteer.sounds.nbytes + gazetteer.agent_bytes
    )
    assert_same_answers(gazetteer, Gazetteer.of_tables(built, table), snapshot)


def without_tables(base: Path, folder: Path) -> Path:
    """A format-5 snapshot written before gazetteer.bin: the manifest lists no tables."""
    shutil.copytree(base, folder)
    manifest = json.loads((folder / MANIFEST).read_bytes())
    del manifest["files"][GAZETTEER], manifest["sizes"][GAZETTEER]
    (folder / GAZETTEER).unlink()
    (folder / MANIFEST).write_text(json.dumps(manifest))
    return folder


def test_a_snapshot_without_its_tables_builds_them_at_load_and_answers_the_same(
    base: Path, tmp_path: Path
) -> None:
    snapshot = load_snapshot(without_tables(base, tmp_path / "older"))
    assert snapshot.key_tables is None
    searcher = Searcher.build(snapshot)
    tables = searcher.gazetteer.tables
    built = tables.nbytes + tables.prefixes.python_bytes + searcher.gazetteer.sounds.nbytes
    built += searcher.gazetteer.agent_bytes
    assert searcher.gazetteer.built_bytes == built > 0
    assert searcher.held_bytes >= searcher.gazetteer.built_bytes  # counted: built here
    assert_same_answers(searcher.gazetteer, Gazetteer.of(load_snapshot(base)), snapshot)


def test_tables_of_other_rules_are_built_again(base: Path, tmp_path: Path) -> None:
    folder = tmp_path / "other-rules"
    shutil.copytree(base, folder)
    tampered(folder, "tables", 99)
    snapshot = load_snapshot(folder)
    assert snapshot.key_tables is None
    assert_same_answers(Gazetteer.of(snapshot), from_the_chunks(snapshot), snapshot)


def tampered(folder: Path, field: str, value: object) -> None:
    """gazetteer.bin with one header field changed, re-signed."""
    path = folder / GAZETTEER
    path.write_bytes(_header(field, value)(path.read_bytes()))
    resign(folder, GAZETTEER)


def item_set(folder: Path, array: str, i: int, value: int) -> None:
    """gazetteer.bin with element ``i`` of ``array`` set (``i`` < 0: the first occupied prefix
    slot), re-signed."""
    path = folder / GAZETTEER
    data = path.read_bytes()
    if i < 0:
        i = int(np.flatnonzero(ArraysFile(data, GAZETTEER_KIND).array("prefix_key", "<i4") >= 0)[0])
    path.write_bytes(_item(array, i, value)(data))
    resign(folder, GAZETTEER)


_ARRAYS = {"prefix_hash": "<u8", "prefix_key": "<i4", "near_hash": "<u8", "near_key": "<i4",
           "near_filter": "|u1"}  # fmt: skip


def rewritten(folder: Path, **changed: object) -> None:
    """gazetteer.bin written again with arrays (numpy values) or header fields replaced,
    re-signed: a file that parses, sized or filled as no build makes it."""
    path = folder / GAZETTEER
    file = ArraysFile(path.read_bytes(), GAZETTEER_KIND)
    arrays = {name: np.array(file.array(name, dtype)) for name, dtype in _ARRAYS.items()}
    fields = {k: v for k, v in file.header.items() if k not in ("kind", "arrays", "version")}
    arrays.update({k: v for k, v in changed.items() if isinstance(v, np.ndarray)})
    fields.update({k: v for k, v in changed.items() if not isinstance(v, np.ndarray)})
    path.write_bytes(dump_arrays(GAZETTEER_KIND, arrays, **fields))
    resign(folder, GAZETTEER)


def _table_of(folder: Path, bits: int = 0, fill: bool = False) -> dict[str, object]:
    """A prefix table of 2^bits slots (0: the file's own size): empty, or every slot holding a
    prefix whose home is the first slot (hash 0), each within the probe of it."""
    file = ArraysFile((folder / GAZETTEER).read_bytes(), GAZETTEER_KIND)
    bits = bits or int(file.header["prefix_bits"])
    table_key = np.full(1 << bits, 0 if fill else -1, np.int32)
    return {"prefix_hash": np.zeros(1 << bits, np.uint64), "prefix_key": table_key,
            "prefix_bits": bits, "probe": (1 << bits) - 1 if fill else 0}  # fmt: skip


def _near_of_a_short_key(folder: Path) -> None:
    file = ArraysFile((folder / GAZETTEER).read_bytes(), GAZETTEER_KIND)
    keys = load_snapshot(folder).entities.rated_keys()  # type: ignore[union-attr]
    short = int(np.flatnonzero(keys.lengths() < 7)[0])
    owners = np.array(file.array("near_key", "<i4"))
    owners[0] = short
    rewritten(folder, near_key=owners)


TABLE_ATTACKS = {
    # sized past what the keys allow: every worker would map and check gigabytes
    "a_prefix_table_larger_than_its_keys_allow": lambda f: rewritten(f, **_table_of(f, 24)),
    # every lookup would walk the whole table
    "a_full_prefix_table": lambda f: rewritten(f, **_table_of(f, fill=True)),
    "more_near_keys_than_letters": lambda f: rewritten(
        f, near_hash=np.zeros(1 << 20, np.uint64), near_key=np.zeros(1 << 20, np.int32)
    ),
    "a_near_key_too_short_for_one_edit_matches": _near_of_a_short_key,
    "prefix_key_past_the_keys": lambda f: item_set(f, "prefix_key", 0, 1 << 20),
    "prefix_key_below_empty": lambda f: item_set(f, "prefix_key", 0, (1 << 32) - 7),
    "prefix_before_its_home": lambda f: item_set(f, "prefix_hash", -1, (1 << 64) - 1),
    "probe_over_the_bound": lambda f: tampered(f, "probe", 1 << 20),
    "slots_not_the_table_size": lambda f: tampered(f, "prefix_bits", 30),
    "near_key_past_the_keys": lambda f: item_set(f, "near_key", 0, 1 << 20),
    "near_hashes_unsorted": lambda f: item_set(f, "near_hash", 0, (1 << 64) - 1),
    "near_bitmap_of_another_size": lambda f: tampered(f, "near_shift", 64 - 20),
    "an_even_hash_base": lambda f: tampered(f, "near_base", 2),
    "a_modulus_that_is_text": lambda f: tampered(f, "prefix_mod", "7"),
    "a_modulus_past_63_bits": lambda f: tampered(f, "prefix_mod", 1 << 60),
    "keys_counted_otherwise": lambda f: tampered(f, "keys", 3),
    "of_another_entities_file": lambda f: tampered(f, "entities", "0" * 64),
    "cut_in_half": lambda f: (
        (f / GAZETTEER).write_bytes((f / GAZETTEER).read_bytes()[:700]),
        resign(f, GAZETTEER),
    ),
}


@pytest.mark.parametrize("attack", sorted(TABLE_ATTACKS))
def test_hostile_tables_are_refused_by_name(attack: str, base: Path, tmp_path: Path) -> None:
    """Every offset a lookup reads is checked at load: a tampered gazetteer.bin whose checksum
    matches is CorruptSnapshot naming it, never an IndexError in a turn."""
    folder = tmp_path / attack
    shutil.copytree(base, folder)
    TABLE_ATTACKS[attack](folder)
    with pytest.raises(CorruptSnapshot, match=r"gazetteer\.bin"):
        load_snapshot(folder)


def test_the_keys_memory_bound_is_the_tables_bytes(base: Path) -> None:
    """MAX_GAZETTEER_BYTES bounds the tables' own bytes (hashed, not strings): at least what
    they take for these keys, and not many times more for keys of distinct prefixes."""
    from index import entities

    table = load_snapshot(base).entities
    assert table is not None
    lengths = np.diff(np.asarray(table.keys.parts()[1], dtype=np.int64))
    built = KeyTables.build(table.rated_keys())
    assert built.nbytes <= entities.gazetteer_bytes(lengths)
    distinct = KeyTables.build(
        RatedKeys.of({"x" * 12 + str(i): "N" for i in range(4000)}, {}, frozenset())
    )
    lengths = np.full(4000, 13, dtype=np.int64)
    lengths[:10] = 12
    assert entities.gazetteer_bytes(lengths) <= 4 * distinct.nbytes
