"""fsspec's in-process ``memory://`` filesystem (tests and demos; one process only)."""

from __future__ import annotations

import threading

from dcp_volumes.backends.base import Backend

__all__ = ["MemoryBackend"]

# memory:// has no conditional create: one lock per process makes the commit exclusive.
_commit_lock = threading.Lock()


class MemoryBackend(Backend):
    name = "memory"
    shared_across_processes = False

    async def _commit_once(self, relative: str, data: bytes, *, exclusive: bool,
                           save_id: str) -> None:
        path = self.path(relative)
        with _commit_lock:
            if exclusive and self.fs.exists(path):
                raise FileExistsError(path)
            self.fs.pipe_file(path, data)
