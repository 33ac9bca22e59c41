"""What checking an hnswlib file before loading it costs: ``python -m bench.hnsw_check [--n N]``.

Builds an index of N random unit vectors at 384 dimensions (M 16, the build's default) into a
temporary folder, then times, in one run, ``check_hnsw_file`` (index/hnsw_file.py: the header,
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

from index.hnsw_file import check_hnsw_file

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


def measure(n: int, ef_construction: int = 100, repeats: int = 3) -> dict[str, float | int]:
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "vectors.hnsw"
        started = time.perf_counter()
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
            "file_mb": round(path.stat().st_size / 2**20, 1),
            "build_s": round(build_s, 1),
            "check_s_min": round(min(check), 3),
            "hnswlib_load_s_min": round(min(load), 3),
            "check_over_load": round(min(check) / min(load), 3),
        }


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.hnsw_check", description=__doc__)
    parser.add_argument("--n", type=int, default=100_000)
    parser.add_argument("--ef-construction", type=int, default=100)
    args = parser.parse_args()
    print(json.dumps(measure(args.n, args.ef_construction)), flush=True)


if __name__ == "__main__":
    main()
