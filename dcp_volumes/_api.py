"""``dcp_volumes.save`` / ``dcp_volumes.load``: DCP's calls with our writer/reader, raising
our typed errors.

Both DCP calls wrap a rank's failure in a ``CheckpointException`` (a ``BaseException``,
whatever the failure): ``except IncompleteCheckpointError`` around plain ``dcp.load`` never
matches. Our readers make sure the typed error is at least inside it, in ``.failures``
(torch 2.9+ would otherwise turn a failed ``read_metadata`` into an ``AssertionError``
message: :mod:`dcp_volumes._typed`); these wrappers re-raise it unwrapped so callers can tell
"no checkpoint" from "damaged" from "unreachable". ``load`` also takes a reader in place of
the path (a :class:`~dcp_volumes.SafetensorsReader`).
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

from dcp_volumes import _compat, errors
from dcp_volumes.reader import VolumeReader
from dcp_volumes.writer import VolumeWriter

__all__ = ["load", "reraise_typed", "save", "typed_errors", "typed_failure"]


def typed_failure(exc: BaseException) -> errors.DCPVolumesError | None:
    """The dcp_volumes error behind what ``dcp.save``/``dcp.load`` raised, if there is one."""
    seen: list[BaseException] = []
    cur: BaseException | None = exc
    while cur is not None and cur not in seen and len(seen) < 8:
        seen.append(cur)
        if isinstance(cur, errors.DCPVolumesError):
            return cur
        if isinstance(cur, CheckpointException):
            for failure in cur.failures.values():
                inner = failure[0] if isinstance(failure, tuple) else failure
                found = typed_failure(inner) if isinstance(inner, BaseException) else None
                if found is not None:
                    return found
        cur = cur.__cause__ or cur.__context__
    return None


def reraise_typed(exc: BaseException, recorded: errors.DCPVolumesError | None) -> None:
    """Raise the typed error behind ``exc`` (``recorded`` first), if any; else return."""
    typed = recorded or typed_failure(exc)
    if typed is not None and typed is not exc:
        raise typed  # keeps its own cause (the backend error); DCP's exception is its context


@contextlib.contextmanager
def typed_errors(
    recorded: Callable[[], errors.DCPVolumesError | None] = lambda: None,
) -> Iterator[None]:
    """Around a ``dcp.save``/``dcp.load`` call: re-raise the typed error behind what DCP
    raised (``recorded()`` first, e.g. a reader's ``last_error``), if there is one."""
    try:
        yield
    except (Exception, CheckpointException) as exc:  # CheckpointException: a BaseException
        reraise_typed(exc, recorded())
        raise


def _alone(no_dist: bool) -> dict[str, bool]:
    return _compat.no_dist() if no_dist else {}


def load(
    state_dict: dict[str, Any],
    path: str | os.PathLike[str] | VolumeReader,
    /,
    *,
    storage_options: dict[str, Any] | None = None,
    process_group: dist.ProcessGroup | None = None,
    planner: Any = None,
    no_dist: bool = False,
    safe_globals: Sequence[Any] = (),
    **reader_options: Any,
) -> VolumeReader:
    """``dcp.load(state_dict, storage_reader=VolumeReader(path, ...))`` in place, raising
    :class:`~dcp_volumes.errors.DCPVolumesError` subclasses on failure.

    ``path`` may be a reader instead (a :class:`~dcp_volumes.SafetensorsReader`, or a
    :class:`~dcp_volumes.VolumeReader` built by the caller); its options are then its own.
    ``no_dist=True`` loads in this process alone (DCP's ``no_dist``); other keywords go to
    :class:`~dcp_volumes.VolumeReader`. Returns the reader (``last_stats`` has the figures).

    Args:
        state_dict: loaded in place, as for ``dcp.load``.
        path: checkpoint URL, or a reader (then pass no reader options).
        storage_options: passed to fsspec unchanged; never logged.
        process_group: DCP's process group (default: the default group).
        planner: DCP's ``LoadPlanner`` (default: DCP's).
        no_dist: load in this process alone (DCP's ``no_dist``).
        safe_globals: as for :class:`~dcp_volumes.VolumeReader`.
        **reader_options: the other keywords of :class:`~dcp_volumes.VolumeReader`
            (``verify``, ``transfer``, ``cooperative``, ``extension_registry``, ...).

    Raises:
        ConfigError: a reader was passed together with reader options.
    """
    reader = _reader_for(path, storage_options, safe_globals, reader_options)
    with typed_errors(lambda: reader.last_error):
        dcp.load(state_dict, storage_reader=reader, planner=planner, process_group=process_group,
                 **_alone(no_dist))
    return reader


def _reader_for(path: str | os.PathLike[str] | VolumeReader,
                storage_options: dict[str, Any] | None, safe_globals: Sequence[Any],
                reader_options: dict[str, Any]) -> VolumeReader:
    """The reader passed in (then no reader options may come with it), or a new one."""
    if isinstance(path, VolumeReader):
        if storage_options is not None or safe_globals or reader_options:
            raise errors.ConfigError(
                "load() got a reader and reader options: pass storage_options, safe_globals "
                f"and {', '.join(sorted(reader_options)) or 'the rest'} to the reader itself")
        return path
    return VolumeReader(path, storage_options=storage_options, safe_globals=safe_globals,
                        **reader_options)


def save(
    state_dict: dict[str, Any],
    path: str | os.PathLike[str],
    /,
    *,
    storage_options: dict[str, Any] | None = None,
    process_group: dist.ProcessGroup | None = None,
    planner: Any = None,
    no_dist: bool = False,
    **writer_options: Any,
) -> VolumeWriter:
    """``dcp.save(state_dict, storage_writer=VolumeWriter(path, ...))``, raising
    :class:`~dcp_volumes.errors.DCPVolumesError` subclasses on failure.

    ``no_dist=True`` saves from this process alone (DCP's ``no_dist``); other keywords go to
    :class:`~dcp_volumes.VolumeWriter`. Returns the writer (``last_stats`` has the figures).

    Args:
        state_dict: what to save, as for ``dcp.save``.
        path: checkpoint URL (``s3://``, ``gs://``, ``az://``, a local directory, ...).
        storage_options: passed to fsspec unchanged; never logged.
        process_group: DCP's process group (default: the default group).
        planner: DCP's ``SavePlanner`` (default: DCP's).
        no_dist: save from this process alone (DCP's ``no_dist``).
        **writer_options: the other keywords of :class:`~dcp_volumes.VolumeWriter`
            (``overwrite``, ``transfer``, ``retry``, ``spool``, ...).
    """
    writer = VolumeWriter(path, storage_options=storage_options, **writer_options)
    try:
        with typed_errors():
            dcp.save(state_dict, storage_writer=writer, planner=planner,
                     process_group=process_group, **_alone(no_dist))
    finally:
        writer.close()
    return writer
