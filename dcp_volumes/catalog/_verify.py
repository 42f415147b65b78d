"""Verify: read a checkpoint back and check it against its manifest.

The bytes go through the reader's own serve path: each stored item becomes a
:class:`~dcp_volumes.loading.needs.Need`, needs are coalesced into ranged GETs by
``plan_ranges``, fetched by the store source (``loading.sources.StoreSource``) and checked by ``check_need``
(recorded in the file's report instead of raised) -- so ``verify``
passes exactly when a load would find every byte intact. A large tensor whose manifest
records per-block CRC32Cs is read in pieces of at most ``chunk_size`` bytes (its blocks
checked one by one, the bytes around them folded into the item's CRC32C), so memory stays
bounded whatever the tensor's size.
"""

from __future__ import annotations

import asyncio
import math
import os
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any

from dcp_volumes import _layout, errors
from dcp_volumes.backends import Backend, CallStats, redact_url
from dcp_volumes.catalog._committed import CommittedSave, load_committed
from dcp_volumes.catalog._common import Progress, open_root

if TYPE_CHECKING:
    from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex
    from torch.distributed.checkpoint.planner import ReadItem

    from dcp_volumes._manifest import ItemEntry, Manifest
    from dcp_volumes.loading.needs import Need

__all__ = ["FileReport", "VerifyReport", "verify"]


@dataclass
class FileReport:
    """What :func:`verify` found for one file.

    Attributes:
        name: the file, relative to the checkpoint.
        status: ``"ok"``, ``"missing"``, ``"link outside the checkpoint"`` (local files: a
            symbolic link, never read), ``"size mismatch"``, ``"checksum mismatch"`` or
            ``"not in manifest"``.
        expected_size: the size the manifest records (no manifest: the least size the items
            named in ``.metadata`` need).
        actual_size: the stored size, ``None`` when missing.
        bad_items: the items whose checksum or length did not match, described.
    """

    name: str
    status: str
    expected_size: int
    actual_size: int | None = None
    bad_items: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return self.status == "ok"


@dataclass
class VerifyReport:
    """The outcome of :func:`verify`.

    Attributes:
        url: the checkpoint.
        save_id: the committed save's id (``None`` for checkpoints written by torch's writers).
        checksummed: the items' CRC32C were checked (a manifest was there).
        note: what was and was not checked, in words.
        files: one :class:`FileReport` per file.
        bytes_read: bytes read back from the store.
    """

    url: str
    save_id: str | None
    checksummed: bool
    note: str
    files: list[FileReport]
    bytes_read: int = 0

    @property
    def ok(self) -> bool:
        """Every file is as recorded."""
        return all(f.ok for f in self.files)

    def as_dict(self) -> dict[str, Any]:
        doc = asdict(self)
        doc["ok"] = self.ok
        return doc


def verify(
    url: str | os.PathLike[str],
    *,
    storage_options: dict[str, Any] | None = None,
    max_concurrency: int = 4,
    chunk_size: int = 16 << 20,
    progress: Progress | None = None,
) -> VerifyReport:
    """Read every item of a checkpoint back and check sizes and CRC32C against its manifest.

    Each file's size is checked first (a missing or resized file is not read); the items of
    the others are fetched in ranged reads of up to ``chunk_size`` bytes, ``max_concurrency``
    at a time, and checked as a load checks them. A checkpoint written by torch's own writers
    has no manifest: nothing to verify, but the files named in ``.metadata`` must exist and be
    large enough for the items they hold.

    Args:
        url: the checkpoint.
        storage_options: passed to fsspec unchanged; never logged.
        max_concurrency: requests in flight at the same time.
        chunk_size: bytes per ranged read.
        progress: called as ``progress(bytes_done, bytes_total)`` while reading.

    Raises:
        CheckpointNotFoundError: nothing is stored at ``url``.
        IncompleteCheckpointError: objects but no ``.metadata``.
    """
    if max_concurrency < 1 or chunk_size < 1:
        raise errors.ConfigError("max_concurrency and chunk_size must be >= 1")
    backend = open_root(url, storage_options)
    save = load_committed(backend)
    needed = _needed_sizes(save.metadata)
    if save.manifest is None:
        return _unverified(backend, save, needed, max_concurrency)
    files = _check_sizes_against_manifest(backend, save.manifest, max_concurrency)
    plan = _plan(save.metadata, save.manifest, files, chunk_size)
    read = _fetch_and_check(backend, plan, files, max_concurrency, chunk_size, progress)
    reports = [files[name] for name in sorted(files)]
    for name in sorted(set(needed) - set(save.manifest.files)):
        reports.append(FileReport(name, "not in manifest", needed[name]))
    n_items = sum(len(e.items) for e in save.manifest.files.values())
    note = f"checked size and CRC32C of {n_items} items"
    return VerifyReport(redact_url(backend.url), save.save_id, True, note, reports, read)


# --------------------------------------------------------------------------------------------
# Sizes


def _needed_sizes(md: Metadata) -> dict[str, int]:
    """The least size of each file named in ``.metadata``: the end of its last item."""
    needed: dict[str, int] = {}
    for info in md.storage_data.values():
        needed[info.relative_path] = max(
            needed.get(info.relative_path, 0), info.offset + info.length
        )
    return needed


#: the stored "size" of a file that resolves outside the checkpoint (a symbolic link)
_ESCAPES = -1
_ESCAPES_STATUS = "link outside the checkpoint"


def _stored_sizes(backend: Backend, names: list[str], limit: int) -> dict[str, int | None]:
    """Each object's stored size (fresh, not from a listing cache); None where absent."""

    async def _all() -> list[int | None]:
        gate = asyncio.Semaphore(limit)

        async def one(name: str) -> int | None:
            async with gate:
                try:
                    return await backend.size(name)
                except errors.UnsafeCheckpointError:
                    return _ESCAPES  # a link out of the checkpoint: reported, never read

        return list(await asyncio.gather(*(one(n) for n in names)))

    return dict(zip(names, backend.run(_all)))


def _unverified(
    backend: Backend, save: CommittedSave, needed: dict[str, int], limit: int
) -> VerifyReport:
    """No manifest: check that the files named in ``.metadata`` exist and are large enough."""
    sizes = _stored_sizes(backend, sorted(needed), limit)
    files = []
    for name, size in sorted(needed.items()):
        actual = sizes[name]
        if actual is None:
            files.append(FileReport(name, "missing", size))
        elif actual == _ESCAPES:
            files.append(FileReport(name, _ESCAPES_STATUS, size))
        else:
            files.append(
                FileReport(name, "ok" if actual >= size else "size mismatch", size, actual)
            )
    if save.ours:
        assert save.manifest_problem is not None
        name = _layout.manifest_name(save.save_id)  # type: ignore[arg-type]
        files.insert(0, FileReport(name, "missing", 0))
        note = f"{save.manifest_problem}: checksums cannot be verified"
    else:
        note = (
            "no manifest: nothing to verify (not written by dcp_volumes); checked that "
            "the files named in .metadata exist and are large enough"
        )
    return VerifyReport(redact_url(backend.url), save.save_id, False, note, files)


def _check_sizes_against_manifest(
    backend: Backend, manifest: Manifest, limit: int
) -> dict[str, FileReport]:
    """One report per manifest file: ``ok`` so far, ``missing`` or ``size mismatch``."""
    sizes = _stored_sizes(backend, sorted(manifest.files), limit)
    files = {}
    for name, actual in sizes.items():
        size = manifest.files[name].size
        if actual is None:
            files[name] = FileReport(name, "missing", size)
        elif actual == _ESCAPES:
            files[name] = FileReport(name, _ESCAPES_STATUS, size)
        else:
            files[name] = FileReport(
                name, "ok" if actual == size else "size mismatch", size, actual
            )
    return files


# --------------------------------------------------------------------------------------------
# Planning: every item of every file of the right size, as the reader's needs


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
class _Plan:
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


def _plan(md: Metadata, manifest: Manifest, files: dict[str, FileReport], chunk_size: int) -> _Plan:
    from torch.distributed.checkpoint.metadata import MetadataIndex

    labels = _item_labels(md)
    plan = _Plan()
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

    end = offset + entry.length
    return Need(relative, offset, end, offset, entry.length, [read], entry, None, entry.length)


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
        return Need(
            s.relative, start, end, s.offset, entry.length, [s.read], checked, block, end - start
        )

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


def _fetch_and_check(
    backend: Backend,
    plan: _Plan,
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


def _check(need: Need, chunk: memoryview, report: FileReport, plan: _Plan, url: str) -> None:
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
