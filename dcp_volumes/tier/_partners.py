"""Partner replicas: after a save, each rank sends its local-tier files to a partner rank on
another node, which keeps them in its own tier (``LocalTierOptions(partner_replicas=True)``).

A node whose tier is lost then restores from its partners: at load, the partner finds the
replica with :func:`~dcp_volumes.tier.find_local` like any local copy, and the cooperative load makes it
the owner that reads those bytes and sends them to the rank that needs them. Replicas are
never durable and never trusted: every byte is checked against the committed manifest at
read, as a byte from this node's own tier is.

The partner map: rank ``r`` sends to ``(r + ranks_per_node) % world`` (the same local rank on
the next node), unless ``LocalTierOptions.partners`` names another for it.

The exchange is a fixed sequence of collectives on the Checkpointer's gloo control group
(three ``all_gather_object`` and the point-to-point steps between them), which every rank
joins even when it has nothing to send (a failed save to its tier, a full disk):

1. ``all_gather_object`` of each rank's :class:`_Offer` (its own copy's file list, host, tier
   directory, ``$LOCAL_WORLD_SIZE``); every rank derives the same partner map and schedule
   from them. A pair whose two ranks share one tier directory on one host skips.
2. ``all_gather_object`` of what each receiver accepts: an offer that is the sender's own
   copy (its rank, shard names that are not descriptor names, sizes in range), that fits
   in ``max_bytes`` and in the disk's free space.
3. The files stream in chunks of at most :data:`CHUNK_BYTES` (``isend`` / ``irecv`` of
   ``uint8`` tensors, one chunk per sender per step, so memory stays a chunk per stream),
   each followed by a status byte: a sender whose read failed says so and the stream ends
   there on both sides. The receiver writes them under temporary names.
4. ``all_gather_object`` of each sender's status (it read every byte it sent); the receiver
   writes the partner's descriptor (marked ``replica``) only then, and applies retention.

A failure to replicate is a WARNING on the rank concerned and never fails the save.
"""

from __future__ import annotations

import logging
import os
import socket
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from dcp_volumes import errors
from dcp_volumes._dist import uint8_tensor, wait_all
from dcp_volumes.backends import redact_url
from dcp_volumes.config import LocalTierOptions
from dcp_volumes.tier._replicas import OwnCopy, TierReplica, open_own, own_copy

__all__ = ["CHUNK_BYTES", "partner_map", "replicate"]

logger = logging.getLogger(__name__)

MiB = 1 << 20
#: bytes per message: what a sender or a receiver holds in memory per stream
CHUNK_BYTES = 32 * MiB
#: the longest one step of the exchange may take before the replication gives up
TIMEOUT_S = 600.0
LOCAL_WORLD_ENV = "LOCAL_WORLD_SIZE"


def partner_map(world: int, ranks_per_node: int,
                partners: Mapping[int, int] | None = None) -> dict[int, int]:
    """``{rank: partner}`` for a job of ``world`` ranks, ``ranks_per_node`` per node (the
    node of rank ``r`` is ``r // ranks_per_node``). Empty when the job runs on one node.

    Raises:
        ConfigError: a partner is out of range or on its rank's own node, or the derived map
            would put one there (``world`` not a multiple of ``ranks_per_node``).
    """
    if ranks_per_node >= world:
        return {}
    explicit = dict(partners or {})
    for rank, partner in explicit.items():
        if not (0 <= rank < world and 0 <= partner < world):
            raise errors.ConfigError(
                f"LocalTierOptions.partners maps {rank} to {partner}, and the job has ranks "
                f"0..{world - 1}: name ranks of this job")
    out: dict[int, int] = {}
    for rank in range(world):
        partner = explicit.get(rank, (rank + ranks_per_node) % world)
        if partner // ranks_per_node == rank // ranks_per_node:
            how = ("LocalTierOptions.partners maps it there" if rank in explicit else
                   f"the job's {world} ranks are not a multiple of ranks_per_node="
                   f"{ranks_per_node}")
            raise errors.ConfigError(
                f"rank {rank}'s partner replica would be rank {partner}, on the same node "
                f"({ranks_per_node} ranks per node; {how}): a replica must be on another "
                "node; pass LocalTierOptions(partners={...}) or the right ranks_per_node")
        out[rank] = partner
    return out


@dataclass(frozen=True)
class _Offer:
    rank: int
    host: str
    tier: str  # the tier directory, resolved
    local_world: int | None
    copy: OwnCopy | None


def _local_world() -> int | None:
    try:
        value = int(os.environ.get(LOCAL_WORLD_ENV, ""))
    except ValueError:
        return None
    return value if value > 0 else None


def _ranks_per_node(options: LocalTierOptions, offers: list[_Offer]) -> int:
    if options.ranks_per_node is not None:
        return options.ranks_per_node
    if offers[0].local_world is not None:
        return offers[0].local_world
    return sum(1 for o in offers if o.host == offers[0].host)


def _chunks(copy: OwnCopy) -> list[tuple[int, int, int]]:
    """The stream of ``copy``'s files: ``(file index, offset, length)`` per message (an
    empty file is one message of 0 bytes and its status byte, so its receiver creates it)."""
    out: list[tuple[int, int, int]] = []
    for i, (_, size) in enumerate(copy.stream):
        out.extend((i, off, min(CHUNK_BYTES, size - off)) for off in range(0, size, CHUNK_BYTES))
        if size == 0:
            out.append((i, 0, 0))
    return out


def replicate(options: LocalTierOptions | None, url: str, *, group: Any) -> int:
    """Send this rank's copy of the save at ``url`` to its partner and keep the copies sent
    to this rank (a collective on the gloo ``group``; every rank calls it after the same
    save). A no-op without ``partner_replicas`` or a process group. Never raises: a failure
    is a WARNING. Returns the bytes of replicas this rank kept."""
    if options is None or not options.partner_replicas or not (
            dist.is_available() and dist.is_initialized()):
        return 0
    try:
        return _replicate(options, url, group)
    except errors.ConfigError as exc:
        logger.warning("partner replicas of %s are off: %s", redact_url(url), exc)
    except Exception as exc:  # noqa: BLE001 -- a replica is optional, the save is not
        logger.warning("rank %d: partner replicas of %s failed (%s: %s); the save is "
                       "unaffected", dist.get_rank(), redact_url(url), type(exc).__name__, exc)
    return 0


def _replicate(options: LocalTierOptions, url: str, group: Any) -> int:
    me = dist.get_rank(group)
    world = dist.get_world_size(group)
    copy, offers = _offers(options, url, group, me, world)
    per_node = _ranks_per_node(options, offers)
    if per_node >= world:
        if me == 0:
            logger.warning("partner replicas of %s skipped: all %d ranks are on one node "
                           "(%d ranks per node); set LocalTierOptions.ranks_per_node if not",
                           redact_url(url), world, per_node)
        return 0
    pairs, incoming = _pairs(options, offers, per_node, group, me, world)
    try:
        sent_ok = _stream(options, me, offers, pairs, incoming, group)
    except BaseException:
        for rep in incoming.values():
            rep.abandon()
        raise
    status: list[Any] = [None] * world
    dist.all_gather_object(status, sent_ok, group=group)
    kept = sum(r.complete(bool(status[s])) for s, r in incoming.items())
    if me in pairs or incoming:
        sent = copy.nbytes if me in pairs and copy is not None else 0
        logger.info("rank %d: partner replicas of %s: sent %d bytes to rank %s, kept %d "
                    "bytes of ranks %s", me, redact_url(url), sent, pairs.get(me, "-"), kept,
                    sorted(incoming) or "-")
    return kept


def _offers(options: LocalTierOptions, url: str, group: Any, me: int, world: int
            ) -> tuple[OwnCopy | None, list[_Offer]]:
    """This rank's copy of the save (None when it cannot be read) and every rank's offer."""
    try:
        copy = own_copy(options, url, me)
    except Exception as exc:  # noqa: BLE001 -- this rank must still join the collectives
        logger.warning("rank %d: its copy of %s in the local tier cannot be read (%s): no "
                       "partner replica of its files", me, redact_url(url), exc)
        copy = None
    mine = _Offer(me, socket.gethostname(), os.path.realpath(options.resolved_directory()),
                  _local_world(), copy)
    gathered: list[Any] = [None] * world
    dist.all_gather_object(gathered, mine, group=group)
    return copy, gathered


def _pairs(options: LocalTierOptions, offers: list[_Offer], per_node: int, group: Any,
           me: int, world: int) -> tuple[dict[int, int], dict[int, TierReplica]]:
    """Who streams to whom (a rank with a copy, to a partner not sharing its tier directory
    that accepted it), and the replicas this rank takes in, by sender."""
    partners = partner_map(world, per_node, options.partners)  # the same on every rank
    pairs = {r: p for r, p in partners.items() if offers[r].copy is not None
             and (offers[r].host, offers[r].tier) != (offers[p].host, offers[p].tier)}
    incoming = {s: TierReplica(options, offers[s].copy, me, s)  # type: ignore[arg-type]
                for s, p in sorted(pairs.items()) if p == me}
    accepts: list[Any] = [None] * world
    dist.all_gather_object(accepts, sorted(s for s, r in incoming.items() if r.ok),
                           group=group)
    pairs = {s: p for s, p in pairs.items() if s in accepts[p]}
    incoming = {s: r for s, r in incoming.items() if s in pairs}
    return pairs, incoming


def _stream(options: LocalTierOptions, me: int, offers: list[_Offer], pairs: dict[int, int],
            incoming: dict[int, TierReplica], group: Any) -> bool:
    """Step through every stream in lockstep; True when this rank read all it sent.

    Each message is one chunk of a file and one status byte after it: 1 while the sender
    reads its files, 0 when a read failed, which ends that stream on both sides (the
    sender sends nothing more, the receiver drops what arrived)."""
    streams = {s: _chunks(offers[s].copy) for s in pairs}  # type: ignore[arg-type]
    steps = max((len(c) for c in streams.values()), default=0)
    reader = _OwnReader(options, me, offers[me].copy)
    ended: set[int] = set()
    try:
        for step in range(steps):
            works: list[Any] = []
            recv: list[tuple[int, tuple[int, int, int], torch.Tensor]] = []
            for s in incoming:
                if s not in ended and step < len(streams[s]):
                    chunk = streams[s][step]
                    buf = torch.empty(chunk[2] + 1, dtype=torch.uint8)
                    works.append(dist.irecv(buf, src=s, group=group))
                    recv.append((s, chunk, buf))
            if me in pairs and me not in ended and step < len(streams[me]):
                data = reader.chunk(*streams[me][step])
                works.append(dist.isend(uint8_tensor(data), dst=pairs[me], group=group))
                if not reader.ok:
                    ended.add(me)
            wait_all(works, TIMEOUT_S)
            for s, chunk, buf in recv:
                if not _receive(incoming[s], chunk, buf):
                    ended.add(s)
    finally:
        reader.close()
    return reader.ok


class _OwnReader:
    """Reads this rank's own files for its partner, chunk by chunk."""

    def __init__(self, options: LocalTierOptions, me: int, copy: OwnCopy | None) -> None:
        self.options, self.me, self.copy = options, me, copy
        self.ok = True
        self._fd: int | None = None
        self._index = -1

    def chunk(self, index: int, off: int, length: int) -> bytearray:
        """The chunk's bytes and its status byte (0 once a read failed)."""
        data = bytearray(length + 1)
        assert self.copy is not None
        relative = self.copy.stream[index][0]
        try:
            if index != self._index:
                self.close()
                self._index = index
                self._fd = open_own(self.options, self.copy, relative)
            fd = self._fd
            assert fd is not None
            if length and os.preadv(fd, [memoryview(data)[:length]], off) != length:
                raise EOFError("the file shrank")
        except (OSError, EOFError, errors.DCPVolumesError) as exc:
            logger.warning("rank %d: reading %s from the local tier for its partner replica "
                           "failed (%s): no replica of this rank's files", self.me, relative,
                           exc)
            self.ok = False
        data[length] = 1 if self.ok else 0
        return data

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None


def _receive(rep: TierReplica, chunk: tuple[int, int, int], buf: torch.Tensor) -> bool:
    """Write one received chunk; False when its sender said its stream ended."""
    index, off, length = chunk
    if int(buf[length]) != 1:
        rep.abandon()
        return False
    name, size = rep.copy.stream[index]
    if off == 0:
        rep.begin(name)
    rep.write(memoryview(buf.numpy().data).cast("B")[:length])
    if off + length == size:
        rep.end()
    return True
