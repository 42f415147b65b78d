# moved verbatim from tests/unit/test_periphery_hardening.py (split by subject, issue 24)
"""Usage errors the CLI reports before doing any work (issue 18 #8), without servers.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from _cli import run_cli

from dcp_volumes.cli._exit import EXIT_USAGE


@pytest.mark.parametrize("kind", ["missing", "file"])
def test_ls_local_tier_must_be_a_directory(tmp_path: Path, kind: str) -> None:
    root = tmp_path / "run"
    root.mkdir()
    tier = tmp_path / "tier"
    if kind == "file":
        tier.write_text("not a directory")
    result = run_cli("ls", str(root), "--local-tier", str(tier))
    assert result.returncode == EXIT_USAGE, result
    expected = "does not exist" if kind == "missing" else "is not a directory"
    assert expected in result.stderr and "--local-tier" in result.stderr
    assert "no checkpoints" not in result.stderr
