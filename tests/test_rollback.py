"""``voxrecall index rollback``: a kept older version published again as a new version.

A sidecar refuses a pointer that goes back (``test_a_pointer_going_backwards_is_refused``), so
a rollback is a roll forward: the old version's files under a newer id, which a running sidecar
takes at its next poll as it takes any new build.
"""

from __future__ import annotations

import asyncio
from functools import partial
from pathlib import Path

import pytest

from index.embedders.base import Embedder, FakeEmbedder
from index.snapshot import read_manifest, sha256_file, verify_fetched
from index.store import LocalStore
from sidecar.cli import main
from tests.snapshot_kit import KB, flip_a_byte, version_id
from tests.test_refresh import (
    Store,
    eventually,
    kb_status,
    publish,
    running,
    search,
    serving,
    sidecar_config,
    store,  # noqa: F401 (the fixture)
)


def config_file(tmp_path: Path, root: Path, keep: int = 3) -> Path:
    """A config whose [index] store is ``root``, with the one base the snapshot kit writes."""
    path = tmp_path / "voxrecall.toml"
    path.write_text(
        f'[index]\nstore = "{root}"\nkeep_versions = {keep}\n\n'
        f'[[knowledge_base]]\nname = "{KB}"\n'
        f'[[knowledge_base.source]]\nname = "faq"\ntype = "markdown"\npath = "{tmp_path}"\n',
        encoding="utf-8",
    )
    return path


def rollback(config: Path, version: str, kb: str = KB) -> int:
    return main(["index", "rollback", "--config", str(config), "--kb", kb, "--to", version])


async def test_a_rollback_publishes_the_old_content_as_a_new_version_a_sidecar_swaps_to(
    store: Store,  # noqa: F811 (the fixture)
    tmp_path: Path,
    local_embedder: Embedder,
    capsys: pytest.CaptureFixture[str],
) -> None:
    v1 = await publish(store.root, 1, local_embedder, "password")
    v2 = await publish(store.root, 2, local_embedder, "roaming")
    config = config_file(tmp_path, store.root)
    async with running(sidecar_config(store, tmp_path), local_embedder) as sidecar:
        assert await serving(sidecar.port, v2)
        assert await asyncio.to_thread(rollback, config, v1) == 0
        local = LocalStore(store.root)
        v3 = local.latest(KB)
        assert v3 is not None
        assert v3 > v2
        assert capsys.readouterr().out == f"{KB}: published {v1}'s content as {v3}\n"
        old, new = local.version_dir(KB, v1), local.version_dir(KB, v3)
        manifest = verify_fetched(new)  # every file as the manifest says, the graph readable
        assert (manifest.version, manifest.extra["rolled_back_from"]) == (v3, v1)
        assert manifest.files == read_manifest(old).files
        assert all(sha256_file(new / n) == h for n, h in manifest.files.items())
        await eventually(partial(serving, sidecar.port, v3), f"the rollback {v3} served")
        resp = await search(sidecar.port, "Tell me about password")
        assert resp.snapshot_version == v3
        assert resp.chunks[0].title == "Password"  # v1's content, not v2's roaming
        assert (await kb_status(sidecar.port)).last_refusal == ""
        assert sidecar.holder.refusals.total() == 0
    assert local.versions(KB) == [v1, v2, v3]  # nothing of the old ones deleted (keep 3)


async def test_a_rollback_is_carried_on_by_publish(
    tmp_path: Path, local_embedder: Embedder, capsys: pytest.CaptureFixture[str]
) -> None:
    root = tmp_path / "built"
    v1 = await publish(root, 1, local_embedder, "password")
    await publish(root, 2, local_embedder, "roaming")
    config = config_file(tmp_path, root)
    assert rollback(config, v1) == 0
    v3 = LocalStore(root).latest(KB)
    assert v3 is not None
    edge = tmp_path / "edge"
    assert main(["index", "publish", "--config", str(config), "--to", str(edge)]) == 0
    assert LocalStore(edge).latest(KB) == v3
    assert verify_fetched(LocalStore(edge).version_dir(KB, v3)).extra["rolled_back_from"] == v1


async def test_a_rollback_to_a_pruned_or_unknown_version_or_base_is_refused(
    tmp_path: Path, local_embedder: Embedder, capsys: pytest.CaptureFixture[str]
) -> None:
    root = tmp_path / "built"
    for n, topic in enumerate(("password", "roaming", "voicemail"), start=1):
        await publish(root, n, local_embedder, topic)
    LocalStore(root).prune(KB, keep=2)  # what the next build does with keep_versions = 2
    config = config_file(tmp_path, root, keep=2)
    capsys.readouterr()
    for version in (version_id(1), "20990101T000000000000Z-nothere"):
        assert rollback(config, version) == 2
        err = capsys.readouterr().err
        assert err.startswith(f"error: no version {version!r} of {KB!r} in {root}")
        assert err.endswith(f"kept: {version_id(3)!r}, {version_id(2)!r}\n")
        assert err.count("\n") == 1
    assert rollback(config, version_id(2), kb="nope") == 2
    err = capsys.readouterr().err
    assert err == f"error: no [[knowledge_base]] named 'nope' in {config} (configured: {KB!r})\n"
    assert rollback(config, version_id(3)) == 2
    assert "is the published version already" in capsys.readouterr().err
    assert LocalStore(root).latest(KB) == version_id(3)
    assert LocalStore(root).versions(KB) == [version_id(2), version_id(3)]


async def test_a_version_that_fails_verification_is_not_rolled_back_to(
    tmp_path: Path, local_embedder: Embedder, capsys: pytest.CaptureFixture[str]
) -> None:
    root = tmp_path / "built"
    v1 = await publish(root, 1, local_embedder, "password")
    v2 = await publish(root, 2, local_embedder, "roaming")
    flip_a_byte(LocalStore(root).version_dir(KB, v1))
    capsys.readouterr()
    assert rollback(config_file(tmp_path, root), v1) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: {KB} {v1} fails verification: ")
    assert "sha256" in err
    assert err.count("\n") == 1
    assert LocalStore(root).latest(KB) == v2
    assert [p.name for p in (root / KB).iterdir() if p.name.startswith(".staging-")] == []


async def test_a_version_another_embedder_made_is_not_rolled_back_to(
    tmp_path: Path, local_embedder: Embedder, capsys: pytest.CaptureFixture[str]
) -> None:
    """The sidecars serving the published version refuse a snapshot of another embedder: the
    rollback says so rather than publish one nobody can serve."""
    root = tmp_path / "built"
    v1 = await publish(root, 1, FakeEmbedder(dimension=384), "password")
    v2 = await publish(root, 2, local_embedder, "roaming")
    capsys.readouterr()
    assert rollback(config_file(tmp_path, root), v1) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: {KB} {v1} was embedded by ")
    assert f"sidecars serving {v2} would refuse it" in err
    assert LocalStore(root).latest(KB) == v2
