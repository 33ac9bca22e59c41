"""What a build holds at its peak against what ``max_text_bytes`` counts: ``python -m
bench.build_memory``.

Builds one base of about 30,000 chunks of English Markdown (``--chunks``) with the hash embedder (no
model runs), as ``voxrecall index build`` does: sources, chunker, embedding, every snapshot file.
The pages are written once, seeded, from sentences of real English: SciFact's abstracts and the two
Markdown doc sets of the evaluation data when present, else the repository's own docs (README.md,
ARCHITECTURE.md, docs/, examples/), each page a title, a few ``##`` sections and paragraphs of
sentences drawn at random, so no two chunks are the same.

Each build runs in a child process of its own, twice: once for its peak RSS growth (VmHWM less
the RSS after the imports, the pages already on disk; VmHWM is read and reset at each stage's
start and end, which gives each stage's own RSS peak), once under tracemalloc
(which slows the build several times over) for the biggest holders by file:line, taken at the
end of each stage of the build (loading, chunking, embedding, each snapshot file) while the
stage's result is still held; the largest of those snapshots is reported beside tracemalloc's
own peak. Reports the pages' bytes as ``PageBytes`` counts them (what ``max_text_bytes``
bounds), the peak growth, and their ratio: the factor docs/config.md quotes. Writes
``bench/results/build_memory.json`` (``--out``); ``--keep DIR`` keeps the built store, and
``--compare A B`` says of two kept stores, file by file, whether they hold the same snapshot: the
same bytes, or for ``vectors.hnsw`` the same vector under every label (hnswlib inserts on every
core, so its links differ between any two builds) and for ``gazetteer.bin`` the same bytes under
the same hash seeds (a build draws them at random); and of the manifests, whether their counts,
embedder, sources, extra fields and file names are the same, and their ``hnsw`` (the ef chosen
and the recall measured, which depend on the graph's links, may differ between any two builds).
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import random
import re
import resource
import subprocess
import sys
import tempfile
import time
import tracemalloc
from collections.abc import Callable, Iterator
from dataclasses import asdict
from pathlib import Path
from typing import Any

import numpy as np

from bench.report import plain
from bench.shared_data import SHARED_DATA

RESULTS = Path(__file__).resolve().parent / "results" / "build_memory.json"
ROOT = Path(__file__).resolve().parents[1]
SEED = 19
CHUNKS = 30_000
WORDS_A_CHUNK = 132  # what a 256-token chunk of these pages holds, about: sizes the corpus
TOP = 25  # holders reported

_SENTENCE = re.compile(r"(?<=[.!?])\s+(?=[A-Z])")
_PROSE = re.compile(r"^[A-Za-z(\"'`]")


def _shared_texts() -> list[str]:
    texts: list[str] = []
    scifact = SHARED_DATA / "scifact" / "corpus.jsonl"
    if scifact.is_file():
        with scifact.open(encoding="utf-8") as lines:
            texts += [json.loads(line)["text"] for line in lines if line.strip()]
    for name in ("docs-rclone", "docs-windows-terminal"):
        folder = SHARED_DATA / name / "docs"
        if folder.is_dir():
            texts += [
                p.read_text(encoding="utf-8", errors="replace")
                for p in sorted(folder.rglob("*.md"))
            ]
    return texts


def _repo_texts() -> list[str]:
    paths = [ROOT / "README.md", ROOT / "ARCHITECTURE.md", *sorted((ROOT / "docs").glob("*.md"))]
    paths += sorted((ROOT / "examples").rglob("*.md"))
    return [p.read_text(encoding="utf-8") for p in paths if p.is_file()]


def sentences(texts: list[str]) -> list[str]:
    """The prose sentences of ``texts``: no code, tables, headings or front matter; 40 to 400
    characters each."""
    found: list[str] = []
    for text in texts:
        fenced = False
        for line in text.splitlines():
            line = line.strip()
            if line.startswith("```"):
                fenced = not fenced
                continue
            if fenced or not _PROSE.match(line):
                continue
            found += [s for s in _SENTENCE.split(line) if 40 <= len(s) <= 400]
    return found


def corpus_sentences() -> tuple[str, list[str]]:
    """(where they came from, the sentences): the evaluation data's, else the repository's."""
    shared = sentences(_shared_texts())
    if len(shared) >= 1000:
        return "shared data (scifact, docs-rclone, docs-windows-terminal)", shared
    return "the repository's docs (no shared data)", sentences(_repo_texts())


def write_pages(folder: Path, pool: list[str], chunks: int, seed: int = SEED) -> int:
    """Seeded Markdown pages of ``pool``'s sentences, about ``chunks`` chunks' worth, under
    ``folder``; returns the number of pages."""
    rng = random.Random(seed)
    words, page = 0, 0
    while words < chunks * WORDS_A_CHUNK:
        title = " ".join(rng.choice(pool).split()[:6]).rstrip(".,;:")
        lines = [f"# {title}", ""]
        for _ in range(rng.randint(2, 6)):
            heading = " ".join(rng.choice(pool).split()[:5]).rstrip(".,;:")
            lines += [f"## {heading}", ""]
            for _ in range(rng.randint(1, 5)):
                paragraph = " ".join(rng.choice(pool) for _ in range(rng.randint(2, 7)))
                words += paragraph.count(" ") + 1
                lines += [paragraph, ""]
        path = folder / f"part-{page // 200:03d}" / f"page-{page:05d}.md"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text("\n".join(lines), encoding="utf-8")
        page += 1
    return page


def _config(work: Path) -> Any:
    from sidecar.config import parse_config

    raw = {
        "knowledge_base": [
            {"name": "kb", "source": [{"type": "markdown", "path": str(work / "pages")}]}
        ],
        "index": {"store": str(work / "store"), "cache_dir": str(work / "cache")},
    }
    return parse_config(raw, base=work)


def _status_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(f"{field}:"):
            return int(line.split()[1])
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux


# -- the child: one build, measured ------------------------------------------------------------


# the stages a tracemalloc run takes a snapshot at the end of, while their result is held
_STAGES = (
    ("index.build", "collect_pages"),
    ("index.build", "chunk_pages"),
    ("index.build", "embed_chunks"),
    ("index.snapshot", "build_hnsw"),
    ("index.snapshot", "choose_ef"),
    ("index.tables", "ChunkTable.dump"),
    ("index.tables", "PageTable.dump"),
    ("index.lexical", "LexicalIndex.build"),
    ("index.lexical", "LexicalIndex.to_bytes"),
    ("index.entities", "EntityTable.dump"),
    ("index.snapshot", "gazetteer_tables"),
    ("index.snapshot", "write_snapshot"),
    ("index.mapped", "StringTable.of"),
    ("index.mapped", "dump_arrays"),
    ("index.snapshot", "write_atomic"),
)


def _traced_peak() -> int:
    return tracemalloc.get_traced_memory()[1]


def _rss_peak() -> int:
    return _status_kib("VmHWM") * 1024


def _reset_rss_peak() -> None:
    Path("/proc/self/clear_refs").write_text("5")  # Linux: VmHWM back to VmRSS


class _Peak:
    """Each stage's own peak (tracemalloc's, or the RSS's when ``rss``; nested stages folded
    into the stages around them), and under tracemalloc the largest snapshot taken at the end
    of a stage, with its stage."""

    def __init__(self, rss: bool = False) -> None:
        self.rss = rss
        self.read, self.reset = (
            (_rss_peak, _reset_rss_peak) if rss else (_traced_peak, tracemalloc.reset_peak)
        )
        self.size = 0
        self.stage = ""
        self.snapshot: tracemalloc.Snapshot | None = None
        self.sizes: dict[str, int] = {}
        self.peaks: dict[str, int] = {}
        self._open: list[int] = []  # the peak so far of each stage under way, outermost first
        self.overall = 0  # the peak of all, the resets notwithstanding

    def _fold(self) -> None:
        peak = self.read()
        self.overall = max(self.overall, peak)
        self._open = [max(p, peak) for p in self._open]

    def wrap(self, name: str, function: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(function)
        def measured(*args: Any, **kwargs: Any) -> Any:
            self._fold()
            self._open.append(0)
            self.reset()
            try:
                result = function(*args, **kwargs)
            finally:
                self._fold()
                own = self._open.pop()
                self.reset()
                self.peaks[name] = max(self.peaks.get(name, 0), own)
            if not self.rss:
                size, _ = tracemalloc.get_traced_memory()
                self.sizes[name] = max(self.sizes.get(name, 0), size)
                if size > self.size:
                    self.size, self.stage = size, name
                    self.snapshot = tracemalloc.take_snapshot()
            return result

        return measured


def _patch(peak: _Peak) -> None:
    """Wrap every stage of ``_STAGES`` where it is defined and where it is imported."""
    import importlib

    for module_name, qualname in _STAGES:
        module = importlib.import_module(module_name)
        owner_name, _, attr = qualname.rpartition(".")
        owner: Any = getattr(module, owner_name) if owner_name else module
        original = owner.__dict__[attr]
        function = (
            original.__func__ if isinstance(original, (staticmethod, classmethod)) else original
        )
        wrapped = peak.wrap(qualname, function)
        if isinstance(original, staticmethod):
            setattr(owner, attr, staticmethod(wrapped))
        elif isinstance(original, classmethod):
            setattr(owner, attr, classmethod(wrapped))
        else:
            setattr(owner, attr, wrapped)
            for other in list(sys.modules.values()):
                if getattr(other, "__name__", "").startswith("index.") and (
                    other.__dict__.get(attr) is original
                ):
                    setattr(other, attr, wrapped)


def _holders(snapshot: tracemalloc.Snapshot, top: int) -> list[dict[str, Any]]:
    """The biggest holders by file:line (paths relative to the repository or site-packages)."""
    stats = snapshot.filter_traces([tracemalloc.Filter(False, tracemalloc.__file__)]).statistics(
        "lineno"
    )
    rows = []
    for stat in stats[:top]:
        frame = stat.traceback[0]
        where = frame.filename
        for prefix in (str(ROOT) + os.sep, "site-packages" + os.sep, "lib" + os.sep):
            if prefix in where:
                where = where.split(prefix, 1)[1]
        rows.append(
            {
                "where": f"{where}:{frame.lineno}",
                "mb": round(stat.size / 1e6, 1),
                "blocks": stat.count,
            }
        )
    return rows


def _by_file(snapshot: tracemalloc.Snapshot, top: int) -> list[dict[str, Any]]:
    stats = snapshot.statistics("filename")
    rows = []
    for stat in stats[:top]:
        where = stat.traceback[0].filename
        if str(ROOT) in where:
            where = where.split(str(ROOT) + os.sep, 1)[1]
        rows.append({"file": where, "mb": round(stat.size / 1e6, 1)})
    return rows


def child(work: Path, mode: str) -> dict[str, Any]:
    """One build of the pages under ``work``, measured: ``rss`` or ``tracemalloc``."""
    from index.build import build_knowledge_base, collect_pages, with_sources
    from index.embedders.base import HashEmbedder
    from index.sources import PageBytes
    from index.sources.registry import LoadContext

    config = _config(work)
    kb = config.knowledge_bases[0]
    embedder = HashEmbedder()
    out: dict[str, Any] = {}
    peak = _Peak(rss=mode == "rss")
    _patch(peak)
    if mode == "tracemalloc":
        tracemalloc.start(1)
    before_kib = _status_kib("VmRSS")
    start = time.perf_counter()
    summary = build_knowledge_base(config, kb, embedder, progress=lambda done, total: None)
    out["seconds"] = round(time.perf_counter() - start, 2)
    if mode == "rss":
        out["rss_before_mb"] = round(before_kib / 1024, 1)
        peak._fold()  # each stage resets VmHWM: the build's peak is the largest of them all
        out["peak_rss_mb"] = round(peak.overall / 2**20, 1)
        out["peak_growth_bytes"] = peak.overall - before_kib * 1024
        out["rss_peak_mb_within"] = {k: round(v / 2**20, 1) for k, v in peak.peaks.items()}
        out["phases"] = {k: round(v, 2) for k, v in summary.seconds.items()}
    else:
        _, traced_peak = tracemalloc.get_traced_memory()
        tracemalloc.stop()
        # each stage resets tracemalloc's peak: the build's is the largest of the stages' own
        out["tracemalloc_peak_mb"] = round(max(traced_peak, peak.overall) / 1e6, 1)
        out["largest_stage_snapshot"] = {"stage": peak.stage, "mb": round(peak.size / 1e6, 1)}
        out["traced_mb_at_the_end_of"] = {k: round(v / 1e6, 1) for k, v in peak.sizes.items()}
        out["traced_peak_mb_within"] = {k: round(v / 1e6, 1) for k, v in peak.peaks.items()}
        if peak.snapshot is not None:
            out["top_lines"] = _holders(peak.snapshot, TOP)
            out["top_files"] = _by_file(peak.snapshot, 12)
    out["pages"], out["chunks"] = summary.pages, summary.chunks
    budget = PageBytes(kb.name, kb.max_text_bytes)
    collect_pages(
        with_sources(config, kb), LoadContext(kb.name, config.index.cache_dir, budget=budget)
    )
    out["counted_bytes"] = budget.held
    return out


def _run_child(work: Path, mode: str) -> dict[str, Any]:
    done = subprocess.run(
        [sys.executable, "-m", "bench.build_memory", "--child", mode, "--work", str(work)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=False,
        # the gazetteer's tables are ordered by string hashes: one seed, so two builds compare
        env={**os.environ, "PYTHONHASHSEED": "0"},
    )
    if done.returncode != 0:
        raise RuntimeError(f"the {mode} build failed:\n{done.stderr[-4000:]}")
    result: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    return result


def _store_of(work: Path, keep: Path) -> None:
    import shutil

    if keep.exists():
        shutil.rmtree(keep)
    shutil.copytree(work / "store", keep)


def _runs(work: Path, modes: list[str], keep: Path | None) -> Iterator[tuple[str, dict[str, Any]]]:
    import shutil

    for mode in modes:
        if (work / "store").exists():
            shutil.rmtree(work / "store")
        yield mode, _run_child(work, mode)
        if keep is not None and mode == modes[0]:
            _store_of(work, keep)


# -- two builds of the same pages, compared ---------------------------------------------------


def _version_dir(store: Path) -> Path:
    from index.store import LocalStore

    return LocalStore(store).latest_dir("kb")


def _same_graph_vectors(a: Path, b: Path) -> bool:
    """Whether two ``vectors.hnsw`` hold the same vector under every label (their links are
    not compared: hnswlib inserts on every core, and thread timing decides them)."""
    from index.hnsw_file import vector_rows
    from index.snapshot import VECTORS, read_manifest

    manifest = read_manifest(a)
    shape = {"count": manifest.chunks, "dimension": manifest.embedder.dimension}
    (va, ra), (vb, rb) = vector_rows(a / VECTORS, **shape), vector_rows(b / VECTORS, **shape)
    return bool(np.array_equal(va[ra], vb[rb]))


def _same_gazetteer(a: Path, b: Path) -> bool:
    """Whether ``b``'s entities give ``a``'s gazetteer under ``a``'s seeds (a build draws its
    tables' hash seeds at random)."""
    import hashlib

    from index.entities import ENTITIES_KIND, EntityTable
    from index.key_tables import GAZETTEER_KIND, KeyTables
    from index.mapped import ArraysFile
    from index.snapshot import ENTITIES, GAZETTEER, read_manifest

    header = ArraysFile((a / GAZETTEER).read_bytes(), GAZETTEER_KIND).header
    entities = (b / ENTITIES).read_bytes()
    table = EntityTable.read(ArraysFile(entities, ENTITIES_KIND), read_manifest(b).chunks)
    tables = KeyTables.build(table.rated_keys(), (header["prefix_mod"], header["near_base"]))
    return tables.dump(hashlib.sha256(entities).hexdigest()) == (a / GAZETTEER).read_bytes()


def _hnsw_found(a: dict[str, Any], b: dict[str, Any]) -> str:
    """The manifests' ``hnsw``: m, ef_construction, the ef the calibration chose and the recall
    it measured, "same" or each that differs as A -> B. The ef and recall are measured on the
    graph, whose links differ between any two builds: they may differ with the same code."""
    if a == b:
        return "same " + ", ".join(f"{name} {value}" for name, value in a.items())
    return "differs: " + ", ".join(f"{k} {a[k]} -> {b[k]}" for k in a if a[k] != b[k])


def compare(a_store: Path, b_store: Path) -> dict[str, str]:
    """Each file of two kept builds: "same bytes", or how it was found the same, or "differs"."""
    from index.snapshot import GAZETTEER, MANIFEST, VECTORS, read_manifest, sha256_file

    a, b = _version_dir(a_store), _version_dir(b_store)
    found: dict[str, str] = {}
    for name in sorted({p.name for p in a.iterdir()} | {p.name for p in b.iterdir()}):
        if name == MANIFEST:
            continue
        if (
            (a / name).is_file()
            and (b / name).is_file()
            and sha256_file(a / name) == sha256_file(b / name)
        ):
            found[name] = "same bytes"
        elif name == VECTORS:
            same = _same_graph_vectors(a, b)
            found[name] = "same vector under every label" if same else "differs"
        elif name == GAZETTEER:
            same = _same_gazetteer(a, b)
            found[name] = "same bytes under the same hash seeds" if same else "differs"
        else:
            found[name] = "differs"
    ma, mb = read_manifest(a), read_manifest(b)
    same = (ma.chunks, ma.pages, ma.embedder, ma.sources, ma.extra) == (
        mb.chunks,
        mb.pages,
        mb.embedder,
        mb.sources,
        mb.extra,
    ) and set(ma.files) == set(mb.files)
    found[MANIFEST] = "same counts, embedder, sources, extra and file names" if same else "differs"
    found[f"{MANIFEST} hnsw"] = _hnsw_found(asdict(ma.hnsw), asdict(mb.hnsw))
    return found


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=plain(__doc__))
    parser.add_argument("--out", type=Path, default=RESULTS, help="the JSON written")
    parser.add_argument("--chunks", type=int, default=CHUNKS, help="about how many chunks")
    parser.add_argument(
        "--only", choices=["rss", "tracemalloc"], help="one of the two builds (default: both)"
    )
    parser.add_argument("--keep", type=Path, help="copy the built store here")
    parser.add_argument(
        "--compare", nargs=2, type=Path, metavar=("A", "B"), help="compare two --keep stores"
    )
    parser.add_argument("--child", choices=["rss", "tracemalloc"], help=argparse.SUPPRESS)
    parser.add_argument("--work", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.compare:
        found = compare(*args.compare)
        print(json.dumps(found, indent=2))
        return found
    if args.child:
        result = child(args.work, args.child)
        print(json.dumps(result))
        return result

    from bench.__main__ import machine

    out: dict[str, Any] = {
        "command": " ".join(["python -m bench.build_memory", *(argv or sys.argv[1:])]),
        "machine": machine(),
    }
    source, pool = corpus_sentences()
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        out["corpus"] = {
            "sentences_from": source,
            "sentences": len(pool),
            "pages_written": write_pages(work / "pages", pool, args.chunks),
            "seed": SEED,
        }
        modes = [args.only] if args.only else ["rss", "tracemalloc"]
        for mode, result in _runs(work, modes, args.keep):
            out[mode] = result
            print(mode, json.dumps(result, indent=1), file=sys.stderr, flush=True)
    rss = out.get("rss")
    if rss:
        out["counted_bytes"] = rss["counted_bytes"]
        out["peak_growth_bytes"] = rss["peak_growth_bytes"]
        out["factor"] = round(rss["peak_growth_bytes"] / max(rss["counted_bytes"], 1), 1)
    out["load_average_at_end"] = [round(x, 2) for x in os.getloadavg()]
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(out, indent=2) + "\n", encoding="utf-8")
    print(
        json.dumps(
            {k: out.get(k) for k in ("corpus", "counted_bytes", "peak_growth_bytes", "factor")}
        )
    )
    return out


if __name__ == "__main__":
    main()
