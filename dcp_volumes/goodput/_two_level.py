"""Two tiers: frequent cheap local saves, rarer durable ones. See :mod:`dcp_volumes.goodput`
and ``docs/goodput.md`` ("Two tiers").

The job makes a save every ``τ_L`` of useful work; every ``τ_R`` of work that save is durable
(it goes to the store, and keeps a local copy too), the others are local-only. A share ``p`` of
failures leaves the local copies usable (a crashed process, a job requeued on its nodes, a lost
node whose partner holds a replica); the rest (lost nodes without replicas, several nodes, the
disks) restart from the store. Per unit of useful work, the saves block

    c = δ_L/τ_L + (δ_R − δ_L)/τ_R

and a failure costs, in wall time,

    p·(R + L_L + U_L + (1+c)·τ_L/2) + (1−p)·(R + L_R + U_R + (1+c)·τ_R/2)

(restart, restore from the tier that survived, the completion lag of a save, and half the work
since that tier's last save, redone with its saves). Goodput to first order:

    G = 1/(1+c) · (1 − E[loss per failure] / M)        clipped at 0.

Minimising the first-order expansion ``c + p·τ_L/(2M) + (1−p)·τ_R/(2M)`` term by term gives
Young's formula once per tier:

    τ_L = √(2·δ_L·M / p)        τ_R = √(2·(δ_R − δ_L)·M / (1 − p))

when that gives ``τ_L < τ_R``; otherwise local-only saves do not pay and both are Young's
``√(2·δ_R·M)`` (every save durable). With ``p = 0`` the model is the one-level model of
:func:`~dcp_volumes.goodput.expected_goodput` with restart ``R + L_R + U_R``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
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
from dcp_volumes.goodput._model import FailureModel

__all__ = [
    "TierCosts",
    "TwoLevelPlan",
    "TwoLevelRow",
    "expected_loss_per_failure_s",
    "plan_two_level",
    "two_level_goodput",
    "two_level_intervals_s",
]


@dataclass(frozen=True, kw_only=True)
class TierCosts:
    """Measured (or assumed) costs of the two kinds of save and of a restart.

    Args:
        local_save_s: Time a local-only save blocks training ``δ_L`` (> 0).
        remote_save_s: Time a durable save blocks training ``δ_R`` (> 0): a blocking save's
            duration, or what ``async_save`` blocks.
        local_complete_s: Lag from a local save's return to its copy being usable ``U_L``
            (0 for a blocking save).
        remote_complete_s: Lag from a durable save's return to its commit in the store
            ``U_R`` (the upload of an ``async_save``; 0 for a blocking save).
        local_restore_s: Time to load the state from the local tier ``L_L``.
        remote_restore_s: Time to load the state from the store ``L_R``.
        restart_s: Everything else a restart costs ``R``: detect, reschedule, start the
            processes, warm up.
        local_survives: Share of failures after which the local copies are usable ``p``,
            in ``[0, 1)``.

    Raises:
        ConfigError: A negative, NaN or infinite value, or ``local_survives`` outside
            ``[0, 1)``.
    """

    local_save_s: float
    remote_save_s: float
    local_survives: float
    local_complete_s: float = 0.0
    remote_complete_s: float = 0.0
    local_restore_s: float = 0.0
    remote_restore_s: float = 0.0
    restart_s: float = 0.0

    def __post_init__(self) -> None:
        positive("local_save_s", self.local_save_s, at_most=MAX_DURATION_S)
        positive("remote_save_s", self.remote_save_s, at_most=MAX_DURATION_S)
        for name in (
            "local_complete_s",
            "remote_complete_s",
            "local_restore_s",
            "remote_restore_s",
            "restart_s",
        ):
            non_negative(name, getattr(self, name), at_most=MAX_DURATION_S)
        p = non_negative("local_survives", self.local_survives)
        if p >= 1.0:
            raise ConfigError(
                f"local_survives is the share of failures the local tier survives, in [0, 1), "
                f"got {p:g}; storage loss and multi-node failures always need the store, so "
                "use e.g. 0.8, or 0.95 with peer replicas"
            )

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready form."""
        return {
            "local_save_s": self.local_save_s,
            "remote_save_s": self.remote_save_s,
            "local_complete_s": self.local_complete_s,
            "remote_complete_s": self.remote_complete_s,
            "local_restore_s": self.local_restore_s,
            "remote_restore_s": self.remote_restore_s,
            "restart_s": self.restart_s,
            "local_survives": self.local_survives,
        }


def _overhead_per_work(local_s: float, remote_s: float, costs: TierCosts) -> float:
    """``c``: blocked time per unit of useful work."""
    return costs.local_save_s / local_s + (costs.remote_save_s - costs.local_save_s) / remote_s


def _check_pair(local_interval_s: float, remote_interval_s: float) -> tuple[float, float]:
    tl = positive("local_interval_s", local_interval_s)
    tr = positive("remote_interval_s", remote_interval_s)
    if tl > tr:
        raise ConfigError(
            f"local_interval_s ({format_duration(tl)}) is longer than remote_interval_s "
            f"({format_duration(tr)}); every durable save also keeps a local copy, so the "
            "local interval is at most the remote one (equal: no local-only saves)"
        )
    return tl, tr


def expected_loss_per_failure_s(
    local_interval_s: float, remote_interval_s: float, *, costs: TierCosts
) -> float:
    """Wall time one failure costs on average (restart, restore, rework), two-tier model."""
    tl, tr = _check_pair(local_interval_s, remote_interval_s)
    c = _overhead_per_work(tl, tr, costs)
    p = costs.local_survives
    local = costs.restart_s + costs.local_restore_s + costs.local_complete_s + (1 + c) * tl / 2
    remote = costs.restart_s + costs.remote_restore_s + costs.remote_complete_s + (1 + c) * tr / 2
    return p * local + (1 - p) * remote


def two_level_goodput(
    local_interval_s: float, remote_interval_s: float, *, costs: TierCosts, mttf_s: float
) -> float:
    """Expected goodput with a local save every ``local_interval_s`` of work and a durable one
    every ``remote_interval_s``: ``1/(1+c) · (1 − E[loss per failure]/M)``, clipped at 0.

    ``local_interval_s == remote_interval_s`` means every save is durable (no local-only
    saves); with ``costs.local_survives == 0`` too, this equals
    :func:`~dcp_volumes.goodput.expected_goodput` with restart ``R + L_R + U_R``.

    Raises:
        ConfigError: A non-positive interval, or the local interval longer than the remote.
    """
    tl, tr = _check_pair(local_interval_s, remote_interval_s)
    m = positive("mttf_s", mttf_s, allow_inf=True)
    c = _overhead_per_work(tl, tr, costs)
    loss = 0.0 if math.isinf(m) else expected_loss_per_failure_s(tl, tr, costs=costs) / m
    return max(0.0, (1.0 - loss) / (1.0 + c))


def two_level_intervals_s(*, costs: TierCosts, mttf_s: float) -> tuple[float, float]:
    """The recommended ``(local, remote)`` intervals: Young's formula once per tier.

    ``τ_L = √(2·δ_L·M/p)`` and ``τ_R = √(2·(δ_R − δ_L)·M/(1−p))`` when ``τ_L < τ_R``;
    otherwise ``τ_L = τ_R = √(2·δ_R·M)`` (local-only saves do not pay: every save durable).
    Both are ``inf`` when ``M`` is ``inf``.
    """
    m = positive("mttf_s", mttf_s, allow_inf=True)
    if math.isinf(m):
        return math.inf, math.inf
    p, dl, dr = costs.local_survives, costs.local_save_s, costs.remote_save_s
    if p > 0 and dr > dl:
        tl = math.sqrt(2.0 * dl * m / p)
        tr = math.sqrt(2.0 * (dr - dl) * m / (1.0 - p))
        if tl < tr:
            return tl, tr
    one = math.sqrt(2.0 * dr * m)
    return one, one


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

    def make(name: str, tl: float, tr: float, c: TierCosts, local: bool) -> TwoLevelRow:
        return _two_level_row(name, tl, tr, c, local=local, mttf_s=m, gpus=failure_model.gpus,
                              job_hours=d_hours)

    t1 = math.sqrt(2.0 * costs.remote_save_s * m)
    tl, tr = two_level_intervals_s(costs=costs, mttf_s=m)
    rows = [make("remote-only", t1, t1, _remote_only(costs), False),
            make("two-tier", tl, tr, costs, True)]
    if given is not None:
        gl, gr = _check_pair(*given)
        rows.append(make("given", gl, gr, costs, True))
    return TwoLevelPlan(
        failure_model=failure_model,
        costs=costs,
        job_hours=d_hours,
        rows=tuple(rows),
        warnings=_two_level_warnings(rows, costs, mttf_s=m, same_intervals=tl == tr),
    )


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
    over = _overhead_per_work(tl, tr, c)
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
