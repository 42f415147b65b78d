"""The commands that examine one checkpoint: ``info`` (what it holds, how it was saved) and
``verify`` (every item read back and checked). Both import torch (they unpickle
``.metadata``). Registered with the other lifecycle commands by
:func:`dcp_volumes.cli.lifecycle.register`.
"""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING, Any

from dcp_volumes.cli._exit import EXIT_FAILURE, EXIT_OK
from dcp_volumes.cli._format import (
    human_bytes,
    print_json,
    print_table,
    progress_bar,
    when,
)
from dcp_volumes.cli._options import (
    positive_count,
    storage_options_for,
    storage_options_parser,
)

if TYPE_CHECKING:
    from dcp_volumes.catalog import CheckpointDetails, VerifyReport

__all__ = ["register"]


def register(sub: Any, common: argparse.ArgumentParser) -> None:
    """Add ``info`` and ``verify`` to ``sub``."""
    _add_info(sub, common)
    _add_verify(sub, common)


# --------------------------------------------------------------------------------------------
# info


def _add_info(sub: Any, common: argparse.ArgumentParser) -> None:
    p = sub.add_parser(
        "info",
        parents=[common, storage_options_parser()],
        help="show a checkpoint's state-dict keys, shapes, dtypes and sizes",
        description=(
            "Show what a checkpoint holds (state-dict keys, shapes, dtypes, sizes) and how it\n"
            "was saved (time, writer and torch version, world size), from .metadata and the\n"
            "manifest. Reads no shard data."
        ),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("url", metavar="URL", help="checkpoint URL, e.g. s3://bucket/run/step-100")
    p.add_argument("--json", action="store_true", help="print one JSON document")
    p.set_defaults(handler=_run_info)


def _run_info(args: argparse.Namespace) -> int:
    from dcp_volumes.catalog import describe

    details = describe(args.url, storage_options=storage_options_for(args, args.url))
    if args.json:
        print_json(details.as_dict())
        return EXIT_OK
    _print_details(details)
    return EXIT_OK


def _print_details(d: CheckpointDetails) -> None:
    world = (
        str(d.world_size)
        if d.world_size is not None
        else f"unknown ({d.ranks_in_files} ranks wrote files)"
    )
    summary = [
        ("checkpoint", d.url),
        ("saved", when(d.save_time) + (" UTC" if d.save_time is not None else "")),
        ("save id", d.save_id or "-"),
        ("writer", d.writer or "not dcp_volumes (no manifest)"),
        ("torch", d.torch_version or "-"),
        ("world size", world),
        ("checksums", "yes (CRC32C per item)" if d.checksummed else "no"),
        ("stored", f"{human_bytes(d.total_bytes)} in {d.objects} objects ({d.files} shard files)"),
        ("entries", str(len(d.entries))),
    ]
    for key, value in summary:
        print(f"{key:<12}{value}")
    print()
    rows = [
        [
            e.key,
            e.dtype or "object",
            "-" if e.shape is None else "x".join(map(str, e.shape)) or "scalar",
            "-" if e.nbytes is None else human_bytes(e.nbytes),
            human_bytes(e.stored_bytes),
            str(e.chunks),
        ]
        for e in d.entries
    ]
    print_table(["key", "dtype", "shape", "size", "stored", "chunks"], rows, right={3, 4, 5})


# --------------------------------------------------------------------------------------------
# verify


def _add_verify(sub: Any, common: argparse.ArgumentParser) -> None:
    p = sub.add_parser(
        "verify",
        parents=[common, storage_options_parser()],
        help="re-read a checkpoint and check every item's size and CRC32C",
        description=(
            "Read every shard file back (each once, in ranged reads) and check sizes and\n"
            "CRC32C against the manifest. Checkpoints written by torch's own writers have no\n"
            "manifest: only that their files exist and are large enough is checked.\n"
            "Exit code 1 on any mismatch."
        ),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("url", metavar="URL", help="checkpoint URL")
    p.add_argument(
        "--concurrency", type=positive_count, default=4, metavar="N", help="files read at once (4)"
    )
    p.add_argument("--json", action="store_true", help="print one JSON document")
    p.set_defaults(handler=_run_verify)


def _run_verify(args: argparse.Namespace) -> int:
    from dcp_volumes.catalog import verify

    with progress_bar("verify", enabled=not args.json, unit="bytes") as progress:
        report = verify(
            args.url,
            storage_options=storage_options_for(args, args.url),
            max_concurrency=args.concurrency,
            progress=progress,
        )
    if args.json:
        print_json(report.as_dict())
    else:
        _print_verify(report)
    return EXIT_OK if report.ok else EXIT_FAILURE


def _print_verify(r: VerifyReport) -> None:
    rows = [
        [
            f.name,
            f.status,
            human_bytes(f.expected_size),
            "-" if f.actual_size is None else human_bytes(f.actual_size),
        ]
        for f in r.files
    ]
    print_table(
        ["file", "status", "expected", "stored"],
        rows,
        right={2, 3},
        styles=[None if f.ok else "bold red" for f in r.files],
    )
    for f in r.files:
        for item in f.bad_items:
            print(f"  {f.name}: {item}")
    bad = [f for f in r.files if not f.ok]
    verdict = "OK" if not bad else f"FAILED ({len(bad)} of {len(r.files)} files)"
    print(f"{verdict}: {r.url}: {r.note}; {human_bytes(r.bytes_read)} read")
