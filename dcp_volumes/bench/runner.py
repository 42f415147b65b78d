"""One worker process: the specs go in a file, the results come back in another; the worker
and every process it started are killed at the timeout."""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

__all__ = ["run_worker"]


def _worker_argv(spec_path: str, out_path: str, profile_to: str | None) -> list[str]:
    argv = [sys.executable, "-m", "dcp_volumes.bench.worker", spec_path, out_path]
    if profile_to:
        spy = shutil.which("py-spy") or str(Path(sys.executable).parent / "py-spy")
        argv = [spy, "record", "--format", "raw", "--rate", "200", "--subprocesses",
                "--output", profile_to, "--", *argv]
    return argv


def run_worker(specs: list[dict[str, Any]], env: dict[str, str], timeout: float,
               workdir: str, profile_to: str | None = None) -> list[dict[str, Any]]:
    """Run ``specs`` in one ``python -m dcp_volumes.bench.worker`` (under py-spy when
    ``profile_to`` names an output); one result per spec, an ``error`` for those it did not
    finish."""
    spec_path = os.path.join(workdir, f"spec-{secrets.token_hex(4)}.json")
    out_path = spec_path.replace("spec-", "out-")
    with open(os.open(spec_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600), "w") as f:
        json.dump(specs, f)
    log_path = out_path + ".log"
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(
            _worker_argv(spec_path, out_path, profile_to),
            env={**os.environ, **env}, stdin=subprocess.DEVNULL, stdout=log,
            stderr=subprocess.STDOUT, start_new_session=True)
        try:
            proc.wait(timeout=timeout)
        except BaseException:  # timeout or Ctrl-C
            # The worker and the rank processes it spawned form their own process group.
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, 9)
            proc.wait()
            if not isinstance(sys.exc_info()[1], subprocess.TimeoutExpired):
                raise
    results: list[dict[str, Any]] = []
    with contextlib.suppress(OSError, ValueError), open(out_path) as f:
        results = json.load(f)
    if len(results) < len(specs):
        tail = ""
        with contextlib.suppress(OSError):
            tail = Path(log_path).read_text(errors="replace")[-1500:]
        why = (f"timed out after {timeout:.0f}s" if proc.returncode in (-9, 137)
               else f"worker exited with {proc.returncode}")
        results += [{"error": why, "traceback": tail}] * (len(specs) - len(results))
    for p in (spec_path, out_path, log_path):
        with contextlib.suppress(OSError):
            os.unlink(p)
    return results
