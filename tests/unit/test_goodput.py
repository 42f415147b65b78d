"""Failure/interval model and the `dcp-volumes plan` command.

Expected values are closed forms written out here, never computed by the code under test.
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import pytest
from _cli import run_cli as _run

from dcp_volumes import cli
from dcp_volumes.bench.costs import checkpoint_cost_from_bench
from dcp_volumes.cli.plan import plot_goodput
from dcp_volumes.errors import ConfigError, DCPVolumesError
from dcp_volumes.goodput import (
    DEFAULT_INTERVALS_S,
    FailureModel,
    Plan,
    daly_interval_s,
    expected_goodput,
    expected_rework_s,
    format_duration,
    interruption_probability,
    parse_duration_s,
    plan_intervals,
    young_interval_s,
)

HOUR = 3600.0

# The running example: AFR 10 %/GPU-year on 1000 GPUs.
# M = 8760 h / (0.1 · 1000) = 87.6 h = 315 360 s.
M_HOURS = 87.6
M_S = 87.6 * 3600.0
DELTA = 60.0
RESTART = 600.0


# --------------------------------------------------------------------------------------------
# Failure model


def test_afr_scales_to_job_mttf() -> None:
    fm = FailureModel.from_afr(0.1, gpus=1000)
    assert fm.gpu_hours_per_failure == pytest.approx(87_600.0)
    assert fm.mttf_hours == pytest.approx(M_HOURS)
    assert fm.mttf_s == pytest.approx(315_360.0)
    assert fm.failures_per_hour == pytest.approx(1 / 87.6)


def test_fleet_scales_to_job_mttf() -> None:
    # One failure every 3 h across 16 384 GPUs is 49 152 GPU-hours per failure; a job on
    # 4 096 of them fails every 49 152 / 4 096 = 12 h.
    fm = FailureModel.from_fleet(mtbf_hours=3.0, fleet_gpus=16_384, gpus=4_096)
    assert fm.gpu_hours_per_failure == pytest.approx(49_152.0)
    assert fm.mttf_hours == pytest.approx(12.0)


def test_afr_and_fleet_agree() -> None:
    # AFR 0.1 is one failure per 87 600 GPU-hours: a 1000-GPU fleet sees one every 87.6 h.
    by_afr = FailureModel(gpus=250, afr=0.1)
    by_fleet = FailureModel(gpus=250, fleet_mtbf_hours=87.6, fleet_gpus=1000)
    assert by_afr.mttf_hours == pytest.approx(by_fleet.mttf_hours) == pytest.approx(350.4)


@pytest.mark.parametrize(
    "model",
    [
        pytest.param(FailureModel(gpus=8, afr=0.0), id="afr-zero"),
        pytest.param(
            FailureModel(gpus=8, fleet_mtbf_hours=math.inf, fleet_gpus=100), id="fleet-inf"
        ),
    ],
)
def test_zero_failure_rate_is_infinite_mttf(model: FailureModel) -> None:
    assert math.isinf(model.mttf_hours)
    assert model.failures_per_hour == 0.0
    assert model.to_dict()["mttf_hours"] is None


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        pytest.param({"gpus": 0, "afr": 0.1}, "gpus must be at least 1", id="zero-gpus"),
        pytest.param({"gpus": -4, "afr": 0.1}, "gpus must be at least 1", id="negative-gpus"),
        pytest.param({"gpus": 1.5, "afr": 0.1}, "whole number", id="fractional-gpus"),
        pytest.param({"gpus": True, "afr": 0.1}, "whole number", id="bool-gpus"),
        pytest.param({"gpus": 8, "afr": -0.1}, "afr must be >= 0", id="negative-afr"),
        pytest.param({"gpus": 8, "afr": math.nan}, "afr is NaN", id="nan-afr"),
        pytest.param({"gpus": 8, "afr": math.inf}, "afr must be finite", id="inf-afr"),
        pytest.param({"gpus": 8, "afr": 5}, "did you mean 0.05", id="afr-as-percent"),
        pytest.param({"gpus": 8, "afr": "0.1"}, "afr must be a number", id="string-afr"),
        pytest.param({"gpus": 8}, "give a failure rate", id="no-rate"),
        pytest.param(
            {"gpus": 8, "afr": 0.1, "fleet_mtbf_hours": 3, "fleet_gpus": 100},
            "not both",
            id="afr-and-fleet",
        ),
        pytest.param(
            {"gpus": 8, "fleet_mtbf_hours": 3}, "also pass fleet_gpus", id="fleet-no-gpus"
        ),
        pytest.param(
            {"gpus": 8, "fleet_gpus": 100}, "also pass fleet_mtbf_hours", id="fleet-no-mtbf"
        ),
        pytest.param(
            {"gpus": 8, "fleet_mtbf_hours": 0, "fleet_gpus": 100},
            "fleet_mtbf_hours must be > 0",
            id="fleet-mtbf-zero",
        ),
        pytest.param(
            {"gpus": 8, "fleet_mtbf_hours": 3, "fleet_gpus": 0},
            "fleet_gpus must be at least 1",
            id="fleet-gpus-zero",
        ),
    ],
)
def test_invalid_failure_model(kwargs: dict[str, object], match: str) -> None:
    with pytest.raises(ConfigError, match=match) as info:
        FailureModel(**kwargs)  # type: ignore[arg-type]
    # ConfigError is catchable as both the package root and the builtin.
    assert isinstance(info.value, DCPVolumesError)
    assert isinstance(info.value, ValueError)


def test_failure_model_is_frozen() -> None:
    fm = FailureModel(gpus=8, afr=0.1)
    with pytest.raises(AttributeError):
        fm.gpus = 16  # type: ignore[misc]


# --------------------------------------------------------------------------------------------
# Formulas


@pytest.mark.parametrize(
    ("duration_s", "mttf_s", "expected"),
    [
        # 720 h / 87.6 h = 8.2192 expected failures: 1 − e^(−8.2192) = 0.999 730 56
        pytest.param(720 * HOUR, M_S, 1 - math.exp(-720 / 87.6), id="month-on-1000-gpus"),
        pytest.param(M_S, M_S, 1 - 1 / math.e, id="one-mttf"),
        pytest.param(0.0, M_S, 0.0, id="zero-duration"),
        pytest.param(720 * HOUR, math.inf, 0.0, id="no-failures"),
        pytest.param(math.inf, M_S, 1.0, id="forever"),
    ],
)
def test_interruption_probability(duration_s: float, mttf_s: float, expected: float) -> None:
    assert interruption_probability(duration_s=duration_s, mttf_s=mttf_s) == pytest.approx(expected)
    if duration_s == 720 * HOUR and math.isfinite(mttf_s):
        assert expected == pytest.approx(0.99973056, abs=1e-8)


def test_expected_rework_is_half_interval_plus_restart() -> None:
    assert expected_rework_s(3600.0, restart_cost_s=600.0) == 1800.0 + 600.0
    assert expected_rework_s(300.0) == 150.0


def test_young_interval() -> None:
    # τ = √(2 · 60 s · 315 360 s) = √37 843 200 s² = 6151.68 s ≈ 1 h 42.5 m
    tau = young_interval_s(checkpoint_cost_s=DELTA, mttf_s=M_S)
    assert tau == pytest.approx(math.sqrt(37_843_200.0))
    assert tau == pytest.approx(6151.6827, abs=1e-3)


def test_daly_interval() -> None:
    # x = δ/(2M) = 60 / 630 720;  τ = √(2δM)·(1 + √x/3 + x/9) − δ = 6111.75 s
    x = 60.0 / 630_720.0
    expected = math.sqrt(37_843_200.0) * (1 + math.sqrt(x) / 3 + x / 9) - 60.0
    tau = daly_interval_s(checkpoint_cost_s=DELTA, mttf_s=M_S)
    assert tau == pytest.approx(expected)
    assert tau == pytest.approx(6111.7477, abs=1e-3)


def test_daly_sits_two_thirds_delta_below_young_when_delta_is_small() -> None:
    # √(2δM)·(1/3)·√(δ/2M) = δ/3, so Daly − Young = δ/3 − δ + O(δ^1.5/M^0.5) ≈ −2δ/3.
    young = young_interval_s(checkpoint_cost_s=DELTA, mttf_s=M_S)
    daly = daly_interval_s(checkpoint_cost_s=DELTA, mttf_s=M_S)
    assert young - daly == pytest.approx(2 * DELTA / 3, rel=0.01)


@pytest.mark.parametrize(
    ("delta", "mttf"),
    [
        pytest.param(100.0, 50.0, id="delta-twice-mttf"),
        pytest.param(100.0, 50.0 - 1e-9, id="delta-above-twice-mttf"),
        pytest.param(1e6, 10.0, id="delta-far-above"),
    ],
)
def test_daly_falls_back_to_mttf_when_delta_at_least_2m(delta: float, mttf: float) -> None:
    assert daly_interval_s(checkpoint_cost_s=delta, mttf_s=mttf) == mttf


def test_optima_are_infinite_without_failures() -> None:
    assert math.isinf(young_interval_s(checkpoint_cost_s=DELTA, mttf_s=math.inf))
    assert math.isinf(daly_interval_s(checkpoint_cost_s=DELTA, mttf_s=math.inf))


def test_goodput_at_one_hour() -> None:
    # τ/(τ+δ) · (1 − (R + (τ+δ)/2)/M) = 3600/3660 · (1 − (600 + 1830)/315 360) = 0.976 027
    g = expected_goodput(3600.0, checkpoint_cost_s=DELTA, mttf_s=M_S, restart_cost_s=RESTART)
    assert g == pytest.approx(3600 / 3660 * (1 - 2430 / 315_360))
    assert g == pytest.approx(0.9760274, abs=1e-7)


def test_goodput_without_failures_is_checkpoint_overhead_only() -> None:
    g = expected_goodput(600.0, checkpoint_cost_s=30.0, mttf_s=math.inf, restart_cost_s=RESTART)
    assert g == pytest.approx(600 / 630)


def test_goodput_clips_at_zero() -> None:
    # Rework per failure (R + (τ+δ)/2 = 2430 s) exceeds M = 1000 s: no progress at all.
    g = expected_goodput(3600.0, checkpoint_cost_s=DELTA, mttf_s=1000.0, restart_cost_s=RESTART)
    assert g == 0.0


def test_goodput_peaks_at_young_when_delta_is_small() -> None:
    # First order, G ≈ 1 − δ/τ − τ/(2M), whose maximum is at τ = √(2δM).
    grid = [3000.0 * 1.0005**i for i in range(3000)]
    best = max(grid, key=lambda t: expected_goodput(t, checkpoint_cost_s=DELTA, mttf_s=M_S))
    assert best == pytest.approx(math.sqrt(2 * DELTA * M_S), rel=0.01)


@pytest.mark.parametrize(
    ("call", "match"),
    [
        pytest.param(
            lambda: expected_goodput(0.0, checkpoint_cost_s=1, mttf_s=M_S),
            "interval_s must be > 0",
            id="goodput-zero-interval",
        ),
        pytest.param(
            lambda: expected_goodput(60.0, checkpoint_cost_s=-1, mttf_s=M_S),
            "checkpoint_cost_s must be >= 0",
            id="goodput-negative-delta",
        ),
        pytest.param(
            lambda: expected_goodput(60.0, checkpoint_cost_s=1, mttf_s=math.nan),
            "mttf_s is NaN",
            id="goodput-nan-mttf",
        ),
        pytest.param(
            lambda: expected_goodput(60.0, checkpoint_cost_s=1, mttf_s=M_S, restart_cost_s=-5),
            "restart_cost_s must be >= 0",
            id="goodput-negative-restart",
        ),
        pytest.param(
            lambda: young_interval_s(checkpoint_cost_s=0.0, mttf_s=M_S),
            "checkpoint_cost_s must be > 0",
            id="young-zero-delta",
        ),
        pytest.param(
            lambda: daly_interval_s(checkpoint_cost_s=60.0, mttf_s=0.0),
            "mttf_s must be > 0",
            id="daly-zero-mttf",
        ),
        pytest.param(
            lambda: interruption_probability(duration_s=-1.0, mttf_s=M_S),
            "duration_s must be >= 0",
            id="negative-duration",
        ),
        pytest.param(
            lambda: expected_rework_s(math.inf),
            "interval_s must be finite",
            id="infinite-interval",
        ),
    ],
)
def test_invalid_formula_inputs(call: object, match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        call()  # type: ignore[operator]


# --------------------------------------------------------------------------------------------
# Plan


def _plan(**kwargs: object) -> Plan:
    kwargs.setdefault("checkpoint_cost_s", DELTA)
    kwargs.setdefault("restart_cost_s", RESTART)
    model = kwargs.pop("model", FailureModel(gpus=1000, afr=0.1))
    return plan_intervals(model, **kwargs)  # type: ignore[arg-type]


def test_default_candidate_intervals() -> None:
    minutes = [5, 10, 15, 30, 60, 120, 240, 480, 720, 1440]
    assert list(DEFAULT_INTERVALS_S) == [m * 60.0 for m in minutes]
    plan = _plan()
    assert [r.interval_s for r in plan.rows] == [m * 60.0 for m in minutes]
    assert all(r.kind == "candidate" for r in plan.rows)


def test_plan_rows_and_optimum() -> None:
    plan = _plan(job_hours=720.0, intervals_s=[7200.0, 3600.0, 3600.0])
    assert [r.interval_s for r in plan.rows] == [3600.0, 7200.0]  # sorted, deduplicated
    one_hour = plan.rows[0]
    assert one_hour.goodput == pytest.approx(0.9760274, abs=1e-7)
    assert one_hour.overhead == pytest.approx(60 / 3660)
    assert one_hour.rework_s == 1800.0 + 600.0
    assert one_hour.lost_hours == pytest.approx(720 * (1 - one_hour.goodput))
    assert one_hour.first_order_ok  # 3660 s ≤ 31 536 s = M/10

    assert plan.mttf_hours == pytest.approx(M_HOURS)
    assert plan.interruption_probability == pytest.approx(1 - math.exp(-720 / 87.6))
    assert plan.expected_failures == pytest.approx(720 / 87.6)
    assert plan.method == "young"
    assert plan.optimum is plan.young
    assert plan.young is not None and plan.daly is not None
    assert plan.young.interval_s == pytest.approx(6151.6827, abs=1e-3)
    assert plan.daly.interval_s == pytest.approx(6111.7477, abs=1e-3)
    # The optimum beats every candidate.
    assert all(plan.young.goodput >= r.goodput for r in plan.rows)
    assert plan.warnings == ()


def test_plan_daly_method() -> None:
    plan = _plan(method="daly")
    assert plan.optimum is plan.daly
    assert plan.to_dict()["optimum"]["kind"] == "daly"


def test_plan_flags_rows_beyond_first_order() -> None:
    # M/10 = 8.76 h: the 12 h and 24 h candidates are past the model's range.
    plan = _plan()
    beyond = [r.interval_s / HOUR for r in plan.rows if not r.first_order_ok]
    assert beyond == [12.0, 24.0]
    assert any("12h, 1d" in w and "first-order" in w for w in plan.warnings)


def test_plan_without_failures() -> None:
    plan = _plan(model=FailureModel(gpus=8, afr=0.0), job_hours=100.0)
    assert plan.optimum is None and plan.young is None and plan.daly is None
    assert plan.interruption_probability == 0.0
    assert plan.expected_failures == 0.0
    for row in plan.rows:
        assert row.goodput == pytest.approx(row.interval_s / (row.interval_s + DELTA))
        assert row.first_order_ok  # any finite τ+δ is ≪ an infinite M
    assert any("failure rate is zero" in w for w in plan.warnings)
    # Infinities must not leak into JSON.
    doc = json.loads(json.dumps(plan.to_dict(), allow_nan=False))
    assert doc["mttf_hours"] is None and doc["optimum"] is None


def test_plan_when_checkpoint_costs_more_than_twice_mttf() -> None:
    # 100 000 GPUs at AFR 0.5: M = 8760/(0.5·100 000) h = 0.1752 h = 630.72 s; δ = 1800 s ≥ 2M.
    model = FailureModel(gpus=100_000, afr=0.5)
    plan = _plan(model=model, checkpoint_cost_s=1800.0, restart_cost_s=0.0)
    assert plan.daly is not None
    assert plan.daly.interval_s == pytest.approx(630.72)
    assert plan.daly.goodput == 0.0
    assert any("at least twice the job MTTF" in w for w in plan.warnings)
    assert any("goodput is 0 at every candidate" in w for w in plan.warnings)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        pytest.param({"checkpoint_cost_s": 0.0}, "checkpoint_cost_s must be > 0", id="zero-delta"),
        pytest.param({"checkpoint_cost_s": math.nan}, "checkpoint_cost_s is NaN", id="nan-delta"),
        pytest.param({"restart_cost_s": -1.0}, "restart_cost_s must be >= 0", id="neg-restart"),
        pytest.param({"job_hours": 0.0}, "job_hours must be > 0", id="zero-job-hours"),
        pytest.param({"intervals_s": []}, "intervals_s is empty", id="no-intervals"),
        pytest.param({"intervals_s": [60.0, -5.0]}, "intervals_s must be > 0", id="neg-interval"),
        pytest.param({"method": "optimal"}, "method must be 'young' or 'daly'", id="bad-method"),
        pytest.param({"model": 0.05}, "must be a FailureModel", id="afr-instead-of-model"),
    ],
)
def test_invalid_plan_inputs(kwargs: dict[str, object], match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        _plan(**kwargs)


def test_plot_writes_png(tmp_path: Path) -> None:
    for name, model in [
        ("failing", FailureModel(gpus=1000, afr=0.1)),
        ("no-failures", FailureModel(gpus=8, afr=0.0)),
    ]:
        out = plot_goodput(_plan(model=model), tmp_path / f"{name}.png")
        data = out.read_bytes()
        assert data.startswith(b"\x89PNG\r\n\x1a\n"), name
        assert len(data) > 10_000, name


# --------------------------------------------------------------------------------------------
# Bench-file reader

_BENCH = """\
| contender | save_s |
|---|---|
# a comment

not json at all
{"contender": "dcp_volumes", "save_s": 10.0, "async_block_s": 1.0}
{"contender": "dcp_volumes", "save_s": 30.0, "async_block_s": 3.0}
{"contender": "dcp_volumes", "save_s": 20.0, "async_block_s": 2.0}
{"contender": "filesystem", "save_s": 40.0}
{"contender": "filesystem", "save_s": 50.0}
{"contender": "filesystem", "save_s": "n/a"}
{"contender": "filesystem", "save_s": true}
{"contender": "filesystem", "save_s": NaN}
{"contender": "filesystem", "save_s": -3}
{"contender": "broken", "save_s": 
[1, 2, 3]
"""


@pytest.fixture
def bench_file(tmp_path: Path) -> Path:
    path = tmp_path / "bench.jsonl"
    path.write_text(_BENCH, encoding="utf-8")
    return path


@pytest.mark.parametrize(
    ("contender", "use_async", "median", "samples"),
    [
        pytest.param("dcp_volumes", False, 20.0, 3, id="blocking-odd-count"),
        pytest.param("dcp_volumes", True, 2.0, 3, id="async"),
        # Non-numeric, bool, NaN and negative values are skipped: median of 40 and 50.
        pytest.param("filesystem", False, 45.0, 2, id="blocking-even-count-skips-junk"),
        pytest.param(None, False, 30.0, 5, id="all-contenders"),
    ],
)
def test_bench_median(
    bench_file: Path, contender: str | None, use_async: bool, median: float, samples: int
) -> None:
    cost = checkpoint_cost_from_bench(bench_file, contender=contender, use_async=use_async)
    assert cost.seconds == median
    assert cost.samples == samples
    assert cost.metric == ("async_block_s" if use_async else "save_s")
    assert str(bench_file) in cost.describe()


def test_bench_reads_dcp_volumes_bench_lines(tmp_path: Path) -> None:
    """`dcp-volumes bench` nests its figures under "result"."""
    path = tmp_path / "results.jsonl"
    lines = [
        {"kind": "save_load", "contender": "vol-disk-c8", "result": {"save_s": s}}
        for s in (4.0, 6.0, 5.0)
    ] + [{"kind": "async", "contender": "vol-disk-c8", "result": {"async_block_s": 0.05}}]
    path.write_text("\n".join(json.dumps(x) for x in lines), encoding="utf-8")
    assert checkpoint_cost_from_bench(path, contender="vol-disk-c8").seconds == 5.0
    assert checkpoint_cost_from_bench(path, use_async=True).seconds == 0.05


@pytest.mark.parametrize(
    ("content", "kwargs", "match"),
    [
        pytest.param(
            None, {}, "does not exist; write one with `dcp-volumes bench", id="missing-file"
        ),
        pytest.param("", {}, "holds no JSON-object lines", id="empty-file"),
        pytest.param(
            _BENCH,
            {"contender": "nope"},
            "no line .* has contender 'nope'; contenders there: dcp_volumes, filesystem",
            id="unknown-contender",
        ),
        pytest.param(
            _BENCH,
            {"contender": "filesystem", "use_async": True},
            "no line .* has a number under 'async_block_s' for contender 'filesystem'; lines do "
            "have 'save_s': drop --async",
            id="no-async-values",
        ),
    ],
)
def test_bench_errors(
    tmp_path: Path, content: str | None, kwargs: dict[str, object], match: str
) -> None:
    path = tmp_path / "bench.jsonl"
    if content is not None:
        path.write_text(content, encoding="utf-8")
    with pytest.raises(ConfigError, match=match):
        checkpoint_cost_from_bench(path, **kwargs)  # type: ignore[arg-type]


def test_bench_directory_is_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="cannot read bench file"):
        checkpoint_cost_from_bench(tmp_path)


# --------------------------------------------------------------------------------------------
# Durations


@pytest.mark.parametrize(
    ("text", "seconds"),
    [
        pytest.param("90s", 90.0, id="seconds"),
        pytest.param("5m", 300.0, id="minutes"),
        pytest.param("1.5h", 5400.0, id="fractional-hours"),
        pytest.param(" 2 H ", 7200.0, id="spaces-and-case"),
        pytest.param("1d", 86400.0, id="day"),
        pytest.param("10min", 600.0, id="min-suffix"),
    ],
)
def test_parse_duration(text: str, seconds: float) -> None:
    assert parse_duration_s(text) == seconds


@pytest.mark.parametrize(
    "text",
    ["30", "5 minutes", "-5m", "0s", "m", ""],
    ids=["no-unit", "long-unit", "negative", "zero", "no-number", "empty"],
)
def test_parse_duration_rejects(text: str) -> None:
    with pytest.raises(ConfigError, match="duration"):
        parse_duration_s(text)


@pytest.mark.parametrize(
    ("seconds", "text"),
    [
        pytest.param(45.0, "45s", id="seconds"),
        pytest.param(300.0, "5m", id="minutes"),
        pytest.param(6151.68, "1h 43m", id="hours-minutes"),
        pytest.param(86400.0, "1d", id="day"),
        pytest.param(315_360.0, "3d 16h", id="days-hours"),
        pytest.param(3599.9, "1h", id="rounds-up-into-next-unit"),
        pytest.param(math.inf, "inf", id="infinite"),
    ],
)
def test_format_duration(seconds: float, text: str) -> None:
    assert format_duration(seconds) == text


# --------------------------------------------------------------------------------------------
# CLI through a subprocess: the real entry point, exit codes and streams

_BASE = ["--gpus", "1000", "--afr", "0.1", "--checkpoint-cost-s", "60", "--restart-cost-s", "600"]


def test_cli_plan_table() -> None:
    proc = _run("plan", *_BASE, "--job-hours", "720")
    assert proc.returncode == 0, proc.stderr
    assert proc.stderr == ""
    assert "87.6 h" in proc.stdout
    assert "Young optimum" in proc.stdout and "Daly optimum" in proc.stdout
    assert "99.97%" in proc.stdout  # P(≥1 interruption in 720 h)


def test_cli_plan_json() -> None:
    proc = _run("plan", *_BASE, "--job-hours", "720", "--intervals", "30m,1h,2h", "--json")
    assert proc.returncode == 0, proc.stderr
    doc = json.loads(proc.stdout)
    assert doc["mttf_hours"] == pytest.approx(M_HOURS)
    assert doc["method"] == "young"
    assert doc["optimum"]["interval_s"] == pytest.approx(6151.6827, abs=1e-3)
    assert [r["interval_s"] for r in doc["rows"]] == [1800.0, 3600.0, 7200.0]
    assert doc["rows"][1]["goodput"] == pytest.approx(0.9760274, abs=1e-7)
    assert doc["plot"] is None


def test_cli_plan_daly_and_fleet() -> None:
    proc = _run(
        "plan",
        "--gpus",
        "4096",
        "--fleet-mtbf-hours",
        "3",
        "--fleet-gpus",
        "16384",
        "--checkpoint-cost-s",
        "60",
        "--daly",
        "--json",
    )
    assert proc.returncode == 0, proc.stderr
    doc = json.loads(proc.stdout)
    assert doc["mttf_hours"] == pytest.approx(12.0)
    # M = 43 200 s: x = 60/86 400; τ = √(2·60·43 200)·(1 + √x/3 + x/9) − 60
    x = 60 / 86_400
    expected = math.sqrt(2 * 60 * 43_200) * (1 + math.sqrt(x) / 3 + x / 9) - 60
    assert doc["method"] == "daly"
    assert doc["optimum"]["interval_s"] == pytest.approx(expected)


def test_cli_plan_from_bench(bench_file: Path) -> None:
    proc = _run(
        "plan",
        "--gpus",
        "1000",
        "--afr",
        "0.1",
        "--from-bench",
        str(bench_file),
        "--contender",
        "dcp_volumes",
        "--async",
        "--json",
    )
    assert proc.returncode == 0, proc.stderr
    doc = json.loads(proc.stdout)
    assert doc["checkpoint_cost_s"] == 2.0
    assert "median async_block_s of 3 run(s)" in doc["checkpoint_cost_source"]


def test_cli_plan_plot(tmp_path: Path) -> None:
    out = tmp_path / "goodput.png"
    proc = _run("plan", *_BASE, "--plot", str(out), "--json")
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout)["plot"] == str(out)
    data = out.read_bytes()
    assert data.startswith(b"\x89PNG") and len(data) > 10_000


@pytest.mark.parametrize(
    ("args", "match"),
    [
        pytest.param(
            ["--gpus", "0", "--afr", "0.1", "--checkpoint-cost-s", "60"],
            "argument --gpus: must be at least 1",
            id="zero-gpus",
        ),
        pytest.param(
            ["--gpus", "8", "--afr", "-0.1", "--checkpoint-cost-s", "60"],
            "argument --afr: must be a finite number >= 0",
            id="negative-afr",
        ),
        pytest.param(
            ["--gpus", "8", "--afr", "nan", "--checkpoint-cost-s", "60"],
            "argument --afr: expected a number, got NaN",
            id="nan-afr",
        ),
        pytest.param(
            ["--gpus", "8", "--afr", "5", "--checkpoint-cost-s", "60"],
            "did you mean 0.05",
            id="afr-as-percent",
        ),
        pytest.param(
            ["--gpus", "8", "--checkpoint-cost-s", "60"],
            "give a failure rate: --afr",
            id="no-failure-rate",
        ),
        pytest.param(
            ["--gpus", "8", "--fleet-mtbf-hours", "3", "--checkpoint-cost-s", "60"],
            "--fleet-mtbf-hours T together with --fleet-gpus",
            id="fleet-half",
        ),
        pytest.param(
            ["--gpus", "8", "--afr", "0.1"], "give the checkpoint cost", id="no-checkpoint-cost"
        ),
        pytest.param(
            ["--gpus", "8", "--afr", "0.1", "--checkpoint-cost-s", "-1"],
            "argument --checkpoint-cost-s: must be a finite number >= 0",
            id="negative-cost",
        ),
        pytest.param(
            ["--gpus", "8", "--afr", "0.1", "--checkpoint-cost-s", "6", "--from-bench", "b.jsonl"],
            "not both",
            id="two-cost-sources",
        ),
        pytest.param(
            ["--gpus", "8", "--afr", "0.1", "--checkpoint-cost-s", "6", "--async"],
            "only apply with --from-bench",
            id="async-without-bench",
        ),
        pytest.param(
            ["--gpus", "8", "--afr", "0.1", "--from-bench", "missing.jsonl"],
            "bench file 'missing.jsonl' does not exist",
            id="missing-bench-file",
        ),
        pytest.param(
            ["--gpus", "8", "--afr", "0.1", "--checkpoint-cost-s", "6", "--intervals", "30,60"],
            "cannot read duration '30'",
            id="unitless-interval",
        ),
        pytest.param(
            ["--gpus", "8", "--afr", "0.1", "--checkpoint-cost-s", "6", "--bogus"],
            "unrecognized arguments: --bogus",
            id="unknown-flag",
        ),
        pytest.param(
            ["--afr", "0.1", "--checkpoint-cost-s", "6"],
            "the following arguments are required: --gpus",
            id="missing-gpus",
        ),
    ],
)
def test_cli_invalid_input_is_one_line_exit_2(
    args: list[str], match: str, capsys: pytest.CaptureFixture[str]
) -> None:
    # In-process: same main() as the console script, without a 2 s interpreter start per case.
    assert cli.main(["plan", *args]) == 2
    out, err = capsys.readouterr()
    assert out == ""
    lines = err.splitlines()
    assert len(lines) == 1, err
    assert lines[0].startswith("dcp-volumes: error: ")
    assert match in lines[0]


@pytest.mark.parametrize(
    ("args", "match"),
    [
        pytest.param(
            ["--gpus", "0", "--afr", "0.1", "--checkpoint-cost-s", "60"],
            "argument --gpus: must be at least 1",
            id="argparse-check",
        ),
        pytest.param(
            ["--gpus", "8", "--afr", "5", "--checkpoint-cost-s", "60"],
            "did you mean 0.05",
            id="library-config-error",
        ),
    ],
)
def test_cli_subprocess_invalid_input_is_one_line_exit_2(args: list[str], match: str) -> None:
    proc = _run("plan", *args)
    assert proc.returncode == 2
    assert proc.stdout == ""
    lines = proc.stderr.splitlines()
    assert len(lines) == 1, proc.stderr
    assert lines[0].startswith("dcp-volumes: error: ")
    assert match in lines[0]


def test_cli_debug_shows_traceback() -> None:
    proc = _run("--debug", "plan", "--gpus", "8", "--afr", "5", "--checkpoint-cost-s", "6")
    assert proc.returncode == 2
    assert "Traceback" in proc.stderr
    assert proc.stderr.splitlines()[-1].startswith("dcp-volumes: error: ")


def test_cli_debug_after_subcommand_also_works(capsys: pytest.CaptureFixture[str]) -> None:
    assert (
        cli.main(["plan", "--gpus", "8", "--afr", "5", "--checkpoint-cost-s", "6", "--debug"]) == 2
    )
    assert "Traceback" in capsys.readouterr().err


def test_cli_os_error_exits_1(tmp_path: Path) -> None:
    proc = _run("plan", *_BASE, "--plot", str(tmp_path / "no-such-dir" / "g.png"))
    assert proc.returncode == 1
    lines = proc.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("dcp-volumes: error: "), proc.stderr


@pytest.mark.parametrize(
    ("args", "code"),
    [
        pytest.param([], 2, id="no-subcommand"),
        pytest.param(["--help"], 0, id="help"),
        pytest.param(["plan", "--help"], 0, id="plan-help"),
    ],
)
def test_cli_help_and_missing_command(
    args: list[str], code: int, capsys: pytest.CaptureFixture[str]
) -> None:
    assert cli.main(args) == code
    out, err = capsys.readouterr()
    assert "plan" in out + err


# --------------------------------------------------------------------------------------------
# CLI in-process: the plain-text renderer used when rich is not installed


def test_cli_plain_output_without_rich(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    for mod in ("rich", "rich.console", "rich.table"):
        monkeypatch.setitem(sys.modules, mod, None)  # makes `import rich...` raise ImportError
    assert cli.main(["plan", *_BASE, "--job-hours", "720", "--intervals", "1h,2h"]) == 0
    out = capsys.readouterr().out
    lines = out.splitlines()
    header = next(i for i, line in enumerate(lines) if line.startswith("interval"))
    assert set(lines[header + 1].replace(" ", "")) == {"-"}
    assert any(line.startswith("1h ") and "97.60%" in line for line in lines)
    assert any("Young optimum *" in line for line in lines)
    assert "┃" not in out
