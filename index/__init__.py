"""voxrecall's batch indexer: sources -> chunks -> embeddings -> immutable snapshots.

The snapshot format, the configuration model and the embedders live here too, because the
sidecar reads what the indexer writes and must embed queries with the same model.
"""
