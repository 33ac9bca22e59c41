"""A config that only serves names its bases with no ``[[knowledge_base.source]]``: the sidecar
serves them; only ``voxrecall index build`` needs sources, and it says so in one line. A
serve-only config had to declare sources it never read ("at least one
[[knowledge_base.source]] is required").

Real parts: a config file read by the ``voxrecall`` command's loader, a real sidecar on
127.0.0.1 port 0 over a real local store, the ``voxrecall`` command itself.
"""

from __future__ import annotations

from pathlib import Path

import grpc
import pytest

from index.embedders.base import HashEmbedder
from sidecar.cli import main
from sidecar.config import load_config
from sidecar.edge.server import create_server
from sidecar.gen import retrieval_pb2_grpc as pb_grpc
from tests.bases_kit import LOAD_WAIT_S, search
from tests.snapshot_kit import version_id, write_version

EMBEDDER = HashEmbedder(dimension=64)


def serve_only(tmp_path: Path) -> Path:
    path = tmp_path / "sidecar.toml"
    path.write_text(
        '[[knowledge_base]]\nname = "help"\nfallback = "I could not find that."\n\n'
        '[sidecar]\nstore = "store"\nlisten = "127.0.0.1:0"\nmin_score = -1.0\n',
        encoding="utf-8",
    )
    return path


async def test_a_base_with_no_source_is_served(tmp_path: Path) -> None:
    write_version(tmp_path / "store", version_id(1), EMBEDDER, "password", kb="help")
    config = load_config(serve_only(tmp_path))
    assert [kb.name for kb in config.knowledge_bases] == ["help"]
    sidecar = await create_server(config, embedder=EMBEDDER, poll=False)
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{sidecar.port}") as channel:
            stub = pb_grpc.RetrievalStub(channel)  # type: ignore[no-untyped-call]
            resp = await stub.Search(search("help"), timeout=LOAD_WAIT_S)
    finally:
        await sidecar.stop(0.5)
    assert resp.chunks


def test_building_a_base_with_no_source_says_what_it_needs(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["index", "build", "--config", str(serve_only(tmp_path))]) == 2
    (error,) = capsys.readouterr().err.strip().splitlines()
    assert error.startswith("error: knowledge base 'help' has no [[knowledge_base.source]]")
    assert "a config that only serves it needs none" in error
