"""What an unpickled ``.metadata`` must hold before any number in it is used.

``.metadata`` is untrusted (``DESIGN.md``, "Trust boundary"): the allow-listed unpickler
(:func:`dcp_volumes._metadata.load_metadata`) builds only torch's classes, but their fields
can still hold anything: a shape of ``[0, 10**30]``, a chunk outside its tensor, a chunk with
no stored location, a dtype that is not one. Unchecked, these reach the caller from deep
inside torch's planner as ``ValueError``, ``KeyError``, ``IndexError`` or ``RuntimeError``,
or make a reader allocate or decode what a chunk claims. :func:`check_metadata` checks them
all in one pass, before the planner sees the metadata, so each becomes an
:class:`~dcp_volumes.errors.IntegrityError` that names the item.

What it checks, per item: a tensor has a torch dtype, a shape of at most :data:`MAX_DIMS`
dimensions whose bytes fit in 63 bits, and chunks that lie inside that shape, have the same
number of dimensions, cover as many elements as the tensor has, and each have a stored
location; a non-tensor item has one; every stored location has a non-negative offset and
length. DCP's default planner checks the shape against the caller's own tensor, so a chunk
inside it is no larger than what the caller allocated.

What it cannot check, the stored bytes, is checked where they are read: the loader compares
a chunk stored whole (a ``torch.save``) with its dtype and with the shape
:func:`chunk_shapes` gives it (``dcp_volumes.loading.apply``).
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    MetadataIndex,
    TensorStorageMetadata,
)

from dcp_volumes import errors

__all__ = ["MAX_DIMS", "check_metadata", "check_tensor_item", "chunk_shapes"]

#: the most dimensions a tensor may have (torch's own limit is 64)
MAX_DIMS = 64
_LIMIT = 2**63  # torch's sizes and byte counts are signed 64-bit


def _natural(value: Any) -> bool:
    return type(value) is int and 0 <= value < _LIMIT


def _dims(value: Any) -> bool:
    """A shape: a tuple of at most :data:`MAX_DIMS` non-negative 64-bit integers."""
    if type(value) is torch.Size:  # what torch writes; it holds only ints
        return len(value) <= MAX_DIMS and (not value or (min(value) >= 0
                                                         and max(value) < _LIMIT))
    return isinstance(value, tuple) and len(value) <= MAX_DIMS and all(map(_natural, value))


def _bad(where: str, why: str) -> errors.IntegrityError:
    return errors.IntegrityError(
        f"{where} is not a usable torch DCP .metadata: {why}. It is damaged or crafted; load "
        "an earlier checkpoint, or save this one again")


def check_metadata(metadata: Any, where: str) -> None:
    """Check every item and stored location of an unpickled ``Metadata``.

    Raises:
        IntegrityError: naming the first item that does not hold together.
    """
    items = getattr(metadata, "state_dict_metadata", None)
    storage = getattr(metadata, "storage_data", None)
    if not isinstance(items, dict) or not isinstance(storage, dict):
        raise _bad(where, "its items or their stored locations are not maps")
    located: set[tuple[str, Any]] = set()
    for index, info in storage.items():
        if type(index) is not MetadataIndex or type(index.fqn) is not str:
            raise _bad(where, "a stored location is not keyed by an item")
        if not _natural(getattr(info, "offset", None)) \
                or not _natural(getattr(info, "length", None)):
            raise _bad(where, f"item {index.fqn[:200]!r} has a stored offset or length that "
                              "is not a non-negative 64-bit integer")
        located.add((index.fqn, index.offset))
    for fqn, md in items.items():
        if type(fqn) is not str:
            raise _bad(where, "an item's name is not a string")
        if type(md) is TensorStorageMetadata:
            check_tensor_item(fqn, md, located, where)
        elif type(md) is BytesStorageMetadata:
            if (fqn, None) not in located:
                raise _bad(where, f"item {fqn[:200]!r} has no stored location")
        else:
            raise _bad(where, f"item {fqn[:200]!r} is neither a tensor nor a stored object")


def check_tensor_item(fqn: str, md: TensorStorageMetadata, located: set[tuple[str, Any]],
                      where: str) -> None:
    """One tensor item: its dtype, shape and chunks (see the module's docstring);
    ``located``: the ``(fqn, offsets)`` of every stored location."""
    name = repr(fqn[:200])
    dtype = getattr(getattr(md, "properties", None), "dtype", None)
    if type(dtype) is not torch.dtype:
        raise _bad(where, f"tensor {name} has no torch dtype")
    size = md.size
    if not _dims(size):
        raise _bad(where, f"tensor {name} has a shape that is not a list of at most "
                          f"{MAX_DIMS} non-negative 64-bit integers")
    numel = math.prod(size)
    if (numel or math.prod(max(d, 1) for d in size)) * dtype.itemsize >= _LIMIT:
        raise _bad(where, f"tensor {name} has a shape {tuple(size)} too large for any tensor")
    chunks = md.chunks
    if not isinstance(chunks, list):
        raise _bad(where, f"tensor {name} has no list of chunks")
    volume = 0
    for chunk in chunks:
        offsets: Any = getattr(chunk, "offsets", None)
        sizes: Any = getattr(chunk, "sizes", None)
        if not _dims(offsets) or not _dims(sizes) or len(offsets) != len(size) \
                or len(sizes) != len(size):
            raise _bad(where, f"tensor {name} has a chunk whose offsets or sizes do not "
                              f"match its {len(size)} dimensions")
        elements = math.prod(sizes)
        if not elements:
            continue  # an empty shard (a rank with no rows): no read ever overlaps it
        if sizes != size and any(o + n > d for o, n, d in zip(offsets, sizes, size)) \
                or sizes == size and any(offsets):
            raise _bad(where, f"tensor {name} of shape {tuple(size)} has a chunk at "
                              f"{tuple(offsets)} of {tuple(sizes)} that lies outside it")
        if (fqn, offsets) not in located:
            raise _bad(where, f"tensor {name} has a chunk at {tuple(offsets)} with no stored "
                              "location")
        volume += elements
    if volume != numel:
        raise _bad(where, f"the chunks of tensor {name} hold {volume} elements, its shape "
                          f"{tuple(size)} has {numel}")


def chunk_shapes(metadata: Any, fqns: Iterable[str]
                 ) -> dict[tuple[str, tuple[int, ...]], tuple[int, ...]]:
    """The shape of every chunk of the tensors ``fqns``, keyed by ``(fqn, offsets)`` (a
    checked ``Metadata``; anything else gives none): one pass per call, so a rank reading
    every chunk of a tensor sharded a thousand ways does not search its chunks per read."""
    items = getattr(metadata, "state_dict_metadata", None)
    out: dict[tuple[str, tuple[int, ...]], tuple[int, ...]] = {}
    if not isinstance(items, dict):
        return out
    for fqn in fqns:
        md = items.get(fqn)
        if type(md) is TensorStorageMetadata:
            for chunk in md.chunks:
                out[(fqn, tuple(chunk.offsets))] = tuple(chunk.sizes)
    return out
