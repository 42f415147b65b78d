"""This rank's part of a cooperative load, worked out from its :class:`Assignment` (pure).

:func:`rank_part` checks the coordinator's plan against the needs this rank has now and
sorts the bundles by what this rank does with them each round: fetch from the store, read
from its local tier, receive from their owners; and which pieces make up each item it needs.
A plan that no longer fits the rank's needs (a planner changed it in ``finish_plan``) raises
:class:`PlanMismatch`: every rank then falls back to direct reads.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field

from dcp_volumes import errors
from dcp_volumes.loading.cooperative.peer import Held, held
from dcp_volumes.loading.cooperative.storage_data import Assignment, Bundle, Piece
from dcp_volumes.loading.needs import Need, describe, plan_ranges
from dcp_volumes.transfer.download import RangeRequest

__all__ = ["PlanMismatch", "RankPart", "rank_part"]


class PlanMismatch(Exception):
    """This rank's needs are not what the coordinator planned for (a planner changed the plan
    in ``finish_plan``): every rank falls back to direct reads."""


@dataclass
class RankPart:
    """What this rank does in each round (keys ``(relative, item_offset)`` name an item).

    Attributes:
        need_of: this rank's needs by item.
        parts: the pieces (and their bundles) that make up each item it needs, in order.
        owned: per round, the bundles it fetches from the store.
        local_owned: per round, the bundles it reads from its local tier.
        theirs: per round, the bundles it receives from their owners.
        round_needs: per round, the needs its bytes complete.
        ranges: per round, the store reads of its ``owned`` bundles.
    """

    need_of: dict[tuple[str, int], Need] = field(default_factory=dict)
    parts: dict[tuple[str, int], list[tuple[Piece, Bundle]]] = field(default_factory=dict)
    owned: dict[int, list[Held]] = field(default_factory=lambda: defaultdict(list))
    local_owned: dict[int, list[Held]] = field(default_factory=lambda: defaultdict(list))
    theirs: dict[int, list[Bundle]] = field(default_factory=lambda: defaultdict(list))
    round_needs: dict[int, list[Need]] = field(default_factory=lambda: defaultdict(list))
    ranges: dict[int, list[RangeRequest]] = field(default_factory=dict)


def rank_part(a: Assignment, needs: list[Need], *, local_files: frozenset[str] | set[str],
              store: bool, url: str, max_size: int) -> RankPart:
    """This rank's part of ``a``, checked against its ``needs`` (``store``: the store holds
    the save; ``max_size``: the longest store read).

    Raises:
        PlanMismatch: the plan does not fit this rank's needs.
        IntegrityError: a local-only save's bundle no rank can read locally.
    """
    mine = tuple(sorted((nd.relative, nd.start, nd.end) for nd in needs))
    if mine != a.needs:
        raise PlanMismatch("the load plan changed after the coordinator planned the "
                           "cooperative load (a planner's finish_plan?)")
    part = RankPart(need_of={(nd.relative, nd.item_offset): nd for nd in needs})
    for b in a.bundles:
        _sort_bundle(part, b, a.rank, local_files=local_files, store=store, url=url)
    rounds_of = {key: _covered(part.need_of[key], parts) for key, parts in part.parts.items()}
    if set(part.parts) != set(part.need_of) or any(len(r) != 1 for r in rounds_of.values()):
        raise PlanMismatch("the cooperative plan does not cover this rank's items")
    for key, need in part.need_of.items():
        part.round_needs[next(iter(rounds_of[key]))].append(need)
    for rnd, owned in part.owned.items():
        # gap 0: the bytes between two of this rank's bundles belong to other owners
        # (neighbours with the same consumers were bundled, gaps included)
        # (and one GET each: a range longer than a part would be assembled, one more copy)
        part.ranges[rnd] = plan_ranges(owned, gap=0, max_size=max_size)
    return part


def _sort_bundle(part: RankPart, b: Bundle, me: int, *, local_files: frozenset[str] | set[str],
                 store: bool, url: str) -> None:
    """File bundle ``b`` under what this rank does with it, and its pieces under the items."""
    if b.owner != me:
        part.theirs[b.round].append(b)
    elif b.local:
        if b.relative not in local_files:
            raise PlanMismatch(f"bundle {b.bid} is planned from a local copy of "
                               f"{b.relative} this rank does not hold")
        part.local_owned[b.round].append(held(b, part.need_of))
    else:
        if not store:
            raise errors.IntegrityError(
                f"no rank holds a usable local copy of shard {b.relative} of the "
                f"local-only save of {url}, and the store has none: it cannot "
                "be loaded; load the newest durable checkpoint instead")
        part.owned[b.round].append(held(b, part.need_of))
    for p in b.pieces:
        key = (b.relative, p.item_offset)
        if key not in part.need_of:
            if b.owner == me:
                continue  # served to the others from this rank's local tier
            raise PlanMismatch(f"bundle {b.bid} serves an item this rank does not need")
        part.parts.setdefault(key, []).append((p, b))


def _covered(need: Need, parts: list[tuple[Piece, Bundle]]) -> set[int]:
    """Sort ``parts`` by start, check that they cover ``need`` exactly; their rounds."""
    parts.sort(key=_piece_start)
    pos = need.start
    for p, _ in parts:
        if p.start != pos:
            break
        pos = p.end
    if pos != need.end or parts[-1][0].end != need.end:
        raise PlanMismatch(f"the pieces planned for {describe(need.reads[0])} do not "
                           "cover what this rank needs")
    return {b.round for _, b in parts}


def _piece_start(part: tuple[Piece, Bundle]) -> int:
    return part[0].start
