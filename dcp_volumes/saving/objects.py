"""New objects written as streams: a writable file object per object, uploading as it is
written through the save path's :class:`~dcp_volumes.saving.Uploader`.

:class:`ObjectUploads` is one Uploader (adaptive parts in flight, the backend's sink:
multipart on S3, abort and cleanup) for any number of objects, with at most
``max_concurrency + 1`` parts held in memory (those in flight, and one being filled);
:meth:`ObjectUploads.open` gives an :class:`ObjectWriter` for each: the spool's memory mode
(:class:`~dcp_volumes.saving.SpoolFile`), so a part goes out as soon as it is complete, with
its CRC32C. :func:`write_object` is the one-object case: durable when the stream closes,
aborted when it fails. The export streams its files through them; so does the
torch_checkpointing Storage.
"""

from __future__ import annotations

import io
import threading
from collections.abc import Callable
from types import TracebackType
from typing import Any

from dcp_volumes._crc import crc32c_extend
from dcp_volumes._manifest import FileEntry, ItemEntry
from dcp_volumes.backends import Backend, CallStats
from dcp_volumes.saving._parts import PartStream, SpooledPart
from dcp_volumes.saving._spool import SpoolFile
from dcp_volumes.saving._upload import Uploader

__all__ = ["ObjectUploads", "ObjectWriter", "write_object"]


class _CrcParts(PartStream):
    """A part stream that remembers each part's length and CRC32C as it goes out."""

    def __init__(self) -> None:
        super().__init__()
        self.sizes: list[tuple[int, int]] = []  # (length, crc32c) of each non-empty part

    def put(self, part: SpooledPart) -> None:
        super().put(part)
        if part.part.length:
            self.sizes.append((part.part.length, part.part.crc))


class ObjectUploads:
    """Objects streamed into the store through one :class:`Uploader` (see the module).

    Args:
        backend: the store (objects are named relative to its root).
        part_size: bytes per part (the last one of an object may be shorter).
        max_concurrency: parts in flight, at most (the adaptive limit's ceiling).
        stats: where the requests are counted.
        adaptive: follow the store's round trip and throttling below ``max_concurrency``.
    """

    def __init__(self, backend: Backend, *, part_size: int, max_concurrency: int,
                 stats: CallStats, adaptive: bool = True) -> None:
        self.uploader = Uploader(backend, part_size=part_size, max_concurrency=max_concurrency,
                                 stats=stats, adaptive=adaptive)
        # parts held in memory: the ones in flight, and one being filled
        self._slots = threading.Semaphore(max_concurrency + 1)
        self._writers: list[ObjectWriter] = []

    def open(self, key: str, *, expected_size: int = 0) -> ObjectWriter:
        """A writable stream of the new object ``key`` (``expected_size``: its bytes, if
        known); its parts upload as they complete. Durable once :meth:`wait` returns."""
        writer = ObjectWriter(self, key, expected_size=expected_size)
        self._writers.append(writer)
        return writer

    def wait(self) -> None:
        """Once every object is written and closed: block until all are durable; raise the
        first failure."""
        self.uploader.wait()

    def abort(self) -> None:
        """Stop what is pending and remove what was uploaded (best effort)."""
        self.uploader.abort()

    def fail(self, exc: BaseException) -> None:
        """Stop what is pending with ``exc``, removing nothing."""
        self.uploader.fail(exc)

    def discard(self) -> None:
        """Free every part buffer still held (idempotent; never raises)."""
        for writer in self._writers:
            writer.discard()


class ObjectWriter(io.RawIOBase):
    """A writable stream of one new object of an :class:`ObjectUploads` (one writer
    thread). :meth:`close` hands out its last part; the object is durable once its
    uploads' :meth:`~ObjectUploads.wait` returns."""

    def __init__(self, uploads: ObjectUploads, key: str, *, expected_size: int = 0) -> None:
        self._uploads = uploads
        self._parts = _CrcParts()
        self._spool = SpoolFile(key, mode="memory", directory="",
                                part_size=uploads.uploader.part_size,
                                buffer_slots=uploads._slots, parts=self._parts)
        uploads.uploader.upload(key, self._parts, expected_size=expected_size)

    def writable(self) -> bool:
        return True

    def write(self, data: Any) -> int:
        return self._spool.write(data)

    def tell(self) -> int:
        return self._spool.tell()

    def close(self) -> None:
        if not self.closed:
            try:
                self._spool.close()
            finally:
                super().close()

    def discard(self) -> None:
        """Drop the object: its buffers freed, nothing more handed out (its uploads'
        :meth:`~ObjectUploads.abort` removes what went)."""
        self._spool.discard()
        super().close()

    @property
    def entry(self) -> FileEntry:
        """The object's manifest entry (after :meth:`close`): one item of raw bytes whose
        blocks are its parts, a CRC32C each, so any run of whole parts is checked alone."""
        crc = 0
        for length, part_crc in self._parts.sizes:
            crc = crc32c_extend(crc, part_crc, length)
        size = self.tell()
        item = ItemEntry(size, crc, data_offset=0, block_size=self._uploads.uploader.part_size,
                         block_crcs=tuple(c for _, c in self._parts.sizes), shape=(size,),
                         dtype="uint8")
        return FileEntry(size=size, items={0: item})


class _DurableWriter(ObjectWriter):
    """:func:`write_object`'s stream: durable when :meth:`close` returns."""

    def __init__(self, uploads: ObjectUploads, key: str,
                 done: Callable[[FileEntry], None] | None) -> None:
        super().__init__(uploads, key)
        self._done = done

    def close(self) -> None:
        if self.closed:
            return
        try:
            super().close()
            self._uploads.wait()
        except BaseException:
            self._uploads.abort()
            raise
        if self._done is not None:
            self._done(self.entry)

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        if exc_type is not None and not self.closed:
            self._uploads.abort()
            self.discard()
        super().__exit__(exc_type, exc, tb)


def write_object(backend: Backend, key: str, *, part_size: int, max_concurrency: int,
                 done: Callable[[FileEntry], None] | None = None,
                 stats: CallStats | None = None) -> ObjectWriter:
    """A writable stream of the new object ``key``, durable when ``close`` returns (then
    ``done`` gets its :attr:`~ObjectWriter.entry`: its size and CRC32Cs); a stream left by
    an exception (``with``) or whose upload fails is aborted: nothing of it stays."""
    uploads = ObjectUploads(backend, part_size=part_size, max_concurrency=max_concurrency,
                            stats=stats or CallStats())
    writer = _DurableWriter(uploads, key, done)
    uploads._writers.append(writer)
    return writer
