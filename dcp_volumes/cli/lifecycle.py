"""The lifecycle commands that read: ``ls`` and ``latest`` here, ``info`` and ``verify`` (one
checkpoint examined) in :mod:`~dcp_volumes.cli.examine`; ``rm`` and ``gc``, which delete, in
:mod:`~dcp_volumes.cli.removal`.

They take the storage flags (:func:`~dcp_volumes.cli._options.storage_options_parser`) and
call :mod:`dcp_volumes.catalog`. Only ``info`` and ``verify`` import torch (they unpickle
``.metadata``); ``ls`` and ``latest`` start fast.
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import TYPE_CHECKING, Any

from dcp_volumes.cli import examine, removal
from dcp_volumes.cli._exit import EXIT_NOT_FOUND, EXIT_OK, PROG
from dcp_volumes.cli._format import (
    human_bytes,
    plural,
    print_json,
    print_table,
    redact,
    when,
)
from dcp_volumes.cli._options import (
    add_step_pattern,
    count_or_zero,
    storage_options_for,
    storage_options_parser,
)
from dcp_volumes.errors import ConfigError

if TYPE_CHECKING:
    from dcp_volumes.catalog import CheckpointInfo

__all__ = ["register"]


def register(sub: Any, common: argparse.ArgumentParser) -> None:
    """Add ``ls``, ``latest``, ``info``, ``verify``, ``rm`` and ``gc`` to ``sub``."""
    for add in (_add_ls, _add_latest):
        add(sub, common)
    examine.register(sub, common)
    removal.register(sub, common)


def _add_ls(sub: Any, common: argparse.ArgumentParser) -> None:
    p = sub.add_parser(
        "ls",
        parents=[common, storage_options_parser()],
        help="list the checkpoints under a run root",
        description=(
            "List the checkpoints under a run root: step, complete or not, size, objects,\n"
            "commit time. One recursive listing of the root, however many checkpoints."
        ),
        epilog=(
            "examples:\n  dcp-volumes ls s3://bucket/run-42/\n  dcp-volumes ls /ckpt/run-1 --json\n"
            "  dcp-volumes ls s3://bucket/run-42/ --local-tier /nvme/dcp-tier"
        ),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("root", metavar="ROOT", help="run root: s3://bucket/run/, gs://, az://, a dir")
    add_step_pattern(p)
    p.add_argument("--json", action="store_true", help="print one JSON document")
    p.add_argument(
        "--check", type=count_or_zero, default=None, metavar="N",
        help="read the .metadata and manifest of the newest N committed checkpoints (and on "
        "until one loads) to tell 'complete' from 'unreadable' (default 16); 0 lists only, "
        "without importing torch (statuses show 'committed')",
    )
    p.add_argument(
        "--local-tier", metavar="DIR",
        help="also show what this node's local tier (LocalTierOptions.directory) holds: a "
        "'tier' column says durable (in the store), '+ local copy', or local-only (in local "
        "tiers only: not durable)",
    )
    p.set_defaults(handler=_run_ls)


def _check_local_tier(directory: str) -> None:
    """``--local-tier`` must name an existing directory: a typo must not read as an empty
    tier ("no checkpoints")."""
    if not os.path.exists(directory):
        raise ConfigError(f"--local-tier {directory!r} does not exist: pass the "
                          "LocalTierOptions.directory of this node's saves")
    if not os.path.isdir(directory):
        raise ConfigError(f"--local-tier {directory!r} is not a directory: pass the "
                          "LocalTierOptions.directory of this node's saves")


def _run_ls(args: argparse.Namespace) -> int:
    from dcp_volumes.catalog import list_checkpoints

    if args.local_tier is not None:
        _check_local_tier(args.local_tier)  # before any request to the store
    kwargs = {} if args.check is None else {"check": args.check}
    infos = list_checkpoints(
        args.root,
        storage_options=storage_options_for(args, args.root),
        step_pattern=args.step_pattern,
        **kwargs,
    )
    if args.local_tier is not None:
        return _ls_with_tier(args, infos)
    if args.json:
        print_json({"root": redact(args.root), "checkpoints": [_info_doc(i) for i in infos]})
        return EXIT_OK
    if not infos:
        print(f"no checkpoints under {redact(args.root)}", file=sys.stderr)
        return EXIT_OK
    rows = [
        [
            "-" if i.step is None else str(i.step),
            i.name,
            i.status,
            human_bytes(i.bytes),
            str(i.objects),
            when(i.commit_time),
        ]
        for i in infos
    ]
    complete = sum(i.complete for i in infos)
    print_table(
        ["step", "name", "status", "size", "objects", "committed (UTC)"],
        rows,
        right={0, 3, 4},
        styles=[None if i.complete else "yellow" for i in infos],
    )
    print(
        f"{plural(len(infos), 'checkpoint')} ({complete} complete, {len(infos) - complete} "
        f"incomplete), {human_bytes(sum(i.bytes for i in infos))}"
    )
    return EXIT_OK


# --------------------------------------------------------------------------------------------
# latest


def _add_latest(sub: Any, common: argparse.ArgumentParser) -> None:
    p = sub.add_parser(
        "latest",
        parents=[common, storage_options_parser()],
        help="print the URL of the newest complete checkpoint",
        description=(
            "Print the URL of the newest complete checkpoint (highest step) under a run root.\n"
            "Exit code 3 when there is none, so scripts can branch on it."
        ),
        epilog='example:\n  url=$(dcp-volumes latest s3://bucket/run-42/) && echo "resume from $url"',
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("root", metavar="ROOT", help="run root")
    add_step_pattern(p)
    p.add_argument("--json", action="store_true", help="print the checkpoint as JSON")
    p.set_defaults(handler=_run_latest)


def _run_latest(args: argparse.Namespace) -> int:
    from dcp_volumes.catalog import latest

    info = latest(
        args.root,
        storage_options=storage_options_for(args, args.root),
        step_pattern=args.step_pattern,
    )
    if info is None:
        if args.json:
            print_json(None)
        print(f"{PROG}: no complete checkpoint under {redact(args.root)}", file=sys.stderr)
        return EXIT_NOT_FOUND
    if args.json:
        print_json(_info_doc(info))
    else:
        print(redact(info.url))
    return EXIT_OK


def _info_doc(info: CheckpointInfo) -> dict[str, Any]:
    return {**info.as_dict(), "url": redact(info.url)}


def _ls_with_tier(args: argparse.Namespace, infos: list[CheckpointInfo]) -> int:
    """``ls --local-tier``: the store's checkpoints with their tier, and the local-only saves
    this node's tier holds (never durable) as rows of their own."""
    from dcp_volumes.catalog import local_tier_copies

    copies = local_tier_copies(args.root, args.local_tier, step_pattern=args.step_pattern)
    local_copy = {c.name for c in copies if c.kind == "local-copy"}
    durable = {i.name for i in infos if i.complete}
    local_only = [c for c in copies if c.kind == "local-only" and c.name not in durable]

    def tier_of(info: CheckpointInfo) -> str | None:
        if not info.complete:
            return None
        return "durable" + (" + local copy" if info.name in local_copy else "")

    # one row per store checkpoint, then the local-only saves, merged by step
    entries: list[tuple[tuple[bool, int, str], list[str], dict[str, Any], str | None]] = []
    for i in infos:
        tier = tier_of(i)
        cells = ["-" if i.step is None else str(i.step), i.name, i.status, tier or "-",
                 human_bytes(i.bytes), str(i.objects), when(i.commit_time)]
        doc = {**_info_doc(i), "tier": "durable" if i.complete else None, "durable": i.complete,
               "local_copy": i.name in local_copy}
        entries.append(((i.step is None, i.step or 0, i.name), cells, doc,
                        None if i.complete else "yellow"))
    for c in local_only:
        status = "local-only" if c.complete_here else \
            f"local-only, {len(c.ranks)} of {c.world} ranks here"
        cells = ["-" if c.step is None else str(c.step), c.name, status,
                 "local-only (not durable)", human_bytes(c.bytes), str(c.files),
                 when(c.created)]
        doc = {"url": redact(args.root.rstrip("/") + "/" + c.name), "name": c.name,
               "step": c.step, "status": "local-only", "tier": "local-only",
               "durable": False, "local_copy": True, "bytes": c.bytes, "objects": c.files,
               "commit_time": c.created, "local_ranks": list(c.ranks), "world": c.world,
               "complete_here": c.complete_here}
        entries.append(((c.step is None, c.step or 0, c.name), cells, doc, "cyan"))
    entries.sort(key=lambda e: e[0])
    if args.json:
        print_json({"root": redact(args.root), "local_tier": args.local_tier,
                    "checkpoints": [e[2] for e in entries]})
        return EXIT_OK
    if not entries:
        print(f"no checkpoints under {redact(args.root)} or in the local tier "
              f"{args.local_tier}", file=sys.stderr)
        return EXIT_OK
    print_table(
        ["step", "name", "status", "tier", "size", "objects", "committed (UTC)"],
        [e[1] for e in entries],
        right={0, 4, 5},
        styles=[e[3] for e in entries],
    )
    complete = sum(i.complete for i in infos)
    print(
        f"{plural(len(infos), 'checkpoint')} in the store ({complete} durable, "
        f"{len(local_copy & durable)} with a local copy here), "
        f"{plural(len(local_only), 'local-only save')} in {args.local_tier} (not durable: "
        "lost with this node's disk)"
    )
    return EXIT_OK
