"""The indexer's configuration: the ``[embedder]``, ``[[knowledge_base]]`` and ``[index]`` tables
of the one TOML file, and the small helpers every table's parser uses.

The sidecar's tables (``[sidecar]``, ``[[function]]``) and the whole file's ``Config`` are
``sidecar/config.py``'s: it parses the file, these tables through ``parse_build_config``, and
the indexer never imports it (the entry point hands ``index/cli.py`` its loader). Every key is documented in docs/config.md. Relative paths are resolved against the config file's folder, so
a config works from any working directory. Nothing below the entry point reads the environment:
the API key is looked up here, by the variable name the file gives.
"""

from __future__ import annotations

import difflib
import functools
import json
import math
import os
import re
import reprlib
import tomllib
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Literal, TypeVar, get_args, get_origin, get_type_hints

from index.errors import ConfigError

LOCAL_MODEL = "all-MiniLM-L6-v2-int8"
MAX_RERANK_CANDIDATES = 100  # Cohere's documents per call is far higher; 100 is ~100 ms of it
MAX_EF_SEARCH = 4096  # past this an HNSW search visits most of any graph: use exact search
MIN_TOKEN_CHARS = 16  # shorter bearer tokens can be guessed; `openssl rand -hex 32` makes one
# A build holds every page of its base at once, and more again for their chunks and vectors.
# 1M chunks of 256 tokens are ~1.2 GB of English text; this leaves room for text held at 2 bytes
# a character (Python's, for most scripts past Latin-1) and larger chunks.
DEFAULT_MAX_TEXT_BYTES = 4 * 1024**3
_T = TypeVar("_T")


@dataclass(frozen=True, slots=True)
class EmbedderConfig:
    provider: Literal["local", "openai"] = "local"
    model: str = LOCAL_MODEL
    base_url: str = ""
    dimensions: int = 0  # 0: the model's native dimension
    api_key_env: str = "OPENAI_API_KEY"
    api_key: str = field(default="", repr=False)  # resolved from api_key_env; never logged
    batch_size: int = 16
    max_concurrency: int = 4  # concurrent embedding requests during an index build
    threads: int = 1  # local model: intra-op threads per inference on the hot path


@dataclass(frozen=True, slots=True)
class SourceConfig:
    name: str
    type: str
    path: Path | None = None
    # Type-specific keys (urls, refresh, id_field, context_fields, ...) as the file gave them.
    options: Mapping[str, Any] = field(default_factory=dict)


_RECORD_OPTIONS = frozenset(
    {
        "id_field",
        "title_field",
        "text_field",
        "context_fields",
        "metadata_fields",
        "max_page_bytes",
    }
)
# What every folder source takes (index/sources/folder.py reads them).
_FOLDER_OPTIONS = frozenset({"follow_symlinks", "max_page_bytes"})
# The options each type accepts; markdown's required_files and require_last_updated are read by
# `voxrecall index validate`.
SOURCE_OPTIONS: dict[str, frozenset[str]] = {
    "markdown": _FOLDER_OPTIONS | {"required_files", "require_last_updated"},
    "text": _FOLDER_OPTIONS,
    "html": _FOLDER_OPTIONS,
    "pdf": _FOLDER_OPTIONS,
    "url": frozenset({"urls", "refresh"}),
    "jsonl": _RECORD_OPTIONS,
    "csv": _RECORD_OPTIONS,
    # images become text through [index.llm]'s vision model, only with approved = true
    "image": frozenset({"approved", "urls", "follow_symlinks", "max_image_bytes"}),
}
# Text sources whose long pages [index.llm] may rewrite into clean Markdown (index/enrich.py).
CLEANABLE_TYPES = frozenset({"markdown", "text", "html", "pdf", "url"})
for _type in CLEANABLE_TYPES:
    SOURCE_OPTIONS[_type] = SOURCE_OPTIONS[_type] | {"clean"}
SOURCE_TYPES = tuple(SOURCE_OPTIONS)
# Each option's type, checked when the file is read (its range too: SOURCE_OPTION_RANGES).
OPTION_TYPES: dict[str, Any] = {
    "clean": bool,
    "approved": bool,
    "follow_symlinks": bool,
    "require_last_updated": bool,
    "max_page_bytes": int,
    "max_image_bytes": int,
    "refresh": float,
    "id_field": str,
    "title_field": str,
    "text_field": str,
    "urls": list[str],
    "required_files": list[str],
    "context_fields": list[str],
    "metadata_fields": list[str],
}
SOURCE_KEYS = frozenset({"name", "type", "path"})  # every type's, beside its options
OPENAI_MAX_INPUTS = 2048  # the OpenAI embeddings API's limit on inputs per request


# A refusal names at most this many names of a list (unknown or known), each cut to
# NAME_CHARS: a request may send 256 names of 1 KiB each, and a store may hold many bases.
NAMED = 5
NAME_CHARS = 64


# What ``quoted`` writes of a value that is not a string: a few levels and items of a list or
# an object, never the whole (JSON a request sends may be nested 1,024 deep, past what ``repr``
# recurses through, or hold 100,000 items).
_SHORT = reprlib.Repr()
_SHORT.maxlevel, _SHORT.maxstring, _SHORT.maxother = 3, NAME_CHARS, NAME_CHARS


def quoted(value: object) -> str:
    """``value`` as an error message quotes it: its repr, a string cut to ``NAME_CHARS``
    characters and anything else's repr to as many (a list or an object to a few levels and
    items first), so a 5,000-character value in a file or a request costs its refusal a bounded
    line."""
    if isinstance(value, str):
        return repr(value if len(value) <= NAME_CHARS else value[:NAME_CHARS] + "...")
    try:
        text = _SHORT.repr(value)
    except ValueError:  # an int of more digits than Python writes (4,300)
        return f"({type(value).__name__}: a number too long to write)"
    return text if len(text) <= NAME_CHARS else text[:NAME_CHARS] + "..."


def named(names: Sequence[str]) -> str:
    """The first ``NAMED`` of ``names``, quoted and each cut to ``NAME_CHARS``, and how many
    more there are: what an error message repeats of a list it cannot bound."""
    shown = ", ".join(map(quoted, names[:NAMED]))
    more = len(names) - NAMED
    return f"{shown} and {more} more" if more > 0 else shown or "none"


def unknown_names(unknown: Iterable[str], known: Iterable[str]) -> str:
    """``max_result (did you mean `max_results`?), colour``: each unknown name, with the known
    name closest to it where one is close (a typo, a singular for a plural)."""
    choices = sorted(known)
    return ", ".join(_with_guess(name, choices) for name in unknown)


def _with_guess(name: str, choices: list[str]) -> str:
    close = difflib.get_close_matches(name, choices, n=1)
    return f"{name} (did you mean `{close[0]}`?)" if close else name


def check_options(source: SourceConfig) -> None:
    """Raise ConfigError for an unknown type, an option the type does not take, or a path that
    the type needs and lacks (or does not take)."""
    allowed = SOURCE_OPTIONS.get(source.type)
    if allowed is None:
        raise ConfigError(
            f"source {quoted(source.name)}: type {quoted(source.type)} is not supported"
        )
    unknown = sorted(set(source.options) - allowed)
    if unknown:
        raise ConfigError(
            f"source {quoted(source.name)}: unknown option(s) {unknown_names(unknown, allowed)} for type "
            f"{source.type} (it takes: {', '.join(sorted(allowed)) or 'none'})"
        )
    for key, value in source.options.items():
        wanted = _wanted(OPTION_TYPES[key], value)
        if wanted:
            raise ConfigError(
                f"source {quoted(source.name)}: {key} must be {wanted}, got {quoted(value)}"
            )
    ranged = {k: v for k, v in SOURCE_OPTION_RANGES.items() if k in source.options}
    check_ranges(source.options, ranged, f"source {quoted(source.name)}")
    if source.type == "image":
        if (source.path is None) == ("urls" not in source.options):
            raise ConfigError(
                f"source {quoted(source.name)}: type image takes a path (a folder) or urls"
            )
    elif source.type == "url":
        if source.path is not None:
            raise ConfigError(f"source {quoted(source.name)}: type url takes urls, not a path")
    elif source.path is None:
        what = "file" if source.type in ("jsonl", "csv") else "folder"
        raise ConfigError(
            f"source {quoted(source.name)}: type {source.type} needs a path (a {what})"
        )


@dataclass(frozen=True, slots=True)
class ChunkingConfig:
    target_tokens: int = 256
    overlap_tokens: int = 32
    heading_levels: int = 3


@dataclass(frozen=True, slots=True)
class HnswConfig:
    m: int = 16
    ef_construction: int = 200
    target_recall: float = 0.98  # the build picks the smallest ef reaching this recall@10


@dataclass(frozen=True, slots=True)
class RerankConfig:
    """``[knowledge_base.rerank]``: reorder the top vector candidates with a rerank API that
    speaks Cohere's shape (``POST {base_url}/rerank``; Jina, Voyage and text-embeddings-inference
    speak it too), under the turn's budget (``sidecar/turn/rerank.py``)."""

    base_url: str
    model: str = ""
    api_key_env: str = ""  # empty: no Authorization header (a local server)
    api_key: str = field(default="", repr=False)  # resolved from api_key_env; never logged
    candidates: int = 20  # the top N vector results sent to be reranked
    # The share of what is left of the budget after the search that the rerank call may use;
    # the rest answers in vector order if it misses.
    budget_share: float = 0.5
    # A rerank answer for 50 documents is ~3 KB; more is a wrong server, refused, not parsed.
    max_response_bytes: int = 256 * 1024


@dataclass(frozen=True, slots=True)
class KnowledgeBaseConfig:
    name: str
    sources: tuple[SourceConfig, ...]
    hybrid: bool = False  # fuse dense and lexical scores (convex, sidecar/turn/relevance.py)
    # A second vector per chunk, of what question it answers, searched beside the content
    # (index/enrich.py, sidecar/turn/relevance.py): written by [index.llm] ("model") or taken from the
    # chunk's heading path and first sentence ("heading", no model).
    summaries: bool = False
    summary_text: Literal["model", "heading"] = "model"
    chunking: ChunkingConfig = ChunkingConfig()
    hnsw: HnswConfig = HnswConfig()
    filterable: tuple[str, ...] = ()  # metadata fields indexed for filters (index/filters.py)
    fallback: str = ""  # what the agent says when nothing passes (with every answer)
    instructions: str = ""  # how to use this base: the policy a system prompt carries
    rerank: RerankConfig | None = None
    # What one build of the base may hold of its pages (index/sources/__init__.py PageBytes).
    max_text_bytes: int = DEFAULT_MAX_TEXT_BYTES


@dataclass(frozen=True, slots=True)
class LlmConfig:
    """``[index.llm]``: an OpenAI-compatible chat model the indexer (never the sidecar) calls to
    clean pages, write chunk summaries and describe images (index/llm.py)."""

    model: str = "gpt-4o-mini"
    base_url: str = ""  # empty: api.openai.com
    api_key_env: str = "OPENAI_API_KEY"
    api_key: str = field(default="", repr=False)  # resolved from api_key_env; never logged
    max_concurrency: int = 4  # requests in flight at once
    max_build_tokens: int = 2_000_000  # one build's spend cap (prompt + completion tokens)
    max_output_tokens: int = 2048  # per answer
    timeout_s: float = 120.0  # per request, whole (a trickling answer is cut too)
    retries: int = 6  # on 429, 5xx, timeouts and dropped connections, with backoff
    clean_min_bytes: int = 2048  # a page of a clean = true source longer than this is cleaned
    max_input_bytes: int = 64 * 1024  # a longer page is not sent (kept as it is, named)
    max_image_bytes: int = 4 * 1024 * 1024  # a larger image is skipped, never sent
    cache_dir: Path = Path("store/.llm-cache")  # answers by (model, prompt version, input hash)


@dataclass(frozen=True, slots=True)
class IndexConfig:
    store: Path = Path("store")
    keep_versions: int = 3
    cache_dir: Path = Path("store/.embedding-cache")
    strict: bool = False  # exit non-zero when any page is skipped
    llm: LlmConfig | None = None  # [index.llm]; None: no model is ever called
    # Proposed, approved and rejected sources (`voxrecall source ...`, index/curation.py)
    registry: Path = Path("sources.json")
    rebuild_token_env: str = "VOXRECALL_REBUILD_TOKEN"  # `index watch --listen`'s bearer token
    rebuild_token: str = field(default="", repr=False)  # resolved from rebuild_token_env
    # `index publish --to s3://...`: an S3-compatible endpoint ("" is AWS) and its region
    s3_endpoint_url: str = ""
    s3_region: str = ""


@dataclass(frozen=True, slots=True)
class BuildConfig:
    """What an index build reads: the embedder, the bases and ``[index]``. The sidecar's
    ``Config`` is one too, with its own tables beside these."""

    embedder: EmbedderConfig = EmbedderConfig()
    knowledge_bases: tuple[KnowledgeBaseConfig, ...] = ()
    index: IndexConfig = IndexConfig()
    path: Path | None = None

    def knowledge_base(self, name: str) -> KnowledgeBaseConfig:
        for kb in self.knowledge_bases:
            if kb.name == name:
                return kb
        configured = named([kb.name for kb in self.knowledge_bases])
        raise ConfigError(
            f"no [[knowledge_base]] named {quoted(name)} in {self.path} (configured: {configured})"
        )


def sub_table(raw: Mapping[str, Any], key: str, where: str) -> dict[str, Any]:
    value = raw.get(key, {})
    if not isinstance(value, dict):
        raise ConfigError(f"{where}: [{key}] must be a table")
    return value


def refuse_secrets(raw: Mapping[str, Any], keys: Iterable[str], where: str) -> None:
    """A secret written in the file (``api_key``, a token) is refused, naming the ``KEY_env`` key
    that names its environment variable: a config file is checked in, copied and shown, and the
    secret is read from the variable only (taking the file's would hide that it is ignored)."""
    for key in keys:
        if key in raw:
            raise ConfigError(
                f"{where}: {key}: a secret never goes in the file: put it in an environment "
                f"variable and name that with {key}_env"
            )


def build_table(
    cls: type[_T], values: Mapping[str, Any], where: str, keys: Iterable[str] = (), **extra: Any
) -> _T:
    """``cls(**values, **extra)``. A key of ``values`` that is no field, or one ``extra`` sets,
    is refused with the closest key the file may use (those fields, and ``keys``: the table's
    keys read apart, such as a base's ``source``)."""
    known = set(cls.__dataclass_fields__) - set(extra)  # type: ignore[attr-defined]
    unknown = sorted(set(values) - known)
    if unknown:
        raise ConfigError(f"{where}: unknown key(s) {unknown_names(unknown, known | set(keys))}")
    check_types(cls, values, where)
    try:
        return cls(**{**values, **extra})
    except TypeError as exc:
        raise ConfigError(f"{where}: {exc}") from exc


def _is_number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


# A field's type -> whether a value fits it, and what the error calls it. TOML's own types:
# an integer is a number too; inf and nan are no number a limit can take.
_KINDS: tuple[tuple[type, Callable[[Any], bool], str], ...] = (
    (bool, lambda v: isinstance(v, bool), "true or false"),
    (int, lambda v: is_whole(v), "a whole number"),
    (float, _is_number, "a number"),
    (str, lambda v: isinstance(v, str), "a string"),
)


@functools.cache
def _field_types(cls: type) -> dict[str, Any]:
    return get_type_hints(cls)


def check_types(cls: type, values: Mapping[str, Any], where: str) -> None:
    """Every key the file gave has its field's type (a whole number, a number, true or false, a
    string, one of a Literal's words), so a value such as ``budget_ms = "150ms"`` stops the start
    naming the key, instead of failing every call that reads it. Paths, lists and sub-tables are
    converted and checked by their tables' parsers before they get here."""
    types = _field_types(cls)
    for key, value in values.items():
        wanted = _wanted(types.get(key), value)
        if wanted:
            raise ConfigError(f"{where}: {key} must be {wanted}, got {quoted(value)}")


def _wanted(hint: Any, value: Any) -> str:
    """What ``value`` should have been for a field of type ``hint``; "" when it fits."""
    if get_origin(hint) is Literal:
        words = get_args(hint)
        return "" if value in words else " or ".join(json.dumps(w) for w in words)
    if hint == list[str]:
        strings = isinstance(value, list) and all(isinstance(v, str) for v in value)
        return "" if strings else "a list of strings"
    for kind, fits, name in _KINDS:
        if hint is kind:
            return "" if fits(value) else name
    return ""


@dataclass(frozen=True, slots=True)
class Range:
    """The values a numeric key takes: ``low`` to ``high`` (None: no upper bound), ``low``
    itself excluded when ``above``; ``note`` says what the value counts or means."""

    low: float
    high: float | None = None
    above: bool = False
    note: str = ""

    def holds(self, value: float) -> bool:
        over_low = value > self.low if self.above else value >= self.low
        return over_low and (self.high is None or value <= self.high)

    def __str__(self) -> str:
        low = _number(self.low)
        if self.high is not None and not self.above:
            allowed = f"from {low} to {_number(self.high)}"
        else:
            allowed = f"> {low}" if self.above else f">= {low}"
            allowed += f" and <= {_number(self.high)}" if self.high is not None else ""
        return f"{allowed} ({self.note})" if self.note else allowed


def _number(value: float) -> str:
    """A bound as a person writes it: 67108864, not 6.71089e+07."""
    return str(int(value)) if float(value).is_integer() else f"{value:g}"


def check_ranges(table: object, ranges: Mapping[str, Range], where: str) -> None:
    """Each of ``ranges``' keys of a parsed table (or a source's options, a mapping) within its
    range (its type already checked), with one error naming the key, what is allowed and the
    value given."""
    for key, allowed in ranges.items():
        value = table[key] if isinstance(table, Mapping) else getattr(table, key)
        if not allowed.holds(value):
            raise ConfigError(f"{where}: {key} must be {allowed}, got {quoted(value)}")


def resolve_path(base: Path, value: Any, where: str) -> Path:
    """A path the file gives, relative ones against ``base``; no system call takes a NUL byte,
    so one is refused here rather than failing the first open with a traceback."""
    if not isinstance(value, str) or not value:
        raise ConfigError(f"{where}: expected a path string, got {quoted(value)}")
    if "\0" in value:
        raise ConfigError(f"{where}: a path cannot hold a NUL byte (\\u0000), got {quoted(value)}")
    p = Path(value).expanduser()
    return p if p.is_absolute() else (base / p).resolve()


def is_whole(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def unique_strings(value: Any, where: str) -> tuple[str, ...]:
    if not isinstance(value, list) or not all(isinstance(v, str) and v for v in value):
        raise ConfigError(f"{where} must be a list of non-empty strings")
    if len(set(value)) != len(value):
        raise ConfigError(f"{where} must not repeat a name, got {named(value)}")
    return tuple(value)


def parse_build_config(raw: Mapping[str, Any], base: Path, path: Path | None = None) -> BuildConfig:
    """The ``[embedder]``, ``[[knowledge_base]]`` and ``[index]`` tables of parsed TOML;
    ``base`` resolves relative paths. Other tables are the caller's to check."""
    where = str(path or "<config>")
    embedder = _embedder_config(sub_table(raw, "embedder", where), where)
    kbs = _knowledge_bases(raw, base, where)
    index = _index_config(sub_table(raw, "index", where), base, where)
    _check_enrichment(kbs, index, where)
    return BuildConfig(embedder=embedder, knowledge_bases=tuple(kbs), index=index, path=path)


# The numeric keys' ranges, per table (their types are the fields' own, checked by build_table).
# Every key has a top: far past what a deployment uses, and low enough that no value runs away
# (threads the process cannot start, a timer past what the clock holds) or overflows a C int.
# Threads per inference: a fixed cap, not the core count, so one file checks the same on the
# laptop that builds and the pod that serves; one query's matrices stop gaining well before 64.
MAX_THREADS = 64
MAX_TOKENS = 8192  # a chunk's tokens: OpenAI's embedding input limit (8191), the local model's 512
EMBEDDER_RANGES = {
    "dimensions": Range(0, 8192, note="0: the model's own"),
    "batch_size": Range(1, 4096, note="inputs per embedding call"),
    "max_concurrency": Range(1, 64, note="embedding requests in flight"),
    "threads": Range(1, MAX_THREADS, note="threads per inference"),
}
CHUNKING_RANGES = {
    "target_tokens": Range(1, MAX_TOKENS),
    "overlap_tokens": Range(0, MAX_TOKENS),
    "heading_levels": Range(0, 6, note="split at H1..Hn; 0: no heading splits"),
}
HNSW_RANGES = {
    "m": Range(2, 256, note="links per node; hnswlib suggests 2 to 100"),
    "ef_construction": Range(1, MAX_EF_SEARCH),
    "target_recall": Range(0, 1, above=True, note="a recall@10"),
}
INDEX_RANGES = {"keep_versions": Range(1, 1000, note="the newest version is always kept")}
KB_RANGES = {"max_text_bytes": Range(1, 1024**4, note="bytes")}


def _embedder_config(raw: Mapping[str, Any], where: str) -> EmbedderConfig:
    refuse_secrets(raw, ["api_key"], f"{where} [embedder]")
    provider = raw.get("provider", "local")
    check_types(EmbedderConfig, {"provider": provider}, f"{where} [embedder]")
    if provider == "local":
        return _ranged(EmbedderConfig, raw, EMBEDDER_RANGES, f"{where} [embedder]")
    # a build's requests as large as the API takes (index/embedders/remote.py)
    values = {"model": "text-embedding-3-small", "batch_size": OPENAI_MAX_INPUTS, **raw}
    embedder = _ranged(EmbedderConfig, values, EMBEDDER_RANGES, f"{where} [embedder]")
    if not 1 <= embedder.batch_size <= OPENAI_MAX_INPUTS:
        raise ConfigError(
            f"{where} [embedder] batch_size must be 1 to {OPENAI_MAX_INPUTS} for openai "
            "(the most inputs the embeddings API takes in one request)"
        )
    return replace(embedder, api_key=os.environ.get(embedder.api_key_env, ""))


def _knowledge_bases(raw: Mapping[str, Any], base: Path, where: str) -> list[KnowledgeBaseConfig]:
    kb_list = raw.get("knowledge_base", [])
    if not isinstance(kb_list, list):
        raise ConfigError(f"{where}: knowledge_base must be an array of tables [[knowledge_base]]")
    kbs = [_knowledge_base(kb_raw, base, f"{where} [[knowledge_base]] #{i + 1}")
           for i, kb_raw in enumerate(kb_list)]  # fmt: skip
    if len({kb.name for kb in kbs}) != len(kbs):
        raise ConfigError(f"{where}: knowledge base names must be unique")
    return kbs


def _knowledge_base(raw: object, base: Path, kb_where: str) -> KnowledgeBaseConfig:
    kb_raw = _table(raw, kb_where, "[[knowledge_base]]")
    name = kb_raw.get("name")
    if not isinstance(name, str) or not name:
        raise ConfigError(f"{kb_where}: a name is required")
    if not _one_component(name):
        raise ConfigError(
            f"{kb_where}: name {quoted(name)} must be one folder's name (no '/' or NUL, not "
            "starting with '.', 255 bytes at most): it names the base's folder in the store"
        )
    sources = _sources(kb_raw, base, kb_where)
    apart = ("name", "source", "chunking", "hnsw", "rerank")
    rest = {k: v for k, v in kb_raw.items() if k not in apart}
    kb = build_table(
        KnowledgeBaseConfig,
        _kb_policy(rest, kb_where),
        kb_where,
        keys=apart,
        name=name,
        rerank=_rerank_config(kb_raw.get("rerank"), f"{kb_where} [rerank]"),
        sources=sources,
        chunking=_chunking(sub_table(kb_raw, "chunking", kb_where), f"{kb_where} [chunking]"),
        hnsw=_ranged(HnswConfig, sub_table(kb_raw, "hnsw", kb_where), HNSW_RANGES,
                     f"{kb_where} [hnsw]"),
    )  # fmt: skip
    check_ranges(kb, KB_RANGES, kb_where)
    return kb


def _chunking(values: Mapping[str, Any], where: str) -> ChunkingConfig:
    """The chunking table, its overlap at most half its target: each chunk starts
    ``target - overlap`` tokens after the one before, so an overlap of 8191 under a target of
    8192 cut a 100 kB page into 20,905 chunks of the same text (685 MB)."""
    chunking = _ranged(ChunkingConfig, values, CHUNKING_RANGES, where)
    if chunking.overlap_tokens * 2 > chunking.target_tokens:
        raise ConfigError(
            f"{where}: overlap_tokens ({chunking.overlap_tokens}) must be at most half of "
            f"target_tokens ({chunking.target_tokens}): each chunk would repeat more of the "
            "one before than it adds"
        )
    return chunking


# One safe path component, no "..": the name of a base or a version an HTTP or S3 store holds
# (a URL's segment, a key's), and what a folder store lists.
SAFE_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")
MAX_NAME_BYTES = 255  # a file name's most on Linux


def _one_component(name: str) -> bool:
    """Whether a base's name is one folder's name in a folder store, and no name of its own
    (``.embedding-cache``, ``.publish.lock``): "../escaped" published outside the store."""
    size = len(name.encode("utf-8", "surrogatepass"))
    return not ("/" in name or "\0" in name or name.startswith(".") or size > MAX_NAME_BYTES)


# A base's sources' names, written as the JSON list its snapshot's manifest holds: a quarter of
# the manifest's cap (index.snapshot.MAX_MANIFEST_BYTES), so that no base can build a snapshot
# its own sidecar refuses (~1,500 sources of 40-character names).
MAX_SOURCE_NAMES_BYTES = 64 << 10


def _ranged(
    cls: type[_T], values: Mapping[str, Any], ranges: Mapping[str, Range], where: str
) -> _T:
    """``build_table``, then ``ranges`` checked on what it built."""
    table = build_table(cls, values, where)
    check_ranges(table, ranges, where)
    return table


def _sources(kb_raw: Mapping[str, Any], base: Path, kb_where: str) -> tuple[SourceConfig, ...]:
    listed = kb_raw.get("source", [])
    if not isinstance(listed, list):
        raise ConfigError(
            f"{kb_where}: source must be an array of tables [[knowledge_base.source]]"
        )
    sources = [_source(src, base, kb_where, f"{kb_where} source #{j + 1}")
               for j, src in enumerate(listed)]  # fmt: skip
    names = [s.name for s in sources]
    if len(set(names)) != len(names):
        raise ConfigError(f"{kb_where}: source names must be unique, got {named(names)}")
    listed = len(json.dumps(names, ensure_ascii=False).encode("utf-8", "surrogatepass"))
    if listed > MAX_SOURCE_NAMES_BYTES:
        raise ConfigError(
            f"{kb_where}: its {len(names)} sources' names come to {listed} bytes; the limit is "
            f"{MAX_SOURCE_NAMES_BYTES} (a snapshot's manifest lists them): merge sources (a "
            "folder source reads a whole tree) or give them shorter names"
        )
    return tuple(sources)


def _table(value: object, where: str, written: str) -> Mapping[str, Any]:
    """``value`` when it is a TOML table, else ConfigError saying how one is written."""
    if not isinstance(value, dict):
        raise ConfigError(f"{where}: must be a table {written}, got {quoted(value)}")
    return value


def _source(raw: object, base: Path, kb_where: str, s_where: str) -> SourceConfig:
    src = _table(raw, s_where, "[[knowledge_base.source]]")
    s_type = src.get("type")
    if s_type not in SOURCE_TYPES:
        raise ConfigError(f"{s_where}: {_source_type_problem(src)}")
    s_name = src.get("name", s_type)
    if not isinstance(s_name, str) or not s_name:
        raise ConfigError(f"{s_where}: name must be a string, got {quoted(s_name)}")
    s_path = resolve_path(base, src["path"], s_where) if "path" in src else None
    options = {k: v for k, v in src.items() if k not in ("name", "type", "path")}
    source = SourceConfig(name=s_name, type=s_type, path=s_path, options=options)
    try:
        check_options(source)
    except ConfigError as exc:
        raise ConfigError(f"{kb_where}: {exc}") from None
    return source


def _index_config(raw: Mapping[str, Any], base: Path, where: str) -> IndexConfig:
    idx_raw = dict(raw)
    for key in ("store", "cache_dir"):
        if key in idx_raw:
            idx_raw[key] = resolve_path(base, idx_raw[key], f"{where} [index] {key}")
    idx_raw.setdefault("store", (base / "store").resolve())
    idx_raw.setdefault("cache_dir", Path(idx_raw["store"]) / ".embedding-cache")
    idx_raw["registry"] = resolve_path(
        base, idx_raw.get("registry", "sources.json"), f"{where} [index]"
    )
    if "llm" in idx_raw:
        idx_raw["llm"] = _llm_config(
            sub_table(idx_raw, "llm", f"{where} [index]"), base, Path(idx_raw["store"]), where
        )
    refuse_secrets(idx_raw, ["rebuild_token"], f"{where} [index]")
    index = _ranged(IndexConfig, idx_raw, INDEX_RANGES, f"{where} [index]")
    return replace(index, rebuild_token=os.environ.get(index.rebuild_token_env, ""))


def _llm_config(raw: Mapping[str, Any], base: Path, store: Path, where: str) -> LlmConfig:
    """``[index.llm]``: every limit a positive number; the key read from its variable here."""
    where = f"{where} [index.llm]"
    refuse_secrets(raw, ["api_key"], where)
    values = dict(raw)
    values["cache_dir"] = (
        resolve_path(base, raw["cache_dir"], f"{where} cache_dir")
        if "cache_dir" in raw
        else store / ".llm-cache"
    )
    llm = _ranged(LlmConfig, values, LLM_RANGES, where)
    if not llm.model:
        raise ConfigError(f"{where}: model must be a model name")
    return replace(llm, api_key=os.environ.get(llm.api_key_env, ""))


MAX_FILE_BYTES = 1024**3  # a page or image read whole into memory: 1 GiB is past any real one
LLM_RANGES = {
    "max_concurrency": Range(1, 64, note="requests in flight"),
    "max_build_tokens": Range(1, 10**12, note="tokens"),
    "max_output_tokens": Range(1, 10**6, note="tokens"),
    "timeout_s": Range(0, 3600, above=True, note="seconds"),
    "retries": Range(0, 100),
    "clean_min_bytes": Range(1, MAX_FILE_BYTES, note="bytes"),
    "max_input_bytes": Range(1, MAX_FILE_BYTES, note="bytes"),
    "max_image_bytes": Range(1, MAX_FILE_BYTES, note="bytes"),
}
# A source's numeric options (check_options, when the file is read and again when it is built).
SOURCE_OPTION_RANGES = {
    "max_page_bytes": Range(1, MAX_FILE_BYTES, note="bytes"),
    "max_image_bytes": Range(1, MAX_FILE_BYTES, note="bytes"),
    # no top: nothing is sized or scheduled by it but a comparison with a time, and configs
    # with years in it loaded before the other tops came
    "refresh": Range(0, note="seconds"),
}


def _check_enrichment(kbs: list[KnowledgeBaseConfig], index: IndexConfig, where: str) -> None:
    """What needs a model (clean = true, model summaries, images) names an [index.llm]."""
    for kb in kbs:
        if not isinstance(kb.summaries, bool) or kb.summary_text not in ("model", "heading"):
            raise ConfigError(
                f'{where} {kb.name}: summaries must be true or false, summary_text "model" or '
                '"heading"'
            )
        needs = [f"source {s.name} (clean = true)" for s in kb.sources if s.options.get("clean")]
        needs += [f"source {s.name} (type image)" for s in kb.sources if s.type == "image"]
        if kb.summaries and kb.summary_text == "model":
            needs.append('summaries = true (summary_text = "model")')
        if needs and index.llm is None:
            raise ConfigError(
                f"{where} knowledge base {kb.name}: {', '.join(needs)} needs a model: add an "
                '[index.llm] table (model, base_url, api_key_env), or use summary_text = "heading"'
            )


def _source_type_problem(src: Mapping[str, Any]) -> str:
    """Why a source's type is missing or wrong: a misspelt ``type`` key is named as unknown."""
    types = ", ".join(SOURCE_TYPES)
    if "type" in src:
        return f"type {quoted(src['type'])} is not one of {types}"
    known = SOURCE_KEYS.union(*SOURCE_OPTIONS.values())
    unknown = sorted(set(src) - known)
    needed = f"type is required (one of {types})"
    return f"unknown key(s) {unknown_names(unknown, known)}; {needed}" if unknown else needed


def _kb_policy(rest: Mapping[str, Any], where: str) -> dict[str, Any]:
    """A base's ``filterable``, ``fallback`` and ``instructions``, checked by type."""
    out = dict(rest)
    if "filterable" in out:
        out["filterable"] = unique_strings(out["filterable"], f"{where}: filterable")
    for key in ("fallback", "instructions"):
        if key in out and not isinstance(out[key], str):
            raise ConfigError(f"{where}: {key} must be a string")
    return out


def _rerank_config(raw: Any, where: str) -> RerankConfig | None:
    if raw is None:
        return None
    if not isinstance(raw, dict):
        raise ConfigError(f"{where} must be a table")
    refuse_secrets(raw, ["api_key"], where)
    url = raw.get("base_url")
    if not isinstance(url, str) or not url.startswith(("http://", "https://")):
        raise ConfigError(f"{where}: base_url is required: the http(s) URL before /rerank")
    rerank = build_table(RerankConfig, {**raw, "base_url": url.rstrip("/")}, where)
    if not isinstance(rerank.model, str) or not isinstance(rerank.api_key_env, str):
        raise ConfigError(f"{where}: model and api_key_env must be strings")
    if not is_whole(rerank.candidates) or not 1 <= rerank.candidates <= MAX_RERANK_CANDIDATES:
        raise ConfigError(f"{where}: candidates must be 1..{MAX_RERANK_CANDIDATES}")
    share = rerank.budget_share
    if isinstance(share, bool) or not isinstance(share, int | float) or not 0 < share < 1:
        raise ConfigError(f"{where}: budget_share must be a number between 0 and 1")
    check_ranges(rerank, {"max_response_bytes": Range(1024, 64 * 1024**2, note="bytes")}, where)
    key = os.environ.get(rerank.api_key_env, "") if rerank.api_key_env else ""
    return replace(rerank, api_key=key, budget_share=float(share))


def read_toml(path: Path) -> dict[str, Any]:
    """A config file's TOML, or ConfigError naming the file."""
    try:
        return tomllib.loads(path.read_text(encoding="utf-8"))
    except RecursionError as exc:  # tomllib reads nested arrays and tables recursively
        raise ConfigError(f"{path}: not valid TOML: arrays or tables nested too deeply") from exc
    except UnicodeDecodeError as exc:
        raise ConfigError(f"{path}: not UTF-8 (TOML is): byte {exc.start}") from exc
    except FileNotFoundError as exc:
        raise ConfigError(
            f"config file not found: {path}: pass --config with your file's path (without it, "
            "voxrecall.toml in the working directory is read; examples/voxrecall.toml is one)"
        ) from exc
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"{path}: not valid TOML: {exc}") from exc
    except OSError as exc:  # a folder, no permission
        raise ConfigError(f"config file {path} cannot be read: {exc.strerror or exc}") from exc
