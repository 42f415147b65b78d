"""torch_checkpointing's checkpoints stored as dcp_volumes checkpoints.

A committed torch_checkpointing checkpoint ``<name>`` is a dcp_volumes checkpoint directory:
``.metadata`` (torch's ``Metadata``: one bytes item per torch_checkpointing file, named by
the file's path, stored in one object) and the integrity manifest (the object's size and a
CRC32C per block), committed by :func:`dcp_volumes._commit.commit` (the manifest first,
``.metadata`` last by conditional create) and read back through the package's bounded,
allow-listed parsers. Each rank records its files the same way before the barrier, under
names of its own (:func:`record_names`), for the coordinator to gather.
"""

from __future__ import annotations

import pickle
from dataclasses import dataclass

from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import BytesStorageMetadata, Metadata, MetadataIndex

from dcp_volumes import _commit, _commit_read, _layout, errors
from dcp_volumes._manifest import FileEntry, Manifest
from dcp_volumes._metadata import load_metadata, set_save_id
from dcp_volumes.backends import Backend, CallStats, redact_url

__all__ = ["RECORD_PREFIX", "RESERVED_PREFIX", "WRITER", "Stored", "View", "commit", "read_record", "read_view",
           "record_names", "write_record"]

WRITER = "dcp_volumes.torch_checkpointing"
RESERVED_PREFIX = ".dcpv-"  #: the package's own names in a checkpoint directory
RECORD_PREFIX = f"{RESERVED_PREFIX}rank-"


@dataclass(frozen=True)
class Stored:
    """One torch_checkpointing file: the object holding it (relative to its checkpoint
    directory) and its manifest entry (size, CRC32C per block)."""

    key: str
    entry: FileEntry

    @property
    def size(self) -> int:
        return self.entry.size


#: torch_checkpointing file path (relative to its checkpoint) -> where it is stored
View = dict[str, Stored]


def record_names(rank: int, world_size: int, job: str) -> tuple[str, str]:
    """The names of rank ``rank``'s record (its ``.metadata``, its manifest) for ``job``."""
    stem = f"{RECORD_PREFIX}{rank}-of-{world_size}-{job}"
    return f"{stem}.metadata", f"{stem}.json"


def _encode(files: View, save_id: str, world_size: int, url: str) -> tuple[bytes, Manifest]:
    metadata = Metadata(
        state_dict_metadata={name: BytesStorageMetadata() for name in files},
        storage_data={MetadataIndex(name): _StorageInfo(s.key, 0, s.size)
                      for name, s in files.items()})
    set_save_id(metadata, save_id, url)
    manifest = Manifest(save_id=save_id, writer=WRITER, world_size=world_size,
                        files={s.key: s.entry for s in files.values()})
    return pickle.dumps(metadata), manifest


async def _bounded(backend: Backend, name: str, limit: int) -> bytes | None:
    size = await backend.size(name)
    if size is None:
        return None
    if size > limit:
        raise errors.UnsafeCheckpointError(
            f"{redact_url(backend.object_url(name))} is {size} bytes, over the {limit >> 20} "
            "MiB it may have: refusing to read it (damaged or crafted)")
    try:
        return await backend.cat(name, op="read")
    except errors.ObjectNotFoundError:
        return None


def _view(metadata: Metadata, manifest_data: bytes | None, *, where: str) -> View:
    """An untrusted manifest parsed by the package's parser and checked against the
    (parsed) ``.metadata``: every file one bytes item, its object in the manifest."""
    save_id = str(getattr(metadata.storage_meta, "save_id", None))
    if manifest_data is None:
        raise errors.IntegrityError(f"{where}: its manifest is missing: remove the checkpoint")
    manifest = _commit_read.parse_manifest(manifest_data, save_id=save_id, where=where)
    view: View = {}
    for index, info in metadata.storage_data.items():
        entry = manifest.files.get(info.relative_path)
        if (entry is None or info.offset != 0 or entry.size != info.length
                or set(entry.items) != {0} or entry.items[0].length != entry.size):
            raise errors.IntegrityError(f"{where}: file {str(index.fqn)[:80]!r} does not match "
                                        "its manifest: remove the checkpoint")
        view[str(index.fqn)] = Stored(info.relative_path, entry)
    return view


async def read_view(backend: Backend) -> View | None:
    """The files of the checkpoint committed at ``backend``; None when none is committed."""
    try:
        data = await _commit_read.read_metadata_bytes(backend)
    except (errors.CheckpointNotFoundError, errors.IncompleteCheckpointError):
        return None
    metadata = load_metadata(data, where=redact_url(backend.object_url(_layout.METADATA)))
    save_id = str(getattr(metadata.storage_meta, "save_id", None))
    if not _layout.is_save_id(save_id):
        raise errors.IntegrityError(f"{redact_url(backend.url)} was not committed by "
                                    "VolumeStorage: read it with the tool that wrote it")
    manifest = await _bounded(backend, _layout.manifest_name(save_id),
                              _commit_read.MAX_MANIFEST_BYTES)
    return _view(metadata, manifest, where=redact_url(backend.url))


async def write_record(backend: Backend, files: View, *, rank: int, world_size: int,
                       job: str) -> None:
    """Rank ``rank``'s record of its files: the manifest, then its ``.metadata``."""
    meta_name, manifest_name = record_names(rank, world_size, job)
    data, manifest = _encode(files, f"{job}-{rank}", world_size, backend.url)
    await backend.put(manifest_name, manifest.to_json())
    await backend.put(meta_name, data)


async def read_record(backend: Backend, *, rank: int, world_size: int, job: str
                      ) -> View | None:
    """Rank ``rank``'s record of ``job``; None when it wrote none."""
    meta_name, manifest_name = record_names(rank, world_size, job)
    data = await _bounded(backend, meta_name, _commit_read.MAX_METADATA_BYTES)
    if data is None:
        return None
    where = redact_url(backend.object_url(meta_name))
    metadata = load_metadata(data, where=where)
    if getattr(metadata.storage_meta, "save_id", None) != f"{job}-{rank}":
        raise errors.IntegrityError(f"{where} is not rank {rank}'s record of job {job}")
    return _view(metadata, await _bounded(backend, manifest_name, _commit_read.MAX_MANIFEST_BYTES),
                 where=where)


async def commit(backend: Backend, files: View, *, world_size: int) -> list[str]:
    """Commit ``files`` as the checkpoint at ``backend`` (see :mod:`dcp_volumes._commit`):
    refused unless every object is there at its size, and if a checkpoint is committed
    there already (``CheckpointExistsError``, a ``FileExistsError``). Returns the
    objects there that the commit does not name (records, earlier attempts)."""
    data, manifest = _encode(files, _layout.new_save_id(), world_size, backend.url)
    await _commit.check_durable(backend, manifest)
    await _commit.commit(backend, manifest=manifest, metadata_bytes=data, overwrite=False,
                         stats=CallStats())
    keep = {*manifest.files, _layout.manifest_name(manifest.save_id), _layout.METADATA}
    return [o.name for o in await backend.scan() if o.name not in keep]
