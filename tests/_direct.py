"""Whether the test directory's filesystem takes ``O_DIRECT``, and a fixture that skips when
it does not (shared by the unit and integration spool tests; ``tests/`` is on ``sys.path``
through its conftest)."""

from __future__ import annotations

import os
import uuid
from pathlib import Path

import pytest


def direct_supported(directory: Path) -> bool:
    flag = getattr(os, "O_DIRECT", 0)
    if not flag:
        return False
    path = directory / f"probe-{uuid.uuid4().hex[:6]}"
    path.touch()
    try:
        os.close(os.open(path, os.O_RDONLY | flag))
        return True
    except OSError:
        return False
    finally:
        path.unlink()


@pytest.fixture
def disk_dir(tmp_path: Path) -> Path:
    """``tmp_path``, when its filesystem takes ``O_DIRECT`` (else the test skips)."""
    if not direct_supported(tmp_path):
        pytest.skip("the test directory's filesystem refuses O_DIRECT")
    return tmp_path
