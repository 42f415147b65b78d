"""What the autopilot's prior weight costs in the goodput harness's setting (simulated, not
measured): a Monte-Carlo of 120 s runs (``--budget``) at ``M`` = 40 s with the harness's
pooled costs (``δ`` 1.45 s, restart + first-save extra 10.6 s), ``auto`` given the *right*
prior with weight ``w`` (``M̂ = (w·M₀ + T)/(w + n)``, re-chosen at each save) against the fixed
14.9 s the harness ran as Young's, on common failure times per seed. Also: failures that land
in a restart left uncounted (as before the run record was written at construction)::

    python benchmarks/goodput_prior_weight.py --seeds 3000

Prints the mean paired difference auto − fixed (points) and its per-seed standard deviation.
"""

from __future__ import annotations

import argparse
import math
import random
import statistics

DELTA, RESTART, M, YOUNG = 1.45, 10.6, 40.0, 14.9


def failures(seed: int, budget: float) -> list[float]:
    rng, out, t = random.Random(seed), [], 0.0
    while True:
        t += rng.expovariate(1.0 / M)
        if t > budget:
            return [*out, math.inf]
        out.append(t)


def run(seed: int, budget: float, w: float | None, *, count_restarts: bool = True) -> float:
    """Goodput of one run; ``w`` None: the fixed interval."""
    fails = failures(seed, budget)
    t, kept, n, i, first = 0.0, 0.0, 0, 0, True
    while t < budget:
        if not first:  # a restart, which a failure may interrupt
            if fails[i] < t + RESTART:
                t, i, n = fails[i], i + 1, n + int(count_restarts)
                continue
            t += RESTART
        first, progress = False, kept
        while True:
            if t >= budget:  # the budget ended during a save: its work was done
                return progress / budget
            every = YOUNG if w is None else math.sqrt(2 * DELTA * (w * M + t) / (w + n)) + DELTA
            end = t + every - DELTA
            if fails[i] < min(end + DELTA, budget):  # killed in the work or the save
                t, i, n = fails[i], i + 1, n + 1
                break
            if end >= budget:
                return (progress + budget - t) / budget
            progress, t, kept = progress + every - DELTA, end + DELTA, progress + every - DELTA
    return kept / budget


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--seeds", type=int, default=3000)
    p.add_argument("--budget", type=float, default=120.0)
    args = p.parse_args()
    fixed = [run(s, args.budget, None) for s in range(args.seeds)]
    for w, counted in ((0.25, True), (0.25, False), (1.0, True), (4.0, True)):
        d = [100 * (run(s, args.budget, w, count_restarts=counted) - f)
             for s, f in enumerate(fixed)]
        print(f"w {w:g}{'' if counted else ', failures in restarts uncounted'}: auto − fixed "
              f"{statistics.fmean(d):+.2f} points (sd per seed {statistics.stdev(d):.1f}; "
              f"fixed {statistics.fmean(fixed):.1%})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
