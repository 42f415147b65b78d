"""Rank functions for multi-rank save/load checks (importable by spawned processes).

The state is deterministic, so any rank count can rebuild what it must read back:

- ``sharded.*``: DTensors sharded on dim 0 over a 1-D CPU device mesh of all ranks.
- ``replicated.*``: identical plain tensors on every rank (DDP-style); DCP spreads their
  writes over the ranks.
- ``step``, ``meta``: non-tensor objects.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard, distribute_tensor

__all__ = ["build_state", "expected_full_state", "load_on_ranks", "save_on_ranks"]


def expected_full_state() -> dict[str, Any]:
    """The global (unsharded) values every scenario saves."""
    g = torch.Generator().manual_seed(1234)
    return {
        "sharded": {
            "w": torch.randn(12, 7, generator=g),
            "emb": torch.randn(30, 4, generator=g).to(torch.bfloat16),
            # 8 MiB: its shards are large enough to be fetched partially on reshard
            "big": torch.randn(1024, 2048, generator=g),
        },
        "replicated": {f"r{i}": torch.randn(64 + i, generator=g) for i in range(6)},
        "step": 1000,
        "meta": {"name": "scenario", "lr": 0.1},
    }


def build_state(world_size: int, *, zeros: bool) -> dict[str, Any]:
    """This rank's state dict: DTensors for ``sharded``, plain tensors for the rest."""
    full = expected_full_state()
    mesh = init_device_mesh("cpu", (world_size,))
    sharded = {}
    for k, v in full["sharded"].items():
        src = torch.zeros_like(v) if zeros else v
        sharded[k] = distribute_tensor(src, mesh, [Shard(0)])
    replicated = {k: (torch.zeros_like(v) if zeros else v.clone())
                  for k, v in full["replicated"].items()}
    return {
        "sharded": sharded,
        "replicated": replicated,
        "step": 0 if zeros else full["step"],
        "meta": {"name": "", "lr": 0.0} if zeros else dict(full["meta"]),
    }


def save_on_ranks(rank: int, world_size: int, url: str, writer_kwargs: dict[str, Any]
                  ) -> dict[str, Any]:
    """Save the scenario state with VolumeWriter; returns this rank's SaveStats as a dict."""
    from dcp_volumes import VolumeWriter

    state = build_state(world_size, zeros=False)
    writer = VolumeWriter(url, **writer_kwargs)
    dcp.save(state, storage_writer=writer)
    dist.barrier()
    return writer.last_stats.as_dict() if writer.last_stats else {}


def load_on_ranks(rank: int, world_size: int, url: str, reader_kwargs: dict[str, Any],
                  use_torch_reader: bool = False) -> dict[str, Any]:
    """Load onto ``world_size`` ranks and compare with the expected values bit for bit."""
    from dcp_volumes import VolumeReader

    state = build_state(world_size, zeros=True)
    if use_torch_reader:
        reader: Any = dcp.FileSystemReader(url)
    else:
        reader = VolumeReader(url, **reader_kwargs)
    dcp.load(state, storage_reader=reader)
    full = expected_full_state()
    for k, v in full["sharded"].items():
        got = state["sharded"][k].full_tensor()
        if not torch.equal(got, v):
            raise AssertionError(f"sharded.{k} differs after load on {world_size} ranks")
    for k, v in full["replicated"].items():
        if not torch.equal(state["replicated"][k], v):
            raise AssertionError(f"replicated.{k} differs after load on {world_size} ranks")
    if state["step"] != full["step"] or state["meta"] != full["meta"]:
        raise AssertionError("non-tensor objects differ after load")
    stats = getattr(reader, "last_stats", None)
    return stats.as_dict() if stats else {}


def async_save_on_ranks(rank: int, world_size: int, url: str, writer_kwargs: dict[str, Any],
                        checkpointer: str) -> dict[str, Any]:
    """``dcp.async_save`` with the THREAD or PROCESS checkpointer; the caller keeps training
    while it runs. Returns how long the call blocked and how many training steps ran before
    the upload finished."""
    import time

    from dcp_volumes import VolumeWriter
    from dcp_volumes._compat import async_executor, upload_future

    state = build_state(world_size, zeros=False)
    writer = VolumeWriter(url, **writer_kwargs)
    executor = async_executor(checkpointer)
    start = time.monotonic()
    response = dcp.async_save(state, storage_writer=writer, **executor)
    blocked = time.monotonic() - start
    future = upload_future(response)
    steps = 0
    model = torch.nn.Linear(64, 64)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    while not future.done():
        loss = model(torch.randn(32, 64)).pow(2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        steps += 1
    future.result()
    dist.barrier()
    return {"blocked_s": blocked, "steps_during_upload": steps,
            "total_s": time.monotonic() - start}
