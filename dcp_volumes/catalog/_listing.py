"""Listing a run root: one recursive listing, grouped into checkpoints; ``latest`` on top.

Listing costs **one** recursive listing of the root (a paginated LIST of the prefix on object
stores: one request per 1000 objects), grouped by the first path component -- never one LIST
per checkpoint. :func:`latest` lists on one rank and broadcasts the answer.

A checkpoint is *complete* only if it loads: its ``.metadata`` parses safely and, when
VolumeWriter wrote it, its manifest is there and belongs to the same save. Checking that
means reading both, so only the checkpoints that matter are read, newest first and
concurrently (:func:`check_newest`): :func:`latest` reads until one loads, retention until
``keep_last`` load, ``list_checkpoints`` the newest :data:`DEFAULT_CHECK` (and on until one
loads; ``check=0``: none). The others keep the status the listing alone gives:
``committed``. Reading a ``.metadata`` imports torch (the allow-listed unpickler needs its
classes), so only ``list_checkpoints(check=0)`` stays torch-free.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import os
import re
import sys
import threading
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any

from dcp_volumes import _layout, errors
from dcp_volumes.backends import Backend, ObjectInfo
from dcp_volumes.catalog._common import (
    compile_step_pattern,
    is_artifact,
    open_root,
    save_id_in,
    save_id_time,
    step_of,
)

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup

__all__ = [
    "COMMITTED",
    "COMPLETE",
    "DEFAULT_CHECK",
    "INCOMPLETE",
    "UNREADABLE",
    "CheckpointInfo",
    "check_newest",
    "latest",
    "list_checkpoints",
]

#: ``CheckpointInfo.status``: ``.metadata`` parses and its manifest matches -- it loads
COMPLETE = "complete"
#: ``.metadata`` exists; this listing did not read it
COMMITTED = "committed"
#: ``.metadata`` exists but the checkpoint cannot load (``CheckpointInfo.problem`` says why)
UNREADABLE = "unreadable"
#: no ``.metadata``: being written, or killed
INCOMPLETE = "incomplete"

#: how many committed checkpoints :func:`list_checkpoints` reads by default, newest first
DEFAULT_CHECK = 16
#: checkpoints read at the same time
CHECK_CONCURRENCY = 16

#: what makes a checkpoint unreadable (anything else -- refused credentials, a network that
#: stays down -- is raised: a checkpoint is never skipped because the store was unreachable)
_UNREADABLE_ERRORS = (
    errors.IntegrityError,
    errors.UnsafeCheckpointError,
    errors.IncompleteCheckpointError,  # .metadata vanished since the listing (removed)
    errors.CheckpointNotFoundError,
    errors.ObjectNotFoundError,
)

# Root listings made by this process (see listings_made()).
_listings = 0
_listings_lock = threading.Lock()


def listings_made() -> int:
    """How many recursive root listings this process has made through the catalog.

    Each is one paginated LIST of the prefix. Tests use it to prove that :func:`latest` on N
    ranks lists once in total, not once per rank.
    """
    with _listings_lock:
        return _listings


def _count_listing() -> None:
    global _listings
    with _listings_lock:
        _listings += 1


@dataclass(frozen=True)
class CheckpointInfo:
    """One checkpoint under a run root, as one listing sees it.

    Attributes:
        url: the checkpoint's URL (root URL + ``/`` + ``name``).
        name: the directory name under the root, e.g. ``"step-00001000"``.
        step: the step parsed from ``name`` by the step pattern; ``None`` if it does not match.
        status: :data:`COMPLETE` (read: it loads), :data:`COMMITTED` (``.metadata`` exists,
            not read by this listing), :data:`UNREADABLE` (``.metadata`` exists but the
            checkpoint cannot load) or :data:`INCOMPLETE` (no ``.metadata``).
        bytes: total size of its objects.
        objects: number of its objects.
        commit_time: epoch seconds when ``.metadata`` was written (its modification time, else
            the timestamp in the newest save id); ``None`` when incomplete or unknown.
        last_modified: epoch seconds of its newest object (``None`` if the store gives none).
        problem: why an unreadable checkpoint cannot load; ``None`` otherwise.
    """

    url: str
    name: str
    step: int | None
    status: str
    bytes: int
    objects: int
    commit_time: float | None
    last_modified: float | None
    problem: str | None = None

    @property
    def complete(self) -> bool:
        """Committed and not found unreadable: status ``complete``, or ``committed`` (not read).

        The newest checkpoint with ``complete`` set in a :func:`list_checkpoints` answer was
        always read and loads (the listing reads on until one does)."""
        return self.status in (COMPLETE, COMMITTED)

    @property
    def checked(self) -> bool:
        """This listing read ``.metadata`` and the manifest (status complete or unreadable)."""
        return self.status in (COMPLETE, UNREADABLE)

    def as_dict(self) -> dict[str, Any]:
        """JSON-ready fields, plus ``complete``."""
        doc = asdict(self)
        doc["complete"] = self.complete
        return doc


# --------------------------------------------------------------------------------------------
# One recursive listing


async def scan(backend: Backend) -> list[ObjectInfo]:
    """Every object under the backend's root, in one recursive listing (counted).

    An empty listing of an object store checks that the bucket exists, so a missing bucket
    raises rather than looking like an empty run.
    """
    _count_listing()
    return await backend.scan()


def list_objects(backend: Backend) -> list[ObjectInfo]:
    """:func:`scan`, from synchronous code."""
    return backend.run(lambda: scan(backend))


def group(objects: Iterable[ObjectInfo]) -> dict[str, list[ObjectInfo]]:
    """Group objects by their first path component (objects right under the root: dropped)."""
    groups: dict[str, list[ObjectInfo]] = {}
    for o in objects:
        head, sep, rest = o.name.partition("/")
        if sep and rest:
            groups.setdefault(head, []).append(ObjectInfo(rest, o.size, o.mtime))
    return groups


def _describe_group(
    base_url: str, name: str, objects: list[ObjectInfo], pattern: re.Pattern[str]
) -> CheckpointInfo:
    meta = next((o for o in objects if o.name == _layout.METADATA), None)
    ids = sorted({sid for o in objects if (sid := save_id_in(o.name)) is not None})
    newest_id_time = save_id_time(ids[-1]) if ids else None
    commit_time = None
    if meta is not None:
        commit_time = meta.mtime if meta.mtime is not None else newest_id_time
    mtimes = [o.mtime for o in objects if o.mtime is not None]
    return CheckpointInfo(
        url=f"{base_url}/{name}",
        name=name,
        step=step_of(name, pattern),
        status=COMMITTED if meta is not None else INCOMPLETE,
        bytes=sum(o.size for o in objects),
        objects=len(objects),
        commit_time=commit_time,
        last_modified=max(mtimes) if mtimes else newest_id_time,
    )


def checkpoints_in(
    backend: Backend, groups: dict[str, list[ObjectInfo]], pattern: re.Pattern[str]
) -> list[CheckpointInfo]:
    """The groups that are checkpoints, sorted by step (steps first), then name."""
    infos = [
        _describe_group(backend.url, name, objs, pattern)
        for name, objs in groups.items()
        # A directory is a checkpoint if its name is a step or it holds DCP files; `logs/` is not.
        if step_of(name, pattern) is not None or any(is_artifact(o.name) for o in objs)
    ]
    infos.sort(key=lambda i: (i.step is None, i.step if i.step is not None else 0, i.name))
    return infos


# --------------------------------------------------------------------------------------------
# Reading committed checkpoints: does it load?


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
    """``info`` with status complete or unreadable, after reading ``.metadata`` and manifest."""
    from dcp_volumes import _commit  # imports torch (unpickling needs it): only when read

    try:
        _commit.read_committed(backend)
    except _UNREADABLE_ERRORS as exc:
        return dataclasses.replace(info, status=UNREADABLE, problem=f"{type(exc).__name__}: {exc}")
    return dataclasses.replace(info, status=COMPLETE)


def check_newest(
    infos: list[CheckpointInfo],
    storage_options: dict[str, Any] | None,
    *,
    read: int | None = 0,
    loadable: int = 1,
) -> list[CheckpointInfo]:
    """``infos``, with committed checkpoints read newest first (:func:`newest_first`).

    Reads the newest ``read`` committed checkpoints (``None``: all of them), then goes on
    until ``loadable`` of those read load, or none is left. A read fetches ``.metadata``,
    unpickles it with the allow-list and, for VolumeWriter's checkpoints, reads the manifest
    and checks its save id. Reads run :data:`CHECK_CONCURRENCY` at a time; past the first
    ``read``, in batches of the number still needed, growing (doubling) only after two rounds
    found too few, so a damaged newest checkpoint costs one extra read and a long run of
    them a few rounds.

    Raises:
        StoragePermissionError, DownloadError, ...: the store could not be read (a checkpoint
            is never taken for unreadable because the store was unreachable).
    """
    order = newest_first(i for i in infos if i.status == COMMITTED)
    if not order:
        return infos
    done: dict[str, CheckpointInfo] = {}
    with concurrent.futures.ThreadPoolExecutor(max_workers=CHECK_CONCURRENCY) as pool:

        def read_all(batch: list[CheckpointInfo]) -> None:
            # Opened in this thread, not the pool's: fsspec caches filesystems per thread.
            backends = [open_root(i.url, storage_options) for i in batch]
            for info in pool.map(_checked, backends, batch):
                done[info.url] = info

        pos = len(order) if read is None else min(read, len(order))
        read_all(order[:pos])
        rounds = 0
        while pos < len(order):
            missing = loadable - sum(i.status == COMPLETE for i in done.values())
            if missing <= 0:
                break
            # One more than needed only after two rounds found too few: a damaged newest
            # checkpoint costs one extra read, a long run of them log(n) rounds.
            batch = 1 if rounds < 2 else 2 ** (rounds - 1)
            size = min(max(missing, batch), CHECK_CONCURRENCY)
            read_all(order[pos : pos + size])
            pos += size
            rounds += 1
    return [done.get(i.url, i) for i in infos]


def _check_count(value: int | None) -> None:
    if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 0):
        raise errors.ConfigError(f"check must be a whole number >= 0 or None, got {value!r}")


def list_checkpoints(
    root: str | os.PathLike[str],
    *,
    storage_options: dict[str, Any] | None = None,
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
    storage_options: dict[str, Any] | None = None,
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
