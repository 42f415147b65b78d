"""The byte streams torch_checkpointing's ``Storage`` hands out, over the package's stacks.

- :class:`UploadStream`: a write stream into one new object through the save path's
  :class:`~dcp_volumes.saving.Uploader` (adaptive concurrency, the backend's sink,
  multipart on S3, abort on failure); its parts are the blocks of the file's manifest
  entry (a CRC32C each).
- :class:`CheckedReader`: a seekable read stream of one committed file through the load
  path's serve path (:func:`dcp_volumes.loading.serve.serve` over a
  :class:`~dcp_volumes.loading.sources.StoreSource`): whole blocks, fetched with
  concurrent ranged GETs, each checked against its CRC32C before a byte is returned; the
  last blocks read are kept for the next small read.
"""

from __future__ import annotations

import io
import threading
from collections.abc import Callable
from types import TracebackType
from typing import Any

import crc32c

from dcp_volumes._crc import crc32c_extend
from dcp_volumes._manifest import FileEntry, ItemEntry
from dcp_volumes.backends import Backend, CallStats
from dcp_volumes.backends.sink import Part
from dcp_volumes.integrations._tc_checkpoint import file_entry
from dcp_volumes.loading.needs import Need, plan_ranges
from dcp_volumes.loading.serve import serve
from dcp_volumes.loading.sources import StoreSource
from dcp_volumes.saving import PartStream, SpooledPart, Uploader

__all__ = ["CheckedReader", "UploadStream"]


class UploadStream(io.RawIOBase):
    """A write stream into the new object ``key``, at most ``parts_in_flight`` parts held in
    memory; durable when ``close`` returns (then ``done`` gets its manifest entry), aborted
    on error."""

    def __init__(self, backend: Backend, key: str, *, part_size: int, parts_in_flight: int,
                 done: Callable[[FileEntry], None]) -> None:
        self._part_size, self._done = part_size, done
        self._uploader = Uploader(backend, part_size=part_size, max_concurrency=parts_in_flight,
                                  stats=CallStats())
        self._parts = PartStream()
        self._slots = threading.BoundedSemaphore(parts_in_flight)
        self._uploader.upload(key, self._parts)
        self._buf, self._offset, self._number, self._finished = bytearray(), 0, 0, False
        self._crc, self._crcs = 0, list[int]()

    def writable(self) -> bool:
        return True

    def write(self, data: Any) -> int:
        view = memoryview(data).cast("B")
        self._buf += view
        while len(self._buf) > self._part_size:  # the last part is sent by close
            chunk = self._buf[:self._part_size]
            del self._buf[:self._part_size]
            self._send(chunk, final=False)
        return len(view)

    def _send(self, chunk: bytearray, *, final: bool) -> None:
        self._number += 1
        crc = crc32c.crc32c(chunk)
        if chunk:
            self._crc = crc32c_extend(self._crc, crc, len(chunk))
            self._crcs.append(crc)
        part = Part(self._number, self._offset, len(chunk), final, crc)
        self._offset += len(chunk)
        self._slots.acquire()  # released when the part is uploaded, or dropped on failure
        self._parts.put(SpooledPart(part, buffer=chunk, release=self._slots.release))

    def close(self) -> None:
        if not self._finished and not self.closed:
            self._finished = True
            try:
                self._send(self._buf, final=True)
                self._parts.end()
                self._uploader.wait()
            except BaseException:
                self._uploader.abort()
                raise
            self._done(file_entry(self._offset, self._crc, self._part_size, self._crcs))
        super().close()

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        if exc_type is not None and not self._finished:
            self._finished = True
            self._uploader.abort()
        super().__exit__(exc_type, exc, tb)


class _Bytes:
    """The serve path's target for one span: its checked bytes."""

    data = memoryview(b"")

    def apply(self, span: Any, chunk: memoryview, into: Any) -> None:
        self.data = chunk


class CheckedReader(io.RawIOBase):
    """A seekable read stream of the object ``key`` (``item``: its manifest entry, one item
    of raw bytes in CRC-checked blocks) from ``source``."""

    def __init__(self, source: StoreSource, key: str, item: ItemEntry) -> None:
        self._source, self._key, self._item, self._pos = source, key, item, 0
        self._cached, self._cached_at = memoryview(b""), 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self._pos, io.SEEK_END: self._item.length}[whence]
        self._pos = max(0, base + offset)
        return self._pos

    def read_range(self, start: int, end: int) -> memoryview:
        """Bytes ``[start, end)`` of the object (whole blocks fetched and checked)."""
        end = min(end, self._item.length)
        if end <= start:
            return memoryview(b"")
        cached_end = self._cached_at + len(self._cached)
        if not self._cached_at <= start or end > cached_end:
            bs = self._item.block_size
            first, last = start // bs, -(-end // bs)
            lo, hi = first * bs, min(last * bs, self._item.length)
            need = Need(self._key, lo, hi, 0, self._item.length, [], self._item, first, hi - lo)
            got = _Bytes()
            serve(self._source, plan_ranges([need], gap=0, max_size=hi - lo), got,
                  url=self._source.url, last=True)
            self._cached, self._cached_at = got.data, lo
        return self._cached[start - self._cached_at:end - self._cached_at]

    def readall(self) -> bytes:
        data = bytes(self.read_range(self._pos, self._item.length))
        self._pos += len(data)
        return data

    def readinto(self, buffer: Any) -> int:
        # The views are released even when a read fails: a caller's mmap behind ``buffer``
        # cannot be closed while a view of it is alive (in a traceback's frame, say).
        with memoryview(buffer) as raw, raw.cast("B") as view:
            data = self.read_range(self._pos, self._pos + len(view))
            view[:len(data)] = data
        self._pos += len(data)
        return len(data)
