"""The training loop never waits for the run record (issue 37, finding 4).

A real S3 server (SeaweedFS) behind the fault proxy, which holds the record's GET or PUT for
longer than any bound here; and a FIFO where the record belongs on a local disk. Before, the
first ``should_save``/``save`` joined the construction's read (a GET held 120 s held it as
long), and ``close()`` and then the exit each waited up to 120 s for a PUT that hung."""

from __future__ import annotations

import json
import os
import stat
import time
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from dcp_volumes import Checkpointer
from dcp_volumes.checkpointer._record_writes import record_writes
from dcp_volumes.goodput import AutopilotOptions
from dcp_volumes.goodput._record import RECORD_NAME, parse_record
from dcp_volumes.testing.faultproxy import FaultProxy, FaultRule

pytestmark = pytest.mark.xdist_group("seaweedfs")
warnings.filterwarnings("ignore", message="torch.distributed is disabled")

#: a deadline small enough for a test (the default is 10 s)
DEADLINE_S = 1.0
OPTS = AutopilotOptions(record_deadline_s=DEADLINE_S)
#: how long the proxy holds the record's request: longer than every bound below
HANG_S = 30.0
#: what a hook, close() or the exit may take with the store hung: well under the old 120 s
#: and under HANG_S, generous for a busy machine
BOUND_S = 10.0
RECORD = r"dcpv-run-record\.json"


class FakeClock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


@pytest.fixture
def proxied(seaweedfs: Any) -> Iterator[tuple[str, dict[str, Any], FaultProxy]]:
    store = seaweedfs.store()
    opts, proxy = store.proxied_options()
    yield f"{store.root}/run", opts, proxy
    proxy.clear_rules()


def _state(step: int) -> dict[str, Any]:
    return {"w": torch.full((8, 8), float(step))}


def _eventually(check: Any, seconds: float = BOUND_S) -> bool:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if check():
            return True
        time.sleep(0.05)
    return bool(check())


def _hung(proxy: FaultProxy, method: str) -> FaultRule:
    return proxy.add_rule(FaultRule(action="delay", delay_s=HANG_S, method=method,
                                    path_regex=RECORD, times=None, name=f"hung {method}"))


def test_a_hung_get_holds_up_neither_the_loop_nor_close(
        proxied: tuple[str, dict[str, Any], FaultProxy]) -> None:
    root, opts, proxy = proxied
    rule = _hung(proxy, "GET")
    clock = FakeClock()
    began = time.monotonic()
    ckpt = Checkpointer(root, storage_options=opts, every_seconds="auto", autopilot=OPTS,
                        clock=clock)
    clock.t += 2.0  # past the first interval (1 s: nothing measured yet)
    assert ckpt.should_save(1)
    assert ckpt.save(1, _state(1))
    assert time.monotonic() - began < BOUND_S  # was: the GET's whole hang
    assert proxy.stats.rule(rule).injected >= 1
    assert _eventually(lambda: ckpt.stats["record"]["timeouts"] >= 1), ckpt.stats["record"]
    assert ckpt.stats["record"]["read"] in ("timed out", "reading")
    assert ckpt.stats["costs"]["saves"] == 1  # this run's own figures meanwhile
    began = time.monotonic()
    ckpt.close()
    assert time.monotonic() - began < BOUND_S


def test_a_hung_put_holds_up_neither_close_nor_the_exit(
        proxied: tuple[str, dict[str, Any], FaultProxy]) -> None:
    root, opts, proxy = proxied
    rule = _hung(proxy, "PUT")
    clock = FakeClock()
    began = time.monotonic()
    ckpt = Checkpointer(root, storage_options=opts, every_seconds="auto", autopilot=OPTS,
                        clock=clock)
    assert ckpt.save(1, _state(1), force=True)
    assert time.monotonic() - began < BOUND_S
    began = time.monotonic()
    ckpt.close()  # waits for the record's write: at most the deadline
    closed_in = time.monotonic() - began
    began = time.monotonic()
    record_writes().flush_at_exit()  # what the interpreter's exit runs: not a second wait
    exit_in = time.monotonic() - began
    assert closed_in + exit_in < BOUND_S, (closed_in, exit_in)  # was 121 s + 187 s
    assert proxy.stats.rule(rule).injected >= 1
    stats = ckpt.stats["record"]
    assert stats["timeouts"] >= 1 and stats["deadline_s"] == DEADLINE_S, stats


def test_a_fifo_where_the_record_belongs_is_replaced(tmp_path: Path) -> None:
    """Not a record (a FIFO would hang its reader or its writer): ignored, and the atomic
    write replaces it; nothing waits on it."""
    root = tmp_path / "run"
    root.mkdir()
    fifo = root / RECORD_NAME
    os.mkfifo(fifo)
    try:
        began = time.monotonic()
        ckpt = Checkpointer(str(root), every_seconds="auto", autopilot=OPTS)
        assert ckpt.save(1, _state(1), force=True)
        ckpt.close()
        assert time.monotonic() - began < BOUND_S
        assert stat.S_ISREG(os.lstat(fifo).st_mode)
        doc = json.loads(fifo.read_bytes())
        record, problems = parse_record(fifo.read_bytes(), root=doc["root"])
        assert record is not None and problems == [] and len(record.saves) == 1
        assert ckpt.stats["record"]["read"] == "ignored"
    finally:
        if stat.S_ISFIFO(os.lstat(fifo).st_mode):  # release a writer blocked on it
            os.close(os.open(fifo, os.O_RDONLY | os.O_NONBLOCK))
