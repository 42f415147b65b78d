# moved verbatim from tests/unit/test_periphery_hardening.py (split by subject, issue 24)
"""A transfer the store keeps throttling fails with an error that says so (issue 18 #6), without
servers.
"""

from __future__ import annotations

import time
import uuid

import pytest
from _error_shapes import ClientErrorShape

from dcp_volumes import errors
from dcp_volumes.backends import open_backend
from dcp_volumes.backends.records import CallStats
from dcp_volumes.config import RetryOptions


class _AlwaysSlowDown:
    def __init__(self) -> None:
        self.calls = 0

    async def __call__(self) -> str:
        self.calls += 1
        raise ClientErrorShape("SlowDown", 503)


def test_a_transfer_throttled_past_the_deadline_fails_saying_so() -> None:
    """Requests of one transfer (sharing CallStats) that only ever get throttle answers: once
    the run of throttles outlasts the deadline, the next throttled request fails at once,
    however many attempts it has left, and the error says what to change."""
    backend = open_backend(f"memory://storm-{uuid.uuid4().hex[:6]}/ckpt", None,
                           RetryOptions(max_attempts=1000, initial_backoff_s=0.01,
                                        max_backoff_s=0.02, deadline_s=0.3))
    backend.throttle = None  # the pacing is not what this is about
    stats = CallStats()
    first = _AlwaysSlowDown()
    with pytest.raises(errors.UploadError, match="kept throttling"):
        backend.run(lambda: backend.call(first, op="upload", url="x", stats=stats))
    started = time.monotonic()
    later = _AlwaysSlowDown()  # the next part of the same save
    with pytest.raises(errors.UploadError) as info:
        backend.run(lambda: backend.call(later, op="upload", url="y", stats=stats))
    assert time.monotonic() - started < 0.25 and later.calls == 1  # no deadline of its own
    message = str(info.value)
    assert "throttle answers in a row" in message and "SlowDown" in message
    assert "max_concurrency" in message and "deadline_s=0.3s" in message


def test_an_answer_ends_the_run_of_throttles() -> None:
    stats = CallStats()
    assert stats.note_throttle(10.0) == (1, 0.0)
    assert stats.note_throttle(12.5) == (2, 2.5)
    stats.note_answer()
    assert stats.throttle_streak(13.0) is None
    assert stats.note_throttle(14.0) == (1, 0.0)
