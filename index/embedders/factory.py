"""Build the configured embedder. Loading a model takes a second: call it off the event loop."""

from __future__ import annotations

from index.config import LOCAL_MODEL, EmbedderConfig
from index.embedders.base import Embedder
from index.errors import ConfigError


def make_embedder(
    config: EmbedderConfig, *, threads: int | None = None, parallel: int = 1
) -> Embedder:
    """``threads`` overrides the local model's intra-op thread count; ``parallel`` texts are
    embedded side by side by the local model in a build (index builds: one per core)."""
    if config.provider == "openai":
        from index.embedders.remote import OpenAIEmbedder

        return OpenAIEmbedder(config)
    if config.model != LOCAL_MODEL:
        raise ConfigError(
            f'[embedder] provider = "local" ships one model, {LOCAL_MODEL!r}; got {config.model!r}'
        )
    from index.embedders.local import LocalEmbedder

    return LocalEmbedder(
        threads=threads or config.threads, batch_size=config.batch_size, parallel=parallel
    )
