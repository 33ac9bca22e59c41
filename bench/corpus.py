"""The synthetic corpus every search system is measured on: seeded, clustered unit vectors.

Real embeddings are far from uniform on the sphere: they crowd around topics and span far fewer
directions than their dimension. So points are drawn around cluster centres in a low-dimensional
latent space, projected up to ``dim`` with a fixed random basis, given a little isotropic noise,
and normalised. Queries come from the same process with their own stream, so they are near the
corpus without being in it. The exact top-k by numpy is the ground truth.

A corpus is cached under ``bench/.cache/`` keyed by every parameter that shapes it, so a rerun
loads it instead of drawing it again.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import numpy.typing as npt

CACHE = Path(__file__).resolve().parent / ".cache"
GENERATOR_VERSION = 1  # bump when the drawing changes: cached corpora keyed on it are redrawn
LATENT_DIM = 64  # intrinsic dimension, about that of sentence embeddings' useful subspace
POINTS_PER_CLUSTER = 400  # a topic's worth of chunks
CLUSTER_SPREAD = 0.7  # latent noise around a centre, relative to the centres' unit scale
AMBIENT_NOISE = 0.25  # isotropic noise in the full dimension, relative to the signal's norm
BLOCK = 8192  # rows drawn or scored at a time: bounds peak memory at 100k x 1536

F32 = npt.NDArray[np.float32]
I64 = npt.NDArray[np.int64]


@dataclass(frozen=True, slots=True)
class CorpusSpec:
    """Everything that shapes a corpus; its ``key`` names the cache entries built from it."""

    n: int
    dim: int
    queries: int
    k: int = 10
    seed: int = 20240607

    @property
    def key(self) -> str:
        return f"n{self.n}-d{self.dim}-q{self.queries}-k{self.k}-s{self.seed}-g{GENERATOR_VERSION}"


@dataclass(frozen=True, slots=True)
class Corpus:
    spec: CorpusSpec
    vectors: F32  # (n, dim), unit rows
    queries: F32  # (queries, dim), unit rows
    truth: I64  # (queries, k): exact top-k labels by inner product, best first
    calibration: F32  # a separate query set for choosing each system's ef, never measured
    calibration_truth: I64


def _unit(rows: npt.NDArray[np.floating]) -> F32:
    out = np.asarray(rows, dtype=np.float32)
    out /= np.linalg.norm(out, axis=1, keepdims=True)
    return out


def _draw(
    rng: np.random.Generator, count: int, centres: F32, basis: F32, noise_scale: float
) -> F32:
    out = np.empty((count, basis.shape[1]), dtype=np.float32)
    for start in range(0, count, BLOCK):
        m = min(BLOCK, count - start)
        which = rng.integers(len(centres), size=m)
        latent = centres[which] + rng.normal(0, CLUSTER_SPREAD, (m, LATENT_DIM)).astype(np.float32)
        signal = latent @ basis
        signal += rng.normal(0, noise_scale, signal.shape).astype(np.float32)
        out[start : start + m] = _unit(signal)
    return out


def exact_top_k(vectors: F32, queries: F32, k: int) -> I64:
    """Exact top-k labels by inner product, best first (ties broken by label)."""
    out = np.empty((len(queries), k), dtype=np.int64)
    for start in range(0, len(queries), 256):
        scores = queries[start : start + 256] @ vectors.T
        part = np.argpartition(-scores, k - 1, axis=1)[:, :k]
        order = np.argsort(-np.take_along_axis(scores, part, axis=1), axis=1, kind="stable")
        out[start : start + 256] = np.take_along_axis(part, order, axis=1)
    return out


def generate(spec: CorpusSpec) -> Corpus:
    """Draw the corpus and its queries, and compute the exact top-k of each query."""
    root = np.random.default_rng(spec.seed)
    clusters = max(8, spec.n // POINTS_PER_CLUSTER)
    centres = root.normal(0, 1, (clusters, LATENT_DIM)).astype(np.float32)
    basis = (root.normal(0, 1, (LATENT_DIM, spec.dim)) / np.sqrt(LATENT_DIM)).astype(np.float32)
    # each coordinate of the signal has variance ~ 1 + spread^2: scale the noise to match
    noise_scale = AMBIENT_NOISE * float(np.sqrt(1 + CLUSTER_SPREAD**2))
    vectors_rng, queries_rng, calib_rng = (np.random.default_rng(s) for s in root.spawn(3))
    vectors = _draw(vectors_rng, spec.n, centres, basis, noise_scale)
    queries = _draw(queries_rng, spec.queries, centres, basis, noise_scale)
    calibration = _draw(calib_rng, min(200, spec.queries), centres, basis, noise_scale)
    return Corpus(
        spec=spec,
        vectors=vectors,
        queries=queries,
        truth=exact_top_k(vectors, queries, spec.k),
        calibration=calibration,
        calibration_truth=exact_top_k(vectors, calibration, spec.k),
    )


def load_or_generate(spec: CorpusSpec, cache: Path = CACHE) -> Corpus:
    """The corpus from the cache, or drawn and cached (``.npy`` files, memory-mapped on load)."""
    folder = cache / f"corpus-{spec.key}"
    names = ("vectors", "queries", "truth", "calibration", "calibration_truth")
    if all((folder / f"{name}.npy").is_file() for name in names):
        arrays = {name: np.load(folder / f"{name}.npy", mmap_mode="r") for name in names}
        return Corpus(spec=spec, **{name: np.ascontiguousarray(a) for name, a in arrays.items()})
    corpus = generate(spec)
    folder.mkdir(parents=True, exist_ok=True)
    for name in names:
        tmp = folder / f".{name}.npy.tmp"
        with tmp.open("wb") as f:
            np.save(f, getattr(corpus, name))
        tmp.replace(folder / f"{name}.npy")
    return corpus


def recall_at_k(found: npt.NDArray[np.int64], truth: I64) -> float:
    """Mean share of each query's exact top-k that the system returned in its top-k."""
    k = truth.shape[1]
    hits = [len(set(f[:k].tolist()) & set(t.tolist())) for f, t in zip(found, truth, strict=True)]
    return sum(hits) / (k * len(hits)) if hits else 0.0


def digest(array: npt.NDArray[np.generic]) -> str:
    """A short content hash, to tie a cached index to the exact vectors it was built from."""
    return hashlib.sha256(np.ascontiguousarray(array).tobytes()).hexdigest()[:12]
