"""What one checkpoint holds: state-dict keys, dtypes, shapes, sizes, and how it was saved."""

from __future__ import annotations

import os
import re
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any

from dcp_volumes import _layout
from dcp_volumes.backends import ObjectInfo, redact_url
from dcp_volumes.catalog._committed import CommittedSave, load_committed
from dcp_volumes.catalog._common import open_root, save_id_time
from dcp_volumes.catalog._scan import list_objects

if TYPE_CHECKING:
    from torch.distributed.checkpoint.metadata import Metadata

__all__ = ["CheckpointDetails", "EntryInfo", "describe"]

_RANK_RE = re.compile(r"^__(\d+)_\d+")


@dataclass(frozen=True)
class EntryInfo:
    """One state-dict entry of a checkpoint.

    Attributes:
        key: the fully qualified name, e.g. ``"model.layer.weight"``.
        kind: ``"tensor"`` or ``"bytes"`` (a pickled non-tensor object).
        dtype: e.g. ``"float32"`` (tensors only).
        shape: the global shape (tensors only).
        nbytes: ``numel * element size`` (tensors only).
        stored_bytes: bytes this entry takes in the shard files (all chunks, with torch's
            serialization overhead).
        chunks: how many pieces it was saved in.
    """

    key: str
    kind: str
    dtype: str | None
    shape: list[int] | None
    nbytes: int | None
    stored_bytes: int
    chunks: int


@dataclass(frozen=True)
class CheckpointDetails:
    """What :func:`describe` reports about one checkpoint.

    Attributes:
        url: the checkpoint.
        save_id: the committed save's id (``None`` if not written by dcp_volumes).
        save_time: epoch seconds of the save (manifest, else ``.metadata``'s modification time,
            else the save id's timestamp).
        writer: e.g. ``"dcp_volumes 0.1.0"``, or ``None`` without a manifest.
        torch_version: torch version at save (from the manifest).
        world_size: ranks at save (from the manifest; ``None`` if unknown).
        ranks_in_files: distinct ranks that wrote shard files (from their names).
        files: number of shard files.
        objects: objects stored under the checkpoint.
        total_bytes: their total size.
        checksummed: a manifest with checksums exists.
        entries: the state-dict entries, sorted by key.
    """

    url: str
    save_id: str | None
    save_time: float | None
    writer: str | None
    torch_version: str | None
    world_size: int | None
    ranks_in_files: int
    files: int
    objects: int
    total_bytes: int
    checksummed: bool
    entries: list[EntryInfo]

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def _entries(md: Metadata) -> list[EntryInfo]:
    """One :class:`EntryInfo` per state-dict key, sorted by key."""
    import torch
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    stored: dict[str, list[int]] = {}
    for index, info in md.storage_data.items():
        stored.setdefault(index.fqn, []).append(info.length)
    entries: list[EntryInfo] = []
    for key, item in md.state_dict_metadata.items():
        lengths = stored.get(key, [])
        if not isinstance(item, TensorStorageMetadata):
            entries.append(EntryInfo(key, "bytes", None, None, None, sum(lengths), len(lengths)))
            continue
        dtype = item.properties.dtype
        numel = 1
        for s in item.size:
            numel *= int(s)
        elem = torch.empty((), dtype=dtype).element_size()
        entries.append(
            EntryInfo(
                key,
                "tensor",
                str(dtype).removeprefix("torch."),
                [int(s) for s in item.size],
                numel * elem,
                sum(lengths),
                len(item.chunks),
            )
        )
    entries.sort(key=lambda e: e.key)
    return entries


def _save_time(save: CommittedSave, objects: list[ObjectInfo]) -> float | None:
    """The manifest's time, else ``.metadata``'s modification time, else the save id's."""
    manifest = save.manifest
    if manifest is not None and manifest.created:
        return manifest.created
    meta_obj = next((o for o in objects if o.name == _layout.METADATA), None)
    if meta_obj is not None and meta_obj.mtime:
        return meta_obj.mtime
    return save_id_time(save.save_id)


def describe(
    url: str | os.PathLike[str],
    *,
    storage_options: dict[str, Any] | None = None,
) -> CheckpointDetails:
    """Keys, shapes, dtypes and sizes of a checkpoint's state dict, and how it was saved.

    Reads ``.metadata`` (allow-listed unpickling), the manifest if any, and lists the
    checkpoint once.

    Args:
        url: checkpoint URL.
        storage_options: passed to fsspec unchanged; never logged.

    Raises:
        CheckpointNotFoundError: nothing is stored at ``url``.
        IncompleteCheckpointError: objects but no ``.metadata``.
    """
    backend = open_root(url, storage_options)
    save = load_committed(backend)
    md = save.metadata
    objects = list_objects(backend)
    files = {info.relative_path for info in md.storage_data.values()}
    ranks = {int(m.group(1)) for f in files if (m := _RANK_RE.match(f))}
    manifest = save.manifest
    return CheckpointDetails(
        url=redact_url(backend.url),
        save_id=save.save_id,
        save_time=_save_time(save, objects),
        writer=manifest.writer if manifest is not None else None,
        torch_version=save.torch_version,
        world_size=manifest.world_size if manifest is not None and manifest.world_size else None,
        ranks_in_files=len(ranks),
        files=len(files),
        objects=len(objects),
        total_bytes=sum(o.size for o in objects),
        checksummed=manifest is not None,
        entries=_entries(md),
    )
