"""What gc would remove: one listing of the run root judged checkpoint by checkpoint.

gc judges a save's objects together, never one by one (see :mod:`._gc`): a save that may
still be running keeps all of its objects, and is reported in ``skipped``. The survey fills
the report and returns the :class:`Collection` that :func:`~dcp_volumes.catalog.gc` deletes.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from dcp_volumes import _layout, errors
from dcp_volumes.backends import Backend, ObjectInfo
from dcp_volumes.catalog._common import (
    TMP_RE,
    TORCH_SHARD_RE,
    is_artifact,
    save_id_in,
    save_id_time,
)
from dcp_volumes.catalog._delete import REMOVING
from dcp_volumes.catalog._gc_report import GcReport
from dcp_volumes.catalog._scan import CheckpointInfo, checkpoints_in, group, list_objects

__all__ = ["Collection", "survey"]


@dataclass
class Collection:
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


def _being_removed(objects: list[ObjectInfo]) -> bool:
    """Whether a removal of this whole directory stopped half way: its removal marker,
    written before ``.metadata`` went (:mod:`._delete`), says that everything here was
    asked to go, checkpoint files or not."""
    return any(o.name == REMOVING for o in objects)


def _survey_incomplete(
    info: CheckpointInfo,
    objs: list[ObjectInfo],
    now: float,
    report: GcReport,
    plan: Collection,
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
    elif not all(is_artifact(o.name) for o in objs) and not _being_removed(objs):
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
    plan: Collection,
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


def survey(backend: Backend, pattern: re.Pattern[str], now: float,
           report: GcReport) -> Collection:
    """One listing of the root, judged checkpoint by checkpoint: what ``gc`` would remove
    (in the plan and the report) and which saves are still running."""
    groups = group(list_objects(backend))
    plan = Collection()
    for info in checkpoints_in(backend, groups, pattern):
        objs = groups[info.name]
        running = _running_saves(objs, now, report.older_than_s)
        plan.running.update(running)
        if info.complete:
            _survey_complete(backend, info, objs, now, report, plan, running)
        else:
            _survey_incomplete(info, objs, now, report, plan, running)
    return plan
