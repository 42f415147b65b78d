"""Goodput under injected failures: fixed checkpoint intervals against ``every_seconds="auto"``.

A real training job (``benchmarks/goodput_worker.py``: 2 gloo ranks, a fixed step time, a
state of ``--state-mib`` MiB per rank saved synchronously through a ``Checkpointer`` to a local
SeaweedFS behind the s3-like proxy, 30 ms before every response and 10 MB/s per connection)
runs for a fixed wall-clock budget per configuration. Failures are a Poisson process: after
each launch the harness draws an exponential time of mean ``--mttf`` and SIGKILLs every rank
then, and relaunches them (warm spares, which resume through ``load_latest``). Goodput is the
progress kept, ``final step × step time ÷ wall time``, the wall time from the job's first
start of training (the first launch is no failure's cost) and the step time the one measured
in the run (the 0.1 s sleep overshoots on a loaded machine; ``goodput_stated`` uses 0.1 s and
the whole budget).

Configurations, interleaved (each seed runs them all, in rotated order): fixed intervals --
too frequent, too rare, and the offline Young optimum from a calibration run's ``δ`` and the
injected ``M`` -- and ``auto`` given the injected rate as its prior. Beside each measured
goodput, the model's prediction from that run's own measured ``δ`` (median save blocking)
and ``R`` (median launch to training): first order ``τ/(τ+δ)·(1 − (R + (τ+δ)/2)/M)`` and
Daly's exponential model ``τ / (M·e^(R/M)·(e^((τ+δ)/M) − 1))`` (which also counts failures
during a restart and a second failure in one interval, both frequent at this ``M``)::

    python benchmarks/goodput_autopilot.py --budget 90 --seeds 3 --mttf 40

Prints one JSON line per run (and writes them to ``--out``) and a markdown table.
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import os
import random
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
import zlib
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from goodput_report import predict  # type: ignore[import-not-found]

HERE = os.path.dirname(os.path.abspath(__file__))
WORKER = os.path.join(HERE, "goodput_worker.py")
_PROFILE = (0.030, 10e6)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _kill(procs: list[subprocess.Popen[bytes]]) -> None:
    for p in procs:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
    for p in procs:
        p.wait()


class Spares:
    """Worker pairs started ahead (``depth`` of them), imported and waiting to be released:
    a restart takes a ready pair while the next one imports."""

    def __init__(self, log: str, depth: int = 2) -> None:
        self.log = log
        self.pairs = [self._start() for _ in range(depth)]

    def _start(self) -> list[subprocess.Popen[bytes]]:
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        with open(self.log, "ab") as err:
            return [subprocess.Popen([sys.executable, WORKER], env=env, stdin=subprocess.PIPE,
                                     stdout=subprocess.DEVNULL, stderr=err,
                                     start_new_session=True) for _ in range(2)]

    def launch(self, cfg: dict[str, Any]) -> list[subprocess.Popen[bytes]]:
        """Release the oldest waiting pair into the job ``cfg``; start another."""
        pair = self.pairs.pop(0)
        self.pairs.append(self._start())
        port = _free_port()
        for rank, proc in enumerate(pair):
            assert proc.stdin is not None
            proc.stdin.write((json.dumps({**cfg, "rank": rank, "port": port}) + "\n").encode())
            proc.stdin.flush()
        return pair

    def close(self) -> None:
        for pair in self.pairs:
            _kill(pair)


def run_once(args: argparse.Namespace, cfg: dict[str, Any], seed: int, store: dict[str, Any],
             budget: float, mttf: float | None, spares: Spares) -> dict[str, Any]:
    """One configuration for ``budget`` seconds, failures every Exp(``mttf``) after each
    launch (None: no failures)."""
    rng = random.Random(seed * 1000 + zlib.crc32(cfg["name"].encode()) % 1000)
    tmp = tempfile.mkdtemp(prefix="goodput-")
    files = {k: os.path.join(tmp, k) for k in ("progress", "events")}
    root = f"{store['bucket']}/{cfg['name']}-{seed}-{uuid.uuid4().hex[:6]}"
    job = {"root": root, "options": store["options"], "every": str(cfg["every"]),
           "prior_mttf_s": cfg.get("prior_mttf_s"), "step_time": args.step_time,
           "state_mib": args.state_mib, "progress": files["progress"],
           "events": files["events"]}
    start = time.monotonic()
    end = start + budget
    kills, launches = 0, []
    offsets = []  # wall clock − monotonic clock: a wall-clock step (NTP, a paused VM) moves it
    while time.monotonic() < end:
        launches.append(time.time())
        offsets.append(time.time() - time.monotonic())
        procs = spares.launch(job)
        fail_at = time.monotonic() + (rng.expovariate(1.0 / mttf) if mttf else math.inf)
        while time.monotonic() < min(fail_at, end):
            if any(p.poll() not in (None,) for p in procs):
                break  # a rank died on its own (e.g. the other one's collective broke)
            time.sleep(0.05)
        _kill(procs)
        if time.monotonic() < end:
            kills += 1
    wall = time.monotonic() - start
    offsets.append(time.time() - time.monotonic())
    step = 0
    if os.path.exists(files["progress"]):
        with open(files["progress"], "rb") as f:
            step = int.from_bytes(f.read(8) or b"\0", "little")
    m = _measured(files["events"], launches)
    # from the job's first start of training (its first launch is no failure's cost), each
    # step counted at the step time measured here (a sleep overshoots on a loaded machine);
    # the ranks stamp events with the wall clock, taken onto the monotonic clock of ``wall``
    # at the first launch's offset, so a wall-clock step during the run is not counted as time
    first = m.pop("first_trained")
    trained_wall = start + wall - (first - offsets[0]) if first else None
    return {"config": cfg["name"], "every": cfg["every"], "seed": seed, "wall_s": wall,
            "clock_step_s": max(offsets) - min(offsets),
            "events_file": files["events"],
            "final_step": step, "failures": kills, "goodput_stated": step * args.step_time / wall,
            "trained_wall_s": trained_wall,
            "goodput": (step * m["step_s"] / trained_wall
                        if trained_wall and m["step_s"] else None), **m}


def _measured(events_path: str, launches: list[float]) -> dict[str, Any]:
    """δ (median save blocking), R (median launch to training) and the auto's intervals."""
    events = []
    if os.path.exists(events_path):
        with open(events_path) as f:
            events = [json.loads(line) for line in f if line.strip()]
    # each incarnation's first save also pays one-time setup (as the autopilot counts δ)
    saves = [b["blocking_s"] for a, b in itertools.pairwise(events)
             if b["ev"] == "save" and a["ev"] == "save"]
    steady = len(saves)  # the report pools δ over runs that measured a steady save
    saves = saves or [e["blocking_s"] for e in events if e["ev"] == "save"]
    trained = [e["t"] for e in events if e["ev"] == "trained"]
    restarts = []
    for t in trained:  # the launch just before each start of training
        before = [launch for launch in launches if launch <= t]
        if before:
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
    delta = statistics.median(saves) if saves else None
    return {"delta_s": delta, "saves": len(saves), "steady_saves": steady,
            "first_save_extra_s": _first_save_extra(events, delta),
            "step_s": step_s, "first_trained": min(trained) if trained else None,
            "restart_s": statistics.median(restarts) if restarts else None,
            "save_gap_s": statistics.median(gaps) if gaps else None,
            "incarnations": len(launches), "auto_intervals": intervals[-8:],
            "last_interval": next((e.get("interval") for e in reversed(events)
                                   if e["ev"] == "interval"), None)}


def _first_save_extra(events: list[dict[str, Any]], delta: float | None) -> float | None:
    """How much longer each incarnation's first save blocks than a steady one (median): a
    cost every restart pays once, so part of ``R``."""
    if delta is None:
        return None
    extra = [b["blocking_s"] - delta for a, b in itertools.pairwise(events)
             if a["ev"] == "trained" and b["ev"] == "save"]
    return max(0.0, statistics.median(extra)) if extra else None


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
        if ev and os.path.exists(ev):
            with open(ev) as f:
                events = [json.loads(line) for line in f if line.strip()]
            saves = [b["blocking_s"] for a, b in itertools.pairwise(events)
                     if b["ev"] == "save" and a["ev"] == "save"]
            row["first_save_extra_s"] = _first_save_extra(events, row.get("delta_s"))
            row["steady_saves"] = len(saves)
        out.append(with_predictions(row, row.get("mttf_s", 40.0)) if row.get("section") == "run"
                   else row)
    return out


def _store(server: Any, proxy_url: str) -> dict[str, Any]:
    bucket = server.create_bucket(f"goodput-{uuid.uuid4().hex[:8]}")
    return {"bucket": bucket, "options": server.storage_options(endpoint_url=proxy_url)}


def main(argv: list[str] | None = None) -> int:
    from goodput_report import (  # type: ignore[import-not-found]
        configurations,
        emit,
        plot,
        report,
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
    p.add_argument("--out", default=os.path.join(HERE, "results", "goodput-autopilot.jsonl"))
    p.add_argument("--reprocess", metavar="JSONL", help="recompute the measurements and "
                   "predictions of a results file from its runs' events files, rewrite it, "
                   "print the table (no runs)")
    p.add_argument("--plot", metavar="PNG", help="also draw the table")
    args = p.parse_args(argv)
    if args.reprocess:
        rows = reprocess(args.reprocess)
        with open(args.reprocess, "w") as f:
            f.writelines(json.dumps(r) + "\n" for r in rows)
        report(rows)
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
        cal = run_once(args, {"name": "calibrate", "every": 4.0}, 0, store, args.calibrate_s,
                       None, spares)
        emit({**cal, "section": "calibration"}, rows, args.out)
        for seed in range(1, args.seeds + 1):
            cfgs = configurations(cal["delta_s"], args.mttf)
            for cfg in cfgs[seed % len(cfgs):] + cfgs[:seed % len(cfgs)]:
                row = run_once(args, cfg, seed, store, args.budget, args.mttf, spares)
                emit(with_predictions({**row, "section": "run", "mttf_s": args.mttf,
                                       "step_time_s": args.step_time,
                                       "state_mib_per_rank": args.state_mib}, args.mttf),
                     rows, args.out)
    finally:
        spares.close()
        proxy.stop()
        server.stop()
    report(rows)
    if args.plot:
        plot(rows, args.plot)
    return 0


if __name__ == "__main__":
    sys.path.insert(0, HERE)
    raise SystemExit(main())
