"""The local tier without servers: options, layout on disk, retention, and the reader's
choice of source on a local-filesystem checkpoint (one process, no process group).

Multi-rank loads from SeaweedFS, cooperative loads and resharding with a tier are in
``tests/integration/test_local_tier.py``."""

from __future__ import annotations

import json
import os
import time
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

from dcp_volumes import (
    Checkpointer,
    LocalTierOptions,
    SpoolOptions,
    TransferOptions,
    VolumeReader,
    VolumeWriter,
    _tier,
    errors,
)
from dcp_volumes._compat import no_dist
from dcp_volumes.testing.states import assert_state_equal, mixed_state, zeros_like_state

warnings.filterwarnings("ignore", message="torch.distributed is disabled")

MiB = 1 << 20
SMALL_PARTS = TransferOptions(part_size=5 * MiB, max_concurrency=4)


# ---- options --------------------------------------------------------------------------------

@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"directory": ""}, "non-empty path"),
        ({"directory": 3}, "non-empty path"),
        ({"directory": "/x", "keep_last": 0}, "keep_last must be a positive integer"),
        ({"directory": "/x", "keep_last": True}, "keep_last must be a positive integer"),
        ({"directory": "/x", "max_bytes": -1}, "max_bytes must be a positive integer"),
        ({"directory": "/x", "max_bytes": 1.5}, "max_bytes must be a positive integer"),
    ],
    ids=["empty-dir", "dir-not-path", "keep-zero", "keep-bool", "bytes-negative",
         "bytes-float"],
)
def test_bad_options_say_what_to_change(kwargs: dict[str, Any], match: str) -> None:
    with pytest.raises(errors.ConfigError, match=match):
        LocalTierOptions(**kwargs)


def test_options_are_frozen_and_keyword_only(tmp_path: Path) -> None:
    opts = LocalTierOptions(directory=str(tmp_path), keep_last=None, max_bytes=10)
    with pytest.raises(AttributeError):
        opts.keep_last = 3  # type: ignore[misc]
    with pytest.raises(TypeError):
        LocalTierOptions(str(tmp_path))  # type: ignore[misc]
    assert opts.resolved_directory() == str(tmp_path)


def test_memory_spool_and_unverified_reads_are_refused(tmp_path: Path) -> None:
    tier = LocalTierOptions(directory=str(tmp_path / "tier"))
    with pytest.raises(errors.ConfigError, match="mode='memory'"):
        VolumeWriter(str(tmp_path / "c"), spool=SpoolOptions(mode="memory"), local_tier=tier)
    with pytest.raises(errors.ConfigError, match="mode='memory'"):
        Checkpointer(str(tmp_path / "run"), spool=SpoolOptions(mode="memory"), local_tier=tier)
    with pytest.raises(errors.ConfigError, match="verify=True"):
        VolumeReader(str(tmp_path / "c"), verify=False, local_tier=tier)
    with pytest.raises(errors.ConfigError, match="LocalTierOptions"):
        VolumeWriter(str(tmp_path / "c"), local_tier=str(tmp_path))  # type: ignore[arg-type]
    with pytest.raises(errors.ConfigError, match="LocalTierOptions"):
        VolumeReader(str(tmp_path / "c"), local_tier={"directory": "x"})  # type: ignore[arg-type]


# ---- layout and retention -------------------------------------------------------------------

def _fake_save(tier: LocalTierOptions, url: str, save_id: str, rank: int, size: int,
               spool: Path) -> int:
    src = spool / f"spool-{save_id}-{rank}"
    src.write_bytes(b"x" * size)
    save = _tier.TierSave(tier, url, save_id, rank)
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
    save_dir = tmp_path / "tier" / _tier.url_key("s3://b/ckpt") / sid
    assert sorted(os.listdir(save_dir)) == [
        ".dcpv-tier-0.json", ".dcpv-tier-1.json",
        f"__0_0-{sid}.distcp", f"__1_0-{sid}.distcp"]
    assert not list(spool.iterdir()), "spool files are moved, not copied"
    doc = json.loads((save_dir / ".dcpv-tier-1.json").read_text())
    assert doc["url"] == "s3://b/ckpt" and doc["save_key"] == sid and doc["rank"] == 1
    assert doc["files"] == {f"__1_0-{sid}.distcp": 20}
    # credentials never reach the disk, and do not change the key
    assert _tier.url_key("s3://user:secret@b/ckpt") == _tier.url_key("s3://other@b/ckpt")


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
    unfinished = tmp_path / "tier" / _tier.url_key("s3://b/c")
    fresh = unfinished / "00000001-bbbbbbbbbbbb"
    stale = unfinished / "00000001-cccccccccccc"
    for d in (fresh, stale):
        d.mkdir(parents=True)
        (d / "__0_0-x.distcp").write_bytes(b"x")
    old = time.time() - 2 * _tier.STALE_S
    os.utime(stale, (old, old))
    other = tmp_path / "tier" / "not-ours"
    other.mkdir()
    _tier.apply_retention(tier)
    assert fresh.exists() and not stale.exists() and other.exists()


def test_an_unwritable_tier_never_fails_the_save(tmp_path: Path,
                                                 caplog: pytest.LogCaptureFixture) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    tier = LocalTierOptions(directory=str(blocker / "tier"))
    state = mixed_state(big_bytes=3 * MiB, many=5)
    url = str(tmp_path / "ckpt")
    writer = VolumeWriter(url, transfer=SMALL_PARTS, local_tier=tier,
                          spool=SpoolOptions(directory=str(tmp_path / "spool")))
    with caplog.at_level("WARNING", logger="dcp_volumes"):
        dcp.save(state, storage_writer=writer, **no_dist())
    assert writer.last_stats is not None and writer.last_stats.bytes_kept_local == 0
    assert "local tier" in caplog.text
    assert not list((tmp_path / "spool").iterdir()), "the spool files were cleaned up"
    target = zeros_like_state(state)
    dcp.load(target, storage_reader=VolumeReader(url, local_tier=tier), **no_dist())
    assert_state_equal(target, state)


# ---- the reader's source, end to end on local files -----------------------------------------

def _save(url: str, tier: LocalTierOptions, state: dict[str, Any], spool: Path,
          **kw: Any) -> VolumeWriter:
    writer = VolumeWriter(url, transfer=SMALL_PARTS, local_tier=tier,
                          spool=SpoolOptions(directory=str(spool)), **kw)
    dcp.save(state, storage_writer=writer, **no_dist())
    return writer


def _load(url: str, tier: LocalTierOptions | None, state: dict[str, Any]) -> VolumeReader:
    target = zeros_like_state(state)
    reader = VolumeReader(url, local_tier=tier, transfer=SMALL_PARTS)
    dcp.load(target, storage_reader=reader, **no_dist())
    assert_state_equal(target, state)
    return reader


def _tier_files(root: Path) -> list[Path]:
    return sorted(p for p in root.rglob("*.distcp"))


@pytest.fixture
def saved(tmp_path: Path) -> tuple[str, LocalTierOptions, dict[str, Any], Path]:
    tier = LocalTierOptions(directory=str(tmp_path / "tier"))
    state = mixed_state(big_bytes=6 * MiB, many=20)
    url = str(tmp_path / "ckpt")
    writer = _save(url, tier, state, tmp_path / "spool")
    assert writer.last_stats is not None
    assert writer.last_stats.bytes_kept_local == writer.last_stats.bytes > 0
    return url, tier, state, tmp_path / "tier"


def test_every_byte_from_the_tier(saved: Any) -> None:
    url, tier, state, _ = saved
    s = _load(url, tier, state).last_stats
    assert s is not None
    assert s.bytes_fetched == 0 and s.ranges == 0 and s.local_fallbacks == 0
    assert s.bytes_from_local == s.bytes_needed > 0
    plain = _load(url, None, state).last_stats  # without the option: the store, as before
    assert plain is not None and plain.bytes_from_local == 0
    assert plain.bytes_fetched >= plain.bytes_needed


def test_a_corrupt_local_copy_is_read_from_the_store(saved: Any,
                                                     caplog: pytest.LogCaptureFixture) -> None:
    url, tier, state, root = saved
    victim = max(_tier_files(root), key=lambda p: p.stat().st_size)
    data = bytearray(victim.read_bytes())
    data[len(data) // 2] ^= 0x01
    victim.write_bytes(bytes(data))
    with caplog.at_level("WARNING", logger="dcp_volumes"):
        s = _load(url, tier, state).last_stats
    assert s is not None and s.local_fallbacks >= 1 and 0 < s.bytes_fetched
    assert s.bytes_from_local > 0
    assert "fails its checksum" in caplog.text


@pytest.mark.parametrize("damage", ["truncate", "symlink", "missing", "no-descriptor"],
                         ids=["truncate", "symlink", "missing", "no-descriptor"])
def test_an_unusable_local_copy_is_not_read(saved: Any, damage: str, tmp_path: Path) -> None:
    url, tier, state, root = saved
    files = _tier_files(root)
    victim = files[0]
    if damage == "truncate":
        with open(victim, "r+b") as f:
            f.truncate(victim.stat().st_size - 1)
    elif damage == "symlink":
        copy = tmp_path / "elsewhere.distcp"
        copy.write_bytes(victim.read_bytes())  # even the right bytes: never through a link
        victim.unlink()
        victim.symlink_to(copy)
    elif damage == "missing":
        victim.unlink()
    else:
        for d in root.rglob(".dcpv-tier-*.json"):
            d.unlink()
    s = _load(url, tier, state).last_stats
    assert s is not None
    if damage == "no-descriptor":  # an unfinished copy: nothing local at all, no warning
        assert s.bytes_from_local == 0 and s.local_fallbacks == 0
    else:
        assert s.local_fallbacks >= 1
        assert s.bytes_fetched > 0
        if len(files) > 1:
            assert s.bytes_from_local > 0


def test_only_the_committed_save_is_read(tmp_path: Path) -> None:
    """A newer save whose local copy exists but that never committed is not used; nor is a
    planted directory that claims the committed save id with other bytes."""
    tier = LocalTierOptions(directory=str(tmp_path / "tier"), keep_last=None)
    url = str(tmp_path / "ckpt")
    first = mixed_state(big_bytes=3 * MiB, many=5)
    _save(url, tier, first, tmp_path / "spool")

    second = {k: (v + 1 if isinstance(v, torch.Tensor) and v.dtype.is_floating_point else v)
              for k, v in first.items()}

    class _DiesBeforeCommit(VolumeWriter):
        def finish(self, metadata: Any, results: Any) -> None:
            raise RuntimeError("killed before commit")

    writer = _DiesBeforeCommit(url, transfer=SMALL_PARTS, local_tier=tier, overwrite=True,
                               spool=SpoolOptions(directory=str(tmp_path / "spool")))
    with pytest.raises(CheckpointException, match="killed before commit"):
        dcp.save(second, storage_writer=writer, **no_dist())
    assert len(_saves_in(tmp_path / "tier")) == 2  # the uncommitted copy is there...
    s = _load(url, tier, first).last_stats  # ...and never read
    assert s is not None and s.bytes_from_local == s.bytes_needed and s.local_fallbacks == 0


def test_checkpointer_keeps_and_resumes_from_the_tier(tmp_path: Path,
                                                      caplog: pytest.LogCaptureFixture) -> None:
    tier = LocalTierOptions(directory=str(tmp_path / "tier"), keep_last=2)
    spool = SpoolOptions(directory=str(tmp_path / "spool"))
    ckpt = Checkpointer(str(tmp_path / "run"), local_tier=tier, spool=spool, keep_last=3)
    states = {step: {"w": torch.full((300, 300), float(step)), "step": step}
              for step in (1, 2, 3)}
    for step, state in states.items():
        assert ckpt.save(step, state)
    ckpt.close()
    assert len(_saves_in(tmp_path / "tier")) == 2
    resumed = Checkpointer(str(tmp_path / "run"), local_tier=tier, spool=spool)
    target = {"w": torch.zeros(300, 300), "step": 0}
    with caplog.at_level("INFO", logger="dcp_volumes.reader"):
        assert resumed.load_latest(target) == 3
    resumed.close()
    assert torch.equal(target["w"], states[3]["w"]) and target["step"] == 3
    assert "0 items read from the store instead" in caplog.text
    assert "rank 0 read 0 bytes" in caplog.text


def test_hashed_layout_and_a_linked_directory(tmp_path: Path) -> None:
    """Shard files one directory down (key_layout="hashed") are kept and read the same way;
    a prefix directory replaced by a link is not followed."""
    tier = LocalTierOptions(directory=str(tmp_path / "tier"))
    transfer = TransferOptions(part_size=5 * MiB, max_concurrency=4, key_layout="hashed")
    state = mixed_state(big_bytes=3 * MiB, many=5)
    url = str(tmp_path / "ckpt")
    writer = VolumeWriter(url, transfer=transfer, local_tier=tier,
                          spool=SpoolOptions(directory=str(tmp_path / "spool"),
                                             files_per_rank=1))
    dcp.save(state, storage_writer=writer, **no_dist())
    (shard,) = _tier_files(tmp_path / "tier")
    assert len(shard.parent.name) == 2  # <save id>/<hh>/__0_0-<id>.distcp
    s = _load(url, tier, state).last_stats
    assert s is not None and s.bytes_from_local == s.bytes_needed and s.bytes_fetched == 0

    moved = tmp_path / "moved"
    shard.parent.rename(moved)
    shard.parent.symlink_to(moved, target_is_directory=True)
    s = _load(url, tier, state).last_stats
    assert s is not None and s.bytes_from_local == 0 and s.local_fallbacks >= 1
