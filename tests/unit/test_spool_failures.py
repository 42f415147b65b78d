"""Hardening of the periphery (issue 18 #6-#8), without servers: a transfer the store keeps
throttling fails with an error that says so; a spool file whose O_DIRECT flush hit ENOSPC is
still removed; a read-only spool is named as such; ``ls --local-tier`` refuses a directory
that is not there; goodput inputs are held to a sane range."""

from __future__ import annotations

import errno
import os
import time
import uuid
from pathlib import Path
from typing import Any

import pytest
from _cli import run_cli
from _direct import direct_supported
from _error_shapes import ClientErrorShape

from dcp_volumes import errors
from dcp_volumes.backends import open_backend
from dcp_volumes.backends.records import CallStats
from dcp_volumes.cli._exit import EXIT_USAGE
from dcp_volumes.config import RetryOptions
from dcp_volumes.goodput import FailureModel, TierCosts, plan_intervals
from dcp_volumes.saving import SpoolFile
from dcp_volumes.saving._spool_dir import check_free_space

MiB = 1 << 20

# ---- a transfer the store keeps throttling ---------------------------------------------------


class _AlwaysSlowDown:
    def __init__(self) -> None:
        self.calls = 0

    async def __call__(self) -> str:
        self.calls += 1
        raise ClientErrorShape("SlowDown", 503)


def test_a_transfer_throttled_past_the_deadline_fails_saying_so() -> None:
    """Requests of one transfer (sharing CallStats) that only ever get throttle answers: once
    the run of throttles outlasts the deadline, the next throttled request fails at once,
    however many attempts it has left, and the error says what to change."""
    backend = open_backend(f"memory://storm-{uuid.uuid4().hex[:6]}/ckpt", None,
                           RetryOptions(max_attempts=1000, initial_backoff_s=0.01,
                                        max_backoff_s=0.02, deadline_s=0.3))
    backend.throttle = None  # the pacing is not what this is about
    stats = CallStats()
    first = _AlwaysSlowDown()
    with pytest.raises(errors.UploadError, match="kept throttling"):
        backend.run(lambda: backend.call(first, op="upload", url="x", stats=stats))
    started = time.monotonic()
    later = _AlwaysSlowDown()  # the next part of the same save
    with pytest.raises(errors.UploadError) as info:
        backend.run(lambda: backend.call(later, op="upload", url="y", stats=stats))
    assert time.monotonic() - started < 0.25 and later.calls == 1  # no deadline of its own
    message = str(info.value)
    assert "throttle answers in a row" in message and "SlowDown" in message
    assert "max_concurrency" in message and "deadline_s=0.3s" in message


def test_an_answer_ends_the_run_of_throttles() -> None:
    stats = CallStats()
    assert stats.note_throttle(10.0) == (1, 0.0)
    assert stats.note_throttle(12.5) == (2, 2.5)
    stats.note_answer()
    assert stats.throttle_streak(13.0) is None
    assert stats.note_throttle(14.0) == (1, 0.0)


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


@pytest.mark.parametrize("kind", ["missing", "file"])
def test_ls_local_tier_must_be_a_directory(tmp_path: Path, kind: str) -> None:
    root = tmp_path / "run"
    root.mkdir()
    tier = tmp_path / "tier"
    if kind == "file":
        tier.write_text("not a directory")
    result = run_cli("ls", str(root), "--local-tier", str(tier))
    assert result.returncode == EXIT_USAGE, result
    expected = "does not exist" if kind == "missing" else "is not a directory"
    assert expected in result.stderr and "--local-tier" in result.stderr
    assert "no checkpoints" not in result.stderr


@pytest.mark.parametrize(("flags", "match"), [
    (["--fleet-mtbf-hours", "1e-300", "--fleet-gpus", "8"], "fleet_mtbf_hours"),
    (["--fleet-mtbf-hours", "1e300", "--fleet-gpus", "8"], "fleet_mtbf_hours"),
    (["--afr", "0.05", "--restart-cost-s", "1e300"], "restart_cost_s"),
    (["--afr", "0.05", "--job-hours", "1e300"], "job_hours"),
    (["--afr", "1e300"], "afr"),
], ids=["mtbf-tiny", "mtbf-huge", "restart-huge", "job-hours-huge", "afr-huge"])
def test_plan_refuses_out_of_range_inputs_naming_the_range(flags: list[str], match: str
                                                           ) -> None:
    result = run_cli("plan", "--gpus", "8", "--checkpoint-cost-s", "60", *flags)
    assert result.returncode == EXIT_USAGE, result
    assert match in result.stderr
    assert "valid range" in result.stderr or "fraction per GPU-year" in result.stderr


@pytest.mark.parametrize("build", [
    lambda: FailureModel(gpus=10**12, afr=0.05),
    lambda: plan_intervals(FailureModel(gpus=8, afr=0.05), checkpoint_cost_s=1e300),
    lambda: plan_intervals(FailureModel(gpus=8, afr=0.05), checkpoint_cost_s=60,
                           intervals_s=[1e300]),
    lambda: TierCosts(local_save_s=1, remote_save_s=1e300, local_survives=0.5),
], ids=["gpus", "checkpoint-cost", "interval", "tier-cost"])
def test_goodput_inputs_have_a_sane_range(build: Any) -> None:
    with pytest.raises(errors.ConfigError, match="valid range"):
        build()
