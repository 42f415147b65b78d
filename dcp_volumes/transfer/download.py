"""Concurrent ranged downloads with bounded memory."""

from __future__ import annotations

import asyncio
import contextlib
import queue
import threading
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any, Generic, Protocol, TypeVar

from dcp_volumes import errors
from dcp_volumes.backends import Backend, CallStats
from dcp_volumes.backends.versions import ObjectVersion

__all__ = ["MIN_SPLIT_GET", "Memory", "RangeRequest", "check_extents", "fanout_chunk",
           "fetch_ranges"]


async def _make_semaphore(n: int) -> asyncio.Semaphore:
    return asyncio.Semaphore(n)


class Memory(Protocol):
    """Memory a range may be read into: exactly the range's bytes (a load's target tensor,
    seen as bytes), so a source that can writes them there and nothing is copied again."""

    def bytes_view(self) -> memoryview:
        """The memory, writable, as unsigned bytes (format ``"B"``), of the range's length."""
        ...


#: what a range's ``items`` are: the caller's spans (a load's needs, a peer's pieces)
S = TypeVar("S")


@dataclass
class RangeRequest(Generic[S]):
    """One GET of ``[start, end)`` of ``relative``; ``items`` is the caller's bookkeeping."""

    relative: str
    start: int
    end: int
    items: list[S] = field(default_factory=list)
    #: where a source that can should read the bytes to, or None
    into: Memory | None = None

#: what :func:`fetch_ranges` yields for a range: its bytes, or why its object could not be
#: read (gone: ``ObjectNotFoundError``; no longer the pinned version: ``CheckpointChangedError``)
Fetched = bytes | bytearray | memoryview | errors.ObjectNotFoundError | errors.CheckpointChangedError


class _Fetches:
    """The event-loop side of :func:`fetch_ranges`: one task per range, results on a queue."""

    def __init__(self, backend: Backend, *, max_concurrency: int, chunk_size: int,
                 stats: CallStats, pins: Mapping[str, ObjectVersion] | None) -> None:
        self.backend = backend
        self.chunk_size = chunk_size
        self.stats = stats
        self.pins = pins or {}
        self.results: queue.Queue[tuple[RangeRequest | None, Any]] = queue.Queue()
        self.cancel = threading.Event()
        self.inflight = backend.run(lambda: _make_semaphore(max_concurrency))
        #: fetched ranges that may wait for the consumer (released as it takes them)
        self.slots = backend.run(lambda: _make_semaphore(2 * max_concurrency))

    async def all(self, ranges: list[RangeRequest]) -> None:
        await asyncio.gather(*(self._one(r) for r in ranges))

    def release_slot(self) -> None:
        """Called from the consumer's thread: one more range may be fetched."""
        self.backend.loop.call_soon_threadsafe(self.slots.release)

    async def _one(self, req: RangeRequest) -> None:
        await self.slots.acquire()
        if self.cancel.is_set():
            self.slots.release()
            return
        try:
            data = await self._fetch_one(req)
            self.results.put((req, data))
        except (errors.ObjectNotFoundError, errors.CheckpointChangedError) as exc:
            self.results.put((req, exc))  # this range's answer: the consumer decides
        except BaseException as exc:  # noqa: BLE001 — handed to the consumer
            self.slots.release()
            self.results.put((None, exc))

    async def _get(self, req: RangeRequest, start: int, end: int) -> bytes:
        pin = self.pins.get(req.relative)
        async with self.inflight:
            if pin is not None:
                return await self.backend.cat_pinned(req.relative, pin, start=start, end=end,
                                                     stats=self.stats)
            return await self.backend.cat(req.relative, start=start, end=end, stats=self.stats)

    async def _fetch_one(self, req: RangeRequest) -> bytes | bytearray | memoryview:
        chunk_size = self.chunk_size
        if req.into is None and req.end - req.start <= chunk_size:
            return await self._get(req, req.start, req.end)
        # One large item: parallel ranged GETs of chunk_size, each read straight into its
        # place in the item's buffer (no chunk held apart and copied again); with ``into``,
        # that buffer is the target's own memory.
        if req.into is not None:
            out: bytearray | memoryview = req.into.bytes_view()
            view = memoryview(out)
        else:
            out = bytearray(req.end - req.start)
            view = memoryview(out)
        bounds = [(o, min(o + chunk_size, req.end)) for o in range(req.start, req.end, chunk_size)]
        try:
            got = await asyncio.gather(*(self._get_into(req, view[a - req.start:b - req.start], a)
                                         for a, b in bounds))
        finally:
            view.release()
        for (a, b), n in zip(bounds, got):
            if n != b - a:  # the object is shorter: the checks report it truncated
                if isinstance(out, memoryview):
                    return out[:a - req.start + n]
                del out[a - req.start + n:]
                break
        return out

    async def _get_into(self, req: RangeRequest, out: memoryview, start: int) -> int:
        async with self.inflight:
            return await self.backend.cat_into(req.relative, out, start=start,
                                               pin=self.pins.get(req.relative),
                                               stats=self.stats)


#: the smallest GET a large range is split into so that it uses the allowed concurrency
MIN_SPLIT_GET = 2 << 20


def fanout_chunk(total: int, max_concurrency: int, chunk_size: int) -> int:
    """The GET size for fetching ``total`` bytes: ``chunk_size``, or less so that they fill
    ``max_concurrency`` GETs (never below :data:`MIN_SPLIT_GET`). A rank that needs a few
    parts' worth would otherwise use a few connections, each as slow as one connection to
    the store is (a 61 MB share in 16 MiB GETs: 4 of 16 connections)."""
    if max_concurrency < 1 or chunk_size < 1:
        return chunk_size
    even = -(-total // max_concurrency)
    return max(min(chunk_size, even), min(chunk_size, MIN_SPLIT_GET))


def fetch_ranges(
    backend: Backend,
    ranges: list[RangeRequest],
    *,
    max_concurrency: int,
    chunk_size: int,
    stats: CallStats,
    pins: Mapping[str, ObjectVersion] | None = None,
) -> Iterator[tuple[RangeRequest, Fetched]]:
    """Fetch ``ranges`` concurrently; yield each with its bytes as it arrives, or with the
    typed error of an object that is gone or (``pins``: the versions to read, by relative
    path) no longer the pinned version. Any other failure is raised.

    At most ``max_concurrency`` GETs are in flight and at most ``2 × max_concurrency``
    fetched ranges wait for the consumer, which bounds memory. A range larger than
    ``chunk_size`` (one large item) is fetched as parallel GETs of ``chunk_size``.
    """
    fetches = _Fetches(backend, max_concurrency=max_concurrency, chunk_size=chunk_size,
                       stats=stats, pins=pins)
    done = asyncio.run_coroutine_threadsafe(fetches.all(ranges), backend.loop)
    try:
        for _ in range(len(ranges)):
            req, payload = fetches.results.get()
            if req is None:
                raise payload
            try:
                yield req, payload
            finally:
                fetches.release_slot()
        done.result()
    finally:
        if not done.done():
            # Stopped early (an error, or the consumer gave up): wake every waiting fetch so
            # it sees `cancel` and returns; the first error was already raised.
            fetches.cancel.set()
            for _ in range(len(ranges)):
                fetches.release_slot()
            with contextlib.suppress(BaseException):
                done.result(timeout=120)


def check_extents(backend: Backend, ranges: list[RangeRequest],
                  sizes: Mapping[str, int] | None = None
                  ) -> tuple[RangeRequest, int | None] | None:
    """Check every planned range against its object's size before any GET.

    The size is the one ``sizes`` holds for the file (the checked manifest's: no request),
    else one size lookup per file (concurrent): a range past the end of its object means
    the checkpoint is truncated, or its metadata claims lengths it does not have, and
    nothing is fetched for it (so a crafted length cannot make a reader issue unbounded
    requests). An object shorter than its manifest says fails the check of the bytes that
    arrive (a short read), missing it fails the GET.

    Returns:
        None when every range fits; else the furthest range of the first file that is
        missing (with None) or ends before that range does (with the object's size).
    """
    ends: dict[str, RangeRequest] = {}
    for r in ranges:
        if r.relative not in ends or r.end > ends[r.relative].end:
            ends[r.relative] = r

    known = sizes or {}

    async def _size(relative: str) -> int | None:
        if relative in known:
            return known[relative]
        return await backend.size(relative)

    async def _sizes() -> list[int | None]:
        return list(await asyncio.gather(*(_size(rel) for rel in ends)))

    for last, size in zip(ends.values(), backend.run(_sizes)):
        if size is None or last.end > size:
            return last, size
    return None
