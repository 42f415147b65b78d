"""One recursive listing of a run root, grouped into checkpoints: what a listing alone says.

Listing costs **one** recursive listing of the root (a paginated LIST of the prefix on object
stores: one request per 1000 objects), grouped by the first path component -- never one LIST
per checkpoint. A checkpoint with ``.metadata`` is ``committed`` here; whether it is
*complete* takes reading it (:mod:`dcp_volumes.catalog._check`). Torch-free.
"""

from __future__ import annotations

import re
import threading
from collections.abc import Iterable
from dataclasses import asdict, dataclass
from typing import Any

from dcp_volumes import _layout
from dcp_volumes.backends import Backend, ObjectInfo
from dcp_volumes.catalog._common import is_artifact, save_id_in, save_id_time, step_of

__all__ = [
    "COMMITTED",
    "COMPLETE",
    "INCOMPLETE",
    "UNREADABLE",
    "CheckpointInfo",
    "checkpoints_in",
    "group",
    "list_objects",
    "listings_made",
    "scan",
]

#: ``CheckpointInfo.status``: ``.metadata`` parses and its manifest matches -- it loads
COMPLETE = "complete"
#: ``.metadata`` exists; this listing did not read it
COMMITTED = "committed"
#: ``.metadata`` exists but the checkpoint cannot load (``CheckpointInfo.problem`` says why)
UNREADABLE = "unreadable"
#: no ``.metadata``: being written, or killed
INCOMPLETE = "incomplete"

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

