"""Building and running the sidecar: ``create_server`` (tests bind port 0) apart from ``serve``."""

from __future__ import annotations

import asyncio
import logging
import resource
import signal
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from index.embedders import Embedder
from index.embedders.factory import make_embedder
from index.errors import SnapshotError
from index.store import SnapshotStore, is_url, open_store
from sidecar.config import Config
from sidecar.edge import logs, reflection, tls
from sidecar.edge.guards import Guards
from sidecar.edge.health import Health
from sidecar.edge.lifecycle import Lifecycle, State
from sidecar.edge.service import RetrievalService
from sidecar.edge.wire import passing_through
from sidecar.functions.tools import Toolbox
from sidecar.gen import retrieval_pb2 as pb
from sidecar.gen import retrieval_pb2_grpc as pb_grpc
from sidecar.shards import in_shard
from sidecar.snapshots.holder import SnapshotHolder
from sidecar.snapshots.refresh import Refresher
from sidecar.turn.engine import BasePolicy, Engine
from sidecar.turn.rerank import Reranker
from sidecar.turn.sessions import SessionStore
from sidecar.turn.skip import SkipPolicy

if TYPE_CHECKING:  # imported when [sidecar.http] is on: the MCP SDK takes ~1.5 s to import
    from sidecar.http.door import HttpDoor

log = logging.getLogger("voxrecall.server")

SERVICE_NAME = pb.DESCRIPTOR.services_by_name["Retrieval"].full_name
# After the grace period, the calls still in flight are cut off with UNAVAILABLE; this long is
# left for them to send that status before the server closes their connections.
CUT_OFF_WAIT_S = 1.0


# The most bases one sidecar serves from its store's listing (a config that names none): far
# past what one replica holds (tests/test_many_bases.py serves 1,000 under a budget), and a bound
# on what a store listing new names at every poll can make it keep (each base: its name, its
# entry in the engine, the refresher and the metrics, about 1 KiB).
MAX_LISTED_BASES = 10_000

# The methods whose handlers answer a response's bytes (sidecar/edge/wire.py).
SENDS_BYTES = ("Search", "Turn", "Converse")


class _SendsBytes:
    """The server as the generated registration sees it: the same method handlers, registered
    both ways it registers them, with the serializers of ``SENDS_BYTES`` sending the bytes the
    handler wrote (sidecar/edge/wire.py) as they are. The generated code stays as generated."""

    def __init__(self, server: grpc.aio.Server) -> None:
        self.server = server

    def add_generic_rpc_handlers(self, handlers: Any) -> None:
        """Nothing: ``add_registered_method_handlers`` comes next with the same table."""

    def add_registered_method_handlers(self, service: str, handlers: dict[str, Any]) -> None:
        handlers = {**handlers, **{m: passing_through(handlers[m]) for m in SENDS_BYTES}}
        generic = grpc.method_handlers_generic_handler(service, handlers)
        self.server.add_generic_rpc_handlers((generic,))
        self.server.add_registered_method_handlers(service, handlers)  # type: ignore[attr-defined]


@dataclass
class Sidecar:
    """A built, started sidecar. ``stop`` drains it."""

    server: grpc.aio.Server
    port: int
    config: Config
    engine: Engine
    holder: SnapshotHolder
    lifecycle: Lifecycle
    health: Health
    refresher: Refresher
    owns_embedder: bool = True
    guards: Guards | None = None
    metrics_port: int = 0  # 0: no metrics endpoint
    http: HttpDoor | None = None  # [sidecar.http]: MCP, webhooks and health over HTTP
    http_port: int = 0  # 0: no HTTP door
    _tasks: list[asyncio.Task[None]] = field(default_factory=list)
    over_cap_logged: bool = False  # a listing was cut to MAX_LISTED_BASES and said so, once
    _listing_failed: str = ""  # the last reason listing the store failed, logged once

    async def update_health(self) -> None:
        # with a memory budget, bases load on their first call: the sidecar serves from the start
        lazy = self.engine.load_on_demand is not None
        ready = lazy or not self.holder.waiting(self.engine.known_bases)
        if self.lifecycle.state is State.DRAINING:
            return
        if ready and (self.engine.known_bases or nothing_to_wait_for(self.config)):
            if self.lifecycle.state is State.LOADING:
                log.info("SERVING: %s", self._ready_because(lazy))
            self.lifecycle.state = State.SERVING
        status = (
            health_pb2.HealthCheckResponse.SERVING
            if self.lifecycle.state is State.SERVING
            else health_pb2.HealthCheckResponse.NOT_SERVING
        )
        for name in ("", SERVICE_NAME):
            await self.health.set(name, status)

    def _ready_because(self, lazy: bool) -> str:
        if not self.engine.known_bases:
            return "no knowledge base to load yet"
        return "bases load on their first call" if lazy else "every knowledge base has a snapshot"

    async def add_listed_bases(self) -> None:
        """For a config that names no base: list the store again, forget the bases gone from it
        (those not loaded), and serve the bases published there since (of this replica's
        shard), within ``MAX_LISTED_BASES`` (``_within_listed_cap``); the next refresh loads them (with
        a memory budget, their first call). A listing that fails is logged once per reason,
        and what is served goes on."""
        try:
            listed = await asyncio.to_thread(
                knowledge_base_names, self.config, self.refresher.store
            )
        except (SnapshotError, OSError) as exc:
            if str(exc) != self._listing_failed:
                log.warning("could not list the bases in the store again: %s", exc)
            self._listing_failed = str(exc)
            return
        self._listing_failed = ""
        self._forget_gone(listed)
        new = await self._within_listed_cap(listed)
        if new:
            self.engine.known_bases = self.engine.known_bases | frozenset(new)
            self.refresher.add_bases(new)
            log.info(
                "serving new bases of the store: %s", ", ".join(new[:20]) + _more(len(new), 20)
            )

    def _forget_gone(self, listed: frozenset[str]) -> None:
        """Forget the bases the store no longer lists and that are not loaded: 10,000 folders
        made then deleted kept the cap full until a restart. A loaded one serves on (a base
        deleted from the store serves its last snapshot until a restart)."""
        gone = frozenset(
            kb for kb in self.engine.known_bases - listed if self.holder.get(kb) is None
        )
        if gone:
            self.engine.known_bases = self.engine.known_bases - gone
            self.refresher.remove_bases(gone)
            log.info("forgot %d bases gone from the store", len(gone))

    async def _within_listed_cap(self, listed: frozenset[str]) -> list[str]:
        """The bases of ``listed`` not known yet, by name, the first that keep this sidecar
        within ``MAX_LISTED_BASES`` bases with something published (a base whose pointer read
        found no LATEST does not count: ``SnapshotHolder.unpublished``) and twice that in all;
        the rest logged once (``listed_within_cap``). The set and sort work over a listing (a
        folder's is up to ``MAX_LISTED_ENTRIES`` names) runs off the event loop."""
        known = self.engine.known_bases
        published = len(known - self.holder.unpublished)
        room = min(MAX_LISTED_BASES - published, 2 * MAX_LISTED_BASES - len(known))
        warn = not self.over_cap_logged
        new, cut = await asyncio.to_thread(_new_within_cap, listed, known, room, warn)
        self.over_cap_logged |= cut
        return new

    def log_waiting(self) -> None:
        """While LOADING, say which bases have no snapshot, where it is looked for, and what to
        run to make one."""
        missing = self.holder.waiting(self.engine.known_bases)
        if missing and self.engine.load_on_demand is None:
            log.warning("LOADING: %s", waiting_for(self.config, missing))

    async def _cut_off(self, grace: float) -> None:
        """End the calls that outlived the grace period with UNAVAILABLE (with a log line each
        and one here), so a client retries them elsewhere rather than seeing CANCELLED."""
        assert self.guards is not None
        cut = self.guards.limit.cut_off(
            f"the sidecar shut down before this call ended (grace_s {grace:g}): "
            "retry on another instance"
        )
        log.warning("grace period over: %d call(s) in flight ended UNAVAILABLE", cut)
        await self.guards.limit.wait_idle(asyncio.get_running_loop().time() + CUT_OFF_WAIT_S)

    async def stop(self, grace_s: float | None = None) -> None:
        """Refuse new calls, let calls in flight finish within the grace period, then stop.

        Until the calls in flight are done the server keeps its port, so a new call gets a clear
        UNAVAILABLE from the lifecycle rather than whatever a closing transport answers."""
        grace = self.config.sidecar.grace_s if grace_s is None else grace_s
        deadline = asyncio.get_running_loop().time() + grace
        self.lifecycle.state = State.DRAINING
        await self.health.enter_graceful_shutdown()
        self.refresher.close()  # a download waiting out a retry gives up; the heap is unfrozen
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        if self.guards is not None and not await self.guards.limit.wait_idle(deadline):
            await self._cut_off(grace)
        if self.http is not None:
            await self.http.stop()
        await self.server.stop(max(0.0, deadline - asyncio.get_running_loop().time()))
        if self.guards is not None:
            self.guards.limit.close()
        await self.engine.aclose()  # query embeddings still running in the background
        self.holder.clear()
        if self.owns_embedder:
            await self.engine.embedder.aclose()
        if self.guards is not None:
            await asyncio.to_thread(self.guards.metrics.close)


def waiting_for(config: Config, missing: list[str]) -> str:
    """``waiting for a snapshot of 'help' in var/store (checked every 2 s): run `voxrecall index
    build --config voxrecall.toml` to build one``; for a remote store, the build then the
    publish to it."""
    where = str(config.sidecar.store)
    return (
        f"waiting for a snapshot of {', '.join(map(repr, missing[:20]))}"
        f"{_more(len(missing), 20)} in {where} "
        f"(checked every {config.sidecar.poll_seconds:g} s): {to_make_one(config)}"
    )


def to_make_one(config: Config) -> str:
    """What to run to put a snapshot where this sidecar reads: a remote store (s3://, http(s))
    is written by ``voxrecall index publish``, a folder by the build itself."""
    flag = f" --config {config.path}" if config.path else ""
    where = str(config.sidecar.store)
    if where.startswith("s3://"):
        return (
            f"run `voxrecall index build{flag}`, then `voxrecall index publish{flag} --to "
            f"{where}` to publish it there"
        )
    if is_url(where):
        return (
            f"run `voxrecall index build{flag}`, then `voxrecall index publish{flag} --to "
            f"FOLDER` into the folder {where} serves"
        )
    built_into = str(config.index.store)
    into = "" if built_into == where else f" (it publishes to {built_into})"
    return f"run `voxrecall index build{flag}` to build one{into}"


def sidecar_store(config: Config) -> SnapshotStore:
    """The store ``[sidecar] store`` names, with the ``[sidecar]`` download limits."""
    return open_store(
        config.sidecar.store,
        cache_dir=config.sidecar.cache_dir,
        timeout_s=config.sidecar.http_timeout_s,
        download_timeout_s=config.sidecar.http_download_timeout_s,
        version_timeout_s=config.sidecar.http_version_timeout_s,
        s3_endpoint_url=config.sidecar.s3_endpoint_url,
        s3_region=config.sidecar.s3_region,
        max_listed=listed_names_read(config),
    )


def listed_names_read(config: Config) -> int:
    """The names of a store's listing a sidecar reads at most (an s3:// listing stops there,
    the first by name): all its shard may serve, ``MAX_LISTED_BASES`` with something published
    and as many more with nothing yet (``_within_listed_cap``), from a listing spread over
    ``shards``."""
    return 2 * MAX_LISTED_BASES * config.sidecar.shards


def base_policies(config: Config) -> dict[str, BasePolicy]:
    """Each configured base's fallback, instructions and rerank stage (one policy for Turn,
    Search and the knowledge tools)."""
    return {
        kb.name: BasePolicy(
            fallback=kb.fallback,
            instructions=kb.instructions,
            reranker=Reranker(kb.rerank) if kb.rerank is not None else None,
        )
        for kb in config.knowledge_bases
    }


def knowledge_base_names(config: Config, store: SnapshotStore) -> frozenset[str]:
    """The configured bases, or, for a config that names none, those in the store now;
    with ``[sidecar] shards`` > 1, only those of this replica's shard (sidecar/shards.py)."""
    if config.knowledge_bases:
        names = frozenset(kb.name for kb in config.knowledge_bases)
    else:
        names = store.knowledge_bases()
    settings = config.sidecar
    return names if settings.shards == 1 else in_shard(names, settings.shard, settings.shards)


def lists_store(config: Config) -> bool:
    """Whether this sidecar serves the bases its store lists (its config names none), the
    store being one that can be listed (a folder or s3://; a static http(s) server cannot)."""
    store = config.sidecar.store
    return not config.knowledge_bases and not is_url(store)


def nothing_to_wait_for(config: Config) -> bool:
    """Whether a sidecar with no base is SERVING (nothing to load): its shard has none of the
    configured bases, or none of its store's yet (picked up at the polls); not a config that
    names none over a store that cannot be listed, which can never serve anything."""
    return bool(config.knowledge_bases) or lists_store(config)


def no_bases(config: Config, store: SnapshotStore) -> str:
    """What is true of a sidecar that starts with no base to serve, and what to do."""
    settings = config.sidecar
    shard = f" of shard {settings.shard} of {settings.shards}" if settings.shards > 1 else ""
    if config.knowledge_bases:
        return f"none of the bases [[knowledge_base]] names is{shard}: this replica serves none"
    if not lists_store(config):
        return (
            f"no knowledge base to serve: {store!r} cannot be listed: name them with "
            "[[knowledge_base]]"
        )
    return (
        f"no knowledge base{shard} in {store!r} yet: SERVING none; the store is listed again "
        f"every {settings.poll_seconds:g} s and a base published there is served from that poll"
    )


def starting_bases(config: Config, store: SnapshotStore) -> tuple[frozenset[str], bool]:
    """The bases a sidecar starts with (``knowledge_base_names`` within ``first_bases``), and
    whether the listing was cut to the cap."""
    return first_bases(config, store, knowledge_base_names(config, store))


def first_bases(
    config: Config, store: SnapshotStore, names: frozenset[str]
) -> tuple[frozenset[str], bool]:
    """The bases a sidecar starts with: ``names``, the first ``MAX_LISTED_BASES`` of a listing
    that holds more (logged: the polls then say it no more, ``Sidecar.over_cap_logged``), and
    whether it held more; a start with none logs what is true of it (``no_bases``)."""
    if not names:
        log.warning("%s", no_bases(config, store))
    elif lists_store(config):
        kept, cut = listed_within_cap(names, MAX_LISTED_BASES, len(names))
        return frozenset(kept), cut
    return names, False


def _new_within_cap(
    listed: frozenset[str], known: frozenset[str], room: int, warn: bool
) -> tuple[list[str], bool]:
    """The names of ``listed`` not in ``known`` within ``room`` (``listed_within_cap``), by
    name, and whether some were left out (a worker thread's work: a listing may be long)."""
    return listed_within_cap(listed - known, room, len(listed), warn=warn)


def listed_within_cap(
    new: frozenset[str], room: int, listed: int, warn: bool = True
) -> tuple[list[str], bool]:
    """The first ``room`` of ``new`` by name, and whether some were left out (cut); with
    ``warn``, a cut is logged with the ``listed`` count of the store's listing."""
    room = max(room, 0)
    if len(new) <= room:
        return sorted(new), False
    if warn:
        log.warning(
            "the store lists %d bases, more bases than one sidecar serves (%d): the first by "
            "name are served, %d left out; split them over shards ([sidecar] shards)",
            listed,
            MAX_LISTED_BASES,
            len(new) - room,
        )
    return sorted(new)[:room], True


def _more(count: int, shown: int) -> str:
    return f" and {count - shown} more" if count > shown else ""


async def create_server(
    config: Config,
    *,
    embedder: Embedder | None = None,
    listen: str | None = None,
    poll: bool = True,
    store: SnapshotStore | None = None,
    listen_while_loading: bool = True,
) -> Sidecar:
    """Build the service, load what the store has, bind, and start. The port may be 0.

    ``store`` replaces the one ``[sidecar] store`` names (tests inject faults through it).
    ``listen_while_loading``: bind and answer health (NOT_SERVING) while the snapshots load; a
    later worker of ``workers`` > 1 binds only once loaded, as the kernel would otherwise hand
    it connections whose calls it can only refuse while the first worker answers health.
    """
    logs.quiet_loop_errors()
    owns_embedder = embedder is None
    if embedder is None:
        embedder = await asyncio.to_thread(make_embedder, config.embedder)
    if store is None:  # an s3:// store reads the AWS configuration files: off the loop
        store = await asyncio.to_thread(sidecar_store, config)
    # listing a remote store (s3://) is a request, and a long listing is cut by name: off the loop
    names, over_cap = await asyncio.to_thread(starting_bases, config, store)
    holder = SnapshotHolder()
    lifecycle = Lifecycle()
    policies = base_policies(config)
    engine = _engine(config, embedder, holder, names, policies)
    guards = Guards.build(config, engine, holder, lifecycle)
    toolbox = Toolbox.from_config(config, policies)
    server = _grpc_server(config, guards, RetrievalService(engine, holder, lifecycle, toolbox))
    hangups = guards.limit.hangups  # the limits' and health's: one scan at a time
    health = Health(hangups)
    health_pb2_grpc.add_HealthServicer_to_server(health, server)
    refresher = _refresher(config, store, holder, embedder, names)
    if refresher.budget_bytes:  # bases load on their first call, under the budget
        engine.load_on_demand = refresher.want
    if not listen_while_loading:
        await refresher.refresh()
    port = tls.add_port(server, listen or config.sidecar.listen, config.sidecar.tls)
    hangups.ports = frozenset({port})
    sidecar = Sidecar(
        server,
        port,
        config,
        engine,
        holder,
        lifecycle,
        health,
        refresher,
        owns_embedder,
        guards,
        over_cap_logged=over_cap,  # said once, at the start
    )
    if config.sidecar.http.enabled:
        from sidecar.http.door import HttpDoor

        sidecar.http = HttpDoor(config, engine, lifecycle, guards, toolbox)
        sidecar.http_port = sidecar.http.bind(config.sidecar.http.listen)
    if config.sidecar.metrics_listen:
        sidecar.metrics_port = guards.metrics.serve(config.sidecar.metrics_listen)
    refresher.on_change = sidecar.update_health
    await sidecar.update_health()
    await server.start()
    if sidecar.http is not None:
        await sidecar.http.start()
    if listen_while_loading:
        await refresher.refresh()
    sidecar.log_waiting()
    if poll:
        relist = sidecar.add_listed_bases if lists_store(config) else None
        sidecar._tasks.append(
            asyncio.create_task(refresher.poll_forever(config.sidecar.poll_seconds, relist))
        )
    return sidecar


def _engine(
    config: Config,
    embedder: Embedder,
    holder: SnapshotHolder,
    names: frozenset[str],
    policies: Mapping[str, BasePolicy],
) -> Engine:
    """The turn engine over its sessions, with the config's policies and skip rules."""
    settings = config.sidecar
    sessions = SessionStore(
        max_sessions=settings.max_sessions,
        ttl_s=settings.session_ttl_s,
        context_turns=settings.context_turns,
        max_session_bytes=settings.max_session_bytes,
        max_bytes=settings.session_memory_bytes,
        quotas={c.name: (c.max_sessions, c.session_memory_bytes) for c in settings.auth.callers},
    )
    return Engine(
        settings,
        embedder,
        holder,
        names,
        sessions,
        skip_policy=SkipPolicy.from_config(settings.skip),
        hybrid_bases=frozenset(kb.name for kb in config.knowledge_bases if kb.hybrid),
        default_knowledge_base=config.default_knowledge_base
        or (min(names) if len(names) == 1 else ""),
        policies=policies,
    )


def _refresher(
    config: Config,
    store: SnapshotStore,
    holder: SnapshotHolder,
    embedder: Embedder,
    names: frozenset[str],
) -> Refresher:
    """What loads the bases' snapshots into ``holder`` and keeps them current."""
    settings = config.sidecar
    refresher = Refresher(
        store,
        holder,
        embedder.info,
        sorted(names),
        keep_downloaded=settings.keep_downloaded,
        ef_search=settings.ef_search,
        budget_bytes=settings.memory_budget_mb * 2**20,
        retry_refused_s=settings.poll_seconds,
    )
    refresher.listed = lists_store(config)
    return refresher


def _grpc_server(config: Config, guards: Guards, service: RetrievalService) -> grpc.aio.Server:
    """A grpc.aio server behind the guards' interceptors, serving ``service`` and reflection."""
    # Port sharing only between the workers of one sidecar: otherwise a second sidecar started
    # on the same port fails to bind, rather than silently taking half the calls.
    reuse_port = 1 if config.sidecar.workers > 1 else 0
    logs.quiet_grpc_core()  # gRPC's ERROR line a call whose client went first, as a failure's
    server = grpc.aio.server(
        interceptors=guards.interceptors,
        options=[*guards.options, ("grpc.so_reuseport", reuse_port)],
    )
    pb_grpc.add_RetrievalServicer_to_server(service, _SendsBytes(server))  # type: ignore[no-untyped-call]
    reflection.enable(
        server, (SERVICE_NAME, health_pb2.DESCRIPTOR.services_by_name["Health"].full_name)
    )
    return server


# The open-file limit ``serve`` raises its soft limit to, when the hard one is unlimited.
MAX_OPEN_FILES = 1 << 20


def raise_open_files_limit() -> int:
    """Raise this process's soft open-file limit to its hard limit (MAX_OPEN_FILES where that is
    unlimited) and return it, for ``serve``'s start line to say: every connection, stream and
    snapshot file is a descriptor, and a default soft limit (often 1,024) is what a flood of idle
    connections exhausts first. Left as it is where the system refuses."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = MAX_OPEN_FILES if hard == resource.RLIM_INFINITY else hard
    if soft != resource.RLIM_INFINITY and soft < target:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
        except (ValueError, OSError) as exc:
            log.warning("the open-file limit stays at %d: %s", soft, exc)
            return soft
        return target
    return soft


def start_line(sidecar: Sidecar) -> str:
    """The line ``serve`` logs once listening: each door's port, HTTPS where the HTTP door
    speaks TLS (a team reading "HTTP" would send http:// and see its calls closed)."""
    http = ""
    if sidecar.http is not None and sidecar.http_port:
        http = f", {sidecar.http.scheme} on port {sidecar.http_port}"
    metrics = f", metrics on port {sidecar.metrics_port}" if sidecar.metrics_port else ""
    return (
        f"voxrecall sidecar listening on port {sidecar.port} "
        f"({sidecar.lifecycle.state.name}){http}{metrics}"
    )


async def serve(
    config: Config, listen: str | None = None, *, listen_while_loading: bool = True
) -> None:
    """Run until SIGTERM or SIGINT, then drain: health NOT_SERVING, in-flight calls finish.

    The handlers go in first, so a signal during the start (loading snapshots) drains too: it
    closes the store at once, which cuts a download in progress, rather than after the start."""
    stopping = asyncio.Event()
    store = sidecar_store(config)

    def stop() -> None:
        stopping.set()
        store.close()

    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop)
    open_files = raise_open_files_limit()
    sidecar = await create_server(
        config, listen=listen, store=store, listen_while_loading=listen_while_loading
    )
    log.info("%s, up to %d open files", start_line(sidecar), open_files)
    await stopping.wait()
    log.info("draining (grace %.1f s)", config.sidecar.grace_s)
    await sidecar.stop()
