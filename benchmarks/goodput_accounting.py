"""Where each goodput run's wall time went, term by term, measured from its events and
predicted by the model (``benchmarks/goodput_autopilot.py`` writes the runs).

The window of a run is ``wall_s`` seconds from its first start of training. Incarnation ``i``
runs from its launch (the first one: from the window's start) to the next launch (or the
window's end). Its time is

- **restart**: launch to start of training (the whole incarnation when it was killed before
  it trained: a failure during a restart);
- **first save, extra**: how much longer the incarnation's first save blocked than the run's
  median steady save (one-time setup: writer, connections, staging buffers);
- **saves**: every save's blocking time (the first saves' steady part included);
- **lost**: killed incarnations only: from their last completed save (or their start of
  training when none completed) to the kill -- work redone by the next incarnation;
A run whose wall clock stepped by more than 1 s (``clock_step_s``: the VM paused, or the
clock was set) gets no account (its events are stamped with the wall clock); its goodput,
on the monotonic clock, stands.

- **per step**: what is left beyond ``final_step × step time`` (the **useful** work): time
  each step spends outside its measured step time -- the cadence's decision (with a timed
  cadence, a collective every step), the progress and event writes -- plus a step cut by a
  kill and the kill's wait.

The prediction uses the run's own failure count ``N`` (the same for every configuration of a
seed: common random numbers), its measured ``δ`` (median steady save), ``R`` (median launch
to training), first-save extra ``X`` and the cadence it kept (``every``, save start to save
start)::

    M' = W/N,  p = 1 − e^(−R/M')    (the chance a failure lands in the restart before it)
    restart   = N·M'·p  (≈ N·R)     first save extra = (N(1 − p) + 1)·X
    lost      = (N(1 − p) + p)·(M' − every/(e^(every/M') − 1))   (≈ N·every/2, every ≪ M')
    saves     = (W − restart − extra − lost) · δ / every
    per step  = (W − the four) · ε / (step + ε)     (ε: pooled, measured per step)
    useful    = W − the five

With ``p = 0`` and ``every/2`` for the lost work this is the first-order goodput
``τ/(τ+δ)·(1 − N(R + X + (τ+δ)/2)/W)`` with ``N/W`` for ``1/M`` (and no ``ε``, ``X``); the exact expectation of the
time since the last save matters once ``every`` is not small against ``M`` (the too-rare
interval: ``every/2`` predicts twice the loss measured).
"""

from __future__ import annotations

import bisect
import json
import math
import statistics
from typing import Any

TERMS = ("restart", "first_save_extra", "saves", "lost", "per_step", "useful")


def events_of(path: str) -> list[dict[str, Any]]:
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def incarnations(row: dict[str, Any], events: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The run's incarnations with their events (wall clock spans)."""
    begin = [row["start_wall"], *row["launch_wall"][1:]]
    launch = list(row["launch_wall"])
    end = [*row["launch_wall"][1:], row["start_wall"] + row["wall_s"]]
    incs = [{"launch": launch[i], "begin": begin[i], "end": end[i], "events": [],
             "killed": i < len(end) - 1} for i in range(len(begin))]
    for ev in events:
        i = bisect.bisect_right(launch, ev["t"]) - 1
        if 0 <= i < len(incs):
            incs[i]["events"].append(ev)
    return incs


def steady_delta(events: list[dict[str, Any]]) -> tuple[float | None, list[float], list[float]]:
    """The median steady save (not an incarnation's first), the steady saves and the first
    saves' blocking times. A save is an incarnation's first when no save came between it and
    the incarnation's start of training (ticks in between do not count)."""
    steady, first, fresh = [], [], False
    for ev in events:
        if ev["ev"] == "trained":
            fresh = True
        elif ev["ev"] == "save":
            (first if fresh else steady).append(ev["blocking_s"])
            fresh = False
    return (statistics.median(steady) if steady else None), steady, first


def measured_terms(row: dict[str, Any], delta: float | None = None) -> dict[str, float] | None:
    """Seconds of the window per term (see the module docstring), measured; ``delta``: the
    steady save when the run measured none (each of its incarnations saved at most once)."""
    events = events_of(row["events_file"])
    delta = steady_delta(events)[0] or delta
    if delta is None or not row.get("step_s"):
        return None
    t = dict.fromkeys(TERMS[:4], 0.0)
    for i, inc in enumerate(incarnations(row, events)):
        trained = next((e["t"] for e in inc["events"] if e["ev"] == "trained"), None)
        if i > 0:
            t["restart"] += (trained if trained is not None else inc["end"]) - inc["begin"]
        saves = [e for e in inc["events"] if e["ev"] == "save"]
        t["saves"] += sum(e["blocking_s"] for e in saves)
        if saves:
            t["first_save_extra"] += max(0.0, saves[0]["blocking_s"] - delta)
            t["saves"] -= max(0.0, saves[0]["blocking_s"] - delta)
        if inc["killed"] and trained is not None:
            t["lost"] += inc["end"] - max([trained, *(e["t"] for e in saves)])
    by_time = row["wall_s"] - sum(t[k] for k in TERMS[:4])
    t["useful"] = row["final_step"] * row["step_s"]
    t["per_step"] = by_time - t["useful"]
    return t


def lost_per_failure(every: float, mttf: float) -> float:
    """Expected work lost to one failure with a save every ``every`` seconds and failures
    at rate ``1/mttf``: the time since the last save (or the start of training) at the
    failure, ``E[L mod every]`` for an exponential lifetime ``L``, which is
    ``mttf − every/(e^(every/mttf) − 1)``: ``every/2`` while ``every ≪ mttf`` (the
    first-order model), at most ``mttf`` however rare the saves."""
    if every <= 0:
        return 0.0
    return mttf - every / math.expm1(every / mttf)


def predicted_terms(row: dict[str, Any], *, delta: float, restart: float, extra: float,
                    every: float, per_step: float = 0.0) -> dict[str, float]:
    """Seconds of the window per term at the run's own failure count ``N`` (rate ``N/W``,
    ``M' = W/N``). A failure starts a restart of ``R``; the next failure lands in it with
    probability ``p = 1 − e^(−R/M')``, so a restart costs ``E[min(Exp(M'), R)] = M'·p`` and
    about ``N·(1 − p) + p`` failures land in training, each losing
    :func:`lost_per_failure`; every incarnation that trains (the first one included) pays
    its first save's extra. ``per_step``: the seconds each step spends outside its measured
    step time (the cadence's decision, a collective in a timed cadence; the progress write)."""
    n, w = row["failures"] + row.get("self_deaths", 0), row["wall_s"]
    m = w / n if n else math.inf
    p = -math.expm1(-restart / m) if n else 0.0
    in_training = n * (1 - p) + p if n else 0.0
    t = {"restart": m * p if n else 0.0, "first_save_extra": (in_training + 1 - p) * extra,
         "lost": in_training * (lost_per_failure(every, m) if n else 0.0)}
    t["restart"] *= n
    t["saves"] = max(0.0, w - sum(t.values())) * delta / every
    rest = w - sum(t.values())
    t["per_step"] = rest * per_step / (row["step_s"] + per_step)
    t["useful"] = rest - t["per_step"]
    return t


def account(row: dict[str, Any], pooled_delta: float | None = None,
            per_step: float = 0.0) -> dict[str, Any] | None:
    """Measured and predicted terms of one run, with the parameters the prediction used: the
    run's own δ (``pooled_delta`` when it measured no steady save), its mean restart (none
    without a failure) and the median extra of its first saves."""
    if row.get("clock_step_s", 0.0) > 1.0:
        return None  # the events' wall-clock stamps moved under the run: no per-term account
    events = events_of(row["events_file"])
    delta, _, first = steady_delta(events)
    delta = delta or pooled_delta
    measured = measured_terms(row, delta)
    if measured is None:
        return None
    every = row.get("save_gap_s") or (float(row["every"]) if row["every"] != "auto" else None)
    if every is None:
        return None
    extra = max(0.0, statistics.median(first) - delta) if first else 0.0
    assert delta is not None
    restart = row.get("restart_mean_s") or 0.0
    predicted = predicted_terms(row, delta=delta, restart=restart, extra=extra, every=every,
                                per_step=per_step)
    return {"delta_s": delta, "restart_s": row.get("restart_mean_s"), "first_save_extra_s": extra,
            "every_s": every, "measured": measured, "predicted": predicted}
