"""The Checkpointer's policy and resume choice as pure pieces: cadences on an injected clock
(no sleeps), and which local-only save every rank picks from what the ranks reported."""

from __future__ import annotations

import pytest

from dcp_volumes import errors
from dcp_volumes.checkpointer import SavePolicy
from dcp_volumes.checkpointer._policy import Marks
from dcp_volumes.checkpointer._resume import choose_local_only
from dcp_volumes.tier import DurableBase, LocalOnlyCopy


class Clock:
    def __init__(self) -> None:
        self.now = 50.0

    def __call__(self) -> float:
        return self.now


def test_steps_cadences_over_twelve_steps() -> None:
    policy = SavePolicy(every_steps=6, local_every_steps=2)
    marks = Marks()
    kinds = {s: policy.due(s, marks) for s in range(1, 13)}
    assert [s for s, k in kinds.items() if k == "durable"] == [6, 12]
    assert [s for s, k in kinds.items() if k == "local-only"] == [2, 4, 8, 10]
    marks.saved(6, 0.0, durable=True)
    assert policy.due(6, marks) is None  # the step saved last


def test_seconds_cadences_on_an_injected_clock() -> None:
    clock = Clock()
    policy = SavePolicy(every_seconds=10.0, local_every_seconds=2.0, clock=clock)
    marks = Marks()
    marks.reset(clock())
    assert policy.due(1, marks) is None
    clock.now += 2.0
    assert policy.due(2, marks) == "local-only"
    marks.saved(2, clock(), durable=False)
    clock.now += 1.0
    assert policy.due(3, marks) is None  # the local clock restarted at step 2
    clock.now += 7.5  # 10.5 s since the last durable save, 8.5 s since the local one
    assert policy.due(4, marks) == "durable"  # local saves never reset the durable clock
    marks.saved(4, clock(), durable=True)
    assert policy.due(5, marks) is None


def test_no_cadence_saves_every_call() -> None:
    assert SavePolicy().due(7, Marks()) == "durable"


@pytest.mark.parametrize(
    ("kw", "match"),
    [
        ({"every_steps": 0}, "every_steps must be a whole number"),
        ({"every_seconds": float("inf")}, "every_seconds must be > 0"),
        ({"local_every_seconds": True, "every_steps": 1}, "local_every_seconds must be > 0"),
        ({"local_every_steps": 2}, "need a durable cadence"),
        ({"drain": "yes"}, "drain= must be True or False"),
        ({"clock": 3.0}, "clock= must be a function"),
    ],
    ids=["zero-steps", "infinite-seconds", "bool-seconds", "local-alone", "drain-str",
         "clock-not-callable"],
)
def test_bad_policies_say_what_to_change(kw: dict[str, object], match: str) -> None:
    with pytest.raises(errors.ConfigError, match=match):
        SavePolicy(**kw)  # type: ignore[arg-type]


def test_policy_checks_that_need_the_checkpointer() -> None:
    with pytest.raises(errors.ConfigError, match="need a local tier"):
        SavePolicy(every_steps=4, local_every_steps=2).check_with(local_tier=False,
                                                                 async_save=False)
    with pytest.raises(errors.ConfigError, match="drain=True"):
        SavePolicy(every_steps=4, local_every_steps=2, drain=True).check_with(
            local_tier=True, async_save=False)


# ---- which local-only save to resume from ----------------------------------------------

BASE = DurableBase("s3://b/run/step-100", "0000000a-000000000001", "ab" * 32)
OTHER = DurableBase("s3://b/run/step-100", "0000000c-000000000003", "cd" * 32)


def _copy(step: int, rank: int, world: int = 2, base: DurableBase | None = BASE,
          sid: str = "0000000b-000000000002") -> LocalOnlyCopy:
    return LocalOnlyCopy(f"s3://b/run/step-{step}", sid, rank, world, "ef" * 32, 1.0 + step,
                         base)


def _step_of(url: str) -> int | None:
    return int(url.rsplit("-", 1)[1])


def _choose(gathered: list[object], newer_than: int | None = 100,
            newest: DurableBase | None = BASE) -> int | None:
    choice = choose_local_only(gathered, _step_of, newer_than, lambda b: b == newest)
    return None if choice is None else choice.step


def test_the_newest_save_every_rank_holds_wins() -> None:
    gathered = [[_copy(150, 0), _copy(175, 0)], [_copy(150, 1), _copy(175, 1)]]
    assert _choose(gathered) == 175
    choice = choose_local_only(gathered, _step_of, 100, lambda b: True)
    assert choice is not None and choice.holders == (0, 1)


def test_a_save_one_rank_lacks_is_not_used() -> None:
    assert _choose([[_copy(150, 0), _copy(175, 0)], [_copy(150, 1)]]) == 150


def test_one_node_may_hold_every_ranks_copy() -> None:
    choice = choose_local_only([[_copy(150, 0), _copy(150, 1)], []], _step_of, 100,
                               lambda b: True)
    assert choice is not None and choice.holders == (0,)


def test_older_than_the_newest_durable_is_not_used() -> None:
    assert _choose([[_copy(150, 0)], [_copy(150, 1)]], newer_than=150) is None


@pytest.mark.parametrize(
    ("base", "newest"),
    [(OTHER, BASE), (BASE, None), (None, BASE)],
    ids=["replaced-base", "base-removed", "no-base-but-a-durable-exists"],
)
def test_another_lineage_is_never_used(base: DurableBase | None,
                                       newest: DurableBase | None) -> None:
    gathered = [[_copy(150, 0, base=base)], [_copy(150, 1, base=base)]]
    assert _choose(gathered, newest=newest) is None


def test_what_a_rank_sent_that_is_not_a_copy_is_ignored() -> None:
    gathered: list[object] = [[_copy(150, 0), "junk", 7], {"not": "a list"}]
    assert _choose([*gathered[:1], [_copy(150, 1)]]) == 150
    assert _choose(gathered) is None
