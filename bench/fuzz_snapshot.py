"""Fuzz the snapshot loader with mutated real snapshot files, in child processes that may crash.

``python -m bench fuzz_snapshot --seconds 300`` (or ``python -m bench.fuzz_snapshot``) writes a
real snapshot (``write_snapshot``: 400 chunks in three sources, a 16-d hnswlib graph, pages, the
BM25 index, and the files a build adds: ``filters.json``, the summary view's ``summaries.hnsw``
and ``summaries.json``, ``originals.json``), then, case after case, copies it, mutates one of its files (bit flips, bytes and
integers set to edge values, cuts, splices; JSON values swapped for another type in the
manifest; one element of a named array set to an edge value in the mapped files; for
the graphs also header fields and links) and re-signs the manifest with the mutated file's
sha256 and size, as someone able to write to the store would. A worker process loads each case
the way the sidecar does (``load_snapshot``, the refresher's ``warm_up``, ``Searcher.build``),
then answers through a real ``Engine`` (``answer``: a search, a search by a vector, a sourced
and a filtered search, turns, lexically too): what a load lets through and fails later (s12's
F5: a graph that failed a share of searches with UNKNOWN) is found. One line per case:

    ok         the mutation left a snapshot that loads and answers (a named error at answer
               time, ``VoxrecallError``, is a status the caller reads: ok)
    degraded   it loads, then a graph could not answer a search (``GraphSearchFailed``: named,
               answered lexically or INTERNAL): a check the load could add, not a failure
    refused    a named SnapshotError (CorruptSnapshot, IncompatibleSnapshot): what must happen
    bug        any other exception, at load or at answer time ("late: ...")
    crash      the worker died by a signal (hnswlib read memory it should not): restarted
    hang       no answer within HANG_S: killed and restarted

A run passes with 0 crashes, 0 hangs and 0 bugs. ``tests/test_snapshot_fuzz.py`` runs a short,
seeded run in CI.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import random
import shutil
import subprocess
import sys
import tempfile
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import orjson

from bench.report import plain
from index.embedders.base import EmbedderInfo
from index.enrich import ORIGINALS, originals_writer, summary_writer
from index.filters import FILTERS
from index.hnsw_file import HEADER
from index.mapped import MAGIC
from index.snapshot import (
    CHUNKS,
    DATA_FILES,
    ENTITIES,
    LEXICAL,
    MANIFEST,
    PAGES,
    VECTORS,
    sha256_file,
)
from index.snapshot import write_snapshot as _write_snapshot
from index.summaries import SUMMARY_TEXTS, SUMMARY_VECTORS
from index.types import Chunk

if TYPE_CHECKING:
    from sidecar.snapshots.searcher import Searcher

INFO = EmbedderInfo(name="fuzz-16", dimension=16)
CHUNK_COUNT = 400  # enough for every hnsw level-1 list and a few level-2 ones at M = 6
# seeded vectors each case searches by alone (the graph's own answer, no fallback): a graph
# whose search stops short at one element failed ~6% of random searches (s12's F5), so 64
# find it ~98% of the time
VECTORS_SEARCHED = 64
HANG_S = 20.0  # a tiny snapshot loads in milliseconds; this long is a loop, not a slow disk
# every outcome a case can have (the docstring's table), each counted in the JSON even at 0: a
# run's "0 crashes" is read, not inferred from a missing key
OUTCOMES = ("ok", "degraded", "refused", "bug", "crash", "hang")
EXTRA_FILES = (FILTERS, SUMMARY_VECTORS, SUMMARY_TEXTS, ORIGINALS)  # the seed's, beside DATA_FILES
FILES = (MANIFEST, *DATA_FILES, *EXTRA_FILES)
# 64-bit and 32-bit values that break code trusting a length, a count or an id
EDGE_INTS = (0, 1, 2, 7, 255, 0xFFFF, 0x7FFFFFFF, 0xFFFFFF00, 0xFFFFFFFF, 100_000, 1 << 40)
EDGE_JSON: tuple[Any, ...] = (None, True, 5, -1, 1.5, 1e308, "x", "", [], [1, 2], {}, {"n": 5})


def write_seed(folder: Path) -> Path:
    """The snapshot every case mutates: real files from the real writer."""
    rng = np.random.default_rng(3)
    vectors = rng.normal(size=(CHUNK_COUNT, INFO.dimension)).astype(np.float32)
    vectors /= np.linalg.norm(vectors, axis=1, keepdims=True)
    chunks = [
        Chunk(
            chunk_id=f"c{i}",
            source=f"src{i % 3}",
            source_path=f"page{i // 4}.md",
            title=f"Page {i // 4}",
            breadcrumbs=(f"Page {i // 4}", f"Part {i % 4}"),
            text=f"roaming password invoice number {i} of the fuzz corpus",
            embed_text=f"Page {i // 4} > Part {i % 4}\nroaming password invoice {i}",
            url=f"https://example.com/page{i // 4}",
            metadata={"lang": "en", "tier": f"t{i % 7}"},
        )
        for i in range(CHUNK_COUNT)
    ]
    pages = {f"src{i % 3}:page{i // 4}.md": f"page {i // 4} text" for i in range(CHUNK_COUNT)}
    summaries = summary_writer([c.embed_text for c in chunks], vectors[::-1].copy(), 6, 40)
    originals = originals_writer({key: f"{text} before clean-up" for key, text in pages.items()})
    _write_snapshot(
        folder,
        knowledge_base="fuzz",
        version="v1",
        embedder=INFO,
        chunks=chunks,
        vectors=vectors,
        pages=pages,
        page_count=len(pages),
        hnsw_m=6,
        hnsw_ef_construction=40,
        target_recall=0.9,
        sources=["src0", "src1", "src2"],
        extra={"summaries": "heading"},
        more_files=lambda f: [*summaries(f), *originals(f)],
        filterable=("lang", "tier"),
    )
    return folder


# -- mutations ------------------------------------------------------------------------------


def _flip(data: bytearray, rng: random.Random) -> str:
    for _ in range(rng.randint(1, 8)):
        data[rng.randrange(len(data))] ^= 1 << rng.randrange(8)
    return "flip"


def _edge_byte(data: bytearray, rng: random.Random) -> str:
    data[rng.randrange(len(data))] = rng.choice((0, 1, 0x7F, 0x80, 0xFF))
    return "edge_byte"


def _edge_int(data: bytearray, rng: random.Random) -> str:
    width = rng.choice((4, 8))
    at = rng.randrange(max(1, len(data) - width))
    data[at : at + width] = (rng.choice(EDGE_INTS) % (1 << (8 * width))).to_bytes(width, "little")
    return f"edge_int{width * 8}"


def _cut(data: bytearray, rng: random.Random) -> str:
    del data[rng.randrange(len(data)) :]
    return "cut"


def _splice(data: bytearray, rng: random.Random) -> str:
    a = rng.randrange(len(data))
    b = min(len(data), a + rng.randint(1, 256))
    if rng.random() < 0.5:
        del data[a:b]
        return "delete"
    data[a:a] = data[a:b] if rng.random() < 0.5 else rng.randbytes(b - a)
    return "insert"


def _hnsw_field(data: bytearray, rng: random.Random) -> str:
    """One header field of vectors.hnsw set to an edge value (the attacks of issue 14)."""
    offsets = [0, 8, 16, 24, 32, 40, 48, 52, 56, 64, 72, 80, 88]
    widths = [8, 8, 8, 8, 8, 8, 4, 4, 8, 8, 8, 8, 8]
    k = rng.randrange(len(offsets))
    at, width = offsets[k], widths[k]
    data[at : at + width] = (rng.choice(EDGE_INTS) % (1 << (8 * width))).to_bytes(width, "little")
    return f"hnsw_header@{at}"


def _hnsw_link(data: bytearray, rng: random.Random) -> str:
    """A level-0 link count or neighbour id of one element set to an edge value."""
    (_, _, count, per_element, *_rest) = HEADER.unpack_from(data)
    if not 0 < count <= CHUNK_COUNT or per_element > len(data):
        return _flip(data, rng)
    at = HEADER.size + rng.randrange(count) * per_element + 4 * rng.randrange(13)
    data[at : at + 4] = (rng.choice(EDGE_INTS) & 0xFFFFFFFF).to_bytes(4, "little")
    return "hnsw_link"


def _json_value(data: bytearray, rng: random.Random) -> str:
    """One value somewhere in a JSON document (or one JSON line) replaced by another type."""
    lines = bytes(data).split(b"\n")
    row = rng.randrange(len(lines))
    try:
        doc = orjson.loads(lines[row])
    except orjson.JSONDecodeError:
        return _flip(data, rng)
    doc = _swap_value(doc, rng)
    lines[row] = orjson.dumps(doc)
    data[:] = b"\n".join(lines)
    return "json_value"


def array_slots(data: bytes) -> dict[str, tuple[int, int, int]]:
    """Where each array of an arrays file (``index/mapped.py``) lies: name -> (start, item
    width, length), read from its header as the writer laid it out."""
    start = len(MAGIC) + 4
    head_len = int.from_bytes(data[len(MAGIC) : start], "little")
    header = orjson.loads(data[start : start + head_len])
    base = start + head_len + (-(start + head_len) % 64)
    return {
        name: (base + spec["offset"], np.dtype(spec["dtype"]).itemsize, spec["length"])
        for name, spec in header["arrays"].items()
    }


def set_item(data: bytearray, slot: tuple[int, int, int], i: int, value: int) -> None:
    start, width, _ = slot
    at = start + i * width
    data[at : at + width] = (value % (1 << (8 * width))).to_bytes(width, "little")


def _array_value(data: bytearray, rng: random.Random) -> str:
    """One element of one array of a mapped file set to an edge value: an offset, a count, a
    doc id, a source index."""
    try:
        slots = array_slots(bytes(data))
    except (ValueError, KeyError, TypeError):
        return _flip(data, rng)
    name = rng.choice(sorted(slots))
    if not slots[name][2]:
        return _flip(data, rng)
    set_item(data, slots[name], rng.randrange(slots[name][2]), rng.choice(EDGE_INTS))
    return f"array:{name}"


def _swap_value(doc: Any, rng: random.Random) -> Any:
    if rng.random() < 0.3 or not isinstance(doc, dict | list) or not doc:
        return rng.choice(EDGE_JSON)
    if isinstance(doc, dict):
        key = rng.choice(list(doc))
        doc[key] = _swap_value(doc[key], rng)
    else:
        i = rng.randrange(len(doc))
        doc[i] = _swap_value(doc[i], rng)
    return doc


MUTATIONS = {
    "bytes": (_flip, _edge_byte, _edge_int, _cut, _splice),
    VECTORS: (_hnsw_field, _hnsw_field, _hnsw_link, _hnsw_link),
    SUMMARY_VECTORS: (_hnsw_field, _hnsw_link, _hnsw_link),
    FILTERS: (_json_value, _json_value),
    SUMMARY_TEXTS: (_json_value,),
    ORIGINALS: (_json_value,),
    CHUNKS: (_array_value, _array_value),
    PAGES: (_array_value,),
    LEXICAL: (_array_value,),
    ENTITIES: (_array_value,),
    MANIFEST: (_json_value, _json_value),
}


def mutate(folder: Path, rng: random.Random) -> str:
    """Mutate one file of ``folder`` in place and re-sign the manifest; names what was done."""
    name = rng.choice(FILES)
    path = folder / name
    data = bytearray(path.read_bytes())
    choices = MUTATIONS["bytes"] + MUTATIONS.get(name, ())
    what = rng.choice(choices)(data, rng) if data else "empty"
    path.write_bytes(bytes(data))
    if name != MANIFEST:
        _resign(folder, name)
    return f"{name}:{what}"


def _resign(folder: Path, name: str) -> None:
    manifest = orjson.loads((folder / MANIFEST).read_bytes())
    manifest["files"][name] = sha256_file(folder / name)
    manifest["sizes"][name] = (folder / name).stat().st_size
    (folder / MANIFEST).write_bytes(orjson.dumps(manifest))


# -- the worker ----------------------------------------------------------------------------


def worker() -> None:
    """Load each folder named on stdin as the sidecar would, then answer from it; one JSON line
    per folder."""
    from index.errors import SnapshotError
    from index.snapshot import load_snapshot
    from sidecar.snapshots.refresh import warm_up
    from sidecar.snapshots.searcher import Searcher

    for line in sys.stdin:
        folder = Path(line.strip())
        try:
            snapshot = load_snapshot(folder, INFO)
            warm_up(snapshot)
            searcher = Searcher.build(snapshot)
        except SnapshotError as exc:
            outcome = {"outcome": "refused", "error": type(exc).__name__}
        except Exception as exc:  # what the harness is here to find
            outcome = {"outcome": "bug", "error": f"{type(exc).__name__}: {exc}"[:300]}
        else:
            outcome = answered(searcher)
        sys.stdout.write(json.dumps(outcome) + "\n")
        sys.stdout.flush()


def answered(searcher: Searcher) -> dict[str, Any]:
    """``answer`` over a loaded case: "ok"; "degraded" when a graph could not answer a search
    (named, answered lexically: a check the load could add); or a "bug" naming what escaped."""
    import asyncio

    from index.errors import VoxrecallError

    try:
        failures = asyncio.run(answer(searcher))
    except VoxrecallError:  # a named status a caller reads (a base renamed: NOT_FOUND, ...)
        return {"outcome": "ok"}
    except Exception as exc:
        return {"outcome": "bug", "error": f"late: {type(exc).__name__}: {exc}"[:300]}
    return {"outcome": "degraded" if failures else "ok"}


async def answer(searcher: Searcher) -> int:
    """What a caller reaches, through a real Engine over ``searcher``: searches (plain, by
    source, by filter, by VECTORS_SEARCHED seeded vectors alone), turns naming pages and
    pointing back; with the embedder up, then failing (the lexical fallback). Returns the
    searches the graph could not answer (``GraphSearchFailed``, a named status)."""
    from dataclasses import replace

    from index.embedders.base import FakeEmbedder
    from index.errors import VoxrecallError
    from index.types import MetadataFilter
    from sidecar.config import SidecarConfig
    from sidecar.snapshots.holder import SnapshotHolder
    from sidecar.turn.engine import Engine, SearchInput, TurnInput
    from sidecar.turn.sessions import SessionStore

    tier = (MetadataFilter(field="tier", any_of=("t3",)),)
    searches = [
        SearchInput(query="roaming password invoice"),
        SearchInput(query="invoice number 7", sources=("src1",)),
        SearchInput(query="invoice", filters=tier),
    ]
    vectors = np.random.default_rng(5).normal(size=(VECTORS_SEARCHED, INFO.dimension))
    by_vector = [SearchInput(query="", vector=v.astype(np.float32).tobytes()) for v in vectors]
    failures = 0
    for fail in (False, True):
        holder = SnapshotHolder()
        holder.publish(searcher)
        engine = Engine(
            replace(SidecarConfig(), budget_ms=2000, min_score=0.0),
            FakeEmbedder(dimension=INFO.dimension, name=INFO.name, fail=fail),
            holder,
            frozenset({"fuzz"}),
            SessionStore(max_sessions=8, ttl_s=60, context_turns=3),
            default_knowledge_base="fuzz",
        )
        try:
            for search in [*searches, *(by_vector if not fail else ())]:
                # a named status (a filter on a field the case lost, GraphSearchFailed for a
                # vector alone: counted below): the caller reads it, the next search is tried
                with contextlib.suppress(VoxrecallError):
                    await engine.search(search)
            for text in ("Tell me about Page 3.", "What about its invoice?", "And page 12?"):
                with contextlib.suppress(VoxrecallError):  # named, as a search's: the next runs
                    await engine.turn(TurnInput(session_id="fuzz", text=text, speaker="user"))
        finally:
            await engine.aclose()
        failures += engine.counters.graph_failures
    return failures


class Worker:
    """A child process loading cases; ``argv`` replaces the command (tests start one that dies)."""

    def __init__(self, argv: list[str] | None = None) -> None:
        self.proc = subprocess.Popen(
            argv or [sys.executable, "-m", "bench.fuzz_snapshot", "--worker"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            text=True,
        )

    def load(self, folder: Path) -> dict[str, Any]:
        assert self.proc.stdin is not None
        try:
            self.proc.stdin.write(f"{folder}\n")
            self.proc.stdin.flush()
        except BrokenPipeError:
            pass
        line = _readline(self.proc, HANG_S)
        if line:
            result: dict[str, Any] = json.loads(line)
            return result
        if line is None:  # silent: a loop
            self.proc.kill()
            self.proc.wait()
            return {"outcome": "hang"}
        code = self.proc.wait(HANG_S)  # its output ended: it is exiting
        if code < 0:
            return {"outcome": "crash", "signal": -code}
        return {"outcome": "bug", "error": f"the worker exited with status {code}"}

    def close(self) -> None:
        if self.proc.stdin is not None:
            self.proc.stdin.close()
        try:
            self.proc.wait(HANG_S)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        if self.proc.stdout is not None:
            self.proc.stdout.close()


def _readline(proc: subprocess.Popen[str], timeout: float) -> str | None:
    """One line of the worker's answer; "" when its output ended, None after ``timeout`` of
    silence."""
    import selectors

    assert proc.stdout is not None
    with selectors.DefaultSelector() as sel:
        sel.register(proc.stdout, selectors.EVENT_READ)
        if not sel.select(timeout):
            return None
    return proc.stdout.readline()


@dataclass
class FuzzResult:
    cases: int = 0
    outcomes: Counter[str] = field(default_factory=Counter)
    by_file: dict[str, Counter[str]] = field(default_factory=dict)
    failures: list[dict[str, Any]] = field(default_factory=list)  # crash, hang, bug: with repro

    def as_dict(self) -> dict[str, Any]:
        return {
            "cases": self.cases,
            "outcomes": {name: self.outcomes[name] for name in OUTCOMES},
            "by_file": {k: dict(v) for k, v in sorted(self.by_file.items())},
            "crashes": self.outcomes["crash"],
            "hangs": self.outcomes["hang"],
            "bugs": self.outcomes["bug"],
            "failures": self.failures[:20],
        }


def fuzz(
    *, seed: int, cases: int = 0, seconds: float = 0.0, work: Path | None = None
) -> FuzzResult:
    """Run ``cases`` cases (or as many as fit in ``seconds``) from ``seed``."""
    rng = random.Random(seed)
    result = FuzzResult()
    with tempfile.TemporaryDirectory(dir=work) as tmp:
        seed_folder = write_seed(Path(tmp) / "seed")
        case = Path(tmp) / "case"
        runner = Worker()
        stop_at = time.monotonic() + seconds
        try:
            while (cases and result.cases < cases) or (seconds and time.monotonic() < stop_at):
                shutil.rmtree(case, ignore_errors=True)
                shutil.copytree(seed_folder, case)
                case_seed = rng.getrandbits(32)
                what = mutate(case, random.Random(case_seed))
                answer = runner.load(case)
                outcome = answer["outcome"]
                result.cases += 1
                result.outcomes[outcome] += 1
                result.by_file.setdefault(what.split(":")[0], Counter())[outcome] += 1
                if outcome in ("crash", "hang", "bug"):
                    result.failures.append({"case_seed": case_seed, "mutation": what, **answer})
                if outcome in ("crash", "hang"):
                    runner = Worker()
        finally:
            runner.close()
    return result


def run(quick: bool, seconds: float = 300.0, seed: int = 14) -> dict[str, Any]:
    """The bench entry point: ``seconds`` of cases (30 in quick mode)."""
    result = fuzz(seed=seed, seconds=30.0 if quick else seconds).as_dict()
    return {"suite": "fuzz_snapshot", "seed": seed, "seconds": 30.0 if quick else seconds, **result}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m bench.fuzz_snapshot", description=plain(__doc__)
    )
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--seconds", type=float, default=300.0, help="how long (default 300)")
    parser.add_argument("--seed", type=int, default=14, help="the cases' seed (default 14)")
    args = parser.parse_args(argv)
    if args.worker:
        worker()
        return 0
    result = run(False, seconds=args.seconds, seed=args.seed)
    print(json.dumps(result, indent=2))
    return 1 if result["crashes"] or result["hangs"] or result["bugs"] else 0


if __name__ == "__main__":
    sys.exit(main())
