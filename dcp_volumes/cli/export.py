"""``dcp-volumes export SRC DEST --to safetensors``: a committed checkpoint to Hugging Face
safetensors (:func:`dcp_volumes.export.export_safetensors`).

Prints a summary (tensors, bytes, files, MB/s, skipped non-tensor items), or one JSON
document with ``--json``; a progress bar on a terminal. Imports torch (it reads
``.metadata``) only when it runs.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

from dcp_volumes import errors
from dcp_volumes.cli._exit import EXIT_OK
from dcp_volumes.cli._format import human_bytes, plural, print_json, progress_bar, redact
from dcp_volumes.cli._options import key_value, storage_options_for, storage_options_parser

__all__ = ["register"]


def register(sub: Any, common: argparse.ArgumentParser) -> None:
    """Add ``export`` to ``sub``."""
    p = sub.add_parser(
        "export",
        parents=[common, storage_options_parser()],
        help="export a checkpoint to Hugging Face safetensors",
        description=(
            "Export the committed checkpoint SRC to Hugging Face safetensors at DEST (a URL on\n"
            "any store, or a local directory): model.safetensors when it fits in\n"
            "--max-shard-size, else model-0000i-of-0000N.safetensors and\n"
            "model.safetensors.index.json. Checksums are verified as on load; bytes stream\n"
            "from store to store with flat memory; the index (or the single file) is written\n"
            "last, so a partial export never looks complete. Under torchrun, every rank\n"
            "writes its share of the files.\n\n"
            "An earlier export at DEST is removed before the new one is written (its index\n"
            "or model.safetensors first): if the new export fails or is killed, DEST holds\n"
            "neither. So when DEST holds one, export asks first (on a terminal) or refuses\n"
            "(exit 1) unless --replace is given. Only files of this naming scheme that the\n"
            "earlier export wrote are removed. DEST may not be SRC or inside it; of two\n"
            "exports to one DEST at the same time, the one that started last goes on and\n"
            "the other stops with an error."
        ),
        epilog=(
            "examples:\n"
            "  dcp-volumes export s3://bucket/run-42/step-1000 s3://bucket/hf/run-42 "
            "--prefix model.\n"
            "  dcp-volumes export /ckpt/step-100 ./hf --prefix model. --dtype bf16 --json\n"
            "  dcp-volumes export /ckpt/step-100 ./hf --prefix model. --keep-tied"
        ),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("src", metavar="SRC", help="committed checkpoint URL (s3://, gs://, az://, dir)")
    p.add_argument("dest", metavar="DEST", help="destination URL or local directory")
    p.add_argument("--to", choices=["safetensors"], default="safetensors",
                   help="output format (default: safetensors)")
    p.add_argument("--prefix", metavar="PREFIX",
                   help="keep only keys under PREFIX, stripped (e.g. 'model.')")
    p.add_argument("--dtype", choices=["bf16", "fp16", "fp32"],
                   help="cast floating tensors to this dtype")
    p.add_argument("--max-shard-size", default="5GB", metavar="SIZE",
                   help="most tensor bytes per file: 5GB (= 5*10**9, the default), 500MiB, ...")
    p.add_argument("--keep-tied", action="store_true",
                   help="write tied duplicates too (by default lm_head.weight is left out "
                   "when its bytes equal the embedding's, as save_pretrained does)")
    p.add_argument("--tie", action="append", default=[], type=_name_pair,
                   metavar="NAME=KEPT",
                   help="leave out exported tensor NAME as a duplicate of KEPT, checked "
                   "byte-equal (repeatable; replaces the lm_head.weight default)")
    p.add_argument("--extension", action="append", default=[], metavar="MODULE:CLASS",
                   help="a torch StreamTransformExtension the checkpoint was written "
                   "through, imported and registered to decode it (repeatable)")
    p.add_argument("--dest-option", dest="dest_option", action="append", default=[],
                   type=key_value, metavar="KEY=VALUE",
                   help="an fsspec option for DEST only, repeatable (the storage flags apply "
                   "to DEST too when it is on the same kind of store as SRC)")
    p.add_argument("--replace", action="store_true",
                   help="replace an earlier export at DEST without asking (it is removed "
                   "before the new one is written)")
    p.add_argument("--json", action="store_true", help="print one JSON document")
    p.set_defaults(handler=_run_export)


def _name_pair(text: str) -> tuple[str, str]:
    name, sep, kept = text.partition("=")
    if not sep or not name or not kept:
        raise argparse.ArgumentTypeError(f"expected NAME=KEPT (two tensor names), got {text!r}")
    return name, kept


def _scheme(url: str) -> str:
    return url.split("://", 1)[0] if "://" in url else "file"


def _dest_options(args: argparse.Namespace) -> dict[str, Any]:
    if _scheme(args.dest) == _scheme(args.src):
        opts = storage_options_for(args, args.dest)
    else:
        from dcp_volumes.backends import backend_class

        opts = backend_class(args.dest).cli_options(endpoint=None, anon=False, url=args.dest)
    opts.update(dict(args.dest_option))
    return opts


def _ask(names: list[str]) -> bool:
    """Whether to remove the earlier export (``names``: its commit) at DEST: ask on a
    terminal, decline elsewhere (``--replace`` skips the question)."""
    if not (sys.stdin.isatty() and sys.stderr.isatty()):
        return False
    print(f"DEST holds an earlier export ({', '.join(names)}). It is removed before the new "
          "one is written; if this export fails, DEST holds neither. Replace it? [y/N] ",
          end="", file=sys.stderr, flush=True)
    return sys.stdin.readline().strip().lower() in ("y", "yes")


def _tied(args: argparse.Namespace) -> str | dict[str, str]:
    if args.keep_tied and args.tie:
        raise errors.ConfigError("--keep-tied writes every tensor and --tie leaves one out: "
                                 "pass one of them")
    return "keep" if args.keep_tied else dict(args.tie) if args.tie else "auto"


def _registry(specs: list[str]) -> Any:
    """torch's ExtensionRegistry with each ``MODULE:CLASS`` (named by the user, never read
    from storage) imported and registered; None when none is named."""
    if not specs:
        return None
    import importlib

    from torch.distributed.checkpoint._extension import ExtensionRegistry

    registry = ExtensionRegistry()
    for spec in specs:
        module, _, name = spec.partition(":")
        try:
            registry.register(getattr(importlib.import_module(module), name))
        except (ImportError, AttributeError, ValueError) as exc:
            raise errors.ConfigError(
                f"--extension {spec!r} cannot be registered ({type(exc).__name__}: {exc}): "
                "name an importable torch StreamTransformExtension as MODULE:CLASS (its "
                "module on PYTHONPATH)") from None
    return registry


def _run_export(args: argparse.Namespace) -> int:
    from dcp_volumes.export import export_safetensors, parse_size

    parse_size(args.max_shard_size)  # a bad size fails before torch is imported
    tied = _tied(args)
    with progress_bar("export", enabled=not args.json, unit="bytes") as progress:
        report = export_safetensors(
            args.src, args.dest, prefix=args.prefix, dtype=args.dtype,
            max_shard_size=args.max_shard_size, tied=tied,
            storage_options=storage_options_for(args, args.src),
            dest_storage_options=_dest_options(args), progress=progress,
            replace=True if args.replace else _ask,
            extension_registry=_registry(args.extension))
    if args.json:
        print_json({"src": redact(args.src), **report.to_dict()})
        return EXIT_OK
    index = f" + {report.index}" if report.index else ""
    print(f"exported {plural(report.tensors, 'tensor')} ({human_bytes(report.bytes)}) from "
          f"{redact(args.src)} to {report.dest}: {plural(len(report.files), 'file')}{index}, "
          f"{report.seconds:.1f}s, {report.mb_per_s:.1f} MB/s, checksums "
          f"{'verified' if report.verified else 'not available (not written by dcp_volumes)'}")
    if report.skipped:
        shown = ", ".join(report.skipped[:5]) + (", ..." if len(report.skipped) > 5 else "")
        print(f"skipped {plural(len(report.skipped), 'non-tensor item')}: {shown}")
    if report.tied:
        shown = ", ".join(f"{a} (= {b})" for a, b in report.tied[:5])
        print(f"left out {plural(len(report.tied), 'tied duplicate')}: {shown}")
    if report.not_selected:
        print(f"left out {plural(report.not_selected, 'item')} outside the prefix or dropped")
    return EXIT_OK
