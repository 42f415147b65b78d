"""Run the real ``dcp-volumes`` entry point in a subprocess, as a user would (shared by the
unit and integration tests; ``tests/`` is on ``sys.path`` through its conftest)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def run_cli(*args: str, env: dict[str, str] | None = None,
            clean_env: bool = False) -> subprocess.CompletedProcess[str]:
    """``python -m dcp_volumes.cli *args`` from the repository root, output captured.

    ``env`` is added to this process's environment (without ``AWS_ENDPOINT*``, so a test
    names its endpoint itself); ``clean_env=True`` runs with ``env`` alone.
    """
    base = {} if clean_env else {k: v for k, v in os.environ.items()
                                 if not k.startswith("AWS_ENDPOINT")}
    return subprocess.run(
        [sys.executable, "-m", "dcp_volumes.cli", *args],
        check=False, capture_output=True, text=True, timeout=120, cwd=REPO,
        env={**base, **(env or {})},
    )
