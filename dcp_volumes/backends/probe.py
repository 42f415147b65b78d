"""The store's round-trip time, measured once per process and store rather than per save.

Adaptive upload concurrency starts from the store's round trip (:mod:`dcp_volumes.transfer.
adaptive`). Probing it costs a few requests (the fastest of three: the first may pay a TCP
and TLS handshake); made by every rank at every save, they were most of a save's
control-plane requests, growing with the rank count (3 per rank per save, counted at the
store by ``benchmarks/requests.py``). A measurement now stands for :data:`ROUND_TRIP_TTL_S`
per process and store, so the saves of a training job after its first one probe no more.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Awaitable, Callable, Hashable
from typing import Any

__all__ = ["ROUND_TRIP_TTL_S", "forget", "round_trip_s"]

#: how long a measured round trip stands for the store in this process
ROUND_TRIP_TTL_S = 600.0

_MEASURED: dict[Hashable, tuple[float, float]] = {}  # store key -> (seconds, measured at)
_LOCK = threading.Lock()


def forget() -> None:
    """Drop every measurement (the next save of each store probes again)."""
    with _LOCK:
        _MEASURED.clear()


async def round_trip_s(ping: Callable[[], Awaitable[Any]], key: Hashable,
                       samples: int = 3) -> float | None:
    """The fastest of ``samples`` calls of ``ping`` in seconds, or the measurement for
    ``key`` made less than :data:`ROUND_TRIP_TTL_S` ago; ``None`` when a ping fails (a
    probe never fails a save). The fastest ping answered is remembered, even when a later
    one fails or the probe is cancelled."""
    with _LOCK:
        cached = _MEASURED.get(key)
    if cached is not None and time.monotonic() - cached[1] < ROUND_TRIP_TTL_S:
        return cached[0]
    best = float("inf")
    try:
        for _ in range(samples):
            started = time.monotonic()
            try:
                await ping()
            except Exception:  # noqa: BLE001 — a hint only; the save's requests report errors
                return None
            best = min(best, time.monotonic() - started)
    finally:
        # also when the probe is cancelled (an upload that ended first): what it measured
        # stands, so the next save does not probe again
        if best < float("inf"):
            with _LOCK:
                _MEASURED[key] = (best, time.monotonic())
    return best
