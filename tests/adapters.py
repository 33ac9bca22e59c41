"""What the adapter tests share: the example help centre served with a knowledge function."""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import replace
from typing import Any

import pytest

from index.embedders.base import Embedder
from sidecar.config import Config, FunctionConfig

KNOWLEDGE_SEARCH = FunctionConfig(
    name="knowledge_search",
    description="Northwind Mobile help: plans, prices, roaming, voicemail, passwords. Call it "
    "before answering any question about the caller's phone service.",
    knowledge_base="docs",
    limit=3,
)
# Questions the example help centre (examples/kb) answers, each from one page.
ROAMING = "How much does roaming cost in Europe?"  # roaming.md
VOICEMAIL = "How do I set up voicemail?"  # voicemail.md
PASSWORD = "How do I reset my password?"  # reset-password.md


@pytest.fixture(name="knowledge_sidecar")
async def knowledge_sidecar_fixture(
    example_config: Config, local_embedder: Embedder
) -> AsyncIterator[Any]:
    """A real sidecar on port 0 over the session's example help centre snapshot (the
    repository's own base: these tests run on any machine).

    Import ``knowledge_sidecar_fixture`` into a test module to use ``knowledge_sidecar``.
    """
    from sidecar.edge.server import create_server

    config = replace(example_config, functions=(KNOWLEDGE_SEARCH,))
    sidecar = await create_server(config, embedder=local_embedder, poll=False)
    yield sidecar
    await sidecar.stop(0.5)
