# was tests/unit/test_local_only_plan.py (renamed by subject, issue 24)
"""Owners that serve local copies (the cooperative plan); local-only saves themselves, and
the checks of ``save(..., local_only=)``, are in ``tests/integration/test_tier_local_only_one_process.py``."""

from __future__ import annotations

from typing import Any

from dcp_volumes.loading.cooperative import assign
from dcp_volumes.loading.cooperative.storage_data import LocalInfo
from dcp_volumes.loading.needs import Need

MiB = 1 << 20


def _need(relative: str, offset: int, length: int) -> Need:
    return Need.whole(relative, offset, length)


def _infos(*local: set[str], hosts: tuple[str, ...] | None = None) -> list[LocalInfo]:
    n = len(local)
    return [LocalInfo(r, n, (hosts or tuple(f"h{i}" for i in range(n)))[r], True,
                      frozenset(files)) for r, files in enumerate(local)]


def _owned(assignments: Any) -> dict[tuple[str, int], tuple[int, bool]]:
    out = {}
    for a in assignments:
        for b in a.bundles:
            if b.owner == a.rank:
                out[(b.relative, b.start)] = (b.owner, b.local)
    return out


def test_a_holder_serves_what_another_rank_needs() -> None:
    # rank 1 holds a.distcp (and needs none of it: it reads what it needs itself);
    # rank 0 needs an item of it: rank 1 reads it from local disk and sends it
    needs: list[list[Need]] = [[_need("a.distcp", 0, 100)], []]
    assigned, summary = assign(needs, _infos(set(), {"a.distcp"}), unit_bytes=MiB, gap=0)
    assert assigned is not None and not isinstance(summary, str)
    assert _owned(assigned) == {("a.distcp", 0): (1, True)}
    (b,) = assigned[1].bundles
    assert b.consumers == (0,) and b.pieces[0].item_length == 100
    assert summary.local_bytes == 100


def test_holders_share_the_serving_and_the_store_is_the_last_resort() -> None:
    needs: list[list[Need]] = [[_need("a.distcp", 0, 100), _need("a.distcp", 300, 100),
                                _need("b.distcp", 0, 50)], [], []]
    assigned, _ = assign(needs, _infos(set(), {"a.distcp"}, {"a.distcp"}), unit_bytes=MiB,
                         gap=0)
    assert assigned is not None
    owned = _owned(assigned)
    # two items of a.distcp, balanced over its two holders; b.distcp nobody holds: its
    # only consumer fetches it from the store
    assert sorted(o for o, _ in (owned[("a.distcp", 0)], owned[("a.distcp", 300)])) == [1, 2]
    assert owned[("a.distcp", 0)][1] and owned[("a.distcp", 300)][1]
    assert owned[("b.distcp", 0)] == (0, False)


def test_nothing_held_and_nothing_shared_reads_directly() -> None:
    needs = [[_need("a.distcp", 0, 100)], [_need("b.distcp", 0, 100)]]
    assigned, why = assign(needs, _infos(set(), set()), unit_bytes=MiB, gap=0)
    assert assigned is None and "locally" in str(why)
