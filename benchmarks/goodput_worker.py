"""One rank of the goodput harness's training job (``benchmarks/goodput_autopilot.py``
launches two per incarnation and SIGKILLs them at random times).

Started as a hot spare: it imports everything, then waits for one JSON line on stdin (its
rank, the rendezvous port, the root, ...) before it joins the job, so a restart does not pay
the interpreter's and torch's start (tens of seconds on a loaded 2-core machine) but the
group's start, the Checkpointer's and ``load_latest``. A real training loop on a gloo group: each step all-reduces a small gradient and updates the
rank's state, then sleeps to a fixed step time (the compute stand-in: robust on a busy
machine, and the same for every configuration). The state (``--state-mib`` per rank) is
saved through a ``Checkpointer`` to the s3-like endpoint, ``every_seconds`` fixed or
``"auto"``, and resumed with ``load_latest``. Rank 0 records its progress (the step reached,
one 8-byte write per step) and its events (start, resumed, each save's blocking time, the
autopilot's interval) as JSON lines for the harness.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from typing import Any

import torch
import torch.distributed as dist

from dcp_volumes import Checkpointer
from dcp_volumes.goodput import AutopilotOptions, FailureModel


def _args() -> argparse.Namespace:
    """The job's arguments, from the one JSON line that releases this spare."""
    line = sys.stdin.readline()
    if not line.strip():
        raise SystemExit(0)  # never released: the harness is done
    cfg = json.loads(line)
    cfg["released"] = time.time()
    os.environ.update({"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(cfg["port"]),
                       "RANK": str(cfg["rank"]), "WORLD_SIZE": "2"})
    return argparse.Namespace(**cfg)


def _event(path: str, **row: Any) -> None:
    with open(path, "a") as f:
        f.write(json.dumps({"t": time.time(), **row}) + "\n")


def _checkpointer(a: argparse.Namespace, options: dict[str, Any]) -> Any:
    if a.every != "auto":
        return Checkpointer(a.root, storage_options=options, every_seconds=float(a.every),
                            keep_last=2)
    model = None
    if a.prior_mttf_s:  # a fleet of the job's 2 GPUs failing every M
        model = FailureModel.from_fleet(mtbf_hours=a.prior_mttf_s / 3600.0, fleet_gpus=2,
                                        gpus=2)
    # the spare's wait is not this incarnation's: it started when the harness released it
    auto = AutopilotOptions(failure_model=model, min_interval_s=0.5, started_at=a.released)
    return Checkpointer(a.root, storage_options=options, every_seconds="auto", autopilot=auto,
                        keep_last=2)


def main() -> None:
    a = _args()
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    n = a.state_mib * (1 << 20) // 4
    state: dict[str, Any] = {"w": torch.zeros(n), "step": 0}
    ckpt = _checkpointer(a, a.options)
    step = ckpt.load_latest(state) or 0
    if rank == 0:
        _event(a.events, ev="trained", resumed_step=step,
               every=ckpt.every_seconds)
        fd = os.open(a.progress, os.O_WRONLY | os.O_CREAT, 0o644)
    grad = torch.ones(1024)
    last_every = ckpt.every_seconds
    steps, steps_wall = 0, 0.0  # since the last event: how long a step really takes here
    while True:
        t0 = time.monotonic()
        step += 1
        dist.all_reduce(grad)
        grad.fill_(1.0)
        state["w"][:1024].add_(grad, alpha=1e-3)
        state["step"] = step
        pause = a.step_time - (time.monotonic() - t0)
        if pause > 0:
            time.sleep(pause)
        s0 = time.monotonic()
        steps, steps_wall = steps + 1, steps_wall + (s0 - t0)
        saved = ckpt.save(step, state)
        if rank != 0:
            continue
        os.pwrite(fd, step.to_bytes(8, "little"), 0)
        if saved or steps >= 50:
            _event(a.events, ev="save" if saved else "tick", step=step,
                   blocking_s=time.monotonic() - s0, steps=steps, steps_wall=steps_wall)
            steps, steps_wall = 0, 0.0
        if ckpt.every_seconds != last_every:
            last_every = ckpt.every_seconds
            _event(a.events, ev="interval", every=last_every,
                   interval=ckpt.stats.get("interval"))


if __name__ == "__main__":
    main()
