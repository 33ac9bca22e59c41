"""Latency of the embedded default embedder: ``python -m bench.embedder_latency``.

Measures one short query sentence on one thread (``embed_batch`` in the calling thread, and
``embed`` through the worker thread as the hot path does), a 16-chunk batch as an index build
sends it, and the process's peak RSS. Prints a table and writes
``bench/results/embedder_latency.json``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import resource
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import onnxruntime as ort

from bench.report import plain
from index.embedders.local import LocalEmbedder

QUERY = "How do I open a new tab?"
RESULTS = Path(__file__).resolve().parent / "results" / "embedder_latency.json"

_SENTENCES = [
    "To configure two-factor authentication, open Settings and choose Security.",
    "Scan the QR code with an authenticator app and enter the six-digit code it shows.",
    "Keep the recovery codes somewhere safe: each one signs you in once if you lose your phone.",
    "Refunds are processed within five to seven business days after the item arrives.",
    "Our premium plan includes unlimited storage, priority support and single sign-on.",
    "Teams larger than fifty seats should contact sales for an enterprise quote.",
    "If the router's light blinks orange, restart it and wait two minutes before testing.",
    "Invoices are emailed on the first day of each month and can be downloaded as PDF.",
]


def chunks(count: int = 16) -> list[str]:
    """Index-build-sized chunks: 6 to 13 sentences each (~110-240 tokens), all different."""
    out = []
    for i in range(count):
        n = 6 + (i % 8)
        out.append(f"Section {i}. " + " ".join(_SENTENCES[(i + k) % 8] for k in range(n)))
    return out


def peak_rss_mb() -> float:
    # ru_maxrss is KiB on Linux, bytes on macOS
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return rss / (1024 * 1024) if sys.platform == "darwin" else rss / 1024


def percentiles(samples_ns: list[int]) -> dict[str, float]:
    ms = np.asarray(samples_ns, dtype=np.float64) / 1e6
    return {
        "p50_ms": float(np.percentile(ms, 50)),
        "p90_ms": float(np.percentile(ms, 90)),
        "p99_ms": float(np.percentile(ms, 99)),
        "mean_ms": float(ms.mean()),
        "max_ms": float(ms.max()),
    }


def time_sync(embedder: LocalEmbedder, iterations: int, warmup: int) -> list[int]:
    for _ in range(warmup):
        embedder.embed_batch([QUERY])
    samples = []
    for _ in range(iterations):
        start = time.perf_counter_ns()
        embedder.embed_batch([QUERY])
        samples.append(time.perf_counter_ns() - start)
    return samples


async def time_async(embedder: LocalEmbedder, iterations: int, warmup: int) -> list[int]:
    for _ in range(warmup):
        await embedder.embed([QUERY])
    samples = []
    for _ in range(iterations):
        start = time.perf_counter_ns()
        await embedder.embed([QUERY])
        samples.append(time.perf_counter_ns() - start)
    return samples


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=plain(__doc__))
    parser.add_argument("--iterations", type=int, default=300, help="timed embeddings")
    parser.add_argument("--warmup", type=int, default=30, help="untimed ones first")
    parser.add_argument("--threads", type=int, default=1, help="onnxruntime threads")
    parser.add_argument("--batch-repeats", type=int, default=5, help="batch runs timed")
    parser.add_argument("--out", type=Path, default=RESULTS, help="the JSON written")
    args = parser.parse_args(argv)

    rss_before = peak_rss_mb()
    start = time.perf_counter()
    embedder = LocalEmbedder(threads=args.threads)
    load_ms = (time.perf_counter() - start) * 1e3
    rss_loaded = peak_rss_mb()

    sync = percentiles(time_sync(embedder, args.iterations, args.warmup))

    batch = chunks(16)
    tokens = [len(embedder._tokenizer.encode(text).ids) for text in batch]
    embedder.embed_batch(batch)  # warm-up
    batch_ms = []
    for _ in range(args.batch_repeats):
        start = time.perf_counter()
        embedder.embed_batch(batch)
        batch_ms.append((time.perf_counter() - start) * 1e3)

    async def hot_path() -> list[int]:
        try:
            return await time_async(embedder, args.iterations, args.warmup)
        finally:
            await embedder.aclose()

    via_worker = percentiles(asyncio.run(hot_path()))

    result: dict[str, Any] = {
        "model": embedder.info.name,
        "threads": args.threads,
        "iterations": args.iterations,
        "query": QUERY,
        "load_ms": load_ms,
        "single_embed_batch": sync,
        "single_embed_async": via_worker,
        "batch16": {
            "median_ms": statistics.median(batch_ms),
            "min_ms": min(batch_ms),
            "tokens_min": min(tokens),
            "tokens_max": max(tokens),
            "tokens_total": sum(tokens),
        },
        "peak_rss_mb": {
            "before_load": rss_before,
            "after_load": rss_loaded,
            "end": peak_rss_mb(),
        },
        "env": {
            "python": platform.python_version(),
            "onnxruntime": ort.__version__,
            "machine": platform.machine(),
            "processor": platform.processor() or platform.platform(),
            "cpus": os.cpu_count(),
        },
    }

    rows = [
        ("single, embed_batch (p50 / p99)", f"{sync['p50_ms']:.2f} / {sync['p99_ms']:.2f} ms"),
        (
            "single, async embed (p50 / p99)",
            f"{via_worker['p50_ms']:.2f} / {via_worker['p99_ms']:.2f} ms",
        ),
        (
            f"16 chunks, {sum(tokens)} tokens (median)",
            f"{statistics.median(batch_ms):.1f} ms",
        ),
        ("model load + sha256 check", f"{load_ms:.0f} ms"),
        ("peak RSS after load / at end", f"{rss_loaded:.0f} / {peak_rss_mb():.0f} MB"),
    ]
    width = max(len(name) for name, _ in rows)
    print(f"{embedder.info.name}, {args.threads} thread(s), {args.iterations} iterations")
    for name, value in rows:
        print(f"  {name:<{width}}  {value}")

    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n", encoding="utf-8")
    print(f"wrote {args.out}")
    return result


if __name__ == "__main__":
    main()
