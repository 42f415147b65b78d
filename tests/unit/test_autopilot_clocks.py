"""The autopilot's clocks (issue 27): every duration within one process is measured on the
monotonic clock, so a wall-clock step (NTP, a paused VM: 7, 34 and 109 s were seen in the
goodput harness) is neither failure-free exposure nor restart cost; only the gap between two
incarnations spans processes and uses the wall clock, bounded. Fake clocks, a local directory
as the store, no sleeps."""

from __future__ import annotations

import json
import logging
import threading
import warnings
from pathlib import Path
from typing import Any

import pytest
from _goodput_oracle import mixture_mttf

from dcp_volumes.checkpointer._autopilot import Autopilot
from dcp_volumes.checkpointer._record_writes import record_writes
from dcp_volumes.goodput import AutopilotOptions, FailureModel
from dcp_volumes.goodput._record import RECORD_NAME

warnings.filterwarnings("ignore", message="torch.distributed is disabled")

#: the prior: the injected rate of the harness, M = 40 s on 2 GPUs
OPTS = AutopilotOptions(failure_model=FailureModel.from_fleet(mtbf_hours=40 / 3600,
                                                              fleet_gpus=2, gpus=2),
                        min_interval_s=0.5)
from _clocks import T0, Clocks


def _pilot(root: Path, clocks: Clocks, *, settle: bool = True, **kw: Any) -> Autopilot:
    """An autopilot constructed now; ``settle``: its read of the record has landed (the
    hooks do not wait for it)."""
    pilot = Autopilot(str(root), {}, None, OPTS, local_tier=False, wall=clocks.wall,
                      monotonic=clocks.mono, **kw)
    pilot.begin(None)
    if settle:
        pilot.flush()
    return pilot


def _save(pilot: Autopilot, clocks: Clocks, blocking: float, wall_step: float = 0.0) -> None:
    started = clocks.mono()
    clocks.advance(blocking / 2)
    clocks.step(wall_step)  # the VM stalls in the middle of the save
    clocks.advance(blocking / 2)
    pilot.track("durable", started, None, None)


def _train_and_save(pilot: Autopilot, clocks: Clocks, saves: int, *, work: float = 10.0,
                    wall_step: float = 0.0) -> None:
    for i in range(saves):
        clocks.advance(work)
        _save(pilot, clocks, 1.5, wall_step if i == saves // 2 else 0.0)


@pytest.mark.parametrize("wall_step", [0.0, 109.0, -109.0], ids=["none", "forward", "back"])
def test_a_wall_clock_step_within_an_incarnation_changes_nothing(
        tmp_path: Path, wall_step: float) -> None:
    clocks = Clocks()
    pilot = _pilot(tmp_path / "run", clocks, age_s=2.0)
    _train_and_save(pilot, clocks, 6, wall_step=wall_step)
    st = pilot.stats()
    # 2 s before the Checkpointer, 6 × (10 s of work + a 1.5 s save): 71 s, on any wall clock
    assert st["failures"]["exposure_s"] == pytest.approx(71.0)
    assert st["costs"]["durable_blocking_s"] == pytest.approx(1.5)
    assert st["failures"]["mttf_s"] == pytest.approx(mixture_mttf(40.0, 0, 71.0))


@pytest.mark.parametrize("wall_step", [34.0, -34.0], ids=["forward", "back"])
def test_a_restart_is_measured_on_the_monotonic_clock(tmp_path: Path, wall_step: float) -> None:
    clocks = Clocks()
    first = _pilot(tmp_path / "run", clocks, age_s=1.0)
    _train_and_save(first, clocks, 3)
    clocks.advance(4.0)  # killed 4 s after its last save; the next process starts at once
    second = _pilot(tmp_path / "run", clocks, age_s=3.0)  # 3 s of start before the Checkpointer
    resume_started = clocks.mono()
    clocks.advance(1.0)
    clocks.step(wall_step)  # the VM stalls in the middle of the restore
    clocks.advance(1.0)
    second.resumed(resume_started, 30, None, False)
    st = second.stats()
    assert st["failures"]["interruptions"] == 1
    # restart: 3 s + the 2 s restore, whatever the wall clock did
    assert st["costs"]["restart_s"] == pytest.approx(5.0)
    assert st["costs"]["store_restore_s"] == pytest.approx(2.0)
    # exposure: the first 35.5 s (1 + 3 × 11.5) and the gap to the next start (counted up
    # to half an interval: the kill came 4 s after its last sign of life, the next start
    # followed at once, 3 s before the Checkpointer), then the second's 5 s
    exposure = st["failures"]["exposure_s"]
    assert 35.5 + 5.0 <= exposure <= 35.5 + 5.0 + st["interval"]["every_s"] / 2 + 1e-6


def test_a_start_before_the_last_sign_of_life_is_clamped_and_warned(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """The wall clock stepped back 1,000 s between two processes: the gap is clamped at 0
    (no negative exposure, no absurd interval) and a WARNING says why."""
    clocks = Clocks()
    first = _pilot(tmp_path / "run", clocks, age_s=1.0)
    _train_and_save(first, clocks, 4)
    clocks.step(-1000.0)
    caplog.set_level(logging.WARNING)
    second = _pilot(tmp_path / "run", clocks, age_s=0.5)
    _train_and_save(second, clocks, 2)
    st = second.stats()
    assert any("last seen" in r.message for r in caplog.records)
    assert st["failures"]["interruptions"] == 1
    assert st["failures"]["exposure_s"] == pytest.approx(1.0 + 4 * 11.5 + 2 * 11.5, abs=0.51)
    assert 0.5 <= st["interval"]["every_s"] <= 60.0


def test_a_launchers_start_from_another_clock_is_bounded(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """``started_at`` is another process's wall clock: a start in the future or days ago is
    clamped to [0, 1 h] with a WARNING, never an absurd restart cost."""
    clocks = Clocks()
    caplog.set_level(logging.WARNING)
    ahead = _pilot(tmp_path / "a", clocks, started=T0 + 50.0)
    ahead.resumed(clocks.mono(), 1, None, False)
    assert ahead.stats()["costs"]["restart_s"] == pytest.approx(0.0)
    days = _pilot(tmp_path / "b", clocks, started=T0 - 5 * 86400.0)
    days.resumed(clocks.mono(), 1, None, False)
    assert days.stats()["costs"]["restart_s"] == pytest.approx(3600.0)
    assert sum("outside [0, 3.6e+03] s" in r.message for r in caplog.records) == 2


def test_the_construction_does_not_wait_for_the_store(tmp_path: Path) -> None:
    """The construction's read of the record and its write of this incarnation run on a
    thread of their own (a restart's ``load_latest`` overlaps them): ``begin`` returns while
    the read is held up, and the record still says what it would have at the construction's
    instant, whenever the read ran."""
    clocks, run = Clocks(), tmp_path / "run"
    first = _pilot(run, clocks, age_s=1.0)
    _train_and_save(first, clocks, 3)
    first.flush()
    held, release = threading.Event(), threading.Event()

    def hold() -> None:  # as a write of this root in flight would
        with record_writes().turn(str(run)):
            held.set()
            assert release.wait(30.0)

    holder = threading.Thread(target=hold)
    holder.start()
    assert held.wait(30.0)
    clocks.advance(4.0)
    second = _pilot(run, clocks, settle=False, age_s=2.0)  # returns with its read held up
    assert len(json.loads((run / RECORD_NAME).read_bytes())["incarnations"]) == 1
    clocks.advance(50.0)  # the read runs 50 s later
    release.set()
    holder.join(30.0)
    second.flush()
    doc = json.loads((run / RECORD_NAME).read_bytes())
    assert len(doc["incarnations"]) == 2
    inc = doc["incarnations"][-1]
    assert inc["last_seen"] - inc["started"] == pytest.approx(2.0)  # as of the construction
    assert second.stats()["failures"]["interruptions"] == 1
