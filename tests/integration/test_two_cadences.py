"""Two cadences on one ``Checkpointer``: durable saves every N steps, local-only saves every M
steps between them; which steps go where, resume from the newest, retention per tier.

Single process (no process group) on a local-directory store, plus one run on two gloo ranks
with a tier directory per "node". What is in the store and in the tiers is checked behind the
Checkpointer's back: directory listings and the tiers' descriptors.
"""

from __future__ import annotations

import json
import os
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

from dcp_volumes import Checkpointer, LocalTierOptions, SpoolOptions, catalog, errors
from dcp_volumes.checkpointer._run import MARKER
from dcp_volumes.testing.dist import run_ranks
from dcp_volumes.tier._layout import url_key

warnings.filterwarnings("ignore", message="torch.distributed is disabled")


def state_at(step: int) -> dict[str, Any]:
    return {"w": torch.full((64, 64), float(step)), "meta": {"step": step}}


def _ckpt(root: Path, tiers: Path, rank: int = 0, **kw: Any) -> Checkpointer:
    opts: dict[str, Any] = {"every_steps": 6, "local_every_steps": 2}
    opts.update(kw)
    tier_keep = opts.pop("tier_keep_last", None)
    return Checkpointer(
        str(root),
        spool=SpoolOptions(directory=str(tiers / f"spool{rank}")),
        local_tier=LocalTierOptions(directory=str(tiers / f"node{rank}"), keep_last=tier_keep),
        **opts,
    )


def store_steps(root: Path) -> list[int]:
    """Committed steps in the store, read behind the Checkpointer's back."""
    return sorted(
        int(p.name.split("-")[1]) for p in root.glob("step-*") if (p / ".metadata").is_file()
    )


def tier_steps(tier: Path, ckpt: Checkpointer, steps: range) -> dict[int, str]:
    """``{step: "local-only" | "durable copy"}`` for each step with a descriptor in ``tier``."""
    out: dict[int, str] = {}
    for step in steps:
        for desc in (tier / url_key(ckpt.url_for(step))).glob("*/.dcpv-tier-*.json"):
            doc = json.loads(desc.read_text())
            out[step] = "local-only" if doc.get("local_only") else "durable copy"
    return out


# --------------------------------------------------------------------------------------------
# the policy alone


def test_due_over_twelve_steps(tmp_path: Path) -> None:
    ckpt = _ckpt(tmp_path / "run", tmp_path)
    kinds = {s: ckpt.due(s) for s in range(1, 13)}
    assert kinds == {
        1: None, 2: "local-only", 3: None, 4: "local-only", 5: None, 6: "durable",
        7: None, 8: "local-only", 9: None, 10: "local-only", 11: None, 12: "durable",
    }  # fmt: skip
    assert [s for s in range(1, 13) if ckpt.should_save(s)] == [2, 4, 6, 8, 10, 12]


class FakeClock:
    """Monotonic seconds that move only when the test says so."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_local_every_seconds(tmp_path: Path) -> None:
    clock = FakeClock()
    ckpt = _ckpt(tmp_path / "run", tmp_path, every_steps=100, local_every_steps=None,
                 local_every_seconds=0.2, clock=clock)  # fmt: skip
    assert ckpt.due(1) is None
    clock.now += 0.25
    assert ckpt.due(2) == "local-only"
    assert ckpt.due(100) == "durable"  # due for both: durable


def test_durable_clock_is_not_reset_by_local_saves(tmp_path: Path) -> None:
    clock = FakeClock()
    ckpt = _ckpt(tmp_path / "run", tmp_path, every_steps=None, every_seconds=0.3,
                 local_every_steps=1, clock=clock)  # fmt: skip
    with ckpt:
        assert ckpt.save(1, state_at(1))  # local-only
        clock.now += 0.35
        assert ckpt.save(2, state_at(2))  # local save started 0.35 s ago, durable never: durable
        assert ckpt.due(3) == "local-only"
    assert store_steps(tmp_path / "run") == [2]


@pytest.mark.parametrize(
    ("kw", "match"),
    [
        ({"local_every_steps": 0}, "local_every_steps must be a whole number"),
        ({"local_every_steps": True}, "local_every_steps must be a whole number"),
        ({"local_every_seconds": -1.0}, "local_every_seconds must be > 0"),
        ({"every_steps": None}, "need a durable cadence"),
    ],
    ids=["zero-steps", "bool-steps", "negative-seconds", "no-durable-cadence"],
)
def test_invalid_cadences(tmp_path: Path, kw: dict[str, Any], match: str) -> None:
    with pytest.raises(errors.ConfigError, match=match):
        _ckpt(tmp_path / "run", tmp_path, **kw)


@pytest.mark.parametrize(
    "kw", [{"drain": True}, {"drain": True, "async_save": True, "local_every_steps": None}],
    ids=["sync", "no-local-cadence"],
)  # fmt: skip
def test_drain_needs_async_and_a_local_cadence(tmp_path: Path, kw: dict[str, Any]) -> None:
    with pytest.raises(errors.ConfigError, match="drain=True"):
        _ckpt(tmp_path / "run", tmp_path, **kw)


def test_local_cadence_needs_a_tier(tmp_path: Path) -> None:
    with pytest.raises(errors.ConfigError, match="need a local tier"):
        Checkpointer(str(tmp_path / "run"), every_steps=6, local_every_steps=2)


# --------------------------------------------------------------------------------------------
# saving and resuming, one process


def _train(ckpt: Checkpointer, steps: range) -> list[int]:
    saved = []
    for step in steps:
        if ckpt.save(step, state_at(step)):
            saved.append(step)
    return saved


@pytest.mark.parametrize("async_save", [False, True], ids=["sync", "async"])
def test_twelve_steps_local_and_durable(tmp_path: Path, async_save: bool) -> None:
    root, tier = tmp_path / "run", tmp_path / "node0"
    with _ckpt(root, tmp_path, async_save=async_save) as ckpt:
        assert _train(ckpt, range(1, 11)) == [2, 4, 6, 8, 10]
    # nothing of a local-only step in the store
    assert store_steps(root) == [6]
    assert sorted(p.name for p in root.iterdir()) == [MARKER, "step-00000006"]  # + run lease
    assert tier_steps(tier, ckpt, range(1, 13)) == {
        2: "local-only", 4: "local-only", 6: "durable copy", 8: "local-only", 10: "local-only",
    }  # fmt: skip

    # a restart resumes from the newest: local-only step 10 (newer than durable 6)
    target = state_at(0)
    with _ckpt(root, tmp_path) as resumed:
        assert resumed.load_latest(target) == 10
        assert torch.equal(target["w"], state_at(10)["w"]) and target["meta"] == {"step": 10}
        assert _train(resumed, range(11, 13)) == [12]
    assert store_steps(root) == [6, 12]
    with _ckpt(root, tmp_path) as again:
        assert again.load_latest(target) == 12
    assert torch.equal(target["w"], state_at(12)["w"])


def test_retention_per_tier(tmp_path: Path) -> None:
    root, tier = tmp_path / "run", tmp_path / "node0"
    with _ckpt(root, tmp_path, every_steps=4, local_every_steps=1, keep_last=2,
               tier_keep_last=3) as ckpt:  # fmt: skip
        _train(ckpt, range(1, 13))
    # durable: 4, 8, 12, keep_last=2 in the store
    assert store_steps(root) == [8, 12]
    # the tier keeps the newest 3 saves of either kind: 10, 11 (local-only), 12 (durable copy)
    assert tier_steps(tier, ckpt, range(1, 13)) == {
        10: "local-only", 11: "local-only", 12: "durable copy",
    }  # fmt: skip
    # an explicit kind still wins over the cadence, and force saves are durable by default
    with _ckpt(root, tmp_path, every_steps=4, local_every_steps=1, tier_keep_last=3) as ckpt:
        assert ckpt.save(14, state_at(14), local_only=False)
        assert ckpt.save(15, state_at(15), force=True)
        assert ckpt.save(17, state_at(17), force=True, local_only=True)
    assert store_steps(root)[-2:] == [14, 15]
    assert tier_steps(tier, ckpt, range(14, 18)) == {
        14: "durable copy", 15: "durable copy", 17: "local-only",
    }  # fmt: skip


def test_drain_makes_local_saves_durable_while_no_upload_is_in_flight(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    root, tier = tmp_path / "run", tmp_path / "node0"
    busy = False
    with _ckpt(root, tmp_path, every_steps=100, local_every_steps=1, async_save=True,
               drain=True, tier_keep_last=None) as ckpt:  # fmt: skip
        assert ckpt.due(1) == "local-only"
        assert ckpt.save(1, state_at(1))  # nothing in flight: durable
        ckpt.wait()
        assert ckpt._upload_idle()
        monkeypatch.setattr(ckpt, "_upload_idle", lambda: not busy)
        busy = True  # an upload in flight: the local-only save stays local
        assert ckpt.save(2, state_at(2))
        busy = False
        assert ckpt.save(3, state_at(3))
        assert ckpt.save(4, state_at(4), local_only=True)  # an explicit kind wins
    assert store_steps(root) == [1, 3]
    assert tier_steps(tier, ckpt, range(1, 5)) == {
        1: "durable copy", 2: "local-only", 3: "durable copy", 4: "local-only",
    }  # fmt: skip


# --------------------------------------------------------------------------------------------
# two gloo ranks, a tier directory per node


def _ranks_run(rank: int, world: int, root: str, tiers: str) -> dict[str, Any]:
    base = Path(tiers)
    with _ckpt(Path(root), base, rank, every_steps=6, local_every_steps=2,
               every_seconds=3600.0) as ckpt:  # fmt: skip
        saved = _train(ckpt, range(1, 11))
    dist.barrier()
    target = {"w": torch.zeros(64, 64), "meta": {"step": 0}}
    with _ckpt(Path(root), base, rank) as resumed:
        step = resumed.load_latest(target)
    ok = torch.equal(target["w"], state_at(10)["w"])
    dist.barrier()
    # drain: rank 0 says whether the uploader is idle, for both ranks (one broadcast)
    with _ckpt(Path(root + "-drain"), base, rank, every_steps=100, local_every_steps=1,
               async_save=True, drain=True) as drained:  # fmt: skip
        for n in (1, 2, 3):
            drained.save(n, state_at(n))
            drained.wait()
    dist.barrier()
    return {"saved": saved, "step": step, "same": ok,
            "tier": tier_steps(base / f"node{rank}", resumed, range(1, 11))}  # fmt: skip


def test_two_ranks(tmp_path: Path) -> None:
    root = tmp_path / "run"
    out = run_ranks(2, _ranks_run, str(root), str(tmp_path))
    for o in out:
        assert o["saved"] == [2, 4, 6, 8, 10]
        assert o["step"] == 10 and o["same"]
        assert o["tier"] == {2: "local-only", 4: "local-only", 6: "durable copy",
                             8: "local-only", 10: "local-only"}  # fmt: skip
    assert store_steps(root) == [6]
    assert store_steps(tmp_path / "run-drain") == [1, 2, 3]
    infos = catalog.list_checkpoints(str(root))
    assert [i.step for i in infos] == [6] and infos[0].complete
    assert sorted(os.listdir(root)) == [MARKER, "step-00000006"]  # + the run's lease
