"""A rank's own reads of its needs, nearest source first: its local tier, then the store.

:func:`read_tier` serves what this node's local tier holds (whole contiguous tensors read
straight into their targets) and returns what it could not serve; :func:`read_store` serves
the rest from the store, the last source (its failures are the load's). Both go through the
one serve path (:func:`dcp_volumes.loading.serve.serve`).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

from dcp_volumes.loading.apply import PlannerTarget
from dcp_volumes.loading.needs import Need, plan_ranges
from dcp_volumes.loading.serve import serve
from dcp_volumes.loading.sources import CannotServe, LocalTierSource, StoreSource, Unserved
from dcp_volumes.transfer.download import MIN_SPLIT_GET, RangeRequest

__all__ = ["TierRead", "read_store", "read_tier"]

logger = logging.getLogger(__name__)


@dataclass
class TierRead:
    """What :func:`read_tier` did: the bytes it applied, the needs whose local copy failed
    (for the store), and the needs the tier does not hold."""

    bytes_used: int = 0
    fallback: list[Need] = field(default_factory=list)
    elsewhere: list[Need] = field(default_factory=list)


def read_tier(needs: list[Need], source: LocalTierSource, target: PlannerTarget, *,
              gap: int, max_size: int, url: str) -> TierRead:
    """Apply the ``needs`` the local tier holds, each checked as a store read is; a need
    whose local copy cannot be used is left to the store, with a WARNING."""
    mine = [n for n in needs if n.relative in source.files]
    out = TierRead(elsewhere=[n for n in needs if n.relative not in source.files])
    if not mine:
        return out
    into, rest = _split_direct(mine, target, min_size=0)
    ranges = into + plan_ranges(rest, gap=gap, max_size=max_size)
    served = serve(source, ranges, target, url=url)
    _warn(served.unserved, url)
    out.bytes_used, out.fallback = served.nbytes, served.failed
    return out


def _split_direct(needs: list[Need], target: PlannerTarget, *, min_size: int
                  ) -> tuple[list[RangeRequest], list[Need]]:
    """The needs of at least ``min_size`` bytes that are exactly a target's memory (each a
    range read straight into it: no buffer, no copy), and the rest."""
    into: list[RangeRequest] = []
    rest: list[Need] = []
    for need in needs:
        d = target.direct(need) if need.end - need.start >= min_size else None
        if d is not None and (d.start, d.end) == (need.start, need.end):
            into.append(RangeRequest(need.relative, need.start, need.end, [need], into=d))
        else:
            rest.append(need)
    return into, rest


def _warn(unserved: list[tuple[Need, CannotServe]], url: str) -> None:
    """One WARNING per local range not served (all its needs go to the store), one per need
    that failed its check."""
    counts: dict[int, tuple[Need, CannotServe, int]] = {}
    for need, why in unserved:
        first, _, n = counts.get(id(why), (need, why, 0))
        counts[id(why)] = (first, why, n + 1)
    for need, why, n in counts.values():
        if why.reason is Unserved.DAMAGED:
            logger.warning("local copy of shard %s of %s: %s; reading it from the store",
                           need.relative, url, why.why)
        else:
            logger.warning("local copy of shard %s of %s is not used: %s; reading %d items "
                           "from the store", need.relative, url, why.why, n)


def read_store(needs: list[Need], store: StoreSource, target: PlannerTarget, *, gap: int,
               max_size: int, url: str) -> int:
    """Fetch, check and apply ``needs`` from the store; returns the ranges fetched.

    Raises:
        IntegrityError: an object is missing, shorter than planned, or a span fails its
            check (nothing else can serve it).
    """
    for need in needs:
        if need.start == need.end and need.first_block is not None:
            target.apply(need, memoryview(b""), None)  # no element of a raw tensor: no fetch
    needs = [n for n in needs if not (n.start == n.end and n.first_block is not None)]
    if not needs:
        return 0
    # A large tensor's bytes go from the socket straight into its memory; small ones are
    # still coalesced into fewer GETs (a GET costs more than a copy of a small item)
    into, rest = _split_direct(needs, target, min_size=MIN_SPLIT_GET)
    ranges = sorted(into + plan_ranges(rest, gap=gap, max_size=max_size),
                    key=lambda r: (r.relative, r.start))
    store.check(ranges)
    serve(store, ranges, target, url=url, last=True)
    return len(ranges)
