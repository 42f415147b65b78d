"""Whether the test directory's filesystem takes ``O_DIRECT``, a fixture that skips when
it does not, and a save-and-load round trip through a spool (shared by the unit and integration spool tests; ``tests/`` is on ``sys.path``
through its conftest)."""

from __future__ import annotations

import os
import uuid
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp

from dcp_volumes import LocalTierOptions, SpoolOptions, TransferOptions, VolumeReader, VolumeWriter

MiB = 1 << 20


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


def spool_state() -> dict[str, Any]:
    g = torch.Generator().manual_seed(7)
    return {"w": torch.randn(1500, 1024, generator=g), "b": torch.randn(333, generator=g),
            "h": torch.randn(64, 64, generator=g).to(torch.bfloat16), "step": 11}


def spool_roundtrip(url: str, options: dict[str, Any], spool: SpoolOptions,
                    tier: LocalTierOptions | None = None) -> VolumeWriter:
    """Save a small mixed state through ``spool`` and load it back bit-identical."""
    state = spool_state()
    writer = VolumeWriter(url, storage_options=options, spool=spool, local_tier=tier,
                          transfer=TransferOptions(part_size=5 * MiB, max_concurrency=4))
    dcp.save(state, storage_writer=writer, no_dist=True)
    target = {"w": torch.zeros(1500, 1024), "b": torch.zeros(333),
              "h": torch.zeros(64, 64, dtype=torch.bfloat16), "step": 0}
    dcp.load(target, storage_reader=VolumeReader(url, storage_options=options), no_dist=True)
    for key in ("w", "b", "h"):
        assert torch.equal(target[key], state[key]), key
    assert target["step"] == 11
    return writer
