"""Committed objects read as streams: a seekable file object over one object, its bytes
fetched and checked by the load path.

An :class:`ObjectReader` reads an object stored as one item of raw bytes checked per block
(what :class:`~dcp_volumes.saving.objects.ObjectWriter` records: a CRC32C per part) through
the one serve path (:func:`~dcp_volumes.loading.serve.serve` over a
:class:`~dcp_volumes.loading.sources.StoreSource`): a read fetches the whole blocks it
touches with concurrent ranged GETs, checks each against its CRC32C before a byte is
returned, and keeps the last blocks read for the next small read. :func:`read_object` opens
one from the store.
"""

from __future__ import annotations

import io
from typing import Any

from dcp_volumes._manifest import FileEntry, ItemEntry
from dcp_volumes.backends import Backend, CallStats, redact_url
from dcp_volumes.loading.needs import Need, plan_ranges
from dcp_volumes.loading.serve import serve
from dcp_volumes.loading.sources import StoreSource
from dcp_volumes.transfer.download import Memory

__all__ = ["ObjectReader", "read_object"]


class _Bytes:
    """The serve path's target for one span: its checked bytes."""

    data = memoryview(b"")

    def apply(self, span: Any, chunk: memoryview, into: Memory | None) -> None:
        self.data = chunk


class ObjectReader(io.RawIOBase):
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
            need = Need.part(self._key, lo, hi, item_offset=0, item_length=self._item.length,
                             entry=self._item, first_block=first, needed=hi - lo)
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


def read_object(backend: Backend, key: str, entry: FileEntry, *, max_concurrency: int,
                chunk_size: int) -> ObjectReader:
    """A seekable, CRC-checked read stream of the committed object ``key`` at ``backend``
    (``entry``: its manifest entry, one item; ``max_concurrency`` GETs in flight, a large
    range split in ``chunk_size`` pieces)."""
    source = StoreSource(backend, redact_url(backend.url), max_concurrency=max_concurrency,
                         chunk_size=chunk_size, stats=CallStats(), sizes={key: entry.size})
    return ObjectReader(source, key, entry.items[0])
