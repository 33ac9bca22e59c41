"""The configuration: one TOML file, read once in the entry point and passed down.

Every key is documented in docs/config.md. Relative paths are resolved against the config file's
folder, so a config works from any working directory. Nothing below the entry point reads the
environment: the API key is looked up here, by the variable name the file gives.
"""

from __future__ import annotations

import os
import tomllib
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Literal, TypeVar

from index.errors import ConfigError

SOURCE_TYPES = ("markdown", "text", "html", "pdf", "url", "jsonl", "csv")
LOCAL_MODEL = "all-MiniLM-L6-v2-int8"
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
class KnowledgeBaseConfig:
    name: str
    sources: tuple[SourceConfig, ...]
    hybrid: bool = False  # fuse dense and lexical results by reciprocal rank
    chunking: ChunkingConfig = ChunkingConfig()
    hnsw: HnswConfig = HnswConfig()


@dataclass(frozen=True, slots=True)
class IndexConfig:
    store: Path = Path("store")
    keep_versions: int = 3
    cache_dir: Path = Path("store/.embedding-cache")
    strict: bool = False  # exit non-zero when any page is skipped


@dataclass(frozen=True, slots=True)
class SidecarConfig:
    listen: str = "127.0.0.1:50051"
    store: Path | str = Path("store")  # a folder, or an http(s):// URL (a str)
    default_knowledge_base: str = ""
    budget_ms: int = 150
    max_results: int = 3
    min_score: float = 0.3
    min_lexical_score: float = 1.0
    context_turns: int = 3  # retained context: this many turns' worth of chunks
    session_ttl_s: float = 900.0
    max_sessions: int = 10_000
    query_cache_size: int = 2048
    poll_seconds: float = 30.0
    grace_s: float = 5.0
    cache_dir: Path = Path(".snapshot-cache")  # where an http(s) store's downloads are kept
    keep_downloaded: int = 2  # downloaded versions kept per base: the current and the previous
    http_timeout_s: float = 10.0  # per connect and per read against an http(s) store


@dataclass(frozen=True, slots=True)
class Config:
    embedder: EmbedderConfig = EmbedderConfig()
    knowledge_bases: tuple[KnowledgeBaseConfig, ...] = ()
    index: IndexConfig = IndexConfig()
    sidecar: SidecarConfig = SidecarConfig()
    path: Path | None = None

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
        return replace(self, sidecar=replace(self.sidecar, **given)) if given else self


def _table(raw: Mapping[str, Any], key: str, where: str) -> dict[str, Any]:
    value = raw.get(key, {})
    if not isinstance(value, dict):
        raise ConfigError(f"{where}: [{key}] must be a table")
    return value


def _build(cls: type[_T], values: Mapping[str, Any], where: str, **extra: Any) -> _T:
    known = set(cls.__dataclass_fields__)  # type: ignore[attr-defined]
    unknown = sorted(set(values) - known)
    if unknown:
        raise ConfigError(f"{where}: unknown key(s) {', '.join(unknown)}")
    try:
        return cls(**{**values, **extra})
    except TypeError as exc:
        raise ConfigError(f"{where}: {exc}") from exc


def _path(base: Path, value: Any, where: str) -> Path:
    if not isinstance(value, str) or not value:
        raise ConfigError(f"{where}: expected a path string, got {value!r}")
    p = Path(value).expanduser()
    return p if p.is_absolute() else (base / p).resolve()


def parse_config(raw: Mapping[str, Any], base: Path, path: Path | None = None) -> Config:
    """Build a Config from parsed TOML; ``base`` resolves relative paths."""
    where = str(path or "<config>")
    unknown = sorted(set(raw) - {"embedder", "knowledge_base", "index", "sidecar", "function"})
    if unknown:
        raise ConfigError(f"{where}: unknown table(s) {', '.join(unknown)}")

    emb_raw = _table(raw, "embedder", where)
    provider = emb_raw.get("provider", "local")
    if provider not in ("local", "openai"):
        raise ConfigError(f'{where}: [embedder] provider must be "local" or "openai"')
    if provider == "openai":
        emb_raw = {"model": "text-embedding-3-small", **emb_raw}
    embedder = _build(EmbedderConfig, emb_raw, f"{where} [embedder]")
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
                raise ConfigError(f"{s_where}: type must be one of {', '.join(SOURCE_TYPES)}")
            s_name = src.get("name", s_type)
            s_path = _path(base, src["path"], s_where) if "path" in src else None
            options = {k: v for k, v in src.items() if k not in ("name", "type", "path")}
            sources.append(SourceConfig(name=s_name, type=s_type, path=s_path, options=options))
        if not sources:
            raise ConfigError(f"{kb_where}: at least one [[knowledge_base.source]] is required")
        names = [s.name for s in sources]
        if len(set(names)) != len(names):
            raise ConfigError(f"{kb_where}: source names must be unique, got {names}")
        rest = {k: v for k, v in kb_raw.items() if k not in ("name", "source", "chunking", "hnsw")}
        kbs.append(
            _build(
                KnowledgeBaseConfig,
                rest,
                kb_where,
                name=name,
                sources=tuple(sources),
                chunking=_build(ChunkingConfig, _table(kb_raw, "chunking", kb_where), kb_where),
                hnsw=_build(HnswConfig, _table(kb_raw, "hnsw", kb_where), kb_where),
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
    index = _build(IndexConfig, idx_raw, f"{where} [index]")

    sc_raw = dict(_table(raw, "sidecar", where))
    store = sc_raw.get("store")
    if isinstance(store, str) and store.startswith(("http://", "https://")):
        sc_raw["store"] = store.rstrip("/")
    else:
        sc_raw["store"] = (
            _path(base, store, f"{where} [sidecar] store") if "store" in sc_raw else index.store
        )
    sc_raw["cache_dir"] = _path(
        base, sc_raw.get("cache_dir", ".snapshot-cache"), f"{where} [sidecar] cache_dir"
    )
    sidecar = _build(SidecarConfig, sc_raw, f"{where} [sidecar]")
    if sidecar.keep_downloaded < 1:
        raise ConfigError(f"{where} [sidecar] keep_downloaded must be >= 1 (the serving version)")
    if sidecar.poll_seconds <= 0 or sidecar.http_timeout_s <= 0:
        raise ConfigError(f"{where} [sidecar] poll_seconds and http_timeout_s must be > 0")
    return Config(
        embedder=embedder, knowledge_bases=tuple(kbs), index=index, sidecar=sidecar, path=path
    )


def load_config(path: Path) -> Config:
    """Read and validate a TOML config file."""
    try:
        raw = tomllib.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError as exc:
        raise ConfigError(f"config file not found: {path}") from exc
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"{path}: not valid TOML: {exc}") from exc
    return parse_config(raw, path.resolve().parent, path)
