"""``dcp-volumes plan --plot``: expected goodput against checkpoint interval, as a PNG."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from dcp_volumes.errors import ConfigError
from dcp_volumes.goodput import Plan, expected_goodput, format_duration

__all__ = ["plot_goodput"]

_PLOT_TICKS_S = (
    1.0,
    10.0,
    60.0,
    300.0,
    900.0,
    3600.0,
    4 * 3600.0,
    12 * 3600.0,
    86400.0,
    3 * 86400.0,
    7 * 86400.0,
    30 * 86400.0,
    365 * 86400.0,
)

_STYLES = {"young": ("tab:green", "--", "Young"), "daly": ("tab:red", ":", "Daly")}


def plot_goodput(plan: Plan, path: str | Path, /, *, title: str | None = None) -> Path:
    """Write a PNG of expected goodput against checkpoint interval.

    The curve spans the candidate intervals and both optima on a log axis; candidates are
    marked as points and the Young and Daly optima as vertical lines. Uses matplotlib's Agg
    canvas directly, so pyplot's global backend is left alone.

    Args:
        plan: From :func:`dcp_volumes.goodput.plan_intervals`.
        path: Where to write the PNG; parent directories must exist.
        title: Figure title; defaults to the failure model and costs.

    Returns:
        ``path`` as a :class:`~pathlib.Path`.

    Raises:
        ConfigError: matplotlib is not installed.
    """
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError as exc:
        raise ConfigError(
            "plotting needs matplotlib: pip install matplotlib (or 'dcp-volumes[all]')"
        ) from exc

    out = Path(path)
    lo, hi = _span(plan)
    xs, ys = _curve(plan, lo, hi)
    fig = Figure(figsize=(8, 4.8), dpi=120)
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    _draw(ax, plan, xs, ys, hi)
    _decorate(ax, plan, lo, hi, ys, title)
    fig.tight_layout()
    fig.savefig(out, format="png")
    return out


def _span(plan: Plan) -> tuple[float, float]:
    """From half the shortest to twice the longest interval in the plan (seconds)."""
    optima = [row for row in (plan.young, plan.daly) if row is not None]
    span = [row.interval_s for row in plan.rows] + [row.interval_s for row in optima]
    return min(span) / 2.0, max(span) * 2.0


def _curve(plan: Plan, lo: float, hi: float) -> tuple[list[float], list[float]]:
    """400 log-spaced intervals from ``lo`` to ``hi`` and the goodput at each."""
    m = plan.failure_model.mttf_s
    n = 400
    xs = [lo * (hi / lo) ** (i / (n - 1)) for i in range(n)]
    ys = [
        expected_goodput(
            x,
            checkpoint_cost_s=plan.checkpoint_cost_s,
            mttf_s=m,
            restart_cost_s=plan.restart_cost_s,
        )
        for x in xs
    ]
    return xs, ys


def _draw(ax: Any, plan: Plan, xs: list[float], ys: list[float], hi: float) -> None:
    """The curve, the candidates, the optima and the region the model does not cover."""
    lo = xs[0]
    ax.plot([x / 3600.0 for x in xs], ys, color="tab:blue", label="expected goodput")
    ax.scatter(
        [row.interval_s / 3600.0 for row in plan.rows],
        [row.goodput for row in plan.rows],
        color="tab:blue",
        zorder=3,
        label="candidates",
    )
    for row in (r for r in (plan.young, plan.daly) if r is not None):
        color, ls, name = _STYLES[row.kind]
        ax.axvline(
            row.interval_s / 3600.0,
            color=color,
            linestyle=ls,
            label=(f"{name} τ = {format_duration(row.interval_s)} ({row.goodput:.2%})"),
        )
    edge = plan.first_order_limit_s  # τ where τ+δ reaches M/10
    if math.isfinite(edge) and edge < hi:
        ax.axvspan(
            max(edge, lo) / 3600.0,
            hi / 3600.0,
            color="0.9",
            zorder=0,
            label="τ+δ > M/10: model unreliable",
        )


def _decorate(
    ax: Any, plan: Plan, lo: float, hi: float, ys: list[float], title: str | None
) -> None:
    """Axes, ticks, labels, legend and title."""
    from matplotlib.ticker import FixedLocator, FuncFormatter, NullFormatter, PercentFormatter

    ax.set_xscale("log")
    ax.set_xlim(lo / 3600.0, hi / 3600.0)
    ticks = [t / 3600.0 for t in _PLOT_TICKS_S if lo <= t <= hi]
    if len(ticks) >= 2:
        ax.xaxis.set_major_locator(FixedLocator(ticks))
        ax.xaxis.set_minor_formatter(NullFormatter())
    ax.xaxis.set_major_formatter(FuncFormatter(lambda v, _pos: format_duration(v * 3600.0)))
    ax.yaxis.set_major_formatter(PercentFormatter(xmax=1.0))
    top = max(ys) if ys else 1.0
    ax.set_ylim(max(0.0, min(ys + [top - 0.1]) - 0.01), min(1.0, top + 0.01))
    ax.set_xlabel("checkpoint interval τ")
    ax.set_ylabel("expected goodput")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(loc="best", fontsize="small")
    m = plan.failure_model.mttf_s
    mt = "∞" if math.isinf(m) else format_duration(m)
    ax.set_title(
        title
        or f"{plan.failure_model.describe()}: M = {mt}, δ = "
        f"{format_duration(plan.checkpoint_cost_s)}, R = {format_duration(plan.restart_cost_s)}",
        fontsize="medium",
    )
