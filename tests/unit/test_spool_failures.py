# was tests/unit/test_periphery_hardening.py (renamed by subject, issue 24)
"""The spool when things go wrong (issue 18 #7; issue 10), without servers: a spool file whose
O_DIRECT flush hit ENOSPC is still removed; a read-only spool is named as such; spool files
left by dead processes are removed at the next save.

The throttling test that was here is in ``test_throttle_streak.py``, the CLI's in
``test_cli_usage_errors.py``, goodput's ranges in ``test_goodput_ranges.py``."""

from __future__ import annotations

import errno
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from _direct import direct_supported

import dcp_volumes
from dcp_volumes import SpoolOptions, errors
from dcp_volumes.saving import SpoolFile
from dcp_volumes.saving._spool_dir import check_free_space, spool_file_name

MiB = 1 << 20

# ---- the spool --------------------------------------------------------------------------------


@pytest.mark.parametrize("first_flush", [True, False], ids=["first-flush", "later-flush"])
def test_enospc_during_a_direct_flush_still_removes_the_spool_file(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, first_flush: bool) -> None:
    if not direct_supported(tmp_path):
        pytest.skip("the test directory's filesystem refuses O_DIRECT")
    real_write = os.write
    flushes = [0]

    def write(fd: int, data: Any) -> int:
        if fd == direct_fd[0] and sf.direct_io:  # fd numbers are reused
            flushes[0] += 1
            if first_flush or flushes[0] > 1:
                raise OSError(errno.ENOSPC, "No space left on device")
        return real_write(fd, data)

    sf = SpoolFile("x", mode="disk", directory=str(tmp_path), part_size=5 * MiB, direct=True)
    direct_fd = [sf._disk._fd]  # type: ignore[union-attr]
    assert sf.direct_io and sf.path is not None
    monkeypatch.setattr(os, "write", write)
    sf.begin_item()
    with pytest.raises(errors.SpoolError, match="No space left") as info:
        for _ in range(20):
            sf.write(os.urandom(MiB))
    monkeypatch.setattr(os, "write", real_write)
    kept = info.value  # the writer keeps the error (and its traceback) to report it
    sf.discard()
    assert not os.path.exists(sf.path)
    sf.discard()  # idempotent
    assert kept is info.value


def test_a_read_only_spool_directory_is_named_as_such(tmp_path: Path,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    real_statvfs = os.statvfs

    class _ReadOnly:
        def __init__(self, path: Any) -> None:
            self._real = real_statvfs(path)
            self.f_flag = self._real.f_flag | os.ST_RDONLY

        def __getattr__(self, name: str) -> Any:
            return getattr(self._real, name)

    monkeypatch.setattr(os, "statvfs", _ReadOnly)  # a read-only mount, as statvfs reports it
    with pytest.raises(errors.SpoolError, match="read-only") as info:
        check_free_space(str(tmp_path), 1 << 20, 1.1)
    assert "GiB free" not in str(info.value) and "SpoolOptions(directory=" in str(info.value)


# ---- the CLI ----------------------------------------------------------------------------------


# moved verbatim from tests/unit/test_hardening.py (split by subject, issue 24)
def _state(extra: object) -> dict[str, object]:
    return {"w": torch.arange(16, dtype=torch.float32), "extra": extra}


def _dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def test_spool_files_of_dead_processes_are_removed_at_the_next_save(tmp_path: Path) -> None:
    spool = tmp_path / "spool"
    spool.mkdir()
    shard = f"__0_0-{'0' * 8}-{'a' * 12}.distcp"
    mine = spool_file_name(shard)  # this host, this pid
    host = mine.split("-")[1]
    dead = spool / f"dcpv-{host}-{_dead_pid()}-{shard}"
    live = spool / f"dcpv-{host}-{os.getppid()}-{shard}"
    other_host = spool / f"dcpv-ffffffff-{_dead_pid()}-{shard}"
    unrelated = spool / "dcpv-notes.txt"
    link = spool / f"dcpv-{host}-{_dead_pid()}-__0_1-{'0' * 8}-{'b' * 12}.distcp"
    for f in (dead, live, other_host, unrelated):
        f.write_bytes(b"x" * 10)
    link.symlink_to(unrelated)
    dcp_volumes.save(_state(1), str(tmp_path / "ckpt"),
                     spool=SpoolOptions(directory=str(spool)), no_dist=True)
    assert not dead.exists()
    assert live.exists() and other_host.exists() and unrelated.exists() and link.is_symlink()
