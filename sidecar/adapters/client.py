"""The async client the adapters share: one channel, a deadline on every call.

``Voxrecall`` wraps the ``Retrieval`` stub over a ``sidecar.connection.Connection`` (target, token,
TLS: the ``VOXRECALL_*`` variables, read by the agent's entry point); ``TurnStream`` is one call's ``Converse`` stream, where
interim transcripts go ahead so the server can prefetch, and each final transcript waits for its
answer. ``knowledge_text`` renders chunks as the message an LLM context takes. ``call_tool`` is
the one way every adapter runs a model's knowledge function call: arguments over the sidecar's
limit are answered here (never sent), and a refused call becomes the error output the sidecar's
own tool path gives a model.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Coroutine, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import grpc
import orjson

from sidecar.connection import DEFAULT_TARGET, Connection, open_channel
from sidecar.edge.limits import MAX_ARGUMENTS_BYTES, arguments_too_large, utf8_size
from sidecar.edge.status import UNAVAILABLE_TYPE, tool_error_type
from sidecar.gen import retrieval_pb2 as pb
from sidecar.gen import retrieval_pb2_grpc as pb_grpc

log = logging.getLogger("voxrecall.adapters")

# A turn answers within its budget (150 ms by default) or says why not; a second without an
# answer means the sidecar is not there, and the agent should go on without knowledge.
TURN_TIMEOUT_S = 1.0
# A model waits for its tool call anyway, but a call must still end.
TOOL_TIMEOUT_S = 3.0
# The most of an answer that goes into the context: a turn answers up to [sidecar] max_results
# (3 by default, 50 at most) chunks of a few hundred words; an answer past these is not one.
MAX_KNOWLEDGE_CHUNKS = 50
MAX_KNOWLEDGE_CHARS = 64_000
KNOWLEDGE_HEADER = (
    "Knowledge base excerpts for the caller's last turn. Answer from them when they are "
    "relevant; when they do not answer the question, say you do not know rather than guess."
)


def knowledge_text(chunks: Sequence[pb.Chunk]) -> str:
    """The chunks as one message for an LLM context; empty when there are none. At most
    MAX_KNOWLEDGE_CHUNKS of them and MAX_KNOWLEDGE_CHARS in all (a chunk past them is left out
    whole): an answer of 400,000 chunks held the event loop 0.5 s and made 6.7 MB of context."""
    if not chunks:
        return ""
    parts = [KNOWLEDGE_HEADER]
    size = len(KNOWLEDGE_HEADER)
    for i, chunk in enumerate(chunks[:MAX_KNOWLEDGE_CHUNKS], 1):
        where = " > ".join(chunk.breadcrumbs) or chunk.title
        part = f"[{i}] {where} ({chunk.source}:{chunk.source_path})\n{chunk.text.strip()}"
        size += len(part) + 2
        if size > MAX_KNOWLEDGE_CHARS:
            break
        parts.append(part)
    return "\n\n".join(parts) if len(parts) > 1 else ""


INVALID_ARGUMENTS = "invalid_arguments"  # the type the sidecar gives arguments it refuses
DID_NOT_ANSWER = (
    "the knowledge base did not answer; tell the caller you cannot look it up right now"
)


def error_output(type_: str, message: str) -> str:
    """An error output, shaped as the sidecar's (``sidecar.functions.tools.error_output``)."""
    return orjson.dumps({"error": {"type": type_, "message": message}}).decode()


@dataclass(frozen=True, slots=True)
class ToolOutput:
    output: str  # what the model reads: results, or {"error": {"type", "message"}}
    is_error: bool


async def call_tool(
    client: Voxrecall, name: str, arguments_json: str, *, session_id: str = "", call_id: str = ""
) -> ToolOutput:
    """A model's call of knowledge function ``name`` through ``InvokeTool``, as the output the
    model reads. Arguments over ``MAX_ARGUMENTS_BYTES`` get the sidecar's own refusal, unsent
    (past its message limit gRPC would refuse them with a status the model could not act on);
    a call refused INVALID_ARGUMENT, NOT_FOUND or RESOURCE_EXHAUSTED gets its code and message
    (``sidecar.edge.status.tool_error_type``, as on MCP); any other failure, "unavailable"."""
    size = utf8_size(arguments_json, MAX_ARGUMENTS_BYTES)
    if size > MAX_ARGUMENTS_BYTES:
        return ToolOutput(error_output(INVALID_ARGUMENTS, arguments_too_large(size)), True)
    try:
        resp = await client.invoke_tool(
            name, arguments_json, session_id=session_id, call_id=call_id
        )
    except grpc.aio.AioRpcError as exc:
        log.warning("%s failed: %s %s", name, exc.code().name, exc.details())
        type_ = tool_error_type(exc.code())
        message = (exc.details() or DID_NOT_ANSWER) if type_ != UNAVAILABLE_TYPE else DID_NOT_ANSWER
        return ToolOutput(error_output(type_, message), True)
    except TimeoutError:
        log.warning("%s failed: no answer in time", name)
        return ToolOutput(error_output(UNAVAILABLE_TYPE, DID_NOT_ANSWER), True)
    return ToolOutput(resp.output, resp.is_error)


_T = TypeVar("_T")


def readable(resp: _T | None, method: str) -> _T:
    """``resp``, or an INTERNAL ``AioRpcError`` when grpc.aio could not parse the answer (it
    logs the error and hands over None: every adapter then failed on an attribute of None,
    where it goes on without knowledge from a failed call)."""
    if resp is None:
        raise unreadable(method)
    return resp


def unreadable(method: str) -> grpc.aio.AioRpcError:
    empty = grpc.aio.Metadata()
    details = f"the sidecar's {method} answer could not be read as the proto's message"
    return grpc.aio.AioRpcError(grpc.StatusCode.INTERNAL, empty, empty, details, None)


def is_knowledge(text: object) -> bool:
    """Whether a message's content is one ``knowledge_text`` made."""
    return isinstance(text, str) and text.startswith(KNOWLEDGE_HEADER)


class Voxrecall:
    """An async client of one sidecar, for adapters and agents.

    Usage::

        async with Voxrecall(Connection.from_env(os.environ)) as vr:  # or Voxrecall("host:port")
            resp = await vr.turn("call-1", "How much is roaming?")
    """

    def __init__(
        self,
        connection: Connection | str = DEFAULT_TARGET,
        *,
        knowledge_base: str = "",
        turn_timeout_s: float = TURN_TIMEOUT_S,
        tool_timeout_s: float = TOOL_TIMEOUT_S,
    ) -> None:
        self.connection = (
            connection if isinstance(connection, Connection) else Connection(connection)
        )
        self.metadata = self.connection.metadata  # on every call: the bearer token, if any
        self.knowledge_base = knowledge_base
        self.turn_timeout_s = turn_timeout_s
        self.tool_timeout_s = tool_timeout_s
        self._channel: grpc.aio.Channel | None = None
        self._stub: Any = None
        self._over: Voxrecall | None = None  # the client whose channel this one shares

    def for_base(self, knowledge_base: str) -> Voxrecall:
        """A client of ``knowledge_base`` over this client's channel (one channel per sidecar,
        however many bases it serves); closing this client closes it."""
        bound = Voxrecall(
            self.connection,
            knowledge_base=knowledge_base,
            turn_timeout_s=self.turn_timeout_s,
            tool_timeout_s=self.tool_timeout_s,
        )
        bound._over = self
        return bound

    @property
    def stub(self) -> Any:
        """The ``Retrieval`` stub; the channel is opened on first use, inside the running loop."""
        if self._over is not None:
            return self._over.stub
        if self._stub is None:
            self._channel = open_channel(self.connection)
            self._stub = pb_grpc.RetrievalStub(self._channel)  # type: ignore[no-untyped-call]
        return self._stub

    async def turn(
        self,
        session_id: str,
        text: str,
        *,
        sources: Sequence[str] = (),
        is_final: bool = True,
        timeout_s: float | None = None,
    ) -> pb.TurnResponse:
        """One turn's answer within ``timeout_s`` (default ``turn_timeout_s``)."""
        resp: pb.TurnResponse = await self.stub.Turn(
            self.turn_request(session_id, text, sources=sources, is_final=is_final),
            metadata=self.metadata,
            timeout=self.turn_timeout_s if timeout_s is None else timeout_s,
        )
        return readable(resp, "Turn")

    async def search(
        self, query: str, *, sources: Sequence[str] = (), limit: int = 0, session_id: str = ""
    ) -> pb.SearchResponse:
        resp: pb.SearchResponse = await self.stub.Search(
            pb.SearchRequest(
                knowledge_base=self.knowledge_base,
                query=query,
                sources=list(sources),
                limit=limit,
                session_id=session_id,
            ),
            metadata=self.metadata,
            timeout=self.turn_timeout_s,
        )
        return readable(resp, "Search")

    async def list_tools(self) -> list[pb.Tool]:
        resp: pb.ListToolsResponse = await self.stub.ListTools(
            pb.ListToolsRequest(), metadata=self.metadata, timeout=self.tool_timeout_s
        )
        return list(readable(resp, "ListTools").tools)

    async def invoke_tool(
        self, name: str, arguments_json: str, *, session_id: str = "", call_id: str = ""
    ) -> pb.InvokeToolResponse:
        resp: pb.InvokeToolResponse = await self.stub.InvokeTool(
            pb.InvokeToolRequest(
                name=name, arguments_json=arguments_json, session_id=session_id, call_id=call_id
            ),
            metadata=self.metadata,
            timeout=self.tool_timeout_s,
        )
        return readable(resp, "InvokeTool")

    async def end_session(self, session_id: str) -> bool:
        resp: pb.EndSessionResponse = await self.stub.EndSession(
            pb.EndSessionRequest(session_id=session_id),
            metadata=self.metadata,
            timeout=self.turn_timeout_s,
        )
        return readable(resp, "EndSession").existed

    async def status(self) -> pb.StatusResponse:
        """Each base's snapshot, the embedder, uptime, and this caller's sessions."""
        resp: pb.StatusResponse = await self.stub.Status(
            pb.StatusRequest(), metadata=self.metadata, timeout=self.tool_timeout_s
        )
        return readable(resp, "Status")

    async def read_page(
        self, source_path: str, *, source: str = "", offset: int | None = None
    ) -> pb.ReadPageResponse:
        """A whole page of this client's base; with ``offset`` (0 for the start) the part from
        there that fits one message (``truncated`` and ``next_offset`` say where to read on)."""
        request = pb.ReadPageRequest(
            knowledge_base=self.knowledge_base, source_path=source_path, source=source
        )
        if offset is not None:
            request.offset = offset
        resp: pb.ReadPageResponse = await self.stub.ReadPage(
            request, metadata=self.metadata, timeout=self.tool_timeout_s
        )
        return readable(resp, "ReadPage")

    def turn_stream(self, session_id: str, *, sources: Sequence[str] = ()) -> TurnStream:
        """A ``Converse`` stream for one call (opened on first use)."""
        return TurnStream(self, session_id, sources=sources)

    def turn_request(
        self, session_id: str, text: str, *, sources: Sequence[str] = (), is_final: bool = True
    ) -> pb.TurnRequest:
        return pb.TurnRequest(
            session_id=session_id,
            knowledge_base=self.knowledge_base,
            text=_sound(text),
            speaker=pb.USER,
            is_final=is_final,
            sources=list(sources),
        )

    async def close(self) -> None:
        if self._channel is not None:
            await self._channel.close(None)
        self._channel = self._stub = None

    async def __aenter__(self) -> Voxrecall:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()


def _sound(text: str) -> str:
    """``text`` as protobuf takes it: a lone surrogate (``json.loads`` writes one for
    ``"\\ud800"``, a recogniser's or a platform's JSON may hold one) as U+FFFD, where protobuf
    raised UnicodeEncodeError into the pipeline and its transcription was dropped."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return text.encode("utf-16", "surrogatepass").decode("utf-16", "replace")
    return text


class _Converse:
    """One open ``Converse`` call, whose reads and writes run in tasks of its own.

    grpc.aio cancels an RPC whose read or write is cancelled, and a caller may be cancelled
    mid-turn (Pipecat cancels the frame a processor is on at each interruption): that must
    cost the caller its answer, not the call its stream. Answers wait in ``answers`` (one per
    final written; a cancelled final's is skipped by the next), then the error that ended the
    call, if any.
    """

    def __init__(self, call: Any) -> None:
        self.call = call
        self.answers: asyncio.Queue[pb.ConverseResponse | Exception] = asyncio.Queue()
        self._writing = asyncio.Lock()  # one write at a time, in the order they were asked
        self._tasks: set[asyncio.Task[None]] = set()
        # answers the finals written are owed: the queue holds at most these (the sidecar
        # answers a final user turn; an agent's turn sent here would be owed one too)
        self._owed = 0
        self._spawn(self._read())

    async def write(self, request: pb.ConverseRequest) -> None:
        """Write ``request`` in a task of its own: the caller's cancellation is not the write's
        (nor the call's), and the call's close (``close``) is not the caller's cancellation
        but the stream's end (InvalidStateError)."""
        self._owed += request.turn.is_final
        writing = self._spawn(self._write(request))
        await asyncio.wait({writing})
        if writing.cancelled():
            raise asyncio.InvalidStateError("the stream was closed")
        writing.result()

    async def answer(self) -> pb.ConverseResponse:
        item = await self.answers.get()
        if isinstance(item, Exception):
            self.answers.put_nowait(item)  # the call is over: every later read says so
            raise item
        return item

    def close(self) -> None:
        self.call.cancel()
        for task in list(self._tasks):
            task.cancel()

    def _spawn(self, work: Coroutine[Any, Any, None]) -> asyncio.Task[None]:
        task = asyncio.create_task(work)
        self._tasks.add(task)
        task.add_done_callback(self._done)
        return task

    def _done(self, task: asyncio.Task[None]) -> None:
        """Forget ``task``, reading its error: a write whose caller was cancelled is awaited by
        nobody, and the error (the stream broke; the next read says so) would be logged by
        asyncio as never retrieved."""
        self._tasks.discard(task)
        if not task.cancelled():
            task.exception()

    async def _write(self, request: pb.ConverseRequest) -> None:
        async with self._writing:
            await self.call.write(request)

    async def _read(self) -> None:
        try:
            while (resp := await self.call.read()) is not grpc.aio.EOF:  # type: ignore[attr-defined]
                self._take(resp)
            self.answers.put_nowait(asyncio.InvalidStateError("the sidecar ended the stream"))
        except asyncio.CancelledError:  # closed (grpc.aio says a cancelled RPC's read so too)
            self.answers.put_nowait(asyncio.InvalidStateError("the stream was closed"))
        except Exception as exc:  # handed to the final waiting, which raises it
            self.answers.put_nowait(exc)

    def _take(self, resp: pb.ConverseResponse | None) -> None:
        """Queue an answer; one that cannot be read (grpc.aio's None), or that no final is owed
        (answers sent unasked, 89,000 of them queued in 10 s: 900 MB), ends the stream."""
        if resp is None:
            raise unreadable("Converse")
        if self._owed <= 0:
            self.call.cancel()
            raise asyncio.InvalidStateError("the sidecar answered a final never sent")
        self._owed -= 1
        self.answers.put_nowait(resp)


class TurnStream:
    """One call's ``Converse`` stream: interims go ahead (prefetch), a final waits for its answer.

    Where the sidecar has no ``Converse`` (UNIMPLEMENTED), or the stream breaks, a final
    transcript is sent as a plain ``Turn`` instead, so an answer never depends on the stream.
    Feed it from one task: a final's answer is the next one the stream returns. A final whose
    caller is cancelled while it waits loses its answer, not the stream (``_Converse``).
    """

    def __init__(self, client: Voxrecall, session_id: str, *, sources: Sequence[str] = ()) -> None:
        self.client = client
        self.session_id = session_id
        self.sources = tuple(sources)
        self.streaming = True  # False once the sidecar said it has no Converse
        self._converse: _Converse | None = None
        self._interim: asyncio.Task[None] | None = None  # sending interims, if any
        self._next_interim: str | None = None  # the newest interim not sent yet
        self._closed = False  # ``aclose``: no stream is opened again

    async def interim(self, text: str) -> None:
        """Send an interim transcript ahead, without waiting for it to go out (nothing comes
        back for it): a pipeline's frames never wait on a prefetch (a sidecar down held each
        interim 350 ms to 1 s, and a final behind them seconds). While one goes out, the
        newest after it waits to follow (the ones between are never sent: the newest is the
        one worth a prefetch)."""
        if not self.streaming or not text.strip():
            return
        self._next_interim = text
        if self._interim is None or self._interim.done():
            self._interim = asyncio.create_task(self._send_interims())

    async def _send_interims(self) -> None:
        while (text := self._next_interim) is not None:
            self._next_interim = None
            try:
                async with asyncio.timeout(self.client.turn_timeout_s):
                    await self._open().write(self._request(text, is_final=False))
            except Exception as exc:  # awaited by nobody: a prefetch missed is all it costs
                self._broken(exc)
                return

    async def final(self, text: str) -> tuple[pb.TurnResponse, bool]:
        """This final transcript's answer, and whether it was answered from a prefetch.

        Raises TimeoutError past ``turn_timeout_s`` and ``grpc.aio.AioRpcError`` when the
        sidecar refuses the turn: the caller goes on without knowledge for this turn. Where the
        stream breaks, the plain ``Turn`` sent instead has what is left of that time.
        """
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.client.turn_timeout_s
        if self.streaming:
            try:
                async with asyncio.timeout_at(deadline):
                    return await self._streamed(text)
            except TimeoutError as exc:
                self._broken(exc)
                raise
            except (grpc.aio.AioRpcError, asyncio.InvalidStateError) as exc:
                self._broken(exc)
        left = deadline - loop.time()
        if left <= 0:
            raise TimeoutError("no answer within turn_timeout_s")
        resp = await self.client.turn(self.session_id, text, sources=self.sources, timeout_s=left)
        return resp, False

    async def _streamed(self, text: str) -> tuple[pb.TurnResponse, bool]:
        if self._interim is not None and not self._interim.done():
            # its interims go out first, within this deadline; how they end is theirs (a
            # cancelled one is not this final's cancellation)
            await asyncio.wait({self._interim})
        converse = self._open()
        await converse.write(self._request(text, is_final=True))
        said = _sound(text).strip()  # as sent, and so as echoed
        while True:
            resp = await converse.answer()
            # An answer to an earlier final that missed its deadline is skipped.
            if not resp.transcript or resp.transcript.strip() == said:
                return resp.turn, resp.prefetched

    async def aclose(self) -> None:
        self._closed = True
        if self._interim is not None:
            self._interim.cancel()
        self._close()

    def _open(self) -> _Converse:
        if self._closed:  # a final or an interim still under way when the call ended
            raise asyncio.InvalidStateError("the stream was closed")
        if self._converse is None:
            self._converse = _Converse(self.client.stub.Converse(metadata=self.client.metadata))
        return self._converse

    def _close(self) -> None:
        converse, self._converse = self._converse, None
        if converse is not None:
            converse.close()

    def _request(self, text: str, *, is_final: bool) -> pb.ConverseRequest:
        turn = self.client.turn_request(
            self.session_id, text, sources=self.sources, is_final=is_final
        )
        return pb.ConverseRequest(turn=turn)

    def _broken(self, exc: BaseException) -> None:
        if self._closed:
            return  # closed on purpose: nothing broke, and nothing is reopened
        if isinstance(exc, grpc.aio.AioRpcError) and exc.code() == grpc.StatusCode.UNIMPLEMENTED:
            log.info("the sidecar has no Converse: finals go through Turn, without prefetch")
            self.streaming = False
        else:
            log.warning("Converse stream broke (%s): reopening on the next transcript", exc)
        self._close()
