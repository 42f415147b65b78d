"""The autopilot's record writes off the training loop
(:mod:`dcp_volumes.checkpointer._record_writes`): a save does not wait for them, the newest
snapshot of a record wins, a flush waits for it, and a failed write is a WARNING."""

from __future__ import annotations

import logging
import threading
import time

import pytest

from dcp_volumes.checkpointer._record_writes import RecordWrites

WAIT_S = 30.0


def _held_write(writes: RecordWrites, key: str, done: list[str], name: str) -> threading.Event:
    """Submit a write of ``key`` that is in flight when this returns and appends ``name`` to
    ``done`` once the returned Event is set."""
    release, started = threading.Event(), threading.Event()

    def slow() -> None:
        started.set()
        assert release.wait(WAIT_S)
        done.append(name)

    writes.submit(key, slow)
    assert started.wait(WAIT_S)
    return release


def test_a_slow_write_blocks_neither_submit_nor_other_keys_and_the_newest_wins() -> None:
    writes = RecordWrites()
    done: list[str] = []
    release = _held_write(writes, "a", done, "a1")  # a1 is in flight and blocked
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


def test_a_turn_waits_for_the_keys_writes_and_turns_and_a_flush_waits_for_it() -> None:
    """A Checkpointer's read of the record and its resubmission are one turn: it starts after
    the root's pending write (a second Checkpointer reads what the first wrote) and another
    turn of the root waits for it (the first's read never misses the second's news)."""
    writes = RecordWrites()
    entered = threading.Event()
    order: list[str] = []
    release = _held_write(writes, "a", order, "write")

    def reader() -> None:
        with writes.turn("a"):
            order.append("turn 1")
            entered.set()
            assert release_turn.wait(WAIT_S)
            writes.submit("a", lambda: order.append("turn 1's write"))

    release_turn = threading.Event()
    first = threading.Thread(target=reader)
    first.start()
    assert not entered.wait(0.05)  # the write is in flight: the turn waits for it
    release.set()
    assert entered.wait(WAIT_S) and order == ["write", "turn 1"]
    with writes.turn("b"):  # another key is not held up
        order.append("turn b")
    assert not writes.flush("a", timeout=0.05)  # the turn holds "a"
    second_done = threading.Event()

    def second() -> None:
        with writes.turn("a"):
            order.append("turn 2")
        second_done.set()

    threading.Thread(target=second).start()
    assert not second_done.wait(0.05)  # waits for turn 1 and the write it submits
    release_turn.set()
    first.join(WAIT_S)
    assert second_done.wait(WAIT_S) and writes.flush("a", timeout=WAIT_S)
    assert order == ["write", "turn 1", "turn b", "turn 1's write", "turn 2"]


def test_an_exit_waits_for_a_started_turn_and_the_write_it_submits() -> None:
    """A Checkpointer's construction reads and resubmits its record on a thread of its own
    (:meth:`RecordWrites.start`): an exit without ``close()`` waits for that thread and its
    write, so the incarnation is recorded; a store that hangs bounds the wait."""
    writes = RecordWrites()
    release = threading.Event()
    done: list[str] = []

    def begin() -> None:
        with writes.turn("a"):
            assert release.wait(WAIT_S)
            writes.submit("a", lambda: done.append("incarnation"))

    thread = writes.start(begin, "test-begin", "a")
    assert not writes.flush(timeout=0.05) and done == []  # held: the wait is bounded
    release.set()
    assert writes.flush_at_exit() and done == ["incarnation"]
    assert not thread.is_alive()


def test_close_and_the_exit_share_one_budget() -> None:
    """A store that hangs: ``close()``'s wait spends the budget, and the exit does not wait
    for the same write again (it waited 121 s + 187 s before); once the writes are done, the
    next wait has the whole budget again."""
    budget = 2.0
    writes = RecordWrites(budget_s=budget)
    done: list[str] = []
    release = _held_write(writes, "a", done, "hung")
    began = time.monotonic()
    assert not writes.flush("a")  # close(): the whole budget, then it gives up
    assert time.monotonic() - began >= budget * 0.9
    began = time.monotonic()
    assert not writes.flush_at_exit()  # the exit: nothing left to wait
    assert time.monotonic() - began < budget / 2
    release.set()
    deadline = time.monotonic() + WAIT_S
    while not done and time.monotonic() < deadline:
        time.sleep(0.01)
    assert done == ["hung"] and writes.flush_at_exit()  # done: the budget is whole again
    release = _held_write(writes, "a", done, "hung again")
    began = time.monotonic()
    assert not writes.flush("a")
    assert time.monotonic() - began >= budget * 0.9
    release.set()


def test_a_turn_that_stops_waiting_is_still_held_after_the_first_ends(
        caplog: pytest.LogCaptureFixture) -> None:
    """A store that hangs: a second turn stops waiting after its timeout (a WARNING) and
    reads anyway; when the first turn ends, the second still holds the key."""
    writes = RecordWrites()
    held, release = threading.Event(), threading.Event()

    def first() -> None:
        with writes.turn("a"):
            held.set()
            assert release.wait(WAIT_S)

    thread = threading.Thread(target=first)
    thread.start()
    assert held.wait(WAIT_S)
    caplog.set_level(logging.WARNING)
    with writes.turn("a", timeout=0.05):
        assert any("reading it anyway" in r.message for r in caplog.records)
        release.set()
        thread.join(WAIT_S)
        assert not writes.flush("a", timeout=0.05)  # this turn still holds it
    assert writes.flush("a", timeout=WAIT_S)


def test_started_reads_of_one_key_take_their_turns_in_order() -> None:
    """Two Checkpointers of one root in a process, the second constructed while the first's
    read has not begun (the process killed the first before its restart finished): the
    second's read waits for the first's turn, so it sees the first's incarnation (the
    integration test of an incarnation that dies in its restart was flaky without it)."""
    writes = RecordWrites()
    order: list[str] = []
    go_first, second_waits = threading.Event(), threading.Event()

    def first() -> None:
        assert go_first.wait(WAIT_S)  # its thread got no CPU yet
        with writes.turn("a"):
            order.append("first")

    def second() -> None:
        second_waits.set()
        with writes.turn("a"):
            order.append("second")

    writes.start(first, "first", "a")
    writes.start(second, "second", "a")
    assert second_waits.wait(WAIT_S)
    assert not writes.flush("a", timeout=0.1) and order == []
    go_first.set()
    assert writes.flush("a", timeout=WAIT_S) and order == ["first", "second"]
