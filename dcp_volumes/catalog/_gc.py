"""Garbage collection: what failed or superseded saves left under a run root.

gc judges a save's objects together, never one by one: everything of one save id in a
checkpoint directory stays while the newest of them is younger than the threshold, or while
the save's live record (:mod:`dcp_volumes._layout`) was written less than
:data:`~dcp_volumes._layout.LIVE_STALE_S` ago -- a running save rewrites it every
:data:`~dcp_volumes._layout.LIVE_REFRESH_S`. A save that is running is reported in
``skipped``; so are its multipart uploads, which are not aborted.
"""

from __future__ import annotations

import functools
import logging
import os
import re
import time
from dataclasses import asdict, dataclass, field
from typing import Any

from dcp_volumes import _layout, errors
from dcp_volumes.backends import Backend, ObjectInfo, StaleUpload, redact_url
from dcp_volumes.catalog._common import (
    TMP_RE,
    TORCH_SHARD_RE,
    Progress,
    compile_step_pattern,
    is_artifact,
    open_root,
    save_id_in,
    save_id_time,
)
from dcp_volumes.catalog._retention import delete_checkpoint
from dcp_volumes.catalog._scan import CheckpointInfo, checkpoints_in, group, list_objects

__all__ = ["GcReport", "gc"]

logger = logging.getLogger(__name__)


@dataclass
class GcReport:
    """What :func:`gc` removed (or would remove, with ``dry_run``).

    Attributes:
        root: the run root.
        dry_run: nothing was deleted.
        older_than_s: the age threshold used.
        incomplete: URLs of stale incomplete checkpoints (no ``.metadata``).
        leftovers: URLs of objects inside complete checkpoints that belong to no committed save
            (a killed or losing save's shards and manifests, stale live records and commit
            temp files).
        uploads: stale multipart uploads: ``{"key", "upload_id", "initiated"}`` (S3 only).
        bytes: bytes the removed objects held (uploaded parts not counted).
        skipped: what was left alone, and why (saves that may still be running among them).
    """

    root: str
    dry_run: bool
    older_than_s: float
    incomplete: list[str] = field(default_factory=list)
    leftovers: list[str] = field(default_factory=list)
    uploads: list[dict[str, Any]] = field(default_factory=list)
    bytes: int = 0
    skipped: list[str] = field(default_factory=list)

    @property
    def empty(self) -> bool:
        """Nothing to collect."""
        return not (self.incomplete or self.leftovers or self.uploads)

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass
class _Plan:
    """What a collection deletes: whole checkpoints, and objects relative to the root."""

    whole: list[tuple[str, list[ObjectInfo]]] = field(default_factory=list)
    loose: list[str] = field(default_factory=list)
    running: set[str] = field(default_factory=set)  # save ids that may still be running


def _needs_metadata(objects: list[ObjectInfo]) -> bool:
    """Whether a complete checkpoint can hold leftovers at all (else skip reading .metadata)."""
    ids = {_layout.save_id_of(o.name) for o in objects} - {None}
    plain = any(TORCH_SHARD_RE.match(o.name) for o in objects)
    tmp = any(TMP_RE.match(o.name) for o in objects)
    live = any(_layout.live_save_id_of(o.name) for o in objects)
    return len(ids) > 1 or (bool(ids) and plain) or tmp or live


def _age(o: ObjectInfo, now: float) -> float | None:
    t = o.mtime if o.mtime is not None else save_id_time(save_id_in(o.name))
    return None if t is None else max(0.0, now - t)


def _by_save(objects: list[ObjectInfo]) -> dict[str, list[ObjectInfo]]:
    """Objects grouped by the save id in their names (objects without one left out)."""
    groups: dict[str, list[ObjectInfo]] = {}
    for o in objects:
        sid = save_id_in(o.name)
        if sid is not None:
            groups.setdefault(sid, []).append(o)
    return groups


def _why_running(
    save_id: str, objects: list[ObjectInfo], now: float, older_than_s: float
) -> str | None:
    """Why save ``save_id`` (``objects``: all of its objects in one directory) may still be
    running, so that none of its objects may go; ``None`` when it is stale."""
    ages = [_age(o, now) for o in objects]
    known = [a for a in ages if a is not None]
    if len(known) < len(ages):
        return f"save {save_id}: age unknown"
    if min(known) < older_than_s:
        return f"save {save_id} wrote an object {min(known):.0f}s ago (it may be running)"
    live = [a for o, a in zip(objects, known) if _layout.live_save_id_of(o.name) is not None]
    if live and min(live) < _layout.LIVE_STALE_S:
        return f"save {save_id} refreshed its live record {min(live):.0f}s ago (it may be running)"
    return None


def _running_saves(objects: list[ObjectInfo], now: float, older_than_s: float) -> dict[str, str]:
    """The saves with objects in one directory that may still be running, and why."""
    return {
        sid: why
        for sid, of_save in _by_save(objects).items()
        if (why := _why_running(sid, of_save, now, older_than_s)) is not None
    }


def _leftovers(backend: Backend, name: str, objects: list[ObjectInfo]) -> list[ObjectInfo]:
    """The objects of checkpoint ``name`` that its committed save does not own."""
    from dcp_volumes._commit_read import objects_of
    from dcp_volumes._metadata import load_metadata, metadata_save_id

    rel = f"{name}/{_layout.METADATA}"
    data = backend.run(lambda: backend.cat(rel, op="read"))
    md = load_metadata(data, where=backend.object_url(rel))
    committed = metadata_save_id(md)
    owned = objects_of(md)
    out = []
    for o in objects:
        if o.name == _layout.METADATA or o.name in owned:
            continue
        sid = _layout.save_id_of(o.name)
        if (
            (sid is not None and sid != committed)
            or _layout.live_save_id_of(o.name) is not None  # even the committed save's
            or TMP_RE.match(o.name)
        ):
            out.append(o)
    return out


# --------------------------------------------------------------------------------------------
# Multipart uploads (stores that list them)


def _stale_uploads(
    backend: Backend, older_than_s: float, now: float, report: GcReport, running: set[str]
) -> list[dict[str, Any]]:
    """``{"key", "upload_id", "initiated"}`` of each unfinished upload under the root that
    belongs to no save that may still be running (those are reported in ``skipped``)."""
    if not backend.lists_stale_uploads:
        return []
    out = []
    for up in backend.run(lambda: backend.stale_uploads(older_than_s, now)):
        sid = _layout.save_id_of(up.key.rsplit("/", 1)[-1])
        if sid is not None and sid in running:
            report.skipped.append(f"upload {up.key}: save {sid} may be running")
        else:
            out.append(asdict(up))
    return out


def _abort_upload(backend: Backend, upload: dict[str, Any]) -> None:
    backend.run(lambda: backend.abort_upload(StaleUpload(**upload)))


# --------------------------------------------------------------------------------------------
# Survey, then collect


def _survey_incomplete(
    info: CheckpointInfo,
    objs: list[ObjectInfo],
    now: float,
    report: GcReport,
    plan: _Plan,
    running: dict[str, str],
) -> None:
    ages = [_age(o, now) for o in objs]
    if any(a is None for a in ages):
        report.skipped.append(f"{info.url}: incomplete, age unknown")
    elif min(a for a in ages if a is not None) < report.older_than_s:
        report.skipped.append(
            f"{info.url}: incomplete, written to recently (a save may be running)"
        )
    elif running:
        report.skipped.append(f"{info.url}: incomplete, {next(iter(running.values()))}")
    elif not all(is_artifact(o.name) for o in objs):
        report.skipped.append(
            f"{info.url}: incomplete, but holds files that are not checkpoint files"
        )
    else:
        plan.whole.append((info.name, objs))
        report.incomplete.append(info.url)
        report.bytes += info.bytes


def _survey_complete(
    backend: Backend,
    info: CheckpointInfo,
    objs: list[ObjectInfo],
    now: float,
    report: GcReport,
    plan: _Plan,
    running: dict[str, str],
) -> None:
    if not _needs_metadata(objs):
        return
    try:
        stray = _leftovers(backend, info.name, objs)
    except errors.DCPVolumesError as exc:
        report.skipped.append(f"{info.url}: .metadata unreadable ({type(exc).__name__})")
        return
    # A save's objects go together or not at all (`running` judged all of them here).
    stale: list[ObjectInfo] = []
    for sid, strays in _by_save(stray).items():
        if sid in running:
            report.skipped.append(f"{info.url}: {running[sid]}")
        else:
            stale.extend(strays)
    for o in stray:
        if save_id_in(o.name) is None:  # a commit's temp file: its own age decides, and
            # never under the live record's age: a commit lives milliseconds, and a listing
            # may show its temp file after the rename and the live record's removal
            age = _age(o, now)
            if age is not None and age >= max(report.older_than_s, _layout.LIVE_STALE_S):
                stale.append(o)
    for o in stale:
        plan.loose.append(f"{info.name}/{o.name}")
        report.leftovers.append(f"{info.url}/{o.name}")
        report.bytes += o.size


def _collect(backend: Backend, plan: _Plan, report: GcReport, progress: Progress | None) -> None:
    total = sum(len(objs) for _, objs in plan.whole) + len(plan.loose) + len(report.uploads)
    done = 0

    def step(n: int) -> None:
        nonlocal done
        done += n
        if progress is not None:
            progress(done, total)

    for name, objs in plan.whole:
        backend.run(functools.partial(delete_checkpoint, backend, name, objs))
        step(len(objs))
    if plan.loose:
        backend.run(lambda: backend.remove(plan.loose))
        step(len(plan.loose))
    for up in report.uploads:
        _abort_upload(backend, up)
        step(1)


def _survey(backend: Backend, pattern: re.Pattern[str], now: float,
            report: GcReport) -> _Plan:
    """One listing of the root, judged checkpoint by checkpoint: what ``gc`` would remove
    (in the plan and the report) and which saves are still running."""
    groups = group(list_objects(backend))
    plan = _Plan()
    for info in checkpoints_in(backend, groups, pattern):
        objs = groups[info.name]
        running = _running_saves(objs, now, report.older_than_s)
        plan.running.update(running)
        if info.complete:
            _survey_complete(backend, info, objs, now, report, plan, running)
        else:
            _survey_incomplete(info, objs, now, report, plan, running)
    return plan

def gc(
    root: str | os.PathLike[str],
    *,
    older_than_s: float = 3600.0,
    storage_options: dict[str, Any] | None = None,
    step_pattern: str | re.Pattern[str] | None = None,
    dry_run: bool = True,
    progress: Progress | None = None,
) -> GcReport:
    """Collect what failed or superseded saves left under ``root``.

    Removes, when older than ``older_than_s`` (newest object's modification time):

    - incomplete checkpoints (no ``.metadata``) made only of DCP files -- a directory holding
      anything else is reported in ``skipped`` and left alone;
    - objects inside a complete checkpoint that belong to no committed save: shards,
      manifests and live records whose save id differs from ``.metadata``'s
      ``storage_meta.save_id`` and that it does not name (a killed or losing save), the
      committed save's own live record, and stale ``.metadata.*.tmp`` files;
    - S3 multipart uploads under the root initiated before the threshold (they cost storage
      and are invisible to listings).

    A save's objects are judged together: none goes while the newest object of that save id
    in the directory is younger than ``older_than_s``, or while its live record -- rewritten
    by every uploading rank every 30 s -- is younger than two minutes, whatever
    ``older_than_s`` is; nor are its multipart uploads aborted. Such saves are reported in
    ``skipped``. So a short threshold does not destroy a running save, but a save killed a
    moment ago is collected only once its live record is two minutes old.

    Args:
        root: the run root.
        older_than_s: minimum age, in seconds.
        storage_options: passed to fsspec unchanged; never logged.
        step_pattern: as for :func:`list_checkpoints`.
        dry_run: report only (the default); pass ``False`` to delete.
        progress: called as ``progress(done, total)`` while deleting objects and uploads.
    """
    if older_than_s < 0:
        raise errors.ConfigError(f"older_than_s must be >= 0, got {older_than_s}")
    pattern = compile_step_pattern(step_pattern)
    backend = open_root(root, storage_options)
    now = time.time()
    report = GcReport(redact_url(backend.url), dry_run, float(older_than_s))
    plan = _survey(backend, pattern, now, report)
    report.uploads = _stale_uploads(backend, older_than_s, now, report, plan.running)
    if dry_run:
        return report
    _collect(backend, plan, report, progress)
    logger.info(
        "gc of %s: %d incomplete checkpoints, %d leftover objects, %d uploads, %d bytes",
        report.root,
        len(report.incomplete),
        len(report.leftovers),
        len(report.uploads),
        report.bytes,
    )
    return report
