"""The run record in the store: read (bounded, untrusted, never raising) and written."""

from __future__ import annotations

import logging
from typing import Any

from dcp_volumes import errors
from dcp_volumes.backends import Backend, open_backend, redact_url
from dcp_volumes.config import RetryOptions
from dcp_volumes.goodput._record import (
    MAX_RECORD_BYTES,
    RECORD_NAME,
    RunRecord,
    dump_record,
    parse_record,
)

__all__ = ["read_run_record", "record_root", "write_run_record"]

logger = logging.getLogger(__name__)


def record_root(backend: Backend) -> str:
    """The run root as the record names it: scheme and path, no credentials or endpoint."""
    return f"{backend.scheme}://{backend.root}"


def read_run_record(root: str, storage_options: dict[str, Any] | None,
                    retry: RetryOptions | None = None, *,
                    run: str | None = None) -> RunRecord | None:
    """The run's record, or ``None`` when there is none or it is unusable (a WARNING says
    why; invalid entries of a usable record are dropped with a WARNING). ``run``: the
    :func:`~dcp_volumes.goodput.run_key` the record must carry (None: any run's). Never
    raises for what the store holds."""
    try:
        backend = open_backend(root, storage_options, retry)
        # one ranged GET, no HEAD first: a record over the cap reads as one byte too many
        # and is refused below, having read at most that much
        data = backend.run(lambda: backend.cat(RECORD_NAME, start=0, end=MAX_RECORD_BYTES + 1))
    except errors.ObjectNotFoundError:
        return None
    except (errors.DCPVolumesError, OSError) as exc:
        logger.warning("the run record under %s could not be read (%s): the autopilot starts "
                       "from its prior and measures again", redact_url(root), type(exc).__name__)
        return None
    record, problems = parse_record(data, root=record_root(backend), run=run)
    if record is None:
        logger.warning("the run record under %s is ignored (%s): the autopilot starts from its "
                       "prior and measures again; the record is rewritten at the next save",
                       redact_url(root), "; ".join(problems))
    elif problems:
        logger.warning("the run record under %s had invalid entries, dropped: %s",
                       redact_url(root), "; ".join(sorted(set(problems))))
    return record


def write_run_record(root: str, storage_options: dict[str, Any] | None,
                     retry: RetryOptions | None, record: RunRecord) -> bool:
    """Write ``record``; a failure is a WARNING (False), never an error of the save."""
    try:
        backend = open_backend(root, storage_options, retry)
        data = dump_record(record)
        backend.run(lambda: backend.put(RECORD_NAME, data))
    except (errors.DCPVolumesError, OSError, ValueError) as exc:
        logger.warning("the run record under %s could not be written (%s): the autopilot "
                       "keeps its figures in memory and tries again at the next save",
                       redact_url(root), type(exc).__name__)
        return False
    return True
