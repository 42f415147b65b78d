# was tests/unit/test_torch_test_wording.py (renamed by subject, issue 24)
"""What users' existing DCP tests match on still matches with dcp_volumes swapped in
(issue 26, "drop-in where users already have tests")."""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.api import CheckpointException

from dcp_volumes import VolumeReader, VolumeWriter, errors
from dcp_volumes._compat import no_dist

warnings.filterwarnings("ignore", message="torch.distributed is disabled")


def test_overwrite_wording_matches_torch_test_overwrite(tmp_path) -> None:
    """torch's ``test_overwrite`` (test_file_system_checkpoint.py), with our writer/reader."""
    url = f"file://{tmp_path}/ckpt"
    t1, t2 = torch.randn(10), torch.randn(10)
    dcp.save({"random": t1}, storage_writer=VolumeWriter(url, overwrite=False), **no_dist())
    dcp.save({"random": t2}, storage_writer=VolumeWriter(url, overwrite=True), **no_dist())
    sd = {"random": torch.zeros(10)}
    dcp.load(sd, storage_reader=VolumeReader(url), **no_dist())
    assert torch.allclose(sd["random"], t2)
    with pytest.raises(CheckpointException, match=".*Checkpoint already exists.*") as info:
        dcp.save({"random": t2}, storage_writer=VolumeWriter(url, overwrite=False), **no_dist())
    (err, _tb), = info.value.failures.values()
    assert isinstance(err, errors.CheckpointExistsError)
    assert "overwrite=True" in str(err)  # the rest of the message kept: what to do


def test_torch_own_writer_says_the_same_phrase(tmp_path) -> None:
    """The phrase is torch's own (so a test written against FileSystemWriter keeps passing)."""
    path = str(tmp_path / "ckpt")
    dcp.save({"a": torch.ones(2)}, storage_writer=FileSystemWriter(path), **no_dist())
    with pytest.raises(CheckpointException, match="Checkpoint already exists"):
        dcp.save({"a": torch.ones(2)}, storage_writer=FileSystemWriter(path, overwrite=False),
                 **no_dist())
