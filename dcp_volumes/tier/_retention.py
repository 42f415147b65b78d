"""Retention of the local tier: the newest saves within ``keep_last`` and ``max_bytes``."""

from __future__ import annotations

import logging
import os
import shutil
import time
from dataclasses import dataclass

from dcp_volumes.config import LocalTierOptions
from dcp_volumes.tier._files import remove_empty_dirs
from dcp_volumes.tier._layout import STALE_S, walk_saves

__all__ = ["apply_retention", "retain_quietly"]

logger = logging.getLogger(__name__)


@dataclass
class _Save:
    path: str
    created: float
    nbytes: int


def apply_retention(options: LocalTierOptions) -> list[str]:
    """Evict the oldest saves of the whole tier directory beyond ``keep_last`` saves or
    ``max_bytes`` bytes (a save is older when its newest descriptor is). Directories that
    have no descriptor and are older than :data:`STALE_S` (a killed save) are removed too.
    Returns the save directories removed."""
    root = options.resolved_directory()
    saves: list[_Save] = []
    removed: list[str] = []
    now = time.time()
    for sdir in walk_saves(root):
        descs = sdir.descriptors()
        if descs:
            saves.append(_Save(sdir.path, max(d.created for d in descs),
                               sum(d.nbytes for d in descs)))
            continue
        try:
            stale = now - os.stat(sdir.path, follow_symlinks=False).st_mtime > STALE_S
        except OSError:
            continue
        if stale:
            shutil.rmtree(sdir.path, ignore_errors=True)
            removed.append(sdir.path)
    saves.sort(key=lambda s: s.created, reverse=True)
    total, over = 0, False
    for i, s in enumerate(saves):
        over = over or (options.keep_last is not None and i >= options.keep_last) or (
            options.max_bytes is not None and total + s.nbytes > options.max_bytes)
        if over:
            shutil.rmtree(s.path, ignore_errors=True)
            removed.append(s.path)
        else:
            total += s.nbytes
    for path in removed:
        remove_empty_dirs(os.path.dirname(path), root)
    if removed:
        logger.debug("local tier %s: removed %d saves", root, len(removed))
    return removed


def retain_quietly(options: LocalTierOptions, rank: int) -> None:
    """:func:`apply_retention` after a save or a replica arrived; a failure is a WARNING."""
    try:
        apply_retention(options)
    except OSError as exc:
        logger.warning("rank %d: local tier retention in %s failed (%s); the save is kept",
                       rank, options.resolved_directory(), exc.strerror or type(exc).__name__)
