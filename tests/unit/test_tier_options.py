# was tests/unit/test_local_tier_options.py (renamed by subject, issue 24)
"""The local tier's options, without servers or full saves (layout on disk and retention are in
``tests/unit/test_tier_layout_retention.py``).

Full saves and loads on local files are in ``tests/integration/test_tier_keep_one_process.py``;
multi-rank loads from SeaweedFS, cooperative loads and resharding with a tier in
``tests/integration/test_tier_keep_ranks.py``."""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import pytest

from dcp_volumes import (
    Checkpointer,
    LocalTierOptions,
    SpoolOptions,
    TransferOptions,
    VolumeReader,
    VolumeWriter,
    errors,
)

warnings.filterwarnings("ignore", message="torch.distributed is disabled")

MiB = 1 << 20
SMALL_PARTS = TransferOptions(part_size=5 * MiB, max_concurrency=4)


# ---- options --------------------------------------------------------------------------------

@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"directory": ""}, "non-empty path"),
        ({"directory": 3}, "non-empty path"),
        ({"directory": "/x", "keep_last": 0}, "keep_last must be a positive integer"),
        ({"directory": "/x", "keep_last": True}, "keep_last must be a positive integer"),
        ({"directory": "/x", "max_bytes": -1}, "max_bytes must be a positive integer"),
        ({"directory": "/x", "max_bytes": 1.5}, "max_bytes must be a positive integer"),
    ],
    ids=["empty-dir", "dir-not-path", "keep-zero", "keep-bool", "bytes-negative",
         "bytes-float"],
)
def test_bad_options_say_what_to_change(kwargs: dict[str, Any], match: str) -> None:
    with pytest.raises(errors.ConfigError, match=match):
        LocalTierOptions(**kwargs)


def test_options_are_frozen_and_keyword_only(tmp_path: Path) -> None:
    opts = LocalTierOptions(directory=str(tmp_path), keep_last=None, max_bytes=10)
    with pytest.raises(AttributeError):
        opts.keep_last = 3  # type: ignore[misc]
    with pytest.raises(TypeError):
        LocalTierOptions(str(tmp_path))  # type: ignore[misc]
    assert opts.resolved_directory() == str(tmp_path)


def test_memory_spool_and_unverified_reads_are_refused(tmp_path: Path) -> None:
    tier = LocalTierOptions(directory=str(tmp_path / "tier"))
    with pytest.raises(errors.ConfigError, match="mode='memory'"):
        VolumeWriter(str(tmp_path / "c"), spool=SpoolOptions(mode="memory"), local_tier=tier)
    with pytest.raises(errors.ConfigError, match="mode='memory'"):
        Checkpointer(str(tmp_path / "run"), spool=SpoolOptions(mode="memory"), local_tier=tier)
    with pytest.raises(errors.ConfigError, match="verify=True"):
        VolumeReader(str(tmp_path / "c"), verify=False, local_tier=tier)
    with pytest.raises(errors.ConfigError, match="LocalTierOptions"):
        VolumeWriter(str(tmp_path / "c"), local_tier=str(tmp_path))  # type: ignore[arg-type]
    with pytest.raises(errors.ConfigError, match="LocalTierOptions"):
        VolumeReader(str(tmp_path / "c"), local_tier={"directory": "x"})  # type: ignore[arg-type]


# ---- layout and retention -------------------------------------------------------------------


