"""Where a save's and a load's client CPU goes, per phase (issue 28).

Starts SeaweedFS on 127.0.0.1 (``weed mini``), saves a state dict of 16 fp32 tensors with
``VolumeWriter`` (defaults: disk spool with O_DIRECT, 16 MiB parts) and loads it back, each
under ``py-spy record --pid`` (this process, only while the call runs, 100 Hz, idle threads
left out), and buckets every sample by the innermost frame that names a phase
(:data:`PHASES`): the table printed is each phase's share of the samples. It also reports
the process's CPU seconds (user + sys, ``getrusage``) per GiB of every call, measured apart
from the profiled calls (``--rounds`` unprofiled saves and loads; sampling perturbs them).

    PYTHONPATH=. .venv/bin/python benchmarks/profile_phases.py --size 1GiB --rounds 3 \\
        --out benchmarks/results/profile-after

writes ``save.txt`` / ``load.txt`` (py-spy's collapsed stacks), ``phases.json`` and prints a
markdown table. py-spy sees Python frames only: time in C (crc32c, memcpy, the kernel's
socket copies) is counted at the Python line that called it, which is what names the phase.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import signal
import statistics
import subprocess
import sys
import time
from collections import Counter
from typing import Any

#: (phase, substrings of a frame, innermost match wins), checked in order for each frame
PHASES: list[tuple[str, tuple[str, ...]]] = [
    ("CRC32C (spool, per item/part/block)", ("saving/_checksums.py", "dcp_volumes/_crc.py")),
    ("CRC32C verify (load)", ("check_need (", "check_span (")),
    ("spool write (copy into the O_DIRECT buffer, write)", ("saving/_spool_disk.py:append",
                                                             "_flush_direct", "_write_all",
                                                             "_write_memory")),
    ("spool read-back (O_DIRECT pread + copy)", ("_spool_direct.py:read_direct",
                                                  "_spool_disk.py:read")),
    ("part body copies (PartBody)", ("backends/s3.py:read", "s3_upload.py:read")),
    ("copy into the target tensors (load)", ("loading/apply.py",)),
    ("GET bodies read (joined, or copied into the item's buffer)", (
        "backends/s3.py:_get", "backends/versions.py:_get_into")),
    ("assembling GET chunks (load)", ("transfer/download.py",)),
    ("serialization (torch.save into the spool)", ("torch/serialization.py",)),
    ("HTTP client + event loop", ("aiohttp/", "aiobotocore/", "botocore/", "asyncio/", "s3fs/",
                                  "selectors.py", "ssl.py", "obstore", "yarl/", "multidict/")),
    ("DCP planning + metadata", ("torch/distributed/checkpoint/",)),
    ("dcp_volumes (other)", ("dcp_volumes/",)),
]
#: leaves of threads that wait (py-spy's idle detection misses some under load)
IDLE = ("_worker (concurrent/futures/thread.py", "wait (threading.py", "_wait_for_tstate_lock",
        "select (selectors.py")


def phase_of(frames: list[str]) -> str | None:
    """The phase of one stack (frames outermost first), ``None`` for an idle thread."""
    if not frames or any(frames[-1].startswith(i) for i in IDLE):
        return None
    for frame in reversed(frames):
        for phase, marks in PHASES:
            if any(m in frame for m in marks):
                return phase
    return "other (interpreter, GC, torch)"


def summarize(path: str) -> dict[str, int]:
    """Samples per phase in one py-spy raw (collapsed) profile."""
    out: Counter[str] = Counter()
    with open(path) as f:
        for line in f:
            stack, _, n = line.rstrip().rpartition(" ")
            if not n.isdigit():
                continue
            # py-spy's frames are "func (file:line)"; the first is the process
            frames = [_file_line(fr.strip()) for fr in stack.split(";")[1:]]
            phase = phase_of(frames)
            if phase is not None:
                out[phase] += int(n)
    return dict(out)


def _file_line(frame: str) -> str:
    """``func (path:line)`` also matched as ``path:func`` (so a mark can name both)."""
    if " (" in frame and frame.endswith(")"):
        func, where = frame[:-1].split(" (", 1)
        return f"{frame} {where.rsplit(':', 1)[0]}:{func}"
    return frame


def cpu_s() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


class Spy:
    """``py-spy record`` attached to this process while the block runs."""

    def __init__(self, out: str | None) -> None:
        self.out = out
        self.proc: subprocess.Popen[bytes] | None = None

    def __enter__(self) -> Spy:  # noqa: PYI034
        if self.out:
            spy = shutil.which("py-spy") or os.path.join(os.path.dirname(sys.executable),
                                                          "py-spy")
            self.proc = subprocess.Popen(
                [spy, "record", "--pid", str(os.getpid()), "--rate", "100", "--format", "raw",
                 "--nonblocking", "--output", self.out],
                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            time.sleep(1.5)  # attached
        return self

    def __exit__(self, *exc: object) -> None:
        if self.proc is not None:
            self.proc.send_signal(signal.SIGINT)
            self.proc.wait(timeout=120)


def parse_size(text: str) -> int:
    units = {"KiB": 1 << 10, "MiB": 1 << 20, "GiB": 1 << 30}
    for u, m in units.items():
        if text.endswith(u):
            return int(float(text[:-len(u)]) * m)
    return int(text)


def build_state(size: int) -> dict[str, Any]:
    import torch

    g = torch.Generator().manual_seed(0)
    n = size // 16 // 4
    return {f"t{i}": torch.rand(n, generator=g) for i in range(16)} | {"step": 1}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--size", type=parse_size, default=1 << 30)
    ap.add_argument("--rounds", type=int, default=3, help="unprofiled save+load rounds")
    ap.add_argument("--out", required=True, help="directory for the profiles and phases.json")
    ap.add_argument("--no-profile", action="store_true", help="only the CPU rounds")
    ap.add_argument("--resummarize", action="store_true",
                    help="measure nothing: bucket --out's save.txt/load.txt again and print")
    args = ap.parse_args()
    if args.resummarize:
        with open(os.path.join(args.out, "phases.json")) as f:
            rows = json.load(f)
        for what in ("save", "load"):
            rows[f"{what}_phases"] = summarize(os.path.join(args.out, f"{what}.txt"))
        with open(os.path.join(args.out, "phases.json"), "w") as f:
            json.dump(rows, f, indent=1)
        print(render(rows))
        return 0
    import torch
    import torch.distributed.checkpoint as dcp

    from dcp_volumes import VolumeReader, VolumeWriter
    from dcp_volumes.testing.servers import start_server

    os.makedirs(args.out, exist_ok=True)
    server = start_server("seaweedfs")
    root = server.create_bucket("dcpv-prof")
    os.environ.update(server.env())
    opts = server.storage_options()
    gib = args.size / (1 << 30)
    state = build_state(args.size)
    rows: dict[str, Any] = {"size_bytes": args.size, "save_cpu_s_per_gib": [],
                            "load_cpu_s_per_gib": [], "save_s": [], "load_s": []}
    try:
        def save(url: str, out: str | None, what: dict[str, Any] = state) -> None:
            w = VolumeWriter(url, storage_options=opts)
            with Spy(out):
                c0, t0 = cpu_s(), time.perf_counter()
                dcp.save(what, storage_writer=w, no_dist=True)
                c1, t1 = cpu_s(), time.perf_counter()
            if out is None:
                rows["save_cpu_s_per_gib"].append((c1 - c0) / gib)
                rows["save_s"].append(t1 - t0)

        def load(url: str, out: str | None, what: dict[str, Any] = state) -> None:
            target = {k: (torch.empty_like(v) if isinstance(v, torch.Tensor) else 0)
                      for k, v in what.items()}
            r = VolumeReader(url, storage_options=opts)
            with Spy(out):
                c0, t0 = cpu_s(), time.perf_counter()
                dcp.load(target, storage_reader=r, no_dist=True)
                c1, t1 = cpu_s(), time.perf_counter()
            assert all(torch.equal(target[k], what[k]) for k in what if k != "step")
            if out is None:
                rows["load_cpu_s_per_gib"].append((c1 - c0) / gib)
                rows["load_s"].append(t1 - t0)

        tiny = build_state(16 << 20)  # imports, sessions, connection pools
        save(f"{root}/warm", None, tiny)
        load(f"{root}/warm", None, tiny)
        rows["save_cpu_s_per_gib"].clear(), rows["load_cpu_s_per_gib"].clear()
        rows["save_s"].clear(), rows["load_s"].clear()
        for i in range(args.rounds):
            save(f"{root}/r{i}", None)
            load(f"{root}/r{i}", None)
        if not args.no_profile:
            save(f"{root}/prof", os.path.join(args.out, "save.txt"))
            load(f"{root}/prof", os.path.join(args.out, "load.txt"))
            for what in ("save", "load"):
                rows[f"{what}_phases"] = summarize(os.path.join(args.out, f"{what}.txt"))
    finally:
        server.stop()
    rows["load_average"] = os.getloadavg()
    with open(os.path.join(args.out, "phases.json"), "w") as f:
        json.dump(rows, f, indent=1)
    print(render(rows))
    return 0


def render(rows: dict[str, Any]) -> str:
    lines = []
    for what in ("save", "load"):
        cpu = rows[f"{what}_cpu_s_per_gib"]
        lines.append(f"{what}: CPU s/GiB median {statistics.median(cpu):.2f} "
                     f"({', '.join(f'{c:.2f}' for c in cpu)}); wall s "
                     f"{', '.join(f'{s:.1f}' for s in rows[f'{what}_s'])}")
        phases = rows.get(f"{what}_phases")
        if phases:
            total = sum(phases.values())
            lines += ["", f"| {what} phase | samples | share |", "|---|---|---|"]
            for phase, n in sorted(phases.items(), key=lambda kv: -kv[1]):
                lines.append(f"| {phase} | {n} | {100 * n / total:.0f}% |")
            lines.append("")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
