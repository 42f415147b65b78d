"""Staging for ``dcp.async_save``: copy the state dict into CPU buffers reused across saves.

*Stage* is torch's word for making a training-safe CPU copy before the background save;
it is unrelated to our *spool*. Allocating a fresh copy each time costs a page-faulting
clone; copying into buffers allocated once costs a plain memcpy (pinned when CUDA is
available, which makes device-to-host copies faster).

Safety: a buffer set is reused only after the save that read it has finished on this
writer (``release`` is called when ``write_data`` returns). Saves started with
``AsyncCheckpointerType.PROCESS`` read the buffers in another process, which this object
cannot observe: pickling the writer (which PROCESS mode does for every save) turns reuse
off for good, and every later save gets fresh buffers.
"""

from __future__ import annotations

import collections
import threading
from typing import Any

import torch
from torch.distributed._state_dict_utils import _copy_state_dict, _create_cpu_state_dict

__all__ = ["StagingBuffers"]


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


class StagingBuffers:
    """A small pool of CPU buffer sets, handed out in FIFO order."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._free: list[tuple[Any, dict[str, Any]]] = []
        self._busy: collections.deque[tuple[Any, dict[str, Any]]] = collections.deque()
        self.reuse = True
        self.allocations = 0

    def stage(self, state_dict: dict[str, Any]) -> dict[str, Any]:
        sig = _signature(state_dict)
        buffers = None
        with self._lock:
            if self.reuse:
                for i, (s, b) in enumerate(self._free):
                    if s == sig:
                        buffers = self._free.pop(i)[1]
                        break
        if buffers is None:
            pin = torch.cuda.is_available()
            buffers = _create_cpu_state_dict(state_dict, pin_memory=pin)
            self.allocations += 1
        cuda = torch.cuda.is_available()
        staged = _copy_state_dict(state_dict, buffers, non_blocking=cuda, type_check=False)
        if cuda:
            torch.cuda.synchronize()
        with self._lock:
            if self.reuse:
                self._busy.append((sig, buffers))
        return staged

    def release_oldest(self) -> None:
        """The oldest staged save finished reading its buffers."""
        with self._lock:
            if self._busy:
                entry = self._busy.popleft()
                if self.reuse:
                    self._free = [entry]  # keep one idle set, not a growing pile

    def disable_reuse(self) -> None:
        with self._lock:
            self.reuse = False
            self._free.clear()
            self._busy.clear()

    def close(self) -> None:
        with self._lock:
            self._free.clear()
            self._busy.clear()
