"""Every prompt the indexer sends to a chat model, in one place, each with a version.

The version is part of the answer cache's key (``index/llm.py``): change a prompt's wording and
raise its version, and every answer it gave is asked again instead of served from the cache.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class Prompt:
    """A task for the model: its system message and the version the cache keys on."""

    name: str
    version: int
    system: str


CLEAN = Prompt(
    name="clean",
    version=1,
    system=(
        "You rewrite text extracted from a document (a PDF, a web page, a crawl) into clean "
        "Markdown for a search index. Keep every fact, number, name, step and heading; keep "
        "tables as Markdown tables; join words split by hyphenation or line breaks. Drop page "
        "headers, footers and page numbers repeated on every page, navigation, cookie notices "
        "and other boilerplate. Never add, guess or summarise. Answer with the Markdown only."
    ),
)

SUMMARY = Prompt(
    name="summary",
    version=1,
    system=(
        "You are given one passage of a knowledge base, after its heading path. In one or two "
        "short sentences, write the question or questions a caller would ask that this passage "
        "answers, in the caller's own words. Answer with the question(s) only."
    ),
)

IMAGE = Prompt(
    name="image",
    version=1,
    system=(
        "You describe an image for a search index. First a short paragraph saying what the "
        "image shows (a screenshot, a diagram, a photo, a table) and what it is for; then, "
        "under the heading 'Text in the image', every piece of readable text in it, verbatim, "
        "in reading order. Answer in Markdown only."
    ),
)
