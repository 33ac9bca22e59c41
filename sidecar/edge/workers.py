"""Several sidecar processes on one port: ``[sidecar] workers = N``.

One event loop answers every call of a process, so a sidecar process uses one core for its
calls (``python -m bench.search_parts``). With ``workers`` > 1, ``voxrecall serve`` becomes a
supervisor that starts N copies of itself (``VOXRECALL_WORKER=i`` in their environment); each
binds the same address with SO_REUSEPORT and the kernel spreads new connections over them
(worker 0 binds while it loads, to answer health; the others once loaded, so that no connection
reaches a worker still loading, whose calls it could only refuse). A
connection stays with its worker, so the turns of a call that keeps its channel (or its
``Converse`` stream) keep their session while the connection lives (a connection closed after
``[sidecar] max_connection_idle_s`` without a call reconnects wherever the kernel sends it). Each worker loads every snapshot (memory x N), polls
the store itself (an HTTP store's downloads under ``cache_dir/worker-i``) and serves metrics on
the configured port + i.

The supervisor forwards SIGTERM and SIGINT to every worker and waits for them to drain. A worker
that exits on its own stops the others, and the supervisor exits with that worker's status, so
an orchestrator restarts the sidecar as a whole rather than leaving it short of a worker; a
supervisor that is killed takes its workers with it (they drain).
"""

from __future__ import annotations

import ctypes
import logging
import os
import signal
import socket
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path
from types import FrameType

from index.errors import CannotListen, ConfigError
from sidecar.config import UNIX_LISTEN, Config

log = logging.getLogger("voxrecall.workers")

WORKER_ENV = "VOXRECALL_WORKER"  # set by the supervisor: which worker a process is
FORWARDED = (signal.SIGTERM, signal.SIGINT)
PR_SET_PDEATHSIG = 1  # linux/prctl.h


def check(config: Config) -> None:
    """Raise ConfigError when ``workers`` processes cannot share the configured addresses."""
    settings = config.sidecar
    if settings.workers <= 1:
        return
    if settings.listen.startswith(UNIX_LISTEN):
        raise ConfigError(
            f"[sidecar] workers = {settings.workers} needs host:port in listen (got "
            f"{settings.listen}): each worker binding a unix socket's path replaces the one "
            "before, which then gets no connection"
        )
    if settings.listen.rpartition(":")[2] == "0":
        raise ConfigError(
            f"[sidecar] workers = {settings.workers} needs a fixed port in listen (got {settings.listen}): "
            "with port 0 each worker would listen on a port of its own"
        )
    if settings.metrics_listen and settings.metrics_listen.rpartition(":")[2] == "0":
        raise ConfigError(
            f"[sidecar] workers = {settings.workers} needs a fixed metrics_listen port: worker i "
            "serves its metrics on that port + i"
        )


def claim(config: Config) -> None:
    """Raise CannotListen when another process already serves an address the workers would
    share. Workers bind with SO_REUSEPORT, which any process of the same user may join: a
    second sidecar with workers > 1 on the same port would bind beside the first and take part
    of its calls. A plain bind (no SO_REUSEPORT) fails wherever anything listens there."""
    settings = config.sidecar
    addresses = [(settings.listen, "[sidecar] listen, or --listen")]
    if settings.http.listen:
        addresses.append((settings.http.listen, "[sidecar.http] listen"))
    for listen, key in addresses:
        _probe(listen, key)


def _probe(listen: str, key: str) -> None:
    host, _, port = listen.rpartition(":")
    if not port.isdigit():
        return  # an address gRPC itself refuses (``check`` refuses a unix socket before)
    try:
        family, kind, proto, _, address = socket.getaddrinfo(
            host.strip("[]") or None, int(port), type=socket.SOCK_STREAM
        )[0]
        with socket.socket(family, kind, proto) as probe:
            # a closed connection's TIME_WAIT does not hold the port (a restart would be
            # refused for a minute); a listener still does, without SO_REUSEPORT
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            probe.bind(address)
    except OSError as exc:
        raise CannotListen(
            listen, key, f"{exc.strerror or exc}: another process serves it (a sidecar already?)"
        ) from exc


def worker_config(config: Config, index: int) -> Config:
    """What worker ``index`` serves: the shared port, its own metrics port and download cache."""
    settings = config.sidecar
    metrics = settings.metrics_listen
    if metrics:
        host, _, port = metrics.rpartition(":")
        metrics = f"{host}:{int(port) + index}"
    return config.with_overrides(
        metrics_listen=metrics, cache_dir=Path(settings.cache_dir) / f"worker-{index}"
    )


def _die_with_parent() -> None:
    """In a new worker: SIGTERM (a drain) when the supervisor dies, even by SIGKILL (Linux)."""
    if sys.platform == "linux":
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)


def supervise(argv: Sequence[str], workers: int) -> int:
    """Run ``voxrecall <argv>`` as ``workers`` worker processes until they have all exited.

    Returns 0 when a forwarded signal stopped them and each drained cleanly; otherwise the exit
    status of the first worker that stopped on its own (1 if that was 0: it was not asked to).
    """
    children: dict[int, subprocess.Popen[bytes]] = {}
    stopping = False
    failed = 0

    def stop_all(signum: int) -> None:
        for child in children.values():
            if child.poll() is None:
                child.send_signal(signum)

    def forward(signum: int, frame: FrameType | None) -> None:
        nonlocal stopping
        stopping = True
        stop_all(signum)

    previous = {sig: signal.signal(sig, forward) for sig in FORWARDED}
    try:
        for i in range(workers):
            env = {**os.environ, WORKER_ENV: str(i)}
            child = subprocess.Popen(
                [sys.executable, "-m", "sidecar.cli", *argv], env=env, preexec_fn=_die_with_parent
            )
            children[child.pid] = child
        log.info("started %d workers: pids %s", workers, " ".join(map(str, children)))
        running = set(children)
        while running:
            pid, status = os.wait()  # a forwarded signal runs its handler, then waiting resumes
            if pid not in running:
                continue
            running.discard(pid)
            code = os.waitstatus_to_exitcode(status)
            children[pid].returncode = code
            code = code if code >= 0 else 128 - code  # killed by a signal: as a shell reports it
            if not stopping:
                log.error("worker pid %d exited with %d: stopping the others", pid, code)
                stopping = True
                failed = code or 1
                stop_all(signal.SIGTERM)
            elif code != 0 and not failed:
                failed = code
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        stop_all(signal.SIGKILL)  # only on an error of our own: the loop above reaps them all
    return failed
