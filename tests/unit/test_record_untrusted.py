"""The run record as untrusted input (issue 37, finding 1): a record whose every field is in
the parser's range can still say what no run wrote. It is judged against what the store
cannot forge -- the clock, its own span, the run's own measurements --; one that fails is
ignored with exactly one WARNING and rewritten from what this run saw, never carried
forward. Fake clocks, a local directory as the store, no sleeps."""

from __future__ import annotations

import json
import logging
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from _clocks import T0, Clocks

from dcp_volumes.checkpointer._autopilot import Autopilot
from dcp_volumes.goodput import AutopilotOptions, FailureModel, Incarnation, RunRecord
from dcp_volumes.goodput._judge import judge_record
from dcp_volumes.goodput._record import RECORD_NAME, parse_record

warnings.filterwarnings("ignore", message="torch.distributed is disabled")

#: the prior of the goodput harness: M = 40 s on 2 GPUs
OPTS = AutopilotOptions(failure_model=FailureModel.from_fleet(mtbf_hours=40 / 3600,
                                                              fleet_gpus=2, gpus=2),
                        min_interval_s=0.5)
Doc = dict[str, Any]


def _pilot(root: Path, clocks: Clocks, age_s: float) -> Autopilot:
    pilot = Autopilot(str(root), {}, None, OPTS, local_tier=False, wall=clocks.wall,
                      monotonic=clocks.mono, age_s=age_s)
    pilot.begin(None)
    pilot.flush()  # its read of the record has landed (no hook waits for it)
    return pilot


def _saves(pilot: Autopilot, clocks: Clocks, n: int) -> None:
    for _ in range(n):
        clocks.advance(10.0)
        started = clocks.mono()
        clocks.advance(1.5)
        pilot.track("durable", started, None, None)
    pilot.flush()


def _doc(root: Path) -> Doc:
    return json.loads((root / RECORD_NAME).read_bytes())  # type: ignore[no-any-return]


def _restart(tmp_path: Path, name: str, craft: Callable[[Doc], None] | None, *,
             history: bool = True, saves: int = 3
             ) -> tuple[Autopilot, Clocks, list[logging.LogRecord]]:
    """A run killed after 6 saves (no close: one interruption), its record then changed by
    ``craft``, and the next incarnation, which makes ``saves`` saves; the WARNINGs it logged.
    ``history=False``: the next incarnation starts on a root without a record."""
    clocks, root = Clocks(), tmp_path / name
    first = _pilot(root, clocks, age_s=1.0)
    _saves(first, clocks, 6)
    clocks.advance(4.0)  # killed 4 s after its last save
    if not history:
        (root / RECORD_NAME).unlink()
    elif craft is not None:
        doc = _doc(root)
        craft(doc)
        (root / RECORD_NAME).write_text(json.dumps(doc))
    handler = _Collect()
    logging.getLogger("dcp_volumes").addHandler(handler)
    try:
        second = _pilot(root, clocks, age_s=2.0)
        _saves(second, clocks, saves)
    finally:
        logging.getLogger("dcp_volumes").removeHandler(handler)
    return second, clocks, handler.warnings


class _Collect(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.warnings: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.warnings.append(record)


def _storm(doc: Doc) -> None:
    doc["earlier_interruptions"], doc["earlier_exposure_s"] = 10**9, 1


def _day_long_saves(doc: Doc) -> None:
    last = doc["incarnations"][-1]["last_seen"]
    doc["saves"] += [{"kind": "durable", "blocking_s": 86400.0, "background_s": 0.0,
                      "bytes": 1, "at": last, "first": False}] * 5


def _dated_2001(doc: Doc) -> None:
    doc["incarnations"].insert(0, {"started": 1e9 + 1, "last_seen": 1e9 + 100,
                                   "closed": False, "interval_s": 1e9})


def _exposure(doc: Doc) -> None:
    doc["earlier_exposure_s"] = 1e9


def _seen_2286(doc: Doc) -> None:
    doc["incarnations"][-1]["last_seen"] = 9.9e9


CRAFTED = [_storm, _day_long_saves, _dated_2001, _exposure, _seen_2286]


@pytest.mark.parametrize("craft", CRAFTED,
                         ids=["1e9-interruptions", "day-long-saves", "dated-2001",
                              "1e9-exposure", "seen-2286"])
def test_a_crafted_record_is_ignored_once_and_rewritten(
        tmp_path: Path, craft: Callable[[Doc], None]) -> None:
    clean, _, clean_warnings = _restart(tmp_path, "clean", None)
    fresh, _, _ = _restart(tmp_path, "fresh", None, history=False)
    crafted, clocks, warned = _restart(tmp_path, "crafted", craft)
    assert clean_warnings == []
    # the interval: what this run saw alone, near the clean record's (the issue saw 1.0 s,
    # 5,146 s and 6 h where the clean record gives tens of seconds)
    every = crafted.stats()["interval"]["every_s"]
    clean_every = clean.stats()["interval"]["every_s"]
    assert clean_every / 3 <= every <= clean_every * 3, (every, clean_every)
    assert every == pytest.approx(fresh.stats()["interval"]["every_s"])
    # exactly one WARNING, and it says the record was ignored
    assert len(warned) == 1 and "ignored" in warned[0].getMessage(), [
        r.getMessage() for r in warned]
    # the record written back is this run's alone, and clean: nothing carried forward
    doc = _doc(tmp_path / "crafted")
    record, problems = parse_record(json.dumps(doc).encode(), root=doc["root"])
    assert record is not None and problems == []
    assert judge_record(record, now=clocks.wall(), max_interval_s=OPTS.max_interval_s) == []
    assert len(record.incarnations) == 1 and record.incarnations[0].started > T0
    assert (record.earlier_interruptions, record.earlier_exposure_s) == (0, 0.0)
    assert max(s.blocking_s for s in record.saves) < 10.0
    assert record.incarnations[0].last_seen <= clocks.wall()


def _long_clean_history(doc: Doc) -> None:
    """Three days without a failure before the run: a closed incarnation, judged sane."""
    start = doc["incarnations"][0]["started"] - 3 * 86400.0
    doc["incarnations"].insert(0, {"started": start, "last_seen": start + 3 * 86400.0 - 60,
                                   "closed": True, "interval_s": 600.0})


def _long_history_claiming_day_long_saves(doc: Doc) -> None:
    _long_clean_history(doc)
    start = doc["incarnations"][0]["started"]  # within it: consistent with the record's span
    doc["saves"] += [{"kind": "durable", "blocking_s": 86400.0, "background_s": 0.0,
                         "bytes": 1, "at": start + 86400.0 * (1 + i / 10), "first": False}
                        for i in range(5)]


def test_a_claimed_save_cost_is_replaced_by_the_first_measured(tmp_path: Path) -> None:
    """A record consistent in time (its day-long saves fit in its three days) is used, but
    a claimed cost lasts until the run measures one: after this incarnation's first save the
    interval is the one the same history without the claims gives (the median kept the
    claim for ~5 real saves, capped at 6 h each: ~30 h)."""
    honest, _, honest_warnings = _restart(tmp_path, "honest", _long_clean_history, saves=1)
    claimed, _, warned = _restart(tmp_path, "claimed", _long_history_claiming_day_long_saves,
                                  saves=1)
    assert honest_warnings == []
    # not a record to ignore: a claim to replace (until then it set the first interval, at
    # the cap with a "saves will queue" WARNING)
    assert not [r for r in warned if "ignored" in r.getMessage()]
    every = claimed.stats()["interval"]["every_s"]
    assert every == pytest.approx(honest.stats()["interval"]["every_s"], rel=0.01)
    assert every < OPTS.max_interval_s / 4
    assert claimed.stats()["costs"]["durable_blocking_s"] == pytest.approx(1.5)


def test_honest_records_pass_the_judge() -> None:
    """A record folded past 64 incarnations, and one whose clock runs ahead of this host's
    by less than the allowed skew (another host's clock), are what runs write."""
    r = RunRecord(root="s3://b/run")
    for i in range(500):
        r.add_incarnation(Incarnation(T0 + 10 * i, T0 + 10 * i + 5, interval_s=2.0))
    assert r.earlier_incarnations == 500 - 64 and r.first_started == T0
    assert judge_record(r, now=T0 + 5000, max_interval_s=6 * 3600.0) == []
    assert judge_record(r, now=T0 + 5000 - 1000, max_interval_s=6 * 3600.0) == []
    assert judge_record(r, now=T0 + 5000 - 7200, max_interval_s=6 * 3600.0) != []
    r.earlier_incarnations -= 1
    assert judge_record(r, now=T0 + 5000, max_interval_s=6 * 3600.0) != []
