"""Index-time enrichment with a chat model (``[index.llm]``, ``index/llm.py``): all optional.

    clean-up     a page of a ``clean = true`` source longer than ``clean_min_bytes`` is
                 rewritten into clean Markdown before chunking; its original text is kept beside
                 it in the snapshot (``originals.json``); a page whose clean-up fails keeps its
                 original and is named in the build summary
    summaries    ``summaries = true``: per chunk, the question it answers ("model") or its
                 heading path and first sentence ("heading"), embedded as a second vector
                 (``index/summaries.py``); a chunk whose summary fails gets the heading view
    images       an ``image`` source with ``approved = true``: each image becomes a page (a
                 description and the text in it) whose source path is the image's

Nothing here runs in the sidecar.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from pathlib import Path

import orjson

from index.config import KnowledgeBaseConfig, LlmConfig, SourceConfig
from index.embedders.base import Vectors
from index.llm import Ask, ModelCaller
from index.prompts import CLEAN, IMAGE, SUMMARY
from index.snapshot import build_hnsw, page_key, write_atomic
from index.sources import SkippedPage
from index.sources.image import ImageFile
from index.summaries import SUMMARY_TEXTS, SUMMARY_VECTORS, heading_summary
from index.types import Chunk, Page

ORIGINALS = "originals.json"  # page key -> the text before clean-up, for pages that were cleaned


def clean_pages(
    pages: list[Page], kb: KnowledgeBaseConfig, llm: LlmConfig, caller: ModelCaller
) -> tuple[list[Page], dict[str, str]]:
    """The pages with long ones of ``clean = true`` sources cleaned, and their originals."""
    cleanable = {s.name for s in kb.sources if s.options.get("clean")}
    chosen: list[int] = []
    for i, page in enumerate(pages):
        size = len(page.text.encode("utf-8"))
        if page.source not in cleanable or size <= llm.clean_min_bytes:
            continue
        if size > llm.max_input_bytes:
            _not_sent(caller, page, f"{size} bytes, more than max_input_bytes: kept as it is")
            continue
        chosen.append(i)
    asks = [Ask(CLEAN, text=pages[i].text, label=_label(pages[i])) for i in chosen]
    out = list(pages)
    originals: dict[str, str] = {}
    for i, answer in zip(chosen, caller.ask_all(asks), strict=True):
        if answer is not None:
            originals[page_key(pages[i].source, pages[i].source_path)] = pages[i].text
            out[i] = dataclasses.replace(pages[i], text=answer, kind="markdown")
    return out, originals


def _label(page: Page) -> str:
    return f"{page.source}:{page.source_path}"


def _not_sent(caller: ModelCaller, page: Page, reason: str) -> None:
    caller.usage.failures += 1
    caller.usage.failed.append({"label": _label(page), "task": CLEAN.name, "reason": reason})


def summary_texts(
    chunks: Sequence[Chunk], kb: KnowledgeBaseConfig, caller: ModelCaller | None
) -> list[str]:
    """Each chunk's summary text in the base's view; a failed model summary: the heading view."""
    offline = [heading_summary(c) for c in chunks]
    if kb.summary_text == "heading" or caller is None:
        return offline
    asks = [Ask(SUMMARY, text=c.embed_text, label=c.chunk_id) for c in chunks]
    answers = caller.ask_all(asks)
    return [a if a is not None else h for a, h in zip(answers, offline, strict=True)]


def summary_writer(
    texts: Sequence[str], vectors: Vectors, m: int, ef_construction: int
) -> Callable[[Path], list[str]]:
    """Writes ``summaries.hnsw`` and ``summaries.json`` into a snapshot folder."""

    def write(folder: Path) -> list[str]:
        build_hnsw(vectors, m, ef_construction).save_index(str(folder / SUMMARY_VECTORS))
        write_atomic(folder / SUMMARY_TEXTS, orjson.dumps(list(texts)))
        return [SUMMARY_VECTORS, SUMMARY_TEXTS]

    return write


def originals_writer(originals: dict[str, str]) -> Callable[[Path], list[str]]:
    def write(folder: Path) -> list[str]:
        write_atomic(folder / ORIGINALS, orjson.dumps(originals))
        return [ORIGINALS]

    return write


def describe_images(
    source: SourceConfig, images: list[ImageFile], caller: ModelCaller
) -> tuple[list[Page], list[SkippedPage]]:
    """A page per image the model described; an image it could not is skipped, named."""
    asks = [
        Ask(IMAGE, image=img.data, image_type=img.media_type, label=f"{source.name}:{img.path}")
        for img in images
    ]
    pages: list[Page] = []
    skipped: list[SkippedPage] = []
    for img, answer in zip(images, caller.ask_all(asks), strict=True):
        if answer is None:
            skipped.append(SkippedPage(img.path, "the model could not describe it"))
            continue
        title = img.path.rsplit("/", 1)[-1]
        pages.append(
            Page(source=source.name, source_path=img.path, title=title, text=answer, url=img.url)
        )
    return pages, skipped
