"""Removing checkpoints: one by URL, or those a retention policy does not keep."""

from __future__ import annotations

import functools
import logging
import os
import re
import time
from collections.abc import Mapping
from typing import Any

from dcp_volumes import _layout, errors
from dcp_volumes.backends import ObjectInfo, redact_url
from dcp_volumes.catalog._check import check_newest
from dcp_volumes.catalog._common import check_count, compile_step_pattern, is_artifact, open_root
from dcp_volumes.catalog._delete import delete_checkpoint
from dcp_volumes.catalog._scan import (
    COMMITTED,
    COMPLETE,
    UNREADABLE,
    CheckpointInfo,
    checkpoints_in,
    group,
    list_objects,
)

__all__ = ["apply_retention", "delete_checkpoint", "remove"]

logger = logging.getLogger(__name__)


def _ordered_urls(base: str, objects: list[ObjectInfo]) -> list[str]:
    names = sorted((o.name for o in objects), key=lambda n: (n != _layout.METADATA, n))
    return [f"{base}/{n}" for n in names]


def _check_is_one_checkpoint(where: str, objects: list[ObjectInfo]) -> None:
    """Refuse a run root or a directory without DCP files, so a typo cannot wipe a run."""
    if not objects:
        raise errors.CheckpointNotFoundError(f"no checkpoint at {where}: nothing to remove")
    nested = sorted(o.name for o in objects if "/" in o.name)
    if nested:
        raise errors.ConfigError(
            f"{where} holds sub-directories ({nested[0]}, ...): it looks like a run root, not one "
            "checkpoint; remove checkpoints one at a time"
        )
    if not any(is_artifact(o.name) for o in objects):
        raise errors.ConfigError(
            f"{where} holds no checkpoint files (.metadata, *.distcp): refusing to remove it"
        )


def remove(
    url: str | os.PathLike[str],
    *,
    storage_options: Mapping[str, Any] | None = None,
    dry_run: bool = False,
) -> list[str]:
    """Remove one checkpoint: ``.metadata`` first, then every other object, so that a
    removal stopped at any request leaves either the complete checkpoint or garbage that
    :func:`gc` removes (:mod:`dcp_volumes.catalog._delete`).

    Refuses anything that does not look like one checkpoint (objects in sub-directories,
    e.g. a run root, or no DCP files at all), so a typo cannot wipe a run.

    Args:
        url: checkpoint URL.
        storage_options: passed to fsspec unchanged; never logged.
        dry_run: only list what would be removed.

    Returns:
        The URLs of the objects removed (or that would be, with ``dry_run``), ``.metadata``
        first.

    Raises:
        CheckpointNotFoundError: nothing is stored at ``url``.
        ConfigError: ``url`` is not a checkpoint directory.
        DeleteError: the store did not delete every object (or did not say it did); what
            stays is the complete checkpoint or garbage :func:`gc` removes.
    """
    backend = open_root(url, storage_options)
    objects = list_objects(backend)
    where = redact_url(backend.url)
    _check_is_one_checkpoint(where, objects)
    urls = _ordered_urls(backend.url, objects)
    if not dry_run:
        backend.run(lambda: delete_checkpoint(backend, "", objects))
        logger.info("removed %s (%d objects)", where, len(objects))
    return urls


def _retention_victims(
    infos: list[CheckpointInfo], keep_last: int | None, keep_every: int | None
) -> list[CheckpointInfo]:
    """What the policy removes, given ``infos`` read newest first (see :func:`check_newest`)."""
    if keep_last is None and keep_every is None:
        return []
    # Only committed checkpoints with a step are candidates: an incomplete one may be being
    # written, and one without a step cannot be ordered.
    newest = sorted(
        (i for i in infos if i.status in (COMPLETE, COMMITTED, UNREADABLE) and i.step is not None),
        key=lambda i: (i.step, i.name),
        reverse=True,
    )
    # The window: the newest `keep_last` checkpoints that load (the newest one, always).
    # Unreadable ones newer than its end never count, and stay: one may be mid-overwrite,
    # and what is wrong with it is for a person to see. Older ones go unless kept by step.
    window = keep_last or 1
    loadable = 0
    end = len(newest)
    for n, info in enumerate(newest):
        if loadable == window:
            end = n
            break
        loadable += info.status == COMPLETE
    if loadable == 0:
        return []  # nothing loads: removing anything could remove the last usable bytes
    older = newest[end:]
    if keep_every is not None:
        older = [i for i in older if i.step is None or i.step % keep_every != 0]
    return sorted(older, key=lambda i: (i.step, i.name))


def _save_running(objects: list[ObjectInfo], now: float) -> bool:
    """Whether a save is writing into this checkpoint (its live record is fresh)."""
    return any(
        _layout.live_save_id_of(o.name) is not None
        and (o.mtime is None or now - o.mtime < _layout.LIVE_STALE_S)
        for o in objects
    )


def apply_retention(
    root: str | os.PathLike[str],
    *,
    keep_last: int | None = None,
    keep_every: int | None = None,
    storage_options: Mapping[str, Any] | None = None,
    step_pattern: str | re.Pattern[str] | None = None,
    dry_run: bool = False,
) -> list[str]:
    """Delete the complete checkpoints the policy does not keep.

    Kept: the last ``keep_last`` checkpoints that load, every checkpoint whose step is a
    multiple of ``keep_every``, the newest checkpoint that loads (always), every committed
    checkpoint newer than those (one that does not load never counts toward ``keep_last``),
    every incomplete checkpoint (it may be being written; :func:`gc` handles stale ones),
    every checkpoint a save is writing into (fresh live record) and every checkpoint whose
    name has no step. With neither option set nothing is deleted; when no checkpoint loads,
    nothing is deleted either. Each checkpoint is deleted ``.metadata`` first, so it is never
    visible while partially deleted, and a deletion that fails leaves either the complete
    checkpoint or garbage that :func:`gc` removes.

    "Loads" is checked by reading ``.metadata`` and the manifest of the newest checkpoints
    until ``keep_last`` (at least one) of them load; older ones are not read.

    Args:
        root: run root holding one checkpoint per step.
        keep_last: keep the newest this many checkpoints that load.
        keep_every: keep every checkpoint whose step is a multiple of this.
        storage_options: passed to fsspec unchanged; never logged.
        step_pattern: how a checkpoint's name gives its step (default:
            :data:`~dcp_volumes.catalog.DEFAULT_STEP_PATTERN`).
        dry_run: only list what would be removed.

    Returns:
        URLs of the checkpoints removed (or that would be, with ``dry_run``), oldest first.
    """
    check_count("keep_last", keep_last)
    check_count("keep_every", keep_every)
    pattern = compile_step_pattern(step_pattern)
    backend = open_root(root, storage_options)
    groups = group(list_objects(backend))
    if keep_last is None and keep_every is None:
        return []
    stepped = [i for i in checkpoints_in(backend, groups, pattern) if i.step is not None]
    infos = check_newest(stepped, storage_options, read=0, loadable=keep_last or 1)
    victims = _retention_victims(infos, keep_last, keep_every)
    now = time.time()
    for info in [i for i in victims if _save_running(groups[i.name], now)]:
        logger.info("retention keeps %s: a save is writing into it", redact_url(info.url))
        victims.remove(info)
    if not dry_run:
        for info in victims:
            backend.run(functools.partial(delete_checkpoint, backend, info.name, groups[info.name]))
            logger.info("retention removed %s (step %s)", redact_url(info.url), info.step)
    return [i.url for i in victims]
