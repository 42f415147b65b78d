"""Concurrent part uploads of one rank's shard files.

Serialization runs in the caller's thread; every network call runs on the backend's event
loop, through the backend's choke point, with at most ``limit`` parts in flight
(:class:`~dcp_volumes.transfer.adaptive.AdaptiveLimit`; it follows the process's
:class:`~dcp_volumes.backends.pacing.StoreThrottle` for the store, ``backend.throttle``,
when the store throttles). Each shard file goes to the store
through the backend's *sink* (:meth:`Backend.make_sink`): S3 multipart, Azure staged
blocks, local ``pwrite``, or the filesystem's own ordered stream.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import logging
import threading
from collections.abc import Callable

from dcp_volumes import errors
from dcp_volumes._spool import Part, SpoolFile
from dcp_volumes.backends import Backend, CallStats
from dcp_volumes.transfer.adaptive import make_limit

__all__ = ["FileUpload", "Uploader"]

logger = logging.getLogger(__name__)


class FileUpload:
    """The upload of one shard file, fed part by part from the spool thread."""

    def __init__(self, uploader: Uploader, relative: str,
                 make_spool: Callable[..., SpoolFile]) -> None:
        self.uploader = uploader
        self.relative = relative
        self.sink = uploader.backend.make_sink(relative, uploader.stats, uploader.part_size)
        self._parts: list[concurrent.futures.Future[None]] = []
        self._turn: asyncio.Condition | None = None
        self._next = 1
        self.done: concurrent.futures.Future[None] | None = None
        self.spool = make_spool(emit=self.submit)

    def prepare_early(self) -> None:
        """Overlap the sink's set-up request (a multipart start) with serializing part 1."""
        self._parts.append(asyncio.run_coroutine_threadsafe(self.sink.prepare(),
                                                            self.uploader.loop))

    def pending(self) -> list[concurrent.futures.Future[None]]:
        """Every request of this file scheduled so far (for :meth:`Uploader.abort`)."""
        return [*self._parts, *([self.done] if self.done is not None else [])]

    def submit(self, part: Part) -> None:
        """Schedule the upload of ``part`` (called from the spool thread)."""
        fut = asyncio.run_coroutine_threadsafe(self._upload_part(part), self.uploader.loop)
        self._parts.append(fut)

    async def _upload_part(self, part: Part) -> None:
        up = self.uploader
        try:
            if self.sink.ordered:
                if self._turn is None:
                    self._turn = asyncio.Condition()
                async with self._turn:
                    # Polls as well as waits: a failure elsewhere (another thread) must wake
                    # parts queued behind one that will never come.
                    while not (self._next == part.number or up.failed):
                        with contextlib.suppress(asyncio.TimeoutError):
                            await asyncio.wait_for(self._turn.wait(), timeout=0.5)
            if up.failed:
                return
            async with up.limit.slot(part.length):
                if up.failed:  # failed while this part waited for its slot
                    return
                data = await asyncio.to_thread(self.spool.read, part)
                await self.sink.put_part(part, data)
                up.add_bytes(part.length)
        except BaseException as exc:
            up.fail(exc)
            raise
        finally:
            part.done()
            if self.sink.ordered and self._turn is not None:
                async with self._turn:
                    self._next = max(self._next, part.number + 1)
                    self._turn.notify_all()

    def finish(self) -> None:
        """Schedule completion once every part is uploaded (called after spool close)."""
        parts = list(self._parts)
        nparts = self.spool.parts

        async def _complete() -> None:
            results = await asyncio.gather(*(asyncio.wrap_future(f) for f in parts),
                                           return_exceptions=True)
            for r in results:
                if isinstance(r, BaseException):
                    raise r
            await self.sink.complete(nparts)

        self.done = asyncio.run_coroutine_threadsafe(_complete(), self.uploader.loop)


class Uploader:
    """Uploads the shard files of one rank's save; remembers what to undo on failure."""

    def __init__(self, backend: Backend, *, part_size: int, max_concurrency: int,
                 stats: CallStats, adaptive: bool = True) -> None:
        self.backend = backend
        self.loop = backend.loop
        self.part_size = part_size
        self.stats = stats
        self.files: list[FileUpload] = []
        self._failure: BaseException | None = None
        self._lock = threading.Lock()
        self.bytes_uploaded = 0
        self.limit = backend.run(lambda: make_limit(max_concurrency, adaptive,
                                                    backend.throttle))
        # The store's round-trip time decides where the limit starts; measured while the
        # first part serializes (a far store is switched to max_concurrency when it answers).
        self._probe: concurrent.futures.Future[None] | None = None
        if adaptive:
            self._probe = asyncio.run_coroutine_threadsafe(self._measure_round_trip(),
                                                           self.loop)

    async def _measure_round_trip(self) -> None:
        rtt = await self.backend.round_trip_s()
        if rtt is not None:
            self.limit.note_latency(rtt)

    def _stop_probe(self) -> None:
        if self._probe is not None and not self._probe.done():
            self._probe.cancel()

    @property
    def failed(self) -> bool:
        return self._failure is not None

    def fail(self, exc: BaseException) -> None:
        with self._lock:
            if self._failure is None:
                self._failure = exc

    def add_bytes(self, n: int) -> None:
        with self._lock:
            self.bytes_uploaded += n

    def raise_if_failed(self) -> None:
        """Stop the spool thread early once any part failed for good."""
        if self._failure is not None:
            raise self._failure

    def start_file(self, relative: str,
                   make_spool: Callable[..., SpoolFile], *,
                   expected_size: int = 0) -> FileUpload:
        """Begin the upload of ``relative``; ``make_spool(emit=...)`` builds the spool file
        that hands its parts to ``emit`` as they fill."""
        upload = FileUpload(self, relative, make_spool)
        self.files.append(upload)
        if expected_size > self.part_size:
            upload.prepare_early()
        return upload

    def spooling_ended(self) -> None:
        """Called from the spool thread once every file is serialized."""
        self.loop.call_soon_threadsafe(self.limit.freeze)

    def wait(self) -> None:
        """Block until every file is durable; raise the first failure."""
        try:
            for f in self.files:
                if f.done is None:
                    raise errors.UploadError(f"internal error: {f.relative} was never finished")
                try:
                    f.done.result()
                except BaseException as exc:  # noqa: BLE001 — recorded, re-raised below
                    self.fail(exc)
        finally:
            self._stop_probe()  # a save shorter than the probe does not need it any more
        self.raise_if_failed()

    def abort(self) -> None:
        """Cancel what is pending and remove what was uploaded (best effort)."""
        self._stop_probe()
        self.fail(errors.UploadError("save aborted"))
        # Let in-flight requests end (they see the failure and stop) before undoing them;
        # their own errors were recorded by fail() already.
        for f in self.files:
            for fut in f.pending():
                with contextlib.suppress(BaseException):
                    fut.result(timeout=600)

        async def _abort_all() -> None:
            await asyncio.gather(*(f.sink.abort() for f in self.files), return_exceptions=True)

        try:
            self.backend.run(_abort_all, timeout=600)
        except Exception as exc:  # noqa: BLE001
            logger.warning("cleanup after a failed save did not finish: %s", type(exc).__name__)


