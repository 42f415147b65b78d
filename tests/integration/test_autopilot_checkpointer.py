"""``Checkpointer(every_seconds="auto")`` end to end on a local directory and on moto: the
run record written and read back, an interruption counted, the interval in ``stats``;
crafted and damaged records never fail a save or a resume and never make the interval
absurd. The policy's clock is a fake one (no sleeps)."""

from __future__ import annotations

import json
import logging
import uuid
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import fsspec
import pytest
import torch

from dcp_volumes import Checkpointer, errors
from dcp_volumes.goodput import AutopilotOptions, FailureModel, RunRecord, SaveSample
from dcp_volumes.goodput._record import RECORD_NAME, dump_record, parse_record
from dcp_volumes.testing.servers import LocalServer, start_server

warnings.filterwarnings("ignore", message="torch.distributed is disabled")

PRIOR = AutopilotOptions(failure_model=FailureModel.from_fleet(mtbf_hours=0.1, fleet_gpus=1,
                                                               gpus=1))
LOG = "dcp_volumes.checkpointer._autopilot"


@pytest.fixture(scope="module")
def moto() -> Iterator[LocalServer]:
    server = start_server("moto")
    server.create_bucket("auto")
    yield server
    server.stop()


@pytest.fixture(params=["local", "moto"], ids=["local", "moto"])
def where(request: pytest.FixtureRequest, tmp_path: Path) -> tuple[str, dict[str, Any]]:
    if request.param == "local":
        return str(tmp_path / "run"), {}
    server: LocalServer = request.getfixturevalue("moto")
    return f"s3://auto/{uuid.uuid4().hex[:12]}", server.storage_options()


class FakeClock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def state_at(step: int) -> dict[str, Any]:
    return {"w": torch.full((64, 64), float(step)), "extra": {"step": step}}


def _record(root: str, options: dict[str, Any]) -> bytes:
    fs, path = fsspec.url_to_fs(root, **options)
    return fs.cat_file(f"{path}/{RECORD_NAME}")  # type: ignore[no-any-return]


def _train(ckpt: Checkpointer, clock: FakeClock, start: int, steps: int) -> list[int]:
    saved = []
    for step in range(start, start + steps):
        clock.t += 1.0
        if ckpt.save(step, state_at(step)):
            saved.append(step)
    return saved


@pytest.mark.parametrize("async_save", [False, True], ids=["sync", "async"])
def test_auto_end_to_end(where: tuple[str, dict[str, Any]], async_save: bool,
                         caplog: pytest.LogCaptureFixture) -> None:
    root, opts = where
    clock = FakeClock()
    caplog.set_level(logging.INFO, logger=LOG)
    ckpt = Checkpointer(root, storage_options=opts, every_seconds="auto", autopilot=PRIOR,
                        async_save=async_save, clock=clock)
    assert ckpt.every_seconds == 1.0  # nothing measured yet: the first save measures δ
    saved = _train(ckpt, clock, 1, 150)
    ckpt.wait()
    st = ckpt.stats
    interval = st["interval"]
    assert saved[0] == 1 and len(saved) >= 2
    assert interval["delta_s"] > 0 and "Young" in interval["formula"]
    ckpt.due(saved[-1] + 1)  # the policy takes the interval at its next decision
    assert ckpt.every_seconds == pytest.approx(interval["every_s"])
    assert st["costs"]["saves"] == min(len(saved), 32)  # the record keeps the newest 32
    assert st["failures"]["prior"]["source"].startswith("given: 1 GPUs, fleet: 1 failure every 0.1 h")
    if async_save:  # the upload is measured apart from what save() blocked
        assert st["costs"]["durable_background_s"] > 0
    changes = [r for r in caplog.records if "autopilot: a durable save every" in r.message]
    assert 1 <= len(changes) <= len(saved) + 1
    assert json.loads(_record(root, opts))["saves"]  # rank 0 wrote it under the root
    # abandoned without close(): the next incarnation counts an interruption
    del ckpt
    again = Checkpointer(root, storage_options=opts, every_seconds="auto", autopilot=PRIOR,
                         async_save=async_save, clock=clock)
    step = again.load_latest(state_at(0))
    assert step == saved[-1]
    again.wait()  # its read of the record has landed (no hook waits for it)
    st = again.stats
    assert st["failures"]["interruptions"] == 1 and st["costs"]["restores"] == 1
    assert st["costs"]["saves"] == min(len(saved), 32)  # read back from the record
    _train(again, clock, step + 1, 5)
    again.close()  # a clean end: not an interruption
    third = Checkpointer(root, storage_options=opts, every_seconds="auto", autopilot=PRIOR,
                         clock=clock)
    third.load_latest(state_at(0))
    third.wait()
    assert third.stats["failures"]["interruptions"] == 1
    assert third.stats["run_id"] == st["run_id"]
    third.close()


def _crafted(root_in_record: str) -> list[bytes]:
    def record(blocking: float) -> dict[str, Any]:
        r = RunRecord(root=root_in_record)
        for _ in range(5):
            r.add_save(SaveSample("durable", blocking, blocking, 10**15, 1.8e9))
        return json.loads(dump_record(r))  # type: ignore[no-any-return]

    absurd = record(9e8)  # 28 years a save: not a measurement, dropped
    absurd["saves"].append({"kind": "durable", "blocking_s": 1e300, "background_s": 0,
                            "bytes": 1, "at": 1.8e9})
    return [b"{" + b" " * (10 << 20) + b"}",  # 10 MB of JSON
            b'{"format": "dcp-volumes-run-record", "version": 1, "saves": [NaN]}',
            dump_record(RunRecord(root="s3://elsewhere/another-run")),
            json.dumps(absurd).encode(),
            json.dumps(record(20 * 3600.0)).encode(),  # plausible, huge: capped, warned
            b"\x00garbage"]


@pytest.mark.parametrize("case", range(6),
                         ids=["10MB", "nan", "other-run", "absurd", "huge", "garbage"])
def test_damaged_records_never_fail(where: tuple[str, dict[str, Any]], case: int,
                                    caplog: pytest.LogCaptureFixture) -> None:
    root, opts = where
    first = Checkpointer(root, storage_options=opts, every_seconds="auto", autopilot=PRIOR)
    first.save(1, state_at(1), force=True)
    first.close()
    record_root = json.loads(_record(root, opts))["root"]
    fs, path = fsspec.url_to_fs(root, **opts)
    fs.pipe_file(f"{path}/{RECORD_NAME}", _crafted(record_root)[case])
    clock = FakeClock()
    caplog.set_level(logging.INFO)
    ckpt = Checkpointer(root, storage_options=opts, every_seconds="auto", autopilot=PRIOR,
                        clock=clock)
    assert ckpt.load_latest(state_at(0)) == 1
    assert ckpt.save(2, state_at(2), force=True)
    _train(ckpt, clock, 3, 30)
    ckpt.close()
    warned = [r.message for r in caplog.records if r.levelno == logging.WARNING]
    assert any("run record" in w or "saves will queue" in w for w in warned), warned
    assert 1.0 <= ckpt.every_seconds <= PRIOR.max_interval_s
    # the record is ours again, and clean
    record, problems = parse_record(_record(root, opts), root=record_root)
    assert record is not None and problems == []


def test_options_checked(tmp_path: Path) -> None:
    with pytest.raises(errors.ConfigError, match="every_seconds=\"auto\""):
        Checkpointer(str(tmp_path), every_steps=5, autopilot=PRIOR)
    with pytest.raises(errors.ConfigError, match="local_every_seconds"):
        Checkpointer(str(tmp_path), every_seconds="auto", local_every_seconds=5.0)
    with pytest.raises(errors.ConfigError, match="AutopilotOptions"):
        Checkpointer(str(tmp_path), every_seconds="auto", autopilot={"x": 1})  # type: ignore[arg-type]
    with pytest.raises(errors.ConfigError):
        Checkpointer(str(tmp_path), every_seconds="often")
    assert Checkpointer(str(tmp_path), every_steps=5).stats == {}  # fixed cadences: unchanged


def _auto(root: str, clock: FakeClock, **kw: Any) -> Checkpointer:
    return Checkpointer(root, every_seconds="auto", autopilot=PRIOR, clock=clock, **kw)


def test_one_run_id_for_the_lease_and_the_record(tmp_path: Path,
                                                 monkeypatch: pytest.MonkeyPatch,
                                                 caplog: pytest.LogCaptureFixture) -> None:
    """The record's run is the Checkpointer's ``RunIdentity``: any printable run id (a path
    included) names the record by a digest; the same run id keeps its history across
    restarts, another run id under the root starts afresh (WARNING), and with no run id
    named (one made per process) the root is the run."""
    for var in ("DCP_VOLUMES_RUN_ID", "TORCHELASTIC_RUN_ID", "SLURM_JOB_ID"):
        monkeypatch.delenv(var, raising=False)
    root, clock = str(tmp_path / "run"), FakeClock()
    odd = "../../etc job 42 ∞ " + "x" * 230  # printable, 250 characters
    first = _auto(root, clock, run_id=odd)
    _train(first, clock, 1, 20)
    first.close()
    doc = json.loads(_record(root, {}))
    assert doc["run_id"].isalnum() and len(doc["run_id"]) == 32
    again = _auto(root, clock, run_id=odd)
    assert again.load_latest(state_at(0)) is not None
    again.wait()  # its read of the record has landed (no hook waits for it)
    assert again.stats["costs"]["saves"] == len(doc["saves"])  # the history kept
    assert again.stats["run_id"] == doc["run_id"]
    again.close()
    caplog.set_level(logging.WARNING)
    other = _auto(root, clock, run_id="another-run")
    other.wait()
    assert other.stats["costs"]["saves"] == 0  # another run's figures are not this one's
    assert any("another run" in r.message for r in caplog.records)
    other.close()
    saved: list[int] = []
    for k in range(2):  # per-process run ids: the root is the run
        unnamed = _auto(root, clock)
        assert not unnamed.run.named
        # the first saves at once; the second's first save waits an interval set by the
        # measured δ, which 5 steps may not reach: its incarnation is its mark in the record
        saved += _train(unnamed, clock, 100 + 10 * k, 5)  # steps of its own: no overwrite
        unnamed.close()
    doc = json.loads(_record(root, {}))
    assert len(doc["incarnations"]) == 2 and all(i["closed"] for i in doc["incarnations"])
    assert len(doc["saves"]) == len(saved) >= 1
    last = _auto(root, clock)
    last.wait()
    assert last.stats["costs"]["saves"] == len(saved)


def test_an_incarnation_that_dies_before_its_first_save_is_counted(tmp_path: Path) -> None:
    """A failure during a restart (before ``load_latest`` returns or the first save) is an
    interruption too: the incarnation is in the record from its construction. Before, it
    was recorded at its first hook, so such failures were invisible (the goodput harness's
    seed 1 lost one that way) and the estimate ran long."""
    root, clock = str(tmp_path / "run"), FakeClock()
    first = _auto(root, clock)
    _train(first, clock, 1, 10)
    del first  # killed
    dies_restoring = _auto(root, clock)
    del dies_restoring  # killed before load_latest returned
    third = _auto(root, clock)
    assert third.load_latest(state_at(0)) is not None
    third.wait()
    assert third.stats["failures"]["interruptions"] == 2
    third.close()
