"""Sources: each reads one kind of knowledge base input into pages (``index.types.Page``).

A page that cannot be read is never an exception for the build: the source returns it as a
``SkippedPage`` naming the reason, next to the pages it could read.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["SkippedPage"]


@dataclass(frozen=True, slots=True)
class SkippedPage:
    """A page a source could not use: its path inside the source, and why, for the build report."""

    path: str
    reason: str
