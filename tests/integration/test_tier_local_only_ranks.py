# was tests/integration/test_local_only.py (renamed by subject, issue 24)
"""Local-only saves and restores from the nearest complete copy, on a real store (SeaweedFS
over S3) and real ranks (gloo on 127.0.0.1).

"Nodes" are ranks with separate tier directories (``<tiers>/node<rank>``). A run saves step 1
to the store (kept locally too) and step 2 to the local tiers only; every restore runs in
fresh processes on a copy of those tiers, damaged behind the reader's back with plain file
operations.

- step 2 is not in the store; the restore loads step 2, bit-identical, every byte from a
  local tier or a peer (the replicated items one rank wrote are served by it to the other);
- one node lacks the step-2 copy, or its ``.metadata`` is damaged: both ranks load step 1;
- a flipped byte in a local-only shard: ``IntegrityError`` on every rank (no store copy);
- every local byte of the durable step 1 damaged: each holder fetches from the store what it
  serves to its peer, and the load is still right;
- a remote save newer than the local-only one is loaded instead.
"""

from __future__ import annotations

import os
import shutil
import uuid
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard, distribute_tensor

from dcp_volumes import (
    Checkpointer,
    LocalTierOptions,
    SpoolOptions,
    TransferOptions,
    VolumeReader,
    catalog,
    errors,
)
from dcp_volumes.testing.dist import run_ranks

warnings.filterwarnings("ignore", message="torch.distributed is disabled")

MiB = 1 << 20
TRANSFER = TransferOptions(part_size=5 * MiB, max_concurrency=4)


def full_state(step: int) -> dict[str, Any]:
    """The global values saved at ``step`` (different for every step)."""
    g = torch.Generator().manual_seed(100 + step)
    return {
        "sharded": torch.randn(512, 1024, generator=g),  # 2 MiB, sharded over the ranks
        "rep": {f"r{i}": torch.randn(3 * MiB // 4 // 4 * (i + 1), generator=g)
                for i in range(3)},  # replicated: DCP writes each once, on one rank
        "bias": torch.randn(77, generator=g),
        "meta": {"step": step, "name": "local-only"},
    }


def rank_state(world: int, step: int | None) -> dict[str, Any]:
    full = full_state(step or 0)
    mesh = init_device_mesh("cpu", (world,))
    zero = step is None
    return {
        "sharded": distribute_tensor(torch.zeros_like(full["sharded"]) if zero
                                     else full["sharded"], mesh, [Shard(0)]),
        "rep": {k: torch.zeros_like(v) if zero else v.clone() for k, v in full["rep"].items()},
        "bias": torch.zeros_like(full["bias"]) if zero else full["bias"].clone(),
        "meta": {"step": 0, "name": ""} if zero else dict(full["meta"]),
    }


def _checkpointer(rank: int, root: str, options: dict[str, Any], tiers: str) -> Checkpointer:
    return Checkpointer(root, storage_options=options, transfer=TRANSFER,
                        spool=SpoolOptions(directory=os.path.join(tiers, f"spool{rank}")),
                        local_tier=LocalTierOptions(directory=os.path.join(tiers, f"node{rank}"),
                                                    keep_last=None))


def _save_steps(rank: int, world: int, root: str, options: dict[str, Any], tiers: str,
                steps: list[tuple[int, bool]]) -> None:
    with _checkpointer(rank, root, options, tiers) as ckpt:
        for step, local_only in steps:
            ckpt.save(step, rank_state(world, step), force=True, local_only=local_only)
    dist.barrier()


def _resume(rank: int, world: int, root: str, options: dict[str, Any], tiers: str
            ) -> dict[str, Any]:
    state = rank_state(world, None)
    with _checkpointer(rank, root, options, tiers) as ckpt:
        try:
            step = ckpt.load_latest(state)
        except errors.DCPVolumesError as exc:
            dist.barrier()
            return {"error": type(exc).__name__, "message": str(exc)}
        stats = ckpt.last_load_stats
    full = full_state(step or 0)
    got = state["sharded"].full_tensor()
    same = (torch.equal(got, full["sharded"]) and torch.equal(state["bias"], full["bias"])
            and all(torch.equal(state["rep"][k], v) for k, v in full["rep"].items())
            and state["meta"] == full["meta"])
    dist.barrier()
    return {"step": step, "same": same, **(stats.as_dict() if stats else {})}


@pytest.fixture(scope="module")
def run(seaweedfs: Any, tmp_path_factory: pytest.TempPathFactory
        ) -> tuple[str, dict[str, Any], Any, Path]:
    store = seaweedfs.store()
    root = store.url("run")
    tiers = tmp_path_factory.mktemp("tiers")
    run_ranks(2, _save_steps, root, store.storage_options, str(tiers),
              [(1, False), (2, True)])
    return root, store.storage_options, store, tiers


def _copy(tiers: Path) -> Path:
    dest = tiers.parent / f"copy-{uuid.uuid4().hex[:6]}"
    shutil.copytree(tiers, dest)
    return dest


def _step2_dirs(tiers: Path, rank: int) -> list[Path]:
    """The directories of rank ``rank``'s node holding its step-2 (local-only) copy."""
    out = []
    for desc in (tiers / f"node{rank}").glob("*/*/.dcpv-tier-*.json"):
        if '"local_only"' in desc.read_text():
            out.append(desc.parent)
    return out


def test_nothing_of_the_local_only_save_is_in_the_store(run: Any) -> None:
    root, options, store, tiers = run
    fs = store.raw_fs
    names = [p.rsplit("/", 1)[-1] for p in fs.find(store.raw_path(root), withdirs=False)]
    assert any(n == ".metadata" for n in names)  # step 1
    assert not fs.exists(store.raw_path(f"{root}/step-00000002"))
    assert not [p for p in fs.find(store.raw_path(root)) if "step-00000002" in p]
    # the catalog lists only what is durable
    latest = catalog.latest(root, storage_options=options)
    assert latest is not None and latest.step == 1
    for rank in range(2):
        (d,) = _step2_dirs(tiers, rank)
        assert (d / ".metadata").is_file()
        assert list(d.glob(".dcpv-manifest-*.json"))
        assert list(d.glob(f"__{rank}_*.distcp"))


def test_restore_loads_the_local_only_save_from_tiers_and_peers(run: Any) -> None:
    root, options, _, tiers = run
    out = run_ranks(2, _resume, root, options, str(_copy(tiers)))
    for s in out:
        assert s.get("step") == 2 and s["same"], out
        assert s["bytes_fetched"] == 0 and s["ranges"] == 0, out  # no GET of any shard
        assert s["local_fallbacks"] == 0
        assert s["bytes_from_local"] > 0
    # each rank's replicated items live in one rank's files: the other got them from it
    assert sum(s["bytes_from_peers"] for s in out) > 0, out
    assert sum(s["bytes_to_peers"] for s in out) == sum(s["bytes_from_peers"] for s in out)


def test_a_node_without_the_local_only_copy_means_the_durable_one(run: Any) -> None:
    root, options, _, tiers = run
    copy = _copy(tiers)
    for d in _step2_dirs(copy, 1):
        shutil.rmtree(d)
    out = run_ranks(2, _resume, root, options, str(copy))
    assert [s.get("step") for s in out] == [1, 1], out
    assert all(s["same"] for s in out)


@pytest.mark.parametrize("damage", ["metadata", "truncated-shard"],
                         ids=["damaged-metadata", "truncated-shard"])
def test_a_damaged_copy_is_not_counted(run: Any, damage: str) -> None:
    root, options, _, tiers = run
    copy = _copy(tiers)
    (d,) = _step2_dirs(copy, 0)
    if damage == "metadata":
        (d / ".metadata").write_bytes(b"\x80\x04not a pickle")
    else:
        shard = next(d.glob("__0_*.distcp"))
        with open(shard, "r+b") as f:
            f.truncate(shard.stat().st_size - 1)
    out = run_ranks(2, _resume, root, options, str(copy))
    assert [s.get("step") for s in out] == [1, 1], out
    assert all(s["same"] for s in out)


def test_a_corrupt_local_only_byte_fails_every_rank(run: Any) -> None:
    """Same size, one byte flipped: the copy counts as complete, and the load finds the bad
    checksum. There is no store copy of step 2: every rank raises IntegrityError (the
    training state must not be trusted; restart to load step 1)."""
    root, options, _, tiers = run
    copy = _copy(tiers)
    (d,) = _step2_dirs(copy, 0)
    shard = max(d.glob("__0_*.distcp"), key=lambda p: p.stat().st_size)
    with open(shard, "r+b") as f:
        f.seek(shard.stat().st_size // 2)
        b = f.read(1)
        f.seek(-1, 1)
        f.write(bytes([b[0] ^ 0xFF]))
    out = run_ranks(2, _resume, root, options, str(copy))
    assert [s.get("error") for s in out] == ["IntegrityError"] * 2, out


def test_a_newer_durable_save_wins(seaweedfs: Any, tmp_path: Path) -> None:
    store = seaweedfs.store()
    root = store.url("newer")
    run_ranks(2, _save_steps, root, store.storage_options, str(tmp_path),
              [(2, True), (3, False)])
    out = run_ranks(2, _resume, root, store.storage_options, str(tmp_path))
    assert [s.get("step") for s in out] == [3, 3], out
    assert all(s["same"] for s in out)
    # all read locally: step 3 was kept in the tiers as well
    assert all(s["bytes_fetched"] == 0 for s in out), out


def _load_step1(rank: int, world: int, url: str, options: dict[str, Any], tiers: str
                ) -> dict[str, Any]:
    state = rank_state(world, None)
    reader = VolumeReader(url, storage_options=options, transfer=TRANSFER,
                          local_tier=LocalTierOptions(directory=os.path.join(tiers,
                                                                             f"node{rank}")))
    dcp.load(state, storage_reader=reader)
    full = full_state(1)
    same = (torch.equal(state["sharded"].full_tensor(), full["sharded"])
            and all(torch.equal(state["rep"][k], v) for k, v in full["rep"].items())
            and torch.equal(state["bias"], full["bias"]) and state["meta"] == full["meta"])
    dist.barrier()
    return {"same": same, **(reader.last_stats.as_dict() if reader.last_stats else {})}


def test_a_holder_with_a_corrupt_copy_fetches_what_it_serves(run: Any) -> None:
    """Step 1 is durable and kept on both nodes; every local byte of it is damaged (same
    sizes): each holder's check fails, it fetches the bundles it serves from the store, and
    every rank still gets checked, right bytes."""
    root, options, _, tiers = run
    copy = _copy(tiers)
    for rank in range(2):
        for desc in (copy / f"node{rank}").glob("*/*/.dcpv-tier-*.json"):
            if '"local_only"' in desc.read_text():
                continue
            for shard in desc.parent.glob("*.distcp"):
                data = bytearray(shard.read_bytes())
                for pos in range(0, len(data), 4096):
                    data[pos] ^= 0xFF
                shard.write_bytes(bytes(data))
    out = run_ranks(2, _load_step1, f"{root}/step-00000001", options, str(copy))
    assert all(s["same"] for s in out), out
    assert all(s["cooperative"] and s["local_fallbacks"] > 0 for s in out), out
    assert sum(s["bytes_from_peers"] for s in out) > 0, out
    assert all(s["bytes_from_local"] == 0 for s in out), out
