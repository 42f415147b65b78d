"""The integrity manifest, safe unpickling of ``.metadata``, and the atomic commit.

The manifest is a small JSON sidecar named after the save id::

    {"format": 1, "save_id": "...", "writer": "dcp_volumes 0.1.0", "torch": "2.13.0",
     "world_size": 2, "created": 1764412345.1,
     "files": {"__0_0-<id>.distcp": {"size": 123, "items": [[offset, length, crc32c], ...]}}}

``.metadata`` is committed last, with a conditional create when ``overwrite`` is off:
S3 ``If-None-Match: *``, GCS ``ifGenerationMatch=0``, Azure ``overwrite=False``, local
``link(2)`` of a fully written temp file (fails if the name exists).
"""

from __future__ import annotations

import asyncio
import io
import json
import os
import pickle
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta

from dcp_volumes import _layout, errors
from dcp_volumes._fs import Backend, CallStats, redact_url, s3_checksum
from dcp_volumes._layout import METADATA, check_relative_path

__all__ = ["FileEntry", "ItemEntry", "Manifest", "commit_metadata", "load_metadata"]

FORMAT_VERSION = 1
_memory_commit_lock = threading.Lock()


@dataclass(frozen=True)
class ItemEntry:
    """One stored item. ``data_offset`` etc. are set for large contiguous tensors: their raw
    bytes start ``data_offset`` bytes into the item, with a CRC32C per ``block_size`` block."""

    length: int
    crc: int
    data_offset: int | None = None
    block_size: int = 0
    block_crcs: tuple[int, ...] = ()
    shape: tuple[int, ...] = ()
    dtype: str = ""

    def to_json(self, offset: int) -> list[Any]:
        out: list[Any] = [offset, self.length, self.crc]
        if self.data_offset is not None:
            out.append({"data": self.data_offset, "block": self.block_size,
                        "crcs": list(self.block_crcs), "shape": list(self.shape),
                        "dtype": self.dtype})
        return out

    @classmethod
    def from_json(cls, row: list[Any]) -> tuple[int, ItemEntry]:
        offset, length, crc = int(row[0]), int(row[1]), int(row[2])
        if len(row) > 3 and isinstance(row[3], dict):
            d = row[3]
            return offset, cls(length, crc, int(d["data"]), int(d["block"]),
                               tuple(int(c) for c in d["crcs"]),
                               tuple(int(x) for x in d["shape"]), str(d["dtype"]))
        return offset, cls(length, crc)


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

    def to_json(self) -> bytes:
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
            return cls(save_id=str(doc["save_id"]), writer=str(doc.get("writer", "?")),
                       world_size=int(doc.get("world_size", 0)),
                       created=float(doc.get("created", 0.0)), files=files,
                       torch=str(doc.get("torch", "")))
        except errors.DCPVolumesError:
            raise
        except (ValueError, KeyError, TypeError, AttributeError) as exc:
            raise errors.IntegrityError(f"manifest {where} is not valid: {type(exc).__name__}") \
                from exc


# --------------------------------------------------------------------------------------
# .metadata: restricted unpickling
# --------------------------------------------------------------------------------------
_ALLOWED: dict[str, frozenset[str]] = {
    "torch.distributed.checkpoint.metadata": frozenset({
        "Metadata", "StorageMeta", "TensorStorageMetadata", "BytesStorageMetadata",
        "ChunkStorageMetadata", "TensorProperties", "MetadataIndex", "_MEM_FORMAT_ENCODING",
    }),
    "torch.distributed.checkpoint.filesystem": frozenset({"_StorageInfo", "_StoragePrefix"}),
    "torch.distributed.checkpoint.planner": frozenset({"WriteItemType", "LoadItemType"}),
    "torch.distributed.checkpoint.default_planner": frozenset(),
    "torch": frozenset({"Size", "device", "layout", "memory_format", "dtype"}),
    "torch.serialization": frozenset({"_get_layout"}),
    "collections": frozenset({"OrderedDict"}),
    "pathlib": frozenset({"PosixPath", "PurePosixPath", "WindowsPath", "PureWindowsPath"}),
    "builtins": frozenset({"set", "frozenset", "tuple", "list", "dict", "getattr", "slice",
                           "complex", "bytearray"}),
    "enum": frozenset(),
    "datetime": frozenset({"datetime", "timedelta", "timezone"}),
}


class _SafeUnpickler(pickle.Unpickler):
    """Unpickler that only builds the classes a torch ``Metadata`` is made of."""

    def find_class(self, module: str, name: str) -> Any:
        if module == "torch" and isinstance(getattr(torch, name, None),
                                            (torch.dtype, torch.layout, torch.memory_format)):
            return getattr(torch, name)
        allowed = _ALLOWED.get(module)
        if allowed is None or name not in allowed:
            raise errors.UnsafeCheckpointError(
                f".metadata references {module}.{name}, which is not part of a torch DCP "
                "Metadata; refusing to unpickle it (the checkpoint may be malicious or written "
                "by an incompatible tool)"
            )
        obj = super().find_class(module, name)
        if module == "builtins" and name == "getattr":
            return _safe_getattr
        return obj


def _safe_getattr(obj: Any, name: str, *default: Any) -> Any:
    # Pickles of torch.dtype use getattr(torch, "float32"); allow nothing else.
    if obj is torch and isinstance(getattr(torch, name, None),
                                   (torch.dtype, torch.layout, torch.memory_format)):
        return getattr(torch, name)
    raise errors.UnsafeCheckpointError(f".metadata calls getattr on {type(obj).__name__}.{name}")


def load_metadata(data: bytes, *, where: str) -> Metadata:
    """Unpickle ``.metadata`` bytes with the allow-list, and check its stored paths."""
    try:
        metadata = _SafeUnpickler(io.BytesIO(data)).load()
    except errors.DCPVolumesError:
        raise
    except Exception as exc:
        raise errors.IntegrityError(f"{where} is not a readable torch DCP .metadata "
                                    f"({type(exc).__name__})") from exc
    if not isinstance(metadata, Metadata):
        raise errors.UnsafeCheckpointError(f"{where} does not hold a torch DCP Metadata")
    storage_data = metadata.storage_data
    if not isinstance(storage_data, dict):
        raise errors.IntegrityError(f"{where} has no storage_data: not a file-based checkpoint")
    for info in storage_data.values():
        check_relative_path(getattr(info, "relative_path", None))
    return metadata


def metadata_save_id(metadata: Metadata) -> str | None:
    meta = getattr(metadata, "storage_meta", None)
    return getattr(meta, "save_id", None) if meta is not None else None


def volume_save_id(metadata: Metadata) -> str | None:
    """The save id when VolumeWriter wrote this checkpoint (so a manifest must exist)."""
    save_id = metadata_save_id(metadata)
    if not _layout.is_save_id(save_id):
        return None
    paths = (info.relative_path for info in metadata.storage_data.values())
    return save_id if any(_layout.save_id_of(p) == save_id for p in paths) else None


async def read_manifest(backend: Backend, metadata: Metadata) -> Manifest | None:
    """The manifest of the save ``metadata`` commits; None for torch-written checkpoints.

    Raises:
        IntegrityError: VolumeWriter wrote the checkpoint but its manifest is missing,
            unreadable, or belongs to another save.
    """
    save_id = volume_save_id(metadata)
    if save_id is None:
        return None
    name = _layout.manifest_name(save_id)
    try:
        data = await backend.cat(name, op="read")
    except errors.ObjectNotFoundError:
        raise errors.IntegrityError(
            f"{redact_url(backend.url)} was written by VolumeWriter but its manifest {name} is "
            "missing: the checkpoint was modified; pass verify=False to load it unverified"
        ) from None
    manifest = Manifest.from_json(data, where=backend.object_url(name))
    if manifest.save_id != save_id:
        raise errors.IntegrityError(
            f"manifest {name} belongs to save {manifest.save_id}, not {save_id}")
    return manifest


def set_save_id(metadata: Metadata, save_id: str, checkpoint_url: str) -> None:
    if metadata.storage_meta is None:
        metadata.storage_meta = StorageMeta()
    metadata.storage_meta.save_id = save_id
    metadata.storage_meta.checkpoint_id = redact_url(checkpoint_url)


# --------------------------------------------------------------------------------------
# Commit
# --------------------------------------------------------------------------------------
async def _commit_local(backend: Backend, data: bytes, *, exclusive: bool, save_id: str) -> None:
    final = backend.path(METADATA)
    tmp = backend.path(f"{METADATA}.{save_id}.tmp")

    def _do() -> None:
        os.makedirs(os.path.dirname(final), exist_ok=True)
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        try:
            if exclusive:
                os.link(tmp, final)  # atomic; EEXIST if another save committed
                os.unlink(tmp)
            else:
                os.replace(tmp, final)
        except BaseException:
            try:
                os.unlink(tmp)
            except OSError:
                pass
            raise
        dfd = os.open(os.path.dirname(final), os.O_RDONLY)
        try:
            os.fsync(dfd)
        finally:
            os.close(dfd)

    await asyncio.to_thread(_do)


async def _commit_memory(backend: Backend, data: bytes, *, exclusive: bool) -> None:
    path = backend.path(METADATA)
    with _memory_commit_lock:
        if exclusive and backend.fs.exists(path):
            raise FileExistsError(path)
        backend.fs.pipe_file(path, data)


async def _commit_s3(backend: Backend, data: bytes, *, exclusive: bool) -> None:
    bucket, key, _ = backend.fs.split_path(backend.path(METADATA))
    s3 = await backend.fs.set_session()
    kwargs: dict[str, Any] = {"IfNoneMatch": "*"} if exclusive else {}
    # Raw client: SeaweedFS answers a failed If-None-Match without the field s3fs needs to
    # raise FileExistsError; the HTTP 412 is visible here and translated in one place.
    await s3.put_object(Bucket=bucket, Key=key, Body=data, **kwargs, **s3_checksum(data))


async def _commit_generic(backend: Backend, data: bytes, *, exclusive: bool) -> None:
    path = backend.path(METADATA)
    if backend.kind == "azure":
        await backend.azure_blob(METADATA).upload_blob(data, overwrite=not exclusive,
                                                       retry_total=0)
    elif exclusive:
        await backend.fs_call("pipe_file", path, data, mode="create")
    else:
        await backend.fs_call("pipe_file", path, data)


async def _try_commit(backend: Backend, data: bytes, *, exclusive: bool, save_id: str) -> None:
    if backend.kind == "local":
        await _commit_local(backend, data, exclusive=exclusive, save_id=save_id)
    elif backend.kind == "memory":
        await _commit_memory(backend, data, exclusive=exclusive)
    elif backend.kind == "s3":
        await _commit_s3(backend, data, exclusive=exclusive)
    else:
        await _commit_generic(backend, data, exclusive=exclusive)


async def commit_metadata(
    backend: Backend,
    metadata_bytes: bytes,
    *,
    exclusive: bool,
    save_id: str,
    stats: CallStats,
) -> None:
    """Write ``.metadata`` in one atomic operation (conditional create if ``exclusive``).

    Raises:
        CheckpointExistsError: ``exclusive`` and another save's ``.metadata`` is there.
    """
    url = backend.object_url(METADATA)
    try:
        await backend.call(
            lambda: _try_commit(backend, metadata_bytes, exclusive=exclusive, save_id=save_id),
            op="commit", url=url, stats=stats,
        )
    except errors.CheckpointExistsError:
        # A retried conditional PUT whose first attempt landed sees its own object: check.
        try:
            current = await backend.cat(METADATA, op="read")
            if metadata_save_id(load_metadata(current, where=url)) == save_id:
                return
        except errors.DCPVolumesError:
            pass
        raise errors.CheckpointExistsError(
            f"{redact_url(backend.url)} was committed by another save while this one uploaded; "
            "this save's shards were removed. Use a new path, or overwrite=True to replace it"
        ) from None

