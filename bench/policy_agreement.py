"""One policy for auto-search and the knowledge tool: ``python -m bench.policy_agreement [--quick]``.

The same question in the same scope must get the same answer whether the pipeline searched it on
the caller's turn (``Turn``) or the model called the knowledge tool (``InvokeTool``): the same
chunks in the same order, or both nothing and the base's same ``fallback``. Through a real
sidecar (``create_server``, gRPC on 127.0.0.1, the embedded model, the project's default
``max_results`` and ``min_score``), for the judged user turns of DSTC11 and doc2dial-dev
(``bench.conversations``; their snapshots are cached in bench/.cache):

* ``standalone``: each judged turn's text as a ``Turn`` in a fresh session, and as
  ``InvokeTool({"query": text})`` of a function over the same base (goal: every one agrees).
  A turn the pipeline does not search at all (a bare "yes" in a fresh session is a
  backchannel: it has no question to answer) is counted apart, as ``turn_skipped``;
* ``followups``: each dialogue replayed turn by turn in one session; at a judged turn, the
  ``Turn``'s answer against ``InvokeTool({"query": <what the Turn searched>})``, as a model
  writing the self-contained question would call it. A follow-up's answer may also lean on the
  conversation (the page prior, the turn searched alone beside the folded query), which the
  tool cannot see: reported apart, no goal.

Writes bench/results/policy_agreement.json: per set and kind, the questions, the share that
agree, and a few that do not.
"""

from __future__ import annotations

import argparse
import asyncio
import json
from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import grpc
import orjson

from bench import conversations
from bench.conversations import ConversationSet
from bench.quality_turns import DEFAULT_DATA, EVAL_BUDGET_MS
from bench.report import plain
from index.embedders.base import Embedder
from sidecar.config import Config, parse_config
from sidecar.gen import retrieval_pb2 as pb
from sidecar.gen import retrieval_pb2_grpc as pb_grpc
from sidecar.turn.engine import Speaker

RESULTS = Path(__file__).resolve().parent / "results" / "policy_agreement.json"
FUNCTION = "knowledge_search"
FALLBACK = "I don't have that information."
EXAMPLES = 5  # disagreements kept in the JSON, per set and kind
SETS: dict[str, Callable[[Path, bool, bool], ConversationSet]] = {
    "dstc11": conversations.dstc11,
    "doc2dial": conversations.doc2dial,
}


def policy_config(store_dir: Path, kb: str) -> Config:
    """A sidecar over ``store_dir`` with one knowledge function over ``kb`` and a fallback."""
    raw: dict[str, Any] = {
        "knowledge_base": [
            {
                "name": kb,
                # the sidecar reads the store, never a source: this one only names the base
                "source": [{"type": "markdown", "path": str(store_dir)}],
                "fallback": FALLBACK,
            }
        ],
        "function": [
            {"name": FUNCTION, "description": "The knowledge base.", "knowledge_base": kb}
        ],
        "index": {"store": str(store_dir)},
        "sidecar": {"store": str(store_dir), "listen": "127.0.0.1:0", "budget_ms": EVAL_BUDGET_MS},
    }
    return parse_config(raw, base=store_dir.parent)


@asynccontextmanager
async def sidecar_stub(config: Config, embedder: Embedder) -> AsyncIterator[pb_grpc.RetrievalStub]:
    from sidecar.edge.server import create_server

    sidecar = await create_server(config, embedder=embedder, poll=False)
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{sidecar.port}") as channel:
            yield pb_grpc.RetrievalStub(channel)  # type: ignore[no-untyped-call]
    finally:
        await sidecar.stop(0.5)


def answer(chunks: Sequence[pb.Chunk], fallback: str) -> tuple[tuple[str, ...], str]:
    return tuple(c.chunk_id for c in chunks), fallback


class Tally:
    def __init__(self) -> None:
        self.questions = 0
        self.agree = 0
        self.skipped = 0  # the Turn searched nothing (a backchannel or closing, as it judged)
        self.examples: list[dict[str, Any]] = []

    def add(self, text: str, turn: pb.TurnResponse, tool: pb.InvokeToolResponse) -> None:
        if turn.skipped != pb.NOT_SKIPPED:
            self.skipped += 1  # not searched at all: no answer to compare, counted apart
            return
        self.questions += 1
        same = answer(turn.chunks, turn.fallback) == answer(tool.chunks, tool.fallback)
        self.agree += same
        if not same and len(self.examples) < EXAMPLES:
            self.examples.append(
                {
                    "text": text,
                    "turn_query": turn.query,
                    "skipped": pb.SkipReason.Name(turn.skipped),
                    "turn": [c.source_path for c in turn.chunks],
                    "tool": [c.source_path for c in tool.chunks],
                }
            )

    def as_dict(self) -> dict[str, Any]:
        share = self.agree / self.questions if self.questions else None
        return {
            "questions": self.questions,
            "agree": self.agree,
            "agree_share": round(share, 4) if share is not None else None,
            "turn_skipped": self.skipped,  # not in questions: the Turn searched nothing
            "disagreements": self.examples,
        }


async def invoke(stub: pb_grpc.RetrievalStub, query: str) -> pb.InvokeToolResponse:
    args = orjson.dumps({"query": query}).decode()
    resp: pb.InvokeToolResponse = await stub.InvokeTool(
        pb.InvokeToolRequest(name=FUNCTION, arguments_json=args)
    )
    if resp.is_error:
        raise RuntimeError(f"the tool refused {query!r}: {resp.output}")
    return resp


async def standalone(stub: pb_grpc.RetrievalStub, cs: ConversationSet, kb: str) -> Tally:
    tally = Tally()
    for d in cs.dialogues:
        for i, said in enumerate(t for t in d.turns if t.qid):
            turn = await stub.Turn(
                pb.TurnRequest(session_id=f"alone-{d.dialogue_id}-{i}", knowledge_base=kb,
                               text=said.text, is_final=True)
            )  # fmt: skip
            tally.add(said.text, turn, await invoke(stub, said.text))
    return tally


async def followups(stub: pb_grpc.RetrievalStub, cs: ConversationSet, kb: str) -> Tally:
    tally = Tally()
    for d in cs.dialogues:
        session = f"dialogue-{d.dialogue_id}"
        for said in d.turns:
            speaker = pb.AGENT if said.speaker == Speaker.AGENT else pb.USER
            turn = await stub.Turn(
                pb.TurnRequest(session_id=session, knowledge_base=kb, text=said.text,
                               speaker=speaker, is_final=True)
            )  # fmt: skip
            if said.qid and turn.skipped == pb.NOT_SKIPPED:
                tally.add(said.text, turn, await invoke(stub, turn.query))
        await stub.EndSession(pb.EndSessionRequest(session_id=session))
    return tally


async def measure(
    data_dir: Path, *, quick: bool = False, tiny: bool = False, embedder: Embedder | None = None
) -> dict[str, Any]:
    own = embedder is None
    if embedder is None:
        from index.embedders.local import LocalEmbedder

        embedder = LocalEmbedder()
    out: dict[str, Any] = {}
    try:
        for name, make in SETS.items():
            cs = make(data_dir, quick or tiny, tiny)
            store_dir = await asyncio.to_thread(cs.store, embedder)
            config = policy_config(store_dir, cs.knowledge_base)
            async with sidecar_stub(config, embedder) as stub:
                out[name] = {
                    "standalone": (await standalone(stub, cs, cs.knowledge_base)).as_dict(),
                    "followups": (await followups(stub, cs, cs.knowledge_base)).as_dict(),
                }
            print(f"{name}: {json.dumps({k: v['agree_share'] for k, v in out[name].items()})}")
    finally:
        if own:
            await embedder.aclose()
    return out


def run(quick: bool, data_dir: Path = DEFAULT_DATA) -> dict[str, Any]:
    """The ``policy`` suite of ``python -m bench``."""
    return {"suite": "policy", "sets": asyncio.run(measure(data_dir, quick=quick))}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=plain(__doc__))
    parser.add_argument(
        "--quick", action="store_true", help="150 DSTC11 turns, 40 doc2dial dialogues"
    )
    parser.add_argument("--data", type=Path, default=DEFAULT_DATA, help="the evaluation data")
    args = parser.parse_args(argv)
    result = run(args.quick, args.data)
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps(result, indent=2) + "\n", encoding="utf-8")
    print(f"wrote {RESULTS}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
