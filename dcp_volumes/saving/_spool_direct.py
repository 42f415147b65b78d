"""``O_DIRECT`` for the disk spool: opening a spool file for direct I/O, the alignment its
offsets and lengths need, aligned reads into reused buffers (:class:`ReadBuffers`), and
releasing the aligned write buffer.

:class:`~dcp_volumes.saving._spool_disk.DiskFile` gathers bytes in one page-aligned buffer
(:data:`DIRECT_BUFFER`, an anonymous ``mmap``) and writes it out whole; where the filesystem
refuses ``O_DIRECT`` (at open, or at the first write) the file goes through the page cache.
"""

from __future__ import annotations

import logging
import mmap
import os
import threading

__all__ = ["ALIGN", "DIRECT_BUFFER", "READ_BUFFERS", "ReadBuffers", "aligned", "open_direct",
           "read_direct", "release_buffer"]

logger = logging.getLogger(__name__)

#: alignment of O_DIRECT offsets, lengths and buffer addresses (the largest logical block
#: size in use; mmap'd buffers are page-aligned)
ALIGN = 4096
#: bytes gathered before each O_DIRECT write
DIRECT_BUFFER = 8 << 20


def aligned(n: int) -> int:
    """``n`` rounded up to :data:`ALIGN`."""
    return -(-n // ALIGN) * ALIGN


def open_direct(path: str) -> tuple[int, int] | None:
    """``(write fd, read fd)`` of ``path`` opened with ``O_DIRECT``; ``None`` where the
    platform has no ``O_DIRECT`` or the filesystem refuses it (tmpfs)."""
    flag = getattr(os, "O_DIRECT", 0)
    if not flag:
        return None
    try:
        wfd = os.open(path, os.O_WRONLY | flag)
    except OSError:
        return None
    try:
        rfd = os.open(path, os.O_RDONLY | flag)
    except OSError:
        os.close(wfd)
        return None
    return wfd, rfd


def read_direct(fd: int, offset: int, length: int, buf: mmap.mmap) -> int:
    """Read up to ``length`` bytes at ``offset`` of ``fd`` into ``buf`` (page-aligned, at
    least ``aligned(length)`` long; ``offset`` aligned for an ``O_DIRECT`` ``fd``); returns
    how many were read."""
    done = 0
    with memoryview(buf) as view:
        while done < length:
            n = os.preadv(fd, [view[done:aligned(length)]], offset + done)
            if n <= 0:
                break
            done += n
    return min(done, length)


class ReadBuffers:
    """Page-aligned buffers that parts are read back into, reused from part to part.

    A fresh buffer per part costs a page fault and the kernel's zeroing for every page of it
    (a part's size of both per part read back); a reused one costs neither. A buffer is
    taken back only once nothing views it any more (an ``mmap`` with a view alive refuses
    to resize: then it is left to the garbage collector, which frees it with its last view),
    so a request body that a client still holds is never overwritten. At most ``keep_bytes``
    are kept, and none once no spool file is open (:meth:`open` / :meth:`close`).
    """

    def __init__(self, keep_bytes: int = 64 << 20) -> None:
        self.keep_bytes = keep_bytes
        self._lock = threading.Lock()
        self._free: list[mmap.mmap] = []
        self._users = 0
        self.reused = 0  # buffers handed out again (for tests and profiles)

    def open(self) -> None:
        """A spool file that reads parts back opened."""
        with self._lock:
            self._users += 1

    def close(self) -> None:
        """One closed; the last one frees what is kept."""
        with self._lock:
            self._users = max(0, self._users - 1)
            free, self._free = (self._free, []) if self._users == 0 else ([], self._free)
        for buf in free:
            release_buffer(buf)

    def take(self, length: int) -> mmap.mmap:
        """A page-aligned buffer of at least ``aligned(length)`` bytes."""
        size = aligned(max(length, 1))
        with self._lock:
            for i, buf in enumerate(self._free):
                if len(buf) == size:
                    self.reused += 1
                    return self._free.pop(i)
        return mmap.mmap(-1, size)

    def give(self, view: memoryview) -> None:
        """Take back the buffer under ``view`` (a view of a buffer :meth:`take` gave), once
        nothing views it any more."""
        buf = view.obj
        try:
            view.release()
            if not isinstance(buf, mmap.mmap):
                return
            buf.resize(len(buf))  # BufferError while any other view is alive
        except (BufferError, OSError, ValueError):
            return
        with self._lock:
            if self._users and (len(self._free) + 1) * len(buf) <= self.keep_bytes:
                self._free.append(buf)
                return
        release_buffer(buf)


#: the process's read-back buffers (spool files of every save share them)
READ_BUFFERS = ReadBuffers()


def release_buffer(buf: mmap.mmap) -> None:
    """Close the aligned buffer; never raises.

    A failed write leaves a slice of the buffer alive in its traceback (the error a caller
    keeps to report), and an ``mmap`` with views alive refuses to close (``BufferError``):
    then the buffer is left to the garbage collector, which frees it with its last view.
    """
    try:
        buf.close()
    except BufferError:
        logger.debug("spool buffer still viewed by an error's traceback: freed with it")
