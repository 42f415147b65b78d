"""The local spool: where a rank serializes one shard file before (and while) it uploads.

A :class:`SpoolFile` is the file-like object ``torch.save`` writes into. It computes a
CRC32C per item as bytes pass through and hands out *parts* (``part_size`` bytes) to the
uploader as soon as they are complete, so a file uploads while it is still being written.

- ``disk`` mode appends to a file in the spool directory and never waits for the network;
  the uploader reads each part back with ``pread``. With ``direct=True`` the file is written
  and read with ``O_DIRECT`` (:mod:`dcp_volumes._spool_direct`), bypassing the page cache: a
  spool file is read once and deleted, so caching it only costs CPU (about 2 CPU-s per GiB
  through ext4's cache on a small VM, against 0.3 direct); tmpfs refuses it: cached writes.
- ``memory`` mode fills part-sized buffers; a semaphore shared with the uploader caps the
  buffers alive at once, so serialization waits for uploads instead of growing RAM.

A part is only handed out once at least one more byte follows it, so the last part of a
non-empty file is never empty and is marked ``final``.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import logging
import mmap
import os
import re
import shutil
import socket
import threading
from collections.abc import Callable
from dataclasses import dataclass

import crc32c

from dcp_volumes._crc import crc32c_extend
from dcp_volumes._spool_direct import (
    ALIGN,
    DIRECT_BUFFER,
    aligned,
    open_direct,
    read_direct,
    release_buffer,
)
from dcp_volumes.errors import SpoolError

__all__ = ["DataLayout", "Part", "SpoolFile", "check_free_space"]

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class DataLayout:
    """Where a tensor's raw bytes sit inside its serialized item, with per-block CRC32Cs."""

    data_offset: int
    block_size: int
    block_crcs: list[int]


@dataclass
class Part:
    """One contiguous piece of a shard file, numbered from 1."""

    number: int
    offset: int
    length: int
    final: bool
    crc: int  # CRC32C of the part's bytes, taken while they were spooled
    buffer: bytearray | None = None  # memory mode only
    release: Callable[[], None] | None = None

    def done(self) -> None:
        """Free the part's buffer slot (memory mode); safe to call twice."""
        self.buffer = None
        if self.release is not None:
            release, self.release = self.release, None
            release()


def check_free_space(directory: str, needed: int, margin: float) -> None:
    """Raise :class:`SpoolError` unless ``directory`` can hold ``needed × margin`` bytes."""
    try:
        os.makedirs(directory, exist_ok=True)
        read_only = bool(os.statvfs(directory).f_flag & os.ST_RDONLY)
        free = shutil.disk_usage(directory).free
    except OSError as exc:
        raise SpoolError(
            f"spool directory {directory!r} is not usable ({exc.strerror}): set "
            "SpoolOptions(directory=...) or DCP_VOLUMES_SPOOL_DIR to a writable local directory"
        ) from exc
    if read_only or not os.access(directory, os.W_OK):
        why = "on a read-only filesystem" if read_only else "not writable by this process"
        raise SpoolError(
            f"spool directory {directory!r} is {why}: mount it read-write, or set "
            "SpoolOptions(directory=...) or DCP_VOLUMES_SPOOL_DIR to a writable local "
            "directory (or use SpoolOptions(mode='memory'))")
    want = int(needed * margin)
    if free < want:
        raise SpoolError(
            f"spool directory {directory!r} has {free / 2**30:.2f} GiB free but this rank needs "
            f"{want / 2**30:.2f} GiB: free space there, point SpoolOptions(directory=...) or "
            "DCP_VOLUMES_SPOOL_DIR at a larger disk, or use SpoolOptions(mode='memory')"
        )


def _host_tag() -> str:
    """A short tag of this host: spool directories may be shared (NFS), pids are not."""
    return hashlib.sha1(socket.gethostname().encode()).hexdigest()[:8]


def spool_file_name(shard: str) -> str:
    """``dcpv-<host>-<pid>-<shard>``: whose file it is, so a later save can tell it is dead.

    Only the shard's file name counts: a hashed layout's prefix directory (``3f/``) is a
    store-side matter, and the spool directory stays flat."""
    return f"dcpv-{_host_tag()}-{os.getpid()}-{shard.rsplit('/', 1)[-1]}"


_SPOOL_NAME_RE = re.compile(
    r"^dcpv-([0-9a-f]{8})-(\d+)-__\d+_\d+-[0-9a-f]{8}-[0-9a-f]{12}\.distcp$")


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # someone else's live process
    return True


def remove_dead_spools(directory: str) -> int:
    """Remove spool files that killed processes of this host left in ``directory``.

    Only regular files (never links) whose name is exactly a spool file's, made on this
    host by a process that no longer exists, are removed. Returns how many were.
    """
    host, removed = _host_tag(), 0
    try:
        entries = list(os.scandir(directory))
    except OSError:
        return 0
    for entry in entries:
        m = _SPOOL_NAME_RE.match(entry.name)
        if m is None or m.group(1) != host or int(m.group(2)) == os.getpid():
            continue
        try:
            if not entry.is_file(follow_symlinks=False) or _pid_alive(int(m.group(2))):
                continue
            os.unlink(entry.path)
            removed += 1
        except OSError:
            continue  # gone meanwhile, or not ours to remove
    if removed:
        logger.warning("removed %d spool files that killed saves left in %s", removed, directory)
    return removed


class SpoolFile:
    """A shard file being serialized. Not thread-safe: one writer thread."""

    def __init__(
        self,
        name: str,
        *,
        mode: str,
        directory: str,
        part_size: int,
        emit: Callable[[Part], None],
        buffer_slots: threading.Semaphore | None = None,
        should_stop: Callable[[], None] | None = None,
        direct: bool = False,
    ) -> None:
        self.name = name
        self.mode = mode
        self.part_size = part_size
        self._emit = emit
        self._slots = buffer_slots
        self._should_stop = should_stop
        self._pos = 0
        self._emitted = 0  # bytes handed out as parts
        self._next_part = 1
        self._item_start = 0
        self._item_crc = 0
        self._data_bytes = 0
        self._block_size = 0
        self._data_off: int | None = None
        self._block_crcs: list[int] = []
        self._part_crcs: list[int] = []  # CRC32C of each full part, in order
        self._part_crc = 0  # of the bytes after the last full part
        self._closed = False
        self.path: str | None = None
        self._fd = -1
        self._buf: bytearray | None = None
        self._buf_len = 0
        self._buf_release: Callable[[], None] | None = None
        # O_DIRECT: bytes gather in an aligned buffer; only what was written out (flushed)
        # may be handed out as parts. Without it every written byte is in the file.
        self._direct: mmap.mmap | None = None
        self._direct_len = 0
        self._flushed = 0
        self._read_fd = -1  # O_DIRECT reads of aligned parts
        self._cached_fd = -1  # cached reads of parts at unaligned offsets
        if mode == "disk":
            os.makedirs(directory, exist_ok=True)
            self.path = os.path.join(directory, spool_file_name(name))
            try:
                self._fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
            except OSError as exc:
                raise SpoolError(
                    f"cannot create spool file in {directory!r} ({exc.strerror}): set "
                    "SpoolOptions(directory=...) to a writable local directory"
                ) from exc
            if direct:
                self._open_direct()

    def _open_direct(self) -> None:
        """Switch to O_DIRECT where the filesystem takes it (not tmpfs); else stay cached."""
        assert self.path is not None
        fds = open_direct(self.path)
        if fds is None:
            return
        os.close(self._fd)
        self._fd, self._read_fd = fds
        self._cached_fd = os.open(self.path, os.O_RDONLY)
        self._direct = mmap.mmap(-1, DIRECT_BUFFER)

    # ---- file-like API used by torch.save -----------------------------------------------
    def writable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return False

    def tell(self) -> int:
        return self._pos

    def flush(self) -> None:
        pass

    def write(self, data: bytes | bytearray | memoryview) -> int:
        mv = memoryview(data).cast("B")
        n = len(mv)
        if n == 0:
            return 0
        self._checksum(mv)
        if self.mode == "disk":
            self._write_disk(mv)
        else:
            self._write_memory(mv)
        self._pos += n
        return n

    def _checksum(self, mv: memoryview) -> None:
        """Read ``mv`` once, in pieces cut at part ends (and, for a tensor's bytes, at block
        ends); the item, part and block CRCs are all assembled from the pieces' CRCs."""
        n = len(mv)
        data = bool(self._data_bytes) and n == self._data_bytes and self._data_off is None
        if data:
            # torch.save writes a tensor's storage in one call: checksum it per block so a
            # reader can fetch and verify only part of it.
            self._data_off = self._pos - self._item_start
            self._block_crcs = []
        bs = self._block_size
        block_crc = block_len = 0
        pos = 0
        while pos < n:
            take = min(n - pos, self.part_size - (self._pos + pos) % self.part_size)
            if data:
                take = min(take, bs - block_len)
            crc = crc32c.crc32c(mv[pos:pos + take])
            self._item_crc = crc32c_extend(self._item_crc, crc, take)
            self._part_crc = crc32c_extend(self._part_crc, crc, take)
            pos += take
            if (self._pos + pos) % self.part_size == 0:
                self._part_crcs.append(self._part_crc)
                self._part_crc = 0
            if data:
                block_crc = crc32c_extend(block_crc, crc, take)
                block_len += take
                if block_len == bs or pos == n:
                    self._block_crcs.append(block_crc)
                    block_crc = block_len = 0

    # ---- items ---------------------------------------------------------------------------
    def begin_item(self, *, data_bytes: int = 0, block_size: int = 0) -> None:
        """Start an item. With ``data_bytes``, the one write of exactly that many bytes
        (torch.save writes a tensor's storage in one call) is located and checksummed per
        ``block_size`` block, so a reader can later fetch and verify only part of it."""
        self._item_start = self._pos
        self._item_crc = 0
        self._data_bytes = data_bytes
        self._block_size = block_size
        self._data_off = None
        self._block_crcs = []

    def end_item(self) -> tuple[int, int, int, DataLayout | None]:
        """(offset, length, crc32c, data layout or None) of the item since :meth:`begin_item`."""
        layout = None
        if self._data_off is not None:
            layout = DataLayout(self._data_off, self._block_size, self._block_crcs)
        return self._item_start, self._pos - self._item_start, self._item_crc, layout

    # ---- parts ---------------------------------------------------------------------------
    def _write_disk(self, mv: memoryview) -> None:
        end = self._pos + len(mv)
        if self._direct is None:
            self._write_all(mv)
            self._flushed = end
        else:
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
                        self._flushed = end
                        break
        # A part goes out once its bytes are in the file and at least one more byte follows.
        while (end - self._emitted > self.part_size
               and self._flushed - self._emitted >= self.part_size):
            self._hand_out(self.part_size, final=False)

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
        """Write the aligned buffer out (its tail padded to the alignment; :meth:`close`
        truncates the padding off)."""
        assert self._direct is not None
        n = self._direct_len
        padded = aligned(n)
        if padded > n:
            self._direct[n:padded] = bytes(padded - n)
        refused = False
        with memoryview(self._direct) as view:
            if self._flushed == 0:
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
        self._flushed += n
        self._direct_len = 0

    def _drop_direct(self, pending: bytes) -> None:
        """Switch this file to cached I/O with ``pending`` (the file's first bytes) written."""
        assert self.path is not None and self._direct is not None
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
        self._flushed = len(pending)
        logger.info("spool directory of %s refuses O_DIRECT writes: writing through the "
                    "page cache", self.path)

    def _write_memory(self, mv: memoryview) -> None:
        i = 0
        while i < len(mv):
            if self._buf is not None and self._buf_len == self.part_size:
                # The buffer is full and more bytes follow, so it is not the last part.
                self._hand_out(self.part_size, final=False)
            if self._buf is None:
                self._new_buffer()
            assert self._buf is not None
            take = min(len(mv) - i, self.part_size - self._buf_len)
            self._buf[self._buf_len:self._buf_len + take] = mv[i:i + take]
            self._buf_len += take
            i += take

    def _new_buffer(self) -> None:
        if self._slots is not None:
            while not self._slots.acquire(timeout=0.5):
                if self._should_stop is not None:
                    self._should_stop()
            self._buf_release = self._slots.release
        self._buf = bytearray(self.part_size)
        self._buf_len = 0

    def _hand_out(self, length: int, *, final: bool) -> None:
        if self._should_stop is not None:
            self._should_stop()
        index = self._next_part - 1
        crc = self._part_crcs[index] if index < len(self._part_crcs) else self._part_crc
        part = Part(self._next_part, self._emitted, length, final, crc)
        if self.mode == "memory":
            assert self._buf is not None
            part.buffer = self._buf if length == len(self._buf) else self._buf[:length]
            part.release = self._buf_release
            self._buf, self._buf_len, self._buf_release = None, 0, None
        self._next_part += 1
        self._emitted += length
        self._emit(part)

    def read(self, part: Part) -> bytes | bytearray:
        """The bytes of ``part`` (called by the uploader, possibly again on retry)."""
        if part.buffer is not None:
            return part.buffer
        if part.length == 0:
            return b""
        data: bytes | None = None
        if self._read_fd >= 0 and part.offset % ALIGN == 0:
            try:
                data = read_direct(self._read_fd, part.offset, part.length)
            except OSError as exc:
                if exc.errno != errno.EINVAL:
                    raise
        if data is None:
            # Cached reads see what O_DIRECT wrote (the kernel keeps the two coherent).
            data = os.pread(self._fd if self._cached_fd < 0 else self._cached_fd,
                            part.length, part.offset)
        if len(data) != part.length:
            raise SpoolError(f"spool file {self.path!r} is shorter than expected")
        return data

    def close(self) -> int:
        """Hand out the final part; returns the file's size."""
        if not self._closed:
            self._closed = True
            if self._direct is not None:
                if self._direct_len:
                    self._flush_direct()
                try:
                    os.ftruncate(self._fd, self._pos)  # drop the last write's padding
                except OSError as exc:
                    raise SpoolError(
                        f"truncating spool file {self.path!r} failed ({exc.strerror})") from exc
                while self._pos - self._emitted > self.part_size:
                    self._hand_out(self.part_size, final=False)
            remaining = self._pos - self._emitted
            if remaining > 0 or self._next_part == 1:
                if self.mode == "memory" and self._buf is None:
                    self._buf, self._buf_len = bytearray(0), 0
                self._hand_out(remaining, final=True)
        return self._pos

    @property
    def parts(self) -> int:
        return self._next_part - 1

    def discard(self) -> None:
        """Free everything this file holds locally (idempotent); never raises. The file is
        unlinked first: whatever else fails (a descriptor that will not close, a buffer a
        failed write's traceback still views), it does not outlive the failed save."""
        if self.path is not None:
            try:
                os.unlink(self.path)
            except FileNotFoundError:
                pass
            except OSError as exc:
                logger.warning("could not remove spool file %s (%s)", self.path, exc.strerror)
        if self._buf_release is not None:
            release, self._buf_release = self._buf_release, None
            release()
        self._buf = None
        for fd in (self._fd, self._read_fd, self._cached_fd):
            if fd >= 0:
                with contextlib.suppress(OSError):
                    os.close(fd)
        self._fd = self._read_fd = self._cached_fd = -1
        if self._direct is not None:
            direct, self._direct = self._direct, None
            release_buffer(direct)
