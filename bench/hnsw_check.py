"""What checking an hnswlib file before loading it costs: ``python -m bench.hnsw_check [--n N]``.

Builds an index of N random unit vectors at 384 dimensions (M 16, the build's default) into a
temporary folder (``--synthetic``: writes a file of hnswlib's layout with random links and
hnswlib's level distribution instead, in seconds rather than the hours 1M takes to build on two
cores; neither the check nor ``load_index`` looks at the graph's quality), then times, in one run, ``check_hnsw_file`` (index/hnsw_file.py: the header,
every link list and label, in numpy) and hnswlib's own ``load_index`` of the same file, each
from a warm page cache, and prints JSON with the ratio. The check is linear in the file: the
ratio at 1M is about the ratio at 100k.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from pathlib import Path

import hnswlib
import numpy as np

from bench.report import plain
from index.hnsw_file import HEADER, check_hnsw_file

DIM = 384
M = 16


def _build(path: Path, n: int, ef_construction: int) -> None:
    rng = np.random.default_rng(0)
    index = hnswlib.Index(space="ip", dim=DIM)
    index.init_index(max_elements=n, M=M, ef_construction=ef_construction, random_seed=42)
    step = 100_000
    for start in range(0, n, step):
        block = rng.normal(size=(min(step, n - start), DIM)).astype(np.float32)
        block /= np.linalg.norm(block, axis=1, keepdims=True)
        index.add_items(block, np.arange(start, start + len(block)), num_threads=os.cpu_count())
    index.save_index(str(path))


def _synthetic(path: Path, n: int) -> None:
    """A file hnswlib loads and the check accepts: random links, levels as hnswlib draws them."""
    rng = np.random.default_rng(0)
    m, m0 = M, 2 * M
    levels = np.floor(-np.log(rng.random(n)) / np.log(M)).astype(np.int64)
    top = int(levels.max())
    entry = int(np.flatnonzero(levels == top)[0])
    links0 = 4 * (m0 + 1)
    per_element = links0 + 4 * DIM + 8
    head = HEADER.pack(0, n, n, per_element, links0 + 4 * DIM, links0, top, entry, m, m0, M,
                       1 / np.log(M), 100)  # fmt: skip
    with path.open("wb") as f:
        f.write(head)
        for start in range(0, n, 1 << 16):
            rows = min(1 << 16, n - start)
            block = np.zeros((rows, per_element), dtype=np.uint8)
            lists = rng.integers(0, n, size=(rows, m0 + 1), dtype=np.uint32)
            lists[:, 0] = m0
            block[:, :links0] = lists.view(np.uint8)
            vectors = rng.normal(size=(rows, DIM)).astype(np.float32)
            vectors /= np.linalg.norm(vectors, axis=1, keepdims=True)  # what a build writes
            block[:, links0 : links0 + 4 * DIM] = vectors.view(np.uint8)
            labels = np.arange(start, start + rows, dtype=np.uint64)
            block[:, links0 + 4 * DIM :] = labels.view(np.uint8).reshape(rows, 8)
            f.write(block.tobytes())
        by_level = [np.flatnonzero(levels >= lv).astype(np.uint32) for lv in range(top + 1)]
        done = 0  # elements whose upper-level record is written
        for i in np.flatnonzero(levels > 0).tolist():
            f.write(bytes(4 * (i - done)))  # the level-0 elements before it: a zero size each
            level = int(levels[i])
            body = np.zeros((level, m + 1), dtype=np.uint32)
            for lv in range(1, level + 1):
                ids = rng.choice(by_level[lv], size=min(m, len(by_level[lv])))
                body[lv - 1, 0], body[lv - 1, 1 : 1 + len(ids)] = len(ids), ids
            f.write(np.uint32(body.nbytes).tobytes() + body.tobytes())
            done = i + 1
        f.write(bytes(4 * (n - done)))


def measure(
    n: int, ef_construction: int = 100, repeats: int = 3, synthetic: bool = False
) -> dict[str, float | int | bool]:
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "vectors.hnsw"
        started = time.perf_counter()
        if synthetic:
            _synthetic(path, n)
        else:
            _build(path, n, ef_construction)
        build_s = time.perf_counter() - started
        check, load = [], []
        for _ in range(repeats):
            started = time.perf_counter()
            check_hnsw_file(path, count=n, dimension=DIM, m=M)
            check.append(time.perf_counter() - started)
            index = hnswlib.Index(space="ip", dim=DIM)
            started = time.perf_counter()
            index.load_index(str(path), max_elements=n)
            load.append(time.perf_counter() - started)
            del index
        return {
            "n": n,
            "dim": DIM,
            "synthetic": synthetic,
            "file_mb": round(path.stat().st_size / 2**20, 1),
            "build_s": round(build_s, 1),
            "check_s_min": round(min(check), 3),
            "hnswlib_load_s_min": round(min(load), 3),
            "check_over_load": round(min(check) / min(load), 3),
        }


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.hnsw_check", description=plain(__doc__))
    parser.add_argument("--n", type=int, default=100_000, help="elements in the graph")
    parser.add_argument("--ef-construction", type=int, default=100, help="of the graph built")
    parser.add_argument("--synthetic", action="store_true", help="random links, no build")
    args = parser.parse_args()
    print(json.dumps(measure(args.n, args.ef_construction, synthetic=args.synthetic)), flush=True)


if __name__ == "__main__":
    main()
