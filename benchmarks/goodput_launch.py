"""The goodput harness's processes: warm spare rank pairs, the failure schedule, the
job's progress and start of training as the harness sees them, the machine's load
(``benchmarks/goodput_autopilot.py``)."""

from __future__ import annotations

import json
import os
import random
import signal
import socket
import statistics
import subprocess
import sys
import time
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
WORKER = os.path.join(HERE, "goodput_worker.py")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def kill(procs: list[subprocess.Popen[bytes]]) -> None:
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
            kill(pair)


def failure_schedule(seed: int, budget: float, mttf: float | None) -> list[float]:
    """The seed's failure times, seconds after the job's first start of training: a Poisson
    process of mean ``mttf`` (cumulative exponential draws from ``random.Random(seed)``).
    Every configuration of one seed gets this same list (common random numbers), so a
    per-seed difference between two configurations measures their intervals, not their luck."""
    rng, times, t = random.Random(seed), [], 0.0
    while mttf:
        t += rng.expovariate(1.0 / mttf)
        if t >= budget:
            break
        times.append(t)
    return times


def read_step(path: str) -> int:
    if not os.path.exists(path):
        return 0
    with open(path, "rb") as f:
        return int.from_bytes(f.read(8) or b"\0", "little")


def wait_trained(events: str, procs: list[subprocess.Popen[bytes]], timeout: float) -> float:
    """The monotonic time at which the job's first incarnation starts training."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if os.path.exists(events):
            with open(events) as f:
                if '"trained"' in f.read():
                    return time.monotonic()
        if any(p.poll() is not None for p in procs):
            raise RuntimeError(f"a rank exited before training started; see {events}")
        time.sleep(0.02)
    raise RuntimeError(f"no start of training within {timeout:g} s")


class Load:
    """The machine's 1-minute load average, sampled every few seconds of a run."""

    def __init__(self) -> None:
        self.samples: list[float] = []
        self.last = 0.0

    def sample(self) -> None:
        if time.monotonic() - self.last >= 5.0:
            self.last = time.monotonic()
            self.samples.append(os.getloadavg()[0])

    def summary(self) -> dict[str, float | None]:
        s = self.samples
        return {"load_mean": statistics.fmean(s) if s else None,
                "load_max": max(s) if s else None}
