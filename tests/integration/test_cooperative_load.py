"""Cooperative loads on a real store (SeaweedFS) and real ranks (gloo on 127.0.0.1).

Each stored byte range that several ranks need is fetched once, by one of them, checked there,
and sent to the others (``VolumeReader(cooperative=...)``, default ``"auto"``), through plain
``dcp.load``. Damage is done behind the writer's back with raw fsspec calls.

- 4 ranks, fully replicated state: fetched once in all (≤ 1.05 × the unique bytes), owners
  balanced, bit-identical; ``cooperative=False``, ``no_dist=True`` and no process group read
  directly.
- sharded + replicated state saved on 2, loaded on 3 and 4: bit-identical, fetched once.
- a flipped byte: ``IntegrityError`` on every rank, quickly; a rank killed mid-load: every
  other rank raises ``DownloadError`` in bounded time; a rank that hangs: the others raise
  ``DownloadError`` after ``cooperative_timeout_s`` plus DCP's own wait for the process
  group's timeout, and the message says so.
"""

from __future__ import annotations

import datetime
import os
import signal
import time
import uuid
import warnings
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import DefaultLoadPlanner

from dcp_volumes import SpoolOptions, VolumeReader, VolumeWriter, errors
from dcp_volumes._api import load as typed_load
from dcp_volumes._compat import HAS_NO_DIST, no_dist
from dcp_volumes.testing.dist import run_ranks, run_ranks_with_victim
from dcp_volumes.testing.scenarios import load_on_ranks, save_on_ranks

warnings.filterwarnings("ignore", message="torch.distributed is disabled")

MiB = 1 << 20
VICTIM = 2


def replicated_state(zeros: bool = False) -> dict[str, Any]:
    """DDP-style state: the same tensors on every rank. Large tensors are checked per 1 MiB
    block (and split between owners); small ones and objects by one CRC each."""
    g = torch.Generator().manual_seed(7)
    state: dict[str, Any] = {
        f"layer{i}.weight": torch.randn(3 * MiB // 4 + 1000 * i, generator=g) for i in range(4)
    }
    state.update({f"layer{i}.bias": torch.randn(100 + i, generator=g) for i in range(4)})
    state["emb"] = torch.randn(512, 33, generator=g).to(torch.bfloat16)
    state["step"] = 1234
    state["meta"] = {"name": "replicated", "lr": 0.5}
    if zeros:
        state = {k: torch.zeros_like(v) if isinstance(v, torch.Tensor) else None
                 for k, v in state.items()}
        state["step"], state["meta"] = 0, {"name": "", "lr": 0.0}
    return state


def _same(got: dict[str, Any], want: dict[str, Any]) -> bool:
    return all(
        torch.equal(got[k], v) if isinstance(v, torch.Tensor) else got[k] == v
        for k, v in want.items()
    )


def _load(url: str, options: dict[str, Any], **reader: Any) -> dict[str, Any]:
    target = replicated_state(zeros=True)
    r = VolumeReader(url, storage_options=options, **reader)
    start = time.monotonic()
    dcp.load(target, storage_reader=r)
    stats = r.last_stats.as_dict() if r.last_stats else {}
    return {"ok": _same(target, replicated_state()), "s": time.monotonic() - start, **stats}


def _save_and_load_replicated(rank: int, world: int, url: str, options: dict[str, Any]
                              ) -> dict[str, Any]:
    dcp.save(replicated_state(), storage_writer=VolumeWriter(
        url, storage_options=options, spool=SpoolOptions(files_per_rank=1)))
    dist.barrier()
    out = {"auto": _load(url, options), "off": _load(url, options, cooperative=False)}
    if HAS_NO_DIST:  # each rank alone in the group: nothing to share
        target = replicated_state(zeros=True)
        alone = VolumeReader(url, storage_options=options, cooperative=True)
        dcp.load(target, storage_reader=alone, **no_dist())
        out["no_dist"] = {"ok": _same(target, replicated_state()),
                          **(alone.last_stats.as_dict() if alone.last_stats else {})}
    dist.barrier()
    return out


@pytest.fixture(scope="module")
def replicated_on_four(seaweedfs: Any) -> tuple[str, dict[str, Any], list[dict[str, Any]]]:
    store = seaweedfs.store()
    url = store.url("replicated")
    out = run_ranks(4, _save_and_load_replicated, url, store.storage_options)
    return url, store.storage_options, out


def test_replicated_state_is_fetched_once(replicated_on_four: Any) -> None:
    _, _, out = replicated_on_four
    auto = [o["auto"] for o in out]
    assert all(a["ok"] for a in auto), "a rank loaded different values"
    assert all(a["cooperative"] for a in auto)
    unique = auto[0]["bytes_needed"]  # replicated: every rank needs every stored byte
    assert all(a["bytes_needed"] == unique for a in auto)
    fetched = [a["bytes_fetched"] for a in auto]
    assert sum(fetched) <= 1.05 * unique, (fetched, unique)
    # balanced by bytes: the 1 MiB-block checked tensors are split between the owners
    assert max(fetched) <= 0.5 * unique, fetched
    # what a rank did not fetch, it received; what it fetched for others, it sent
    for a in auto:
        assert a["bytes_from_peers"] + a["bytes_fetched"] >= a["bytes_needed"]
    assert sum(a["bytes_from_peers"] for a in auto) == sum(a["bytes_to_peers"] for a in auto)


def test_cooperative_false_reads_directly(replicated_on_four: Any) -> None:
    _, _, out = replicated_on_four
    off = [o["off"] for o in out]
    assert all(o["ok"] and not o["cooperative"] and o["bytes_from_peers"] == 0 for o in off)
    assert sum(o["bytes_fetched"] for o in off) >= 4 * off[0]["bytes_needed"]


@pytest.mark.skipif(not HAS_NO_DIST, reason="this torch has no dcp.load(no_dist=True)")
def test_no_dist_inside_a_group_reads_directly(replicated_on_four: Any) -> None:
    _, _, out = replicated_on_four
    alone = [o["no_dist"] for o in out]
    assert all(a["ok"] and not a["cooperative"] for a in alone)
    assert all(a["bytes_fetched"] >= a["bytes_needed"] for a in alone)


def test_no_process_group_reads_directly(replicated_on_four: Any) -> None:
    url, options, _ = replicated_on_four
    assert not dist.is_initialized()
    got = _load(url, options, cooperative=True)
    assert got["ok"] and not got["cooperative"] and got["bytes_fetched"] >= got["bytes_needed"]


# --------------------------------------------------------------------------------------------
# sharded + replicated, resharded


@pytest.fixture(scope="module")
def mixed_saved_on_two(seaweedfs: Any) -> tuple[str, dict[str, Any]]:
    store = seaweedfs.store()
    url = store.url("mixed")
    run_ranks(2, save_on_ranks, url, {"storage_options": store.storage_options})
    return url, store.storage_options


@pytest.mark.parametrize("world", [3, 4], ids=["2-to-3-ranks", "2-to-4-ranks"])
def test_sharded_and_replicated_mix_resharded(mixed_saved_on_two: Any, world: int) -> None:
    url, options = mixed_saved_on_two
    # load_on_ranks compares every value bit for bit with what was saved
    stats = run_ranks(world, load_on_ranks, url, {"storage_options": options})
    assert all(s["cooperative"] and s["verified"] for s in stats)
    # the 8 MiB sharded tensor and the replicated/object items, each fetched about once:
    # the 1 MiB blocks two ranks' new shards share are no longer fetched twice
    assert sum(s["bytes_fetched"] for s in stats) <= 1.05 * (8 * MiB) + 256 * 1024
    assert sum(s["bytes_from_peers"] for s in stats) > 0


# --------------------------------------------------------------------------------------------
# a damaged shard


def _load_damaged(rank: int, world: int, url: str, options: dict[str, Any]) -> dict[str, Any]:
    target = replicated_state(zeros=True)
    dist.barrier()
    start = time.monotonic()
    try:
        typed_load(target, url, storage_options=options, cooperative_timeout_s=60)
    except errors.DCPVolumesError as exc:
        return {"error": type(exc).__name__, "message": str(exc),
                "s": time.monotonic() - start}
    return {"error": None, "s": time.monotonic() - start}


def test_corrupt_shard_fails_every_rank_quickly(seaweedfs: Any) -> None:
    store = seaweedfs.store()
    url = store.url("damaged")
    run_ranks(4, _save_replicated, url, store.storage_options)
    fs, root = store.raw_fs, store.raw_path(url)
    shards = [p for p in fs.ls(root, detail=True) if p["name"].endswith(".distcp")]
    biggest = max(shards, key=lambda p: p["size"])["name"]
    data = bytearray(fs.cat_file(biggest))
    data[len(data) // 2] ^= 0x10  # inside a large tensor's data: one rank fetches that block
    fs.pipe_file(biggest, bytes(data))
    out = run_ranks(4, _load_damaged, url, store.storage_options, timeout=180)
    assert [o["error"] for o in out] == ["IntegrityError"] * 4, out
    assert all(o["s"] < 60 for o in out), [o["s"] for o in out]
    owners = [o for o in out if "checksum mismatch" in o["message"]]
    assert owners and all(biggest.rsplit("/", 1)[-1] in o["message"] for o in owners)
    # the ranks that did not fetch the damaged bytes say which rank did
    assert all("checksum mismatch" in o["message"] for o in out)
    assert sum("rank " in o["message"] and "failed while loading" in o["message"]
               for o in out) >= 1


class _DieOnSecondTensor(DefaultLoadPlanner):
    """The victim rank SIGKILLs itself when its second tensor is complete (mid-load)."""

    def __init__(self, die: bool) -> None:
        super().__init__()
        self.die = die
        self.committed = 0

    def commit_tensor(self, read_item: Any, tensor: torch.Tensor) -> None:
        self.committed += 1
        if self.die and self.committed == 2:
            os.kill(os.getpid(), signal.SIGKILL)
        super().commit_tensor(read_item, tensor)


def _load_with_a_victim(rank: int, world: int, url: str, options: dict[str, Any]
                        ) -> dict[str, Any]:
    target = replicated_state(zeros=True)
    start = time.monotonic()
    try:
        typed_load(target, url, storage_options=options, cooperative_timeout_s=30,
                   planner=_DieOnSecondTensor(rank == VICTIM))
    except errors.DCPVolumesError as exc:
        return {"error": type(exc).__name__, "message": str(exc), "s": time.monotonic() - start}
    return {"error": None, "s": time.monotonic() - start}


def test_a_rank_killed_mid_load_fails_the_others_in_bounded_time(replicated_on_four: Any
                                                                 ) -> None:
    url, options, _ = replicated_on_four
    reported = {rank: out if ok else {"error": f"untyped: {out}"}
                for rank, (ok, out) in run_ranks_with_victim(
                    4, VICTIM, _load_with_a_victim, url, options, timeout=180).items()}
    assert sorted(reported) == [r for r in range(4) if r != VICTIM]
    # a typed error, well within the test's limit (the timeout per step is 30 s)
    assert all(o["error"] == "DownloadError" for o in reported.values()), reported
    assert all(o["s"] < 90 for o in reported.values()), reported


#: how long the hung rank stalls before it dies (longer than the survivors may take)
# 60 s of margin for the others' 4 s + up to 8 s: they took 32 s once at load 20-30 on 2 cores
HANG_S = 75.0


class _HangOnSecondTensor(DefaultLoadPlanner):
    """The victim rank stops answering when its second tensor is complete (alive, stuck),
    and is SIGKILLed ``HANG_S`` later (so the test ends)."""

    def __init__(self, hang: bool) -> None:
        super().__init__()
        self.hang = hang
        self.committed = 0

    def commit_tensor(self, read_item: Any, tensor: torch.Tensor) -> None:
        self.committed += 1
        if self.hang and self.committed == 2:
            time.sleep(HANG_S)
            os.kill(os.getpid(), signal.SIGKILL)
        super().commit_tensor(read_item, tensor)


def _load_with_a_hung_rank(rank: int, world: int, url: str, options: dict[str, Any]
                           ) -> dict[str, Any]:
    # DCP's own collectives run on a group of every rank with a short timeout (as
    # init_process_group(timeout=...) would set it for the default group); ours on the default
    group = dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=8))
    target = replicated_state(zeros=True)
    dist.barrier()
    start = time.monotonic()
    try:
        typed_load(target, url, storage_options=options, cooperative_timeout_s=4,
                   process_group=group, planner=_HangOnSecondTensor(rank == VICTIM))
    except errors.DCPVolumesError as exc:
        return {"error": type(exc).__name__, "message": str(exc), "s": time.monotonic() - start}
    return {"error": None, "s": time.monotonic() - start}


def test_a_hung_rank_fails_the_others_within_both_timeouts(replicated_on_four: Any) -> None:
    """A rank that hangs (alive, not answering) fails the others after
    ``cooperative_timeout_s``; DCP's own gather after ``read_data`` then waits for it up to
    the process group's timeout, and the error says so (and how to lower it)."""
    url, options, _ = replicated_on_four
    reported = {rank: out if ok else {"error": f"untyped: {out}"}
                for rank, (ok, out) in run_ranks_with_victim(
                    4, VICTIM, _load_with_a_hung_rank, url, options, timeout=180).items()}
    assert sorted(reported) == [r for r in range(4) if r != VICTIM]
    assert all(o["error"] == "DownloadError" for o in reported.values()), reported
    # 4 s of ours, then up to 8 s in DCP's gather: well before the hung rank dies
    assert all(4 <= o["s"] < HANG_S - 15 for o in reported.values()), reported
    for o in reported.values():
        assert "process group's timeout" in o["message"], o["message"]
        assert "dist.init_process_group(timeout=...)" in o["message"], o["message"]
        assert "waited at most" not in o["message"], o["message"]


def _save_replicated(rank: int, world: int, url: str, options: dict[str, Any]) -> None:
    dcp.save(replicated_state(), storage_writer=VolumeWriter(
        url, storage_options=options, spool=SpoolOptions(files_per_rank=1)))
    dist.barrier()


def test_options_are_checked() -> None:
    with pytest.raises(errors.ConfigError, match="cooperative"):
        VolumeReader(f"memory://x/{uuid.uuid4().hex}", cooperative="yes")  # type: ignore[arg-type]
    with pytest.raises(errors.ConfigError, match="cooperative_timeout_s"):
        VolumeReader(f"memory://x/{uuid.uuid4().hex}", cooperative_timeout_s=0)
    with pytest.raises(errors.ConfigError, match="local_commit= must be a LocalCommit"):
        VolumeReader(f"memory://x/{uuid.uuid4().hex}", local_commit=b"x")  # type: ignore[arg-type]
