"""Tabulating candidate intervals into a :class:`Plan`. See :mod:`dcp_volumes.goodput`."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from dcp_volumes.errors import ConfigError
from dcp_volumes.goodput._checks import (
    FIRST_ORDER_LIMIT,
    MAX_DURATION_S,
    finite_or_none,
    non_negative,
    positive,
)
from dcp_volumes.goodput._durations import format_duration
from dcp_volumes.goodput._model import (
    DEFAULT_INTERVALS_S,
    FailureModel,
    Method,
    RowKind,
    daly_interval_s,
    expected_goodput,
    expected_rework_s,
    interruption_probability,
    young_interval_s,
)

# --------------------------------------------------------------------------------------------
# The plan: a table over candidate intervals plus the optimum


@dataclass(frozen=True, kw_only=True)
class IntervalRow:
    """The model's verdict on one checkpoint interval.

    Args:
        interval_s: Useful work between checkpoints ``τ``.
        goodput: Expected fraction of wall time spent on new work.
        overhead: Fraction of wall time blocked on checkpoints, ``δ/(τ+δ)``.
        rework_s: Expected work lost per failure, ``τ/2 + R``.
        lost_hours: Expected wall hours not spent on new work over the job,
            ``D·(1 − goodput)``; ``None`` without a job duration.
        first_order_ok: ``τ + δ ≤ M/10``, where the first-order model can be trusted.
        kind: ``"candidate"``, ``"young"`` or ``"daly"``.
    """

    interval_s: float
    goodput: float
    overhead: float
    rework_s: float
    lost_hours: float | None
    first_order_ok: bool
    kind: RowKind = "candidate"

    @property
    def is_optimum(self) -> bool:
        """A Young or Daly optimum rather than a candidate interval."""
        return self.kind in ("young", "daly")

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready form."""
        return {
            "interval_s": self.interval_s,
            "interval": format_duration(self.interval_s),
            "goodput": self.goodput,
            "overhead": self.overhead,
            "rework_s": self.rework_s,
            "lost_hours": self.lost_hours,
            "first_order_ok": self.first_order_ok,
            "kind": self.kind,
        }


@dataclass(frozen=True, kw_only=True)
class Plan:
    """Goodput over candidate intervals, the Young and Daly optima, and the failure odds.

    Built by :func:`plan_intervals`.

    Args:
        failure_model: Where the failure rate came from.
        checkpoint_cost_s: Blocking checkpoint cost ``δ``.
        restart_cost_s: Restart cost ``R``.
        job_hours: Job duration ``D``, or ``None``.
        interruption_probability: ``1 − exp(−D/M)``, or ``None`` without ``job_hours``.
        expected_failures: ``D/M``, or ``None`` without ``job_hours``.
        rows: One row per candidate interval, shortest first.
        young: The row at Young's optimum, ``None`` when ``M`` is ``inf``.
        daly: The row at Daly's optimum, ``None`` when ``M`` is ``inf``.
        method: Which optimum :attr:`optimum` reports.
        warnings: Where the inputs push the model past its limits, in words.
        cost_source: Where ``δ`` came from, in words.
    """

    failure_model: FailureModel
    checkpoint_cost_s: float
    restart_cost_s: float
    job_hours: float | None
    interruption_probability: float | None
    expected_failures: float | None
    rows: tuple[IntervalRow, ...]
    young: IntervalRow | None
    daly: IntervalRow | None
    method: Method = "young"
    warnings: tuple[str, ...] = field(default=())
    cost_source: str = "given"

    @property
    def mttf_hours(self) -> float:
        """The job's mean time to failure ``M`` in hours (``inf`` without failures)."""
        return self.failure_model.mttf_hours

    @property
    def optimum(self) -> IntervalRow | None:
        """The row at the chosen optimum; ``None`` when failures never happen."""
        return self.daly if self.method == "daly" else self.young

    @property
    def first_order_limit_s(self) -> float:
        """The longest interval ``τ`` the first-order model can be trusted at: where
        ``τ + δ`` reaches ``M/10`` (``inf`` without failures)."""
        return FIRST_ORDER_LIMIT * self.failure_model.mttf_s - self.checkpoint_cost_s

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready form; infinities become ``None`` so ``json.dumps`` stays standard."""
        opt = self.optimum
        return {
            "failure_model": self.failure_model.to_dict(),
            "mttf_hours": finite_or_none(self.mttf_hours),
            "checkpoint_cost_s": self.checkpoint_cost_s,
            "checkpoint_cost_source": self.cost_source,
            "restart_cost_s": self.restart_cost_s,
            "job_hours": self.job_hours,
            "interruption_probability": self.interruption_probability,
            "expected_failures": self.expected_failures,
            "method": self.method,
            "optimum": opt.to_dict() if opt is not None else None,
            "young": self.young.to_dict() if self.young is not None else None,
            "daly": self.daly.to_dict() if self.daly is not None else None,
            "rows": [r.to_dict() for r in self.rows],
            "warnings": list(self.warnings),
        }


def plan_intervals(
    failure_model: FailureModel,
    /,
    *,
    checkpoint_cost_s: float,
    restart_cost_s: float = 0.0,
    job_hours: float | None = None,
    intervals_s: Sequence[float] = DEFAULT_INTERVALS_S,
    method: Method = "young",
    cost_source: str = "given",
) -> Plan:
    """Tabulate goodput over candidate intervals and find the optimum.

    Args:
        failure_model: The job's failure rate.
        checkpoint_cost_s: Time one checkpoint blocks training ``δ`` (> 0): a blocking
            save's duration, or the blocking part of ``async_save``.
        restart_cost_s: Time from a failure to training again ``R``: reschedule, load the
            checkpoint, warm up.
        job_hours: Wall-clock job duration ``D``, for the interruption odds and lost hours.
        intervals_s: Candidate intervals ``τ`` to tabulate; sorted and deduplicated.
        method: ``"young"`` or ``"daly"``: which optimum :attr:`Plan.optimum` reports.
            Both are always computed.
        cost_source: Where ``δ`` came from, in words (``dcp-volumes plan --from-bench`` passes
            the bench file and metric it read).

    Returns:
        The plan.

    Raises:
        ConfigError: A negative, NaN or zero value where it makes no sense, an empty
            ``intervals_s`` or an unknown ``method``.
    """
    delta, r, d_hours, taus = _plan_inputs(failure_model, checkpoint_cost_s, restart_cost_s,
                                           job_hours, intervals_s, method)
    m = failure_model.mttf_s

    def row(tau: float, kind: RowKind) -> IntervalRow:
        return _interval_row(tau, kind, delta=delta, m=m, restart_s=r, job_hours=d_hours)

    finite = math.isfinite(m)
    young = row(young_interval_s(checkpoint_cost_s=delta, mttf_s=m), "young") if finite else None
    daly = row(daly_interval_s(checkpoint_cost_s=delta, mttf_s=m), "daly") if finite else None
    p_int, expected = _job_odds(d_hours, m)
    rows = tuple(row(t, "candidate") for t in taus)
    return Plan(
        failure_model=failure_model,
        checkpoint_cost_s=delta,
        restart_cost_s=r,
        job_hours=d_hours,
        interruption_probability=p_int,
        expected_failures=expected,
        rows=rows,
        young=young,
        daly=daly,
        method=method,
        warnings=_warnings(m, delta=delta, restart_s=r, rows=rows),
        cost_source=cost_source,
    )


def _plan_inputs(failure_model: object, checkpoint_cost_s: float, restart_cost_s: float,
                 job_hours: float | None, intervals_s: Sequence[float], method: str
                 ) -> tuple[float, float, float | None, list[float]]:
    """The validated ``(δ, R, D in hours, sorted intervals)`` of :func:`plan_intervals`."""
    if not isinstance(failure_model, FailureModel):
        raise ConfigError(
            f"failure_model must be a FailureModel, got {type(failure_model).__name__}"
        )
    delta = positive("checkpoint_cost_s", checkpoint_cost_s, at_most=MAX_DURATION_S)
    r = non_negative("restart_cost_s", restart_cost_s, at_most=MAX_DURATION_S)
    d_hours = None if job_hours is None else positive("job_hours", job_hours,
                                                      at_most=MAX_DURATION_S / 3600.0)
    if method not in ("young", "daly"):
        raise ConfigError(f"method must be 'young' or 'daly', got {method!r}")
    taus = sorted({positive("each of intervals_s", t, at_most=MAX_DURATION_S)
                   for t in intervals_s})
    if not taus:
        raise ConfigError("intervals_s is empty; pass at least one candidate interval")
    return delta, r, d_hours, taus


def _job_odds(d_hours: float | None, m: float) -> tuple[float | None, float | None]:
    """The chance of an interruption over a job of ``d_hours`` and its expected failures."""
    if d_hours is None:
        return None, None
    p_int = interruption_probability(duration_s=d_hours * 3600.0, mttf_s=m)
    return p_int, 0.0 if math.isinf(m) else d_hours * 3600.0 / m


def _interval_row(
    tau: float, kind: RowKind, *, delta: float, m: float, restart_s: float, job_hours: float | None
) -> IntervalRow:
    g = expected_goodput(tau, checkpoint_cost_s=delta, mttf_s=m, restart_cost_s=restart_s)
    return IntervalRow(
        interval_s=tau,
        goodput=g,
        overhead=delta / (tau + delta),
        rework_s=expected_rework_s(tau, restart_cost_s=restart_s),
        lost_hours=None if job_hours is None else job_hours * (1.0 - g),
        first_order_ok=(tau + delta) <= FIRST_ORDER_LIMIT * m,
        kind=kind,
    )


def _warnings(
    m: float, *, delta: float, restart_s: float, rows: Sequence[IntervalRow]
) -> tuple[str, ...]:
    out: list[str] = []
    if math.isinf(m):
        out.append(
            "failure rate is zero: goodput only rises with longer intervals, so there is no "
            "finite optimum; choose the interval by how much work a planned stop may lose"
        )
        return tuple(out)
    mh = format_duration(m)
    if delta >= 2.0 * m:
        out.append(
            f"checkpoint cost {format_duration(delta)} is at least twice the job MTTF {mh}: "
            "checkpoints cannot pay for themselves (Daly falls back to τ = M); cut the cost "
            "(async save, faster store) or the GPU count"
        )
    if restart_s >= m:
        out.append(
            f"restart cost {format_duration(restart_s)} is at least the job MTTF {mh}: the job "
            "spends its time restarting and goodput is 0 at every interval"
        )
    if all(r.goodput == 0.0 for r in rows):
        out.append(
            f"goodput is 0 at every candidate interval: with M = {mh} failures outpace "
            "checkpoint and restart; cut the checkpoint or restart cost, or the GPU count"
        )
    beyond = [format_duration(r.interval_s) for r in rows if not r.first_order_ok]
    if beyond:
        out.append(
            f"interval(s) {', '.join(beyond)} have τ+δ above M/10 (M = {mh}); the first-order "
            "model is unreliable there"
        )
    return tuple(out)
