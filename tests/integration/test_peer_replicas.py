"""Partner replicas (``LocalTierOptions(partner_replicas=True)``) on a real store (SeaweedFS
over S3) and real ranks (gloo on 127.0.0.1).

Four ranks are two simulated nodes: ranks 0-1 share ``<tiers>/node0``, ranks 2-3
``<tiers>/node1``; with 2 ranks per node, rank r's partner is ``(r + 2) % 4``. One run saves
step 1 to the store and step 2 to the local tiers only, each replicated to the partners.
Every restore runs in fresh processes on a copy of the tiers, wiped or damaged behind the
reader's back with plain file operations:

- node 0 wiped: its ranks' bytes come from node 1's replicas over the process group, no
  shard byte from the store, bit-identical;
- both nodes wiped: everything from the store, bit-identical;
- a flipped byte in a replica (node 0 wiped): its holder's check fails, it fetches those
  bytes from the store, bit-identical;
- the local-only step 2 with node 0 wiped: restored from node 1 alone, without the store.

Step 1 is saved by a sync Checkpointer (replicated right after its commit), step 2 by an
async one (replicated when ``close()`` settles the background save).
"""

from __future__ import annotations

import json
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
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard, distribute_tensor

from dcp_volumes import (
    Checkpointer,
    LocalTierOptions,
    SpoolOptions,
    TransferOptions,
    VolumeReader,
    _layout,
    tier,
)
from dcp_volumes.testing.dist import run_ranks
from dcp_volumes.tier import _partners
from dcp_volumes.tier._layout import url_key

warnings.filterwarnings("ignore", message="torch.distributed is disabled")

MiB = 1 << 20
TRANSFER = TransferOptions(part_size=5 * MiB, max_concurrency=4)
WORLD = 4
PER_NODE = 2


def full_state(step: int) -> dict[str, Any]:
    g = torch.Generator().manual_seed(200 + step)
    return {
        "sharded": torch.randn(512, 512, generator=g),  # 1 MiB over the 4 ranks
        "rep": {f"r{i}": torch.randn(64 * 1024 * (i + 1), generator=g) for i in range(2)},
        "meta": {"step": step},
    }


def rank_state(world: int, step: int | None) -> dict[str, Any]:
    full = full_state(step or 0)
    mesh = init_device_mesh("cpu", (world,))
    zero = step is None
    return {
        "sharded": distribute_tensor(torch.zeros_like(full["sharded"]) if zero
                                     else full["sharded"], mesh, [Shard(0)]),
        "rep": {k: torch.zeros_like(v) if zero else v.clone() for k, v in full["rep"].items()},
        "meta": {"step": 0} if zero else dict(full["meta"]),
    }


def _same(state: dict[str, Any], step: int) -> bool:
    full = full_state(step)
    return (torch.equal(state["sharded"].full_tensor(), full["sharded"])
            and all(torch.equal(state["rep"][k], v) for k, v in full["rep"].items())
            and state["meta"] == full["meta"])


def _node_tier(tiers: str, rank: int, **kw: Any) -> LocalTierOptions:
    return LocalTierOptions(directory=os.path.join(tiers, f"node{rank // PER_NODE}"),
                            keep_last=None, **kw)


def _checkpointer(rank: int, root: str, options: dict[str, Any], tiers: str,
                  async_save: bool = False) -> Checkpointer:
    return Checkpointer(root, storage_options=options, transfer=TRANSFER, async_save=async_save,
                        spool=SpoolOptions(directory=os.path.join(tiers, f"spool{rank}")),
                        local_tier=_node_tier(tiers, rank, partner_replicas=True,
                                              ranks_per_node=PER_NODE))


def _save(rank: int, world: int, root: str, options: dict[str, Any], tiers: str) -> None:
    """Step 1 to the store from a sync Checkpointer (replicated right after its commit),
    step 2 local-only from an async one (replicated when close() settles it)."""
    with _checkpointer(rank, root, options, tiers) as ckpt:
        ckpt.save(1, rank_state(world, 1), force=True)
    with _checkpointer(rank, root, options, tiers, async_save=True) as ckpt:
        ckpt.save(2, rank_state(world, 2), force=True, local_only=True)
    dist.barrier()


def _load_step1(rank: int, world: int, url: str, options: dict[str, Any], tiers: str
                ) -> dict[str, Any]:
    state = rank_state(world, None)
    reader = VolumeReader(url, storage_options=options, transfer=TRANSFER,
                          local_tier=_node_tier(tiers, rank))
    dcp.load(state, storage_reader=reader)
    same = _same(state, 1)
    dist.barrier()
    return {"same": same, **(reader.last_stats.as_dict() if reader.last_stats else {})}


def _resume(rank: int, world: int, root: str, options: dict[str, Any], tiers: str
            ) -> dict[str, Any]:
    state = rank_state(world, None)
    with _checkpointer(rank, root, options, tiers) as ckpt:
        step = ckpt.load_latest(state)
        stats = ckpt.last_load_stats
    same = _same(state, step or 0)
    dist.barrier()
    return {"step": step, "same": same, **(stats.as_dict() if stats else {})}


def _restores(rank: int, world: int, root: str, options: dict[str, Any],
              scenarios: dict[str, tuple[str, str]]) -> dict[str, dict[str, Any]]:
    """Every restore scenario in one set of processes (spawning 4 ranks is the slow part)."""
    out = {}
    for name, (how, tiers) in scenarios.items():
        out[name] = (_resume(rank, world, root, options, tiers) if how == "resume" else
                     _load_step1(rank, world, f"{root}/step-00000001", options, tiers))
    return out


@pytest.fixture(scope="module")
def run(seaweedfs: Any, tmp_path_factory: pytest.TempPathFactory
        ) -> tuple[str, dict[str, Any], Path]:
    store = seaweedfs.store()
    root = store.url("partners")
    tiers = tmp_path_factory.mktemp("tiers")
    run_ranks(WORLD, _save, root, store.storage_options, str(tiers))
    return root, store.storage_options, tiers


def _copy(tiers: Path, wipe: tuple[int, ...] = ()) -> Path:
    dest = tiers.parent / f"copy-{uuid.uuid4().hex[:6]}"
    shutil.copytree(tiers, dest)
    for node in wipe:
        shutil.rmtree(dest / f"node{node}")
    return dest


def _flip_a_replica_byte(tiers: Path) -> None:
    d, doc = _replicas(tiers, 1)[0]["durable"]
    shard = max((d / rel for rel in doc["files"]), key=lambda p: p.stat().st_size)
    with open(shard, "r+b") as f:
        f.seek(shard.stat().st_size // 2)
        b = f.read(1)
        f.seek(-1, 1)
        f.write(bytes([b[0] ^ 0xFF]))


@pytest.fixture(scope="module")
def restored(run: Any) -> dict[str, list[dict[str, Any]]]:
    root, options, tiers = run
    corrupt = _copy(tiers, wipe=(0,))
    _flip_a_replica_byte(corrupt)
    scenarios = {
        "node0-wiped": ("load", str(_copy(tiers, wipe=(0,)))),
        "both-wiped": ("load", str(_copy(tiers, wipe=(0, 1)))),
        "corrupt-replica": ("load", str(corrupt)),
        "local-only-node0-wiped": ("resume", str(_copy(tiers, wipe=(0,)))),
    }
    per_rank = run_ranks(WORLD, _restores, root, options, scenarios)
    return {name: [r[name] for r in per_rank] for name in scenarios}


def _replicas(tiers: Path, node: int) -> dict[int, dict[str, Any]]:
    """The replica descriptors in ``node``'s tier, by rank, per save (local-only or not)."""
    out: dict[int, dict[str, Any]] = {}
    for desc in (tiers / f"node{node}").glob("*/*/.dcpv-tier-*.json"):
        doc = json.loads(desc.read_text())
        if doc.get("replica"):
            kind = "local_only" if doc.get("local_only") else "durable"
            out.setdefault(doc["rank"], {})[kind] = (desc.parent, doc)
    return out


def test_each_node_holds_its_partners_files(run: Any) -> None:
    _, _, tiers = run
    for node, partners in ((0, {2, 3}), (1, {0, 1})):
        held = _replicas(tiers, node)
        assert set(held) == partners, held
        for rank, saves in held.items():
            assert set(saves) == {"durable", "local_only"}, saves
            for d, doc in saves.values():
                assert doc["replica"]["held_by"] == (rank + PER_NODE) % WORLD
                for rel, size in doc["files"].items():
                    assert rel.startswith(f"__{rank}_")
                    assert (d / rel).stat().st_size == size
            d, doc = saves["local_only"]
            assert (d / ".metadata").is_file()
            assert (d / f".dcpv-manifest-{doc['local_only']['save_id']}.json").is_file()
        assert not list((tiers / f"node{node}").rglob("*.tmp-*"))


def test_a_wiped_node_restores_from_its_partners(restored: Any) -> None:
    out = restored["node0-wiped"]
    assert all(s["same"] for s in out), out
    assert all(s["bytes_fetched"] == 0 and s["ranges"] == 0 for s in out), out
    assert all(s["cooperative"] and s["local_fallbacks"] == 0 for s in out), out
    for s in out[:PER_NODE]:  # node 0: every byte from node 1, over the process group
        assert s["bytes_from_local"] == 0 and s["bytes_from_peers"] >= s["bytes_needed"] > 0
    assert sum(s["bytes_to_peers"] for s in out[PER_NODE:]) >= \
        sum(s["bytes_needed"] for s in out[:PER_NODE])


def test_both_nodes_wiped_falls_back_to_the_store(restored: Any) -> None:
    out = restored["both-wiped"]
    assert all(s["same"] for s in out), out
    assert all(s["bytes_from_local"] == 0 for s in out), out
    assert sum(s["bytes_fetched"] for s in out) > 0, out


def test_a_corrupt_replica_byte_is_fetched_from_the_store(restored: Any) -> None:
    out = restored["corrupt-replica"]
    assert all(s["same"] for s in out), out
    assert sum(s["local_fallbacks"] for s in out) > 0, out
    assert 0 < sum(s["bytes_fetched"] for s in out) < sum(s["bytes_needed"] for s in out), out


def test_a_local_only_save_restores_from_the_partner_without_the_store(restored: Any) -> None:
    out = restored["local-only-node0-wiped"]
    assert [s["step"] for s in out] == [2] * WORLD, out
    assert all(s["same"] for s in out), out
    assert all(s["bytes_fetched"] == 0 and s["ranges"] == 0 for s in out), out
    for s in out[:PER_NODE]:
        assert s["bytes_from_local"] == 0 and s["bytes_from_peers"] >= s["bytes_needed"] > 0


# ---- the exchange itself, without a store: many chunks per file, a receiver that fails ----

SAVE_KEY = "0123abcd-0123456789ab"
SIZES = (2500, 0, 1000)  # chunks of 1000 bytes: 3, an empty file, exactly 1


def _shard(rank: int, index: int) -> str:
    return _layout.shard_name(rank, index, SAVE_KEY)


def _content(rank: int, index: int) -> bytes:
    return bytes((rank * 31 + index * 7 + i) % 251 for i in range(SIZES[index]))


def _exchange(rank: int, world: int, tiers: str) -> None:
    _partners.CHUNK_BYTES = 1000
    opts = LocalTierOptions(directory=os.path.join(tiers, f"node{rank}"), keep_last=None,
                            partner_replicas=True, ranks_per_node=1)
    for url in ("s3://b/run/ok", "s3://b/run/blocked"):
        keep = tier.TierSave(opts, url, SAVE_KEY, rank)
        for index in range(len(SIZES)):
            src = os.path.join(tiers, f"spool{rank}-{index}")
            Path(src).write_bytes(_content(rank, index))
            keep.keep(src, _shard(rank, index), SIZES[index])
        keep.complete()
        if url.endswith("blocked") and rank == 1:  # rank 0's first file cannot land here
            os.makedirs(os.path.join(opts.resolved_directory(), url_key(url), SAVE_KEY,
                                     _shard(0, 0)))
        dist.barrier()
        kept = tier.replicate(opts, url, group=None)
        assert kept == (0 if url.endswith("blocked") and rank == 1 else sum(SIZES)), kept
    dist.barrier()


def test_files_stream_in_chunks_and_a_failing_receiver_keeps_nothing(tmp_path: Path) -> None:
    run_ranks(2, _exchange, str(tmp_path))
    for url in ("s3://b/run/ok", "s3://b/run/blocked"):
        for node in (0, 1):
            sender = 1 - node
            d = tmp_path / f"node{node}" / url_key(url) / SAVE_KEY
            desc = d / f".dcpv-tier-{sender}.json"
            assert not list(d.glob("*.tmp-*"))
            if url.endswith("blocked") and node == 1:
                assert not desc.exists()
                assert not (d / _shard(0, 1)).exists() and not (d / _shard(0, 2)).exists()
                continue
            doc = json.loads(desc.read_text())
            assert doc["replica"] == {"held_by": node} and doc["rank"] == sender
            assert doc["files"] == {_shard(sender, i): n for i, n in enumerate(SIZES)}
            for index in range(len(SIZES)):
                assert (d / _shard(sender, index)).read_bytes() == _content(sender, index)
