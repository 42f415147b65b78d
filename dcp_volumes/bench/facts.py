"""What every ``dcp-volumes bench`` result names: the command, the versions, the machine and
the dcp_volumes code that produced it."""

from __future__ import annotations

import contextlib
import os
import platform
import shlex
import subprocess
import sys
from importlib import metadata
from pathlib import Path
from typing import Any

__all__ = ["command", "machine", "source", "versions"]

GiB = 1 << 30


def versions() -> dict[str, str | None]:
    out: dict[str, str | None] = {"python": platform.python_version()}
    for dist in ("torch", "dcp-volumes", "fsspec", "s3fs", "s3torchconnector", "obstore",
                 "boto3", "gcsfs", "adlfs"):
        try:
            out[dist] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            out[dist] = None
    return out


def source() -> dict[str, Any]:
    """Which dcp_volumes code was measured: its path and, in a git checkout, the commit."""
    import dcp_volumes

    pkg = Path(dcp_volumes.__file__).resolve().parent
    out: dict[str, Any] = {"path": str(pkg)}
    note = os.environ.get("DCP_VOLUMES_BENCH_SOURCE")
    if note:
        out["note"] = note
    with contextlib.suppress(OSError, subprocess.SubprocessError):
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=pkg, text=True,
                              capture_output=True, timeout=10, check=False)
        if head.returncode == 0:
            out["git_commit"] = head.stdout.strip()
            dirty = subprocess.run(["git", "status", "--porcelain", "--", "."], cwd=pkg,
                                   text=True, capture_output=True, timeout=10, check=False)
            out["git_dirty"] = bool(dirty.stdout.strip())
    return out


def machine() -> dict[str, Any]:
    info: dict[str, Any] = {"cpu_count": os.cpu_count(), "platform": platform.platform(),
                            "machine": platform.machine()}
    with contextlib.suppress(OSError):
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                info["ram_gib"] = round(int(line.split()[1]) * 1024 / GiB, 1)
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                info["cpu_model"] = line.split(":", 1)[1].strip()
                break
    return info


def command() -> str:
    """The command line of this run, as a reader would type it again."""
    argv0 = sys.argv[0] if sys.argv else ""
    # `python -m dcp_volumes.bench` runs dcp_volumes/bench/__main__.py.
    as_module = Path(argv0).name == "__main__.py" and Path(argv0).parent.name == "bench"
    if as_module or argv0.endswith("dcp_volumes.bench") or argv0 == "-m":
        return shlex.join(["python", "-m", "dcp_volumes.bench", *sys.argv[1:]])
    return shlex.join([Path(argv0).name or "dcp-volumes", *sys.argv[1:]])
