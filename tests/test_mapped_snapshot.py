"""Snapshot format 4 (issue 19, 1): chunks, pages and the lexical index read in place from mapped
files, and a local store that records what it has hashed. The refusals of hostile files are in
tests/test_snapshot_fuzz.py."""

from __future__ import annotations

import dataclasses
import itertools
import os
from collections import Counter
from pathlib import Path

import hnswlib
import numpy as np
import orjson
import pytest

import index.hnsw_file
import index.snapshot
from index.chunker import MAX_CHUNK_BYTES, bounded_metadata
from index.embedders.base import Embedder
from index.errors import CorruptSnapshot
from index.filters import FilterIndex
from index.hnsw_file import CHECKS_VERSION
from index.mapped import ArraysFile
from index.snapshot import (
    CHUNKS,
    DATA_FILES,
    MANIFEST,
    MAX_MANIFEST_BYTES,
    VECTORS,
    load_snapshot,
    read_manifest,
    sha256_file,
)
from index.store import LocalStore, Verified, file_stats
from index.tables import (
    CACHE_BYTES,
    CHUNKS_KIND,
    MAX_CRUMBS,
    MAX_EMBED_BYTES,
    MAX_FIELD_BYTES,
    MAX_META_BYTES,
    MAX_META_STRINGS,
    RUN_PATH_BYTES,
    ChunkTable,
    PageTable,
)
from index.types import Chunk
from sidecar.snapshots.searcher import page_index
from tests.snapshot_kit import (
    KB,
    LEVEL0_LINK_PAST_THE_END,
    TAMPERED,
    flip_a_byte,
    resident_kb,
    version_id,
    write_version,
)

CHUNKS_IN = [
    Chunk(
        chunk_id="c0",
        source="faq",
        source_path="café/menu.md",
        title="Café — menu",
        breadcrumbs=("Café", "Menu", "Drinks ☕"),
        text="Espresso costs 2 €.",
        embed_text="Café > Menu\n\nEspresso costs 2 €.",
        url="https://example.com/café",
        metadata={"lang": "fr", "related_urls": "/menu/*"},
    ),
    Chunk("c1", "docs", "empty.md", "", (), "", "", "", {}),
    Chunk("c2", "faq", "b.md", "B", ("B",), "bee", "B\n\nbee"),
]


def test_chunks_and_pages_read_back_as_written(tmp_path: Path) -> None:
    (tmp_path / "c.bin").write_bytes(ChunkTable.dump(CHUNKS_IN))
    table = ChunkTable.open(tmp_path / "c.bin")
    assert list(table) == CHUNKS_IN
    assert [table[i] for i in (2, 0, -1)] == [CHUNKS_IN[2], CHUNKS_IN[0], CHUNKS_IN[2]]
    assert table[0:2] == CHUNKS_IN[0:2]
    assert table.source_names == ("docs", "faq")
    assert table.source_of.tolist() == [1, 0, 1]
    with pytest.raises(IndexError):
        table[3]
    pages = {"faq:café/menu.md": "Espresso …", "docs:empty.md": "", "faq:b.md": "bee"}
    (tmp_path / "p.bin").write_bytes(PageTable.dump(pages))
    read = PageTable.open(tmp_path / "p.bin")
    assert dict(read) == pages
    assert "faq:b.md" in read
    assert "faq:c.md" not in read
    assert 5 not in read
    with pytest.raises(KeyError):
        read["nope"]


def test_a_column_and_the_heads_read_what_the_decoded_chunks_hold(tmp_path: Path) -> None:
    (tmp_path / "c.bin").write_bytes(ChunkTable.dump(CHUNKS_IN))
    table = ChunkTable.open(tmp_path / "c.bin")
    fields = ("chunk_id", "source_path", "title", "text", "embed_text", "url")
    for field, name in enumerate(fields):
        assert table.column(field) == [getattr(c, name) for c in CHUNKS_IN]
    with pytest.raises(ValueError, match="field must be 0 to 5"):
        table.column(6)  # breadcrumbs and metadata are not fixed fields
    heads = [(c.chunk_id, c.title, c.breadcrumbs) for c in CHUNKS_IN]
    assert [h[:3] for h in table.heads()] == heads
    assert [h[3] for h in table.heads()] == ["Café > Menu", "", "B"]
    assert [table.breadcrumbs(i) for i in range(len(table))] == [c.breadcrumbs for c in CHUNKS_IN]


def test_list_metadata_reads_back_as_a_list_and_strings_as_strings(tmp_path: Path) -> None:
    chunks = [
        Chunk("a", "faq", "a.md", "A", ("A",), "x", "A x", metadata={"tags": ("roaming", "eu")}),
        Chunk("b", "faq", "b.md", "B", (), "y", "y", metadata={"tags": (), "lang": "en"}),
        Chunk("c", "faq", "c.md", "C", (), "z", "z", metadata={"lang": "fr", "tags": ("one",)}),
        Chunk("d", "faq", "d.md", "D", ("D", "E"), "w", "w"),
    ]
    (tmp_path / "c.bin").write_bytes(ChunkTable.dump(chunks))
    table = ChunkTable.open(tmp_path / "c.bin")
    assert list(table) == chunks
    assert table[0].metadata["tags"] == ("roaming", "eu")
    assert table[2].metadata == {"lang": "fr", "tags": ("one",)}
    assert type(table[2].metadata["lang"]) is str
    assert list(table[1].metadata) == ["tags", "lang"]  # the order written


def test_a_small_table_keeps_no_more_decoded_chunks_than_it_has(tmp_path: Path) -> None:
    (tmp_path / "c.bin").write_bytes(ChunkTable.dump(CHUNKS_IN))
    table = ChunkTable.open(tmp_path / "c.bin")
    assert 0 < table.cache_bytes < 4096 < CACHE_BYTES  # three chunks: never 2 MiB of a budget
    assert [table[i] for i in range(3)] == CHUNKS_IN  # all three kept, none evicted
    assert table._cached_bytes <= table.cache_bytes
    assert len(table._cache) == 3


def test_a_changed_text_byte_reads_with_a_replacement_not_an_error(tmp_path: Path) -> None:
    """The checksum is what refuses a changed file; past it, no byte of a text can fail a call."""
    data = bytearray(ChunkTable.dump(CHUNKS_IN))
    at = data.index("☕".encode())
    data[at] = 0xFF  # no longer UTF-8
    (tmp_path / "c.bin").write_bytes(bytes(data))
    chunk = ChunkTable.open(tmp_path / "c.bin")[0]
    assert chunk.breadcrumbs[2].startswith("Drinks \ufffd")
    assert chunk.text == CHUNKS_IN[0].text


BIG = 5_000_000  # bytes of each hostile field: 5 MB in every answer, were it not cut


def _utf8(text: str) -> int:
    return len(text.encode())


def test_a_hostile_chunks_huge_fields_are_cut_as_read_and_its_neighbours_untouched(
    tmp_path: Path,
) -> None:
    """A snapshot (checksummed, so published as it is) with a 5 MB title, URL, breadcrumb,
    embedded text and metadata value, and a thousand breadcrumbs and metadata entries: each
    string is read cut at its cap (at a character: "é" is two bytes), the lists cut in count,
    and the chunks beside it read as written, by ``[i]``, a scan, a column and the heads."""
    huge = "é" * (BIG // 2)
    hostile = Chunk(
        "h", "faq", "h.md", "T" + huge, ("C" + huge, *(f"c{i}" for i in range(1000))),
        "short text", "E" + huge, "https://x/" + huge,
        {"big": "V" + huge, **{f"k{i}": "v" for i in range(1000)}},
    )  # fmt: skip
    (tmp_path / "c.bin").write_bytes(ChunkTable.dump([CHUNKS_IN[0], hostile, CHUNKS_IN[2]]))
    table = ChunkTable.open(tmp_path / "c.bin")
    for chunk in (table[1], next(itertools.islice(table, 1, None))):
        assert chunk.title.startswith("Té")
        assert _utf8(chunk.title) > MAX_FIELD_BYTES - 4
        assert _utf8(chunk.title) <= MAX_FIELD_BYTES
        assert not chunk.title.endswith("\ufffd")
        assert chunk.url.startswith("https://x/é")
        assert _utf8(chunk.url) <= MAX_FIELD_BYTES
        assert MAX_CHUNK_BYTES < _utf8(chunk.embed_text) <= MAX_EMBED_BYTES
        assert len(chunk.breadcrumbs) == MAX_CRUMBS
        assert all(_utf8(crumb) <= MAX_FIELD_BYTES for crumb in chunk.breadcrumbs)
        assert chunk.breadcrumbs[0].startswith("Cé")
        assert chunk.breadcrumbs[1] == "c0"
        assert chunk.text == "short text"
        strings = [k for k in chunk.metadata] + [str(v) for v in chunk.metadata.values()]
        assert 0 < len(strings) <= MAX_META_STRINGS
        assert sum(_utf8(t) for t in strings) <= MAX_META_BYTES  # the 5 MB value is left out
        assert "big" not in chunk.metadata
        assert chunk.metadata["k0"] == "v"
    assert [table[0], table[2]] == [CHUNKS_IN[0], CHUNKS_IN[2]]
    for field in range(6):
        assert all(_utf8(t) <= MAX_EMBED_BYTES for t in table.column(field))
    head = list(table.heads())[1]
    assert _utf8(head[1]) <= MAX_FIELD_BYTES
    assert len(head[2]) == MAX_CRUMBS
    assert next(iter(table.heads()))[1:3] == (CHUNKS_IN[0].title, CHUNKS_IN[0].breadcrumbs)


def test_an_older_builds_entry_over_the_string_cap_is_read_as_the_chunker_writes_it(
    tmp_path: Path,
) -> None:
    """s12's F7: a chunk written with 70 tags before ``lang`` (an older build's) reads as this
    build writes it (``bounded_metadata``): the tags left out, ``lang`` kept."""
    tags = tuple(f"t{i}" for i in range(70))
    metadata = {"tags": tags, "lang": "en", "more": tags, "plan": "all"}
    old = dataclasses.replace(CHUNKS_IN[1], metadata=metadata)
    (tmp_path / "c.bin").write_bytes(ChunkTable.dump([CHUNKS_IN[0], old]))
    table = ChunkTable.open(tmp_path / "c.bin")
    assert table[1].metadata == dict(bounded_metadata(metadata)) == {"lang": "en", "plan": "all"}


def test_an_empty_or_foreign_file_is_refused_by_kind(tmp_path: Path) -> None:
    (tmp_path / "empty").write_bytes(b"")
    with pytest.raises(ValueError, match="empty"):
        ArraysFile.open(tmp_path / "empty", CHUNKS_KIND)
    (tmp_path / "p.bin").write_bytes(PageTable.dump({"a": "b"}))
    with pytest.raises(ValueError, match="another kind"):
        ChunkTable.open(tmp_path / "p.bin")


def test_a_loaded_snapshot_maps_its_files_and_serves_chunks_from_them(
    tmp_path: Path, local_embedder: Embedder
) -> None:
    folder = write_version(tmp_path, version_id(1), local_embedder, "password")
    snapshot = load_snapshot(folder)
    assert isinstance(snapshot.chunks, ChunkTable)
    assert isinstance(snapshot.pages, PageTable)
    assert snapshot.chunks[0].chunk_id.startswith(version_id(1))
    assert snapshot.lexical.search("reset password", 3)
    assert snapshot.memory_bytes >= sum(snapshot.manifest.sizes.values())


def test_a_local_store_records_what_it_hashed(
    tmp_path: Path, local_embedder: Embedder, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Fetched once, hashed once: another store object (the next start, another worker) with
    the same record folder does not hash again, until a file changes."""
    hashed: Counter[str] = Counter()

    def counting(path: Path) -> str:
        hashed[path.name] += 1
        return sha256_file(path)

    root = tmp_path / "store"
    write_version(root, version_id(1), local_embedder)
    monkeypatch.setattr(index.snapshot, "sha256_file", counting)
    verified = tmp_path / "cache" / "verified"
    folder = LocalStore(root, verified_dir=verified).fetch(KB, version_id(1))
    assert hashed == Counter(DATA_FILES)
    hashed.clear()
    assert LocalStore(root, verified_dir=verified).fetch(KB, version_id(1)) == folder
    assert not hashed
    flip_a_byte(folder, CHUNKS)
    with pytest.raises(CorruptSnapshot, match="sha256"):
        LocalStore(root, verified_dir=verified).fetch(KB, version_id(1))


def counting_graph_checks(monkeypatch: pytest.MonkeyPatch) -> Counter[str]:
    """Each graph file ``check_hnsw_file`` reads, counted (the real check still runs)."""
    checked: Counter[str] = Counter()
    real = index.snapshot.check_hnsw_file

    def counting(path: Path, *, count: int, dimension: int, m: int) -> None:
        checked[path.name] += 1
        real(path, count=count, dimension=dimension, m=m)

    monkeypatch.setattr(index.snapshot, "check_hnsw_file", counting)
    return checked


def test_a_fetch_checks_the_graph_once_and_a_load_of_what_it_fetched_trusts_it(
    tmp_path: Path, local_embedder: Embedder, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The graph's layout is checked with the sha256, at fetch, and recorded with it: neither
    the load of the fetched folder nor the next start reads the graph again; a load of a
    folder no store fetched still checks it."""
    checked = counting_graph_checks(monkeypatch)
    root, verified, _, folder = fetched_once(tmp_path, local_embedder)
    assert checked == Counter({VECTORS: 1})
    assert load_snapshot(folder, fetched=True).lexical.search("reset password", 3)
    assert LocalStore(root, verified_dir=verified).fetch(KB, version_id(1)) == folder
    assert checked == Counter({VECTORS: 1})
    load_snapshot(folder, checksums=False)
    assert checked == Counter({VECTORS: 2})


def fetched_once(tmp_path: Path, embedder: Embedder) -> tuple[Path, Path, LocalStore, Path]:
    """A version written and fetched once by a store that records what it verified: the store's
    root, its records' folder, the store and the fetched folder."""
    root = tmp_path / "store"
    write_version(root, version_id(1), embedder)
    verified = tmp_path / "cache" / "verified"
    store = LocalStore(root, verified_dir=verified)
    return root, verified, store, store.fetch(KB, version_id(1))


def test_a_graph_changed_after_its_check_is_checked_again_and_refused(
    tmp_path: Path, local_embedder: Embedder
) -> None:
    """A graph rewritten in place with a manifest re-signed to match (the checksums pass):
    its stats changed, so the store that checked it, and the next start, check it again."""
    root, verified, store, folder = fetched_once(tmp_path, local_embedder)
    TAMPERED["hnsw_entry_point_past_the_end"](folder)
    with pytest.raises(CorruptSnapshot, match="entry point"):
        store.fetch(KB, version_id(1))
    with pytest.raises(CorruptSnapshot, match="entry point"):
        LocalStore(root, verified_dir=verified).fetch(KB, version_id(1))


def test_a_graph_given_its_old_mtime_back_is_checked_again_and_refused(
    tmp_path: Path, local_embedder: Embedder
) -> None:
    """A graph rewritten in place and given its old mtime back (``touch -r``, ``cp -p``,
    ``rsync -t``): same size, mtime and inode, but its ctime moved, so it is checked again."""
    root, verified, _, folder = fetched_once(tmp_path, local_embedder)
    before = {name: (folder / name).stat() for name in (VECTORS, MANIFEST)}
    LEVEL0_LINK_PAST_THE_END(folder)
    for name, st in before.items():
        os.utime(folder / name, ns=(st.st_atime_ns, st.st_mtime_ns))
        assert (folder / name).stat().st_ino == st.st_ino
    with pytest.raises(CorruptSnapshot, match="level-0 link names an element past"):
        LocalStore(root, verified_dir=verified).fetch(KB, version_id(1))


def test_a_load_of_a_fetched_graph_checks_its_header_whatever_the_record_says(
    tmp_path: Path, local_embedder: Embedder
) -> None:
    """A record that matches a graph whose header went bad under it (what a disk's corruption
    of an unchanged-looking file would be): the load refuses it by name before hnswlib reads it
    (hnswlib trusts its header: an entry point past the end crashes the process)."""
    root, verified, store, folder = fetched_once(tmp_path, local_embedder)
    TAMPERED["hnsw_entry_point_past_the_end"](folder)
    store.verified.remember(folder, read_manifest(folder), KB, version_id(1))  # a record that lies
    assert LocalStore(root, verified_dir=verified).fetch(KB, version_id(1)) == folder
    with pytest.raises(CorruptSnapshot, match="entry point"):
        load_snapshot(folder, fetched=True)


def test_rows_of_a_graph_whose_label_went_past_the_end_are_refused_by_name(
    tmp_path: Path, local_embedder: Embedder
) -> None:
    """A label changed under a record that still trusts the file (the load checks the header
    only): the label -> row table refuses it, where it raised IndexError (or, negative, wrapped
    to a wrong row) in the searcher's build."""
    folder = write_version(tmp_path / "store", version_id(1), local_embedder)
    path, count = folder / VECTORS, read_manifest(folder).chunks
    head = index.hnsw_file._Header(path.read_bytes()[: index.hnsw_file.HEADER.size], str(path))
    data = bytearray(path.read_bytes())
    at = index.hnsw_file.HEADER.size + head.label_offset
    data[at : at + 8] = (count + 5).to_bytes(8, "little")
    path.write_bytes(bytes(data))
    with pytest.raises(CorruptSnapshot, match=f"a label is past {count - 1}"):
        index.hnsw_file.vector_rows(path, count=count, dimension=local_embedder.info.dimension)


@pytest.mark.parametrize(
    "checks",
    [None, ["sha256", "hnsw_layout"], ["sha256", f"hnsw_layout:{CHECKS_VERSION - 1}"]],
    ids=["sha256_alone", "layout_unversioned", "older_layout_checks"],
)
def test_a_record_of_fewer_or_older_checks_does_not_pass_a_graph_unchecked(
    checks: list[str] | None, tmp_path: Path, local_embedder: Embedder
) -> None:
    """A record written before fetch checked graphs, or by checks since made stricter
    (``CHECKS_VERSION``), names a lying graph whose checksums match: the folder is verified
    again, and refused."""
    root = tmp_path / "store"
    folder = write_version(root, version_id(1), local_embedder, damage=LEVEL0_LINK_PAST_THE_END)
    verified = tmp_path / "cache" / "verified"
    record = Verified(verified).record(KB, version_id(1))
    assert record is not None
    record.parent.mkdir(parents=True)
    files = [list(s) for s in file_stats(folder, read_manifest(folder))]
    record.write_bytes(
        orjson.dumps({"files": files} if checks is None else {"checks": checks, "files": files})
    )
    with pytest.raises(CorruptSnapshot, match="level-0 link names an element past"):
        LocalStore(root, verified_dir=verified).fetch(KB, version_id(1))


def test_a_store_forgets_in_memory_what_it_verified_of_versions_it_no_longer_keeps(
    tmp_path: Path, local_embedder: Embedder
) -> None:
    root = tmp_path / "store"
    store = LocalStore(root)
    for n in (1, 2, 3):
        write_version(root, version_id(n), local_embedder)
        store.fetch(KB, version_id(n))
    store.retain(KB, [version_id(3)])
    assert list(store.verified._seen) == [(KB, version_id(3))]


def test_a_pointer_or_manifest_that_is_a_fifo_or_huge_is_refused_unread(tmp_path: Path) -> None:
    """A store's LATEST or manifest.json that is a FIFO (a read would wait for a writer for
    ever) or far larger than one can be is refused naming it, after at most its cap + 1 bytes."""
    store = LocalStore(tmp_path)
    base = tmp_path / KB
    base.mkdir()
    os.mkfifo(base / "LATEST")
    with pytest.raises(CorruptSnapshot, match="LATEST is not a regular file"):
        store.latest(KB)
    (base / "LATEST").unlink()
    (base / "LATEST").write_bytes(b"v" * (1 << 20))
    with pytest.raises(CorruptSnapshot, match="LATEST is over 256 bytes"):
        store.latest(KB)
    folder = tmp_path / "v1"
    folder.mkdir()
    os.mkfifo(folder / "manifest.json")
    with pytest.raises(CorruptSnapshot, match="the manifest is not a regular file"):
        read_manifest(folder)
    (folder / "manifest.json").unlink()
    (folder / "manifest.json").write_bytes(b" " * (MAX_MANIFEST_BYTES + 1))
    with pytest.raises(CorruptSnapshot, match=f"the manifest is over {MAX_MANIFEST_BYTES} bytes"):
        read_manifest(folder)


def test_vector_rows_read_each_labels_vector_as_hnswlib_does_and_keep_no_page_of_the_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(index.hnsw_file, "_LABEL_BLOCK", 256)  # several blocks, one partial
    count, dim = 3000, 24
    rng = np.random.default_rng(7)
    vectors = rng.normal(size=(count, dim)).astype(np.float32)
    labels = rng.permutation(count)  # row i holds label labels[i]: rows and labels differ
    graph = hnswlib.Index(space="ip", dim=dim)
    graph.init_index(max_elements=count, M=8, ef_construction=40)
    graph.add_items(vectors, labels, num_threads=1)
    path = tmp_path / "vectors.hnsw"
    graph.save_index(str(path))
    table, rows = index.hnsw_file.vector_rows(path, count=count, dimension=dim)
    resident = resident_kb(path)
    every = np.arange(count)
    assert np.array_equal(rows[labels], every)
    stored = np.asarray(graph.get_items(every, return_type="numpy"), dtype=np.float32)
    assert np.array_equal(table[rows[every]], stored)  # each label's vector, as hnswlib has it
    if resident is None:
        pytest.skip("no /proc/self/smaps: resident pages are not visible here")
    assert resident == 0  # every label was read, and none of the file's pages kept for it
    assert (resident_kb(path) or 0) > 0  # the vectors just read were mapped: the check sees it


def test_page_runs_key_each_page_by_its_first_chunk_wherever_its_chunks_lie(
    tmp_path: Path,
) -> None:
    long = "deep/" * 110 + "page.md"  # over RUN_PATH_BYTES: a run a chunk, still one page
    assert len(long) > RUN_PATH_BYTES
    layout = [("docs", "a.md")] * 3 + [("docs", "b.md"), ("docs", "a.md")]  # a.md apart
    layout += [("faq", "a.md")] * 2 + [("faq", "a.me")]  # a.me: a.md's length, not its bytes
    layout += [("docs", long)] * 2 + [("docs", "")] * 2
    layout += [("docs", "z.md"), ("docs", "y.md"), ("docs", "y.md")]  # the last: at the blob's end
    chunks = [
        Chunk(f"c{i}", s, p, "T", (), f"text {i}", f"text {i}") for i, (s, p) in enumerate(layout)
    ]
    chunks[-2:] = [Chunk(f"c{i}", "docs", "y.md", "", (), "", "") for i in (13, 14)]
    (tmp_path / "c.bin").write_bytes(ChunkTable.dump(chunks))
    table = ChunkTable.open(tmp_path / "c.bin")
    bounds, keys = table.page_runs()
    assert bounds.tolist() == [0, 3, 4, 5, 7, 8, 9, 10, 12, 13, 15]
    assert keys == [layout[i] for i in bounds[:-1]]
    pages = page_index(table)
    assert pages == page_index(chunks)
    assert pages == {
        ("docs", "a.md"): 0, ("docs", "b.md"): 3, ("faq", "a.md"): 5, ("faq", "a.me"): 7,
        ("docs", long): 8, ("docs", ""): 10, ("docs", "z.md"): 12, ("docs", "y.md"): 13,
    }  # fmt: skip
    mapped, decoded = FilterIndex({}, table), FilterIndex({}, chunks)
    assert mapped.paths == decoded.paths == sorted({p for _, p in layout})
    for path in mapped.paths:
        assert mapped.page_labels(path).tolist() == decoded.page_labels(path).tolist()
    assert mapped.page_labels("a.md").tolist() == [0, 1, 2, 4, 5, 6]
    assert mapped.page_labels("nowhere.md").size == 0
