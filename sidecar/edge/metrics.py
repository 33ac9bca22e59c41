"""Prometheus metrics on their own port (``[sidecar] metrics_listen``).

    metrics = Metrics(engine, holder, lifecycle, limit)      # a hook and a registry
    server = grpc.aio.server(interceptors=[HookInterceptor([..., metrics, ...])])
    metrics.serve("127.0.0.1:9464")  ...  metrics.close()

Calls are measured by the hook as they end: ``voxrecall_rpcs_total{door,method,code}``, the
server-side latency ``voxrecall_rpc_seconds{door,method}`` (``door``: grpc or http), the per-stage latency each answer reports
``voxrecall_stage_seconds{rpc,stage}`` (embed, search, total), and calls refused
``voxrecall_refusals_total{reason}``. Everything else is read when Prometheus scrapes, from the
counters the parts already keep: turns, skips by reason, degraded and prefetched turns
(``Engine.counters``), query embeddings by outcome and the cache hit ratio
(``QueryEmbedder.stats``), sessions, calls in flight, the lifecycle state, each base's snapshot
version, age and size, and snapshot refusals by kind (``SnapshotHolder.refusals``).
No label ever holds a token, a query or a session id. The per-base series are read at each
scrape from the bases the engine knows (``Engine.known_bases``, at most ``MAX_LISTED_BASES``
listed ones): a base forgotten at a poll leaves none behind; calls are counted by door,
method and code, never by base, so a call naming a base that does not exist makes none.
"""

from __future__ import annotations

import socket
import sys
import threading
import time
from bisect import bisect_left
from collections.abc import Callable, Iterator, Sequence
from socketserver import ThreadingMixIn
from typing import Any
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

import grpc
from prometheus_client import CollectorRegistry, make_wsgi_app
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.registry import Collector
from prometheus_client.utils import floatToGoString

from index.errors import CannotListen
from sidecar.edge.interceptor import OK, Call, Hook
from sidecar.edge.lifecycle import Lifecycle, State
from sidecar.edge.limits import ConcurrencyLimit
from sidecar.edge.wire import EncodedResponse
from sidecar.gen import retrieval_pb2 as pb
from sidecar.snapshots.holder import SnapshotHolder
from sidecar.turn.engine import Engine, Timings
from sidecar.turn.prefetch import PREFETCH_MAX_BYTES

# The metrics endpoint's connections at once, and how long it waits on each read and write
# (``_BoundedServer``): a scraper opens one every 15-60 s and is answered in milliseconds.
METRICS_CONNECTIONS = 16
METRICS_TIMEOUT_S = 10.0
# Seconds. A turn's default budget is 150 ms and an embedding ~2-10 ms: the buckets are dense
# there, with a tail to show calls that waited on a slow remote embedder or a full queue.
LATENCY_BUCKETS = (
    0.001,
    0.0025,
    0.005,
    0.01,
    0.025,
    0.05,
    0.075,
    0.1,
    0.15,
    0.2,
    0.3,
    0.5,
    1.0,
    2.5,
    10.0,
)
# The codes that say a call was refused rather than failed: counted by reason as well.
REFUSALS = frozenset(
    {
        "INVALID_ARGUMENT",
        "NOT_FOUND",
        "UNAVAILABLE",
        "RESOURCE_EXHAUSTED",
        "UNAUTHENTICATED",
        "PERMISSION_DENIED",
    }
)

# QueryEmbedder.stats field -> the outcome label
_OUTCOMES = (
    ("hit", "hits"),
    ("miss", "misses"),
    ("joined", "joined"),
    ("late", "late"),
    ("busy", "busy"),
    ("failed", "failed"),
    ("dropped", "dropped"),
)


class Metrics(Hook):
    """The hook that measures calls, and the registry a scrape reads."""

    def __init__(
        self,
        engine: Engine,
        holder: SnapshotHolder,
        lifecycle: Lifecycle,
        limit: ConcurrencyLimit | None = None,
    ) -> None:
        self.registry = CollectorRegistry()
        self.rpcs = Counted(
            "voxrecall_rpcs",
            "Calls ended, by door (grpc, http), method and status code.",
            ("door", "method", "code"),
        )
        self.rpc_seconds = Histogram(
            "voxrecall_rpc_seconds",
            "Server-side duration of a call (a Converse stream: of the whole stream), by door.",
            ("door", "method"),
            LATENCY_BUCKETS,
        )
        self.stage_seconds = Histogram(
            "voxrecall_stage_seconds",
            "Per-stage latency each answer reports: embed, search, total (searched turns only "
            "for embed and search).",
            ("rpc", "stage"),
            LATENCY_BUCKETS,
        )
        self.refusals = Counted(
            "voxrecall_refusals", "Calls refused, by reason (the status code).", ("reason",)
        )
        for collector in (self.rpcs, self.rpc_seconds, self.stage_seconds, self.refusals):
            self.registry.register(collector)
        self.registry.register(_CountersAtScrape(engine, holder, lifecycle, limit))
        # each door's methods, by door then method: what their calls count, found once a call
        self._tallies: dict[str, dict[str, Tally]] = {}
        # the calls that end otherwise than OK (few), by door, method and code: counted apart
        self._failed: dict[tuple[str, str, grpc.StatusCode], tuple[Any, Any]] = {}
        self.rpcs.fold = self._ok_calls
        self.rpc_seconds.fold = self._call_seconds
        self.stage_seconds.fold = self._stage_seconds
        self._server: WSGIServer | None = None
        self._thread: threading.Thread | None = None

    # -- the hook -----------------------------------------------------------------------------

    reads_encoded = True  # a written answer's timings are read beside its bytes, never parsed

    def response(self, call: Call, message: Any) -> None:
        kind = type(message)  # generated message classes are never subclassed
        if kind is EncodedResponse:  # a Search's, a Turn's or a Converse answer, as bytes
            self._timings(call, message.timings, searched=message.searched)
            return
        if kind is pb.SearchResponse:
            self._timings(call, message.timings, searched=True)
            return
        if kind is pb.ConverseResponse:
            message, kind = message.turn, pb.TurnResponse
        if kind is pb.TurnResponse:
            self._timings(call, message.timings, searched=not message.skipped)

    def _timings(self, call: Call, timings: pb.Timings | Timings, *, searched: bool) -> None:
        tally: Tally = call.tally or self._tally(call)
        if searched:
            tally.stage(EMBED, timings.embed_ms / 1000.0)
            tally.stage(SEARCH, timings.search_ms / 1000.0)
        tally.stage(TOTAL, timings.total_ms / 1000.0)

    def end(self, call: Call) -> None:
        tally: Tally = call.tally or self._tally(call)
        seconds = call.elapsed_s()
        tally.seconds[bisect_left(LATENCY_BUCKETS, seconds)] += 1
        tally.seconds_sum += seconds
        if call.code is OK:
            tally.ok += 1
        else:
            self._failed_call(call)

    def _tally(self, call: Call) -> Tally:
        """The tally of the call's door and method, made at its first call; kept on the call."""
        by_method = self._tallies.get(call.door)
        if by_method is None:
            by_method = self._tallies[call.door] = {}
        tally = by_method.get(call.method)
        if tally is None:
            tally = by_method[call.method] = Tally(call.door, call.method)
        call.tally = tally
        return tally

    def _failed_call(self, call: Call) -> None:
        """A call ended otherwise than OK, counted by its code (and as a refusal, when it was
        one); the children looked up once per door, method and code."""
        key = (call.door, call.method, call.code)
        failed = self._failed.get(key)
        if failed is None:
            code = call.code.name
            refused = self.refusals.labels(code.lower()) if code in REFUSALS else None
            failed = self._failed[key] = (self.rpcs.labels(call.door, call.method, code), refused)
        calls, refusals = failed
        calls.inc()
        if refusals is not None:
            refusals.inc()

    # -- the tallies, folded into the families at scrape ---------------------------------------

    def _every_tally(self) -> list[Tally]:
        return [t for by_method in list(self._tallies.values()) for t in list(by_method.values())]

    def _ok_calls(self) -> Iterator[tuple[tuple[str, ...], float]]:
        for tally in self._every_tally():
            if tally.ok:
                yield (tally.door, tally.method, "OK"), float(tally.ok)

    def _call_seconds(self) -> Iterator[tuple[tuple[str, ...], list[int], float]]:
        for tally in self._every_tally():
            counts, total = list(tally.seconds), tally.seconds_sum
            if any(counts):
                yield (tally.door, tally.method), counts, total

    def _stage_seconds(self) -> Iterator[tuple[tuple[str, ...], list[int], float]]:
        """Each method's stages, summed over the doors it was answered by."""
        by_rpc: dict[str, list[tuple[list[int], float]]] = {}
        for tally in self._every_tally():
            stages, sums = list(tally.stages), list(tally.stage_sums)
            if not any(stages[TOTAL * _WIDTH : (TOTAL + 1) * _WIDTH]):
                continue  # no answer of this door's method reported its timings
            rows = by_rpc.setdefault(tally.method, [([0] * _WIDTH, 0.0) for _ in STAGES])
            for i in range(len(STAGES)):
                counts, total = rows[i]
                part = stages[i * _WIDTH : (i + 1) * _WIDTH]
                rows[i] = [a + b for a, b in zip(counts, part, strict=True)], total + sums[i]
        for rpc, rows in by_rpc.items():
            for stage, (counts, total) in zip(STAGES, rows, strict=True):
                yield (rpc, stage), counts, total

    # -- the endpoint -------------------------------------------------------------------------

    def serve(self, listen: str) -> int:
        """Serve ``/metrics`` on ``host:port`` from a daemon thread; returns the bound port."""
        host, _, port = listen.rpartition(":")
        try:
            server, thread = _serve(host.strip("[]"), int(port), make_wsgi_app(self.registry))
        except OSError as exc:
            raise CannotListen(
                listen, "[sidecar] metrics_listen", exc.strerror or str(exc)
            ) from exc
        self._server, self._thread = server, thread
        return int(server.server_port)

    def close(self) -> None:
        """Stop the endpoint (blocks until its thread ends: call it off the event loop)."""
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
        if self._thread is not None:
            self._thread.join()
        self._server = self._thread = None


class _BoundedServer(ThreadingMixIn, WSGIServer):
    """prometheus_client's threaded WSGI server (a thread a connection), with at most
    ``METRICS_CONNECTIONS`` connections served at once (one more is closed unread: a scraper
    tries again at its next interval) and ``METRICS_TIMEOUT_S`` for each read and write. Its own
    had neither: connections opened and left silent held a thread and a descriptor each for
    ever (741 in a minute), until the process had none for its calls."""

    daemon_threads = True

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self._slots = threading.BoundedSemaphore(METRICS_CONNECTIONS)
        super().__init__(*args, **kwargs)

    def process_request(self, request: Any, client_address: Any) -> None:
        if not self._slots.acquire(blocking=False):
            self.shutdown_request(request)
            return
        try:
            super().process_request(request, client_address)
        except BaseException:  # no thread started: its slot is free again
            self._slots.release()
            raise

    def process_request_thread(self, request: Any, client_address: Any) -> None:
        try:
            request.settimeout(METRICS_TIMEOUT_S)
            super().process_request_thread(request, client_address)
        finally:
            self._slots.release()

    def handle_error(self, request: Any, client_address: Any) -> None:
        if isinstance(sys.exc_info()[1], OSError):
            return  # a client gone, or silent past the timeout: socketserver printed a traceback
        super().handle_error(request, client_address)


class _Quiet(WSGIRequestHandler):
    def log_message(self, format: str, *args: Any) -> None:
        pass  # a line a scrape on stderr, as prometheus_client's own handler does not write


def _serve(host: str, port: int, app: Any) -> tuple[WSGIServer, threading.Thread]:
    """``app`` served on ``host:port`` from a daemon thread (``_BoundedServer``)."""
    family, _, _, _, address = socket.getaddrinfo(
        host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
    )[0]
    server_class = type("MetricsServer", (_BoundedServer,), {"address_family": family})
    server: WSGIServer = make_server(str(address[0]), port, app, server_class, handler_class=_Quiet)
    thread = threading.Thread(target=server.serve_forever, name="voxrecall-metrics", daemon=True)
    thread.start()
    return server, thread


class _Count:
    """One labelled counter: a float the event loop adds to."""

    __slots__ = ("value",)

    def __init__(self) -> None:
        self.value = 0.0

    def inc(self, amount: float = 1.0) -> None:
        self.value += amount


STAGES = ("embed", "search", "total")  # the ``stage`` label's values, in ``Tally.stages``' order
EMBED, SEARCH, TOTAL = range(len(STAGES))
_WIDTH = len(LATENCY_BUCKETS) + 1  # a histogram's buckets, +Inf's own last


class Tally:
    """What one door's method counts of its calls, in plain ints the event loop adds to and a
    scrape folds into the families (``Counted.fold``): the calls ended OK, every call's seconds
    (per bucket, not cumulative, and their sum), and the seconds each answer reports per stage
    (``STAGES``, one row of buckets each). One record a call touches, where a child per label
    set made six (a counter, two histograms' and three stages' buckets). Read by the scrape's
    thread as it stands (a list copied whole under the GIL; a sum may be one observation
    ahead of its counts)."""

    __slots__ = ("door", "method", "ok", "seconds", "seconds_sum", "stage_sums", "stages")

    def __init__(self, door: str, method: str) -> None:
        self.door = door
        self.method = method
        self.ok = 0
        self.seconds = [0] * _WIDTH
        self.seconds_sum = 0.0
        self.stages = [0] * (_WIDTH * len(STAGES))
        self.stage_sums = [0.0] * len(STAGES)

    def stage(self, stage: int, seconds: float) -> None:
        self.stages[stage * _WIDTH + bisect_left(LATENCY_BUCKETS, seconds)] += 1
        self.stage_sums[stage] += seconds


class Counted(Collector):
    """A counter for the hot path: prometheus_client's ``Counter`` takes a lock on every ``inc``
    (and ``Histogram`` one per bucket and one for the sum: ~4 us an observation, five a
    ``Search``); these are written from the event loop alone and read by the scrape's thread
    as they stand (a list or a float read whole under the GIL; a scrape may see a sum one
    observation ahead of the counts)."""

    def __init__(self, name: str, documentation: str, labelnames: Sequence[str]) -> None:
        self.name = name
        self.documentation = documentation
        self.labelnames = tuple(labelnames)
        self._children: dict[tuple[str, ...], Any] = {}
        # more samples, read at scrape from where the hot path counts them (``Tally``)
        self.fold: Callable[[], Iterator[Any]] = _nothing

    def labels(self, *values: str) -> Any:
        child = self._children.get(values)
        if child is None:
            child = self._children[values] = self._child()
        return child

    def _child(self) -> Any:
        return _Count()

    def describe(self) -> Iterator[Metric]:
        return iter(())  # the names are fixed; a scrape of an unused one yields nothing

    def collect(self) -> Iterator[Metric]:
        family = CounterMetricFamily(self.name, self.documentation, labels=self.labelnames)
        for values, child in list(self._children.items()):
            family.add_metric(list(values), child.value)
        for values, value in self.fold():
            family.add_metric(list(values), value)
        yield family


class Histogram(Counted):
    """A histogram for the hot path, read only from where the hot path counts (``fold``, each
    ``Tally``'s per-bucket counts): it has no labelled children of its own."""

    def __init__(
        self, name: str, documentation: str, labelnames: Sequence[str], buckets: Sequence[float]
    ) -> None:
        super().__init__(name, documentation, labelnames)
        self.buckets = tuple(buckets)

    def labels(self, *values: str) -> Any:
        """None to count into: an observation goes through a ``Tally`` (``fold`` exports it), and
        a child counted here would never be exported."""
        raise TypeError(f"{self.name} has no labelled children: count through a Tally")

    def collect(self) -> Iterator[Metric]:
        family = HistogramMetricFamily(self.name, self.documentation, labels=self.labelnames)
        for values, counts, total in self.fold():
            family.add_metric(list(values), self._cumulative(counts), sum_value=total)
        yield family

    def _cumulative(self, counts: Sequence[int]) -> list[tuple[str, float]]:
        """Per-bucket ``counts`` (copied whole first) as Prometheus' cumulative buckets."""
        cumulative: list[tuple[str, float]] = []
        running = 0
        bounds = (*map(floatToGoString, self.buckets), "+Inf")
        for bound, count in zip(bounds, list(counts), strict=True):
            running += count
            cumulative.append((bound, running))
        return cumulative


def _nothing() -> Iterator[Any]:
    return iter(())


class _CountersAtScrape(Collector):
    """What the parts already count, read at scrape time (from the endpoint's thread: every
    read is of one int or a copied dict, each atomic under the GIL)."""

    def __init__(
        self,
        engine: Engine,
        holder: SnapshotHolder,
        lifecycle: Lifecycle,
        limit: ConcurrencyLimit | None,
    ) -> None:
        self.engine = engine
        self.holder = holder
        self.lifecycle = lifecycle
        self.limit = limit

    def collect(self) -> Iterator[Metric]:
        counters = self.engine.counters
        yield CounterMetricFamily(
            "voxrecall_turns", "Turns received (Turn and Converse).", counters.turns
        )
        skips = CounterMetricFamily(
            "voxrecall_skips", "Turns not searched, by reason.", labels=["reason"]
        )
        for reason, n in sorted(dict(counters.by_skip).items()):  # a copy: the loop writes it
            skips.add_metric([reason.lower()], n)
        yield skips
        yield CounterMetricFamily(
            "voxrecall_degraded_turns",
            "Turns the lexical index answered because the embedder missed the budget or failed.",
            counters.degraded,
        )
        yield CounterMetricFamily(
            "voxrecall_graph_search_failures",
            "Searches a loaded graph could not answer (answered lexically, degraded; a search "
            "by a vector alone fails INTERNAL); the log names the snapshot once.",
            counters.graph_failures,
        )
        yield CounterMetricFamily(
            "voxrecall_prefetched_turns",
            "Turns answered from a search started on an interim transcript.",
            counters.prefetched,
        )
        yield CounterMetricFamily(
            "voxrecall_prefetches_started",
            "Searches started ahead on a stable interim transcript (prefetched turns over these: "
            "how often the final took what was searched ahead).",
            counters.prefetch_started,
        )
        yield CounterMetricFamily(
            "voxrecall_prefetches_deferred",
            "Interims ending in a pause held back because their stream started a prefetch less "
            "than prefetch_stable_ms before (most are replaced by a newer interim meanwhile).",
            counters.prefetch_deferred,
        )
        yield CounterMetricFamily(
            "voxrecall_prefetches_too_long",
            f"Interim transcripts over {PREFETCH_MAX_BYTES} bytes, never searched ahead (their "
            "finals are searched as usual).",
            counters.prefetch_too_long,
        )
        yield CounterMetricFamily(
            "voxrecall_prefetches_refused",
            "Interim transcripts whose plan was refused (a filter the base has no index for, an "
            "unknown source): never searched ahead; the log says it once per stream, the final "
            "reports the error.",
            counters.prefetch_refused,
        )
        yield from self._embeddings()
        sessions = self.engine.sessions  # two ints: no expiry from this thread
        yield GaugeMetricFamily("voxrecall_sessions", "Sessions held.", sessions.count)
        yield GaugeMetricFamily(
            "voxrecall_session_bytes",
            "Bytes the sessions keep, as accounted (open MCP sessions included).",
            sessions.bytes,
        )
        if self.limit is not None:
            yield GaugeMetricFamily(
                "voxrecall_rpcs_in_flight",
                "Calls in flight (health excepted).",
                self.limit.in_flight,
            )
            yield CounterMetricFamily(
                "voxrecall_connections_closed_unread",
                "gRPC connections closed because their clients read none of their answers "
                "(held past stream_idle_s) or held unread health checks a new address needed.",
                self.limit.hangups.hung_up,
            )
        state = GaugeMetricFamily(
            "voxrecall_state", "The lifecycle state: 1 for the current one.", labels=["state"]
        )
        for s in State:
            state.add_metric([s.name.lower()], 1.0 if self.lifecycle.state is s else 0.0)
        yield state
        yield from self._snapshots()

    def _embeddings(self) -> Iterator[Metric]:
        stats = self.engine.vectors.stats
        outcomes = CounterMetricFamily(
            "voxrecall_query_embeddings",
            "Query vectors asked for, by outcome: hit (cache), miss, joined (a call in flight), "
            "late (missed the deadline), busy (not submitted), failed, dropped (asked ahead of a "
            "turn and never embedded: the queue behind the final turns was full or out of time).",
            labels=["outcome"],
        )
        for label, field in _OUTCOMES:
            outcomes.add_metric([label], getattr(stats, field))
        yield outcomes
        looked_up = stats.hits + stats.misses
        yield GaugeMetricFamily(
            "voxrecall_query_cache_hit_ratio",
            "Share of query vectors answered from the cache since start (0 before any).",
            stats.hits / looked_up if looked_up else 0.0,
        )

    def _snapshots(self) -> Iterator[Metric]:
        now = time.time()
        info = GaugeMetricFamily(
            "voxrecall_snapshot_info",
            "The snapshot version served, per base.",
            labels=["knowledge_base", "version"],
        )
        age = GaugeMetricFamily(
            "voxrecall_snapshot_age_seconds",
            "Since the served snapshot was built.",
            labels=["knowledge_base"],
        )
        chunks = GaugeMetricFamily(
            "voxrecall_snapshot_chunks", "Chunks in the served snapshot.", labels=["knowledge_base"]
        )
        loaded = GaugeMetricFamily(
            "voxrecall_snapshot_loaded",
            "1 when the base has a snapshot to serve.",
            labels=["knowledge_base"],
        )
        for kb in sorted(self.engine.known_bases):
            snap = self.holder.get(kb)
            loaded.add_metric([kb], 0.0 if snap is None else 1.0)
            if snap is None:
                continue
            info.add_metric([kb, snap.version], 1.0)
            age.add_metric([kb], max(0.0, now - snap.manifest.created_at))
            chunks.add_metric([kb], float(len(snap.chunks)))
        yield from (info, age, chunks, loaded)
        refusals = CounterMetricFamily(
            "voxrecall_snapshot_refusals",
            "Snapshot versions refused (or a store that could not be read), by kind.",
            labels=["kind"],
        )
        for kind, n in sorted(dict(self.holder.refusals).items()):
            refusals.add_metric([kind], n)
        yield refusals
