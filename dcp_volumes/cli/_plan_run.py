"""``dcp-volumes plan --from-run ROOT``: the plan from a run's own record (the autopilot's
measured costs and its failure estimate), printed as the usual plan table with the measured
figures, the prior and the evidence."""

from __future__ import annotations

import argparse
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from dcp_volumes.backends import redact_url
from dcp_volumes.cli._options import storage_options_for
from dcp_volumes.errors import ConfigError, DCPVolumesError, DownloadError

if TYPE_CHECKING:
    from dcp_volumes.goodput import FailureEstimate, FailureModel, MeasuredCosts, Plan, RunRecord

__all__ = ["run_from_run"]

#: the table around the optimum when no --intervals are given
_AROUND = (0.25, 0.5, 2.0, 4.0)
_NOT_WITH = ("checkpoint_cost_s", "from_bench", "local_save_s")


def run_from_run(args: argparse.Namespace,
                 prior_model: Callable[[int], FailureModel | None],
                 emit: Callable[[Plan, list[tuple[str, str]], dict[str, Any]], int]) -> int:
    """Plan from the record under ``args.from_run``; ``prior_model(gpus)`` is the rate the
    flags give (None: the default prior); ``emit`` prints the plan."""
    from dcp_volumes.goodput import (
        AutopilotOptions,
        FailurePrior,
        choose_interval,
        default_prior,
        estimate_failures,
        measured_costs,
    )

    used = [f"--{n.replace('_', '-')}" for n in _NOT_WITH if getattr(args, n) is not None]
    if used or args.restart_cost_s:
        raise ConfigError(f"{', '.join(used) or '--restart-cost-s'} does not apply with "
                          "--from-run: the costs are the run's measured ones")
    root = args.from_run
    record = _record(root, storage_options_for(args, root))
    gpus = args.gpus or record.gpus
    model = prior_model(gpus)
    prior = FailurePrior.from_model(model) if model is not None else default_prior(gpus)
    last_seen = max((i.last_seen for i in record.incarnations), default=0.0)
    n, exposure = record.evidence(last_seen)
    estimate = estimate_failures(prior, interruptions=n, exposure_s=exposure)
    costs = measured_costs(record)
    if costs.durable_blocking_s is None:
        raise ConfigError(f"the run record under {redact_url(root)} has no durable save "
                          "measured yet: plan again after the run's first save")
    auto = choose_interval(costs, estimate, AutopilotOptions(), local_tier=False)
    plan = _plan(args, gpus, costs, estimate)
    doc = {"run": {"root": redact_url(root), "run_id": record.run_id, "gpus": gpus,
                   "costs": costs.to_dict(), "failures": estimate.to_dict(),
                   "auto": auto.to_dict()}}
    return emit(plan, _summary(costs, estimate, auto.every_s), doc)


def _record(root: str, storage_options: dict[str, Any]) -> RunRecord:
    """The run's record; a store that refused or failed the read raises its own error (what
    it answered, never the credentials), a missing or unusable record a ConfigError."""
    from dcp_volumes.goodput import load_run_record

    got = load_run_record(root, storage_options)
    if got.error is not None:
        kind = type(got.error) if isinstance(got.error, DCPVolumesError) else DownloadError
        raise kind(f"the run record under {redact_url(root)} could not be read: "
                   f"{got.error}") from got.error
    if got.record is None:
        raise ConfigError(f"no usable run record under {redact_url(root)}: it is written by "
                          "Checkpointer(every_seconds=\"auto\") (a WARNING above says why one "
                          "was ignored)")
    return got.record


def _plan(args: argparse.Namespace, gpus: int, costs: MeasuredCosts,
          estimate: FailureEstimate) -> Plan:
    from dcp_volumes.goodput import (
        FailureModel,
        parse_duration_s,
        plan_intervals,
        young_interval_s,
    )

    assert costs.durable_blocking_s is not None
    delta = max(costs.durable_blocking_s, 1e-3)
    # the estimate as a failure model: one failure every M on the job's GPUs
    model = FailureModel.from_fleet(mtbf_hours=max(estimate.mttf_s, 1.0) / 3600.0,
                                    fleet_gpus=gpus, gpus=gpus)
    if args.intervals is not None:
        intervals = [parse_duration_s(t) for t in args.intervals.split(",") if t.strip()]
    else:
        young = young_interval_s(checkpoint_cost_s=delta, mttf_s=model.mttf_s)
        intervals = [young * k for k in _AROUND]
    return plan_intervals(
        model, checkpoint_cost_s=delta,
        restart_cost_s=costs.restart_s + costs.durable_background_s,
        job_hours=args.job_hours, intervals_s=intervals,
        method="daly" if args.daly else "young",
        cost_source=(f"measured: median blocking time of the run's newest durable saves "
                     f"({costs.saves} saves recorded)"))


def _summary(costs: MeasuredCosts, estimate: FailureEstimate,
             auto_every_s: float) -> list[tuple[str, str]]:
    from dcp_volumes.goodput import TRUSTED_PRIOR_WEIGHT, format_duration

    prior = estimate.prior
    observed = estimate.observed_mttf_s
    return [
        ("measured", (f"δ {costs.durable_blocking_s:.4g} s blocking, U "
                      f"{costs.durable_background_s:.4g} s to commit, restart "
                      f"{costs.restart_s:.4g} s ({costs.restores} resumes); restart cost = "
                      "restart + U")),
        ("prior", (f"M₀ {format_duration(prior.mttf_s)} ({prior.source}), weighing "
                   + (f"{prior.weight:g} interruption(s)" if prior.trust == 0 else
                      f"{prior.weight:g} interruption(s), {prior.trust:.0%} of it "
                      f"{TRUSTED_PRIOR_WEIGHT:g} while the run agrees "
                      f"(now {estimate.trusted_share:.0%})"))),
        ("evidence", (f"{estimate.interruptions} interruption(s) in "
                      f"{format_duration(estimate.exposure_s)} of running time"
                      + (f" (alone: M {format_duration(observed)})" if observed else ""))),
        ("estimate", (f"M {format_duration(estimate.mttf_s)}, the prior "
                      f"{estimate.prior_share:.0%} of it")),
        ("autopilot", f"a durable save every {format_duration(auto_every_s)} (τ + δ, bounded)"),
    ]
