"""Block reads of a resharding load, as properties.

A global tensor is saved as a grid of chunks (one stored item each, several items in one
shard file, written through the real :class:`SpoolFile` with small CRC32C blocks), then
loaded into a different grid: DCP's own resharding (``create_read_items_for_chunk_list``)
makes the read items, :func:`plan_needs` turns them into byte spans, and the fetched bytes
go through :func:`check_need`, :func:`direct_target` and :func:`apply_need` exactly as the
reader calls them. What comes out is compared with torch's own way: load the whole item and
narrow it.
"""

from __future__ import annotations

import io
import itertools
import math
from typing import Any

import crc32c
import pytest
import torch
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st
from torch.distributed._shard._utils import narrow_tensor_by_index
from torch.distributed.checkpoint import DefaultLoadPlanner
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    MetadataIndex,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import ReadItem
from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list

from dcp_volumes import errors
from dcp_volumes._manifest import FileEntry, ItemEntry, Manifest
from dcp_volumes.loading.apply import apply_need, direct_target
from dcp_volumes.loading.needs import Need, check_need, plan_needs
from dcp_volumes.saving import SpoolFile

FQN = "w"
SHARD = "__0_0.distcp"
URL = "memory://ckpt"
DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int8,
          torch.uint8, torch.int32, torch.int64, torch.bool]
#: torch.save's writes before a tensor's storage are all shorter than this, so a storage
#: of at least this many bytes is the one write SpoolFile takes for the tensor's data
MIN_BLOCKED_BYTES = 256

Box = tuple[tuple[int, ...], tuple[int, ...]]  # (offsets, sizes)


class ShardPlanner(DefaultLoadPlanner):
    """DCP's default planner, with the rank's local shards looked up by their global offset
    (what DTensor/ShardedTensor do through ``find_tensor_shard``)."""

    def __init__(self, shards: dict[tuple[int, ...], torch.Tensor]) -> None:
        super().__init__()
        self.shards = shards

    def lookup_tensor(self, index: MetadataIndex) -> torch.Tensor:
        assert index.offset is not None
        return self.shards[tuple(index.offset)]


# ---- strategies ----------------------------------------------------------------------------
@st.composite
def _cuts(draw: st.DrawFn, size: int) -> list[tuple[int, int]]:
    """Split ``[0, size)`` into 1..3 contiguous, possibly uneven, non-empty pieces."""
    points = draw(st.lists(st.integers(1, size - 1), max_size=2, unique=True)) if size > 1 else []
    edges = [0, *sorted(points), size]
    return list(itertools.pairwise(edges))


@st.composite
def _grid(draw: st.DrawFn, shape: tuple[int, ...]) -> list[Box]:
    per_dim = [draw(_cuts(n)) for n in shape]
    return [(tuple(a for a, _ in cell), tuple(b - a for a, b in cell))
            for cell in itertools.product(*per_dim)]


@st.composite
def cases(draw: st.DrawFn) -> dict[str, Any]:
    dtype = draw(st.sampled_from(DTYPES))
    ndim = draw(st.integers(0, 3))
    longest = {0: 1, 1: 4096, 2: 64, 3: 16}[ndim]  # a few KiB: many small blocks each
    size = st.integers(1, longest) | st.integers(max(1, longest // 2), longest)
    shape = tuple(draw(st.lists(size, min_size=ndim, max_size=ndim)))
    saved = draw(_grid(shape))
    loaded = draw(_grid(shape))
    # a loading rank holds one or two chunks of the new grid
    held = draw(st.lists(st.sampled_from(loaded), min_size=1, max_size=2, unique=True))
    return {
        "dtype": dtype,
        "shape": shape,
        "saved": saved,
        "held": held,
        # multiples of every element size, as the writer's 1 MiB is (a block boundary is
        # an element boundary; the block path relies on it)
        "block_size": draw(st.sampled_from([8, 16, 24, 40, 64, 200, 256, 1024])),
        # per saved chunk: record blocks (where the tensor is large enough) or not
        "blocked": [draw(st.integers(0, 4)) > 0 for _ in saved],
        "contiguous_targets": draw(st.booleans()),
        "seed": draw(st.integers(0, 2**31 - 1)),
        "flip": draw(st.integers(0, 2**31 - 1)),
    }


# ---- building a real checkpoint ------------------------------------------------------------
def _values(shape: tuple[int, ...], dtype: torch.dtype, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    # small integers: exact in every dtype, and +1 (or not) differs from each of them
    return torch.randint(0, 100, shape, generator=g).to(dtype)


def _other_than(t: torch.Tensor) -> torch.Tensor:
    return t.logical_not() if t.dtype == torch.bool else t + 1


def _slices(box: Box) -> tuple[slice, ...]:
    return tuple(slice(o, o + n) for o, n in zip(*box))


def _write_shard(chunks: list[torch.Tensor], blocked: list[bool], block_size: int
                 ) -> tuple[bytes, list[ItemEntry], list[int]]:
    """Spool ``chunks`` into one shard file the way the writer does (``_write_item``), with
    ``block_size`` blocks instead of 1 MiB; returns the file, its entries and offsets."""
    sf = SpoolFile(SHARD, mode="memory", directory="", part_size=1 << 20)
    entries, offsets = [], []
    for tensor, want_blocks in zip(chunks, blocked):
        partial = want_blocks and tensor.nbytes >= MIN_BLOCKED_BYTES
        sf.begin_item(data_bytes=tensor.nbytes if partial else 0, block_size=block_size)
        torch.save(tensor, sf)  # type: ignore[arg-type]  # SpoolFile is file-like
        offset, length, crc, layout = sf.end_item()
        assert (layout is not None) == partial
        entry = ItemEntry(length, crc)
        if layout is not None:
            entry = ItemEntry(length, crc, layout.data_offset, layout.block_size,
                              tuple(layout.block_crcs), tuple(tensor.shape),
                              str(tensor.dtype).removeprefix("torch."))
        entries.append(entry)
        offsets.append(offset)
    sf.close()
    parts = sf.parts.take()
    data = b"".join(bytes(p.buffer or b"") for p in sorted(parts, key=lambda p: p.part.number))
    assert len(data) == sf.tell()
    for tensor, entry, offset in zip(chunks, entries, offsets):
        assert crc32c.crc32c(data[offset:offset + entry.length]) == entry.crc
        if entry.data_offset is not None:
            start = offset + entry.data_offset
            raw = data[start:start + tensor.nbytes]
            assert raw == _bytes(tensor)
            assert entry.block_crcs == tuple(
                crc32c.crc32c(raw[i:i + block_size]) for i in range(0, len(raw), block_size))
    return data, entries, offsets


def _saved_key(read: ReadItem) -> tuple[int, ...]:
    """The saved chunk a read comes from, by its offset in the global tensor."""
    assert read.storage_index.offset is not None
    return tuple(read.storage_index.offset)


def _bytes(t: torch.Tensor) -> bytes:
    return bytes(t.contiguous().reshape(-1).view(torch.uint8).numpy())


def _element_ids(read: ReadItem, shape: tuple[int, ...]) -> torch.Tensor:
    """Linear indices, in the stored chunk, of the read's elements (in the read's order)."""
    ids = torch.arange(math.prod(shape)).reshape(shape)
    return narrow_tensor_by_index(ids, read.storage_offsets, read.lengths).reshape(-1)


def _check_span(need: Need, stored: torch.Tensor, data_start: int, bs: int) -> None:
    """The span is the fewest whole blocks that hold every byte of every read."""
    es = stored.element_size()
    ids = torch.cat([_element_ids(r, tuple(stored.shape)) for r in need.reads])
    first, stop = data_start + int(ids.min()) * es, data_start + (int(ids.max()) + 1) * es
    assert need.first_block is not None
    assert need.start == data_start + need.first_block * bs
    assert need.start <= first < need.start + bs
    assert need.end == data_start + stored.nbytes or (need.end - data_start) % bs == 0
    assert need.end - bs < stop <= need.end


def _stored_run_is_contiguous(read: ReadItem, shape: tuple[int, ...]) -> bool:
    """Whether the read's elements are one run of the stored chunk, by enumerating them."""
    picked = _element_ids(read, shape)
    return bool(torch.equal(picked, torch.arange(int(picked[0]), int(picked[0]) + len(picked))))


def _target(box: Box, dtype: torch.dtype, contiguous: bool, fill: torch.Tensor) -> torch.Tensor:
    sizes = box[1]
    if contiguous or len(sizes) < 2:
        t = torch.empty(sizes, dtype=dtype)
    else:  # column-major memory: DCP loads into whatever layout the model's tensor has
        t = torch.empty(tuple(reversed(sizes)), dtype=dtype).permute(
            *reversed(range(len(sizes))))
    t.copy_(fill)
    return t


def _flipped(chunk: memoryview, pos: int, bit: int) -> memoryview:
    out = bytearray(chunk)
    out[pos] ^= 1 << bit
    return memoryview(bytes(out))


# ---- the property --------------------------------------------------------------------------
@settings(max_examples=300, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.too_slow])
@given(case=cases())
def test_block_reads_match_narrowing_the_whole_item(case: dict[str, Any]) -> None:
    dtype, shape, bs = case["dtype"], case["shape"], case["block_size"]
    whole = _values(shape, dtype, case["seed"])
    # cloned: the writer saves a view's own bytes, never the whole storage behind it
    chunks = [whole[_slices(box)].clone() for box in case["saved"]]
    data, entries, offsets = _write_shard(chunks, case["blocked"], bs)

    md = TensorStorageMetadata(TensorProperties(dtype=dtype), torch.Size(shape),
                               [ChunkStorageMetadata(torch.Size(o), torch.Size(n))
                                for o, n in case["saved"]])
    storage_data = {MetadataIndex(FQN, torch.Size(box[0])): _StorageInfo(SHARD, off, e.length)
                    for box, off, e in zip(case["saved"], offsets, entries)}
    manifest = Manifest("save", "test", 1, files={
        SHARD: FileEntry(len(data), dict(zip(offsets, entries)))})
    saved_at = {tuple(box[0]): (chunk, off, e)
                for box, chunk, off, e in zip(case["saved"], chunks, offsets, entries)}

    held = case["held"]
    expected = {tuple(box[0]): whole[_slices(box)] for box in held}
    shards = {tuple(box[0]): _target(box, dtype, case["contiguous_targets"],
                                     _other_than(whole[_slices(box)])) for box in held}
    planner = ShardPlanner(shards)
    reads = create_read_items_for_chunk_list(
        FQN, md, [ChunkStorageMetadata(torch.Size(o), torch.Size(n)) for o, n in held])
    needs = plan_needs(reads, storage_data, manifest, URL)
    assert sorted(id(r) for n in needs for r in n.reads) == sorted(id(r) for r in reads)

    view = memoryview(data)
    for need in needs:
        chunk_t, item_offset, entry = saved_at[_saved_key(need.reads[0])]
        assert need.entry == entry and need.item_offset == item_offset
        assert item_offset <= need.start <= need.end <= item_offset + entry.length
        if entry.data_offset is None:
            assert need.first_block is None
            assert (need.start, need.end) == (item_offset, item_offset + entry.length)
        else:
            assert need.first_block is not None
            _check_span(need, chunk_t, item_offset + entry.data_offset, bs)
        event("block read" if need.first_block is not None else "whole item")
        event(f"{len(need.reads)} reads in one need")
        chunk = view[need.start:need.end]
        check_need(need, chunk, URL)
        _check_direct(need, chunk, planner, saved_at, data)
        _check_rejects_corruption(need, chunk, case["flip"])

    # the direct path wrote into the targets: start over from bytes that differ everywhere
    for key, target in shards.items():
        target.copy_(_other_than(expected[key]))
    for need in needs:
        apply_need(need, view[need.start:need.end], planner)
    for read in reads:
        stored, item_offset, entry = saved_at[_saved_key(read)]
        item = torch.load(io.BytesIO(data[item_offset:item_offset + entry.length]),
                          weights_only=True)
        assert torch.equal(item, stored)
        want = narrow_tensor_by_index(item, read.storage_offsets, read.lengths)
        assert torch.equal(planner.resolve_tensor(read), want)
    for key, target in shards.items():
        assert torch.equal(target, expected[key])


def _check_direct(need: Need, chunk: memoryview, planner: ShardPlanner,
                  saved_at: dict[tuple[int, ...], Any], data: bytes) -> None:
    """``direct_target`` is offered exactly when the bytes are one run in the file and one
    run in the target, and the bytes it names, written to its view, are the read's."""
    direct = direct_target(need, planner)
    read = need.reads[0]
    stored = saved_at[_saved_key(read)][0]
    resolved = planner.resolve_tensor(read)
    eligible = (need.first_block is not None and len(need.reads) == 1
                and _stored_run_is_contiguous(read, tuple(stored.shape))
                and resolved.is_contiguous())
    assert (direct is not None) == eligible
    event("direct" if direct is not None else "not direct")
    if direct is None:
        return
    assert direct.read is read
    assert need.start <= direct.start <= direct.end <= need.end
    assert direct.end - direct.start == math.prod(read.lengths) * stored.element_size()
    assert direct.view.dtype == torch.uint8 and direct.view.numel() == direct.end - direct.start
    assert direct.view.data_ptr() == resolved.data_ptr()  # the target's own memory
    # the claimed file bytes are the read's elements, in the target's order
    want = narrow_tensor_by_index(stored, read.storage_offsets, read.lengths).contiguous()
    raw = data[direct.start:direct.end]
    assert raw == _bytes(want)
    # and writing them where it says lands them in the target
    offset = direct.start - need.start
    direct.view.copy_(torch.frombuffer(bytearray(chunk[offset:offset + len(raw)]),
                                       dtype=torch.uint8))
    assert torch.equal(resolved, want)


def _check_rejects_corruption(need: Need, chunk: memoryview, salt: int) -> None:
    """A flipped bit in a block (the first, the last and a few between; anywhere in a whole
    item) fails the check, and so does a short read."""
    assert need.entry is not None
    step = need.entry.block_size if need.first_block is not None else len(chunk)
    blocks = -(-len(chunk) // step)
    for i in sorted({0, blocks - 1, *(salt % (k + blocks) % blocks for k in range(4))}):
        size = min(step, len(chunk) - i * step)
        pos = i * step + (salt + 31 * i) % size
        with pytest.raises(errors.IntegrityError, match="checksum mismatch"):
            check_need(need, _flipped(chunk, pos, (salt + i) % 8), URL)
    if len(chunk):
        with pytest.raises(errors.IntegrityError, match="truncated"):
            check_need(need, chunk[:-1], URL)
