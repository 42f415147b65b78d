"""``auto``'s interval over time, per seed, from the goodput harness's rows and events files
(``benchmarks/goodput_autopilot.py``): the interval in force at each moment (time-weighted
mean before and after the seed's first failure), the interval and the failure estimate ``M``
in force at each kill, and the kills that landed in a restart, before the incarnation
reached training (before the record was written at construction, such a kill was not
counted)::

    python benchmarks/goodput_trace.py benchmarks/results/goodput-autopilot-crn.jsonl

Times are the events' wall clock against the run's start (``start_wall``): a run whose wall
clock stepped (``clock_step_s``) is marked and its times are off by the step.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
from typing import Any


def _events(path: str) -> list[dict[str, Any]]:
    if not os.path.exists(path):
        return []
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def _timeline(row: dict[str, Any]) -> list[tuple[float, float, float | None]]:
    """(seconds from the start of training, interval, M) at each change of ``auto``'s
    interval; a restart's first moments run at the initial interval until it is set."""
    out = []
    for e in _events(row["events_file"]):
        t = e["t"] - row["start_wall"]
        if e["ev"] == "interval":
            out.append((t, float(e["every"]), (e.get("interval") or {}).get("mttf_s")))
    return out


def _in_force(timeline: list[tuple[float, float, float | None]],
              t: float) -> tuple[float | None, float | None]:
    before = [x for x in timeline if x[0] <= t]
    return (before[-1][1], before[-1][2]) if before else (None, None)


def _weighted(timeline: list[tuple[float, float, float | None]], lo: float,
              hi: float) -> float | None:
    total, acc = 0.0, 0.0
    for (t, every, _), nxt in zip(timeline, [*timeline[1:], (hi, 0.0, None)], strict=True):
        a, b = max(t, lo), min(nxt[0], hi)
        if b > a:
            total, acc = total + (b - a), acc + (b - a) * every
    return acc / total if total else None


def trace(row: dict[str, Any], young: float) -> dict[str, Any]:
    tl = _timeline(row)
    kills = row.get("kills_at_s", [])
    wall = row["wall_s"]
    first = kills[0] if kills else wall
    at_kill = [_in_force(tl, k) for k in kills]
    launches = [w - row["start_wall"] for w in row.get("launch_wall", [])]
    trained = [e["t"] - row["start_wall"] for e in _events(row["events_file"])
               if e["ev"] == "trained"]
    # in a restart: the last launch before the kill came after the last start of training
    in_restart = sum(1 for k in kills
                     if max((lt for lt in launches if lt < k), default=-1e9)
                     > max((tr for tr in trained if tr < k), default=-1e9))
    return {"seed": row["seed"], "young": young, "failures": len(kills),
            "before_first": _weighted(tl, 0.0, first), "after_first": _weighted(tl, first, wall),
            "at_kills": [(round(e, 1) if e else None, round(m, 0) if m else None)
                         for e, m in at_kill],
            "kills_in_restart": in_restart, "clock_step_s": row.get("clock_step_s", 0.0)}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("rows", help="the harness's JSON lines")
    args = p.parse_args(argv)
    with open(args.rows) as f:
        rows = [json.loads(line) for line in f if line.strip()]
    runs = [r for r in rows if r.get("section") == "run"]
    young = {r["seed"]: r["every"] for r in runs if r["config"] == "fixed-young"}
    print("| seed | failures | auto before the first failure (s) | after it (s) | Young (s) | "
          "auto's interval, M at each kill | kills in a restart | clock step (s) |")
    print("|---|---|---|---|---|---|---|---|")
    ratios = []
    for r in sorted((r for r in runs if r["config"] == "auto"), key=lambda r: r["seed"]):
        t = trace(r, young.get(r["seed"], float("nan")))
        fmt = lambda x: "–" if x is None else f"{x:.1f}"
        if t["before_first"]:
            ratios.append(t["before_first"] / t["young"])
        print(f"| {t['seed']} | {t['failures']} | {fmt(t['before_first'])} | "
              f"{fmt(t['after_first'])} | {t['young']:.1f} | {t['at_kills']} | "
              f"{t['kills_in_restart']} | {t['clock_step_s']:.1f} |")
    if ratios:
        print(f"\nauto / Young before the first failure: median {statistics.median(ratios):.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
