"""The one definition of a *complete* checkpoint.

A checkpoint is **complete** iff its ``.metadata`` exists, is a regular object (not a
directory, a FIFO, a link -- on local disk the entry itself is judged, a link is never
followed -- nor, on object stores, a prefix with keys under it), parses safely (allow-listed
unpickling, checked paths) and, when VolumeWriter wrote it, its manifest is there, readable
and of the same save. The writer's existence check, ``latest``, resume, ``ls``, retention
and ``verify`` all ask :func:`completeness`, so they agree: a step whose ``.metadata`` is
damaged or not a regular object is skipped on resume, not shown complete by ``ls``, not
kept by retention, and a new save of that step replaces it (by
:func:`dcp_volumes._commit.commit` with ``replaces=``, which of two racing replacements lets
exactly one win, and which removes an entry that is not a regular object -- a link itself,
never what it points to).

Transient or permission errors are raised, never taken for damage: a checkpoint is never
skipped or replaced because the store was unreachable.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from dcp_volumes import errors
from dcp_volumes._commit_read import (
    METADATA,
    NOT_REGULAR,
    metadata_kind,
    metadata_version,
    read_manifest,
    read_metadata_bytes,
)
from dcp_volumes._metadata import load_metadata, volume_save_id
from dcp_volumes.backends import Backend, CallStats, redact_url

__all__ = ["ABSENT", "COMPLETE", "DAMAGED", "Completeness", "completeness"]

ABSENT: Literal["absent"] = "absent"
COMPLETE: Literal["complete"] = "complete"
DAMAGED: Literal["damaged"] = "damaged"


@dataclass(frozen=True)
class Completeness:
    """What :func:`completeness` found at one checkpoint.

    Attributes:
        state: :data:`COMPLETE` (it loads), :data:`DAMAGED` (``.metadata`` exists but is not
            a regular object or does not parse safely, or its manifest is missing,
            unreadable or another save's) or :data:`ABSENT` (no ``.metadata``).
        problem: why it is not complete (``"<ErrorType>: <message>"``); ``None`` if it is.
        version: the damaged ``.metadata``'s content identity
            (:func:`~dcp_volumes._commit_read.metadata_version`), or
            :data:`~dcp_volumes._commit_read.NOT_REGULAR` when it is not a regular object,
            which a save replacing it names so that it replaces exactly that one; ``None``
            when not damaged or too large to read.
    """

    state: Literal["absent", "complete", "damaged"]
    problem: str | None = None
    version: str | None = None

    @property
    def complete(self) -> bool:
        return self.state == COMPLETE


def _problem(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}"


def _not_regular(backend: Backend, kind: str) -> str:
    return _problem(errors.UnsafeCheckpointError(
        f"{redact_url(backend.object_url(METADATA))} is {kind}, not a regular object: no "
        "save is committed there; a new save of this checkpoint replaces it"))


def completeness(backend: Backend, *, listed: bool = False,
                 stats: CallStats | None = None) -> Completeness:
    """Whether the checkpoint at ``backend``'s root is complete (see the module docstring).

    Args:
        listed: a listing just saw ``.metadata`` (skip the existence check on object stores,
            where a listed object is a regular one: read it).
        stats: request figures to add to.

    Raises:
        DCPVolumesError: the store could not be read (refused credentials, a network that
            stays down, ...): never taken for a damaged or absent checkpoint.
    """
    if not listed or not backend.object_store:  # on local disk the look is an lstat
        kind = backend.run(lambda: metadata_kind(backend, stats))
        if kind is None:
            return Completeness(ABSENT, f"no {METADATA}")
        if kind != "file":
            return Completeness(DAMAGED, _not_regular(backend, kind), NOT_REGULAR)
    try:
        data = backend.run(lambda: read_metadata_bytes(backend, stats))
    except (errors.CheckpointNotFoundError, errors.IncompleteCheckpointError,
            errors.ObjectNotFoundError) as exc:  # removed since it was seen
        return Completeness(ABSENT, _problem(exc))
    except errors.UnsafeCheckpointError as exc:  # too large to read: damaged or crafted
        return Completeness(DAMAGED, _problem(exc))
    version = metadata_version(data)
    try:
        metadata = load_metadata(data, where=backend.object_url(METADATA))
        if volume_save_id(metadata) is not None:
            backend.run(lambda: read_manifest(backend, metadata, stats))
    except (errors.IntegrityError, errors.UnsafeCheckpointError,
            errors.ObjectNotFoundError) as exc:
        return Completeness(DAMAGED, _problem(exc), version)
    return Completeness(COMPLETE)
