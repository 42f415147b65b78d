"""Reading the committed save: ``.metadata`` and its manifest, bounded and typed.

:func:`read_committed` tells "nothing here" from "a save that never committed" and unpickles
nothing but torch's ``Metadata``; the manifest is checked to belong to the save that
``.metadata`` commits. Also here: what a committed save consists of (:func:`objects_of`) and
whether ``.metadata`` now commits a given save (:func:`is_committed_by`), which the commit
(:mod:`dcp_volumes._commit`) uses to settle an unknown outcome.
"""

from __future__ import annotations

import hashlib
import time
from dataclasses import dataclass

from torch.distributed.checkpoint.metadata import Metadata

from dcp_volumes import _layout, errors
from dcp_volumes._manifest import Manifest
from dcp_volumes._metadata import load_metadata, metadata_save_id, volume_save_id
from dcp_volumes.backends import Backend, CallStats, redact_url

__all__ = [
    "MAX_MANIFEST_BYTES",
    "MAX_METADATA_BYTES",
    "METADATA",
    "NOT_REGULAR",
    "Committed",
    "is_committed_by",
    "metadata_kind",
    "metadata_version",
    "objects_of",
    "objects_of_current_save",
    "parse_manifest",
    "read_committed",
    "read_manifest",
    "read_manifest_bytes",
    "read_metadata_bytes",
]

METADATA = _layout.METADATA
#: the largest ``.metadata`` read (a million items take ~300 MiB): bounds what a crafted or
#: damaged checkpoint can make a reader allocate
MAX_METADATA_BYTES = 1 << 30
#: likewise for the integrity manifest
MAX_MANIFEST_BYTES = 1 << 30
#: the "version" of a ``.metadata`` that is not a regular object (:func:`metadata_kind`),
#: which a save replacing it names as it names a damaged one's content identity
NOT_REGULAR = "not-a-regular-object"


@dataclass
class Committed:
    """The save a checkpoint's ``.metadata`` commits.

    Attributes:
        metadata: the unpickled (allow-listed) torch ``Metadata``.
        save_id: ``storage_meta.save_id`` (``None`` for checkpoints torch wrote).
        ours: VolumeWriter wrote it, so a manifest must exist.
        manifest: the integrity manifest (``None`` when not ours or not read).
    """

    metadata: Metadata
    save_id: str | None
    ours: bool
    manifest: Manifest | None


async def read_metadata_bytes(backend: Backend, stats: CallStats | None = None) -> bytes:
    """``.metadata``'s bytes.

    Raises:
        CheckpointNotFoundError: nothing is stored at the URL.
        IncompleteCheckpointError: objects exist but ``.metadata`` does not.
    """
    size = await backend.size(METADATA, stats=stats)
    if size is not None:
        if size > MAX_METADATA_BYTES:
            raise errors.UnsafeCheckpointError(
                f"{redact_url(backend.object_url(METADATA))} is {size} bytes, over the "
                f"{MAX_METADATA_BYTES >> 20} MiB a .metadata may have: refusing to read it "
                "(the checkpoint is damaged or crafted)")
        try:
            return await backend.cat(METADATA, op="read", stats=stats)
        except errors.ObjectNotFoundError:
            pass  # removed between the two calls: an overwrite or rm is under way
    names = await backend.list_names()
    where = redact_url(backend.url)
    if not names and backend.lists_stale_uploads:
        # A save killed before any shard completed leaves only invisible multipart uploads.
        names = [u.key for u in await backend.stale_uploads(0.0, time.time())]
    if names:
        shown = ", ".join(sorted(names)[:3])
        raise errors.IncompleteCheckpointError(
            f"{where} has {len(names)} objects ({shown}, ...) but no .metadata: the save that "
            "wrote them did not commit (interrupted or still running). Load an earlier "
            "checkpoint; `dcp-volumes gc` removes leftovers"
        )
    raise errors.CheckpointNotFoundError(
        f"no checkpoint at {where}: check the URL and storage_options")


async def read_manifest(backend: Backend, metadata: Metadata,
                        stats: CallStats | None = None) -> Manifest | None:
    """The manifest of the save ``metadata`` commits; ``None`` for torch-written checkpoints.

    Raises:
        IntegrityError: VolumeWriter wrote the checkpoint but its manifest is missing,
            unreadable, or belongs to another save.
    """
    save_id = volume_save_id(metadata)
    if save_id is None:
        return None
    data = await read_manifest_bytes(backend, save_id, stats)
    return parse_manifest(data, save_id=save_id, where=backend.object_url(
        _layout.manifest_name(save_id)))


async def read_manifest_bytes(backend: Backend, save_id: str,
                              stats: CallStats | None = None) -> bytes:
    """The bytes of save ``save_id``'s manifest, bounded by :data:`MAX_MANIFEST_BYTES`.

    Raises:
        IntegrityError: the manifest is missing.
        UnsafeCheckpointError: it is larger than a manifest may be.
    """
    name = _layout.manifest_name(save_id)
    try:
        size = await backend.size(name, stats=stats)
        if size is not None and size > MAX_MANIFEST_BYTES:
            raise errors.UnsafeCheckpointError(
                f"manifest {name} of {redact_url(backend.url)} is {size} bytes, over the "
                f"{MAX_MANIFEST_BYTES >> 20} MiB a manifest may have: refusing to read it")
        return await backend.cat(name, op="read", stats=stats)
    except errors.ObjectNotFoundError:
        raise errors.IntegrityError(
            f"{redact_url(backend.url)} was written by VolumeWriter but its manifest {name} is "
            "missing: the checkpoint was modified or replaced while it was read; load it again, "
            "or an earlier checkpoint"
        ) from None


def parse_manifest(data: bytes, *, save_id: str, where: str) -> Manifest:
    """Parse (untrusted) manifest bytes and check that they belong to save ``save_id``.

    Raises:
        IntegrityError: the bytes are not a valid manifest, or one of another save.
    """
    manifest = Manifest.from_json(data, where=where)
    if manifest.save_id != save_id:
        name = _layout.manifest_name(save_id)
        raise errors.IntegrityError(
            f"manifest {name} belongs to save {manifest.save_id}, not {save_id}")
    return manifest


def read_committed(backend: Backend, *, with_manifest: bool = True,
                   stats: CallStats | None = None) -> Committed:
    """Read and check the committed save at ``backend`` (``.metadata``, then its manifest).

    Raises:
        CheckpointNotFoundError, IncompleteCheckpointError: see :func:`read_metadata_bytes`.
        UnsafeCheckpointError: ``.metadata`` names classes or paths it must not.
        IntegrityError: ``.metadata`` is unreadable, or (``with_manifest``) the manifest is.
    """
    data = backend.run(lambda: read_metadata_bytes(backend, stats))
    metadata = load_metadata(data, where=backend.object_url(METADATA))
    ours = volume_save_id(metadata) is not None
    manifest = None
    if with_manifest and ours:
        manifest = backend.run(lambda: read_manifest(backend, metadata, stats))
    return Committed(metadata, metadata_save_id(metadata), ours, manifest)


async def metadata_kind(backend: Backend, stats: CallStats | None = None) -> str | None:
    """What stands where ``.metadata`` belongs: None (nothing), ``"file"`` (a regular
    object), or in words what else: on local disk the entry itself, a link not followed
    ("a directory", "a FIFO", "a link"); on object stores "a prefix with keys under it"
    (keys under ``.metadata/`` and no ``.metadata`` object). Whatever it holds or points
    to, anything but a regular object is no committed save: such a step is not complete
    (:mod:`dcp_volumes._complete`) and a save of it removes the entry
    (:func:`dcp_volumes._commit.commit`). The same lookup a size takes (``info``)."""
    return await backend.entry_kind(METADATA, stats=stats)


def metadata_version(data: bytes) -> str:
    """The identity of a ``.metadata``'s content (a replacement names the one it replaces)."""
    return hashlib.sha256(data).hexdigest()


def objects_of(metadata: Metadata) -> set[str]:
    """The objects a committed save consists of: its shards and its manifest."""
    names = {info.relative_path for info in metadata.storage_data.values()}
    save_id = metadata_save_id(metadata)
    if _layout.is_save_id(save_id):
        names.add(_layout.manifest_name(save_id))  # type: ignore[arg-type]
    return names


async def objects_of_current_save(backend: Backend) -> list[str]:
    """Objects the checkpoint committed now at ``backend`` consists of (empty if none)."""
    try:
        data = await backend.cat(METADATA, op="read")
    except (errors.ObjectNotFoundError, errors.UnsafeCheckpointError):
        return []  # nothing, or not a regular file (never read through a link): no save
    try:
        metadata = load_metadata(data, where=backend.object_url(METADATA))
    except errors.DCPVolumesError:
        return []  # not ours to interpret; leave it to gc
    return sorted(objects_of(metadata))


async def is_committed_by(backend: Backend, save_id: str) -> bool:
    """Whether ``.metadata`` now commits ``save_id`` (unknown counts as no)."""
    try:
        data = await backend.cat(METADATA, op="read")
        return metadata_save_id(load_metadata(data, where="")) == save_id
    except Exception:  # noqa: BLE001 — unknown means "not provably ours"
        return False
