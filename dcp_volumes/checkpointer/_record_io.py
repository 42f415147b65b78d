"""One autopilot's reads and writes of its run record: each bounded by ``record_deadline_s``,
run off the training loop (the read on a thread of its own, the writes by the process's
record writer, :mod:`._record_writes`), and counted for ``Checkpointer.stats["record"]``.

The read's outcome decides what is written: a record read (or none there, or one ignored)
becomes this run's figures and is written back at every write; a read that failed or timed
out leaves the store's record as it is (writing this incarnation alone over it would lose
the run's history for one answer the store did not give): the next write asks for the
record again instead.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import Any

from dcp_volumes.backends import redact_url
from dcp_volumes.checkpointer._record_writes import record_writes
from dcp_volumes.config import RetryOptions
from dcp_volumes.goodput import RecordRead, RunRecord, load_run_record, store_run_record

__all__ = ["RecordIO"]

logger = logging.getLogger(__name__)


class RecordIO:
    """The record's I/O for one autopilot (see the module docstring)."""

    def __init__(self, root: str, storage_options: dict[str, Any], retry: RetryOptions | None,
                 deadline_s: float) -> None:
        self._root, self._storage_options, self._retry = root, storage_options, retry
        self.deadline_s = deadline_s
        self._lock = threading.Lock()
        self._loader: Callable[[], None] | None = None
        #: the last read's outcome ("not read": none yet, "reading": one in flight)
        self._state = "not read"
        self._counts = {"reads": 0, "writes": 0, "failures": 0, "timeouts": 0}
        record_writes().use_budget(deadline_s)

    def load_soon(self, loader: Callable[[], None]) -> None:
        """Run ``loader`` (which calls :meth:`read`) on a thread of its own; again at the
        next :meth:`write_soon` while the store has not answered."""
        with self._lock:
            self._loader = loader
            self._state = "reading"
        self._start(loader)

    def _start(self, loader: Callable[[], None]) -> None:
        def run() -> None:
            try:
                loader()
            except Exception:  # a bug, not the store's (those are WARNINGs already)
                logger.warning("autopilot: the run record could not be read; asking again at "
                               "the next save", exc_info=True)
                with self._lock:
                    self._state = "failed"

        record_writes().start(run, "dcp-volumes-autopilot-record", self._root)

    def read(self, run_key: str, *, now: float, max_interval_s: float) -> RecordRead:
        """Read the record (bounded by the deadline), judged at wall-clock ``now``."""
        got = load_run_record(self._root, self._storage_options, self._retry, run=run_key,
                              now=now, max_interval_s=max_interval_s,
                              deadline_s=self.deadline_s)
        with self._lock:
            self._state = got.outcome
            self._counts["reads"] += 1
            self._counts["timeouts"] += got.outcome == "timed out"
            self._counts["failures"] += got.outcome == "failed"
        if got.error is not None:
            logger.warning("autopilot: the run record under %s could not be read (%s%s): "
                           "going on from the prior and this run's own measurements, the record "
                           "left as it is; asking again at the next save", redact_url(self._root),
                           type(got.error).__name__,
                           f", no answer in {self.deadline_s:g} s"
                           if got.outcome == "timed out" else "")
        return got

    def write_soon(self, snapshot: RunRecord) -> None:
        """Have ``snapshot`` written by the process's writer (newest wins); while the record
        could not be read, ask for it again instead (that read writes what it merges)."""
        with self._lock:
            state, loader = self._state, self._loader
            if state in ("failed", "timed out") and loader is not None:
                self._state = "reading"
        if state in ("failed", "timed out") and loader is not None:
            self._start(loader)
            return
        if state in ("not read", "reading", "failed", "timed out"):
            return  # the read in flight writes what it merges

        def _write() -> None:
            outcome = store_run_record(self._root, self._storage_options, self._retry,
                                       snapshot, deadline_s=self.deadline_s)
            with self._lock:
                self._counts["writes"] += outcome == "written"
                self._counts["timeouts"] += outcome == "timed out"
                self._counts["failures"] += outcome == "failed"

        record_writes().submit(self._root, _write)

    def flush(self) -> bool:
        """Wait for the read and the write in flight: at most the deadline and what is left
        of the process's budget (a timeout is counted)."""
        done = record_writes().flush(self._root, timeout=self.deadline_s)
        if not done:
            with self._lock:
                self._counts["timeouts"] += 1
        return done

    def stats(self) -> dict[str, Any]:
        """The deadline, the last read's outcome, and how many reads and writes were made,
        failed and timed out (a wait that gave up included)."""
        with self._lock:
            return {"deadline_s": self.deadline_s, "read": self._state, **self._counts}
