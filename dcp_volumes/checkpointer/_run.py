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
replaced, with a warning). Identities and the marker's bytes: :mod:`._run_marker`; the
lease object: :mod:`._lease`; here, its use by every rank of a process group.
"""


from __future__ import annotations

from typing import Any

from dcp_volumes._dist import from_rank0
from dcp_volumes.checkpointer._lease import RootLease
from dcp_volumes.checkpointer._run_marker import (
    LEASE_S,
    MARKER,
    MAX_MARKER_BYTES,
    Holder,
    RunIdentity,
    parse_marker,
    run_identity,
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
