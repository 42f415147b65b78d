"""Local-only saves: saves written to the ranks' local tiers and nowhere else.

Each rank's save directory holds its shard files, the coordinator's ``.metadata`` and
manifest (the same bytes on every rank) and its descriptor, written last, whose
:class:`~dcp_volumes.tier.LocalOnlyRef` names the save id, the world size, the manifest's
SHA-256 and the durable checkpoint the save continues (its *base*). :func:`find_local_only`
lists such saves for a restore; each is checked (descriptor, ``.metadata`` with the
restricted unpickler, manifest and its SHA-256, files present at their sizes) before it
counts, and each byte read later is checked against that manifest's CRC32C.

Lineage: a local-only save is a continuation of its base and nothing else. A restore uses
it only when its base is exactly the newest durable checkpoint in the store (see
:func:`continues`); a local-only save whose base is gone, or was replaced by another save,
belongs to another lineage and is never used.
"""

from __future__ import annotations

import hashlib
import logging
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from torch.distributed.checkpoint.metadata import StorageMeta

from dcp_volumes import _layout, errors
from dcp_volumes._manifest import Manifest
from dcp_volumes._metadata import load_metadata, volume_save_id
from dcp_volumes.backends.translate import redact_url
from dcp_volumes.config import LocalTierOptions
from dcp_volumes.tier._descriptor import DurableBase, LocalOnlyRef
from dcp_volumes.tier._files import read_bounded
from dcp_volumes.tier._layout import walk_saves
from dcp_volumes.tier._read import unusable

if TYPE_CHECKING:
    from torch.distributed.checkpoint.metadata import Metadata

__all__ = ["LocalCommit", "LocalOnlyCopy", "continues", "find_local_only", "parse_commit"]

logger = logging.getLogger(__name__)

#: the largest local ``.metadata`` / manifest read (as for the store's, see ``_commit``)
MAX_COMMIT_FILE = 1 << 30


@dataclass(frozen=True)
class LocalCommit:
    """What commits a local-only save in each rank's tier: the coordinator's ``.metadata``
    and manifest bytes, and the durable checkpoint the save continues (``base``)."""

    save_id: str
    metadata: bytes
    manifest: bytes
    base: DurableBase | None = None

    @property
    def manifest_sha256(self) -> str:
        return hashlib.sha256(self.manifest).hexdigest()


@dataclass(frozen=True)
class LocalOnlyCopy:
    """One rank's descriptor of a local-only save found (and checked) in this node's tier.
    ``commit`` (the ``.metadata`` and manifest bytes) stays on the rank that read it."""

    url: str
    save_id: str
    rank: int
    world: int
    manifest_sha256: str
    created: float
    base: DurableBase | None = None
    commit: LocalCommit | None = field(default=None, compare=False, repr=False)

    def key(self) -> tuple[str, str, str, int, DurableBase | None]:
        """What every rank's descriptor of one save has in common."""
        return self.url, self.save_id, self.manifest_sha256, self.world, self.base

    def without_commit(self) -> LocalOnlyCopy:
        return LocalOnlyCopy(self.url, self.save_id, self.rank, self.world,
                             self.manifest_sha256, self.created, self.base)


def continues(base: DurableBase | None, newest: DurableBase | None) -> bool:
    """Whether a local-only save with ``base`` continues the newest durable checkpoint
    ``newest`` (None: the store has none). One with no base continues only an empty store."""
    return base == newest


def parse_commit(commit: LocalCommit, url: str) -> tuple[Metadata, Manifest]:
    """The ``.metadata`` and manifest of a local-only save, checked as the store's are.

    Raises:
        UnsafeCheckpointError, IntegrityError: either is damaged or belongs to another save.
    """
    where = f"the local-only save {commit.save_id} of {redact_url(url)}"
    metadata = load_metadata(commit.metadata, where=where)
    manifest = Manifest.from_json(commit.manifest, where=where)
    if volume_save_id(metadata) != commit.save_id or manifest.save_id != commit.save_id:
        raise errors.IntegrityError(f"{where}: its .metadata or manifest belongs to another "
                                    "save")
    if metadata.storage_meta is None:
        metadata.storage_meta = StorageMeta()
    return metadata, manifest


def _check_commit(save_dir: str, url: str, ref: LocalOnlyRef) -> LocalCommit | None:
    """The ``.metadata`` and manifest of a local-only save in ``save_dir``, when they are
    what its descriptor says: a manifest with that SHA-256, save id and world size, and a
    ``.metadata`` that the restricted unpickler accepts and that commits that save id."""
    manifest_bytes = read_bounded(os.path.join(save_dir, _layout.manifest_name(ref.save_id)),
                                  MAX_COMMIT_FILE)
    if manifest_bytes is None or hashlib.sha256(manifest_bytes).hexdigest() != \
            ref.manifest_sha256:
        return None
    metadata_bytes = read_bounded(os.path.join(save_dir, _layout.METADATA), MAX_COMMIT_FILE)
    if metadata_bytes is None:
        return None
    commit = LocalCommit(ref.save_id, metadata_bytes, manifest_bytes, ref.base)
    try:
        _, manifest = parse_commit(commit, url)
    except errors.DCPVolumesError as exc:
        logger.warning("local-only save %s in %s is not used: %s", ref.save_id, save_dir, exc)
        return None
    if manifest.world_size != ref.world:
        logger.warning("local-only save %s in %s is not used: its manifest belongs to "
                       "another save", ref.save_id, save_dir)
        return None
    return commit


def find_local_only(options: LocalTierOptions, wanted: Callable[[str], bool]
                    ) -> list[LocalOnlyCopy]:
    """Every rank descriptor of a local-only save in this node's tier whose checkpoint URL
    ``wanted`` accepts, with its save's ``.metadata`` and manifest checked. Descriptors
    whose URL does not hash to their directory, or whose files are missing or damaged, are
    left out."""
    root = os.path.realpath(options.resolved_directory())
    out: list[LocalOnlyCopy] = []
    for sdir in walk_saves(root):
        checked: dict[LocalOnlyRef, LocalCommit | None] = {}
        for d in sdir.descriptors():
            ref = d.local_only
            if ref is None or not wanted(d.url):
                continue
            if ref not in checked:
                checked[ref] = _check_commit(sdir.path, d.url, ref)
            commit = checked[ref]
            if commit is None:
                continue
            if any(unusable(os.path.join(sdir.path, rel), size) is not None
                   for rel, size in d.files.items()):
                logger.warning("local-only save %s of %s: rank %d's files in %s are "
                               "missing or damaged; not used", ref.save_id, d.url, d.rank,
                               sdir.path)
                continue
            out.append(LocalOnlyCopy(d.url, ref.save_id, d.rank, ref.world,
                                     ref.manifest_sha256, d.created, ref.base, commit))
    return out
