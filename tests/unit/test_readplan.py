"""Range planning and coalescing, as tables."""

from __future__ import annotations

import dataclasses

import pytest

from dcp_volumes.loading.needs import Need, plan_ranges


def _needs(spec: list[tuple[str, int, int]]) -> list[Need]:
    return [Need.part(rel, start, end, item_offset=start, item_length=end - start)
            for rel, start, end in spec]


def _shape(ranges: list) -> list[tuple[str, int, int, int]]:
    return [(r.relative, r.start, r.end, len(r.items)) for r in ranges]


CASES = [
    ("adjacent-merge", [("a", 0, 10), ("a", 10, 20)], 0, 100, [("a", 0, 20, 2)]),
    ("gap-within-limit", [("a", 0, 10), ("a", 15, 20)], 5, 100, [("a", 0, 20, 2)]),
    ("gap-too-wide", [("a", 0, 10), ("a", 16, 20)], 5, 100, [("a", 0, 10, 1), ("a", 16, 20, 1)]),
    ("unsorted-input", [("a", 15, 20), ("a", 0, 10)], 5, 100, [("a", 0, 20, 2)]),
    ("max-size-splits", [("a", 0, 60), ("a", 60, 120)], 0, 100,
     [("a", 0, 60, 1), ("a", 60, 120, 1)]),
    ("files-never-merge", [("b", 0, 10), ("a", 10, 20)], 100, 100,
     [("a", 10, 20, 1), ("b", 0, 10, 1)]),
    ("overlap-stays-separate", [("a", 0, 10), ("a", 5, 15)], 100, 100,
     [("a", 0, 10, 1), ("a", 5, 15, 1)]),
    ("one-large-item", [("a", 0, 500)], 0, 100, [("a", 0, 500, 1)]),
    ("nothing", [], 0, 100, []),
]


@pytest.mark.parametrize(("needs", "gap", "max_size", "expected"),
                         [(n, g, m, e) for _, n, g, m, e in CASES], ids=[c[0] for c in CASES])
def test_plan_ranges(needs: list[tuple[str, int, int]], gap: int, max_size: int,
                     expected: list[tuple[str, int, int, int]]) -> None:
    ranges = plan_ranges(_needs(needs), gap=gap, max_size=max_size)
    assert _shape(ranges) == expected
    # every need is served by exactly one range that covers it
    served = [(n.relative, n.start, n.end) for r in ranges for n in r.items]
    assert sorted(served) == sorted(needs)
    for r in ranges:
        assert all(r.start <= n.start and n.end <= r.end for n in r.items)


def test_a_need_is_built_by_name_and_never_changes() -> None:
    # six of its fields are ints: positional construction (a swapped pair reads wrong bytes)
    # and changes after planning are refused
    with pytest.raises(TypeError):
        Need("a.distcp", 0, 10, 0, 10)  # type: ignore[misc]
    need = Need.whole("a.distcp", 100, 10)
    assert (need.start, need.end, need.item_offset, need.item_length, need.needed) == (
        100, 110, 100, 10, 10)
    with pytest.raises(dataclasses.FrozenInstanceError):
        need.start = 0  # type: ignore[misc]
