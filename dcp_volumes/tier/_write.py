"""A rank's files of one save going into its local tier (:class:`TierSave`).

The writer moves each spool file here once its upload succeeded (``rename``; a copy when
the tier is on another filesystem), then writes the rank's descriptor with ``os.replace``,
so a directory whose descriptor is missing is never read. Whether the save committed is not
recorded here: the reader only ever looks for the files the committed manifest names, at the
sizes it names, and checks every byte against the manifest's CRC32C. A failure in the tier
never fails a durable save.

A **local-only** save goes nowhere else: every rank writes its shard files here, then the
coordinator's ``.metadata`` and manifest (the same bytes on every rank), then its
descriptor, which also records the save's :class:`~dcp_volumes.tier.LocalOnlyRef` (save
id, world, manifest digest, and the durable checkpoint it continues).
"""

from __future__ import annotations

import logging
import os
import time

from dcp_volumes import _layout, errors
from dcp_volumes.config import LocalTierOptions
from dcp_volumes.tier._descriptor import Descriptor, LocalOnlyRef, descriptor_name
from dcp_volumes.tier._files import (
    copy_file,
    is_exdev,
    remove_empty_dirs,
    unlink_quietly,
    write_atomic,
)
from dcp_volumes.tier._layout import normal_url, url_key
from dcp_volumes.tier._local_only import LocalCommit
from dcp_volumes.tier._retention import retain_quietly

__all__ = ["TierSave"]

logger = logging.getLogger(__name__)


class TierSave:
    """One rank's files of one save going into the tier.

    Every method swallows filesystem errors: the first one is logged as a WARNING, what was
    moved so far is removed, and the save goes on (it is durable in the store regardless).
    """

    def __init__(self, options: LocalTierOptions, url: str, save_key: str, rank: int) -> None:
        self.options = options
        self.root = options.resolved_directory()
        self.url = normal_url(url)
        self.save_key = save_key
        self.rank = rank
        self.dir = os.path.join(self.root, url_key(url), save_key)
        self.files: dict[str, int] = {}
        self.ok = True

    def admit(self, nbytes: int) -> bool:
        """Whether this rank's ``nbytes`` can be kept at all (the byte budget)."""
        limit = self.options.max_bytes
        if self.ok and limit is not None and nbytes > limit:
            logger.warning("rank %d: this save's %d bytes exceed LocalTierOptions.max_bytes "
                           "(%d): not kept in the local tier", self.rank, nbytes, limit)
            self.ok = False
        return self.ok

    def keep(self, source: str, relative: str, size: int, *, sync: bool = False) -> None:
        """Move the spooled file ``source`` (uploaded in full) into the tier; ``sync``: make
        its bytes durable on local disk first (a local-only save has no other copy)."""
        if not self.ok:
            return
        try:
            if sync:
                fd = os.open(source, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0))
                try:
                    os.fsync(fd)
                finally:
                    os.close(fd)
            dest = os.path.join(self.dir, _layout.check_relative_path(relative))
            try:
                os.makedirs(os.path.dirname(dest), exist_ok=True)
            except FileNotFoundError:  # another rank's retention pruned a parent meanwhile
                os.makedirs(os.path.dirname(dest), exist_ok=True)
            try:
                os.rename(source, dest)
            except OSError as exc:
                if not is_exdev(exc):
                    raise
                copy_file(source, dest)
            self.files[relative] = size
        except (OSError, errors.UnsafeCheckpointError) as exc:
            self._give_up(exc)

    def complete(self, local_only: LocalCommit | None = None, world: int = 0) -> int:
        """Write this rank's descriptor (the files are complete), then apply retention.
        With ``local_only``, the save's ``.metadata`` and manifest are written first and the
        descriptor says so (``world``: the ranks that saved). Returns the bytes kept."""
        if not self.ok or (not self.files and local_only is None):
            return 0
        ref = None
        try:
            if local_only is not None:
                os.makedirs(self.dir, exist_ok=True)
                write_atomic(os.path.join(self.dir, _layout.METADATA), local_only.metadata)
                write_atomic(os.path.join(self.dir, _layout.manifest_name(local_only.save_id)),
                             local_only.manifest)
                ref = LocalOnlyRef(local_only.save_id, world, local_only.manifest_sha256,
                                   local_only.base)
            doc = Descriptor(self.url, self.save_key, self.rank, time.time(), self.files, ref)
            write_atomic(os.path.join(self.dir, descriptor_name(self.rank)), doc.to_json())
        except OSError as exc:
            self._give_up(exc)
            return 0
        retain_quietly(self.options, self.rank)
        return sum(self.files.values())

    def abandon(self) -> None:
        """Remove what this rank moved into the tier (its save failed)."""
        for relative in self.files:
            path = os.path.join(self.dir, relative)
            unlink_quietly(path)
            remove_empty_dirs(os.path.dirname(path), self.root)
        self.files.clear()
        self.ok = False

    def _give_up(self, exc: BaseException) -> None:
        what = getattr(exc, "strerror", None) or type(exc).__name__
        logger.warning("rank %d: keeping the save in the local tier %s failed (%s): it is "
                       "durable in the store, loads will read it from there", self.rank,
                       self.root, what)
        self.abandon()
