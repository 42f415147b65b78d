"""Export of DCP checkpoints to Hugging Face safetensors, end to end on real servers.

One FSDP2 state (``fully_shard`` on a 2-rank CPU gloo mesh: DTensor-sharded weights, AdamW
state, ``{"model": ..., "optim": ...}`` from ``get_state_dict``) is saved once to SeaweedFS
and exported from there: to SeaweedFS, to moto (another store) and to a local directory;
in one file and in many; cast; on one rank and on two. Every output is read back with the
``safetensors`` library and checked behind the exporter's back through a raw filesystem.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from _cli import run_cli
from safetensors.torch import load, load_file

from dcp_volumes import errors
from dcp_volumes.config import RetryOptions
from dcp_volumes.export import export_safetensors
from dcp_volumes.testing.dist import run_ranks
from dcp_volumes.testing.faultproxy import s3_internal_error
from dcp_volumes.testing.suite import Store

pytestmark = pytest.mark.xdist_group("export")

SLAB = 1 << 20  # 1 MiB rounds: the 4 MiB weight is fetched in row slabs of its 2 MiB chunks
#: files of ``SMALL``: [0.bias] [0.weight] [2.bias 2.weight]
SMALL = "1MB"
FILES3 = [f"model-0000{i}-of-00003.safetensors" for i in (1, 2, 3)]


def _model() -> torch.nn.Module:
    # 0.weight: 2048 x 512 fp32 = 4 MiB, two 2 MiB row shards (stored with block checksums)
    return torch.nn.Sequential(torch.nn.Linear(512, 2048), torch.nn.ReLU(),
                               torch.nn.Linear(2048, 64))


def _save_fsdp(rank: int, world: int, url: str, opts: dict[str, Any]) -> Any:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from dcp_volumes import VolumeWriter

    torch.manual_seed(0)
    model = _model()
    mesh = init_device_mesh("cpu", (world,))
    fully_shard(model[0], mesh=mesh)
    fully_shard(model[2], mesh=mesh)
    fully_shard(model, mesh=mesh)
    optim = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model(torch.randn(4, 512)).square().mean().backward()
    optim.step()
    msd, osd = get_state_dict(model, optim)
    dcp.save({"model": msd, "optim": osd}, storage_writer=VolumeWriter(url, storage_options=opts))
    full = {k: v.full_tensor() for k, v in msd.items()}  # a collective: every rank
    assert all(type(v).__name__ == "DTensor" for v in msd.values())
    return {k: v.detach().numpy().copy() for k, v in full.items()} if rank == 0 else None


def _export_on_ranks(rank: int, world: int, src: str, dest: str, opts: dict[str, Any]) -> Any:
    return export_safetensors(src, dest, prefix="model.", max_shard_size=SMALL,
                              storage_options=opts, slab_size=SLAB).to_dict()


@pytest.fixture(scope="module")
def store(seaweedfs: Any) -> Store:
    return seaweedfs.store()


@pytest.fixture(scope="module")
def saved(store: Store) -> tuple[str, dict[str, torch.Tensor]]:
    """The FSDP2 checkpoint on SeaweedFS and the full model tensors it holds."""
    url = store.url("fsdp")
    full = run_ranks(2, _save_fsdp, url, store.storage_options, timeout=120)[0]
    return url, {k: torch.from_numpy(v) for k, v in full.items()}


def _read(store: Store, url: str, name: str) -> bytes:
    return bytes(store.raw_fs.cat_file(f"{store.raw_path(url)}/{name}"))


def _check_files(blobs: dict[str, bytes], full: dict[str, torch.Tensor],
                 dtype: torch.dtype | None = None) -> None:
    got: dict[str, torch.Tensor] = {}
    for blob in blobs.values():
        got.update(load(blob))
    assert set(got) == set(full)
    for name, ref in full.items():
        want = ref.to(dtype) if dtype is not None else ref
        assert got[name].dtype == want.dtype and torch.equal(got[name], want), name


def test_fsdp_state_exports_in_one_file_then_many_across_stores(
        store: Store, saved: tuple[str, dict[str, torch.Tensor]], moto: Any,
        tmp_path: Path) -> None:
    src, full = saved
    dest = store.url("hf")
    one = export_safetensors(src, dest, prefix="model.", storage_options=store.storage_options,
                             slab_size=SLAB)
    assert one.files == ("model.safetensors",) and one.index is None and one.verified
    assert one.tensors == 4 and one.skipped == () and one.not_selected > 0
    assert store.names(dest) == ["model.safetensors"]
    _check_files({"one": _read(store, dest, "model.safetensors")}, full)
    # the same DEST again, in three files: the single file of the last export goes first
    many = export_safetensors(src, dest, prefix="model.", max_shard_size=SMALL,
                              storage_options=store.storage_options, slab_size=SLAB)
    assert many.files == tuple(FILES3) and many.index == "model.safetensors.index.json"
    assert store.names(dest) == sorted([*FILES3, "model.safetensors.index.json"])
    blobs = {n: _read(store, dest, n) for n in FILES3}
    _check_files(blobs, full)
    index = json.loads(_read(store, dest, "model.safetensors.index.json"))
    assert index == {"metadata": {"total_size": sum(t.nbytes for t in full.values())},
                     "weight_map": {"0.bias": FILES3[0], "0.weight": FILES3[1],
                                    "2.bias": FILES3[2], "2.weight": FILES3[2]}}
    assert many.bytes == sum(map(len, blobs.values()))
    # the 4 MiB weight came in slabs of partial chunk reads: about what was needed is fetched
    assert many.bytes_fetched < 1.6 * many.total_size
    # to another store (moto), cast to bf16
    mstore = moto.store()
    mdest = mstore.url("hf")
    cast = export_safetensors(src, mdest, prefix="model.", dtype="bf16",
                              storage_options=store.storage_options,
                              dest_storage_options=mstore.storage_options)
    assert cast.bytes < one.bytes
    _check_files({"c": _read(mstore, mdest, "model.safetensors")}, full, torch.bfloat16)
    # to a local directory: the optimizer's tensors, its non-tensor items reported, skipped
    local = tmp_path / "optim"
    opt = export_safetensors(src, str(local), prefix="optim.", max_shard_size=SMALL,
                             storage_options=store.storage_options)
    assert any(s.startswith("optim.param_groups.") for s in opt.skipped)
    names = {n for f in opt.files for n in load_file(local / f)}
    assert "state.0.weight.exp_avg" in names and "state.0.weight.exp_avg_sq" in names
    assert sorted(os.listdir(local)) == sorted([*opt.files, "model.safetensors.index.json"])


def test_two_rank_export_equals_one_rank(store: Store,
                                         saved: tuple[str, dict[str, torch.Tensor]]) -> None:
    src, full = saved
    one, two = store.url("one-rank"), store.url("two-ranks")
    export_safetensors(src, one, prefix="model.", max_shard_size=SMALL,
                       storage_options=store.storage_options, slab_size=SLAB)
    reports = run_ranks(2, _export_on_ranks, src, two, store.storage_options, timeout=120)
    assert [r["rank"] for r in reports] == [0, 1]
    assert all(r["bytes_written"] > 0 for r in reports)  # the files were split across ranks
    assert sum(r["bytes_written"] for r in reports) == reports[0]["bytes"]
    assert store.names(two) == store.names(one)
    for name in store.names(one):
        assert _read(store, two, name) == _read(store, one, name), name
    _check_files({n: _read(store, two, n) for n in FILES3}, full)


_CHILD = """
import sys, json
from dcp_volumes.config import RetryOptions
from dcp_volumes.export import export_safetensors
src, dest, opts = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
export_safetensors(src, dest, prefix="model.", max_shard_size="1MB", storage_options=opts,
                   retry=RetryOptions(max_attempts=100000, max_backoff_s=0.2, deadline_s=None))
"""


def test_kill_mid_export_leaves_nothing_complete_and_rerun_succeeds(
        store: Store, saved: tuple[str, dict[str, torch.Tensor]]) -> None:
    src, full = saved
    dest = store.url("killed")
    # an earlier, complete export at DEST: the new one must remove its commit first
    export_safetensors(src, dest, prefix="model.", storage_options=store.storage_options)
    assert store.proxied_options is not None
    opts, proxy = store.proxied_options()
    # every request for the last file fails (the child retries forever): the first two
    # files become durable, the third never does, and the child is killed in that state
    rule = proxy.add_rule(s3_internal_error(path_regex=r"model-00003-of-00003", times=None))
    child = subprocess.Popen([sys.executable, "-c", _CHILD, src, dest, json.dumps(opts)],
                             stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        deadline = time.monotonic() + 60
        while not (proxy.stats.rule(rule).injected >= 1
                   and set(FILES3[:2]) <= set(store.names(dest))):
            assert child.poll() is None, child.stderr.read().decode()[-2000:] if child.stderr \
                else child.returncode
            assert time.monotonic() < deadline, "the child did not reach the third file"
            time.sleep(0.05)  # polls a condition; the outcome does not depend on timing
        child.send_signal(signal.SIGKILL)
        assert child.wait(timeout=30) == -signal.SIGKILL
    finally:
        proxy.remove_rule(rule)
        if child.poll() is None:
            child.kill()
            child.wait()
    left = store.names(dest)
    assert "model.safetensors.index.json" not in left and "model.safetensors" not in left
    assert FILES3[2] not in left
    again = export_safetensors(src, dest, prefix="model.", max_shard_size=SMALL,
                               storage_options=store.storage_options, retry=RetryOptions())
    assert store.names(dest) == sorted([*FILES3, "model.safetensors.index.json"])
    _check_files({n: _read(store, dest, n) for n in again.files}, full)


def test_corrupt_missing_and_incomplete_sources(store: Store, tmp_path: Path) -> None:
    import torch.distributed.checkpoint as dcp

    from dcp_volumes import VolumeWriter

    src = store.url("corrupt")
    state = {"model": {"w": torch.arange(1 << 20, dtype=torch.float32).reshape(1024, 1024),
                       "b": torch.ones(7)}}
    dcp.save(state, storage_writer=VolumeWriter(src, storage_options=store.storage_options))
    fs, root = store.raw_fs, store.raw_path(src)
    shard = next(p for p in fs.ls(root, detail=False) if p.endswith(".distcp")
                 and fs.size(p) > 1 << 20)
    data = bytearray(fs.cat_file(shard))
    data[len(data) // 2] ^= 0xFF
    fs.pipe_file(shard, bytes(data))
    for dest in (store.url("from-corrupt"), str(tmp_path / "from-corrupt")):
        with pytest.raises(errors.IntegrityError, match="checksum mismatch"):
            export_safetensors(src, dest, prefix="model.", max_shard_size="10KB",
                               storage_options=store.storage_options,
                               dest_storage_options=None if "://" in dest else {})
        left = store.names(dest) if "://" in dest else sorted(os.listdir(dest))
        assert not {"model.safetensors", "model.safetensors.index.json"} & set(left), left
    with pytest.raises(errors.CheckpointNotFoundError):
        export_safetensors(store.url("nothing-here"), str(tmp_path / "x"),
                           storage_options=store.storage_options, dest_storage_options={})
    fs.rm_file(f"{root}/.metadata")
    with pytest.raises(errors.IncompleteCheckpointError):
        export_safetensors(src, str(tmp_path / "x"), storage_options=store.storage_options,
                           dest_storage_options={})
    assert not (tmp_path / "x").exists()  # nothing was written for a source that failed


def test_cli_json_summary_and_exit_codes(store: Store, seaweedfs: Any,
                                         saved: tuple[str, dict[str, torch.Tensor]],
                                         tmp_path: Path) -> None:
    src, full = saved
    env = seaweedfs.server.env()
    out = run_cli("export", src, str(tmp_path / "hf"), "--to", "safetensors", "--prefix",
                  "model.", "--dtype", "fp16", "--json", env=env)
    assert out.returncode == 0, out.stderr
    doc = json.loads(out.stdout)
    assert doc["files"] == ["model.safetensors"] and doc["tensors"] == 4
    assert doc["index"] is None and doc["verified"] is True and doc["mb_per_s"] > 0
    assert doc["bytes"] == os.path.getsize(tmp_path / "hf" / "model.safetensors")
    assert {"skipped", "not_selected", "seconds", "total_size", "src", "dest"} <= set(doc)
    _check_files({"f": (tmp_path / "hf" / "model.safetensors").read_bytes()}, full,
                 torch.float16)
    missing = run_cli("export", store.url("no-such"), str(tmp_path / "m"), env=env)
    assert missing.returncode == 3 and "no checkpoint" in missing.stderr, missing.stderr
