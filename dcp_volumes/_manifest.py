"""The integrity manifest's format, built from the ranks' results.

The manifest is a small JSON sidecar named after the save id::

    {"format": 1, "save_id": "...", "writer": "dcp_volumes 0.1.0", "torch": "2.13.0",
     "world_size": 2, "created": 1764412345.1,
     "files": {"__0_0-<id>.distcp": {"size": 123, "items": [[offset, length, crc32c], ...]}}}

How a save is committed lives in :mod:`dcp_volumes._commit`; the allow-listed unpickling of
``.metadata`` in :mod:`dcp_volumes._metadata`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import hashlib
import json
import math
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.distributed.checkpoint.storage import WriteResult

from dcp_volumes import errors
from dcp_volumes._layout import check_relative_path

__all__ = ["CheckedWriteResult", "FileEntry", "ItemEntry", "Manifest", "item_dtype",
           "manifest_of", "paused_gc"]

FORMAT_VERSION = 1


@dataclass(frozen=True, slots=True)
class ItemEntry:
    """One stored item. ``data_offset`` etc. are set for large contiguous tensors: their raw
    bytes start ``data_offset`` bytes into the item, with a CRC32C per ``block_size`` block.

    ``checked`` is False only for entries the code builds itself for bytes that carry no
    checksum (:meth:`raw`: a safetensors tensor); it is no JSON field, so a manifest read
    from storage always has every entry checked."""

    length: int
    crc: int
    data_offset: int | None = None
    block_size: int = 0
    block_crcs: tuple[int, ...] = ()
    shape: tuple[int, ...] = ()
    dtype: str = ""
    checked: bool = True

    @classmethod
    def raw(cls, length: int, dtype: str, shape: tuple[int, ...], element_size: int
            ) -> ItemEntry:
        """An item that is a tensor's raw bytes (C order) and nothing else, with no checksum:
        any element range of it can be fetched alone (blocks of one element)."""
        return cls(length, 0, data_offset=0, block_size=element_size, shape=shape,
                   dtype=dtype, checked=False)

    def to_json(self, offset: int) -> list[Any]:
        if not self.checked:
            raise errors.DCPVolumesError("an entry with no checksum is never written to a "
                                         "manifest")
        out: list[Any] = [offset, self.length, self.crc]
        if self.data_offset is not None:
            out.append({"data": self.data_offset, "block": self.block_size,
                        "crcs": list(self.block_crcs), "shape": list(self.shape),
                        "dtype": self.dtype})
        return out

    @classmethod
    def from_json(cls, row: list[Any]) -> tuple[int, ItemEntry]:
        offset, length, crc = int(row[0]), int(row[1]), int(row[2])
        if offset < 0 or length < 0 or not 0 <= crc <= 0xFFFFFFFF:
            raise ValueError("negative offset/length or a CRC out of range")
        if len(row) > 3 and isinstance(row[3], dict):
            d = row[3]
            entry = cls(length, crc, int(d["data"]), int(d["block"]),
                        tuple(int(c) for c in d["crcs"]),
                        tuple(int(x) for x in d["shape"]), str(d["dtype"]))
            entry._check_layout()
            return offset, entry
        return offset, cls(length, crc)

    def _check_layout(self) -> None:
        """A crafted layout must not steer reads outside the item or divide by zero."""
        dtype = getattr(torch, self.dtype, None)
        if not isinstance(dtype, torch.dtype):
            raise TypeError(f"unknown dtype {self.dtype!r}")
        if (self.block_size < 1 or self.data_offset is None or len(self.shape) > 64
                or any(not 0 <= x < 2**63 for x in self.shape)):
            raise ValueError("bad block size or shape")
        element = torch.empty((), dtype=dtype).element_size()
        if self.block_size % element:
            raise ValueError("a block size that cuts through an element")
        nbytes = math.prod(self.shape) * element
        if not 0 <= self.data_offset <= self.length - nbytes:
            raise ValueError("tensor data outside its item")
        if len(self.block_crcs) != -(-nbytes // self.block_size):
            raise ValueError("block CRC count does not match the data size")


def item_dtype(metadata: Any, fqn: str, chunk_offset: Any, entry: ItemEntry | None,
               what: str) -> torch.dtype | None:
    """The dtype of a stored tensor item as ``.metadata`` and the manifest both record it
    (``None`` for a non-tensor item or without ``metadata``).

    The manifest records the dtype and shape of a large tensor's raw bytes (its layout);
    ``.metadata`` the dtype of every tensor and the shape of every chunk. A lie in either one
    would have the checked bytes read as another dtype (``verified`` and wrong), so they must
    agree before a byte is reinterpreted; an item stored whole is compared with the dtype
    ``torch.save`` recorded in it once it is unpickled (``loading.apply``).

    Raises:
        IntegrityError: the two disagree on the item's dtype or shape.
    """
    md: Any = getattr(metadata, "state_dict_metadata", {}).get(fqn)
    dtype = getattr(getattr(md, "properties", None), "dtype", None)
    if not isinstance(dtype, torch.dtype):
        return None
    if entry is None or entry.data_offset is None:
        return dtype
    named = str(dtype).removeprefix("torch.")
    if entry.dtype != named:
        raise errors.IntegrityError(
            f"{what}: .metadata says dtype {named}, the manifest {entry.dtype[:40]}: the "
            "checkpoint was damaged or crafted; refusing to read its bytes as either")
    offset = tuple(chunk_offset or ())
    sizes = next((tuple(c.sizes) for c in md.chunks if tuple(c.offsets) == offset), None)
    if sizes is not None and sizes != entry.shape:
        raise errors.IntegrityError(
            f"{what}: .metadata says shape {sizes}, the manifest {entry.shape}: the "
            "checkpoint was damaged or crafted; refusing to read its bytes as either")
    return dtype


@dataclass
class FileEntry:
    size: int = 0
    items: dict[int, ItemEntry] = field(default_factory=dict)  # offset → entry


@dataclass
class Manifest:
    save_id: str
    writer: str
    world_size: int
    created: float = field(default_factory=time.time)
    files: dict[str, FileEntry] = field(default_factory=dict)
    torch: str = field(default_factory=lambda: torch.__version__)
    #: SHA-256 of the bytes this manifest was read from or encoded to ("" before either)
    sha256: str = field(default="", compare=False)

    def to_json(self) -> bytes:
        with paused_gc():
            data = self._to_json()
        self.sha256 = hashlib.sha256(data).hexdigest()
        return data

    def _to_json(self) -> bytes:
        return json.dumps(
            {
                "format": FORMAT_VERSION,
                "save_id": self.save_id,
                "writer": self.writer,
                "torch": self.torch,
                "world_size": self.world_size,
                "created": self.created,
                "files": {
                    name: {"size": e.size,
                           "items": [it.to_json(off) for off, it in sorted(e.items.items())]}
                    for name, e in sorted(self.files.items())
                },
            },
            separators=(",", ":"),
        ).encode()

    @classmethod
    def from_json(cls, data: bytes, *, where: str) -> Manifest:
        with paused_gc():
            return cls._from_json(data, where=where)

    @classmethod
    def _from_json(cls, data: bytes, *, where: str) -> Manifest:
        try:
            doc = json.loads(data)
            if doc.get("format") != FORMAT_VERSION:
                raise errors.IntegrityError(
                    f"manifest {where} has format {doc.get('format')!r}; this dcp_volumes reads "
                    f"format {FORMAT_VERSION}: upgrade dcp_volumes"
                )
            files: dict[str, FileEntry] = {}
            for name, entry in doc["files"].items():
                check_relative_path(name)
                items = dict(ItemEntry.from_json(row) for row in entry["items"])
                files[name] = FileEntry(size=int(entry["size"]), items=items)
            created = float(doc.get("created", 0.0))
            if not math.isfinite(created):
                raise ValueError("created is not a finite number")
            return cls(save_id=str(doc["save_id"]), writer=str(doc.get("writer", "?")),
                       world_size=int(doc.get("world_size", 0)), created=created,
                       files=files, torch=str(doc.get("torch", "")),
                       sha256=hashlib.sha256(data).hexdigest())
        except errors.DCPVolumesError:
            raise
        except (ValueError, KeyError, TypeError, AttributeError, OverflowError,
                RecursionError) as exc:
            raise errors.IntegrityError(f"manifest {where} is not valid: {type(exc).__name__}") \
                from exc


@dataclasses.dataclass(frozen=True)
class CheckedWriteResult(WriteResult):
    """A WriteResult that also carries the item's CRC32C (and block layout) to the
    coordinator, which builds the manifest from them (:func:`manifest_of`)."""

    crc32c: int
    layout: ItemEntry | None = None


def manifest_of(save_id: str, writer: str, results: list[list[WriteResult]]) -> Manifest:
    """The integrity manifest of a save from every rank's write results."""
    manifest = Manifest(save_id=save_id, writer=writer, world_size=len(results))
    for rank_results in results:
        for wr in rank_results:
            if not isinstance(wr, CheckedWriteResult):
                raise errors.DCPVolumesError(
                    f"a write result of item {wr.index} carries no checksum: it was not "
                    "written by VolumeWriter.write_data (a custom planner or writer mixed in?)"
                )
            info = wr.storage_data
            entry = manifest.files.setdefault(info.relative_path, FileEntry())
            entry.items[info.offset] = wr.layout or ItemEntry(info.length, wr.crc32c)
            entry.size = max(entry.size, info.offset + info.length)
    return manifest


@contextlib.contextmanager
def paused_gc() -> Iterator[None]:
    """Python's cyclic garbage collector paused meanwhile.

    Building a million small objects (unpickling ``.metadata``, a manifest) triggers a full
    collection again and again, each one walking every object built so far: 7x the time of
    the build itself at 100k items. Nothing built here is cyclic garbage. Process-wide;
    re-enabled only by whoever paused it."""
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()
