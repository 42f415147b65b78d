"""The run record in the store: read (bounded in bytes and time, untrusted, judged, never
raising) and written (atomically, bounded in time)."""

from __future__ import annotations

import dataclasses
import logging
import time
import uuid
from dataclasses import dataclass
from typing import Any, Literal

from dcp_volumes import errors
from dcp_volumes.backends import Backend, open_backend, redact_url
from dcp_volumes.config import RetryOptions
from dcp_volumes.goodput._judge import judge_record
from dcp_volumes.goodput._record import (
    MAX_RECORD_BYTES,
    RECORD_NAME,
    RunRecord,
    dump_record,
    parse_record,
)

__all__ = ["RecordRead", "load_run_record", "read_run_record", "record_root", "store_run_record",
           "write_run_record"]

logger = logging.getLogger(__name__)

#: what became of one read or write of the record
Outcome = Literal["read", "absent", "ignored", "written", "failed", "timed out"]
#: the longest interval an autopilot chooses unless told otherwise (AutopilotOptions' default)
_MAX_INTERVAL_S = 6 * 3600.0


@dataclass(frozen=True, kw_only=True)
class RecordRead:
    """One read of the record: the record (None: none to use), what became of the read
    (``"read"``, ``"absent"``, ``"ignored"`` -- unusable or failing
    :func:`~dcp_volumes.goodput._judge.judge_record` --, ``"failed"``, ``"timed out"``) and,
    for the last two, the store's error (typed, no credentials)."""

    record: RunRecord | None
    outcome: Outcome
    error: BaseException | None = None


def record_root(backend: Backend) -> str:
    """The run root as the record names it: scheme and path, no credentials or endpoint."""
    return f"{backend.scheme}://{backend.root}"


def _bounded(retry: RetryOptions | None, deadline_s: float | None) -> RetryOptions | None:
    """``retry`` with its deadline no longer than ``deadline_s`` (None: unchanged)."""
    if deadline_s is None:
        return retry
    retry = retry or RetryOptions()
    own = retry.deadline_s
    return dataclasses.replace(retry, deadline_s=deadline_s if own is None else min(own,
                                                                                 deadline_s))


def _failure(exc: BaseException, started: float, deadline_s: float | None) -> Outcome:
    """``"timed out"`` when ``exc`` is (or was caused by) a timeout or came at the deadline."""
    seen: BaseException | None = exc
    while seen is not None:
        if isinstance(seen, TimeoutError):
            return "timed out"
        seen = seen.__cause__ or seen.__context__
    late = deadline_s is not None and time.monotonic() - started >= deadline_s
    return "timed out" if late else "failed"


def load_run_record(root: str, storage_options: dict[str, Any] | None,
                    retry: RetryOptions | None = None, *, run: str | None = None,
                    now: float | None = None, max_interval_s: float = _MAX_INTERVAL_S,
                    deadline_s: float | None = None) -> RecordRead:
    """Read the run's record, judged at wall-clock ``now`` (default: this host's) for an
    autopilot of intervals up to ``max_interval_s`` (:func:`judge_record`). ``run``: the
    :func:`~dcp_volumes.goodput.run_key` it must carry (None: any run's). ``deadline_s``:
    the longest the read may take, retries included. Every outcome but ``"read"`` and
    ``"absent"`` is one WARNING that says why, except ``"failed"`` and ``"timed out"``,
    whose consequence the caller logs; never raises for what the store holds or answers."""
    started = time.monotonic()
    try:
        backend = open_backend(root, storage_options, _bounded(retry, deadline_s))
        # one ranged GET, no HEAD first: a record over the cap reads as one byte too many
        # and is refused below, having read at most that much
        data = backend.run(lambda: backend.cat(RECORD_NAME, start=0, end=MAX_RECORD_BYTES + 1),
                           timeout=deadline_s)
    except errors.ObjectNotFoundError:
        return RecordRead(record=None, outcome="absent")
    except errors.UnsafeCheckpointError as exc:  # a FIFO, a link out of the root: not ours
        return _ignored(root, [str(exc)])
    except (errors.DCPVolumesError, OSError) as exc:  # the caller says what it does then
        return RecordRead(record=None, outcome=_failure(exc, started, deadline_s), error=exc)
    record, problems = parse_record(data, root=record_root(backend), run=run)
    if record is not None:
        lies = judge_record(record, now=time.time() if now is None else now,
                            max_interval_s=max_interval_s)
        if lies:
            return _ignored(root, sorted(set(problems)) + lies)
    if record is None:
        return _ignored(root, problems)
    if problems:
        logger.warning("the run record under %s had invalid entries, dropped: %s",
                       redact_url(root), "; ".join(sorted(set(problems))))
    return RecordRead(record=record, outcome="read")


def _ignored(root: str, why: list[str]) -> RecordRead:
    logger.warning("the run record under %s is ignored (%s): the autopilot starts from its "
                   "prior and measures again; the record is rewritten from what this run sees",
                   redact_url(root), "; ".join(why))
    return RecordRead(record=None, outcome="ignored")


def read_run_record(root: str, storage_options: dict[str, Any] | None,
                    retry: RetryOptions | None = None, *,
                    run: str | None = None) -> RunRecord | None:
    """The run's record, or ``None`` when there is none, it is unusable or the store did not
    answer (:func:`load_run_record`, judged now; a WARNING says why)."""
    got = load_run_record(root, storage_options, retry, run=run)
    if got.error is not None:
        logger.warning("the run record under %s could not be read (%s)", redact_url(root),
                       type(got.error).__name__)
    return got.record


def store_run_record(root: str, storage_options: dict[str, Any] | None,
                     retry: RetryOptions | None, record: RunRecord, *,
                     deadline_s: float | None = None) -> Outcome:
    """Write ``record`` in one atomic operation (a reader never sees half of it; on a local
    disk it replaces whatever is at its name, a FIFO included), in at most ``deadline_s``:
    ``"written"``, or a WARNING and ``"failed"`` / ``"timed out"``; never an error of the
    save."""
    started = time.monotonic()
    try:
        backend = open_backend(root, storage_options, _bounded(retry, deadline_s))
        data = dump_record(record)
        backend.run(lambda: backend.commit(RECORD_NAME, data, exclusive=False,
                                           save_id=uuid.uuid4().hex), timeout=deadline_s)
    except (errors.DCPVolumesError, OSError, ValueError) as exc:
        outcome = _failure(exc, started, deadline_s)
        logger.warning("the run record under %s could not be written (%s%s): the autopilot "
                       "keeps its figures in memory and tries again at the next save",
                       redact_url(root), type(exc).__name__,
                       f", no answer in {deadline_s:g} s" if outcome == "timed out" else "")
        return outcome
    return "written"


def write_run_record(root: str, storage_options: dict[str, Any] | None,
                     retry: RetryOptions | None, record: RunRecord) -> bool:
    """Write ``record`` (:func:`store_run_record`); False: it was not written (a WARNING)."""
    return store_run_record(root, storage_options, retry, record) == "written"
