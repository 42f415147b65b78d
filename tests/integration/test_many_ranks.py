"""Eight ranks (gloo on 127.0.0.1, spawned processes, small tensors).

- Sharded (DTensor ``Shard(0)`` over a 1-D mesh of 8) + replicated state saved on 8 ranks
  loads bit-identical on 3.
- One rank of 8 killed (SIGKILL) mid-save: every other rank fails in bounded time, nothing
  is committed (no ``.metadata``; loading raises ``IncompleteCheckpointError``), and a later
  save to the same path commits and loads.

8 processes on a 2-core machine are slow: the state is the scenario's (about 8 MiB in all)
and the timeouts are generous.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import queue
import signal
from typing import Any

import pytest
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import DefaultSavePlanner

from dcp_volumes import VolumeReader, VolumeWriter, errors
from dcp_volumes.testing.dist import _entry, free_port, run_ranks
from dcp_volumes.testing.scenarios import build_state, load_on_ranks, save_on_ranks
from dcp_volumes.testing.suite import Store

RANKS = 8
VICTIM = 5
TIMEOUT_S = 400.0


@pytest.fixture(params=["local", "seaweedfs"])
def store(request: pytest.FixtureRequest, tmp_path: Any) -> Store:
    if request.param == "local":
        return Store(root=str(tmp_path / "root"))
    return request.getfixturevalue("seaweedfs").store()


def test_save_on_8_ranks_load_on_3(store: Store) -> None:
    url = store.url("eight")
    opts = {"storage_options": store.storage_options}
    stats = run_ranks(RANKS, save_on_ranks, url, opts, timeout=TIMEOUT_S)
    assert len(stats) == RANKS
    assert sum(s["bytes"] for s in stats) > 8 << 20  # the 8 MiB tensor and the rest, once
    out = run_ranks(3, load_on_ranks, url, opts, timeout=TIMEOUT_S)
    assert all(o["verified"] for o in out)


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


def save_with_a_victim(rank: int, world_size: int, url: str, options: dict[str, Any]) -> None:
    state = build_state(world_size, zeros=False)
    writer = VolumeWriter(url, storage_options=options)
    dcp.save(state, storage_writer=writer, planner=_DieOnSecondItem(rank == VICTIM))


def _run_with_victim(url: str, options: dict[str, Any]) -> dict[int, tuple[bool, str]]:
    """Run :func:`save_with_a_victim` on 8 ranks; every survivor must end (fail) in time.
    Returns {rank: (ok, output)} of the ranks that reported."""
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_entry, args=(r, RANKS, port, save_with_a_victim,
                                              (url, options), {}, results))
             for r in range(RANKS)]
    for p in procs:
        p.start()
    reported: dict[int, tuple[bool, str]] = {}
    try:
        while len(reported) < RANKS - 1:
            rank, ok, out = results.get(timeout=TIMEOUT_S)
            reported[rank] = (ok, str(out))
    except queue.Empty:
        pytest.fail(f"ranks {sorted(set(range(RANKS)) - set(reported) - {VICTIM})} hung after "
                    f"rank {VICTIM} was killed")
    finally:
        for p in procs:
            p.join(timeout=60)
            if p.is_alive():
                p.kill()
                p.join()
    assert procs[VICTIM].exitcode == -signal.SIGKILL, procs[VICTIM].exitcode
    return reported


def test_a_rank_killed_mid_save_among_8_commits_nothing(store: Store) -> None:
    url = store.url("victim")
    options = store.storage_options
    reported = _run_with_victim(url, options)
    assert VICTIM not in reported
    assert sorted(reported) == [r for r in range(RANKS) if r != VICTIM]
    assert not any(ok for ok, _ in reported.values()), "a rank reported a completed save"
    # nothing committed: objects of the failed save may remain, .metadata does not
    assert ".metadata" not in store.names(url)
    with pytest.raises((errors.IncompleteCheckpointError, errors.CheckpointNotFoundError)):
        VolumeReader(url, storage_options=options).read_metadata()
    # a later save to the same path commits and loads
    opts = {"storage_options": options}
    run_ranks(RANKS, save_on_ranks, url, opts, timeout=TIMEOUT_S)
    out = run_ranks(3, load_on_ranks, url, opts, timeout=TIMEOUT_S)
    assert all(o["verified"] for o in out)
