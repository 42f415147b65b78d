"""Multi-rank saves and resharded loads (gloo on 127.0.0.1, spawned processes)."""

from __future__ import annotations

import pytest

from dcp_volumes._compat import HAS_PROCESS_ASYNC_SAVE, TORCH_VERSION
from dcp_volumes.testing.dist import run_ranks
from dcp_volumes.testing.scenarios import async_save_on_ranks, load_on_ranks, save_on_ranks


@pytest.fixture(scope="module")
def saved_on_two(tmp_path_factory) -> str:
    url = str(tmp_path_factory.mktemp("dist") / "ckpt")
    stats = run_ranks(2, save_on_ranks, url, {})
    # DCP spreads the replicated tensors' writes over both ranks
    assert all(s["bytes"] > 0 for s in stats)
    return url


@pytest.mark.parametrize("world_size", [1, 3], ids=["load-on-1", "load-on-3"])
def test_save_on_two_load_resharded(saved_on_two: str, world_size: int) -> None:
    stats = run_ranks(world_size, load_on_ranks, saved_on_two, {})
    assert all(s["verified"] for s in stats)
    # a rank fetches only the 1 MiB checksum blocks its new shards need, not whole shards
    total_fetched = sum(s["bytes_fetched"] for s in stats)
    for s in stats:
        assert s["bytes_fetched"] <= 1.1 * s["bytes_needed"] + (2 << 20)
    if world_size == 1:
        assert total_fetched >= 8 << 20  # one rank needs everything
    else:  # three ranks together fetch the 8 MiB tensor about once, not 2-3 times
        assert total_fetched <= 1.1 * (8 << 20) + 3 * (2 << 20)


def test_stock_torch_reader_loads_multi_rank_save(saved_on_two: str) -> None:
    run_ranks(2, load_on_ranks, saved_on_two, {}, True)


@pytest.mark.parametrize("checkpointer", ["thread", "process"], ids=["thread", "process"])
def test_async_save_then_load(tmp_path, checkpointer: str) -> None:
    if checkpointer == "process" and not HAS_PROCESS_ASYNC_SAVE:
        pytest.skip(f"needs dcp.async_save(async_checkpointer_type=AsyncCheckpointerType.PROCESS),"
                    f" which torch {TORCH_VERSION} lacks")
    url = str(tmp_path / f"async-{checkpointer}")
    out = run_ranks(2, async_save_on_ranks, url, {}, checkpointer)
    assert all(o["blocked_s"] < o["total_s"] for o in out)
    run_ranks(1, load_on_ranks, url, {})
