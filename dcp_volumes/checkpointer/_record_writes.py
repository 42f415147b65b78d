"""The autopilot's run-record writes, off the training loop.

A sync save used to write the record (a PUT to the store) inside ``save()``, and an async
one before its waiters woke: a request's round trip on the training loop's path for a
measurement (in the goodput harness it was within the noise of a 1.2 s save; on a distant
store it is not). Here one daemon thread per process writes them. Each root keeps only its
newest snapshot (a record is cumulative, so the newest supersedes every older one) and the
thread writes one at a time, so two writes of one record never race. :meth:`RecordWrites.turn`
holds a root while a Checkpointer reads its record and submits it back with its own
incarnation added: it waits for the root's writes and other turns first, so a second
Checkpointer in this process reads what the first wrote, and the first's read never misses
the second's. :meth:`RecordWrites.start` runs such a read on a thread of its own (a
Checkpointer's construction does not wait for the store).

Waits are bounded, and never stacked: :meth:`RecordWrites.flush` (``wait()``, ``close()``)
and :meth:`RecordWrites.flush_at_exit` (an interpreter exit) draw on one budget per process
(the autopilot's ``record_deadline_s``): a wait that times out spends what it waited, the
next ones get what is left, and a wait that sees the writes done restores it. A store that
hangs costs ``close()`` and the exit one budget together, not one each. A process killed
with a write pending loses that write, as it would lose one in flight: the record is a
measurement, and the next incarnation's write carries everything the store last held.
"""

from __future__ import annotations

import atexit
import contextlib
import logging
import os
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

from dcp_volumes.goodput import RECORD_DEADLINE_S

__all__ = ["FLUSH_TIMEOUT_S", "RecordWrites", "record_writes"]

logger = logging.getLogger(__name__)

#: the waits' budget unless an autopilot gives its own (a store that hangs must not hang
#: ``close()`` or the exit)
FLUSH_TIMEOUT_S = RECORD_DEADLINE_S


class RecordWrites:
    """Newest-wins writes per key, by one daemon thread (see the module docstring)."""

    def __init__(self, budget_s: float = FLUSH_TIMEOUT_S) -> None:
        self._cond = threading.Condition()
        self._pending: dict[str, Callable[[], object]] = {}
        self._busy: set[str] = set()
        self._turns: dict[str, int] = {}  # keys whose record turns are reading: how many
        #: start()'s threads still running, per key, in the order they started
        self._starting: dict[str, list[threading.Thread]] = {}
        self._thread: threading.Thread | None = None
        self._budget_s, self._spent_s = budget_s, 0.0

    def use_budget(self, seconds: float) -> None:
        """Waits may take ``seconds`` in all (the largest any autopilot of the process asks)."""
        with self._cond:
            self._budget_s = max(self._budget_s, seconds)

    def submit(self, key: str, write: Callable[[], object]) -> None:
        """Run ``write`` in the background, replacing ``key``'s pending write if any."""
        with self._cond:
            self._pending[key] = write
            if self._thread is None:
                self._thread = threading.Thread(target=self._loop, name="dcp-volumes-record",
                                                daemon=True)
                self._thread.start()
            self._cond.notify_all()

    def _idle(self, key: str | None, *, started: bool = True) -> bool:
        """No write or turn of ``key`` (None: of any) pending or running, nor (``started``)
        a :meth:`start` thread."""
        held: list[Any] = [self._pending, self._busy, self._turns]
        if started:
            held.append(self._starting)
        return not any(held) if key is None else all(key not in h for h in held)

    def flush(self, key: str | None = None, timeout: float | None = None) -> bool:
        """Wait until ``key``'s writes, turns and :meth:`start` threads (None: every key's)
        are done, at most ``timeout`` and what is left of the budget; False when they are
        not (a WARNING, and the time waited is spent)."""
        with self._cond:
            left = max(0.0, self._budget_s - self._spent_s)
            limit = left if timeout is None else min(timeout, left)
            began = time.monotonic()
            if self._cond.wait_for(lambda: self._idle(key), timeout=limit):
                self._spent_s = 0.0  # the store answers: the next wait gets the whole budget
                return True
            self._spent_s += time.monotonic() - began
        logger.warning("autopilot: the run record's write did not finish in %.3g s (the store "
                       "is slow or unreachable): going on without it", limit)
        return False

    @contextlib.contextmanager
    def turn(self, key: str, timeout: float = FLUSH_TIMEOUT_S) -> Iterator[None]:
        """Hold ``key`` for a read of its record and the :meth:`submit` of what was read
        plus this process's news: first wait (at most ``timeout``) until no write or other
        turn of ``key`` is pending or running; :meth:`flush` waits for the turn."""
        me = threading.current_thread()

        def ready() -> bool:  # start()'s threads of one key take their turns in order
            order = self._starting.get(key, [])
            return self._idle(key, started=False) and (me not in order or order[0] is me)

        with self._cond:
            if not self._cond.wait_for(ready, timeout=timeout):
                logger.warning("autopilot: the run record's write did not finish in %.0f s "
                               "(the store is slow or unreachable): reading it anyway", timeout)
            self._turns[key] = self._turns.get(key, 0) + 1  # 2 only after a timed-out wait
        try:
            yield
        finally:
            with self._cond:
                self._turns[key] -= 1
                if not self._turns[key]:
                    del self._turns[key]
                self._cond.notify_all()

    def start(self, work: Callable[[], object], name: str, key: str) -> threading.Thread:
        """Run ``work`` (which takes its turns itself) on a daemon thread of its own, one
        that :meth:`flush` of ``key`` and :meth:`flush_at_exit` wait for; the turns of
        ``key`` that such threads take come in the order they were started (a second
        Checkpointer's read never overtakes the first's)."""
        def run() -> None:
            try:
                work()
            finally:
                with self._cond:
                    self._starting[key].remove(thread)
                    if not self._starting[key]:
                        del self._starting[key]
                    self._cond.notify_all()

        thread = threading.Thread(target=run, name=name, daemon=True)
        with self._cond:
            self._starting.setdefault(key, []).append(thread)
        thread.start()
        return thread

    def flush_at_exit(self) -> bool:
        """Wait for :meth:`start`'s threads and every write, at most what is left of the
        budget (what ``close()`` waited for a store that hangs is not waited again)."""
        return self.flush()

    def _loop(self) -> None:
        while True:
            with self._cond:
                self._cond.wait_for(lambda: bool(self._pending))
                key = next(iter(self._pending))
                write = self._pending.pop(key)
                self._busy.add(key)
            try:
                write()
            except Exception:  # a measurement's write never fails a save: logged, dropped
                logger.warning("autopilot: the run record could not be written", exc_info=True)
            finally:
                with self._cond:
                    self._busy.discard(key)
                    self._cond.notify_all()


_WRITES = RecordWrites()


def record_writes() -> RecordWrites:
    """This process's writer (a forked child gets a fresh one: the parent's thread is not
    in it)."""
    return _WRITES


def _after_fork() -> None:
    global _WRITES
    _WRITES = RecordWrites()


def _at_exit() -> None:
    _WRITES.flush_at_exit()


os.register_at_fork(after_in_child=_after_fork)
atexit.register(_at_exit)
