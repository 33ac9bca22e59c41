"""Platform webhooks of the HTTP door: Vapi's custom knowledge base and a generic tool webhook.

**Vapi** (``POST /vapi/knowledge-base``) posts ``{"message": {"type": "knowledge-base-request",
"messages": [{"role", "content"}...], "call": {"id", ...}, ...}}`` each time its model is about
to answer, with the whole call so far. The call id names the session. The messages not fed
before (``Conversations``) are fed to it in order, as ``Turn`` would take them: a user message
is a user turn, an assistant (or ``bot``) message an agent turn; the last user turn's chunks are
the answer, ``{"documents": [{"content", "similarity", "uuid"}]}``, with its follow-up resolved
exactly as on ``Turn``. With ``[sidecar.http] vapi_secret_env`` set, the ``X-Vapi-Secret``
header must hold that secret.

**Tools** (``POST /tools/{function}``) take the shapes hosted platforms post: Retell's custom
function ``{"name", "args": {...}, "call": {"call_id", ...}}``, a body with ``arguments`` (an
object, or the JSON string a model emitted), or the arguments themselves at the top level
(ElevenLabs server tools post their body parameters so), with ``session_id`` or ``call_id``
beside them. The answer is the function's output, the same JSON as ``InvokeTool``; a model's
mistake is an error output for the model (200, ``x-voxrecall-tool-error: true``). With
``[sidecar.http] webhook_secret_env`` set, every call must be signed with that secret and
recently (``verify_signature``), and an unsigned, badly signed or stale one is refused (401);
so is a signature seen before (``Replays``): within its window, a captured call sent again.
Both tables are the process's: with ``[sidecar] workers`` > 1 each worker keeps its own, so a
call sent again that reaches another worker is served there afresh.

**Vapi's tools** post their own envelope to the same path, ``{"message": {"type": "tool-calls",
"toolCallList": [{"id", "function": {"name", "arguments"}}...], "call": {"id", ...}}}``: each
call in the list is run by the function it names (``Webhooks._vapi_tools``; at most
``MAX_TOOL_CALLS``) and answered in Vapi's form, ``{"results": [{"toolCallId", "name", "result"}]}``,
a model's mistake (an unknown function, bad arguments, a name or arguments that cannot be read)
as that call's ``error`` instead of its ``result``, the model's to read. Every call is read
before any runs: one that cannot be answered (no id, or one over ``MAX_TOOL_CALL_ID``) refuses
the envelope. The call id names the session; with ``vapi_secret_env`` set the
``X-Vapi-Secret`` header must hold that secret, as for the knowledge base. Only Vapi's envelope
is checked for it: the other bodies ``/tools/`` takes carry the bearer token alone.

Each body is parsed (the door has bounded its objects and arrays:
``sidecar.http.door.check_json_containers``) and read at once, and the parsed body dropped
before the first search: held through them, it kept every value alive for the collector.

The ``x-voxrecall-session`` header, when sent, names the session on all three.
"""

from __future__ import annotations

import asyncio
import hashlib
import heapq
import hmac
import re
import sys
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import orjson
from cachetools import TTLCache

from index.config import NAME_CHARS, quoted
from index.errors import ConfigError
from sidecar.config import Config, HttpConfig
from sidecar.edge.limits import check_fields, check_session_header
from sidecar.edge.logs import MIN_SECRET_CHARS
from sidecar.edge.service import set_timings
from sidecar.edge.status import caller_message, status_for, tool_error_type
from sidecar.errors import (
    InvalidArgument,
    NotFound,
    RequestError,
    Unauthenticated,
    Unavailable,
)
from sidecar.functions.tools import INVALID_ARGUMENTS, Toolbox, error_output
from sidecar.gen import retrieval_pb2 as pb
from sidecar.turn import sessions
from sidecar.turn.engine import (
    MAX_SESSION_ID,
    MAX_TEXT_CHARS,
    Engine,
    SearchInput,
    Speaker,
    TurnInput,
    TurnResult,
)
from sidecar.turn.hits import Hit
from sidecar.turn.skip import Skip

if TYPE_CHECKING:
    from sidecar.http.door import HttpCall

# (status, JSON body, extra headers)
Reply = tuple[int, bytes, list[tuple[bytes, bytes]]]

SESSION_HEADER = "x-voxrecall-session"
VAPI_SECRET_HEADER = "x-vapi-secret"
# as written in messages and docs; looked up in lower case (ASGI gives header names so)
RETELL_SIGNATURE = "X-Retell-Signature"
SIGNATURE = "X-Voxrecall-Signature"
TIMESTAMP = "X-Voxrecall-Timestamp"
# A 401's WWW-Authenticate names what the caller must send: the bearer token for the door's own
# refusal (``Unauthenticated``'s default), else the header of the check that failed.
VAPI_CHALLENGE = 'Secret header="X-Vapi-Secret"'
SIGNATURE_CHALLENGE = f'Signature headers="{TIMESTAMP} {SIGNATURE}"'
RETELL_SIGNATURE_HEADER = RETELL_SIGNATURE.lower()
SIGNATURE_HEADER = SIGNATURE.lower()
TIMESTAMP_HEADER = TIMESTAMP.lower()
KNOWLEDGE_BASE_REQUEST = "knowledge-base-request"
TOOL_CALLS = "tool-calls"
# Tool calls of one Vapi envelope answered at most: a model calls a few tools at once, and each
# call is a search; a body of thousands (256 KiB holds them) would hold its slot that long.
MAX_TOOL_CALLS = 16
# The longest id of a Vapi tool call, in characters: it is echoed in the answer, so it is
# bounded as a session id is (``MAX_SESSION_ID``); a platform's call ids are a few dozen.
MAX_TOOL_CALL_ID = MAX_SESSION_ID
VAPI_TOOLS_EXAMPLE = (
    '{"message": {"type": "tool-calls", "toolCallList": [{"id": "call_1", "function": '
    '{"name": "knowledge_search", "arguments": {"query": "..."}}}], "call": {"id": "..."}}}'
)
TOOL_ERROR_HEADER = (b"x-voxrecall-tool-error", b"true")
USER_ROLES = frozenset({"user"})
AGENT_ROLES = frozenset({"assistant", "bot"})
# Messages of one request fed at most: the session keeps a few turns (context_turns), so older
# ones cannot change what a follow-up resolves to, and each user message fed is a search.
MAX_FED = 8
# How far a signature's timestamp (ours or Retell's) may be from our clock: the window in which
# a captured call could be replayed. Retell's own verifier allows 5 minutes.
SIGNATURE_TOLERANCE_MS = 5 * 60 * 1000
# Signatures remembered (``Replays``), each until its window has passed: about 250 bytes
# each, so ~4 MiB at most; 16,384 calls in 5 minutes is 55 a second, beyond any one agent's.
SEEN_SIGNATURES = 16_384
# Answers of signed tool calls kept for a platform's retry of the same call (``Answers``), each
# for the signature's window: at most this many, and this many bytes of them, each counted as at
# least their quotient (8 KiB: an output of the default 2,000 characters is at most 8,000 bytes,
# so 1,024 of those fit; [sidecar] tool_output_chars has no maximum, and at 100,000 characters
# an answer may hold 400 KB). A retry is sent within seconds of its call; its answer forgotten
# (the table full since), it is refused as a replay (401), as before.
ANSWERS_KEPT = 1024
ANSWER_BYTES_KEPT = 8 * 1024 * 1024
# How long a retry waits for the answer of its call still being answered (a tool call answers
# within its turn's budget; one held longer holds every retry's connection): then 503, retry.
ANSWER_WAIT_S = 10.0
# A ``Fed`` beyond its strings and its tuple: the object and its digest (tracemalloc,
# tests/test_http_door.py)
FED_BYTES = 160
NOTE_HEADER = b"x-voxrecall-note"
# What an empty Vapi answer's ``x-voxrecall-note`` says (Vapi reads only ``documents``; a
# person testing by curl must tell "nothing asked" from "nothing found").
NOTHING_ASKED = "nothing asked: the last message with words is not the caller's"
NOTHING_SAID = "nothing asked: no user or assistant message has words yet"
NOTHING_FOUND = "nothing found: nothing in the knowledge base matched the caller's last turn"
_RETELL = re.compile(r"v=(\d{1,16}),d=([0-9a-fA-F]{64})")
_STAMP = re.compile(r"\d{1,12}")
# Top-level keys of a tool webhook body that describe the call rather than being arguments.
TOOL_METADATA = frozenset({"name", "call", "session_id", "call_id"})
# The bodies a bad one is told to send: Retell's, or the arguments at the top level (ElevenLabs)
TOOL_BODIES = (
    'Retell\'s {"args": {"query": "..."}, "call": {"call_id": "..."}}, or the arguments at the '
    'top level, as ElevenLabs sends them: {"query": "...", "session_id": "..."}'
)


@dataclass(frozen=True, slots=True)
class Said:
    speaker: str  # Speaker.USER or Speaker.AGENT
    text: str


def _text(message: dict[str, Any]) -> str | None:
    """A message's words: its ``content`` (or ``message``) string, or the text of its content
    parts where ``content`` is a list of OpenAI content parts (``{"type": "text", "text"}``);
    None where it has no words of either shape."""
    content = message.get("content", message.get("message"))
    if isinstance(content, list):
        parts = [
            p["text"] for p in content if isinstance(p, dict) and isinstance(p.get("text"), str)
        ]
        return " ".join(parts) if parts else None
    return content if isinstance(content, str) else None


def _said(message: Any) -> Said | None:
    """A Vapi message as a turn, or None for one that is not (system, tool calls, empty)."""
    if not isinstance(message, dict):
        return None
    role = message.get("role")
    if not isinstance(role, str):  # a list or an object is no role (and cannot be looked up)
        return None
    text = _text(message)
    if text is None or not text.strip():
        return None
    if len(text) > MAX_TEXT_CHARS:  # a long answer of the agent's: its start is what it is about
        text = text[:MAX_TEXT_CHARS].rsplit(" ", 1)[0]
    if role in USER_ROLES:
        return Said(Speaker.USER, text)
    if role in AGENT_ROLES:
        return Said(Speaker.AGENT, text)
    return None


def _digests(messages: list[Any]) -> Iterator[bytes]:
    """The digest of every prefix of ``messages`` (each message's role and words, not its
    timings, which a platform may update): the empty prefix first."""
    h = hashlib.blake2b(digest_size=16)
    yield h.digest()
    for m in messages:
        h.update(orjson.dumps(_words(m)) + b"\0")
        yield h.digest()


def _words(message: Any) -> tuple[str | None, str | None]:
    """A message's role and words where they are strings (all ``_said`` reads of it): whatever
    else it holds, nested however deep, neither feeds a turn nor breaks the digest."""
    if not isinstance(message, dict):
        return None, None
    role = message.get("role")
    return role if isinstance(role, str) else None, _text(message)


@dataclass(slots=True)
class Fed:
    """What a call's session has been fed: how many messages, their digest, the query of its
    last searched user turn, and the chunks the last request was answered with (a request
    repeated as it was is answered with them again)."""

    count: int
    digest: bytes
    query: str = ""
    answer: tuple[str, ...] = ()  # the chunk ids of the last answer, in order
    note: str = ""  # why the last answer was empty (``NOTE_HEADER``)

    def size(self) -> int:
        """The bytes it holds (``FED_BYTES`` and its strings), counted in its session's."""
        strings = (self.query, self.note, *self.answer)
        return FED_BYTES + sys.getsizeof(self.answer) + sum(map(sys.getsizeof, strings))


class Conversations:
    """How much of each call's message list its session has been fed, so a message Vapi sends
    again (every request carries the whole call) is fed once. Kept in the call's own session
    (``Session.keep_door_state``), counted in its bytes: it is the caller's, under its quota of sessions and
    bytes, and no other caller's requests can push it out (a table shared by all let 10,000
    requests of no messages push a live call's out, and its next request fed its turns again).
    It goes with the session (ended, expired, evicted within its owner's quota): the call's
    next request then feeds its last ``MAX_FED`` messages anew, rebuilding the context. A request
    that feeds no turn to a call with no session keeps nothing (it fed nothing to remember)."""

    def __init__(self, store: sessions.SessionStore) -> None:
        self._store = store

    def new(self, call_id: str, messages: list[Any]) -> tuple[list[Any], Fed]:
        """The messages after those already fed (all of them for a new call), and the call's
        entry once they are, which ``fed`` keeps. When the list no longer starts with what was
        fed (the platform trimmed or rewrote it), only its last message is new: feeding the rest
        again would repeat turns."""
        digests = list(_digests(messages))
        session = self._store.peek(call_id)
        before = session.door_state if session is not None else None
        if not isinstance(before, Fed):
            return messages, Fed(len(messages), digests[-1])
        fed = Fed(len(messages), digests[-1], before.query, before.answer, before.note)
        if before.count <= len(messages) and digests[before.count] == before.digest:
            return messages[before.count :], fed
        return messages[-1:], fed

    def fed(self, call_id: str, entry: Fed) -> None:
        """Keep ``entry`` in the call's session once its messages were fed: a request that
        failed on the way (a base still loading) is fed again when the platform retries it, not
        answered as a repeat."""
        if self._store.peek(call_id) is not None:
            self._store.get(call_id).keep_door_state(entry, entry.size())


def _documents(hits: Sequence[Hit]) -> list[dict[str, Any]]:
    docs = []
    for hit in hits:
        c = hit.chunk
        heading = " > ".join(c.breadcrumbs) or c.title
        docs.append(
            {
                "content": f"{heading}\n\n{c.text}" if heading else c.text,
                "similarity": round(hit.score, 4),
                "uuid": c.chunk_id,
            }
        )
    return docs


def _object(body: bytes, example: str) -> dict[str, Any]:
    try:
        payload = orjson.loads(body)
    except orjson.JSONDecodeError as exc:
        raise InvalidArgument(f"the body is not JSON ({exc}): send {example}") from exc
    if not isinstance(payload, dict):
        raise InvalidArgument(f"the body must be a JSON object: {example}")
    return payload


def _string(value: Any, what: str) -> str:
    if value is None:
        return ""
    if not isinstance(value, str):
        raise InvalidArgument(f"{what} must be a string")
    return value


@dataclass(frozen=True, slots=True)
class Signature:
    """A good signature: its digest and its timestamp (Unix ms)."""

    digest: bytes
    stamp_ms: int


class Replays:
    """The signatures seen within their window, so a call is accepted once: the same signed
    request sent again by the same caller (the token's; a signature covers the body alone)
    within ``SIGNATURE_TOLERANCE_MS`` is refused (401), to any path. A call that failed (an
    error status: a base loading, say) is forgotten, so the platform may retry it.

    A fixed-size table of ``size`` entries (``SEEN_SIGNATURES``), each kept until its window
    has passed; when it is full the entry signed earliest is forgotten, and from then on a call
    signed no later than the latest forgotten one is refused too (it could be a replay of one
    forgotten), so the table never lets a replay through: past ``size`` calls in a window, the
    window shrinks to them. Only signatures that verified are kept: no stranger can fill it."""

    def __init__(self, size: int = SEEN_SIGNATURES) -> None:
        self.size = size
        self._seen: dict[tuple[str, bytes], int] = {}  # (caller, digest) -> timestamp (ms)
        # (timestamp, key), the earliest signed first: expiry and eviction go by the time a call
        # was signed, not by arrival (a signer whose clock runs ahead must not set the floor);
        # an entry forgotten or replaced is dropped when it comes to the top
        self._order: list[tuple[int, tuple[str, bytes]]] = []
        self.floor_ms = -1  # the latest timestamp forgotten while still in its window
        self.refused = 0

    def first(self, caller: str, signature: Signature, now_ms: float) -> None:
        """Record ``caller``'s ``signature``, or raise ``Unauthenticated`` when it was seen (or
        could have been: signed no later than one forgotten)."""
        self._expire(now_ms)
        key = (caller, signature.digest)
        if key in self._seen or signature.stamp_ms <= self.floor_ms:
            self.refused += 1
            raise _signature_refused(
                "this signed call was already received (a signature is accepted once, or, "
                f"past {self.size} calls in {SIGNATURE_TOLERANCE_MS // 60000} minutes, only "
                "the newest): send each call with a new timestamp and its own signature"
            )
        self._seen[key] = signature.stamp_ms
        heapq.heappush(self._order, (signature.stamp_ms, key))
        while len(self._seen) > self.size:
            self.floor_ms = max(self.floor_ms, self._pop())
        if len(self._order) > 2 * self.size:  # forgotten calls' entries: rebuild from the table
            self._order = [(stamp, k) for k, stamp in self._seen.items()]
            heapq.heapify(self._order)

    def forget(self, caller: str, signature: Signature) -> None:
        """A call that failed: the same signature may come again (a platform's retry)."""
        self._seen.pop((caller, signature.digest), None)

    def _expire(self, now_ms: float) -> None:
        """Forget the signatures whose window has passed (the earliest signed first)."""
        while self._order:
            stamp_ms, key = self._order[0]
            if self._seen.get(key) == stamp_ms and now_ms - stamp_ms <= SIGNATURE_TOLERANCE_MS:
                return
            heapq.heappop(self._order)  # expired, or an entry forgotten or replaced
            if self._seen.get(key) == stamp_ms:
                del self._seen[key]

    def _pop(self) -> int:
        """Forget the earliest signed call still held; its timestamp."""
        while True:
            stamp_ms, key = heapq.heappop(self._order)
            if self._seen.get(key) == stamp_ms:
                del self._seen[key]
                return stamp_ms


class Answers:
    """The answers of signed tool calls, so a platform's retry of one (the same body and
    signature, to the same path, from the same caller: its first answer lost to a timeout or a
    dropped connection) is answered as the call was, and not refused as a replay: Retell cannot
    sign a retry anew. A retry that comes while its call is still being answered waits for that
    answer. A call that failed (an error status) is forgotten, as ``Replays`` forgets it, so its
    retry is served afresh: the first retry waiting on it is served, the others wait for that
    one's answer. At most ``size`` answers and ``budget`` bytes of them (each counted as at least
    ``budget / size``; a call being answered as that), each for the signature's window, the
    least recently answered or asked for forgotten first; an answer over ``budget`` is not kept.
    A retry of a call forgotten is refused as a replay. Whoever could replay a captured call
    within its window holds the caller's token too, and gets only the answer the call got."""

    def __init__(self, size: int = ANSWERS_KEPT, budget: int = ANSWER_BYTES_KEPT) -> None:
        self.budget = budget
        self.least = budget // size
        self._kept: TTLCache[tuple[str, str, bytes], asyncio.Future[Reply | None]] = TTLCache(
            budget, SIGNATURE_TOLERANCE_MS / 1000, getsizeof=self._bytes
        )

    def _bytes(self, answer: asyncio.Future[Reply | None]) -> int:
        """What ``answer`` counts against the budget: its body and headers, or ``least``."""
        reply = answer.result() if answer.done() else None
        if reply is None:
            return self.least
        _, body, headers = reply
        return max(self.least, len(body) + sum(len(k) + len(v) for k, v in headers))

    async def of(self, key: tuple[str, str, bytes]) -> Reply | None:
        """The answer of the call ``key`` names, once it has one; None if none is kept. A call
        that failed is forgotten before its waiters wake, so a waiter looks again: the first
        finds nothing and serves it afresh (``expect``), the others wait for that answer.
        Waiting past ``ANSWER_WAIT_S`` is ``Unavailable`` (503): a retry holds its connection."""
        try:
            async with asyncio.timeout(ANSWER_WAIT_S):
                while (answer := self._kept.get(key)) is not None:
                    reply = await asyncio.shield(answer)
                    if reply is not None:
                        return reply
        except TimeoutError:
            raise Unavailable(
                f"the call this retries is still being answered after {ANSWER_WAIT_S:g} s: retry it"
            ) from None
        return None

    def expect(self, key: tuple[str, str, bytes]) -> asyncio.Future[Reply | None]:
        """The answer to come of a call being served: ``answered`` or ``failed`` settle it."""
        answer: asyncio.Future[Reply | None] = asyncio.get_running_loop().create_future()
        self._kept[key] = answer
        return answer

    def answered(
        self, key: tuple[str, str, bytes], answer: asyncio.Future[Reply | None], reply: Reply
    ) -> None:
        """The call was answered ``reply``: its waiters get it, and it is kept by its size (the
        oldest forgotten to make room), or not at all when it is over the whole budget."""
        answer.set_result(reply)
        if self._kept.get(key) is not answer:  # forgotten while it was answered
            return
        if self._bytes(answer) > self.budget:
            self._kept.pop(key, None)
        else:
            self._kept[key] = answer  # counted again, at its size

    def failed(self, key: tuple[str, str, bytes], answer: asyncio.Future[Reply | None]) -> None:
        """The call failed: forget it; a retry waiting for it is served afresh."""
        if self._kept.get(key) is answer:
            self._kept.pop(key, None)
        answer.set_result(None)


def _signature_refused(message: str) -> Unauthenticated:
    """A webhook call refused for its signature: the 401 names the signature's headers."""
    return Unauthenticated(message, challenge=SIGNATURE_CHALLENGE)


def verify_signature(
    secret: bytes, body: bytes, headers: Mapping[str, str], now: float | None = None
) -> Signature:
    """Raise ``Unauthenticated`` unless ``body`` carries a good, recent signature made with
    ``secret`` (``now``: Unix seconds, the clock's by default); return it:

    - ``X-Voxrecall-Timestamp: <unix seconds>`` and ``X-Voxrecall-Signature: sha256=<hex
      HMAC-SHA256 of the timestamp's digits, ".", then the body>`` (Stripe's and Slack's
      shape), within ``SIGNATURE_TOLERANCE_MS`` of now. A signature of the body alone (the
      scheme before the timestamp) is refused, naming the timestamp header: it is good
      forever, so a captured call could be replayed at will.
    - ``X-Retell-Signature: v=<unix ms>,d=<hex HMAC-SHA256 of the body followed by those
      digits>``, as Retell signs (the secret is the Retell API key with the webhook badge),
      within ``SIGNATURE_TOLERANCE_MS`` of now.
    """
    now_ms = (time.time() if now is None else now) * 1000
    if headers.get(SIGNATURE_HEADER, ""):
        return _verify_generic(secret, body, headers, now_ms)
    if headers.get(RETELL_SIGNATURE_HEADER, ""):
        return _verify_retell(secret, body, headers[RETELL_SIGNATURE_HEADER], now_ms)
    raise _signature_refused(
        f"this call is unsigned and a webhook secret is configured: send {TIMESTAMP}: "
        f"<unix seconds> and {SIGNATURE}: sha256=<hex HMAC-SHA256 of "
        f'"<timestamp>.<body>"> (or Retell\'s {RETELL_SIGNATURE})'
    )


def _verify_generic(
    secret: bytes, body: bytes, headers: Mapping[str, str], now_ms: float
) -> Signature:
    stamp = headers.get(TIMESTAMP_HEADER, "").strip()
    if not stamp:
        raise _signature_refused(
            f"{SIGNATURE} needs {TIMESTAMP}: <unix seconds>, and the signature "
            f'is over "<timestamp>.<body>": a signature of the body alone could be replayed '
            "forever, so it is refused"
        )
    if not _STAMP.fullmatch(stamp):
        raise _signature_refused(f"{TIMESTAMP} must be the Unix time in whole seconds")
    _check_fresh(TIMESTAMP, int(stamp) * 1000, now_ms)
    scheme, _, given = headers[SIGNATURE_HEADER].partition("=")
    expected = hmac.new(secret, stamp.encode() + b"." + body, hashlib.sha256).hexdigest()
    # as bytes: compare_digest raises on a str with a non-ASCII character (a header may hold one)
    if scheme != "sha256" or not hmac.compare_digest(given.lower().encode(), expected.encode()):
        raise _signature_refused(
            f"{SIGNATURE} does not match: send sha256=<hex HMAC-SHA256 of "
            f'"<{TIMESTAMP}>.<the exact body bytes>"> with the secret in [sidecar.http] '
            "webhook_secret_env"
        )
    return Signature(bytes.fromhex(expected), int(stamp) * 1000)


def _verify_retell(secret: bytes, body: bytes, header: str, now_ms: float) -> Signature:
    match = _RETELL.fullmatch(header.strip())
    if match is None:
        raise _signature_refused(f"{RETELL_SIGNATURE} is not v=<ms>,d=<hex digest>")
    stamp, given = match.groups()
    if abs(now_ms - int(stamp) * 1000) <= SIGNATURE_TOLERANCE_MS:  # Unix seconds, not ms
        raise _signature_refused(
            f"{RETELL_SIGNATURE}'s v= is the Unix time in milliseconds; v={stamp} is in "
            "seconds: send v=<unix ms>,d=<hex HMAC-SHA256 of the body followed by those digits>"
        )
    _check_fresh(RETELL_SIGNATURE, int(stamp), now_ms)
    expected = hmac.new(secret, body + stamp.encode(), hashlib.sha256).hexdigest()
    if not hmac.compare_digest(given.lower(), expected):
        raise _signature_refused(
            f"{RETELL_SIGNATURE} does not match the body: set [sidecar.http] "
            "webhook_secret_env to the variable holding the Retell API key with the webhook badge"
        )
    return Signature(bytes.fromhex(expected), int(stamp))


def _check_fresh(header: str, stamp_ms: int, now_ms: float) -> None:
    if abs(now_ms - stamp_ms) > SIGNATURE_TOLERANCE_MS:
        raise _signature_refused(
            f"{header} is more than {SIGNATURE_TOLERANCE_MS // 60000} minutes from this "
            "sidecar's clock: a replayed request is refused (if it is new, check both clocks)"
        )


def _check_secrets(http: HttpConfig) -> None:
    """A secret's variable named but unset or empty would switch the check off: refuse to start,
    as an unset caller token does; and one under ``MIN_SECRET_CHARS`` is refused too (a guess
    away, and the logs do not redact so short a string: ``logs.worth_scrubbing``)."""
    for key, secret in (
        ("vapi_secret_env", http.vapi_secret),
        ("webhook_secret_env", http.webhook_secret),
    ):
        if getattr(http, key) and not secret:
            raise ConfigError(
                f"[sidecar.http] {key}: the environment variable {getattr(http, key)} is unset "
                "or empty: set it to the secret, or remove the key to accept unsigned calls"
            )
        if getattr(http, key) and len(secret) < MIN_SECRET_CHARS:
            raise ConfigError(
                f"[sidecar.http] {key}: the secret in {getattr(http, key)} is shorter than "
                f"{MIN_SECRET_CHARS} characters: use a longer one (e.g. `openssl rand -hex 16`)"
            )


class Webhooks:
    def __init__(self, config: Config, engine: Engine, toolbox: Toolbox) -> None:
        http = config.sidecar.http
        self.engine = engine
        self.toolbox = toolbox
        self.knowledge_base = http.vapi_knowledge_base or engine.default_knowledge_base
        _check_secrets(http)
        self.vapi_secret = http.vapi_secret.encode()
        self.webhook_secret = http.webhook_secret.encode()
        self.conversations = Conversations(engine.sessions)
        self.replays = Replays()
        self.answers = Answers()

    # -- Vapi ----------------------------------------------------------------------------------

    def _check_vapi_secret(self, headers: Mapping[str, str], where: str) -> None:
        if self.vapi_secret and not hmac.compare_digest(
            headers.get(VAPI_SECRET_HEADER, "").encode(), self.vapi_secret
        ):
            raise Unauthenticated(
                f"X-Vapi-Secret is missing or wrong: set the {where}'s server.secret to the "
                "secret in the variable [sidecar.http] vapi_secret_env names",
                challenge=VAPI_CHALLENGE,
            )

    async def vapi(self, call: HttpCall, headers: dict[str, str], body: bytes) -> Reply:
        self._check_vapi_secret(headers, "knowledge base")
        asked = self._kb_request(headers, body)
        fed, note = asked.fed, asked.note
        hits: Sequence[Hit] = ()
        for i, turn in enumerate(asked.said):
            result = await self._turn(call, asked.call_id, turn)
            if turn.speaker == Speaker.USER and i == len(asked.said) - 1:
                hits, fed.query, note = result.hits, result.query, _why_nothing(result)
        if asked.fresh:
            fed.answer, fed.note = tuple(hit.chunk.chunk_id for hit in hits), note
        self.conversations.fed(asked.call_id, fed)
        if not asked.fresh:  # the same request again (a retry): the same answer
            hits = await self._answered_again(asked.call_id, fed)
        extra = [] if hits else [(NOTE_HEADER, (fed.note or note).encode())]
        return 200, orjson.dumps({"documents": _documents(hits)}), extra

    def _kb_request(self, headers: Mapping[str, str], body: bytes) -> KbRequest:
        """What a knowledge-base request asks, read from its body at once: the parsed body is
        dropped before the first search (kept through them, 64 bodies of tiny JSON values held
        millions of objects for the collector to walk)."""
        example = '{"message": {"type": "knowledge-base-request", "messages": [...], "call": {"id": ...}}}'
        message = _object(body, example).get("message")
        if not isinstance(message, dict) or message.get("type") != KNOWLEDGE_BASE_REQUEST:
            raise InvalidArgument(f"this URL answers Vapi's knowledge-base-request: {example}")
        messages = message.get("messages")
        if not isinstance(messages, list):
            raise InvalidArgument("message.messages must be the list of the call's messages")
        call_id = _vapi_call_id(message, headers)
        if not call_id:
            raise InvalidArgument("message.call.id is missing: it names the call's session")
        fresh, fed = self.conversations.new(call_id, messages)
        said = [s for s in map(_said, fresh[-MAX_FED:]) if s is not None]
        note = NOTHING_ASKED if any(map(_said, messages)) else NOTHING_SAID
        return KbRequest(call_id, said, fed, bool(fresh), note)

    async def _answered_again(self, call_id: str, fed: Fed) -> Sequence[Hit]:
        """What the request retried was answered with: nothing, or the search the call's
        session kept of it, or (the session gone, or the search dropped) its query again."""
        if not fed.answer:
            return ()
        session = self.engine.sessions.peek(call_id)
        for hits in reversed(session.retained if session is not None else ()):
            if tuple(hit.chunk.chunk_id for hit in hits) == fed.answer:
                return hits
        return await self._searched_again(fed.query)

    async def _searched_again(self, query: str) -> Sequence[Hit]:
        """The last searched query again, for a call whose session has gone: a folded query
        may be longer than a caller's text may be, so its end (the turn's own words) is kept."""
        again = SearchInput(query[-MAX_TEXT_CHARS:], self.knowledge_base)
        return (await self.engine.search(again)).hits

    async def _turn(self, call: HttpCall, session_id: str, said: Said) -> TurnResult:
        speaker = pb.AGENT if said.speaker == Speaker.AGENT else pb.USER
        call.check(
            pb.TurnRequest(
                session_id=session_id,
                text=said.text,
                knowledge_base=self.knowledge_base,
                speaker=speaker,
                is_final=True,
            )
        )
        result = await self.engine.turn(
            TurnInput(
                session_id=session_id,
                text=said.text,
                knowledge_base=self.knowledge_base,
                speaker=said.speaker,
            )
        )
        call.sent(_seen(result))
        return result

    # -- tools ---------------------------------------------------------------------------------

    async def tool(
        self, call: HttpCall, function: str, headers: dict[str, str], body: bytes
    ) -> Reply:
        if not self.webhook_secret:
            return await self._tool(call, function, headers, body)
        now, caller = time.time(), sessions.owner.get()
        signature = verify_signature(self.webhook_secret, body, headers, now)
        key = (caller, function, signature.digest)
        retried = await self.answers.of(key)
        if retried is not None:  # the same signed call again: a platform retrying it
            return retried
        self.replays.first(caller, signature, now * 1000)
        answer = self.answers.expect(key)
        try:
            reply = await self._tool(call, function, headers, body)
        except BaseException:
            self.replays.forget(caller, signature)
            self.answers.failed(key, answer)
            raise
        self.answers.answered(key, answer, reply)
        return reply

    async def _tool(
        self, call: HttpCall, function: str, headers: dict[str, str], body: bytes
    ) -> Reply:
        asked = self._tool_request(function, headers, body)
        if isinstance(asked, VapiTools):
            return await self._vapi_tools(call, asked)
        arguments, session_id = asked
        call.check(
            pb.InvokeToolRequest(name=function, arguments_json=arguments, session_id=session_id)
        )
        if self.toolbox.get(function) is None:  # unknown, or outside the token's scope: alike
            known = ", ".join(fn.name for fn in self.toolbox.visible_functions()) or "none"
            raise NotFound(f"no function {function!r} at /tools/: known: {known}")
        result = await self.toolbox.invoke(self.engine, function, arguments, session_id)
        extra = [TOOL_ERROR_HEADER] if result.is_error else []
        return 200, result.output.encode(), extra

    def _tool_request(
        self, function: str, headers: Mapping[str, str], body: bytes
    ) -> VapiTools | tuple[str, str]:
        """What a ``/tools/`` body asks, read at once so the parsed body is dropped before any
        search: Vapi's envelope, or the arguments (as JSON text) and session id of one call."""
        payload = _object(body, TOOL_BODIES)
        message = payload.get("message")
        if isinstance(message, dict) and message.get("type") == TOOL_CALLS:
            self._check_vapi_secret(headers, "tool")
            return _vapi_envelope(message, headers)
        name = payload.get("name")
        if name is not None and name != function:
            raise InvalidArgument(_other_function(name, function))
        arguments, session_id, field = _tool_call(payload, headers)
        check_session_header(session_id, field)
        return arguments, session_id

    async def _vapi_tools(self, call: HttpCall, asked: VapiTools) -> Reply:
        """Vapi's ``tool-calls`` envelope: each call run by the function it names, answered
        ``{"results": [{"toolCallId", "name", "result" or "error"}]}`` in the list's order; a
        call that cannot run (its arguments or name unreadable) is its ``error``, the others
        run."""
        results = [await self._vapi_tool(call, c, asked.session_id) for c in asked.calls]
        extra = [TOOL_ERROR_HEADER] if any("error" in r for r in results) else []
        return 200, orjson.dumps({"results": results}), extra

    async def _vapi_tool(
        self, call: HttpCall, tool_call: VapiCall, session_id: str
    ) -> dict[str, str]:
        """One of Vapi's tool calls run: its result, or its error for the model to read."""
        call_id, name, arguments = tool_call.call_id, tool_call.name, tool_call.arguments
        echoed = {"toolCallId": call_id, "name": name[:MAX_TOOL_CALL_ID]}  # a model's runaway name
        if tool_call.error:
            return {**echoed, "error": tool_call.error}
        try:
            call.check(
                pb.InvokeToolRequest(name=name, arguments_json=arguments, session_id=session_id)
            )
            result = await self.toolbox.invoke(self.engine, name, arguments, session_id)
        except RequestError as exc:  # this call's (a base loading, a scope): the others stand
            error = error_output(tool_error_type(status_for(exc)), caller_message(exc))
            return {**echoed, "error": error}
        return {**echoed, "error" if result.is_error else "result": result.output}


@dataclass(slots=True)
class KbRequest:
    """What a Vapi knowledge-base request asks (``Webhooks._kb_request``)."""

    call_id: str
    said: list[Said]  # the turns to feed, in order
    fed: Fed  # the call's entry once they are
    fresh: bool  # the request holds messages not fed before (else it is a retry)
    note: str  # why an answer would be empty


@dataclass(frozen=True, slots=True)
class VapiCall:
    """One entry of Vapi's ``toolCallList``, read: ``error`` (an output for the model) where it
    cannot run."""

    call_id: str
    name: str
    arguments: str
    error: str = ""


@dataclass(frozen=True, slots=True)
class VapiTools:
    """A Vapi ``tool-calls`` envelope, every call read before any runs."""

    session_id: str
    calls: list[VapiCall]


def _vapi_envelope(message: dict[str, Any], headers: Mapping[str, str]) -> VapiTools:
    """Vapi's ``tool-calls`` envelope read, every call checked before any runs: one whose
    answer could not be matched to it (no id, an id over ``MAX_TOOL_CALL_ID``) refuses the
    envelope (400, naming its entry)."""
    calls = message.get("toolCallList", message.get("toolCalls"))
    if not isinstance(calls, list):
        raise InvalidArgument(
            f"message.toolCallList must be the list of the model's tool calls: {VAPI_TOOLS_EXAMPLE}"
        )
    if len(calls) > MAX_TOOL_CALLS:
        raise InvalidArgument(
            f"message.toolCallList holds {len(calls)} calls; at most {MAX_TOOL_CALLS} are "
            "answered in one request"
        )
    session_id = _vapi_call_id(message, headers)
    return VapiTools(session_id, [_tool_call_of(i, c, session_id) for i, c in enumerate(calls)])


def _why_nothing(result: TurnResult) -> str:
    """Why a searched (or skipped) last user turn answered no documents."""
    if result.skipped is not Skip.NOT_SKIPPED:
        return f"not searched: the caller's last turn was skipped ({result.skipped.name.lower()})"
    return NOTHING_FOUND


def _seen(result: TurnResult) -> pb.TurnResponse:
    """What the hooks read of a turn's answer (the metrics: whether it searched, its timings):
    Vapi gets documents, so the chunks a ``TurnResponse`` would carry are never built."""
    seen = pb.TurnResponse(skipped=result.skipped.name)
    set_timings(seen.timings, result.timings)
    return seen


def _other_function(name: Any, function: str) -> str:
    """What a ``/tools/{function}`` body naming another function (or naming none as a string:
    any JSON, quoted in part) is told."""
    if not isinstance(name, str):
        return f"the body's name is {quoted(name)}, not a string: send {function!r} or none"
    return (
        f"the body names function {quoted(name)} but the URL {quoted(function)}: point the "
        f"platform's {quoted(name)} at /tools/{name[:NAME_CHARS]}"
    )


def _vapi_call_id(message: dict[str, Any], headers: Mapping[str, str]) -> str:
    """The session of a Vapi request: the ``x-voxrecall-session`` header, else
    ``message.call.id`` ("" when neither is sent), checked against the name limit."""
    call_id, field = headers.get(SESSION_HEADER, ""), SESSION_HEADER
    if not call_id:
        field = "message.call.id"
        call_info = message.get("call")
        call_id = _string(call_info.get("id") if isinstance(call_info, dict) else None, field)
    check_session_header(call_id, field)
    return call_id


def _tool_call_of(index: int, tool_call: Any, session_id: str) -> VapiCall:
    """Entry ``index`` of Vapi's ``toolCallList``: its id, the function's name ("" when missing:
    the toolbox answers that no function has that name) and its arguments as JSON text, or the
    error its call answers (arguments nested too deep to write or over their byte limit). An entry without an id, or with one over ``MAX_TOOL_CALL_ID`` characters,
    cannot be answered (its id is echoed), so it refuses the request (400)."""
    where = f"message.toolCallList[{index}].id"
    call_id = tool_call.get("id") if isinstance(tool_call, dict) else None
    if not isinstance(call_id, str) or not call_id:
        raise InvalidArgument(
            f"each entry of message.toolCallList needs its id (a string), {where} has none: "
            f"{VAPI_TOOLS_EXAMPLE}"
        )
    if len(call_id) > MAX_TOOL_CALL_ID:
        raise InvalidArgument(
            f"{where} is {len(call_id)} characters; the limit is {MAX_TOOL_CALL_ID}: send the "
            "id Vapi gave the call"
        )
    function = tool_call.get("function")
    function = function if isinstance(function, dict) else {}
    name = function.get("name")
    name = name if isinstance(name, str) else ""
    try:
        arguments = _arguments_json(function.get("arguments", {}))
        check_fields(
            pb.InvokeToolRequest(name=name, arguments_json=arguments, session_id=session_id)
        )
    except InvalidArgument as exc:
        error = error_output(INVALID_ARGUMENTS, f"tool call {call_id!r}: {exc}")
        return VapiCall(call_id, name[:MAX_TOOL_CALL_ID], "", error)
    return VapiCall(call_id, name, arguments)


def _tool_call(payload: dict[str, Any], headers: Mapping[str, str]) -> tuple[str, str, str]:
    """The arguments (as a JSON string), the session id of a tool webhook's body, and the
    field that named it (the first given of the header, ``call.call_id``, ``session_id``,
    ``call_id``)."""
    if "args" in payload:
        arguments: Any = payload["args"]
    elif "arguments" in payload:
        arguments = payload["arguments"]
    else:
        arguments = {k: v for k, v in payload.items() if k not in TOOL_METADATA}
    call_info = payload.get("call")
    named = (
        (SESSION_HEADER, headers.get(SESSION_HEADER)),
        ("call.call_id", call_info.get("call_id") if isinstance(call_info, dict) else None),
        ("session_id", payload.get("session_id")),
        ("call_id", payload.get("call_id")),
    )
    for field, value in named:
        session_id = _string(value, field)
        if session_id:
            return _arguments_json(arguments), session_id, field
    return _arguments_json(arguments), "", ""


def _arguments_json(arguments: Any) -> str:
    """The arguments as the JSON text ``InvokeTool`` takes (a string as it came)."""
    if isinstance(arguments, str):
        return arguments
    try:
        return orjson.dumps(arguments).decode()
    except orjson.JSONEncodeError as exc:  # nested deeper than orjson writes (255)
        raise InvalidArgument(
            f'the arguments cannot be read ({exc}): send a flat object like {{"query": "..."}}'
        ) from exc
