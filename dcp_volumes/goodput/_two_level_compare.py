"""Remote-only checkpointing against two tiers, each at its recommended intervals (and a
given setting, if any): one row per setting with what the two-level model of
:mod:`._two_level` expects of it, and the warnings where the model is unreliable."""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import Any

from dcp_volumes.errors import ConfigError
from dcp_volumes.goodput._checks import (
    FIRST_ORDER_LIMIT,
    MAX_DURATION_S,
    finite_or_none,
    positive,
)
from dcp_volumes.goodput._durations import format_duration
from dcp_volumes.goodput._model import FailureModel
from dcp_volumes.goodput._two_level import (
    TierCosts,
    check_pair,
    expected_loss_per_failure_s,
    overhead_per_work,
    two_level_goodput,
    two_level_intervals_s,
)

__all__ = ["TwoLevelPlan", "TwoLevelRow", "plan_two_level"]


@dataclass(frozen=True, kw_only=True)
class TwoLevelRow:
    """One setting of the two intervals, and what the model expects of it.

    Args:
        name: ``"remote-only"``, ``"two-tier"`` or ``"given"``.
        local_interval_s: Work between saves ``τ_L`` (``None`` for remote-only: no tier).
        remote_interval_s: Work between durable saves ``τ_R``.
        goodput: Expected fraction of wall time spent on new work.
        overhead: Fraction of wall time blocked on saves, ``c/(1+c)``.
        loss_per_failure_s: Expected wall time one failure costs.
        lost_gpu_hours_per_day: ``N · 24 · (1 − goodput)``.
        lost_gpu_hours: ``N · D · (1 − goodput)``; ``None`` without a job duration.
        first_order_ok: ``τ_R + δ_R ≤ M/10``.
    """

    name: str
    local_interval_s: float | None
    remote_interval_s: float
    goodput: float
    overhead: float
    loss_per_failure_s: float
    lost_gpu_hours_per_day: float
    lost_gpu_hours: float | None
    first_order_ok: bool

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready form; infinities become ``None``."""
        return {
            "name": self.name,
            "local_interval_s": finite_or_none(self.local_interval_s),
            "remote_interval_s": finite_or_none(self.remote_interval_s),
            "goodput": self.goodput,
            "overhead": self.overhead,
            "loss_per_failure_s": self.loss_per_failure_s,
            "lost_gpu_hours_per_day": self.lost_gpu_hours_per_day,
            "lost_gpu_hours": self.lost_gpu_hours,
            "first_order_ok": self.first_order_ok,
        }


@dataclass(frozen=True, kw_only=True)
class TwoLevelPlan:
    """Remote-only against two tiers, each at its optimum (plus a given setting, if any).

    Built by :func:`plan_two_level`.
    """

    failure_model: FailureModel
    costs: TierCosts
    job_hours: float | None
    rows: tuple[TwoLevelRow, ...]
    warnings: tuple[str, ...] = ()

    def row(self, name: str) -> TwoLevelRow:
        """The row called ``name``."""
        for r in self.rows:
            if r.name == name:
                return r
        raise KeyError(name)

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready form."""
        return {
            "model": "two-level",
            "failure_model": self.failure_model.to_dict(),
            "mttf_hours": finite_or_none(self.failure_model.mttf_hours),
            "costs": self.costs.to_dict(),
            "job_hours": self.job_hours,
            "rows": [r.to_dict() for r in self.rows],
            "warnings": list(self.warnings),
        }


def plan_two_level(
    failure_model: FailureModel,
    /,
    *,
    costs: TierCosts,
    job_hours: float | None = None,
    given: tuple[float, float] | None = None,
) -> TwoLevelPlan:
    """Compare remote-only checkpointing with two tiers, each at its recommended intervals.

    Remote-only: no local tier, every failure restarts from the store
    (``R + L_R + U_R``), durable saves every Young ``√(2·δ_R·M)``. Two-tier: the intervals of
    :func:`two_level_intervals_s`.

    Args:
        failure_model: The job's failure rate.
        costs: The two tiers' costs and the share of failures the local tier survives.
        job_hours: Job duration ``D``, for the GPU-hours lost over the job.
        given: A ``(local, remote)`` pair of intervals to evaluate as well.

    Raises:
        ConfigError: Invalid inputs, or ``given`` with its local interval above its remote.
    """
    d_hours, m = _checked(failure_model, costs, job_hours)
    row = functools.partial(_two_level_row, mttf_s=m, gpus=failure_model.gpus,
                            job_hours=d_hours)
    t1 = math.sqrt(2.0 * costs.remote_save_s * m)
    tl, tr = two_level_intervals_s(costs=costs, mttf_s=m)
    rows = [row("remote-only", t1, t1, _remote_only(costs), local=False),
            row("two-tier", tl, tr, costs, local=True)]
    if given is not None:
        gl, gr = check_pair(*given)
        rows.append(row("given", gl, gr, costs, local=True))
    return TwoLevelPlan(
        failure_model=failure_model,
        costs=costs,
        job_hours=d_hours,
        rows=tuple(rows),
        warnings=_two_level_warnings(rows, costs, mttf_s=m, same_intervals=tl == tr),
    )


def _checked(failure_model: Any, costs: Any, job_hours: float | None
             ) -> tuple[float | None, float]:
    """``plan_two_level``'s inputs checked: the job's hours (or None) and a finite MTTF."""
    if not isinstance(failure_model, FailureModel):
        raise ConfigError(
            f"failure_model must be a FailureModel, got {type(failure_model).__name__}"
        )
    if not isinstance(costs, TierCosts):
        raise ConfigError(f"costs must be a TierCosts, got {type(costs).__name__}")
    d_hours = None if job_hours is None else positive("job_hours", job_hours,
                                                      at_most=MAX_DURATION_S / 3600.0)
    m = failure_model.mttf_s
    if math.isinf(m):
        raise ConfigError(
            "the failure rate is zero: no interval is optimal and a local tier cannot pay "
            "for itself; give a failure rate above 0"
        )
    return d_hours, m


def _remote_only(costs: TierCosts) -> TierCosts:
    """The costs of the same job without a local tier: every restart from the store."""
    return TierCosts(
        local_save_s=costs.remote_save_s,
        remote_save_s=costs.remote_save_s,
        local_survives=0.0,
        remote_complete_s=costs.remote_complete_s,
        remote_restore_s=costs.remote_restore_s,
        restart_s=costs.restart_s,
    )


def _two_level_row(name: str, tl: float, tr: float, c: TierCosts, *, local: bool,
                   mttf_s: float, gpus: int, job_hours: float | None) -> TwoLevelRow:
    g = two_level_goodput(tl, tr, costs=c, mttf_s=mttf_s)
    over = overhead_per_work(tl, tr, c)
    return TwoLevelRow(
        name=name,
        local_interval_s=tl if local else None,
        remote_interval_s=tr,
        goodput=g,
        overhead=over / (1 + over),
        loss_per_failure_s=expected_loss_per_failure_s(tl, tr, costs=c),
        lost_gpu_hours_per_day=gpus * 24.0 * (1 - g),
        lost_gpu_hours=None if job_hours is None else gpus * job_hours * (1 - g),
        first_order_ok=tr + c.remote_save_s <= FIRST_ORDER_LIMIT * mttf_s,
    )


def _two_level_warnings(rows: list[TwoLevelRow], costs: TierCosts, *, mttf_s: float,
                        same_intervals: bool) -> tuple[str, ...]:
    warnings: list[str] = []
    if same_intervals:
        warnings.append(
            "local-only saves do not pay with these costs (local save not cheaper than a "
            "durable one, or too few failures survive locally): every save durable, at "
            f"{format_duration(rows[1].remote_interval_s)}"
        )
    for r in rows:
        if r.remote_interval_s < costs.remote_complete_s:
            warnings.append(
                f"{r.name}: the remote interval {format_duration(r.remote_interval_s)} is "
                f"shorter than a durable save's completion {format_duration(costs.remote_complete_s)}: "
                "uploads would queue behind each other"
            )
        if not r.first_order_ok:
            warnings.append(
                f"{r.name}: τ_R+δ_R is above M/10 (M = {format_duration(mttf_s)}); the first-order "
                "model is unreliable there"
            )
    return tuple(warnings)
