"""The configuration: one TOML file, read once in the entry point and passed down.

Every key is documented in docs/config.md. Relative paths are resolved against the config file's
folder, so a config works from any working directory. Nothing below the entry point reads the
environment: the API key is looked up here, by the variable name the file gives.
"""

from __future__ import annotations

import difflib
import os
import re
import tomllib
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Literal, TypeVar

from index.errors import ConfigError
from index.types import MetadataFilter

LOCAL_MODEL = "all-MiniLM-L6-v2-int8"
# OpenAI's rule for function names (Realtime, Responses and Chat Completions alike).
FUNCTION_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")
MAX_FUNCTION_LIMIT = 50  # the sidecar's largest search limit (sidecar.engine.MAX_LIMIT)
MAX_RERANK_CANDIDATES = 100  # Cohere's documents per call is far higher; 100 is ~100 ms of it
MAX_WORKERS = 64  # processes: each holds every snapshot in memory
MAX_EF_SEARCH = 4096  # past this an HNSW search visits most of any graph: use exact search
MIN_TOOL_OUTPUT_CHARS = 200  # room for the JSON envelope, an error, or one short result
SKIP_LANGUAGES = ("en",)  # the languages sidecar/skip.py ships word lists for
LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR")
# A session must hold at least its newest turn: 4000 characters of up to 4 bytes (engine).
MIN_SESSION_BYTES = 32 * 1024
MIN_TOKEN_CHARS = 16  # shorter bearer tokens can be guessed; `openssl rand -hex 32` makes one
# A page read whole (ReadPage) must fit; more lets one call pin that much memory per RPC.
MESSAGE_BYTES_RANGE = (64 * 1024, 64 * 1024 * 1024)
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
SOURCE_KEYS = frozenset({"name", "type", "path"})  # every type's, beside its options
OPENAI_MAX_INPUTS = 2048  # the OpenAI embeddings API's limit on inputs per request
TABLES = ("embedder", "knowledge_base", "index", "sidecar", "function")


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
        raise ConfigError(f"source {source.name!r}: type {source.type!r} is not supported")
    unknown = sorted(set(source.options) - allowed)
    if unknown:
        raise ConfigError(
            f"source {source.name!r}: unknown option(s) {unknown_names(unknown, allowed)} for type "
            f"{source.type} (it takes: {', '.join(sorted(allowed)) or 'none'})"
        )
    for flag in ("clean", "approved"):
        if flag in source.options and not isinstance(source.options[flag], bool):
            raise ConfigError(f"source {source.name!r}: {flag} must be true or false")
    if source.type == "image":
        if (source.path is None) == ("urls" not in source.options):
            raise ConfigError(f"source {source.name!r}: type image takes a path (a folder) or urls")
    elif source.type == "url":
        if source.path is not None:
            raise ConfigError(f"source {source.name!r}: type url takes urls, not a path")
    elif source.path is None:
        what = "file" if source.type in ("jsonl", "csv") else "folder"
        raise ConfigError(f"source {source.name!r}: type {source.type} needs a path (a {what})")


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
    speak it too), under the turn's budget (``sidecar/rerank.py``)."""

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
    hybrid: bool = False  # fuse dense and lexical scores (convex, sidecar/relevance.py)
    # A second vector per chunk, of what question it answers, searched beside the content
    # (index/enrich.py, sidecar/relevance.py): written by [index.llm] ("model") or taken from the
    # chunk's heading path and first sentence ("heading", no model).
    summaries: bool = False
    summary_text: Literal["model", "heading"] = "model"
    chunking: ChunkingConfig = ChunkingConfig()
    hnsw: HnswConfig = HnswConfig()
    filterable: tuple[str, ...] = ()  # metadata fields indexed for filters (index/filters.py)
    fallback: str = ""  # what the agent says when nothing passes (with every answer)
    instructions: str = ""  # how to use this base: the policy a system prompt carries
    rerank: RerankConfig | None = None


@dataclass(frozen=True, slots=True)
class FunctionConfig:
    """A knowledge function a model can call: one base, optionally only some of its sources."""

    name: str
    description: str  # written for the model: what it finds and when to call it
    knowledge_base: str
    sources: tuple[str, ...] = ()  # empty: every source of the base
    limit: int = 0  # results per call; 0: [sidecar] max_results
    filters: tuple[MetadataFilter, ...] = ()  # always apply, whatever the model asks
    # Fields the model may filter on; when the file gives none, the parser sets the base's.
    filterable: tuple[str, ...] = ()


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
class SkipConfig:
    """``[sidecar.skip]``: which turns need no search (sidecar/skip.py)."""

    max_words: int = 16  # longer turns are never skipped; the labelled closings fit in 16
    phrases: tuple[str, ...] = ()  # closings to skip beside the language's built-in ones
    language: str = "en"  # selects the built-in word lists (SKIP_LANGUAGES)


@dataclass(frozen=True, slots=True)
class FollowupConfig:
    """``[sidecar.followups]``: how a follow-up turn's query is completed (sidecar/followups.py)."""

    enabled: bool = True
    fold: Literal["always", "referring"] = "always"  # when to fold the current entity in


@dataclass(frozen=True, slots=True)
class TlsConfig:
    """``[sidecar.tls]``: serve TLS from PEM files; ``client_ca_file`` makes it mutual TLS."""

    cert_file: Path | None = None
    key_file: Path | None = None
    client_ca_file: Path | None = None  # set: every client must present a cert signed by it

    @property
    def enabled(self) -> bool:
        return self.cert_file is not None


@dataclass(frozen=True, slots=True)
class CallerConfig:
    """One bearer token and what it may reach; an empty scope reaches everything."""

    name: str  # shown in logs and metrics instead of the token
    token_env: str
    knowledge_bases: tuple[str, ...] = ()  # empty: the bases of its functions, or all
    functions: tuple[str, ...] = ()
    token: str = field(default="", repr=False)  # resolved from token_env; never logged
    # This caller's shares of the [sidecar] limits of the same names; 0: a fair share (what the
    # callers given none are left, split evenly), so no caller can lock out or evict another.
    max_concurrent_rpcs: int = 0
    max_streams: int = 0
    max_sessions: int = 0
    session_memory_bytes: int = 0
    # Filters every call of this caller carries (Search, Turn, Converse, InvokeTool), on top of
    # whatever the request asks: a starter-plan token never reaches an enterprise-only chunk.
    filters: tuple[MetadataFilter, ...] = ()


@dataclass(frozen=True, slots=True)
class AuthConfig:
    """``[sidecar.auth]``: the tokens callers present; none configured means no token is asked."""

    callers: tuple[CallerConfig, ...] = ()

    @property
    def enabled(self) -> bool:
        return bool(self.callers)


@dataclass(frozen=True, slots=True)
class HttpConfig:
    """``[sidecar.http]``: the HTTP door (MCP, platform webhooks, health); off without ``listen``.

    The secrets are read from the environment variables the ``*_env`` keys name, here, once."""

    listen: str = ""  # host:port; empty: no HTTP door
    max_body_bytes: int = 256 * 1024  # a request body larger than this is refused (413)
    vapi_knowledge_base: str = ""  # the base Vapi's requests search; empty: the default base
    read_page_bases: tuple[str, ...] = ()  # the bases whose pages the MCP read_page tool reads
    vapi_secret_env: str = ""  # names the variable holding Vapi's X-Vapi-Secret
    webhook_secret_env: str = ""  # names the variable holding the /tools HMAC signing secret
    vapi_secret: str = field(default="", repr=False)
    webhook_secret: str = field(default="", repr=False)

    @property
    def enabled(self) -> bool:
        return bool(self.listen)


@dataclass(frozen=True, slots=True)
class SidecarConfig:
    listen: str = "127.0.0.1:50051"
    store: Path | str = Path("store")  # a folder, or an http(s):// or s3:// URL (a str)
    default_knowledge_base: str = ""
    budget_ms: int = 150
    max_results: int = 3
    min_score: float = 0.3
    min_lexical_score: float = 1.0
    ef_search: int = 0  # hnswlib ef at query time; 0: what each snapshot's build measured
    context_turns: int = 3  # retained context: this many turns' worth of chunks
    session_ttl_s: float = 900.0
    max_sessions: int = 10_000
    # What one session keeps (its recent turns' text, its retained hits) and all of them
    # together, in bytes; the oldest turns, then the least recently used sessions, go first.
    max_session_bytes: int = 64 * 1024
    session_memory_bytes: int = 256 * 1024 * 1024
    query_cache_size: int = 2048
    context_bonus: float = 0.05  # cosine added to chunks whose related_urls match context_url
    prefetch_stable_ms: int = (
        200  # Converse: an interim unchanged this long is searched ahead; 0: off
    )
    poll_seconds: float = 30.0
    grace_s: float = 5.0
    cache_dir: Path = Path(".snapshot-cache")  # where an http(s) store's downloads are kept
    keep_downloaded: int = 2  # downloaded versions kept per base: the current and the previous
    http_timeout_s: float = 10.0  # per connect and per read against an http(s) store
    http_download_timeout_s: float = 600.0  # per file downloaded from an http(s) store, whole
    s3_endpoint_url: str = ""  # an s3:// store's S3-compatible endpoint; "": AWS
    s3_region: str = ""  # "": the AWS configuration's, else us-east-1
    # Sharding (sidecar/shards.py): this replica serves the bases with shard_of(base, shards)
    # == shard; `voxrecall serve --shard I` sets shard per replica.
    shards: int = 1
    shard: int = 0
    tool_output_chars: int = 2000  # the most characters one knowledge function call returns
    skip: SkipConfig = SkipConfig()
    followups: FollowupConfig = FollowupConfig()
    # A sidecar serves one pod's agent: a few calls per live phone call. Beyond this many at once
    # a call is refused (RESOURCE_EXHAUSTED) rather than queued behind one embedder thread.
    max_concurrent_rpcs: int = 64  # unary calls in flight
    max_streams: int = 64  # Converse streams open, counted apart so neither kind starves the other
    # A Converse stream with no request for this long ends DEADLINE_EXCEEDED: an abandoned stream
    # must not hold its slot. A live call sends transcripts far more often.
    stream_idle_s: float = 60.0
    max_message_bytes: int = 4 * 1024 * 1024
    metrics_listen: str = ""  # host:port for Prometheus; empty: no metrics endpoint
    workers: int = 1  # processes serving `listen` together (sidecar/workers.py)
    # 0: every base is loaded at start and kept. Above 0: a base is loaded on its first call and
    # the least recently used ones are evicted while the loaded bases' bytes exceed this budget.
    memory_budget_mb: int = 0
    log_level: str = "INFO"
    log_format: Literal["json", "text"] = "json"
    tls: TlsConfig = TlsConfig()
    auth: AuthConfig = AuthConfig()
    http: HttpConfig = HttpConfig()


@dataclass(frozen=True, slots=True)
class Config:
    embedder: EmbedderConfig = EmbedderConfig()
    knowledge_bases: tuple[KnowledgeBaseConfig, ...] = ()
    index: IndexConfig = IndexConfig()
    sidecar: SidecarConfig = SidecarConfig()
    path: Path | None = None
    functions: tuple[FunctionConfig, ...] = ()

    def knowledge_base(self, name: str) -> KnowledgeBaseConfig:
        for kb in self.knowledge_bases:
            if kb.name == name:
                return kb
        raise ConfigError(f"no [[knowledge_base]] named {name!r} in {self.path}")

    @property
    def default_knowledge_base(self) -> str:
        if self.sidecar.default_knowledge_base:
            return self.sidecar.default_knowledge_base
        return self.knowledge_bases[0].name if self.knowledge_bases else ""

    def with_overrides(self, **sidecar: Any) -> Config:
        """The same config with [sidecar] keys replaced (command-line flags); None means unset."""
        given = {k: v for k, v in sidecar.items() if v is not None}
        if not given:
            return self
        config = replace(self, sidecar=replace(self.sidecar, **given))
        _check_shard(config.sidecar.shard, config.sidecar.shards, "--shard:")
        return config


def _check_shard(shard: object, shards: object, where: str) -> None:
    """``[sidecar] shards`` (1 to 65536) and ``shard`` (0 to shards - 1), as integers."""
    if not (isinstance(shards, int) and not isinstance(shards, bool) and 1 <= shards <= 65536):
        raise ConfigError(f"{where} shards must be an integer from 1 to 65536, got {shards!r}")
    if not (isinstance(shard, int) and not isinstance(shard, bool) and 0 <= shard < shards):
        raise ConfigError(
            f"{where} shard must be an integer from 0 to shards - 1 ({shards - 1}), got {shard!r}"
            " (`voxrecall serve --shard I` sets it per replica)"
        )


def _table(raw: Mapping[str, Any], key: str, where: str) -> dict[str, Any]:
    value = raw.get(key, {})
    if not isinstance(value, dict):
        raise ConfigError(f"{where}: [{key}] must be a table")
    return value


def _build(
    cls: type[_T], values: Mapping[str, Any], where: str, keys: Iterable[str] = (), **extra: Any
) -> _T:
    """``cls(**values, **extra)``. A key of ``values`` that is no field, or one ``extra`` sets,
    is refused with the closest key the file may use (those fields, and ``keys``: the table's
    keys read apart, such as a base's ``source``)."""
    known = set(cls.__dataclass_fields__) - set(extra)  # type: ignore[attr-defined]
    unknown = sorted(set(values) - known)
    if unknown:
        raise ConfigError(f"{where}: unknown key(s) {unknown_names(unknown, known | set(keys))}")
    try:
        return cls(**{**values, **extra})
    except TypeError as exc:
        raise ConfigError(f"{where}: {exc}") from exc


def _path(base: Path, value: Any, where: str) -> Path:
    if not isinstance(value, str) or not value:
        raise ConfigError(f"{where}: expected a path string, got {value!r}")
    p = Path(value).expanduser()
    return p if p.is_absolute() else (base / p).resolve()


def _functions(
    raw: Mapping[str, Any], kbs: list[KnowledgeBaseConfig], where: str
) -> tuple[FunctionConfig, ...]:
    """The [[function]] tables; each may reach only a configured base and sources of it."""
    fn_list = raw.get("function", [])
    if not isinstance(fn_list, list):
        raise ConfigError(f"{where}: function must be an array of tables [[function]]")
    sources_of = {kb.name: [s.name for s in kb.sources] for kb in kbs}
    functions: list[FunctionConfig] = []
    for i, fn_raw in enumerate(fn_list):
        fn_where = f"{where} [[function]] #{i + 1}"
        if not isinstance(fn_raw, dict):
            raise ConfigError(f"{fn_where}: must be a table")
        fixed = _filters(fn_raw.get("filters", {}), f"{fn_where} filters")
        fn = _build(FunctionConfig, {**fn_raw, "sources": (), "filters": fixed}, fn_where)
        if not isinstance(fn.name, str) or not FUNCTION_NAME.fullmatch(fn.name):
            raise ConfigError(f"{fn_where}: name must be 1-64 of a-z A-Z 0-9 _ -, got {fn.name!r}")
        if not isinstance(fn.description, str) or not fn.description.strip():
            raise ConfigError(
                f"{fn_where}: a description is required: tell the model when to call it"
            )
        if fn.knowledge_base not in sources_of:
            known = ", ".join(sorted(sources_of)) or "none"
            raise ConfigError(
                f"{fn_where}: knowledge_base {fn.knowledge_base!r} is not a configured "
                f"[[knowledge_base]] (known: {known})"
            )
        sources = fn_raw.get("sources", [])
        if not isinstance(sources, list) or not all(isinstance(s, str) for s in sources):
            raise ConfigError(f"{fn_where}: sources must be a list of source names")
        allowed = sources_of[fn.knowledge_base]
        unknown = sorted(set(sources) - set(allowed))
        if unknown:
            raise ConfigError(
                f"{fn_where}: source(s) {', '.join(unknown)} not in knowledge base "
                f"{fn.knowledge_base!r} (its sources: {', '.join(allowed)})"
            )
        if len(set(sources)) != len(sources):
            raise ConfigError(f"{fn_where}: sources must be unique, got {sources}")
        if isinstance(fn.limit, bool) or not isinstance(fn.limit, int):
            raise ConfigError(f"{fn_where}: limit must be an integer, got {fn.limit!r}")
        if not 0 <= fn.limit <= MAX_FUNCTION_LIMIT:
            raise ConfigError(f"{fn_where}: limit must be 0..{MAX_FUNCTION_LIMIT}, got {fn.limit}")
        base = next(kb for kb in kbs if kb.name == fn.knowledge_base)
        filterable = _function_filterable(fn, fn_raw, base, fn_where)
        functions.append(replace(fn, sources=tuple(sources), filterable=filterable))
    names = [fn.name for fn in functions]
    if len(set(names)) != len(names):
        raise ConfigError(f"{where}: [[function]] names must be unique, got {names}")
    return tuple(functions)


def parse_config(raw: Mapping[str, Any], base: Path, path: Path | None = None) -> Config:
    """Build a Config from parsed TOML; ``base`` resolves relative paths."""
    where = str(path or "<config>")
    unknown = sorted(set(raw) - set(TABLES))
    if unknown:
        raise ConfigError(f"{where}: unknown table(s) {unknown_names(unknown, TABLES)}")

    emb_raw = _table(raw, "embedder", where)
    provider = emb_raw.get("provider", "local")
    if provider not in ("local", "openai"):
        raise ConfigError(f'{where}: [embedder] provider must be "local" or "openai"')
    if (
        provider == "openai"
    ):  # a build's requests as large as the API takes (index/embedders/remote.py)
        emb_raw = {"model": "text-embedding-3-small", "batch_size": OPENAI_MAX_INPUTS, **emb_raw}
    embedder = _build(EmbedderConfig, emb_raw, f"{where} [embedder]")
    if provider == "openai" and not 1 <= embedder.batch_size <= OPENAI_MAX_INPUTS:
        raise ConfigError(
            f"{where} [embedder] batch_size must be 1 to {OPENAI_MAX_INPUTS} for openai "
            "(the most inputs the embeddings API takes in one request)"
        )
    if provider == "openai":
        embedder = replace(embedder, api_key=os.environ.get(embedder.api_key_env, ""))

    kbs: list[KnowledgeBaseConfig] = []
    kb_list = raw.get("knowledge_base", [])
    if not isinstance(kb_list, list):
        raise ConfigError(f"{where}: knowledge_base must be an array of tables [[knowledge_base]]")
    for i, kb_raw in enumerate(kb_list):
        kb_where = f"{where} [[knowledge_base]] #{i + 1}"
        name = kb_raw.get("name")
        if not isinstance(name, str) or not name:
            raise ConfigError(f"{kb_where}: a name is required")
        sources = []
        for j, src in enumerate(kb_raw.get("source", [])):
            s_where = f"{kb_where} source #{j + 1}"
            s_type = src.get("type")
            if s_type not in SOURCE_TYPES:
                raise ConfigError(f"{s_where}: {_source_type_problem(src)}")
            s_name = src.get("name", s_type)
            s_path = _path(base, src["path"], s_where) if "path" in src else None
            options = {k: v for k, v in src.items() if k not in ("name", "type", "path")}
            source = SourceConfig(name=s_name, type=s_type, path=s_path, options=options)
            try:
                check_options(source)
            except ConfigError as exc:
                raise ConfigError(f"{kb_where}: {exc}") from None
            sources.append(source)
        if not sources:
            raise ConfigError(f"{kb_where}: at least one [[knowledge_base.source]] is required")
        names = [s.name for s in sources]
        if len(set(names)) != len(names):
            raise ConfigError(f"{kb_where}: source names must be unique, got {names}")
        apart = ("name", "source", "chunking", "hnsw", "rerank")
        rest = {k: v for k, v in kb_raw.items() if k not in apart}
        kbs.append(
            _build(
                KnowledgeBaseConfig,
                _kb_policy(rest, kb_where),
                kb_where,
                keys=apart,
                name=name,
                rerank=_rerank_config(kb_raw.get("rerank"), f"{kb_where} [rerank]"),
                sources=tuple(sources),
                chunking=_build(
                    ChunkingConfig, _table(kb_raw, "chunking", kb_where), f"{kb_where} [chunking]"
                ),
                hnsw=_build(HnswConfig, _table(kb_raw, "hnsw", kb_where), f"{kb_where} [hnsw]"),
            )
        )
    if len({kb.name for kb in kbs}) != len(kbs):
        raise ConfigError(f"{where}: knowledge base names must be unique")

    idx_raw = dict(_table(raw, "index", where))
    for key in ("store", "cache_dir"):
        if key in idx_raw:
            idx_raw[key] = _path(base, idx_raw[key], f"{where} [index] {key}")
    idx_raw.setdefault("store", (base / "store").resolve())
    idx_raw.setdefault("cache_dir", Path(idx_raw["store"]) / ".embedding-cache")
    idx_raw["registry"] = _path(base, idx_raw.get("registry", "sources.json"), f"{where} [index]")
    if "llm" in idx_raw:
        idx_raw["llm"] = _llm_config(
            _table(idx_raw, "llm", f"{where} [index]"), base, Path(idx_raw["store"]), where
        )
    if "rebuild_token" in idx_raw:
        raise ConfigError(
            f"{where} [index]: a token never goes in the file: name its variable with "
            "rebuild_token_env"
        )
    index = _build(IndexConfig, idx_raw, f"{where} [index]")
    index = replace(index, rebuild_token=os.environ.get(index.rebuild_token_env, ""))
    _check_enrichment(kbs, index, where)

    sc_raw = dict(_table(raw, "sidecar", where))
    store = sc_raw.get("store")
    if isinstance(store, str) and store.startswith(("http://", "https://", "s3://")):
        sc_raw["store"] = store.rstrip("/")
    else:
        sc_raw["store"] = (
            _path(base, store, f"{where} [sidecar] store") if "store" in sc_raw else index.store
        )
    sc_raw["cache_dir"] = _path(
        base, sc_raw.get("cache_dir", ".snapshot-cache"), f"{where} [sidecar] cache_dir"
    )
    sc_where = f"{where} [sidecar]"
    sc_raw["skip"] = _skip_config(_table(sc_raw, "skip", sc_where), f"{where} [sidecar.skip]")
    sc_raw["followups"] = _followup_config(
        _table(sc_raw, "followups", sc_where), f"{where} [sidecar.followups]"
    )
    sc_raw["tls"] = _tls_config(_table(sc_raw, "tls", sc_where), base, f"{where} [sidecar.tls]")
    sc_raw["auth"] = _auth_config(_table(sc_raw, "auth", sc_where), f"{where} [sidecar.auth]")
    sc_raw["http"] = _http_config(_table(sc_raw, "http", sc_where), kbs, f"{where} [sidecar.http]")
    sidecar = _build(SidecarConfig, sc_raw, f"{where} [sidecar]")
    _check_operations(sidecar, sc_where)
    _check_shard(sidecar.shard, sidecar.shards, sc_where)
    if sidecar.keep_downloaded < 1:
        raise ConfigError(f"{where} [sidecar] keep_downloaded must be >= 1 (the serving version)")
    if not _whole(sidecar.memory_budget_mb) or sidecar.memory_budget_mb < 0:
        raise ConfigError(
            f"{where} [sidecar] memory_budget_mb must be a whole number of MiB, 0 for no budget "
            "(every base loaded at start)"
        )
    if min(sidecar.poll_seconds, sidecar.http_timeout_s, sidecar.http_download_timeout_s) <= 0:
        raise ConfigError(
            f"{where} [sidecar] poll_seconds, http_timeout_s and http_download_timeout_s "
            "must be > 0"
        )
    if (
        isinstance(sidecar.workers, bool)
        or not isinstance(sidecar.workers, int)
        or not (1 <= sidecar.workers <= MAX_WORKERS)
    ):
        raise ConfigError(
            f"{where} [sidecar] workers must be a whole number from 1 to {MAX_WORKERS}"
        )
    ef = sidecar.ef_search
    if isinstance(ef, bool) or not isinstance(ef, int) or not 0 <= ef <= MAX_EF_SEARCH:
        raise ConfigError(
            f"{where} [sidecar] ef_search must be a whole number from 0 (the snapshot's) "
            f"to {MAX_EF_SEARCH}"
        )
    chars = sidecar.tool_output_chars
    if isinstance(chars, bool) or not isinstance(chars, int) or chars < MIN_TOOL_OUTPUT_CHARS:
        raise ConfigError(
            f"{where} [sidecar] tool_output_chars must be at least {MIN_TOOL_OUTPUT_CHARS} (an integer)"
        )
    functions = _functions(raw, kbs, where)
    _check_scopes(sidecar.auth, kbs, functions, f"{where} [sidecar.auth]")
    sidecar = replace(sidecar, auth=_resolve_callers(sidecar, functions, f"{where} [sidecar.auth]"))
    return Config(
        embedder=embedder,
        knowledge_bases=tuple(kbs),
        index=index,
        sidecar=sidecar,
        path=path,
        functions=functions,
    )


def _llm_config(raw: Mapping[str, Any], base: Path, store: Path, where: str) -> LlmConfig:
    """``[index.llm]``: every limit a positive number; the key read from its variable here."""
    where = f"{where} [index.llm]"
    values = dict(raw)
    values["cache_dir"] = (
        _path(base, raw["cache_dir"], f"{where} cache_dir")
        if "cache_dir" in raw
        else store / ".llm-cache"
    )
    llm = _build(LlmConfig, values, where)
    for key in ("max_concurrency", "max_build_tokens", "max_output_tokens", "clean_min_bytes",
                "max_input_bytes", "max_image_bytes"):  # fmt: skip
        if not _whole(getattr(llm, key)) or getattr(llm, key) < 1:
            raise ConfigError(f"{where}: {key} must be a whole number >= 1")
    if not _whole(llm.retries) or llm.retries < 0:
        raise ConfigError(f"{where}: retries must be a whole number >= 0")
    if isinstance(llm.timeout_s, bool) or not isinstance(llm.timeout_s, int | float):
        raise ConfigError(f"{where}: timeout_s must be a number of seconds > 0")
    if llm.timeout_s <= 0 or not isinstance(llm.model, str) or not llm.model:
        raise ConfigError(f"{where}: timeout_s must be > 0 and model a model name")
    return replace(llm, api_key=os.environ.get(llm.api_key_env, ""))


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
        return f"type {src['type']!r} is not one of {types}"
    known = SOURCE_KEYS.union(*SOURCE_OPTIONS.values())
    unknown = sorted(set(src) - known)
    needed = f"type is required (one of {types})"
    return f"unknown key(s) {unknown_names(unknown, known)}; {needed}" if unknown else needed


def _skip_config(raw: Mapping[str, Any], where: str) -> SkipConfig:
    phrases = raw.get("phrases", [])
    if not isinstance(phrases, list) or not all(isinstance(p, str) and p.strip() for p in phrases):
        raise ConfigError(f"{where}: phrases must be a list of non-empty strings")
    skip = _build(SkipConfig, {**raw, "phrases": tuple(phrases)}, where)
    if not isinstance(skip.max_words, int) or skip.max_words < 1:
        raise ConfigError(f"{where}: max_words must be a whole number >= 1")
    if skip.language not in SKIP_LANGUAGES:
        raise ConfigError(
            f"{where}: language {skip.language!r} has no built-in word lists; "
            f"known: {', '.join(SKIP_LANGUAGES)}"
        )
    return skip


def _followup_config(raw: Mapping[str, Any], where: str) -> FollowupConfig:
    followups = _build(FollowupConfig, raw, where)
    if not isinstance(followups.enabled, bool):
        raise ConfigError(f"{where}: enabled must be true or false")
    if followups.fold not in ("always", "referring"):
        raise ConfigError(f'{where}: fold must be "always" or "referring"')
    return followups


def _check_operations(sidecar: SidecarConfig, where: str) -> None:
    _check_shared_limits(sidecar, where)
    low, high = MESSAGE_BYTES_RANGE
    if (
        not isinstance(sidecar.max_message_bytes, int)
        or not low <= sidecar.max_message_bytes <= high
    ):
        raise ConfigError(f"{where}: max_message_bytes must be between {low} and {high}")
    if sidecar.log_level not in LOG_LEVELS:
        raise ConfigError(f"{where}: log_level must be one of {', '.join(LOG_LEVELS)}")
    if sidecar.log_format not in ("json", "text"):
        raise ConfigError(f'{where}: log_format must be "json" or "text"')
    if sidecar.metrics_listen:
        host, _, port = str(sidecar.metrics_listen).rpartition(":")
        if not host or not port.isdigit() or int(port) > 65535:
            raise ConfigError(f"{where}: metrics_listen must be host:port, e.g. 127.0.0.1:9464")


def _check_shared_limits(sidecar: SidecarConfig, where: str) -> None:
    """The limits callers share (calls, streams, sessions and their bytes) and the idle bound."""
    for key in ("max_concurrent_rpcs", "max_streams", "max_sessions"):
        if not _whole(getattr(sidecar, key)) or getattr(sidecar, key) < 1:
            raise ConfigError(f"{where}: {key} must be a whole number >= 1")
    if not _whole(sidecar.max_session_bytes) or sidecar.max_session_bytes < MIN_SESSION_BYTES:
        raise ConfigError(
            f"{where}: max_session_bytes must be a whole number >= {MIN_SESSION_BYTES} "
            "(room for the longest turn)"
        )
    if (
        not _whole(sidecar.session_memory_bytes)
        or sidecar.session_memory_bytes < sidecar.max_session_bytes
    ):
        raise ConfigError(f"{where}: session_memory_bytes must be >= max_session_bytes")
    if isinstance(sidecar.stream_idle_s, bool) or not (
        isinstance(sidecar.stream_idle_s, int | float) and sidecar.stream_idle_s > 0
    ):
        raise ConfigError(f"{where}: stream_idle_s must be a number of seconds > 0")


def _tls_config(raw: Mapping[str, Any], base: Path, where: str) -> TlsConfig:
    files = {
        key: _path(base, raw[key], f"{where} {key}")
        for key in ("cert_file", "key_file", "client_ca_file")
        if key in raw
    }
    tls = _build(TlsConfig, {**raw, **files}, where)
    if (tls.cert_file is None) != (tls.key_file is None):
        raise ConfigError(f"{where}: cert_file and key_file go together")
    if tls.client_ca_file is not None and tls.cert_file is None:
        raise ConfigError(f"{where}: mutual TLS (client_ca_file) needs cert_file and key_file too")
    return tls


MIN_BODY_BYTES = 4 * 1024  # a tool call's arguments or a short Vapi conversation must fit


def _http_config(raw: Mapping[str, Any], kbs: list[KnowledgeBaseConfig], where: str) -> HttpConfig:
    """``[sidecar.http]``: the listen address, the body limit, Vapi's base, the secrets."""
    for key in ("vapi_secret", "webhook_secret"):
        if key in raw:
            raise ConfigError(
                f"{where}: a secret never goes in the file: put it in an environment variable "
                f"and name that with {key}_env"
            )
    bases = _names(raw, "read_page_bases", where)
    http = _build(
        HttpConfig, {**raw, "read_page_bases": bases}, where, vapi_secret="", webhook_secret=""
    )
    if http.listen:
        host, _, port = str(http.listen).rpartition(":")
        if not host or not port.isdigit() or int(port) > 65535:
            raise ConfigError(f"{where}: listen must be host:port, e.g. 127.0.0.1:8080")
    if not _whole(http.max_body_bytes) or http.max_body_bytes < MIN_BODY_BYTES:
        raise ConfigError(f"{where}: max_body_bytes must be a whole number >= {MIN_BODY_BYTES}")
    known = {kb.name for kb in kbs}
    named = [*bases, *([http.vapi_knowledge_base] if http.vapi_knowledge_base else [])]
    unknown = sorted(set(named) - known)
    if kbs and unknown:
        raise ConfigError(f"{where}: knowledge base(s) {', '.join(unknown)} are not configured")
    for key in ("vapi_secret_env", "webhook_secret_env"):
        if not isinstance(getattr(http, key), str):
            raise ConfigError(f"{where}: {key} must be the name of an environment variable")
    return replace(
        http,
        vapi_secret=os.environ.get(http.vapi_secret_env, "") if http.vapi_secret_env else "",
        webhook_secret=os.environ.get(http.webhook_secret_env, "")
        if http.webhook_secret_env
        else "",
    )


# Names the knowledge tool's arguments already use: a filterable field cannot take them.
TOOL_ARGUMENTS = ("query", "sources", "source_paths")


def _strings(value: Any, where: str) -> tuple[str, ...]:
    if not isinstance(value, list) or not all(isinstance(v, str) and v for v in value):
        raise ConfigError(f"{where} must be a list of non-empty strings")
    if len(set(value)) != len(value):
        raise ConfigError(f"{where} must not repeat a name, got {value}")
    return tuple(value)


def _filters(raw: Any, where: str) -> tuple[MetadataFilter, ...]:
    """A filters table, ``{ plan_scope = ["starter", "all"], tags = "billing" }``: per field
    the values any of which passes; the fields all apply."""
    if not isinstance(raw, dict):
        raise ConfigError(f'{where} must be a table like {{ plan_scope = ["starter", "all"] }}')
    out = []
    for name, values in sorted(raw.items()):
        given = [values] if isinstance(values, str) else values
        if not name or not isinstance(given, list) or not given:
            raise ConfigError(f"{where}: {name!r} needs a value or a non-empty list of values")
        out.append(MetadataFilter(name, _strings(given, f"{where}: {name}")))
    return tuple(out)


def _kb_policy(rest: Mapping[str, Any], where: str) -> dict[str, Any]:
    """A base's ``filterable``, ``fallback`` and ``instructions``, checked by type."""
    out = dict(rest)
    if "filterable" in out:
        out["filterable"] = _strings(out["filterable"], f"{where}: filterable")
    for key in ("fallback", "instructions"):
        if key in out and not isinstance(out[key], str):
            raise ConfigError(f"{where}: {key} must be a string")
    return out


def _rerank_config(raw: Any, where: str) -> RerankConfig | None:
    if raw is None:
        return None
    if not isinstance(raw, dict):
        raise ConfigError(f"{where} must be a table")
    url = raw.get("base_url")
    if not isinstance(url, str) or not url.startswith(("http://", "https://")):
        raise ConfigError(f"{where}: base_url is required: the http(s) URL before /rerank")
    rerank = _build(RerankConfig, {**raw, "base_url": url.rstrip("/")}, where)
    if not isinstance(rerank.model, str) or not isinstance(rerank.api_key_env, str):
        raise ConfigError(f"{where}: model and api_key_env must be strings")
    if not _whole(rerank.candidates) or not 1 <= rerank.candidates <= MAX_RERANK_CANDIDATES:
        raise ConfigError(f"{where}: candidates must be 1..{MAX_RERANK_CANDIDATES}")
    share = rerank.budget_share
    if isinstance(share, bool) or not isinstance(share, int | float) or not 0 < share < 1:
        raise ConfigError(f"{where}: budget_share must be a number between 0 and 1")
    if not _whole(rerank.max_response_bytes) or rerank.max_response_bytes < 1024:
        raise ConfigError(f"{where}: max_response_bytes must be a whole number >= 1024")
    key = os.environ.get(rerank.api_key_env, "") if rerank.api_key_env else ""
    return replace(rerank, api_key=key, budget_share=float(share))


def _function_filterable(
    fn: FunctionConfig, raw: Mapping[str, Any], base: KnowledgeBaseConfig, where: str
) -> tuple[str, ...]:
    """The fields a function's model may filter on (its ``filterable``, else its base's),
    each one its base indexes; its fixed filters may name only those the base indexes."""
    given = _strings(raw["filterable"], f"{where}: filterable") if "filterable" in raw else None
    fields = base.filterable if given is None else given
    fixed = [f.field for f in fn.filters]
    unknown = sorted(set(fields).union(fixed) - set(base.filterable))
    if unknown:
        raise ConfigError(
            f"{where}: {', '.join(unknown)} not in knowledge base {base.name!r}'s filterable "
            f"({', '.join(base.filterable) or 'none'}): add them there"
        )
    clash = sorted(set(fields) & set(TOOL_ARGUMENTS))
    if clash:
        raise ConfigError(f"{where}: a filterable field cannot be named {', '.join(clash)}")
    return fields


def _names(raw: Mapping[str, Any], key: str, where: str) -> tuple[str, ...]:
    value = raw.get(key, [])
    if not isinstance(value, list) or not all(isinstance(v, str) and v for v in value):
        raise ConfigError(f"{where}: {key} must be a list of names")
    return tuple(value)


def _auth_config(raw: Mapping[str, Any], where: str) -> AuthConfig:
    """The default token (``token_env`` in ``[sidecar.auth]``) and ``[[sidecar.auth.caller]]``s.

    Tokens are read from the environment here, once; an unset variable leaves the token empty
    and the sidecar refuses to start (an index build with the same file does not need it)."""
    callers_raw = raw.get("caller", [])
    if not isinstance(callers_raw, list):
        raise ConfigError(f"{where}: caller must be an array of tables [[sidecar.auth.caller]]")
    top = {k: v for k, v in raw.items() if k != "caller"}
    entries = [(where, {"name": "default", **top})] if top else []
    entries += [(f"{where} caller #{i + 1}", c) for i, c in enumerate(callers_raw)]
    callers = []
    for c_where, c_raw in entries:
        if not isinstance(c_raw, dict):
            raise ConfigError(f"{c_where}: must be a table")
        if "token" in c_raw:
            raise ConfigError(
                f"{c_where}: a token never goes in the file: put it in an environment variable "
                "and name that with token_env"
            )
        for key in ("name", "token_env"):
            if not isinstance(c_raw.get(key), str) or not c_raw[key]:
                raise ConfigError(f"{c_where}: {key} is required")
        scope: dict[str, Any] = {
            key: _names(c_raw, key, c_where) for key in ("knowledge_bases", "functions")
        }
        scope["filters"] = _filters(c_raw.get("filters", {}), f"{c_where} filters")
        caller = _build(CallerConfig, {**c_raw, **scope}, c_where)
        callers.append(replace(caller, token=os.environ.get(caller.token_env, "")))
    names = [c.name for c in callers]
    if len(set(names)) != len(names):
        raise ConfigError(f"{where}: caller names must be unique, got {names}")
    return AuthConfig(callers=tuple(callers))


def _check_scopes(
    auth: AuthConfig,
    kbs: list[KnowledgeBaseConfig],
    functions: tuple[FunctionConfig, ...],
    where: str,
) -> None:
    """A scope may name only configured bases and functions, so a typo never locks a caller out
    silently (a config that names no base serves what the store has: bases are not checked)."""
    known_fns = {fn.name for fn in functions}
    for caller in auth.callers:
        unknown_fns = sorted(set(caller.functions) - known_fns)
        if unknown_fns:
            raise ConfigError(
                f"{where} {caller.name}: function(s) {', '.join(unknown_fns)} are not [[function]]s"
            )
        unknown_kbs = sorted(set(caller.knowledge_bases) - {kb.name for kb in kbs})
        if kbs and unknown_kbs:
            raise ConfigError(
                f"{where} {caller.name}: knowledge base(s) {', '.join(unknown_kbs)} are not "
                "configured"
            )


def _whole(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


# [sidecar] limits each caller gets a share of, and the least share that still works.
SHARED_LIMITS = ("max_concurrent_rpcs", "max_streams", "max_sessions", "session_memory_bytes")


def _resolve_callers(
    sidecar: SidecarConfig, functions: tuple[FunctionConfig, ...], where: str
) -> AuthConfig:
    """Each caller with its base scope defaulted to its functions' bases, and its shares."""
    bases = {fn.name: fn.knowledge_base for fn in functions}
    callers = [
        replace(c, knowledge_bases=tuple(dict.fromkeys(bases[f] for f in c.functions)))
        if c.functions and not c.knowledge_bases
        else c
        for c in sidecar.auth.callers
    ]
    for key in SHARED_LIMITS:
        least = sidecar.max_session_bytes if key == "session_memory_bytes" else 1
        given = [getattr(c, key) for c in callers]
        shares = _shares(getattr(sidecar, key), given, least, f"{where} {key}")
        callers = [_with(c, key, share) for c, share in zip(callers, shares, strict=True)]
    return replace(sidecar.auth, callers=tuple(callers))


def _with(caller: CallerConfig, key: str, value: int) -> CallerConfig:
    changes: dict[str, Any] = {key: value}
    return replace(caller, **changes)


def _shares(total: int, given: list[int], least: int, where: str) -> list[int]:
    """Explicit shares as given; the rest of ``total`` split evenly among the callers given 0.
    Shares add up to at most ``total``, so what one caller holds never takes another's."""
    if not all(_whole(g) and (g == 0 or g >= least) for g in given):
        raise ConfigError(f"{where}: a caller's share must be a whole number >= {least} (0: fair)")
    fixed = sum(given)
    if fixed > total:
        raise ConfigError(
            f"{where}: the callers' shares add up to {fixed}, more than the [sidecar] limit "
            f"{total}: lower them or raise the limit"
        )
    open_ = given.count(0)
    share = (total - fixed) // open_ if open_ else 0
    if open_ and share < least:
        raise ConfigError(
            f"{where}: {open_} caller(s) without a share would get {share} of what is left "
            f"({total - fixed}); the least that works is {least}: give them shares or raise the limit"
        )
    return [g or share for g in given]


def load_config(path: Path) -> Config:
    """Read and validate a TOML config file."""
    try:
        raw = tomllib.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError as exc:
        raise ConfigError(f"config file not found: {path}") from exc
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"{path}: not valid TOML: {exc}") from exc
    return parse_config(raw, path.resolve().parent, path)
