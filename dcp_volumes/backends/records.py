"""The plain values of the backends: call counters, listing entries, upload records.

They live apart from :mod:`dcp_volumes.backends.base` so that the sinks
(:mod:`dcp_volumes.backends.sink`) and the store modules share them without importing the
backend they serve.
"""

from __future__ import annotations

import datetime as _dt
import threading
from dataclasses import dataclass
from typing import Any

__all__ = ["Attempts", "CallStats", "ObjectInfo", "StaleUpload", "never_retry", "to_epoch"]


def never_retry(_: BaseException) -> bool:
    """``retry_if`` for calls that cannot be repeated (a stream cannot be rewound)."""
    return False


@dataclass
class CallStats:
    """Counters shared by every call of one save or load (``throttled``: retries that
    answered a throttle, SlowDown / 429 / 503; they are counted in ``retries`` too).

    It also follows the transfer's current run of throttle answers (:meth:`note_throttle`,
    ended by any answered request, :meth:`note_answer`): the choke point fails the transfer
    once the store has throttled it without a break for longer than the retry deadline.
    """

    retries: int = 0
    requests: int = 0
    throttled: int = 0

    def __post_init__(self) -> None:
        self._lock = threading.Lock()
        self._streak = 0  # throttle answers since the last answered request
        self._streak_since: float | None = None  # when the first of them came

    def add(self, *, retries: int = 0, requests: int = 0, throttled: int = 0) -> None:
        with self._lock:
            self.retries += retries
            self.requests += requests
            self.throttled += throttled

    def note_answer(self) -> None:
        """A request of this transfer was answered: a run of throttle answers ends."""
        if self._streak_since is not None:
            with self._lock:
                self._streak, self._streak_since = 0, None

    def throttle_streak(self, now: float) -> tuple[int, float] | None:
        """The current run of throttle answers (count, seconds since the first), if any."""
        with self._lock:
            if self._streak_since is None:
                return None
            return self._streak, now - self._streak_since

    def note_throttle(self, now: float) -> tuple[int, float]:
        """The store throttled a request of this transfer at ``now`` (monotonic seconds);
        returns the throttle answers in a row and the seconds since the first of them."""
        with self._lock:
            if self._streak_since is None:
                self._streak_since = now
            self._streak += 1
            return self._streak, now - self._streak_since


def to_epoch(value: Any) -> float | None:
    """Seconds since the epoch from what stores put in listings (naive datetimes are UTC)."""
    if isinstance(value, bool) or value is None:
        return None
    if isinstance(value, (int, float)):
        return float(value)
    if isinstance(value, _dt.datetime):
        if value.tzinfo is None:
            value = value.replace(tzinfo=_dt.timezone.utc)
        return value.timestamp()
    if isinstance(value, str):
        try:
            return to_epoch(_dt.datetime.fromisoformat(value.replace("Z", "+00:00")))
        except ValueError:
            return None
    return None


@dataclass(frozen=True)
class ObjectInfo:
    """One object found by :meth:`Backend.scan`."""

    name: str  # relative to the root
    size: int
    mtime: float | None  # epoch seconds, when the store reports it


@dataclass(frozen=True)
class StaleUpload:
    """An unfinished multipart upload (invisible to listings, billed by the store)."""

    key: str  # "bucket/key", as the backend names objects
    upload_id: str
    initiated: float | None  # epoch seconds


@dataclass
class Attempts:
    """Where one request through :meth:`Backend.call
    <dcp_volumes.backends.base.Backend.call>` stands."""

    start: float  # monotonic time of the call
    attempt: int = 0
    spent: float = 0.0  # of RetryOptions.max_attempts
    started: float = 0.0  # the current attempt's start, as the throttle reserved it
    first_started: float | None = None
    throttles: int = 0  # throttle answers to this request
