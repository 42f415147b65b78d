"""Who a run is, and which run owns a root: a small lease object under the run root.

Two runs saving to one root resume from and replace each other's checkpoints. So the run
that saves under a root holds a *lease* on it: the object :data:`MARKER` right under the
root (the catalog, retention and ``gc`` never look at objects right under the root) says
which run holds it, which incarnation (process) of that run, where it runs, and a beat
counter that the holder renews every ``lease_s / 4`` seconds while it lives.

A run is named by :class:`RunIdentity`: ``run_id`` stays the same across restarts of one
run where something says so (the ``run_id=`` the caller gives, else ``DCP_VOLUMES_RUN_ID``,
``TORCHELASTIC_RUN_ID`` or ``SLURM_JOB_ID`` from the environment, else one id per process);
``incarnation`` is new in every process. :meth:`RootLease.acquire` takes the root when it is
free, released, held by the same run (a restart) or by a holder that is provably gone (a
process on this host that no longer exists, or a lease not renewed for ``lease_s``); it
refuses a live holder of another run with :class:`~dcp_volumes.errors.RootInUseError`. The
lease is judged by beats observed, not by clocks compared across hosts.

Everything read from the marker is untrusted: at most :data:`MAX_MARKER_BYTES` are read,
every field is checked, and a marker that does not parse is a holder nobody can name (it is
replaced, with a warning). Identities and the marker's bytes: :mod:`._run_marker`.
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
from dcp_volumes._dist import from_rank0
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
    run_identity,
    this_host,
)
from dcp_volumes.config import RetryOptions

__all__ = [
    "LEASE_S",
    "MARKER",
    "MAX_MARKER_BYTES",
    "Holder",
    "RootLease",
    "RunGuard",
    "RunIdentity",
    "parse_marker",
    "run_identity",
]

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


# ---- for a process group: rank 0 holds the lease, every rank learns the outcome ----------
class RunGuard:
    """A run's identity and its lease of a root, for every rank of a process group.

    :meth:`open` (collective) gives every rank rank 0's identity and costs one GET of the
    marker on rank 0 (and a bucket check when there is none), so a missing bucket or
    refused credentials fail at construction, before any training step. :meth:`claim`
    (collective) takes the root before the first save and checks it is still held before
    each later one; every rank raises when rank 0 cannot. :meth:`release` frees it.
    """

    def __init__(self, identity: RunIdentity, lease: RootLease | None, group: Any,
                 distributed: bool) -> None:
        self.identity = identity
        self.lease = lease  # rank 0's; None on the other ranks
        self._group, self._distributed = group, distributed

    @classmethod
    def open(cls, root: str, run_id: str | None, *, storage_options: dict[str, Any] | None,
             retry: RetryOptions | None, group: Any, distributed: bool) -> RunGuard:
        identity = run_identity(run_id)  # a bad run_id raises on every rank
        lease: list[RootLease] = []

        def _open() -> RunIdentity:
            lease.append(RootLease(root, identity, storage_options=storage_options,
                                   retry=retry))
            lease[0].peek()
            return identity

        shared = from_rank0(_open, group, distributed)
        return cls(shared, lease[0] if lease else None, group, distributed)

    def claim(self) -> None:
        def _claim() -> None:
            if self.lease is not None:
                self.lease.check()
                self.lease.acquire()

        from_rank0(_claim, self._group, self._distributed)

    def release(self) -> None:
        if self.lease is not None:
            self.lease.release()
