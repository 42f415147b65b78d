# was tests/integration/test_local_tier.py (renamed by subject, issue 24)
"""The local tier on a real store (SeaweedFS over S3) and real ranks (gloo on 127.0.0.1).

"Nodes" are ranks with separate tier directories (``<tiers>/node<rank>``); a node whose
ranks share one directory is ``<tiers>/shared`` (both nodes' files, merged after the save).
Damage is done to the local copies with plain file operations, behind the reader's back.

- one save on 2 ranks, kept locally; loads in fresh processes: all from local disk (shared
  directory), each node from its own copy plus the store (separate ones), resharded onto 1
  rank; a flipped byte, a truncated file and a symlink in the tier: read from the store,
  counted, the load bit-identical; torch's own FsspecReader still loads the checkpoint.
- a second save that dies before its commit leaves a local copy that is never read.
"""

from __future__ import annotations

import os
import shutil
import uuid
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

from dcp_volumes import LocalTierOptions, SpoolOptions, TransferOptions, VolumeWriter
from dcp_volumes.testing.dist import run_ranks
from dcp_volumes.testing.scenarios import build_state, expected_full_state, load_on_ranks

warnings.filterwarnings("ignore", message="torch.distributed is disabled")

MiB = 1 << 20
TRANSFER = TransferOptions(part_size=5 * MiB, max_concurrency=4)


def _tier(root: str, rank: int) -> LocalTierOptions:
    return LocalTierOptions(directory=os.path.join(root, f"node{rank}"), keep_last=None)


def _save(rank: int, world: int, url: str, options: dict[str, Any], tiers: str) -> dict[str, Any]:
    writer = VolumeWriter(url, storage_options=options, transfer=TRANSFER,
                          spool=SpoolOptions(directory=os.path.join(tiers, f"spool{rank}")),
                          local_tier=_tier(tiers, rank))
    dcp.save(build_state(world, zeros=False), storage_writer=writer)
    dist.barrier()
    return writer.last_stats.as_dict() if writer.last_stats else {}


def _load(rank: int, world: int, url: str, options: dict[str, Any], tier: str | None,
          cooperative: Any = "auto", stock: bool = False) -> dict[str, Any]:
    kwargs: dict[str, Any] = {"storage_options": options, "transfer": TRANSFER,
                              "cooperative": cooperative}
    if tier is not None:
        kwargs["local_tier"] = LocalTierOptions(
            directory=tier if "{rank}" not in tier else tier.format(rank=rank))
    out = load_on_ranks(rank, world, url, kwargs)  # raises unless bit-identical
    if stock:  # nothing in the store changed: torch's own reader loads it
        from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader

        state = build_state(world, zeros=True)
        dcp.load(state, storage_reader=FsspecReader(url, **options))
        full = expected_full_state()
        for k, v in full["sharded"].items():
            assert torch.equal(state["sharded"][k].full_tensor(), v), k
        out["stock_ok"] = True
    dist.barrier()
    return out


@pytest.fixture(scope="module")
def saved(seaweedfs: Any, tmp_path_factory: pytest.TempPathFactory
          ) -> tuple[str, dict[str, Any], Path, list[dict[str, Any]]]:
    store = seaweedfs.store()
    url = store.url("tiered")
    tiers = tmp_path_factory.mktemp("tiers")
    stats = run_ranks(2, _save, url, store.storage_options, str(tiers))
    for rank in range(2):  # one node with both ranks: both nodes' copies in one directory
        shutil.copytree(tiers / f"node{rank}", tiers / "shared", dirs_exist_ok=True)
    return url, store.storage_options, tiers, stats


def _copy_tier(tiers: Path, name: str) -> Path:
    dest = tiers / f"{name}-{uuid.uuid4().hex[:6]}"
    shutil.copytree(tiers / "shared", dest)
    return dest


def test_the_save_keeps_every_rank_file(saved: Any) -> None:
    _, _, tiers, stats = saved
    for rank, s in enumerate(stats):
        assert s["bytes_kept_local"] == s["bytes"] > 0
        files = list((tiers / f"node{rank}").rglob("*.distcp"))
        assert files and all(f.name.startswith(f"__{rank}_") for f in files)
        assert sum(f.stat().st_size for f in files) == s["bytes"]
        assert not list((tiers / f"spool{rank}").iterdir()), "spool files were moved"


def test_every_byte_from_the_local_tier(saved: Any) -> None:
    url, options, tiers, _ = saved
    out = run_ranks(2, _load, url, options, str(tiers / "shared"), "auto", True)
    for s in out:
        assert s["bytes_from_local"] == s["bytes_needed"] > 0
        assert s["bytes_fetched"] == 0 and s["ranges"] == 0  # no GET of any shard
        assert s["local_fallbacks"] == 0
        assert s["stock_ok"]


@pytest.mark.parametrize("cooperative", [False, "auto"], ids=["direct", "cooperative"])
def test_each_node_reads_its_copy_and_fetches_the_rest(saved: Any, cooperative: Any) -> None:
    url, options, tiers, _ = saved
    out = run_ranks(2, _load, url, options, str(tiers / "node{rank}"), cooperative)
    if cooperative:
        assert sum(s["bytes_from_peers"] for s in out) > 0, out
    for s in out:
        assert s["local_fallbacks"] == 0
        assert s["bytes_from_local"] > 0
        if cooperative:
            # what the node does not hold (items deduplicated into the other rank's files)
            # the other rank reads from its local copy and sends: nothing from the store
            assert s["bytes_fetched"] == 0, out
            assert s["bytes_from_local"] + s["bytes_from_peers"] >= s["bytes_needed"], out
        else:
            # ... or read directly: from the store, and nothing else is
            assert s["bytes_from_local"] + s["bytes_fetched"] >= s["bytes_needed"]
            assert s["bytes_fetched"] < s["bytes_needed"]


def test_cooperative_load_with_a_tier_on_one_node(saved: Any) -> None:
    """Rank 0 holds its node's copy, rank 1 none: rank 0 reads its files locally, and what
    both still need from the store (rank 1's files) is fetched once and shared."""
    url, options, tiers, _ = saved
    one = tiers / f"one-{uuid.uuid4().hex[:6]}"
    shutil.copytree(tiers / "node0", one / "node0")
    out = run_ranks(2, _load, url, options, str(one / "node{rank}"), True)
    assert all(s["cooperative"] for s in out), out
    r0, r1 = out
    assert r0["bytes_from_local"] > 0 and r1["bytes_from_local"] == 0
    assert r0["bytes_fetched"] < r0["bytes_needed"]
    assert r0["bytes_from_peers"] + r1["bytes_from_peers"] > 0, out  # something was shared
    assert r0["local_fallbacks"] == r1["local_fallbacks"] == 0


def test_reshard_onto_one_rank(saved: Any) -> None:
    url, options, tiers, _ = saved
    (s,) = run_ranks(1, _load, url, options, str(tiers / "node0"))
    assert s["local_fallbacks"] == 0
    assert 0 < s["bytes_from_local"] < s["bytes_needed"]
    assert s["bytes_fetched"] > 0


def test_damaged_local_copies_are_read_from_the_store(saved: Any) -> None:
    url, options, tiers, _ = saved
    tier = _copy_tier(tiers, "damaged")
    by_name = {p.name: p for p in tier.rglob("*.distcp")}
    flipped, truncated, linked = (by_name[n] for n in sorted(by_name)[:3])
    data = bytearray(flipped.read_bytes())
    data[len(data) // 2] ^= 0x10
    flipped.write_bytes(bytes(data))
    with open(truncated, "r+b") as f:
        f.truncate(truncated.stat().st_size - 7)
    elsewhere = tiers / f"elsewhere-{uuid.uuid4().hex[:6]}.distcp"
    shutil.copyfile(linked, elsewhere)  # the right bytes, but behind a link: never used
    linked.unlink()
    linked.symlink_to(elsewhere)
    out = run_ranks(2, _load, url, options, str(tier))  # raises unless bit-identical
    assert sum(s["local_fallbacks"] for s in out) >= 3
    assert all(s["bytes_fetched"] > 0 for s in out)
    assert sum(s["bytes_from_local"] for s in out) > 0


def _failed_second_save(rank: int, world: int, url: str, options: dict[str, Any],
                        tiers: str) -> dict[str, Any]:
    class _DiesBeforeCommit(VolumeWriter):
        def finish(self, metadata: Any, results: Any) -> None:
            raise RuntimeError("killed before commit")

    state = build_state(world, zeros=False)
    for v in state["sharded"].values():
        v.to_local().add_(1)
    writer = _DiesBeforeCommit(
        url, storage_options=options, transfer=TRANSFER, overwrite=True,
        spool=SpoolOptions(directory=os.path.join(tiers, f"spool{rank}")),
        local_tier=LocalTierOptions(directory=os.path.join(tiers, "shared"), keep_last=None))
    try:
        dcp.save(state, storage_writer=writer)
    except CheckpointException:
        pass
    else:
        raise AssertionError("the second save committed")
    dist.barrier()
    return writer.last_stats.as_dict() if writer.last_stats else {}


def test_an_uncommitted_local_copy_is_never_read(seaweedfs: Any,
                                                 tmp_path: Path) -> None:
    store = seaweedfs.store()
    url = store.url("uncommitted")
    run_ranks(2, _save, url, store.storage_options, str(tmp_path))
    for rank in range(2):
        shutil.copytree(tmp_path / f"node{rank}", tmp_path / "shared", dirs_exist_ok=True)
    second = run_ranks(2, _failed_second_save, url, store.storage_options, str(tmp_path))
    assert all(s["bytes_kept_local"] > 0 for s in second)  # kept: its upload succeeded
    saves = [p for p in (tmp_path / "shared").glob("*/*") if p.is_dir()]
    assert len(saves) == 2
    # the store still commits the first save: its values load, all from its local copy
    out = run_ranks(2, _load, url, store.storage_options, str(tmp_path / "shared"), "auto")
    for s in out:
        assert s["bytes_from_local"] == s["bytes_needed"] and s["bytes_fetched"] == 0
