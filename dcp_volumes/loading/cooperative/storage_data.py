"""What a cooperative load passes through DCP's plans (``storage_data``): each rank's
:class:`LocalInfo` to the coordinator, one :class:`Assignment` (its :class:`Bundle` s of
:class:`Piece` s) back to each rank, and the coordinator's :class:`Summary` for its log line.
Plain values, pickled by DCP between ranks of one job."""

from __future__ import annotations

import socket
from dataclasses import dataclass

import torch.distributed as dist

from dcp_volumes._manifest import ItemEntry

__all__ = ["ROUND_BYTES", "Assignment", "Bundle", "LocalInfo", "Piece", "Summary", "local_info"]

MiB = 1 << 20
#: bytes of bundles per round: what one rank holds at most (its items' bytes of the round)
ROUND_BYTES = 256 * MiB


@dataclass(frozen=True)
class LocalInfo:
    """What a rank tells the coordinator (its local plan's ``storage_data``)."""

    rank: int  # global rank in the default group
    world: int  # size of the default group
    host: str
    cpu_group: bool  # the default group carries CPU tensors (gloo)
    #: shard files this rank holds in its local tier (see ``VolumeReader(local_tier=)``): it
    #: reads what it needs of them from there, and serves them to ranks that need them
    local_files: frozenset[str] = frozenset()


def local_info(local_files: frozenset[str] = frozenset()) -> LocalInfo | None:
    """This rank's :class:`LocalInfo`, or None where no default process group exists."""
    if not (dist.is_available() and dist.is_initialized()):
        return None
    backend = str(dist.get_backend())
    return LocalInfo(dist.get_rank(), dist.get_world_size(), socket.gethostname(),
                     "gloo" in backend or backend == "mpi", local_files)


@dataclass(frozen=True)
class Piece:
    """Bytes ``[start, end)`` of the stored item at ``item_offset``; ``first_block``: the
    item's checksum block it starts at (None: the whole item, or an item with no checksum).
    ``item_length`` and ``entry`` let an owner that does not need the item check it."""

    start: int
    end: int
    item_offset: int
    first_block: int | None
    item_length: int = 0
    entry: ItemEntry | None = None


@dataclass(frozen=True)
class Bundle:
    """Neighbouring pieces of one file with the same consumers: fetched by ``owner`` in one
    span and sent to each consumer as one message. ``consumers`` (the ranks to send to) is
    filled in the owner's copy only. ``local``: the owner reads it from its local tier."""

    bid: int
    round: int
    relative: str
    start: int
    end: int
    owner: int
    pieces: tuple[Piece, ...]
    consumers: tuple[int, ...] = ()
    local: bool = False

    @property
    def size(self) -> int:
        return self.end - self.start


@dataclass(frozen=True)
class Assignment:
    """One rank's part of a cooperative load (its plan's ``storage_data``)."""

    rank: int
    world: int
    rounds: int
    bundles: tuple[Bundle, ...]  # those this rank owns or consumes
    needs: tuple[tuple[str, int, int], ...]  # the spans this rank needs, as the coordinator saw
    new_gloo_group: bool  # the default group cannot carry CPU tensors: make a gloo group


@dataclass
class Summary:
    """The coordinator's view of a cooperative load, for its log line."""

    ranks: int
    unique_bytes: int
    shared_bytes: int
    direct_bytes: int  # what the ranks would fetch reading directly
    bundles: int
    rounds: int
    local_bytes: int = 0  # read from a local tier by their owner
