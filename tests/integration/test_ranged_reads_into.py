"""Ranged reads straight into the caller's buffer (issue 28: ``Backend.cat_into``): a large
item fetched as several GETs lands in place, with no chunk copied twice; pinned reads still
refuse another version; a shorter object reports how many bytes arrived. Against real
servers on loopback (SeaweedFS and moto over S3; local files through the generic path)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp

from dcp_volumes import TransferOptions, VolumeReader, VolumeWriter
from dcp_volumes.backends import open_backend
from dcp_volumes.errors import CheckpointChangedError

MiB = 1 << 20


def _where(request: pytest.FixtureRequest, tmp_path: Path, kind: str) -> tuple[str, Any]:
    if kind == "local":
        return f"file://{tmp_path}/t", None
    store = request.getfixturevalue(kind).store()
    return store.root, store.storage_options


@pytest.mark.parametrize("kind", ["seaweedfs", "moto", "local"])
def test_cat_into_fills_the_view_and_keeps_pins(request: pytest.FixtureRequest,
                                                tmp_path: Path, kind: str) -> None:
    root, opts = _where(request, tmp_path, kind)
    backend = open_backend(root, opts)
    payload = os.urandom(3 * MiB + 17)
    backend.run(lambda: backend.put("obj", payload))
    pin = backend.run(lambda: backend.pin("obj"))
    assert pin is not None
    out = bytearray(2 * MiB)
    view = memoryview(out)
    n = backend.run(lambda: backend.cat_into("obj", view[MiB:], start=5, pin=pin))
    assert n == MiB and out[MiB:] == payload[5:5 + MiB] and out[:MiB] == bytes(MiB)
    # past the end of the object: only what is there arrives
    n = backend.run(lambda: backend.cat_into("obj", view, start=len(payload) - 10))
    assert n == 10 and out[:10] == payload[-10:]
    backend.run(lambda: backend.put("obj", payload[::-1]))  # another version now
    with pytest.raises(CheckpointChangedError):
        backend.run(lambda: backend.cat_into("obj", view[:MiB], start=0, pin=pin))


@pytest.mark.parametrize("kind", ["seaweedfs", "moto"])
def test_a_large_item_loads_through_split_gets(request: pytest.FixtureRequest, tmp_path: Path,
                                              kind: str) -> None:
    """Items of 9 MiB with GETs of at most 5 MiB: each item arrives as several GETs, each
    read into its place."""
    root, opts = _where(request, tmp_path, kind)
    g = torch.Generator().manual_seed(3)
    state = {f"t{i}": torch.rand(9 * MiB // 4 + i, generator=g) for i in range(3)}
    dcp.save(state, storage_writer=VolumeWriter(root, storage_options=opts), no_dist=True)
    reader = VolumeReader(root, storage_options=opts,
                          transfer=TransferOptions(part_size=5 * MiB, max_concurrency=4))
    target = {k: torch.zeros_like(v) for k, v in state.items()}
    dcp.load(target, storage_reader=reader, no_dist=True)
    assert all(torch.equal(target[k], state[k]) for k in state)
