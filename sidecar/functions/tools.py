"""Knowledge functions: their definitions in the formats models take, and one call of them.

A ``[[function]]`` is one knowledge base, optionally narrowed to some of its sources and by
fixed metadata filters the model cannot widen. Its arguments are ``query``, ``sources`` (when it
has more than one), ``source_paths`` (a prefix ending in ``/``, a glob, or a path) and one
optional argument per filterable field it allows (an enum of the values the serving snapshot
holds, when there are at most ``MAX_ENUM_VALUES``). ``KnowledgeFunction.definitions`` builds its
definition in three formats: OpenAI Realtime ``session.update`` tools (flat),
the Responses API (flat, strict) and Chat Completions (nested under ``function``). A call takes
the arguments exactly as the model emitted them. Anything wrong with them (bad JSON, an unknown
function, no query, a filter the function does not allow) comes back as an error *output* the
model can read and recover from: ``{"error": {"type": ..., "message": ...}}`` with
``is_error``, never a failed RPC. Every output, results and errors alike, is compact JSON of at
most ``[sidecar] tool_output_chars`` characters (so at most 4x that in bytes), however large or
odd the arguments; arguments over ``MAX_ARGUMENTS_BYTES`` are refused before they are parsed.
Only the functions the caller may see (``visible``, set per call by sidecar.edge.auth) are there for
it: one outside its scope is an unknown function, whose error lists only the visible ones.

``PageReader`` serves ``ReadPage`` and MCP's ``read_page``: a page, looked up by key in the
snapshot's pages, so no path outside the snapshot can be read; read in parts from an offset,
decoded once while it is kept (``PAGE_CACHE_BYTES``).
"""

from __future__ import annotations

import asyncio
import logging
import math
import sys
from collections import OrderedDict
from collections.abc import Iterable, Iterator, Mapping, Sequence
from contextvars import ContextVar
from dataclasses import dataclass, field
from typing import Any

import orjson
from cachetools import LRUCache

from index.config import named
from index.errors import SnapshotError
from index.filters import Allowed
from index.snapshot import LoadedSnapshot, page_key
from index.tables import PageTable
from index.types import MetadataFilter
from sidecar.config import Config, FunctionConfig
from sidecar.edge.limits import MAX_ARGUMENTS_BYTES, arguments_too_large, utf8_size
from sidecar.errors import (
    FilterRefused,
    InvalidArgument,
    NotFound,
    ResourceExhausted,
    ToolCallError,
)
from sidecar.snapshots.searcher import Searcher
from sidecar.turn import scope
from sidecar.turn.engine import MAX_TEXT_BYTES, NO_POLICY, BasePolicy, Engine, SearchInput
from sidecar.turn.hits import Hit

log = logging.getLogger("voxrecall.tools")

# Error types a model sees in {"error": {"type": ...}}; each says what to change.
INVALID_JSON = "invalid_json"
UNKNOWN_FUNCTION = "unknown_function"
INVALID_ARGUMENTS = "invalid_arguments"
FILTER_NOT_ALLOWED = "filter_not_allowed"
UNAVAILABLE = "unavailable"

QUERY = "query"
SOURCES = "sources"
SOURCE_PATHS = "source_paths"
# A field with more values than this is offered as free strings: an enum of hundreds of tags
# costs the model's context more than it helps.
MAX_ENUM_VALUES = 64
DEFINITIONS_KEPT = 64  # (function, snapshot version) definitions rendered and kept
MIN_EXCERPT_CHARS = 80  # a shorter excerpt rarely answers anything: drop a result instead
QUOTE_CHARS = 80  # how much of a model's bad input an error message repeats
QUOTED_ITEMS = 5  # how many of a model's bad keys or sources an error message repeats
# The functions the current call's caller may see; None: all (no auth, or an unscoped caller).
visible: ContextVar[frozenset[str] | None] = ContextVar("visible_functions", default=None)
NOTHING_FOUND = (
    "Nothing in the knowledge base matched. Say you could not find it, or ask the caller to "
    "rephrase; do not guess."
)
QUERY_DESCRIPTION = (
    "What to look up: the caller's question or its key words, self-contained (spell out what "
    "'it' or 'that' refers to from the conversation)."
)
# An optional argument's description ends with what leaving it out does: "null or left out"
# only where the schema allows null (strict mode), so a model's schema and its words agree.
SOURCES_DESCRIPTION = "Only search these sources; {omitted} searches all of them."
PATHS_DESCRIPTION = (
    'Only search pages under these paths: a folder ending in "/" (e.g. "billing/"), a glob '
    '(e.g. "billing/*.md") or one page\'s path; {omitted} searches every page.'
)
NO_PAGE_THERE = (
    "No page of the knowledge base is under source_paths {paths}: search again without "
    "source_paths (or with a path a result gave)."
)


def omitted(strict: bool) -> str:
    """How a description names an optional argument not given, as its schema allows it."""
    return "null or left out" if strict else "left out"


def field_description(name: str, strict: bool) -> str:
    return f"Only results whose {name} is one of these; {omitted(strict)}: any {name}."


def _dumps(value: Any) -> str:
    return orjson.dumps(value).decode()


def _quote(text: str) -> str:
    return repr(text if len(text) <= QUOTE_CHARS else text[:QUOTE_CHARS] + "...")


def _quote_all(texts: Sequence[str]) -> str:
    """The first few, quoted, and how many more there are."""
    shown = ", ".join(_quote(t) for t in texts[:QUOTED_ITEMS])
    more = len(texts) - QUOTED_ITEMS
    return f"{shown} and {more} more" if more > 0 else shown


def error_output(type_: str, message: str, max_chars: int | None = None) -> str:
    """The output for a failed call: what went wrong, in words the model can act on; with
    ``max_chars``, the message is cut (marked ...) until the whole output fits."""
    out = _dumps({"error": {"type": type_, "message": message}})
    while max_chars is not None and len(out) > max_chars and message:
        # each cut removes at least the overflow, and escapes only make a character longer
        message = message[: max(0, len(message) - (len(out) - max_chars) - 3)]
        out = _dumps({"error": {"type": type_, "message": message + "..."}})
    return out


@dataclass(frozen=True, slots=True)
class ToolCall:
    query: str
    sources: tuple[str, ...]  # what the search may reach; empty only for an unrestricted base
    filters: tuple[MetadataFilter, ...] = ()  # the model's, then the function's fixed ones
    source_paths: tuple[str, ...] = ()


# What a tool's arguments look like, for an error saying what to send.
ARGUMENTS_SHAPE = '{"query": "how do I reset my password"}'


def arguments_object(text: str, like: str = ARGUMENTS_SHAPE) -> dict[str, Any]:
    """A tool call's arguments, sent as the JSON text a model emitted, as their object (blank:
    none), or ``ToolCallError`` saying to send an object ``like`` this: the one reading every
    door (``/tools/``, gRPC ``InvokeTool``, MCP's ``tools/call``) gives them."""
    size = utf8_size(text, MAX_ARGUMENTS_BYTES)
    if size > MAX_ARGUMENTS_BYTES:
        raise ToolCallError(INVALID_ARGUMENTS, arguments_too_large(size))
    try:
        args = orjson.loads(text) if text.strip() else {}
    except orjson.JSONDecodeError as exc:
        raise _not_json(str(exc), like) from exc
    if not isinstance(args, dict):
        raise ToolCallError(INVALID_ARGUMENTS, not_an_object(like))
    return args


def finite_arguments(args: dict[str, Any], like: str = ARGUMENTS_SHAPE) -> dict[str, Any]:
    """Arguments a door was handed already parsed (MCP's, by its SDK, which reads ``1e99999``
    as infinity and orjson then writes as null), refused as ``arguments_object`` refuses their
    text on the other doors: a number past a double's range is no JSON the search reads."""
    values: list[Any] = [args]
    while values:  # not recursive: the nesting is as deep as the body allows
        value = values.pop()
        if isinstance(value, float) and not math.isfinite(value):
            raise _not_json(f"a number is {value} when parsed as double", like)
        if isinstance(value, dict):
            values.extend(value.values())
        elif isinstance(value, list):
            values.extend(value)
    return args


def _not_json(why: str, like: str) -> ToolCallError:
    return ToolCallError(
        INVALID_JSON, f"arguments are not valid JSON ({why}); send an object like {like}"
    )


# How deep a tool call's arguments may nest: a function's are an object of strings and lists of
# them (filters: three levels). MCP's SDK parses no deeper than about 200 levels.
MAX_ARGUMENTS_DEPTH = 32


def nested_past(value: Any, limit: int) -> bool:
    """Whether ``value`` (parsed JSON) nests lists and objects more than ``limit`` deep."""
    level: list[Any] = [value] if isinstance(value, dict | list) else []
    for _ in range(limit):  # each pass: the containers one level further in
        level = [
            inner
            for v in level
            for inner in (v.values() if isinstance(v, dict) else v)
            if isinstance(inner, dict | list)
        ]
        if not level:
            return False
    return bool(level)


def too_deep(limit: int, like: str) -> str:
    """What arguments nested past ``limit`` are told."""
    return f"the arguments nest lists and objects more than {limit} levels deep: send a flat object like {like}"


def not_an_object(like: str) -> str:
    """What arguments that are no JSON object are told."""
    return f"arguments must be a JSON object like {like}"


@dataclass(frozen=True, slots=True)
class KnowledgeFunction:
    """One configured function and the sources it may search."""

    config: FunctionConfig
    searchable: tuple[str, ...]  # the function's sources, or every source of its base
    policy: BasePolicy = NO_POLICY  # its base's fallback and instructions

    @property
    def name(self) -> str:
        return self.config.name

    @property
    def restricted(self) -> bool:
        """Whether the function reaches only some of its base's sources."""
        return bool(self.config.sources)

    @property
    def filterable(self) -> bool:
        """Whether the model may narrow a call to some sources (it has more than one)."""
        return len(self.searchable) > 1

    def allowed_values(self, name: str, values: Sequence[str]) -> list[str]:
        """The values of field ``name`` a model may ask for: ``values`` (the snapshot's),
        within the function's fixed filter on that field if it has one."""
        fixed = [f.any_of for f in self.config.filters if f.field == name]
        return [v for v in values if all(v in allowed for allowed in fixed)]

    def parameters(
        self, *, strict: bool, values: Mapping[str, Sequence[str]] | None = None
    ) -> dict[str, Any]:
        """The JSON Schema of the arguments; strict: every property required, optional ones
        nullable. ``values``: each filterable field's values in the serving snapshot (enums)."""
        properties: dict[str, Any] = {QUERY: {"type": "string", "description": QUERY_DESCRIPTION}}
        if self.filterable:
            properties[SOURCES] = _strings_argument(
                strict, SOURCES_DESCRIPTION.format(omitted=omitted(strict)), self.searchable
            )
        paths = PATHS_DESCRIPTION.format(omitted=omitted(strict))
        properties[SOURCE_PATHS] = _strings_argument(strict, paths, None)
        for name in self.config.filterable:
            known = self.allowed_values(name, (values or {}).get(name, ()))
            enum = known if 0 < len(known) <= MAX_ENUM_VALUES else None
            properties[name] = _strings_argument(strict, field_description(name, strict), enum)
        required = list(properties) if strict else [QUERY]
        return {
            "type": "object",
            "properties": properties,
            "required": required,
            "additionalProperties": False,
        }

    def realtime(self, values: Mapping[str, Sequence[str]] | None = None) -> dict[str, Any]:
        """A tool of OpenAI Realtime ``session.update`` (``session.tools[]``)."""
        return {
            "type": "function",
            "name": self.name,
            "description": self.config.description,
            "parameters": self.parameters(strict=False, values=values),
        }

    def responses(self, values: Mapping[str, Sequence[str]] | None = None) -> dict[str, Any]:
        """A function tool of the Responses API, in strict mode."""
        return {
            "type": "function",
            "name": self.name,
            "description": self.config.description,
            "parameters": self.parameters(strict=True, values=values),
            "strict": True,
        }

    def chat_completions(self, values: Mapping[str, Sequence[str]] | None = None) -> dict[str, Any]:
        """A tool of Chat Completions: ``{"type": "function", "function": {...}}``."""
        return {
            "type": "function",
            "function": {
                "name": self.name,
                "description": self.config.description,
                "parameters": self.parameters(strict=False, values=values),
            },
        }

    def definitions(
        self, values: Mapping[str, Sequence[str]] | None = None
    ) -> tuple[dict[str, Any], dict[str, Any], dict[str, Any]]:
        """The Realtime, Responses and Chat Completions definitions: the one schema builder
        every door (gRPC ``ListTools``, HTTP) renders tools with."""
        return self.realtime(values), self.responses(values), self.chat_completions(values)

    def parse(self, arguments_json: str) -> ToolCall:
        """The call the model meant, or ``ToolCallError`` saying what to change."""
        args = arguments_object(arguments_json)
        accepted = [QUERY, *([SOURCES] if self.filterable else []), SOURCE_PATHS]
        accepted += self.config.filterable
        extra = sorted(k for k in args if k not in accepted)
        if extra:  # a misnamed argument: no filter is involved
            raise ToolCallError(
                INVALID_ARGUMENTS,
                f"{self.name} does not take {_quote_all(extra)}; "
                f"it takes only {', '.join(accepted)}",
            )
        return ToolCall(
            query=self._query(args.get(QUERY)),
            sources=self._sources(args.get(SOURCES)),
            filters=(*self._filters(args), *self.config.filters),
            source_paths=_string_list(args.get(SOURCE_PATHS), SOURCE_PATHS),
        )

    def _filters(self, args: Mapping[str, Any]) -> tuple[MetadataFilter, ...]:
        """The model's filters: each a value or list of values of a field it may filter on,
        within the function's fixed filter on that field."""
        out = []
        for name in self.config.filterable:
            values = _string_list(args.get(name), name)
            if not values:
                continue
            refused = [v for v in values if not self.allowed_values(name, [v])]
            if refused:
                allowed = next(f.any_of for f in self.config.filters if f.field == name)
                raise ToolCallError(
                    FILTER_NOT_ALLOWED,
                    f"{self.name} cannot search {name} {_quote_all(refused)}; "
                    f"it may search {name} {_quote_all(list(allowed))}",
                )
            out.append(MetadataFilter(name, values))
        return tuple(out)

    def _query(self, query: Any) -> str:
        if query is None:
            raise ToolCallError(INVALID_ARGUMENTS, "query is required: what to look up")
        if not isinstance(query, str):
            raise ToolCallError(INVALID_ARGUMENTS, "query must be a string")
        if not query.strip():
            raise ToolCallError(INVALID_ARGUMENTS, "query is empty: send the words to look up")
        size = utf8_size(query, MAX_TEXT_BYTES)
        if size > MAX_TEXT_BYTES:
            raise ToolCallError(
                INVALID_ARGUMENTS,
                f"query is {size} bytes; keep it under {MAX_TEXT_BYTES}: the key words are enough",
            )
        return query

    def _sources(self, sources: Any) -> tuple[str, ...]:
        everything = self.searchable if self.restricted else ()
        if sources is None or sources == []:
            return everything
        if not isinstance(sources, list) or not all(isinstance(s, str) for s in sources):
            raise ToolCallError(
                INVALID_ARGUMENTS, "sources must be a list of source names, or null"
            )
        refused = [s for s in dict.fromkeys(sources) if s not in self.searchable]
        if refused:
            raise ToolCallError(
                FILTER_NOT_ALLOWED,
                f"{self.name} cannot search {_quote_all(refused)}; "
                f"its sources are {', '.join(self.searchable)}",
            )
        return tuple(dict.fromkeys(sources))


def _strings_argument(strict: bool, description: str, enum: Sequence[str] | None) -> dict[str, Any]:
    """An optional list-of-strings argument (nullable when strict: every key is required)."""
    items: dict[str, Any] = {"type": "string"}
    if enum is not None:
        items["enum"] = list(enum)
    return {
        "type": ["array", "null"] if strict else "array",
        "items": items,
        "description": description,
    }


def _string_list(value: Any, name: str) -> tuple[str, ...]:
    """A model's list of strings (or one string), without repeats; () for null or absent."""
    if value is None or value == []:
        return ()
    if isinstance(value, str):
        value = [value]
    if not isinstance(value, list) or not all(isinstance(v, str) and v for v in value):
        raise ToolCallError(
            INVALID_ARGUMENTS, f"{name} must be a list of non-empty strings, or null"
        )
    return tuple(dict.fromkeys(value))


def _result(hit: Hit) -> dict[str, Any]:
    c = hit.chunk
    out: dict[str, Any] = {
        "title": c.title,
        "source": c.source,
        "path": c.source_path,
        "breadcrumbs": list(c.breadcrumbs),
        "excerpt": " ".join(c.text.split()),
        "score": round(hit.score, 3),
    }
    if c.url:
        out["url"] = c.url
    return out


def _trim(text: str, limit: int) -> str:
    """At most ``limit`` characters, cut at a word boundary where one is near, marked with ...."""
    if len(text) <= limit:
        return text
    cut = text[: limit - 3]
    space = cut.rfind(" ")
    if space > limit * 0.6:
        cut = cut[:space]
    return cut.rstrip() + "..."


def _render(
    results: Sequence[dict[str, Any]],
    excerpt_chars: int | None,
    truncated: bool,
    fallback: str = "",
) -> str:
    if excerpt_chars is not None:
        results = [{**r, "excerpt": _trim(r["excerpt"], excerpt_chars)} for r in results]
    body: dict[str, Any] = {"results": list(results)}
    if not results and not truncated:
        body["note"] = fallback or NOTHING_FOUND
    if truncated:
        body["truncated"] = True
    return _dumps(body)


def format_results(hits: Sequence[Hit], max_chars: int, fallback: str = "") -> str:
    """Compact JSON of the results in at most ``max_chars`` characters, always valid.

    First the excerpts are trimmed (all to one length, found by bisection), then results are
    dropped from the end (the lowest scores) while even ``MIN_EXCERPT_CHARS`` would not fit.
    """
    results = [_result(h) for h in hits]
    whole = _render(results, None, truncated=False, fallback=fallback)
    if len(whole) <= max_chars:
        return whole
    for n in range(len(results), 0, -1):
        kept = results[:n]
        if len(_render(kept, MIN_EXCERPT_CHARS, truncated=True)) > max_chars:
            continue
        lo, hi = MIN_EXCERPT_CHARS, max(len(r["excerpt"]) for r in kept)
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if len(_render(kept, mid, truncated=True)) <= max_chars:
                lo = mid
            else:
                hi = mid - 1
        return _render(kept, lo, truncated=True)
    return _render([], None, truncated=True)


@dataclass(frozen=True, slots=True)
class Invocation:
    """One call's answer: the output string for the model, and the results behind it."""

    output: str
    is_error: bool = False
    hits: Sequence[Hit] = field(default_factory=list)
    fallback: str = ""  # the base's, when nothing was found


class Toolbox:
    """The configured knowledge functions, and the one way to call them."""

    def __init__(self, functions: Sequence[KnowledgeFunction], max_chars: int) -> None:
        self._functions = {fn.name: fn for fn in functions}
        self.max_chars = max_chars
        self._json: LRUCache[tuple[str, str], tuple[str, str, str]] = LRUCache(DEFINITIONS_KEPT)

    @classmethod
    def from_config(
        cls, config: Config, policies: Mapping[str, BasePolicy] | None = None
    ) -> Toolbox:
        functions = []
        for fn in config.functions:
            base_sources = tuple(s.name for s in config.knowledge_base(fn.knowledge_base).sources)
            policy = (policies or {}).get(fn.knowledge_base, NO_POLICY)
            functions.append(KnowledgeFunction(fn, fn.sources or base_sources, policy))
        return cls(functions, config.sidecar.tool_output_chars)

    def get(self, name: str) -> KnowledgeFunction | None:
        """The function named so, if the current caller may see it (``visible``): one outside
        a token's scope is not there for it, as if unknown."""
        shown = visible.get()
        return self._functions.get(name) if shown is None or name in shown else None

    def __iter__(self) -> Iterator[KnowledgeFunction]:
        return iter(self._functions.values())

    def visible_functions(self) -> list[KnowledgeFunction]:
        """The functions the current caller may see (``visible``): what a tool list shows."""
        return [self._functions[name] for name in self._visible()]

    def definitions_json(
        self, name: str, snapshot: LoadedSnapshot | None = None
    ) -> tuple[str, str, str]:
        """Realtime, Responses and Chat Completions definitions of one function, as JSON, with
        the enums of the snapshot serving its base (kept per snapshot version)."""
        fn = self._functions[name]
        key = (name, snapshot.version if snapshot is not None else "")
        found = self._json.get(key)
        if found is None:
            values = (
                {f: snapshot.filters.values(f) for f in fn.config.filterable} if snapshot else {}
            )
            realtime, responses, chat = fn.definitions(values)
            found = (_dumps(realtime), _dumps(responses), _dumps(chat))
            self._json[key] = found
        return found

    async def invoke(
        self,
        engine: Engine,
        name: str,
        arguments_json: str,
        session_id: str = "",
        other_tools: Sequence[str] = (),
    ) -> Invocation:
        """Run one call. Model mistakes and a base without a snapshot come back as error outputs.
        ``other_tools``: what the door serves beside the functions (MCP's read_page), named with
        them when a call names no tool."""
        fn = self.get(name)
        if fn is None:
            known = ", ".join([*self._visible(), *other_tools]) or "none are configured"
            return self._error(
                UNKNOWN_FUNCTION, f"no function named {_quote(name)}; known: {known}"
            )
        try:
            call = fn.parse(arguments_json)
        except ToolCallError as exc:
            return self._error(exc.type, exc.message)
        try:
            sources = _served(engine, fn.config.knowledge_base, call.sources)
            if call.sources and not sources:
                log.warning("%s: the snapshot has none of its sources %s", name, call.sources)
                return self._error(
                    UNAVAILABLE,
                    f"the knowledge base has none of {_quote_all(call.sources)} right now; tell "
                    "the caller you cannot look it up at the moment",
                )
            result = await engine.search(
                SearchInput(
                    query=call.query,
                    knowledge_base=fn.config.knowledge_base,
                    limit=fn.config.limit,
                    sources=sources,
                    session_id=session_id,
                    filters=call.filters,
                    source_paths=call.source_paths,
                )
            )
            nowhere = not result.hits and _no_page_under(engine, fn, call.source_paths, sources)
        except SnapshotError as exc:
            log.warning("%s: %s", name, exc)
            return self._error(
                UNAVAILABLE,
                "the knowledge base cannot be searched right now; tell the caller you cannot "
                "look it up at the moment",
            )
        except FilterRefused as exc:  # a filter or path the snapshot cannot apply
            return self._error(INVALID_ARGUMENTS, str(exc))
        fallback = fn.policy.fallback if not result.hits else ""
        if nowhere:  # the model's own filter, not a miss: it may search again without it
            note = NO_PAGE_THERE.format(paths=_quote_all(call.source_paths))
            return Invocation(output=format_results((), self.max_chars, note), fallback=fallback)
        output = format_results(result.hits, self.max_chars, fn.policy.fallback)
        return Invocation(output=output, hits=result.hits, fallback=fallback)

    def _visible(self) -> Iterable[str]:
        """The names the current caller may see."""
        shown = visible.get()
        return (n for n in self._functions if shown is None or n in shown)

    def _error(self, type_: str, message: str) -> Invocation:
        output = error_output(type_, message, self.max_chars or None)
        log.info("tool call refused: %s", output)
        return Invocation(output=output, is_error=True)


@dataclass(frozen=True, slots=True)
class PageText:
    title: str
    text: str  # the whole page (kept decoded by the reader: slice it, do not copy it)
    source: str
    source_path: str
    url: str


# A page is read only up to this many bytes (UTF-8): a build's largest is a url page's 20 MiB.
# A larger one (a hostile snapshot's) is refused, so that no call decodes more than this.
MAX_PAGE_BYTES = 32 << 20
# Decoded pages each door keeps (``PageReader``), in the bytes of their str objects: a model
# reading a long page in parts asks for the same page part after part, and each part would
# otherwise decode all of it. Holds at least one page of MAX_PAGE_BYTES (a str of it is at most
# that: 1 byte a character for ASCII, at most 4 for 4-byte characters).
PAGE_CACHE_BYTES = 64 << 20
# A page over this many bytes is decoded in a thread (about a millisecond a MiB), not on the loop.
OFF_LOOP_BYTES = 1 << 20


def _page_bytes(pages: Mapping[str, str], key: str) -> int:
    """Page ``key``'s bytes, from a snapshot's ``PageTable`` offsets (a plain mapping: its text)."""
    if isinstance(pages, PageTable):
        return pages.size(key)
    return len(pages[key].encode("utf-8", "surrogatepass"))


def _reachable(snapshot: LoadedSnapshot, source: str, source_path: str, allowed: Allowed) -> bool:
    labels = snapshot.filters.page_labels(source_path)
    return any(allowed.mask[i] and snapshot.chunks[i].source == source for i in labels)


class PageReader:
    """Whole pages of a snapshot, found by key in its pages: never a file path. The title and
    URL are its first chunk's, found in the searcher's page index (built before the swap).
    Decoded pages are kept (``PAGE_CACHE_BYTES``, least recently read out first), so that a
    page read in parts is decoded once, not once a part."""

    def __init__(self, cache_bytes: int = PAGE_CACHE_BYTES) -> None:
        self.cache_bytes = cache_bytes
        self._kept: OrderedDict[tuple[str, str], str] = OrderedDict()
        self._kept_bytes = 0
        # one large page decoded at a time: what decoding holds is bounded in bytes
        # (MAX_PAGE_BYTES of UTF-8 and its str), not by how many calls come at once
        self._large = asyncio.Lock()
        self.decoded = 0  # pages decoded (tests: a page read in parts is decoded once)

    async def read(
        self, searcher: Searcher, kb: str, source_path: str, source: str = "", offset: int = 0
    ) -> PageText:
        """A whole page of base ``kb``; under the caller's filters (``sidecar.turn.scope``, on
        every door), only a page with a chunk the caller may reach (another is "no page", as if it
        did not exist). ``offset`` (characters: where a caller reads on from) is checked against
        the page: past its end is InvalidArgument naming it."""
        found, label = self._find(searcher, kb, source_path, source)
        snapshot = searcher.snapshot
        chunk = snapshot.chunks[label] if label is not None else None
        text = await self._text(snapshot, page_key(found, source_path))
        if offset and offset >= len(text):
            raise InvalidArgument(
                f"offset {offset} is past the page's end ({len(text)} characters): read from 0 "
                "up to the last answer's next_offset"
            )
        return PageText(
            title=chunk.title if chunk else "",
            text=text,
            source=found,
            source_path=source_path,
            url=chunk.url if chunk else "",
        )

    async def _text(self, snapshot: LoadedSnapshot, key: str) -> str:
        """The page's text, decoded once while it stays among those kept."""
        kept_key = (str(snapshot.folder), key)
        text = self._kept.get(kept_key)
        if text is not None:
            self._kept.move_to_end(kept_key)
            return text
        size = _page_bytes(snapshot.pages, key)
        if size > MAX_PAGE_BYTES:
            raise ResourceExhausted(
                f"page {named([key.partition(':')[2]])} is {size} bytes; pages are read up "
                f"to {MAX_PAGE_BYTES} bytes: search its chunks instead (source_paths set to its "
                "path), or rebuild the base with a smaller max_page_bytes"
            )
        if size > OFF_LOOP_BYTES:
            return await self._decoded_off_loop(snapshot, key, kept_key)
        return self._decoded(snapshot.pages[key], kept_key)

    async def _decoded_off_loop(
        self, snapshot: LoadedSnapshot, key: str, kept_key: tuple[str, str]
    ) -> str:
        """A large page decoded in a worker thread, one at a time; a page another call decoded
        while this one waited is taken from those kept."""
        async with self._large:
            text = self._kept.get(kept_key)
            if text is not None:
                return text
            return self._decoded(await asyncio.to_thread(snapshot.pages.__getitem__, key), kept_key)

    def _decoded(self, text: str, kept_key: tuple[str, str]) -> str:
        self.decoded += 1
        self._keep(kept_key, text)
        return text

    def _keep(self, key: tuple[str, str], text: str) -> None:
        size = sys.getsizeof(text)
        if key in self._kept or size > self.cache_bytes:
            return
        while self._kept and self._kept_bytes + size > self.cache_bytes:
            self._kept_bytes -= sys.getsizeof(self._kept.popitem(last=False)[1])
        self._kept[key] = text
        self._kept_bytes += size

    def _find(
        self, searcher: Searcher, kb: str, source_path: str, source: str
    ) -> tuple[str, int | None]:
        """The source of the page at ``source_path`` the caller may read, and the label of its
        first chunk (None: a page without chunks)."""
        snapshot = searcher.snapshot
        if not source_path:
            raise InvalidArgument("source_path is empty: give the page's path, as chunks carry it")
        if source and source not in snapshot.source_names:
            raise NotFound(
                f"no source {named([source])} in snapshot {snapshot.version}; its "
                f"sources: {named(snapshot.source_names)}"
            )
        names = [source] if source else snapshot.source_names
        found = [s for s in names if page_key(s, source_path) in snapshot.pages]
        allowed = scope.resolve(searcher, kb, (), (), ())
        if allowed is not None:
            found = [s for s in found if _reachable(snapshot, s, source_path, allowed)]
        if not found:
            raise NotFound(f"no page {source_path!r} in snapshot {snapshot.version}")
        if len(found) > 1:
            raise InvalidArgument(
                f"sources {', '.join(found)} each have a page {source_path!r}: set source"
            )
        return found[0], searcher.pages.get((found[0], source_path))


def _served(engine: Engine, kb: str, sources: tuple[str, ...]) -> tuple[str, ...]:
    """The ones of a call's ``sources`` (all checked against the function's configuration) that
    the serving snapshot has: a snapshot built before a source was added, or a swap that dropped
    one, is no mistake of the model's, so the sources left are searched."""
    if not sources:
        return sources
    names = engine.searcher(kb).sources.names
    return tuple(s for s in sources if s in names)


def _no_page_under(
    engine: Engine, fn: KnowledgeFunction, source_paths: tuple[str, ...], sources: tuple[str, ...]
) -> bool:
    """Whether a call's ``source_paths`` name no page the function may reach (its sources, its
    fixed filters, the caller's filters: nothing outside its scope is told apart): its empty
    answer is then the model's filter, not a miss, and its note says so (a model told "nothing
    matched" would not retry without the filter)."""
    if not source_paths:
        return False
    searcher = engine.searcher(fn.config.knowledge_base)
    allowed = scope.resolve(
        searcher, fn.config.knowledge_base, fn.config.filters, source_paths, sources
    )
    return allowed is not None and allowed.count == 0
