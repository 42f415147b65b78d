"""Verify's reads: every item of a checkpoint read back through the reader's serve path
and checked as a load checks it (failures recorded in the file's report, never raised).

Each stored item becomes a :class:`~dcp_volumes.loading.needs.Need`, needs are coalesced into
ranged GETs by ``plan_ranges``, fetched by the store source (``loading.sources.StoreSource``)
and checked by ``check_need``. A large tensor whose manifest records per-block CRC32Cs is read
in pieces of at most ``chunk_size`` bytes (its blocks checked one by one, the bytes around them
folded into the item's CRC32C), so memory stays bounded whatever the tensor's size.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from dcp_volumes import errors
from dcp_volumes.backends import Backend, CallStats, redact_url
from dcp_volumes.catalog._common import Progress
from dcp_volumes.catalog._verify_report import FileReport

if TYPE_CHECKING:
    from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex
    from torch.distributed.checkpoint.planner import ReadItem

    from dcp_volumes._manifest import ItemEntry, Manifest
    from dcp_volumes.loading.needs import Need

__all__ = ["Reads", "fetch_and_check", "reads_of"]


# --------------------------------------------------------------------------------------------
# What verify reads: every item of every file of the right size, as the reader's needs


@dataclass
class _Split:
    """A large tensor item read in pieces: its blocks are checked by ``check_need``, the CRCs
    of the bytes around them (``outer``: piece start -> CRC32C) are folded in afterwards."""

    relative: str
    offset: int
    entry: ItemEntry
    read: ReadItem
    nbytes: int
    outer: dict[int, int] = field(default_factory=dict)


@dataclass
class Reads:
    """What verify reads: every item as the reader's needs, and the large tensors split."""

    needs: list[Need] = field(default_factory=list)
    split: dict[tuple[str, int], _Split] = field(default_factory=dict)


def _item_labels(md: Metadata) -> dict[tuple[str, int], ReadItem]:
    """A ReadItem naming each stored item (its state-dict key), for the checks' messages."""
    return {
        (info.relative_path, info.offset): _label(index) for index, info in md.storage_data.items()
    }


def _label(index: MetadataIndex) -> ReadItem:
    import torch
    from torch.distributed.checkpoint.planner import LoadItemType, ReadItem

    none = torch.Size([])
    return ReadItem(LoadItemType.BYTE_IO, index, none, index, none, none)


def reads_of(md: Metadata, manifest: Manifest, files: dict[str, FileReport],
             chunk_size: int) -> Reads:
    """Every item of every file of the right size, as the reader's needs."""
    from torch.distributed.checkpoint.metadata import MetadataIndex

    labels = _item_labels(md)
    plan = Reads()
    for name, report in sorted(files.items()):
        if not report.ok:
            continue  # missing or resized: reported, not read
        for offset, entry in sorted(manifest.files[name].items.items()):
            read = labels.get((name, offset)) or _label(MetadataIndex("?"))
            nbytes = _data_bytes(entry)
            if nbytes is None or entry.length <= chunk_size:
                plan.needs.append(_whole(name, offset, entry, read))
            else:
                split = _Split(name, offset, entry, read, nbytes)
                plan.split[(name, offset)] = split
                plan.needs.extend(_pieces(split, chunk_size))
    return plan


def _whole(relative: str, offset: int, entry: ItemEntry, read: ReadItem) -> Need:
    from dcp_volumes.loading.needs import Need

    return Need.whole(relative, offset, entry.length, reads=[read], entry=entry)


def _data_bytes(entry: ItemEntry) -> int | None:
    """Size of the raw tensor bytes the manifest checks per block; None if it does not."""
    import torch

    if entry.data_offset is None or entry.block_size <= 0:
        return None
    dtype = getattr(torch, entry.dtype, None)
    if not isinstance(dtype, torch.dtype):
        return None
    nbytes = math.prod(entry.shape) * torch.empty((), dtype=dtype).element_size()
    blocks = -(-nbytes // entry.block_size)
    if nbytes <= 0 or entry.data_offset + nbytes > entry.length or blocks != len(entry.block_crcs):
        return None
    return nbytes


def _pieces(split: _Split, chunk_size: int) -> list[Need]:
    """Bytes before the data, runs of whole blocks of at most ``chunk_size``, bytes after."""
    from dcp_volumes.loading.needs import Need

    s, entry = split, split.entry
    data_start = s.offset + (entry.data_offset or 0)
    data_end = data_start + s.nbytes
    item_end = s.offset + entry.length

    def piece(start: int, end: int, checked: ItemEntry | None, block: int | None) -> Need:
        return Need.part(s.relative, start, end, item_offset=s.offset,
                         item_length=entry.length, reads=[s.read], entry=checked,
                         first_block=block, needed=end - start)

    needs = [piece(s.offset, data_start, None, None)] if data_start > s.offset else []
    step = max(1, chunk_size // entry.block_size)
    for block in range(0, len(entry.block_crcs), step):
        start = data_start + block * entry.block_size
        end = min(data_start + (block + step) * entry.block_size, data_end)
        needs.append(piece(start, end, entry, block))
    if item_end > data_end:
        needs.append(piece(data_end, item_end, None, None))
    return needs


# --------------------------------------------------------------------------------------------
# Fetch and check


def fetch_and_check(
    backend: Backend,
    plan: Reads,
    files: dict[str, FileReport],
    max_concurrency: int,
    chunk_size: int,
    progress: Progress | None,
) -> int:
    """Fetch every need as the reader does and check it; returns the bytes read."""
    from dcp_volumes.loading.needs import plan_ranges
    from dcp_volumes.loading.sources import CannotServe, StoreSource

    url = redact_url(backend.url)
    ranges = plan_ranges(plan.needs, gap=0, max_size=chunk_size)
    store = StoreSource(backend, url, max_concurrency=max_concurrency, chunk_size=chunk_size,
                        stats=CallStats())
    total = sum(r.end - r.start for r in ranges)
    for rng, got in store.serve(ranges):
        if isinstance(got, CannotServe):
            raise got.error  # deleted while verifying: raise, as a load would
        view = memoryview(got)
        for need in rng.items:
            # a failure is recorded in the file's report, never raised: every file is checked
            _check(need, view[need.start - rng.start:need.end - rng.start],
                   files[need.relative], plan, url)
        if progress is not None:
            progress(store.fetched, total)
    read = store.fetched
    for split in plan.split.values():
        _check_folded(split, files[split.relative], url)
    return read


def _check(need: Need, chunk: memoryview, report: FileReport, plan: Reads, url: str) -> None:
    from dcp_volumes.loading.needs import check_need

    if len(chunk) != need.end - need.start:  # the file shrank after its size was checked
        report.status = "size mismatch"
        report.actual_size = need.start + len(chunk)
        return
    if need.entry is None:  # the bytes around a split tensor's data: folded in later
        import crc32c

        plan.split[(need.relative, need.item_offset)].outer[need.start] = crc32c.crc32c(chunk)
        return
    try:
        check_need(need, chunk, url)
    except errors.IntegrityError as exc:
        _bad(report, str(exc))


def _check_folded(split: _Split, report: FileReport, url: str) -> None:
    """The item's CRC32C from the outer pieces' CRCs and the (checked) block CRCs."""
    from dcp_volumes._crc import crc32c_extend
    from dcp_volumes.loading.needs import describe

    entry = split.entry
    data_start = split.offset + (entry.data_offset or 0)
    data_end = data_start + split.nbytes
    item_end = split.offset + entry.length
    if (data_start > split.offset and split.offset not in split.outer) or (
        item_end > data_end and data_end not in split.outer
    ):
        return  # a piece came back short: already reported as a size mismatch
    crc = split.outer.get(split.offset, 0)
    for i, block_crc in enumerate(entry.block_crcs):
        crc = crc32c_extend(
            crc, block_crc, min(entry.block_size, split.nbytes - i * entry.block_size)
        )
    if item_end > data_end:
        crc = crc32c_extend(crc, split.outer[data_end], item_end - data_end)
    if crc != entry.crc:
        _bad(
            report,
            f"checksum mismatch for {describe(split.read)} in shard {split.relative} of {url} "
            f"(crc32c {crc:08x}, expected {entry.crc & 0xFFFFFFFF:08x}): the stored bytes "
            "around its tensor data are corrupt",
        )


def _bad(report: FileReport, what: str) -> None:
    report.bad_items.append(what)
    if report.status == "ok":
        report.status = "checksum mismatch"
