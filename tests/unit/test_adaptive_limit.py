"""The upload concurrency controller against simulated stores (on a virtual clock: no I/O,
no real sleeps), and the reaction to throttling: which answers count as throttles, the per-store AIMD rate
(:class:`StoreThrottle`, on a fake clock), the limit following its cuts, and the choke point
reporting to it.

Real stores are exercised by the conformance suite and the benchmarks; here the two regimes
the controller must tell apart are simulated exactly: a store that serves one part at a time
(CPU-bound: more parts in flight only queue) and one where every connection is capped
(far away: throughput grows with parts in flight).
"""

from __future__ import annotations

import asyncio
import itertools
import pickle
import random
import selectors
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

import pytest
from _error_shapes import AzureErrorShape, ClientErrorShape, HttpErrorShape

from dcp_volumes import errors
from dcp_volumes.backends import open_backend, pacing
from dcp_volumes.backends.base import CallStats
from dcp_volumes.backends.pacing import (
    MIN_RATE,
    RATE_CUT,
    RATE_PROBE,
    RATE_RECOVERY,
    StoreThrottle,
    store_throttle,
)
from dcp_volumes.backends.translate import is_throttle, is_transient
from dcp_volumes.config import RetryOptions, TransferOptions
from dcp_volumes.transfer import adaptive
from dcp_volumes.transfer.adaptive import NEAR_START, AdaptiveLimit

T = TypeVar("T")


class _VirtualSelector(selectors.DefaultSelector):
    """Never blocks: a wait for ``timeout`` seconds moves the loop's clock on instead."""

    def __init__(self, loop: _VirtualTimeLoop) -> None:
        super().__init__()
        self._loop = loop

    def select(self, timeout: float | None = None) -> Any:
        if timeout is None:
            raise RuntimeError("deadlock: every task waits and no timer is due")
        self._loop.now += max(timeout, 0.0)
        return super().select(0)


class _VirtualTimeLoop(asyncio.SelectorEventLoop):
    """An event loop on a virtual clock (like trio's ``MockClock(autojump_threshold=0)``):
    when every task waits, time jumps to the next timer, so ``asyncio.sleep`` takes no real
    time and a simulated store's timings are exact, whatever the machine's load."""

    def __init__(self) -> None:
        self.now = 1000.0
        super().__init__(_VirtualSelector(self))

    def time(self) -> float:
        return self.now


def _virtual_run(main: Callable[[], Awaitable[T]]) -> T:
    """Run ``main()`` on a fresh virtual-time loop."""
    with asyncio.Runner(loop_factory=_VirtualTimeLoop) as runner:
        return runner.run(main())  # type: ignore[arg-type]


def _now() -> float:
    """The running (virtual) loop's clock: the ``clock`` of AdaptiveLimit and StoreThrottle."""
    return asyncio.get_running_loop().time()


async def _one(limit: AdaptiveLimit, serve) -> None:
    async with limit.slot(1 << 20):
        await serve()


def _run_fresh(maximum: int, serve_factory, parts: int) -> AdaptiveLimit:
    """``parts`` parts, all queued at once, through a fresh limit against one store."""
    async def main() -> AdaptiveLimit:
        limit = AdaptiveLimit(maximum, clock=_now)
        serve = serve_factory()
        await asyncio.gather(*(_one(limit, serve) for _ in range(parts)))
        return limit

    return _virtual_run(main)


def _cpu_bound_store(service_s: float):
    def factory():
        lock = asyncio.Lock()

        async def serve() -> None:
            async with lock:  # one part at a time, whatever the concurrency
                await asyncio.sleep(service_s)
        return serve
    return factory


def _far_store(latency_s: float):
    def factory():
        async def serve() -> None:
            await asyncio.sleep(latency_s)  # every connection on its own
        return serve
    return factory


def test_cpu_bound_store_settles_at_the_start_level() -> None:
    limit = _run_fresh(16, _cpu_bound_store(0.02), parts=40)
    assert limit.history == [NEAR_START, 2 * NEAR_START, NEAR_START]
    assert limit.settled and limit.limit == NEAR_START


def test_far_store_climbs_to_the_maximum() -> None:
    limit = _run_fresh(16, _far_store(0.05), parts=60)
    assert limit.history == [2, 4, 8, 16]
    assert limit.settled and limit.limit == 16
    assert limit.levels[8] >= 1.25 * limit.levels[4] >= 1.25 ** 2 * limit.levels[2]


def test_slow_first_request_starts_at_the_maximum() -> None:
    async def main() -> AdaptiveLimit:
        limit = AdaptiveLimit(16, clock=_now)
        limit.note_latency(0.03)
        limit.note_latency(0.0001)  # only the first one counts
        return limit

    limit = _virtual_run(main)
    assert limit.limit == 16 and limit.settled and limit.history == [NEAR_START, 16]


def test_fast_first_request_keeps_the_near_start() -> None:
    async def main() -> AdaptiveLimit:
        limit = AdaptiveLimit(16, clock=_now)
        limit.note_latency(0.001)
        return limit

    limit = _virtual_run(main)
    assert limit.limit == NEAR_START and not limit.settled


def test_fixed_concurrency_never_moves() -> None:
    async def main() -> AdaptiveLimit:
        fixed = AdaptiveLimit(8, adaptive=False, clock=_now)
        fixed.note_latency(1.0)
        tasks = [asyncio.create_task(_one(fixed, _far_store(0.01)())) for _ in range(30)]
        await asyncio.gather(*tasks)
        return fixed

    fixed = _virtual_run(main)
    assert fixed.history == [8] and fixed.limit == 8


def test_windows_the_producer_could_not_fill_decide_nothing() -> None:
    async def main() -> AdaptiveLimit:
        limit = AdaptiveLimit(16, clock=_now)
        serve = _far_store(0.005)()
        tasks = []
        for _ in range(20):  # one part every 20 ms: never 4 in flight
            tasks.append(asyncio.create_task(_one(limit, serve)))
            await asyncio.sleep(0.02)
        await asyncio.gather(*tasks)
        return limit

    limit = _virtual_run(main)
    assert limit.history == [NEAR_START] and not limit.levels


@pytest.mark.parametrize("maximum", [1, 2, 4])
def test_small_maximum_is_respected(maximum: int) -> None:
    limit = _run_fresh(maximum, _far_store(0.01), parts=20)
    assert max(limit.history) <= maximum and limit.limit <= maximum


def test_freeze_keeps_the_limit() -> None:
    async def main() -> AdaptiveLimit:
        limit = AdaptiveLimit(16, clock=_now)
        limit.freeze()
        serve = _far_store(0.01)()
        await asyncio.gather(*(_one(limit, serve) for _ in range(30)))
        return limit

    limit = _virtual_run(main)
    assert limit.history == [NEAR_START] and limit.settled and not limit.levels


# ---- throttling: classification, the store's AIMD rate, the limit following it ------------


def _wrapped(inner: BaseException) -> BaseException:
    """A filesystem re-raising a client error as a builtin (s3fs: ``raise OSError from``)."""
    try:
        try:
            raise inner
        except Exception as e:
            raise OSError("wrapped") from e
    except OSError as outer:
        return outer


THROTTLES = [
    ("s3-slowdown", ClientErrorShape("SlowDown", 503), True),
    ("s3-slowdown-wrapped", _wrapped(ClientErrorShape("SlowDown", 503)), True),
    ("s3-503-no-code", ClientErrorShape(None, 503), True),
    ("s3-service-unavailable", ClientErrorShape("ServiceUnavailable", 503), True),
    ("aws-throttling-400", ClientErrorShape("ThrottlingException", 400), True),
    ("aws-too-many-requests", ClientErrorShape("TooManyRequests", 429), True),
    ("azure-server-busy", AzureErrorShape(503, "ServerBusy"), True),
    ("azure-429", AzureErrorShape(429, None), True),
    ("gcs-429", HttpErrorShape(429), True),
    ("s3-internal-error", ClientErrorShape("InternalError", 500), False),
    ("s3-bad-digest", ClientErrorShape("BadDigest", 400), False),
    ("connection-reset", ConnectionResetError(), False),
    ("not-found", ClientErrorShape("NoSuchKey", 404), False),
    ("ours", errors.UploadError("x"), False),
]


@pytest.mark.parametrize(("exc", "throttle"), [t[1:] for t in THROTTLES],
                         ids=[t[0] for t in THROTTLES])
def test_throttle_classification(exc: BaseException, throttle: bool) -> None:
    assert is_throttle(exc) is throttle
    if throttle:
        assert is_transient(exc)  # every throttle is retried


class _Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def _send(t: StoreThrottle, clock: _Clock, n: int, every_s: float) -> list[float]:
    """``n`` requests taking their turns ``every_s`` apart; their start times."""
    starts = []
    for _ in range(n):
        delay, start = t._reserve()
        clock.now += max(delay, every_s)
        starts.append(start)
    return starts


def test_unthrottled_store_is_never_paced() -> None:
    clock = _Clock()
    t = StoreThrottle(clock=clock)
    for s in _send(t, clock, 50, 0.001):
        t.on_success(s)
    assert t.rate is None and t.cuts == 0
    assert t._reserve()[0] == 0.0


def test_first_throttle_cuts_to_a_fraction_of_what_was_sent() -> None:
    clock = _Clock()
    t = StoreThrottle(clock=clock)
    starts = _send(t, clock, 40, 0.025)  # 40 requests/s
    assert t.on_throttle(starts[-1])
    assert t.rate == pytest.approx(RATE_CUT * 40, rel=0.05)
    assert t.cuts == 1 and t.throttled == 1


def test_a_short_burst_is_measured_over_its_own_length() -> None:
    clock = _Clock()
    t = StoreThrottle(clock=clock)
    starts = _send(t, clock, 5, 0.01)  # 5 requests in 50 ms: ~50/s, not 5/s
    t.on_throttle(starts[-1])
    assert t.rate == pytest.approx(RATE_CUT * 5 / pacing.MEASURE_MIN_S, rel=0.05)


def test_answers_to_the_old_rate_do_not_cut_again() -> None:
    clock = _Clock()
    t = StoreThrottle(clock=clock)
    starts = _send(t, clock, 40, 0.025)
    assert t.on_throttle(starts[-1])
    rate = t.rate
    for s in starts[:-1]:  # every request in flight at the cut comes back throttled
        assert not t.on_throttle(s)
        t.on_success(s)  # and old successes do not count towards recovery either
    assert t.rate == rate and t.cuts == 1 and t.throttled == len(starts)
    later = _send(t, clock, 1, 0.0)[0]  # a request at the new rate is news
    assert t.on_throttle(later)
    assert t.cuts == 2 and t.rate is not None and rate is not None and t.rate < rate


def test_paced_requests_leave_one_interval_apart() -> None:
    clock = _Clock()
    t = StoreThrottle(clock=clock)
    t.on_throttle(_send(t, clock, 20, 0.05)[-1])  # 20/s -> 14/s
    assert t.rate is not None
    delays = [t._reserve()[0] for _ in range(5)]  # five at once: queued
    gap = 1.0 / t.rate
    assert delays == pytest.approx([gap * (i + 1) for i in range(5)], rel=1e-6)


def test_recovery_is_linear_then_probes() -> None:
    clock = _Clock()
    t = StoreThrottle(clock=clock)
    t.on_throttle(_send(t, clock, 50, 0.02)[-1])  # 50/s -> 35/s
    assert t.rate == pytest.approx(RATE_CUT * 50, rel=0.05)
    r0, step = t.rate, t._step
    assert r0 is not None and step == pytest.approx(RATE_RECOVERY * t._peak)
    t.on_success(_send(t, clock, 1, 0.0)[0])
    assert t.rate == pytest.approx(r0 + step / r0)  # per answer: step / rate ...
    cut_at = clock.now
    while clock.now - cut_at < 0.8:  # ... so, sending at the paced rate, + step per second
        delay, s = t._reserve()
        clock.now += delay
        t.on_success(s)
    assert t.rate == pytest.approx(r0 + step * (clock.now - cut_at), rel=0.1)
    clock.now = cut_at + pacing.PROBE_AFTER_S + 0.01  # no cut for a while: probe
    r1 = t.rate
    assert r1 is not None
    t.on_success(_send(t, clock, 1, 0.0)[0])
    assert t.rate == pytest.approx(r1 + RATE_PROBE)  # × e^RATE_PROBE per second


def test_the_step_is_absolute_so_shares_converge() -> None:
    """AIMD converges on equal shares only if every process adds the same requests/s per
    second whatever its current rate: the step follows the peak, not the last rate."""
    clock = _Clock()
    t = StoreThrottle(clock=clock)
    t.on_throttle(_send(t, clock, 50, 0.02)[-1])  # peak 50
    clock.now += 2
    t.on_throttle(_send(t, clock, 1, 0.0)[0])  # cut again, from a lower rate
    assert t.rate is not None and t.rate < 30
    assert t._step == pytest.approx(RATE_RECOVERY * 50, rel=0.05)
    # a process that was cut while it was still starting (5/s) steps like the others
    slow = StoreThrottle(clock=clock)
    slow.on_throttle(_send(slow, clock, 5, 0.2)[-1])
    assert slow._step == pytest.approx(RATE_RECOVERY * pacing.STEP_FLOOR_RATE)


def test_recovery_takes_seconds_not_minutes() -> None:
    """Simulated unthrottled sending at the paced rate: back to the rate before the cut
    within (1 - RATE_CUT) / RATE_RECOVERY seconds (sooner once probing)."""
    clock = _Clock()
    t = StoreThrottle(clock=clock)
    t.on_throttle(_send(t, clock, 100, 0.01)[-1])  # 100/s -> 70/s
    start = clock.now
    while t.rate is not None and t.rate < t._peak:
        delay, s = t._reserve()
        clock.now += delay
        t.on_success(s)
    assert clock.now - start <= 1.05 * (1 - RATE_CUT) / RATE_RECOVERY


def test_rate_has_a_floor() -> None:
    clock = _Clock()
    t = StoreThrottle(clock=clock)
    for _ in range(30):
        clock.now += 10  # alone, one request every 10 s, each throttled
        s = _send(t, clock, 1, 0.0)[0]
        t.on_throttle(s)
    assert t.rate == MIN_RATE


def test_idle_store_is_forgotten() -> None:
    clock = _Clock()
    t = StoreThrottle(clock=clock)
    t.on_throttle(_send(t, clock, 10, 0.01)[-1])
    assert t.rate is not None
    clock.now += pacing.IDLE_RESET_S + 1
    assert t._reserve()[0] == 0.0 and t.rate is None


def test_waiters_requeue_at_the_new_rate_after_a_cut() -> None:
    """A request queued at the old rate starts no earlier than the new rate allows."""
    async def main() -> tuple[list[float], float]:
        t = StoreThrottle(clock=_now)
        t.rate = 200.0  # paced: 5 ms apart
        tasks = [asyncio.create_task(t.turn()) for _ in range(6)]
        await asyncio.sleep(0.006)
        t.on_throttle(t._last)  # a request reserved at the old rate cuts: 200 -> 140/s
        starts = await asyncio.gather(*tasks)
        assert t.rate is not None
        return sorted(starts), t.rate

    starts, rate = _virtual_run(main)
    late = [s for s in starts if s > starts[0] + 0.006]
    gaps = [b - a for a, b in itertools.pairwise(late)]
    assert all(g >= 0.98 / rate for g in gaps)


def test_one_throttle_per_process_and_store() -> None:
    a = store_throttle(("s3", "http://h:1", "bkt"))
    assert store_throttle(("s3", "http://h:1", "bkt")) is a
    assert store_throttle(("s3", "http://h:1", "other")) is not a
    assert store_throttle(("s3", "http://h:2", "bkt")) is not a


def _run_cut(limit: AdaptiveLimit, throttle: StoreThrottle, parts: int, cut_after: int,
             serve_s: float = 0.01) -> None:
    async def main() -> None:
        done = 0

        async def one() -> None:
            nonlocal done
            async with limit.slot(1 << 20):
                await asyncio.sleep(serve_s)
                done += 1
                if done == cut_after:
                    throttle.cuts += 1  # the store throttled someone in this process

        await asyncio.gather(*(one() for _ in range(parts)))

    _virtual_run(main)


def test_limit_halves_on_a_cut_and_climbs_back_one_at_a_time() -> None:
    throttle = StoreThrottle()
    limit = AdaptiveLimit(8, adaptive=False, throttle=throttle, clock=_now)
    _run_cut(limit, throttle, parts=80, cut_after=4)
    assert limit.history == [8, 4, 5, 6, 7, 8]
    assert limit.throttle_cuts == 1 and limit.limit == 8


def test_many_cuts_between_looks_halve_once() -> None:
    throttle = StoreThrottle()
    limit = AdaptiveLimit(8, adaptive=False, throttle=throttle, clock=_now)

    async def main() -> None:
        async with limit.slot(1):
            throttle.cuts += 3
        async with limit.slot(1):
            pass

    _virtual_run(main)
    # the part that saw the cuts does not count towards recovery; the next one does
    assert limit.history == [8, 4, 5] and limit.throttle_cuts == 1


def test_a_cut_ends_the_hill_climb_and_recovery_stops_at_the_old_level() -> None:
    throttle = StoreThrottle()
    limit = AdaptiveLimit(16, throttle=throttle, clock=_now)
    _run_cut(limit, throttle, parts=120, cut_after=9, serve_s=0.05)  # during the climb
    cut_at = limit.history.index(min(limit.history[1:]))
    before = limit.history[cut_at - 1]
    assert limit.history[cut_at] == max(1, before // 2)
    assert limit.settled and max(limit.history[cut_at:]) == before
    assert limit.limit == before


def test_limit_without_a_throttle_ignores_cuts() -> None:
    limit = AdaptiveLimit(8, adaptive=False, throttle=None, clock=_now)
    _run_cut(limit, StoreThrottle(), parts=20, cut_after=2)
    assert limit.history == [8]


class _Flaky:
    """Raises ``exc`` ``times`` times, then answers."""

    def __init__(self, exc: BaseException, times: int) -> None:
        self.exc, self.left, self.calls = exc, times, 0

    async def __call__(self) -> str:
        self.calls += 1
        if self.left:
            self.left -= 1
            raise self.exc
        return "ok"


class _Unpaced(StoreThrottle):
    """Reacts (cuts, counts) but never makes a request wait: for tests of the choke point's
    retry accounting, where the pacing's waits would only slow the test down."""

    async def turn(self) -> float:
        return self._reserve()[1] if self.rate is None else pacing.time.monotonic()


def _memory_backend(tmp_name: str):
    return open_backend(f"memory://throttle-{tmp_name}/ckpt", None,
                        RetryOptions(initial_backoff_s=0.01, max_backoff_s=0.02))


def test_choke_point_reports_throttles_to_the_store(monkeypatch: pytest.MonkeyPatch) -> None:
    backend = _memory_backend("report")
    backend.throttle = StoreThrottle()
    drawn: list[tuple[float, float]] = []
    real_uniform = random.uniform

    def uniform(a: float, b: float) -> float:
        drawn.append((a, b))
        return real_uniform(a, b)

    monkeypatch.setattr("dcp_volumes.backends.base.random.uniform", uniform)
    stats = CallStats()
    fn = _Flaky(ClientErrorShape("SlowDown", 503), 2)
    assert backend.run(lambda: backend.call(fn, op="upload", url="x", stats=stats)) == "ok"
    assert stats.throttled == 2 and stats.retries == 2 and fn.calls == 3
    assert backend.throttle.throttled == 2 and backend.throttle.cuts >= 1
    assert backend.throttle.rate is not None
    assert drawn == [(0, 0.01), (0, 0.02)]  # the backoff keeps its full jitter


@pytest.mark.parametrize("react", [True, False], ids=["reaction-on", "reaction-off"])
def test_throttled_retries_stop_doubling_while_paced(monkeypatch: pytest.MonkeyPatch,
                                                     react: bool) -> None:
    backend = open_backend("memory://throttle-doubling/ckpt", None,
                           RetryOptions(initial_backoff_s=0.001, max_backoff_s=1.0))
    backend.throttle = _Unpaced() if react else None
    drawn: list[float] = []

    def uniform(a: float, b: float) -> float:
        drawn.append(b)
        return 0.0

    monkeypatch.setattr("dcp_volumes.backends.base.random.uniform", uniform)
    fn = _Flaky(ClientErrorShape("SlowDown", 503), 4)
    backend.run(lambda: backend.call(fn, op="upload", url="x"))
    if react:  # full jitter over a backoff that doubles once, then stays
        assert drawn == [0.001, 0.002, 0.002, 0.002]
    else:
        assert drawn == [0.001, 0.002, 0.004, 0.008]
    other = _Flaky(ClientErrorShape("InternalError", 500), 3)  # not a throttle: doubles as ever
    drawn.clear()
    backend.run(lambda: backend.call(other, op="upload", url="x"))
    assert drawn == [0.001, 0.002, 0.004]


class _ServingOthers(_Flaky):
    """Throttled ``times`` times while the store answers the process's other requests (each
    call first records one such answer): a store that rate-limits, not one that is down."""

    def __init__(self, exc: BaseException, times: int, throttle: StoreThrottle) -> None:
        super().__init__(exc, times)
        self.throttle = throttle

    async def __call__(self) -> str:
        self.throttle.on_success(pacing.time.monotonic())
        return await super().__call__()


@pytest.mark.parametrize("react", [True, False], ids=["reaction-on", "reaction-off"])
def test_paced_throttles_spend_a_fraction_of_an_attempt(react: bool) -> None:
    from dcp_volumes.backends.base import THROTTLES_PER_ATTEMPT

    backend = open_backend("memory://throttle-attempts/ckpt", None,
                           RetryOptions(max_attempts=3, initial_backoff_s=0.0))
    throttle = _Unpaced()
    backend.throttle = throttle if react else None
    # (max_attempts - 1) × THROTTLES_PER_ATTEMPT throttles, then an answer, while the store
    # answers the process's other requests
    fn = _ServingOthers(ClientErrorShape("SlowDown", 503), 2 * THROTTLES_PER_ATTEMPT, throttle)
    if react:
        assert backend.run(lambda: backend.call(fn, op="upload", url="x")) == "ok"
        assert fn.calls == 2 * THROTTLES_PER_ATTEMPT + 1
    else:
        with pytest.raises(errors.UploadError, match="SlowDown"):
            backend.run(lambda: backend.call(fn, op="upload", url="x"))
        assert fn.calls == 3
    # other transient errors spend whole attempts either way
    other = _Flaky(ClientErrorShape("InternalError", 500), 3)
    with pytest.raises(errors.UploadError):
        backend.run(lambda: backend.call(other, op="upload", url="x"))
    assert other.calls == 3
    # and max_attempts=1 still means no retry at all
    once = open_backend("memory://throttle-attempts/ckpt", None, RetryOptions(max_attempts=1))
    once.throttle = StoreThrottle()
    single = _Flaky(ClientErrorShape("SlowDown", 503), 1)
    with pytest.raises(errors.UploadError):
        once.run(lambda: once.call(single, op="upload", url="x"))
    assert single.calls == 1


def test_a_store_that_refuses_everything_gets_whole_attempts() -> None:
    """A dead store (503 SlowDown to every request since this one started) fails a request
    after max_attempts, as fast as without the reaction; an answer to another request that
    started before this one does not make it look alive."""
    backend = open_backend("memory://throttle-dead/ckpt", None,
                           RetryOptions(max_attempts=3, initial_backoff_s=0.0))
    throttle = _Unpaced()
    backend.throttle = throttle
    throttle.on_success(pacing.time.monotonic())  # an earlier request was answered
    fn = _Flaky(ClientErrorShape("SlowDown", 503), 100)
    with pytest.raises(errors.UploadError, match="SlowDown"):
        backend.run(lambda: backend.call(fn, op="upload", url="x"))
    assert fn.calls == 3
    assert throttle.throttled == 3


def test_choke_point_does_not_cut_on_other_transient_errors() -> None:
    backend = _memory_backend("other")
    backend.throttle = StoreThrottle()
    stats = CallStats()
    fn = _Flaky(ClientErrorShape("InternalError", 500), 2)
    backend.run(lambda: backend.call(fn, op="upload", url="x", stats=stats))
    assert stats.retries == 2 and stats.throttled == 0
    assert backend.throttle.cuts == 0 and backend.throttle.rate is None


def test_choke_point_without_a_throttle_only_retries() -> None:
    backend = _memory_backend("off")
    backend.throttle = None
    stats = CallStats()
    fn = _Flaky(ClientErrorShape("SlowDown", 503), 2)
    assert backend.run(lambda: backend.call(fn, op="upload", url="x", stats=stats)) == "ok"
    assert stats.throttled == 2


def test_writers_and_readers_share_their_stores_throttle_and_pickle_without_it(
        tmp_path) -> None:
    from dcp_volumes import VolumeReader, VolumeWriter

    url = f"file://{tmp_path}/ckpt"
    writer = VolumeWriter(url)
    reader = VolumeReader(url)
    off = VolumeWriter(url, transfer=TransferOptions(throttle_backoff=False))
    assert writer.backend().throttle is reader.backend().throttle is not None
    assert off.backend().throttle is None
    for obj in (writer, reader, off):
        clone = pickle.loads(pickle.dumps(obj))
        assert clone._backend_obj is None  # config only
    assert pickle.loads(pickle.dumps(off)).backend().throttle is None


@pytest.mark.parametrize(("field", "value"), [("throttle_backoff", "yes"),
                                              ("key_layout", "sharded")],
                         ids=["throttle_backoff-not-bool", "key_layout-unknown"])
def test_transfer_options_validate_the_new_fields(field: str, value: object) -> None:
    with pytest.raises(errors.ConfigError, match=field):
        TransferOptions(**{field: value})  # type: ignore[arg-type]


def test_history_of_a_long_throttled_save_keeps_its_ends() -> None:
    throttle = StoreThrottle()
    limit = AdaptiveLimit(8, adaptive=False, throttle=throttle, clock=_now)

    async def main() -> None:
        for _ in range(100):  # cut, then four clean parts back to 8, a hundred times
            throttle.cuts += 1
            for _ in range(5):
                async with limit.slot(1):
                    pass

    _virtual_run(main)
    assert len(limit.history) == 2 * adaptive.HISTORY_KEEP
    assert limit.history[:3] == [8, 4, 5] and limit.history[-1] == 8
