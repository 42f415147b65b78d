"""The ``O_DIRECT`` disk spool against a real S3 server (SeaweedFS): the test moved here
unchanged from tests/unit/test_spool_direct.py, since unit tests start no servers; the
helpers it needs are copies of that module's."""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp

from dcp_volumes import LocalTierOptions, SpoolOptions, TransferOptions, VolumeReader, VolumeWriter

warnings.filterwarnings("ignore", message="torch.distributed is disabled")

MiB = 1 << 20






def _state() -> dict[str, Any]:
    g = torch.Generator().manual_seed(7)
    return {"w": torch.randn(1500, 1024, generator=g), "b": torch.randn(333, generator=g),
            "h": torch.randn(64, 64, generator=g).to(torch.bfloat16), "step": 11}


def _roundtrip(url: str, options: dict[str, Any], spool: SpoolOptions,
               tier: LocalTierOptions | None = None) -> VolumeWriter:
    state = _state()
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


def test_saves_load_bit_identical_from_seaweedfs(seaweedfs: Any, disk_dir: Path) -> None:
    store = seaweedfs.store()
    spool = SpoolOptions(directory=str(disk_dir / "spool"), direct_io=True)
    _roundtrip(f"{store.root}/ck", store.storage_options, spool)
