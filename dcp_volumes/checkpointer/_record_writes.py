"""The autopilot's run-record writes, off the training loop.

A sync save used to write the record (a PUT to the store) inside ``save()``, and an async
one before its waiters woke: a request's round trip on the training loop's path for a
measurement (in the goodput harness it was within the noise of a 1.2 s save; on a distant
store it is not). Here one daemon thread per process writes them. Each root keeps only its newest snapshot (a record is cumulative, so
the newest supersedes every older one) and the thread writes one at a time, so two writes
of one record never race. :meth:`RecordWrites.flush` waits for a root's pending write (at
``close()``; an interpreter exit flushes every root). :meth:`RecordWrites.turn` holds a root
while a Checkpointer reads its record and submits it back with its own incarnation added:
it waits for the root's writes and other turns first, so a second Checkpointer in this
process reads what the first wrote, and the first's read never misses the second's.
:meth:`RecordWrites.start` runs such a turn on a thread of its own (a Checkpointer's
construction does not wait for the store); an exit waits for those threads too. A process
killed with a write pending loses that write, as it would lose one in flight: the record is
a measurement, and the next incarnation's write carries everything the store last held.
"""

from __future__ import annotations

import atexit
import contextlib
import logging
import os
import threading
import time
from collections.abc import Callable, Iterator

__all__ = ["FLUSH_TIMEOUT_S", "RecordWrites", "record_writes"]

logger = logging.getLogger(__name__)

#: the longest a flush waits (a store that hangs must not hang ``close()`` or the exit)
FLUSH_TIMEOUT_S = 120.0


class RecordWrites:
    """Newest-wins writes per key, by one daemon thread (see the module docstring)."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._pending: dict[str, Callable[[], object]] = {}
        self._busy: set[str] = set()
        self._turns: dict[str, int] = {}  # keys whose record turns are reading: how many
        self._started: set[threading.Thread] = set()  # start()'s threads still running
        self._thread: threading.Thread | None = None

    def submit(self, key: str, write: Callable[[], object]) -> None:
        """Run ``write`` in the background, replacing ``key``'s pending write if any."""
        with self._cond:
            self._pending[key] = write
            if self._thread is None:
                self._thread = threading.Thread(target=self._loop, name="dcp-volumes-record",
                                                daemon=True)
                self._thread.start()
            self._cond.notify_all()

    def _idle(self, key: str | None) -> bool:
        if key is None:
            return not self._pending and not self._busy and not self._turns
        return key not in self._pending and key not in self._busy and key not in self._turns

    def flush(self, key: str | None = None, timeout: float = FLUSH_TIMEOUT_S) -> bool:
        """Wait until ``key``'s writes and turns (None: every key's) are done; False on
        timeout."""
        with self._cond:
            if self._cond.wait_for(lambda: self._idle(key), timeout=timeout):
                return True
        logger.warning("autopilot: the run record's write did not finish in %.0f s (the store "
                       "is slow or unreachable): going on without it", timeout)
        return False

    @contextlib.contextmanager
    def turn(self, key: str, timeout: float = FLUSH_TIMEOUT_S) -> Iterator[None]:
        """Hold ``key`` for a read of its record and the :meth:`submit` of what was read
        plus this process's news: first wait (at most ``timeout``) until no write or other
        turn of ``key`` is pending or running; :meth:`flush` waits for the turn."""
        with self._cond:
            if not self._cond.wait_for(lambda: self._idle(key), timeout=timeout):
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

    def start(self, work: Callable[[], object], name: str) -> threading.Thread:
        """Run ``work`` (which takes its turns itself) on a daemon thread of its own, one
        that :meth:`flush_at_exit` waits for."""
        def run() -> None:
            try:
                work()
            finally:
                with self._cond:
                    self._started.discard(thread)

        thread = threading.Thread(target=run, name=name, daemon=True)
        with self._cond:
            self._started.add(thread)
        thread.start()
        return thread

    def flush_at_exit(self, timeout: float = FLUSH_TIMEOUT_S) -> bool:
        """Wait for :meth:`start`'s threads, then for every write: at most ``timeout`` in
        all."""
        deadline = time.monotonic() + timeout
        with self._cond:
            threads = list(self._started)
        for thread in threads:
            thread.join(max(0.0, deadline - time.monotonic()))
        return self.flush(timeout=max(0.0, deadline - time.monotonic()))

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
