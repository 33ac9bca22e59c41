from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class Speaker(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    SPEAKER_UNSPECIFIED: _ClassVar[Speaker]
    USER: _ClassVar[Speaker]
    AGENT: _ClassVar[Speaker]

class SkipReason(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    NOT_SKIPPED: _ClassVar[SkipReason]
    BACKCHANNEL: _ClassVar[SkipReason]
    AGENT_TURN: _ClassVar[SkipReason]
    NOT_FINAL: _ClassVar[SkipReason]
    EMPTY: _ClassVar[SkipReason]
    CLOSING: _ClassVar[SkipReason]

class RerankStatus(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    RERANK_NONE: _ClassVar[RerankStatus]
    RERANKED: _ClassVar[RerankStatus]
    RERANK_TIMED_OUT: _ClassVar[RerankStatus]
    RERANK_FAILED: _ClassVar[RerankStatus]

class ToolFormat(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    TOOL_FORMAT_UNSPECIFIED: _ClassVar[ToolFormat]
    REALTIME: _ClassVar[ToolFormat]
    RESPONSES: _ClassVar[ToolFormat]
    CHAT_COMPLETIONS: _ClassVar[ToolFormat]
SPEAKER_UNSPECIFIED: Speaker
USER: Speaker
AGENT: Speaker
NOT_SKIPPED: SkipReason
BACKCHANNEL: SkipReason
AGENT_TURN: SkipReason
NOT_FINAL: SkipReason
EMPTY: SkipReason
CLOSING: SkipReason
RERANK_NONE: RerankStatus
RERANKED: RerankStatus
RERANK_TIMED_OUT: RerankStatus
RERANK_FAILED: RerankStatus
TOOL_FORMAT_UNSPECIFIED: ToolFormat
REALTIME: ToolFormat
RESPONSES: ToolFormat
CHAT_COMPLETIONS: ToolFormat

class Chunk(_message.Message):
    __slots__ = ("chunk_id", "knowledge_base", "source", "source_path", "title", "breadcrumbs", "text", "score", "url", "metadata")
    class MetadataEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    CHUNK_ID_FIELD_NUMBER: _ClassVar[int]
    KNOWLEDGE_BASE_FIELD_NUMBER: _ClassVar[int]
    SOURCE_FIELD_NUMBER: _ClassVar[int]
    SOURCE_PATH_FIELD_NUMBER: _ClassVar[int]
    TITLE_FIELD_NUMBER: _ClassVar[int]
    BREADCRUMBS_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    SCORE_FIELD_NUMBER: _ClassVar[int]
    URL_FIELD_NUMBER: _ClassVar[int]
    METADATA_FIELD_NUMBER: _ClassVar[int]
    chunk_id: str
    knowledge_base: str
    source: str
    source_path: str
    title: str
    breadcrumbs: _containers.RepeatedScalarFieldContainer[str]
    text: str
    score: float
    url: str
    metadata: _containers.ScalarMap[str, str]
    def __init__(self, chunk_id: _Optional[str] = ..., knowledge_base: _Optional[str] = ..., source: _Optional[str] = ..., source_path: _Optional[str] = ..., title: _Optional[str] = ..., breadcrumbs: _Optional[_Iterable[str]] = ..., text: _Optional[str] = ..., score: _Optional[float] = ..., url: _Optional[str] = ..., metadata: _Optional[_Mapping[str, str]] = ...) -> None: ...

class Timings(_message.Message):
    __slots__ = ("embed_ms", "search_ms", "total_ms")
    EMBED_MS_FIELD_NUMBER: _ClassVar[int]
    SEARCH_MS_FIELD_NUMBER: _ClassVar[int]
    TOTAL_MS_FIELD_NUMBER: _ClassVar[int]
    embed_ms: float
    search_ms: float
    total_ms: float
    def __init__(self, embed_ms: _Optional[float] = ..., search_ms: _Optional[float] = ..., total_ms: _Optional[float] = ...) -> None: ...

class MetadataFilter(_message.Message):
    __slots__ = ("field", "any_of")
    FIELD_FIELD_NUMBER: _ClassVar[int]
    ANY_OF_FIELD_NUMBER: _ClassVar[int]
    field: str
    any_of: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, field: _Optional[str] = ..., any_of: _Optional[_Iterable[str]] = ...) -> None: ...

class TurnRequest(_message.Message):
    __slots__ = ("session_id", "knowledge_base", "text", "speaker", "is_final", "budget_ms", "sources", "context_url", "filters", "source_paths")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    KNOWLEDGE_BASE_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    SPEAKER_FIELD_NUMBER: _ClassVar[int]
    IS_FINAL_FIELD_NUMBER: _ClassVar[int]
    BUDGET_MS_FIELD_NUMBER: _ClassVar[int]
    SOURCES_FIELD_NUMBER: _ClassVar[int]
    CONTEXT_URL_FIELD_NUMBER: _ClassVar[int]
    FILTERS_FIELD_NUMBER: _ClassVar[int]
    SOURCE_PATHS_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    knowledge_base: str
    text: str
    speaker: Speaker
    is_final: bool
    budget_ms: int
    sources: _containers.RepeatedScalarFieldContainer[str]
    context_url: str
    filters: _containers.RepeatedCompositeFieldContainer[MetadataFilter]
    source_paths: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, session_id: _Optional[str] = ..., knowledge_base: _Optional[str] = ..., text: _Optional[str] = ..., speaker: _Optional[_Union[Speaker, str]] = ..., is_final: _Optional[bool] = ..., budget_ms: _Optional[int] = ..., sources: _Optional[_Iterable[str]] = ..., context_url: _Optional[str] = ..., filters: _Optional[_Iterable[_Union[MetadataFilter, _Mapping]]] = ..., source_paths: _Optional[_Iterable[str]] = ...) -> None: ...

class TurnResponse(_message.Message):
    __slots__ = ("chunks", "context", "skipped", "degraded", "query", "timings", "snapshot_version", "truncated", "followup", "fallback", "instructions", "rerank")
    CHUNKS_FIELD_NUMBER: _ClassVar[int]
    CONTEXT_FIELD_NUMBER: _ClassVar[int]
    SKIPPED_FIELD_NUMBER: _ClassVar[int]
    DEGRADED_FIELD_NUMBER: _ClassVar[int]
    QUERY_FIELD_NUMBER: _ClassVar[int]
    TIMINGS_FIELD_NUMBER: _ClassVar[int]
    SNAPSHOT_VERSION_FIELD_NUMBER: _ClassVar[int]
    TRUNCATED_FIELD_NUMBER: _ClassVar[int]
    FOLLOWUP_FIELD_NUMBER: _ClassVar[int]
    FALLBACK_FIELD_NUMBER: _ClassVar[int]
    INSTRUCTIONS_FIELD_NUMBER: _ClassVar[int]
    RERANK_FIELD_NUMBER: _ClassVar[int]
    chunks: _containers.RepeatedCompositeFieldContainer[Chunk]
    context: _containers.RepeatedCompositeFieldContainer[Chunk]
    skipped: SkipReason
    degraded: bool
    query: str
    timings: Timings
    snapshot_version: str
    truncated: bool
    followup: FollowUp
    fallback: str
    instructions: str
    rerank: RerankStatus
    def __init__(self, chunks: _Optional[_Iterable[_Union[Chunk, _Mapping]]] = ..., context: _Optional[_Iterable[_Union[Chunk, _Mapping]]] = ..., skipped: _Optional[_Union[SkipReason, str]] = ..., degraded: _Optional[bool] = ..., query: _Optional[str] = ..., timings: _Optional[_Union[Timings, _Mapping]] = ..., snapshot_version: _Optional[str] = ..., truncated: _Optional[bool] = ..., followup: _Optional[_Union[FollowUp, _Mapping]] = ..., fallback: _Optional[str] = ..., instructions: _Optional[str] = ..., rerank: _Optional[_Union[RerankStatus, str]] = ...) -> None: ...

class FollowUp(_message.Message):
    __slots__ = ("used", "source", "confidence")
    USED_FIELD_NUMBER: _ClassVar[int]
    SOURCE_FIELD_NUMBER: _ClassVar[int]
    CONFIDENCE_FIELD_NUMBER: _ClassVar[int]
    used: str
    source: str
    confidence: float
    def __init__(self, used: _Optional[str] = ..., source: _Optional[str] = ..., confidence: _Optional[float] = ...) -> None: ...

class SearchRequest(_message.Message):
    __slots__ = ("knowledge_base", "query", "limit", "min_score", "sources", "session_id", "context_url", "vector", "filters", "source_paths")
    KNOWLEDGE_BASE_FIELD_NUMBER: _ClassVar[int]
    QUERY_FIELD_NUMBER: _ClassVar[int]
    LIMIT_FIELD_NUMBER: _ClassVar[int]
    MIN_SCORE_FIELD_NUMBER: _ClassVar[int]
    SOURCES_FIELD_NUMBER: _ClassVar[int]
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    CONTEXT_URL_FIELD_NUMBER: _ClassVar[int]
    VECTOR_FIELD_NUMBER: _ClassVar[int]
    FILTERS_FIELD_NUMBER: _ClassVar[int]
    SOURCE_PATHS_FIELD_NUMBER: _ClassVar[int]
    knowledge_base: str
    query: str
    limit: int
    min_score: float
    sources: _containers.RepeatedScalarFieldContainer[str]
    session_id: str
    context_url: str
    vector: bytes
    filters: _containers.RepeatedCompositeFieldContainer[MetadataFilter]
    source_paths: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, knowledge_base: _Optional[str] = ..., query: _Optional[str] = ..., limit: _Optional[int] = ..., min_score: _Optional[float] = ..., sources: _Optional[_Iterable[str]] = ..., session_id: _Optional[str] = ..., context_url: _Optional[str] = ..., vector: _Optional[bytes] = ..., filters: _Optional[_Iterable[_Union[MetadataFilter, _Mapping]]] = ..., source_paths: _Optional[_Iterable[str]] = ...) -> None: ...

class SearchResponse(_message.Message):
    __slots__ = ("chunks", "timings", "snapshot_version", "degraded", "fallback", "instructions", "rerank")
    CHUNKS_FIELD_NUMBER: _ClassVar[int]
    TIMINGS_FIELD_NUMBER: _ClassVar[int]
    SNAPSHOT_VERSION_FIELD_NUMBER: _ClassVar[int]
    DEGRADED_FIELD_NUMBER: _ClassVar[int]
    FALLBACK_FIELD_NUMBER: _ClassVar[int]
    INSTRUCTIONS_FIELD_NUMBER: _ClassVar[int]
    RERANK_FIELD_NUMBER: _ClassVar[int]
    chunks: _containers.RepeatedCompositeFieldContainer[Chunk]
    timings: Timings
    snapshot_version: str
    degraded: bool
    fallback: str
    instructions: str
    rerank: RerankStatus
    def __init__(self, chunks: _Optional[_Iterable[_Union[Chunk, _Mapping]]] = ..., timings: _Optional[_Union[Timings, _Mapping]] = ..., snapshot_version: _Optional[str] = ..., degraded: _Optional[bool] = ..., fallback: _Optional[str] = ..., instructions: _Optional[str] = ..., rerank: _Optional[_Union[RerankStatus, str]] = ...) -> None: ...

class EndSessionRequest(_message.Message):
    __slots__ = ("session_id",)
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    def __init__(self, session_id: _Optional[str] = ...) -> None: ...

class EndSessionResponse(_message.Message):
    __slots__ = ("existed",)
    EXISTED_FIELD_NUMBER: _ClassVar[int]
    existed: bool
    def __init__(self, existed: _Optional[bool] = ...) -> None: ...

class StatusRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class KnowledgeBaseStatus(_message.Message):
    __slots__ = ("name", "snapshot_version", "chunks", "pages", "age_seconds", "last_refusal")
    NAME_FIELD_NUMBER: _ClassVar[int]
    SNAPSHOT_VERSION_FIELD_NUMBER: _ClassVar[int]
    CHUNKS_FIELD_NUMBER: _ClassVar[int]
    PAGES_FIELD_NUMBER: _ClassVar[int]
    AGE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    LAST_REFUSAL_FIELD_NUMBER: _ClassVar[int]
    name: str
    snapshot_version: str
    chunks: int
    pages: int
    age_seconds: float
    last_refusal: str
    def __init__(self, name: _Optional[str] = ..., snapshot_version: _Optional[str] = ..., chunks: _Optional[int] = ..., pages: _Optional[int] = ..., age_seconds: _Optional[float] = ..., last_refusal: _Optional[str] = ...) -> None: ...

class StatusResponse(_message.Message):
    __slots__ = ("state", "knowledge_bases", "embedder", "dimension", "uptime_seconds", "sessions", "version", "session_bytes", "knowledge_bases_left_out")
    STATE_FIELD_NUMBER: _ClassVar[int]
    KNOWLEDGE_BASES_FIELD_NUMBER: _ClassVar[int]
    EMBEDDER_FIELD_NUMBER: _ClassVar[int]
    DIMENSION_FIELD_NUMBER: _ClassVar[int]
    UPTIME_SECONDS_FIELD_NUMBER: _ClassVar[int]
    SESSIONS_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    SESSION_BYTES_FIELD_NUMBER: _ClassVar[int]
    KNOWLEDGE_BASES_LEFT_OUT_FIELD_NUMBER: _ClassVar[int]
    state: str
    knowledge_bases: _containers.RepeatedCompositeFieldContainer[KnowledgeBaseStatus]
    embedder: str
    dimension: int
    uptime_seconds: float
    sessions: int
    version: str
    session_bytes: int
    knowledge_bases_left_out: int
    def __init__(self, state: _Optional[str] = ..., knowledge_bases: _Optional[_Iterable[_Union[KnowledgeBaseStatus, _Mapping]]] = ..., embedder: _Optional[str] = ..., dimension: _Optional[int] = ..., uptime_seconds: _Optional[float] = ..., sessions: _Optional[int] = ..., version: _Optional[str] = ..., session_bytes: _Optional[int] = ..., knowledge_bases_left_out: _Optional[int] = ...) -> None: ...

class ConverseRequest(_message.Message):
    __slots__ = ("turn",)
    TURN_FIELD_NUMBER: _ClassVar[int]
    turn: TurnRequest
    def __init__(self, turn: _Optional[_Union[TurnRequest, _Mapping]] = ...) -> None: ...

class ConverseResponse(_message.Message):
    __slots__ = ("turn", "prefetched", "transcript")
    TURN_FIELD_NUMBER: _ClassVar[int]
    PREFETCHED_FIELD_NUMBER: _ClassVar[int]
    TRANSCRIPT_FIELD_NUMBER: _ClassVar[int]
    turn: TurnResponse
    prefetched: bool
    transcript: str
    def __init__(self, turn: _Optional[_Union[TurnResponse, _Mapping]] = ..., prefetched: _Optional[bool] = ..., transcript: _Optional[str] = ...) -> None: ...

class ListToolsRequest(_message.Message):
    __slots__ = ("format",)
    FORMAT_FIELD_NUMBER: _ClassVar[int]
    format: ToolFormat
    def __init__(self, format: _Optional[_Union[ToolFormat, str]] = ...) -> None: ...

class Tool(_message.Message):
    __slots__ = ("name", "description", "knowledge_base", "sources", "realtime_json", "responses_json", "chat_completions_json", "instructions", "fallback")
    NAME_FIELD_NUMBER: _ClassVar[int]
    DESCRIPTION_FIELD_NUMBER: _ClassVar[int]
    KNOWLEDGE_BASE_FIELD_NUMBER: _ClassVar[int]
    SOURCES_FIELD_NUMBER: _ClassVar[int]
    REALTIME_JSON_FIELD_NUMBER: _ClassVar[int]
    RESPONSES_JSON_FIELD_NUMBER: _ClassVar[int]
    CHAT_COMPLETIONS_JSON_FIELD_NUMBER: _ClassVar[int]
    INSTRUCTIONS_FIELD_NUMBER: _ClassVar[int]
    FALLBACK_FIELD_NUMBER: _ClassVar[int]
    name: str
    description: str
    knowledge_base: str
    sources: _containers.RepeatedScalarFieldContainer[str]
    realtime_json: str
    responses_json: str
    chat_completions_json: str
    instructions: str
    fallback: str
    def __init__(self, name: _Optional[str] = ..., description: _Optional[str] = ..., knowledge_base: _Optional[str] = ..., sources: _Optional[_Iterable[str]] = ..., realtime_json: _Optional[str] = ..., responses_json: _Optional[str] = ..., chat_completions_json: _Optional[str] = ..., instructions: _Optional[str] = ..., fallback: _Optional[str] = ...) -> None: ...

class ListToolsResponse(_message.Message):
    __slots__ = ("tools",)
    TOOLS_FIELD_NUMBER: _ClassVar[int]
    tools: _containers.RepeatedCompositeFieldContainer[Tool]
    def __init__(self, tools: _Optional[_Iterable[_Union[Tool, _Mapping]]] = ...) -> None: ...

class InvokeToolRequest(_message.Message):
    __slots__ = ("name", "arguments_json", "session_id", "call_id")
    NAME_FIELD_NUMBER: _ClassVar[int]
    ARGUMENTS_JSON_FIELD_NUMBER: _ClassVar[int]
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    CALL_ID_FIELD_NUMBER: _ClassVar[int]
    name: str
    arguments_json: str
    session_id: str
    call_id: str
    def __init__(self, name: _Optional[str] = ..., arguments_json: _Optional[str] = ..., session_id: _Optional[str] = ..., call_id: _Optional[str] = ...) -> None: ...

class InvokeToolResponse(_message.Message):
    __slots__ = ("output", "is_error", "call_id", "chunks", "fallback", "instructions")
    OUTPUT_FIELD_NUMBER: _ClassVar[int]
    IS_ERROR_FIELD_NUMBER: _ClassVar[int]
    CALL_ID_FIELD_NUMBER: _ClassVar[int]
    CHUNKS_FIELD_NUMBER: _ClassVar[int]
    FALLBACK_FIELD_NUMBER: _ClassVar[int]
    INSTRUCTIONS_FIELD_NUMBER: _ClassVar[int]
    output: str
    is_error: bool
    call_id: str
    chunks: _containers.RepeatedCompositeFieldContainer[Chunk]
    fallback: str
    instructions: str
    def __init__(self, output: _Optional[str] = ..., is_error: _Optional[bool] = ..., call_id: _Optional[str] = ..., chunks: _Optional[_Iterable[_Union[Chunk, _Mapping]]] = ..., fallback: _Optional[str] = ..., instructions: _Optional[str] = ...) -> None: ...

class ReadPageRequest(_message.Message):
    __slots__ = ("knowledge_base", "source_path", "source", "offset")
    KNOWLEDGE_BASE_FIELD_NUMBER: _ClassVar[int]
    SOURCE_PATH_FIELD_NUMBER: _ClassVar[int]
    SOURCE_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    knowledge_base: str
    source_path: str
    source: str
    offset: int
    def __init__(self, knowledge_base: _Optional[str] = ..., source_path: _Optional[str] = ..., source: _Optional[str] = ..., offset: _Optional[int] = ...) -> None: ...

class ReadPageResponse(_message.Message):
    __slots__ = ("title", "text", "source", "source_path", "url", "snapshot_version", "truncated", "next_offset")
    TITLE_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    SOURCE_FIELD_NUMBER: _ClassVar[int]
    SOURCE_PATH_FIELD_NUMBER: _ClassVar[int]
    URL_FIELD_NUMBER: _ClassVar[int]
    SNAPSHOT_VERSION_FIELD_NUMBER: _ClassVar[int]
    TRUNCATED_FIELD_NUMBER: _ClassVar[int]
    NEXT_OFFSET_FIELD_NUMBER: _ClassVar[int]
    title: str
    text: str
    source: str
    source_path: str
    url: str
    snapshot_version: str
    truncated: bool
    next_offset: int
    def __init__(self, title: _Optional[str] = ..., text: _Optional[str] = ..., source: _Optional[str] = ..., source_path: _Optional[str] = ..., url: _Optional[str] = ..., snapshot_version: _Optional[str] = ..., truncated: _Optional[bool] = ..., next_offset: _Optional[int] = ...) -> None: ...
