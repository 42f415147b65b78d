"""Failure and checkpoint-interval model: how often to checkpoint, and what it costs.

A synchronous training job on ``N`` GPUs stops whenever any one of them fails. This module turns a
failure rate and a measured checkpoint cost into the job's mean time to failure, the chance of an
interruption, the optimal checkpoint interval (Young, Daly) and the expected goodput at any
interval. ``docs/goodput.md`` derives every formula; in short, with durations in seconds:

* job MTTF ``M = 8760 h / (AFR · N)`` or ``M = T · G / N`` (observed fleet: a failure every
  ``T`` hours across ``G`` GPUs);
* ``P(at least one interruption in D) = 1 − exp(−D / M)``;
* rework per failure ``τ/2 + R``;
* Young ``τ = √(2δM)``; Daly ``τ = √(2δM)·[1 + ⅓√(δ/2M) + (1/9)(δ/2M)] − δ`` for ``δ < 2M``,
  else ``τ = M``;
* goodput ``G(τ) = τ/(τ+δ) · (1 − (R + (τ+δ)/2) / M)``, clipped at 0.

The model covers infrastructure failures only, assumes independent exponential arrivals, and is
first order: trust it when ``τ + δ ≪ M``. A zero failure rate gives ``M = inf`` and is handled
everywhere (no finite optimum; goodput is ``τ/(τ+δ)``).
"""

from __future__ import annotations

import json
import math
import re
import statistics
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from dcp_volumes.errors import ConfigError

__all__ = [
    "DEFAULT_INTERVALS_S",
    "HOURS_PER_YEAR",
    "BenchCost",
    "FailureModel",
    "IntervalRow",
    "Plan",
    "checkpoint_cost_from_bench",
    "daly_interval_s",
    "expected_goodput",
    "expected_rework_s",
    "format_duration",
    "interruption_probability",
    "parse_duration_s",
    "plan_intervals",
    "plot_goodput",
    "young_interval_s",
]

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

# The first-order model drops terms of order ((τ+δ)/M)²; past this ratio they stop being small.
_FIRST_ORDER_LIMIT = 0.1

Method = Literal["young", "daly"]


# --------------------------------------------------------------------------------------------
# Validation helpers: every message names the argument and says what to pass instead.


def _number(name: str, value: object) -> float:
    # bool is an int subclass; True GPUs or an AFR of False is always a mistake.
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ConfigError(f"{name} must be a number, got {value!r} ({type(value).__name__})")
    if math.isnan(value):
        raise ConfigError(f"{name} is NaN; pass a real number")
    return float(value)


def _non_negative(name: str, value: object, *, allow_inf: bool = False) -> float:
    x = _number(name, value)
    if x < 0:
        raise ConfigError(f"{name} must be >= 0, got {x:g}")
    if math.isinf(x) and not allow_inf:
        raise ConfigError(f"{name} must be finite, got {x:g}")
    return x


def _positive(name: str, value: object, *, allow_inf: bool = False) -> float:
    x = _number(name, value)
    if x <= 0:
        raise ConfigError(f"{name} must be > 0, got {x:g}")
    if math.isinf(x) and not allow_inf:
        raise ConfigError(f"{name} must be finite, got {x:g}")
    return x


def _count(name: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ConfigError(f"{name} must be a whole number of GPUs, got {value!r}")
    if value < 1:
        raise ConfigError(f"{name} must be at least 1, got {value}")
    return value


def _mttf(name: str, value: object) -> float:
    # M = inf (no failures) is legal everywhere; M = 0 would mean failing continuously.
    return _positive(name, value, allow_inf=True)


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
        _count("gpus", self.gpus)
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
            afr = _non_negative("afr", self.afr)
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
        _positive("fleet_mtbf_hours", self.fleet_mtbf_hours, allow_inf=True)
        _count("fleet_gpus", self.fleet_gpus)

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
            "fleet_mtbf_hours": _finite_or_none(self.fleet_mtbf_hours),
            "fleet_gpus": self.fleet_gpus,
            "mttf_hours": _finite_or_none(self.mttf_hours),
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
    d = _non_negative("duration_s", duration_s, allow_inf=True)
    m = _mttf("mttf_s", mttf_s)
    if math.isinf(m):
        return 0.0
    return -math.expm1(-d / m)


def expected_rework_s(interval_s: float, *, restart_cost_s: float = 0.0) -> float:
    """Work lost to one failure: on average half an interval, plus the restart ``τ/2 + R``.

    A failure lands uniformly within the interval since the last checkpoint, so on average
    ``τ/2`` of progress is redone after paying ``R`` to restart (reschedule, load, warm up).
    """
    tau = _positive("interval_s", interval_s)
    r = _non_negative("restart_cost_s", restart_cost_s)
    return tau / 2.0 + r


def young_interval_s(*, checkpoint_cost_s: float, mttf_s: float) -> float:
    """Young's optimal checkpoint interval ``τ = √(2δM)``; ``inf`` when ``M`` is ``inf``.

    Args:
        checkpoint_cost_s: Time training is blocked by one checkpoint ``δ`` (> 0).
        mttf_s: The job's mean time to failure ``M``.
    """
    delta = _positive("checkpoint_cost_s", checkpoint_cost_s)
    m = _mttf("mttf_s", mttf_s)
    return math.sqrt(2.0 * delta * m)


def daly_interval_s(*, checkpoint_cost_s: float, mttf_s: float) -> float:
    """Daly's higher-order optimal interval.

    ``τ = √(2δM)·[1 + (1/3)√(δ/(2M)) + (1/9)(δ/(2M))] − δ`` for ``δ < 2M``, and ``τ = M``
    for ``δ ≥ 2M``. ``inf`` when ``M`` is ``inf``.

    Args:
        checkpoint_cost_s: Time training is blocked by one checkpoint ``δ`` (> 0).
        mttf_s: The job's mean time to failure ``M``.
    """
    delta = _positive("checkpoint_cost_s", checkpoint_cost_s)
    m = _mttf("mttf_s", mttf_s)
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
    tau = _positive("interval_s", interval_s)
    delta = _non_negative("checkpoint_cost_s", checkpoint_cost_s)
    m = _mttf("mttf_s", mttf_s)
    r = _non_negative("restart_cost_s", restart_cost_s)
    segment = tau + delta
    loss = 0.0 if math.isinf(m) else (r + segment / 2.0) / m
    return max(0.0, tau / segment * (1.0 - loss))


# --------------------------------------------------------------------------------------------
# Checkpoint cost from `dcp-volumes bench` results


@dataclass(frozen=True, kw_only=True)
class BenchCost:
    """A checkpoint cost ``δ`` read from a ``dcp-volumes bench`` JSON-lines file.

    Args:
        seconds: Median of ``metric`` over the matching lines.
        metric: ``"save_s"`` (blocking save) or ``"async_block_s"`` (time ``async_save``
            blocks training).
        samples: Lines the median was taken over.
        contender: The contender filter, or ``None`` for every line.
        path: The file read.
    """

    seconds: float
    metric: str
    samples: int
    contender: str | None
    path: str

    def describe(self) -> str:
        """One line saying where ``δ`` came from."""
        who = f", contender {self.contender!r}" if self.contender is not None else ""
        return f"median {self.metric} of {self.samples} run(s) in {self.path}{who}"


def checkpoint_cost_from_bench(
    path: str | Path,
    /,
    *,
    contender: str | None = None,
    use_async: bool = False,
) -> BenchCost:
    """Median checkpoint cost from a ``dcp-volumes bench`` JSON-lines result file.

    Each line that parses as a JSON object with a finite, non-negative number under the
    metric counts; blank lines, ``#`` comments, markdown table lines and other non-JSON text
    are skipped, so a captured bench stdout can be passed as is.

    Args:
        path: The JSON-lines file.
        contender: Keep only lines whose ``"contender"`` equals this.
        use_async: Read ``async_block_s`` (time ``async_save`` blocks training) instead of
            ``save_s`` (a blocking save).

    Returns:
        The median, with how many lines it came from.

    Raises:
        ConfigError: The file cannot be read, or no line matches; the message lists the
            contenders and metrics the file does have.
    """
    metric = "async_block_s" if use_async else "save_s"
    p = Path(path)
    try:
        text = p.read_text(encoding="utf-8")
    except FileNotFoundError as exc:
        raise ConfigError(
            f"bench file {str(p)!r} does not exist; write one with `dcp-volumes bench ... > "
            f"{p.name}` or give the checkpoint cost directly"
        ) from exc
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"cannot read bench file {str(p)!r}: {exc}") from exc

    records = list(_json_objects(text.splitlines()))
    values = [
        v
        for rec in records
        if contender is None or rec.get("contender") == contender
        if (v := _bench_value(_metric_of(rec, metric))) is not None
    ]
    if not values:
        raise ConfigError(_no_match_message(p, records, metric=metric, contender=contender))
    return BenchCost(
        seconds=float(statistics.median(values)),
        metric=metric,
        samples=len(values),
        contender=contender,
        path=str(p),
    )


def _metric_of(rec: Mapping[str, Any], metric: str) -> Any:
    """A metric from a bench line: top level, or under ``result`` (``dcp-volumes bench``)."""
    if metric in rec:
        return rec[metric]
    result = rec.get("result")
    return result.get(metric) if isinstance(result, Mapping) else None


def _json_objects(lines: Iterable[str]) -> Iterable[Mapping[str, Any]]:
    for line in lines:
        s = line.strip()
        if not s.startswith("{"):
            continue
        try:
            obj = json.loads(s)
        except json.JSONDecodeError:
            continue
        if isinstance(obj, dict):
            yield obj


def _bench_value(raw: object) -> float | None:
    if isinstance(raw, bool) or not isinstance(raw, (int, float)):
        return None
    if not math.isfinite(raw) or raw < 0:
        return None
    return float(raw)


def _no_match_message(
    path: Path, records: Sequence[Mapping[str, Any]], *, metric: str, contender: str | None
) -> str:
    if not records:
        return f"bench file {str(path)!r} holds no JSON-object lines; is it `dcp-volumes bench` output?"
    contenders = sorted({str(r["contender"]) for r in records if "contender" in r})
    listed = ", ".join(contenders) if contenders else "none named"
    if contender is not None and contender not in contenders:
        return (
            f"no line in bench file {str(path)!r} has contender {contender!r}; "
            f"contenders there: {listed}"
        )
    other = "save_s" if metric == "async_block_s" else "async_block_s"
    hint = ""
    if any(_bench_value(_metric_of(r, other)) is not None for r in records):
        switch = (
            "drop --async (use_async=False)"
            if other == "save_s"
            else ("pass --async (use_async=True)")
        )
        hint = f"; lines do have {other!r}: {switch} to read it"
    who = f" for contender {contender!r}" if contender is not None else ""
    return (
        f"no line in bench file {str(path)!r} has a number under {metric!r}{who}{hint}"
        f" (contenders there: {listed})"
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
    kind: Literal["candidate", "young", "daly"] = "candidate"

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

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready form; infinities become ``None`` so ``json.dumps`` stays standard."""
        opt = self.optimum
        return {
            "failure_model": self.failure_model.to_dict(),
            "mttf_hours": _finite_or_none(self.mttf_hours),
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
        cost_source: Where ``δ`` came from, in words (see :meth:`BenchCost.describe`).

    Returns:
        The plan.

    Raises:
        ConfigError: A negative, NaN or zero value where it makes no sense, an empty
            ``intervals_s`` or an unknown ``method``.
    """
    if not isinstance(failure_model, FailureModel):
        raise ConfigError(
            f"failure_model must be a FailureModel, got {type(failure_model).__name__}"
        )
    delta = _positive("checkpoint_cost_s", checkpoint_cost_s)
    r = _non_negative("restart_cost_s", restart_cost_s)
    d_hours = None if job_hours is None else _positive("job_hours", job_hours)
    if method not in ("young", "daly"):
        raise ConfigError(f"method must be 'young' or 'daly', got {method!r}")
    taus = sorted({_positive("each of intervals_s", t) for t in intervals_s})
    if not taus:
        raise ConfigError("intervals_s is empty; pass at least one candidate interval")

    m = failure_model.mttf_s

    def row(tau: float, kind: Literal["candidate", "young", "daly"]) -> IntervalRow:
        g = expected_goodput(tau, checkpoint_cost_s=delta, mttf_s=m, restart_cost_s=r)
        return IntervalRow(
            interval_s=tau,
            goodput=g,
            overhead=delta / (tau + delta),
            rework_s=expected_rework_s(tau, restart_cost_s=r),
            lost_hours=None if d_hours is None else d_hours * (1.0 - g),
            first_order_ok=(tau + delta) <= _FIRST_ORDER_LIMIT * m,
            kind=kind,
        )

    young = daly = None
    if math.isfinite(m):
        young = row(young_interval_s(checkpoint_cost_s=delta, mttf_s=m), "young")
        daly = row(daly_interval_s(checkpoint_cost_s=delta, mttf_s=m), "daly")

    p_int = expected = None
    if d_hours is not None:
        p_int = interruption_probability(duration_s=d_hours * 3600.0, mttf_s=m)
        expected = 0.0 if math.isinf(m) else d_hours * 3600.0 / m

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


def _finite_or_none(x: float | None) -> float | None:
    return x if x is not None and math.isfinite(x) else None


# --------------------------------------------------------------------------------------------
# Plot

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


def plot_goodput(plan: Plan, path: str | Path, /, *, title: str | None = None) -> Path:
    """Write a PNG of expected goodput against checkpoint interval.

    The curve spans the candidate intervals and both optima on a log axis; candidates are
    marked as points and the Young and Daly optima as vertical lines. Uses matplotlib's Agg
    canvas directly, so pyplot's global backend is left alone.

    Args:
        plan: From :func:`plan_intervals`.
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
        from matplotlib.ticker import (
            FixedLocator,
            FuncFormatter,
            NullFormatter,
            PercentFormatter,
        )
    except ImportError as exc:
        raise ConfigError(
            "plotting needs matplotlib: pip install matplotlib (or 'dcp-volumes[all]')"
        ) from exc

    out = Path(path)
    m = plan.failure_model.mttf_s
    delta, r = plan.checkpoint_cost_s, plan.restart_cost_s
    optima = [row for row in (plan.young, plan.daly) if row is not None]
    span = [row.interval_s for row in plan.rows] + [row.interval_s for row in optima]
    lo, hi = min(span) / 2.0, max(span) * 2.0
    n = 400
    xs = [lo * (hi / lo) ** (i / (n - 1)) for i in range(n)]
    ys = [expected_goodput(x, checkpoint_cost_s=delta, mttf_s=m, restart_cost_s=r) for x in xs]

    fig = Figure(figsize=(8, 4.8), dpi=120)
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    ax.plot([x / 3600.0 for x in xs], ys, color="tab:blue", label="expected goodput")
    ax.scatter(
        [row.interval_s / 3600.0 for row in plan.rows],
        [row.goodput for row in plan.rows],
        color="tab:blue",
        zorder=3,
        label="candidates",
    )
    styles = {"young": ("tab:green", "--", "Young"), "daly": ("tab:red", ":", "Daly")}
    for row in optima:
        color, ls, name = styles[row.kind]
        ax.axvline(
            row.interval_s / 3600.0,
            color=color,
            linestyle=ls,
            label=(f"{name} τ = {format_duration(row.interval_s)} ({row.goodput:.2%})"),
        )
    edge = _FIRST_ORDER_LIMIT * m - delta  # τ where τ+δ reaches M/10
    if math.isfinite(m) and edge < hi:
        ax.axvspan(
            max(edge, lo) / 3600.0,
            hi / 3600.0,
            color="0.9",
            zorder=0,
            label="τ+δ > M/10: model unreliable",
        )
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
    mt = "∞" if math.isinf(m) else format_duration(m)
    ax.set_title(
        title
        or f"{plan.failure_model.describe()}: M = {mt}, δ = {format_duration(delta)}, "
        f"R = {format_duration(r)}",
        fontsize="medium",
    )
    fig.tight_layout()
    fig.savefig(out, format="png")
    return out


# --------------------------------------------------------------------------------------------
# Durations as people write them


_DURATION = re.compile(r"^\s*(\d+(?:\.\d*)?|\.\d+)\s*(s|sec|m|min|h|hr|d)\s*$", re.IGNORECASE)
_UNIT_S = {"s": 1.0, "sec": 1.0, "m": 60.0, "min": 60.0, "h": 3600.0, "hr": 3600.0, "d": 86400.0}


def parse_duration_s(text: str) -> float:
    """Seconds in a duration like ``"90s"``, ``"5m"``, ``"1.5h"`` or ``"1d"``.

    The unit is required: a bare ``30`` could mean seconds or minutes.

    Raises:
        ConfigError: Not a positive number followed by s, m, h or d.
    """
    match = _DURATION.match(text)
    if not match:
        raise ConfigError(
            f"cannot read duration {text!r}; write a number and a unit, e.g. 90s, 5m, 1.5h, 1d"
        )
    seconds = float(match.group(1)) * _UNIT_S[match.group(2).lower()]
    if seconds <= 0:
        raise ConfigError(f"duration {text!r} must be greater than zero")
    return seconds


def format_duration(seconds: float) -> str:
    """A short human form: ``"45s"``, ``"5m"``, ``"1h 42m"``, ``"3d 15h"``, ``"inf"``."""
    if math.isinf(seconds):
        return "inf"
    if seconds < 60:
        return f"{seconds:.3g}s"
    s = round(seconds)
    for big, big_u, small, small_u in (
        (86400, "d", 3600, "h"),
        (3600, "h", 60, "m"),
        (60, "m", 1, "s"),
    ):
        if s >= big:
            whole, rest = divmod(s, big)
            part = round(rest / small)
            if part * small == big:  # rounding carried into the larger unit
                whole, part = whole + 1, 0
            return f"{whole}{big_u}" + (f" {part}{small_u}" if part else "")
    return f"{s}s"
