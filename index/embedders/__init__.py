"""Embedders: the one model a snapshot's chunk vectors and the sidecar's query vectors share."""

from index.embedders.base import Embedder, EmbedderInfo, FakeEmbedder, HashEmbedder

__all__ = ["Embedder", "EmbedderInfo", "FakeEmbedder", "HashEmbedder"]
