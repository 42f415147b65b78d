"""The process's pool of staging buffer sets (:class:`StagingPool`): which sets are idle,
which are out with a save, and when a set may be handed out again (see
:mod:`dcp_volumes.saving._staging` for the rules)."""

from __future__ import annotations

import threading
import weakref
from collections import deque
from typing import Any

import torch
from torch.distributed._state_dict_utils import _copy_state_dict, _create_cpu_state_dict
from torch.utils._pytree import tree_map_only

__all__ = ["StagingPool"]

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


class StagingPool:
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
        found = self._take_idle(sig, reuse)
        allocated = found is None
        if found is None:
            pin = torch.cuda.is_available()
            found = _BufferSet(sig, _create_cpu_state_dict(state_dict, pin_memory=pin))
            with self._lock:
                self.allocations += 1
        lease = _Lease(found, owner, keep=reuse)
        copied = self._copy(state_dict, lease, found)
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

    def _take_idle(self, sig: Any, reuse: bool) -> _BufferSet | None:
        """An idle set of layout ``sig``, taken out of the pool (None if there is none, or
        without ``reuse``). A new layout frees the idle sets of the old one."""
        with self._lock:
            self._file_ended()
            if not reuse:
                return None
            if sig != self._layout:  # the layout changed: free the old one's idle sets
                self._idle = [e for e in self._idle if e[0].sig == sig]
                self._layout = sig
            for i, (bs, _) in enumerate(self._idle):
                if bs.sig == sig:
                    return self._idle.pop(i)[0]
        return None

    def _copy(self, state_dict: dict[str, Any], lease: _Lease,
              found: _BufferSet) -> dict[str, Any]:
        """``state_dict`` copied into ``found``'s buffers (waited for on CUDA); a failed copy
        ends ``lease`` without returning the set (a copy may still be in flight into it)."""
        try:
            cuda = torch.cuda.is_available()
            # the copy's structure, not found.buffers: non-tensor values are this state's
            copied: dict[str, Any] = _copy_state_dict(state_dict, found.buffers,
                                                      non_blocking=cuda, type_check=False)
            if cuda:
                torch.cuda.synchronize()
        except BaseException:
            lease.keep = False  # a copy may still be in flight into it: drop, don't reuse
            self._end(lease)
            raise
        return copied

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
