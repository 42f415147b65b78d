"""Staging for ``dcp.async_save``: copy the state dict into CPU buffers reused across saves.

*Stage* is torch's word for making a training-safe CPU copy before the background save;
it is unrelated to our *spool*. Allocating a fresh copy each time costs a page-faulting
clone; copying into buffers allocated once costs a plain memcpy (pinned when CUDA is
available, which makes device-to-host copies faster).

The buffers belong to the process, not to a writer: one pool, keyed by the state's layout
(keys, shapes, dtypes, strides), serves every :class:`~dcp_volumes.VolumeWriter` of the
process, so a fresh writer per step reuses them as well as one writer kept across saves.

Safety: a buffer set is handed out again only after the save that read it has finished
reading, learnt in one of two ways, whichever comes first:

* ``write_data`` returned or failed (the writer calls :meth:`StagingBuffers.finished_reading`,
  which finds the set by the storage of a tensor the save read: exact even when saves
  overlap and finish out of order);
* nothing references the staged tensors any more (the save's thread ended, for instance
  one that failed while planning and never reached ``write_data``): every staged tensor is
  an alias of a buffer carrying a token, and a finalizer on the token returns the set.

Saves started with ``AsyncCheckpointerType.PROCESS`` read the buffers in another process,
which neither signal observes: pickling a writer (which PROCESS mode does for every save)
drops the sets that writer staged instead of returning them, and its later saves get fresh
buffers that never join the pool.

Memory is bounded: at most ``_MAX_IDLE`` idle sets are kept, all of the latest layout
staged; a stage of another layout frees the idle sets of the old one ("the layout
changed"), and :func:`release_staging_buffers` frees them on request. Sets out with a
running save are freed when it ends, unless they may go back to the pool.
"""

from __future__ import annotations

import itertools
from typing import Any

import torch

from dcp_volumes.saving._staging_pool import StagingPool

__all__ = ["StagingBuffers", "release_staging_buffers"]

_POOL = StagingPool()
_owners = itertools.count(1)


def release_staging_buffers() -> None:
    """Free this process's idle ``dcp.async_save`` staging buffers now.

    Buffers still read by a running save are freed when that save ends. The next
    ``async_save`` allocates afresh (one page-faulting copy), and later ones reuse again.
    """
    _POOL.drop()


class StagingBuffers:
    """One writer's view of the process's staging pool."""

    def __init__(self) -> None:
        self._owner = next(_owners)
        self.reuse = True
        self.allocations = 0  # buffer sets this writer's stages allocated (not reused)

    def stage(self, state_dict: dict[str, Any]) -> dict[str, Any]:
        staged, allocated = _POOL.stage(state_dict, owner=self._owner, reuse=self.reuse)
        self.allocations += allocated
        return staged

    def finished_reading(self, items: list[Any], planner: Any) -> None:
        """The save that wrote ``items`` (``write_data`` returned or failed) has finished
        reading its staged tensors: hand their buffer set out again."""
        for item in items:
            if item.tensor_data is None:
                continue
            try:
                data = planner.resolve_data(item)
            except Exception:  # noqa: BLE001 -- best effort: the finalizer returns it anyway
                return
            if isinstance(data, torch.Tensor):
                _POOL.finished_reading(data)
            return

    def disable_reuse(self) -> None:
        """Another process reads what this writer staged, where we cannot see it finish:
        drop those sets, and stage into fresh buffers that never join the pool."""
        self.reuse = False
        _POOL.drop(self._owner)

    def close(self) -> None:
        """Free the buffer sets this writer staged last (idle, or once their save ends).

        The pool lets go of an idle set at once, even while someone (the thread of a
        finished ``async_save``) still holds the staged copy: the memory goes with it."""
        _POOL.drop(self._owner)
