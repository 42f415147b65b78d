"""Cooperative loads: a stored byte range that several ranks need is fetched by one of them,
checked against its CRC32C there, and sent to the others over the process group.

It runs inside DCP's own load, through the reader's hooks (no planner of ours):

1. ``prepare_local_plan``: each rank puts a :class:`LocalInfo` (its global rank, host, whether
   its group carries CPU tensors) in its plan's ``storage_data``.
2. ``prepare_global_plan``: the coordinator, holding every rank's plan, calls :func:`assign`.
   The bytes the ranks need are cut into *pieces* (a piece has one set of consumer ranks; a
   large tensor's block-checked data is cut at block boundaries, at most one unit long), the
   pieces into *bundles* (one fetch, one message per consumer), the bundles into *rounds* of
   about ``round_bytes``, and each bundle gets one owner among its consumers, balanced by bytes
   per round (per host first, then per rank). A bundle whose file some rank holds in its
   local tier (``LocalInfo.local_files``) goes to one of those ranks (balanced the same way),
   which reads it from local disk instead of the store and serves it to the others; such a
   rank need not need the bytes itself. DCP scatters one :class:`Assignment` per rank back
   in the plans' ``storage_data``.
3. ``read_data``: :class:`CooperativeRead` runs the rounds. In each, owners fetch and check
   their bundles; every rank then reports a status (one small all-reduce), so a failed fetch
   or checksum raises a typed error on every rank before any byte is exchanged; then owners
   send each bundle to its consumers (point-to-point, CPU tensors), and every rank copies the
   bytes of its items into the planner's targets (a tensor's raw bytes straight into its
   target where they map onto it one to one). The next round is fetched meanwhile; memory
   per rank stays about two rounds.

A rank's local tier may also hold a partner rank's files (``_replicate``: partner replicas,
kept there after the save): they are local copies like its own, so a rank whose node lost its
tier gets its bytes from the partner that holds them, not from the store.

Peers are other ranks of the same job: bytes received from them are not checked again (their
owner checked them); bytes from the store or from a local tier always are, on the rank that
read them. A local copy that fails its check is fetched from the store by its owner instead
(or, where there is no store copy — a local-only save — fails the load on every rank).
"""

from __future__ import annotations

import datetime
import itertools
import logging
import socket
import threading
import time
import warnings
from collections import defaultdict
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.planner import LoadPlanner

from dcp_volumes import _tier, errors
from dcp_volumes._manifest import ItemEntry
from dcp_volumes.backends import Backend, CallStats
from dcp_volumes.transfer.download import RangeRequest, check_extents, fetch_ranges
from dcp_volumes.transfer.readplan import (
    DirectTarget,
    Need,
    apply_need,
    check_need,
    describe,
    direct_target,
    plan_ranges,
)

__all__ = ["Assignment", "Bundle", "CooperativeRead", "ExchangeFigures", "LocalInfo", "Piece",
           "assign", "local_info"]

logger = logging.getLogger(__name__)

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


@dataclass(frozen=True)
class _Piece:
    relative: str
    start: int
    end: int
    item_offset: int
    first_block: int | None
    consumers: tuple[int, ...]
    single: bool  # the piece is the whole span every consumer needs of its item
    item_length: int
    entry: ItemEntry | None


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


def assign(needs_per_rank: list[list[Need]], infos: list[Any], *, unit_bytes: int,
           gap: int, round_bytes: int = ROUND_BYTES
           ) -> tuple[list[Assignment] | None, Summary | str]:
    """Plan a cooperative load from every rank's needs (the coordinator's part).

    Returns one :class:`Assignment` per rank and a :class:`Summary`, or ``None`` and the
    reason the ranks should read directly.
    """
    n = len(needs_per_rank)
    if n < 2:
        return None, "a single rank loads"
    if not all(isinstance(i, LocalInfo) for i in infos):
        return None, "not every rank has a default process group (or cooperative=False there)"
    world = infos[0].world
    if [i.rank for i in infos] != list(range(world)) or any(i.world != world for i in infos):
        return None, ("dcp.load runs on a process group other than the default one (a "
                      "subgroup, or no_dist=True): cooperative loads need the default group")
    by_item: dict[tuple[str, int], list[tuple[int, Need]]] = {}
    for r, needs in enumerate(needs_per_rank):
        for need in needs:
            by_item.setdefault((need.relative, need.item_offset), []).append((r, need))
    pieces: list[_Piece] = []
    for holders in by_item.values():
        whole = [(r, nd) for r, nd in holders if nd.first_block is None]
        part = [(r, nd) for r, nd in holders if nd.first_block is not None]
        for group in (whole, part):
            if group:
                pieces.extend(_pieces_of(group, unit_bytes))
    held: dict[str, tuple[int, ...]] = {}
    for r, info in enumerate(infos):
        for relative in sorted(info.local_files):
            held[relative] = (*held.get(relative, ()), r)
    if not any(len(p.consumers) > 1 for p in pieces) and not any(
            p.relative in held and not set(p.consumers) <= set(held[p.relative])
            for p in pieces):
        return None, ("no stored byte range is needed by more than one rank, and no rank "
                      "needs a file only another rank holds locally")
    bundles = _bundle(pieces, unit_bytes=unit_bytes, gap=gap)
    rounds = _rounds(bundles, round_bytes)
    owners = _owners(bundles, rounds, [i.host for i in infos], n, held)
    per_rank: list[list[Bundle]] = [[] for _ in range(n)]
    local_bytes = 0
    for bid, (group_, rnd, owner) in enumerate(zip(bundles, rounds, owners)):
        consumers = group_[0].consumers
        local = owner in held.get(group_[0].relative, ())
        local_bytes += (group_[-1].end - group_[0].start) if local else 0
        kw: dict[str, Any] = {
            "bid": bid, "round": rnd, "relative": group_[0].relative, "start": group_[0].start,
            "end": group_[-1].end, "owner": owner, "local": local,
            # an owner that does not need the bytes checks them with what the piece carries
            "pieces": tuple(Piece(p.start, p.end, p.item_offset, p.first_block,
                                  *((p.item_length, p.entry) if owner not in consumers
                                    else (0, None)))
                            for p in group_),
        }
        per_rank[owner].append(Bundle(**kw, consumers=tuple(c for c in consumers if c != owner)))
        received = Bundle(**kw)
        for c in consumers:
            if c != owner:
                per_rank[c].append(received)
    new_gloo = not all(i.cpu_group for i in infos)
    nrounds = (rounds[-1] + 1) if rounds else 0
    out = [
        Assignment(r, n, nrounds, tuple(per_rank[r]),
                   tuple(sorted((nd.relative, nd.start, nd.end) for nd in needs_per_rank[r])),
                   new_gloo)
        for r in range(n)
    ]
    sizes = [p.end - p.start for p in pieces]
    summary = Summary(
        ranks=n, unique_bytes=sum(sizes),
        shared_bytes=sum(s for s, p in zip(sizes, pieces) if len(p.consumers) > 1),
        direct_bytes=sum(nd.end - nd.start for needs in needs_per_rank for nd in needs),
        bundles=len(bundles), rounds=nrounds, local_bytes=local_bytes)
    return out, summary


def _pieces_of(holders: list[tuple[int, Need]], unit_bytes: int) -> list[_Piece]:
    """Cut one item's spans (all whole, or all block spans) where any rank's span starts or
    ends; each cut gets the ranks whose span covers it, and long cuts are split."""
    ref = holders[0][1]
    cuts = sorted({x for _, nd in holders for x in (nd.start, nd.end)})
    out = []
    for a, b in itertools.pairwise(cuts):
        covering = [(r, nd) for r, nd in holders if nd.start <= a and b <= nd.end]
        if not covering:
            continue
        consumers = tuple(sorted(r for r, _ in covering))
        for s, e, block in _split(ref, a, b, unit_bytes):
            single = all(nd.start == s and nd.end == e for _, nd in covering)
            out.append(_Piece(ref.relative, s, e, ref.item_offset, block, consumers, single,
                              ref.item_length, ref.entry))
    return out


def _split(ref: Need, a: int, b: int, unit_bytes: int) -> list[tuple[int, int, int | None]]:
    """``[a, b)`` in pieces of at most about ``unit_bytes`` that their owner can check alone:
    at block boundaries for block-checked data, anywhere for an item with no checksum, not at
    all for an item checked by one CRC32C."""
    if ref.first_block is not None and ref.entry is not None:
        bs = ref.entry.block_size
        data_start = ref.start - ref.first_block * bs
        step = max(1, unit_bytes // bs) * bs
        return [(s, min(s + step, b), (s - data_start) // bs) for s in range(a, b, step)]
    if ref.entry is None:
        return [(s, min(s + unit_bytes, b), None) for s in range(a, b, unit_bytes)]
    return [(a, b, None)]


def _bundle(pieces: list[_Piece], *, unit_bytes: int, gap: int) -> list[list[_Piece]]:
    """Group neighbouring small pieces with the same consumers (one fetch, one message). Only
    pieces that are the whole of every consumer's span are grouped, so a piece of a larger
    span always arrives alone, straight into that span's buffer."""
    out: list[list[_Piece]] = []
    for p in sorted(pieces, key=lambda p: (p.relative, p.start, p.end)):
        cur = out[-1] if out else None
        if (
            cur is not None
            and p.single and cur[-1].single
            and cur[0].relative == p.relative and cur[0].consumers == p.consumers
            and cur[-1].end <= p.start <= cur[-1].end + gap
            and p.end - cur[0].start <= unit_bytes
        ):
            cur.append(p)
        else:
            out.append([p])
    return out


def _rounds(bundles: list[list[_Piece]], round_bytes: int) -> list[int]:
    """A round number per bundle: about ``round_bytes`` per round, never splitting an item."""
    out = []
    rnd = acc = 0
    for i, b in enumerate(bundles):
        prev = bundles[i - 1][-1] if i else None
        if (
            prev is not None and acc >= round_bytes
            and (prev.relative, prev.item_offset) != (b[0].relative, b[0].item_offset)
        ):
            rnd += 1
            acc = 0
        out.append(rnd)
        acc += b[-1].end - b[0].start
    return out


def _owners(bundles: list[list[_Piece]], rounds: list[int], hosts: list[str], n: int,
            holders: dict[str, tuple[int, ...]] | None = None) -> list[int]:
    """An owner per bundle. A bundle whose file some ranks hold locally goes to one of them
    (the one consumer that needs it alone, when it holds it); otherwise to a consumer: a
    bundle only one rank needs is its own. The rest go, largest first, to the candidate whose
    host and then whose rank has the fewest bytes to read in that round (then overall)."""
    holders = holders or {}

    def candidates(i: int) -> tuple[int, ...]:
        return holders.get(bundles[i][0].relative) or bundles[i][0].consumers

    owners = [0] * len(bundles)
    total = [0] * n
    by_round: dict[int, list[int]] = defaultdict(list)
    for i, rnd in enumerate(rounds):
        by_round[rnd].append(i)
    for ids in by_round.values():
        mine = [0] * n
        host: dict[str, int] = defaultdict(int)

        def size(i: int) -> int:
            return bundles[i][-1].end - bundles[i][0].start

        alone = {i for i in ids if len(bundles[i][0].consumers) == 1
                 and bundles[i][0].consumers[0] in candidates(i)}
        for i in sorted(alone):
            c = bundles[i][0].consumers[0]
            owners[i] = c
            mine[c] += size(i)
            host[hosts[c]] += size(i)
        for i in sorted((i for i in ids if i not in alone), key=lambda i: (-size(i), i)):
            c = min(candidates(i),
                    key=lambda c: (host[hosts[c]], mine[c], total[c], (c - i) % n))
            owners[i] = c
            mine[c] += size(i)
            host[hosts[c]] += size(i)
        for r in range(n):
            total[r] += mine[r]
    return owners


# --------------------------------------------------------------------------------------------
# Running a cooperative load (every rank, in read_data)

_GLOO_GROUPS: dict[int, Any] = {}

# status codes a rank reports after each phase
_OK, _FALLBACK, _FAILED = 0, 1, 2


class _Mismatch(Exception):
    """This rank's needs are not what the coordinator planned for (a planner changed the plan
    in ``finish_plan``): every rank falls back to direct reads."""


@dataclass
class ExchangeFigures:
    """What one rank moved in a cooperative load."""

    bytes_fetched: int = 0
    bytes_from_peers: int = 0
    bytes_to_peers: int = 0
    bytes_from_local: int = 0  # read from this rank's local tier (for itself or peers)
    local_fallbacks: int = 0  # pieces whose local copy failed and came from the store
    ranges: int = 0
    rounds: int = 0
    wait_s: float = 0.0  # waiting on other ranks (status) and on the exchange
    calls: CallStats = field(default_factory=CallStats)


def _cpu_group(new_gloo: bool) -> Any:
    """The group to exchange CPU tensors on: the default one, or (when its backend cannot
    carry CPU tensors, e.g. NCCL alone) a gloo group over the same ranks, made once per
    process (``new_group`` is a collective: every rank gets here in the same load)."""
    if not new_gloo:
        return None
    key = id(dist.group.WORLD)
    if key not in _GLOO_GROUPS:
        _GLOO_GROUPS[key] = dist.new_group(backend="gloo")
    return _GLOO_GROUPS[key]


def _piece_start(part: tuple[Piece, Bundle]) -> int:
    return part[0].start


def _need_start(need: Need) -> tuple[str, int]:
    return need.relative, need.start


@dataclass
class _Round:
    """One round's bytes on one rank."""

    data: dict[int, memoryview] = field(default_factory=dict)  # fetched bundles (owned)
    received: dict[int, memoryview] = field(default_factory=dict)  # bundles in own buffers
    recv_into: dict[int, torch.Tensor] = field(default_factory=dict)  # where each arrives
    direct: set[int] = field(default_factory=set)  # bundles received into their target
    targets: dict[tuple[str, int], DirectTarget] = field(default_factory=dict)
    need_bufs: dict[tuple[str, int], bytearray] = field(default_factory=dict)


def _tensor(buf: Any) -> torch.Tensor:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # a read-only buffer: gloo only reads what it sends
        return torch.frombuffer(buf, dtype=torch.uint8)


class CooperativeRead:
    """One rank's side of a cooperative load (see the module docstring).

    Args:
        assignment: this rank's part, from :func:`assign` via the plan's ``storage_data``.
        url: the checkpoint's URL, for messages (redacted).
        planner: DCP's load planner (targets, ``load_bytes``, ``commit_tensor``).
        trusted: ``safe_globals`` for object items.
        max_concurrency, part_size, max_range_size: as in ``TransferOptions``.
        timeout_s: the longest this rank waits for the other ranks at one step (a status
            report, or one round's exchange) before it raises ``DownloadError``.
        local_files: the shard files this rank holds in its local tier (its bundles marked
            ``local`` are read from there).
        store: whether the store holds the save (False for a local-only save: a local copy
            that fails its check then fails the load instead of being fetched).
    """

    def __init__(self, assignment: Assignment, *, url: str, planner: LoadPlanner,
                 trusted: tuple[Any, ...], max_concurrency: int, part_size: int,
                 max_range_size: int, timeout_s: float,
                 local_files: dict[str, _tier.LocalFile] | None = None,
                 store: bool = True) -> None:
        self.a = assignment
        self.url = url
        self.planner = planner
        self.trusted = trusted
        self.max_concurrency = max_concurrency
        self.part_size = part_size
        self.max_range_size = max_range_size
        self.timeout_s = timeout_s
        self.local_files = local_files or {}
        self.store = store
        self.me = assignment.rank
        self.fig = ExchangeFigures(rounds=assignment.rounds)
        self.group: Any = None
        self._stop = threading.Event()
        # filled by run's set-up and _prepare
        self.backend: Any = None
        self.needs: list[Need] = []
        self.need_of: dict[tuple[str, int], Need] = {}
        self.parts: dict[tuple[str, int], list[tuple[Piece, Bundle]]] = {}
        self.owned: dict[int, list[Bundle]] = defaultdict(list)
        self.theirs: dict[int, list[Bundle]] = defaultdict(list)
        self.round_needs: dict[int, list[Need]] = defaultdict(list)
        self.ranges: dict[int, list[RangeRequest]] = {}
        self.local_owned: dict[int, list[Bundle]] = defaultdict(list)

    # ---- the whole load ---------------------------------------------------------------
    def run(self, setup: Callable[[], tuple[Backend, list[Need]]]) -> ExchangeFigures | None:
        """Load this rank's items; None when the ranks agreed to read directly instead.

        ``setup`` gives the backend and this rank's needs; it runs inside the first status
        step, so a rank that cannot even start (no credentials, a damaged plan) fails every
        rank at once instead of leaving them waiting for it.

        Raises:
            DCPVolumesError: on every rank, when any rank failed to fetch, check or apply
                its bytes (the same class as the failing rank's error), or a peer did not
                answer within ``timeout_s`` (``DownloadError``).
        """
        self.group = _cpu_group(self.a.new_gloo_group)
        err: BaseException | None = None
        code = _OK
        try:
            self.backend, self.needs = setup()
            self._prepare()
        except _Mismatch as exc:
            logger.warning("rank %d: %s; every rank reads directly", self.me, exc)
            code = _FALLBACK
        except Exception as exc:  # noqa: BLE001 — reported to every rank by _agree
            err = exc
        if self._agree(err, code, "planning") == _FALLBACK:
            return None
        # Round k+1 is fetched (in a thread) while round k is exchanged and applied: the
        # store and the peers' links work at the same time. Its status is still reported
        # before any of its bytes is sent.
        pending: BaseException | None = None
        with ThreadPoolExecutor(1, thread_name_prefix="dcpv-coop-fetch") as pool:
            try:
                nxt = self._start(pool, 0) if self.a.rounds else None
                for rnd in range(self.a.rounds):
                    assert nxt is not None
                    state, fetching = nxt
                    nxt = None
                    try:
                        fetching.result()
                    except Exception as exc:  # noqa: BLE001 — reported by _agree
                        pending = pending or exc
                    self._agree(pending, _OK, f"round {rnd + 1}/{self.a.rounds}")
                    if rnd + 1 < self.a.rounds:
                        nxt = self._start(pool, rnd + 1)
                    self._exchange(rnd, state)
                    try:
                        self._apply(rnd, state)
                    except Exception as exc:  # noqa: BLE001 — reported at the next status
                        pending = exc
                        self._stop.set()
            except BaseException:
                self._stop.set()  # the fetch in flight stops at its next range
                raise
        self._agree(pending, _OK, "the last round")
        return self.fig

    def _start(self, pool: ThreadPoolExecutor, rnd: int) -> tuple[_Round, Future[None]]:
        """Choose round ``rnd``'s destinations (here: the planner is not thread-safe) and
        start fetching its bundles."""
        state = _Round()
        try:
            self._destinations(rnd, state)
        except Exception as exc:  # noqa: BLE001 — reported by _agree via the future
            failed: Future[None] = Future()
            failed.set_exception(exc)
            return state, failed
        return state, pool.submit(self._fetch, rnd, state)

    # ---- phases -------------------------------------------------------------------------
    def _prepare(self) -> None:
        a = self.a
        mine = tuple(sorted((nd.relative, nd.start, nd.end) for nd in self.needs))
        if mine != a.needs:
            raise _Mismatch("the load plan changed after the coordinator planned the "
                            "cooperative load (a planner's finish_plan?)")
        self.need_of = {(nd.relative, nd.item_offset): nd for nd in self.needs}
        for b in a.bundles:
            if b.owner != self.me:
                self.theirs[b.round].append(b)
            elif b.local:
                if b.relative not in self.local_files:
                    raise _Mismatch(f"bundle {b.bid} is planned from a local copy of "
                                    f"{b.relative} this rank does not hold")
                self.local_owned[b.round].append(b)
            else:
                if not self.store:
                    raise errors.IntegrityError(
                        f"no rank holds a usable local copy of shard {b.relative} of the "
                        f"local-only save of {self.url}, and the store has none: it cannot "
                        "be loaded; load the newest durable checkpoint instead")
                self.owned[b.round].append(b)
            for p in b.pieces:
                key = (b.relative, p.item_offset)
                if key not in self.need_of:
                    if b.owner == self.me:
                        continue  # served to the others from this rank's local tier
                    raise _Mismatch(f"bundle {b.bid} serves an item this rank does not need")
                self.parts.setdefault(key, []).append((p, b))
        rounds_of: dict[tuple[str, int], set[int]] = {}
        for key, parts in self.parts.items():
            need = self.need_of[key]
            parts.sort(key=_piece_start)
            pos = need.start
            for p, _ in parts:
                if p.start != pos:
                    break
                pos = p.end
            if pos != need.end or parts[-1][0].end != need.end:
                raise _Mismatch(f"the pieces planned for {describe(need.reads[0])} do not "
                                "cover what this rank needs")
            rounds_of[key] = {b.round for _, b in parts}
        if set(self.parts) != set(self.need_of) or any(len(r) != 1 for r in rounds_of.values()):
            raise _Mismatch("the cooperative plan does not cover this rank's items")
        for key, need in self.need_of.items():
            self.round_needs[next(iter(rounds_of[key]))].append(need)
        for rnd, owned in self.owned.items():
            # gap 0: the bytes between two of this rank's bundles belong to other owners
            # (neighbours with the same consumers were bundled, gaps included)
            # (and one GET each: a range longer than a part would be assembled, one more copy)
            self.ranges[rnd] = plan_ranges(owned, gap=0,
                                           max_size=min(self.part_size, self.max_range_size))
        everything = [r for rs in self.ranges.values() for r in rs]
        if everything:
            check_extents(self.backend, everything, self._missing, self._short)

    def _destinations(self, rnd: int, st: _Round) -> None:
        """Where each byte this rank receives in round ``rnd`` goes: a tensor's raw bytes
        straight into its target where they map onto it one to one (no copy after), else a
        buffer per larger span or per bundle."""
        for need in self.round_needs.get(rnd, []):
            key = (need.relative, need.item_offset)
            target = direct_target(need, self.planner)
            if target is not None:
                st.targets[key] = target
            elif len(self.parts[key]) > 1:
                st.need_bufs[key] = bytearray(need.end - need.start)
        for b in self.theirs.get(rnd, []):
            key = (b.relative, b.pieces[0].item_offset)
            t = st.targets.get(key)
            if len(b.pieces) == 1 and t is not None and t.start <= b.start and b.end <= t.end:
                st.recv_into[b.bid] = t.view[b.start - t.start:b.end - t.start]
                st.direct.add(b.bid)
            elif len(b.pieces) == 1 and key in st.need_bufs:
                need = self.need_of[key]
                st.recv_into[b.bid] = _tensor(st.need_bufs[key])[b.start - need.start:
                                                                  b.end - need.start]
            else:
                buf = bytearray(b.size)
                st.received[b.bid] = memoryview(buf)
                st.recv_into[b.bid] = _tensor(buf)

    def _check_bundle(self, b: Bundle, bview: memoryview) -> None:
        for p in b.pieces:
            need = self.need_of.get((b.relative, p.item_offset))
            if need is not None:
                span = Need(b.relative, p.start, p.end, need.item_offset, need.item_length,
                            need.reads, need.entry, p.first_block)
            else:  # an item this rank serves without needing it
                span = Need(b.relative, p.start, p.end, p.item_offset, p.item_length, [],
                            p.entry, p.first_block)
            check_need(span, bview[p.start - b.start:p.end - b.start], self.url)

    def _read_local(self, rnd: int, st: _Round) -> list[Bundle]:
        """Read and check this rank's local bundles of round ``rnd``; those whose local copy
        cannot be used are returned (for the store)."""
        failed: list[Bundle] = []
        for b in self.local_owned.get(rnd, []):
            if self._stop.is_set():
                return []
            local = self.local_files[b.relative]
            try:
                bview = memoryview(_tier.read_span(local, b.start, b.end))
                self._check_bundle(b, bview)
            except (OSError, errors.IntegrityError) as exc:
                if not self.store:
                    raise errors.IntegrityError(
                        f"rank {self.me}: the local copy of shard {b.relative} of the "
                        f"local-only save of {self.url} cannot be used ({exc}), and the store "
                        "has no copy: load the newest durable checkpoint instead") from exc
                logger.warning("rank %d: local copy of shard %s of %s is not used (%s); "
                               "fetching bytes %d..%d from the store", self.me, b.relative,
                               self.url, exc, b.start, b.end)
                self.fig.local_fallbacks += len(b.pieces)
                failed.append(b)
                continue
            self.fig.bytes_from_local += len(bview)
            st.data[b.bid] = bview
        return failed

    def _fetch(self, rnd: int, st: _Round) -> None:
        """Read (local tier) or fetch (store) and check this rank's bundles of round
        ``rnd``."""
        ranges = self.ranges.get(rnd, [])
        failed = self._read_local(rnd, st)
        if failed:
            extra = plan_ranges(failed, gap=0,
                                max_size=min(self.part_size, self.max_range_size))
            check_extents(self.backend, extra, self._missing, self._short)
            ranges = ranges + extra
        self.fig.ranges += len(ranges)
        for rng, payload in fetch_ranges(self.backend, ranges,
                                         max_concurrency=self.max_concurrency,
                                         chunk_size=self.part_size, stats=self.fig.calls,
                                         on_missing=self._missing):
            if self._stop.is_set():
                return  # the load failed elsewhere: the generator cancels the rest
            self.fig.bytes_fetched += len(payload)
            view = memoryview(payload)
            for b in rng.items:
                bview = view[b.start - rng.start:b.end - rng.start]
                self._check_bundle(b, bview)
                st.data[b.bid] = bview

    def _exchange(self, rnd: int, st: _Round) -> None:
        """Send this rank's bundles to their consumers; receive the bundles it needs from
        their owners into the places :meth:`_destinations` chose."""
        works: list[tuple[Any, str]] = []
        start = time.monotonic()
        deadline = start + self.timeout_s
        what = "?"
        try:
            for b in self.theirs.get(rnd, []):
                if b.size == 0:
                    continue
                what = f"bytes {b.start}..{b.end} of shard {b.relative} from rank {b.owner}"
                works.append((dist.irecv(st.recv_into[b.bid], src=b.owner, group=self.group,
                                         tag=b.bid), what))
                self.fig.bytes_from_peers += b.size
            for b in [*self.owned.get(rnd, []), *self.local_owned.get(rnd, [])]:
                if not b.consumers or b.size == 0:
                    continue
                t = _tensor(st.data[b.bid])
                for c in b.consumers:
                    what = f"bytes {b.start}..{b.end} of shard {b.relative} to rank {c}"
                    works.append((dist.isend(t, dst=c, group=self.group, tag=b.bid), what))
                    self.fig.bytes_to_peers += b.size
            for work, what in works:  # `what` names the one that failed, below
                work.wait(timeout=datetime.timedelta(
                    seconds=max(0.001, deadline - time.monotonic())))
        except RuntimeError as exc:
            raise errors.DownloadError(
                f"rank {self.me}: exchanging {what} of {self.url} failed or took longer than "
                f"{self.timeout_s:.0f}s: a rank died or is stuck ({exc})"
            ) from exc
        self.fig.wait_s += time.monotonic() - start

    def _apply(self, rnd: int, st: _Round) -> None:
        """Copy this round's items into the planner's targets."""
        for need in sorted(self.round_needs.get(rnd, []), key=_need_start):
            key = (need.relative, need.item_offset)
            parts = self.parts[key]
            target = st.targets.get(key)
            if target is not None:
                for p, b in parts:
                    if b.bid in st.direct:
                        continue  # received in place
                    src = (st.data[b.bid] if b.owner == self.me else st.received[b.bid])
                    lo, hi = max(p.start, target.start), min(p.end, target.end)
                    if lo < hi:
                        target.view[lo - target.start:hi - target.start].copy_(
                            _tensor(src[lo - b.start:hi - b.start]))
                self.planner.commit_tensor(target.read, target.target)
                continue
            if key in st.need_bufs:
                buf = st.need_bufs[key]
                for p, b in parts:
                    if b.owner == self.me:
                        buf[p.start - need.start:p.end - need.start] = \
                            st.data[b.bid][p.start - b.start:p.end - b.start]
                chunk = memoryview(buf)
            else:
                p, b = parts[0]
                view = st.data[b.bid] if b.owner == self.me else st.received[b.bid]
                chunk = view[p.start - b.start:p.end - b.start]
            apply_need(need, chunk, self.planner, self.trusted)

    # ---- status -------------------------------------------------------------------------
    def _agree(self, err: BaseException | None, code: int, step: str) -> int:
        """Every rank reports its status; if any failed, every rank raises.

        Returns ``_OK``, or ``_FALLBACK`` when some rank asked for direct reads and none
        failed.
        """
        codes = torch.zeros(self.a.world, dtype=torch.int64)
        codes[self.me] = _FAILED if err is not None else code
        start = time.monotonic()
        try:
            work = dist.all_reduce(codes, group=self.group, async_op=True)
            work.wait(timeout=datetime.timedelta(seconds=self.timeout_s))
        except RuntimeError as exc:
            if err is not None:
                raise err  # this rank's own failure says more than the lost peers
            raise errors.DownloadError(
                f"rank {self.me}: the other ranks' status did not arrive while loading "
                f"{self.url} ({step}; waited at most {self.timeout_s:.0f}s): a rank died or "
                f"is stuck ({exc})"
            ) from exc
        self.fig.wait_s += time.monotonic() - start
        failed = [r for r, c in enumerate(codes.tolist()) if c == _FAILED]
        if not failed:
            return _FALLBACK if any(c == _FALLBACK for c in codes.tolist()) else _OK
        src = failed[0]
        message: list[Any] = [
            (type(err).__name__, str(err)) if self.me == src and err is not None else None]
        try:
            dist.broadcast_object_list(message, src=src, group=self.group)
        except RuntimeError as exc:  # the failing rank died after reporting: name it anyway
            if err is None:
                raise errors.DownloadError(
                    f"rank {src} failed while loading {self.url} cooperatively ({step}) and "
                    f"its message did not arrive ({exc})") from exc
        if err is not None:
            raise err
        name, text = message[0] if isinstance(message[0], tuple) else ("", "?")
        cls = getattr(errors, str(name), None)
        if not (isinstance(cls, type) and issubclass(cls, errors.DCPVolumesError)):
            cls = errors.DownloadError
        more = f" (and {len(failed) - 1} other rank(s))" if len(failed) > 1 else ""
        raise cls(f"rank {src}{more} failed while loading {self.url} cooperatively ({step}): "
                  f"{text}")

    # ---- errors -------------------------------------------------------------------------
    def _missing(self, rng: RangeRequest, exc: BaseException) -> BaseException:
        return errors.IntegrityError(
            f"shard {rng.relative} of {self.url} is missing: the checkpoint is damaged or was "
            "replaced while loading"
        )

    def _short(self, rng: RangeRequest, size: int) -> BaseException:
        return errors.IntegrityError(
            f"shard {rng.relative} of {self.url} is truncated or its metadata is damaged: "
            f"bytes up to {rng.end} are needed, the object has {size}"
        )
