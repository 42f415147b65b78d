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

Two tiers (:func:`plan_two_level`): a local save every ``τ_L``, a durable one every ``τ_R``,
a share ``p`` of failures survived by the local copies; each tier gets Young's interval from
its extra cost and the failures it must cover, ``τ_L = √(2δ_L·M/p)``,
``τ_R = √(2(δ_R−δ_L)·M/(1−p))`` (see :mod:`dcp_volumes.goodput._two_level`).

The model covers infrastructure failures only, assumes independent exponential arrivals, and is
first order: trust it when ``τ + δ ≪ M``. A zero failure rate gives ``M = inf`` and is handled
everywhere (no finite optimum; goodput is ``τ/(τ+δ)``).
"""

from __future__ import annotations

from dcp_volumes.goodput._auto import (
    RECORD_DEADLINE_S,
    AutoInterval,
    AutopilotOptions,
    Bound,
    MeasuredCosts,
    choose_interval,
    measured_costs,
    settle_interval,
)
from dcp_volumes.goodput._durations import format_duration, parse_duration_s
from dcp_volumes.goodput._estimate import (
    TRUSTED_PRIOR_WEIGHT,
    FailureEstimate,
    FailurePrior,
    default_prior,
    estimate_failures,
)
from dcp_volumes.goodput._model import (
    DEFAULT_INTERVALS_S,
    FailureModel,
    daly_interval_s,
    expected_goodput,
    expected_rework_s,
    interruption_probability,
    young_interval_s,
)
from dcp_volumes.goodput._plan import IntervalRow, Plan, plan_intervals
from dcp_volumes.goodput._record import (
    MAX_SAVES,
    Incarnation,
    RestoreSample,
    RunRecord,
    SaveSample,
    run_key,
)
from dcp_volumes.goodput._store import (
    RecordRead,
    load_run_record,
    read_run_record,
    record_root,
    store_run_record,
    write_run_record,
)
from dcp_volumes.goodput._two_level import TierCosts
from dcp_volumes.goodput._two_level_compare import TwoLevelPlan, plan_two_level

__all__ = [
    "DEFAULT_INTERVALS_S",
    "MAX_SAVES",
    "RECORD_DEADLINE_S",
    "TRUSTED_PRIOR_WEIGHT",
    "AutoInterval",
    "AutopilotOptions",
    "Bound",
    "FailureEstimate",
    "FailureModel",
    "FailurePrior",
    "Incarnation",
    "IntervalRow",
    "MeasuredCosts",
    "Plan",
    "RecordRead",
    "RestoreSample",
    "RunRecord",
    "SaveSample",
    "TierCosts",
    "TwoLevelPlan",
    "choose_interval",
    "daly_interval_s",
    "default_prior",
    "estimate_failures",
    "expected_goodput",
    "expected_rework_s",
    "format_duration",
    "interruption_probability",
    "load_run_record",
    "measured_costs",
    "parse_duration_s",
    "plan_intervals",
    "plan_two_level",
    "read_run_record",
    "record_root",
    "run_key",
    "settle_interval",
    "store_run_record",
    "write_run_record",
    "young_interval_s",
]
