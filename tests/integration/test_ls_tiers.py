"""``dcp-volumes ls --local-tier DIR``: each checkpoint's tier (durable, with or without a
local copy on this node, or local-only), run as a user runs it (a subprocess), on a run
written by a ``Checkpointer`` with two cadences into a local-directory store.

Also ``catalog.local_tier_copies`` directly: a node holding only some ranks of a local-only
save, and a damaged local-only save (left out: it would never be used).
"""

from __future__ import annotations

import json
import os
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
from _cli import run_cli as dcpv

from dcp_volumes import Checkpointer, LocalTierOptions, SpoolOptions, catalog

warnings.filterwarnings("ignore", message="torch.distributed is disabled")



@pytest.fixture
def run(tmp_path: Path) -> tuple[Path, Path]:
    """Steps 1..10, durable every 6 and local-only every 2; the tier keeps its newest 3."""
    root, tier = tmp_path / "run", tmp_path / "tier"
    with Checkpointer(
        str(root),
        every_steps=6,
        local_every_steps=2,
        spool=SpoolOptions(directory=str(tmp_path / "spool")),
        local_tier=LocalTierOptions(directory=str(tier), keep_last=3),
    ) as ckpt:
        for step in range(1, 11):
            ckpt.save(step, {"w": torch.full((128, 128), float(step))})
    return root, tier


def test_ls_shows_tiers(run: tuple[Path, Path]) -> None:
    root, tier = run
    proc = dcpv("ls", str(root), "--local-tier", str(tier))
    assert proc.returncode == 0, proc.stderr
    lines = {line.split()[1]: line for line in proc.stdout.splitlines()[2:-1]}
    assert list(lines) == ["step-00000006", "step-00000008", "step-00000010"]
    assert "durable + local copy" in lines["step-00000006"]
    for name in ("step-00000008", "step-00000010"):
        assert "local-only (not durable)" in lines[name]
    summary = proc.stdout.splitlines()[-1]
    assert "1 checkpoint in the store (1 durable, 1 with a local copy here)" in summary
    assert "2 local-only saves" in summary and "not durable" in summary


def test_ls_json_tiers(run: tuple[Path, Path]) -> None:
    root, tier = run
    proc = dcpv("ls", f"{root}/", "--local-tier", str(tier), "--json")
    assert proc.returncode == 0, proc.stderr
    doc = json.loads(proc.stdout)
    got = [(c["step"], c["tier"], c["durable"], c["local_copy"]) for c in doc["checkpoints"]]
    assert got == [(6, "durable", True, True), (8, "local-only", False, True),
                   (10, "local-only", False, True)]  # fmt: skip
    assert doc["checkpoints"][1]["local_ranks"] == [0] and doc["checkpoints"][1]["world"] == 1


def test_ls_without_local_tier_is_unchanged(run: tuple[Path, Path]) -> None:
    root, _ = run
    proc = dcpv("ls", str(root), "--json")
    assert proc.returncode == 0, proc.stderr
    doc = json.loads(proc.stdout)
    assert [c["step"] for c in doc["checkpoints"]] == [6]
    assert "tier" not in doc["checkpoints"][0]


def test_durable_without_local_copy(run: tuple[Path, Path], tmp_path: Path) -> None:
    root, _ = run
    empty = tmp_path / "other-node-tier"
    empty.mkdir()
    proc = dcpv("ls", str(root), "--local-tier", str(empty), "--json")
    assert proc.returncode == 0, proc.stderr
    doc = json.loads(proc.stdout)
    assert [(c["step"], c["tier"], c["local_copy"]) for c in doc["checkpoints"]] == [
        (6, "durable", False)
    ]


def test_local_tier_copies_partial_and_damaged(run: tuple[Path, Path]) -> None:
    root, tier = run
    copies = catalog.local_tier_copies(root, tier)
    assert [(c.step, c.kind, c.complete_here) for c in copies] == [
        (6, "local-copy", True), (8, "local-only", True), (10, "local-only", True),
    ]  # fmt: skip
    # damage step 10's shard behind the tier's back: it is left out (never used on restore)
    step10 = next(p for p in tier.glob("*/*") if _descriptor(p).get("url", "").endswith("10"))
    shard = next(p for p in step10.rglob("*.distcp"))
    os.truncate(shard, 10)
    assert [c.step for c in catalog.local_tier_copies(root, tier)] == [6, 8]


def _two_nodes(rank: int, world: int, root: str, base: str) -> None:
    # a key per rank: DCP writes a replicated tensor on one rank only, and a rank with no
    # files keeps no local copy
    with Checkpointer(
        root,
        every_steps=4,
        local_every_steps=2,
        spool=SpoolOptions(directory=os.path.join(base, f"spool{rank}")),
        local_tier=LocalTierOptions(directory=os.path.join(base, f"node{rank}"), keep_last=None),
    ) as ckpt:
        for step in range(1, 7):
            ckpt.save(step, {f"w{rank}": torch.full((64, 64), float(step))})


def test_two_nodes_each_hold_their_ranks(tmp_path: Path) -> None:
    from dcp_volumes.testing.dist import run_ranks

    root = tmp_path / "run"
    run_ranks(2, _two_nodes, str(root), str(tmp_path))
    proc = dcpv("ls", str(root), "--local-tier", str(tmp_path / "node1"), "--json")
    assert proc.returncode == 0, proc.stderr
    doc = json.loads(proc.stdout)
    got = [(c["step"], c["tier"], c["local_copy"]) for c in doc["checkpoints"]]
    assert got == [(2, "local-only", True), (4, "durable", True), (6, "local-only", True)]
    lo = doc["checkpoints"][2]
    assert lo["local_ranks"] == [1] and lo["world"] == 2 and not lo["complete_here"]
    table = dcpv("ls", str(root), "--local-tier", str(tmp_path / "node1")).stdout
    assert "local-only, 1 of 2 ranks here" in table


def _descriptor(save_dir: Path) -> dict[str, Any]:
    for p in save_dir.glob(".dcpv-tier-*.json"):
        doc: dict[str, Any] = json.loads(p.read_text())
        return doc
    return {}
