"""Goodput under injected failures: fixed checkpoint intervals against ``every_seconds="auto"``.

A real training job (``benchmarks/goodput_worker.py``: 2 gloo ranks, a fixed step time, a
state of ``--state-mib`` MiB per rank saved synchronously through a ``Checkpointer`` to a local
SeaweedFS behind the s3-like proxy, 30 ms before every response and 10 MB/s per connection)
runs for ``--budget`` seconds per configuration from its first start of training. Failures are
a Poisson process of mean ``--mttf`` drawn once per seed (``goodput_launch.failure_schedule``):
every configuration of a seed has every rank SIGKILLed at the *same* times after its first
start of training (common random numbers), then relaunched at once (warm spares, which resume
through ``load_latest``); a failure that lands during a restart kills the restarting job.
So within a seed the configurations differ by their interval only, and per-seed differences
between configurations are paired. Goodput is the progress kept, ``final step × step time ÷
wall time``, the step time the one measured in the run (``goodput_stated`` uses the nominal
0.1 s).

Configurations, interleaved (each seed runs them all, in rotated order): fixed intervals --
too frequent, too rare, and the offline Young optimum from a calibration run's ``δ`` and the
injected ``M`` -- and ``auto`` given the injected rate as its prior. Each row records the
run's kill times, the progress at each kill, its launches and the machine's load average;
``goodput_accounting`` splits each run's wall time into restart, first-save extra, saves,
lost work and useful work, measured from its events and predicted by the model at the run's
own failure count, ``δ``, ``R`` and cadence::

    python benchmarks/goodput_autopilot.py --budget 120 --seeds 6 --mttf 40 \
        --out benchmarks/results/goodput-autopilot-crn.jsonl \
        --events-dir benchmarks/results/goodput-crn-events --plot goodput.png

Prints one JSON line per run (and writes them to ``--out``) and the markdown tables.
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import os
import signal
import statistics
import sys
import tempfile
import time
import uuid
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from goodput_accounting import steady_delta  # type: ignore[import-not-found]
from goodput_launch import (  # type: ignore[import-not-found]
    Load,
    Spares,
    failure_schedule,
    kill,
    read_step,
    wait_trained,
)
from goodput_report import predict  # type: ignore[import-not-found]

HERE = os.path.dirname(os.path.abspath(__file__))
_PROFILE = (0.030, 10e6)


def run_once(args: argparse.Namespace, cfg: dict[str, Any], seed: int, store: dict[str, Any],
             budget: float, kills_at: list[float], spares: Spares) -> dict[str, Any]:
    """One configuration for ``budget`` seconds from its first start of training, every rank
    SIGKILLed at ``kills_at`` (seconds from that start) and relaunched at once."""
    tmp = os.path.join(args.events_dir, f"{cfg['name']}-s{seed}-{uuid.uuid4().hex[:4]}")
    os.makedirs(tmp, exist_ok=True)
    files = {k: os.path.join(tmp, k) for k in ("progress", "events")}
    root = f"{store['bucket']}/{cfg['name']}-{seed}-{uuid.uuid4().hex[:6]}"
    job = {"root": root, "options": store["options"], "every": str(cfg["every"]),
           "prior_mttf_s": cfg.get("prior_mttf_s"), "step_time": args.step_time,
           "state_mib": args.state_mib, "progress": files["progress"],
           "events": files["events"]}
    load = Load()
    launches = [time.time()]
    offsets = [time.time() - time.monotonic()]  # a wall-clock step (NTP, a paused VM) moves it
    procs = spares.launch(job)
    start = wait_trained(files["events"], procs, 300.0)
    end = start + budget
    pending = [start + k for k in kills_at]
    kills: list[float] = []  # seconds from the start of training
    steps_at_kill: list[int] = []
    self_deaths = 0
    while True:
        nxt = pending[0] if pending else math.inf
        died = False
        while time.monotonic() < min(nxt, end):
            load.sample()
            if any(p.poll() is not None for p in procs):
                died = True  # a rank died on its own (e.g. the other one's collective broke)
                break
            time.sleep(0.02)
        if time.monotonic() >= end:
            break
        kill(procs)
        if died:
            self_deaths += 1
        else:
            kills.append(pending.pop(0) - start)
        steps_at_kill.append(read_step(files["progress"]))
        launches.append(time.time())
        offsets.append(time.time() - time.monotonic())
        procs = spares.launch(job)
    kill(procs)
    wall = time.monotonic() - start
    offsets.append(time.time() - time.monotonic())
    step = read_step(files["progress"])
    m = _measured(files["events"], launches)
    m.pop("first_trained")
    return {"config": cfg["name"], "every": cfg["every"], "seed": seed, "wall_s": wall,
            "clock_step_s": max(offsets) - min(offsets), "events_file": files["events"],
            "final_step": step, "failures": len(kills), "self_deaths": self_deaths,
            "kills_at_s": kills, "steps_at_kill": steps_at_kill,
            "launch_wall": launches, "start_wall": offsets[0] + start,
            "goodput_stated": step * args.step_time / wall, "trained_wall_s": wall,
            "goodput": step * m["step_s"] / wall if m["step_s"] else None,
            **load.summary(), **m}


def _measured(events_path: str, launches: list[float]) -> dict[str, Any]:
    """δ (median steady save), R (median launch to training over the restarts) and the auto's
    intervals."""
    events = []
    if os.path.exists(events_path):
        with open(events_path) as f:
            events = [json.loads(line) for line in f if line.strip()]
    # each incarnation's first save also pays one-time setup (as the autopilot counts δ)
    delta, steady, first = steady_delta(events)
    if delta is None and first:
        delta = statistics.median(first)
    trained = [e["t"] for e in events if e["ev"] == "trained"]
    restarts = []
    for t in trained:  # the launch just before each start of training, the first one's not
        before = [launch for launch in launches if launch <= t]
        if len(before) > 1:
            restarts.append(t - max(before))
    gaps = []  # between two saves of one incarnation: the cadence as it happened
    marks = [e for e in events if e["ev"] in ("save", "trained")]
    counted = [e for e in events if e["ev"] in ("save", "tick")]
    n_steps = sum(e["steps"] for e in counted)
    step_s = sum(e["steps_wall"] for e in counted) / n_steps if n_steps else None
    for a, b in itertools.pairwise(marks):
        if a["ev"] == "save" and b["ev"] == "save":
            gaps.append(b["t"] - a["t"])
    intervals = [e["every"] for e in events if e["ev"] == "interval"]
    extra = [f - delta for f in first] if delta is not None and steady else []
    return {"delta_s": delta, "saves": len(steady) + len(first), "steady_saves": len(steady),
            "first_save_extra_s": max(0.0, statistics.median(extra)) if extra else None,
            "step_s": step_s, "first_trained": min(trained) if trained else None,
            "restart_s": statistics.median(restarts) if restarts else None,
            "restart_mean_s": statistics.fmean(restarts) if restarts else None,
            "save_gap_s": statistics.median(gaps) if gaps else None,
            "incarnations": len(launches), "auto_intervals": intervals[-8:],
            "last_interval": next((e.get("interval") for e in reversed(events)
                                   if e["ev"] == "interval"), None)}


def with_predictions(row: dict[str, Any], mttf: float) -> dict[str, Any]:
    """``row`` with the model's goodput from the run's own δ and R (+ the first save's
    extra), at the cadence it kept (the median gap between saves)."""
    every = row.get("save_gap_s") or (row["every"] if row["every"] != "auto" else None)
    if None in (every, row.get("delta_s"), row.get("restart_s")):
        return row
    restart = row["restart_s"] + (row.get("first_save_extra_s") or 0.0)
    return {**row, "effective_every": every, "restart_eff_s": restart,
            **predict(float(every), row["delta_s"], restart, mttf)}


def reprocess(path: str) -> list[dict[str, Any]]:
    """The rows of ``path`` with their measurements recomputed from each run's events file
    (``events_file``) and their predictions redone."""
    with open(path) as f:
        rows = [json.loads(line) for line in f if line.strip()]
    out = []
    for row in rows:
        ev = row.get("events_file")
        if ev and os.path.exists(ev) and "launch_wall" in row:
            m = _measured(ev, row["launch_wall"])
            m.pop("first_trained")
            row = {**row, **m}
            if m["step_s"]:
                row["goodput"] = row["final_step"] * m["step_s"] / row["wall_s"]
        out.append(with_predictions(row, row.get("mttf_s", 40.0)) if row.get("section") == "run"
                   else row)
    return out


def _store(server: Any, proxy_url: str) -> dict[str, Any]:
    bucket = server.create_bucket(f"goodput-{uuid.uuid4().hex[:8]}")
    return {"bucket": bucket, "options": server.storage_options(endpoint_url=proxy_url)}


def main(argv: list[str] | None = None) -> int:
    from goodput_report import (  # type: ignore[import-not-found]
        configurations,
        crn_report,
        emit,
        plot,
        print_paired,
    )

    from dcp_volumes.bench.target import ProfileProxy
    from dcp_volumes.testing.servers import start_server

    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--budget", type=float, default=90.0, help="seconds per run")
    p.add_argument("--seeds", type=int, default=3)
    p.add_argument("--mttf", type=float, default=40.0, help="mean seconds between failures")
    p.add_argument("--step-time", type=float, default=0.1)
    p.add_argument("--state-mib", type=int, default=4, help="state per rank")
    p.add_argument("--calibrate-s", type=float, default=45.0)
    p.add_argument("--delta", type=float, metavar="S", help="the fixed intervals from this δ "
                   "(e.g. an earlier calibration's, to keep them) instead of a calibration run")
    p.add_argument("--configs", help="comma-separated subset of the configurations to run "
                   "(fixed-frequent, fixed-young, fixed-rare, auto); default all")
    p.add_argument("--first-seed", type=int, default=1, help="seeds first-seed .. "
                   "first-seed + seeds - 1 (new seeds draw new failure times)")
    p.add_argument("--rotate", type=int, default=0, help="start each seed's rotation of the "
                   "configurations this many places later: two harnesses at once with "
                   "--rotate 0 and 1 run different configurations side by side (with the same "
                   "rotation, seeds of one parity run the same configuration at the same time, "
                   "so each contends with its own kind)")
    p.add_argument("--out", default=os.path.join(HERE, "results", "goodput-autopilot.jsonl"))
    p.add_argument("--reprocess", metavar="JSONL", help="recompute the measurements and "
                   "predictions of a results file from its runs' events files, rewrite it, "
                   "print the table (no runs)")
    p.add_argument("--plot", metavar="PNG", help="also draw the table")
    p.add_argument("--events-dir", default=os.path.join(tempfile.gettempdir(), "goodput-runs"),
                   help="where each run's progress and events files are kept")
    args = p.parse_args(argv)
    if args.reprocess:
        rows = reprocess(args.reprocess)
        with open(args.reprocess, "w") as f:
            f.writelines(json.dumps(r) + "\n" for r in rows)
        crn_report(rows)
        print_paired(rows)
        if args.plot:
            plot(rows, args.plot)
        return 0
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(1))  # clean up the servers too
    server = start_server("seaweedfs")
    proxy = ProfileProxy(server.endpoint_url, *_PROFILE)
    rows: list[dict[str, Any]] = []
    spares = Spares(os.path.join(tempfile.mkdtemp(prefix="goodput-"), "ranks.log"))
    print(f"rank logs: {spares.log}", flush=True)
    try:
        store = _store(server, proxy.endpoint_url)
        delta = args.delta
        if delta is None:
            cal = run_once(args, {"name": "calibrate", "every": 4.0}, 0, store,
                           args.calibrate_s, [], spares)
            emit({**cal, "section": "calibration"}, rows, args.out)
            delta = cal["delta_s"]
        wanted = args.configs.split(",") if args.configs else None
        for seed in range(args.first_seed, args.first_seed + args.seeds):
            cfgs = [c for c in configurations(delta, args.mttf)
                    if wanted is None or c["name"] in wanted]
            kills_at = failure_schedule(seed, args.budget, args.mttf)
            first = (seed + args.rotate) % len(cfgs)
            for cfg in cfgs[first:] + cfgs[:first]:
                row = run_once(args, cfg, seed, store, args.budget, kills_at, spares)
                emit(with_predictions({**row, "section": "run", "mttf_s": args.mttf,
                                       "step_time_s": args.step_time,
                                       "state_mib_per_rank": args.state_mib}, args.mttf),
                     rows, args.out)
    finally:
        spares.close()
        proxy.stop()
        server.stop()
    crn_report(rows)
    if args.plot:
        plot(rows, args.plot)
    return 0


if __name__ == "__main__":
    sys.path.insert(0, HERE)
    raise SystemExit(main())
