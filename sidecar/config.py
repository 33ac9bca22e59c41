"""The sidecar's configuration: the ``[sidecar]`` tables and ``[[function]]``s, and ``Config``,
the whole TOML file, read once in the entry point and passed down.

The indexer's tables (``[embedder]``, ``[[knowledge_base]]``, ``[index]``) are parsed by
``index/config.py``, whose ``BuildConfig`` this ``Config`` extends; one small parser per table
here. Every key is documented in docs/config.md. Nothing below the entry point reads the
environment: tokens and secrets are looked up here, by the variable names the file gives.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Literal

from index.config import (
    MAX_EF_SEARCH,
    BuildConfig,
    KnowledgeBaseConfig,
    Range,
    build_table,
    check_ranges,
    is_whole,
    named,
    parse_build_config,
    quoted,
    read_toml,
    refuse_secrets,
    resolve_path,
    sub_table,
    unique_strings,
    unknown_names,
)
from index.errors import ConfigError
from index.types import MetadataFilter
from sidecar.turn import skip

# OpenAI's rule for function names (Realtime, Responses and Chat Completions alike).
FUNCTION_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")
MAX_LIMIT = 50  # the most results one search returns: a request's limit and a function's
MAX_BUDGET_MS = 10_000  # the longest turn budget, [sidecar] budget_ms's and a call's alike
MAX_WORKERS = 64  # processes: each holds every snapshot in memory
MIN_TOOL_OUTPUT_CHARS = 200  # room for the JSON envelope, an error, or one short result
SKIP_LANGUAGES = tuple(skip.LEXICONS)  # the languages sidecar/turn/skip.py ships word lists for
# Python logging's level names, as it spells them (it takes no other spelling)
LogLevel = Literal["DEBUG", "INFO", "WARNING", "ERROR"]
# A session must hold at least its newest turn: 16 KiB of text (engine.MAX_TEXT_BYTES) and its costs.
MIN_SESSION_BYTES = 32 * 1024
# A page read whole (ReadPage) must fit; more lets one call pin that much memory per RPC.
MESSAGE_BYTES_RANGE = (64 * 1024, 64 * 1024 * 1024)
TABLES = ("embedder", "knowledge_base", "index", "sidecar", "function")


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
class SkipConfig:
    """``[sidecar.skip]``: which turns need no search (sidecar/turn/skip.py)."""

    max_words: int = skip.MAX_WORDS  # longer turns are never skipped
    phrases: tuple[str, ...] = ()  # closings to skip beside the language's built-in ones
    language: str = "en"  # selects the built-in word lists (SKIP_LANGUAGES)


@dataclass(frozen=True, slots=True)
class FollowupConfig:
    """``[sidecar.followups]``: how a follow-up turn's query is completed (sidecar/turn/followups.py)."""

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
    # Connections served at once (each worker): one more is answered 503 and closed, so a client
    # holding thousands open cannot take the file descriptors gRPC and the snapshots need. A
    # platform keeps a few per live call; the calls themselves are bounded by max_concurrent_rpcs.
    max_connections: int = 256
    # Connections served at once from one client address (each worker): one address cannot take
    # every connection; 0: no per-address cap (behind a proxy every connection shares its address)
    max_connections_per_ip: int = 32
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
    http_version_timeout_s: float = 1800.0  # per version (all its files) from an http(s) store
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
    # A connection with no call open for this long is closed (GOAWAY; a client reconnects on its
    # next call): idle connections, each a file descriptor, cannot pile up until none is left.
    # Well past a call's pauses: a reconnect costs the next turn ~1.5-2 ms on loopback, and with
    # ``workers`` > 1 it may reach another worker, which holds none of the call's session.
    max_connection_idle_s: float = 300.0
    # gRPC connections served at once (each worker); one more is refused at its accept. Each
    # holds a file descriptor and its calls' state: without a cap, connections whose calls never
    # sent their request took every descriptor (and ~20 KB a call) until none was left.
    max_grpc_connections: int = 1024
    max_message_bytes: int = 4 * 1024 * 1024
    metrics_listen: str = ""  # host:port for Prometheus; empty: no metrics endpoint
    workers: int = 1  # processes serving `listen` together (sidecar/edge/workers.py)
    # 0: every base is loaded at start and kept. Above 0: a base is loaded on its first call and
    # the least recently used ones are evicted while the loaded bases' bytes exceed this budget.
    memory_budget_mb: int = 0
    log_level: LogLevel = "INFO"
    log_format: Literal["json", "text"] = "json"
    tls: TlsConfig = TlsConfig()
    auth: AuthConfig = AuthConfig()
    http: HttpConfig = HttpConfig()


@dataclass(frozen=True, slots=True)
class Config(BuildConfig):
    """The whole file: what an index build reads (``BuildConfig``), ``[sidecar]`` and the
    ``[[function]]``s."""

    sidecar: SidecarConfig = SidecarConfig()
    functions: tuple[FunctionConfig, ...] = ()

    @property
    def default_knowledge_base(self) -> str:
        if self.sidecar.default_knowledge_base:
            return self.sidecar.default_knowledge_base
        return self.knowledge_bases[0].name if self.knowledge_bases else ""

    @property
    def secrets(self) -> list[str]:
        """Every secret value the file's variables gave: the sidecar's logs redact each one
        (``logs.configure``): callers' tokens, the embedder's, the LLM's and the rerankers'
        API keys, the HTTP door's Vapi and signing secrets."""
        http = self.sidecar.http
        keys = [self.embedder.api_key, http.vapi_secret, http.webhook_secret]
        keys += [c.token for c in self.sidecar.auth.callers]
        keys += [kb.rerank.api_key for kb in self.knowledge_bases if kb.rerank is not None]
        if self.index.llm is not None:
            keys.append(self.index.llm.api_key)
        return [key for key in keys if key]

    def with_overrides(self, **sidecar: Any) -> Config:
        """The same config with [sidecar] keys replaced (command-line flags); None means unset."""
        given = {k: v for k, v in sidecar.items() if v is not None}
        if not given:
            return self
        config = replace(self, sidecar=replace(self.sidecar, **given))
        if "listen" in given:
            check_listen(config.sidecar.listen, "--listen", "command line")
        _check_shard(config.sidecar.shard, config.sidecar.shards, "--shard:")
        return config


def parse_config(raw: Mapping[str, Any], base: Path, path: Path | None = None) -> Config:
    """Build a Config from parsed TOML; ``base`` resolves relative paths."""
    where = str(path or "<config>")
    unknown = sorted(set(raw) - set(TABLES))
    if unknown:
        raise ConfigError(f"{where}: unknown table(s) {unknown_names(unknown, TABLES)}")
    built = parse_build_config(raw, base, path)
    kbs = list(built.knowledge_bases)
    sidecar = _sidecar_config(sub_table(raw, "sidecar", where), base, built, where)
    functions = _functions(raw, kbs, where)
    _check_scopes(sidecar.auth, kbs, functions, f"{where} [sidecar.auth]")
    sidecar = replace(sidecar, auth=_resolve_callers(sidecar, functions, f"{where} [sidecar.auth]"))
    return Config(
        embedder=built.embedder,
        knowledge_bases=built.knowledge_bases,
        index=built.index,
        sidecar=sidecar,
        path=path,
        functions=functions,
    )


def load_config(path: Path) -> Config:
    """Read and validate a TOML config file."""
    return parse_config(read_toml(path), path.resolve().parent, path)


def _sidecar_config(
    raw: Mapping[str, Any], base: Path, built: BuildConfig, where: str
) -> SidecarConfig:
    """``[sidecar]`` with its sub-tables; the store defaults to ``[index] store``."""
    sc_where = f"{where} [sidecar]"
    values = dict(raw)
    values["store"] = _store(raw, base, built.index.store, where)
    values["cache_dir"] = resolve_path(
        base, raw.get("cache_dir", ".snapshot-cache"), f"{where} [sidecar] cache_dir"
    )
    values |= _sub_tables(raw, base, list(built.knowledge_bases), where)
    sidecar = build_table(SidecarConfig, values, sc_where)
    check_ranges(sidecar, SIDECAR_RANGES, sc_where)
    _check_addresses(sidecar, built, sc_where)
    _check_operations(sidecar, sc_where)
    _check_shard(sidecar.shard, sidecar.shards, sc_where)
    _check_worker_ports(sidecar, sc_where)
    return sidecar


# [sidecar]'s numeric keys no check below covers with more than a range (their types are the
# fields', checked by build_table): a value out of these stops the start, naming the key. Each has
# a top far past what a deployment uses: a count or a size that cannot run away with memory or
# threads, a time that every timer and clock takes (1e308 seconds overflows time_t).
HOUR_S = 3600.0
DAY_S = 86400.0  # also the most an idle limit may be: gRPC takes it in milliseconds, a 32-bit int
MAX_COUNT = 100_000  # calls, streams or connections at once, and cached queries
MAX_SESSIONS = 1_000_000
MAX_SESSION_MEMORY_BYTES = 64 * 1024**3
SIDECAR_RANGES = {
    "budget_ms": Range(1, MAX_BUDGET_MS, note="milliseconds, as a call's budget_ms"),
    "max_results": Range(1, MAX_LIMIT),
    "min_score": Range(-1, 1, note="a cosine similarity: over 1 no chunk ever passes"),
    "min_lexical_score": Range(0, 1000, note="a BM25 score"),
    "context_turns": Range(0, 100),
    "session_ttl_s": Range(0, DAY_S, above=True, note="seconds"),
    "query_cache_size": Range(0, MAX_COUNT, note="queries"),
    "context_bonus": Range(0, 1, note="added to a cosine similarity; 0: off"),
    "prefetch_stable_ms": Range(0, 60_000, note="milliseconds; 0: no prefetch"),
    "grace_s": Range(0, HOUR_S, note="seconds"),
    "poll_seconds": Range(0, DAY_S, above=True, note="seconds"),
    "keep_downloaded": Range(1, 100, note="the serving version"),
    "http_timeout_s": Range(0, HOUR_S, above=True, note="seconds"),
    "http_download_timeout_s": Range(0, DAY_S, above=True, note="seconds"),
    "http_version_timeout_s": Range(0, DAY_S, above=True, note="seconds"),
    "workers": Range(1, MAX_WORKERS, note="processes, each holding every snapshot"),
    "ef_search": Range(0, MAX_EF_SEARCH, note="0: the snapshot's"),
    "tool_output_chars": Range(MIN_TOOL_OUTPUT_CHARS, 1_000_000, note="characters"),
    "memory_budget_mb": Range(0, 1024**2, note="MiB; 0: no budget, every base loaded at start"),
    "max_message_bytes": Range(*MESSAGE_BYTES_RANGE),
    "max_concurrent_rpcs": Range(1, MAX_COUNT),
    "max_streams": Range(1, MAX_COUNT),
    "max_sessions": Range(1, MAX_SESSIONS),
    "max_session_bytes": Range(
        MIN_SESSION_BYTES, MESSAGE_BYTES_RANGE[1], note="room for the longest turn"
    ),
    "stream_idle_s": Range(0, DAY_S, above=True, note="seconds"),
    "max_connection_idle_s": Range(0, DAY_S, above=True, note="seconds"),
    "max_grpc_connections": Range(1, MAX_COUNT),
}


def _store(raw: Mapping[str, Any], base: Path, index_store: Path, where: str) -> Path | str:
    """A URL (its trailing slash dropped), or a folder resolved like every path."""
    store = raw.get("store")
    if isinstance(store, str) and store.startswith(("http://", "https://", "s3://")):
        if "\0" in store:
            raise ConfigError(
                f"{where} [sidecar]: store cannot hold a NUL byte, got {quoted(store)}"
            )
        return store.rstrip("/")
    return resolve_path(base, store, f"{where} [sidecar] store") if "store" in raw else index_store


def _sub_tables(
    raw: Mapping[str, Any], base: Path, kbs: list[KnowledgeBaseConfig], where: str
) -> dict[str, Any]:
    """``[sidecar.skip]``, ``[sidecar.followups]``, ``[sidecar.tls]``, ``[sidecar.auth]`` and
    ``[sidecar.http]``, each by its own parser."""
    sc_where = f"{where} [sidecar]"
    return {
        "skip": _skip_config(sub_table(raw, "skip", sc_where), f"{where} [sidecar.skip]"),
        "followups": _followup_config(
            sub_table(raw, "followups", sc_where), f"{where} [sidecar.followups]"
        ),
        "tls": _tls_config(sub_table(raw, "tls", sc_where), base, f"{where} [sidecar.tls]"),
        "auth": _auth_config(sub_table(raw, "auth", sc_where), f"{where} [sidecar.auth]"),
        "http": _http_config(sub_table(raw, "http", sc_where), kbs, f"{where} [sidecar.http]"),
    }


def _check_addresses(sidecar: SidecarConfig, built: BuildConfig, where: str) -> None:
    """The addresses served on (gRPC's a unix socket too), and the default base, one that is
    configured."""
    check_listen(sidecar.listen, "listen", where)
    if sidecar.metrics_listen:
        _check_host_port(sidecar.metrics_listen, "metrics_listen", where, "127.0.0.1:9464")
    known = [kb.name for kb in built.knowledge_bases]
    default = sidecar.default_knowledge_base
    if default and known and default not in known:
        raise ConfigError(
            f"{where}: default_knowledge_base {quoted(default)} is not a configured [[knowledge_base]] "
            f"(known: {', '.join(known)})"
        )


# gRPC's unix socket addresses: a path, or an abstract socket's name (sidecar/connection.py
# dials them as local).
UNIX_LISTEN = ("unix:", "unix-abstract:")
MAX_PORT = 65535


def check_listen(address: str, key: str, where: str) -> None:
    """gRPC's ``listen``, from the file or ``--listen``: a unix socket or ``host:port``."""
    if address.startswith(UNIX_LISTEN) and address.partition(":")[2]:
        return
    _check_host_port(address, key, where, "127.0.0.1:50051 or unix:/run/voxrecall.sock")


def _check_host_port(address: str, key: str, where: str, example: str) -> None:
    """``host:port`` as a server binds it: an IPv6 host bracketed (``[::1]:50051``; ``::1:50051``
    reads two ways), the port ASCII digits (``int`` reads other scripts' digits, gRPC does not)
    up to 65535."""
    host, _, port = address.rpartition(":")
    bare_ipv6 = ":" in host and not (host.startswith("[") and host.endswith("]"))
    if not host or bare_ipv6 or not _is_port(port):
        raise ConfigError(
            f"{where}: {key} must be host:port, e.g. {example}, got {quoted(address)}"
        )


def _is_port(port: str) -> bool:
    return port.isascii() and port.isdigit() and int(port) <= MAX_PORT


def _check_worker_ports(sidecar: SidecarConfig, where: str) -> None:
    """Worker i serves metrics on metrics_listen's port + i (sidecar/edge/workers.py): each one
    a port, checked here rather than failing in the last workers once they have loaded."""
    if not sidecar.metrics_listen or sidecar.workers <= 1:
        return
    port = int(sidecar.metrics_listen.rpartition(":")[2])
    if port and port + sidecar.workers - 1 > MAX_PORT:
        raise ConfigError(
            f"{where} metrics_listen port {port} + {sidecar.workers - 1}: worker i serves its "
            f"metrics on that port + i, over {MAX_PORT} for the last of {sidecar.workers} workers"
        )


def _check_shard(shard: object, shards: object, where: str) -> None:
    """``[sidecar] shards`` (1 to 65536) and ``shard`` (0 to shards - 1), as integers."""
    if not (isinstance(shards, int) and not isinstance(shards, bool) and 1 <= shards <= 65536):
        raise ConfigError(
            f"{where} shards must be an integer from 1 to 65536, got {quoted(shards)}"
        )
    if not (isinstance(shard, int) and not isinstance(shard, bool) and 0 <= shard < shards):
        raise ConfigError(
            f"{where} shard must be an integer from 0 to shards - 1 ({shards - 1}), got {quoted(shard)}"
            " (`voxrecall serve --shard I` sets it per replica)"
        )


def _functions(
    raw: Mapping[str, Any], kbs: list[KnowledgeBaseConfig], where: str
) -> tuple[FunctionConfig, ...]:
    """The [[function]] tables; each may reach only a configured base and sources of it."""
    fn_list = raw.get("function", [])
    if not isinstance(fn_list, list):
        raise ConfigError(f"{where}: function must be an array of tables [[function]]")
    functions = [
        _function(fn_raw, kbs, f"{where} [[function]] #{i + 1}") for i, fn_raw in enumerate(fn_list)
    ]
    names = [fn.name for fn in functions]
    if len(set(names)) != len(names):
        raise ConfigError(f"{where}: [[function]] names must be unique, got {named(names)}")
    return tuple(functions)


def _function(fn_raw: Any, kbs: list[KnowledgeBaseConfig], fn_where: str) -> FunctionConfig:
    """One [[function]]: its name, description and base, then its sources, limit and fields."""
    if not isinstance(fn_raw, dict):
        raise ConfigError(f"{fn_where}: must be a table")
    fixed = _filters(fn_raw.get("filters", {}), f"{fn_where} filters")
    fn = build_table(FunctionConfig, {**fn_raw, "sources": (), "filters": fixed}, fn_where)
    if not isinstance(fn.name, str) or not FUNCTION_NAME.fullmatch(fn.name):
        raise ConfigError(
            f"{fn_where}: name must be 1-64 of a-z A-Z 0-9 _ -, got {quoted(fn.name)}"
        )
    if not isinstance(fn.description, str) or not fn.description.strip():
        raise ConfigError(f"{fn_where}: a description is required: tell the model when to call it")
    base = next((kb for kb in kbs if kb.name == fn.knowledge_base), None)
    if base is None:
        known = ", ".join(sorted(kb.name for kb in kbs)) or "none"
        raise ConfigError(
            f"{fn_where}: knowledge_base {quoted(fn.knowledge_base)} is not a configured "
            f"[[knowledge_base]] (known: {known})"
        )
    sources = _function_sources(fn_raw.get("sources", []), base, fn_where)
    if not 0 <= fn.limit <= MAX_LIMIT:
        raise ConfigError(f"{fn_where}: limit must be 0..{MAX_LIMIT}, got {fn.limit}")
    filterable = _function_filterable(fn, fn_raw, base, fn_where)
    return replace(fn, sources=sources, filterable=filterable)


def _function_sources(sources: Any, base: KnowledgeBaseConfig, fn_where: str) -> tuple[str, ...]:
    """A function's ``sources``: unique names of its base's sources (none: all of them)."""
    if not isinstance(sources, list) or not all(isinstance(s, str) for s in sources):
        raise ConfigError(f"{fn_where}: sources must be a list of source names")
    allowed = [s.name for s in base.sources]
    unknown = sorted(set(sources) - set(allowed))
    if unknown:
        raise ConfigError(
            f"{fn_where}: source(s) {', '.join(unknown)} not in knowledge base "
            f"{base.name!r} (its sources: {', '.join(allowed)})"
        )
    if len(set(sources)) != len(sources):
        raise ConfigError(f"{fn_where}: sources must be unique, got {named(sources)}")
    return tuple(sources)


def _skip_config(raw: Mapping[str, Any], where: str) -> SkipConfig:
    phrases = raw.get("phrases", [])
    if not isinstance(phrases, list) or not all(isinstance(p, str) and p.strip() for p in phrases):
        raise ConfigError(f"{where}: phrases must be a list of non-empty strings")
    skip = build_table(SkipConfig, {**raw, "phrases": tuple(phrases)}, where)
    check_ranges(skip, {"max_words": Range(1, 1000, note="words")}, where)
    if skip.language not in SKIP_LANGUAGES:
        raise ConfigError(
            f"{where}: language {quoted(skip.language)} has no built-in word lists; "
            f"known: {', '.join(SKIP_LANGUAGES)}"
        )
    return skip


def _followup_config(raw: Mapping[str, Any], where: str) -> FollowupConfig:
    followups = build_table(FollowupConfig, raw, where)
    if not isinstance(followups.enabled, bool):
        raise ConfigError(f"{where}: enabled must be true or false")
    if followups.fold not in ("always", "referring"):
        raise ConfigError(f'{where}: fold must be "always" or "referring"')
    return followups


def _check_operations(sidecar: SidecarConfig, where: str) -> None:
    """What the ranges cannot say alone: the sessions' memory against one session's bytes."""
    room = Range(
        sidecar.max_session_bytes,
        MAX_SESSION_MEMORY_BYTES,
        note="at least max_session_bytes, so one session fits",
    )
    check_ranges(sidecar, {"session_memory_bytes": room}, where)


def _tls_config(raw: Mapping[str, Any], base: Path, where: str) -> TlsConfig:
    files = {
        key: resolve_path(base, raw[key], f"{where} {key}")
        for key in ("cert_file", "key_file", "client_ca_file")
        if key in raw
    }
    tls = build_table(TlsConfig, {**raw, **files}, where)
    if (tls.cert_file is None) != (tls.key_file is None):
        raise ConfigError(f"{where}: cert_file and key_file go together")
    if tls.client_ca_file is not None and tls.cert_file is None:
        raise ConfigError(f"{where}: mutual TLS (client_ca_file) needs cert_file and key_file too")
    return tls


MIN_BODY_BYTES = 4 * 1024  # a tool call's arguments or a short Vapi conversation must fit


def _http_config(raw: Mapping[str, Any], kbs: list[KnowledgeBaseConfig], where: str) -> HttpConfig:
    """``[sidecar.http]``: the listen address, the body limit, Vapi's base, the secrets."""
    refuse_secrets(raw, ["vapi_secret", "webhook_secret"], where)
    bases = _names(raw, "read_page_bases", where)
    http = build_table(
        HttpConfig, {**raw, "read_page_bases": bases}, where, vapi_secret="", webhook_secret=""
    )
    if http.listen:
        _check_host_port(http.listen, "listen", where, "127.0.0.1:8080")
    check_ranges(http, HTTP_RANGES, where)
    known = {kb.name for kb in kbs}
    given = [*bases, *([http.vapi_knowledge_base] if http.vapi_knowledge_base else [])]
    unknown = sorted(set(given) - known)
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


HTTP_RANGES = {
    "max_body_bytes": Range(MIN_BODY_BYTES, MESSAGE_BYTES_RANGE[1], note="bytes"),
    "max_connections": Range(1, MAX_COUNT),
    "max_connections_per_ip": Range(0, MAX_COUNT, note="0: off"),
}


# Names the knowledge tool's arguments already use: a filterable field cannot take them.
TOOL_ARGUMENTS = ("query", "sources", "source_paths")


def _filters(raw: Any, where: str) -> tuple[MetadataFilter, ...]:
    """A filters table, ``{ plan_scope = ["starter", "all"], tags = "billing" }``: per field
    the values any of which passes; the fields all apply."""
    if not isinstance(raw, dict):
        raise ConfigError(f'{where} must be a table like {{ plan_scope = ["starter", "all"] }}')
    out = []
    for name, values in sorted(raw.items()):
        given = [values] if isinstance(values, str) else values
        if not name or not isinstance(given, list) or not given:
            raise ConfigError(
                f"{where}: {quoted(name)} needs a value or a non-empty list of values"
            )
        out.append(MetadataFilter(name, unique_strings(given, f"{where}: {name}")))
    return tuple(out)


def _function_filterable(
    fn: FunctionConfig, raw: Mapping[str, Any], base: KnowledgeBaseConfig, where: str
) -> tuple[str, ...]:
    """The fields a function's model may filter on (its ``filterable``, else its base's),
    each one its base indexes; its fixed filters may name only those the base indexes."""
    given = (
        unique_strings(raw["filterable"], f"{where}: filterable") if "filterable" in raw else None
    )
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
        refuse_secrets(c_raw, ["token"], c_where)
        for key in ("name", "token_env"):
            if not isinstance(c_raw.get(key), str) or not c_raw[key]:
                raise ConfigError(f"{c_where}: {key} is required")
        scope: dict[str, Any] = {
            key: _names(c_raw, key, c_where) for key in ("knowledge_bases", "functions")
        }
        scope["filters"] = _filters(c_raw.get("filters", {}), f"{c_where} filters")
        caller = build_table(CallerConfig, {**c_raw, **scope}, c_where)
        callers.append(replace(caller, token=os.environ.get(caller.token_env, "")))
    names = [c.name for c in callers]
    if len(set(names)) != len(names):
        raise ConfigError(f"{where}: caller names must be unique, got {named(names)}")
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
    if not all(is_whole(g) and (g == 0 or g >= least) for g in given):
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
