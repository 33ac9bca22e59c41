"""The project's clients (``Voxrecall``, ``voxrecall ask``: ``sidecar.connection``'s channels)
retry a call refused UNAVAILABLE by a gRPC retry policy: a base loading under ``[sidecar]
memory_budget_mb`` is asked again after the sidecar's hint, within the call's deadline; a base
with no snapshot is not (its refusal's hint is negative), and every refusal keeps its call id.

Real parts: a real sidecar on 127.0.0.1 port 0 over a real local store (the hash embedder: a
small base that loads at once), the project's own client over a real channel. Attempts are
counted where the sidecar looks the call's base up (``Engine.searcher``, once per attempt).
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import grpc
import pytest

from index.embedders.base import HashEmbedder
from sidecar.adapters.client import Voxrecall
from sidecar.cli import ask_failure, main
from sidecar.edge.lifecycle import State
from sidecar.edge.logs import CALL_ID_HEADER
from sidecar.edge.server import Sidecar, create_server
from sidecar.edge.status import trailers_for
from sidecar.errors import Loading
from sidecar.gen import retrieval_pb2_grpc as pb_grpc
from tests.bases_kit import LOAD_WAIT_S, config, search
from tests.snapshot_kit import version_id, write_version

EMBEDDER = HashEmbedder(dimension=64)


@contextlib.asynccontextmanager
async def serving(tmp_path: Path, **sidecar: Any) -> AsyncIterator[tuple[Sidecar, list[str]]]:
    """A sidecar over a store holding ``help``; the bases its calls looked up, one per attempt."""
    store = tmp_path / "store"
    write_version(store, version_id(1), EMBEDDER, "password", kb="help")
    cfg = config(store, tmp_path, cache_dir=str(tmp_path / "cache"), **sidecar)
    running = await create_server(cfg, embedder=EMBEDDER, poll=False)
    attempts: list[str] = []
    running.engine.searcher = counted(running.engine.searcher, attempts)  # type: ignore[method-assign]
    try:
        yield running, attempts
    finally:
        await running.stop(0.5)


def counted(searcher: Callable[[str], Any], attempts: list[str]) -> Callable[[str], Any]:
    def looked_up(kb: str) -> Any:
        attempts.append(kb)
        return searcher(kb)

    return looked_up


def trailers(exc: grpc.aio.AioRpcError) -> dict[str, str]:
    return dict(exc.trailing_metadata() or ())  # type: ignore[arg-type]


async def test_the_client_asks_again_for_a_base_loading_after_the_sidecars_hint(
    tmp_path: Path,
) -> None:
    """It answered UNAVAILABLE "is loading" at the first call, once, and the agent's turn went
    without knowledge; now the same call is sent again within its deadline. (Whether the base is
    in by the last attempt is the machine's speed; that it was asked again is not.)"""
    async with serving(tmp_path, memory_budget_mb=64) as (sidecar, attempts):
        # a deadline no hint passes (the first is 100 ms), so that a retry is always in it
        client = Voxrecall(
            f"127.0.0.1:{sidecar.port}", knowledge_base="help", turn_timeout_s=LOAD_WAIT_S
        )
        refused: grpc.aio.AioRpcError | None = None
        try:
            got = await client.search("reset my password")
        except grpc.aio.AioRpcError as exc:  # still loading at every attempt
            refused = exc
        finally:
            await client.close()
    if refused is not None:
        assert refused.code() is grpc.StatusCode.UNAVAILABLE
        assert "is loading" in str(refused.details())
    else:
        assert got.chunks
    assert attempts[:2] == ["help", "help"]


async def test_a_base_with_no_snapshot_is_not_asked_again(tmp_path: Path) -> None:
    """Nothing to retry for: a retry would spend the caller's turn waiting for a snapshot that
    no poll brings within it."""
    kb = {"name": "ghost", "source": [{"type": "markdown", "path": str(tmp_path)}]}
    async with serving(tmp_path, tables={"knowledge_base": [kb]}) as (sidecar, attempts):
        client = Voxrecall(f"127.0.0.1:{sidecar.port}", knowledge_base="ghost")
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await client.search("anything")
        await client.close()
    assert refused.value.code() is grpc.StatusCode.UNAVAILABLE
    assert "has no snapshot loaded" in str(refused.value.details())
    assert trailers(refused.value)["grpc-retry-pushback-ms"] == "-1"
    assert CALL_ID_HEADER in trailers(refused.value)
    assert attempts == ["ghost"]


async def test_ask_shows_the_loading_refusal_as_the_sidecar_sent_it(tmp_path: Path) -> None:
    """It said no sidecar answered and told the user to start one: the loading refusal's
    trailers (its retry hint) replaced the call id that tells a sidecar's answer apart."""
    async with serving(tmp_path, memory_budget_mb=64) as (sidecar, _):
        target = f"127.0.0.1:{sidecar.port}"
        async with grpc.aio.insecure_channel(target) as channel:  # no retry policy: one answer
            stub = pb_grpc.RetrievalStub(channel)  # type: ignore[no-untyped-call]
            with pytest.raises(grpc.aio.AioRpcError) as loading:
                await stub.Search(search("help"), timeout=LOAD_WAIT_S)
    assert "is loading" in str(loading.value.details())
    assert CALL_ID_HEADER in trailers(loading.value)
    assert int(trailers(loading.value)["grpc-retry-pushback-ms"]) > 0
    said = ask_failure(loading.value, target, Path("sidecar.toml"))
    assert said == f"error: UNAVAILABLE: {loading.value.details()}"


def test_ask_with_no_sidecar_names_the_config_it_was_given(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """It named voxrecall.toml whatever --config said."""
    path = tmp_path / "sidecar.toml"
    path.write_text('[sidecar]\nlisten = "127.0.0.1:1"\n', encoding="utf-8")  # nothing there
    assert main(["ask", "--config", str(path), "How do I reset my password?"]) == 1
    err = capsys.readouterr().err
    assert (
        f"no voxrecall sidecar answered at 127.0.0.1:1 (-v shows gRPC's reason): start one with "
        f"`voxrecall serve --config {path}`" in err
    )


async def test_a_turn_of_the_client_is_retried_too(tmp_path: Path) -> None:
    """Turn (what an agent sends every caller turn) takes the same policy as Search."""
    async with serving(tmp_path, memory_budget_mb=64) as (sidecar, attempts):
        target = f"127.0.0.1:{sidecar.port}"
        async with Voxrecall(target, knowledge_base="help", turn_timeout_s=LOAD_WAIT_S) as client:
            with contextlib.suppress(grpc.aio.AioRpcError):
                await client.turn("call-1", "how do I reset my password")
    assert attempts[:2] == ["help", "help"]


@pytest.mark.parametrize("hint_ms", [1000, 5000])
async def test_a_hint_past_the_turns_deadline_answers_the_refusal_at_once(
    tmp_path: Path, hint_ms: int
) -> None:
    """A base downloading (a hint of 1,000 ms) or held for room (up to 5,000 ms) for a 1 s turn:
    the client's retry policy waited out the hint past its deadline, and the caller got
    DEADLINE_EXCEEDED with no word of the base loading. Now the hint is -1 (a retry would not
    fit): the caller reads "is loading, retry in about N ms" from the one attempt."""
    async with serving(tmp_path, memory_budget_mb=64) as (sidecar, attempts):
        sidecar.engine.load_on_demand = lambda kb, peer: hint_ms
        async with Voxrecall(f"127.0.0.1:{sidecar.port}", knowledge_base="help") as client:
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                await client.turn("call-1", "how do I reset my password")
    assert refused.value.code() is grpc.StatusCode.UNAVAILABLE
    assert "is loading" in str(refused.value.details())
    assert f"retry in about {hint_ms} ms" in str(refused.value.details())
    assert trailers(refused.value)["grpc-retry-pushback-ms"] == "-1"
    assert CALL_ID_HEADER in trailers(refused.value)
    assert attempts == ["help"]


@pytest.mark.parametrize(
    ("retry_ms", "time_left_s", "sent"),
    [
        (100, None, "100"),  # no deadline: any hint fits
        (100, 1.0, "100"),
        (400, 0.6, "400"),
        (400, 0.45, "-1"),  # the retry would land within the margin of the deadline
        (1000, 1.0, "-1"),
        (5000, 1.0, "-1"),
    ],
)
def test_a_retry_hint_is_sent_only_when_the_retry_fits(
    retry_ms: int, time_left_s: float | None, sent: str
) -> None:
    error = Loading(f"retry in about {retry_ms} ms", retry_ms)
    assert trailers_for(error, time_left_s) == (("grpc-retry-pushback-ms", sent),)


async def test_a_draining_sidecar_is_not_asked_again(tmp_path: Path) -> None:
    """It answered every attempt alike, and the client spent a third of its turn on 4 attempts
    before "retry on another instance": now the refusal's hint is -1, and one attempt answers."""
    async with serving(tmp_path) as (sidecar, _):
        checks: list[State] = []
        accepting = sidecar.lifecycle.check_accepting

        def checked() -> None:
            checks.append(sidecar.lifecycle.state)
            accepting()

        sidecar.lifecycle.check_accepting = checked  # type: ignore[method-assign]
        sidecar.lifecycle.state = State.DRAINING  # what stop() sets first
        async with Voxrecall(f"127.0.0.1:{sidecar.port}", knowledge_base="help") as client:
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                await client.turn("call-1", "how do I reset my password")
    assert refused.value.code() is grpc.StatusCode.UNAVAILABLE
    assert "retry on another instance" in str(refused.value.details())
    assert trailers(refused.value)["grpc-retry-pushback-ms"] == "-1"
    assert CALL_ID_HEADER in trailers(refused.value)
    assert checks == [State.DRAINING]
