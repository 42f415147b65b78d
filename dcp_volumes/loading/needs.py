"""What a loading rank needs: byte spans per stored item (:class:`Need`), coalesced into
ranged reads (:func:`plan_ranges`), and the one check of their bytes against the manifest
(:func:`check_need`). Turning checked bytes into tensors is :mod:`dcp_volumes.loading.apply`.

A stored item is fetched whole (and its CRC32C checked) unless the manifest records where
the raw bytes of a large contiguous tensor sit inside it (``ItemEntry.data_offset``). Then
only the blocks covering the elements this rank's read items need are fetched, each block
checked against its own CRC32C — a resharding load reads about what its new shards need.
An entry with no checksum (``ItemEntry.raw``, built by the code for a safetensors tensor,
never read from a manifest) is narrowed the same way, to the element, with only its length
checked. An item written through torch's stream transforms (``transform_descriptors``) is
fetched whole and decoded with a bound (:mod:`dcp_volumes.transfer.transforms`).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol, TypeVar

import crc32c
import torch
from torch.distributed.checkpoint.planner import LoadItemType, ReadItem

from dcp_volumes import _layout, errors
from dcp_volumes._manifest import ItemEntry, Manifest, item_dtype
from dcp_volumes._metacheck import chunk_shapes
from dcp_volumes.transfer import transforms
from dcp_volumes.transfer.download import RangeRequest

__all__ = ["Need", "Span", "check_need", "contiguous_strides", "describe", "element_span",
           "plan_needs", "plan_ranges"]


@dataclass(frozen=True, kw_only=True)
class Need:
    """A byte span ``[start, end)`` of one file that some read items need.

    Built by name only (six of its fields are ints: a swapped pair would read wrong
    bytes): :meth:`whole` for a whole stored item, :meth:`part` for a span inside one.
    """

    relative: str
    start: int
    end: int
    #: where the stored item the span belongs to starts in the file, and its length
    item_offset: int
    item_length: int
    reads: tuple[ReadItem, ...] = ()
    entry: ItemEntry | None = None
    first_block: int | None = None  # set when the span covers raw data blocks only
    #: the bytes the reads take out of the span (what a load reports as read)
    needed: int = 0
    #: torch's stream transforms the item was written through (decoded in apply_need)
    transforms: tuple[str, ...] = ()
    #: the most the item may decode to (with ``transforms``)
    decoded_limit: int = 0
    #: the item's dtype as ``.metadata`` and the manifest record it (a tensor item)
    dtype: torch.dtype | None = None
    #: the stored chunk's shape as ``.metadata`` records it (a tensor item)
    shape: tuple[int, ...] | None = None
    #: torch's ``ExtensionRegistry`` that decodes custom ``transforms`` (None: zstd only)
    registry: Any = None

    @classmethod
    def whole(cls, relative: str, offset: int, length: int, *,
              reads: Sequence[ReadItem] = (), entry: ItemEntry | None = None,
              transforms: tuple[str, ...] = (), decoded_limit: int = 0,
              registry: Any = None) -> Need:
        """The whole stored item ``[offset, offset + length)`` of ``relative``, all of it
        needed (``transforms``: fetched whole to be decoded)."""
        return cls(relative=relative, start=offset, end=offset + length, item_offset=offset,
                   item_length=length, reads=tuple(reads), entry=entry, needed=length,
                   transforms=transforms, decoded_limit=decoded_limit, registry=registry)

    @classmethod
    def part(cls, relative: str, start: int, end: int, *, item_offset: int, item_length: int,
             reads: Sequence[ReadItem] = (), entry: ItemEntry | None = None,
             first_block: int | None = None, needed: int = 0) -> Need:
        """The span ``[start, end)`` inside the stored item at ``item_offset`` (of
        ``item_length`` bytes); ``first_block``: the span is whole raw data blocks from
        that one on, checked block by block."""
        return cls(relative=relative, start=start, end=end, item_offset=item_offset,
                   item_length=item_length, reads=tuple(reads), entry=entry,
                   first_block=first_block, needed=needed)

    @property
    def parts(self) -> tuple[Need, ...]:
        """The spans :func:`check_need` checks (a need is checked as a whole)."""
        return (self,)


def describe(read: ReadItem) -> str:
    index = read.storage_index
    return f"item {index.fqn!r}" + (f" at offset {tuple(index.offset)}" if index.offset else "")


def contiguous_strides(shape: tuple[int, ...]) -> tuple[int, ...]:
    strides = [1] * len(shape)
    for i in range(len(shape) - 2, -1, -1):
        strides[i] = strides[i + 1] * max(shape[i + 1], 1)
    return tuple(strides)


def element_span(read: ReadItem, strides: tuple[int, ...]) -> tuple[int, int]:
    """[first, last + 1) linear element index of the read's block in a contiguous chunk."""
    first = sum(o * s for o, s in zip(read.storage_offsets, strides))
    last = sum((o + n - 1) * s for o, n, s in zip(read.storage_offsets, read.lengths, strides))
    return first, last + 1


def plan_needs(reads: list[ReadItem], storage_data: dict[Any, Any],
               manifest: Manifest | None, url: str, metadata: Any = None,
               registry: Any = None) -> list[Need]:
    """One :class:`Need` per stored item the reads touch.

    ``metadata``: the checkpoint's ``Metadata``, which bounds what an item written through
    a stream transform may decode to (without it: :data:`~dcp_volumes.transfer.transforms.
    MAX_OBJECT_BYTES`). ``registry``: torch's ``ExtensionRegistry`` for custom stream
    transforms (:func:`~dcp_volumes.transfer.transforms.check_transforms`).

    Raises:
        UnsupportedTransformError: an item was written through a transform that cannot be
            decoded here (before any byte is fetched).
    """
    by_item, infos = _by_item(reads, storage_data)
    shapes = chunk_shapes(metadata, {r.storage_index.fqn for r in reads})
    needs = []
    for (relative, offset), item_reads in by_item.items():
        length = int(infos[(relative, offset)].length)
        entry = _entry_of(manifest, relative, offset, length, item_reads, url)
        what = f"{describe(item_reads[0])} in shard {relative} of {url}"
        index = item_reads[0].storage_index
        dtype = item_dtype(metadata, index.fqn, index.offset, entry, what)
        descriptors = getattr(infos[(relative, offset)], "transform_descriptors", None)
        shape = shapes.get((index.fqn, tuple(index.offset or ())))
        if descriptors:  # fetched whole: the stored bytes are a transform's output
            need = Need.whole(
                relative, offset, length, reads=item_reads, entry=entry,
                transforms=transforms.check_transforms(descriptors, what, registry),
                decoded_limit=_decoded_limit(item_reads[0], metadata), registry=registry)
        else:
            need = _need_for(relative, offset, length, item_reads, entry)
        needs.append(dataclasses.replace(need, dtype=dtype, shape=shape))
    return needs


def _by_item(reads: list[ReadItem], storage_data: dict[Any, Any]
             ) -> tuple[dict[tuple[str, int], list[ReadItem]], dict[tuple[str, int], Any]]:
    """The reads grouped by the stored item they touch ``(relative, offset)`` (its path
    checked), and each item's storage info."""
    by_item: dict[tuple[str, int], list[ReadItem]] = {}
    infos: dict[tuple[str, int], Any] = {}
    for read in reads:
        info = storage_data[read.storage_index]
        key = (_layout.check_relative_path(info.relative_path), int(info.offset))
        by_item.setdefault(key, []).append(read)
        infos[key] = info
    return by_item, infos


def _entry_of(manifest: Manifest | None, relative: str, offset: int, length: int,
              item_reads: list[ReadItem], url: str) -> ItemEntry | None:
    """The manifest's entry of the item (None without a manifest), which must be there and
    agree with ``.metadata`` on its length."""
    if manifest is None:
        return None
    file_entry = manifest.files.get(relative)
    entry = file_entry.items.get(offset) if file_entry is not None else None
    if entry is None:
        raise errors.IntegrityError(
            f"{describe(item_reads[0])} in shard {relative} is not in the manifest of "
            f"{url}"
        )
    if entry.length != length:
        raise errors.IntegrityError(
            f"{describe(item_reads[0])} in shard {relative}: .metadata says {length} "
            f"bytes, manifest says {entry.length}"
        )
    return entry


def _decoded_limit(read: ReadItem, metadata: Any) -> int:
    """What the stored chunk a read item comes from may decode to (its metadata's size)."""
    md = getattr(metadata, "state_dict_metadata", {}).get(read.storage_index.fqn)
    chunks = getattr(md, "chunks", None)
    if md is None or read.type == LoadItemType.BYTE_IO or not chunks:
        return transforms.decoded_limit(None, 0)
    offset = tuple(read.storage_index.offset or ())
    for chunk in chunks:
        if tuple(chunk.offsets) == offset:
            es = torch.empty((), dtype=md.properties.dtype).element_size()
            return transforms.decoded_limit(tuple(chunk.sizes), es)
    return transforms.decoded_limit(None, 0)


def _need_for(relative: str, offset: int, length: int, reads: list[ReadItem],
              entry: ItemEntry | None) -> Need:
    whole = Need.whole(relative, offset, length, reads=reads, entry=entry)
    if entry is not None and not entry.checked:
        return _raw_need(relative, offset, length, reads, entry)
    if (
        entry is None
        or entry.data_offset is None
        or any(r.type != LoadItemType.TENSOR for r in reads)
        or any(math.prod(r.lengths) == 0 for r in reads)
    ):
        return whole
    dtype = getattr(torch, entry.dtype, None)
    if not isinstance(dtype, torch.dtype):
        return whole
    es = torch.empty((), dtype=dtype).element_size()
    strides = contiguous_strides(entry.shape)
    spans = [element_span(r, strides) for r in reads]
    lo, hi = min(a for a, _ in spans), max(b for _, b in spans)
    nbytes = math.prod(entry.shape) * es
    bs = entry.block_size
    b0, b1 = (lo * es) // bs, -(-(hi * es) // bs)
    data_start = offset + entry.data_offset
    return Need.part(relative, data_start + b0 * bs, data_start + min(b1 * bs, nbytes),
                     item_offset=offset, item_length=length, reads=reads, entry=entry,
                     first_block=b0, needed=sum(math.prod(r.lengths) * es for r in reads))


def _raw_need(relative: str, offset: int, length: int, reads: list[ReadItem],
              entry: ItemEntry) -> Need:
    """The span of a raw item (nothing but the tensor's bytes) its reads' elements cover;
    an empty span at the item's start when they cover none."""
    es = entry.block_size  # a raw entry's blocks are its elements
    strides = contiguous_strides(entry.shape)
    spans = [element_span(r, strides) for r in reads if math.prod(r.lengths)]
    if any(r.type != LoadItemType.TENSOR for r in reads):
        raise errors.IntegrityError(f"{describe(reads[0])} is a tensor in the stored file, "
                                    "but the state dict holds a non-tensor value there")
    if not spans:
        return Need.part(relative, offset, offset, item_offset=offset, item_length=length,
                         reads=reads, entry=entry, first_block=0)
    lo, hi = min(a for a, _ in spans), max(b for _, b in spans)
    return Need.part(relative, offset + lo * es, offset + hi * es, item_offset=offset,
                     item_length=length, reads=reads, entry=entry, first_block=lo,
                     needed=sum(math.prod(r.lengths) * es for r in reads))


class Span(Protocol):
    """Anything with a byte span ``[start, end)`` of a file (a :class:`Need`, or the
    cooperative load's bundles), checked as its ``parts`` (needs inside it)."""

    @property
    def relative(self) -> str: ...
    @property
    def start(self) -> int: ...
    @property
    def end(self) -> int: ...
    @property
    def parts(self) -> Sequence[Need]: ...


#: the spans a range plan is made of (its ranges carry them as ``items``)
SpanT = TypeVar("SpanT", bound=Span)


def plan_ranges(needs: Sequence[SpanT], *, gap: int, max_size: int
                ) -> list[RangeRequest[SpanT]]:
    """Sort each file's spans by offset and coalesce neighbours into ranged GETs; each
    range's ``items`` are the spans it serves."""
    ranges: list[RangeRequest[SpanT]] = []
    by_file: dict[str, list[SpanT]] = {}
    for need in needs:
        by_file.setdefault(need.relative, []).append(need)
    for relative in sorted(by_file):
        current: RangeRequest[SpanT] | None = None
        for need in sorted(by_file[relative], key=lambda n: n.start):
            if (
                current is not None
                and need.start >= current.end
                and need.start - current.end <= gap
                and need.end - current.start <= max_size
            ):
                current.end = need.end
                current.items.append(need)
            else:
                current = RangeRequest(relative, need.start, need.end, [need])
                ranges.append(current)
    return ranges


def check_need(need: Need, chunk: memoryview, url: str) -> None:
    """Length and CRC32C of the fetched bytes against the manifest (if there is one)."""
    what = (describe(need.reads[0]) if need.reads
            else f"the item at offset {need.item_offset}")
    if len(chunk) != need.end - need.start:
        raise errors.IntegrityError(
            f"shard {need.relative} of {url} is truncated: {what} needs bytes "
            f"{need.start}..{need.end}, got {len(chunk)}"
        )
    entry = need.entry
    if entry is None or not entry.checked:
        return
    if need.first_block is None:
        actual = crc32c.crc32c(chunk)
        if actual != entry.crc:
            raise _mismatch(what, need.relative, url, actual, entry.crc)
        return
    bs = entry.block_size
    for i, pos in enumerate(range(0, len(chunk), bs)):
        block = need.first_block + i
        actual = crc32c.crc32c(chunk[pos:pos + bs])
        if block >= len(entry.block_crcs) or actual != entry.block_crcs[block]:
            raise _mismatch(what, need.relative, url, actual,
                            entry.block_crcs[block] if block < len(entry.block_crcs) else -1)


def _mismatch(what: str, relative: str, url: str, actual: int, expected: int
              ) -> errors.IntegrityError:
    return errors.IntegrityError(
        f"checksum mismatch for {what} in shard {relative} of {url} (crc32c {actual:08x}, "
        f"expected {expected & 0xFFFFFFFF:08x}): the stored bytes are corrupt"
    )
