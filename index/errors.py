"""Every error voxrecall raises on purpose, in one tree.

    VoxrecallError
    ├── ConfigError            the config file or a flag is wrong; says which key
    │   └── CannotListen       an address to serve on is in use or cannot be bound
    ├── SourceError            a page could not be read; the build skips it unless strict
    ├── EmbedderError          the model could not be loaded or did not answer
    ├── LlmError               the [index.llm] chat model could not be used for a build
    │   └── SpendCapReached    a build reached [index.llm] max_build_tokens: nothing published
    ├── BaseTooLarge           a build's pages passed max_text_bytes: nothing published
    ├── RegistryError          the approved-sources registry is unreadable or an entry unknown
    ├── SnapshotError
    │   ├── SnapshotNotFound   the store has no published snapshot for a base yet
    │   ├── CorruptSnapshot    a file is missing, or its checksum or counts disagree
    │   │   └── GraphSearchFailed  a loaded graph could not answer a search (hnswlib refused)
    │   ├── IncompatibleSnapshot  another format version, embedder or dimension
    │   ├── IncompleteSnapshot the pointer names a version whose files are not all there (yet)
    │   ├── StoreUnavailable   the store did not answer, or answered an error, or this process
    │   │                      ran out of descriptors reading it (``unreadable``); retried later
    │   └── CacheWriteError    a download could not be written locally (disk full, permissions)
    └── RequestError           a call's input or state (sidecar.errors: the sidecar's branch)
        ├── InvalidArgument    FilterRefused, ToolCallError below it
        ├── NotFound
        ├── Unavailable        Loading below it: a base loading, retry after a pause
        ├── ResourceExhausted  BodyTooLarge below it (HTTP 413)
        ├── IdleTimeout
        └── Unauthenticated

Lower-level errors (hnswlib, onnxruntime, openai, OSError) are wrapped where they arise with
``raise ... from exc``, so a caller handles one family and still sees the cause. Each class
maps to one gRPC status and one HTTP status in one table (``sidecar.edge.status``); none of these
modules imports gRPC.
"""

from __future__ import annotations

import errno


class VoxrecallError(Exception):
    """Base of every error voxrecall raises on purpose."""


class ConfigError(VoxrecallError):
    """The configuration is invalid: the message names the file and key."""


class CannotListen(ConfigError):
    """An address the sidecar serves on (gRPC, the HTTP door, metrics) is in use or cannot be
    bound: the message names the address and the key (or flag) that set it."""

    def __init__(self, listen: str, key: str, reason: str) -> None:
        super().__init__(f"cannot listen on {listen} ({key}): {reason}")


class SourceError(VoxrecallError):
    """A source or one of its pages could not be read."""


class EmptyBuild(SourceError):
    """A build found no chunk where a snapshot is published: it is not published over it."""


class EmbedderError(VoxrecallError):
    """The embedder could not be loaded, failed, or returned something unusable."""


class LlmError(VoxrecallError):
    """The indexer's chat model (``[index.llm]``) is unusable for the whole build."""


class SpendCapReached(LlmError):
    """A build used its token budget (``[index.llm] max_build_tokens``); nothing was published."""


class BaseTooLarge(VoxrecallError):
    """A build's pages held more than the base's ``max_text_bytes``; nothing was published."""


class RegistryError(VoxrecallError):
    """The registry of proposed sources is unreadable, or a command named an unknown entry."""


class SnapshotError(VoxrecallError):
    """A snapshot could not be found, read or trusted."""


class SnapshotNotFound(SnapshotError):
    """The store holds no published snapshot for the knowledge base."""


class CorruptSnapshot(SnapshotError):
    """A snapshot's files disagree with its manifest (missing file, checksum, counts)."""


class GraphSearchFailed(CorruptSnapshot):
    """hnswlib could not answer one search of a loaded graph (fewer elements reachable than
    asked for: a graph its load's checks could not tell apart from a sound one). The engine
    answers such a turn lexically, degraded; a search by a vector alone has no text to fall back
    on and fails INTERNAL, never UNKNOWN."""


class IncompatibleSnapshot(SnapshotError):
    """A snapshot was written in another format or with another embedder than ours."""


class IncompleteSnapshot(SnapshotError):
    """A published version's manifest or files are missing: half-uploaded, so retried later."""


class StoreUnavailable(SnapshotError):
    """The store could not be reached or answered an error; the next poll tries again."""


# An OSError of the process's (or the system's) own limits, not of the file: the same read
# succeeds once descriptors or memory are free again.
_OUT_OF = {
    errno.EMFILE: "this process has no file descriptor left",
    errno.ENFILE: "the system has no file descriptor left",
    errno.ENOMEM: "this process is out of memory",
}


def unreadable(what: str, exc: OSError) -> SnapshotError:
    """The error for a store's or snapshot's file that could not be read (``what``: its path and
    the reason): ``StoreUnavailable``, tried again on the next poll, when the process ran out of
    descriptors or memory (a flood of connections: the snapshot is not at fault); otherwise
    ``CorruptSnapshot``, and the version is refused until a new one is published."""
    cause = _OUT_OF.get(exc.errno or 0)
    if cause is not None:
        return StoreUnavailable(f"{what}: {cause}, not a fault of the snapshot")
    return CorruptSnapshot(what)


class CacheWriteError(SnapshotError):
    """A downloaded snapshot could not be written to the local cache (disk full, permissions)."""


def one_line(text: str) -> str:
    """``text`` with its line breaks and other control characters written as their escapes
    (``\\n``, ``\\r``, ``\\t``, ``\\x1b``, ``\\u202e``): what another party wrote
    (urllib's redirect-loop text, a server's reason phrase, a file's name) stays one line in a
    log, a report, a refusal and Status, and cannot print lines of its own."""
    if text.isprintable():
        return text
    return "".join(c if c.isprintable() else c.encode("unicode_escape").decode() for c in text)


def shortened(text: str, limit: int) -> str:
    """``text`` cut to at most ``limit`` bytes of UTF-8, the cut marked with the size it had: a
    message quoting what another party sent (an HTTP reason phrase of 60,000 characters) stays
    readable and small wherever it is kept or sent."""
    data = text.encode("utf-8", "replace")
    if len(data) <= limit:
        return text
    marker = f" [... cut from {len(data)} bytes]"
    keep = max(0, limit - len(marker))
    return data[:keep].decode("utf-8", "ignore") + marker
