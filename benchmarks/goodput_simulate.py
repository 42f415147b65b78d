"""Simulated (not measured): what ``every_seconds="auto"`` chooses at 1,024–16,384 GPUs and the
goodput it gets, a discrete-event simulation running the autopilot's own code.

The job alternates work and blocking saves; failures are a Poisson process over wall time at
the job's rate (``N`` GPUs × a per-GPU rate), also during restarts; a failure loses the work
since the last save's start and costs a restart ``R``, and the first save after a restart
blocks ``X`` more (one-time setup). The costs are the ones measured by
``benchmarks/goodput_autopilot.py`` on this machine (``--delta``, ``--restart``,
``--first-save-extra``: the pooled median steady save, launch to training and first-save
extra of its runs), each save's ``δ`` drawn with 20 % log-normal noise. Failure rates: 1 % AFR per GPU (the seed's), and the Llama 3 report's one
interruption every ~3 h on 16,384 GPUs scaled to ``N``.

Policies: ``auto`` (the autopilot's run record, Gamma–Poisson estimate and interval choice,
:mod:`dcp_volumes.goodput`, driven by the simulated clock) with the default prior (nothing
given) and with a prior 10× too optimistic; the offline Young optimum (the true rate
known); fixed 30 min and 2 h. Goodput = useful work ÷ wall time over ``--days``::

    python benchmarks/goodput_simulate.py --delta 1.45 --restart 8.8 --first-save-extra 1.8 \
        --days 30 --seeds 3
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import statistics
import sys
from typing import Any

from dcp_volumes.goodput import (
    AutopilotOptions,
    FailurePrior,
    Incarnation,
    RestoreSample,
    RunRecord,
    SaveSample,
    choose_interval,
    default_prior,
    estimate_failures,
    expected_goodput,
    measured_costs,
    settle_interval,
)

HERE = os.path.dirname(os.path.abspath(__file__))
T0 = 1.8e9
RATES = {"afr-1%": lambda n: 8760.0 * 3600.0 / (0.01 * n),
         "llama3": lambda n: 3.0 * 3600.0 * 16384 / n}


class Auto:
    """The autopilot's pure core on a simulated clock."""

    def __init__(self, prior: FailurePrior) -> None:
        self.prior, self.opts = prior, AutopilotOptions()
        self.record = RunRecord(root="sim://run")
        self.record.add_incarnation(Incarnation(T0, T0))
        self.current = None

    def every(self, now: float) -> float:
        n, t = self.record.evidence(T0 + now)
        est = estimate_failures(self.prior, interruptions=n, exposure_s=t)
        new = choose_interval(measured_costs(self.record), est, self.opts, local_tier=False)
        self.current = settle_interval(self.current, new, self.opts)
        return float(self.current.every_s)

    def saved(self, now: float, delta: float, every: float, first: bool = False) -> None:
        self.record.add_save(SaveSample("durable", delta, 0.0, 0, T0 + now, first=first))
        inc = self.record.incarnations[-1]
        inc.last_seen, inc.interval_s = T0 + now, every

    def restarted(self, failed_at: float, now: float, restart: float) -> None:
        self.record.add_incarnation(Incarnation(T0 + failed_at, T0 + now))
        self.record.add_restore(RestoreSample(restart / 2, restart, "store", T0 + now))


def simulate(policy: Any, *, mttf: float, delta: float, restart: float, days: float,
             seed: int, extra: float = 0.0) -> dict[str, Any]:
    """One run of ``days``; ``policy`` is a number (seconds between save starts) or Auto;
    ``extra``: what the first save after a restart blocks beyond ``δ``."""
    rng = random.Random(seed)
    end, t, useful, failures = days * 86400.0, 0.0, 0.0, 0
    first = True
    next_fail = rng.expovariate(1.0 / mttf)
    chosen: list[float] = []
    while t < end:
        every = policy.every(t) if isinstance(policy, Auto) else float(policy)
        chosen.append(every)
        d = delta * math.exp(rng.gauss(0.0, 0.2)) + (extra if first else 0.0)
        work = max(every - delta, 1e-3)
        if min(next_fail, end) >= t + work + d:  # the segment and its save complete
            t += work + d
            useful += work
            if isinstance(policy, Auto):
                policy.saved(t, d, every, first)
            first = False
            continue
        if next_fail >= end:  # the run ends inside this segment: its work so far counts
            useful += max(0.0, min(end - t, work))
            break
        failures += 1  # the segment's work is lost; restart, failing again meanwhile
        failed_at = t = next_fail
        next_fail = t + rng.expovariate(1.0 / mttf)
        while next_fail < t + restart:
            failures, t = failures + 1, next_fail
            next_fail = t + rng.expovariate(1.0 / mttf)
        t += restart
        first = True
        if isinstance(policy, Auto):
            policy.restarted(failed_at, t, restart)
    return {"goodput": useful / end, "failures": failures,
            "median_every_s": statistics.median(chosen) if chosen else None,
            "final_every_s": chosen[-1] if chosen else None}


def _policies(n: int, mttf: float, delta: float) -> dict[str, Any]:
    young = math.sqrt(2.0 * delta * mttf) + delta
    return {
        "auto (default prior)": lambda: Auto(default_prior(n)),
        "auto (prior 10x optimistic)": lambda: Auto(FailurePrior(mttf_s=10 * mttf)),
        "young (true M known)": lambda: young,
        "fixed 30 min": lambda: 1800.0,
        "fixed 2 h": lambda: 7200.0,
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--delta", type=float, required=True, help="save blocking time, s")
    p.add_argument("--restart", type=float, required=True, help="restart cost, s")
    p.add_argument("--first-save-extra", type=float, default=0.0,
                   help="what the first save after a restart blocks beyond δ, s")
    p.add_argument("--days", type=float, default=30.0)
    p.add_argument("--seeds", type=int, default=5)
    p.add_argument("--gpus", default="1024,4096,16384")
    p.add_argument("--out", default=os.path.join(HERE, "results", "goodput-simulated.jsonl"))
    args = p.parse_args(argv)
    print("| rate | GPUs | M | policy | interval chosen (final, median over seeds) | "
          "simulated goodput, median (min–max) | model at that interval |")
    print("|---|---|---|---|---|---|---|")
    for rate, m_of in RATES.items():
        for n in (int(x) for x in args.gpus.split(",")):
            mttf = m_of(n)
            for name, make in _policies(n, mttf, args.delta).items():
                runs = [simulate(make(), mttf=mttf, delta=args.delta, restart=args.restart,
                                 days=args.days, seed=s, extra=args.first_save_extra)
                        for s in range(args.seeds)]
                _row(args, rate, n, mttf, name, runs)
    return 0


def _row(args: argparse.Namespace, rate: str, n: int, mttf: float, name: str,
         runs: list[dict[str, Any]]) -> None:
    every = statistics.median(r["final_every_s"] for r in runs)
    g = [r["goodput"] for r in runs]
    model = expected_goodput(max(every - args.delta, 1e-3), checkpoint_cost_s=args.delta,
                             mttf_s=mttf, restart_cost_s=args.restart + args.first_save_extra)
    row = {"section": "simulated", "rate": rate, "gpus": n, "mttf_s": mttf, "policy": name,
           "delta_s": args.delta, "restart_s": args.restart,
           "first_save_extra_s": args.first_save_extra, "days": args.days,
           "seeds": args.seeds, "final_every_s": every, "goodput": g, "model_goodput": model,
           "failures": [r["failures"] for r in runs], "command": " ".join(sys.argv)}
    with open(args.out, "a") as f:
        f.write(json.dumps(row) + "\n")
    print(f"| {rate} | {n:,} | {mttf / 3600:.3g} h | {name} | {every:,.0f} s | "
          f"{statistics.median(g):.2%} ({min(g):.2%}–{max(g):.2%}) | {model:.2%} |", flush=True)


if __name__ == "__main__":
    raise SystemExit(main())
