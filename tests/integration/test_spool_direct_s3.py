"""The ``O_DIRECT`` disk spool against a real S3 server (SeaweedFS): the test moved here
unchanged from tests/unit/test_spool_direct.py, since unit tests start no servers; the
helpers it needs are copies of that module's."""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

from _direct import spool_roundtrip

from dcp_volumes import SpoolOptions

warnings.filterwarnings("ignore", message="torch.distributed is disabled")

MiB = 1 << 20


def test_saves_load_bit_identical_from_seaweedfs(seaweedfs: Any, disk_dir: Path) -> None:
    store = seaweedfs.store()
    spool = SpoolOptions(directory=str(disk_dir / "spool"), direct_io=True)
    spool_roundtrip(f"{store.root}/ck", store.storage_options, spool)
