# was tests/integration/test_local_only_saves.py (renamed by subject, issue 24)
"""Local-only saves on one process (no server: a local-directory root): save, resume,
fallback, async, a tier too small. Moved from ``tests/unit/test_cooperative_plan_holders.py``
(unit tests make no full save), with the checks of ``save(..., local_only=)``."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
import torch

from dcp_volumes import Checkpointer, LocalTierOptions, SpoolOptions, errors
from dcp_volumes.checkpointer._run import MARKER

MiB = 1 << 20


def _ckpt(tmp: Path, **kw: Any) -> Checkpointer:
    kw.setdefault("local_tier", LocalTierOptions(directory=str(tmp / "tier"), keep_last=2))
    return Checkpointer(str(tmp / "run"), spool=SpoolOptions(directory=str(tmp / "spool")),
                        **kw)


def _state(step: int) -> dict[str, Any]:
    g = torch.Generator().manual_seed(step)
    return {"w": torch.randn(300, 1000, generator=g), "b": torch.randn(10, generator=g),
            "extra": {"step": step}}


def test_local_only_needs_a_local_tier(tmp_path: Path) -> None:
    ckpt = _ckpt(tmp_path, local_tier=None)
    with pytest.raises(errors.ConfigError, match="local_tier="):
        ckpt.save(1, _state(1), local_only=True)
    with pytest.raises(errors.ConfigError, match="local_only="):
        _ckpt(tmp_path).save(1, _state(1), local_only="yes")  # type: ignore[arg-type]
    assert not (tmp_path / "run").exists()


def test_local_only_saves_on_one_process(tmp_path: Path) -> None:
    with _ckpt(tmp_path) as ckpt:
        ckpt.save(1, _state(1))
        ckpt.save(2, _state(2), local_only=True)
        ckpt.save(3, _state(3), local_only=True)
    # nothing else stored (but the run's lease, taken by the durable save)
    assert sorted(os.listdir(tmp_path / "run")) == [MARKER, "step-00000001"]
    # keep_last=2 counts the local-only saves: step 1's local copy is gone
    assert len(list((tmp_path / "tier").glob("*/*/.dcpv-tier-0.json"))) == 2
    state = {k: (torch.zeros_like(v) if isinstance(v, torch.Tensor) else {"step": 0}) for k, v in
             _state(0).items()}
    with _ckpt(tmp_path) as ckpt:
        assert ckpt.load_latest(state) == 3
        stats = ckpt.last_load_stats
    assert stats is not None and stats.bytes_fetched == 0 and stats.bytes_from_local > 0
    want = _state(3)
    assert torch.equal(state["w"], want["w"]) and state["extra"] == {"step": 3}


def test_a_lost_local_only_save_falls_back_to_the_durable_one(tmp_path: Path) -> None:
    with _ckpt(tmp_path) as ckpt:
        ckpt.save(1, _state(1))
        ckpt.save(2, _state(2), local_only=True)
    for desc in (tmp_path / "tier").glob("*/*/.dcpv-tier-0.json"):
        if '"local_only"' in desc.read_text():
            desc.unlink()  # the descriptor is written last: as if the save never finished
    state = {k: (torch.zeros_like(v) if isinstance(v, torch.Tensor) else {"step": 0}) for k, v in
             _state(0).items()}
    with _ckpt(tmp_path) as ckpt:
        assert ckpt.load_latest(state) == 1
    assert torch.equal(state["w"], _state(1)["w"])


def test_async_local_only_save(tmp_path: Path) -> None:
    with _ckpt(tmp_path, async_save=True) as ckpt:
        ckpt.save(1, _state(1), local_only=True)
        ckpt.save(2, _state(2), local_only=True)
    assert not (tmp_path / "run").exists()
    state = {k: (torch.zeros_like(v) if isinstance(v, torch.Tensor) else {"step": 0})
             for k, v in _state(0).items()}
    with _ckpt(tmp_path) as ckpt:
        assert ckpt.load_latest(state) == 2
    assert torch.equal(state["w"], _state(2)["w"]) and state["extra"] == {"step": 2}


def test_a_tier_too_small_fails_the_local_only_save(tmp_path: Path) -> None:
    tier = LocalTierOptions(directory=str(tmp_path / "tier"), max_bytes=1000)
    with _ckpt(tmp_path, local_tier=tier) as ckpt, \
            pytest.raises(errors.SpoolError, match="max_bytes"):
        ckpt.save(1, _state(1), local_only=True)
    assert not list((tmp_path / "tier").glob("*/*/*.distcp"))


def test_the_writer_completes_its_own_local_only_save(tmp_path: Path) -> None:
    """A VolumeWriter used without a Checkpointer: after dcp.save, ``local_only_result``
    completes the save (the descriptor last, recording the base it asks for) and answers
    whether this rank's copy is complete; asking again gives the same answer."""
    import torch.distributed.checkpoint as dcp

    from dcp_volumes import VolumeWriter
    from dcp_volumes.tier import DurableBase, find_local_only

    tier = LocalTierOptions(directory=str(tmp_path / "tier"))
    url = str(tmp_path / "run" / "step-1")
    writer = VolumeWriter(url, spool=SpoolOptions(directory=str(tmp_path / "spool")),
                          local_tier=tier, local_only=True)
    dcp.save(_state(1), storage_writer=writer, no_dist=True)
    assert find_local_only(tier, lambda u: True) == []  # no descriptor before the result
    base = DurableBase("file:///elsewhere", "0123abcd-0123456789ab", "00" * 32)
    asked: list[int] = []

    def lineage() -> DurableBase:
        asked.append(1)
        return base

    assert writer.local_only_result(base=lineage) is True
    assert writer.local_only_result(base=lineage) is True  # the same answer, done once
    assert asked == [1]
    [copy] = find_local_only(tier, lambda u: True)
    assert copy.base == base and copy.world == 1 and copy.rank == 0
    assert not (tmp_path / "run").exists()  # nothing went to the store
