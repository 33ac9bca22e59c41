"""The ``voxrecall`` command: build snapshots, serve them, ask the running sidecar.

One registrar per command; the indexer's commands (``index``, ``source``, ``snapshot``) are
``index/cli.py``'s, registered here with the loader of the whole config file.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
from pathlib import Path
from typing import Any

import grpc

from index.cli import (
    CONFIG_HELP,
    DEFAULT_CONFIG,
    Commands,
    register_index,
    register_snapshot,
    register_source,
)
from index.errors import ConfigError, VoxrecallError
from sidecar.config import load_config
from sidecar.connection import Connection, target_for_listen

log = logging.getLogger("voxrecall.cli")
EPILOG = """\
first run (the example knowledge base, the embedded model, no API key):
  voxrecall index build --config examples/voxrecall.toml
  voxrecall serve --config examples/voxrecall.toml &
  voxrecall ask "How do I reset my password?"
"""


def cmd_serve(args: argparse.Namespace) -> int:
    import uvloop

    from sidecar.edge.server import serve

    config = load_config(args.config)
    store: Path | str | None = args.store
    if args.store is not None and not args.store.startswith(("http://", "https://", "s3://")):
        store = Path(args.store).resolve()
    overrides = {"store": store, "listen": args.listen, "shard": args.shard, "shards": args.shards}
    config = config.with_overrides(**overrides)
    from sidecar.edge import logs, workers

    worker = os.environ.get(workers.WORKER_ENV)
    if worker is None and config.sidecar.workers > 1:
        workers.check(config)
        workers.claim(config)
        argv = ["serve", "--config", str(args.config)]
        argv += ["--listen", config.sidecar.listen, "--store", str(config.sidecar.store)]
        argv += ["--shards", str(config.sidecar.shards), "--shard", str(config.sidecar.shard)]
        return workers.supervise([*(["-v"] if args.verbose else []), *argv], config.sidecar.workers)
    if worker is not None:
        config = workers.worker_config(config, int(worker))

    logs.configure(
        level="DEBUG" if args.verbose else config.sidecar.log_level,
        fmt=config.sidecar.log_format,
        secrets=config.secrets,
    )
    # the first worker (or the only process) answers health while it loads; the others bind
    # once loaded, so no connection reaches a worker that cannot serve it yet
    uvloop.run(serve(config, listen_while_loading=worker in (None, "0")))
    return 0


def _ask_connection(args: argparse.Namespace) -> Connection:
    """--target, else the --config's listen, else VOXRECALL_TARGET; the same for TLS settings."""
    target = args.target
    config = load_config(args.config) if args.config is not None else None
    if target is None and config is not None:
        target = target_for_listen(config.sidecar.listen, str(args.config))
    connection = Connection.from_env(
        os.environ,
        target=target,
        ca_file=args.tls_ca,
        cert_file=args.tls_cert,
        key_file=args.tls_key,
        server_name=args.tls_server_name,
    )
    if config is not None and config.sidecar.tls.enabled and not connection.tls:
        raise ConfigError(
            f"{args.config}: the sidecar speaks TLS ([sidecar.tls]): give the CA that signed "
            "its certificate with --tls-ca or VOXRECALL_TLS_CA"
        )
    return connection


def cmd_ask(args: argparse.Namespace) -> int:
    from sidecar.client import AskOptions, ask, format_response

    options = AskOptions(
        connection=_ask_connection(args),
        knowledge_base=args.kb,
        session_id=args.session,
        limit=args.limit,
        search=args.search,
        budget_ms=args.budget_ms,
    )
    try:
        resp = ask(" ".join(args.question), options)
    except grpc.RpcError as exc:
        said = ask_failure(exc, options.connection.target, args.config)
        print(said + token_hint(exc, options.connection.token), file=sys.stderr)
        return 1
    print(format_response(resp))
    return 0


def ask_failure(exc: grpc.RpcError, target: str, config: Path | None = None) -> str:
    """The sidecar's own error as it sent it (a base loading, a snapshot missing); where no
    sidecar answered (every answer carries its call id), the address tried and the command that
    starts one, with the config ``ask`` was given (else the default), and not gRPC's own line,
    whose "UNKNOWN" read as the sidecar's status (logged at DEBUG: ``-v``)."""
    line = f"error: {exc.code().name}: {exc.details()}"
    if exc.code() is not grpc.StatusCode.UNAVAILABLE or _answered_by_a_sidecar(exc):
        return line
    log.debug("%s", line)  # gRPC's own words ("UNKNOWN: ... Connection refused"): with -v only
    return (
        f"error: no voxrecall sidecar answered at {target} (-v shows gRPC's reason): start one "
        f"with `voxrecall serve --config {config or DEFAULT_CONFIG}`, or give its address with "
        "--target"
    )


def token_hint(exc: grpc.RpcError, token: str) -> str:
    """For a call refused UNAUTHENTICATED, where ``ask`` takes its token from (there is no flag:
    a command line is visible to every user); else nothing."""
    if exc.code() is not grpc.StatusCode.UNAUTHENTICATED:
        return ""
    if not token:
        return "\nvoxrecall ask reads the token from VOXRECALL_TOKEN, which is unset: set it"
    return "\nvoxrecall ask sent the token in VOXRECALL_TOKEN: check it is the sidecar's"


def _answered_by_a_sidecar(exc: grpc.RpcError) -> bool:
    """Whether a sidecar sent this status: its trailers carry the call id (and a base loading,
    its retry hint)."""
    from sidecar.edge.logs import CALL_ID_HEADER
    from sidecar.edge.status import PUSHBACK

    trailing = getattr(exc, "trailing_metadata", None)  # a blocking call's, or grpc.aio's
    trailers: dict[str, Any] = dict(trailing() or ()) if callable(trailing) else {}
    return CALL_ID_HEADER in trailers or PUSHBACK in trailers


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="voxrecall",
        description="Low-latency retrieval sidecar for voice agents.",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("-v", "--verbose", action="store_true", help="log at DEBUG level")
    commands = p.add_subparsers(dest="command", required=True)
    register_index(commands, load_config)
    _register_serve(commands)
    _register_ask(commands)
    register_source(commands, load_config)
    register_snapshot(commands, load_config)
    return p


def _register_serve(commands: Commands) -> None:
    serve = commands.add_parser(
        "serve",
        help="run the gRPC sidecar",
        description="Serve the newest snapshot of each knowledge base over gRPC; SIGTERM drains.",
    )
    serve.add_argument("--config", type=Path, default=DEFAULT_CONFIG, help=CONFIG_HELP)
    serve.add_argument(
        "--listen", help="address to listen on, e.g. 127.0.0.1:50051 (overrides [sidecar] listen)"
    )
    serve.add_argument(
        "--store", help="snapshot store folder, http(s) or s3 URL (overrides [sidecar] store)"
    )
    serve.add_argument(
        "--shard",
        type=int,
        help="serve only the bases of this shard, 0 to [sidecar] shards - 1 (overrides "
        "[sidecar] shard; a StatefulSet passes its pod index)",
    )
    serve.add_argument(
        "--shards", type=int, help="how many shards the fleet has (overrides [sidecar] shards)"
    )
    serve.set_defaults(func=cmd_serve)


def _register_ask(commands: Commands) -> None:
    ask = commands.add_parser(
        "ask",
        help="ask a running sidecar a question and print the chunks it returns",
        description="Send one caller turn to a running sidecar and print the chunks, scores and "
        "timings. With [sidecar.auth] on, the bearer token comes from VOXRECALL_TOKEN (never a "
        "flag: a command line is visible to every user of the machine).",
    )
    ask.add_argument("question", nargs="+", help="what the caller said")
    ask.add_argument(
        "--target",
        help="the sidecar's address (default: --config's [sidecar] listen, else "
        "VOXRECALL_TARGET, else 127.0.0.1:50051)",
    )
    ask.add_argument(
        "--config", type=Path, help="a sidecar's config file: ask at its [sidecar] listen"
    )
    ask.add_argument(
        "--tls-ca", type=Path, help="speak TLS, trusting this CA (PEM; env VOXRECALL_TLS_CA)"
    )
    ask.add_argument(
        "--tls-cert", type=Path,
        help="client certificate for mutual TLS (PEM; env VOXRECALL_TLS_CERT)",
    )  # fmt: skip
    ask.add_argument("--tls-key", type=Path, help="its private key (PEM; env VOXRECALL_TLS_KEY)")
    ask.add_argument(
        "--tls-server-name", help="the name in the sidecar's certificate, when the target's "
        "differs (env VOXRECALL_TLS_SERVER_NAME)",
    )  # fmt: skip
    ask.add_argument("--kb", default="", help="knowledge base (default: the sidecar's default)")
    ask.add_argument("--session", default="", help="session id, to ask follow-ups in one session")
    ask.add_argument(
        "--limit", type=int, default=0, help="results with --search (default: max_results)"
    )
    ask.add_argument(
        "--budget-ms", type=int, default=0, help="latency budget (default: the sidecar's)"
    )
    ask.add_argument(
        "--search", action="store_true", help="use Search (no skip policy or follow-ups)"
    )
    ask.set_defaults(func=cmd_ask)


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.INFO,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )
    from sidecar.edge.logs import quiet_http_clients

    quiet_http_clients()  # an index build's embeddings: a line per request otherwise
    try:
        code = int(args.func(args))
        sys.stdout.flush()  # here, where a closed pipe is caught, not at the interpreter's exit
        return code
    except VoxrecallError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except BrokenPipeError:
        return _reader_gone()


def _reader_gone() -> int:
    """Stdout's reader went away (``voxrecall ask ... | head -3``): stop quietly, as a Unix tool
    does on SIGPIPE, with the status a shell shows for one (128 + SIGPIPE). Stdout is pointed at
    the null device first, so the interpreter's own flush at exit cannot fail again."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, sys.stdout.fileno())
    os.close(devnull)
    return 128 + signal.SIGPIPE


if __name__ == "__main__":
    raise SystemExit(main())
