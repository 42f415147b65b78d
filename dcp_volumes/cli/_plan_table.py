"""How ``dcp-volumes plan`` prints: the summary lines, the table (rich when installed, else
plain aligned text) and the warnings, for the one-level plan and the two-tier one."""

from __future__ import annotations

import math
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import IO, TYPE_CHECKING

if TYPE_CHECKING:
    from dcp_volumes.goodput import IntervalRow, Plan, TwoLevelPlan

__all__ = ["plan_summary", "print_plan", "print_table", "print_two_tier"]


def print_plan(plan: Plan, *, plot: Path | None, out: IO[str] | None = None,
               extra: Sequence[tuple[str, str]] = ()) -> None:
    """The plan's summary (and ``extra`` lines after it), its table, its warnings."""
    stream = sys.stdout if out is None else out
    headers, rows, marks = _plan_table(plan)
    print_table([*plan_summary(plan), *extra], headers, rows, marks, plan, plot, stream,
                left_last=True)


def print_table(
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


def plan_summary(plan: Plan) -> list[tuple[str, str]]:
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


def print_two_tier(plan: TwoLevelPlan, *, source: str) -> None:
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
    print_table(summary, headers, rows, marks, plan, None, sys.stdout, left_last=False)
