"""``dcp-volumes plan``: choose a checkpoint interval from a failure rate and a checkpoint cost.

The model is :mod:`dcp_volumes.goodput`; the cost comes from the command line or from a
``dcp-volumes bench`` results file (:mod:`dcp_volumes.bench.costs`); ``--plot`` draws
:func:`plot_goodput`.
"""

from __future__ import annotations

import argparse
import math
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any

from dcp_volumes.cli._exit import EXIT_OK
from dcp_volumes.cli._format import print_json
from dcp_volumes.cli._options import gpu_count, non_negative_float, positive_float, positive_or_inf
from dcp_volumes.cli._plot import plot_goodput
from dcp_volumes.errors import ConfigError

if TYPE_CHECKING:
    from dcp_volumes.goodput import FailureModel, IntervalRow, Plan, TwoLevelPlan

__all__ = ["plot_goodput", "register"]


def register(sub: Any, common: argparse.ArgumentParser) -> None:
    """Add ``plan`` to ``sub``."""
    _add_plan(sub, common)


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
        type=gpu_count,
        required=True,
        metavar="N",
        help="GPUs the job needs at once; any one failing interrupts it",
    )
    rate = p.add_argument_group("failure rate (one of)")
    rate.add_argument(
        "--afr",
        type=non_negative_float,
        metavar="RATE",
        help="per-GPU annualised failure rate as a fraction (0.05 = 5%%/year)",
    )
    rate.add_argument(
        "--fleet-mtbf-hours",
        type=positive_or_inf,
        metavar="T",
        help="observed hours between failures across a fleet of --fleet-gpus",
    )
    rate.add_argument("--fleet-gpus", type=gpu_count, metavar="G", help="GPUs in that fleet")
    cost = p.add_argument_group("checkpoint cost (one of)")
    cost.add_argument(
        "--checkpoint-cost-s",
        type=positive_float,
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
        type=non_negative_float,
        default=0.0,
        metavar="SECONDS",
        help="time from a failure to training again: reschedule, load, warm up (default 0)",
    )
    p.add_argument(
        "--job-hours",
        type=positive_float,
        metavar="HOURS",
        help="job duration, for the odds of an interruption and the hours lost",
    )
    p.add_argument(
        "--intervals",
        metavar="LIST",
        help="candidate intervals, e.g. 5m,30m,1h,4h (units s, m, h, d; default "
        "5m,10m,15m,30m,1h,2h,4h,8h,12h,24h)",
    )
    _add_two_tier_options(p)
    p.add_argument("--daly", action="store_true", help="report Daly's optimum instead of Young's")
    p.add_argument(
        "--plot", type=Path, metavar="PNG", help="also write goodput against interval to this PNG"
    )
    p.add_argument("--json", action="store_true", help="print one JSON document")
    p.set_defaults(handler=_run_plan)


def _add_two_tier_options(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group(
        "two tiers (with --local-save-s: compare remote-only with local + durable saves)",
        "The checkpoint cost is then the durable save's, and --restart-cost-s the restart "
        "without loading the state (the restore times below add to it).",
    )
    g.add_argument("--local-save-s", type=positive_float, metavar="SECONDS",
                   help="time a local-only save blocks training")
    g.add_argument("--local-survives", type=non_negative_float, metavar="SHARE",
                   help="share of failures after which the local copies are usable, in [0, 1) "
                   "(e.g. 0.8)")
    g.add_argument("--local-restore-s", type=non_negative_float, default=0.0, metavar="SECONDS",
                   help="time to load the state from the local tier (default 0)")
    g.add_argument("--remote-restore-s", type=non_negative_float, default=0.0,
                   metavar="SECONDS", help="time to load the state from the store (default 0)")
    g.add_argument("--local-complete-s", type=non_negative_float, default=0.0,
                   metavar="SECONDS",
                   help="lag from a local save's return to its copy being usable (default 0)")
    g.add_argument("--remote-complete-s", type=non_negative_float, default=0.0,
                   metavar="SECONDS", help="lag from a durable save's return to its commit "
                   "(the upload of an async save; default 0)")
    g.add_argument("--local-every", metavar="DURATION",
                   help="also evaluate this local interval (with --remote-every), e.g. 10m")
    g.add_argument("--remote-every", metavar="DURATION",
                   help="also evaluate this remote interval (with --local-every), e.g. 2h")


_TWO_TIER_ONLY = ("local_survives", "local_every", "remote_every")


def _run_plan(args: argparse.Namespace) -> int:
    from dcp_volumes.goodput import DEFAULT_INTERVALS_S, parse_duration_s, plan_intervals

    model = _failure_model(args)
    cost_s, source = _checkpoint_cost(args)
    if args.local_save_s is not None:
        return _run_two_tier(args, model, cost_s, source)
    used = [f"--{n.replace('_', '-')}" for n in _TWO_TIER_ONLY if getattr(args, n) is not None]
    if used:
        raise ConfigError(f"{', '.join(used)} only apply with --local-save-s SECONDS")
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
        print_json(doc)
    else:
        _print_plan(plan, plot=plot)
    return EXIT_OK


def _checkpoint_cost(args: argparse.Namespace) -> tuple[float, str]:
    """``δ`` in seconds, and where it came from in words."""
    if args.checkpoint_cost_s is not None and args.from_bench is not None:
        raise ConfigError("give --checkpoint-cost-s or --from-bench, not both")
    if args.from_bench is None and (args.contender is not None or args.use_async):
        raise ConfigError("--contender and --async only apply with --from-bench FILE")
    if args.from_bench is not None:
        from dcp_volumes.bench.costs import checkpoint_cost_from_bench

        bench = checkpoint_cost_from_bench(
            args.from_bench, contender=args.contender, use_async=args.use_async
        )
        return bench.seconds, bench.describe()
    if args.checkpoint_cost_s is not None:
        return args.checkpoint_cost_s, "given"
    raise ConfigError(
        "give the checkpoint cost: --checkpoint-cost-s SECONDS or --from-bench FILE"
    )


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
    headers, rows, marks = _plan_table(plan)
    _print_table(_plan_summary(plan), headers, rows, marks, plan, plot, stream,
                 left_last=True)


def _print_table(
    summary: list[tuple[str, str]],
    headers: list[str],
    rows: list[list[str]],
    marks: list[str],
    plan: Plan | TwoLevelPlan,
    plot: Path | None,
    stream: IO[str],
    *,
    left_last: bool,
) -> None:
    """The summary lines, the table (rich when installed, else plain), the warnings.
    ``left_last``: the last column (a note) is left-aligned."""
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
        left = i == 0 or (left_last and i == len(headers) - 1)
        table.add_column(h, justify="left" if left else "right")
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
    plan: Plan | TwoLevelPlan,
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
        if r.is_optimum:
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
# Two tiers


def _run_two_tier(
    args: argparse.Namespace, model: FailureModel, cost_s: float, source: str
) -> int:
    from dcp_volumes.goodput import TierCosts, parse_duration_s, plan_two_level

    for flag, value in (("--intervals", args.intervals), ("--plot", args.plot)):
        if value is not None:
            raise ConfigError(f"{flag} does not apply with --local-save-s (two tiers)")
    if args.daly:
        raise ConfigError("--daly does not apply with --local-save-s (two tiers)")
    if args.local_survives is None:
        raise ConfigError(
            "with --local-save-s, give --local-survives SHARE: the share of failures after "
            "which the local copies are usable (e.g. 0.8; see docs/goodput.md)"
        )
    if (args.local_every is None) != (args.remote_every is None):
        raise ConfigError("--local-every and --remote-every go together; give both or neither")
    given = None
    if args.local_every is not None:
        given = (parse_duration_s(args.local_every), parse_duration_s(args.remote_every))
    costs = TierCosts(
        local_save_s=args.local_save_s,
        remote_save_s=cost_s,
        local_survives=args.local_survives,
        local_complete_s=args.local_complete_s,
        remote_complete_s=args.remote_complete_s,
        local_restore_s=args.local_restore_s,
        remote_restore_s=args.remote_restore_s,
        restart_s=args.restart_cost_s,
    )
    plan = plan_two_level(model, costs=costs, job_hours=args.job_hours, given=given)
    if args.json:
        doc = plan.to_dict()
        doc["remote_save_source"] = source
        print_json(doc)
    else:
        _print_two_tier(plan, source=source)
    return EXIT_OK


def _print_two_tier(plan: TwoLevelPlan, *, source: str) -> None:
    from dcp_volumes.goodput import format_duration

    c = plan.costs
    m_h = plan.failure_model.mttf_hours
    summary = [
        ("failure model", plan.failure_model.describe()),
        ("job MTTF", f"{m_h:.4g} h ({format_duration(m_h * 3600.0)})"),
        ("durable save", (f"{c.remote_save_s:.4g} s blocking ({source}), "
                          f"{c.remote_complete_s:.4g} s to commit, "
                          f"restore {c.remote_restore_s:.4g} s")),
        ("local save", (f"{c.local_save_s:.4g} s blocking, {c.local_complete_s:.4g} s to "
                        f"complete, restore {c.local_restore_s:.4g} s")),
        ("restart", f"{c.restart_s:.4g} s + restore"),
        ("local survives", f"{c.local_survives:.0%} of failures"),
    ]
    headers = ["setting", "local every", "remote every", "goodput", "ckpt time",
               "loss/failure", "lost GPU-h/day"]
    if plan.job_hours is not None:
        headers.append(f"lost GPU-h/{plan.job_hours:g}h")
    rows = []
    for r in plan.rows:
        cells = [
            r.name,
            "-" if r.local_interval_s is None else format_duration(r.local_interval_s),
            format_duration(r.remote_interval_s),
            f"{r.goodput:.2%}",
            f"{r.overhead:.2%}",
            format_duration(r.loss_per_failure_s),
            f"{r.lost_gpu_hours_per_day:,.0f}",
        ]
        if r.lost_gpu_hours is not None:
            cells.append(f"{r.lost_gpu_hours:,.0f}")
        rows.append(cells)
    marks = ["chosen" if r.name == "two-tier" else "" for r in plan.rows]
    _print_table(summary, headers, rows, marks, plan, None, sys.stdout, left_last=False)
