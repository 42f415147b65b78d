# moved verbatim from tests/unit/test_local_tier_options.py (split by subject, issue 24)
"""The local tier's layout on disk and its retention, without servers or full saves.

Options are in ``tests/unit/test_tier_options.py``; full saves and loads on local files in
``tests/integration/test_tier_keep_one_process.py``.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

from dcp_volumes import (
    LocalTierOptions,
)
from dcp_volumes.tier import TierSave
from dcp_volumes.tier._layout import STALE_S, url_key
from dcp_volumes.tier._retention import apply_retention


def _fake_save(tier: LocalTierOptions, url: str, save_id: str, rank: int, size: int,
               spool: Path) -> int:
    src = spool / f"spool-{save_id}-{rank}"
    src.write_bytes(b"x" * size)
    save = TierSave(tier, url, save_id, rank)
    if not save.admit(size):  # as the writer does
        return 0
    save.keep(str(src), f"__{rank}_0-{save_id}.distcp", size)
    return save.complete()


def _saves_in(root: Path) -> list[str]:
    return sorted(p.name for p in root.glob("*/*") if p.is_dir())


def test_layout_on_disk(tmp_path: Path) -> None:
    tier = LocalTierOptions(directory=str(tmp_path / "tier"), keep_last=None)
    spool = tmp_path / "spool"
    spool.mkdir()
    sid = "00000001-aaaaaaaaaaaa"
    assert _fake_save(tier, "s3://b/ckpt/", sid, 0, 10, spool) == 10
    assert _fake_save(tier, "s3://b/ckpt", sid, 1, 20, spool) == 20  # same URL, no slash
    save_dir = tmp_path / "tier" / url_key("s3://b/ckpt") / sid
    assert sorted(os.listdir(save_dir)) == [
        ".dcpv-tier-0.json", ".dcpv-tier-1.json",
        f"__0_0-{sid}.distcp", f"__1_0-{sid}.distcp"]
    assert not list(spool.iterdir()), "spool files are moved, not copied"
    doc = json.loads((save_dir / ".dcpv-tier-1.json").read_text())
    assert doc["url"] == "s3://b/ckpt" and doc["save_key"] == sid and doc["rank"] == 1
    assert doc["files"] == {f"__1_0-{sid}.distcp": 20}
    # credentials never reach the disk, and do not change the key
    assert url_key("s3://user:secret@b/ckpt") == url_key("s3://other@b/ckpt")


def test_keep_last_evicts_the_oldest_saves(tmp_path: Path) -> None:
    tier = LocalTierOptions(directory=str(tmp_path / "tier"), keep_last=2)
    spool = tmp_path / "spool"
    spool.mkdir()
    ids = [f"0000000{i}-aaaaaaaaaaaa" for i in range(1, 4)]
    for i, sid in enumerate(ids):
        # different checkpoints (a Checkpointer's steps): the budget is the directory's
        _fake_save(tier, f"s3://b/run/step-{i}", sid, 0, 100, spool)
        time.sleep(0.01)
    assert _saves_in(tmp_path / "tier") == ids[1:]


def test_max_bytes_evicts_the_oldest_and_refuses_what_never_fits(tmp_path: Path) -> None:
    tier = LocalTierOptions(directory=str(tmp_path / "tier"), keep_last=None, max_bytes=250)
    spool = tmp_path / "spool"
    spool.mkdir()
    ids = [f"0000000{i}-aaaaaaaaaaaa" for i in range(1, 5)]
    for sid in ids[:3]:
        _fake_save(tier, "s3://b/c", sid, 0, 100, spool)
        time.sleep(0.01)
    assert _saves_in(tmp_path / "tier") == ids[1:3]  # 3 × 100 > 250: the oldest went
    assert _fake_save(tier, "s3://b/c", ids[3], 0, 300, spool) == 0  # alone over budget
    assert _saves_in(tmp_path / "tier") == ids[1:3]


def test_retention_removes_stale_unfinished_saves_only(tmp_path: Path) -> None:
    tier = LocalTierOptions(directory=str(tmp_path / "tier"), keep_last=5)
    unfinished = tmp_path / "tier" / url_key("s3://b/c")
    fresh = unfinished / "00000001-bbbbbbbbbbbb"
    stale = unfinished / "00000001-cccccccccccc"
    for d in (fresh, stale):
        d.mkdir(parents=True)
        (d / "__0_0-x.distcp").write_bytes(b"x")
    old = time.time() - 2 * STALE_S
    os.utime(stale, (old, old))
    other = tmp_path / "tier" / "not-ours"
    other.mkdir()
    apply_retention(tier)
    assert fresh.exists() and not stale.exists() and other.exists()
