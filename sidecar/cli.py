"""The ``voxrecall`` command: build snapshots, serve them, ask the running sidecar."""

from __future__ import annotations

import argparse
import logging
import os
import sys
from pathlib import Path

import grpc
import orjson

from index.config import Config, load_config
from index.errors import VoxrecallError

DEFAULT_CONFIG = Path("voxrecall.toml")

EPILOG = """\
first run (the example knowledge base, the embedded model, no API key):
  voxrecall index build --config examples/voxrecall.toml
  voxrecall serve --config examples/voxrecall.toml &
  voxrecall ask "How do I reset my password?"
"""


def _config(path: Path) -> Config:
    return load_config(path)


def cmd_index_build(args: argparse.Namespace) -> int:
    from index.build import build_knowledge_base
    from index.embedders.factory import make_embedder

    config = _config(args.config)
    bases = (
        [config.knowledge_base(name) for name in args.kb]
        if args.kb
        else list(config.knowledge_bases)
    )
    if not bases:
        raise SystemExit(f"{args.config}: no [[knowledge_base]] to build")
    embedder = make_embedder(config.embedder, threads=os.cpu_count())
    summaries = [build_knowledge_base(config, kb, embedder) for kb in bases]
    if args.json:
        sys.stdout.write(
            orjson.dumps([s.as_dict() for s in summaries], option=orjson.OPT_INDENT_2).decode()
            + "\n"
        )
    else:
        for s in summaries:
            state = "published" if s.published else "unchanged"
            print(
                f"{s.knowledge_base}: {state} {s.version}: {s.pages} pages, {s.chunks} chunks "
                f"({s.embedded} embedded, {s.reused} reused, {s.removed} removed), "
                f"{sum(s.seconds.values()):.1f} s"
            )
            for skipped in s.skipped_pages:
                print(f"  skipped {skipped['path']}: {skipped['reason']}")
    skipped_any = any(s.skipped_pages for s in summaries)
    return 1 if (config.index.strict and skipped_any) else 0


def cmd_serve(args: argparse.Namespace) -> int:
    import uvloop

    from sidecar.server import serve

    config = _config(args.config)
    overrides = {"store": args.store.resolve() if args.store else None, "listen": args.listen}
    config = config.with_overrides(**overrides)
    uvloop.run(serve(config))
    return 0


def cmd_ask(args: argparse.Namespace) -> int:
    from sidecar.client import AskOptions, ask, format_response

    options = AskOptions(
        target=args.target,
        knowledge_base=args.kb,
        session_id=args.session,
        limit=args.limit,
        search=args.search,
        budget_ms=args.budget_ms,
    )
    try:
        resp = ask(" ".join(args.question), options)
    except grpc.RpcError as exc:
        print(f"error: {exc.code().name}: {exc.details()}", file=sys.stderr)
        return 1
    print(format_response(resp))
    return 0


def cmd_snapshot_verify(args: argparse.Namespace) -> int:
    from index.snapshot import verify_snapshot

    manifest = verify_snapshot(args.path)
    print(
        f"ok: {manifest.knowledge_base} {manifest.version}: {manifest.chunks} chunks, "
        f"{manifest.embedder.name} ({manifest.embedder.dimension}-d), ef {manifest.hnsw.ef}"
    )
    return 0


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="voxrecall",
        description="Low-latency retrieval sidecar for voice agents.",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("-v", "--verbose", action="store_true", help="log at DEBUG level")
    sub = p.add_subparsers(dest="command", required=True)

    config_help = f"the TOML config file (default: {DEFAULT_CONFIG})"
    index = sub.add_parser("index", help="build snapshots of knowledge bases")
    index_sub = index.add_subparsers(dest="index_command", required=True)
    build = index_sub.add_parser(
        "build",
        help="read every source, chunk, embed, and publish a snapshot per knowledge base",
        description="Build and publish a snapshot of each knowledge base in the config. Unchanged "
        "chunks reuse their vectors; nothing is published when nothing changed.",
    )
    build.add_argument("--config", type=Path, default=DEFAULT_CONFIG, help=config_help)
    build.add_argument(
        "--kb", action="append", default=[], help="only this knowledge base (repeatable)"
    )
    build.add_argument("--json", action="store_true", help="print the build summary as JSON")
    build.set_defaults(func=cmd_index_build)

    serve = sub.add_parser(
        "serve",
        help="run the gRPC sidecar",
        description="Serve the newest snapshot of each knowledge base over gRPC; SIGTERM drains.",
    )
    serve.add_argument("--config", type=Path, default=DEFAULT_CONFIG, help=config_help)
    serve.add_argument(
        "--listen", help="address to listen on, e.g. 127.0.0.1:50051 (overrides [sidecar] listen)"
    )
    serve.add_argument(
        "--store", type=Path, help="snapshot store folder (overrides [sidecar] store)"
    )
    serve.set_defaults(func=cmd_serve)

    ask = sub.add_parser(
        "ask",
        help="ask a running sidecar a question and print the chunks it returns",
        description="Send one caller turn to a running sidecar and print the chunks, scores and timings.",
    )
    ask.add_argument("question", nargs="+", help="what the caller said")
    ask.add_argument("--target", default="127.0.0.1:50051", help="the sidecar's address")
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

    snapshot = sub.add_parser("snapshot", help="operate on snapshot folders")
    snap_sub = snapshot.add_subparsers(dest="snapshot_command", required=True)
    verify = snap_sub.add_parser(
        "verify", help="check a snapshot folder's files against its manifest"
    )
    verify.add_argument("path", type=Path, help="a snapshot version folder")
    verify.set_defaults(func=cmd_snapshot_verify)
    return p


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.INFO,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )
    try:
        return int(args.func(args))
    except VoxrecallError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    raise SystemExit(main())
