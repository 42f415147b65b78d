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
from torch.distributed.checkpoint.api import CheckpointException

from dcp_volumes import TransferOptions, VolumeReader, VolumeWriter
from dcp_volumes.backends import open_backend
from dcp_volumes.errors import CheckpointChangedError
from dcp_volumes.testing.suite import failures_of

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


def test_large_tensors_load_straight_into_their_targets(
        seaweedfs: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """A tensor of at least 2 MiB stored whole is read from the store into the target's own
    memory (issue 28: no item buffer, no copy into the tensor); small ones still arrive in
    coalesced GETs and are copied in; a shard shorter than its manifest fails its check."""
    import dcp_volumes.loading.apply as apply_mod
    from dcp_volumes.errors import IntegrityError

    store = seaweedfs.store()
    root = f"{store.root}/direct"
    g = torch.Generator().manual_seed(5)
    state = {"big0": torch.rand(3 * MiB // 4, generator=g),
             "big1": torch.rand(6 * MiB // 4 + 3, generator=g),
             "small": torch.rand(1000, generator=g)}
    dcp.save(state, storage_writer=VolumeWriter(root, storage_options=store.storage_options),
             no_dist=True)
    copied: list[int] = []
    apply_need = apply_mod.apply_need

    def counted(need: Any, chunk: memoryview, *args: Any, **kwargs: Any) -> None:
        copied.append(len(chunk))
        apply_need(need, chunk, *args, **kwargs)

    monkeypatch.setattr(apply_mod, "apply_need", counted)
    reader = VolumeReader(root, storage_options=store.storage_options,
                          transfer=TransferOptions(part_size=5 * MiB, max_concurrency=4))
    target = {k: torch.zeros_like(v) for k, v in state.items()}
    dcp.load(target, storage_reader=reader, no_dist=True)
    assert all(torch.equal(target[k], state[k]) for k in state)
    assert copied and max(copied) < MiB  # only the small tensor was copied in

    backend = open_backend(root, store.storage_options)
    shard = next(p for p in backend.run(backend.list_names) if p.endswith(".distcp"))
    whole = backend.run(lambda: backend.cat(shard))
    backend.run(lambda: backend.put(shard, whole[:len(whole) - MiB]))  # big1's end is cut
    with pytest.raises(CheckpointException) as info:
        dcp.load({k: torch.zeros_like(v) for k, v in state.items()},
                 storage_reader=VolumeReader(root, storage_options=store.storage_options),
                 no_dist=True)
    assert all(isinstance(e, IntegrityError) for e in failures_of(info.value))

    # one flipped byte inside a large tensor (both big ones are read in place): the CRC32C
    # checked in the target's memory fails the load
    flipped = bytearray(whole)
    flipped[len(flipped) // 2] ^= 0xFF
    backend.run(lambda: backend.put(shard, bytes(flipped)))
    with pytest.raises(CheckpointException) as info:
        dcp.load({k: torch.zeros_like(v) for k, v in state.items()},
                 storage_reader=VolumeReader(root, storage_options=store.storage_options),
                 no_dist=True)
    assert all(isinstance(e, IntegrityError) for e in failures_of(info.value))
