"""The autopilot's record writes off the training loop
(:mod:`dcp_volumes.checkpointer._record_writes`): a save does not wait for them, the newest
snapshot of a record wins, a flush waits for it, and a failed write is a WARNING."""

from __future__ import annotations

import logging
import threading

import pytest

from dcp_volumes.checkpointer._record_writes import RecordWrites

WAIT_S = 30.0


def test_a_slow_write_blocks_neither_submit_nor_other_keys_and_the_newest_wins() -> None:
    writes = RecordWrites()
    release, started = threading.Event(), threading.Event()
    done: list[str] = []

    def slow() -> None:
        started.set()
        assert release.wait(WAIT_S)
        done.append("a1")

    writes.submit("a", slow)
    assert started.wait(WAIT_S)  # a1 is in flight and blocked
    for name in ("a2", "a3"):  # returns at once; a3 replaces a2 while a1 is in flight
        writes.submit("a", lambda name=name: done.append(name))  # type: ignore[misc]
    assert not writes.flush("a", timeout=0.05)  # a1 still holds it: not flushed
    release.set()
    assert writes.flush("a", timeout=WAIT_S)
    assert done == ["a1", "a3"]  # in order, one at a time; a2 superseded
    writes.submit("b", lambda: done.append("b"))
    assert writes.flush(timeout=WAIT_S) and done[-1] == "b"


def test_a_failed_write_is_a_warning_and_the_next_one_is_written(
        caplog: pytest.LogCaptureFixture) -> None:
    writes = RecordWrites()
    done: list[int] = []

    def fails() -> None:
        raise OSError("store down")

    writes.submit("a", fails)
    assert writes.flush("a", timeout=WAIT_S)
    writes.submit("a", lambda: done.append(1))
    assert writes.flush("a", timeout=WAIT_S) and done == [1]
    assert any(r.levelno == logging.WARNING and "could not be written" in r.message
               for r in caplog.records)
