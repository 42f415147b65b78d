"""The CRC32Cs of a spool file, from one read of each byte: per item, per part, and per
block of a tensor's raw bytes.

Each write is cut at part ends (and, inside a tensor's bytes, at block ends); the CRC of
each piece is taken once and the item, part and block CRCs are assembled from the pieces'
CRCs (:func:`~dcp_volumes._crc.crc32c_extend`).
"""

from __future__ import annotations

from dataclasses import dataclass

import crc32c

from dcp_volumes._crc import crc32c_extend

__all__ = ["DataLayout", "FileChecksums"]


@dataclass(frozen=True)
class DataLayout:
    """Where a tensor's raw bytes sit inside its serialized item, with per-block CRC32Cs."""

    data_offset: int
    block_size: int
    block_crcs: list[int]


class FileChecksums:
    """The running CRC32Cs of one spool file (its bytes arrive in order)."""

    def __init__(self, part_size: int) -> None:
        self.part_size = part_size
        self._item_start = 0
        self._item_crc = 0
        self._data_bytes = 0
        self._block_size = 0
        self._data_off: int | None = None
        self._block_crcs: list[int] = []
        self._part_crcs: list[int] = []  # CRC32C of each full part, in order
        self._part_crc = 0  # of the bytes after the last full part

    def begin_item(self, pos: int, *, data_bytes: int = 0, block_size: int = 0) -> None:
        """An item starts at file offset ``pos``; with ``data_bytes``, its one write of exactly
        that many bytes is its tensor data, checksummed per ``block_size`` block."""
        self._item_start = pos
        self._item_crc = 0
        self._data_bytes = data_bytes
        self._block_size = block_size
        self._data_off = None
        self._block_crcs = []

    def end_item(self, pos: int) -> tuple[int, int, int, DataLayout | None]:
        """(offset, length, crc32c, data layout or None) of the item ending at ``pos``."""
        layout = None
        if self._data_off is not None:
            layout = DataLayout(self._data_off, self._block_size, self._block_crcs)
        return self._item_start, pos - self._item_start, self._item_crc, layout

    def part_crc(self, index: int) -> int:
        """The CRC32C of part ``index`` (from 0): a full part's, else the bytes since."""
        return self._part_crcs[index] if index < len(self._part_crcs) else self._part_crc

    def add(self, mv: memoryview, pos: int) -> None:
        """Checksum ``mv``, written at file offset ``pos``: one read, in pieces cut at part
        ends (and, for a tensor's bytes, at block ends)."""
        n = len(mv)
        data = bool(self._data_bytes) and n == self._data_bytes and self._data_off is None
        if data:
            # torch.save writes a tensor's storage in one call: checksum it per block so a
            # reader can fetch and verify only part of it.
            self._data_off = pos - self._item_start
            self._block_crcs = []
        bs = self._block_size
        block_crc = block_len = 0
        done = 0
        while done < n:
            take = min(n - done, self.part_size - (pos + done) % self.part_size)
            if data:
                take = min(take, bs - block_len)
            crc = crc32c.crc32c(mv[done:done + take])
            self._item_crc = crc32c_extend(self._item_crc, crc, take)
            self._part_crc = crc32c_extend(self._part_crc, crc, take)
            done += take
            if (pos + done) % self.part_size == 0:
                self._part_crcs.append(self._part_crc)
                self._part_crc = 0
            if data:
                block_crc = crc32c_extend(block_crc, crc, take)
                block_len += take
                if block_len == bs or done == n:
                    self._block_crcs.append(block_crc)
                    block_crc = block_len = 0
