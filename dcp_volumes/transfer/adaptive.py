"""How many part uploads may be in flight: a limit that adapts to the store."""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any

__all__ = ["FAR_STORE_LATENCY_S", "KEEP_GAIN", "NEAR_START", "WINDOW_PARTS", "AdaptiveLimit",
           "make_limit"]

#: a round trip this slow (seconds) means a store far away: a large bandwidth-delay product
FAR_STORE_LATENCY_S = 0.010
#: parts in flight to start with when the store looks near (or nothing was timed yet)
NEAR_START = 2
#: a doubling of the limit is kept only when throughput grew by at least this factor
KEEP_GAIN = 1.4
#: parts per measuring window, at least (and at least the limit)
WINDOW_PARTS = 4


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

    With ``adaptive=False`` the limit is ``maximum`` throughout. Lives on the event loop.
    """

    def __init__(self, maximum: int, *, adaptive: bool = True) -> None:
        self.maximum = maximum
        self.adaptive = adaptive
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
        loop = asyncio.get_running_loop()
        async with self._cond:
            self._waiting += 1
            try:
                await self._cond.wait_for(lambda: self._inflight < self.limit)
            finally:
                self._waiting -= 1
            self._inflight += 1
            started = loop.time()
            if self._window_start is None:
                self._window_start = started
        ok = False
        try:
            yield
            ok = True
        finally:
            async with self._cond:
                self._inflight -= 1
                if ok:
                    self._finished(nbytes, started, loop.time())
                self._cond.notify_all()

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



async def make_limit(n: int, adaptive: bool) -> AdaptiveLimit:
    """An :class:`AdaptiveLimit` created on the running loop (its condition binds to it)."""
    return AdaptiveLimit(n, adaptive=adaptive)
