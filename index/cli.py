"""The indexer's commands: ``voxrecall index build | validate | watch | publish | rollback``,
``voxrecall source add | approve | reject | list`` and ``voxrecall snapshot verify``.

One registrar per command adds its parser. The entry point (``sidecar/cli.py``) calls them
with the loader that reads the whole config file, so an index command refuses a bad
``[sidecar]`` key just as ``serve`` does, and this package still never imports the sidecar.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import orjson

from index.config import BuildConfig

DEFAULT_CONFIG = Path("voxrecall.toml")
CONFIG_HELP = f"the TOML config file (default: {DEFAULT_CONFIG})"
# Reads and checks a config file: sidecar.config.load_config, given by the entry point.
Loader = Callable[[Path], BuildConfig]
Commands = Any  # argparse's sub-parsers action (its type is private)


def _config(args: argparse.Namespace) -> BuildConfig:
    loader: Loader = args.load
    return loader(args.config)


def cmd_index_build(args: argparse.Namespace) -> int:
    from index.build import build_knowledge_base
    from index.embedders.factory import make_embedder
    from index.errors import one_line

    config = _config(args)
    bases = (
        [config.knowledge_base(name) for name in args.kb]
        if args.kb
        else list(config.knowledge_bases)
    )
    if not bases:
        raise SystemExit(f"{args.config}: no [[knowledge_base]] to build")
    embedder = make_embedder(config.embedder, parallel=os.cpu_count() or 1)
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
                print(f"  skipped {one_line(skipped['path'])}: {one_line(skipped['reason'])}")
            _print_llm(s.as_dict())
    skipped_count = sum(len(s.skipped_pages) for s in summaries)
    if config.index.strict and skipped_count:
        print(f"error: [index] strict: {skipped_count} page(s) skipped", file=sys.stderr)
        return 1
    return 0


def _print_llm(summary: dict[str, Any]) -> None:
    llm = summary["llm"]
    if llm["calls"] or llm["cache_hits"] or llm["failures"]:
        print(
            f"  model: {llm['calls']} calls, {llm['cache_hits']} cached, {llm['tokens']} tokens, "
            f"{llm['failures']} failed"
        )
    for failed in summary["enrichment_failures"]:
        print(f"  {failed['task']} failed for {failed['label']}: {failed['reason']}")


def _seconds(value: str) -> float:
    try:
        seconds = float(value)
    except ValueError:
        seconds = -1.0
    if not seconds > 0:
        raise argparse.ArgumentTypeError(f"expected seconds > 0, got {value!r}")
    return seconds


def cmd_index_validate(args: argparse.Namespace) -> int:
    from index.validate import ValidateOptions, validate_docs, write_manifest

    flags = ValidateOptions(tuple(args.require), args.require_last_updated)
    targets: list[tuple[Path, ValidateOptions]] = []
    if args.config is not None:
        config = _config(args)
        wanted = args.dir.resolve() if args.dir is not None else None
        for kb in config.knowledge_bases:
            for source in kb.sources:
                if source.type != "markdown" or source.path is None:
                    continue
                if wanted is None or source.path.resolve() == wanted:
                    own = ValidateOptions.from_options(source.name, source.options)
                    shown = args.dir if wanted is not None else source.path
                    targets.append((shown, own.merged(flags)))
        if args.dir is None and not targets:
            raise SystemExit(f"{args.config}: no markdown source to validate")
    if args.dir is not None and not targets:
        targets.append((args.dir, flags))
    if not targets:
        raise SystemExit("voxrecall index validate: give a DIR or --config")
    total = 0
    for root, options in targets:
        report = validate_docs(root, options)
        if args.write_manifest:
            written = write_manifest(root, report.pages)
            report.problems = [p for p in report.problems if p.kind != "stale-manifest"]
            print(f"wrote {written} ({len(report.pages)} pages)", file=sys.stderr)
        for problem in report.problems:
            print(f"{root / problem.path}:{problem.line}: {problem.message}")
        counts = ", ".join(f"{kind} {n}" for kind, n in sorted(report.counts().items()))
        print(
            f"{root}: {len(report.pages)} pages, {len(report.problems)} problem(s)"
            + (f" ({counts})" if counts else ""),
            file=sys.stderr,
        )
        total += len(report.problems)
    return 1 if total else 0


def cmd_index_watch(args: argparse.Namespace) -> int:
    from index.embedders.factory import make_embedder
    from index.watch import WatchOptions, run_watch

    config = _config(args)
    if not config.knowledge_bases:
        raise SystemExit(f"{args.config}: no [[knowledge_base]] to watch")
    embedder = make_embedder(config.embedder, parallel=os.cpu_count() or 1)
    options = WatchOptions(interval_s=args.interval, poll_s=args.poll)
    run_watch(config, embedder, options, listen=args.listen)
    return 0


def _registry(args: argparse.Namespace) -> Any:
    from index.curation import Registry

    return Registry(_config(args).index.registry)


def cmd_source_add(args: argparse.Namespace) -> int:
    config = _config(args)
    config.knowledge_base(args.kb)  # an unknown base is refused here, not at the next build
    from index.curation import Registry

    entry = Registry(config.index.registry).add(args.kb, args.location, args.by, args.note)
    print(
        f"{entry.id} pending: {entry.location} for {entry.knowledge_base} (by {entry.proposed_by})"
    )
    return 0


def cmd_source_decide(args: argparse.Namespace) -> int:
    entry = _registry(args).decide(args.id, args.status, args.by)
    print(f"{entry.id} {entry.status}: {entry.location} (by {entry.decided_by})")
    return 0


def cmd_source_list(args: argparse.Namespace) -> int:
    entries = [
        e
        for e in _registry(args).entries()
        if (not args.kb or e.knowledge_base == args.kb)
        and (not args.status or e.status == args.status)
    ]
    if args.json:
        rows = [dataclasses.asdict(e) for e in entries]
        sys.stdout.write(orjson.dumps(rows, option=orjson.OPT_INDENT_2).decode() + "\n")
        return 0
    for e in entries:
        decided = f", {e.status} by {e.decided_by} {e.decided_at}" if e.decided_by else ""
        print(
            f"{e.id}  {e.status:<8}  {e.knowledge_base}  {e.location}  "
            f"(proposed by {e.proposed_by} {e.proposed_at}{decided})"
        )
    return 0


def cmd_index_publish(args: argparse.Namespace) -> int:
    from index.store import LocalStore

    config = _config(args)
    names = args.kb or [kb.name for kb in config.knowledge_bases]
    source = LocalStore(config.index.store)
    publish = _publisher(args.to, config)
    for name in names:
        folder = source.latest_dir(name)
        copied = publish(name, folder)
        if copied is None:
            print(f"{name}: {args.to} already has {folder.name} or newer")
        else:
            print(f"{name}: published {folder.name} to {copied}")
    return 0


def cmd_index_rollback(args: argparse.Namespace) -> int:
    from index.store import LocalStore

    config = _config(args)
    kb = config.knowledge_base(args.kb).name
    folder = LocalStore(config.index.store).roll_back(kb, args.to, keep=config.index.keep_versions)
    print(f"{kb}: published {args.to}'s content as {folder.name}")
    return 0


def _publisher(to: str, config: BuildConfig) -> Callable[[str, Path], object | None]:
    """What copies one base's snapshot folder to ``--to``: a folder, or s3://bucket/prefix."""
    if to.startswith("s3://"):
        from index.s3_store import S3Options, S3Publisher

        options = S3Options(config.index.s3_endpoint_url, config.index.s3_region)
        return S3Publisher(to, options).publish_copy
    from index.store import LocalStore

    target = LocalStore(Path(to).resolve())
    return lambda name, folder: target.publish_copy(name, folder, keep=config.index.keep_versions)


def cmd_snapshot_verify(args: argparse.Namespace) -> int:
    from index.snapshot import load_snapshot, verify_fetched

    if args.config is None:
        manifest = verify_fetched(args.path)  # every file's sha256 and the graphs' layout
    else:
        from index.embedders.factory import make_embedder

        expected = make_embedder(_config(args).embedder).info
        manifest = load_snapshot(args.path, expected).manifest  # also the hnsw and chunk counts
    print(
        f"ok: {manifest.knowledge_base} {manifest.version}: {manifest.chunks} chunks, "
        f"{manifest.embedder.name} ({manifest.embedder.dimension}-d), ef {manifest.hnsw.ef}"
    )
    return 0


def register_index(commands: Commands, load: Loader) -> None:
    """``voxrecall index ...``: one registrar per command."""
    index = commands.add_parser("index", help="build snapshots of knowledge bases")
    index_commands = index.add_subparsers(dest="index_command", required=True)
    registrars = (
        _register_build,
        _register_validate,
        _register_watch,
        _register_publish,
        _register_rollback,
    )
    for registrar in registrars:
        registrar(index_commands, load)


def _register_build(commands: Commands, load: Loader) -> None:
    build = commands.add_parser(
        "build",
        help="read every source, chunk, embed, and publish a snapshot per knowledge base",
        description="Build and publish a snapshot of each knowledge base in the config. Unchanged "
        "chunks reuse their vectors; nothing is published when nothing changed.",
    )
    build.add_argument("--config", type=Path, default=DEFAULT_CONFIG, help=CONFIG_HELP)
    build.add_argument(
        "--kb", action="append", default=[], help="only this knowledge base (repeatable)"
    )
    build.add_argument("--json", action="store_true", help="print the build summary as JSON")
    build.set_defaults(func=cmd_index_build, load=load)


def _register_validate(commands: Commands, load: Loader) -> None:
    validate = commands.add_parser(
        "validate",
        help="check a Markdown docs folder: links, titles, required files, manifest",
        description="Check a docs folder: required files, duplicate titles, 'Last updated' "
        "dates, broken relative links, sidebar links, and a stale docs-manifest.json. Prints one "
        "'path:line: message' per problem; exits 1 when any was found.",
    )
    validate.add_argument(
        "dir",
        type=Path,
        nargs="?",
        help="the docs folder (default: every markdown source of --config)",
    )
    validate.add_argument(
        "--config",
        type=Path,
        help="also apply the validation options of this config's markdown sources",
    )
    validate.add_argument(
        "--write-manifest", action="store_true", help="(re)write DIR/docs-manifest.json"
    )
    validate.add_argument(
        "--require", action="extend", nargs="+", default=[], metavar="FILE",
        help="a file the folder must have, e.g. Home.md _Sidebar.md",
    )  # fmt: skip
    validate.add_argument(
        "--require-last-updated", action="store_true",
        help="every page must say 'Last updated: YYYY-MM-DD'",
    )  # fmt: skip
    validate.set_defaults(func=cmd_index_validate, load=load)


def _register_watch(commands: Commands, load: Loader) -> None:
    watch = commands.add_parser(
        "watch",
        help="rebuild on a schedule, when local files change, and when URLs are due",
        description="The periodic batch indexer: polls local sources for changes, re-crawls url "
        "sources when their refresh is due, rebuilds every --interval seconds, and publishes only "
        "when something changed. SIGTERM or SIGINT stops it cleanly.",
    )
    watch.add_argument("--config", type=Path, default=DEFAULT_CONFIG, help=CONFIG_HELP)
    watch.add_argument(
        "--interval",
        type=_seconds,
        default=3600.0,
        help="seconds between scheduled rebuilds (default 3600)",
    )
    watch.add_argument(
        "--poll",
        type=_seconds,
        default=10.0,
        help="seconds between checks for changes (default 10)",
    )
    watch.add_argument(
        "--listen",
        default="",
        metavar="HOST:PORT",
        help="also take authenticated rebuild requests over HTTP here: POST /rebuild/<base> with "
        "'Authorization: Bearer $VOXRECALL_REBUILD_TOKEN' ([index] rebuild_token_env)",
    )
    watch.set_defaults(func=cmd_index_watch, load=load)


def _register_publish(commands: Commands, load: Loader) -> None:
    publish = commands.add_parser(
        "publish",
        help="copy the newest snapshot of each base into a folder or an S3 bucket",
        description="Copy each base's newest verified snapshot from [index] store into DIR, or "
        "to s3://bucket/prefix, files first and the LATEST pointer last, so sidecars polling it "
        "(or an HTTP server over DIR) never see a partial version. In a folder, older versions "
        "beyond [index] keep_versions are pruned; in a bucket nothing is deleted (use a "
        "lifecycle rule). [index] s3_endpoint_url and s3_region say where the S3 API is.",
    )
    publish.add_argument("--config", type=Path, default=DEFAULT_CONFIG, help=CONFIG_HELP)
    publish.add_argument(
        "--to", required=True, help="the folder, or s3://bucket/prefix, to publish into"
    )
    publish.add_argument(
        "--kb", action="append", default=[], help="only this knowledge base (repeatable)"
    )
    publish.set_defaults(func=cmd_index_publish, load=load)


def _register_rollback(commands: Commands, load: Loader) -> None:
    rollback = commands.add_parser(
        "rollback",
        help="publish a kept older version of a base again, as its newest version",
        description="Verify VERSION, a version of KB still kept in [index] store, and publish its "
        "files as a new version (a newer id, the same content), LATEST written last: sidecars "
        "take it at their next poll as any new build (they refuse a pointer moved back), and "
        "`voxrecall index publish --to` carries it on. The next build publishes the sources "
        "again: fix them first.",
    )
    rollback.add_argument("--config", type=Path, default=DEFAULT_CONFIG, help=CONFIG_HELP)
    rollback.add_argument("--kb", required=True, help="the knowledge base to roll back")
    rollback.add_argument(
        "--to", required=True, metavar="VERSION", help="the kept version whose content to publish"
    )
    rollback.set_defaults(func=cmd_index_rollback, load=load)


def register_source(commands: Commands, load: Loader) -> None:
    """``voxrecall source add | approve | reject | list`` (index/curation.py)."""
    source = commands.add_parser(
        "source",
        help="propose, approve, reject and list sources of a curated knowledge base",
        description="A proposed source (a URL or a Markdown/text file) is pending until approved; "
        "builds index only approved ones. The registry is [index] registry (sources.json).",
    )
    source_commands = source.add_subparsers(dest="source_command", required=True)
    who = os.environ.get("USER", "") or "unknown"
    add = source_commands.add_parser("add", help="record a proposed source as pending")
    add.add_argument("location", help="an http(s) URL, or a Markdown or text file")
    add.add_argument("--kb", required=True, help="the knowledge base it is proposed for")
    add.add_argument("--by", default=who, help="who proposes it (a person, or an agent's name)")
    add.add_argument("--note", default="", help="why (shown by list)")
    add.set_defaults(func=cmd_source_add)
    for status, verb in (("approved", "approve"), ("rejected", "reject")):
        decide = source_commands.add_parser(verb, help=f"{verb} a proposed source by its id")
        decide.add_argument("id", help="the id `voxrecall source list` shows")
        decide.add_argument("--by", default=who, help="who decides")
        decide.set_defaults(func=cmd_source_decide, status=status)
    listing = source_commands.add_parser("list", help="pending, approved and rejected sources")
    listing.add_argument("--kb", default="", help="only this knowledge base")
    listing.add_argument("--status", choices=("pending", "approved", "rejected"))
    listing.add_argument("--json", action="store_true", help="print the entries as JSON")
    listing.set_defaults(func=cmd_source_list)
    for p in (add, listing, *(source_commands.choices[v] for v in ("approve", "reject"))):
        p.add_argument("--config", type=Path, default=DEFAULT_CONFIG, help=CONFIG_HELP)
        p.set_defaults(load=load)


def register_snapshot(commands: Commands, load: Loader) -> None:
    """``voxrecall snapshot verify``."""
    snapshot = commands.add_parser("snapshot", help="operate on snapshot folders")
    snapshot_commands = snapshot.add_subparsers(dest="snapshot_command", required=True)
    verify = snapshot_commands.add_parser(
        "verify", help="check a snapshot folder's files against its manifest"
    )
    verify.add_argument("path", type=Path, help="a snapshot version folder")
    verify.add_argument(
        "--config",
        type=Path,
        help="also check the embedder name and dimension against this config's, and load it",
    )
    verify.set_defaults(func=cmd_snapshot_verify, load=load)
