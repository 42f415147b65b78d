"""The run lease on a root (checkpointer/_run.py): who may save under a root, judged from an
untrusted marker, with an injected clock so that waiting for a lease to run out is instant."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from dcp_volumes import errors
from dcp_volumes.checkpointer._run import (
    MARKER,
    MAX_MARKER_BYTES,
    Holder,
    RootLease,
    RunIdentity,
    parse_marker,
    run_identity,
)


class FakeTime:
    def __init__(self) -> None:
        self.t = 0.0
        self.on_sleep: list[object] = []

    def clock(self) -> float:
        return self.t

    def sleep(self, s: float) -> None:
        self.t += s
        if self.on_sleep:
            fn = self.on_sleep.pop(0)
            fn()  # type: ignore[operator]


def lease(root: Path, run_id: str, ft: FakeTime | None = None) -> RootLease:
    ft = ft or FakeTime()
    return RootLease(str(root), RunIdentity(run_id, f"inc-{run_id}"), lease_s=8.0,
                     clock=ft.clock, sleep=ft.sleep)


def write_holder(root: Path, **fields: object) -> None:
    base = {"format": 1, "run_id": "other", "incarnation": "inc-other", "host": "elsewhere",
            "pid": 123, "beat": 5, "lease_s": 8.0, "renewed": 1.0e9, "released": False}
    base.update(fields)
    root.mkdir(parents=True, exist_ok=True)
    (root / MARKER).write_text(json.dumps(base))


def holder_of(root: Path) -> Holder:
    h = parse_marker((root / MARKER).read_bytes())
    assert h is not None
    return h


def test_free_root_is_taken_and_released(tmp_path: Path) -> None:
    a = lease(tmp_path, "a")
    assert a.peek() is None
    a.acquire()
    try:
        assert holder_of(tmp_path).run_id == "a" and a.held
        a.renew()
        assert holder_of(tmp_path).beat == 1
    finally:
        a.release()
    assert holder_of(tmp_path).released
    b = lease(tmp_path, "b")
    b.acquire()  # a released root is free at once
    assert holder_of(tmp_path).run_id == "b"
    b.release()


def test_live_holder_of_another_run_on_this_host_is_refused(tmp_path: Path) -> None:
    a = lease(tmp_path, "a")
    a.acquire()
    try:
        with pytest.raises(errors.RootInUseError, match="held by another run: run 'a'"):
            lease(tmp_path, "b").acquire()
        lease(tmp_path, "a").acquire()  # the same run (a restart) takes it over
        assert holder_of(tmp_path).incarnation == "inc-a"
    finally:
        a.release()


def test_dead_process_on_this_host_frees_the_root(tmp_path: Path) -> None:
    proc = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True, check=True)
    write_holder(tmp_path, host=socket.gethostname(), pid=int(proc.stdout), renewed=9e12)
    b = lease(tmp_path, "b")
    b.acquire()  # no wait: its process is gone
    assert holder_of(tmp_path).run_id == "b"
    b.release()


def test_holder_elsewhere_that_stops_beating_is_taken_over_after_one_lease(
        tmp_path: Path) -> None:
    write_holder(tmp_path)
    ft = FakeTime()
    b = lease(tmp_path, "b", ft)
    b.acquire()
    assert ft.t >= 8.0  # waited one whole lease (by the injected clock) before taking it
    assert holder_of(tmp_path).run_id == "b"
    b.release()


def test_holder_elsewhere_that_beats_is_refused(tmp_path: Path) -> None:
    write_holder(tmp_path)
    ft = FakeTime()
    ft.on_sleep.append(lambda: write_holder(tmp_path, beat=6))
    with pytest.raises(errors.RootInUseError, match="run 'other' \\(host elsewhere"):
        lease(tmp_path, "b", ft).acquire()
    assert ft.t < 8.0
    assert holder_of(tmp_path).run_id == "other"


def test_a_renewal_notices_a_takeover(tmp_path: Path) -> None:
    a = lease(tmp_path, "a")
    a.acquire()
    write_holder(tmp_path, run_id="c", incarnation="inc-c")
    a.renew()
    with pytest.raises(errors.RootInUseError, match="taken over by another run"):
        a.check()
    a.release()
    assert holder_of(tmp_path).run_id == "c"  # a released nothing it no longer held


@pytest.mark.parametrize("raw", [
    b"", b"\xff\xfe", b"[]", b"{}", b'{"format": 2}', b"[" * 100_000,
    json.dumps({"format": 1, "run_id": "x" * 1000, "incarnation": "i", "host": "h", "pid": 1,
                "beat": 0, "lease_s": 8.0, "renewed": 0.0, "released": False}).encode(),
    json.dumps({"format": 1, "run_id": "x", "incarnation": "i", "host": "h", "pid": -1,
                "beat": 0, "lease_s": 8.0, "renewed": 0.0, "released": False}).encode(),
    json.dumps({"format": 1, "run_id": "x", "incarnation": "i", "host": "h", "pid": 1,
                "beat": True, "lease_s": 1e300, "renewed": 0.0, "released": False}).encode(),
    b" " * (MAX_MARKER_BYTES + 1),
], ids=["empty", "not-utf8", "list", "no-fields", "newer-format", "deep", "long-text",
        "negative-pid", "bool-and-huge", "too-big"])
def test_untrusted_markers_name_no_holder_and_are_replaced(tmp_path: Path, raw: bytes) -> None:
    assert parse_marker(raw) is None
    tmp_path.mkdir(exist_ok=True)
    (tmp_path / MARKER).write_bytes(raw)
    b = lease(tmp_path, "b")
    b.acquire()
    assert holder_of(tmp_path).run_id == "b"
    b.release()


def test_run_identity_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    for k in ("DCP_VOLUMES_RUN_ID", "TORCHELASTIC_RUN_ID", "SLURM_JOB_ID"):
        monkeypatch.delenv(k, raising=False)
    process_default = run_identity().run_id
    assert run_identity().run_id == process_default  # one per process
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "none")  # torchrun's "no id given"
    assert run_identity().run_id == process_default
    monkeypatch.setenv("SLURM_JOB_ID", "777")
    assert run_identity().run_id == "777"
    monkeypatch.setenv("DCP_VOLUMES_RUN_ID", "mine")
    assert run_identity().run_id == "mine" and run_identity("given").run_id == "given"
    assert run_identity().incarnation != run_identity().incarnation
    with pytest.raises(errors.ConfigError, match="run_id"):
        run_identity("bad\nid")
