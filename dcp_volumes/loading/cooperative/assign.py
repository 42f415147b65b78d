"""The coordinator's part of a cooperative load: a pure function from every rank's needs to
one :class:`Assignment` per rank (see the package docstring for the whole load).

The bytes the ranks need are cut into *pieces* (a piece has one set of consumer ranks; a
large tensor's block-checked data is cut at block boundaries, at most one unit long), the
pieces into *bundles* (one fetch, one message per consumer), the bundles into *rounds* of
about ``round_bytes``, and each bundle gets one owner among its consumers, balanced by bytes
per round (per host first, then per rank). A bundle whose file some rank holds in its local
tier (``LocalInfo.local_files``) goes to one of those ranks (balanced the same way), which
reads it from local disk instead of the store and serves it to the others; such a rank need
not need the bytes itself. The values it reads and returns: :mod:`.storage_data`.
"""

from __future__ import annotations

import itertools
from collections import defaultdict
from dataclasses import dataclass
from typing import Any

from dcp_volumes._manifest import ItemEntry
from dcp_volumes.loading.cooperative.storage_data import (
    ROUND_BYTES,
    Assignment,
    Bundle,
    LocalInfo,
    Piece,
    Summary,
)
from dcp_volumes.loading.needs import Need

__all__ = ["assign"]

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



def assign(needs_per_rank: list[list[Need]], infos: list[Any], *, unit_bytes: int,
           gap: int, round_bytes: int = ROUND_BYTES
           ) -> tuple[list[Assignment] | None, Summary | str]:
    """Plan a cooperative load from every rank's needs (the coordinator's part).

    Returns one :class:`Assignment` per rank and a :class:`Summary`, or ``None`` and the
    reason the ranks should read directly.
    """
    why = _not_cooperative(needs_per_rank, infos)
    if why is not None:
        return None, why
    n = len(needs_per_rank)
    pieces = _all_pieces(needs_per_rank, unit_bytes)
    held = _held(infos)
    if not any(len(p.consumers) > 1 for p in pieces) and not any(
            p.relative in held and not set(p.consumers) <= set(held[p.relative])
            for p in pieces):
        return None, ("no stored byte range is needed by more than one rank, and no rank "
                      "needs a file only another rank holds locally")
    bundles = _bundle(pieces, unit_bytes=unit_bytes, gap=gap)
    rounds = _rounds(bundles, round_bytes)
    owners = _owners(bundles, rounds, [i.host for i in infos], n, held)
    per_rank, local_bytes = _per_rank(bundles, rounds, owners, held, n)
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


def _not_cooperative(needs_per_rank: list[list[Need]], infos: list[Any]) -> str | None:
    """Why these ranks cannot load cooperatively at all, or None."""
    if len(needs_per_rank) < 2:
        return "a single rank loads"
    if not all(isinstance(i, LocalInfo) for i in infos):
        return "not every rank has a default process group (or cooperative=False there)"
    world = infos[0].world
    if [i.rank for i in infos] != list(range(world)) or any(i.world != world for i in infos):
        return ("dcp.load runs on a process group other than the default one (a "
                "subgroup, or no_dist=True): cooperative loads need the default group")
    return None


def _all_pieces(needs_per_rank: list[list[Need]], unit_bytes: int) -> list[_Piece]:
    """Every stored item's pieces (whole-item spans and block spans apart)."""
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
    return pieces


def _held(infos: list[LocalInfo]) -> dict[str, tuple[int, ...]]:
    """The ranks holding each shard file in their local tier."""
    held: dict[str, tuple[int, ...]] = {}
    for r, info in enumerate(infos):
        for relative in sorted(info.local_files):
            held[relative] = (*held.get(relative, ()), r)
    return held


def _per_rank(bundles: list[list[_Piece]], rounds: list[int], owners: list[int],
              held: dict[str, tuple[int, ...]], n: int) -> tuple[list[list[Bundle]], int]:
    """Each rank's bundles (its owner's copy names the consumers), and the bytes owners
    read from their local tiers."""
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
    return per_rank, local_bytes


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
