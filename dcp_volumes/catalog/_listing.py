"""Listing a run root (``ls``) and finding its newest complete checkpoint (``latest``).

Listing costs **one** recursive listing of the root (:mod:`dcp_volumes.catalog._scan`);
then the committed checkpoints that matter are read, newest first, to tell which are
*complete* (:mod:`dcp_volumes.catalog._check`, by the one definition in
:mod:`dcp_volumes._complete`). :func:`latest` lists on one rank and broadcasts the answer.
Reading a ``.metadata`` imports torch (the allow-listed unpickler needs its classes), so only
``list_checkpoints(check=0)`` stays torch-free.
"""

from __future__ import annotations

import os
import re
import sys
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

from dcp_volumes import errors
from dcp_volumes.catalog._check import DEFAULT_CHECK, check_newest, newest_first
from dcp_volumes.catalog._common import compile_step_pattern, open_root
from dcp_volumes.catalog._scan import (
    COMPLETE,
    CheckpointInfo,
    checkpoints_in,
    group,
    list_objects,
    listings_made,
)

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup

__all__ = ["latest", "list_checkpoints", "listings_made"]


def _check_count(value: int | None) -> None:
    if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 0):
        raise errors.ConfigError(f"check must be a whole number >= 0 or None, got {value!r}")


def list_checkpoints(
    root: str | os.PathLike[str],
    *,
    storage_options: Mapping[str, Any] | None = None,
    step_pattern: str | re.Pattern[str] | None = None,
    check: int | None = DEFAULT_CHECK,
) -> list[CheckpointInfo]:
    """The checkpoints under a run root, complete or not, sorted by step then name.

    One recursive listing of ``root`` (one paginated LIST on object stores), grouped by the
    first path component. A directory counts as a checkpoint when its name matches
    ``step_pattern`` or it holds DCP files (``.metadata``, ``*.distcp``, a manifest).

    Then the newest ``check`` committed checkpoints are read (``.metadata`` and manifest,
    :data:`CHECK_CONCURRENCY` at a time), and on past them until one loads: each becomes
    ``complete`` or ``unreadable``; the others stay ``committed``. So the newest checkpoint
    whose :attr:`~CheckpointInfo.complete` is set is always one that loads -- the one
    :func:`latest` returns -- and the cost does not grow with the number of checkpoints.
    Reading a ``.metadata`` imports torch (its allow-listed unpickling needs torch's
    classes); ``check=0`` lists only, without torch.

    Args:
        root: the run root, e.g. ``"s3://bucket/run-42/"`` or a local directory. On object
            stores it must name a prefix inside the bucket.
        storage_options: passed to fsspec unchanged; never logged.
        step_pattern: regular expression that extracts the step from a directory name: the
            group named ``step``, else the first group, else the whole match. Default
            :data:`DEFAULT_STEP_PATTERN` (``step-<N>``, ``step_<N>``, ``<N>``).
        check: how many committed checkpoints to read, newest first, before going on until
            one loads (default :data:`DEFAULT_CHECK`; ``None``: all of them). ``0`` reads
            none: every committed checkpoint is ``committed``, and nothing says which loads.

    Raises:
        BucketNotFoundError: the bucket or container does not exist.
        StoragePermissionError: the store refused the listing.
        ConfigError: ``check`` is not a whole number >= 0 or None.
    """
    _check_count(check)
    pattern = compile_step_pattern(step_pattern)
    backend = open_root(root, storage_options)
    infos = checkpoints_in(backend, group(list_objects(backend)), pattern)
    return check_newest(infos, storage_options, read=check, loadable=0 if check == 0 else 1)


# --------------------------------------------------------------------------------------------
# Latest


def _newest_complete(infos: list[CheckpointInfo]) -> CheckpointInfo | None:
    """The first checkpoint that loads in :func:`newest_first` order (read: status complete)."""
    return next((i for i in newest_first(infos) if i.status == COMPLETE), None)


def _distributed(process_group: ProcessGroup | None) -> bool:
    if process_group is not None:
        return True
    if "torch.distributed" not in sys.modules:
        return False  # nobody imported it, so nobody initialized it: stay torch-free
    import torch.distributed as dist

    return bool(dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1)


def _on_rank0_then_broadcast(fn: Callable[[], Any], process_group: ProcessGroup | None) -> Any:
    """``fn()`` on rank 0 of the group; its answer -- or its error -- on every rank."""
    import torch.distributed as dist

    box: list[Any] = [None]
    if dist.get_rank(process_group) == 0:
        try:
            box[0] = (True, fn())
        except Exception as exc:  # noqa: BLE001 -- every rank must raise it, not hang
            box[0] = (False, exc)
    dist.broadcast_object_list(box, group_src=0, group=process_group)
    ok, value = box[0]
    if not ok:
        raise value
    return value


def latest(
    root: str | os.PathLike[str],
    *,
    storage_options: Mapping[str, Any] | None = None,
    step_pattern: str | re.Pattern[str] | None = None,
    process_group: ProcessGroup | None = None,
    broadcast: bool = True,
) -> CheckpointInfo | None:
    """The newest checkpoint under ``root`` that loads (highest step), or ``None``.

    Committed checkpoints are read newest first until one loads: its ``.metadata`` parses
    safely and, when VolumeWriter wrote it, its manifest is there and belongs to the same
    save. Newer ones that do not load are skipped (``ls`` shows them ``unreadable``).

    When torch.distributed is initialized (or ``process_group`` is given), only rank 0 of the
    group lists the root and the answer -- or its error -- is broadcast with
    ``dist.broadcast_object_list``: one LIST per job, not one per rank. Every rank of the group
    must call it. With NCCL as the default group, pass a gloo ``process_group``.

    Args:
        root: the run root.
        storage_options: passed to fsspec unchanged; never logged.
        step_pattern: as for :func:`list_checkpoints`.
        process_group: the group to broadcast over (default: the default group).
        broadcast: ``False``: this rank lists by itself, no collective (for one rank's own
            use, e.g. the coordinator's, while the others are elsewhere).
    """

    def newest() -> CheckpointInfo | None:
        infos = list_checkpoints(
            root, storage_options=storage_options, step_pattern=step_pattern, check=0
        )
        return _newest_complete(check_newest(infos, storage_options, read=0, loadable=1))

    if not broadcast or not _distributed(process_group):
        return newest()
    return _on_rank0_then_broadcast(newest, process_group)  # type: ignore[no-any-return]
