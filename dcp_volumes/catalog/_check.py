"""Reading committed checkpoints, newest first: which of them are *complete*.

A checkpoint is complete by the one definition (:mod:`dcp_volumes._complete`): its
``.metadata`` parses safely and, when VolumeWriter wrote it, its manifest is there and
belongs to the same save. Checking that means reading both, so only the checkpoints that
matter are read, newest first and concurrently (:func:`check_newest`): ``latest`` reads
until one loads, retention until ``keep_last`` load, ``list_checkpoints`` the newest
:data:`DEFAULT_CHECK` (and on until one loads). The others keep the status the listing
alone gives: ``committed``. Reading a ``.metadata`` imports torch (the allow-listed
unpickler needs its classes), so the import is made only when a checkpoint is read.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
from collections.abc import Callable, Iterable, Mapping
from typing import Any

from dcp_volumes.backends import Backend
from dcp_volumes.catalog._common import open_root
from dcp_volumes.catalog._scan import COMMITTED, COMPLETE, UNREADABLE, CheckpointInfo

__all__ = ["CHECK_CONCURRENCY", "DEFAULT_CHECK", "check_newest", "newest_first"]

#: how many committed checkpoints :func:`list_checkpoints` reads by default, newest first
DEFAULT_CHECK = 16
#: checkpoints read at the same time
CHECK_CONCURRENCY = 16

def newest_first(infos: Iterable[CheckpointInfo]) -> list[CheckpointInfo]:
    """Checkpoints in the order :func:`latest` prefers them: highest step first (then newest
    commit, then name), then those whose name has no step, newest commit first."""
    infos = list(infos)
    stepped = sorted(
        (i for i in infos if i.step is not None),
        key=lambda i: (i.step, i.commit_time or 0.0, i.name),
        reverse=True,
    )
    unstepped = sorted(
        (i for i in infos if i.step is None),
        key=lambda i: (i.commit_time or 0.0, i.name),
        reverse=True,
    )
    return stepped + unstepped




def _checked(backend: Backend, info: CheckpointInfo) -> CheckpointInfo:
    """``info`` with status complete or unreadable, by the one definition of *complete*
    (:func:`dcp_volumes._complete.completeness`, which the writer's existence check uses too)."""
    from dcp_volumes._complete import completeness  # imports torch (unpickling): only when read

    found = completeness(backend, listed=True)
    if not found.complete:
        return dataclasses.replace(info, status=UNREADABLE, problem=found.problem)
    return dataclasses.replace(info, status=COMPLETE)


def _batch_sizes(first: int, total: int, still_needed: Callable[[], int]) -> Iterable[int]:
    """How many to read in each round: ``first``, then the number still needed, growing
    (doubling) only after two rounds found too few, so a damaged newest checkpoint costs one
    extra read and a long run of them log(n) rounds; until none is left or none is needed."""
    yield first
    pos, rounds = first, 0
    while pos < total:
        missing = still_needed()
        if missing <= 0:
            return
        size = min(max(missing, 1 if rounds < 2 else 2 ** (rounds - 1)), CHECK_CONCURRENCY)
        yield size
        pos += size
        rounds += 1


def check_newest(
    infos: list[CheckpointInfo],
    storage_options: Mapping[str, Any] | None,
    *,
    read: int | None = 0,
    loadable: int = 1,
) -> list[CheckpointInfo]:
    """``infos``, with committed checkpoints read newest first (:func:`newest_first`).

    Reads the newest ``read`` committed checkpoints (``None``: all of them), then goes on
    until ``loadable`` of those read load, or none is left. A read fetches ``.metadata``,
    unpickles it with the allow-list and, for VolumeWriter's checkpoints, reads the manifest
    and checks its save id. Reads run :data:`CHECK_CONCURRENCY` at a time; past the first
    ``read``, in batches of the number still needed (:func:`_batch_sizes`).

    Raises:
        StoragePermissionError, DownloadError, ...: the store could not be read (a checkpoint
            is never taken for unreadable because the store was unreachable).
    """
    order = newest_first(i for i in infos if i.status == COMMITTED)
    if not order:
        return infos
    done: dict[str, CheckpointInfo] = {}

    def still_needed() -> int:
        return loadable - sum(i.status == COMPLETE for i in done.values())

    first = len(order) if read is None else min(read, len(order))
    pos = 0
    with concurrent.futures.ThreadPoolExecutor(max_workers=CHECK_CONCURRENCY) as pool:
        for size in _batch_sizes(first, len(order), still_needed):
            batch = order[pos : pos + size]
            # Opened in this thread, not the pool's: fsspec caches filesystems per thread.
            backends = [open_root(i.url, storage_options) for i in batch]
            for info in pool.map(_checked, backends, batch):
                done[info.url] = info
            pos += size
    return [done.get(i.url, i) for i in infos]
