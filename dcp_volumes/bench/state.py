"""The benchmark state dict: a model-like layout whose bytes come from one random pool file.

Every process (the harness, each worker, each rank) rebuilds exactly the same bytes from the
pool, so a loaded state can be checked against it without shipping the data around.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from typing import Any

__all__ = [
    "MiB",
    "TensorSpec",
    "build_state",
    "check_state",
    "layout_for",
    "local_bytes",
    "read_into",
    "state_bytes",
    "tiny_state",
    "write_pool",
]

MiB = 1 << 20


@dataclass(frozen=True)
class TensorSpec:
    """One tensor of the benchmark state dict and where its bytes live in the pool file."""

    name: str
    shape: tuple[int, ...]
    dtype: str  # "float32" | "bfloat16"
    offset: int

    @property
    def itemsize(self) -> int:
        return 4 if self.dtype == "float32" else 2

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.itemsize

    @property
    def row_bytes(self) -> int:
        return math.prod(self.shape[1:]) * self.itemsize


def layout_for(total: int) -> list[TensorSpec]:
    """Layers of (weight [R, 1024] f32, bias [1024] f32, norm [1024] bf16) adding up to
    about ``total`` bytes. Row counts are multiples of 12 so 1, 2, 3 and 4 ranks shard evenly.
    """
    cols = 1024
    layer = min(32 * MiB, max(256 * 1024, total // 8))
    rows = max(12, (layer // (cols * 4)) // 12 * 12)
    per_layer = rows * cols * 4 + cols * 4 + cols * 2
    nlayers = max(1, total // per_layer)
    specs: list[TensorSpec] = []
    offset = 0
    for i in range(nlayers):
        for name, shape, dtype in ((f"layers.{i}.weight", (rows, cols), "float32"),
                                   (f"layers.{i}.bias", (cols,), "float32"),
                                   (f"layers.{i}.norm", (cols,), "bfloat16")):
            spec = TensorSpec(name, shape, dtype, offset)
            specs.append(spec)
            offset += spec.nbytes
    return specs


def state_bytes(specs: list[TensorSpec]) -> int:
    return sum(s.nbytes for s in specs)


def write_pool(path: str, nbytes: int, seed: int = 0) -> None:
    """Random bytes (incompressible, so no store can shortcut them)."""
    import numpy as np

    rng = np.random.default_rng(seed)
    with open(path, "wb") as f:
        left = nbytes
        while left > 0:
            n = min(left, 64 * MiB)
            f.write(rng.bytes(n))
            left -= n


def read_into(fd: int, buf: Any, offset: int) -> None:
    view = memoryview(buf).cast("B")
    done = 0
    while done < len(view):
        n = os.preadv(fd, [view[done:]], offset + done)
        if n <= 0:
            raise OSError(f"pool file too short at {offset + done}")
        done += n


def _chunk(n: int, world: int, rank: int) -> tuple[int, int]:
    """Rows [start, end) of ``rank`` under DTensor Shard(0) (torch.chunk semantics)."""
    size = -(-n // world)
    start = min(n, rank * size)
    return start, min(n, start + size)


def _torch_dtype(name: str) -> Any:
    import torch

    return {"float32": torch.float32, "bfloat16": torch.bfloat16}[name]


def _local_tensor(fd: int, spec: TensorSpec, world: int, rank: int, *, fill: bool) -> Any:
    import torch

    r0, r1 = _chunk(spec.shape[0], world, rank)
    shape = (r1 - r0, *spec.shape[1:])
    t = torch.empty(shape, dtype=_torch_dtype(spec.dtype))
    raw = t.view(-1).view(torch.uint8)
    if fill:
        if raw.numel():
            read_into(fd, raw.numpy(), spec.offset + r0 * spec.row_bytes)
    else:
        raw.fill_(0)
    return t


def build_state(pool: str, specs: list[TensorSpec], *, layout: str = "plain", world: int = 1,
                rank: int = 0, mesh: Any = None, fill: bool = True) -> dict[str, Any]:
    """The benchmark state dict (``fill=False``: a zeroed target of the same shape).

    ``layout``: ``plain`` (one process), ``replicated`` (every rank holds everything) or
    ``sharded`` (DTensors, Shard(0) over ``mesh``).
    """
    import torch

    state: dict[str, Any] = {}
    fd = os.open(pool, os.O_RDONLY)
    try:
        for spec in specs:
            if layout == "sharded":
                from torch.distributed.tensor import DTensor, Shard

                local = _local_tensor(fd, spec, world, rank, fill=fill)
                full = torch.Size(spec.shape)
                stride = tuple(math.prod(spec.shape[i + 1:]) for i in range(len(spec.shape)))
                state[spec.name] = DTensor.from_local(local, mesh, [Shard(0)], run_check=False,
                                                      shape=full, stride=stride)
            else:
                state[spec.name] = _local_tensor(fd, spec, 1, 0, fill=fill)
    finally:
        os.close(fd)
    state["step"] = 1000 if fill else 0
    state["meta"] = {"lr": 1e-4, "name": "dcp-volumes-bench"} if fill else {}
    return state


def check_state(pool: str, specs: list[TensorSpec], state: dict[str, Any], *,
                layout: str = "plain", world: int = 1, rank: int = 0) -> bool:
    """Whether every tensor in ``state`` holds exactly the pool's bytes."""
    import torch

    fd = os.open(pool, os.O_RDONLY)
    try:
        for spec in specs:
            t = state[spec.name]
            if layout == "sharded":
                t = t.to_local()
                want = _local_tensor(fd, spec, world, rank, fill=True)
            else:
                want = _local_tensor(fd, spec, 1, 0, fill=True)
            if not torch.equal(t.reshape(-1).view(torch.uint8), want.reshape(-1).view(torch.uint8)):
                return False
    finally:
        os.close(fd)
    return state.get("step") == 1000


def local_bytes(state: dict[str, Any]) -> int:
    """Tensor bytes this rank holds (what a load into ``state`` logically needs)."""
    n = 0
    for v in state.values():
        if hasattr(v, "to_local"):
            v = v.to_local()
        if hasattr(v, "nbytes") and hasattr(v, "dtype"):
            n += int(v.nbytes)
    return n


def tiny_state() -> dict[str, Any]:
    import torch

    g = torch.Generator().manual_seed(1)
    return {"w": torch.randn(256, 1024, generator=g), "step": 1}

