"""Resume from the newest checkpoint that verifies: the one resume loop every framework uses.

A checkpoint is *complete* when its ``.metadata`` parses and its manifest matches (what
``ls`` and ``latest`` check, cheaply); whether its data bytes match their checksums is known
only when they are read. So a resume tries the newest complete checkpoint, and when its
load finds damaged bytes (:class:`~dcp_volumes.errors.IntegrityError`, the same on every
rank: DCP gathers every rank's failure) it says so at WARNING and tries the next older
complete one. Any other error (credentials, the network, a class not allowed) is raised at
once: a checkpoint is never skipped because the store or the caller's options are wrong.

The happy path costs what :func:`dcp_volumes.catalog.latest` costs (one listing, on rank 0);
only after a damaged checkpoint is the root listed once more, for the older candidates.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

import torch.distributed as dist

from dcp_volumes import catalog, errors
from dcp_volumes._dist import from_rank0
from dcp_volumes.backends import redact_url

__all__ = ["candidates", "load_newest"]

logger = logging.getLogger(__name__)

T = TypeVar("T")


def _older(root: str, storage_options: dict[str, Any] | None,
           step_pattern: str | re.Pattern[str] | None, than: catalog.CheckpointInfo
           ) -> list[catalog.CheckpointInfo]:
    infos = catalog.list_checkpoints(root, storage_options=storage_options,
                                     step_pattern=step_pattern)
    older = [i for i in infos if i.complete and i.url != than.url
             and (than.step is None or (i.step is not None and i.step < than.step))]
    older.sort(key=lambda i: (i.step if i.step is not None else -1, i.commit_time or 0.0),
               reverse=True)
    return older


def candidates(root: str, *, storage_options: dict[str, Any] | None = None,
               step_pattern: str | re.Pattern[str] | None = None, process_group: Any = None,
               alone: bool = False) -> Iterator[catalog.CheckpointInfo]:
    """The complete checkpoints under ``root``, newest first, the same on every rank: the
    first from :func:`~dcp_volumes.catalog.latest`; the others, only when asked for, from
    one more listing on rank 0 (broadcast on ``process_group``, as ``latest`` does).
    ``alone``: this process lists by itself, no collective."""
    first = catalog.latest(root, storage_options=storage_options, step_pattern=step_pattern,
                           process_group=process_group, broadcast=not alone)
    if first is None:
        return
    yield first
    distributed = not alone and (process_group is not None or (
        dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1))
    yield from from_rank0(lambda: _older(root, storage_options, step_pattern, first),
                          process_group, distributed)


def load_newest(found: Iterator[catalog.CheckpointInfo],
                load: Callable[[catalog.CheckpointInfo], T], *,
                while_loading: Callable[[], bool] = lambda: True,
                skipped: list[catalog.CheckpointInfo] | None = None,
                ) -> tuple[catalog.CheckpointInfo, T] | None:
    """``load`` the first of ``found`` whose data verifies: ``(its info, what load
    returned)``, or None when ``found`` is empty. Every rank must see the same ``found``
    and call this together (``load`` is collective). ``while_loading()`` says whether an
    IntegrityError came from the checkpoint's load (a ``load`` that goes on to train after
    loading says False once it has loaded: a later error is raised, never retried).
    ``skipped`` gets each damaged checkpoint passed over: it is still *complete* (its
    ``.metadata`` and manifest are sound), so the run's next save of that step must replace
    it (``overwrite``) rather than be refused as existing.

    Raises:
        IntegrityError: no candidate verified (the newest one's error).
        DCPVolumesError: anything else ``load`` raised, at once.
    """
    first_error: errors.IntegrityError | None = None
    for info in found:
        try:
            return info, load(info)
        except errors.IntegrityError as exc:
            if not while_loading():
                raise
            logger.warning("checkpoint %s (step %s) is damaged and was skipped: %s. Resuming "
                           "from the next older complete checkpoint; `dcp-volumes verify %s` "
                           "shows what is damaged", redact_url(info.url), info.step, exc,
                           redact_url(info.url))
            first_error = first_error or exc
            if skipped is not None:
                skipped.append(info)
    if first_error is not None:
        raise first_error
    return None
