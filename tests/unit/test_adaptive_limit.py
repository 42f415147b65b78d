"""The upload concurrency controller against simulated stores (event-loop time, no I/O).

Real stores are exercised by the conformance suite and the benchmarks; here the two regimes
the controller must tell apart are simulated exactly: a store that serves one part at a time
(CPU-bound: more parts in flight only queue) and one where every connection is capped
(far away: throughput grows with parts in flight).
"""

from __future__ import annotations

import asyncio

import pytest

from dcp_volumes.transfer.adaptive import NEAR_START, AdaptiveLimit


async def _one(limit: AdaptiveLimit, serve) -> None:
    async with limit.slot(1 << 20):
        await serve()


def _run_fresh(maximum: int, serve_factory, parts: int) -> AdaptiveLimit:
    """``parts`` parts, all queued at once, through a fresh limit against one store."""
    async def main() -> AdaptiveLimit:
        limit = AdaptiveLimit(maximum)
        serve = serve_factory()
        await asyncio.gather(*(_one(limit, serve) for _ in range(parts)))
        return limit

    return asyncio.run(main())


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
        limit = AdaptiveLimit(16)
        limit.note_latency(0.03)
        limit.note_latency(0.0001)  # only the first one counts
        return limit

    limit = asyncio.run(main())
    assert limit.limit == 16 and limit.settled and limit.history == [NEAR_START, 16]


def test_fast_first_request_keeps_the_near_start() -> None:
    async def main() -> AdaptiveLimit:
        limit = AdaptiveLimit(16)
        limit.note_latency(0.001)
        return limit

    limit = asyncio.run(main())
    assert limit.limit == NEAR_START and not limit.settled


def test_fixed_concurrency_never_moves() -> None:
    async def main() -> AdaptiveLimit:
        fixed = AdaptiveLimit(8, adaptive=False)
        fixed.note_latency(1.0)
        tasks = [asyncio.create_task(_one(fixed, _far_store(0.01)())) for _ in range(30)]
        await asyncio.gather(*tasks)
        return fixed

    fixed = asyncio.run(main())
    assert fixed.history == [8] and fixed.limit == 8


def test_windows_the_producer_could_not_fill_decide_nothing() -> None:
    async def main() -> AdaptiveLimit:
        limit = AdaptiveLimit(16)
        serve = _far_store(0.005)()
        tasks = []
        for _ in range(20):  # one part every 20 ms: never 4 in flight
            tasks.append(asyncio.create_task(_one(limit, serve)))
            await asyncio.sleep(0.02)
        await asyncio.gather(*tasks)
        return limit

    limit = asyncio.run(main())
    assert limit.history == [NEAR_START] and not limit.levels


@pytest.mark.parametrize("maximum", [1, 2, 4])
def test_small_maximum_is_respected(maximum: int) -> None:
    limit = _run_fresh(maximum, _far_store(0.01), parts=20)
    assert max(limit.history) <= maximum and limit.limit <= maximum


def test_freeze_keeps_the_limit() -> None:
    async def main() -> AdaptiveLimit:
        limit = AdaptiveLimit(16)
        limit.freeze()
        serve = _far_store(0.01)()
        await asyncio.gather(*(_one(limit, serve) for _ in range(30)))
        return limit

    limit = asyncio.run(main())
    assert limit.history == [NEAR_START] and limit.settled and not limit.levels
