"""The local spool: where a rank serializes one shard file before (and while) it uploads.

A :class:`SpoolFile` is the file-like object ``torch.save`` writes into. It computes a
CRC32C per item as bytes pass through (:mod:`~dcp_volumes.saving._checksums`) and puts
*parts* (``part_size`` bytes) into its :attr:`SpoolFile.parts` stream as soon as they are
complete, so a file uploads while it is still being written. It knows nothing of who
takes them.

- ``disk`` mode appends to a file in the spool directory
  (:class:`~dcp_volumes.saving._spool_disk.DiskFile`, ``O_DIRECT`` with ``direct=True``) and
  never waits for the network; each part's bytes are read back from the file when it uploads.
- ``memory`` mode fills part-sized buffers; a semaphore shared with the other files of the
  save caps the buffers alive at once, so serialization waits for uploads instead of growing
  RAM.

A part is only handed out once at least one more byte follows it, so the last part of a
non-empty file is never empty and is marked ``final``.
"""

from __future__ import annotations

import os
import threading

from dcp_volumes.backends.sink import Part
from dcp_volumes.saving._checksums import DataLayout, FileChecksums
from dcp_volumes.saving._parts import PartStream, SpooledPart
from dcp_volumes.saving._spool_dir import spool_file_name
from dcp_volumes.saving._spool_disk import DiskFile

__all__ = ["DataLayout", "SpoolFile"]


class SpoolFile:
    """A shard file being serialized. Not thread-safe: one writer thread.

    Args:
        name: the file's name in the store (relative to the checkpoint).
        mode: ``"disk"`` or ``"memory"``.
        directory: the spool directory (disk mode).
        part_size: bytes per part (the last part may be shorter).
        buffer_slots: memory mode: the part buffers alive at once, shared by the save's files.
        direct: disk mode: write and read the file with ``O_DIRECT`` where possible.
        parts: the stream to put the parts into (a new one by default).
    """

    def __init__(self, name: str, *, mode: str, directory: str, part_size: int,
                 buffer_slots: threading.Semaphore | None = None, direct: bool = False,
                 parts: PartStream | None = None) -> None:
        self.name = name
        self.mode = mode
        self.part_size = part_size
        #: the file's parts, in order, as they complete; ended by :meth:`close`
        self.parts = parts if parts is not None else PartStream()
        self._sums = FileChecksums(part_size)
        self._slots = buffer_slots
        self._pos = 0
        self._emitted = 0  # bytes handed out as parts
        self._next_part = 1
        self._closed = False
        self.path: str | None = None
        self._disk: DiskFile | None = None
        self._buf: bytearray | None = None
        self._buf_len = 0
        self._buf_release: threading.Semaphore | None = None
        if mode == "disk":
            os.makedirs(directory, exist_ok=True)
            self.path = os.path.join(directory, spool_file_name(name))
            self._disk = DiskFile(self.path, direct=direct)

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
        self._sums.add(mv, self._pos)
        if self._disk is not None:
            self._write_disk(self._disk, mv)
        else:
            self._write_memory(mv)
        self._pos += n
        return n

    # ---- items ---------------------------------------------------------------------------
    def begin_item(self, *, data_bytes: int = 0, block_size: int = 0) -> None:
        """Start an item. With ``data_bytes``, the one write of exactly that many bytes
        (torch.save writes a tensor's storage in one call) is located and checksummed per
        ``block_size`` block, so a reader can later fetch and verify only part of it."""
        self._sums.begin_item(self._pos, data_bytes=data_bytes, block_size=block_size)

    def end_item(self) -> tuple[int, int, int, DataLayout | None]:
        """(offset, length, crc32c, data layout or None) of the item since :meth:`begin_item`."""
        return self._sums.end_item(self._pos)

    # ---- parts ---------------------------------------------------------------------------
    def _write_disk(self, disk: DiskFile, mv: memoryview) -> None:
        end = self._pos + len(mv)
        disk.append(mv)
        # A part goes out once its bytes are in the file and at least one more byte follows.
        while end - self._emitted > self.part_size and \
                disk.flushed - self._emitted >= self.part_size:
            self._hand_out(self.part_size, final=False)

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
                self.parts.check()  # an upload failed for good: stop waiting for a slot
            self._buf_release = self._slots
        self._buf = bytearray(self.part_size)
        self._buf_len = 0

    def _hand_out(self, length: int, *, final: bool) -> None:
        self.parts.check()
        part = Part(self._next_part, self._emitted, length, final,
                    self._sums.part_crc(self._next_part - 1))
        spooled = SpooledPart(part)
        if self._disk is not None:
            spooled.reader = self._disk.read
            spooled.recycle = self._disk.recycle
        else:
            assert self._buf is not None
            spooled.buffer = (self._buf if length == len(self._buf)
                              else memoryview(self._buf)[:length])
            if self._buf_release is not None:
                spooled.release = self._buf_release.release
            self._buf, self._buf_len, self._buf_release = None, 0, None
        self._next_part += 1
        self._emitted += length
        self.parts.put(spooled)

    def close(self) -> int:
        """Hand out the final part and end :attr:`parts`; returns the file's size."""
        if not self._closed:
            self._closed = True
            if self._disk is not None:
                self._disk.finish(self._pos)
                while self._pos - self._emitted > self.part_size:
                    self._hand_out(self.part_size, final=False)
            remaining = self._pos - self._emitted
            if remaining > 0 or self._next_part == 1:
                if self._disk is None and self._buf is None:
                    self._buf, self._buf_len = bytearray(0), 0
                self._hand_out(remaining, final=True)
            self.parts.end()
        return self._pos

    @property
    def parts_handed_out(self) -> int:
        return self._next_part - 1

    @property
    def direct_io(self) -> bool:
        """Whether the file is written with ``O_DIRECT`` (now: a refused write switches it
        to the page cache)."""
        return self._disk is not None and self._disk.direct

    def discard(self) -> None:
        """Free everything this file holds locally (idempotent); never raises. The file is
        unlinked first: whatever else fails (a descriptor that will not close, a buffer a
        failed write's traceback still views), it does not outlive the failed save."""
        if self._disk is not None:
            self._disk.discard()
        if self._buf_release is not None:
            slots, self._buf_release = self._buf_release, None
            slots.release()
        self._buf = None
