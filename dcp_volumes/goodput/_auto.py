"""The autopilot's interval: the run's measured costs and failure estimate in, the cadences
out (pure; :mod:`dcp_volumes.checkpointer._autopilot` runs it).

Costs are medians over the newest :attr:`AutopilotOptions.window` samples, so one slow save
does not swing the interval. The durable interval is Young's ``τ = √(2δM)`` of work, i.e. a
save started every ``τ + δ`` seconds, clamped to at least the time a durable save takes to
complete (``δ + U``, with 10 % to spare: shorter, and saves would queue behind each other)
and to ``[min_interval_s, max_interval_s]``. With a local tier both cadences come from the
two-level plan (:func:`~dcp_volumes.goodput.two_level_intervals_s`). A new interval replaces
the current one only when it differs by more than ``change_threshold``. Until a steady save
is measured, ``δ`` is the first saves' (which also pay one-time setup): an upper bound, and
the interval it gives at most ``√(δ_first/δ)`` too long, for one interval.
"""

from __future__ import annotations

import dataclasses
import enum
import math
import statistics
from collections.abc import Collection
from dataclasses import dataclass
from typing import Any

from dcp_volumes.errors import ConfigError
from dcp_volumes.goodput._checks import MAX_DURATION_S, finite_or_none, positive
from dcp_volumes.goodput._estimate import (
    DEFAULT_PRIOR_TRUST,
    DEFAULT_PRIOR_WEIGHT,
    FailureEstimate,
    check_trust,
)
from dcp_volumes.goodput._model import FailureModel, expected_goodput
from dcp_volumes.goodput._record import RunRecord, SaveSample
from dcp_volumes.goodput._two_level import TierCosts, two_level_intervals_s

__all__ = ["RECORD_DEADLINE_S", "AutoInterval", "AutopilotOptions", "Bound", "MeasuredCosts",
           "choose_interval", "measured_costs", "settle_interval", "trusted_saves"]

#: a durable save is started no sooner than this share above its completion time
QUEUE_MARGIN = 1.1
#: the longest a read or a write of the run record takes, and close() and the exit wait
RECORD_DEADLINE_S = 10.0


@dataclass(frozen=True, kw_only=True)
class AutopilotOptions:
    """Options of ``Checkpointer(every_seconds="auto", autopilot=...)``.

    Args:
        failure_model: The prior failure rate (per-GPU AFR or fleet MTBF, as ``plan`` takes
            them); ``None``: the conservative default of
            :func:`~dcp_volumes.goodput.default_prior` for the run's world size.
        prior_weight: How many observed interruptions the prior counts as (its light
            half, for a given ``failure_model``).
        prior_trust: A given ``failure_model``'s share in a weighty half (4 interruptions)
            that keeps the estimate near it while the run agrees
            (:mod:`dcp_volumes.goodput._estimate`); 0: the light prior alone. The default
            prior is never trusted.
        min_interval_s: The fewest seconds between durable saves.
        max_interval_s: The most seconds between durable saves.
        change_threshold: A new interval replaces the current one only when it differs by
            more than this share.
        window: How many of the newest saves and restores the medians use.
        initial_interval_s: The interval before any save of this run was measured (the
            first save then measures ``δ``).
        started_at: When this incarnation started (wall clock, ``time.time()``); default:
            the process's start. A launcher that keeps warm spare processes passes the time
            it released this one, so the wait is neither exposure nor restart cost.
        record_deadline_s: The longest one read or one write of the run record may take
            (retries included: a store that hangs is given up on, counted in ``stats``),
            and the longest ``close()`` and the process's exit wait for the record, both
            together. The training loop never waits for the record.
    """

    failure_model: FailureModel | None = None
    prior_weight: float = DEFAULT_PRIOR_WEIGHT
    prior_trust: float = DEFAULT_PRIOR_TRUST
    min_interval_s: float = 1.0
    max_interval_s: float = 6 * 3600.0
    change_threshold: float = 0.1
    window: int = 8
    initial_interval_s: float = 1.0
    started_at: float | None = None
    record_deadline_s: float = RECORD_DEADLINE_S

    def __post_init__(self) -> None:
        if self.failure_model is not None and not isinstance(self.failure_model, FailureModel):
            raise ConfigError("failure_model must be a dcp_volumes.goodput.FailureModel or None")
        positive("prior_weight", self.prior_weight, at_most=1000.0)
        check_trust(self.prior_trust)
        lo = positive("min_interval_s", self.min_interval_s, at_most=MAX_DURATION_S)
        hi = positive("max_interval_s", self.max_interval_s, at_most=MAX_DURATION_S)
        if lo > hi:
            raise ConfigError(f"min_interval_s ({lo:g}) is above max_interval_s ({hi:g})")
        positive("initial_interval_s", self.initial_interval_s, at_most=MAX_DURATION_S)
        positive("record_deadline_s", self.record_deadline_s, at_most=3600.0)
        if self.started_at is not None:
            positive("started_at", self.started_at, at_most=1e10)
        if not 0 <= self.change_threshold < 1:
            raise ConfigError(f"change_threshold must be in [0, 1), got {self.change_threshold}")
        if isinstance(self.window, bool) or not isinstance(self.window, int) or self.window < 1:
            raise ConfigError(f"window must be a whole number >= 1, got {self.window!r}")


@dataclass(frozen=True, kw_only=True)
class MeasuredCosts:
    """Medians of the run's newest samples (None: not measured yet). ``restart_s``: from a
    process's start to training, plus what its first save blocks beyond a steady one."""

    durable_blocking_s: float | None
    steady_saves: int
    durable_background_s: float
    local_blocking_s: float | None
    local_background_s: float
    restart_s: float
    local_restore_s: float | None
    store_restore_s: float | None
    local_survives: float
    saves: int
    restores: int

    def to_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)


def _median(values: list[float]) -> float | None:
    return statistics.median(values) if values else None


def measured_costs(record: RunRecord, window: int = 8, *,
                   own: Collection[SaveSample] = ()) -> MeasuredCosts:
    """The costs in ``record``: medians of the newest ``window`` samples of each kind.
    ``own``: the saves this process measured (objects of ``record.saves``), which replace
    the record's claims (:func:`trusted_saves`)."""
    saves = trusted_saves(record.saves, own)

    def newest(kind: str) -> list[Any]:
        # an incarnation's first save also pays one-time setup: steady saves when there are
        of_kind = [s for s in saves if s.kind == kind]
        return ([s for s in of_kind if not s.first] or of_kind)[-window:]

    durable, local = newest("durable"), newest("local-only")
    # what an incarnation's first save blocks beyond a steady one is paid once per restart
    firsts = [s.blocking_s for s in saves if s.kind == "durable" and s.first][-window:]
    steady = [s.blocking_s for s in durable if not s.first]
    first_extra = (max(0.0, statistics.median(firsts) - statistics.median(steady))
                   if firsts and steady else 0.0)
    restores = record.restores[-window:]
    by_source = {src: [r.restore_s for r in restores if r.source == src]
                 for src in ("local", "store")}
    from_local = len(by_source["local"])
    return MeasuredCosts(
        durable_blocking_s=_median([s.blocking_s for s in durable]),
        steady_saves=len(steady),
        durable_background_s=_median([s.background_s for s in durable]) or 0.0,
        local_blocking_s=_median([s.blocking_s for s in local]),
        local_background_s=_median([s.background_s for s in local]) or 0.0,
        restart_s=(_median([r.start_to_train_s for r in restores]) or 0.0) + first_extra,
        local_restore_s=_median(by_source["local"]),
        store_restore_s=_median(by_source["store"]),
        # Beta(1, 1) prior: a half until resumes say otherwise
        local_survives=min((1 + from_local) / (2 + len(restores)), 0.95),
        saves=len(record.saves), restores=len(record.restores),
    )


def trusted_saves(saves: list[SaveSample], own: Collection[SaveSample]) -> list[SaveSample]:
    """``saves`` without the claims this process's measurements (``own``) replace.

    A save in the record that this process did not measure is a claim. It counts until this
    process measures a save of its sort (kind, first of an incarnation or steady), and a
    claimed steady save that took longer in all than this process's first save of its kind
    counts no more from that first save (a first save pays one-time setup on top of a
    steady one's work): a claimed cost lasts one interval at most, a claim of the same
    sort as what was measured none."""
    if not own:
        return saves
    mine = {id(s) for s in own}
    measured = {(s.kind, s.first) for s in own}
    ceiling: dict[str, float] = {}
    for s in own:
        if s.first:
            ceiling[s.kind] = max(ceiling.get(s.kind, 0.0), s.blocking_s + s.background_s)
    return [s for s in saves if id(s) in mine or (
        (s.kind, s.first) not in measured
        and (s.first or s.blocking_s + s.background_s <= ceiling.get(s.kind, math.inf)))]


@dataclass(frozen=True, kw_only=True)
class AutoInterval:
    """The cadences chosen, and why."""

    every_s: float
    local_every_s: float | None
    work_s: float
    delta_s: float | None
    upload_s: float
    restart_s: float
    mttf_s: float
    formula: str
    #: which bound decided ``every_s`` (typed: what a caller branches on)
    bound: Bound
    #: the bound's words and what else qualifies the choice (for people)
    reason: str
    predicted_goodput: float | None

    def to_dict(self) -> dict[str, Any]:
        d = dict(self.__dict__)
        d["mttf_s"] = finite_or_none(self.mttf_s)
        d["bound"] = self.bound.name.lower()
        return d


class Bound(str, enum.Enum):
    """Which bound decided an interval (the words of :attr:`AutoInterval.reason`)."""

    NOT_MEASURED = "no save measured yet: the first one measures δ"
    OPTIMUM = "optimum"
    CAPPED = "capped at max_interval_s"
    #: ``max_interval_s`` is shorter than a durable save takes to complete: saves queue
    QUEUES = ("capped at max_interval_s although a durable save takes longer to complete "
              "(δ + U): saves will queue")
    RAISED_TO_COMPLETION = ("raised to a durable save's completion time (δ + U) so saves do "
                            "not queue")
    RAISED_TO_MIN = "raised to min_interval_s"


def _clamp(seconds: float, floor: float, options: AutopilotOptions) -> tuple[float, Bound]:
    """``seconds`` within the bounds; ``max_interval_s`` wins over the floor (a save that
    takes longer than the longest interval allowed is a measurement to distrust, or a store
    to fix: saves then queue, :attr:`Bound.QUEUES`)."""
    hi = options.max_interval_s
    lo = min(max(options.min_interval_s, floor), hi)
    if floor > hi:
        return hi, Bound.QUEUES
    if not math.isfinite(seconds) or seconds > hi:
        return hi, Bound.CAPPED
    if seconds < lo:
        return lo, (Bound.RAISED_TO_COMPLETION if floor >= options.min_interval_s
                    else Bound.RAISED_TO_MIN)
    return seconds, Bound.OPTIMUM


def choose_interval(costs: MeasuredCosts, estimate: FailureEstimate, options: AutopilotOptions,
                    *, local_tier: bool) -> AutoInterval:
    """The cadences for ``costs`` and ``estimate`` (before smoothing)."""
    m = estimate.mttf_s
    delta = costs.durable_blocking_s
    if delta is None:
        every = min(max(options.initial_interval_s, options.min_interval_s),
                    options.max_interval_s)
        return AutoInterval(every_s=every, local_every_s=None, work_s=every, delta_s=None,
                            upload_s=0.0, restart_s=costs.restart_s, mttf_s=m,
                            formula="none yet", predicted_goodput=None,
                            bound=Bound.NOT_MEASURED, reason=Bound.NOT_MEASURED.value)
    delta = max(delta, 1e-3)
    upload = costs.durable_background_s
    floor = QUEUE_MARGIN * (delta + upload)
    chosen = (_two_level(costs, delta, upload, floor, m, options) if local_tier
              else _young(costs, delta, upload, floor, m, options))
    if costs.steady_saves == 0:  # a first save also pays one-time setup: never cheaper
        return dataclasses.replace(chosen, reason=f"{chosen.reason}; δ from first saves only, "
                                   "an upper bound until a steady save is measured")
    return chosen


def _young(costs: MeasuredCosts, delta: float, upload: float, floor: float, m: float,
           options: AutopilotOptions) -> AutoInterval:
    tau = math.sqrt(2.0 * delta * m) if math.isfinite(m) else math.inf
    every, why = _clamp(tau + delta, floor, options)
    work = max(every - delta, 1e-3)
    restart = costs.restart_s + upload
    return AutoInterval(
        every_s=every, local_every_s=None, work_s=work, delta_s=delta, upload_s=upload,
        restart_s=restart, mttf_s=m, bound=why, reason=why.value,
        formula=f"Young: τ = √(2δM) = √(2·{delta:.3g}·{m:.4g}) = {tau:.4g} s of work",
        predicted_goodput=expected_goodput(work, checkpoint_cost_s=delta, mttf_s=m,
                                           restart_cost_s=restart))


def _two_level(costs: MeasuredCosts, delta: float, upload: float, floor: float, m: float,
               options: AutopilotOptions) -> AutoInterval:
    dl = costs.local_blocking_s
    if dl is None or not math.isfinite(m):
        every, why = _clamp(math.sqrt(2.0 * delta * m) + delta, floor, options)
        return AutoInterval(every_s=every, local_every_s=every / 2, work_s=every - delta,
                            delta_s=delta, upload_s=upload, restart_s=costs.restart_s,
                            mttf_s=m, formula="Young on durable saves; local at half of it",
                            bound=why, reason=f"{why.value}; no local-only save measured yet: one between "
                            "durable saves measures δ_L", predicted_goodput=None)
    tiers = TierCosts(local_save_s=max(min(dl, delta), 1e-3), remote_save_s=delta,
                      local_survives=costs.local_survives,
                      local_complete_s=costs.local_background_s, remote_complete_s=upload,
                      local_restore_s=costs.local_restore_s or 0.0,
                      remote_restore_s=costs.store_restore_s or 0.0,
                      restart_s=costs.restart_s)
    tl, tr = two_level_intervals_s(costs=tiers, mttf_s=m)
    every, why = _clamp(tr + delta, floor, options)
    local_every = None if tl >= tr else max(min(tl + dl, every), options.min_interval_s)
    return AutoInterval(
        every_s=every, local_every_s=local_every, work_s=max(every - delta, 1e-3),
        delta_s=delta, upload_s=upload, restart_s=costs.restart_s, mttf_s=m, bound=why,
        reason=why.value, formula=(f"two-level: τ_L = √(2δ_L·M/p) = {tl:.4g} s, τ_R = √(2(δ_R−δ_L)·M/(1−p)) "
                 f"= {tr:.4g} s (δ_L {dl:.3g}, δ_R {delta:.3g}, p {costs.local_survives:.2f})"),
        predicted_goodput=None)


def settle_interval(previous: AutoInterval | None, new: AutoInterval,
           options: AutopilotOptions) -> AutoInterval:
    """``new`` when it differs from ``previous`` by more than the threshold (or the reason
    for the interval changed class), else ``previous``."""
    if previous is None or previous.delta_s is None:
        return new
    if (previous.local_every_s is None) != (new.local_every_s is None):
        return new
    ratio = new.every_s / previous.every_s
    if abs(ratio - 1.0) > options.change_threshold:
        return new
    return previous
