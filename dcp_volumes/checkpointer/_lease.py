"""The lease of one run on one root: the marker right under the root that says which run
holds it, written, read back, renewed every ``lease_s / 4`` seconds and released (see
:mod:`._run` for the whole picture and :class:`~._run.RunGuard`, its use by a process group).
"""

from __future__ import annotations

import logging
import os
import secrets
import threading
import time
import weakref
from collections.abc import Callable
from dataclasses import replace
from typing import Any

from dcp_volumes import errors
from dcp_volumes.backends import Backend, open_backend, redact_url
from dcp_volumes.checkpointer._run_marker import (
    LEASE_S,
    MARKER,
    MAX_MARKER_BYTES,
    RUN_ID_ENV,
    Holder,
    RunIdentity,
    holder_gone,
    parse_marker,
    this_host,
)
from dcp_volumes.config import RetryOptions

__all__ = ["RootLease"]

logger = logging.getLogger(__name__)


class RootLease:
    """The lease of one run on one root (see the module docstring).

    Not picklable and not shared across processes: rank 0 of a run holds it.

    Args:
        root: the run root URL.
        identity: this run and process.
        storage_options: passed to fsspec unchanged; never logged.
        retry: the retry policy of the marker's requests.
        lease_s: how long the lease lasts without a renewal.
        clock: the monotonic clock waits are judged by.
        sleep: how to wait between two looks at a holder that may be gone.
    """

    def __init__(self, root: str, identity: RunIdentity, *,
                 storage_options: dict[str, Any] | None = None,
                 retry: RetryOptions | None = None, lease_s: float = LEASE_S,
                 clock: Callable[[], float] = time.monotonic,
                 sleep: Callable[[float], None] = time.sleep) -> None:
        if not (isinstance(lease_s, (int, float)) and 1.0 <= lease_s <= 86400.0):
            raise errors.ConfigError(f"lease_s must be between 1 and 86400 seconds, got {lease_s!r}")
        self.root = root
        self.identity = identity
        self.lease_s = float(lease_s)
        self._backend: Backend = open_backend(root, storage_options, retry)
        self._clock, self._sleep = clock, sleep
        self._beat = 0
        self._held = False
        self._lost: Holder | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()

    # ---- reading and writing the marker --------------------------------------------------
    def peek(self) -> Holder | None:
        """The current holder (None: no marker, or one nobody can name). One GET; on an
        object store where there is no marker, the bucket is checked too.

        Raises:
            BucketNotFoundError: the bucket or container does not exist.
            StoragePermissionError: the store refused the credentials.
        """
        b = self._backend
        try:
            raw = b.run(lambda: b.cat(MARKER, op="read", start=0, end=MAX_MARKER_BYTES + 1))
        except errors.ObjectNotFoundError:
            if b.object_store:
                b.run(b.check_bucket)
            return None
        holder = parse_marker(raw)
        if holder is None:
            logger.warning("the run marker %s is not one this version can read: it names no "
                           "holder", redact_url(b.object_url(MARKER)))
        return holder

    def _mine(self, beat: int, released: bool = False) -> Holder:
        return Holder(run_id=self.identity.run_id, incarnation=self.identity.incarnation,
                      host=this_host(), pid=os.getpid(), beat=beat,
                      lease_s=self.lease_s, renewed=time.time(), released=released)

    def _write(self, holder: Holder, *, exclusive: bool) -> None:
        b = self._backend
        b.run(lambda: b.commit(MARKER, holder.to_bytes(), exclusive=exclusive,
                               save_id=f"run-{secrets.token_hex(6)}"))

    # ---- taking the root -----------------------------------------------------------------
    @property
    def held(self) -> bool:
        return self._held and self._lost is None

    def acquire(self) -> None:
        """Take the root for this run, then keep renewing the lease in a daemon thread.

        Waits at most ``lease_s`` (plus one look) for a holder of another run that may be
        gone; returns at once when the root is free.

        Raises:
            RootInUseError: another run holds the root and is alive (it renewed its lease
                meanwhile, or runs on this host).
            BucketNotFoundError / StoragePermissionError: as :meth:`peek`.
        """
        if self.held:
            return
        holder = self.peek()
        if holder is None:
            try:
                self._write(self._mine(0), exclusive=True)
            except errors.CheckpointExistsError:  # another run created it meanwhile
                holder = self.peek()
            else:
                return self._took(None)
        if holder is not None and not self._free(holder):
            holder = self._wait_gone(holder)
        self._write(self._mine(0 if holder is None else holder.beat + 1), exclusive=False)
        self._confirm()
        self._took(holder)

    def _free(self, holder: Holder) -> bool:
        return (holder.released or holder.run_id == self.identity.run_id
                or holder_gone(holder))

    def _wait_gone(self, holder: Holder) -> Holder | None:
        """Watch ``holder`` for one lease: a new beat proves it alive (refused)."""
        if holder.host == this_host():
            raise self._in_use(holder)  # its process exists (else it would be free): alive
        deadline = self._clock() + holder.lease_s
        while self._clock() < deadline:
            self._sleep(min(holder.lease_s / 4, max(0.0, deadline - self._clock())))
            now = self.peek()
            if now is None or self._free(now):
                return now
            if (now.incarnation, now.beat) != (holder.incarnation, holder.beat):
                raise self._in_use(now)  # it renewed: alive
        logger.warning("%s: taking over the root from %s: its lease of %.0fs ran out",
                       redact_url(self.root), holder.describe(time.time()), holder.lease_s)
        return holder

    def _in_use(self, holder: Holder) -> errors.RootInUseError:
        return errors.RootInUseError(
            f"{redact_url(self.root)} is held by another run: {holder.describe(time.time())}. "
            "Two runs saving under one root resume from and replace each other's checkpoints. "
            "Use another root, or stop that run; if it is this run restarting, give both the "
            f"same run id (run_id=, or the environment variable {RUN_ID_ENV[0]})")

    def _confirm(self) -> None:
        """Read back what was written: of two that took a free root at once, one wins."""
        now = self.peek()
        if now is None or now.incarnation != self.identity.incarnation:
            raise self._in_use(now) if now is not None else errors.RootInUseError(
                f"{redact_url(self.root)}: the run marker changed while this run took the "
                "root; another run is starting there")

    def _took(self, before: Holder | None) -> None:
        self._held, self._lost = True, None
        if before is not None and before.run_id != self.identity.run_id:
            logger.warning("%s was last used by %s; this run (%r) holds it now",
                           redact_url(self.root), before.describe(time.time()),
                           self.identity.run_id)
        self._stop.clear()
        # the thread holds the lease weakly: a lease nobody holds any more stops renewing
        self._thread = threading.Thread(target=_renew_loop, daemon=True,
                                        args=(weakref.ref(self), self._stop, self.lease_s / 4),
                                        name="dcp-volumes-lease")
        self._thread.start()

    # ---- keeping it ----------------------------------------------------------------------
    def check(self) -> None:
        """Raise :class:`~dcp_volumes.errors.RootInUseError` if another run took the root
        while this one held it (seen by a renewal)."""
        with self._lock:
            lost = self._lost
        if lost is not None:
            raise errors.RootInUseError(
                f"{redact_url(self.root)} was taken over by another run while this one held "
                f"it: {lost.describe(time.time())}. This run saves no more there: stop one "
                "of the two runs")

    def renew(self) -> None:
        """One renewal: read the marker, and rewrite it with the next beat if it is ours."""
        now = self.peek()
        if now is None or now.incarnation != self.identity.incarnation:
            with self._lock:
                self._lost = now or replace(self._mine(0), run_id="?", host="?", pid=0)
            self._stop.set()
            logger.error("%s: another run took the root over: this run's saves there will "
                         "be refused", redact_url(self.root))
            return
        self._beat = now.beat + 1
        self._write(self._mine(self._beat), exclusive=False)

    def release(self) -> None:
        """Stop renewing and mark the root released (best effort: else the lease runs out)."""
        if not self._held:
            return
        self._held = False
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=10.0)
        if self._lost is not None:
            return
        try:
            now = self.peek()
            if now is not None and now.incarnation == self.identity.incarnation:
                self._write(self._mine(now.beat + 1, released=True), exclusive=False)
        except Exception as exc:  # noqa: BLE001 -- the lease runs out by itself
            logger.warning("%s: could not release this run's lease (%s); it runs out in "
                           "%.0fs", redact_url(self.root), type(exc).__name__, self.lease_s)


def _renew_loop(lease: weakref.ref[RootLease], stop: threading.Event, every_s: float) -> None:
    while not stop.wait(every_s):
        held = lease()
        if held is None:
            return
        try:
            held.renew()
        except Exception as exc:  # noqa: BLE001 -- retried next beat; the lease may lapse
            logger.warning("%s: could not renew this run's lease (%s)",
                           redact_url(held.root), type(exc).__name__)
        del held
