"""The commit protocol, in one place.

A save is committed when its ``.metadata`` exists: the coordinator writes the integrity
manifest (named after the save id), then ``.metadata`` **last**, in one atomic operation
(a conditional create unless ``overwrite``). With ``overwrite`` the objects of the save
being replaced are listed before the commit and removed after it, never before. Readers
read the committed save through :func:`dcp_volumes._commit_read.read_committed`.

Just before the commit the coordinator checks that every object the manifest names is in
the store at the size written (:func:`check_durable`); while a save runs its live record
(:mod:`dcp_volumes._live`) tells gc to leave it alone.

Writer, reader, catalog and gc call these functions; none of them re-implements a step.
"""

from __future__ import annotations

import asyncio
import logging

from dcp_volumes import _layout, errors
from dcp_volumes._commit_read import (
    METADATA,
    NOT_REGULAR,
    is_committed_by,
    metadata_kind,
    metadata_version,
    objects_of_current_save,
    read_metadata_bytes,
)
from dcp_volumes._manifest import Manifest
from dcp_volumes.backends import Backend, CallStats, redact_url

__all__ = [
    "check_durable",
    "commit",
    "missing_objects",
    "remove_quietly",
    "remove_superseded",
]

logger = logging.getLogger(__name__)


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
    ``.metadata.*.tmp`` that gc removes. ``damaged`` :data:`NOT_REGULAR`: what stands there
    is removed first (``Backend.remove_entry``: the entry itself, never what a link points
    to), then ``.metadata`` created.
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
        now = await _version_now(backend, stats)
        if now != damaged and not (damaged == NOT_REGULAR and now is None):
            raise errors.CheckpointExistsError(
                f"{taken} while this one uploaded; this save's shards were removed. Use a new "
                "path, or overwrite=True to replace it")
        if damaged == NOT_REGULAR:
            # Exclusive after the removal: a save that did not take the claim and created
            # .metadata meanwhile wins, and this one loses (never replaces a commit).
            await backend.remove_entry(METADATA)
            await _commit_metadata(backend, metadata_bytes, exclusive=True, save_id=save_id,
                                   stats=stats)
        else:
            await backend.commit(METADATA, metadata_bytes, exclusive=False, save_id=save_id,
                                 stats=stats)
    finally:
        await remove_quietly(backend, [claim])


async def _version_now(backend: Backend, stats: CallStats) -> str | None:
    """:func:`metadata_version` of the stored ``.metadata`` (bounded read), or
    :data:`NOT_REGULAR`; None when it is gone or too large to read (changed, either way)."""
    if await metadata_kind(backend, stats) not in (None, "file"):
        return NOT_REGULAR
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


async def _create(backend: Backend, metadata_bytes: bytes, *, replaces: str | None,
                  save_id: str, stats: CallStats) -> None:
    """Create ``.metadata`` (conditional create), or replace the damaged one ``replaces``
    names where the create is refused."""
    if replaces == NOT_REGULAR:
        # Straight to the replacement: a create beside the entry would be refused (a
        # directory, SeaweedFS's prefix) or leave it there (moto's keys under .metadata/).
        await _replace_damaged(backend, metadata_bytes, damaged=replaces, save_id=save_id,
                               stats=stats)
        return
    try:
        await _commit_metadata(backend, metadata_bytes, exclusive=True, save_id=save_id,
                               stats=stats)
    except errors.CheckpointExistsError:
        if replaces is None:
            raise
        await _replace_damaged(backend, metadata_bytes, damaged=replaces, save_id=save_id,
                               stats=stats)


async def _overwrite(backend: Backend, metadata_bytes: bytes, *, save_id: str,
                     stats: CallStats) -> None:
    """Write ``.metadata`` over whatever is there; an entry that is not a regular object
    and refuses it (a directory; SeaweedFS's prefix) is removed first, then written again."""
    try:
        await _commit_metadata(backend, metadata_bytes, exclusive=False, save_id=save_id,
                               stats=stats)
    except errors.DCPVolumesError:
        if await metadata_kind(backend) in (None, "file"):
            raise
        await backend.remove_entry(METADATA)
        await _commit_metadata(backend, metadata_bytes, exclusive=False, save_id=save_id,
                               stats=stats)


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
        if overwrite:
            await _overwrite(backend, metadata_bytes, save_id=manifest.save_id, stats=stats)
        else:
            await _create(backend, metadata_bytes, replaces=replaces,
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
