# was tests/integration/test_local_only_lineage.py (renamed by subject, issue 24)
"""Issue 18 #1 and #2 at the Checkpointer: a local-only save is used at restore only as a
verified continuation of the newest durable checkpoint, and a malformed descriptor spoils
one save, never a restart. One process, a local-directory store; the store and the tiers
are changed behind the Checkpointer's back with plain file operations."""

from __future__ import annotations

import re
import shutil
import warnings
from pathlib import Path
from typing import Any

import torch
from _cli import run_cli

from dcp_volumes import Checkpointer, LocalTierOptions, SpoolOptions, catalog

warnings.filterwarnings("ignore", message="torch.distributed is disabled")


def state(value: float) -> dict[str, Any]:
    return {"w": torch.full((32, 32), value), "meta": {"value": value}}


def _ckpt(tmp: Path, **kw: Any) -> Checkpointer:
    return Checkpointer(str(tmp / "run"), spool=SpoolOptions(directory=str(tmp / "spool")),
                        local_tier=LocalTierOptions(directory=str(tmp / "tier"),
                                                    keep_last=None), **kw)


def _resume(tmp: Path) -> tuple[int | None, float]:
    target = state(-1.0)
    with _ckpt(tmp) as ckpt:
        step = ckpt.load_latest(target)
    assert torch.equal(target["w"], torch.full((32, 32), target["meta"]["value"]))
    return step, target["meta"]["value"]


def _run_one(tmp: Path) -> None:
    """Run 1: durable step 100, local-only step 150."""
    with _ckpt(tmp) as ckpt:
        ckpt.save(100, state(1.0), force=True)
        ckpt.save(150, state(1.5), force=True, local_only=True)


def test_a_continuation_is_used(tmp_path: Path) -> None:
    _run_one(tmp_path)
    assert _resume(tmp_path) == (150, 1.5)


def test_a_stale_local_only_save_never_outranks_a_new_runs_durable_save(
        tmp_path: Path) -> None:
    _run_one(tmp_path)
    shutil.rmtree(tmp_path / "run")  # the user removes the run's checkpoints
    with _ckpt(tmp_path) as ckpt:
        assert ckpt.load_latest(state(0.0)) is None  # run 1's local-only save has no base
        ckpt.save(100, state(2.0), force=True)  # run 2, other values
    assert _resume(tmp_path) == (100, 2.0)


def test_removed_with_the_cli_the_base_is_gone(tmp_path: Path) -> None:
    _run_one(tmp_path)
    url = str(tmp_path / "run" / "step-00000100")
    assert run_cli("rm", url, "--yes").returncode == 0
    assert catalog.latest(str(tmp_path / "run")) is None
    assert _resume(tmp_path) == (None, -1.0)  # nothing durable, and step 150 continues none


def test_a_replaced_base_is_another_lineage(tmp_path: Path) -> None:
    _run_one(tmp_path)
    with _ckpt(tmp_path, overwrite=True) as ckpt:  # step 100 saved again: a new save id
        ckpt.save(100, state(3.0), force=True)
    assert _resume(tmp_path) == (100, 3.0)


def test_a_local_only_save_after_a_resume_continues_what_was_loaded(tmp_path: Path) -> None:
    _run_one(tmp_path)
    with _ckpt(tmp_path) as ckpt:
        assert ckpt.load_latest(state(0.0)) == 150
        ckpt.save(175, state(1.75), force=True, local_only=True)
    assert _resume(tmp_path) == (175, 1.75)


def _spoil_descriptors(tier: Path) -> int:
    n = 0
    for desc in tier.rglob(".dcpv-tier-*.json"):
        desc.write_text(re.sub(r'"created": [0-9.e+]+', '"created": 1' + "0" * 400,
                               desc.read_text()))
        n += 1
    return n


def test_a_malformed_descriptor_spoils_one_save_not_the_restart(tmp_path: Path) -> None:
    with _ckpt(tmp_path) as ckpt:
        ckpt.save(100, state(1.0), force=True)
        ckpt.save(150, state(1.5), force=True, local_only=True)
    assert _spoil_descriptors(tmp_path / "tier") == 2  # step 100's local copy and step 150
    assert _resume(tmp_path) == (100, 1.0)  # from the store: step 150 is unusable
    with _ckpt(tmp_path) as ckpt:  # a local-only save still works beside the bad ones
        ckpt.load_latest(state(0.0))
        assert ckpt.save(160, state(1.6), force=True, local_only=True)
    assert _resume(tmp_path) == (160, 1.6)
    out = run_cli("ls", str(tmp_path / "run"), "--local-tier", str(tmp_path / "tier"))
    assert out.returncode == 0, out.stderr
    assert "Traceback" not in out.stderr and "step-00000160" in out.stdout
