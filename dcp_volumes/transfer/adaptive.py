"""How many part uploads one save on one rank keeps in flight: a limit that adapts to the store.

:class:`AdaptiveLimit` hill-climbs on measured throughput (more parts help a far store, hurt
a CPU-bound one), and when the store throttles it halves and then climbs back one part at a
time. It follows the cuts of the process's request pacing for the store
(:class:`~dcp_volumes.backends.pacing.StoreThrottle`, which lives with the backends: every
request through the choke point takes its turn there).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable
from typing import Any

from dcp_volumes.backends.pacing import StoreThrottle

__all__ = [
    "FAR_STORE_LATENCY_S",
    "HISTORY_KEEP",
    "KEEP_GAIN",
    "NEAR_START",
    "WINDOW_PARTS",
    "AdaptiveLimit",
    "make_limit",
]

#: a round trip this slow (seconds) means a store far away: a large bandwidth-delay product
FAR_STORE_LATENCY_S = 0.010
#: parts in flight to start with when the store looks near (or nothing was timed yet)
NEAR_START = 2
#: a doubling of the limit is kept only when throughput grew by at least this factor
KEEP_GAIN = 1.4
#: parts per measuring window, at least (and at least the limit)
WINDOW_PARTS = 4
#: ``AdaptiveLimit.history`` keeps its first and last this many levels
HISTORY_KEEP = 32


class AdaptiveLimit:
    """How many part uploads may be in flight: hill-climbing on measured throughput.

    More parts in flight help a store far away (each connection is latency- or
    bandwidth-capped, and aggregate throughput grows with connections) and hurt a store
    that is CPU-bound (a local server: parallel parts only add its per-request overhead).
    So the limit starts from the store's round-trip time (the fastest of three cheap
    requests, made while the first part serializes; :meth:`Backend.round_trip_s`): at
    ``maximum`` for a far store, at :data:`NEAR_START` otherwise. It is then doubled, one
    window at a time (a window ends when ``max(WINDOW_PARTS, limit)`` parts started inside
    it have finished; the first window only warms connections up and is not measured), for
    as long as a doubling raises throughput by :data:`KEEP_GAIN`; the first doubling that
    does not is undone and the limit settles at the level before it. Windows
    in which the limit was not reached (the spool could not keep up) decide nothing, and
    once serialization has ended (:meth:`freeze`) the limit stays where it is: the CPU that
    serialization used goes to the uploads then, which would read as a gain from concurrency.

    With ``adaptive=False`` the limit is ``maximum`` throughout, unless the store throttles.

    Given the process's :class:`StoreThrottle` for the store, the limit follows its cuts:
    each cut (by any request of the process to that store) halves the limit (not below 1)
    and ends the hill-climb for good (throughput under throttling says nothing about
    concurrency); then each part finished without a further cut adds one back, up to the
    level the limit had before the first cut. The store's pacing
    (:class:`StoreThrottle`) is what holds the request rate down; the halving only keeps a
    throttled store from seeing the whole window again at once, and a slow climb back
    would leave the rate the pacing allows unused. Lives on the event loop.

    ``clock`` (seconds, monotonic) times the measuring windows; tests pass the clock of a
    simulated store.
    """

    def __init__(self, maximum: int, *, adaptive: bool = True,
                 throttle: StoreThrottle | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.maximum = maximum
        self._clock = clock
        self.adaptive = adaptive
        self.throttle = throttle
        self.throttle_cuts = 0  # halvings made because the store throttled
        self._cuts_seen = throttle.cuts if throttle is not None else 0
        self._recover_to = 0  # the level additive recovery climbs back to (0: never cut)
        self.limit = min(NEAR_START, maximum) if adaptive else maximum
        self.settled = not adaptive or self.limit == maximum
        self.levels: dict[int, float] = {}  # limit -> throughput measured at it (bytes/s)
        self.history: list[int] = [self.limit]
        self._latency_known = False
        self._inflight = 0
        self._waiting = 0
        self._cond = asyncio.Condition()
        self._window_start: float | None = None
        self._window_bytes = 0
        self._window_done = 0
        self._window_full = True
        self._warm = False  # the first window (new connections, first parts) is not measured
        self._wake_task: asyncio.Task[None] | None = None

    def note_latency(self, seconds: float) -> None:
        """The store's round-trip time in seconds (only the first report counts)."""
        if self._latency_known or not self.adaptive:
            return
        self._latency_known = True
        if seconds >= FAR_STORE_LATENCY_S and not self.levels and self.limit < self.maximum:
            self._set(self.maximum)
            self.settled = True
            # Parts may be queued at the old limit; wake them (notify needs the lock).
            self._wake_task = asyncio.get_running_loop().create_task(self._wake())

    def freeze(self) -> None:
        """Serialization is over: keep the current limit for the rest of the save."""
        self.settled = True

    async def _wake(self) -> None:
        async with self._cond:
            self._cond.notify_all()

    @contextlib.asynccontextmanager
    async def slot(self, nbytes: int) -> Any:
        """Hold one of the ``limit`` slots while a part of ``nbytes`` uploads."""
        async with self._cond:
            self._waiting += 1
            try:
                await self._cond.wait_for(lambda: self._inflight < self.limit)
            finally:
                self._waiting -= 1
            self._inflight += 1
            started = self._clock()
            if self._window_start is None:
                self._window_start = started
        ok = False
        try:
            yield
            ok = True
        finally:
            async with self._cond:
                self._inflight -= 1
                cut = self._follow_throttle()
                if ok and not cut:
                    self._recover()
                    self._finished(nbytes, started, self._clock())
                self._cond.notify_all()

    def _follow_throttle(self) -> bool:
        """Halve the limit once for any number of store cuts since the last look."""
        if self.throttle is None or self.throttle.cuts == self._cuts_seen:
            return False
        self._cuts_seen = self.throttle.cuts
        self._recover_to = max(self._recover_to, self.limit)
        self._set(max(1, self.limit // 2))
        self.settled = True
        self.throttle_cuts += 1
        return True

    def _recover(self) -> None:
        """One part finished without a cut since the last look: one more in flight."""
        if self.limit < self._recover_to:
            self._set(self.limit + 1)

    def _finished(self, nbytes: int, started: float, now: float) -> None:
        if self.settled or self._window_start is None:
            return
        self._window_bytes += nbytes
        if started >= self._window_start:
            self._window_done += 1
        if self._waiting == 0:
            self._window_full = False  # a free slot found nothing to send: not our limit
        if self._window_done < max(WINDOW_PARTS, self.limit):
            return
        if self._warm and self._window_full and now > self._window_start:
            self._decide(self._window_bytes / (now - self._window_start))
        self._warm = True
        self._window_start, self._window_bytes, self._window_done = now, 0, 0
        self._window_full = True

    def _decide(self, throughput: float) -> None:
        self.levels[self.limit] = throughput
        smaller = self.limit // 2
        if smaller in self.levels and throughput < KEEP_GAIN * self.levels[smaller]:
            self._set(smaller)  # the doubling bought too little: fewer parts load the store less
            self.settled = True
        elif self.limit >= self.maximum:
            self.settled = True
        else:
            self._set(min(self.maximum, 2 * self.limit))

    def _set(self, limit: int) -> None:
        """Change the limit (callers wake the waiters)."""
        if limit != self.limit:
            self.limit = limit
            self.history.append(limit)
            if len(self.history) > 2 * HISTORY_KEEP:  # a long throttled save: keep the ends
                del self.history[HISTORY_KEEP:-HISTORY_KEEP]


async def make_limit(n: int, adaptive: bool,
                     throttle: StoreThrottle | None = None) -> AdaptiveLimit:
    """An :class:`AdaptiveLimit` created on the running loop (its condition binds to it)."""
    return AdaptiveLimit(n, adaptive=adaptive, throttle=throttle)
