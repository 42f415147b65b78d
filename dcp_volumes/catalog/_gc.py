"""Garbage collection: what failed or superseded saves left under a run root.

gc judges a save's objects together, never one by one: everything of one save id in a
checkpoint directory stays while the newest of them is younger than the threshold, or while
the save's live record (:mod:`dcp_volumes._layout`) was written less than
:data:`~dcp_volumes._layout.LIVE_STALE_S` ago -- a running save rewrites it every
:data:`~dcp_volumes._layout.LIVE_REFRESH_S`. A save that is running is reported in
``skipped``; so are its multipart uploads, which are not aborted.

The survey (what would go, and why the rest stays) is :mod:`._gc_survey`; the report
:mod:`._gc_report`.
"""

from __future__ import annotations

import functools
import logging
import os
import re
import time
from dataclasses import asdict
from typing import Any

from dcp_volumes import _layout, errors
from dcp_volumes.backends import Backend, StaleUpload, redact_url
from dcp_volumes.catalog._common import (
    Progress,
    compile_step_pattern,
    open_root,
)
from dcp_volumes.catalog._delete import delete_checkpoint
from dcp_volumes.catalog._gc_report import GcReport
from dcp_volumes.catalog._gc_survey import Collection, survey

__all__ = ["GcReport", "gc"]

logger = logging.getLogger(__name__)


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
# Collect


def _collect(backend: Backend, plan: Collection, report: GcReport, progress: Progress | None) -> None:
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
      anything else is reported in ``skipped`` and left alone, unless it holds the removal
      marker of a removal (``rm``, retention) that stopped half way: it is removed whole;
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
    plan = survey(backend, pattern, now, report)
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
