"""What the adapter tests share: the Windows Terminal docs served with a knowledge function."""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import replace
from typing import Any

import pytest

from index.embedders.base import Embedder
from sidecar.config import Config, FunctionConfig

KNOWLEDGE_SEARCH = FunctionConfig(
    name="knowledge_search",
    description="Windows Terminal documentation. Call it for any question about the terminal.",
    knowledge_base="docs",
    limit=3,
)


@pytest.fixture(name="knowledge_sidecar")
async def knowledge_sidecar_fixture(
    wt_config: Config, local_embedder: Embedder
) -> AsyncIterator[Any]:
    """A real sidecar on port 0 over the session's Windows Terminal snapshot.

    Import ``knowledge_sidecar_fixture`` into a test module to use ``knowledge_sidecar``.
    """
    from sidecar.edge.server import create_server

    config = replace(wt_config, functions=(KNOWLEDGE_SEARCH,))
    sidecar = await create_server(config, embedder=local_embedder, poll=False)
    yield sidecar
    await sidecar.stop(0.5)
