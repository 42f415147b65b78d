"""The ``dcp-volumes`` command.

Each subcommand is two functions. ``_add_<name>(sub, common)`` declares its parser with
``sub.add_parser("<name>", parents=[common], ...)`` (``common`` carries ``--debug``) and calls
``set_defaults(handler=_run_<name>)``; ``_run_<name>(args) -> int`` does the work and returns
the exit code. To add one, write both (here or in a module of its own) and append
``_add_<name>`` to :data:`_SUBCOMMANDS` at the bottom of this file; ``--json`` output goes
through :func:`_print_json`. Commands that touch storage also take ``parents=[_storage_options()]``
(``--endpoint-url``, ``--storage-option``, ``--anon``) and build their fsspec options with
:func:`_storage_options_for`. Handlers raise; they never print errors or call ``sys.exit``:
:func:`main` turns ``dcp_volumes.errors`` exceptions, ``OSError`` and ``ValueError`` into one line
``dcp-volumes: error: ...`` on stderr (the traceback only with ``--debug``) and picks the exit
code. Exit codes (stable; scripts rely on them):

* 0 -- success.
* 1 -- failure: a store error, or ``verify`` found a mismatch.
* 2 -- usage or configuration error (bad flag, bad URL, bad option).
* 3 -- not found: no checkpoint, an incomplete one, a missing bucket, or ``latest`` found no
  complete checkpoint.
* 130 -- interrupted (Ctrl-C).

The commands import torch only where they must unpickle ``.metadata`` (``info``, ``verify``,
``gc``); ``ls``, ``latest``, ``rm`` and ``plan`` start fast.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as _dt
import json
import logging
import math
import os
import re
import sys
import traceback
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any, NoReturn

from dcp_volumes.errors import (
    BucketNotFoundError,
    CheckpointNotFoundError,
    ConfigError,
    DCPVolumesError,
    IncompleteCheckpointError,
)

if TYPE_CHECKING:
    from dcp_volumes.catalog import CheckpointDetails, CheckpointInfo, GcReport, VerifyReport
    from dcp_volumes.goodput import FailureModel, IntervalRow, Plan

__all__ = ["build_parser", "main"]

PROG = "dcp-volumes"
EXIT_OK = 0
EXIT_FAILURE = 1
EXIT_USAGE = 2
EXIT_NOT_FOUND = 3

Handler = Callable[[argparse.Namespace], int]


class _UsageError(ConfigError):
    """The command line itself is wrong (unknown flag, bad value type, missing argument)."""


class _Parser(argparse.ArgumentParser):
    """An ArgumentParser whose errors go through :func:`main`'s one-line error path."""

    def error(self, message: str) -> NoReturn:
        raise _UsageError(f"{message} (see '{self.prog} --help')")


def _common_options() -> argparse.ArgumentParser:
    # Shared by the top-level parser and every subparser, so `--debug` works on either side of
    # the subcommand. SUPPRESS keeps a subparser's default from overwriting the top-level value.
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument(
        "--debug",
        action="store_true",
        default=argparse.SUPPRESS,
        help="log at DEBUG and show full tracebacks on errors",
    )
    return common


def build_parser() -> argparse.ArgumentParser:
    """The ``dcp-volumes`` argument parser with every registered subcommand."""
    common = _common_options()
    parser = _Parser(
        prog=PROG,
        description="PyTorch Distributed Checkpoint on object storage: tools.",
        parents=[common],
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {_version()}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)
    for register in _SUBCOMMANDS:
        register(sub, common)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Run ``dcp-volumes``; returns the process exit code.

    Args:
        argv: Arguments after the program name; ``None`` reads ``sys.argv[1:]``.
    """
    args_list = sys.argv[1:] if argv is None else argv
    debug = "--debug" in args_list
    try:
        args = build_parser().parse_args(args_list)
        debug = bool(getattr(args, "debug", False))
        logging.basicConfig(
            level=logging.DEBUG if debug else logging.WARNING,
            format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        )
        handler: Handler | None = getattr(args, "handler", None)
        if handler is None:
            build_parser().print_help(sys.stderr)
            return EXIT_USAGE
        return handler(args)
    except SystemExit as exc:  # --help / --version exit through argparse
        return exc.code if isinstance(exc.code, int) else EXIT_FAILURE
    except KeyboardInterrupt:
        print(f"{PROG}: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:
        # `dcp-volumes ls ... | head`: the reader left. Say nothing; keep the interpreter from
        # complaining again when it flushes stdout at exit.
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return EXIT_FAILURE
    except (DCPVolumesError, OSError, ValueError) as exc:
        if debug:
            traceback.print_exc()
        print(f"{PROG}: error: {_one_line(exc)}", file=sys.stderr)
        return _exit_code(exc)


def _exit_code(exc: BaseException) -> int:
    if isinstance(exc, (CheckpointNotFoundError, IncompleteCheckpointError, BucketNotFoundError)):
        return EXIT_NOT_FOUND
    # ConfigError is a ValueError, so both read as "change your input".
    return EXIT_USAGE if isinstance(exc, ValueError) else EXIT_FAILURE


def _one_line(exc: BaseException) -> str:
    # Messages may carry newlines (OSError from some backends); the contract is one line.
    return " ".join(str(exc).split()) or type(exc).__name__


def _version() -> str:
    from dcp_volumes._version import __version__

    return __version__


# --------------------------------------------------------------------------------------------
# plan


def _add_plan(sub: Any, common: argparse.ArgumentParser) -> None:
    p = sub.add_parser(
        "plan",
        parents=[common],
        help="choose a checkpoint interval from a failure rate and checkpoint cost",
        description=(
            "Expected goodput over checkpoint intervals, the Young/Daly optimal interval\n"
            "and the odds of an interruption, from a failure rate and a checkpoint cost.\n"
            "Model, assumptions and limits: docs/goodput.md."
        ),
        epilog=(
            "examples:\n"
            "  dcp-volumes plan --gpus 1024 --afr 0.05 --checkpoint-cost-s 45 "
            "--restart-cost-s 600 --job-hours 720\n"
            "  dcp-volumes plan --gpus 4096 --fleet-mtbf-hours 3 --fleet-gpus 16384 "
            "--from-bench bench.jsonl --contender dcp_volumes --async --json"
        ),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "--gpus",
        type=_gpus,
        required=True,
        metavar="N",
        help="GPUs the job needs at once; any one failing interrupts it",
    )
    rate = p.add_argument_group("failure rate (one of)")
    rate.add_argument(
        "--afr",
        type=_non_negative,
        metavar="RATE",
        help="per-GPU annualised failure rate as a fraction (0.05 = 5%%/year)",
    )
    rate.add_argument(
        "--fleet-mtbf-hours",
        type=_positive_or_inf,
        metavar="T",
        help="observed hours between failures across a fleet of --fleet-gpus",
    )
    rate.add_argument("--fleet-gpus", type=_gpus, metavar="G", help="GPUs in that fleet")
    cost = p.add_argument_group("checkpoint cost (one of)")
    cost.add_argument(
        "--checkpoint-cost-s",
        type=_positive,
        metavar="SECONDS",
        help="time one checkpoint blocks training",
    )
    cost.add_argument(
        "--from-bench",
        type=Path,
        metavar="FILE",
        help="median cost from a `dcp-volumes bench` JSON-lines file",
    )
    cost.add_argument(
        "--contender", metavar="NAME", help="with --from-bench: only lines of this contender"
    )
    cost.add_argument(
        "--async",
        dest="use_async",
        action="store_true",
        help=(
            "with --from-bench: use async_block_s (what async_save blocks) not save_s; the "
            "upload still delays durability, so add its duration to --restart-cost-s"
        ),
    )
    p.add_argument(
        "--restart-cost-s",
        type=_non_negative,
        default=0.0,
        metavar="SECONDS",
        help="time from a failure to training again: reschedule, load, warm up (default 0)",
    )
    p.add_argument(
        "--job-hours",
        type=_positive,
        metavar="HOURS",
        help="job duration, for the odds of an interruption and the hours lost",
    )
    p.add_argument(
        "--intervals",
        metavar="LIST",
        help="candidate intervals, e.g. 5m,30m,1h,4h (units s, m, h, d; default "
        "5m,10m,15m,30m,1h,2h,4h,8h,12h,24h)",
    )
    p.add_argument("--daly", action="store_true", help="report Daly's optimum instead of Young's")
    p.add_argument(
        "--plot", type=Path, metavar="PNG", help="also write goodput against interval to this PNG"
    )
    p.add_argument("--json", action="store_true", help="print one JSON document")
    p.set_defaults(handler=_run_plan)


def _run_plan(args: argparse.Namespace) -> int:
    from dcp_volumes.goodput import (
        DEFAULT_INTERVALS_S,
        checkpoint_cost_from_bench,
        parse_duration_s,
        plan_intervals,
        plot_goodput,
    )

    model = _failure_model(args)
    if args.checkpoint_cost_s is not None and args.from_bench is not None:
        raise ConfigError("give --checkpoint-cost-s or --from-bench, not both")
    if args.from_bench is None and (args.contender is not None or args.use_async):
        raise ConfigError("--contender and --async only apply with --from-bench FILE")
    if args.from_bench is not None:
        bench = checkpoint_cost_from_bench(
            args.from_bench, contender=args.contender, use_async=args.use_async
        )
        cost_s, source = bench.seconds, bench.describe()
    elif args.checkpoint_cost_s is not None:
        cost_s, source = args.checkpoint_cost_s, "given"
    else:
        raise ConfigError(
            "give the checkpoint cost: --checkpoint-cost-s SECONDS or --from-bench FILE"
        )
    intervals = (
        [parse_duration_s(t) for t in args.intervals.split(",") if t.strip()]
        if args.intervals is not None
        else DEFAULT_INTERVALS_S
    )
    plan = plan_intervals(
        model,
        checkpoint_cost_s=cost_s,
        restart_cost_s=args.restart_cost_s,
        job_hours=args.job_hours,
        intervals_s=intervals,
        method="daly" if args.daly else "young",
        cost_source=source,
    )
    plot = plot_goodput(plan, args.plot) if args.plot is not None else None
    if args.json:
        doc = plan.to_dict()
        doc["plot"] = str(plot) if plot is not None else None
        _print_json(doc)
    else:
        _print_plan(plan, plot=plot)
    return EXIT_OK


def _failure_model(args: argparse.Namespace) -> FailureModel:
    from dcp_volumes.goodput import FailureModel

    fleet = args.fleet_mtbf_hours is not None or args.fleet_gpus is not None
    if args.afr is not None and fleet:
        raise ConfigError("give --afr or --fleet-mtbf-hours with --fleet-gpus, not both")
    if args.afr is not None:
        return FailureModel.from_afr(args.afr, gpus=args.gpus)
    if args.fleet_mtbf_hours is None or args.fleet_gpus is None:
        raise ConfigError(
            "give a failure rate: --afr RATE (e.g. 0.05), or --fleet-mtbf-hours T together "
            "with --fleet-gpus G"
        )
    return FailureModel.from_fleet(
        mtbf_hours=args.fleet_mtbf_hours, fleet_gpus=args.fleet_gpus, gpus=args.gpus
    )


def _print_plan(plan: Plan, *, plot: Path | None, out: IO[str] | None = None) -> None:
    stream = sys.stdout if out is None else out
    summary = _plan_summary(plan)
    headers, rows, marks = _plan_table(plan)
    try:
        from rich.console import Console
        from rich.table import Table
    except ImportError:
        _print_plain(summary, headers, rows, marks, plan, plot, stream)
        return
    console = Console(file=stream, highlight=False, soft_wrap=True)
    for key, value in summary:
        console.print(f"[bold]{key:<16}[/bold]{value}", markup=True)
    table = Table(show_edge=False, pad_edge=False)
    for i, h in enumerate(headers):
        table.add_column(h, justify="left" if i in (0, len(headers) - 1) else "right")
    for cells, mark in zip(rows, marks):
        table.add_row(
            *cells, style="bold green" if mark == "chosen" else "dim" if mark == "beyond" else None
        )
    console.print()
    console.print(table)
    for w in plan.warnings:
        console.print(f"[yellow]warning:[/yellow] {w}", markup=True)
    if plot is not None:
        console.print(f"plot written to {plot}")


def _print_plain(
    summary: list[tuple[str, str]],
    headers: list[str],
    rows: list[list[str]],
    marks: list[str],
    plan: Plan,
    plot: Path | None,
    stream: IO[str],
) -> None:
    for key, value in summary:
        print(f"{key:<16}{value}", file=stream)
    print(file=stream)
    widths = [max(len(r[i]) for r in [headers, *rows]) for i in range(len(headers))]

    def line(cells: Sequence[str]) -> str:
        last = len(cells) - 1
        return "  ".join(
            c.ljust(w) if i in (0, last) else c.rjust(w)
            for i, (c, w) in enumerate(zip(cells, widths))
        ).rstrip()

    print(line(headers), file=stream)
    print(line(["-" * w for w in widths]), file=stream)
    for cells in rows:
        print(line(cells), file=stream)
    for w in plan.warnings:
        print(f"warning: {w}", file=stream)
    if plot is not None:
        print(f"plot written to {plot}", file=stream)


def _plan_summary(plan: Plan) -> list[tuple[str, str]]:
    from dcp_volumes.goodput import format_duration

    m_h = plan.mttf_hours
    if math.isinf(m_h):
        mttf = "inf (no failures)"
    else:
        human = format_duration(m_h * 3600.0)
        mttf = f"{m_h:.4g} h" + ("" if human == f"{m_h:.4g}h" else f" ({human})")
    lines = [
        ("failure model", plan.failure_model.describe()),
        ("job MTTF", mttf),
        ("checkpoint cost", f"{plan.checkpoint_cost_s:.4g} s ({plan.cost_source})"),
        ("restart cost", f"{plan.restart_cost_s:.4g} s"),
    ]
    if plan.job_hours is not None:
        assert plan.interruption_probability is not None and plan.expected_failures is not None
        lines.append(
            (
                "job",
                (
                    f"{plan.job_hours:g} h: P(>=1 interruption) "
                    f"{_probability(plan.interruption_probability)}, "
                    f"expected interruptions {plan.expected_failures:.3g}"
                ),
            )
        )
    opt = plan.optimum
    if opt is None:
        lines.append(("optimum", "none: with no failures, longer intervals always win"))
    else:
        other = plan.young if plan.method == "daly" else plan.daly
        assert other is not None
        lines.append(
            (
                "optimum",
                (
                    f"{plan.method.capitalize()} {format_duration(opt.interval_s)} -> goodput "
                    f"{opt.goodput:.2%} ({other.kind.capitalize()}: "
                    f"{format_duration(other.interval_s)}, {other.goodput:.2%})"
                ),
            )
        )
    return lines


def _probability(p: float) -> str:
    # 1 − e^(−60) prints as 100.00%, which reads as certainty; say what is known instead.
    if p > 0.9999:
        return "> 99.99%"
    return f"= {p:.2%}"


def _plan_table(plan: Plan) -> tuple[list[str], list[list[str]], list[str]]:
    from dcp_volumes.goodput import format_duration

    with_job = plan.job_hours is not None
    headers = ["interval", "goodput", "ckpt time", "rework/fail"]
    if with_job:
        headers.append("lost h/job")
    headers.append("note")
    entries: list[IntervalRow] = list(plan.rows)
    entries += [r for r in (plan.young, plan.daly) if r is not None]
    entries.sort(key=lambda r: (r.interval_s, r.kind))
    rows: list[list[str]] = []
    marks: list[str] = []
    for r in entries:
        notes = []
        if r.kind != "candidate":
            chosen = r.kind == plan.method
            notes.append(f"{r.kind.capitalize()} optimum{' *' if chosen else ''}")
        if not r.first_order_ok:
            notes.append("beyond model")
        cells = [
            format_duration(r.interval_s),
            f"{r.goodput:.2%}",
            f"{r.overhead:.2%}",
            format_duration(r.rework_s),
        ]
        if with_job:
            assert r.lost_hours is not None
            cells.append(f"{r.lost_hours:.3g}")
        cells.append("; ".join(notes))
        rows.append(cells)
        marks.append(
            "chosen" if r.kind == plan.method else "beyond" if not r.first_order_ok else ""
        )
    return headers, rows, marks


# --------------------------------------------------------------------------------------------
# Storage options shared by the lifecycle commands (ls, latest, info, verify, rm, gc)


def _storage_options() -> argparse.ArgumentParser:
    parent = argparse.ArgumentParser(add_help=False)
    g = parent.add_argument_group(
        "storage",
        "fsspec options for the URL. Credentials come from the environment as usual (AWS_*, "
        "GOOGLE_APPLICATION_CREDENTIALS, AZURE_STORAGE_*); keep them off the command line.",
    )
    g.add_argument(
        "--endpoint-url",
        metavar="URL",
        help="object store endpoint (s3: endpoint_url, default $AWS_ENDPOINT_URL_S3 or "
        "$AWS_ENDPOINT_URL; gs: endpoint_url; az: account_url)",
    )
    g.add_argument(
        "--storage-option",
        "-o",
        dest="storage_option",
        action="append",
        default=[],
        type=_key_value,
        metavar="KEY=VALUE",
        help="any fsspec option, repeatable; VALUE is read as JSON when it is true/false/null, "
        "a number, an object or a list, else as a string",
    )
    g.add_argument("--anon", action="store_true", help="anonymous access (public buckets)")
    return parent


def _key_value(text: str) -> tuple[str, Any]:
    key, sep, raw = text.partition("=")
    if not sep or not key.strip():
        raise argparse.ArgumentTypeError(f"expected KEY=VALUE, got {text!r}")
    value: Any = raw
    if (
        raw in ("true", "false", "null")
        or re.fullmatch(r"-?\d+(\.\d+)?", raw)
        or (raw[:1] in ("{", "["))
    ):
        try:
            value = json.loads(raw)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{key}: {raw!r} is not valid JSON") from None
    return key.strip(), value


def _storage_options_for(args: argparse.Namespace, url: str) -> dict[str, Any]:
    """fsspec options for ``url`` from the flags and the environment (flags win)."""
    from dcp_volumes._fs import _parse_scheme

    _, kind = _parse_scheme(url)
    opts: dict[str, Any] = {}
    endpoint = args.endpoint_url
    if kind == "s3":
        endpoint = (
            endpoint or os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL")
        )
        if endpoint:
            opts["endpoint_url"] = endpoint
    elif endpoint:
        if kind == "gcs":
            opts["endpoint_url"] = endpoint
        elif kind == "azure":
            opts["account_url"] = endpoint
        else:
            raise ConfigError(
                f"--endpoint-url does not apply to {url!r}: it is for s3://, gs:// and az:// URLs"
            )
    if args.anon:
        if kind == "gcs":
            opts["token"] = "anon"
        elif kind in ("s3", "azure"):
            opts["anon"] = True
        else:
            raise ConfigError(f"--anon does not apply to {url!r}")
    opts.update(dict(args.storage_option))
    return opts


def _add_step_pattern(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--step-pattern",
        metavar="REGEX",
        help="regular expression that reads the step from a checkpoint's directory name "
        r"(group 'step', else group 1; default: step-<N>, step_<N> or <N>)",
    )


# --------------------------------------------------------------------------------------------
# ls


def _add_ls(sub: Any, common: argparse.ArgumentParser) -> None:
    p = sub.add_parser(
        "ls",
        parents=[common, _storage_options()],
        help="list the checkpoints under a run root",
        description=(
            "List the checkpoints under a run root: step, complete or not, size, objects,\n"
            "commit time. One recursive listing of the root, however many checkpoints."
        ),
        epilog="examples:\n  dcp-volumes ls s3://bucket/run-42/\n  dcp-volumes ls /ckpt/run-1 --json",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("root", metavar="ROOT", help="run root: s3://bucket/run/, gs://, az://, a dir")
    _add_step_pattern(p)
    p.add_argument("--json", action="store_true", help="print one JSON document")
    p.set_defaults(handler=_run_ls)


def _run_ls(args: argparse.Namespace) -> int:
    from dcp_volumes.catalog import list_checkpoints

    infos = list_checkpoints(
        args.root,
        storage_options=_storage_options_for(args, args.root),
        step_pattern=args.step_pattern,
    )
    if args.json:
        _print_json({"root": _redact(args.root), "checkpoints": [_info_doc(i) for i in infos]})
        return EXIT_OK
    if not infos:
        print(f"no checkpoints under {_redact(args.root)}", file=sys.stderr)
        return EXIT_OK
    rows = [
        [
            "-" if i.step is None else str(i.step),
            i.name,
            i.status,
            _human_bytes(i.bytes),
            str(i.objects),
            _when(i.commit_time),
        ]
        for i in infos
    ]
    complete = sum(i.complete for i in infos)
    _print_table(
        ["step", "name", "status", "size", "objects", "committed (UTC)"],
        rows,
        right={0, 3, 4},
        styles=[None if i.complete else "yellow" for i in infos],
    )
    print(
        f"{_n(len(infos), 'checkpoint')} ({complete} complete, {len(infos) - complete} "
        f"incomplete), {_human_bytes(sum(i.bytes for i in infos))}"
    )
    return EXIT_OK


# --------------------------------------------------------------------------------------------
# latest


def _add_latest(sub: Any, common: argparse.ArgumentParser) -> None:
    p = sub.add_parser(
        "latest",
        parents=[common, _storage_options()],
        help="print the URL of the newest complete checkpoint",
        description=(
            "Print the URL of the newest complete checkpoint (highest step) under a run root.\n"
            "Exit code 3 when there is none, so scripts can branch on it."
        ),
        epilog='example:\n  url=$(dcp-volumes latest s3://bucket/run-42/) && echo "resume from $url"',
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("root", metavar="ROOT", help="run root")
    _add_step_pattern(p)
    p.add_argument("--json", action="store_true", help="print the checkpoint as JSON")
    p.set_defaults(handler=_run_latest)


def _run_latest(args: argparse.Namespace) -> int:
    from dcp_volumes.catalog import latest

    info = latest(
        args.root,
        storage_options=_storage_options_for(args, args.root),
        step_pattern=args.step_pattern,
    )
    if info is None:
        if args.json:
            _print_json(None)
        print(f"{PROG}: no complete checkpoint under {_redact(args.root)}", file=sys.stderr)
        return EXIT_NOT_FOUND
    if args.json:
        _print_json(_info_doc(info))
    else:
        print(_redact(info.url))
    return EXIT_OK


def _info_doc(info: CheckpointInfo) -> dict[str, Any]:
    return {**info.as_dict(), "url": _redact(info.url)}


# --------------------------------------------------------------------------------------------
# info


def _add_info(sub: Any, common: argparse.ArgumentParser) -> None:
    p = sub.add_parser(
        "info",
        parents=[common, _storage_options()],
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

    details = describe(args.url, storage_options=_storage_options_for(args, args.url))
    if args.json:
        _print_json(details.as_dict())
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
        ("saved", _when(d.save_time) + (" UTC" if d.save_time is not None else "")),
        ("save id", d.save_id or "-"),
        ("writer", d.writer or "not dcp_volumes (no manifest)"),
        ("torch", d.torch_version or "-"),
        ("world size", world),
        ("checksums", "yes (CRC32C per item)" if d.checksummed else "no"),
        ("stored", f"{_human_bytes(d.total_bytes)} in {d.objects} objects ({d.files} shard files)"),
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
            "-" if e.nbytes is None else _human_bytes(e.nbytes),
            _human_bytes(e.stored_bytes),
            str(e.chunks),
        ]
        for e in d.entries
    ]
    _print_table(["key", "dtype", "shape", "size", "stored", "chunks"], rows, right={3, 4, 5})


# --------------------------------------------------------------------------------------------
# verify


def _add_verify(sub: Any, common: argparse.ArgumentParser) -> None:
    p = sub.add_parser(
        "verify",
        parents=[common, _storage_options()],
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
        "--concurrency", type=_count, default=4, metavar="N", help="files read at once (4)"
    )
    p.add_argument("--json", action="store_true", help="print one JSON document")
    p.set_defaults(handler=_run_verify)


def _run_verify(args: argparse.Namespace) -> int:
    from dcp_volumes.catalog import verify

    with _progress("verify", enabled=not args.json, unit="bytes") as progress:
        report = verify(
            args.url,
            storage_options=_storage_options_for(args, args.url),
            max_concurrency=args.concurrency,
            progress=progress,
        )
    if args.json:
        _print_json(report.as_dict())
    else:
        _print_verify(report)
    return EXIT_OK if report.ok else EXIT_FAILURE


def _print_verify(r: VerifyReport) -> None:
    rows = [
        [
            f.name,
            f.status,
            _human_bytes(f.expected_size),
            "-" if f.actual_size is None else _human_bytes(f.actual_size),
        ]
        for f in r.files
    ]
    _print_table(
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
    print(f"{verdict}: {r.url}: {r.note}; {_human_bytes(r.bytes_read)} read")


# --------------------------------------------------------------------------------------------
# rm


def _add_rm(sub: Any, common: argparse.ArgumentParser) -> None:
    p = sub.add_parser(
        "rm",
        parents=[common, _storage_options()],
        help="remove one checkpoint (.metadata first)",
        description=(
            "Remove one checkpoint: .metadata first, so readers never see it partially\n"
            "deleted, then its other objects. Refuses a URL holding sub-directories (a run\n"
            "root) or no checkpoint files."
        ),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("url", metavar="URL", help="checkpoint URL")
    p.add_argument("--dry-run", action="store_true", help="only print what would be removed")
    p.add_argument("--json", action="store_true", help="print one JSON document")
    p.set_defaults(handler=_run_rm)


def _run_rm(args: argparse.Namespace) -> int:
    from dcp_volumes.catalog import remove

    removed = remove(
        args.url, storage_options=_storage_options_for(args, args.url), dry_run=args.dry_run
    )
    if args.json:
        _print_json({"url": _redact(args.url), "dry_run": args.dry_run, "objects": removed})
    else:
        verb = "would remove" if args.dry_run else "removed"
        print(f"{verb} {_redact(args.url)} ({len(removed)} objects)")
    return EXIT_OK


# --------------------------------------------------------------------------------------------
# gc


def _add_gc(sub: Any, common: argparse.ArgumentParser) -> None:
    p = sub.add_parser(
        "gc",
        parents=[common, _storage_options()],
        help="collect stale incomplete checkpoints, leftover shards and multipart uploads",
        description=(
            "Find what failed or superseded saves left under a run root, older than\n"
            "--older-than: incomplete checkpoints (no .metadata), shards and manifests of\n"
            "saves that never committed inside complete checkpoints, and stale S3 multipart\n"
            "uploads. A dry run unless --yes."
        ),
        epilog="examples:\n  dcp-volumes gc s3://bucket/run-42/\n"
        "  dcp-volumes gc s3://bucket/run-42/ --older-than 6h --yes",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("root", metavar="ROOT", help="run root")
    p.add_argument(
        "--older-than",
        type=_age,
        default=3600.0,
        metavar="AGE",
        help="only collect what is older than this (units s, m, h, d; default 1h). Keep it "
        "above your longest save: a running save looks like an incomplete checkpoint",
    )
    p.add_argument("--yes", action="store_true", help="delete (default: report only)")
    _add_step_pattern(p)
    p.add_argument("--json", action="store_true", help="print one JSON document")
    p.set_defaults(handler=_run_gc)


def _run_gc(args: argparse.Namespace) -> int:
    from dcp_volumes.catalog import gc

    with _progress("gc", enabled=not args.json and args.yes, unit="objects") as progress:
        report = gc(
            args.root,
            older_than_s=args.older_than,
            storage_options=_storage_options_for(args, args.root),
            step_pattern=args.step_pattern,
            dry_run=not args.yes,
            progress=progress,
        )
    if args.json:
        _print_json(report.as_dict())
    else:
        _print_gc(report)
    return EXIT_OK


def _print_gc(r: GcReport) -> None:
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
            f"(started {_when(up['initiated'])} UTC)"
        )
    for line in r.skipped:
        print(f"  kept {line}")
    if r.empty:
        print("nothing to collect")
        return
    print(
        f"{verb}: {_n(len(r.incomplete), 'incomplete checkpoint')}, "
        f"{_n(len(r.leftovers), 'leftover object')} ({_human_bytes(r.bytes)}), "
        f"{_n(len(r.uploads), 'multipart upload')}"
    )
    if r.dry_run:
        print("dry run: nothing was deleted; run again with --yes to delete")


# --------------------------------------------------------------------------------------------
# bench: owned by the benchmarks work. Write `_add_bench`/`_run_bench` (here or in a module of
# its own) and add `_add_bench` to _SUBCOMMANDS below.


# --------------------------------------------------------------------------------------------
# Shared argument types: argparse reports their errors against the flag's name.


def _float(text: str) -> float:
    try:
        x = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if math.isnan(x):
        raise argparse.ArgumentTypeError("expected a number, got NaN")
    return x


def _non_negative(text: str) -> float:
    x = _float(text)
    if x < 0 or math.isinf(x):
        raise argparse.ArgumentTypeError(f"must be a finite number >= 0, got {text}")
    return x


def _positive(text: str) -> float:
    x = _non_negative(text)
    if x == 0:
        raise argparse.ArgumentTypeError("must be greater than 0, got 0")
    return x


def _positive_or_inf(text: str) -> float:
    x = _float(text)
    if x <= 0:
        raise argparse.ArgumentTypeError(f"must be greater than 0 (or inf), got {text}")
    return x


def _gpus(text: str) -> int:
    try:
        n = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number of GPUs, got {text!r}") from None
    if n < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {n}")
    return n


def _count(text: str) -> int:
    try:
        n = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number, got {text!r}") from None
    if n < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {n}")
    return n


def _age(text: str) -> float:
    from dcp_volumes.goodput import parse_duration_s

    if re.fullmatch(r"0+(\.0*)?[smhd]?", text.strip()):
        return 0.0
    try:
        return parse_duration_s(text)
    except ConfigError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


# --------------------------------------------------------------------------------------------
# Shared output helpers


def _print_json(doc: Any) -> None:
    # allow_nan=False: a stray inf must fail here, not produce invalid JSON downstream.
    print(json.dumps(doc, indent=2, allow_nan=False))


def _redact(url: str) -> str:
    from dcp_volumes._fs import redact_url

    return redact_url(url)


def _n(count: int, noun: str) -> str:
    return f"{count} {noun}{'' if count == 1 else 's'}"


def _human_bytes(n: int) -> str:
    value = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if value < 1024 or unit == "TiB":
            return f"{int(value)} B" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    raise AssertionError("unreachable")


def _when(epoch: float | None) -> str:
    if epoch is None:
        return "-"
    t = _dt.datetime.fromtimestamp(epoch, tz=_dt.timezone.utc)
    return t.strftime("%Y-%m-%d %H:%M:%S")


def _print_table(
    headers: list[str],
    rows: list[list[str]],
    *,
    right: set[int] = frozenset(),  # type: ignore[assignment]
    styles: Sequence[str | None] | None = None,
) -> None:
    """A table on stdout: rich on a terminal (when installed), aligned plain text otherwise,
    so pipes get every character of every cell."""
    try:
        if not sys.stdout.isatty():
            raise ImportError
        from rich.console import Console
        from rich.table import Table
    except ImportError:
        widths = [max(len(r[i]) for r in [headers, *rows]) for i in range(len(headers))]

        def line(cells: Sequence[str]) -> str:
            return "  ".join(
                c.rjust(w) if i in right else c.ljust(w)
                for i, (c, w) in enumerate(zip(cells, widths))
            ).rstrip()

        print(line(headers))
        print(line(["-" * w for w in widths]))
        for cells in rows:
            print(line(cells))
        return
    table = Table(show_edge=False, pad_edge=False, box=None, header_style="bold")
    for i, h in enumerate(headers):
        table.add_column(h, justify="right" if i in right else "left", overflow="fold")
    for n, cells in enumerate(rows):
        table.add_row(*cells, style=styles[n] if styles is not None else None)
    Console(highlight=False, soft_wrap=True).print(table)


@contextlib.contextmanager
def _progress(
    what: str, *, enabled: bool, unit: str
) -> Iterator[Callable[[int, int], None] | None]:
    """A progress bar on stderr when it is a terminal (rich, else tqdm); else nothing."""
    if not (enabled and sys.stderr.isatty()):
        yield None
        return
    try:
        from rich.console import Console
        from rich.progress import (
            BarColumn,
            DownloadColumn,
            MofNCompleteColumn,
            Progress,
            TimeRemainingColumn,
        )
    except ImportError:
        try:
            from tqdm import tqdm
        except ImportError:
            yield None
            return
        bar = tqdm(
            desc=what, unit="B" if unit == "bytes" else " objects", unit_scale=True, file=sys.stderr
        )

        def tick_tqdm(done: int, total: int) -> None:
            bar.total = total
            bar.n = done
            bar.refresh()

        try:
            yield tick_tqdm
        finally:
            bar.close()
        return
    counter = DownloadColumn() if unit == "bytes" else MofNCompleteColumn()
    with Progress(
        f"[bold]{what}[/bold]",
        BarColumn(),
        counter,
        TimeRemainingColumn(),
        console=Console(stderr=True),
        transient=True,
    ) as bar:
        task = bar.add_task(what, total=None)

        def tick(done: int, total: int) -> None:
            bar.update(task, completed=done, total=total)

        yield tick


# --------------------------------------------------------------------------------------------
# Registry: one entry per subcommand, in `dcp-volumes --help` order.

Registrar = Callable[[Any, argparse.ArgumentParser], None]

def _add_bench(sub: Any, common: argparse.ArgumentParser) -> None:
    from dcp_volumes import bench

    p = sub.add_parser(
        "bench",
        parents=[common],
        help="benchmark save/load against torch's writers, s3torchconnector and raw uploads",
        description=(bench.__doc__ or "").strip().splitlines()[0],
    )
    bench.add_arguments(p)
    p.set_defaults(handler=bench.run)


_SUBCOMMANDS: tuple[Registrar, ...] = (
    _add_ls,
    _add_latest,
    _add_info,
    _add_verify,
    _add_rm,
    _add_gc,
    _add_plan,
    _add_bench,
)


if __name__ == "__main__":
    raise SystemExit(main())
