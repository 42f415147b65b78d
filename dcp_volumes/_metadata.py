""".metadata: allow-listed unpickling (nothing but the classes a torch DCP ``Metadata`` is
made of), its stored paths and numbers checked (:mod:`dcp_volumes._metacheck`), and the save
id it records."""

from __future__ import annotations

import io
import pickle
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta

from dcp_volumes import _layout, errors
from dcp_volumes._layout import check_relative_path
from dcp_volumes._manifest import paused_gc
from dcp_volumes._metacheck import check_metadata
from dcp_volumes.backends.translate import redact_url

__all__ = ["load_metadata", "metadata_save_id", "set_save_id", "volume_save_id"]

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
                           "complex"}),
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
        with paused_gc():
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
    checked: set[str] = set()  # a million items live in a few thousand files: check each once
    for info in storage_data.values():
        path = getattr(info, "relative_path", None)
        if isinstance(path, str) and path in checked:
            continue
        checked.add(check_relative_path(path))
    with paused_gc():  # a set of every stored location: as many objects as items
        check_metadata(metadata, where)
    return metadata


def metadata_save_id(metadata: Metadata) -> str | None:
    meta = getattr(metadata, "storage_meta", None)
    return getattr(meta, "save_id", None) if meta is not None else None


def volume_save_id(metadata: Metadata) -> str | None:
    """The save id when VolumeWriter wrote this checkpoint (so a manifest must exist).

    Ours: ``storage_meta.save_id`` has VolumeWriter's save id form and the stored files have
    its shard names (``__<rank>_<i>-<id>.distcp``). A shard's id is usually the save id, but
    a rank that reused a cached plan names its shards with an id of its own
    (``_shards.claim_shard_id``), so any id of that form counts. torch's writers use UUIDs
    and ``__<rank>_<i>.distcp``: never both forms by accident.
    """
    save_id = metadata_save_id(metadata)
    if not _layout.is_save_id(save_id):
        return None
    paths = (info.relative_path for info in metadata.storage_data.values())
    return save_id if any(_layout.save_id_of(p) is not None for p in paths) else None


def set_save_id(metadata: Metadata, save_id: str, checkpoint_url: str) -> None:
    if metadata.storage_meta is None:
        metadata.storage_meta = StorageMeta()
    metadata.storage_meta.save_id = save_id
    metadata.storage_meta.checkpoint_id = redact_url(checkpoint_url)
