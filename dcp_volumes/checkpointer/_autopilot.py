"""``Checkpointer(every_seconds="auto")``: the run measures its saves and restores, keeps them
in its record under the root (rank 0 writes it), estimates its failure rate from a prior and
its own interruptions, and re-chooses the cadences (:mod:`dcp_volumes.goodput._auto`).

The Checkpointer calls six hooks: :meth:`Autopilot.begin` (constructed: this incarnation is
recorded at once, so one that dies in its restart still counts), :meth:`Autopilot.track` (a
save started; its completion is watched), :meth:`Autopilot.resumed` (``load_latest``
returned), :meth:`Autopilot.policy` (before each decision: the cadences now),
:meth:`Autopilot.flush` (``wait()``) and :meth:`Autopilot.closed`. A fixed cadence gets
:meth:`Autopilot.off`, whose hooks do nothing. Nothing here fails a save or a resume: the
record's problems are WARNINGs.

Nothing here makes the caller wait for the store. At construction this incarnation is in
the run's figures at once (no I/O); rank 0 reads the record on a thread of its own, which
overlaps the restart's ``load_latest``, and merges it with what this incarnation measured
meanwhile (as of the construction's instant), then writes it back. No hook waits for that
read: until it lands the cadences come from this incarnation alone (an incarnation killed
before that write lands is not counted). The later writes go through the process's record
writer (:mod:`dcp_volumes.checkpointer._record_writes`), so a save does not wait for its
record. Every read and write is bounded by ``record_deadline_s`` and counted in
``stats["record"]`` (:mod:`dcp_volumes.checkpointer._record_io`); :meth:`Autopilot.flush`
(``wait()``, ``close()``) and the exit wait at most one such budget together.

The record read back is untrusted: one that fails
:func:`~dcp_volumes.goodput._judge.judge_record` (the clock, its own span) is ignored with one
WARNING and rewritten from this incarnation's figures, and the saves this process measures
replace the record's claims (:func:`~dcp_volumes.goodput.measured_costs`, ``own=``).

Clocks: every duration within this process (exposure, a save, a resume, the process's start
to training) is measured on the monotonic clock. The record's timestamps are this
incarnation's wall-clock start advanced by monotonic time, so a wall-clock step (NTP, a
paused VM) inside a process changes no duration; only the gap between two incarnations
spans processes and uses the wall clock, and it is bounded (:mod:`dcp_volumes.goodput._record`).
"""

from __future__ import annotations

import copy
import dataclasses
import logging
import os
import sys
import threading
import time
from collections.abc import Callable
from typing import Any, Literal

import torch.distributed as dist

from dcp_volumes import errors
from dcp_volumes.backends import open_backend
from dcp_volumes.checkpointer._policy import SavePolicy
from dcp_volumes.checkpointer._record_io import RecordIO
from dcp_volumes.checkpointer._record_writes import record_writes
from dcp_volumes.config import RetryOptions
from dcp_volumes.goodput import (
    MAX_SAVES,
    AutoInterval,
    AutopilotOptions,
    Bound,
    FailurePrior,
    Incarnation,
    RestoreSample,
    RunRecord,
    SaveSample,
    choose_interval,
    default_prior,
    estimate_failures,
    format_duration,
    measured_costs,
    record_root,
    run_key,
    settle_interval,
)
from dcp_volumes.stats import LoadStats

__all__ = ["MAX_START_AGE_S", "Autopilot", "AutopilotOptions", "process_age_s"]

logger = logging.getLogger(__name__)


def _nothing() -> None:
    pass


#: the longest a process's start can precede its Checkpointer: an age beyond it is a clock
#: step or a wrong ``started_at``, clamped with a WARNING
MAX_START_AGE_S = 3600.0


def process_age_s() -> float | None:
    """How long ago this process started, on the boot clock (Linux: immune to wall-clock
    steps); None where that cannot be read."""
    try:
        with open(f"/proc/{os.getpid()}/stat", "rb") as f:
            fields = f.read().rsplit(b")", 1)[1].split()
        ticks = int(fields[19])  # field 22, starttime, counted after the ")" of the name
        return max(0.0, time.clock_gettime(time.CLOCK_BOOTTIME)
                   - ticks / os.sysconf("SC_CLK_TCK"))
    except (OSError, ValueError, IndexError, AttributeError):
        return None


def _bounded_age(age: float, limit: float) -> float:
    if 0.0 <= age <= limit:
        return age
    logger.warning("autopilot: this incarnation's start is %.3g s before its Checkpointer, "
                   "outside [0, %.3g] s (a wall-clock step, or started_at from another "
                   "clock): taken as %.3g s", age, limit, min(max(age, 0.0), limit))
    return min(max(age, 0.0), limit)


class Autopilot:
    """The run's measurements and the cadences they give (see the module docstring)."""

    def __init__(self, root: str, storage_options: dict[str, Any], retry: RetryOptions | None,
                 options: AutopilotOptions | None, *, local_tier: bool, enabled: bool = True,
                 wall: Callable[[], float] = time.time,
                 monotonic: Callable[[], float] = time.monotonic,
                 started: float | None = None, age_s: float | None = None) -> None:
        """``started``: this incarnation's start on the ``wall`` clock (default
        ``options.started_at``; bounded to [0, 1 h] before now, a launcher's clock is another
        process's); else ``age_s``: how long before now it started (default: the process's
        age on the boot clock, :func:`process_age_s`)."""
        self.enabled = enabled
        self._root, self._storage_options, self._retry = root, storage_options, retry
        self._local_tier, self._wall, self._mono = local_tier, wall, monotonic
        self.options = options or AutopilotOptions()
        wall_now, mono_now = wall(), monotonic()
        started = self.options.started_at if started is None else started
        if started is not None and enabled:  # from another process: the wall clock, bounded
            age_s = _bounded_age(wall_now - started, MAX_START_AGE_S)
        elif age_s is None:
            age_s = (process_age_s() or 0.0) if enabled else 0.0
        #: this incarnation's start, on the wall clock (the record's) and the monotonic one
        self._started, self._started_mono = wall_now - age_s, mono_now - age_s
        self._run: str | None = None
        self._saves_seen = 0
        distributed = dist.is_available() and dist.is_initialized()
        self._rank = dist.get_rank() if distributed else 0
        self._gpus = gpus = dist.get_world_size() if distributed else 1
        model = self.options.failure_model
        self.prior = (FailurePrior.from_model(model, weight=self.options.prior_weight,
                                              trust=self.options.prior_trust)
                      if model is not None else default_prior(gpus,
                                                              weight=self.options.prior_weight))
        self._lock = threading.Lock()
        self._record: RunRecord | None = None
        self._interval = choose_interval(measured_costs(RunRecord(root="")),
                                         self._estimate(RunRecord(root="")), self.options,
                                         local_tier=local_tier)
        self._applied: AutoInterval | None = None
        self._own: list[SaveSample] = []  # the saves this process measured, in the record
        self._io = RecordIO(root, storage_options, retry, self.options.record_deadline_s)

    @classmethod
    def create(cls, every_seconds: object, local_every_seconds: object,
               options: AutopilotOptions | None, root: str, storage_options: dict[str, Any],
               retry: RetryOptions | None, local_tier: object) -> Autopilot:
        """The Checkpointer's autopilot: on for ``every_seconds="auto"``, else off
        (``local_tier``: the Checkpointer's tier options, or None)."""
        if every_seconds != "auto":
            if options is not None:
                raise errors.ConfigError('autopilot= applies to every_seconds="auto" only; pass '
                                         'every_seconds="auto" or drop autopilot=')
            return cls.off()
        if local_every_seconds is not None:
            raise errors.ConfigError('every_seconds="auto" chooses the local cadence too: drop '
                                     "local_every_seconds (local_every_steps may stay)")
        if options is not None and not isinstance(options, AutopilotOptions):
            raise errors.ConfigError("autopilot= must be a dcp_volumes.goodput.AutopilotOptions")
        return cls(root, storage_options, retry, options, local_tier=local_tier is not None)

    @classmethod
    def off(cls) -> Autopilot:
        return cls("", {}, None, None, local_tier=False, enabled=False, age_s=0.0)

    def every_seconds(self, given: Any) -> Any:
        """The ``every_seconds`` the policy starts with."""
        return self._interval.every_s if self.enabled else given

    # ---- hooks -----------------------------------------------------------------------------
    def begin(self, run_id: str | None) -> None:
        """Constructed, in run ``run_id`` (the Checkpointer's ``RunIdentity.run_id``, or None
        where only a per-process id names it: the root is then the run): this incarnation
        is in the run's figures from now; rank 0 reads the record and writes it back with
        this incarnation added on a thread of its own, so that one which dies before its
        first save or resume is still counted."""
        if not self.enabled or self._record is not None:
            return
        self._run = run_id
        at = self._mono()  # the construction's instant, whenever the thread gets to run
        root = self._record_root()
        self._add_incarnation(RunRecord(root=root, run_id=run_key(run_id, root)), at)
        self._update(write=None, at=at)
        if self._rank == 0:  # no I/O elsewhere: the record is rank 0's
            self._io.load_soon(lambda: self._load(at))

    def policy(self, current: SavePolicy) -> SavePolicy:
        """``current`` with the cadences chosen now (the same object when unchanged)."""
        if not self.enabled:
            return current
        with self._lock:
            chosen = self._interval
        if chosen is self._applied:
            return current
        self._applied = chosen
        return dataclasses.replace(current, every_seconds=chosen.every_s,
                                   local_every_seconds=chosen.local_every_s)

    def track(self, kind: str, started: float, writer: Any,
              settle: Callable[[], None] | None) -> Callable[[], None]:
        """A save of ``kind`` started at ``started`` (``time.monotonic``) has returned.
        Sync (``settle`` None): it completed now. Async: returns ``settle`` followed by the
        measurement of its completion and the record's write, for the background save to
        run after its upload (before its waiters wake)."""
        if not self.enabled:
            return settle if settle is not None else _nothing
        returned = self._mono()
        self.begin(self._run)
        if settle is None:
            self._saved(kind, returned - started, 0.0, writer)
            return _nothing

        def _settle_and_measure() -> None:
            settle()
            try:
                self._saved(kind, returned - started, self._mono() - returned, writer)
            except Exception:
                logger.warning("autopilot: the save could not be measured", exc_info=True)

        return _settle_and_measure

    def resumed(self, started: float, step: int | None, load_stats: LoadStats | None,
                local_only: bool) -> None:
        """``load_latest`` (begun at ``started``, ``time.monotonic``) returned ``step``."""
        if not self.enabled:
            return
        now = self._mono()
        self.begin(self._run)
        if step is not None:
            local = local_only or (load_stats is not None and load_stats.bytes_needed > 0
                                   and 2 * load_stats.bytes_from_local >= load_stats.bytes_needed)
            with self._lock:
                assert self._record is not None
                self._record.add_restore(RestoreSample(
                    max(0.0, now - started), max(0.0, now - self._started_mono),
                    "local" if local else "store", self._now()))
        self._update(write="background")

    def closed(self) -> None:
        """``close()`` after the last save completed: a clean end, not an interruption --
        unless an exception is being handled (``with Checkpointer(...)`` unwinding)."""
        if not self.enabled or self._record is None:
            return
        if sys.exc_info()[1] is None:
            with self._lock:
                self._record.incarnations[-1].closed = True
        self._update(write="background")
        self.flush()  # the clean end is in the store when close() returns (or the deadline)

    def flush(self) -> None:
        """Wait for the record's read and write in flight (``Checkpointer.wait()``), at most
        what is left of the process's budget (``record_deadline_s``)."""
        if self.enabled and self._rank == 0:
            self._io.flush()

    # ---- internals -------------------------------------------------------------------------
    def _load(self, at: float) -> None:
        """On the record's own thread: read the record (bounded), and make it this run's
        figures with what this incarnation measured meanwhile (as of monotonic ``at``, the
        construction); a record that fails its checks is rewritten from those alone. A
        store that does not answer leaves the record as it is (read again at the next
        write)."""
        with record_writes().turn(self._root, timeout=self.options.record_deadline_s):
            got = self._io.read(self._run_key(), now=self._now(),
                                max_interval_s=self.options.max_interval_s)
            if got.record is None and got.outcome in ("failed", "timed out"):
                return
            with self._lock:
                assert self._record is not None
                self._record = self._merged(got.record or RunRecord(
                    root=self._record.root, run_id=self._record.run_id), at)
            self._update(write="background", at=at)

    def _run_key(self) -> str:
        assert self._record is not None
        return self._record.run_id

    def _merged(self, base: RunRecord, at: float) -> RunRecord:
        """``base`` (read) with this incarnation and its measurements so far (under the
        lock), on the record's clock: a start moved by :meth:`_start_after` moves them too."""
        assert self._record is not None
        mine = self._record
        inc = mine.incarnations[-1]
        wall0, mono0 = self._started, self._started_mono
        base.gpus = self._gpus
        if base.incarnations and base.incarnations[-1].last_seen > self._started:
            self._start_after(base.incarnations[-1].last_seen, at)
        d_mono = self._started_mono - mono0
        d_wall = self._started - wall0 - d_mono
        base.add_incarnation(Incarnation(self._started, max(inc.last_seen + d_wall,
                                                            self._started),
                                         closed=inc.closed, interval_s=inc.interval_s))
        own = [dataclasses.replace(s, at=s.at + d_wall) for s in mine.saves]
        for sample in own:
            base.add_save(sample)
        for r in mine.restores:
            base.add_restore(dataclasses.replace(
                r, at=r.at + d_wall, start_to_train_s=max(0.0, r.start_to_train_s - d_mono)))
        self._own = own
        return base

    def _add_incarnation(self, record: RunRecord, at: float | None) -> None:
        record.gpus = self._gpus
        now = self._now(at)
        record.add_incarnation(Incarnation(self._started, max(now, self._started),
                                           interval_s=self._interval.every_s))
        with self._lock:
            self._record = record

    def _now(self, at: float | None = None) -> float:
        """Now (or monotonic ``at``) for the record: this incarnation's wall-clock start plus
        monotonic time."""
        return self._started + ((self._mono() if at is None else at) - self._started_mono)

    def _start_after(self, last_seen: float, at: float | None) -> None:
        """The previous incarnation was last seen after this one started: a second
        Checkpointer in this process (it starts now, not with the process), or a wall clock
        stepped back between two processes (it starts at that last sign of life: a gap
        between incarnations is never negative)."""
        now = self._now(at)
        if now < last_seen:
            logger.warning("autopilot: the run record's previous incarnation was last seen "
                           "%.3g s after now (a wall-clock step, or another host's clock): "
                           "this incarnation is taken to start then", last_seen - now)
        self._started = max(now, last_seen)
        self._started_mono = self._mono() if at is None else at

    def _record_root(self) -> str:
        try:
            return record_root(open_backend(self._root, self._storage_options, self._retry))
        except errors.DCPVolumesError:
            return self._root

    def _saved(self, kind: str, blocking_s: float, background_s: float, writer: Any) -> None:
        stats = getattr(writer, "last_stats", None)
        nbytes = int(getattr(stats, "bytes", 0) or 0)
        with self._lock:
            assert self._record is not None
            self._saves_seen += 1
            sample = SaveSample(kind, blocking_s, background_s, nbytes, self._now(),
                                first=self._saves_seen == 1)
            self._record.add_save(sample)
            self._own = [*self._own, sample][-MAX_SAVES:]
        self._update(write="background" if kind == "durable" else None)

    def _estimate(self, record: RunRecord, at: float | None = None) -> Any:
        n, exposure = record.evidence(self._now(at))
        return estimate_failures(self.prior, interruptions=n, exposure_s=exposure)

    def _update(self, *, write: Literal["background"] | None,
                at: float | None = None) -> None:
        """Recompute the cadences from the record (as of monotonic ``at``, default now);
        rank 0 has the record written in the background when asked."""
        with self._lock:
            record = self._record
            assert record is not None
            inc = record.incarnations[-1]
            inc.last_seen = max(inc.last_seen, self._now(at))
            inc.interval_s = self._interval.every_s
            new = choose_interval(measured_costs(record, self.options.window, own=self._own),
                                  self._estimate(record, at), self.options,
                                  local_tier=self._local_tier)
            chosen = settle_interval(self._interval, new, self.options)
            changed, self._interval = chosen is not self._interval, chosen
        if changed:
            self._log(chosen)
        if write is None or self._rank != 0:
            return
        with self._lock:  # the state as it is now: a newer snapshot supersedes it
            snapshot = copy.deepcopy(record)
        self._io.write_soon(snapshot)

    def _log(self, chosen: AutoInterval) -> None:
        local = ("" if chosen.local_every_s is None
                 else f", a local-only save every {format_duration(chosen.local_every_s)}")
        level = logging.WARNING if chosen.bound is Bound.QUEUES else logging.INFO
        logger.log(level, "autopilot: a durable save every %s%s (%s; %s; δ %s s, U %.3g s, R %.3g s, "
                    "M %s)", format_duration(chosen.every_s), local, chosen.reason,
                    chosen.formula, "?" if chosen.delta_s is None else f"{chosen.delta_s:.3g}",
                    chosen.upload_s, chosen.restart_s, format_duration(chosen.mttf_s))

    def stats(self) -> dict[str, Any]:
        """The current cadences and why, the measured costs, the failure estimate."""
        if not self.enabled:
            return {}
        with self._lock:
            record = self._record or RunRecord(root="")
            estimate = self._estimate(record)
            return {"interval": self._interval.to_dict(),
                    "costs": measured_costs(record, self.options.window,
                                            own=self._own).to_dict(),
                    "failures": estimate.to_dict(), "run_id": record.run_id,
                    "record": self._io.stats()}
