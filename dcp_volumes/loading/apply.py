"""Checked bytes into the planner's targets: a whole stored item deserialized as torch's
``FileSystemReader`` does (pickled objects through the allow-list first), a block-read
tensor's elements copied out of their blocks, or a tensor's raw bytes read straight into its
target's memory (:class:`DirectTarget`)."""

from __future__ import annotations

import io
import math
import pickle
import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, cast

import torch
from torch.distributed._shard._utils import narrow_tensor_by_index
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlanner, ReadItem

from dcp_volumes import errors
from dcp_volumes._manifest import ItemEntry
from dcp_volumes.loading.needs import Need, contiguous_strides, describe, element_span
from dcp_volumes.transfer import transforms
from dcp_volumes.transfer.download import Memory

__all__ = ["ALWAYS_SAFE", "DirectTarget", "PlannerTarget", "apply_need", "check_object_item",
           "direct_target"]


def apply_need(need: Need, chunk: memoryview, planner: LoadPlanner,
               trusted: Sequence[Any] = ()) -> None:
    """Deserialize the fetched bytes into the planner's targets.

    ``trusted``: globals (classes, functions) a pickled non-tensor item may reference on
    top of what torch's weights-only unpickler allows.
    """
    if need.first_block is None:
        what = f"{describe(need.reads[0])} in shard {need.relative}"
        if need.transforms:
            chunk = transforms.decode(need.transforms, chunk, limit=need.decoded_limit,
                                      what=what, registry=need.registry)
            transforms.check_zip_crcs(chunk, what)
        else:
            transforms.check_untransformed(chunk, what)
        for read in need.reads:
            _apply_item(read, chunk, planner, trusted, decoded=bool(need.transforms),
                        dtype=need.dtype, shape=need.shape)
        return
    entry = cast(ItemEntry, need.entry)
    dtype = getattr(torch, entry.dtype)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # read-only buffer: we only copy out of it
        flat = torch.frombuffer(chunk, dtype=dtype) if len(chunk) else torch.empty(0, dtype=dtype)
    strides = contiguous_strides(entry.shape)
    base = need.first_block * entry.block_size // flat.element_size()
    for read in need.reads:
        if not math.prod(read.lengths):
            _copy_into(read, torch.empty(tuple(read.lengths), dtype=dtype), planner)
            continue
        first, _ = element_span(read, strides)
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
                dtype: torch.dtype | None = None,
                shape: tuple[int, ...] | None = None) -> None:
    """Deserialize one whole stored item exactly as torch's FileSystemReader does.
    ``decoded``: the bytes were decoded from a stream transform, so one that is not a
    readable tensor is damaged data (an ``IntegrityError``), not a format torch rejects.
    ``dtype`` / ``shape``: the stored chunk's, as ``.metadata`` records them (None: not
    known), which the unpickled tensor must have."""
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
    _check_shape(read, tensor, shape)
    _copy_into(read, narrow_tensor_by_index(tensor, read.storage_offsets, read.lengths), planner)


def _check_shape(read: ReadItem, tensor: torch.Tensor, shape: tuple[int, ...] | None) -> None:
    """The unpickled chunk must have the shape ``.metadata`` gives it (or, not known, hold
    the read): a claim that does not match would narrow it out of range (torch's
    ``IndexError``) or load part of a larger tensor as the whole."""
    held = tuple(tensor.shape)
    if shape is not None:
        fits = held == shape
    else:
        fits = len(held) == len(read.storage_offsets) and all(
            o + n <= d for o, n, d in zip(read.storage_offsets, read.lengths, held))
    if not fits:
        claimed = shape if shape is not None else tuple(read.lengths)
        raise errors.IntegrityError(
            f"{describe(read)}: .metadata says its stored chunk has shape {claimed}, the "
            f"stored item holds a tensor of shape {held}: the checkpoint was damaged or "
            "crafted; refusing to load it")


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

    def bytes_view(self) -> memoryview:
        """The target's memory as bytes (:class:`~dcp_volumes.transfer.download.Memory`)."""
        return self.view.numpy().data.cast("B")


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
    first, stop = element_span(read, contiguous_strides(entry.shape))
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


class PlannerTarget:
    """DCP's load planner as the serve path's target (:class:`~dcp_volumes.loading.serve.
    Target`): checked bytes deserialized or copied into the planner's tensors, or, where a
    source read them straight into a tensor's memory, that tensor committed.

    ``trusted``: globals (classes, functions) a pickled non-tensor item may reference on
    top of what torch's weights-only unpickler allows.
    """

    def __init__(self, planner: LoadPlanner, trusted: Sequence[Any] = ()) -> None:
        self.planner = planner
        self.trusted = tuple(trusted)

    def apply(self, span: Need, chunk: memoryview, into: Memory | None) -> None:
        if into is not None:
            # only this target's direct() hands out memory, so ``into`` is a DirectTarget
            if not isinstance(into, DirectTarget):
                raise TypeError(f"a load's range was read into {type(into).__name__}, "
                                "not a DirectTarget this target handed out")
            # here, in order: the planner is not thread-safe
            self.planner.commit_tensor(into.read, into.target)
        else:
            apply_need(span, chunk, self.planner, self.trusted)

    def direct(self, need: Need) -> DirectTarget | None:
        """Where ``need``'s bytes can be read straight into (:func:`direct_target`)."""
        return direct_target(need, self.planner)
