"""How an export's work is cut (pure, torch-free): its files across ranks
(:func:`assign_files`), and a tensor into dim-0 row slabs of at most a byte budget
(:func:`slabs`), the units a rank fetches."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from dcp_volumes.export._plan import PlannedFile, PlannedTensor

__all__ = ["Slab", "assign_files", "slabs"]


def assign_files(files: Sequence[PlannedFile], world: int) -> list[list[int]]:
    """Which files (indices) each of ``world`` ranks writes: largest first onto the rank
    with the fewest bytes so far (ties to the lowest rank); each rank's in file order."""
    loads = [0] * world
    out: list[list[int]] = [[] for _ in range(world)]
    for i in sorted(range(len(files)), key=lambda i: (-files[i].size, i)):
        rank = min(range(world), key=lambda r: (loads[r], r))
        out[rank].append(i)
        loads[rank] += files[i].size
    return [sorted(mine) for mine in out]


@dataclass(frozen=True)
class Slab:
    """Rows ``[start, stop)`` of dim 0 of a tensor (the whole tensor for 0-d ones)."""

    tensor: PlannedTensor
    start: int
    stop: int

    @property
    def shape(self) -> tuple[int, ...]:
        shape = self.tensor.shape
        return (self.stop - self.start, *shape[1:]) if shape else ()

    @property
    def offsets(self) -> tuple[int, ...]:
        return (self.start, *([0] * (len(self.tensor.shape) - 1))) if self.tensor.shape else ()

    @property
    def source_nbytes(self) -> int:
        return math.prod(self.shape) * self.tensor.source_element_size


def slabs(tensor: PlannedTensor, budget: int, *, sliceable: bool) -> list[Slab]:
    """``tensor`` in dim-0 row ranges of at most ``budget`` source bytes each (at least one
    row); the whole tensor when it fits, is 0-d, or is not ``sliceable`` (its stored chunks
    can only be read whole, so it is assembled once)."""
    shape = tensor.shape
    rows = shape[0] if shape else 1
    if not shape or not sliceable or tensor.source_nbytes <= budget or rows <= 1:
        return [Slab(tensor, 0, rows)]
    row_bytes = max(1, tensor.source_nbytes // rows)
    step = max(1, budget // row_bytes)
    return [Slab(tensor, r, min(rows, r + step)) for r in range(0, rows, step)]
