"""``[sidecar] workers``: real ``voxrecall serve`` processes sharing one port."""

from __future__ import annotations

import asyncio
import os
import re
import signal
import socket
import threading
import time
import urllib.error
from collections.abc import Callable, Iterator
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from index.embedders.base import Embedder
from index.errors import ConfigError
from index.store import LocalStore
from sidecar.edge import workers
from sidecar.edge.server import create_server
from sidecar.gen import retrieval_pb2 as pb
from sidecar.gen import retrieval_pb2_grpc as pb_grpc
from tests.hardening_kit import (
    PROCESS_WAIT_S,
    ServeProcess,
    build_store,
    serve_refused,
    sidecar_config,
    toml_config,
)
from tests.test_metrics import scrape, value

CHANNELS = 16  # connections the kernel spreads: all on one of two workers has odds 1 in 32,768


def _free_ports(count: int) -> int:
    """The first of ``count`` consecutive ports that are free now."""
    for _ in range(100):
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            first = int(probe.getsockname()[1])
        if first + count > 65535:
            continue
        try:
            for port in range(first, first + count):
                with socket.socket() as s:
                    s.bind(("127.0.0.1", port))
        except OSError:
            continue
        return first
    raise AssertionError("no free consecutive ports")


class Supervisor(ServeProcess):
    """``voxrecall serve`` with workers = 2 on free ports."""

    def __init__(self, root: Path, ports: tuple[int, int]) -> None:
        self.port, self.metrics = ports  # the listen port; the first of two metrics ports
        config = root / "voxrecall.toml"
        config.write_text(
            toml_config(
                root,
                listen=f"127.0.0.1:{self.port}",
                metrics_listen=f"127.0.0.1:{self.metrics}",
                workers=2,
                poll_seconds=3600,
                log_format="text",
            ),
            encoding="utf-8",
        )
        super().__init__(config, {"PATH": os.environ.get("PATH", "")})

    def worker_pids(self) -> list[int]:
        found = self.wait_for(r"started 2 workers: pids (\d+) (\d+)")
        return [int(found.group(1)), int(found.group(2))]

    def wait_serving(self) -> None:
        """Until both workers answer on their metrics ports and report SERVING."""
        deadline = time.monotonic() + PROCESS_WAIT_S
        for port in (self.metrics, self.metrics + 1):
            while True:
                assert self.proc.poll() is None, self.log()
                try:
                    if value(scrape(port), "voxrecall_state", state="serving") == 1:
                        break
                except (urllib.error.URLError, ConnectionError):
                    pass
                assert time.monotonic() < deadline, self.log()
                time.sleep(0.1)


# ``voxrecall serve`` needs fixed ports (workers share one, and worker i serves metrics on the
# metrics port + i), so they are probed free and bound later, by the child: another process may
# take one in between. A start that fails on a bind is tried again on fresh ports.
START_TRIES = 3
_BIND_FAILED = re.compile(r"(?i)address already in use|failed to bind|errno 98")


def fresh_ports() -> tuple[int, int]:
    return _free_ports(1), _free_ports(2)


def start_supervisor(root: Path, ports: Callable[[], tuple[int, int]] = fresh_ports) -> Supervisor:
    """A supervisor whose workers both serve; started again on fresh ``ports()`` when a port it
    was given was taken before it could bind it (any other failure fails at once)."""
    for _ in range(START_TRIES - 1):
        started = Supervisor(root, ports())
        try:
            started.wait_serving()
        except AssertionError:
            started.stop()
            if not _BIND_FAILED.search(started.log()):
                raise
            continue
        return started
    started = Supervisor(root, ports())
    started.wait_serving()
    return started


@pytest.fixture
def supervisor(tmp_path: Path, local_embedder: Embedder) -> Iterator[Supervisor]:
    build_store(tmp_path, local_embedder)
    started = start_supervisor(tmp_path)
    yield started
    started.stop()
    for pid in started.worker_pids():
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)  # no worker outlives its supervisor


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


async def test_two_workers_share_the_port_and_drain_on_sigterm(supervisor: Supervisor) -> None:
    pids = await asyncio.to_thread(supervisor.worker_pids)
    await asyncio.to_thread(supervisor.wait_serving)
    target = f"127.0.0.1:{supervisor.port}"
    request = pb.SearchRequest(query="how do I reset my password", limit=3)
    # own connections: channels of one process otherwise share one (gRPC's subchannel pool)
    own = [("grpc.use_local_subchannel_pool", 1)]
    channels = [grpc.aio.insecure_channel(target, options=own) for _ in range(CHANNELS)]
    try:
        for channel in channels:
            health = health_pb2_grpc.HealthStub(channel)
            reply = await health.Check(health_pb2.HealthCheckRequest(), timeout=PROCESS_WAIT_S)
            assert reply.status == health_pb2.HealthCheckResponse.SERVING
            stub = pb_grpc.RetrievalStub(channel)  # type: ignore[no-untyped-call]
            answer = await stub.Search(request, timeout=PROCESS_WAIT_S)
            assert answer.chunks[0].title == "Reset your password"
    finally:
        for channel in channels:
            await channel.close(None)
    searches = [
        value(
            await asyncio.to_thread(scrape, port),
            "voxrecall_rpcs_total",
            door="grpc",
            method="Search",
            code="OK",
        )
        for port in (supervisor.metrics, supervisor.metrics + 1)
    ]
    assert sum(searches) == CHANNELS
    assert all(n > 0 for n in searches), searches  # the kernel spread the connections

    supervisor.proc.send_signal(signal.SIGTERM)
    assert await asyncio.to_thread(supervisor.proc.wait, PROCESS_WAIT_S) == 0, supervisor.log()
    assert not any(_alive(pid) for pid in pids)
    assert sum("draining" in line for line in supervisor.lines) == 2


async def test_a_worker_that_dies_stops_the_sidecar_with_its_status(
    supervisor: Supervisor,
) -> None:
    pids = await asyncio.to_thread(supervisor.worker_pids)
    await asyncio.to_thread(supervisor.wait_serving)
    os.kill(pids[0], signal.SIGKILL)
    code = await asyncio.to_thread(supervisor.proc.wait, PROCESS_WAIT_S)
    assert code == 128 + signal.SIGKILL, supervisor.log()
    assert not _alive(pids[1])  # the other worker was stopped, not left serving alone


async def test_killing_the_supervisor_drains_its_workers(supervisor: Supervisor) -> None:
    pids = await asyncio.to_thread(supervisor.worker_pids)
    await asyncio.to_thread(supervisor.wait_serving)
    supervisor.proc.kill()
    await asyncio.to_thread(supervisor.proc.wait, PROCESS_WAIT_S)
    deadline = time.monotonic() + PROCESS_WAIT_S
    while any(_alive(pid) for pid in pids):
        assert time.monotonic() < deadline, "a worker outlived its supervisor"
        await asyncio.sleep(0.05)


def test_a_start_whose_port_was_taken_is_tried_again_on_fresh_ports(
    tmp_path: Path, local_embedder: Embedder
) -> None:
    """The race made certain: the first metrics port "probed free" is held by another socket;
    the first start fails on its bind, the second gets fresh ports and serves."""
    build_store(tmp_path, local_embedder)
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))  # bound, not listening: a connection to it is refused
        held = int(taken.getsockname()[1])
        given = iter([(_free_ports(1), held)])  # a free listen port, the taken metrics port
        started = start_supervisor(tmp_path, lambda: next(given, None) or fresh_ports())
        try:
            assert started.metrics != held
            assert value(scrape(started.metrics), "voxrecall_state", state="serving") == 1
        finally:
            started.stop()


def test_workers_need_fixed_ports(tmp_path: Path) -> None:
    config = sidecar_config(tmp_path, workers=2, listen="127.0.0.1:0")
    with pytest.raises(ConfigError, match="fixed port in listen"):
        workers.check(config)
    config = sidecar_config(
        tmp_path, workers=2, listen="127.0.0.1:50051", metrics_listen="127.0.0.1:0"
    )
    with pytest.raises(ConfigError, match="fixed metrics_listen port"):
        workers.check(config)
    workers.check(sidecar_config(tmp_path, workers=1, listen="127.0.0.1:0"))  # one: any port


def test_workers_refuse_a_unix_socket(tmp_path: Path) -> None:
    """gRPC unlinks a unix socket's path before binding it: a second worker would take the
    path from the first, which would serve no connection."""
    config = sidecar_config(tmp_path, workers=2, listen="unix:/run/voxrecall.sock")
    with pytest.raises(ConfigError, match="needs host:port in listen"):
        workers.check(config)
    workers.check(sidecar_config(tmp_path, workers=1, listen="unix:/run/voxrecall.sock"))


def test_each_worker_has_its_own_metrics_port_and_download_cache(tmp_path: Path) -> None:
    config = sidecar_config(
        tmp_path, workers=3, listen="127.0.0.1:50051", metrics_listen="127.0.0.1:9464"
    )
    third = workers.worker_config(config, 2)
    assert third.sidecar.metrics_listen == "127.0.0.1:9466"
    assert third.sidecar.cache_dir == Path(config.sidecar.cache_dir) / "worker-2"
    assert third.sidecar.listen == config.sidecar.listen


@pytest.mark.parametrize("count", [0, 65, True, 1.5])
def test_a_wrong_worker_count_is_a_config_error(tmp_path: Path, count: object) -> None:
    with pytest.raises(ConfigError, match="workers must be "):
        sidecar_config(tmp_path, workers=count)


class HeldStore(LocalStore):
    """A local store whose fetches wait until the test lets them go."""

    def __init__(self, root: Path) -> None:
        super().__init__(root)
        self.fetching = threading.Event()
        self.go = threading.Event()

    def fetch(self, knowledge_base: str, version: str) -> Path:
        self.fetching.set()
        assert self.go.wait(PROCESS_WAIT_S), "the test never let the fetch go"
        return super().fetch(knowledge_base, version)


def _accepts(port: int) -> bool:
    try:
        socket.create_connection(("127.0.0.1", port), timeout=PROCESS_WAIT_S).close()
    except ConnectionRefusedError:
        return False
    return True


@pytest.mark.parametrize("listen_while_loading", [True, False], ids=["first", "later"])
async def test_a_later_worker_listens_only_once_its_snapshots_are_loaded(
    tmp_path: Path, local_embedder: Embedder, listen_while_loading: bool
) -> None:
    """The first worker binds while it loads (health answers NOT_SERVING); a later one binds
    once loaded: the kernel hands a new connection to any socket on the port, and one on a
    worker still loading could only have its calls refused."""
    build_store(tmp_path, local_embedder)
    port = _free_ports(1)
    config = sidecar_config(tmp_path, listen=f"127.0.0.1:{port}", poll_seconds=3600)
    store = HeldStore(tmp_path / "store")
    starting = asyncio.create_task(
        create_server(
            config,
            embedder=local_embedder,
            poll=False,
            store=store,
            listen_while_loading=listen_while_loading,
        )
    )
    try:
        assert await asyncio.to_thread(store.fetching.wait, PROCESS_WAIT_S)
        assert await asyncio.to_thread(_accepts, port) is listen_while_loading
    finally:
        store.go.set()
    sidecar = await asyncio.wait_for(starting, PROCESS_WAIT_S)
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            health = health_pb2_grpc.HealthStub(channel)
            answer = await health.Check(health_pb2.HealthCheckRequest(), timeout=PROCESS_WAIT_S)
            assert answer.status == health_pb2.HealthCheckResponse.SERVING
    finally:
        await sidecar.stop(0.5)


def test_a_second_sidecar_with_workers_is_refused_the_port_the_first_serves(
    supervisor: Supervisor,
) -> None:
    """A second attack: workers bind with SO_REUSEPORT, which any process of the same user may
    join, so a second sidecar of workers > 1 on the port bound beside the first and took part of
    its calls. Its supervisor probes the port first: one error line, exit 2."""
    supervisor.wait_serving()
    config = supervisor.proc.args[supervisor.proc.args.index("--config") + 1]
    second = serve_refused(Path(config), {"PATH": os.environ.get("PATH", "")})
    assert second.returncode == 2, second.stderr
    assert f"cannot listen on 127.0.0.1:{supervisor.port} ([sidecar] listen" in second.stderr
    assert "Traceback" not in second.stderr
