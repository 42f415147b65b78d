"""The destination side of an export: clearing what an earlier export left, streaming each
file into the store through the backend's sink, and the commit.

Commit last: the index (or, for a one-file export, ``model.safetensors`` itself) is what
makes an export complete, so it is removed before anything is written and appears only
once every other file is durable. Object-store sinks make a file visible only when its
upload completes (S3 ``CompleteMultipartUpload``, an Azure block list, a GCS resumable
upload's last chunk), so a file has its final name or nothing. Local files are written
in place by ``pwrite``: there every file is uploaded under a temporary name and renamed
(``rename(2)``, then the directory fsynced) once durable.
"""

from __future__ import annotations

import functools
import os
import re
import secrets
import threading
from collections.abc import Callable, Iterator

import torch

from dcp_volumes._spool import SpoolFile
from dcp_volumes.backends import Backend, CallStats
from dcp_volumes.backends.local import LocalBackend
from dcp_volumes.config import TransferOptions
from dcp_volumes.export._plan import INDEX, NUMBERED_RE, SINGLE, ExportPlan, PlannedFile
from dcp_volumes.transfer.upload import FileUpload, Uploader

__all__ = ["Destination"]

#: temporary names of local files (``<name>.<token>.tmp``) a killed export may have left
_TMP_RE = re.compile(r"^model[-.].*\.[0-9a-f]{16}\.tmp$")


class Destination:
    """One rank's writes to the export's destination directory or prefix."""

    def __init__(self, backend: Backend, transfer: TransferOptions) -> None:
        self.backend = backend
        self.transfer = transfer
        self.local = isinstance(backend, LocalBackend)
        self.token = secrets.token_hex(8)
        self.stats = CallStats()
        self.bytes_written = 0

    def check(self) -> None:
        """Fail fast on a missing bucket, refused credentials, or a DEST that is a file."""
        self.backend.run(self.backend.check_bucket)

    def clear(self, plan: ExportPlan) -> list[str]:
        """Remove the commit of an earlier export first (index, single file), then its
        numbered files that this export does not overwrite, and temporary files a killed
        local export left. Returns what was removed."""
        names = self.backend.run(self.backend.list_names)
        first = [n for n in (INDEX, SINGLE) if n in names]
        keep = {f.name for f in plan.files}
        stale = [n for n in names
                 if (NUMBERED_RE.match(n) and n not in keep) or _TMP_RE.match(n)]
        self.backend.run(lambda: self.backend.remove(first))
        self.backend.run(lambda: self.backend.remove(stale))
        return first + stale

    def _target(self, name: str) -> str:
        return f"{name}.{self.token}.tmp" if self.local else name

    def write(self, files: list[PlannedFile],
              feed: Callable[[PlannedFile, SpoolFile], Iterator[int]],
              progress: Callable[[int], None] | None = None) -> None:
        """Upload ``files`` (in order): ``feed(file, spool)`` writes a file's bytes into its
        upload, yielding after each piece (the bytes fed so far are reported to
        ``progress``); return once every file is durable under its final name."""
        if not files:
            return
        t = self.transfer
        uploader = Uploader(self.backend, part_size=t.part_size,
                            max_concurrency=t.max_concurrency, stats=self.stats,
                            adaptive=t.adaptive_concurrency)
        # parts held in memory: the ones in flight, and one being filled
        slots = threading.Semaphore(t.max_concurrency + 1)
        uploads: list[FileUpload] = []
        fed = 0
        try:
            for pf in files:
                target = self._target(pf.name)
                upload = uploader.start_file(target, functools.partial(
                    SpoolFile, target, mode="memory", directory="", part_size=t.part_size,
                    buffer_slots=slots, should_stop=uploader.raise_if_failed),
                    expected_size=pf.size)
                uploads.append(upload)
                for n in feed(pf, upload.spool):
                    if progress is not None:
                        progress(fed + n)
                fed += upload.spool.close()
                upload.finish()
            uploader.spooling_ended()
            uploader.wait()
            if self.local:
                self._rename([(self._target(f.name), f.name) for f in files])
        except BaseException:
            uploader.abort()
            raise
        finally:
            for upload in uploads:
                upload.spool.discard()
        self.bytes_written += fed

    def _rename(self, moves: list[tuple[str, str]]) -> None:
        for tmp, final in moves:
            os.replace(self.backend.path(tmp), self.backend.path(final))
        dfd = os.open(self.backend.root, os.O_RDONLY)
        try:
            os.fsync(dfd)
        finally:
            os.close(dfd)

    def commit_index(self, plan: ExportPlan) -> None:
        """Write ``model.safetensors.index.json`` in one atomic operation (multi-file only)."""
        data = plan.index_bytes()
        if data is None:
            return
        self.backend.run(lambda: self.backend.commit(INDEX, data, exclusive=False,
                                                     save_id=self.token, stats=self.stats))


def tensor_bytes(tensor: torch.Tensor, dtype: str) -> memoryview:
    """The raw little-endian bytes of ``tensor`` cast to ``dtype`` (a torch dtype name)."""
    out = tensor.to(getattr(torch, dtype)) if str(tensor.dtype) != f"torch.{dtype}" else tensor
    flat = out.contiguous().reshape(-1).view(torch.uint8)
    return memoryview(flat.numpy())  # type: ignore[arg-type]
