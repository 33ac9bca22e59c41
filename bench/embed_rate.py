"""How fast a build embeds with the embedded model: ``python -m bench index [--quick]``.

One run measures, on the same chunks and interleaved block by block (so a neighbour's load
falls on every variant alike; read the ratios, not the rates):

- ``single``: one text at a time on one thread, the single-stream rate;
- ``intra_op``: one text at a time with onnxruntime's intra-op threads = cores (how builds ran
  before parallel embedding);
- ``parallel``: what builds use now, ``parallel`` = cores threads, each one text at a time;
- ``batched``: batches of 8 texts of one token length (no padding), the other way to fill cores.

Every vector is compared with the single-text one (cosine; >= 0.999 required). The chunks are
those the real chunker makes of the rclone docs (``../shared/data``), or of ``examples/kb`` with
``--quick`` or without the shared data. The projected time for 1M chunks on 16 cores assumes
the parallel efficiency measured here (rate / (cores x single)) holds there.
"""

from __future__ import annotations

import os
import time
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from bench.shared_data import SHARED_DATA
from index.chunker import chunk_page
from index.embedders.base import Vectors, normalise
from index.embedders.local import _OUTPUT, LocalEmbedder
from index.sources.markdown import load_markdown

RCLONE = SHARED_DATA / "docs-rclone" / "docs"
EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "kb"
MIN_COSINE = 0.999
BATCH = 8
BLOCK = 16  # texts per turn of each variant: 4 slices of PARALLEL_SLICE for 2 cores and more
MILLION = 1_000_000


def corpus(quick: bool) -> tuple[str, list[str]]:
    folder = EXAMPLE if quick or not RCLONE.is_dir() else RCLONE
    pages, _ = load_markdown("docs", folder)
    texts = [c.embed_text for page in pages for c in chunk_page(page)]
    limit = 32 if quick else 480
    return str(folder), texts[:: max(1, len(texts) // limit)][:limit]  # spread over every page


def _batched(embedder: LocalEmbedder, texts: list[str]) -> Vectors:
    """Groups of up to BATCH texts of one token length, each one run (rows in input order)."""
    tokenizer = embedder._tokenizer
    encodings = [tokenizer.encode(t) for t in texts]
    groups: dict[int, list[int]] = defaultdict(list)
    for row, enc in enumerate(encodings):
        groups[len(enc.ids)].append(row)
    out = np.empty((len(texts), 384), dtype=np.float32)
    for rows in groups.values():
        for start in range(0, len(rows), BATCH):
            part = rows[start : start + BATCH]
            ids = np.asarray([encodings[r].ids for r in part], dtype=np.int64)
            feeds = {
                "input_ids": ids,
                "attention_mask": np.ones_like(ids),
                "token_type_ids": np.asarray([encodings[r].type_ids for r in part], np.int64),
            }
            (vectors,) = embedder._session.run([_OUTPUT], feeds)
            out[part] = vectors
    return normalise(out)


def run(quick: bool = False) -> dict[str, Any]:
    cores = os.cpu_count() or 1
    source, texts = corpus(quick)
    single = LocalEmbedder(threads=1)
    intra = LocalEmbedder(threads=cores)
    parallel = LocalEmbedder(threads=1, parallel=cores)
    variants: dict[str, Callable[[list[str]], Vectors]] = {
        "single": single.embed_batch,
        "intra_op": intra.embed_batch,
        "parallel": parallel.embed_batch,
        "batched": lambda t: _batched(single, t),
    }
    for fn in variants.values():  # warm each session's first run
        fn(texts[:2])
    seconds: dict[str, float] = dict.fromkeys(variants, 0.0)
    parts: dict[str, list[Vectors]] = {name: [] for name in variants}
    load_before = os.getloadavg()
    # Blocks of BLOCK texts, every variant on each block in turn (the order rotating), so a
    # burst of load elsewhere falls on all of them alike, as in the search suite.
    for b, start_row in enumerate(range(0, len(texts), BLOCK)):
        block = texts[start_row : start_row + BLOCK]
        names = list(variants)
        for name in names[b % len(names) :] + names[: b % len(names)]:
            start = time.perf_counter()
            parts[name].append(variants[name](block))
            seconds[name] += time.perf_counter() - start
    rates = {name: len(texts) / s for name, s in seconds.items()}
    vectors = {name: np.concatenate(p) for name, p in parts.items()}
    base = vectors["single"]
    cosine = {name: float(np.min(np.sum(v * base, axis=1))) for name, v in vectors.items()}
    efficiency = rates["parallel"] / (cores * rates["single"])
    return {
        "source": source,
        "chunks": len(texts),
        "cores": cores,
        "load_average": {"before": load_before, "after": os.getloadavg()},
        "chunks_per_s": {k: round(v, 1) for k, v in rates.items()},
        "over_single": {k: round(v / rates["single"], 2) for k, v in rates.items()},
        "parallel_over_intra_op": round(rates["parallel"] / rates["intra_op"], 2),
        "min_cosine_to_single": {k: round(v, 5) for k, v in cosine.items()},
        "parallel_vectors_equal": cosine["parallel"] >= MIN_COSINE,
        "parallel_efficiency": round(efficiency, 2),
        "projected_hours_1m": {
            f"{cores}_cores_measured": round(MILLION / rates["parallel"] / 3600, 2),
            "16_cores": round(MILLION / (16 * efficiency * rates["single"]) / 3600, 2),
            "single_stream": round(MILLION / rates["single"] / 3600, 2),
        },
    }
