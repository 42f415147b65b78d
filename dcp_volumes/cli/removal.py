"""The lifecycle commands that delete: ``rm`` (one checkpoint) and ``gc`` (what failed saves
left under a run root).

Both confirm deletion the same way: ``--yes`` deletes; without it they report what they
would delete and, on a terminal (and without ``--json`` or ``--dry-run``), ask
``[y/N]``; anywhere else (a script, a pipe) they stop at that report, a dry run that says to
pass ``--yes``. ``--dry-run`` reports without asking. ``gc`` imports torch (it unpickles
``.metadata``); ``rm`` starts fast.
"""

from __future__ import annotations

import argparse
import sys
from typing import TYPE_CHECKING, Any

from dcp_volumes.cli._exit import EXIT_OK
from dcp_volumes.cli._format import human_bytes, plural, print_json, progress_bar, redact, when
from dcp_volumes.cli._options import (
    add_step_pattern,
    age_s,
    storage_options_for,
    storage_options_parser,
)

if TYPE_CHECKING:
    from dcp_volumes.catalog import GcReport

__all__ = ["register"]

_CONFIRM = (
    "Deletes only with --yes. Without it: reports what it would delete, then asks [y/N]\n"
    "on a terminal; elsewhere (a script, a pipe, --json) stops there (a dry run, exit 0).\n"
    "--dry-run reports without asking."
)
_DRY = "dry run: nothing was deleted; run again with --yes to delete"


def register(sub: Any, common: argparse.ArgumentParser) -> None:
    """Add ``rm`` and ``gc`` to ``sub``."""
    _add_rm(sub, common)
    _add_gc(sub, common)


def _add_confirmation(p: argparse.ArgumentParser) -> None:
    either = p.add_mutually_exclusive_group()
    either.add_argument("--yes", action="store_true", help="delete without asking")
    either.add_argument("--dry-run", action="store_true",
                        help="only report what would be deleted (do not ask)")


def _deletes(args: argparse.Namespace, question: str) -> bool:
    """Whether to delete: ``--yes``, or a ``y`` at the prompt on a terminal."""
    if args.yes:
        return True
    if args.dry_run or args.json or not (sys.stdin.isatty() and sys.stderr.isatty()):
        return False
    print(f"{question} [y/N] ", end="", file=sys.stderr, flush=True)
    return sys.stdin.readline().strip().lower() in ("y", "yes")


# --------------------------------------------------------------------------------------------
# rm


def _add_rm(sub: Any, common: argparse.ArgumentParser) -> None:
    p = sub.add_parser(
        "rm",
        parents=[common, storage_options_parser()],
        help="remove one checkpoint (.metadata first)",
        description=(
            "Remove one checkpoint: .metadata first, so readers never see it partially\n"
            "deleted, then its other objects. A removal that fails (exit 1) leaves either\n"
            "the complete checkpoint or garbage that gc collects; run rm again to finish.\n"
            "Refuses a URL holding sub-directories (a run root) or no checkpoint files.\n"
            "Node-local tiers are not touched: local copies of it stay until the tier's\n"
            "retention evicts them, and local-only saves that continued it are never\n"
            "loaded again (docs/guarantees.md, lineage rule).\n\n"
            + _CONFIRM
        ),
        epilog="examples:\n  dcp-volumes rm s3://bucket/run-42/step-100\n"
        "  dcp-volumes rm s3://bucket/run-42/step-100 --yes",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("url", metavar="URL", help="checkpoint URL")
    _add_confirmation(p)
    p.add_argument("--json", action="store_true", help="print one JSON document")
    p.set_defaults(handler=_run_rm)


def _run_rm(args: argparse.Namespace) -> int:
    from dcp_volumes.catalog import remove

    options = storage_options_for(args, args.url)
    delete = args.yes
    if not delete:
        listed = remove(args.url, storage_options=options, dry_run=True)
        if not args.json:
            print(f"would remove {redact(args.url)} ({len(listed)} objects)")
        delete = _deletes(args, f"remove {redact(args.url)} ({len(listed)} objects)?")
        if not delete:
            _print_rm(args, listed, dry_run=True)
            return EXIT_OK
    _print_rm(args, remove(args.url, storage_options=options, dry_run=False), dry_run=False)
    return EXIT_OK


def _print_rm(args: argparse.Namespace, objects: list[str], *, dry_run: bool) -> None:
    if args.json:
        print_json({"url": redact(args.url), "dry_run": dry_run, "objects": objects})
    elif dry_run:
        print(_DRY)
    else:
        print(f"removed {redact(args.url)} ({len(objects)} objects)")


# --------------------------------------------------------------------------------------------
# gc


def _add_gc(sub: Any, common: argparse.ArgumentParser) -> None:
    p = sub.add_parser(
        "gc",
        parents=[common, storage_options_parser()],
        help="collect stale incomplete checkpoints, leftover shards and multipart uploads",
        description=(
            "Find what failed or superseded saves (or an interrupted rm) left under a run\n"
            "root, older than --older-than: incomplete checkpoints (no .metadata), shards\n"
            "and manifests of saves that never committed inside complete checkpoints, and\n"
            "stale S3 multipart uploads. Only the store: node-local tiers keep their own\n"
            "retention (LocalTierOptions keep_last / max_bytes).\n\n" + _CONFIRM
        ),
        epilog="examples:\n  dcp-volumes gc s3://bucket/run-42/\n"
        "  dcp-volumes gc s3://bucket/run-42/ --older-than 6h --yes",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("root", metavar="ROOT", help="run root")
    p.add_argument(
        "--older-than",
        type=age_s,
        default=3600.0,
        metavar="AGE",
        help="only collect saves whose newest object is older than this (units s, m, h, d; "
        "default 1h). A save whose live record is fresh (rewritten every 30 s while it "
        "uploads) is never collected, whatever this says",
    )
    _add_confirmation(p)
    add_step_pattern(p)
    p.add_argument("--json", action="store_true", help="print one JSON document")
    p.set_defaults(handler=_run_gc)


def _run_gc(args: argparse.Namespace) -> int:
    report = _gc(args, delete=args.yes)
    if not args.yes:
        if not args.json:
            _print_gc(report, hint=False)
        if report.empty or not _deletes(args, "delete these?"):
            if args.json:
                print_json(report.as_dict())
            elif not report.empty:
                print(_DRY)
            return EXIT_OK
        report = _gc(args, delete=True)  # judged again: what is stale now
    if args.json:
        print_json(report.as_dict())
    else:
        _print_gc(report)
    return EXIT_OK


def _gc(args: argparse.Namespace, *, delete: bool) -> GcReport:
    from dcp_volumes.catalog import gc

    with progress_bar("gc", enabled=not args.json and delete, unit="objects") as progress:
        return gc(
            args.root,
            older_than_s=args.older_than,
            storage_options=storage_options_for(args, args.root),
            step_pattern=args.step_pattern,
            dry_run=not delete,
            progress=progress,
        )


def _print_gc(r: GcReport, *, hint: bool = True) -> None:
    from dcp_volumes.goodput import format_duration

    verb = "would remove" if r.dry_run else "removed"
    print(f"gc of {r.root} (older than {format_duration(r.older_than_s)})")
    for url in r.incomplete:
        print(f"  {verb} incomplete checkpoint {url}")
    for url in r.leftovers:
        print(f"  {verb} leftover {url}")
    for up in r.uploads:
        print(
            f"  {'would abort' if r.dry_run else 'aborted'} multipart upload {up['key']} "
            f"(started {when(up['initiated'])} UTC)"
        )
    for line in r.skipped:
        print(f"  kept {line}")
    if r.empty:
        print("nothing to collect")
        return
    print(
        f"{verb}: {plural(len(r.incomplete), 'incomplete checkpoint')}, "
        f"{plural(len(r.leftovers), 'leftover object')} ({human_bytes(r.bytes)}), "
        f"{plural(len(r.uploads), 'multipart upload')}"
    )
    if r.dry_run and hint:
        print(_DRY)
