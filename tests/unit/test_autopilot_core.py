"""The autopilot's pure core: the failure estimate, the run record (untrusted), the interval
and its convergence under a wrong prior (fake clock, no sleeps)."""

from __future__ import annotations

import json
import math
import random
import statistics

import pytest
from _goodput_oracle import mixture_mttf

from dcp_volumes.errors import ConfigError
from dcp_volumes.goodput import (
    AutopilotOptions,
    Bound,
    FailureModel,
    FailurePrior,
    Incarnation,
    RestoreSample,
    RunRecord,
    SaveSample,
    choose_interval,
    default_prior,
    estimate_failures,
    measured_costs,
    settle_interval,
)
from dcp_volumes.goodput._record import dump_record, parse_record

ROOT = "s3://bucket/run-1"
T0 = 1.8e9  # a wall-clock time in 2027


# ---- the estimate ------------------------------------------------------------------------


def test_gamma_poisson_closed_form() -> None:
    prior = FailurePrior(mttf_s=1000.0, weight=0.25, trust=0.0)  # the light half alone
    est = estimate_failures(prior, interruptions=2, exposure_s=500.0)
    assert est.mttf_s == pytest.approx((0.25 * 1000 + 500) / (0.25 + 2))
    assert est.observed_mttf_s == 250.0
    assert est.prior_share == pytest.approx(0.25 / 2.25)
    assert est.trusted_share == 0.0
    assert estimate_failures(prior, interruptions=0, exposure_s=0.0).mttf_s == 1000.0


def test_a_given_prior_is_trusted_while_the_run_agrees() -> None:
    prior = FailurePrior(mttf_s=40.0)  # given: half weighing 4, half 0.25
    assert prior.trust == 0.5
    for n, t in [(0, 0.0), (0, 30.0), (2, 500.0), (3, 120.0)]:
        est = estimate_failures(prior, interruptions=n, exposure_s=t)
        assert est.mttf_s == pytest.approx(mixture_mttf(40.0, n, t))
    # a lucky stretch of 30 s: the light half alone reads 40 + 30/0.25 = 160 s
    lucky = estimate_failures(prior, interruptions=0, exposure_s=30.0)
    assert 40.0 < lucky.mttf_s < 100.0 and lucky.trusted_share > 0.3
    # the run contradicts it (failures 10x sooner than the prior): the light half takes over
    burst = estimate_failures(FailurePrior(mttf_s=400.0), interruptions=8, exposure_s=320.0)
    assert burst.trusted_share < 0.05
    assert burst.mttf_s == pytest.approx((0.25 * 400 + 320) / 8.25, rel=0.05)
    # the default prior is nobody's knowledge of this job: not trusted
    assert default_prior(8).trust == 0.0
    with pytest.raises(ConfigError):
        FailurePrior(mttf_s=40.0, trust=1.0)
    with pytest.raises(ConfigError):
        AutopilotOptions(prior_trust=-0.1)


def test_prior_from_a_failure_model_and_the_default() -> None:
    model = FailureModel.from_afr(0.01, gpus=1024)
    prior = FailurePrior.from_model(model)
    assert prior.mttf_s == pytest.approx(8760 / (0.01 * 1024) * 3600)
    assert not prior.default and "AFR 0.01" in prior.source
    d = default_prior(2)
    assert d.default and "Llama 3" in d.source
    assert d.mttf_s == pytest.approx(3.0 * 16384 / 2 * 3600)
    assert d.to_dict()["weight"] == 0.25


@pytest.mark.parametrize("bad", [0.0, -1.0, float("nan"), 1e6], ids=["zero", "neg", "nan", "huge"])
def test_prior_weight_checked(bad: float) -> None:
    with pytest.raises(ConfigError):
        FailurePrior(mttf_s=100.0, weight=bad)


# ---- convergence from a prior 10x too optimistic (fake clock) ----------------------------


def _simulate(seed: int, failures: int, *, true_m: float, delta: float,
              prior_m: float) -> list[float]:
    """A run whose failures arrive at the true rate, re-choosing its interval from its
    record after each incarnation; the ``every_s`` chosen after each interruption."""
    rng = random.Random(seed)
    opts = AutopilotOptions(failure_model=None, max_interval_s=1e6)
    prior = FailurePrior(mttf_s=prior_m)
    record = RunRecord(root=ROOT)
    for _ in range(3):
        record.add_save(SaveSample("durable", delta, 0.0, 1 << 20, T0))
    now, chosen = T0, []

    def every_now() -> float:
        n, t = record.evidence(now)
        est = estimate_failures(prior, interruptions=n, exposure_s=t)
        return choose_interval(measured_costs(record), est, opts, local_tier=False).every_s

    record.add_incarnation(Incarnation(now, now))
    for _ in range(failures):
        inc = record.incarnations[-1]
        inc.interval_s = every = every_now()
        life = rng.expovariate(1.0 / true_m)
        inc.last_seen = inc.started + math.floor(life / every) * every  # written at each save
        now = inc.started + life + 30.0  # died, then the restart
        record.add_incarnation(Incarnation(now, now, interval_s=every))
        chosen.append(every_now())
    return chosen


def test_a_10x_optimistic_prior_converges_within_25_percent() -> None:
    true_m, delta = 600.0, 2.0
    target = math.sqrt(2 * delta * true_m) + delta
    runs = [_simulate(seed, 12, true_m=true_m, delta=delta, prior_m=10 * true_m)
            for seed in range(200)]
    ratio = {k: statistics.median(r[k - 1] / target for r in runs) for k in (1, 3, 5, 8, 12)}
    within = {k: sum(abs(r[k - 1] / target - 1) <= 0.25 for r in runs) / len(runs)
              for k in (5, 8, 12)}
    print(f"median every/target after k interruptions: {ratio}; share within 25%: {within}")
    # before any evidence the prior's interval is √10 too long; one interruption is not enough
    assert ratio[1] > 1.3
    assert abs(ratio[5] - 1) <= 0.25
    assert abs(ratio[8] - 1) <= 0.15
    assert within[8] >= 0.75


# ---- the record: round trip and untrusted bytes ------------------------------------------


def _record() -> RunRecord:
    r = RunRecord(root=ROOT)
    r.add_save(SaveSample("durable", 0.5, 3.0, 1 << 30, T0))
    r.add_restore(RestoreSample(4.0, 9.0, "store", T0 + 10))
    r.add_incarnation(Incarnation(T0, T0 + 100, interval_s=60.0))
    return r


def test_round_trip() -> None:
    r = _record()
    back, problems = parse_record(dump_record(r), root=ROOT)
    assert problems == [] and back == r


def _doc(**over: object) -> bytes:
    doc = json.loads(dump_record(_record()))
    doc.update(over)
    return json.dumps(doc).encode()


@pytest.mark.parametrize(
    ("data", "why"),
    [
        (b"{" + b" " * (10 << 20) + b"}", "larger than"),
        (b'{"format": "dcp-volumes-run-record", "version": 1, "x": NaN}', "not JSON"),
        (b"\xff\xfe", "not JSON"),
        (b"[1, 2]", "not a version-1"),
        (b"[" * 100_000, "not JSON"),
        (_doc(root="s3://bucket/another-run"), "another run root"),
        (_doc(run_id="../../etc"), "no valid run id"),
        (_doc(version=2), "not a version-1"),
    ],
    ids=["10MB", "nan", "not-utf8", "list", "deep", "other-run", "bad-id", "version"],
)
def test_unusable_records_are_refused(data: bytes, why: str) -> None:
    record, problems = parse_record(data, root=ROOT)
    assert record is None and why in problems[0]


@pytest.mark.parametrize(
    "entry",
    [
        {"kind": "durable", "blocking_s": 1e300, "background_s": 0, "bytes": 1, "at": T0},
        {"kind": "durable", "blocking_s": -1, "background_s": 0, "bytes": 1, "at": T0},
        {"kind": "durable", "blocking_s": "1", "background_s": 0, "bytes": 1, "at": T0},
        {"kind": "durable", "blocking_s": True, "background_s": 0, "bytes": 1, "at": T0},
        {"kind": "evil", "blocking_s": 1, "background_s": 0, "bytes": 1, "at": T0},
        {"kind": "durable", "blocking_s": 1, "background_s": 0, "bytes": 1, "at": 5},
        {"kind": "durable"},
        "not an object",
    ],
    ids=["huge", "negative", "string", "bool", "kind", "time", "missing", "string-entry"],
)
def test_invalid_entries_are_dropped(entry: object) -> None:
    good = json.loads(dump_record(_record()))["saves"][0]
    record, problems = parse_record(_doc(saves=[good, entry]), root=ROOT)
    assert record is not None and record.saves == _record().saves
    assert problems == ["saves: an invalid entry dropped"]


def test_inconsistent_incarnation_dropped() -> None:
    bad = {"started": T0 + 10, "last_seen": T0, "closed": False, "interval_s": 1.0}
    record, problems = parse_record(_doc(incarnations=[bad]), root=ROOT)
    assert record is not None and record.incarnations == [] and problems


def test_record_is_bounded() -> None:
    r = RunRecord(root=ROOT)
    for i in range(500):
        r.add_save(SaveSample("durable", 1.0, 0.0, 1, T0 + i))
        r.add_restore(RestoreSample(1.0, 2.0, "store", T0 + i))
        r.add_incarnation(Incarnation(T0 + 10 * i, T0 + 10 * i + 5, interval_s=2.0))
    assert len(dump_record(r)) < 64 * 1024
    n, t = r.evidence(T0 + 5000)
    assert n == 499  # every incarnation but the running one was interrupted
    # 5 s seen + half an interval each; the running one up to now, 10 s after its start
    assert t == pytest.approx(499 * 6.0 + 10.0)


# ---- the interval ------------------------------------------------------------------------


def _costs(blocking: float, background: float = 0.0, restart: float = 0.0) -> RunRecord:
    r = RunRecord(root=ROOT)
    for _ in range(3):
        r.add_save(SaveSample("durable", blocking, background, 1, T0))
    if restart:
        r.add_restore(RestoreSample(restart / 2, restart, "store", T0))
    return r


def _every(record: RunRecord, m: float, opts: AutopilotOptions | None = None,
           local_tier: bool = False) -> float:
    est = estimate_failures(FailurePrior(mttf_s=m), interruptions=0, exposure_s=0.0)
    return choose_interval(measured_costs(record), est, opts or AutopilotOptions(),
                           local_tier=local_tier).every_s


def test_young_interval_and_its_reasons() -> None:
    est = estimate_failures(FailurePrior(mttf_s=3600.0), interruptions=0, exposure_s=0.0)
    got = choose_interval(measured_costs(_costs(2.0, restart=20.0)), est, AutopilotOptions(),
                          local_tier=False)
    assert got.every_s == pytest.approx(math.sqrt(2 * 2.0 * 3600) + 2.0)
    assert got.reason == "optimum" and got.delta_s == 2.0 and got.restart_s == 20.0
    assert "√(2δM)" in got.formula and 0 < (got.predicted_goodput or 0) < 1


def test_never_shorter_than_a_save_takes_to_complete() -> None:
    # Young says √(2·1·100) + 1 = 15 s; the upload takes 60 s: saves would queue
    assert _every(_costs(1.0, background=60.0), 100.0) == pytest.approx(1.1 * 61.0)


@pytest.mark.parametrize(("blocking", "m", "expect"),
                         [(1e9, 1e9, 6 * 3600.0), (1e-9, 1.0, 1.0), (1.0, math.inf, 6 * 3600.0)],
                         ids=["huge", "tiny", "no-failures"])
def test_bounded(blocking: float, m: float, expect: float) -> None:
    assert _every(_costs(blocking), m) == pytest.approx(expect)


@pytest.mark.parametrize(("blocking", "background", "m", "bound"), [
    (2.0, 0.0, 3600.0, Bound.OPTIMUM),
    (1.0, 60.0, 100.0, Bound.RAISED_TO_COMPLETION),
    (1.0, 8 * 3600.0, 3600.0, Bound.QUEUES),
    (1.0, 0.0, math.inf, Bound.CAPPED),
], ids=["optimum", "raised-to-completion", "saves-queue", "capped"])
def test_the_bound_that_decided_is_typed(blocking: float, background: float, m: float,
                                         bound: Bound) -> None:
    # callers branch on the bound (the Checkpointer's WARNING when saves queue), never on
    # the reason's words; the words stay the bound's
    est = estimate_failures(FailurePrior(mttf_s=m), interruptions=0, exposure_s=0.0)
    got = choose_interval(measured_costs(_costs(blocking, background=background)), est,
                          AutopilotOptions(), local_tier=False)
    assert got.bound is bound and got.reason.startswith(bound.value)
    assert json.loads(json.dumps(got.to_dict()))["bound"] == bound.name.lower()


def test_one_slow_save_does_not_swing_it() -> None:
    r = _costs(1.0)
    for _ in range(4):
        r.add_save(SaveSample("durable", 1.0, 0.0, 1, T0))
    before = _every(r, 3600.0)
    r.add_save(SaveSample("durable", 100.0, 0.0, 1, T0))
    assert _every(r, 3600.0) == pytest.approx(before)


def test_settle_keeps_small_changes() -> None:
    opts = AutopilotOptions()
    est = estimate_failures(FailurePrior(mttf_s=3600.0), interruptions=0, exposure_s=0.0)
    a = choose_interval(measured_costs(_costs(1.0)), est, opts, local_tier=False)
    b = choose_interval(measured_costs(_costs(1.1)), est, opts, local_tier=False)
    c = choose_interval(measured_costs(_costs(2.0)), est, opts, local_tier=False)
    assert settle_interval(a, b, opts) is a
    assert settle_interval(a, c, opts) is c


def test_two_level_with_a_local_tier() -> None:
    r = _costs(10.0)
    for _ in range(3):
        r.add_save(SaveSample("local-only", 1.0, 0.0, 1, T0))
    est = estimate_failures(FailurePrior(mttf_s=36000.0), interruptions=0, exposure_s=0.0)
    got = choose_interval(measured_costs(r), est, AutopilotOptions(), local_tier=True)
    assert got.local_every_s is not None and got.local_every_s < got.every_s
    assert "two-level" in got.formula
    # before a local-only save was measured: one between durable saves measures it
    boot = choose_interval(measured_costs(_costs(10.0)), est, AutopilotOptions(),
                           local_tier=True)
    assert boot.local_every_s == pytest.approx(boot.every_s / 2)


@pytest.mark.parametrize("kw", [{"min_interval_s": 10.0, "max_interval_s": 1.0},
                                {"window": 0}, {"change_threshold": 1.5},
                                {"failure_model": 0.01}],
                         ids=["bounds", "window", "threshold", "model"])
def test_options_checked(kw: dict[str, object]) -> None:
    with pytest.raises(ConfigError):
        AutopilotOptions(**kw)  # type: ignore[arg-type]


def test_an_incarnations_first_save_is_left_out_of_delta() -> None:
    # the first save of each process also pays one-time setup (writer, buffers, connections)
    r = RunRecord(root=ROOT)
    for _ in range(3):
        r.add_save(SaveSample("durable", 10.0, 0.0, 1, T0, first=True))
        r.add_save(SaveSample("durable", 1.0, 0.0, 1, T0))
    assert measured_costs(r).durable_blocking_s == 1.0
    assert measured_costs(r).restart_s == 9.0  # paid once per restart: part of R
    only_first = _costs(10.0)  # nothing else measured yet: the first saves are all there is
    only_first.saves = [SaveSample("durable", 10.0, 0.0, 1, T0, first=True)]
    assert measured_costs(only_first).durable_blocking_s == 10.0
    good = json.loads(dump_record(_record()))["saves"][0]
    record, problems = parse_record(_doc(saves=[good, {**good, "first": "yes"}]), root=ROOT)
    assert record is not None and len(record.saves) == 1 and problems


def test_started_at_checked() -> None:
    assert AutopilotOptions(started_at=T0).started_at == T0
    with pytest.raises(ConfigError):
        AutopilotOptions(started_at=-1.0)


def test_a_cold_first_save_alone_gives_an_upper_bound_interval() -> None:
    # the run's first save also pays one-time setup: its δ is an upper bound, used until a
    # steady save is measured (a second save only to measure δ costs a save per job)
    est = estimate_failures(FailurePrior(mttf_s=3600.0), interruptions=0, exposure_s=0.0)
    r = RunRecord(root=ROOT)
    none_yet = choose_interval(measured_costs(r), est, AutopilotOptions(), local_tier=False)
    assert none_yet.every_s == 1.0 and none_yet.delta_s is None
    r.add_save(SaveSample("durable", 4.0, 0.0, 1, T0, first=True))
    boot = choose_interval(measured_costs(r), est, AutopilotOptions(), local_tier=False)
    assert boot.delta_s == 4.0 and "upper bound" in boot.reason
    assert boot.every_s == pytest.approx(math.sqrt(2 * 4.0 * 3600) + 4.0)
    two = choose_interval(measured_costs(r), est, AutopilotOptions(), local_tier=True)
    assert two.delta_s == 4.0 and "upper bound" in two.reason
    r.add_save(SaveSample("durable", 1.0, 0.0, 1, T0))
    got = choose_interval(measured_costs(r), est, AutopilotOptions(), local_tier=False)
    assert got.delta_s == 1.0 and "upper bound" not in got.reason
    assert got.every_s == pytest.approx(math.sqrt(2 * 1.0 * 3600) + 1.0)
    # the steady δ is half the bound's interval: beyond the threshold, it replaces it
    assert settle_interval(boot, got, AutopilotOptions()) is got
