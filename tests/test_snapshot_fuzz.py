"""The snapshot loader against files whose checksums match but whose content lies (issue 14, 1-3).

hnswlib trusts its file, so the attacks that crashed it run in a child process here: the same
bytes crash a bare ``hnswlib.load_index`` + query there, and are a ``CorruptSnapshot`` from the
loader. The fuzz run is seeded and short; ``python -m bench fuzz_snapshot --seconds 300`` is the
long one.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import hnswlib
import numpy as np
import orjson
import pytest

import index.snapshot
from bench.fuzz_snapshot import INFO, Worker, answered, fuzz, write_seed
from index.errors import CorruptSnapshot, IncompatibleSnapshot
from index.filters import FILTERS, max_filters_bytes
from index.lexical import LexicalIndex
from index.snapshot import VECTORS, load_snapshot
from index.tables import MAX_META_STRINGS
from sidecar.snapshots.searcher import Searcher
from tests.snapshot_kit import TAMPERED, resign

RAW_HNSWLIB = """
import sys, hnswlib, numpy as np
index = hnswlib.Index(space="ip", dim=16)
index.load_index(sys.argv[1], max_elements=400)
index.set_ef(32)
index.knn_query(np.ones((1, 16), dtype=np.float32), k=3)
print("survived")
"""


@pytest.fixture(scope="module")
def seed(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_seed(tmp_path_factory.mktemp("fuzz") / "seed")


def tampered(seed: Path, tmp_path: Path, attack: str) -> Path:
    folder = tmp_path / attack
    shutil.copytree(seed, folder)
    TAMPERED[attack](folder)
    return folder


@pytest.mark.parametrize("attack", ["hnsw_entry_point_past_the_end", "hnsw_top_level_2_30"])
def test_the_hnsw_attacks_crash_hnswlib_but_the_loader_refuses_them(
    attack: str, seed: Path, tmp_path: Path
) -> None:
    folder = tampered(seed, tmp_path, attack)
    bare = subprocess.run(
        [sys.executable, "-c", RAW_HNSWLIB, str(folder / VECTORS)], capture_output=True, timeout=60
    )
    assert bare.returncode < 0, "hnswlib survived the attack: it no longer reproduces"
    runner = Worker()
    try:
        assert runner.load(folder) == {"outcome": "refused", "error": "CorruptSnapshot"}
    finally:
        runner.close()


def test_an_entry_point_linked_to_none_fails_hnswlibs_searches_but_the_loader_refuses_it(
    seed: Path, tmp_path: Path
) -> None:
    """s12's F5: a layout every earlier check passed; hnswlib itself raises for a share of
    searches (found fewer than k), so it reached callers as UNKNOWN until the load refused it."""
    folder = tampered(seed, tmp_path, "hnsw_entry_point_linked_to_none")
    graph = hnswlib.Index(space="ip", dim=INFO.dimension)
    graph.load_index(str(folder / VECTORS), max_elements=400)
    graph.set_ef(32)
    queries = np.random.default_rng(0).standard_normal((300, INFO.dimension)).astype(np.float32)
    failed = 0
    for query in queries:
        try:
            graph.knn_query(query[None, :], k=3)
        except RuntimeError:
            failed += 1
    assert failed > 0, "hnswlib answered every search: the attack no longer reproduces"
    with pytest.raises(CorruptSnapshot, match=r"vectors.hnsw: element \d+ links to no other"):
        load_snapshot(folder, INFO)


@pytest.mark.parametrize("attack", sorted(TAMPERED))
def test_every_tampered_file_is_a_corrupt_snapshot_naming_the_file(
    attack: str, seed: Path, tmp_path: Path
) -> None:
    folder = tampered(seed, tmp_path, attack)
    with pytest.raises(CorruptSnapshot) as refused:
        load_snapshot(folder, INFO)
    name = {
        "hnsw": "vectors.hnsw",
        "pages": "pages.bin",
        "chunk": "chunks.bin",
        "gazetteer": "gazetteer.bin",
    }
    assert name.get(attack.split("_")[0], "lexical.bin") in str(refused.value)


@pytest.mark.parametrize(
    ("field", "value"),
    [
        (("counts", "chunks"), "400"),
        (("embedder", "dimension"), True),
        (("hnsw", "ef"), -1),
        (("hnsw", "m"), 1 << 20),
        (("files",), [1]),
        (("sizes", "vectors.hnsw"), "big"),
        (("sources",), 5),
    ],
)
def test_a_manifest_field_of_the_wrong_type_is_refused_by_name(
    field: tuple[str, ...], value: object, seed: Path, tmp_path: Path
) -> None:
    folder = tmp_path / "v"
    shutil.copytree(seed, folder)
    manifest = json.loads((folder / "manifest.json").read_text())
    target = manifest
    for key in field[:-1]:
        target = target[key]
    target[field[-1]] = value
    (folder / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(CorruptSnapshot) as refused:
        load_snapshot(folder, INFO)
    assert repr(field[0]) in str(refused.value) or repr(field[-1]) in str(refused.value)


def test_the_harness_counts_a_signal_death_as_a_crash(tmp_path: Path) -> None:
    dies = "import os, signal, sys; sys.stdin.readline(); os.kill(os.getpid(), signal.SIGSEGV)"
    runner = Worker([sys.executable, "-c", dies])
    try:
        assert runner.load(tmp_path) == {"outcome": "crash", "signal": 11}
    finally:
        runner.close()


def test_a_seeded_fuzz_run_finds_no_crash_no_hang_and_no_unnamed_error(tmp_path: Path) -> None:
    """Every file of the folder is mutated, the extra files a build adds too; each case is
    loaded, warmed and answered from (searches and turns) in a child process."""
    result = fuzz(seed=14, cases=300, work=tmp_path).as_dict()
    assert result["failures"] == []
    assert (result["crashes"], result["hangs"], result["bugs"]) == (0, 0, 0)
    assert result["cases"] == 300
    assert set(result["by_file"]) == {
        "manifest.json",
        "vectors.hnsw",
        "chunks.bin",
        "pages.bin",
        "lexical.bin",
        "entities.bin",
        "gazetteer.bin",
        "filters.json",
        "summaries.hnsw",
        "summaries.json",
        "originals.json",
    }
    # the mutations reach past the checksums: most are refused, some still load
    assert result["outcomes"]["refused"] > 150
    assert result["outcomes"]["ok"] > 0
    assert result["outcomes"]["degraded"] == 0  # no graph the load passes fails a search


def test_a_format_2_snapshot_is_incompatible_not_corrupt(seed: Path, tmp_path: Path) -> None:
    """Format 3 added the files' sizes: an older snapshot asks for a rebuild."""
    folder = tmp_path / "v2"
    shutil.copytree(seed, folder)
    manifest = json.loads((folder / "manifest.json").read_text())
    manifest["format_version"] = 2
    del manifest["sizes"]
    (folder / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(IncompatibleSnapshot, match="format version 2"):
        load_snapshot(folder, INFO)


def test_a_format_3_snapshot_is_refused_with_the_rebuild_command(
    seed: Path, tmp_path: Path
) -> None:
    """Format 4 maps what format 3 parsed: a format 3 folder is incompatible, not corrupt."""
    folder = tmp_path / "v3"
    shutil.copytree(seed, folder)
    manifest = json.loads((folder / "manifest.json").read_text())
    manifest["format_version"] = 3
    (folder / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(IncompatibleSnapshot, match=r"format version 3.*voxrecall index build"):
        load_snapshot(folder, INFO)


def test_an_arrays_header_naming_an_array_past_the_end_is_a_value_error() -> None:
    """The header of a mapped file is checked against the file's size before numpy maps it."""
    data = LexicalIndex.build(["roaming costs", "reset the password"]).to_bytes()
    end = 12 + int.from_bytes(data[8:12], "little")
    spec = json.loads(data[12:end])
    spec["arrays"]["doc_ids"]["length"] = 1 << 40
    header = json.dumps(spec).encode()
    prefix = data[:8] + len(header).to_bytes(4, "little") + header
    garbled = prefix + b"\0" * (-len(prefix) % 64) + data[end + (-end % 64) :]
    with pytest.raises(ValueError, match=r"doc_ids.*outside the file"):
        LexicalIndex.from_bytes(garbled)


def with_filters(seed: Path, tmp_path: Path, data: bytes) -> Path:
    """The seed with ``data`` as its filters.json, re-signed (as a store's writer could)."""
    folder = tmp_path / "filtered"
    shutil.copytree(seed, folder)
    (folder / FILTERS).write_bytes(data)
    resign(folder, FILTERS)
    return folder


def test_a_filters_file_larger_than_a_build_writes_is_refused_unparsed(
    seed: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """s12's F6: 15.6 MB took 13 s and 371 MB to load; the cap, from the manifest's sizes, is
    checked once, as the file is read (no more than the cap and a byte: never parsed)."""
    cap = max_filters_bytes(400, (seed / "chunks.bin").stat().st_size)
    folder = with_filters(seed, tmp_path, b'{"fields": {}}' + b" " * cap)
    monkeypatch.setattr(index.snapshot, "read_filters", lambda *_: pytest.fail("parsed"))
    with pytest.raises(
        CorruptSnapshot, match=rf"filters.json: the filters of 400 chunks is over {cap} bytes"
    ):
        load_snapshot(folder, INFO)


def test_more_filter_values_than_the_chunks_metadata_holds_are_refused_by_name(
    seed: Path, tmp_path: Path
) -> None:
    """Within the byte cap, 400 chunks x 64 metadata strings + 1 values of one label each."""
    values = {f"v{i}": [i % 400] for i in range(400 * MAX_META_STRINGS + 1)}
    folder = with_filters(seed, tmp_path, orjson.dumps({"fields": {"lang": values}}))
    with pytest.raises(CorruptSnapshot, match=r"filters.json: 25601 values .* over 25600"):
        load_snapshot(folder, INFO)


def test_a_filters_file_within_the_caps_loads(seed: Path, tmp_path: Path) -> None:
    values = {f"v{i}": list(range(i, 400, 64)) for i in range(64)}
    folder = with_filters(seed, tmp_path, orjson.dumps({"fields": {"lang": values}}))
    assert load_snapshot(folder, INFO).filters.n == 400


class _Broken:
    """A graph whose every search raises ``error`` (hnswlib's RuntimeError: it found fewer than
    asked for; anything else: what no layer names)."""

    def __init__(self, error: Exception) -> None:
        self.error = error

    def knn_query(self, *_: object, **__: object) -> None:
        raise self.error


def test_the_worker_answers_from_a_loaded_case_and_reports_a_late_failure(seed: Path) -> None:
    """The loader's checks and warm-up let s12's F5 through: the worker now answers searches
    and turns from each case, so an error escaping at answer time is a bug, named "late"."""
    searcher = Searcher.build(load_snapshot(seed, INFO))
    assert answered(searcher) == {"outcome": "ok"}
    searcher.snapshot.index = _Broken(RuntimeError("Cannot return the results"))  # type: ignore[assignment]
    assert answered(searcher) == {"outcome": "degraded"}  # named, answered lexically
    searcher.snapshot.index = _Broken(ValueError("a late failure"))  # type: ignore[assignment]
    late = answered(searcher)
    assert late["outcome"] == "bug"
    assert late["error"].startswith("late: ValueError: a late failure")
