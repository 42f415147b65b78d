"""``dcp-volumes plan --from-run ROOT``: the plan from a run record on a local directory, through
the real entry point. The record is written here with known figures; expected values are the
closed forms."""

from __future__ import annotations

import json
import math
import time
from pathlib import Path

import pytest
from _cli import run_cli as _run
from _goodput_oracle import mixture_mttf

from dcp_volumes.goodput import (
    Incarnation,
    RestoreSample,
    RunRecord,
    SaveSample,
    record_root,
    write_run_record,
)
from dcp_volumes.goodput._record import RECORD_NAME

T0 = time.time() - 86400.0  # a day ago: a record's times are never in the future


@pytest.fixture
def run_root(tmp_path: Path) -> str:
    """A run of 4 GPUs: 4 durable saves blocking 2 s (uploads 0), resumes 30 s to training,
    3 interruptions over 3 × 100 s + the running incarnation's 100 s (each resume and save
    within its incarnation, as a run writes them)."""
    from dcp_volumes.backends import open_backend

    root = str(tmp_path / "run")
    (tmp_path / "run").mkdir()
    record = RunRecord(root=record_root(open_backend(root, {})), gpus=4)
    for i in range(4):
        record.add_save(SaveSample("durable", 2.0, 0.0, 1 << 20, T0 + 1000 * i + 50))
        record.add_restore(RestoreSample(10.0, 30.0, "store", T0 + 1000 * i + 40))
    for i in range(4):  # each seen 100 s after its start, with a 0 s interval: dies then
        record.add_incarnation(Incarnation(T0 + 1000 * i, T0 + 1000 * i + 100, interval_s=0.0))
    assert write_run_record(root, {}, None, record)
    return root


def test_from_run_with_a_prior(run_root: str) -> None:
    # prior: 1 failure every 1 h on the job's 4 GPUs, M0 = 3600 s, half weighing 4 and half
    # 0.25; 3 interruptions in 400 s contradict it: the light half's estimate, nearly
    proc = _run("plan", "--from-run", run_root, "--fleet-mtbf-hours", "1", "--fleet-gpus", "4",
                "--json")
    assert proc.returncode == 0, proc.stderr
    doc = json.loads(proc.stdout)
    m = mixture_mttf(3600.0, 3, 400.0)
    assert m == pytest.approx((0.25 * 3600 + 400) / (0.25 + 3), rel=0.15)
    assert doc["mttf_hours"] == pytest.approx(m / 3600)
    assert doc["checkpoint_cost_s"] == 2.0
    assert doc["restart_cost_s"] == 30.0
    assert doc["optimum"]["interval_s"] == pytest.approx(math.sqrt(2 * 2.0 * m))
    run = doc["run"]
    assert run["gpus"] == 4
    assert run["failures"]["interruptions"] == 3
    assert run["failures"]["exposure_s"] == pytest.approx(400.0)
    assert run["failures"]["prior"]["source"].startswith("given: 4 GPUs, fleet")
    assert run["auto"]["every_s"] == pytest.approx(math.sqrt(2 * 2.0 * m) + 2.0)


def test_from_run_table_with_the_default_prior(run_root: str) -> None:
    proc = _run("plan", "--from-run", run_root)
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout
    assert "default: Llama 3" in out and "3 interruption(s) in 6m 40s" in out
    assert "Young optimum" in out and "autopilot" in out


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--checkpoint-cost-s", "5"], "does not apply with --from-run"),
        (["--restart-cost-s", "5"], "does not apply with --from-run"),
    ],
    ids=["cost", "restart"],
)
def test_from_run_refuses_given_costs(run_root: str, extra: list[str], message: str) -> None:
    proc = _run("plan", "--from-run", run_root, *extra)
    assert proc.returncode == 2 and message in proc.stderr


def test_from_run_without_a_record(tmp_path: Path) -> None:
    proc = _run("plan", "--from-run", str(tmp_path))
    assert proc.returncode == 2 and "no usable run record" in proc.stderr


def test_from_run_damaged_record(run_root: str) -> None:
    Path(run_root, RECORD_NAME).write_bytes(b"{" * 1000)
    proc = _run("plan", "--from-run", run_root)
    assert proc.returncode == 2 and "no usable run record" in proc.stderr
    assert "ignored (not JSON)" in proc.stderr  # the WARNING says why


def test_plan_still_needs_gpus_without_a_run() -> None:
    proc = _run("plan", "--afr", "0.1", "--checkpoint-cost-s", "60")
    assert proc.returncode == 2 and "--gpus" in proc.stderr
