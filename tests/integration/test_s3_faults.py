# was tests/integration/test_hardening_s3.py (renamed by subject, issue 24)
"""Hardening findings that need a real S3 server (SeaweedFS) and the fault proxy (issue 10)."""

from __future__ import annotations

import pytest
import torch

import dcp_volumes
from dcp_volumes import RetryOptions, errors
from dcp_volumes.testing.faultproxy import s3_slowdown

pytestmark = pytest.mark.xdist_group("seaweedfs")

FAST_RETRY = RetryOptions(max_attempts=6, initial_backoff_s=0.02, max_backoff_s=0.2)


def _state() -> dict[str, torch.Tensor]:
    return {"w": torch.arange(1 << 16, dtype=torch.float32), "b": torch.ones(3)}


def test_read_retries_are_counted(seaweedfs) -> None:
    store = seaweedfs.store()
    url = store.url()
    dcp_volumes.save(_state(), url, storage_options=store.storage_options, no_dist=True)
    opts, proxy = store.proxied_options()
    proxy.clear_rules()
    try:
        proxy.add_rule(s3_slowdown(method="GET", path_regex=r"\.metadata", times=1))
        proxy.add_rule(s3_slowdown(method="GET", path_regex=r"\.distcp", times=1))
        target = {"w": torch.zeros(1 << 16), "b": torch.zeros(3)}
        reader = dcp_volumes.load(target, url, storage_options=opts, retry=FAST_RETRY,
                                  no_dist=True)
    finally:
        proxy.clear_rules()
    assert torch.equal(target["w"], _state()["w"])
    assert reader.last_stats is not None
    # the .metadata read's retry and the shard GET's retry are both counted
    assert reader.last_stats.retries >= 2, reader.last_stats


def test_save_killed_with_only_a_multipart_upload_reads_as_incomplete(seaweedfs) -> None:
    store = seaweedfs.store()
    url = store.url()
    fs = store.raw_fs
    bucket, _, key = store.raw_path(url).partition("/")
    # What a save killed before any part completed leaves: an open multipart upload, no object.
    up = fs.call_s3("create_multipart_upload", Bucket=bucket, Key=f"{key}/__0_0-x.distcp")
    try:
        with pytest.raises(errors.IncompleteCheckpointError, match="did not commit"):
            dcp_volumes.load(_state(), url, storage_options=store.storage_options,
                             no_dist=True)
    finally:
        fs.call_s3("abort_multipart_upload", Bucket=bucket, Key=f"{key}/__0_0-x.distcp",
                   UploadId=up["UploadId"])
    with pytest.raises(errors.CheckpointNotFoundError):
        dcp_volumes.load(_state(), url, storage_options=store.storage_options, no_dist=True)


