"""The coordinator's two moments with the store in a durable save: before any byte moves
(:func:`begin_store_save`: the target checked once by the one definition of complete, a
new save id, its live record) and
after every rank's bytes are durable (:func:`commit_store_save`: durability checked, then
the manifest and ``.metadata`` last, by :mod:`dcp_volumes._commit`)."""

from __future__ import annotations

import contextlib

from dcp_volumes import _commit, _layout, _live, errors
from dcp_volumes._complete import completeness
from dcp_volumes._manifest import Manifest
from dcp_volumes.backends import Backend, CallStats, redact_url

__all__ = ["begin_store_save", "commit_store_save"]


def begin_store_save(backend: Backend, url: str, *,
                     overwrite: bool) -> tuple[str, str | None]:
    """A new save id for a save to ``url``, once the target is checked (once for the whole
    save) and the id's live record is written (gc leaves the save alone while it is fresh,
    even before its first object); and the version of a damaged ``.metadata`` there, which
    the commit may replace (:data:`~dcp_volumes._commit_read.NOT_REGULAR` for one that is not
    a regular object, which it removes first; None if there is none).

    Raises:
        CheckpointExistsError: a complete checkpoint is there and ``overwrite`` is off.
    """
    backend.run(backend.check_bucket)
    found = None if overwrite else completeness(backend)  # the one definition
    replaces = found.version if found is not None else None  # a damaged .metadata
    if found is not None and found.complete:
        raise errors.CheckpointExistsError(
            f"Checkpoint already exists: a complete checkpoint exists at "
            f"{redact_url(url)}: pick a new path, "
            "or pass VolumeWriter(..., overwrite=True) to replace it"
        )
    save_id = _layout.new_save_id()
    backend.run(lambda: _live.mark_live(backend, save_id))
    return save_id, replaces


def commit_store_save(backend: Backend, manifest: Manifest, metadata_bytes: bytes, *,
                      overwrite: bool, replaces: str | None, stats: CallStats) -> list[str]:
    """Commit the save of ``manifest``: every object checked durable, then the manifest and
    ``.metadata`` (see :func:`dcp_volumes._commit.commit`; ``replaces``: the damaged
    ``.metadata`` it may replace); the save's live record is removed whatever happens. Returns the superseded save's objects, for the caller to
    remove (:func:`dcp_volumes._commit.remove_superseded`)."""
    try:
        try:
            # Never commit a save with a missing object: with overwrite that would replace
            # a loadable checkpoint by one that cannot load.
            backend.run(lambda: _commit.check_durable(backend, manifest))
        except errors.UploadError:
            backend.run(lambda: _commit.remove_quietly(backend, sorted(manifest.files)))
            raise
        return backend.run(lambda: _commit.commit(
            backend, manifest=manifest, metadata_bytes=metadata_bytes,
            overwrite=overwrite, stats=stats, replaces=replaces))
    finally:
        with contextlib.suppress(Exception):  # best effort: gc collects a stale record
            backend.run(lambda: _live.end_live(backend, manifest.save_id))
