"""Concurrent part uploads of one rank's shard files.

Serialization runs in the caller's thread and puts each file's parts into a
:class:`~dcp_volumes.saving._parts.PartStream`; the uploader takes them out on the backend's
event loop (:meth:`Uploader.upload`). Every network call runs on that loop, through the backend's choke point, with at most ``limit`` parts in flight
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

from dcp_volumes import errors
from dcp_volumes.backends import Backend, CallStats
from dcp_volumes.saving._parts import PartStream, SpooledPart
from dcp_volumes.transfer.adaptive import make_limit

__all__ = ["FileUpload", "Uploader"]

logger = logging.getLogger(__name__)


class FileUpload:
    """The upload of one shard file: takes its parts from their stream as the spool puts
    them there, uploads each (at most ``limit`` in flight over the whole save), and makes
    the file durable once the stream ends. :attr:`done` settles then."""

    def __init__(self, uploader: Uploader, relative: str, parts: PartStream, *,
                 early: bool) -> None:
        self.uploader = uploader
        self.relative = relative
        self.parts = parts
        self.sink = uploader.backend.make_sink(relative, uploader.stats, uploader.part_size)
        self._turn: asyncio.Condition | None = None
        self._next = 1
        self.done: concurrent.futures.Future[None] = asyncio.run_coroutine_threadsafe(
            self._consume(early), uploader.loop)

    async def _consume(self, early: bool) -> None:
        """Upload every part of the stream, then complete the file (unless the save failed)."""
        # early: overlap the sink's set-up request (a multipart start) with serializing part 1
        tasks = [asyncio.ensure_future(self.sink.prepare())] if early else []
        nparts = 0
        try:
            async for part in self.parts:
                nparts += 1
                tasks.append(asyncio.ensure_future(self._upload_part(part)))
        finally:
            # every request of this file ends before the file completes or is aborted
            results = await asyncio.gather(*tasks, return_exceptions=True)
        for r in results:
            if isinstance(r, BaseException):
                raise r
        self.uploader.raise_if_failed()  # a cancelled stream: never complete a partial file
        await self.sink.complete(nparts)

    async def _upload_part(self, spooled: SpooledPart) -> None:
        up, part = self.uploader, spooled.part
        try:
            if self.sink.ordered:
                await self._wait_turn(part.number)
            if up.failed:
                return
            async with up.limit.slot(part.length):
                if up.failed:  # failed while this part waited for its slot
                    return
                data = await asyncio.to_thread(spooled.read)
                await self.sink.put_part(part, data)
                up.add_bytes(part.length)
        except BaseException as exc:
            up.fail(exc)
            raise
        finally:
            spooled.done()
            if self.sink.ordered and self._turn is not None:
                async with self._turn:
                    self._next = max(self._next, part.number + 1)
                    self._turn.notify_all()

    async def _wait_turn(self, number: int) -> None:
        """An ordered sink's parts go one after another, in order."""
        if self._turn is None:
            self._turn = asyncio.Condition()
        async with self._turn:
            # Polls as well as waits: a failure elsewhere (another thread) must wake parts
            # queued behind one that will never come.
            while not (self._next == number or self.uploader.failed):
                with contextlib.suppress(asyncio.TimeoutError):
                    await asyncio.wait_for(self._turn.wait(), timeout=0.5)


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
        """Record the save's first failure and cancel every file's stream with it (the
        spool's next part raises it)."""
        with self._lock:
            if self._failure is None:
                self._failure = exc
            failure, files = self._failure, list(self.files)
        for f in files:
            f.parts.cancel(failure)

    def add_bytes(self, n: int) -> None:
        with self._lock:
            self.bytes_uploaded += n

    def raise_if_failed(self) -> None:
        """Raise the save's first failure, if any."""
        if self._failure is not None:
            raise self._failure

    def upload(self, relative: str, parts: PartStream, *,
               expected_size: int = 0) -> FileUpload:
        """Upload the file ``relative`` from its ``parts`` as they come (the spool puts them
        there; ``expected_size``: the bytes it will hold, if known)."""
        upload = FileUpload(self, relative, parts, early=expected_size > self.part_size)
        with self._lock:
            self.files.append(upload)
            failure = self._failure
        if failure is not None:
            parts.cancel(failure)
        return upload

    def wait(self) -> None:
        """Once every file is spooled: block until every file is durable; raise the first
        failure."""
        self.loop.call_soon_threadsafe(self.limit.freeze)  # no more files to come
        try:
            for f in self.files:
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
        # Let in-flight requests end (they see the failure and stop; each file's consumer
        # ends once its requests did) before undoing them; their own errors were recorded
        # by fail() already.
        for f in self.files:
            with contextlib.suppress(BaseException):
                f.done.result(timeout=600)

        async def _abort_all() -> None:
            await asyncio.gather(*(f.sink.abort() for f in self.files), return_exceptions=True)

        try:
            self.backend.run(_abort_all, timeout=600)
        except Exception as exc:  # noqa: BLE001
            logger.warning("cleanup after a failed save did not finish: %s", type(exc).__name__)


