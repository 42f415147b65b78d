"""One checkpoint's committed save, as verify and describe need it.

:func:`dcp_volumes._commit_read.read_committed` reads ``.metadata`` (telling "nothing here" from
"never committed"); here a manifest that is missing or unreadable is recorded rather than
raised, because ``verify`` reports it as a failed file and ``describe`` shows what it can.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from dcp_volumes import errors
from dcp_volumes.backends import Backend

if TYPE_CHECKING:
    from torch.distributed.checkpoint.metadata import Metadata

    from dcp_volumes._manifest import Manifest

__all__ = ["CommittedSave", "load_committed"]


@dataclass
class CommittedSave:
    """What one checkpoint's ``.metadata`` commits, and its manifest if there is one."""

    metadata: Metadata
    save_id: str | None
    ours: bool  # written by VolumeWriter: a manifest is expected
    manifest: Manifest | None
    manifest_problem: str | None  # why an expected manifest could not be read
    torch_version: str | None = None


def load_committed(backend: Backend) -> CommittedSave:
    """Read ``.metadata`` (allow-listed unpickling), then the manifest it names (if ours).

    Raises:
        CheckpointNotFoundError: nothing is stored at the backend's root.
        IncompleteCheckpointError: objects but no ``.metadata``.
    """
    from dcp_volumes import _commit_read  # imports torch (unpickling needs it): only when used

    committed = _commit_read.read_committed(backend, with_manifest=False)
    md, save_id = committed.metadata, committed.save_id
    if not committed.ours:
        return CommittedSave(md, save_id, False, None, None)
    try:
        manifest = backend.run(lambda: _commit_read.read_manifest(backend, md))
    except errors.IntegrityError as exc:
        return CommittedSave(md, save_id, True, None, str(exc))
    torch_version = (manifest.torch or None) if manifest is not None else None
    return CommittedSave(md, save_id, True, manifest, None, torch_version)
