"""``O_DIRECT`` for the disk spool: opening a spool file for direct I/O, the alignment its
offsets and lengths need, aligned reads, and releasing the aligned write buffer.

:class:`~dcp_volumes.saving._spool_disk.DiskFile` gathers bytes in one page-aligned buffer
(:data:`DIRECT_BUFFER`, an anonymous ``mmap``) and writes it out whole; where the filesystem
refuses ``O_DIRECT`` (at open, or at the first write) the file goes through the page cache.
"""

from __future__ import annotations

import logging
import mmap
import os

__all__ = ["ALIGN", "DIRECT_BUFFER", "aligned", "open_direct", "read_direct", "release_buffer"]

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


def read_direct(fd: int, offset: int, length: int) -> bytes:
    """Up to ``length`` bytes at ``offset`` (aligned) of ``fd``, read with ``O_DIRECT``."""
    with mmap.mmap(-1, aligned(length)) as buf:
        done = 0
        while done < length:
            with memoryview(buf) as view:
                n = os.preadv(fd, [view[done:]], offset + done)
            if n <= 0:
                break
            done += n
        return buf[:min(done, length)]


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
