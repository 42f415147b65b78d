"""The coordinator's part of a cooperative load (``loading.cooperative.assign``), as tables:
who fetches which bytes, in which round, and when the ranks read directly instead."""

from __future__ import annotations

from collections import Counter

import pytest

from dcp_volumes._manifest import ItemEntry
from dcp_volumes.loading.cooperative import Assignment, assign
from dcp_volumes.loading.cooperative.storage_data import LocalInfo, Summary
from dcp_volumes.loading.needs import Need

MiB = 1 << 20
BLOCK = MiB


def _infos(n: int, hosts: int = 1) -> list[LocalInfo]:
    return [LocalInfo(r, n, f"node{r * hosts // n}", True) for r in range(n)]


def _whole(rel: str, off: int, length: int, *, crc: bool = True) -> Need:
    entry = ItemEntry(length, 0) if crc else None
    return Need.whole(rel, off, length, entry=entry)


def _blocks(rel: str, off: int, nbytes: int, b0: int, b1: int, header: int = 64) -> Need:
    """A span of whole 1 MiB blocks [b0, b1) of a float32 tensor stored at ``off``."""
    entry = ItemEntry(header + nbytes, 0, header, BLOCK, (0,) * -(-nbytes // BLOCK),
                      (nbytes // 4,), "float32")
    start = off + header
    return Need.part(rel, start + b0 * BLOCK, start + min(b1 * BLOCK, nbytes), item_offset=off,
                     item_length=header + nbytes, entry=entry, first_block=b0,
                     needed=(b1 - b0) * BLOCK)


def _replicated() -> list[Need]:
    return [_blocks("a.distcp", 0, 40 * MiB, 0, 40), _whole("a.distcp", 40 * MiB + 64, 4096),
            _whole("a.distcp", 40 * MiB + 64 + 4096, 300), _whole("b.distcp", 0, 900)]


def _run(needs: list[list[Need]], infos: list[LocalInfo] | None = None, **kw: int
         ) -> tuple[list[Assignment], Summary]:
    out, summary = assign(needs, infos or _infos(len(needs)), unit_bytes=kw.get("unit", 16 * MiB),
                          gap=kw.get("gap", MiB), round_bytes=kw.get("round", 256 * MiB))
    assert out is not None and isinstance(summary, Summary), summary
    return out, summary


def _owned(a: Assignment) -> int:
    return sum(b.size for b in a.bundles if b.owner == a.rank)


def test_replicated_bytes_are_fetched_once_and_balanced() -> None:
    needs = _replicated()
    out, summary = _run([needs] * 4)
    unique = sum(n.end - n.start for n in needs)
    assert summary.unique_bytes == summary.shared_bytes == unique
    assert summary.direct_bytes == 4 * unique
    # every bundle has exactly one owner; all four ranks consume all of them
    owners = Counter(b.bid for a in out for b in a.bundles if b.owner == a.rank)
    assert set(owners.values()) == {1}
    assert sum(_owned(a) for a in out) == unique
    assert max(_owned(a) for a in out) <= unique / 4 + 16 * MiB
    for a in out:
        assert {b.bid for b in a.bundles} == set(owners)
        for b in a.bundles:
            assert b.consumers == (tuple(c for c in range(4) if c != a.rank)
                                   if b.owner == a.rank else ())


def test_large_tensor_split_at_blocks_small_items_bundled() -> None:
    out, _ = _run([_replicated()] * 2)
    bundles = {b.bid: b for b in out[0].bundles}
    big = [b for b in bundles.values() if b.pieces[0].first_block is not None]
    assert [(b.pieces[0].first_block, b.size) for b in sorted(big, key=lambda b: b.start)] == [
        (0, 16 * MiB), (16, 16 * MiB), (32, 8 * MiB)]
    assert all(len(b.pieces) == 1 for b in big)  # a piece of a larger span travels alone
    small = [b for b in bundles.values() if b.pieces[0].first_block is None]
    # the two small neighbours in a.distcp are one bundle; b.distcp's item is another
    assert sorted((b.relative, len(b.pieces)) for b in small) == [("a.distcp", 2),
                                                                   ("b.distcp", 1)]


def test_item_with_one_crc_is_never_split() -> None:
    item = _whole("a.distcp", 0, 40 * MiB)
    out, _ = _run([[item]] * 3)
    assert [(b.start, b.end) for b in out[0].bundles] == [(0, 40 * MiB)]


def test_item_without_checksum_is_split_anywhere() -> None:
    item = _whole("a.distcp", 0, 40 * MiB + 5, crc=False)
    out, _ = _run([[item]] * 3)
    assert sorted(b.size for b in out[0].bundles) == [8 * MiB + 5, 16 * MiB, 16 * MiB]


def test_reshard_shares_only_the_overlapping_blocks() -> None:
    # three ranks read blocks [0,6), [5,11), [10,16) of one tensor: blocks 5 and 10 are shared
    spans = [(0, 6), (5, 11), (10, 16)]
    needs = [[_blocks("a.distcp", 0, 16 * MiB, b0, b1)] for b0, b1 in spans]
    out, summary = _run(needs)
    assert summary.unique_bytes == 16 * MiB and summary.shared_bytes == 2 * MiB
    for r, a in enumerate(out):
        own = [(b.pieces[0].first_block, b.size // MiB) for b in a.bundles if b.owner == r]
        got = [(b.pieces[0].first_block, b.owner) for b in a.bundles if b.owner != r]
        # each rank fetches its blocks that nobody else needs itself
        assert (spans[r][0] + (r > 0), spans[r][1] - spans[r][0] - (r > 0) - (r < 2)) in own
        for block, owner in got:
            assert block in (5, 10) and owner != r


def test_rounds_bound_memory_and_never_cut_an_item() -> None:
    needs = [_blocks("a.distcp", i * 41 * MiB, 40 * MiB, 0, 40) for i in range(5)]
    out, summary = _run([needs] * 2, round=64 * MiB)
    assert summary.rounds == 3  # 40 + 40 MiB, 40 + 40, 40: a round ends after 64 MiB
    by_item: dict[int, set[int]] = {}
    for b in out[0].bundles:
        by_item.setdefault(b.pieces[0].item_offset, set()).add(b.round)
    assert all(len(rounds) == 1 for rounds in by_item.values())


def test_owners_are_spread_over_hosts_first() -> None:
    # four 16 MiB bundles, four ranks on two hosts: each host fetches two
    needs = [_blocks("a.distcp", 0, 64 * MiB, 0, 64)]
    out, _ = _run([needs] * 4, _infos(4, hosts=2))
    per_host = Counter(f"node{a.rank * 2 // 4}" for a in out for b in a.bundles
                       if b.owner == a.rank)
    assert per_host == {"node0": 2, "node1": 2}


@pytest.mark.parametrize(
    ("needs", "infos", "reason"),
    [
        ([[_whole("a", 0, 10)]], _infos(1), "single rank"),
        ([[_whole("a", 0, 10)], [_whole("b", 0, 10)]], _infos(2), "more than one rank"),
        ([[_whole("a", 0, 10)]] * 2, [None, None], "default process group"),
        ([[_whole("a", 0, 10)]] * 2, [LocalInfo(1, 4, "h", True), LocalInfo(3, 4, "h", True)],
         "subgroup"),
    ],
    ids=["one-rank", "nothing-shared", "no-group", "subgroup"],
)
def test_reads_directly(needs: list[list[Need]], infos: list[object], reason: str) -> None:
    out, why = assign(needs, infos, unit_bytes=16 * MiB, gap=MiB)
    assert out is None and isinstance(why, str) and reason in why


def test_gloo_group_is_made_when_the_default_one_cannot_carry_cpu_tensors() -> None:
    infos = [LocalInfo(r, 2, "h", False) for r in range(2)]
    out, _ = _run([[_whole("a", 0, 10)]] * 2, infos)
    assert all(a.new_gloo_group for a in out)
