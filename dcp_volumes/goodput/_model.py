"""Failure rates, the job's mean time to failure, and the interval formulas (Young, Daly,
goodput). See :mod:`dcp_volumes.goodput`."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Literal

from dcp_volumes.errors import ConfigError
from dcp_volumes.goodput._checks import (
    MAX_DURATION_S,
    MIN_FLEET_MTBF_HOURS,
    count,
    finite_or_none,
    mttf,
    non_negative,
    positive,
)

HOURS_PER_YEAR = 8760.0
"""Hours in the (non-leap) year that annualised failure rates are quoted against."""

DEFAULT_INTERVALS_S: tuple[float, ...] = (
    300.0,  # 5 min
    600.0,  # 10 min
    900.0,  # 15 min
    1800.0,  # 30 min
    3600.0,  # 1 h
    7200.0,  # 2 h
    14400.0,  # 4 h
    28800.0,  # 8 h
    43200.0,  # 12 h
    86400.0,  # 24 h
)
"""Candidate checkpoint intervals that :func:`plan_intervals` tabulates by default."""

Method = Literal["young", "daly"]
RowKind = Literal["candidate", "young", "daly"]


# --------------------------------------------------------------------------------------------
# Failure model


@dataclass(frozen=True, kw_only=True)
class FailureModel:
    """How often a job of ``gpus`` GPUs is interrupted by an infrastructure failure.

    Give exactly one source: ``afr`` (per-GPU annualised failure rate) or the pair
    ``fleet_mtbf_hours`` + ``fleet_gpus`` (an observed fleet has one failure every
    ``fleet_mtbf_hours`` hours across ``fleet_gpus`` GPUs). Either way failures are independent
    exponential arrivals per GPU, and any single failure interrupts the whole job, so the job's
    failure rate is ``gpus`` times the per-GPU rate.

    Args:
        gpus: GPUs the job needs at once (``N``).
        afr: Failures per GPU per year, as a fraction: ``0.05`` means 5 %. ``0`` means no
            failures (``mttf_hours`` is ``inf``).
        fleet_mtbf_hours: Observed hours between failures across the whole fleet (``T``);
            ``inf`` means none were observed.
        fleet_gpus: GPUs in that fleet (``G``).

    Raises:
        ConfigError: Both or neither source given, or a value is negative, NaN or out of range.
    """

    gpus: int
    afr: float | None = None
    fleet_mtbf_hours: float | None = None
    fleet_gpus: int | None = None

    def __post_init__(self) -> None:
        count("gpus", self.gpus)
        has_fleet = self.fleet_mtbf_hours is not None or self.fleet_gpus is not None
        if self.afr is None and not has_fleet:
            raise ConfigError(
                "give a failure rate: afr (e.g. afr=0.05 for 5 % per GPU-year) or "
                "fleet_mtbf_hours together with fleet_gpus"
            )
        if self.afr is not None and has_fleet:
            raise ConfigError(
                "give afr or fleet_mtbf_hours + fleet_gpus, not both; drop one of them"
            )
        if self.afr is not None:
            afr = non_negative("afr", self.afr)
            if afr > 1:
                raise ConfigError(
                    f"afr is a fraction per GPU-year (0.05 means 5 %), got {afr:g}; "
                    f"did you mean {afr / 100:g}? For more than one failure per GPU-year, "
                    "use fleet_mtbf_hours + fleet_gpus"
                )
            return
        if self.fleet_mtbf_hours is None or self.fleet_gpus is None:
            missing = "fleet_gpus" if self.fleet_gpus is None else "fleet_mtbf_hours"
            raise ConfigError(f"fleet_mtbf_hours and fleet_gpus go together; also pass {missing}")
        hours = positive("fleet_mtbf_hours", self.fleet_mtbf_hours, allow_inf=True,
                         at_most=MAX_DURATION_S / 3600.0)
        if hours < MIN_FLEET_MTBF_HOURS:
            raise ConfigError(
                f"fleet_mtbf_hours must be at least {MIN_FLEET_MTBF_HOURS:.3g} h (one second; "
                f"valid range: {MIN_FLEET_MTBF_HOURS:.3g} to {MAX_DURATION_S / 3600.0:g} h, or "
                f"inf for no failure observed), got {hours:g}"
            )
        count("fleet_gpus", self.fleet_gpus)

    @classmethod
    def from_afr(cls, afr: float, /, *, gpus: int) -> FailureModel:
        """Failure model from a per-GPU annualised failure rate (``0.05`` = 5 %/year)."""
        return cls(gpus=gpus, afr=afr)

    @classmethod
    def from_fleet(cls, *, mtbf_hours: float, fleet_gpus: int, gpus: int) -> FailureModel:
        """Failure model from an observed fleet: one failure every ``mtbf_hours`` on
        ``fleet_gpus`` GPUs."""
        return cls(gpus=gpus, fleet_mtbf_hours=mtbf_hours, fleet_gpus=fleet_gpus)

    @property
    def gpu_hours_per_failure(self) -> float:
        """GPU-hours between failures of any one GPU (``8760/AFR`` or ``T·G``); may be inf."""
        if self.afr is not None:
            return math.inf if self.afr == 0 else HOURS_PER_YEAR / self.afr
        assert self.fleet_mtbf_hours is not None and self.fleet_gpus is not None
        return float(self.fleet_mtbf_hours) * self.fleet_gpus

    @property
    def mttf_hours(self) -> float:
        """The job's mean time to failure ``M`` in hours: ``8760/(AFR·N)`` or ``T·G/N``."""
        return self.gpu_hours_per_failure / self.gpus

    @property
    def mttf_s(self) -> float:
        """The job's mean time to failure ``M`` in seconds."""
        return self.mttf_hours * 3600.0

    @property
    def failures_per_hour(self) -> float:
        """The job's failure rate ``1/M`` per hour (0 when failures never happen)."""
        return 1.0 / self.mttf_hours

    def describe(self) -> str:
        """One line naming where the failure rate came from, for tables and logs."""
        if self.afr is not None:
            return f"{self.gpus} GPUs, AFR {self.afr:g}/GPU-year"
        return (
            f"{self.gpus} GPUs, fleet: 1 failure every {self.fleet_mtbf_hours:g} h "
            f"on {self.fleet_gpus} GPUs"
        )

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready form; an infinite MTTF is ``None``."""
        return {
            "gpus": self.gpus,
            "afr": self.afr,
            "fleet_mtbf_hours": finite_or_none(self.fleet_mtbf_hours),
            "fleet_gpus": self.fleet_gpus,
            "mttf_hours": finite_or_none(self.mttf_hours),
        }


# --------------------------------------------------------------------------------------------
# Formulas. Durations are in seconds unless the name says otherwise.


def interruption_probability(*, duration_s: float, mttf_s: float) -> float:
    """Chance of at least one interruption in ``duration_s``: ``1 − exp(−D/M)``.

    Args:
        duration_s: Wall-clock duration of the job ``D``.
        mttf_s: The job's mean time to failure ``M``; ``inf`` gives 0.

    Raises:
        ConfigError: A negative or NaN argument, or ``mttf_s`` of 0.
    """
    d = non_negative("duration_s", duration_s, allow_inf=True)
    m = mttf("mttf_s", mttf_s)
    if math.isinf(m):
        return 0.0
    return -math.expm1(-d / m)


def expected_rework_s(interval_s: float, *, restart_cost_s: float = 0.0) -> float:
    """Work lost to one failure: on average half an interval, plus the restart ``τ/2 + R``.

    A failure lands uniformly within the interval since the last checkpoint, so on average
    ``τ/2`` of progress is redone after paying ``R`` to restart (reschedule, load, warm up).
    """
    tau = positive("interval_s", interval_s)
    r = non_negative("restart_cost_s", restart_cost_s)
    return tau / 2.0 + r


def young_interval_s(*, checkpoint_cost_s: float, mttf_s: float) -> float:
    """Young's optimal checkpoint interval ``τ = √(2δM)``; ``inf`` when ``M`` is ``inf``.

    Args:
        checkpoint_cost_s: Time training is blocked by one checkpoint ``δ`` (> 0).
        mttf_s: The job's mean time to failure ``M``.
    """
    delta = positive("checkpoint_cost_s", checkpoint_cost_s)
    m = mttf("mttf_s", mttf_s)
    return math.sqrt(2.0 * delta * m)


def daly_interval_s(*, checkpoint_cost_s: float, mttf_s: float) -> float:
    """Daly's higher-order optimal interval.

    ``τ = √(2δM)·[1 + (1/3)√(δ/(2M)) + (1/9)(δ/(2M))] − δ`` for ``δ < 2M``, and ``τ = M``
    for ``δ ≥ 2M``. ``inf`` when ``M`` is ``inf``.

    Args:
        checkpoint_cost_s: Time training is blocked by one checkpoint ``δ`` (> 0).
        mttf_s: The job's mean time to failure ``M``.
    """
    delta = positive("checkpoint_cost_s", checkpoint_cost_s)
    m = mttf("mttf_s", mttf_s)
    if math.isinf(m):
        return math.inf
    if delta >= 2.0 * m:
        return m
    x = delta / (2.0 * m)
    return math.sqrt(2.0 * delta * m) * (1.0 + math.sqrt(x) / 3.0 + x / 9.0) - delta


def expected_goodput(
    interval_s: float,
    *,
    checkpoint_cost_s: float,
    mttf_s: float,
    restart_cost_s: float = 0.0,
) -> float:
    """Expected fraction of wall time spent on new work, first-order model.

    ``G(τ) = τ/(τ+δ) · (1 − (R + (τ+δ)/2) / M)``, clipped at 0. Each segment is ``τ`` of
    useful work plus a blocking checkpoint ``δ``; failures arrive at rate ``1/M`` and each
    costs the restart ``R`` plus, on average, half a segment. Valid while ``τ + δ ≪ M``.

    Args:
        interval_s: Useful work between checkpoints ``τ`` (> 0, finite).
        checkpoint_cost_s: Time training is blocked per checkpoint ``δ`` (>= 0).
        mttf_s: The job's mean time to failure ``M``; ``inf`` gives ``τ/(τ+δ)``.
        restart_cost_s: Time from a failure to training again ``R`` (>= 0).

    Returns:
        Goodput in ``[0, 1]``.
    """
    tau = positive("interval_s", interval_s)
    delta = non_negative("checkpoint_cost_s", checkpoint_cost_s)
    m = mttf("mttf_s", mttf_s)
    r = non_negative("restart_cost_s", restart_cost_s)
    segment = tau + delta
    loss = 0.0 if math.isinf(m) else (r + segment / 2.0) / m
    return max(0.0, tau / segment * (1.0 - loss))
