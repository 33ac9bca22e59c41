"""Sharding bases across sidecars (sidecar/shards.py): the mapping is stable, balanced and moves
little when the fleet grows; a replica loads only its shard's bases; the client's router sends
each base to the sidecar that has it (real sidecars on port 0, real store)."""

from __future__ import annotations

import asyncio
import tomllib
from pathlib import Path

import grpc
import pytest
import yaml

from index.embedders.base import HashEmbedder
from index.errors import ConfigError
from sidecar.config import parse_config
from sidecar.edge.server import create_server
from sidecar.gen import retrieval_pb2 as pb
from sidecar.gen import retrieval_pb2_grpc as pb_grpc
from sidecar.shards import ShardRouter, in_shard, shard_of
from tests.conftest import REPO
from tests.snapshot_kit import version_id, write_version

EMBEDDER = HashEmbedder(dimension=32)
NAMES = [f"tenant-{i:05d}" for i in range(8000)]


def test_the_mapping_is_pinned() -> None:
    """The same function in every process, version and platform: sidecars and clients built
    apart must agree. These values are sha256 + jump hashing; they never change."""
    assert [shard_of(n, 8) for n in ("acme-support", "billing", "tenant-00042")] == [0, 0, 3]
    assert shard_of("anything", 1) == 0


def test_every_shard_gets_its_share() -> None:
    for shards in (3, 8, 16):
        counts = [0] * shards
        for name in NAMES:
            counts[shard_of(name, shards)] += 1
        mean = len(NAMES) / shards
        assert min(counts) >= 0.85 * mean, (shards, counts)
        assert max(counts) <= 1.15 * mean, (shards, counts)


def test_growing_the_fleet_moves_only_the_new_shards_share() -> None:
    moved = [n for n in NAMES if shard_of(n, 8) != shard_of(n, 9)]
    assert all(shard_of(n, 9) == 8 for n in moved)  # every move is into the new shard
    assert 0.08 <= len(moved) / len(NAMES) <= 0.14  # ~1/9


@pytest.mark.parametrize("shards", [0, -1, 1 << 17])
def test_a_shard_count_out_of_range_is_refused(shards: int) -> None:
    with pytest.raises(ValueError, match="shards"):
        shard_of("x", shards)


@pytest.mark.parametrize(
    ("sidecar", "match"),
    [({"shards": 0}, "shards"), ({"shards": 4, "shard": 4}, "shard"), ({"shard": -1}, "shard")],
)
def test_a_bad_shard_config_is_refused(tmp_path: Path, sidecar: dict[str, int], match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        parse_config({"sidecar": sidecar}, base=tmp_path)


def test_the_serve_flag_is_checked_against_the_config(tmp_path: Path) -> None:
    config = parse_config({"sidecar": {"shards": 4}}, base=tmp_path)
    assert config.with_overrides(shard=3).sidecar.shard == 3
    with pytest.raises(ConfigError, match="--shard"):
        config.with_overrides(shard=4)


async def _status_names(port: int) -> set[str]:
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
        stub = pb_grpc.RetrievalStub(channel)  # type: ignore[no-untyped-call]
        resp = await stub.Status(pb.StatusRequest(), timeout=10)
    return {kb.name for kb in resp.knowledge_bases if kb.snapshot_version}


async def test_each_replica_loads_only_its_shard_and_the_router_finds_every_base(
    tmp_path: Path,
) -> None:
    bases = [f"tenant-{i}" for i in range(9)]
    root = tmp_path / "store"
    for kb in bases:
        await asyncio.to_thread(write_version, root, version_id(1), EMBEDDER, "roaming", kb=kb)
    shards = 3
    sidecars = []
    try:
        for shard in range(shards):
            raw = {
                "sidecar": {
                    "store": str(root),
                    "listen": "127.0.0.1:0",
                    "shards": shards,
                    "shard": shard,
                    "min_score": -1.0,
                    "budget_ms": 5_000,
                }
            }
            config = parse_config(raw, base=tmp_path)  # names no base: serves the store's
            sidecars.append(await create_server(config, embedder=EMBEDDER, poll=False))
        loaded = [await _status_names(s.port) for s in sidecars]
        for shard, names in enumerate(loaded):
            assert names == set(in_shard(frozenset(bases), shard, shards))
        assert set().union(*loaded) == set(bases)
        assert sum(len(n) for n in loaded) == len(bases)  # each base on one shard only
        assert all(loaded), "a shard got no base: pick names that spread"

        router = ShardRouter([f"127.0.0.1:{s.port}" for s in sidecars])
        try:
            for kb in bases:
                resp = await router.client(kb).search("roaming abroad")
                assert resp.chunks, kb
            assert router.client(bases[0]) is router.client(bases[0])
            stubs = {id(router.client(kb).stub) for kb in bases}
            assert len(stubs) == shards  # a channel per shard, however many bases
        finally:
            await router.close()
    finally:
        for sidecar in sidecars:
            await sidecar.stop(0.5)


def fits(budget_mb: int, limit: str) -> bool:
    """A shard's pod of thousands of bases holds them under a memory budget (it loaded every
    base at start), sized by docs/config.md's rule: the process grows to about 1.6x the budget
    plus 100 MB, and keeps up to 64 + 32 MiB of pages outside it."""
    assert limit.endswith("Gi")
    return budget_mb > 0 and 1.6 * budget_mb + 100 + 96 <= int(limit[:-2]) * 1024


def test_the_sharded_manifest_is_consistent() -> None:
    """deploy/sharded.yaml: shard i's Deployment serves `--shard i` of the same count, its
    Service selects those pods, the agents list the Services in shard order, and the config
    parses (an s3 store, no base named: each replica serves its shard of what the store has,
    under a memory budget its pod's limit holds)."""
    docs = list(yaml.safe_load_all((REPO / "deploy" / "sharded.yaml").read_text()))
    kinds = {(d["kind"], d["metadata"]["name"]): d for d in docs}
    (config_map,) = [d for d in docs if d["kind"] == "ConfigMap"]
    config = parse_config(tomllib.loads(config_map["data"]["voxrecall.toml"]), base=REPO)
    assert str(config.sidecar.store).startswith("s3://")
    assert not config.knowledge_bases
    shards = sum(1 for kind, name in kinds if kind == "Deployment" and "-shard-" in name)
    targets = []
    for i in range(shards):
        pod = kinds[("Deployment", f"voxrecall-shard-{i}")]["spec"]["template"]
        (container,) = pod["spec"]["containers"]
        args = container["args"]
        assert args[args.index("--shards") + 1] == str(shards)
        assert args[args.index("--shard") + 1] == str(i)
        service = kinds[("Service", f"voxrecall-shard-{i}")]
        assert service["spec"]["selector"].items() <= pod["metadata"]["labels"].items()
        assert fits(config.sidecar.memory_budget_mb, container["resources"]["limits"]["memory"])
        targets.append(f"voxrecall-shard-{i}:{service['spec']['ports'][0]['port']}")
    agent = kinds[("Deployment", "voice-agent")]["spec"]["template"]["spec"]["containers"][0]
    env = {e["name"]: e.get("value") for e in agent["env"]}
    assert env["VOXRECALL_SHARDS"].split(",") == targets
