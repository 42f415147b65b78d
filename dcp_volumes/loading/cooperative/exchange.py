"""One rank's side of a cooperative load (``read_data``): rounds of fetch (or local read)
and check, a status every rank agrees on, the exchange, and the copy into the planner's
targets (see the package docstring)."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from torch.distributed.checkpoint.planner import LoadPlanner

from dcp_volumes import _dist, errors, tier
from dcp_volumes.backends import Backend, CallStats
from dcp_volumes.backends.versions import ObjectVersion
from dcp_volumes.loading.apply import PlannerTarget
from dcp_volumes.loading.cooperative.peer import Keep, PeerRound, RoundBytes
from dcp_volumes.loading.cooperative.rank_part import PlanMismatch, RankPart, rank_part
from dcp_volumes.loading.cooperative.sendrecv import AFTER_TIMEOUT, exchange_round
from dcp_volumes.loading.cooperative.storage_data import Assignment, Bundle
from dcp_volumes.loading.needs import Need, plan_ranges
from dcp_volumes.loading.serve import serve
from dcp_volumes.loading.sources import CannotServe, LocalTierSource, StoreSource
from dcp_volumes.transfer.download import RangeRequest

__all__ = ["CooperativeRead", "ExchangeFigures"]

logger = logging.getLogger(__name__)

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


def _need_start(need: Need) -> tuple[str, int]:
    return need.relative, need.start


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
        sizes: the shard files' sizes from the checked manifest (no size lookups for them).
        pins: the object versions every store read is conditional on (a source without
            checksums), or None.
    """

    def __init__(self, assignment: Assignment, *, url: str, planner: LoadPlanner,
                 trusted: tuple[Any, ...], max_concurrency: int, part_size: int,
                 max_range_size: int, timeout_s: float,
                 local_files: dict[str, tier.LocalFile] | None = None,
                 store: bool = True, sizes: Mapping[str, int] | None = None,
                 pins: Mapping[str, ObjectVersion] | None = None) -> None:
        self.a = assignment
        self.sizes = sizes
        self.url = url
        self.planner = planner
        self.trusted = trusted
        self.max_concurrency = max_concurrency
        self.part_size = part_size
        self.max_range_size = max_range_size
        self.timeout_s = timeout_s
        self.local_files = local_files or {}
        self.store = store
        self.pins = pins
        self.target = PlannerTarget(planner, trusted)
        self.me = assignment.rank
        self.fig = ExchangeFigures(rounds=assignment.rounds)
        self.group: Any = None
        self._stop = threading.Event()
        # filled by run's set-up and _prepare
        self.source: StoreSource | None = None
        self.needs: list[Need] = []
        self.part = RankPart()

    # ---- the whole load ---------------------------------------------------------------
    def run(self, backend: Backend | None, needs: list[Need], *,
            failed: BaseException | None = None) -> ExchangeFigures | None:
        """Load this rank's items; None when the ranks agreed to read directly instead.

        ``backend`` and ``needs``: the store and this rank's needs of it. ``failed``: why
        this rank could not even get them (no credentials, a damaged plan, a local-only
        save it cannot serve): it is reported at the first status step, so every rank
        fails at once instead of waiting for this one. Every rank calls ``run``.

        Raises:
            DCPVolumesError: on every rank, when any rank failed to fetch, check or apply
                its bytes (the same class as the failing rank's error), or a peer did not
                answer within ``timeout_s`` (``DownloadError``).
        """
        self.group = _dist.cpu_group(self.a.new_gloo_group)
        err = failed
        code = _dist.OK
        if err is None:
            try:
                self.needs = needs
                self._prepare(backend)
            except PlanMismatch as exc:
                logger.warning("rank %d: %s; every rank reads directly", self.me, exc)
                code = _dist.FALLBACK
            except Exception as exc:  # noqa: BLE001 — reported to every rank by _agree
                err = exc
        if self._agree(err, code, "planning") == _dist.FALLBACK:
            return None
        self._agree(self._run_rounds(), _dist.OK, "the last round")
        return self.fig

    def _run_rounds(self) -> BaseException | None:
        """Every round: its status, exchange and copy; returns a failure to report at the
        last status (one that happened after the last round's status)."""
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
                    self._agree(pending, _dist.OK, f"round {rnd + 1}/{self.a.rounds}")
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
        return pending

    def _start(self, pool: ThreadPoolExecutor, rnd: int) -> tuple[RoundBytes, Future[None]]:
        """Choose round ``rnd``'s destinations (here: the planner is not thread-safe) and
        start fetching its bundles."""
        state = RoundBytes()
        try:
            self._destinations(rnd, state)
        except Exception as exc:  # noqa: BLE001 — reported by _agree via the future
            failed: Future[None] = Future()
            failed.set_exception(exc)
            return state, failed
        return state, pool.submit(self._fetch, rnd, state)

    # ---- phases -------------------------------------------------------------------------
    def _prepare(self, backend: Backend | None) -> None:
        """This rank's part (checked against its needs) and the store source for it."""
        self.part = rank_part(self.a, self.needs, local_files=frozenset(self.local_files),
                              store=self.store, url=self.url,
                              max_size=min(self.part_size, self.max_range_size))
        if backend is not None:
            self.source = StoreSource(backend, self.url, max_concurrency=self.max_concurrency,
                                      chunk_size=self.part_size, stats=self.fig.calls,
                                      pins=self.pins, sizes=self.sizes)
            self.source.check([r for rs in self.part.ranges.values() for r in rs])

    def _destinations(self, rnd: int, st: RoundBytes) -> None:
        """Where each byte this rank receives in round ``rnd`` goes: a tensor's raw bytes
        straight into its target where they map onto it one to one (no copy after), else a
        buffer per larger span or per bundle."""
        for need in self.part.round_needs.get(rnd, []):
            key = (need.relative, need.item_offset)
            target = self.target.direct(need)
            if target is not None:
                st.targets[key] = target
            elif len(self.part.parts[key]) > 1:
                st.need_bufs[key] = bytearray(need.end - need.start)
        for b in self.part.theirs.get(rnd, []):
            key = (b.relative, b.pieces[0].item_offset)
            t = st.targets.get(key)
            if len(b.pieces) == 1 and t is not None and t.start <= b.start and b.end <= t.end:
                st.recv_into[b.bid] = t.view[b.start - t.start:b.end - t.start]
                st.direct.add(b.bid)
            elif len(b.pieces) == 1 and key in st.need_bufs:
                need = self.part.need_of[key]
                st.recv_into[b.bid] = _dist.uint8_tensor(st.need_bufs[key])[b.start - need.start:
                                                                  b.end - need.start]
            else:
                buf = bytearray(b.size)
                st.received[b.bid] = memoryview(buf)
                st.recv_into[b.bid] = _dist.uint8_tensor(buf)

    def _local_failed(self, b: Bundle, why: CannotServe) -> None:
        """A local bundle that cannot be used: fetched from the store instead (or, where the
        store has no copy, the load fails)."""
        if not self.store:
            raise errors.IntegrityError(
                f"rank {self.me}: the local copy of shard {b.relative} of the "
                f"local-only save of {self.url} cannot be used ({why.why}), and the store "
                "has no copy: load the newest durable checkpoint instead") from why.error
        logger.warning("rank %d: local copy of shard %s of %s is not used (%s); "
                       "fetching bytes %d..%d from the store", self.me, b.relative,
                       self.url, why.why, b.start, b.end)
        self.fig.local_fallbacks += len(b.pieces)

    def _fetch(self, rnd: int, st: RoundBytes) -> None:
        """Read (local tier) or fetch (store) and check this rank's bundles of round
        ``rnd``; a local bundle that cannot be used is fetched from the store."""
        keep = Keep(st)
        local = serve(LocalTierSource(self.local_files, self.url),
                      [RangeRequest(h.relative, h.start, h.end, [h])
                       for h in self.part.local_owned.get(rnd, [])],
                      keep, url=self.url, stop=self._stop)
        self.fig.bytes_from_local += local.nbytes
        for span, why in local.unserved:
            self._local_failed(span.bundle, why)
        ranges = self.part.ranges.get(rnd, [])
        if local.failed:
            extra = plan_ranges(local.failed, gap=0,
                                max_size=min(self.part_size, self.max_range_size))
            assert self.source is not None  # a store copy (self.store), so a backend
            self.source.check(extra)
            ranges = ranges + extra
        self.fig.ranges += len(ranges)
        if ranges:
            assert self.source is not None
            before = self.source.fetched
            serve(self.source, ranges, keep, url=self.url, stop=self._stop, last=True)
            self.fig.bytes_fetched += self.source.fetched - before

    def _exchange(self, rnd: int, st: RoundBytes) -> None:
        """Send this rank's bundles of round ``rnd`` to their consumers; receive the bundles
        it needs from their owners into the places :meth:`_destinations` chose."""
        sends = [h.bundle for h in (*self.part.owned.get(rnd, []),
                                    *self.part.local_owned.get(rnd, []))]
        start = time.monotonic()
        got, sent = exchange_round(self.part.theirs.get(rnd, []), sends, st, group=self.group,
                                   me=self.me, url=self.url, timeout_s=self.timeout_s)
        self.fig.bytes_from_peers += got
        self.fig.bytes_to_peers += sent
        self.fig.wait_s += time.monotonic() - start

    def _apply(self, rnd: int, st: RoundBytes) -> None:
        """Serve this round's items from the round's bytes (the peer source) into the
        planner's targets."""
        peer = PeerRound(st, self.part.parts, self.me)
        needs = sorted(self.part.round_needs.get(rnd, []), key=_need_start)
        serve(peer, peer.ranges(needs), self.target, url=self.url, last=True)

    # ---- status -------------------------------------------------------------------------
    def _agree(self, err: BaseException | None, code: int, step: str) -> int:
        """Every rank reports its status; if any failed, every rank raises (see
        :func:`dcp_volumes._dist.agree`). Returns ``OK``, or ``FALLBACK`` when some rank
        asked for direct reads and none failed."""
        start = time.monotonic()
        out = _dist.agree(err, group=self.group, world=self.a.world, me=self.me,
                          timeout_s=self.timeout_s, task=f"loading {self.url} cooperatively",
                          step=step, code=code, note=AFTER_TIMEOUT)
        self.fig.wait_s += time.monotonic() - start
        return out
