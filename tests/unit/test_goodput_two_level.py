"""The two-level (local tier + store) goodput model and `dcp-volumes plan --local-save-s`.

Expected values are closed forms written out here, never computed by the code under test.
"""

from __future__ import annotations

import json
import math
import re
import subprocess

import pytest
from _cli import run_cli

from dcp_volumes.errors import ConfigError
from dcp_volumes.goodput import (
    FailureModel,
    TierCosts,
    expected_goodput,
    plan_two_level,
    young_interval_s,
)
from dcp_volumes.goodput._two_level import (
    expected_loss_per_failure_s,
    two_level_goodput,
    two_level_intervals_s,
)

# 1024 GPUs, one failure every 3 h on 16 384 GPUs: M = 3·16384/1024 h = 48 h = 172 800 s.
M_S = 48 * 3600.0
MODEL = FailureModel.from_fleet(mtbf_hours=3, fleet_gpus=16384, gpus=1024)


def _costs(**kw: float) -> TierCosts:
    base: dict[str, float] = {
        "local_save_s": 2.0,
        "remote_save_s": 30.0,
        "local_survives": 0.8,
        "local_restore_s": 20.0,
        "remote_restore_s": 120.0,
        "restart_s": 600.0,
    }
    base.update(kw)
    return TierCosts(**base)


def test_intervals_are_young_per_tier() -> None:
    tl, tr = two_level_intervals_s(costs=_costs(), mttf_s=M_S)
    assert tl == pytest.approx(math.sqrt(2 * 2.0 * M_S / 0.8))  # 929.5 s
    assert tr == pytest.approx(math.sqrt(2 * 28.0 * M_S / 0.2))  # 6955.8 s
    assert tl < tr


def test_goodput_closed_form() -> None:
    # τ_L = 600, τ_R = 3600: c = 2/600 + 28/3600 = 0.0111…; loss =
    # 0.8·(600 + 20 + 1.0111·300) + 0.2·(600 + 120 + 1.0111·1800)
    c = 2 / 600 + 28 / 3600
    loss = 0.8 * (620 + (1 + c) * 300) + 0.2 * (720 + (1 + c) * 1800)
    assert expected_loss_per_failure_s(600, 3600, costs=_costs()) == pytest.approx(loss)
    g = two_level_goodput(600, 3600, costs=_costs(), mttf_s=M_S)
    assert g == pytest.approx((1 - loss / M_S) / (1 + c))


@pytest.mark.parametrize("tau", [600.0, 3600.0, 7200.0], ids=["10m", "1h", "2h"])
def test_reduces_to_one_level_without_local_survival(tau: float) -> None:
    costs = _costs(local_survives=0.0, remote_complete_s=50.0)
    one = expected_goodput(
        tau, checkpoint_cost_s=30.0, mttf_s=M_S, restart_cost_s=600.0 + 120.0 + 50.0
    )
    assert two_level_goodput(tau, tau, costs=costs, mttf_s=M_S) == pytest.approx(one)
    tl, tr = two_level_intervals_s(costs=costs, mttf_s=M_S)
    assert tl == tr == pytest.approx(young_interval_s(checkpoint_cost_s=30.0, mttf_s=M_S))


def test_local_saves_not_cheaper_means_every_save_durable() -> None:
    tl, tr = two_level_intervals_s(costs=_costs(local_save_s=30.0), mttf_s=M_S)
    assert tl == tr == pytest.approx(math.sqrt(2 * 30.0 * M_S))
    plan = plan_two_level(MODEL, costs=_costs(local_save_s=30.0))
    assert any("do not pay" in w for w in plan.warnings)


def test_no_failures_gives_infinite_intervals() -> None:
    assert two_level_intervals_s(costs=_costs(), mttf_s=math.inf) == (math.inf, math.inf)
    # overhead only: c = 2/600 + 28/3600
    g = two_level_goodput(600, 3600, costs=_costs(), mttf_s=math.inf)
    assert g == pytest.approx(1 / (1 + 2 / 600 + 28 / 3600))


@pytest.mark.parametrize(
    "kw",
    [
        {},
        {"local_survives": 0.5},
        {"local_survives": 0.95, "local_save_s": 0.4, "remote_save_s": 5.2},
        {"local_survives": 0.2, "remote_complete_s": 60.0},
    ],
    ids=["p0.8", "p0.5", "p0.95-measured", "p0.2-async"],
)
def test_recommended_intervals_are_minima(kw: dict[str, float]) -> None:
    costs = _costs(**kw)
    tl, tr = two_level_intervals_s(costs=costs, mttf_s=M_S)
    best = two_level_goodput(tl, tr, costs=costs, mttf_s=M_S)
    for fl, fr in [(0.9, 1), (1.1, 1), (1, 0.9), (1, 1.1), (0.9, 0.9), (1.1, 1.1), (0.9, 1.1)]:
        ntl, ntr = tl * fl, tr * fr
        if ntl <= ntr:
            assert two_level_goodput(ntl, ntr, costs=costs, mttf_s=M_S) <= best, (fl, fr)
    # and two tiers beat every save durable at its own optimum
    one = young_interval_s(checkpoint_cost_s=costs.remote_save_s, mttf_s=M_S)
    assert best > two_level_goodput(one, one, costs=costs, mttf_s=M_S)


def test_goodput_rises_with_local_survival() -> None:
    shares = [0.0, 0.2, 0.5, 0.8, 0.95]
    gs = []
    for p in shares:
        costs = _costs(local_survives=p)
        tl, tr = two_level_intervals_s(costs=costs, mttf_s=M_S)
        gs.append(two_level_goodput(tl, tr, costs=costs, mttf_s=M_S))
    assert gs == sorted(gs) and gs[0] < gs[-1]


def test_goodput_falls_with_job_size_and_costs() -> None:
    def best(gpus: int, **kw: float) -> float:
        model = FailureModel.from_fleet(mtbf_hours=3, fleet_gpus=16384, gpus=gpus)
        return plan_two_level(model, costs=_costs(**kw)).row("two-tier").goodput

    assert best(256) > best(1024) > best(4096)
    assert best(1024, local_save_s=1.0) > best(1024) > best(1024, local_save_s=5.0)
    assert best(1024, local_restore_s=0.0) > best(1024) > best(1024, local_restore_s=200.0)
    # the lost GPU-hours per interval grow with the remote interval
    c = _costs()
    assert two_level_goodput(600, 3600, costs=c, mttf_s=M_S) > two_level_goodput(
        600, 36000, costs=c, mttf_s=M_S
    )


def test_plan_rows_and_gpu_hours() -> None:
    plan = plan_two_level(MODEL, costs=_costs(), job_hours=720, given=(600, 3600))
    assert [r.name for r in plan.rows] == ["remote-only", "two-tier", "given"]
    ro, two, given = plan.rows
    t1 = math.sqrt(2 * 30.0 * M_S)
    assert ro.local_interval_s is None and ro.remote_interval_s == pytest.approx(t1)
    # remote-only: every failure restarts from the store, R + L_R = 720
    assert ro.goodput == pytest.approx(
        expected_goodput(t1, checkpoint_cost_s=30.0, mttf_s=M_S, restart_cost_s=720.0)
    )
    assert ro.overhead == pytest.approx(30.0 / (t1 + 30.0))
    assert two.goodput > ro.goodput and two.goodput > given.goodput
    for r in plan.rows:
        assert r.lost_gpu_hours_per_day == pytest.approx(1024 * 24 * (1 - r.goodput))
        assert r.lost_gpu_hours == pytest.approx(1024 * 720 * (1 - r.goodput))
    doc = json.loads(json.dumps(plan.to_dict(), allow_nan=False))
    assert doc["model"] == "two-level" and doc["rows"][2]["local_interval_s"] == 600


@pytest.mark.parametrize(
    ("kw", "match"),
    [
        ({"local_survives": 1.0}, r"in \[0, 1\)"),
        ({"local_survives": -0.1}, "must be >= 0"),
        ({"local_save_s": 0.0}, "local_save_s must be > 0"),
        ({"remote_save_s": math.nan}, "NaN"),
        ({"local_restore_s": -1.0}, "local_restore_s must be >= 0"),
        ({"restart_s": math.inf}, "restart_s must be finite"),
    ],
    ids=["p=1", "p<0", "zero-local-save", "nan-remote", "negative-restore", "inf-restart"],
)
def test_invalid_costs(kw: dict[str, float], match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        _costs(**kw)


def test_invalid_intervals() -> None:
    with pytest.raises(ConfigError, match="longer than remote_interval_s"):
        two_level_goodput(7200, 3600, costs=_costs(), mttf_s=M_S)
    with pytest.raises(ConfigError, match="local_interval_s must be > 0"):
        two_level_goodput(0, 3600, costs=_costs(), mttf_s=M_S)
    with pytest.raises(ConfigError, match="failure rate is zero"):
        plan_two_level(FailureModel(gpus=8, afr=0.0), costs=_costs())
    with pytest.raises(ConfigError, match="TierCosts"):
        plan_two_level(MODEL, costs={"local_save_s": 1})  # type: ignore[arg-type]


# --------------------------------------------------------------------------------------------
# CLI

_BASE = [
    "plan",
    "--gpus",
    "1024",
    "--fleet-mtbf-hours",
    "3",
    "--fleet-gpus",
    "16384",
    "--checkpoint-cost-s",
    "30",
    "--restart-cost-s",
    "600",
]
_TIERS = [
    "--local-save-s",
    "2",
    "--local-survives",
    "0.8",
    "--local-restore-s",
    "20",
    "--remote-restore-s",
    "120",
]


def _run(*args: str) -> subprocess.CompletedProcess[str]:
    return run_cli(*args, env={"COLUMNS": "160", "PATH": "/usr/bin:/bin"}, clean_env=True)


def test_cli_two_tier_json() -> None:
    proc = _run(
        *_BASE,
        *_TIERS,
        "--job-hours",
        "720",
        "--local-every",
        "10m",
        "--remote-every",
        "1h",
        "--json",
    )
    assert proc.returncode == 0, proc.stderr
    doc = json.loads(proc.stdout)
    names = [r["name"] for r in doc["rows"]]
    assert names == ["remote-only", "two-tier", "given"]
    assert doc["rows"][1]["local_interval_s"] == pytest.approx(math.sqrt(2 * 2.0 * M_S / 0.8))
    assert doc["rows"][2]["goodput"] == pytest.approx(
        two_level_goodput(600, 3600, costs=_costs(), mttf_s=M_S)
    )
    assert doc["costs"]["restart_s"] == 600 and doc["remote_save_source"] == "given"


def test_cli_two_tier_table() -> None:
    proc = _run(*_BASE, *_TIERS)
    assert proc.returncode == 0, proc.stderr
    assert "remote-only" in proc.stdout and "two-tier" in proc.stdout
    assert "15m 30s" in proc.stdout  # τ_L = √(2·2·172800/0.8) = 929.5 s
    assert "1h 56m" in proc.stdout  # τ_R = √(2·28·172800/0.2) = 6955.8 s


@pytest.mark.parametrize(
    ("extra", "match"),
    [
        (["--local-save-s", "2"], "give --local-survives"),
        ([*_TIERS, "--local-every", "10m"], "go together"),
        ([*_TIERS, "--daly"], "--daly does not apply"),
        ([*_TIERS, "--intervals", "1h"], "--intervals does not apply"),
        (["--local-survives", "0.8"], "only apply with --local-save-s"),
        ([*_TIERS[:2], "--local-survives", "1"], r"in \[0, 1\)"),
        ([*_TIERS, "--local-every", "2h", "--remote-every", "1h"], "longer than"),
    ],
    ids=["no-share", "lone-every", "daly", "intervals", "share-alone", "share-1", "bad-pair"],
)
def test_cli_two_tier_errors(extra: list[str], match: str) -> None:
    proc = _run(*_BASE, *extra)
    assert proc.returncode == 2, proc.stdout
    assert re.search(match, proc.stderr), proc.stderr
