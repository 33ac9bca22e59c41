"""What stands between a call and the service: logs, metrics, auth, the concurrency limit.

    guards = Guards.build(config, engine, holder, lifecycle)
    server = grpc.aio.server(interceptors=guards.interceptors, options=guards.options)

The order matters: the log context first (every later line carries the call's ids), metrics
next (they see every refusal), the drain gate, then auth (an unauthenticated call never takes a
slot), then the limit.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import grpc

from index.config import Config
from sidecar.auth import Authenticator
from sidecar.engine import Engine
from sidecar.holder import SnapshotHolder
from sidecar.interceptor import Hook, HookInterceptor
from sidecar.lifecycle import Lifecycle
from sidecar.limits import ConcurrencyLimit, DrainGate
from sidecar.logs import CallLog
from sidecar.metrics import Metrics


@dataclass(frozen=True, slots=True)
class Guards:
    limit: ConcurrencyLimit
    metrics: Metrics
    auth: Authenticator | None
    interceptors: tuple[grpc.aio.ServerInterceptor, ...]  # type: ignore[type-arg]
    options: tuple[tuple[str, Any], ...]

    @classmethod
    def build(
        cls, config: Config, engine: Engine, holder: SnapshotHolder, lifecycle: Lifecycle
    ) -> Guards:
        sc = config.sidecar
        limit = ConcurrencyLimit(sc.max_concurrent_rpcs)
        metrics = Metrics(engine, holder, lifecycle, limit)
        auth = (
            Authenticator(
                sc.auth,
                default_knowledge_base=engine.default_knowledge_base,
                functions={fn.name: fn.knowledge_base for fn in config.functions},
            )
            if sc.auth.enabled
            else None
        )
        hooks: list[Hook] = [
            CallLog(),
            metrics,
            DrainGate(lifecycle),
            *([auth] if auth else []),
            limit,
        ]
        options = (
            ("grpc.max_receive_message_length", sc.max_message_bytes),
            ("grpc.max_send_message_length", sc.max_message_bytes),
        )
        return cls(limit, metrics, auth, (HookInterceptor(hooks),), options)
