"""A list of web pages (``urls``), crawled with conditional requests and re-crawled on ``refresh``.

Each URL is one page (a PDF: one page per PDF page) whose ``source_path`` is the URL as
configured. A crawl state file under ``[index] cache_dir`` keeps, per URL, the ``ETag``,
``Last-Modified``, a hash of the body, when it was fetched and the text it yielded. A URL is
fetched again only when its ``refresh`` interval has passed, and then with ``If-None-Match`` /
``If-Modified-Since``: an unchanged page answers 304, so it is neither downloaded nor (its text
being the same) re-embedded. A page that answers 404 or 410 is gone and is dropped; any other
failure keeps the last text fetched (logged), or skips the page when there is none.
A PDF's page left out for its text is kept in the state and reported skipped at every build.
"""

from __future__ import annotations

import hashlib
import http.client
import logging
import re
import time
import urllib.error
import urllib.parse
import urllib.request
from collections import deque
from collections.abc import Callable, Generator, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import closing
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType
from typing import Any

import orjson

from index.chunker import first_h1
from index.errors import ConfigError, one_line, shortened
from index.http_bounds import Connections, WebOnly, opener
from index.snapshot import write_atomic
from index.sources import PageBytes, SkippedPage, sound_pages
from index.sources.charsets import CharsetError, decode_web
from index.sources.html import html_page_text
from index.sources.pdf import pdf_pages
from index.sources.text import split_title_line
from index.types import Page

__all__ = ["UrlOptions", "crawl_urls", "next_due", "state_path"]

log = logging.getLogger("voxrecall.index.url")

DEFAULT_REFRESH_S = 3600.0  # public docs change daily at most; conditional requests keep it cheap
FETCH_TIMEOUT_S = 15.0  # one slow page must not hold a build; a healthy docs site answers in <1 s
# FETCH_TIMEOUT_S bounds each wait on the socket, not a download: a server that trickles a byte
# every few seconds would hold the build for days within it. A whole request gets this long, its
# status line and headers too (20 MiB at a slow 1 MB/s is 20 s).
FETCH_DEADLINE_S = 60.0
MAX_REASON_BYTES = 200  # of a server's words in a skipped page's reason
_READ_BYTES = 64 << 10
MAX_WORKERS = 8  # concurrent fetches: enough to hide latency, few enough to be polite to one host
MAX_BODY_BYTES = 20 << 20  # a knowledge page over 20 MiB is a mistake (a video, an archive)
USER_AGENT = "voxrecall-indexer/0.1"
_STATE_VERSION = 1
_GONE = frozenset({404, 410})
_HTML_TYPES = frozenset({"text/html", "application/xhtml+xml"})
_MARKDOWN_TYPES = frozenset({"text/markdown", "text/x-markdown"})
_CONNECTIONS = Connections()  # every fetch's sockets: each request's deadline shuts its own
_OPENER = opener(_CONNECTIONS, WebOnly(), env_proxies=True)  # as urlopen did


@dataclass(frozen=True, slots=True)
class UrlOptions:
    """The options of a ``url`` source."""

    urls: tuple[str, ...]
    refresh_s: float = DEFAULT_REFRESH_S

    @classmethod
    def from_options(cls, source: str, options: Mapping[str, Any]) -> UrlOptions:
        """Read ``urls`` and ``refresh`` (their types and ranges checked at load: a list of
        strings, seconds); raises ConfigError naming a wrong URL."""
        urls = options.get("urls")
        if not urls:
            raise ConfigError(f'source {source!r}: type url needs urls = ["https://...", ...]')
        for url in urls:
            if not _web_url(url):
                raise ConfigError(f"source {source!r}: {url!r} is not an http(s) URL")
        if len(set(urls)) != len(urls):
            raise ConfigError(f"source {source!r}: urls lists a URL twice")
        refresh = options.get("refresh", DEFAULT_REFRESH_S)  # in range (check_options)
        return cls(urls=tuple(urls), refresh_s=float(refresh))


def _web_url(url: str) -> bool:
    try:
        parts = urllib.parse.urlsplit(url)  # ValueError: "http://[::1/x", an address left open
        _ = parts.port  # ValueError: a port out of range or not a number
    except ValueError:
        return False
    return parts.scheme in ("http", "https") and bool(parts.hostname)


def _slug(name: str) -> str:
    safe = re.sub(r"[^A-Za-z0-9_.-]", "_", name)[:60]
    return f"{safe}-{hashlib.sha256(name.encode()).hexdigest()[:8]}"


def state_path(cache_dir: Path, knowledge_base: str, source: str) -> Path:
    """The crawl state file of one ``url`` source of one knowledge base."""
    return cache_dir / "crawl" / _slug(knowledge_base) / f"{_slug(source)}.json"


def _read_state(path: Path) -> dict[str, dict[str, Any]]:
    try:
        raw = orjson.loads(path.read_bytes())
    except FileNotFoundError:
        return {}
    except (OSError, orjson.JSONDecodeError) as exc:
        log.warning("crawl state %s unreadable (%s): crawling every URL afresh", path, exc)
        return {}
    if not isinstance(raw, dict) or raw.get("version") != _STATE_VERSION:
        return {}
    entries = raw.get("urls", {})
    if not isinstance(entries, dict):
        return {}
    sound = {url: entry for url, entry in entries.items() if _sound(entry)}
    if len(sound) < len(entries):
        log.warning(
            "crawl state %s: %d URL(s) of another shape (edited by hand? a disk fault?): "
            "crawled afresh", path, len(entries) - len(sound),
        )  # fmt: skip
    return sound


_PAGE_TEXTS = ("path", "title", "text", "kind", "url")


def _sound(entry: object) -> bool:
    """Whether a crawl state's entry has the shape ``_entry`` writes: a URL's fetch time, its
    pages (a page's texts, and metadata of strings and lists of strings) and the parts of it
    left out (a path and a reason each)."""
    if not isinstance(entry, dict):
        return False
    fetched = entry.get("fetched_at", 0.0)
    pages = entry.get("pages", [])
    left_out = entry.get("left_out", [])
    if isinstance(fetched, bool) or not isinstance(fetched, int | float):
        return False
    return (
        isinstance(pages, list)
        and all(_sound_page(p) for p in pages)
        and isinstance(left_out, list)
        and all(_texts(s, ("path", "reason")) for s in left_out)
    )


def _texts(value: object, keys: tuple[str, ...]) -> bool:
    return isinstance(value, dict) and all(isinstance(value.get(k), str) for k in keys)


def _sound_page(page: object) -> bool:
    if not isinstance(page, dict) or not _texts(page, _PAGE_TEXTS):
        return False
    metadata = page.get("metadata")
    return isinstance(metadata, dict) and all(
        isinstance(v, str) or (isinstance(v, list) and all(isinstance(x, str) for x in v))
        for v in metadata.values()
    )


def next_due(cache_dir: Path, knowledge_base: str, source: str, options: UrlOptions) -> float:
    """When the first URL of the source is due for a re-crawl (epoch seconds; 0: now)."""
    state = _read_state(state_path(cache_dir, knowledge_base, source))
    due = [
        float(state[url].get("fetched_at", 0.0)) + options.refresh_s if url in state else 0.0
        for url in options.urls
    ]
    return min(due, default=0.0)


# --- fetching ----------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Fetched:
    """A 200 answer: the body and what is needed to parse it and ask again conditionally."""

    body: bytes
    content_type: str
    charset: str | None
    etag: str
    last_modified: str
    final_url: str


@dataclass(frozen=True, slots=True)
class NotModified:
    """A 304 answer: the stored text is still current."""


@dataclass(frozen=True, slots=True)
class Failed:
    """No usable answer; ``gone`` when the server says the page no longer exists."""

    reason: str
    gone: bool = False


FetchResult = Fetched | NotModified | Failed
Fetcher = Callable[[str, Mapping[str, Any] | None], FetchResult]


def fetch(
    url: str,
    previous: Mapping[str, Any] | None,
    timeout: float = FETCH_TIMEOUT_S,
    deadline_s: float = FETCH_DEADLINE_S,
    max_bytes: int = MAX_BODY_BYTES,
) -> FetchResult:
    """GET one URL, conditionally when ``previous`` holds an ETag or Last-Modified; blocking.
    ``timeout`` bounds each wait on the socket, ``deadline_s`` the whole request, from its
    connect to the body's last byte: its socket is shut down then (``index.http_bounds``), so
    headers trickled or a ``100 Continue`` or a trailer sent without end cannot hold a build.
    A body past ``max_bytes`` is not read on."""
    request = urllib.request.Request(url, headers=_headers(previous))
    with _CONNECTIONS.bounded(time.monotonic() + deadline_s) as bound:
        got = _get(request, timeout, max_bytes)
    if bound.passed:
        return Failed(f"not downloaded within {deadline_s:g} s")
    return got


def _headers(previous: Mapping[str, Any] | None) -> dict[str, str]:
    headers = {"User-Agent": USER_AGENT, "Accept": "text/html, text/plain;q=0.9, */*;q=0.5"}
    if previous:
        if previous.get("etag"):
            headers["If-None-Match"] = str(previous["etag"])
        if previous.get("last_modified"):
            headers["If-Modified-Since"] = str(previous["last_modified"])
    return headers


def _get(request: urllib.request.Request, timeout: float, max_bytes: int) -> FetchResult:
    try:
        with _OPENER.open(request, timeout=timeout) as response:
            body = _read_body(response, max_bytes)
            if isinstance(body, Failed):
                return body
            return Fetched(
                body=body,
                content_type=response.headers.get_content_type(),
                charset=response.headers.get_content_charset(),
                etag=response.headers.get("ETag", ""),
                last_modified=response.headers.get("Last-Modified", ""),
                final_url=response.geturl(),
            )
    except urllib.error.HTTPError as exc:
        exc.close()
        if exc.code == 304:
            return NotModified()
        return Failed(_one_line(f"HTTP {exc.code} {exc.reason}"), gone=exc.code in _GONE)
    except urllib.error.URLError as exc:
        return Failed(_one_line(f"cannot fetch: {exc.reason}"))
    except (TimeoutError, OSError, http.client.HTTPException, ValueError) as exc:
        return Failed(_one_line(f"cannot fetch: {type(exc).__name__}: {exc}"))


def _one_line(reason: str) -> str:
    """A server's words (a reason phrase, urllib's redirect-loop text) as one line of a report,
    at most MAX_REASON_BYTES."""
    return shortened(one_line(reason), MAX_REASON_BYTES)


def _read_body(response: http.client.HTTPResponse, max_bytes: int) -> bytes | Failed:
    """The body, read in pieces until it ends or passes ``max_bytes``."""
    pieces: list[bytes] = []
    size = 0
    while piece := response.read1(_READ_BYTES):
        size += len(piece)
        if size > max_bytes:
            return Failed(f"larger than {max_bytes:,} bytes")
        pieces.append(piece)
    return b"".join(pieces)


# --- parsing -----------------------------------------------------------------------------------


def _fallback_title(url: str) -> str:
    parts = urllib.parse.urlsplit(url)
    segment = next((s for s in reversed(parts.path.split("/")) if s), "")
    return urllib.parse.unquote(segment.rsplit(".", 1)[0]) or parts.netloc


def _parse(
    source: str, url: str, got: Fetched
) -> tuple[list[Page], list[SkippedPage]] | SkippedPage:
    """The pages of a fetched body and the pages left out of it (a PDF's page of too much
    text), or why the body cannot be used."""
    if got.content_type == "application/pdf":
        return pdf_pages(source, url, got.body, _fallback_title(url), url=got.final_url)
    parsed = _parse_text(source, url, got)
    return parsed if isinstance(parsed, SkippedPage) else (parsed, [])


def _parse_text(source: str, url: str, got: Fetched) -> list[Page] | SkippedPage:
    fallback = _fallback_title(url)
    if got.content_type in _HTML_TYPES:
        parsed = html_page_text(url, got.body, got.charset)
        if isinstance(parsed, SkippedPage):
            return parsed
        title, text = parsed
        return [Page(source, url, title or fallback, text, kind="markdown", url=got.final_url)]
    if not got.content_type.startswith("text/"):
        return SkippedPage(url, f"unsupported content type {got.content_type}")
    try:
        text = decode_web(got.body, got.charset or "utf-8")
    except CharsetError as exc:
        return SkippedPage(url, str(exc))
    text = text.replace("\r\n", "\n").replace("\r", "\n")
    if got.content_type in _MARKDOWN_TYPES:
        h1 = first_h1(text)
        return [Page(source, url, h1 or fallback, text, kind="markdown", url=got.final_url)]
    title, body = split_title_line(text)
    return [Page(source, url, title or fallback, body or text, kind="text", url=got.final_url)]


def _page_to_dict(page: Page) -> dict[str, Any]:
    return {
        "path": page.source_path,
        "title": page.title,
        "text": page.text,
        "kind": page.kind,
        "url": page.url,
        "metadata": dict(page.metadata),
    }


def _pages_from(source: str, entry: Mapping[str, Any]) -> list[Page]:
    return [
        Page(
            source=source,
            source_path=p["path"],
            title=p["title"],
            text=p["text"],
            kind=p["kind"],
            url=p["url"],
            metadata=MappingProxyType(
                {k: v if isinstance(v, str) else tuple(v) for k, v in p["metadata"].items()}
            ),
        )
        for p in entry.get("pages", [])
    ]


# --- crawling ----------------------------------------------------------------------------------


@dataclass(slots=True)
class CrawlStats:
    """What one crawl did, for logs and tests."""

    requested: int = 0
    not_modified: int = 0
    downloaded: int = 0
    failed: int = 0
    not_due: int = 0


def _fetch_all(
    due: Sequence[str], state: Mapping[str, Mapping[str, Any]], fetcher: Fetcher
) -> Generator[FetchResult, None, None]:
    """Each due URL's answer, in order, at most MAX_WORKERS fetched or held at a time: the next
    URL starts as the oldest answer is taken, so a slow one holds up no window of others, and
    the bodies held at once are MAX_WORKERS' (each at most MAX_BODY_BYTES) whatever the list's
    length."""
    if not due:
        return
    with ThreadPoolExecutor(
        max_workers=min(MAX_WORKERS, len(due)), thread_name_prefix="voxrecall-crawl"
    ) as pool:
        pending: deque[Future[FetchResult]] = deque()
        for url in due:
            if len(pending) == MAX_WORKERS:
                yield pending.popleft().result()
            pending.append(pool.submit(fetcher, url, state.get(url)))
        while pending:
            yield pending.popleft().result()


def crawl_urls(
    source: str,
    options: UrlOptions,
    state_file: Path,
    now: float,
    fetcher: Fetcher = fetch,
    *,
    budget: PageBytes | None = None,
) -> tuple[list[Page], list[SkippedPage], CrawlStats]:
    """The pages of every URL: fetched (conditionally) when due, else from the crawl state.

    Writes the updated crawl state atomically before returning. Raises BaseTooLarge, writing
    nothing, when the pages pass ``budget`` (counted as each URL is fetched; default: this
    source's own).
    """
    budget = budget or PageBytes(source)
    old = _read_state(state_file)
    state: dict[str, dict[str, Any]] = {u: dict(old[u]) for u in options.urls if u in old}
    stats = CrawlStats()
    due = [
        u for u in options.urls
        if u not in state or now - float(state[u].get("fetched_at", 0.0)) >= options.refresh_s
    ]  # fmt: skip
    stats.not_due = len(options.urls) - len(due)
    stats.requested = len(due)
    pages_of: dict[str, list[Page]] = {}  # each URL's pages, made and counted once

    def counted(url: str) -> None:
        pages_of[url] = _pages_from(source, state[url])
        budget.take(*pages_of[url])

    fresh = frozenset(due)
    for url in (u for u in state if u not in fresh):
        counted(url)
    with closing(_fetch_all(due, state, fetcher)) as results:  # a refusal ends the fetching
        for url, result in zip(due, results, strict=True):
            _take(url, result, state, stats, now, source)
            counted(url)
    pages: list[Page] = []
    skipped: list[SkippedPage] = []
    for url in options.urls:
        entry = state[url]
        if entry.get("skipped"):
            skipped.append(SkippedPage(url, str(entry["skipped"])))
        skipped.extend(SkippedPage(s["path"], s["reason"]) for s in entry.get("left_out", []))
        pages.extend(pages_of[url])
    state_file.parent.mkdir(parents=True, exist_ok=True)
    write_atomic(state_file, orjson.dumps({"version": _STATE_VERSION, "urls": state}))
    log.info(
        "%s: %d URLs: %d not due, %d requested (%d not modified, %d downloaded, %d failed)",
        source, len(options.urls), stats.not_due, stats.requested, stats.not_modified,
        stats.downloaded, stats.failed,
    )  # fmt: skip
    return pages, skipped, stats


def _take(
    url: str,
    result: FetchResult,
    state: dict[str, dict[str, Any]],
    stats: CrawlStats,
    now: float,
    source: str,
) -> None:
    """``url``'s answer into its crawl state entry (a copy fetched before is kept on an error)."""
    entry = state.get(url)
    if isinstance(result, NotModified) and entry is not None:
        stats.not_modified += 1
        entry["fetched_at"] = now
    elif isinstance(result, Fetched):
        stats.downloaded += 1
        state[url] = _entry(source, url, result, entry, now)
    elif isinstance(result, Failed) and result.gone:
        stats.failed += 1
        state[url] = {"fetched_at": now, "skipped": result.reason, "pages": []}
    else:
        stats.failed += 1
        reason = result.reason if isinstance(result, Failed) else "304 with no stored copy"
        if entry is not None and entry.get("pages"):
            log.warning("%s: %s; keeping the copy fetched before", url, reason)
        else:  # fetched_at 0: due again at the next crawl
            state[url] = {"fetched_at": 0.0, "skipped": reason, "pages": []}


def _entry(
    source: str, url: str, got: Fetched, previous: Mapping[str, Any] | None, now: float
) -> dict[str, Any]:
    digest = hashlib.sha256(got.body).hexdigest()
    base = {"etag": got.etag, "last_modified": got.last_modified, "sha256": digest}
    if previous is not None and previous.get("sha256") == digest and previous.get("pages"):
        return {**previous, **base, "fetched_at": now}  # same bytes: keep the parsed text
    parsed = _parse(source, url, got)
    if isinstance(parsed, SkippedPage):
        return {**base, "fetched_at": now, "skipped": parsed.reason, "pages": []}
    pages, left_out = parsed
    pages, unsound = sound_pages(pages)  # the state is written as UTF-8 JSON
    left_out = [*left_out, *unsound]
    return {
        **base,
        "fetched_at": now,
        "pages": [_page_to_dict(p) for p in pages],
        "left_out": [{"path": s.path, "reason": s.reason} for s in left_out],
    }
