"""The commit protocol, in one place.

A save is committed when its ``.metadata`` exists: the coordinator writes the integrity
manifest (named after the save id), then ``.metadata`` **last**, in one atomic operation
(a conditional create unless ``overwrite``). With ``overwrite`` the objects of the save
being replaced are listed before the commit and removed after it, never before. Readers
read the committed save through :func:`read_committed`, which tells "nothing here" from
"a save that never committed" and unpickles nothing but torch's ``Metadata``.

Just before the commit the coordinator checks that every object the manifest names is in
the store at the size written (:func:`check_durable`); while a save runs its live record
(:func:`mark_live`, :class:`Heartbeat`, :func:`end_live`) tells gc to leave it alone.

Writer, reader, catalog and gc call these functions; none of them re-implements a step.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import time
from dataclasses import dataclass

from torch.distributed.checkpoint.metadata import Metadata

from dcp_volumes import _layout, errors
from dcp_volumes._manifest import (
    Manifest,
    load_metadata,
    metadata_save_id,
    volume_save_id,
)
from dcp_volumes.backends import Backend, CallStats, redact_url

__all__ = [
    "Committed",
    "Heartbeat",
    "check_durable",
    "commit",
    "end_live",
    "is_committed_by",
    "mark_live",
    "metadata_version",
    "objects_of",
    "objects_of_current_save",
    "parse_manifest",
    "read_committed",
    "read_manifest",
    "read_manifest_bytes",
    "read_metadata_bytes",
    "remove_quietly",
]

logger = logging.getLogger(__name__)

METADATA = _layout.METADATA
#: the largest ``.metadata`` read (a million items take ~300 MiB): bounds what a crafted or
#: damaged checkpoint can make a reader allocate
MAX_METADATA_BYTES = 1 << 30
#: likewise for the integrity manifest
MAX_MANIFEST_BYTES = 1 << 30


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


# --------------------------------------------------------------------------------------
# Reading the committed save
# --------------------------------------------------------------------------------------
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
    except errors.ObjectNotFoundError:
        return []
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


# --------------------------------------------------------------------------------------
# Writing
# --------------------------------------------------------------------------------------
async def remove_quietly(backend: Backend, names: list[str]) -> None:
    """Remove objects of a save that did not commit (best effort: gc collects the rest)."""
    try:
        await backend.remove(names)
    except Exception as exc:  # noqa: BLE001 — best effort; gc collects leftovers
        logger.warning("could not remove %d objects of an uncommitted save under %s (%s)",
                       len(names), redact_url(backend.url), type(exc).__name__)


async def _commit_metadata(backend: Backend, metadata_bytes: bytes, *, exclusive: bool,
                           save_id: str, stats: CallStats) -> None:
    """Write ``.metadata`` atomically; settle a refused create whose first attempt landed."""
    try:
        await backend.commit(METADATA, metadata_bytes, exclusive=exclusive, save_id=save_id,
                             stats=stats)
    except errors.CheckpointExistsError:
        # A retried conditional PUT whose first attempt landed sees its own object: check.
        if await is_committed_by(backend, save_id):
            return
        raise errors.CheckpointExistsError(
            f"Checkpoint already exists: {redact_url(backend.url)} was committed by another "
            "save while this one uploaded; "
            "this save's shards were removed. Use a new path, or overwrite=True to replace it"
        ) from None


async def _replace_damaged(backend: Backend, metadata_bytes: bytes, *, damaged: str,
                           save_id: str, stats: CallStats) -> None:
    """Replace the damaged ``.metadata`` whose content is ``damaged`` by this save's.

    Of saves racing to replace the same damaged ``.metadata`` exactly one wins: each first
    creates a claim named after it (conditional create), and the winner replaces
    ``.metadata`` only if it is still that damaged one. A reader sees the damaged
    ``.metadata`` or this save's, complete: never a mix. A claim left by a killed save is a
    ``.metadata.*.tmp`` that gc removes.
    """
    claim = f"{METADATA}.replacing-{damaged[:32]}.tmp"
    taken = (f"Checkpoint already exists: {redact_url(backend.url)}'s damaged .metadata was "
             "replaced by another save")
    try:
        await backend.commit(claim, save_id.encode(), exclusive=True, save_id=save_id,
                             stats=stats)
    except errors.CheckpointExistsError:
        if await _read_or_none(backend, claim) != save_id.encode():  # not our own retry
            raise errors.CheckpointExistsError(
                f"{taken} (or is being replaced: {claim}); this save's shards were removed. "
                "Use a new path, or overwrite=True") from None
    try:
        if await _version_now(backend, stats) != damaged:
            raise errors.CheckpointExistsError(
                f"{taken} while this one uploaded; this save's shards were removed. Use a new "
                "path, or overwrite=True to replace it")
        await backend.commit(METADATA, metadata_bytes, exclusive=False, save_id=save_id,
                             stats=stats)
    finally:
        await remove_quietly(backend, [claim])


async def _version_now(backend: Backend, stats: CallStats) -> str | None:
    """:func:`metadata_version` of the stored ``.metadata`` (bounded read); None when it is
    gone or too large to read (changed, either way)."""
    try:
        return metadata_version(await read_metadata_bytes(backend, stats))
    except (errors.UnsafeCheckpointError, errors.CheckpointNotFoundError,
            errors.IncompleteCheckpointError, errors.ObjectNotFoundError):
        return None


async def _read_or_none(backend: Backend, name: str) -> bytes | None:
    """The first 64 bytes of ``name`` (a claim holds a save id); None when unreadable."""
    try:
        return await backend.cat(name, op="read", start=0, end=64)
    except errors.DCPVolumesError:
        return None


async def commit(backend: Backend, *, manifest: Manifest, metadata_bytes: bytes,
                 overwrite: bool, stats: CallStats, replaces: str | None = None) -> list[str]:
    """Commit one save: the manifest, then ``.metadata`` last.

    Returns the objects of the save this one superseded (``overwrite``), for the caller to
    remove once the commit is done. On a lost race or an unknown outcome that is not ours,
    this save's own objects are removed before the error propagates. ``replaces``: the
    :func:`metadata_version` of a damaged ``.metadata`` found before the save (not a
    complete checkpoint: see :mod:`dcp_volumes._complete`); if the conditional create finds
    it still there, it is replaced (:func:`_replace_damaged`), else the race is lost.
    """
    ours = [*manifest.files, _layout.manifest_name(manifest.save_id)]
    superseded = await objects_of_current_save(backend) if overwrite else []
    await backend.put(_layout.manifest_name(manifest.save_id), manifest.to_json(), stats=stats)
    try:
        try:
            await _commit_metadata(backend, metadata_bytes, exclusive=not overwrite,
                                   save_id=manifest.save_id, stats=stats)
        except errors.CheckpointExistsError:
            if replaces is None or overwrite:
                raise
            await _replace_damaged(backend, metadata_bytes, damaged=replaces,
                                   save_id=manifest.save_id, stats=stats)
    except errors.CheckpointExistsError:
        await remove_quietly(backend, ours)
        raise
    except BaseException:
        # Unknown outcome: keep our shards if .metadata turns out to be ours after all.
        if not await is_committed_by(backend, manifest.save_id):
            await remove_quietly(backend, ours)
        raise
    keep = set(ours) | {METADATA}
    return [name for name in superseded if name not in keep]


def remove_superseded(backend: Backend, names: list[str]) -> None:
    """Remove a replaced save's objects after the commit; failures leave them to gc."""
    if not names:
        return
    try:
        backend.run(lambda: backend.remove(names))
    except errors.DCPVolumesError as exc:
        logger.warning("superseded objects of %s were not all removed (%s); "
                       "`dcp-volumes gc` collects them", redact_url(backend.url),
                       type(exc).__name__)


# --------------------------------------------------------------------------------------
# Before the commit: every object the manifest names is in the store, at its size
# --------------------------------------------------------------------------------------
async def _size_problem(backend: Backend, name: str, expected: int) -> str | None:
    size = await backend.size(name)
    if size is None:
        return f"{name} (missing)"
    if size != expected:
        return f"{name} ({size} bytes, {expected} written)"
    return None


async def missing_objects(backend: Backend, manifest: Manifest) -> list[str]:
    """The objects ``manifest`` names that are absent or not of the size written, as
    ``"name (why)"``: one listing, then one size lookup for each name the listing does not
    confirm (a store whose listings lag its writes must not fail a good save)."""
    listed = {o.name: o.size for o in await backend.scan()}
    doubtful = [(name, entry.size) for name, entry in sorted(manifest.files.items())
                if listed.get(name) != entry.size]
    found = await asyncio.gather(*(_size_problem(backend, n, size) for n, size in doubtful))
    return [problem for problem in found if problem is not None]


async def check_durable(backend: Backend, manifest: Manifest) -> None:
    """Refuse to commit a save whose objects are not all there.

    Something else may remove or replace objects while a save runs (a ``gc`` with a short
    threshold, a bucket lifecycle rule, another job); committing then would replace a
    loadable checkpoint with one that cannot load.

    Raises:
        UploadError: naming the objects that are missing or of the wrong size.
    """
    problems = await missing_objects(backend, manifest)
    if problems:
        shown = ", ".join(problems[:3]) + (", ..." if len(problems) > 3 else "")
        raise errors.UploadError(
            f"save {manifest.save_id} to {redact_url(backend.url)} was not committed: "
            f"{len(problems)} of its {len(manifest.files)} files are not in the store as "
            f"written ({shown}). Something removed or changed them while the save ran (a "
            "`dcp-volumes gc`, a bucket lifecycle rule, another job); the checkpoint that was "
            "there before (if any) is unchanged. Save again"
        )


# --------------------------------------------------------------------------------------
# Live saves: the record that tells gc a save may still be running
# --------------------------------------------------------------------------------------
def _live_record(save_id: str) -> bytes:
    return json.dumps({"save_id": save_id, "written": time.time(),
                       "refresh_s": _layout.LIVE_REFRESH_S}).encode()


async def mark_live(backend: Backend, save_id: str) -> None:
    """Write (or rewrite) save ``save_id``'s live record (see :mod:`dcp_volumes._layout`)."""
    await backend.put(_layout.live_name(save_id), _live_record(save_id))


async def end_live(backend: Backend, save_id: str) -> None:
    """Remove a finished save's live record (best effort: gc collects a stale one)."""
    try:
        await backend.remove([_layout.live_name(save_id)])
    except Exception as exc:  # noqa: BLE001 -- the save's outcome is decided; gc tidies up
        logger.warning("could not remove the live record of save %s under %s (%s); "
                       "`dcp-volumes gc` collects it", save_id, redact_url(backend.url),
                       type(exc).__name__)


class Heartbeat:
    """Rewrites a save's live record every ``interval_s`` while one rank uploads.

    A task on the backend's event loop, so it costs one small PUT per rank per interval and
    no thread. Best effort: a failed rewrite is logged, never fails the save. :meth:`stop`
    returns only when no rewrite is in flight, so none lands after the rank's last byte.
    """

    def __init__(self, backend: Backend, save_id: str, interval_s: float | None = None) -> None:
        self.backend = backend
        self.save_id = save_id
        self.interval_s = _layout.LIVE_REFRESH_S if interval_s is None else interval_s
        self.beats = 0
        self._task: asyncio.Task[None] | None = None
        self._stop: asyncio.Event | None = None

    def start(self) -> Heartbeat:
        async def _start() -> None:
            self._stop = asyncio.Event()
            self._task = asyncio.ensure_future(self._beat(self._stop))

        self.backend.run(_start)
        return self

    async def _beat(self, stop: asyncio.Event) -> None:
        while True:
            try:
                await asyncio.wait_for(stop.wait(), timeout=self.interval_s)
                return
            except asyncio.TimeoutError:
                pass
            try:
                await mark_live(self.backend, self.save_id)
                self.beats += 1
            except Exception as exc:  # noqa: BLE001 -- a heartbeat never fails the save
                logger.warning("could not refresh the live record of save %s under %s (%s)",
                               self.save_id, redact_url(self.backend.url), type(exc).__name__)

    def stop(self, timeout_s: float = 10.0) -> None:
        """Stop rewriting; waits up to ``timeout_s`` for a rewrite in flight, then cancels it."""
        task, stop = self._task, self._stop
        if task is None or stop is None:
            return
        self._task = self._stop = None

        async def _stop() -> None:
            stop.set()
            try:
                await asyncio.wait_for(task, timeout=timeout_s)
            except (asyncio.TimeoutError, asyncio.CancelledError):
                pass

        self.backend.run(_stop)
