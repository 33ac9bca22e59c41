"""Every error voxrecall raises on purpose, in one tree.

    VoxrecallError
    ├── ConfigError            the config file or a flag is wrong; says which key
    ├── SourceError            a page could not be read; the build skips it unless strict
    ├── EmbedderError          the model could not be loaded or did not answer
    ├── LlmError               the [index.llm] chat model could not be used for a build
    │   └── SpendCapReached    a build reached [index.llm] max_build_tokens: nothing published
    ├── RegistryError          the approved-sources registry is unreadable or an entry unknown
    ├── SnapshotError
    │   ├── SnapshotNotFound   the store has no published snapshot for a base yet
    │   ├── CorruptSnapshot    a file is missing, or its checksum or counts disagree
    │   ├── IncompatibleSnapshot  another format version, embedder or dimension
    │   ├── IncompleteSnapshot the pointer names a version whose files are not all there (yet)
    │   ├── StoreUnavailable   the store did not answer, or answered an error; retried later
    │   └── CacheWriteError    a download could not be written locally (disk full, permissions)
    └── RequestError           a call's input or state (sidecar.errors: the sidecar's branch)
        ├── InvalidArgument    BodyTooLarge, FilterRefused, ToolCallError below it
        ├── NotFound
        ├── Unavailable        Loading below it: a base loading, retry after a pause
        ├── ResourceExhausted
        ├── IdleTimeout
        └── Unauthenticated

Lower-level errors (hnswlib, onnxruntime, openai, OSError) are wrapped where they arise with
``raise ... from exc``, so a caller handles one family and still sees the cause. Each class
maps to one gRPC status and one HTTP status in one table (``sidecar.edge.status``); none of these
modules imports gRPC.
"""

from __future__ import annotations


class VoxrecallError(Exception):
    """Base of every error voxrecall raises on purpose."""


class ConfigError(VoxrecallError):
    """The configuration is invalid: the message names the file and key."""


class SourceError(VoxrecallError):
    """A source or one of its pages could not be read."""


class EmbedderError(VoxrecallError):
    """The embedder could not be loaded, failed, or returned something unusable."""


class LlmError(VoxrecallError):
    """The indexer's chat model (``[index.llm]``) is unusable for the whole build."""


class SpendCapReached(LlmError):
    """A build used its token budget (``[index.llm] max_build_tokens``); nothing was published."""


class RegistryError(VoxrecallError):
    """The registry of proposed sources is unreadable, or a command named an unknown entry."""


class SnapshotError(VoxrecallError):
    """A snapshot could not be found, read or trusted."""


class SnapshotNotFound(SnapshotError):
    """The store holds no published snapshot for the knowledge base."""


class CorruptSnapshot(SnapshotError):
    """A snapshot's files disagree with its manifest (missing file, checksum, counts)."""


class IncompatibleSnapshot(SnapshotError):
    """A snapshot was written in another format or with another embedder than ours."""


class IncompleteSnapshot(SnapshotError):
    """A published version's manifest or files are missing: half-uploaded, so retried later."""


class StoreUnavailable(SnapshotError):
    """The store could not be reached or answered an error; the next poll tries again."""


class CacheWriteError(SnapshotError):
    """A downloaded snapshot could not be written to the local cache (disk full, permissions)."""
