"""A rank's shard files: its write items split into files by size (:func:`plan_shards`),
each item serialized into its file exactly as torch's ``FileSystemWriter`` writes it
(:meth:`ShardFiles.fill`), and the id a rank names its shard files with. A durable save
streams each file's parts to the store as it fills; a local-only save keeps the files on
local disk; both fill them the same way.
"""

from __future__ import annotations

import contextlib
import dataclasses
import io
import threading
from collections.abc import Callable, Iterator
from typing import IO, cast

import torch
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.planner import SavePlanner, WriteItem, WriteItemType
from torch.distributed.checkpoint.storage import WriteResult

from dcp_volumes import _compat, _layout
from dcp_volumes._manifest import CheckedWriteResult, ItemEntry
from dcp_volumes.saving._spool import SpoolFile

__all__ = [
    "DATA_BLOCK",
    "Shard",
    "ShardFiles",
    "claim_shard_id",
    "cpu_tensor",
    "item_nbytes",
    "plan_shards",
    "serializing",
    "split_by_size",
    "write_item",
]

# Large contiguous tensors get a CRC32C per block of their raw bytes, so a resharding load
# can fetch and verify only the blocks its new shards need.
DATA_BLOCK = 1 << 20

# Every id this process named shard files with. A plan whose save id is in here is a cached
# plan of an earlier save; its shards then get an id of their own (one short string per save).
_shard_ids: set[str] = set()
_shard_ids_lock = threading.Lock()


def claim_shard_id(*candidates: str | None) -> str:
    """The id this rank names this save's shard files with: the first candidate (the plan's
    save id, then the coordinator's own current one) that no earlier save of this process
    used, else a new id of the same form. Unique per save per rank by construction, so no
    two saves ever write the same object, whatever plan DCP's cache hands the rank."""
    with _shard_ids_lock:
        for candidate in candidates:
            if candidate is not None and candidate not in _shard_ids:
                _shard_ids.add(candidate)
                return candidate
        while (token := _layout.new_save_id()) in _shard_ids:
            pass
        _shard_ids.add(token)
        return token


def item_nbytes(item: WriteItem) -> int:
    if item.tensor_data is None:
        return 0
    n = 1
    for s in item.tensor_data.size:
        n *= s
    return n * torch._utils._element_size(item.tensor_data.properties.dtype)


def split_by_size(bins: int, items: list[WriteItem]) -> list[list[WriteItem]]:
    """Greedy size balance (largest first), byte items round-robin: torch's own policy."""
    buckets: list[list[WriteItem]] = [[] for _ in range(bins)]
    sizes = [0] * bins
    byte_items = [i for i in items if i.type == WriteItemType.BYTE_IO]
    tensor_items = sorted((i for i in items if i.type != WriteItemType.BYTE_IO),
                          key=item_nbytes, reverse=True)
    for n, item in enumerate(byte_items):
        buckets[n % bins].append(item)
    for item in tensor_items:
        idx = sizes.index(min(sizes))
        buckets[idx].append(item)
        sizes[idx] += item_nbytes(item)
    return [b for b in buckets if b]


_zip_crc_lock = threading.Lock()
_zip_crc_users = 0
_zip_crc_previous: bool | None = None


@contextlib.contextmanager
def serializing() -> Iterator[None]:
    """Skip torch.save's own zip CRC32 while we serialize: every item already gets a
    CRC32C from the spool, and torch's readers do not check the zip CRC. (A process-wide
    torch setting: restored when the last concurrent save in this process ends.)"""
    global _zip_crc_users, _zip_crc_previous
    options = _compat.zip_crc32_options()
    if options is None:
        yield
        return
    get, set_ = options
    with _zip_crc_lock:
        if _zip_crc_users == 0:
            _zip_crc_previous = get()
        _zip_crc_users += 1
        set_(False)
    try:
        yield
    finally:
        with _zip_crc_lock:
            _zip_crc_users -= 1
            if _zip_crc_users == 0 and _zip_crc_previous is not None:
                set_(_zip_crc_previous)


def cpu_tensor(data: torch.Tensor) -> torch.Tensor:
    tensor = data.detach()
    if tensor.device.type != "cpu":
        tensor = tensor.cpu()
    if tensor.untyped_storage().nbytes() != tensor.nbytes:
        # torch.save writes a tensor's whole storage; keep only the view's bytes.
        tensor = tensor.clone()
    return tensor


def write_item(sf: SpoolFile, item: WriteItem, planner: SavePlanner,
                relative: str) -> WriteResult:
    data = planner.resolve_data(item)
    tensor = None
    if isinstance(data, io.BytesIO):
        sf.begin_item()
        sf.write(data.getbuffer())
    else:
        tensor = cpu_tensor(data)
        partial = tensor.is_contiguous() and tensor.nbytes >= 2 * DATA_BLOCK
        sf.begin_item(data_bytes=tensor.nbytes if partial else 0, block_size=DATA_BLOCK)
        torch.save(tensor, cast(IO[bytes], sf))
    offset, length, crc, layout = sf.end_item()
    entry = None
    if layout is not None and tensor is not None:
        entry = ItemEntry(length, crc, layout.data_offset, layout.block_size,
                          tuple(layout.block_crcs), tuple(tensor.shape),
                          str(tensor.dtype).removeprefix("torch."))
    return CheckedWriteResult(index=item.index, size_in_bytes=length,
                              storage_data=_StorageInfo(relative, offset, length),
                              crc32c=crc, layout=entry)


@dataclasses.dataclass(frozen=True)
class Shard:
    """One shard file of a rank's save: its name and the items it holds."""

    relative: str
    items: list[WriteItem]

    @property
    def nbytes(self) -> int:
        """The tensor bytes it will hold (its size, give or take the zip framing)."""
        return sum(map(item_nbytes, self.items))


def plan_shards(items: list[WriteItem], *, files: int,
                shard_path: Callable[[int], str]) -> list[Shard]:
    """``items`` in at most ``files`` shard files, balanced by size; file ``i`` is named
    ``shard_path(i)``."""
    return [Shard(shard_path(i), bucket)
            for i, bucket in enumerate(split_by_size(files, items))]


@dataclasses.dataclass
class ShardFiles:
    """A rank's shard files as they are written: the spool files (the caller discards them,
    also after a failure), the write results and the bytes."""

    spools: list[SpoolFile] = dataclasses.field(default_factory=list)
    results: list[WriteResult] = dataclasses.field(default_factory=list)
    nbytes: int = 0

    def track(self, sf: SpoolFile) -> SpoolFile:
        """Count ``sf`` among the spool files (before anything else can fail)."""
        self.spools.append(sf)
        return sf

    def fill(self, sf: SpoolFile, shard: Shard, planner: SavePlanner) -> None:
        """Serialize ``shard``'s items into ``sf`` (inside :func:`serializing`) and close it:
        its last part goes out and its part stream ends."""
        for item in shard.items:
            self.results.append(write_item(sf, item, planner, shard.relative))
        self.nbytes += sf.close()
