"""The transfer engine: concurrent part uploads and ranged downloads.

Serialization runs in the caller's thread; every network call runs on the backend's event
loop (fsspec's IO loop for async filesystems), through :meth:`Backend.call`, with at most
``max_concurrency`` requests in flight. Each shard file goes to the store through a *sink*:

- S3: multipart upload (one ``PutObject`` when the file is a single part), parts in parallel.
- Azure Blob: ``stage_block`` in parallel, then ``commit_block_list``.
- local files: ``pwrite`` of parts in parallel, ``fsync`` at the end.
- anything else (GCS, memory, other fsspec backends): the filesystem's own streaming
  writer, parts written in order (GCS resumable uploads are sequential by protocol).
"""

from __future__ import annotations

import asyncio
import base64
import concurrent.futures
import contextlib
import io
import logging
import os
import queue
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

from dcp_volumes import errors
from dcp_volumes._fs import Backend, CallStats, s3_checksum
from dcp_volumes._spool import Part, SpoolFile

__all__ = ["FileUpload", "RangeRequest", "Uploader", "fetch_ranges"]

logger = logging.getLogger(__name__)


def _never(_: BaseException) -> bool:
    return False


class _PartBody(io.BytesIO):
    """A seekable read-only view of a part's bytes for an HTTP request body, with no copy.

    botocore wraps a ``bytes`` body in a ``BytesIO`` (a copy for ``bytearray`` parts), and
    aiohttp sends any other file-like body by reading it in a thread pool, one executor
    round trip per 256 KiB. Being a ``BytesIO``, this view is sent the way aiohttp sends
    in-memory buffers (read on the event loop, no thread hop), yet it holds no second copy
    of the part: every read comes from the caller's buffer.
    """

    def __init__(self, data: bytes | bytearray) -> None:
        super().__init__()
        self._view = memoryview(data).cast("B")
        self._pos = 0

    def getbuffer(self) -> memoryview:
        return self._view[:]

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def writable(self) -> bool:
        return False

    def tell(self) -> int:
        return self._pos

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self._pos, io.SEEK_END: len(self._view)}[whence]
        self._pos = max(0, min(len(self._view), base + offset))
        return self._pos

    def read(self, size: int | None = -1) -> bytes:
        end = len(self._view) if size is None or size < 0 else min(len(self._view),
                                                                    self._pos + size)
        chunk = bytes(self._view[self._pos:end])
        self._pos = max(self._pos, end)
        return chunk

    def read1(self, size: int | None = -1) -> bytes:
        return self.read(size)

    def readinto(self, buffer: Any) -> int:
        n = min(len(buffer), len(self._view) - self._pos)
        buffer[:n] = self._view[self._pos:self._pos + n]
        self._pos += n
        return n

    def getvalue(self) -> bytes:
        return bytes(self._view)

    def write(self, _: Any) -> int:
        raise io.UnsupportedOperation("a part body is read-only")

    def __len__(self) -> int:
        return len(self._view)


# --------------------------------------------------------------------------------------
# Sinks
# --------------------------------------------------------------------------------------
class _Sink:
    """Receives the parts of one object and makes it durable."""

    ordered = False

    def __init__(self, backend: Backend, relative: str, stats: CallStats) -> None:
        self.backend = backend
        self.relative = relative
        self.path = backend.path(relative)
        self.url = backend.object_url(relative)
        self.stats = stats

    async def prepare(self) -> None:
        """Optional early set-up for a file expected to span several parts."""

    async def put_part(self, part: Part, data: bytes | bytearray) -> None:
        raise NotImplementedError

    async def complete(self, nparts: int) -> None:
        raise NotImplementedError

    async def abort(self) -> None:
        """Undo whatever was uploaded (best effort, never raises)."""


class _S3Sink(_Sink):
    """Multipart upload; every request carries the part's CRC32C, which the store verifies.

    The checksum header is what lets :class:`~dcp_volumes._fs.Backend` turn botocore's
    SHA-256 payload signing off on ``http://`` endpoints (see ``_fs.py``): corruption in
    transit is still refused by the store (``BadDigest``, retried), at a quarter of the CPU.
    """

    def __init__(self, backend: Backend, relative: str, stats: CallStats) -> None:
        super().__init__(backend, relative, stats)
        self.bucket, self.key, _ = backend.fs.split_path(self.path)
        self._upload_id: str | None = None
        self._create_lock = asyncio.Lock()
        self._parts: dict[int, dict[str, Any]] = {}
        self._single = False

    async def _client(self) -> Any:
        return await self.backend.fs.set_session()

    async def put_part(self, part: Part, data: bytes | bytearray) -> None:
        s3 = await self._client()
        checksum = s3_checksum(data, part.crc)
        if part.number == 1 and part.final:
            self._single = True
            await self.backend.call(
                lambda: s3.put_object(Bucket=self.bucket, Key=self.key, Body=_PartBody(data),
                                      **checksum),
                op="upload", url=self.url, stats=self.stats,
            )
            return
        await self.prepare()
        resp = await self.backend.call(
            lambda: s3.upload_part(
                Bucket=self.bucket, Key=self.key, UploadId=self._upload_id,
                PartNumber=part.number, Body=_PartBody(data), **checksum,
            ),
            op="upload", url=self.url, stats=self.stats,
        )
        self._parts[part.number] = {"PartNumber": part.number, "ETag": resp["ETag"], **checksum}

    async def prepare(self) -> None:
        """Start the multipart upload (once); called early for files known to be large."""
        async with self._create_lock:
            if self._upload_id is None:
                s3 = await self._client()
                resp = await self.backend.call(
                    lambda: s3.create_multipart_upload(Bucket=self.bucket, Key=self.key,
                                                       ChecksumAlgorithm="CRC32C"),
                    op="upload", url=self.url, stats=self.stats,
                )
                self._upload_id = resp["UploadId"]

    async def complete(self, nparts: int) -> None:
        if self._single:
            if self._upload_id is not None:  # started early, but the file fit in one part
                await self.abort_upload()
            return
        s3 = await self._client()
        parts = [self._parts[n] for n in range(1, nparts + 1)]
        await self.backend.call(
            lambda: s3.complete_multipart_upload(
                Bucket=self.bucket, Key=self.key, UploadId=self._upload_id,
                MultipartUpload={"Parts": parts},
            ),
            op="upload", url=self.url, stats=self.stats,
        )
        self._upload_id = None

    async def abort_upload(self) -> None:
        if self._upload_id is not None:
            s3 = await self._client()
            upload_id, self._upload_id = self._upload_id, None
            await self.backend.call(
                lambda: s3.abort_multipart_upload(
                    Bucket=self.bucket, Key=self.key, UploadId=upload_id),
                op="abort", url=self.url,
            )

    async def abort(self) -> None:
        try:
            await self.abort_upload()
            await self.backend.remove([self.relative])
        except Exception as exc:  # noqa: BLE001 — best effort; gc collects leftovers
            logger.warning("could not clean up %s after a failed save: %s", self.url,
                           type(exc).__name__)


class _AzureSink(_Sink):
    # retry_total=0: the SDK's own policy waits ~15 s before its first retry; our loop
    # (Backend.call) retries instead, with our backoff, and counts the retries.

    def __init__(self, backend: Backend, relative: str, stats: CallStats) -> None:
        super().__init__(backend, relative, stats)
        container, blob, _ = backend.fs.split_path(self.path)
        self.container, self.blob = container, blob
        self._single = False

    def _client(self) -> Any:
        return self.backend.fs.service_client.get_blob_client(
            container=self.container, blob=self.blob)

    @staticmethod
    def _block_id(number: int) -> str:
        return base64.b64encode(f"dcpv-{number:08d}".encode()).decode()

    async def put_part(self, part: Part, data: bytes | bytearray) -> None:
        bc = self._client()
        if part.number == 1 and part.final:
            self._single = True
            await self.backend.call(
                lambda: bc.upload_blob(bytes(data), overwrite=True, retry_total=0),
                op="upload", url=self.url, stats=self.stats,
            )
            return
        await self.backend.call(
            lambda: bc.stage_block(self._block_id(part.number), bytes(data), length=len(data),
                                   retry_total=0),
            op="upload", url=self.url, stats=self.stats,
        )

    async def complete(self, nparts: int) -> None:
        if self._single:
            return
        from azure.storage.blob import BlobBlock

        bc = self._client()
        blocks = [BlobBlock(block_id=self._block_id(n)) for n in range(1, nparts + 1)]
        await self.backend.call(lambda: bc.commit_block_list(blocks, retry_total=0), op="upload",
                                url=self.url, stats=self.stats)

    async def abort(self) -> None:
        try:
            await self.backend.remove([self.relative])
        except Exception as exc:  # noqa: BLE001
            logger.warning("could not clean up %s after a failed save: %s", self.url,
                           type(exc).__name__)


class _LocalSink(_Sink):
    def __init__(self, backend: Backend, relative: str, stats: CallStats) -> None:
        super().__init__(backend, relative, stats)
        self._fd = -1
        self._lock = asyncio.Lock()

    async def _open(self) -> int:
        async with self._lock:
            if self._fd < 0:
                def _do() -> int:
                    os.makedirs(os.path.dirname(self.path), exist_ok=True)
                    return os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
                self._fd = await self.backend.call(lambda: asyncio.to_thread(_do), op="upload",
                                                   url=self.url, retry_if=_never)
            return self._fd

    async def put_part(self, part: Part, data: bytes | bytearray) -> None:
        fd = await self._open()

        def _pwrite() -> None:
            view = memoryview(data)
            done = 0
            while done < len(view):
                done += os.pwrite(fd, view[done:], part.offset + done)

        await self.backend.call(lambda: asyncio.to_thread(_pwrite), op="upload", url=self.url,
                                stats=self.stats, retry_if=_never)

    async def complete(self, nparts: int) -> None:
        fd = await self._open()

        def _sync_close() -> None:
            os.fsync(fd)
            os.close(fd)

        self._fd = -1
        await self.backend.call(lambda: asyncio.to_thread(_sync_close), op="upload",
                                url=self.url, retry_if=_never)

    async def abort(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1
        try:
            os.unlink(self.path)
        except OSError:
            pass


class _StreamSink(_Sink):
    """Writes parts in order through the filesystem's own file object."""

    ordered = True

    def __init__(self, backend: Backend, relative: str, stats: CallStats, part_size: int) -> None:
        super().__init__(backend, relative, stats)
        self._file: Any = None
        self._part_size = part_size

    async def put_part(self, part: Part, data: bytes | bytearray) -> None:
        def _write() -> None:
            if self._file is None:
                kwargs: dict[str, Any] = {}
                if self.backend.kind == "gcs":
                    kwargs["block_size"] = self._part_size
                self._file = self.backend.fs.open(self.path, "wb", **kwargs)
            self._file.write(bytes(data))

        # The filesystem retries inside its writer; a stream cannot be rewound to retry here.
        await self.backend.call(lambda: asyncio.to_thread(_write), op="upload", url=self.url,
                                stats=self.stats, retry_if=_never)

    async def complete(self, nparts: int) -> None:
        f, self._file = self._file, None
        if f is not None:
            await self.backend.call(lambda: asyncio.to_thread(f.close), op="upload",
                                    url=self.url, stats=self.stats, retry_if=_never)

    async def abort(self) -> None:
        f, self._file = self._file, None
        try:
            if f is not None:
                discard = getattr(f, "discard", None)
                await asyncio.to_thread(discard if discard else f.close)
            await self.backend.remove([self.relative])
        except Exception as exc:  # noqa: BLE001
            logger.warning("could not clean up %s after a failed save: %s", self.url,
                           type(exc).__name__)


def make_sink(backend: Backend, relative: str, stats: CallStats, part_size: int) -> _Sink:
    if backend.kind == "s3":
        return _S3Sink(backend, relative, stats)
    if backend.kind == "azure":
        return _AzureSink(backend, relative, stats)
    if backend.kind == "local":
        return _LocalSink(backend, relative, stats)
    return _StreamSink(backend, relative, stats, part_size)


# --------------------------------------------------------------------------------------
# Upload orchestration
# --------------------------------------------------------------------------------------
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


class FileUpload:
    """The upload of one shard file, fed part by part from the spool thread."""

    def __init__(self, uploader: Uploader, relative: str, spool: SpoolFile | None) -> None:
        self.uploader = uploader
        self.relative = relative
        self.spool = spool
        self.sink = make_sink(uploader.backend, relative, uploader.stats,
                              uploader.part_size)
        self._parts: list[concurrent.futures.Future[None]] = []
        self._turn: asyncio.Condition | None = None
        self._next = 1
        self.done: concurrent.futures.Future[None] | None = None

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
                spool = self.spool
                assert spool is not None, "FileUpload.spool is set before parts arrive"
                data = await asyncio.to_thread(spool.read, part)
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
        assert self.spool is not None
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
        self.limit = backend.run(lambda: _make_limit(max_concurrency, adaptive))
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

    def start_file(self, relative: str, spool: SpoolFile | None, *,
                   expected_size: int = 0) -> FileUpload:
        upload = FileUpload(self, relative, spool)
        self.files.append(upload)
        if expected_size > self.part_size:
            # Overlap the multipart set-up request with serializing the first part.
            upload._parts.append(asyncio.run_coroutine_threadsafe(upload.sink.prepare(),
                                                                  self.loop))
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
            for fut in [*f._parts, *([f.done] if f.done is not None else [])]:
                with contextlib.suppress(BaseException):
                    fut.result(timeout=600)

        async def _abort_all() -> None:
            await asyncio.gather(*(f.sink.abort() for f in self.files), return_exceptions=True)

        try:
            self.backend.run(_abort_all, timeout=600)
        except Exception as exc:  # noqa: BLE001
            logger.warning("cleanup after a failed save did not finish: %s", type(exc).__name__)


async def _make_semaphore(n: int) -> asyncio.Semaphore:
    return asyncio.Semaphore(n)


async def _make_limit(n: int, adaptive: bool) -> AdaptiveLimit:
    return AdaptiveLimit(n, adaptive=adaptive)


# --------------------------------------------------------------------------------------
# Ranged downloads
# --------------------------------------------------------------------------------------
@dataclass
class RangeRequest:
    """One GET of ``[start, end)`` of ``relative``; ``items`` is the caller's bookkeeping."""

    relative: str
    start: int
    end: int
    items: list[Any] = field(default_factory=list)


def fetch_ranges(
    backend: Backend,
    ranges: list[RangeRequest],
    *,
    max_concurrency: int,
    chunk_size: int,
    stats: CallStats,
    on_missing: Callable[[RangeRequest, BaseException], BaseException],
) -> Iterator[tuple[RangeRequest, bytes]]:
    """Fetch ``ranges`` concurrently; yield each with its bytes as it arrives.

    At most ``max_concurrency`` GETs are in flight and at most ``2 × max_concurrency``
    fetched ranges wait for the consumer, which bounds memory. A range larger than
    ``chunk_size`` (one large item) is fetched as parallel GETs of ``chunk_size``.
    """
    results: queue.Queue[tuple[RangeRequest | None, Any]] = queue.Queue()
    cancel = threading.Event()
    inflight = backend.run(lambda: _make_semaphore(max_concurrency))
    slots = backend.run(lambda: _make_semaphore(2 * max_concurrency))

    async def _one(req: RangeRequest) -> None:
        await slots.acquire()
        if cancel.is_set():
            slots.release()
            return
        try:
            data = await _fetch_one(req)
            results.put((req, data))
        except BaseException as exc:  # noqa: BLE001 — handed to the consumer
            slots.release()
            if isinstance(exc, errors.ObjectNotFoundError):
                exc = on_missing(req, exc)
            results.put((None, exc))

    async def _get(req: RangeRequest, start: int, end: int) -> bytes:
        async with inflight:
            return await backend.cat(req.relative, start=start, end=end, stats=stats)

    async def _fetch_one(req: RangeRequest) -> bytes | bytearray:
        size = req.end - req.start
        if size <= chunk_size:
            return await _get(req, req.start, req.end)
        # One large item: parallel ranged GETs of chunk_size, assembled in place.
        bounds = [(o, min(o + chunk_size, req.end)) for o in range(req.start, req.end, chunk_size)]
        chunks = await asyncio.gather(*(_get(req, a, b) for a, b in bounds))
        out = bytearray(sum(len(c) for c in chunks))
        pos = 0
        for chunk in chunks:
            out[pos:pos + len(chunk)] = chunk
            pos += len(chunk)
        return out

    async def _all() -> None:
        await asyncio.gather(*(_one(r) for r in ranges))

    done = asyncio.run_coroutine_threadsafe(_all(), backend.loop)
    try:
        for _ in range(len(ranges)):
            req, payload = results.get()
            if req is None:
                raise payload
            try:
                yield req, payload
            finally:
                backend.loop.call_soon_threadsafe(slots.release)
        done.result()
    finally:
        if not done.done():
            # Stopped early (an error, or the consumer gave up): wake every waiting fetch so
            # it sees `cancel` and returns; the first error was already raised.
            cancel.set()
            for _ in range(len(ranges)):
                backend.loop.call_soon_threadsafe(slots.release)
            with contextlib.suppress(BaseException):
                done.result(timeout=120)
