"""What stands between a call and the service: logs, metrics, auth, the concurrency limit.

    guards = Guards.build(config, engine, holder, lifecycle)
    server = grpc.aio.server(interceptors=guards.interceptors, options=guards.options)

The HTTP door runs the same ``hooks`` around its calls. The order matters: the log context
first (every later line carries the call's ids), metrics next (they see every refusal), then auth
(an unauthenticated call never takes a slot), the drain gate, the limit, then the field sizes
(checked on each request message before any work). An HTTP call reads its body between auth and
the drain gate (``body_at``): a stranger's body is never read, and a slow body holds no slot.

The server pings a connection that has been quiet for ``KEEPALIVE_S`` and closes it when no
answer comes within ``KEEPALIVE_TIMEOUT_S``: a caller that vanished (a pod killed, a network
cut without a FIN) gives its streams' slots back then rather than never. A connection with no
call open for ``[sidecar] max_connection_idle_s`` is closed (GOAWAY): connections opened and
left idle, each holding a file descriptor, cannot pile up until the process has none left. A
connection that has not finished its handshake within ``HANDSHAKE_TIMEOUT_S`` of its accept is
closed (its slot of ``max_grpc_connections`` with it). One connection may have at most
``streams_per_connection`` streams open (HTTP/2's
SETTINGS_MAX_CONCURRENT_STREAMS): all one caller may run at once (answers it leaves unread keep
their streams open besides); a gRPC client queues its further calls until one ends, and a stream
a client opens past it anyway is refused (REFUSED_STREAM) before the server holds anything for
it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import grpc

from sidecar.config import Config, SidecarConfig
from sidecar.edge.auth import Authenticator
from sidecar.edge.health import MAX_CHECKS_PER_PEER, MAX_WATCHES_PER_PEER
from sidecar.edge.interceptor import Hook, HookInterceptor
from sidecar.edge.lifecycle import Lifecycle
from sidecar.edge.limits import REFLECTION_STREAMS, ConcurrencyLimit, DrainGate, FieldLimits
from sidecar.edge.logs import CallLog
from sidecar.edge.metrics import Metrics
from sidecar.snapshots.holder import SnapshotHolder
from sidecar.turn.engine import Engine

# A dead peer is found within KEEPALIVE_S + KEEPALIVE_TIMEOUT_S; pings that often cost nothing.
KEEPALIVE_S = 30
KEEPALIVE_TIMEOUT_S = 10
# A connection must finish its handshake (TLS, then HTTP/2's preface and SETTINGS) this soon
# after its accept, or it is closed: gRPC's default, 120 s, let 1,024 silent connections hold
# every slot of max_grpc_connections for two minutes at a time. The HTTP door's is the same
# (sidecar.http.door.TLS_HANDSHAKE_TIMEOUT_S).
HANDSHAKE_TIMEOUT_S = 5.0
# Clients may ping this often (grpc's default refuses pings more often than every 5 minutes
# without data, closing the connection of a client that keeps its channel warm).
CLIENT_PING_MIN_S = 10


def streams_per_connection(settings: SidecarConfig) -> int:
    """The streams one connection may have open at once: every slot one caller may run in (the
    unary calls and Converse streams of the whole sidecar, reflection's, and the health checks
    and watches of one address), so an agent running them all on one channel is never held
    back by it. A caller's calls whose answers gRPC still holds are counted apart, up to its
    share again (``Pool.hold``), and not here: a call's stream is closed for its client once
    the status is in, before gRPC is done with the call, so only answers left unread keep
    theirs open, and a client past the cap with those waits on its connection until it reads
    them (more streams would only let one connection hold more unread answers). Without it,
    20,000 calls sent at once on one connection held ~54 MiB of the server while they waited in
    it."""
    held = settings.max_concurrent_rpcs + settings.max_streams + REFLECTION_STREAMS
    return held + MAX_CHECKS_PER_PEER + MAX_WATCHES_PER_PEER


@dataclass(frozen=True, slots=True)
class Guards:
    limit: ConcurrencyLimit
    metrics: Metrics
    auth: Authenticator | None
    interceptors: tuple[grpc.aio.ServerInterceptor, ...]  # type: ignore[type-arg]
    options: tuple[tuple[str, Any], ...]
    hooks: tuple[Hook, ...] = ()  # the same hooks, for the HTTP door (sidecar.http.door)
    body_at: int = 0  # the position of the first hook an HTTP call runs once its body is in

    @classmethod
    def build(
        cls, config: Config, engine: Engine, holder: SnapshotHolder, lifecycle: Lifecycle
    ) -> Guards:
        settings = config.sidecar
        limit = ConcurrencyLimit(
            settings.max_concurrent_rpcs,
            settings.max_streams,
            {c.name: (c.max_concurrent_rpcs, c.max_streams) for c in settings.auth.callers},
            unread_s=settings.stream_idle_s,
        )
        metrics = Metrics(engine, holder, lifecycle, limit)
        auth = (
            Authenticator(
                settings.auth,
                default_knowledge_base=engine.default_knowledge_base,
                functions={fn.name: fn.knowledge_base for fn in config.functions},
            )
            if settings.auth.enabled
            else None
        )
        headers: list[Hook] = [CallLog(), metrics, *([auth] if auth else [])]
        hooks = [*headers, DrainGate(lifecycle), limit, FieldLimits()]
        options = (
            ("grpc.max_receive_message_length", settings.max_message_bytes),
            ("grpc.max_send_message_length", settings.max_message_bytes),
            ("grpc.keepalive_time_ms", KEEPALIVE_S * 1000),
            ("grpc.keepalive_timeout_ms", KEEPALIVE_TIMEOUT_S * 1000),
            ("grpc.keepalive_permit_without_calls", 1),
            ("grpc.http2.min_ping_interval_without_data_ms", CLIENT_PING_MIN_S * 1000),
            ("grpc.max_connection_idle_ms", round(settings.max_connection_idle_s * 1000)),
            ("grpc.max_allowed_incoming_connections", settings.max_grpc_connections),
            ("grpc.server_handshake_timeout_ms", round(HANDSHAKE_TIMEOUT_S * 1000)),
            ("grpc.max_concurrent_streams", streams_per_connection(settings)),
            # count a stream open until HTTP/2 closes it, as its client does: gRPC's default
            # also counts a stream the server has answered until the handler's objects are
            # freed, and refuses a call the client sent within the limit (UNAVAILABLE)
            ("grpc.http.overload_protection", 0),
        )
        interceptors = (HookInterceptor(hooks),)
        return cls(limit, metrics, auth, interceptors, options, tuple(hooks), len(headers))
