"""Server-side Turn latency under the budget: ``python -m bench.turn_latency [--quick]``.

A sidecar runs in a process of its own (``voxrecall serve``) over the Windows Terminal docs.
Simulated callers (CONCURRENCY at once, five turns per call) speak real text: the docs' FAQ
questions in five phrasings and a seeded sample of DSTC11 user turns (some of them backchannels
and closings the skip policy answers without searching). Words arrive every WORD_S; the
recogniser's final transcript follows the last word after ENDPOINT_S. A ``Turn`` scenario sends
only the final transcript; a ``Converse`` scenario streams an interim transcript per word
(unpunctuated, as recognisers send them) and then the final, so that a stable interim can be
searched ahead.

Scenarios: the embedded default model; the OpenAI provider pointed at a local server
(``tests/openai_server.py``, in its own process) answering after a lognormal latency (median
120 ms, sigma 0.4: p95 ~230 ms, p99 ~300 ms) under a 150 ms budget; and the same server at a
uniform 80-200 ms under a budget wide enough never to fall back, to show how much of the turn
prefetch removes. Per scenario: the server-side turn latency (``timings.total_ms``) p50/p95/p99
over every final user turn and over the searched ones, the share within the budget, degraded,
skipped and prefetched, and the client's round trip. Writes ``bench/results/turn_latency.json``.

The client's time of a turn is always from sending its final transcript to reading its answer:
a ``Turn`` from the call's start to its response; a ``Converse`` final from writing it on the
stream to reading the stream's next answer (its interims get none, so that is the final's), not
from the first interim; the DIY system (``--diy``, ``bench.diy_turn``) from handing the final
transcript to its embedder to the database's rows. Each waits the same pace before its final:
the words at WORD_S each, then the endpointing silence (``pause_s``; a ``Converse`` caller sends
an interim per word meanwhile).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import platform
import random
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import grpc
import numpy as np
import orjson
from google.protobuf import json_format
from grpc_health.v1 import health_pb2, health_pb2_grpc

from bench import diy_turn
from bench.corpus import CACHE
from bench.diy_turn import Diy
from bench.measure import Unavailable, free_port
from bench.report import plain
from bench.shared_data import SHARED_DATA
from index.build import build_knowledge_base
from index.embedders.local import LocalEmbedder
from index.embedders.remote import OpenAIEmbedder
from sidecar.config import Config, load_config
from sidecar.gen import retrieval_pb2 as pb
from sidecar.gen import retrieval_pb2_grpc as pb_grpc

# Progress goes to the log (stderr): stdout is the table ``python -m bench`` prints, and the
# figures are the JSON file's.
log = logging.getLogger("bench.turn_latency")

RESULTS = Path(__file__).resolve().parent / "results" / "turn_latency.json"
DATA = SHARED_DATA
DOCS = DATA / "docs-windows-terminal" / "docs"
FAQ = DATA / "docs-windows-terminal" / "faq_questions.json"
DSTC11 = DATA / "turns-dstc11" / "labeled_user_turns.jsonl"
WORK = CACHE / "turn-latency"

CONCURRENCY = 4  # calls in progress at once
TURNS_PER_CALL = 5
DSTC11_TURNS = 60
PHRASINGS = ("{q}", "Hi, {q}", "Quick question: {q}", "Um, {q}", "{q} Thanks.")
WORD_S = 0.06  # interim transcripts arrive this often while the caller speaks
ENDPOINT_S = (0.3, 0.6)  # silence before the recogniser finalises: uniform in this range
REALISTIC = "lognormal:120:0.4"
STARTUP_S = 120.0  # a sidecar process loads its snapshot and model within this


@dataclass(frozen=True, slots=True)
class Scenario:
    name: str
    embedder: str  # "local" or "openai"
    budget_ms: int
    converse: bool
    latency: str = "0"  # the OpenAI server's answer latency
    rerank_s: float | None = None  # a rerank stage, its local server answering this late


SCENARIOS = (
    Scenario("local_default", "local", 150, converse=False),
    Scenario("local_default_prefetch", "local", 150, converse=True),
    # the rerank stage ([knowledge_base.rerank]) against a local Cohere-shaped server: at once
    # (what the stage itself adds) and answering 40 ms late (a hosted reranker's own time)
    Scenario("local_rerank", "local", 150, converse=False, rerank_s=0.0),
    Scenario("local_rerank_40ms", "local", 150, converse=False, rerank_s=0.04),
    Scenario("openai_realistic", "openai", 150, converse=False, latency=REALISTIC),
    Scenario("openai_realistic_prefetch", "openai", 150, converse=True, latency=REALISTIC),
    Scenario("remote_80_200", "openai", 1000, converse=False, latency="uniform:80:200"),
    Scenario("remote_80_200_prefetch", "openai", 1000, converse=True, latency="uniform:80:200"),
)


@dataclass(slots=True)
class Sample:
    server_ms: float
    client_ms: float
    degraded: bool
    skipped: bool
    prefetched: bool
    text: str = ""


@dataclass(slots=True)
class Run:
    samples: list[Sample] = field(default_factory=list)
    reranked: list[bool] = field(default_factory=list)  # per turn: the reranker's order
    answer: pb.TurnResponse | None = None  # the last searched turn's answer (bench.grpc_floor's)
    answer_json: bytes = b""  # the same over HTTP, as sent (bench.http_floor's)
    # the sidecar's query embeddings by outcome (hit, miss, joined, ...), warm-up turn included
    embeddings: dict[str, float] = field(default_factory=dict)


# -- the workload ----------------------------------------------------------------------------


def workload(quick: bool) -> list[list[str]]:
    """Calls, each a list of user turns: real text, seeded order."""
    faq = [q["question"] for q in json.loads(FAQ.read_text(encoding="utf-8"))]
    turns = [p.format(q=q) for p in PHRASINGS for q in faq]
    rows = [json.loads(line) for line in DSTC11.read_text(encoding="utf-8").splitlines()]
    rng = random.Random(4)
    turns += [row["text"] for row in rng.sample(rows, DSTC11_TURNS)]
    rng.shuffle(turns)
    if quick:
        turns = turns[:30]
    return [turns[i : i + TURNS_PER_CALL] for i in range(0, len(turns), TURNS_PER_CALL)]


# -- processes -------------------------------------------------------------------------------


def start_openai_server() -> tuple[subprocess.Popen[str], int]:
    proc = subprocess.Popen(
        [sys.executable, "-m", "tests.openai_server", "--dimension", "384"],
        stdout=subprocess.PIPE,
        text=True,
    )
    assert proc.stdout is not None
    return proc, int(proc.stdout.readline())


def set_latency(port: int, latency: str) -> None:
    body = json.dumps({"latency": latency}).encode()
    request = urllib.request.Request(f"http://127.0.0.1:{port}/_control", data=body, method="POST")
    with urllib.request.urlopen(request, timeout=10) as resp:
        resp.read()


def write_config(folder: Path, embedder: str, openai_port: int) -> Config:
    folder.mkdir(parents=True, exist_ok=True)
    emb = (
        '[embedder]\nprovider = "openai"\nmodel = "text-embedding-3-small"\n'
        f'base_url = "http://127.0.0.1:{openai_port}/v1"\ndimensions = 384\n'
        if embedder == "openai"
        else '[embedder]\nprovider = "local"\n'
    )
    text = (
        emb
        + '\n[[knowledge_base]]\nname = "docs"\n\n[[knowledge_base.source]]\n'
        + f'name = "terminal-docs"\ntype = "markdown"\npath = "{DOCS}"\n\n'
        + '[index]\nstore = "store"\n\n[sidecar]\nlisten = "127.0.0.1:0"\n'
    )
    path = folder / "voxrecall.toml"
    path.write_text(text, encoding="utf-8")
    return load_config(path)


def build(config: Config, embedder: str) -> None:
    """Build (or find unchanged) the snapshot, with the embedder the sidecar will use."""
    if embedder == "openai":
        remote = OpenAIEmbedder(config.embedder)
        build_knowledge_base(config, config.knowledge_bases[0], remote)
        asyncio.run(remote.aclose())
    else:
        local = LocalEmbedder(threads=os.cpu_count() or 1)
        build_knowledge_base(config, config.knowledge_bases[0], local)


def start_rerank_server(latency_s: float) -> tuple[subprocess.Popen[str], int]:
    proc = subprocess.Popen(
        [sys.executable, "-m", "tests.rerank_server", "--latency", str(latency_s)],
        stdout=subprocess.PIPE,
        text=True,
    )
    assert proc.stdout is not None
    return proc, int(proc.stdout.readline())


async def start_sidecar(
    config: Config, budget_ms: int, rerank_port: int = 0, http_port: int = 0, metrics_port: int = 0
) -> tuple[asyncio.subprocess.Process, int]:
    """A sidecar process over ``config`` (with its HTTP door on ``http_port``, its metrics on
    ``metrics_port``, when given) and its gRPC port, once it serves."""
    assert config.path is not None
    text = config.path.read_text(encoding="utf-8")
    if rerank_port:
        table = f'[knowledge_base.rerank]\nbase_url = "http://127.0.0.1:{rerank_port}/v1"\n\n'
        text = text.replace("[index]", table + "[index]")
    scenario = config.path.with_name("scenario.toml")
    text += f"budget_ms = {budget_ms}\n"
    if metrics_port:
        text += f'metrics_listen = "127.0.0.1:{metrics_port}"\n'
    if http_port:
        text += f'\n[sidecar.http]\nlisten = "127.0.0.1:{http_port}"\n'
    scenario.write_text(text, encoding="utf-8")
    port = free_port()
    listen = f"127.0.0.1:{port}"
    proc = await asyncio.create_subprocess_exec(
        *(
            sys.executable,
            "-m",
            "sidecar.cli",
            "serve",
            "--config",
            str(scenario),
            "--listen",
            listen,
        ),
        stderr=asyncio.subprocess.DEVNULL,
    )
    deadline = time.monotonic() + STARTUP_S
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
        health = health_pb2_grpc.HealthStub(channel)
        while True:
            try:
                resp = await health.Check(health_pb2.HealthCheckRequest(), timeout=2)
                if resp.status == health_pb2.HealthCheckResponse.SERVING:
                    return proc, port
            except grpc.aio.AioRpcError:
                pass
            if time.monotonic() > deadline or proc.returncode is not None:
                proc.kill()
                raise RuntimeError(f"sidecar did not start serving ({config.path})")
            await asyncio.sleep(0.2)


# -- callers ---------------------------------------------------------------------------------


def record(
    run: Run, resp: pb.TurnResponse, client_ms: float, prefetched: bool, text: str = ""
) -> None:
    if resp.skipped == pb.NOT_SKIPPED:
        run.reranked.append(resp.rerank == pb.RERANKED)
        run.answer = resp
    run.samples.append(
        Sample(
            server_ms=resp.timings.total_ms,
            client_ms=client_ms,
            degraded=resp.degraded,
            skipped=resp.skipped != pb.NOT_SKIPPED,
            prefetched=prefetched,
            text=text,
        )
    )


def interim_text(words: list[str]) -> str:
    return " ".join(words).rstrip("?.!,")


def pause_s(rng: random.Random, text: str) -> float:
    """From the previous answer to this turn's final transcript: the caller speaking it, then
    the recogniser's endpointing silence."""
    return len(text.split()) * WORD_S + rng.uniform(*ENDPOINT_S)


async def call_with_turns(
    stub: pb_grpc.RetrievalStub, session: str, turns: list[str], budget_ms: int, run: Run
) -> None:
    rng = random.Random(session)
    for text in turns:
        await asyncio.sleep(pause_s(rng, text))
        start = time.perf_counter()
        resp = await stub.Turn(
            pb.TurnRequest(session_id=session, text=text, is_final=True, budget_ms=budget_ms),
            timeout=10,
        )
        record(run, resp, (time.perf_counter() - start) * 1000.0, prefetched=False, text=text)


async def call_with_converse(
    stub: pb_grpc.RetrievalStub, session: str, turns: list[str], budget_ms: int, run: Run
) -> None:
    rng = random.Random(session)
    stream = stub.Converse(timeout=600)
    try:
        for text in turns:
            words = text.split()
            for i in range(1, len(words) + 1):
                await stream.write(
                    pb.ConverseRequest(
                        turn=pb.TurnRequest(session_id=session, text=interim_text(words[:i]))
                    )
                )
                await asyncio.sleep(WORD_S)
            await asyncio.sleep(rng.uniform(*ENDPOINT_S))
            start = time.perf_counter()
            await stream.write(
                pb.ConverseRequest(
                    turn=pb.TurnRequest(
                        session_id=session, text=text, is_final=True, budget_ms=budget_ms
                    )
                )
            )
            resp = await stream.read()  # an interim gets no answer: this is the final's
            client_ms = (time.perf_counter() - start) * 1000.0
            record(run, resp.turn, client_ms, resp.prefetched, text=text)
        await stream.done_writing()
    finally:
        stream.cancel()


TURN_PATH = "/v1/turn"
JSON_BODY = {"content-type": "application/json"}


async def call_over_http(
    port: int, session: str, turns: list[str], budget_ms: int, run: Run
) -> None:
    """One caller's turns as ``POST /v1/turn``, over one aiohttp ``ClientSession`` for the call
    (as an agent holds one: its first turn opens the connection). The client's time takes in
    reading the answer and its JSON, as a gRPC client's takes in parsing the message."""
    rng = random.Random(session)
    url = f"http://127.0.0.1:{port}{TURN_PATH}"
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=10)) as http:
        for text in turns:
            await asyncio.sleep(pause_s(rng, text))
            request = {"session_id": session, "text": text, "is_final": True}
            body = orjson.dumps({**request, "budget_ms": budget_ms})
            start = time.perf_counter()
            async with http.post(url, data=body, headers=JSON_BODY) as reply:
                data = await reply.read()
            client_ms = (time.perf_counter() - start) * 1000.0
            if reply.status != 200:
                raise RuntimeError(f"{url} answered {reply.status}: {data[:300]!r}")
            answer = orjson.loads(data)
            resp = json_format.ParseDict(answer, pb.TurnResponse())
            if resp.skipped == pb.NOT_SKIPPED:
                run.answer_json = data
            record(run, resp, client_ms, prefetched=False, text=text)


async def drive_http(port: int, name: str, calls: list[list[str]], budget_ms: int) -> Run:
    """The callers of ``calls`` as ``POST /v1/turn`` to ``port``, CONCURRENCY at once, paced as
    ``drive`` paces them, after one warm-up turn."""
    run = Run()
    gate = asyncio.Semaphore(CONCURRENCY)

    async def one(i: int, turns: list[str]) -> None:
        async with gate:
            await call_over_http(port, f"{name}-{i}", turns, budget_ms, run)

    await one(-1, ["How do I open a new tab?"])  # warm-up: model pages
    run.samples.clear()
    await asyncio.gather(*(one(i, turns) for i, turns in enumerate(calls)))
    return run


async def run_http_turns(scenario: Scenario, config: Config, calls: list[list[str]]) -> Run:
    """``scenario``'s callers as ``Turn`` over the sidecar's HTTP door (``drive_http``)."""
    http_port = free_port()
    proc, _ = await start_sidecar(config, scenario.budget_ms, http_port=http_port)
    try:
        return await drive_http(http_port, f"{scenario.name}_http", calls, scenario.budget_ms)
    finally:
        proc.terminate()
        await asyncio.wait_for(proc.wait(), timeout=30)


async def run_scenario(scenario: Scenario, config: Config, calls: list[list[str]]) -> Run:
    reranker, rerank_port = (
        start_rerank_server(scenario.rerank_s) if scenario.rerank_s is not None else (None, 0)
    )
    try:
        return await _run_scenario(scenario, config, calls, rerank_port)
    finally:
        if reranker is not None:
            reranker.terminate()
            reranker.wait(timeout=30)


async def _run_scenario(
    scenario: Scenario, config: Config, calls: list[list[str]], rerank_port: int
) -> Run:
    metrics_port = free_port()
    proc, port = await start_sidecar(config, scenario.budget_ms, rerank_port, 0, metrics_port)
    try:
        run = await drive(port, scenario, calls)
        run.embeddings = await asyncio.to_thread(query_embeddings, metrics_port)
        return run
    finally:
        proc.terminate()
        await asyncio.wait_for(proc.wait(), timeout=30)


EMBEDDINGS = "voxrecall_query_embeddings_total{outcome="


def query_embeddings(metrics_port: int) -> dict[str, float]:
    """The sidecar's ``voxrecall_query_embeddings_total`` by outcome, from its /metrics."""
    url = f"http://127.0.0.1:{metrics_port}/metrics"
    with urllib.request.urlopen(url, timeout=10) as resp:
        text = resp.read().decode("utf-8")
    out = {}
    for line in text.splitlines():
        if line.startswith(EMBEDDINGS):
            labels, value = line[len(EMBEDDINGS) :].rsplit(" ", 1)
            out[labels.split('"')[1]] = float(value)
    return out


async def drive(port: int, scenario: Scenario, calls: list[list[str]]) -> Run:
    """The callers of ``calls`` against the server on ``port``, CONCURRENCY at once, paced as
    spoken, after one warm-up turn."""
    run = Run()
    gate = asyncio.Semaphore(CONCURRENCY)
    caller = call_with_converse if scenario.converse else call_with_turns
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
        stub = pb_grpc.RetrievalStub(channel)  # type: ignore[no-untyped-call]

        async def one(i: int, turns: list[str]) -> None:
            async with gate:
                await caller(stub, f"{scenario.name}-{i}", turns, scenario.budget_ms, run)

        await one(-1, ["How do I open a new tab?"])  # warm-up: connections, model pages
        run.samples.clear()
        await asyncio.gather(*(one(i, turns) for i, turns in enumerate(calls)))
    return run


async def grpc_floor(answer: pb.TurnResponse, calls: list[list[str]], folder: Path = WORK) -> Run:
    """The same callers against ``bench.grpc_floor`` answering ``answer`` (written into
    ``folder``) at once: what gRPC itself costs a ``Turn`` at this pace (the client's time; no
    server-side time to take off)."""
    path = folder / "floor-answer.bin"
    path.write_bytes(answer.SerializeToString())
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "bench.grpc_floor", str(path), stdout=asyncio.subprocess.PIPE
    )
    try:
        assert proc.stdout is not None
        port = int(await asyncio.wait_for(proc.stdout.readline(), timeout=STARTUP_S))
        return await drive(port, Scenario("grpc_floor", "local", 150, converse=False), calls)
    finally:
        proc.terminate()
        await asyncio.wait_for(proc.wait(), timeout=30)


async def http_floor(answer: bytes, calls: list[list[str]], folder: Path = WORK) -> Run:
    """The same callers against ``bench.http_floor`` answering ``answer`` (a ``TurnResponse`` in
    the JSON mapping, written into ``folder``) at once: what HTTP itself costs a ``Turn`` over
    ``/v1/turn`` at this pace, measured as ``grpc_floor`` measures gRPC's."""
    path = folder / "floor-answer.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(answer)
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "bench.http_floor", str(path), stdout=asyncio.subprocess.PIPE
    )
    try:
        assert proc.stdout is not None
        port = int(await asyncio.wait_for(proc.stdout.readline(), timeout=STARTUP_S))
        return await drive_http(port, "http_floor", calls, 150)
    finally:
        proc.terminate()
        await asyncio.wait_for(proc.wait(), timeout=30)


# -- the report ------------------------------------------------------------------------------


def percentiles(values: list[float]) -> dict[str, float]:
    if not values:
        return {"p50_ms": 0.0, "p95_ms": 0.0, "p99_ms": 0.0}
    a = np.asarray(values)
    return {f"p{p}_ms": round(float(np.percentile(a, p)), 2) for p in (50, 95, 99)}


def share(flags: list[bool]) -> float:
    return round(sum(flags) / len(flags), 4) if flags else 0.0


def ratio(mine: float, theirs: float) -> float:
    """``mine`` over ``theirs`` (two p50s), or 0.0 where there is no ``theirs``."""
    return round(mine / theirs, 3) if theirs else 0.0


def summarise(scenario: Scenario, run: Run) -> dict[str, Any]:
    s = run.samples
    searched = [x for x in s if not x.skipped]
    return {
        "embedder": scenario.embedder,
        "embedder_latency": scenario.latency if scenario.embedder == "openai" else "in process",
        "rpc": "Converse" if scenario.converse else "Turn",
        "budget_ms": scenario.budget_ms,
        "turns": len(s),
        **percentiles([x.server_ms for x in s]),
        "within_budget": share([x.server_ms <= scenario.budget_ms for x in s]),
        "degraded": share([x.degraded for x in s]),
        "skipped": share([x.skipped for x in s]),
        "prefetched": share([x.prefetched for x in s]),
        "reranked": share(run.reranked),
        "searched_turns": {
            "turns": len(searched),
            **percentiles([x.server_ms for x in searched]),
            "degraded": share([x.degraded for x in searched]),
            "prefetched": share([x.prefetched for x in searched]),
            "client_round_trip": percentiles([x.client_ms for x in searched]),
        },
        "client_round_trip": percentiles([x.client_ms for x in s]),
    }


async def run_diy(config: Config, calls: list[list[str]]) -> list[tuple[str, float]]:
    """The DIY system (``bench.diy_turn``) over the same calls, paced alike."""
    diy = await asyncio.to_thread(Diy, config, WORK / "diy")
    try:
        return await diy_turn.run_calls(diy, calls, CONCURRENCY, pause_s)
    finally:
        await diy.aclose()


def against_diy(
    turn: dict[str, Any], turn_run: Run, diy: list[tuple[str, float]], calls: list[list[str]]
) -> dict[str, Any]:
    """``Turn`` beside the DIY system, both timed by the client: over every turn, over the
    turns the sidecar searched (the DIY system searches all; the sidecar answers the others
    without searching), and over each call's first turn (no conversation yet: one embedding,
    where a later turn may embed two queries, itself and the conversation folded in)."""
    searched = {x.text for x in turn_run.samples if not x.skipped}
    first = {c[0] for c in calls}
    every = percentiles([ms for _, ms in diy])
    only = percentiles([ms for text, ms in diy if text in searched])
    mine, mine_searched = turn["client_round_trip"], turn["searched_turns"]["client_round_trip"]
    return {
        "diy": {
            "turns": len(diy),
            **every,
            "searched_by_voxrecall": only,
            "first_turns": percentiles([ms for text, ms in diy if text in first]),
        },
        "turn_client": mine,
        "turn_client_searched": mine_searched,
        "turn_client_first_turns": percentiles(
            [x.client_ms for x in turn_run.samples if x.text in first and not x.skipped]
        ),
        "turn_server": {k: turn[k] for k in ("p50_ms", "p95_ms", "p99_ms")},
        "turn_server_first_turns": percentiles(
            [x.server_ms for x in turn_run.samples if x.text in first and not x.skipped]
        ),
        # the RPC's share of a Turn: the client's time less the server's, per searched turn
        "turn_rpc": percentiles(
            [x.client_ms - x.server_ms for x in turn_run.samples if not x.skipped]
        ),
        "turn_over_diy_p50": ratio(mine["p50_ms"], every["p50_ms"]),
        "searched_turn_over_diy_p50": ratio(mine_searched["p50_ms"], only["p50_ms"]),
        "goal_met": bool(diy) and mine["p50_ms"] <= every["p50_ms"],
    }


async def diy_beside(
    turn: dict[str, Any], turn_run: Run, config: Config, calls: list[list[str]]
) -> dict[str, Any]:
    """``against_diy``, or ``{"skipped": REASON}`` where pgvector cannot run here."""
    try:
        measured = await run_diy(config, calls)
    except Unavailable as exc:
        return {"skipped": str(exc)}
    out = against_diy(turn, turn_run, measured, calls)
    log.info(
        "diy_pgvector: Turn p50 %.1f ms, DIY p50 %.1f ms (client's time; ratio %.3f)",
        out["turn_client"]["p50_ms"], out["diy"]["p50_ms"], out["turn_over_diy_p50"],
    )  # fmt: skip
    return out


def scenario_line(name: str, summary: dict[str, Any]) -> str:
    """One line of a scenario's figures, for the progress log."""
    return (
        f"{name}: {summary['turns']} turns, p50 {summary['p50_ms']:.1f} ms, p99 "
        f"{summary['p99_ms']:.1f} ms, within budget {summary['within_budget']:.0%}, degraded "
        f"{summary['degraded']:.0%}, skipped {summary['skipped']:.0%}"
    )


def removed(before: dict[str, Any], after: dict[str, Any]) -> dict[str, float]:
    """How much of the searched turns' server-side latency prefetch removed."""
    out: dict[str, float] = {}
    for p in ("p50_ms", "p95_ms"):
        b, a = before["searched_turns"][p], after["searched_turns"][p]
        out[f"{p}_without"] = b
        out[f"{p}_with"] = a
        out[f"{p}_share_removed"] = round(1 - a / b, 3) if b else 0.0
    return out


async def run(quick: bool) -> dict[str, Any]:
    """The ``turn`` suite of ``python -m bench``: every scenario, and what prefetch removes."""
    if not (FAQ.is_file() and DSTC11.is_file()):  # its turns are real questions from the data
        return {"skipped": f"shared data not present: {DATA}"}
    calls = workload(quick)
    server, openai_port = start_openai_server()
    try:
        configs = {
            name: write_config(WORK / name, name, openai_port) for name in ("local", "openai")
        }
        for name, config in configs.items():
            await asyncio.to_thread(build, config, name)
        results: dict[str, Any] = {}
        diy: dict[str, Any] = {"skipped": "--quick runs no peer"}
        for scenario in SCENARIOS:
            set_latency(openai_port, scenario.latency)
            run = await run_scenario(scenario, configs[scenario.embedder], calls)
            results[scenario.name] = summarise(scenario, run)
            log.info("%s", scenario_line(scenario.name, results[scenario.name]))
            if scenario.name == "local_default" and not quick:  # --quick runs no peer
                diy = await diy_beside(results[scenario.name], run, configs["local"], calls)
    finally:
        server.terminate()
        server.wait(timeout=30)
    from bench import turn_breakdown  # it imports this module's workload

    breakdown = await turn_breakdown.run(quick)
    return {
        "suite": "turn",
        "quick": quick,
        "calls": len(calls),
        "turns": sum(len(c) for c in calls),
        "concurrency": CONCURRENCY,
        "word_s": WORD_S,
        "endpoint_s": list(ENDPOINT_S),
        "prefetch_stable_ms": configs["local"].sidecar.prefetch_stable_ms,
        "scenarios": results,
        # the same turns through what a team builds instead: embed in the client, pgvector
        "turn_vs_diy": diy,
        "prefetch_removes": {
            base: removed(results[base], results[f"{base}_prefetch"])
            for base in ("local_default", "openai_realistic", "remote_80_200")
        },
        # what the rerank stage adds to a searched turn's server-side p50 (same run)
        "rerank_adds_ms": {
            name: round(
                results[name]["searched_turns"]["p50_ms"]
                - results["local_default"]["searched_turns"]["p50_ms"],
                2,
            )
            for name in ("local_rerank", "local_rerank_40ms")
        },
        "env": {"python": platform.python_version(), "cpus": os.cpu_count()},
        # where local_default's server-side time goes (``bench.turn_breakdown``, in process)
        "breakdown": breakdown,
    }


# The rerank stage alone: a budget no embedding misses, the two sidecars taking turns, so that
# load from elsewhere falls on both alike (the difference of each round's p50s is the cost).
RERANK_ROUNDS = 3
RERANK_PAIR = (
    Scenario("plain_1000", "local", 1000, converse=False),
    Scenario("rerank_1000", "local", 1000, converse=False, rerank_s=0.0),
)


async def rerank_overhead(quick: bool) -> dict[str, Any]:
    """``--rerank``: what the rerank stage (a local Cohere-shaped server answering at once) adds
    to a searched turn's server-side p50, over RERANK_ROUNDS alternating rounds."""
    calls = workload(quick)
    config = write_config(WORK / "local", "local", 0)
    await asyncio.to_thread(build, config, "local")
    rounds = []
    for _ in range(RERANK_ROUNDS):
        p50 = {}
        for scenario in RERANK_PAIR:
            measured = summarise(scenario, await run_scenario(scenario, config, calls))
            p50[scenario.name] = measured["searched_turns"]["p50_ms"]
            p50[f"{scenario.name}_reranked"] = measured["reranked"]
        p50["added_ms"] = round(p50["rerank_1000"] - p50["plain_1000"], 2)
        rounds.append(p50)
        print(json.dumps(p50), flush=True)
    added = sorted(r["added_ms"] for r in rounds)
    return {"rounds": rounds, "median_added_ms": added[len(added) // 2]}


# Turn against the DIY system alone: the two take turns, round after round, so that load from
# elsewhere falls on both alike (the goal: Turn p50 <= DIY p50, at CONCURRENCY callers).
DIY_ROUNDS = 3


async def diy_rounds(quick: bool) -> dict[str, Any]:
    """``--diy``: ``local_default``, the same as ``Turn`` over HTTP (``/v1/turn``, aiohttp),
    ``local_default_prefetch`` (``Converse``: interims ahead of each final), gRPC's floor
    (``grpc_floor``), HTTP's floor (``http_floor``) and the DIY system over the same calls, in
    that order, DIY_ROUNDS times."""
    calls = workload(quick)
    config = write_config(WORK / "local", "local", 0)
    await asyncio.to_thread(build, config, "local")
    scenario, converse = SCENARIOS[0], SCENARIOS[1]  # local_default, local_default_prefetch
    rounds = []
    loads = [os.getloadavg()]
    for _ in range(DIY_ROUNDS):
        turn_run = await run_scenario(scenario, config, calls)
        summary = summarise(scenario, turn_run)
        http_run = await run_http_turns(scenario, config, calls)
        converse_run = await run_scenario(converse, config, calls)
        floor = await grpc_floor(turn_run.answer or pb.TurnResponse(), calls)
        floor_http = await http_floor(http_run.answer_json or b"{}", calls)
        diy = await run_diy(config, calls)
        rounds.append(against_diy(summary, turn_run, diy, calls))
        rounds[-1].update(floor_beside(rounds[-1], floor))
        rounds[-1].update(http_beside(rounds[-1], http_run, floor_http))
        rounds[-1].update(converse_beside(converse_run, diy))
        loads.append(os.getloadavg())
        print(json.dumps(rounds[-1]), flush=True)
    return {
        "concurrency": CONCURRENCY,
        "turns": sum(len(c) for c in calls),
        # the callers' pace and the sidecar's prefetch setting the Converse round ran at
        "word_s": WORD_S,
        "endpoint_s": list(ENDPOINT_S),
        "prefetch_stable_ms": config.sidecar.prefetch_stable_ms,
        "rounds": rounds,
        **medians(rounds),
        "load_average": os.getloadavg(),
        # at the start and after each round: (1, 5, 15 minutes)
        "load_averages": loads,
    }


RATIOS = ("turn_over_diy_p50", "turn_http_over_diy_p50", "converse_over_diy_p50")


def medians(rounds: list[dict[str, Any]]) -> dict[str, float]:
    """Each of RATIOS's median over the rounds, as ``median_`` + its name."""
    out = {}
    for name in RATIOS:
        ratios = sorted(r[name] for r in rounds)
        out[f"median_{name}"] = ratios[len(ratios) // 2]
    return out


def converse_beside(converse: Run, diy: list[tuple[str, float]]) -> dict[str, Any]:
    """``Converse`` (``local_default_prefetch``) in the same round as the DIY system, both by
    the client's clock from the final transcript: over every final user turn and over the ones
    the sidecar searched (against the DIY system's time for the same texts), the share answered
    from a prefetch, and the client's time of those and of the searched ones that were not."""
    samples = converse.samples
    searched = [x for x in samples if not x.skipped]
    texts = {x.text for x in searched}
    mine = percentiles([x.client_ms for x in samples])
    mine_searched = percentiles([x.client_ms for x in searched])
    every = percentiles([ms for _, ms in diy])
    only = percentiles([ms for text, ms in diy if text in texts])
    return {
        "converse_client": mine,
        "converse_client_searched": mine_searched,
        "converse_client_prefetched": percentiles([x.client_ms for x in searched if x.prefetched]),
        "converse_client_not_prefetched": percentiles(
            [x.client_ms for x in searched if not x.prefetched]
        ),
        "converse_server": percentiles([x.server_ms for x in samples]),
        "converse_prefetched": share([x.prefetched for x in samples]),
        "converse_prefetched_searched": share([x.prefetched for x in searched]),
        "converse_over_diy_p50": ratio(mine["p50_ms"], every["p50_ms"]),
        "searched_converse_over_diy_p50": ratio(mine_searched["p50_ms"], only["p50_ms"]),
        "converse_goal_met": bool(diy and samples) and mine["p50_ms"] <= every["p50_ms"],
        # the sidecar's query cache over the round (the warm-up turn included): hits among
        # the lookups (a final reading its prefetch's vectors counts hits: Engine._said_ahead)
        "converse_query_embeddings": converse.embeddings,
        "converse_query_cache_hit_share": ratio(
            converse.embeddings.get("hit", 0.0),
            converse.embeddings.get("hit", 0.0) + converse.embeddings.get("miss", 0.0),
        ),
    }


def floor_beside(round_: dict[str, Any], floor: Run) -> dict[str, Any]:
    """gRPC's own cost of a call at this pace (``bench.grpc_floor``: the client's time to a
    server answering at once) beside the RPC's share of a ``Turn`` in the same round: the share
    above the floor is what the sidecar's own path outside ``timings.total_ms`` adds."""
    measured = percentiles([x.client_ms for x in floor.samples])
    rpc = round_["turn_rpc"]["p50_ms"]
    return {
        "grpc_floor": measured,
        "turn_rpc_above_floor_p50_ms": round(rpc - measured["p50_ms"], 2),
    }


def http_beside(round_: dict[str, Any], http_run: Run, floor: Run) -> dict[str, Any]:
    """``Turn`` over HTTP (``/v1/turn``) in the same round, by the client's clock: its p50 against
    the round's DIY p50, its RPC share (the client's time less ``timings.total_ms``, per searched
    turn) and HTTP's floor at this pace (``http_floor``)."""
    samples = http_run.samples
    searched = [x for x in samples if not x.skipped]
    mine = percentiles([x.client_ms for x in samples])
    rpc = percentiles([x.client_ms - x.server_ms for x in searched])
    measured = percentiles([x.client_ms for x in floor.samples])
    diy = round_.get("diy", {}).get("p50_ms", 0.0)
    return {
        "turn_http_client": mine,
        "turn_http_client_searched": percentiles([x.client_ms for x in searched]),
        "turn_http_server": percentiles([x.server_ms for x in samples]),
        "turn_http_rpc": rpc,
        "http_floor": measured,
        "turn_http_rpc_above_floor_p50_ms": round(rpc["p50_ms"] - measured["p50_ms"], 2),
        "turn_http_over_diy_p50": ratio(mine["p50_ms"], diy),
        "turn_http_goal_met": bool(diy) and mine["p50_ms"] <= diy,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=plain(__doc__))
    parser.add_argument("--quick", action="store_true", help="30 turns per scenario")
    parser.add_argument("--rerank", action="store_true", help="only the rerank stage's cost")
    parser.add_argument("--diy", action="store_true", help="only Turn against the DIY system")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    if args.diy:
        result = asyncio.run(diy_rounds(args.quick))
        path = RESULTS.with_name("turn_diy.json")
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(result, indent=2) + "\n", encoding="utf-8")
        print(json.dumps(result, indent=2))
        return
    if args.rerank:
        result = asyncio.run(rerank_overhead(args.quick))
        path = RESULTS.with_name("turn_rerank.json")
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(result, indent=2) + "\n", encoding="utf-8")
        print(json.dumps(result, indent=2))
        return
    out = asyncio.run(run(args.quick))
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps(out, indent=2) + "\n", encoding="utf-8")
    print(json.dumps(out["prefetch_removes"], indent=2))


if __name__ == "__main__":
    main()
