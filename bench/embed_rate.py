"""How fast a build embeds with the embedded model: ``python -m bench index [--quick]``.

One run measures, on the same chunks and interleaved block by block (so a neighbour's load
falls on every variant alike; read the ratios, not the rates):

- ``single``: one text at a time on one thread, the single-stream rate;
- ``intra_op``: one text at a time with onnxruntime's intra-op threads = cores (how builds ran
  before parallel embedding);
- ``parallel``: what builds use now, ``parallel`` = cores threads, each one text at a time;
- ``sessions``: one model session per core, each on a thread of its own, one text at a time
  (parallel's threads share one session);
- ``batched``: batches of 8 texts of one token length (no padding), the other way to fill cores.

Every vector is compared with the single-text one (cosine; >= 0.999 required). Beside the rates,
the CPU time a chunk costs and the cores the process got while each variant ran: on a machine
other work keeps busy, ``cores_used`` says how much of the parallel way's gain it was allowed. The chunks are
those the real chunker makes of the rclone docs (``../shared/data``), or of ``examples/kb`` with
``--quick`` or without the shared data (``source`` says which). The projected times for 1M
chunks on 2 and 16 free cores divide by the CPU a chunk costs the parallel way (one core's worth
per thread, which holds while the threads add no work: compare ``cpu_ms_per_chunk``); from fewer
than ``MIN_PROJECTED`` chunks (examples/kb has 13) nothing is projected, and the JSON says why.
"""

from __future__ import annotations

import os
import time
from collections import defaultdict
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np

from bench.shared_data import SHARED_DATA
from index.chunker import chunk_page
from index.embedders.base import Vectors, normalise
from index.embedders.local import _OUTPUT, PARALLEL_SLICE, LocalEmbedder
from index.sources.markdown import load_markdown

RCLONE = SHARED_DATA / "docs-rclone" / "docs"
EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "kb"
MIN_COSINE = 0.999
BATCH = 8
CHUNKS = 320  # of the rclone docs, spread over every page
BLOCK = 16  # texts per turn of each variant (a build hands the embedder 64 at a time)
MILLION = 1_000_000
# Fewer chunks than this project nothing: examples/kb's 13 chunks are timed in a second or two,
# where a warm-up or one burst of load elsewhere moves the rate by half, and they are shorter than
# a real base's; 100 is a third of the full run's sample.
MIN_PROJECTED = 100


def corpus(quick: bool) -> tuple[str, list[str]]:
    """The chunks timed, and which docs they come from (said in the table: on a bare clone or
    with ``--quick`` they are examples/kb's, not the rclone docs' the figures below were)."""
    example = quick or not RCLONE.is_dir()
    folder = EXAMPLE if example else RCLONE
    pages, _ = load_markdown("docs", folder)
    texts = [c.embed_text for page in pages for c in chunk_page(page)]
    limit = 32 if quick else CHUNKS
    texts = texts[:: max(1, len(texts) // limit)][:limit]  # spread over every page
    if example:
        why = "--quick" if quick else f"no rclone docs at {RCLONE}"
        return f"examples/kb ({why}): {len(texts)} chunks, not the rclone docs", texts
    return f"the rclone docs in the shared data: {len(texts)} chunks", texts


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


def _sessions(
    embedders: list[LocalEmbedder], pool: ThreadPoolExecutor
) -> Callable[[list[str]], Vectors]:
    """One session per thread: the texts dealt out in slices of PARALLEL_SLICE, slice i to
    session i mod cores (rows in input order)."""

    def embed(texts: list[str]) -> Vectors:
        slices = [texts[i : i + PARALLEL_SLICE] for i in range(0, len(texts), PARALLEL_SLICE)]
        jobs = [
            pool.submit(embedders[i % len(embedders)].embed_batch, part)
            for i, part in enumerate(slices)
        ]
        return np.concatenate([job.result() for job in jobs])

    return embed


def run(quick: bool = False) -> dict[str, Any]:
    cores = os.cpu_count() or 1
    source, texts = corpus(quick)
    single = LocalEmbedder(threads=1)
    intra = LocalEmbedder(threads=cores)
    parallel = LocalEmbedder(threads=1, parallel=cores)
    pool = ThreadPoolExecutor(max_workers=cores, thread_name_prefix="bench-sessions")
    sessions = [LocalEmbedder(threads=1) for _ in range(cores)]
    variants: dict[str, Callable[[list[str]], Vectors]] = {
        "single": single.embed_batch,
        "intra_op": intra.embed_batch,
        "parallel": parallel.embed_batch,
        "sessions": _sessions(sessions, pool),
        "batched": lambda t: _batched(single, t),
    }
    for fn in variants.values():  # warm each session's first run
        fn(texts[:2])
    seconds: dict[str, float] = dict.fromkeys(variants, 0.0)
    cpu: dict[str, float] = dict.fromkeys(variants, 0.0)  # this process's CPU, every thread
    parts: dict[str, list[Vectors]] = {name: [] for name in variants}
    load_before = os.getloadavg()
    # Blocks of BLOCK texts, every variant on each block in turn (the order rotating), so a
    # burst of load elsewhere falls on all of them alike, as in the search suite.
    for b, start_row in enumerate(range(0, len(texts), BLOCK)):
        block = texts[start_row : start_row + BLOCK]
        names = list(variants)
        for name in names[b % len(names) :] + names[: b % len(names)]:
            start, start_cpu = time.perf_counter(), time.process_time()
            parts[name].append(variants[name](block))
            seconds[name] += time.perf_counter() - start
            cpu[name] += time.process_time() - start_cpu
    pool.shutdown()
    rates = {name: len(texts) / s for name, s in seconds.items()}
    vectors = {name: np.concatenate(p) for name, p in parts.items()}
    base = vectors["single"]
    cosine = {name: float(np.min(np.sum(v * base, axis=1))) for name, v in vectors.items()}
    efficiency = rates["parallel"] / (cores * rates["single"])
    per_core_s = len(texts) / cpu["parallel"]  # chunks a second one free core gives
    return {
        "source": source,
        # with autogroup the kernel shares CPU per session, not per thread: on a machine busy
        # with other sessions, more threads get no more CPU (see ``cores_used``)
        "sched_autogroup": _autogroup(),
        "chunks": len(texts),
        "cores": cores,
        "load_average": {"before": load_before, "after": os.getloadavg()},
        "chunks_per_s": {k: round(v, 1) for k, v in rates.items()},
        "over_single": {k: round(v / rates["single"], 2) for k, v in rates.items()},
        "parallel_over_intra_op": round(rates["parallel"] / rates["intra_op"], 2),
        # CPU seconds a chunk costs (all threads): equal for single and parallel means the
        # parallel way adds no work, so its rate grows with the cores it is given
        "cpu_ms_per_chunk": {k: round(v / len(texts) * 1000, 1) for k, v in cpu.items()},
        # cores this process got while each variant ran: ~1 and ~cores on an idle machine
        "cores_used": {k: round(cpu[k] / seconds[k], 2) for k in variants},
        "min_cosine_to_single": {k: round(v, 5) for k, v in cosine.items()},
        "parallel_vectors_equal": cosine["parallel"] >= MIN_COSINE,
        "parallel_efficiency": round(efficiency, 2),
        "projected_hours_1m": _projected(len(texts), cores, rates, per_core_s),
    }


def _projected(
    chunks: int, cores: int, rates: dict[str, float], per_core_s: float
) -> dict[str, Any]:
    """Hours for 1M chunks at the measured rates, or why ``chunks`` are too few to say."""
    if chunks < MIN_PROJECTED:
        return {
            "skipped": f"{chunks} chunks measured; 1M is projected from {MIN_PROJECTED} or more"
            " (the rclone docs in the shared data, without --quick)"
        }
    return {
        f"{cores}_cores_measured": round(MILLION / rates["parallel"] / 3600, 2),
        "single_stream_measured": round(MILLION / rates["single"] / 3600, 2),
        # from the CPU a chunk costs, on cores given to the build alone
        "2_free_cores": round(MILLION / (2 * per_core_s) / 3600, 2),
        "16_free_cores": round(MILLION / (16 * per_core_s) / 3600, 2),
    }


def _autogroup() -> bool | None:
    try:
        return Path("/proc/sys/kernel/sched_autogroup_enabled").read_text().strip() == "1"
    except OSError:
        return None
