"""What a loading rank fetches: byte spans per stored item, coalesced into ranged GETs,
checked against the manifest, and turned into tensors.

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

import io
import math
import pickle
import warnings
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, cast

import crc32c
import torch
from torch.distributed._shard._utils import narrow_tensor_by_index
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlanner, ReadItem

from dcp_volumes import _layout, errors
from dcp_volumes._manifest import ItemEntry, Manifest, item_dtype
from dcp_volumes.transfer import transforms
from dcp_volumes.transfer.download import RangeRequest

__all__ = ["DirectTarget", "Need", "Span", "apply_need", "check_need", "check_object_item",
           "describe", "direct_target", "plan_needs", "plan_ranges"]


@dataclass
class Need:
    """A byte span ``[start, end)`` of one file that some read items need."""

    relative: str
    start: int
    end: int
    item_offset: int
    item_length: int
    reads: list[ReadItem] = field(default_factory=list)
    entry: ItemEntry | None = None
    first_block: int | None = None  # set when the span covers raw data blocks only
    needed: int = 0
    #: torch's stream transforms the item was written through (decoded in apply_need)
    transforms: tuple[str, ...] = ()
    #: the most the item may decode to (with ``transforms``)
    decoded_limit: int = 0
    #: the item's dtype as ``.metadata`` and the manifest record it (a tensor item)
    dtype: torch.dtype | None = None
    #: torch's ``ExtensionRegistry`` that decodes custom ``transforms`` (None: zstd only)
    registry: Any = None


def describe(read: ReadItem) -> str:
    index = read.storage_index
    return f"item {index.fqn!r}" + (f" at offset {tuple(index.offset)}" if index.offset else "")


def _contiguous_strides(shape: tuple[int, ...]) -> tuple[int, ...]:
    strides = [1] * len(shape)
    for i in range(len(shape) - 2, -1, -1):
        strides[i] = strides[i + 1] * max(shape[i + 1], 1)
    return tuple(strides)


def _element_span(read: ReadItem, strides: tuple[int, ...]) -> tuple[int, int]:
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
    by_item: dict[tuple[str, int], list[ReadItem]] = {}
    infos: dict[tuple[str, int], Any] = {}
    for read in reads:
        info = storage_data[read.storage_index]
        key = (_layout.check_relative_path(info.relative_path), int(info.offset))
        by_item.setdefault(key, []).append(read)
        infos[key] = info
    needs = []
    for (relative, offset), item_reads in by_item.items():
        length = int(infos[(relative, offset)].length)
        entry = None
        if manifest is not None:
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
        what = f"{describe(item_reads[0])} in shard {relative} of {url}"
        index = item_reads[0].storage_index
        dtype = item_dtype(metadata, index.fqn, index.offset, entry, what)
        descriptors = getattr(infos[(relative, offset)], "transform_descriptors", None)
        if descriptors:  # fetched whole: the stored bytes are a transform's output
            need = Need(relative, offset, offset + length, offset, length, item_reads, entry,
                        None, length, transforms.check_transforms(descriptors, what, registry),
                        _decoded_limit(item_reads[0], metadata), registry=registry)
        else:
            need = _need_for(relative, offset, length, item_reads, entry)
        need.dtype = dtype
        needs.append(need)
    return needs


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
    whole = Need(relative, offset, offset + length, offset, length, reads, entry, None, length)
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
    strides = _contiguous_strides(entry.shape)
    spans = [_element_span(r, strides) for r in reads]
    lo, hi = min(a for a, _ in spans), max(b for _, b in spans)
    nbytes = math.prod(entry.shape) * es
    bs = entry.block_size
    b0, b1 = (lo * es) // bs, -(-(hi * es) // bs)
    data_start = offset + entry.data_offset
    return Need(relative, data_start + b0 * bs, data_start + min(b1 * bs, nbytes), offset,
                length, reads, entry, b0, sum(math.prod(r.lengths) * es for r in reads))


def _raw_need(relative: str, offset: int, length: int, reads: list[ReadItem],
              entry: ItemEntry) -> Need:
    """The span of a raw item (nothing but the tensor's bytes) its reads' elements cover;
    an empty span at the item's start when they cover none."""
    es = entry.block_size  # a raw entry's blocks are its elements
    strides = _contiguous_strides(entry.shape)
    spans = [_element_span(r, strides) for r in reads if math.prod(r.lengths)]
    if any(r.type != LoadItemType.TENSOR for r in reads):
        raise errors.IntegrityError(f"{describe(reads[0])} is a tensor in the stored file, "
                                    "but the state dict holds a non-tensor value there")
    if not spans:
        return Need(relative, offset, offset, offset, length, reads, entry, 0, 0)
    lo, hi = min(a for a, _ in spans), max(b for _, b in spans)
    return Need(relative, offset + lo * es, offset + hi * es, offset, length, reads, entry, lo,
                sum(math.prod(r.lengths) * es for r in reads))


class Span(Protocol):
    """Anything with a byte span ``[start, end)`` of a file (a :class:`Need`, or the
    cooperative load's bundles)."""

    @property
    def relative(self) -> str: ...
    @property
    def start(self) -> int: ...
    @property
    def end(self) -> int: ...


def plan_ranges(needs: Sequence[Span], *, gap: int, max_size: int) -> list[RangeRequest]:
    """Sort each file's spans by offset and coalesce neighbours into ranged GETs; each
    range's ``items`` are the spans it serves."""
    ranges: list[RangeRequest] = []
    by_file: dict[str, list[Span]] = {}
    for need in needs:
        by_file.setdefault(need.relative, []).append(need)
    for relative in sorted(by_file):
        current: RangeRequest | None = None
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


def apply_need(need: Need, chunk: memoryview, planner: LoadPlanner,
               trusted: Sequence[Any] = ()) -> None:
    """Deserialize the fetched bytes into the planner's targets.

    ``trusted``: globals (classes, functions) a pickled non-tensor item may reference on
    top of what torch's weights-only unpickler allows.
    """
    if need.first_block is None:
        if need.transforms:
            what = f"{describe(need.reads[0])} in shard {need.relative}"
            chunk = transforms.decode(need.transforms, chunk, limit=need.decoded_limit,
                                      what=what, registry=need.registry)
            transforms.check_zip_crcs(chunk, what)
        for read in need.reads:
            _apply_item(read, chunk, planner, trusted, decoded=bool(need.transforms),
                        dtype=need.dtype)
        return
    entry = cast(ItemEntry, need.entry)
    dtype = getattr(torch, entry.dtype)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # read-only buffer: we only copy out of it
        flat = torch.frombuffer(chunk, dtype=dtype) if len(chunk) else torch.empty(0, dtype=dtype)
    strides = _contiguous_strides(entry.shape)
    base = need.first_block * entry.block_size // flat.element_size()
    for read in need.reads:
        if not math.prod(read.lengths):
            _copy_into(read, torch.empty(tuple(read.lengths), dtype=dtype), planner)
            continue
        first, _ = _element_span(read, strides)
        view = torch.as_strided(flat, size=tuple(read.lengths), stride=strides,
                                storage_offset=first - base)
        _copy_into(read, view, planner)


#: globals every object item may reference: DCP stores ``io.BytesIO`` values this way
ALWAYS_SAFE: tuple[Any, ...] = (io.BytesIO,)


def check_object_item(read: ReadItem, chunk: memoryview, trusted: Sequence[Any]) -> None:
    """Refuse a pickled non-tensor item that would run code when the planner loads it.

    DCP's planners unpickle object items with ``torch.load(weights_only=False)``, which
    calls whatever the pickle names. The bytes are first loaded here with torch's
    weights-only unpickler (containers, numbers, strings, tensors, and ``trusted``); only
    if that succeeds does the planner see them, so it can construct nothing else.

    Raises:
        UnsafeCheckpointError: the item references a global that is not allowed.
        IntegrityError: the item is not a torch-serialized object.
    """
    try:
        with torch.serialization.safe_globals([*ALWAYS_SAFE, *trusted]):
            torch.load(io.BytesIO(chunk), map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as exc:
        try:
            names = torch.serialization.get_unsafe_globals_in_checkpoint(io.BytesIO(chunk))
        except Exception:  # noqa: BLE001 — naming them is a courtesy; the refusal stands
            names = []
        shown = ", ".join(sorted(set(names) - {_name_of(t) for t in (*ALWAYS_SAFE, *trusted)})[:5])
        if not shown:  # refused for something other than a global it names
            raise errors.UnsafeCheckpointError(
                f"{describe(read)} is a pickled object that torch's weights-only unpickler "
                "refuses without naming a class or function (an opcode or value it does not "
                "allow): the item is damaged or crafted; refusing to unpickle it") from exc
        raise errors.UnsafeCheckpointError(
            f"{describe(read)} is a pickled object that references {shown}, which loading "
            "would call: refused. If you trust this checkpoint and that class, pass it in "
            "VolumeReader(..., safe_globals=[...]) (as torch.serialization.add_safe_globals "
            "takes it)"
        ) from exc
    except Exception as exc:
        raise errors.IntegrityError(
            f"{describe(read)} is not a readable torch-serialized object "
            f"({type(exc).__name__})") from exc


def _name_of(obj: Any) -> str:
    return f"{getattr(obj, '__module__', '?')}.{getattr(obj, '__qualname__', obj)}"


def _apply_item(read: ReadItem, chunk: memoryview, planner: LoadPlanner,
                trusted: Sequence[Any], *, decoded: bool = False,
                dtype: torch.dtype | None = None) -> None:
    """Deserialize one whole stored item exactly as torch's FileSystemReader does.
    ``decoded``: the bytes were decoded from a stream transform, so one that is not a
    readable tensor is damaged data (an ``IntegrityError``), not a format torch rejects."""
    if read.type == LoadItemType.BYTE_IO:
        check_object_item(read, chunk, trusted)
        planner.load_bytes(read, io.BytesIO(chunk))
        return
    try:
        tensor = torch.load(io.BytesIO(chunk), map_location="cpu", weights_only=True)
    except Exception as exc:
        if not decoded:
            raise
        raise errors.IntegrityError(f"{describe(read)} does not decode to a readable tensor "
                                    f"({type(exc).__name__}): the stored bytes are damaged"
                                    ) from exc
    if not isinstance(tensor, torch.Tensor):
        raise errors.IntegrityError(f"{describe(read)} is stored as a tensor item but holds "
                                    f"a {type(tensor).__name__}")
    if dtype is not None and tensor.dtype != dtype:
        raise errors.IntegrityError(
            f"{describe(read)}: .metadata says dtype {dtype}, the stored item holds "
            f"{tensor.dtype}: the checkpoint was damaged or crafted; refusing to load it")
    _copy_into(read, narrow_tensor_by_index(tensor, read.storage_offsets, read.lengths), planner)


@dataclass(frozen=True)
class DirectTarget:
    """Where a need's raw tensor bytes land in its target: file bytes ``[start, end)`` are
    ``view`` (the target's memory as bytes), so they can be written there as they arrive
    (and ``planner.commit_tensor(read, target)`` called once all of them have)."""

    read: ReadItem
    target: torch.Tensor
    view: torch.Tensor
    start: int
    end: int


def direct_target(need: Need, planner: LoadPlanner) -> DirectTarget | None:
    """The :class:`DirectTarget` of a block-read need with a single read whose elements are
    one contiguous run both in the stored tensor and in a contiguous CPU target of the same
    dtype and shape; None otherwise (the bytes then go through :func:`apply_need`)."""
    entry = need.entry
    if need.first_block is None or entry is None or entry.data_offset is None \
            or len(need.reads) != 1:
        return None
    read = need.reads[0]
    dtype = getattr(torch, entry.dtype, None)
    if not isinstance(dtype, torch.dtype):
        return None
    first, stop = _element_span(read, _contiguous_strides(entry.shape))
    count = math.prod(read.lengths)
    if stop - first != count:
        return None  # the read's elements are strided in the stored tensor
    target = planner.resolve_tensor(read).detach()
    if (target.device.type != "cpu" or target.dtype != dtype or not target.is_contiguous()
            or tuple(target.size()) != tuple(read.lengths)):
        return None
    es = target.element_size()
    start = need.item_offset + entry.data_offset + first * es
    view = target.reshape(-1).view(torch.uint8)
    return DirectTarget(read, target, view, start, start + count * es)


def _copy_into(read: ReadItem, tensor: torch.Tensor, planner: LoadPlanner) -> None:
    target = planner.resolve_tensor(read).detach()
    if target.size() != tensor.size():
        raise errors.IntegrityError(
            f"{describe(read)}: stored shape {tuple(tensor.size())} does not match the target "
            f"{tuple(target.size())}"
        )
    target.copy_(tensor)
    planner.commit_tensor(read, target)
