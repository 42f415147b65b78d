"""The source side of an export: the committed checkpoint, and its tensors fetched slab by
slab through the one serve path (ranged GETs, coalesced, every byte checked against the
manifest as on load).

A slab is a dim-0 row range of one output tensor. Its ``ReadItem`` s against the stored
chunks come from torch's own resharding helper (``create_read_items_for_chunk_list``), so a
DTensor-sharded weight is read back exactly as ``dcp.load`` would read it into one full
tensor; :class:`SlabTarget` is the small ``LoadPlanner`` the serve path copies into. Many
small slabs make one *round*, fetched together so that neighbours coalesce into few GETs.
Items written through a stream transform are fetched whole and decoded as on load (zstd, or
a custom transform of the ``extension_registry`` given). :meth:`Source.equal` compares two
tensors' bytes slab by slab (the proof of a tie, :mod:`~dcp_volumes.export._ties`).
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.distributed._shard._utils import narrow_tensor_by_index
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import LoadPlan, LoadPlanner, ReadItem
from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list

from dcp_volumes import errors
from dcp_volumes._manifest import Manifest
from dcp_volumes.backends import Backend, CallStats
from dcp_volumes.config import TransferOptions
from dcp_volumes.export._plan import PlannedTensor, SourceItem
from dcp_volumes.export._work import Slab, slabs
from dcp_volumes.loading.apply import PlannerTarget
from dcp_volumes.loading.needs import Need, plan_needs, plan_ranges
from dcp_volumes.loading.serve import serve
from dcp_volumes.loading.sources import StoreSource
from dcp_volumes.transfer.download import RangeRequest

__all__ = ["Round", "SlabTarget", "Source", "source_items"]

#: a stored chunk at most this big may be fetched whole for each slab it overlaps
_WHOLE_CHUNK_OK = 4 << 20


def source_items(metadata: Metadata) -> list[SourceItem]:
    """The planning view of ``.metadata``: each item's fqn, dtype name and global shape."""
    out = []
    for fqn, md in metadata.state_dict_metadata.items():
        if isinstance(md, TensorStorageMetadata):
            dtype = str(md.properties.dtype).removeprefix("torch.")
            out.append(SourceItem(fqn, dtype, tuple(int(d) for d in md.size)))
        else:
            out.append(SourceItem(fqn, None))
    return out


class SlabTarget(LoadPlanner):
    """The serve path's target for one round: ``read.dest_index`` names a slab buffer
    (``(fqn, slab offsets)``), and ``dest_offsets``/``lengths`` a block inside it."""

    def __init__(self, buffers: dict[tuple[str, tuple[int, ...]], torch.Tensor]) -> None:
        self.buffers = buffers

    def resolve_tensor(self, read: ReadItem) -> torch.Tensor:
        buf = self.buffers[(read.dest_index.fqn, tuple(read.dest_index.offset or ()))]
        return narrow_tensor_by_index(buf, read.dest_offsets, read.lengths)

    def commit_tensor(self, read: ReadItem, tensor: torch.Tensor) -> None:
        pass  # the bytes are in the slab buffer already

    def load_bytes(self, read: ReadItem, value: Any) -> None:
        raise errors.IntegrityError(f"{read.storage_index.fqn!r} is not a tensor")

    def set_up_planner(self, *args: Any, **kwargs: Any) -> None:
        raise NotImplementedError

    def create_local_plan(self) -> LoadPlan:
        raise NotImplementedError

    def create_global_plan(self, global_plan: list[LoadPlan]) -> list[LoadPlan]:
        raise NotImplementedError

    def finish_plan(self, central_plan: LoadPlan) -> LoadPlan:
        raise NotImplementedError


@dataclass
class Round:
    """Slabs fetched together: their needs and the coalesced ranges serving them."""

    slabs: list[Slab] = field(default_factory=list)
    reads: list[ReadItem] = field(default_factory=list)
    needs: list[Need] = field(default_factory=list)
    ranges: list[RangeRequest] = field(default_factory=list)
    nbytes: int = 0


class Source:
    """A committed checkpoint opened for export (its ``.metadata`` and manifest read)."""

    def __init__(self, backend: Backend, metadata: Metadata, manifest: Manifest | None,
                 url: str, transfer: TransferOptions, registry: Any = None) -> None:
        if metadata.storage_data is None:
            raise errors.IntegrityError(f"{url}: .metadata has no storage_data")
        self.backend = backend
        self.metadata = metadata
        self.manifest = manifest
        self.url = url
        self.transfer = transfer
        self.registry = registry  # torch's ExtensionRegistry for custom stream transforms
        self.stats = CallStats()
        self.store = StoreSource(backend, url, max_concurrency=transfer.max_concurrency,
                                 chunk_size=transfer.part_size, stats=self.stats)

    @property
    def bytes_fetched(self) -> int:
        return self.store.fetched

    def _md(self, fqn: str) -> TensorStorageMetadata:
        md = self.metadata.state_dict_metadata[fqn]
        assert isinstance(md, TensorStorageMetadata)
        return md

    def sliceable(self, fqn: str) -> bool:
        """Whether row slabs of ``fqn`` can be fetched without reading any big stored chunk
        whole more than once: every chunk is small, or has per-block checksums."""
        md = self._md(fqn)
        for chunk in md.chunks:
            info = self.metadata.storage_data[MetadataIndex(fqn, chunk.offsets)]
            if getattr(info, "transform_descriptors", None):
                return False  # compressed: decoded whole, so once per tensor, not per slab
            if int(info.length) <= _WHOLE_CHUNK_OK:
                continue
            files = self.manifest.files if self.manifest is not None else {}
            entry = files.get(info.relative_path)
            item = entry.items.get(int(info.offset)) if entry is not None else None
            if item is None or item.data_offset is None:
                return False
        return True

    def rounds(self, tensors: Sequence[PlannedTensor], budget: int) -> list[Round]:
        """``tensors`` (one file's, in data order) as rounds of about ``budget`` source bytes,
        every range checked against its object's size before any GET."""
        rounds: list[Round] = [Round()]
        for t in tensors:
            if t.nbytes == 0:
                continue
            for slab in slabs(t, budget, sliceable=self.sliceable(t.source)):
                if rounds[-1].slabs and rounds[-1].nbytes + slab.source_nbytes > budget:
                    rounds.append(Round())
                rounds[-1].slabs.append(slab)
                rounds[-1].nbytes += slab.source_nbytes
        for r in rounds:
            for slab in r.slabs:
                r.reads.extend(self._reads(slab))
            r.needs = plan_needs(r.reads, self.metadata.storage_data, self.manifest, self.url,
                                 self.metadata, self.registry)
            r.ranges = plan_ranges(r.needs, gap=self.transfer.coalesce_gap,
                                   max_size=self.transfer.max_range_size)
        self.store.check([rng for r in rounds for rng in r.ranges])
        return [r for r in rounds if r.slabs]

    def _reads(self, slab: Slab) -> list[ReadItem]:
        fqn = slab.tensor.source
        chunk = ChunkStorageMetadata(offsets=torch.Size(slab.offsets),
                                     sizes=torch.Size(slab.shape))
        reads = create_read_items_for_chunk_list(fqn, self._md(fqn), [chunk])
        covered = sum(math.prod(r.lengths) for r in reads)
        if covered != math.prod(slab.shape):
            raise errors.IntegrityError(
                f"the stored chunks of {fqn!r} in {self.url} cover {covered} of the "
                f"{math.prod(slab.shape)} elements of rows {slab.start}..{slab.stop}: its "
                ".metadata is damaged; save the checkpoint again")
        return reads

    def fetch(self, rnd: Round) -> list[torch.Tensor]:
        """The slabs of ``rnd``, in order, in their source dtype (checked bytes only)."""
        buffers = {(s.tensor.source, s.offsets): torch.empty(
            s.shape, dtype=getattr(torch, s.tensor.source_dtype)) for s in rnd.slabs}
        serve(self.store, rnd.ranges, PlannerTarget(SlabTarget(buffers)), url=self.url,
              last=True)
        return [buffers[(s.tensor.source, s.offsets)] for s in rnd.slabs]

    def _flat(self, t: PlannedTensor, budget: int) -> Iterator[torch.Tensor]:
        for rnd in self.rounds([t], budget):
            for slab in self.fetch(rnd):
                yield slab.reshape(-1).view(torch.uint8)

    def equal(self, a: PlannedTensor, b: PlannedTensor, budget: int) -> bool:
        """Whether ``a`` and ``b`` (one dtype and shape) hold the same bytes: fetched a
        round of each at a time, stopping at the first round that differs."""
        if (a.source_dtype, a.shape) != (b.source_dtype, b.shape):
            return False
        xs, ys = self._flat(a, budget), self._flat(b, budget)
        x = y = torch.empty(0, dtype=torch.uint8)
        while True:
            if not len(x):
                x = next(xs, x)
            if not len(y):
                y = next(ys, y)
            n = min(len(x), len(y))
            if n == 0:
                return len(x) == len(y)  # both ended (the shapes match, so they do together)
            if not torch.equal(x[:n], y[:n]):
                return False
            x, y = x[n:], y[n:]
