# was tests/integration/test_local_tier_saves.py (renamed by subject, issue 24)
"""The local tier end to end on a local-filesystem checkpoint (one process, no process
group, no server): full saves and loads, and the reader's choice of source. Moved from
``tests/unit/test_tier_options.py`` (unit tests make no full save)."""

from __future__ import annotations

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
)
from dcp_volumes._compat import no_dist
from dcp_volumes.testing.states import assert_state_equal, mixed_state, zeros_like_state
from dcp_volumes.tier import walk_saves

warnings.filterwarnings("ignore", message="torch.distributed is disabled")

MiB = 1 << 20
SMALL_PARTS = TransferOptions(part_size=5 * MiB, max_concurrency=4)


# ---- options --------------------------------------------------------------------------------

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
    assert len(list(walk_saves(str(tmp_path / "tier")))) == 2  # the uncommitted copy is there...
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
    assert len(list(walk_saves(str(tmp_path / "tier")))) == 2
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
