"""The systems a user would pick instead of voxrecall, each optional (the ``bench`` extra).

Each module has ``open_system(corpus, cache, target_recall) -> SyncSystem``; it raises
``bench.measure.Unavailable`` when its package is missing or its server cannot start here, and
the suite reports that system as skipped with the reason. Built indexes are cached under
``cache`` keyed by the corpus and the build parameters, so a rerun measures queries only.
Servers listen on 127.0.0.1 only and are stopped by ``close`` (the suite calls it on error too).
"""

from __future__ import annotations

M = 16  # graph degree of every HNSW peer: hnswlib's and voxrecall's default
EF_CONSTRUCTION = 200  # likewise, so that graphs of equal quality are compared
