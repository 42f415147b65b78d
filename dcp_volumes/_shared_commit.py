"""One read of the committed save per job: rank 0 reads, every rank checks.

``dcp.load`` calls ``read_metadata()`` on every rank at the same instant (torch 2.13's
``_load_state_dict``: inside ``local_step``, before the plans are gathered), so N ranks
would make 4·N requests for two small objects on one prefix (a HEAD and a GET each of
``.metadata`` and the manifest) and hold N copies of a ``.metadata`` that reaches tens of
MB for large models. When that load runs over a process group that spans every rank, rank
0 reads and checks both objects exactly as a single reader does
(:func:`~dcp_volumes._commit_read.read_committed`'s bounded, allow-listed reads) and sends the
bytes over the group (:func:`read_shared`):

1. every rank learns rank 0's outcome (:func:`~dcp_volumes._dist.agree`): a failed read
   raises the same class on every rank (``CheckpointNotFoundError``, ...);
2. rank 0 broadcasts the two lengths and the SHA-256 of the bytes; every rank checks the
   lengths against the bounds a single read has, before allocating anything;
3. rank 0 broadcasts the bytes; every rank checks the digest, unpickles ``.metadata``
   (allow-listed) and parses the manifest itself, and the ranks agree once more: bytes
   that differ on one rank fail the load with ``IntegrityError`` on every rank.

Every wait is bounded by the reader's ``cooperative_timeout_s`` (:mod:`dcp_volumes._dist`'s
bounded collectives): a rank 0 that dies or hangs in its read fails the read with
``DownloadError`` on the others, naming rank 0 and saying which it was (a connection closed
after so many seconds, or nothing within the limit). Such a rank then leaves the collectives
DCP makes after ``read_metadata`` (:func:`leave_dcp`): the load ends there, not at the
process group's timeout (gloo's default: 30 minutes). Outside ``dcp.load`` (a direct
``read_metadata()`` call, ``no_dist=True``), on a subgroup, or where no group carries CPU
tensors, every rank reads itself, as before (:func:`read_commit` decides).
"""

from __future__ import annotations

import hashlib
import inspect
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from dcp_volumes import _dist, _layout, errors
from dcp_volumes._commit_read import (
    MAX_MANIFEST_BYTES,
    MAX_METADATA_BYTES,
    Committed,
    parse_manifest,
    read_committed,
    read_manifest_bytes,
    read_metadata_bytes,
)
from dcp_volumes._metadata import load_metadata, metadata_save_id, volume_save_id
from dcp_volumes.backends import Backend, CallStats, redact_url

__all__ = ["LEADER", "Group", "Header", "broadcast_bytes", "dcp_load_group", "leave_dcp",
           "load_group", "read_commit", "read_leader", "read_shared"]

logger = logging.getLogger(__name__)

#: the rank that reads (torch's coordinator of a load over the whole group)
LEADER = 0
#: where torch defines the load whose ``local_step`` calls ``read_metadata`` on every rank
_TORCH_LOADER = "torch.distributed.checkpoint.state_dict_loader"
#: how many frames up from ``read_metadata`` torch's ``local_step`` may be
_MAX_DEPTH = 12
_DIGEST_WORDS = 4  # SHA-256 as int64 words


@dataclass(frozen=True)
class Group:
    """The ranks that share one read: ``group`` carries CPU tensors (None: the default
    group) and spans all ``world`` ranks; ``rank`` is this one's (global = group) rank;
    ``dcp``: the ``_DistWrapper`` of the ``dcp.load`` the read is in (None: not in one)."""

    group: Any
    rank: int
    world: int
    dcp: Any = None


@dataclass(frozen=True)
class Header:
    """What rank 0 sends first: the lengths of the two objects and the bytes' SHA-256."""

    metadata_len: int
    manifest_len: int
    digest: bytes

    def to_tensor(self) -> torch.Tensor:
        words = torch.frombuffer(bytearray(self.digest), dtype=torch.int64)
        return torch.cat([torch.tensor([self.metadata_len, self.manifest_len]), words])

    @classmethod
    def from_tensor(cls, t: torch.Tensor) -> Header:
        values = t.tolist()
        return cls(int(values[0]), int(values[1]), t[2:].numpy().tobytes())

    def check(self, url: str) -> None:
        """The lengths within the bounds a single reader has (before any allocation)."""
        if not (0 < self.metadata_len <= MAX_METADATA_BYTES
                and 0 <= self.manifest_len <= MAX_MANIFEST_BYTES):
            raise errors.IntegrityError(
                f"the commit of {url} as rank {LEADER} sent it claims {self.metadata_len} "
                f"bytes of .metadata and {self.manifest_len} of manifest, outside the bounds "
                "a reader allows: load again (the ranks' process group is unreliable)")


@dataclass
class LeaderRead:
    """What rank 0 read and checked: the bytes it sends and what it made of them."""

    metadata: bytes
    manifest: bytes
    committed: Committed

    @property
    def header(self) -> Header:
        digest = hashlib.sha256(self.metadata + self.manifest).digest()
        return Header(len(self.metadata), len(self.manifest), digest)


# --------------------------------------------------------------------------------------
# Whether this read is shared
# --------------------------------------------------------------------------------------
def dcp_load_group() -> Any:
    """The ``_DistWrapper`` of the ``dcp.load`` whose ``local_step`` called us, else None.

    torch hands ``read_metadata`` no process group; its ``local_step`` closure holds the
    one the load runs on (``distW``). Found only there: a ``read_metadata()`` called
    anywhere else (by one rank alone) never waits for the others.
    """
    frame = inspect.currentframe()
    for _ in range(_MAX_DEPTH):
        if frame is None:
            return None
        if (frame.f_code.co_name == "local_step"
                and frame.f_globals.get("__name__") == _TORCH_LOADER):
            return frame.f_locals.get("distW")
        frame = frame.f_back
    return None


def load_group() -> Group | None:
    """The group to share this ``read_metadata`` over, or None (every rank reads).

    Shared only inside ``dcp.load`` over a group that spans every rank (the default one,
    or one of the same ranks): the only case where every rank is known to be here now.
    """
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() < 2:
        return None
    wrapper = dcp_load_group()
    if wrapper is None or not getattr(wrapper, "use_dist", False):
        return None
    pg = getattr(wrapper, "group", None)
    world, rank = dist.get_world_size(), dist.get_rank()
    is_world = pg is None or pg is dist.group.WORLD
    if not is_world and (dist.get_world_size(pg) != world or dist.get_rank(pg) != rank):
        return None  # a subgroup: ranks outside it are not reading
    backend = str(dist.get_backend(pg))
    if "gloo" in backend or backend == "mpi":
        return Group(pg, rank, world, wrapper)
    if not is_world:
        return None
    try:
        return Group(_dist.cpu_group(True), rank, world, wrapper)
    except (RuntimeError, ValueError) as exc:
        logger.debug("no CPU group for a shared read of the commit (%s)", exc)
        return None


def leave_dcp(wrapper: Any) -> None:
    """Make the rest of this ``dcp.load``'s collectives this rank's alone (``wrapper``: its
    ``_DistWrapper``; None: the read is in none): called once a peer was lost.

    Whatever ``read_metadata`` raises, DCP then gathers every rank's outcome on its
    coordinator and scatters the verdict, over the process group: a stuck rank 0 holds that
    until the group's timeout, a dead one fails it with gloo's untyped ``RuntimeError``.
    With ``use_dist`` off torch's wrapper skips both, and as its own ``is_coordinator`` this
    rank raises its failure at once: ``CheckpointException`` with our error inside (under
    index 0, the wrapper's only entry; ``dcp_volumes.load`` raises the error itself). The
    ranks' collectives are out of step after a lost peer whatever this rank does: the job
    restarts.
    """
    if wrapper is None:
        return
    if not (hasattr(wrapper, "use_dist") and hasattr(wrapper, "is_coordinator")):
        logger.debug("this torch's dcp.load keeps waiting for a lost rank (no use_dist)")
        return
    wrapper.use_dist = False
    wrapper.is_coordinator = True


def read_commit(backend: Backend, *, with_manifest: bool, stats: CallStats | None,
                share: bool, timeout_s: float) -> Committed:
    """The committed save, read once per job where :func:`load_group` finds a group
    (``share``), else on this rank (:func:`~dcp_volumes._commit_read.read_committed`)."""
    group = load_group() if share else None
    if group is None:
        return read_committed(backend, with_manifest=with_manifest, stats=stats)
    return read_shared(backend, group, with_manifest=with_manifest, stats=stats,
                       timeout_s=timeout_s)


# --------------------------------------------------------------------------------------
# The shared read
# --------------------------------------------------------------------------------------
def read_leader(backend: Backend, *, with_manifest: bool,
                stats: CallStats | None = None) -> LeaderRead:
    """Rank 0's read: the bytes of ``.metadata`` and (when ours) of its manifest, checked
    as :func:`~dcp_volumes._commit_read.read_committed` checks them."""
    data = backend.run(lambda: read_metadata_bytes(backend, stats))
    metadata = load_metadata(data, where=backend.object_url(_layout.METADATA))
    save_id = volume_save_id(metadata)
    raw, manifest = b"", None
    if with_manifest and save_id is not None:
        raw = backend.run(lambda: read_manifest_bytes(backend, save_id, stats))
        manifest = parse_manifest(raw, save_id=save_id, where=backend.object_url(
            _layout.manifest_name(save_id)))
    committed = Committed(metadata, metadata_save_id(metadata), save_id is not None, manifest)
    return LeaderRead(data, raw, committed)


def decode(payload: bytes, header: Header, backend: Backend, *,
           with_manifest: bool) -> Committed:
    """The committed save from the bytes rank 0 sent: digest, then the same checks."""
    url = redact_url(backend.url)
    if hashlib.sha256(payload).digest() != header.digest:
        raise errors.IntegrityError(
            f"the commit of {url} arrived from rank {LEADER} with bytes that differ from "
            "those it read (SHA-256 mismatch): load again (the ranks' process group is "
            "unreliable)")
    data, raw = payload[:header.metadata_len], payload[header.metadata_len:]
    metadata = load_metadata(data, where=backend.object_url(_layout.METADATA))
    save_id = volume_save_id(metadata)
    manifest = None
    if with_manifest and save_id is not None:
        manifest = parse_manifest(raw, save_id=save_id, where=backend.object_url(
            _layout.manifest_name(save_id)))
    return Committed(metadata, metadata_save_id(metadata), save_id is not None, manifest)


def broadcast_bytes(data: bytes | None, size: int, group: Group, timeout_s: float, *,
                    fail: Callable[[str, RuntimeError], BaseException]) -> bytes:
    """``size`` bytes from :data:`LEADER` (``data`` there) to every rank, waiting at most
    ``timeout_s``; raises ``fail(what happened, error)`` when they do not arrive
    (:func:`~dcp_volumes._dist.broadcast`)."""
    if size == 0:
        return b""
    buf = (_dist.uint8_tensor(bytearray(data)) if data is not None
           else torch.empty(size, dtype=torch.uint8))
    _dist.broadcast(buf, src=LEADER, group=group.group, timeout_s=timeout_s,
                    what=f"the bytes of the commit from rank {LEADER}", fail=fail)
    return data if data is not None else buf.numpy().tobytes()


class _Steps:
    """The collectives of one shared read, each bounded by ``timeout_s``; a rank that loses
    a peer in one leaves DCP's collectives of the load (:func:`leave_dcp`) and raises."""

    def __init__(self, group: Group, timeout_s: float, url: str) -> None:
        self.group, self.timeout_s = group, timeout_s
        self.task = f"reading the commit of {url} once for {group.world} ranks"
        # what a lost peer means here: only rank 0 does anything the others wait for
        self.note = ((f"; rank {LEADER} reads the commit for every rank: that read is stuck "
                      f"(the store does not answer) or rank {LEADER} died")
                     if group.rank != LEADER else "") + (
            "; the ranks' process group is out of step now: restart the job")

    def agree(self, err: BaseException | None, step: str) -> None:
        """A failed rank's error class on every rank; ``DownloadError`` for a silent one."""
        g = self.group
        _dist.agree(err, group=g.group, world=g.world, me=g.rank, timeout_s=self.timeout_s,
                    task=self.task, step=step, note=self.note,
                    on_lost=lambda: leave_dcp(g.dcp))

    def header(self, read: LeaderRead | None) -> Header:
        t = read.header.to_tensor() if read is not None else torch.zeros(
            2 + _DIGEST_WORDS, dtype=torch.int64)
        _dist.broadcast(t, src=LEADER, group=self.group.group, timeout_s=self.timeout_s,
                        what=f"the sizes of the commit from rank {LEADER}", fail=self._lost)
        return Header.from_tensor(t)

    def payload(self, read: LeaderRead | None, header: Header) -> bytes:
        data = read.metadata + read.manifest if read is not None else None
        size = header.metadata_len + header.manifest_len
        return broadcast_bytes(data, size, self.group, self.timeout_s, fail=self._lost)

    def _lost(self, said: str, exc: RuntimeError) -> errors.DownloadError:
        """The error a broadcast that did not arrive raises (this rank has left DCP's
        collectives: the error is raised at once)."""
        leave_dcp(self.group.dcp)
        return errors.DownloadError(
            f"rank {self.group.rank}: {said} while {self.task}{self.note} ({exc})")


def read_shared(backend: Backend, group: Group, *, with_manifest: bool,
                stats: CallStats | None, timeout_s: float) -> Committed:
    """Read the committed save on :data:`LEADER`, share and check it on every rank.

    Raises, on every rank alike: rank 0's read error (its class), ``DownloadError`` when a
    rank does not answer within ``timeout_s`` at a step, ``IntegrityError`` when the bytes
    a rank received are not those rank 0 read.
    """
    steps = _Steps(group, timeout_s, redact_url(backend.url))
    read, err = None, None
    if group.rank == LEADER:
        try:
            read = read_leader(backend, with_manifest=with_manifest, stats=stats)
        except Exception as exc:  # noqa: BLE001 — every rank raises it (agree)
            err = exc
    steps.agree(err, f"rank {LEADER} reading .metadata and the manifest")
    header = steps.header(read)
    try:
        header.check(redact_url(backend.url))
    except errors.IntegrityError as exc:
        err = exc
    steps.agree(err, "checking the sizes")
    payload = steps.payload(read, header)
    committed = read.committed if read is not None else None
    err = None
    if committed is None:
        try:
            committed = decode(payload, header, backend, with_manifest=with_manifest)
        except errors.DCPVolumesError as exc:
            err = exc
    steps.agree(err, "checking the bytes")
    assert committed is not None
    return committed
