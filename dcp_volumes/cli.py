"""The ``dcp-volumes`` command.

Each subcommand is two functions. ``_add_<name>(sub, common)`` declares its parser with
``sub.add_parser("<name>", parents=[common], ...)`` (``common`` carries ``--debug``) and calls
``set_defaults(handler=_run_<name>)``; ``_run_<name>(args) -> int`` does the work and returns
the exit code. To add one, write both (here or in a module of its own) and append
``_add_<name>`` to :data:`_SUBCOMMANDS` at the bottom of this file; ``--json`` output goes
through :func:`_print_json`. Handlers raise; they never print errors or call ``sys.exit``:
:func:`main` turns
``dcp_volumes.errors`` exceptions, ``OSError`` and ``ValueError`` into one line
``dcp-volumes: error: ...`` on stderr (the traceback only with ``--debug``) and picks the exit
code: 0 success, 1 failure, 2 usage or configuration error.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import sys
import traceback
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any, NoReturn

from dcp_volumes.errors import ConfigError, DCPVolumesError

if TYPE_CHECKING:
    from dcp_volumes.goodput import FailureModel, IntervalRow, Plan

__all__ = ["build_parser", "main"]

PROG = "dcp-volumes"
EXIT_OK = 0
EXIT_FAILURE = 1
EXIT_USAGE = 2

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
    except (DCPVolumesError, OSError, ValueError) as exc:
        if debug:
            traceback.print_exc()
        print(f"{PROG}: error: {_one_line(exc)}", file=sys.stderr)
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


# --------------------------------------------------------------------------------------------
# Shared output helpers


def _print_json(doc: Any) -> None:
    # allow_nan=False: a stray inf must fail here, not produce invalid JSON downstream.
    print(json.dumps(doc, indent=2, allow_nan=False))


# --------------------------------------------------------------------------------------------
# Registry: one entry per subcommand, in `dcp-volumes --help` order.

Registrar = Callable[[Any, argparse.ArgumentParser], None]

_SUBCOMMANDS: tuple[Registrar, ...] = (
    _add_plan,
    # _add_ls, _add_latest, _add_info, _add_verify, _add_rm, _add_gc, _add_bench
)


if __name__ == "__main__":
    raise SystemExit(main())
