"""Conformance tests at 8 ranks: resharded load of sharded + replicated state, a kill among 8.

Eight spawned gloo processes on 127.0.0.1 with small tensors (about 8 MiB in all): more
ranks than a small machine has cores, which is the point (the collectives, the plan, the
commit and the failure paths at a rank count where every rank is not also a core). On a
2-core machine one test takes 20-30 s (ranks fork from a server that has imported torch;
all the runs of a test share ``multi_rank_budget_s``); a backend whose tests must stay
short sets ``many_ranks = 0`` (the tests then skip, saying so).
"""

from __future__ import annotations

import os
import signal
from typing import Any

import pytest
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import DefaultSavePlanner

from dcp_volumes import VolumeReader, VolumeWriter, errors
from dcp_volumes.testing._suite_support import RankBudget, Store, SuiteBase
from dcp_volumes.testing.dist import run_ranks, run_ranks_with_victim
from dcp_volumes.testing.scenarios import build_state, load_on_ranks, save_on_ranks

__all__ = ["ScaleTests"]

class _DieOnSecondItem(DefaultSavePlanner):
    """The victim rank SIGKILLs itself while resolving its second item (mid-save)."""

    def __init__(self, die: bool) -> None:
        super().__init__()
        self.die = die
        self.resolved = 0

    def resolve_data(self, write_item: Any) -> Any:
        self.resolved += 1
        if self.die and self.resolved == 2:
            os.kill(os.getpid(), signal.SIGKILL)
        return super().resolve_data(write_item)


def save_with_a_victim(rank: int, world_size: int, url: str, options: dict[str, Any],
                       victim: int) -> None:
    state = build_state(world_size, zeros=False)
    writer = VolumeWriter(url, storage_options=options)
    dcp.save(state, storage_writer=writer, planner=_DieOnSecondItem(rank == victim))


class ScaleTests(SuiteBase):
    """8 ranks. ``many_ranks``: how many (0 skips these tests)."""

    many_ranks: int = 8

    def _need_ranks(self, store: Store) -> int:
        self._need(store, "multi_process", "the store is private to one process")
        if self.many_ranks < 2:
            pytest.skip(f"{type(self).__name__}: many_ranks = {self.many_ranks} (the "
                        "8-rank tests are switched off for this backend)")
        return self.many_ranks

    # ---- 13. many ranks -----------------------------------------------------------------
    def test_save_on_8_ranks_load_on_3(self, store: Store) -> None:
        ranks = self._need_ranks(store)
        url = store.url("eight")
        opts = {"storage_options": store.storage_options}
        budget = RankBudget(self.multi_rank_budget_s)  # 8 processes share the cores
        stats = run_ranks(ranks, save_on_ranks, url, opts,
                          **budget.next(f"save on {ranks} ranks"))
        assert len(stats) == ranks
        # the sharded 8 MiB tensor and the replicated items, each written once
        assert sum(s["bytes"] for s in stats) > 8 << 20
        assert sum(s["bytes"] > 0 for s in stats) == ranks  # every rank wrote its shard
        out = run_ranks(3, load_on_ranks, url, opts, **budget.next("load on 3 ranks"))
        assert len(out) == 3 and all(o["verified"] for o in out)

    def test_a_rank_killed_mid_save_among_8_commits_nothing(self, store: Store) -> None:
        ranks = self._need_ranks(store)
        victim = ranks - 3
        url = store.url("victim")
        options = store.storage_options
        budget = RankBudget(self.multi_rank_budget_s)
        reported = run_ranks_with_victim(
            ranks, victim, save_with_a_victim, url, options, victim,
            **budget.next(f"save on {ranks} ranks, rank {victim} killed"))
        assert sorted(reported) == [r for r in range(ranks) if r != victim]
        assert not any(ok for ok, _ in reported.values()), "a rank reported a completed save"
        # nothing committed: objects of the failed save may remain, .metadata does not
        assert ".metadata" not in store.names(url)
        with pytest.raises((errors.IncompleteCheckpointError, errors.CheckpointNotFoundError)):
            VolumeReader(url, storage_options=options).read_metadata()
        # a later save to the same path commits and loads
        opts = {"storage_options": options}
        run_ranks(ranks, save_on_ranks, url, opts, **budget.next(f"save again on {ranks} ranks"))
        out = run_ranks(3, load_on_ranks, url, opts, **budget.next("load on 3 ranks"))
        assert len(out) == 3 and all(o["verified"] for o in out)
