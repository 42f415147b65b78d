"""The file behind a disk spool: appended to while a shard serializes, read back part by
part while it uploads.

With ``direct=True`` the file is written and read with ``O_DIRECT``
(:mod:`dcp_volumes.saving._spool_direct`), bypassing the page cache: a spool file is read once
and deleted, so caching it only costs CPU (about 2 CPU-s per GiB through ext4's cache on a
small VM, against 0.3 direct). Bytes then gather in one aligned buffer and only what was
written out (:attr:`DiskFile.flushed`) may be read back; where the filesystem refuses
``O_DIRECT`` (tmpfs: at open, or at the first write) the file goes through the page cache.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import mmap
import os

from dcp_volumes.errors import SpoolError
from dcp_volumes.saving._spool_direct import (
    ALIGN,
    DIRECT_BUFFER,
    READ_BUFFERS,
    aligned,
    open_direct,
    read_direct,
    release_buffer,
)

__all__ = ["DiskFile"]

logger = logging.getLogger(__name__)


class DiskFile:
    """One spool file on disk. Not thread-safe for writes (one writer thread); reads of
    flushed bytes may come from any thread."""

    def __init__(self, path: str, *, direct: bool) -> None:
        self.path = path
        self.flushed = 0  # bytes in the file (readable back)
        self._read_fd = -1  # O_DIRECT reads of aligned parts
        self._cached_fd = -1  # cached reads of parts at unaligned offsets
        # O_DIRECT: bytes gather here until written out whole
        self._direct: mmap.mmap | None = None
        self._direct_len = 0
        self._buffers = READ_BUFFERS
        self._buffers.open()
        self._holds_buffers = True
        try:
            self._fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
        except OSError as exc:
            raise SpoolError(
                f"cannot create spool file in {os.path.dirname(path)!r} ({exc.strerror}): set "
                "SpoolOptions(directory=...) to a writable local directory"
            ) from exc
        if direct:
            self._open_direct()

    def _open_direct(self) -> None:
        """Switch to O_DIRECT where the filesystem takes it (not tmpfs); else stay cached."""
        fds = open_direct(self.path)
        if fds is None:
            return
        os.close(self._fd)
        self._fd, self._read_fd = fds
        self._cached_fd = os.open(self.path, os.O_RDONLY)
        self._direct = mmap.mmap(-1, DIRECT_BUFFER)

    @property
    def direct(self) -> bool:
        """Whether the file is written with ``O_DIRECT`` (now)."""
        return self._direct is not None

    # ---- writing ---------------------------------------------------------------------------
    def append(self, mv: memoryview) -> None:
        """Append ``mv``; with O_DIRECT it may wait in the aligned buffer (not flushed)."""
        if self._direct is None:
            self._write_all(mv)
            self.flushed += len(mv)
            return
        i = 0
        while i < len(mv):
            take = min(len(mv) - i, DIRECT_BUFFER - self._direct_len)
            self._direct[self._direct_len:self._direct_len + take] = mv[i:i + take]
            self._direct_len += take
            i += take
            if self._direct_len == DIRECT_BUFFER:
                self._flush_direct()
                if self._direct is None:  # refused: the rest goes through the cache
                    self._write_all(mv[i:])
                    self.flushed += len(mv) - i
                    return

    def finish(self, size: int) -> None:
        """Write out what the aligned buffer holds and cut the file at ``size`` bytes."""
        if self._direct is None:
            return
        if self._direct_len:
            self._flush_direct()
        try:
            os.ftruncate(self._fd, size)  # drop the last write's padding
        except OSError as exc:
            raise SpoolError(
                f"truncating spool file {self.path!r} failed ({exc.strerror})") from exc
        self.flushed = size

    def _write_all(self, mv: memoryview) -> None:
        written = 0
        while written < len(mv):
            try:
                written += os.write(self._fd, mv[written:])
            except OSError as exc:
                raise SpoolError(
                    f"writing spool file {self.path!r} failed ({exc.strerror}): free space or "
                    "point SpoolOptions(directory=...) elsewhere"
                ) from exc

    def _flush_direct(self) -> None:
        """Write the aligned buffer out (its tail padded to the alignment; :meth:`finish`
        truncates the padding off)."""
        assert self._direct is not None
        n = self._direct_len
        padded = aligned(n)
        if padded > n:
            self._direct[n:padded] = bytes(padded - n)
        refused = False
        with memoryview(self._direct) as view:
            if self.flushed == 0:
                try:
                    written = os.write(self._fd, view[:padded])
                except OSError as exc:
                    if exc.errno != errno.EINVAL:
                        raise SpoolError(
                            f"writing spool file {self.path!r} failed ({exc.strerror}): free "
                            "space or point SpoolOptions(directory=...) elsewhere") from exc
                    refused = True
                else:
                    if written < padded:
                        self._write_all(view[written:padded])
            else:
                self._write_all(view[:padded])
        if refused:
            # The filesystem took the O_DIRECT open but refuses the write: go on through the
            # page cache, from the start of the file.
            self._drop_direct(self._direct[:n])
            return
        self.flushed += n
        self._direct_len = 0

    def _drop_direct(self, pending: bytes) -> None:
        """Switch this file to cached I/O with ``pending`` (the file's first bytes) written."""
        assert self._direct is not None
        for fd in (self._fd, self._read_fd):
            os.close(fd)
        self._read_fd = -1
        try:
            self._fd = os.open(self.path, os.O_RDWR)
        except OSError as exc:
            self._fd = -1
            raise SpoolError(f"cannot reopen spool file {self.path!r} ({exc.strerror})") from exc
        release_buffer(self._direct)
        self._direct = None
        self._direct_len = 0
        self._write_all(memoryview(pending))
        self.flushed = len(pending)
        logger.info("spool directory of %s refuses O_DIRECT writes: writing through the "
                    "page cache", self.path)

    # ---- reading back ------------------------------------------------------------------
    def read(self, offset: int, length: int) -> memoryview:
        """A view of the ``length`` bytes at ``offset`` (flushed bytes only), in a buffer of
        the process's read-back pool: hand the view to :meth:`recycle` once done with it."""
        buf = self._buffers.take(length)
        n: int | None = None
        if self._read_fd >= 0 and offset % ALIGN == 0:
            try:
                n = read_direct(self._read_fd, offset, length, buf)
            except OSError as exc:
                if exc.errno != errno.EINVAL:
                    raise
        if n is None:
            # Cached reads see what O_DIRECT wrote (the kernel keeps the two coherent).
            fd = self._fd if self._cached_fd < 0 else self._cached_fd
            with memoryview(buf) as view:
                n = os.preadv(fd, [view[:length]], offset)
        if n != length:
            release_buffer(buf)
            raise SpoolError(f"spool file {self.path!r} is shorter than expected")
        return memoryview(buf)[:length]

    def recycle(self, view: memoryview) -> None:
        """Give back a view :meth:`read` returned (its buffer is reused once unviewed)."""
        self._buffers.give(view)

    # ---- the end -------------------------------------------------------------------------
    def discard(self) -> None:
        """Unlink the file first, then close what it holds (idempotent); never raises."""
        if self._holds_buffers:
            self._holds_buffers = False
            self._buffers.close()
        try:
            os.unlink(self.path)
        except FileNotFoundError:
            pass
        except OSError as exc:
            logger.warning("could not remove spool file %s (%s)", self.path, exc.strerror)
        for fd in (self._fd, self._read_fd, self._cached_fd):
            if fd >= 0:
                with contextlib.suppress(OSError):
                    os.close(fd)
        self._fd = self._read_fd = self._cached_fd = -1
        if self._direct is not None:
            direct, self._direct = self._direct, None
            release_buffer(direct)
