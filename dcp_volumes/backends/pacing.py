"""How fast this process may send requests to one store: pacing that adapts to throttling.

:class:`StoreThrottle` is how many requests per second this *process* sends to one store
(one per endpoint and bucket, :func:`store_throttle`), shared by every save, load and
catalog call of the process: every request through the choke point
(:meth:`Backend.call <dcp_volumes.backends.base.Backend.call>`) takes its turn here. It
paces nothing until the store first answers SlowDown / 429 / 503; then it cuts the rate
multiplicatively and recovers it additively (AIMD, as TCP does; the AWS SDKs' adaptive
retry mode is a cousin), so that N processes sharing one throttled prefix converge on a
fair share of what the store allows instead of retrying in a storm.

Throttles of requests sent before the last cut do not cut again (they answer the old rate):
one cut per round trip, whatever the number of requests in flight. The per-save limit on
part uploads in flight that follows these cuts is
:class:`~dcp_volumes.transfer.adaptive.AdaptiveLimit`.
"""

from __future__ import annotations

import asyncio
import collections
import os
import threading
import time
from collections.abc import Callable

__all__ = [
    "IDLE_RESET_S",
    "MEASURE_MIN_S",
    "MEASURE_S",
    "MIN_RATE",
    "PROBE_AFTER_S",
    "RATE_CUT",
    "RATE_PROBE",
    "RATE_RECOVERY",
    "STEP_FLOOR_RATE",
    "StoreThrottle",
    "store_throttle",
]

#: a throttle cuts the request rate to this fraction of what was being sent (the AWS SDKs'
#: adaptive mode uses 0.7 too: deep enough to end the throttling within a few round trips,
#: shallow enough that the average stays near the store's limit)
RATE_CUT = 0.7
#: after a cut the rate grows by this fraction of the process's peak rate (the highest it was
#: cut from since it was last idle) per second of requests answered without throttling:
#: linear, and the same absolute step for processes that started alike, which is what makes
#: many processes sharing one limit converge on equal shares (the additive part of AIMD)
RATE_RECOVERY = 0.2
#: the step is at least RATE_RECOVERY × this many requests/s: at small rates, where a
#: process's peak says more about when it started than about what it may send, every
#: process grows by the same absolute step
STEP_FLOOR_RATE = 20.0
#: after this many seconds without a cut the growth turns exponential (by RATE_PROBE of the
#: rate per second): while processes compete, cuts come sooner than this and the growth stays
#: linear; once others are done (or the store scaled up), the freed capacity is found in
#: seconds rather than minutes
PROBE_AFTER_S = 1.0
RATE_PROBE = 1.0
#: the rate never goes below this many requests per second (a process must make progress)
MIN_RATE = 0.5
#: seconds over which the sending rate is measured (the base of a cut)
MEASURE_S = 1.0
#: a burst shorter than this is measured as if it had taken this long
MEASURE_MIN_S = 0.1
#: after this many seconds without a request the store is forgotten: a save minutes later
#: starts unpaced (the store may have scaled its partitions meanwhile)
IDLE_RESET_S = 60.0


class StoreThrottle:
    """The request rate one process may send to one store: AIMD on throttle answers.

    Unpaced (``rate is None``) until the store first throttles. A throttle answer to a
    request sent after the last cut sets ``rate = max(MIN_RATE, RATE_CUT × min(rate,
    measured))``, where ``measured`` is what the process sent over the last
    :data:`MEASURE_S` seconds (over their own span when shorter, at least
    :data:`MEASURE_MIN_S`). Every request answered without throttling afterwards adds
    ``step / rate``, so the rate grows by ``step = RATE_RECOVERY × max(peak,
    STEP_FLOOR_RATE)`` requests/s per second while requests flow, where ``peak`` is the
    highest rate cut from since the store was last forgotten: the same absolute step for processes that started alike,
    which is what makes AIMD converge on equal shares (a step proportional to each one's
    own rate would keep whatever unequal shares the first cuts left). Once
    :data:`PROBE_AFTER_S` passed without a cut, each answer adds :data:`RATE_PROBE`
    instead (exponential growth: capacity that other processes freed is found fast).
    While paced, requests leave at most ``rate`` per second (:meth:`turn`); a cut sends
    requests still waiting for their turn to the back of the queue at the new rate.
    Retries keep their own full jitter on top (the choke point's backoff); the pacing only
    spaces out when requests start.

    Thread-safe and loop-agnostic: any event loop (each backend may run its own) awaits its
    turn here; the shared state is a few numbers behind a lock.
    """

    def __init__(self, key: tuple[str, ...] = (), *,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.key = key
        self._clock = clock
        self.rate: float | None = None  # requests/s; None: not paced
        self.cuts = 0  # multiplicative decreases so far (AdaptiveLimit follows this count)
        self.throttled = 0  # throttle answers seen (cutting or not)
        self.history: list[tuple[float, float]] = []  # (monotonic time, rate) at each cut
        self._lock = threading.Lock()
        self._next = 0.0  # earliest start of the next request while paced
        self._last = -float("inf")  # last start
        self._cut_at = -float("inf")  # when the rate was last cut
        self._step = 0.0  # requests/s regained per second of unthrottled requests
        self._peak = 0.0  # the highest rate cut from since the last reset
        self._answered = -float("inf")  # start time of the latest request answered
        self._starts: collections.deque[float] = collections.deque()

    # ---- the request side --------------------------------------------------------------
    async def turn(self) -> float:
        """Wait until this request may start; returns its start time (pass it back to
        :meth:`on_success` / :meth:`on_throttle`)."""
        while True:
            cuts = self.cuts
            delay, start = self._reserve()
            if delay <= 0:
                return start
            await asyncio.sleep(delay)
            if self.cuts == cuts:
                return start
            # The rate was cut while this request waited: its turn was spaced for the old
            # rate, so it queues again at the new one.

    def _reserve(self) -> tuple[float, float]:
        with self._lock:
            now = self._clock()
            if self.rate is not None and now - self._last > IDLE_RESET_S:
                self.rate = None  # idle long enough: the store's limits are news again
                self._peak = 0.0
            start = now if self.rate is None else max(now, self._next)
            if self.rate is not None:
                self._next = start + 1.0 / self.rate
            self._last = start
            starts = self._starts
            starts.append(start)
            while starts and starts[0] <= now - MEASURE_S:
                starts.popleft()
            return start - now, start

    def on_success(self, started: float) -> None:
        """A request that started at ``started`` was answered (not throttled)."""
        self._answered = max(self._answered, started)  # a race loses one update at worst
        if self.rate is None or started <= self._cut_at:
            return  # not paced, or an answer to the rate before the last cut
        with self._lock:
            if self.rate is not None and started > self._cut_at:
                if self._clock() - self._cut_at < PROBE_AFTER_S:
                    self.rate += self._step / self.rate  # + step per second
                else:
                    self.rate += RATE_PROBE  # × e^RATE_PROBE per second

    def answered_since(self, started: float) -> bool:
        """Whether the store answered (did not throttle) a request of this process that
        started at or after ``started``: a store that throttles while it serves others is
        rate-limiting; one that refuses everything is down, and its refusals are errors."""
        return self._answered >= started

    def on_throttle(self, started: float) -> bool:
        """The store throttled a request that started at ``started``; returns whether this
        cut the rate (once per round trip: answers to the old rate do not cut again)."""
        with self._lock:
            self.throttled += 1
            if started <= self._cut_at:
                return False
            now = self._clock()
            measured = self._measured(now)
            before = measured if self.rate is None else min(self.rate, measured)
            before = max(before, MIN_RATE)
            self.rate = max(MIN_RATE, RATE_CUT * before)
            self._peak = max(self._peak, before)
            self._step = RATE_RECOVERY * max(self._peak, STEP_FLOOR_RATE)
            # Requests that started by now were sent at the old rate: their answers are not
            # news. Those still waiting for their turn queue again (turn()).
            self._cut_at = now
            self._next = now + 1.0 / self.rate
            self.cuts += 1
            self.history.append((now, self.rate))
            del self.history[:-64]
            return True

    def _measured(self, now: float) -> float:
        """Requests per second this process started lately (those over the last
        :data:`MEASURE_S`, over the time they took, at least :data:`MEASURE_MIN_S`)."""
        recent = [t for t in self._starts if t > now - MEASURE_S]
        if not recent:
            return 0.0
        return len(recent) / max(MEASURE_MIN_S, min(MEASURE_S, now - recent[0]))

    def __repr__(self) -> str:
        rate = "unpaced" if self.rate is None else f"{self.rate:.1f}/s"
        return f"<StoreThrottle {rate}, {self.cuts} cuts, {self.throttled} throttled>"


_throttles: dict[tuple[str, ...], StoreThrottle] = {}
_throttles_lock = threading.Lock()


def _forget_after_fork() -> None:
    global _throttles_lock
    _throttles.clear()  # a child process is a new sender, and its lock state is unknown
    _throttles_lock = threading.Lock()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_after_fork)


def store_throttle(key: tuple[str, ...]) -> StoreThrottle:
    """This process's :class:`StoreThrottle` for the store ``key`` names (created once).

    Backends build the key from their scheme, endpoint and bucket
    (:attr:`Backend.store_key <dcp_volumes.backends.base.Backend.store_key>`): every writer,
    reader and catalog call of the process that talks to that bucket shares one.
    """
    with _throttles_lock:
        throttle = _throttles.get(key)
        if throttle is None:
            throttle = _throttles[key] = StoreThrottle(key)
        return throttle
