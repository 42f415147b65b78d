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
import threading
import weakref
from collections import deque
from typing import Any

import torch
from torch.distributed._state_dict_utils import _copy_state_dict, _create_cpu_state_dict
from torch.utils._pytree import tree_map_only

__all__ = ["StagingBuffers", "release_staging_buffers"]

#: idle buffer sets kept per process (all of the latest layout): one covers saves that do
#: not overlap; overlapping saves allocate for the extra set, freed when they end.
_MAX_IDLE = 1

_LEASE_ATTR = "_dcp_volumes_staging_lease"


def _signature(state_dict: Any) -> Any:
    """Structure of a state dict: keys, tensor shapes, dtypes and layouts."""
    if isinstance(state_dict, dict):
        return tuple((k, _signature(v)) for k, v in state_dict.items())
    if isinstance(state_dict, (list, tuple)):
        return tuple(_signature(v) for v in state_dict)
    if isinstance(state_dict, torch.Tensor):
        local = state_dict.to_local() if hasattr(state_dict, "to_local") else state_dict
        return ("T", tuple(local.shape), local.dtype, tuple(local.stride()), type(state_dict))
    return type(state_dict).__name__


def _storage_ptr(tensor: torch.Tensor) -> int:
    local = tensor.to_local() if hasattr(tensor, "to_local") else tensor
    return int(local.untyped_storage().data_ptr())


def _storage_ptrs(buffers: Any) -> list[int]:
    ptrs: list[int] = []
    tree_map_only(torch.Tensor, lambda t: ptrs.append(_storage_ptr(t)), buffers)
    return [p for p in ptrs if p]  # empty tensors own no memory


class _BufferSet:
    """CPU tensors shaped like one state dict, reused from save to save."""

    __slots__ = ("buffers", "ptrs", "sig")

    def __init__(self, sig: Any, buffers: dict[str, Any]) -> None:
        self.sig = sig
        self.buffers = buffers
        self.ptrs = _storage_ptrs(buffers)


class _Lease:
    """One hand-out of a buffer set to one save."""

    __slots__ = ("__weakref__", "buffer_set", "done", "keep", "owner")

    def __init__(self, buffer_set: _BufferSet, owner: int, keep: bool) -> None:
        # None once the lease has ended: the token's finalizer keeps the lease alive for as
        # long as anyone holds a staged tensor, and must not keep the set with it
        self.buffer_set: _BufferSet | None = buffer_set
        self.owner = owner
        self.keep = keep  # may go back to the pool when the save has finished reading
        self.done = False


class _Token:
    """Carried by every staged tensor of one lease; its finalizer ends the lease."""

    __slots__ = ("__weakref__",)


class _Pool:
    """The process's staging buffer sets: idle ones, and those out with a save."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._idle: list[tuple[_BufferSet, int]] = []  # (set, owner that staged it last)
        self._out: dict[int, _Lease] = {}  # storage pointer -> the lease reading it
        self._leases: weakref.WeakSet[_Lease] = weakref.WeakSet()
        # Ended by a finalizer that found the lock taken (possibly by its own thread,
        # garbage-collecting inside a locked section); filed by the next locked call.
        self._ended: deque[_Lease] = deque()
        self._layout: Any = None
        self.allocations = 0

    # ---- hand out ---------------------------------------------------------------------
    def stage(self, state_dict: dict[str, Any], *, owner: int,
              reuse: bool) -> tuple[dict[str, Any], bool]:
        """A staged copy of ``state_dict``, and whether its buffers were allocated now."""
        sig = _signature(state_dict)
        found: _BufferSet | None = None
        allocated = False
        with self._lock:
            self._file_ended()
            if reuse:
                if sig != self._layout:  # the layout changed: free the old one's idle sets
                    self._idle = [e for e in self._idle if e[0].sig == sig]
                    self._layout = sig
                for i, (bs, _) in enumerate(self._idle):
                    if bs.sig == sig:
                        found = self._idle.pop(i)[0]
                        break
        if found is None:
            pin = torch.cuda.is_available()
            found = _BufferSet(sig, _create_cpu_state_dict(state_dict, pin_memory=pin))
            allocated = True
            with self._lock:
                self.allocations += 1
        lease = _Lease(found, owner, keep=reuse)
        try:
            cuda = torch.cuda.is_available()
            # the copy's structure, not found.buffers: non-tensor values are this state's
            copied = _copy_state_dict(state_dict, found.buffers, non_blocking=cuda,
                                      type_check=False)
            if cuda:
                torch.cuda.synchronize()
        except BaseException:
            lease.keep = False  # a copy may still be in flight into it: drop, don't reuse
            self._end(lease)
            raise
        token = _Token()

        def alias(t: torch.Tensor) -> torch.Tensor:
            a = t.detach()
            setattr(a, _LEASE_ATTR, token)
            return a

        staged: dict[str, Any] = tree_map_only(torch.Tensor, alias, copied)
        with self._lock:
            self._leases.add(lease)
            if reuse:
                for p in found.ptrs:
                    self._out[p] = lease
        weakref.finalize(token, self._collected, lease).atexit = False
        return staged, allocated

    # ---- take back --------------------------------------------------------------------
    def finished_reading(self, tensor: torch.Tensor) -> None:
        """The save that read ``tensor`` (a staged tensor, or a view of one) is done with
        its buffer set; a tensor the pool did not stage is ignored."""
        ptr = _storage_ptr(tensor)
        with self._lock:
            self._file_ended()
            lease = self._out.get(ptr)
            if lease is not None:
                self._end_locked(lease)

    def _collected(self, lease: _Lease) -> None:
        # A finalizer: may run in any thread, at any allocation, even inside our own locked
        # sections; never block on the lock.
        if self._lock.acquire(blocking=False):
            try:
                self._end_locked(lease)
                self._file_ended()
            finally:
                self._lock.release()
        else:
            self._ended.append(lease)

    def _end(self, lease: _Lease) -> None:
        with self._lock:
            self._end_locked(lease)

    def _file_ended(self) -> None:
        while self._ended:
            self._end_locked(self._ended.popleft())

    def _end_locked(self, lease: _Lease) -> None:
        bs = lease.buffer_set
        if lease.done or bs is None:
            return
        lease.done, lease.buffer_set = True, None
        for p in bs.ptrs:
            if self._out.get(p) is lease:
                del self._out[p]
        if lease.keep and bs.sig == self._layout and len(self._idle) < _MAX_IDLE:
            self._idle.append((bs, lease.owner))
        # else dropped: the memory goes when the staged tensors do

    # ---- free -------------------------------------------------------------------------
    def drop(self, owner: int | None = None) -> None:
        """Free the idle sets (of ``owner``, or all) and let none of the sets out with a
        save (of ``owner``, or all) come back."""
        with self._lock:
            self._file_ended()
            self._idle = [e for e in self._idle if owner is not None and e[1] != owner]
            for lease in list(self._leases):
                if owner is None or lease.owner == owner:
                    lease.keep = False
                    if lease.buffer_set is not None:  # not ended yet
                        for p in lease.buffer_set.ptrs:
                            if self._out.get(p) is lease:
                                del self._out[p]
            if owner is None:
                self._layout = None

    def idle_sets(self) -> int:
        with self._lock:
            self._file_ended()
            return len(self._idle)


_POOL = _Pool()
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
