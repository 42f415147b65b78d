"""The destination side of an export: claiming DEST, clearing what an earlier export of this
scheme left, streaming each file into the store through the backend's sink, and the commit.

Commit last: the index (or, for a one-file export, ``model.safetensors`` itself) is what
makes an export complete, so it is removed before anything is written and appears only
once every other file is durable. Object-store sinks make a file visible only when its
upload completes (S3 ``CompleteMultipartUpload``, an Azure block list, a GCS resumable
upload's last chunk), so a file has its final name or nothing. Local files are written
in place by ``pwrite``: there every file is uploaded under a temporary name and renamed
(``rename(2)``, then the directory fsynced) once durable.

Ownership (:mod:`~dcp_volumes.export._lease`): DEST is claimed before anything is removed;
only files an earlier export's index or marker names (and their temporary names) are ever
deleted, never another object that merely looks like one; the claim is re-checked before
each file is completed and before the commit, so of two racing exports at most one commits.
"""

from __future__ import annotations

import os
import secrets
import time
from collections.abc import Callable, Iterator

import torch

from dcp_volumes import errors
from dcp_volumes.backends import Backend, CallStats, redact_url
from dcp_volumes.config import TransferOptions
from dcp_volumes.export import _lease
from dcp_volumes.export._plan import INDEX, SINGLE, ExportPlan, PlannedFile
from dcp_volumes.saving.objects import ObjectUploads, ObjectWriter

__all__ = ["Destination", "new_token", "tensor_bytes"]


def new_token() -> str:
    """An export's token (its claim on DEST, its temporary names)."""
    return secrets.token_hex(8)


class Destination:
    """One rank's writes to the export's destination directory or prefix."""

    def __init__(self, backend: Backend, transfer: TransferOptions, token: str) -> None:
        self.backend = backend
        self.transfer = transfer
        self.local = backend.local_paths
        self.token = token
        self.stats = CallStats()
        self.bytes_written = 0

    def check(self) -> None:
        """Fail fast on a missing bucket, refused credentials, a DEST that is a file or a
        link to nothing."""
        root = str(self.backend.root)
        if self.local and os.path.islink(root) and not os.path.exists(root):
            raise errors.ConfigError(
                f"{root} is a symbolic link to {os.readlink(root)!r}, which does not exist: "
                "create the directory it points to, or export to another directory")
        if self.local:
            _check_parents(root)
        self.backend.run(self.backend.check_bucket)

    def earlier(self) -> list[str]:
        """The commit of an earlier export at DEST (its index or single file), if any."""
        names = set(self.backend.run(self.backend.list_names))
        return [n for n in (INDEX, SINGLE) if n in names]

    def claim(self, plan: ExportPlan) -> list[str]:
        """Claim DEST, then remove the commit of an earlier export first (index, single
        file), then the files it (or a killed export) wrote that this one does not
        overwrite, their temporary names, and unfinished uploads of this scheme's names.
        Returns what was removed."""
        before = _lease.read_claim(self.backend)
        owned = set(_lease.index_files(self.backend))
        if before is not None:
            owned.update(before.files)
        keep = {f.name for f in plan.files}
        _lease.write_claim(self.backend, _lease.Claim(self.token, tuple(sorted(keep))))
        names = set(self.backend.run(self.backend.list_names))
        first = [n for n in (INDEX, SINGLE) if n in names and n not in keep]
        stale = sorted((owned - keep) & names)
        if before is not None and self.local:
            stale += [n for n in before.temporaries() if n in names]
        self._remove(first)
        self._remove(stale)
        self._abort_uploads()
        return first + stale

    def _remove(self, names: list[str]) -> None:
        try:
            self.backend.run(lambda: self.backend.remove(names))
        except errors.DCPVolumesError:
            raise
        except OSError as exc:  # a directory by one of these names, say
            raise errors.UploadError(
                f"could not remove {names} of an earlier export at "
                f"{redact_url(self.backend.url)} ({type(exc).__name__}: {exc.strerror}): "
                "remove or rename them, then export again") from None

    def _abort_uploads(self) -> None:
        """Abort unfinished multipart uploads of this scheme's names under DEST (a killed
        export's: they are billed and invisible; the claim makes them no one else's)."""
        if not self.backend.lists_stale_uploads:
            return
        root = str(self.backend.root).rstrip("/") + "/"
        uploads = self.backend.run(lambda: self.backend.stale_uploads(0.0, time.time()))
        for up in uploads:
            name = up.key[len(root):] if up.key.startswith(root) else ""
            if _lease.owned(name) or name == INDEX:
                self.backend.run(lambda u=up: self.backend.abort_upload(u))  # type: ignore[misc]

    def hold(self) -> None:
        """Check that DEST is still this export's (before a file or the index is committed).

        Raises:
            ExportConflictError: another export has claimed DEST since.
        """
        found = _lease.read_claim(self.backend)
        if found is None or found.token != self.token:
            raise _lease.conflict(self.backend, "writing")

    def check_same(self, rank: int) -> None:
        """Every rank, once rank 0 claimed DEST: it must see rank 0's marker.

        Raises:
            DestinationMismatchError: it does not (DEST differs per node).
        """
        found = _lease.read_claim(self.backend)
        if found is None or found.token != self.token:
            raise _lease.mismatch(self.backend, rank, found)

    def _target(self, name: str) -> str:
        return f"{name}.{self.token}.tmp" if self.local else name

    def write(self, files: list[PlannedFile],
              feed: Callable[[PlannedFile, ObjectWriter], Iterator[int]],
              progress: Callable[[int], None] | None = None) -> None:
        """Upload ``files`` (in order): ``feed(file, out)`` writes a file's bytes into its
        upload (an :class:`~dcp_volumes.saving.objects.ObjectWriter`), yielding after each
        piece (the bytes fed so far are reported to ``progress``); return once every file is
        durable under its final name. DEST's claim is checked before each file starts and
        before it is completed."""
        if not files:
            return
        t = self.transfer
        uploads = ObjectUploads(self.backend, part_size=t.part_size,
                                max_concurrency=t.max_concurrency, stats=self.stats,
                                adaptive=t.adaptive_concurrency)
        fed = 0
        try:
            for pf in files:
                self.hold()
                out = uploads.open(self._target(pf.name), expected_size=pf.size)
                for n in feed(pf, out):
                    if progress is not None:
                        progress(fed + n)
                self.hold()  # before the last part goes: a one-part file is put by it
                out.close()
                fed += out.tell()
            uploads.wait()
            if self.local:
                self._rename([(self._target(f.name), f.name) for f in files])
        except BaseException as exc:
            lost = self._lost(exc)
            if lost is None:
                uploads.abort()  # DEST is still this export's: remove what it uploaded
                raise
            # DEST is another export's now: what this one completed may have been replaced
            # by that one's files, so nothing is removed; pending parts stop
            uploads.fail(lost)
            if lost is exc:
                raise
            raise lost from exc
        finally:
            uploads.discard()
        self.bytes_written += fed

    def _lost(self, exc: BaseException) -> errors.ExportConflictError | None:
        """The conflict, when a write failed because another export took DEST over."""
        if isinstance(exc, errors.ExportConflictError):
            return exc
        if not isinstance(exc, Exception):
            return None
        try:
            self.hold()
        except errors.ExportConflictError as lost:
            return lost
        except errors.DCPVolumesError:
            pass  # the store is failing: the original error says more
        return None

    def _rename(self, moves: list[tuple[str, str]]) -> None:
        try:
            for tmp, final in moves:
                os.replace(self.backend.path(tmp), self.backend.path(final))
            dfd = os.open(self.backend.root, os.O_RDONLY)
            try:
                os.fsync(dfd)
            finally:
                os.close(dfd)
        except OSError as exc:  # a directory where a file goes, say
            raise errors.UploadError(
                f"could not put {exc.filename2 or exc.filename} in place at "
                f"{redact_url(self.backend.url)} ({type(exc).__name__}: {exc.strerror}): "
                "move what is there away, then export again") from None

    def commit(self, plan: ExportPlan) -> None:
        """Rank 0, once every file is durable: check the claim, write
        ``model.safetensors.index.json`` in one atomic operation (multi-file only), and
        give DEST up (remove the marker)."""
        self.hold()
        data = plan.index_bytes()
        if data is not None:
            self.backend.run(lambda: self.backend.commit(INDEX, data, exclusive=False,
                                                         save_id=self.token, stats=self.stats))
        self.backend.run(lambda: self.backend.remove([_lease.MARKER]))


def _check_parents(root: str) -> None:
    """A local DEST whose nearest existing ancestor is not a directory cannot be made."""
    parent = os.path.dirname(os.path.abspath(root))
    while parent and not os.path.lexists(parent):
        parent = os.path.dirname(parent)
    if parent and not os.path.isdir(parent):
        raise errors.ConfigError(
            f"{root} cannot be created: {parent} is a file, not a directory; export to a "
            "directory")


def tensor_bytes(tensor: torch.Tensor, dtype: str) -> memoryview:
    """The raw little-endian bytes of ``tensor`` cast to ``dtype`` (a torch dtype name)."""
    out = tensor.to(getattr(torch, dtype)) if str(tensor.dtype) != f"torch.{dtype}" else tensor
    flat = out.contiguous().reshape(-1).view(torch.uint8)
    return memoryview(flat.numpy())  # type: ignore[arg-type]
