"""What the autopilot's prior weight costs in the goodput harness's setting (simulated, not
measured): a Monte-Carlo of 120 s runs (``--budget``) at ``M`` = 40 s with the harness's
pooled costs (``--delta``, ``--restart``: restart + first-save extra), ``auto`` given the
*right* prior, re-choosing ``√(2δM̂) + δ`` at each save, against the fixed interval the harness
ran as Young's (``--fixed``, 14.9 s), on common failure times per seed. Estimators of ``M̂``
after ``n`` interruptions in ``T`` seconds: the autopilot's conjugate one with weight ``w``,
``M̂ = (w·M₀ + T)/(w + n)``, and, for comparison, a robust mixture of two Gamma priors at the
same ``M₀`` (an informative one of weight 4 and a vague one of weight 0.25, half each a
priori; the posterior mixes their means by how well each predicted the run's failures).
``--bootstrap-saves 2``: ``auto`` first saves twice back to back to measure ``δ``, as the
autopilot did before ``75164f9`` (since: once, ``--bootstrap-saves 1``). Also: failures that land in a restart left uncounted (as before the run
record was written at construction)::

    python benchmarks/goodput_prior_weight.py --seeds 3000
    python benchmarks/goodput_prior_weight.py --delta 1.22 --restart 3.0 --bootstrap-saves 2

``--rows JSONL`` replays the failure times the harness injected in each seed of a results file
(``benchmarks/goodput_autopilot.py``'s ``kills_at_s``) instead of drawing them, and prints the
simulated auto − fixed per seed beside the measured one::

    python benchmarks/goodput_prior_weight.py --rows benchmarks/results/goodput-autopilot-crn4.jsonl \\
        --delta 1.22 --restart 3.0 --bootstrap-saves 2

Prints the mean paired difference auto − fixed (points) and its per-seed standard deviation.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
from collections.abc import Callable

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from goodput_launch import failure_schedule  # type: ignore[import-not-found]

from dcp_volumes.goodput import FailurePrior, estimate_failures

Estimator = Callable[[float, int], float]  # (exposure T, interruptions n) -> M̂


def estimator(m0: float, weight: float, trust: float) -> Estimator:
    """The autopilot's own estimate (:func:`dcp_volumes.goodput.estimate_failures`) of a
    prior ``M₀`` of this weight and trust (0: the conjugate ``(w·M₀ + T)/(w + n)``)."""
    prior = FailurePrior(mttf_s=m0, weight=weight, trust=trust)
    return lambda t, n: estimate_failures(prior, interruptions=n, exposure_s=t).mttf_s


def conjugate(w: float, m0: float) -> Estimator:
    return estimator(m0, w, 0.0)


def robust(m0: float) -> Estimator:
    """A given prior since ``27b4b82``: half ``Gamma(4, 4·M₀)``, half ``Gamma(0.25, 0.25·M₀)``."""
    return estimator(m0, 0.25, 0.5)


def run(kills: list[float], args: argparse.Namespace, est: Estimator | None, *,
        count_restarts: bool = True) -> float:
    """Goodput of one run killed at ``kills``; ``est`` None: the fixed interval."""
    fails, delta = [*kills, math.inf], args.delta
    t, kept, n, i, first = 0.0, 0.0, 0, 0, True
    while t < args.budget:
        if not first:  # a restart, which a failure may interrupt
            if fails[i] < t + args.restart:
                t, i, n = fails[i], i + 1, n + int(count_restarts)
                continue
            t += args.restart
        elif est is not None:  # the saves that measure δ, a step apart
            for _ in range(args.bootstrap_saves):
                if fails[i] < t + args.step + delta:
                    break
                t, kept = t + args.step + delta, kept + args.step
        first, progress = False, kept
        while True:
            if t >= args.budget:  # the budget ended during a save: its work was done
                return progress / args.budget
            every = args.fixed if est is None else math.sqrt(2 * delta * est(t, n)) + delta
            end = t + every - delta
            if fails[i] < min(end + delta, args.budget):  # killed in the work or the save
                t, i, n = fails[i], i + 1, n + 1
                break
            if end >= args.budget:
                return (progress + args.budget - t) / args.budget
            progress, t, kept = progress + every - delta, end + delta, progress + every - delta
    return kept / args.budget


def _replay(args: argparse.Namespace, estimators: dict[str, Estimator]) -> None:
    runs: dict[int, dict[str, dict]] = {}
    with open(args.rows) as f:
        for line in f:
            row = json.loads(line)
            if row.get("section") == "run" and row.get("goodput") is not None:
                runs.setdefault(row["seed"], {})[row["config"]] = row
    diffs: dict[str, list[float]] = {name: [] for name in [*estimators, "measured"]}
    print("| seed | failures | measured auto − fixed | " + " | ".join(estimators) + " |")
    print("|---|---|---|" + "---|" * len(estimators))
    for seed, by in sorted(runs.items()):
        if "auto" not in by or "fixed-young" not in by:
            continue
        kills = by["auto"]["kills_at_s"]
        fixed = run(kills, args, None)
        diffs["measured"].append(100 * (by["auto"]["goodput"] - by["fixed-young"]["goodput"]))
        for name, est in estimators.items():
            diffs[name].append(100 * (run(kills, args, est) - fixed))
        print(f"| {seed} | {len(kills)} | " + " | ".join(
            f"{diffs[k][-1]:+.1f}" for k in ["measured", *estimators]) + " |")
    print("| mean | | " + " | ".join(f"{statistics.fmean(diffs[k]):+.2f}"
                                     for k in ["measured", *estimators]) + " |")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--seeds", type=int, default=3000)
    p.add_argument("--budget", type=float, default=120.0)
    p.add_argument("--mttf", type=float, default=40.0)
    p.add_argument("--delta", type=float, default=1.45)
    p.add_argument("--restart", type=float, default=10.6)
    p.add_argument("--fixed", type=float, default=14.9)
    p.add_argument("--step", type=float, default=0.1)
    p.add_argument("--bootstrap-saves", type=int, default=0)
    p.add_argument("--rows", metavar="JSONL", help="replay the harness's failure times")
    args = p.parse_args()
    estimators = {f"w {w:g}": conjugate(w, args.mttf) for w in (0.25, 1.0, 4.0)}
    estimators["robust mixture"] = robust(args.mttf)
    if args.rows:
        _replay(args, estimators)
        return 0
    kills = [failure_schedule(s, args.budget, args.mttf) for s in range(args.seeds)]
    fixed = [run(k, args, None) for k in kills]
    cases = [(name, est, True) for name, est in estimators.items()]
    cases.insert(1, ("w 0.25, failures in restarts uncounted", estimators["w 0.25"], False))
    for name, est, counted in cases:
        d = [100 * (run(k, args, est, count_restarts=counted) - f) for k, f in zip(kills, fixed)]
        print(f"{name}: auto − fixed {statistics.fmean(d):+.2f} points (sd per seed "
              f"{statistics.stdev(d):.1f}; fixed {statistics.fmean(fixed):.1%})")
    for name, est in (("w 0.25", conjugate(0.25, args.mttf * 10)),
                      ("robust mixture", robust(args.mttf * 10))):
        ratios = [math.sqrt(est(n * args.mttf, n) / args.mttf) for n in range(1, 9)]
        print(f"{name}, a prior 10x too optimistic: interval / right one after n = 1..8 "
              "interruptions (at T = n·M): " + ", ".join(f"{r:.2f}" for r in ratios))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
