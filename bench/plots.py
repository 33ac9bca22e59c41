"""PNG figures beside the JSON: latency percentiles per system, and latency against corpus size.

matplotlib is in the ``bench`` extra; without it no figure is drawn and the caller says so.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

PERCENTILES = ("p50_ms", "p95_ms", "p99_ms")


def _pyplot() -> Any:
    import matplotlib

    matplotlib.use("Agg")  # files only, no display
    import matplotlib.pyplot as plt

    return plt


def search_percentiles(result: dict[str, Any], path: Path) -> Path:
    """Grouped bars: p50, p95 and p99 of each measured system, log scale, recall in the label."""
    plt = _pyplot()
    rows = {name: row for name, row in result["systems"].items() if "skipped" not in row}
    fig, ax = plt.subplots(figsize=(max(6.0, 1.3 * len(rows) + 2), 4.5))
    width = 0.8 / len(PERCENTILES)
    for i, key in enumerate(PERCENTILES):
        xs = [j + (i - 1) * width for j in range(len(rows))]
        ax.bar(xs, [row[key] for row in rows.values()], width, label=key.removesuffix("_ms"))
    labels = []
    for name, row in rows.items():
        recall = row.get("recall_at_10")
        labels.append(name if recall is None else f"{name}\nrecall {recall:.3f}")
    ax.set_xticks(range(len(rows)), labels, fontsize=8)
    ax.set_yscale("log")
    ax.set_ylabel("latency per query, ms (log)")
    ax.set_title(
        f"top-{result['k']} search, {result['n']:,} x {result['dim']}, one sequential client"
    )
    ax.legend()
    ax.grid(axis="y", which="both", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def scale_latency(result: dict[str, Any], path: Path) -> Path:
    """Search p50 and p99 against N (log x); extrapolated points drawn hollow."""
    plt = _pyplot()
    sizes = sorted((int(n), row) for n, row in result["sizes"].items() if "search_p50_ms" in row)
    fig, ax = plt.subplots(figsize=(6.0, 4.5))
    for key, marker in (("search_p50_ms", "o"), ("search_p99_ms", "s")):
        line = ax.plot([n for n, _ in sizes], [r[key] for _, r in sizes], marker=marker)[0]
        line.set_label(key.removeprefix("search_").removesuffix("_ms"))
        guessed = [(n, r[key]) for n, r in sizes if "extrapolated" in r]
        if guessed:
            ax.scatter(*zip(*guessed, strict=True), s=90, facecolors="white", zorder=3,
                       edgecolors=line.get_color())  # fmt: skip
    ax.set_xscale("log")
    ax.set_ylim(bottom=0)
    ax.set_xlabel("chunks in the snapshot (hollow: extrapolated)")
    ax.set_ylabel("Search over loopback gRPC, ms")
    ax.set_title(f"voxrecall Search latency against corpus size ({result['dim']}-d)")
    ax.legend()
    ax.grid(which="both", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path
