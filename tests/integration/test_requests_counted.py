"""Cheaper saves and deletes, counted at the store (moto behind the proxy's request log):
a checkpoint removed in two DeleteObjects requests instead of one DELETE per object, and
saves after a process's first one probing the store's round trip no more."""

from __future__ import annotations

from typing import Any

import fsspec
import torch
import torch.distributed.checkpoint as dcp

from dcp_volumes import VolumeWriter
from dcp_volumes.backends import probe
from dcp_volumes.catalog import apply_retention
from dcp_volumes.config import SpoolOptions
from dcp_volumes.testing.requests import count


def _save(url: str, options: dict[str, Any]) -> None:
    state = {f"t{i}": torch.full((256,), float(i)) for i in range(6)}
    dcp.save(state, storage_writer=VolumeWriter(
        url, storage_options=options, spool=SpoolOptions(files_per_rank=4)), no_dist=True)


def test_retention_removes_a_checkpoint_in_two_requests(moto: Any) -> None:
    store = moto.store()
    options = moto.server.storage_options(endpoint_url=moto.proxy.endpoint_url)
    for step in (1, 2):
        _save(store.url(f"step-{step}"), options)
    fs, root = fsspec.url_to_fs(store.url("step-1"), **store.storage_options)
    objects = len(fs.find(root))
    assert objects >= 5  # 4 shard files, the manifest, .metadata
    moto.proxy.record_requests()
    removed = apply_retention(store.root, keep_last=1, storage_options=options)
    counted = count(moto.proxy.recorded_requests(), moto.bucket)
    assert removed == [store.url("step-1")]
    # .metadata first (never visible half deleted), then the rest: 2 requests, not one each
    assert counted.by_kind["DELETE_BATCH"] == 2, counted
    assert counted.by_kind["DELETE"] == 0, counted
    fs.invalidate_cache()
    assert fs.find(root) == []
    assert len(fs.find(fsspec.url_to_fs(store.url("step-2"), **options)[1])) == objects


def test_saves_after_the_first_probe_the_store_no_more(moto: Any) -> None:
    store = moto.store()
    options = moto.server.storage_options(endpoint_url=moto.proxy.endpoint_url)
    probe.forget()
    heads = []
    for step in (1, 2):
        moto.proxy.record_requests()
        _save(store.url(f"step-{step}"), options)
        heads.append(count(moto.proxy.recorded_requests(), moto.bucket).of("HEAD", "bucket"))
    # the fastest of three probes at the first save; the second uses that measurement
    assert heads[0] - heads[1] == 3, heads
