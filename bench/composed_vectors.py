"""How close a composed folded-query vector is to the folded text's own: ``python -m bench.composed_vectors``.

    .venv/bin/python -m bench.composed_vectors [--quick] [--sets dstc11,dstc11-spoken,doc2dial,topics]
                                               [--data DIR]

A later turn's folded query ("NAME: turn", the recent turns joined with the turn) is not
embedded when its parts' vectors are known: its vector is composed from theirs, weighted by
their token counts (``sidecar/turn/composed.py``). Every dialogue is driven through the real
engine (``bench.quality_conversations.measure``, the query vectors cached between runs); at each
turn searched folded and alone, the folded text is also embedded and compared with the
composed vector, for the weights the engine uses and two others: every part alike, and token
counts with [CLS] and [SEP] (``index.embedders.local.POOLED_SPECIAL = 0``). Also counted: how
many such turns were composed, and why the others were not (not made of known parts, or a part
neither cached nor being embedded). Each set is first run through an engine that embeds every
folded query (as before this module), then through one that composes: ``embedded`` and
``composed``, each the set's summary rows. Writes ``bench/results/composed_vectors.json``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import numpy as np

from bench.quality_conversations import DEFAULT_DATA, measure, served
from bench.vector_cache import CachedEmbedder
from index.embedders.base import Embedder, EmbedderInfo, Vectors
from index.embedders.local import LocalEmbedder
from sidecar.config import Config
from sidecar.turn import composed
from sidecar.turn.budget import Budget
from sidecar.turn.engine import Engine
from sidecar.turn.sessions import Session

RESULTS = Path(__file__).resolve().parent / "results" / "composed_vectors.json"
SETS = ("dstc11", "dstc11-spoken", "doc2dial", "topics")


class Spy:
    """What one set's folded turns were: composed by the engine or not (and why), and how close
    a composed vector is to the folded text's own, by how many earlier texts it is made of."""

    def __init__(self, tokens: LocalEmbedder) -> None:
        self.tokens = tokens
        self.turns = 0
        self.composed = 0  # composed by the engine (at most MOST_PARTS parts, all known)
        self.not_parts = 0  # the folded text is not made of whole earlier turns and a name
        self.not_known = 0  # a part's vector was neither cached nor being embedded
        self.cosines: dict[str, list[float]] = {}

    def watch(self, engine: Engine) -> None:
        inner = engine._vectors

        async def vectors(
            queries: tuple[str, str], session: Session, budget: Budget
        ) -> Sequence[Vectors | None]:
            self.turns += 1
            folded, text = queries
            parts = composed.pieces(folded, text, session, most=composed.MAX_PARTS)
            known = parts is not None and all(engine.vectors.known(p) for p in parts)
            out = await inner(queries, session, budget)
            if parts is None:
                self.not_parts += 1
            elif not known:
                self.not_known += 1
            else:
                self.composed += len(parts) <= composed.MOST_PARTS
                await self._compare(engine, (*parts, text), folded)
            return out

        engine._vectors = vectors  # type: ignore[method-assign]

    async def _compare(self, engine: Engine, texts: Sequence[str], folded: str) -> None:
        found = [engine.vectors.cached(t) for t in texts]
        if any(v is None for v in found):
            return
        vectors = [v for v in found if v is not None]
        (real,) = await engine.vectors.embedder.embed([folded])
        counts = [len(self.tokens._tokenizer.encode(t).ids) for t in texts]
        size = "one_part" if len(texts) == 2 else "more_parts"
        for name, weights in (
            ("tokens", [self.tokens.weight(t) for t in texts]),
            ("equal", [1.0] * len(texts)),
            ("tokens_with_special", [float(c) for c in counts]),
        ):
            vector = composed.compose(vectors, weights)
            self.cosines.setdefault(f"{size}_{name}", []).append(float(np.dot(vector, real)))

    def summary(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "folded_turns": self.turns,
            "composed_by_engine": self.composed,
            "not_made_of_known_parts": self.not_parts,
            "a_part_not_ready": self.not_known,
        }
        for name, values in sorted(self.cosines.items()):
            v = np.asarray(values)
            out[f"cosine_{name}"] = {
                "turns": len(values),
                "mean": round(float(v.mean()), 4),
                "p05": round(float(np.percentile(v, 5)), 4),
                "min": round(float(v.min()), 4),
            }
        return out


class PooledView:
    """The cached embedder, ``MeanPooled`` through the model's weights: the engine composes."""

    def __init__(self, inner: CachedEmbedder, model: LocalEmbedder, equal: bool) -> None:
        self.inner, self.model, self.equal = inner, model, equal

    @property
    def info(self) -> EmbedderInfo:
        return self.inner.info

    async def embed(self, texts: Sequence[str]) -> Vectors:
        return await self.inner.embed(texts)

    def embed_batch(self, texts: Sequence[str]) -> Vectors:
        return self.inner.embed_batch(texts)

    def weight(self, text: str) -> float:
        return 1.0 if self.equal else self.model.weight(text)

    async def aclose(self) -> None:
        return None


async def run(data_dir: Path, quick: bool, sets: Sequence[str], equal: bool) -> dict[str, Any]:
    """Per set, the engine that embeds every folded query (as before) and the one that composes
    them, one after the other in this run, over the same cached query vectors."""
    local = LocalEmbedder()
    embedder = CachedEmbedder(local, CachedEmbedder.default_path(local.info))  # not MeanPooled
    pooled = PooledView(embedder, local, equal)
    out: dict[str, Any] = {}
    try:
        for name in sets:
            spy = Spy(local)

            @asynccontextmanager
            async def serve(config: Config, inner: Embedder) -> AsyncIterator[Engine]:
                async with served(config, inner) as engine:
                    spy.watch(engine)  # noqa: B023 (used within this set's run only)
                    yield engine

            before = await measure(data_dir, sets=(name,), quick=quick, embedder=embedder)
            after = await measure(data_dir, sets=(name,), quick=quick, embedder=pooled, serve=serve)
            out[name] = {
                "embedded": before["table"],
                "composed": after["table"],
                **spy.summary(),
            }
            print(name, json.dumps(out[name]), flush=True)
    finally:
        await embedder.aclose()
    weights = "equal" if equal else "model"
    return {
        **out,
        "most_parts": composed.MOST_PARTS,
        "weights": weights,
        "load_average": os.getloadavg(),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--sets", default=",".join(SETS))
    parser.add_argument("--data", type=Path, default=DEFAULT_DATA)
    parser.add_argument(
        "--most-parts", type=int, default=composed.MOST_PARTS, help="compose from this many"
    )
    parser.add_argument("--equal", action="store_true", help="the engine weighs every part alike")
    args = parser.parse_args()
    composed.MOST_PARTS = args.most_parts
    out = asyncio.run(run(args.data, args.quick, args.sets.split(","), args.equal))
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps(out, indent=2) + "\n", encoding="utf-8")
    print(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
