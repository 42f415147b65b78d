"""Safetensors in a store as a DCP source (``SafetensorsReader``), on real servers and ranks.

A model saved with ``safetensors.torch.save_file`` — one file, and two files plus an index —
is uploaded behind the reader's back (raw fsspec), then loaded with plain ``dcp.load``:

- SeaweedFS, 2 gloo ranks: FSDP2 (``fully_shard`` on a CPU mesh) loads the sharded layout
  equal to the saved tensors, each rank fetching ≤ 1.05 × the bytes its shards need; a
  replicated (DDP-like) load of the single file reads each byte once in total (cooperative);
  ``key_map`` leaves tensors out.
- moto and local files (conformance style: the same checks on another backend): both layouts
  load equal in one process, and ``LoadStats.verified`` says False (no checksums exist).
- a crafted header and an index naming a missing file, in the store: typed errors.
"""

from __future__ import annotations

import json
import os
import tempfile
import warnings
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from safetensors.torch import save_file

from dcp_volumes import errors
from dcp_volumes._api import typed_errors
from dcp_volumes.export import SafetensorsReader
from dcp_volumes.testing.dist import run_ranks

pytestmark = pytest.mark.xdist_group("streader")
warnings.filterwarnings("ignore", message="torch.distributed is disabled")

WIDTH = 96


def model_tensors() -> dict[str, torch.Tensor]:
    """What a small transformer-ish model holds: matrices, norms, a bf16 embedding."""
    g = torch.Generator().manual_seed(3)
    t: dict[str, torch.Tensor] = {
        "embed.weight": torch.randn(512, WIDTH, generator=g).to(torch.bfloat16)}
    for i in range(3):
        t[f"layers.{i}.up.weight"] = torch.randn(4 * WIDTH, WIDTH, generator=g)
        t[f"layers.{i}.up.bias"] = torch.randn(4 * WIDTH, generator=g)
        t[f"layers.{i}.down.weight"] = torch.randn(WIDTH, 4 * WIDTH, generator=g)
        t[f"layers.{i}.norm.weight"] = torch.randn(WIDTH, generator=g)
    return t


def write_layouts(local: str) -> None:
    """``single/model.safetensors`` and ``sharded/`` (two files and the index)."""
    t = model_tensors()
    os.makedirs(f"{local}/single")
    os.makedirs(f"{local}/sharded")
    save_file(t, f"{local}/single/model.safetensors")
    names = sorted(t)
    parts = [names[: len(names) // 2], names[len(names) // 2:]]
    weight_map = {}
    for i, part in enumerate(parts):
        fname = f"model-{i + 1:05d}-of-00002.safetensors"
        save_file({n: t[n] for n in part}, f"{local}/sharded/{fname}")
        weight_map.update({n: fname for n in part})
    with open(f"{local}/sharded/model.safetensors.index.json", "w") as f:
        json.dump({"metadata": {"total_size": sum(v.nbytes for v in t.values())},
                   "weight_map": weight_map}, f)


def _upload(store: Any, local: str) -> str:
    url = store.url("model")
    store.raw_fs.put(local + "/", store.raw_path(url), recursive=True)
    return url


@pytest.fixture(scope="module")
def local_model() -> str:
    d = tempfile.mkdtemp(prefix="streader-")
    write_layouts(d)
    return d


# ---- 2 ranks on SeaweedFS -------------------------------------------------------------
class Block(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up = torch.nn.Linear(WIDTH, 4 * WIDTH)
        self.down = torch.nn.Linear(4 * WIDTH, WIDTH, bias=False)
        self.norm = torch.nn.LayerNorm(WIDTH, bias=False)


class Model(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(512, WIDTH, dtype=torch.bfloat16)
        self.layers = torch.nn.ModuleList(Block() for _ in range(3))


def _stats(reader: SafetensorsReader) -> dict[str, Any]:
    return reader.last_stats.as_dict() if reader.last_stats else {}


def _ranks_load(rank: int, world: int, url: str, options: dict[str, Any]) -> dict[str, Any]:
    from torch.distributed.checkpoint.state_dict import get_model_state_dict
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor

    want = model_tensors()
    out: dict[str, Any] = {}
    torch.manual_seed(100 + rank)
    model = Model()
    mesh = init_device_mesh("cpu", (world,))
    for block in model.layers:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    state = get_model_state_dict(model)
    assert all(isinstance(v, DTensor) for v in state.values())
    r = SafetensorsReader(f"{url}/sharded", storage_options=options)
    with typed_errors(lambda: r.last_error):
        dcp.load(state, storage_reader=r)
    out["fsdp_equal"] = all(torch.equal(v.full_tensor(), want[k]) for k, v in state.items())
    out["fsdp"] = _stats(r)

    # replicated (DDP-like): every rank wants every tensor, from the single file
    plain = {f"net.{k}": torch.zeros_like(v) for k, v in want.items()}
    r = SafetensorsReader(f"{url}/single/model.safetensors", prefix="net.",
                          storage_options=options)
    with typed_errors(lambda: r.last_error):
        dcp.load(plain, storage_reader=r)
    out["replicated_equal"] = all(torch.equal(plain[f"net.{k}"], v) for k, v in want.items())
    out["replicated"] = _stats(r)

    # key_map: only the norms, renamed
    norms = {k.replace("layers.", "L"): torch.zeros_like(v) for k, v in want.items()
             if k.endswith("norm.weight")}
    r = SafetensorsReader(f"{url}/sharded", storage_options=options, cooperative=False,
                          key_map=lambda n: n.replace("layers.", "L") if "norm" in n else None)
    dcp.load(norms, storage_reader=r)
    out["keymap_equal"] = all(torch.equal(norms[k.replace("layers.", "L")], v)
                              for k, v in want.items() if k.endswith("norm.weight"))
    out["keymap"] = _stats(r)
    return out


def test_fsdp2_and_replicated_loads_on_two_ranks(seaweedfs: Any, local_model: str) -> None:
    store = seaweedfs.store()
    url = _upload(store, local_model)
    results = run_ranks(2, _ranks_load, url, store.storage_options, timeout=180)
    total = sum(v.nbytes for v in model_tensors().values())
    for rank, res in enumerate(results):
        assert res["fsdp_equal"] and res["replicated_equal"] and res["keymap_equal"], rank
        f = res["fsdp"]
        assert f["verified"] is False
        # each rank needs about half of every tensor and fetches only that
        assert 0.4 * total < f["bytes_needed"] < 0.6 * total, f
        assert f["bytes_fetched"] <= 1.05 * f["bytes_needed"], f
        assert res["replicated"]["bytes_needed"] == total
        assert res["replicated"]["cooperative"] is True
    fetched = sum(res["replicated"]["bytes_fetched"] for res in results)
    assert total <= fetched <= 1.05 * total  # each byte once, in total
    assert sum(res["replicated"]["bytes_from_peers"] for res in results) >= total - fetched / 2
    norm_bytes = sum(v.nbytes for k, v in model_tensors().items() if "norm" in k)
    assert all(res["keymap"]["bytes_needed"] == norm_bytes for res in results)


# ---- one process: another backend, local files, damage ---------------------------------
def _load_alone(url: str, options: dict[str, Any], **kw: Any) -> SafetensorsReader:
    want = model_tensors()
    state = {k: torch.zeros_like(v) for k, v in want.items()}
    r = SafetensorsReader(url, storage_options=options, **kw)
    with typed_errors(lambda: r.last_error):
        dcp.load(state, storage_reader=r, no_dist=True)
    assert all(torch.equal(state[k], v) for k, v in want.items())
    return r


@pytest.mark.parametrize("backend", ["moto", "local"], ids=["moto", "local-files"])
def test_both_layouts_load_equal(backend: str, request: pytest.FixtureRequest,
                                 local_model: str) -> None:
    if backend == "local":
        url, options = "file://" + local_model, {}
    else:
        store = request.getfixturevalue(backend).store()
        url, options = _upload(store, local_model), store.storage_options
    total = sum(v.nbytes for v in model_tensors().values())
    for layout in ("single", "single/model.safetensors", "sharded",
                   "sharded/model.safetensors.index.json"):
        r = _load_alone(f"{url}/{layout}", options)
        assert r.last_stats is not None and r.last_stats.verified is False
        assert r.last_stats.bytes_fetched == r.last_stats.bytes_needed == total


def test_damage_in_the_store_gives_typed_errors(seaweedfs: Any, local_model: str) -> None:
    store = seaweedfs.store()
    url = _upload(store, local_model)
    fs, base = store.raw_fs, store.raw_path(url)
    # an index that names a file which is not there
    index = json.loads(fs.cat(f"{base}/sharded/model.safetensors.index.json"))
    index["weight_map"]["layers.0.up.weight"] = "model-00003-of-00002.safetensors"
    fs.pipe(f"{base}/sharded/model.safetensors.index.json", json.dumps(index).encode())
    with pytest.raises(errors.IntegrityError, match="00003-of-00002.*missing"):
        _load_alone(f"{url}/sharded", store.storage_options)
    # a header whose last tensor claims bytes past the object's end
    blob = bytearray(fs.cat(f"{base}/single/model.safetensors"))
    fs.pipe(f"{base}/single/model.safetensors", bytes(blob[: len(blob) - 100]))
    with pytest.raises(errors.IntegrityError, match="not a usable safetensors file"):
        _load_alone(f"{url}/single", store.storage_options)
    # a header length of 2**63
    fs.pipe(f"{base}/single/model.safetensors", (2**63).to_bytes(8, "little") + blob[8:])
    with pytest.raises(errors.IntegrityError, match="claims"):
        _load_alone(f"{url}/single", store.storage_options)
