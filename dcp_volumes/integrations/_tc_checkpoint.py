"""torch_checkpointing's checkpoints stored, and committed, as dcp_volumes checkpoints.

A committed torch_checkpointing checkpoint ``<name>`` is a dcp_volumes checkpoint directory:
``.metadata`` (torch's ``Metadata``: one bytes item per torch_checkpointing file, named by
the file's path, stored in one object) and the integrity manifest (the object's size and a
CRC32C per block), committed by :func:`dcp_volumes._commit.commit` (the manifest first,
``.metadata`` last by conditional create) and read back through the package's bounded,
allow-listed parsers (:func:`read_view`). Each rank records its files the same way before
the barrier, under a name of its own (:func:`record_names`); the coordinator gathers the
records of exactly this job's ranks and commits them (:func:`commit_recorded`).
"""

from __future__ import annotations

import logging
import pickle
from dataclasses import dataclass

from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import BytesStorageMetadata, Metadata, MetadataIndex

from dcp_volumes import _commit, _commit_read, _layout, errors
from dcp_volumes._manifest import FileEntry, Manifest
from dcp_volumes._metadata import load_metadata, metadata_save_id, set_save_id
from dcp_volumes.backends import Backend, CallStats, redact_url

__all__ = ["RECORD_PREFIX", "RESERVED_PREFIX", "WRITER", "Stored", "View", "commit_recorded",
           "discard", "read_record", "read_view", "record_names", "write_record"]

logger = logging.getLogger("dcp_volumes.integrations.torch_checkpointing")

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
    if manifest_data is None:
        raise errors.IntegrityError(f"{where}: its manifest is missing: remove the checkpoint")
    manifest = _commit_read.parse_manifest(manifest_data, save_id=str(metadata_save_id(metadata)),
                                           where=where)
    view: View = {}
    for index, info in metadata.storage_data.items():
        entry = manifest.files.get(info.relative_path)
        if (entry is None or info.offset != 0 or entry.size != info.length
                or set(entry.items) != {0} or entry.items[0].length != entry.size):
            raise errors.IntegrityError(f"{where}: file {str(index.fqn)[:80]!r} does not match "
                                        "its manifest: remove the checkpoint")
        view[str(index.fqn)] = Stored(info.relative_path, entry)
    return view


def read_view(backend: Backend) -> View | None:
    """The files of the checkpoint committed at ``backend``; None when none is committed."""
    try:
        committed = _commit_read.read_committed(backend, with_manifest=False)
    except (errors.CheckpointNotFoundError, errors.IncompleteCheckpointError):
        return None
    save_id = committed.save_id
    if save_id is None or not _layout.is_save_id(save_id):
        raise errors.IntegrityError(f"{redact_url(backend.url)} was not committed by "
                                    "VolumeStorage: read it with the tool that wrote it")
    manifest = backend.run(lambda: _bounded(backend, _layout.manifest_name(save_id),
                                            _commit_read.MAX_MANIFEST_BYTES))
    return _view(committed.metadata, manifest, where=redact_url(backend.url))


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
    if metadata_save_id(metadata) != f"{job}-{rank}":
        raise errors.IntegrityError(f"{where} is not rank {rank}'s record of job {job}")
    return _view(metadata, await _bounded(backend, manifest_name, _commit_read.MAX_MANIFEST_BYTES),
                 where=where)

async def _gather(backend: Backend, *, world_size: int, job: str) -> View:
    """The files of ranks ``0..world_size-1``, from records of ``job`` only."""
    files: View = {}
    for rank in range(world_size):
        got = await read_record(backend, rank=rank, world_size=world_size, job=job)
        if got is None:
            raise errors.IncompleteCheckpointError(
                f"rank {rank} of {world_size} left no record of this job in "
                f"{redact_url(backend.url)} (set pre_finalize_callback=record_rank_files, "
                "as manager_config does; two jobs saving to one path are refused): "
                "not committing")
        for name, entry in got.items():
            if name in files:
                raise errors.ConfigError(f"two ranks wrote {name!r}: give every rank its "
                                         "own file names in the layout")
            files[name] = entry
    return files


async def discard(backend: Backend, *, world_size: int, job: str, keep: set[str]) -> None:
    """Remove (best effort) a refused save's records and the files they name, never an
    object in ``keep`` (the files of the checkpoint committed there)."""
    names = [n for r in range(world_size) for n in record_names(r, world_size, job)]
    for rank in range(world_size):
        try:
            got = await read_record(backend, rank=rank, world_size=world_size, job=job) or {}
        except errors.DCPVolumesError:
            continue
        names += [s.key for s in got.values() if s.key not in keep]
    await _commit.remove_quietly(backend, names)


async def commit_recorded(backend: Backend, *, world_size: int, job: str) -> View:
    """Commit the files that ranks ``0..world_size-1`` of ``job`` recorded at ``backend``
    as the checkpoint there (:mod:`dcp_volumes._commit`; refused with
    ``CheckpointExistsError`` when one is committed there: this save's files and records
    are removed), then remove the objects it does not name (the records, objects of
    earlier, interrupted attempts). Returns the committed files."""
    files = await _gather(backend, world_size=world_size, job=job)
    data, manifest = _encode(files, _layout.new_save_id(), world_size, backend.url)
    await _commit.check_durable(backend, manifest)
    try:
        await _commit.commit(backend, manifest=manifest, metadata_bytes=data, overwrite=False,
                             stats=CallStats())
    except errors.CheckpointExistsError:  # _commit removed its files; its records too
        await discard(backend, world_size=world_size, job=job, keep=set())
        raise
    keep = {*manifest.files, _layout.manifest_name(manifest.save_id), _layout.METADATA}
    stale = [o.name for o in await backend.scan() if o.name not in keep]
    try:
        await backend.remove(stale)
    except errors.DCPVolumesError as exc:
        logger.warning("committed %s; %d stale objects left: %s", redact_url(backend.url),
                       len(stale), type(exc).__name__)
    logger.info("committed %s: %d files of %d ranks", redact_url(backend.url), len(files),
                world_size)
    return files
