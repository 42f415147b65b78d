"""S3 uploads: a shard file as a multipart upload whose every request carries its part's
CRC32C (``x-amz-checksum-crc32c``), which the store verifies; the part's bytes go to the
HTTP client as views of the spool's buffer (:class:`PartBody`), never copied on the way.

The checksum is the one the spool computed while the bytes were written
(:attr:`~dcp_volumes.backends.sink.Part.crc`): each byte's CRC is taken once.
"""

from __future__ import annotations

import asyncio
import base64
import io
import logging
from typing import Any, Protocol

import crc32c

from dcp_volumes.backends.records import CallStats
from dcp_volumes.backends.sink import Part, Sink, SinkBackend

__all__ = ["PartBody", "S3Sink", "s3_checksum"]

logger = logging.getLogger(__name__)


def s3_checksum(data: bytes | bytearray | memoryview, crc: int | None = None) -> dict[str, str]:
    """The ``ChecksumCRC32C`` argument of an S3 PUT of ``data`` (``crc`` if already known)."""
    value = crc32c.crc32c(data) if crc is None else crc
    return {"ChecksumCRC32C": base64.b64encode(value.to_bytes(4, "big")).decode("ascii")}


class PartBody(io.BytesIO):
    """A seekable read-only view of a part's bytes for an HTTP request body, with no copy.

    botocore wraps a ``bytes`` body in a ``BytesIO`` (a copy for ``bytearray`` parts), and
    aiohttp sends any other file-like body by reading it in a thread pool, one executor
    round trip per 256 KiB. Being a ``BytesIO``, this view is sent the way aiohttp sends
    in-memory buffers (read on the event loop, no thread hop), yet it holds no second copy
    of the part: every read comes from the caller's buffer.
    """

    def __init__(self, data: bytes | bytearray | memoryview) -> None:
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

    def read(self, size: int | None = -1) -> memoryview:  # type: ignore[override]
        # A view, not a copy: the HTTP client writes it to the socket (a transport copies
        # only what the socket did not take at once).
        end = len(self._view) if size is None or size < 0 else min(len(self._view),
                                                                    self._pos + size)
        chunk = self._view[self._pos:end]
        self._pos = max(self._pos, end)
        return chunk

    def read1(self, size: int | None = -1) -> memoryview:  # type: ignore[override]
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


class S3SinkBackend(SinkBackend, Protocol):
    """What an :class:`S3Sink` uses of :class:`~dcp_volumes.backends.s3.S3Backend`."""

    async def client(self) -> Any: ...


class S3Sink(Sink):
    """Multipart upload; every request carries the part's CRC32C, which the store verifies.

    The checksum header is what lets ``S3Backend`` turn botocore's
    SHA-256 payload signing off on ``http://`` endpoints (see ``S3Backend.client_options``): corruption in
    transit is still refused by the store (``BadDigest``, retried), at a quarter of the CPU.
    """

    def __init__(self, backend: S3SinkBackend, relative: str, stats: CallStats) -> None:
        super().__init__(backend, relative, stats)
        self.s3 = backend
        self.bucket, self.key, _ = backend.fs.split_path(self.path)
        self._upload_id: str | None = None
        self._create_lock = asyncio.Lock()
        self._parts: dict[int, dict[str, Any]] = {}
        self._single = False

    async def _client(self) -> Any:
        return await self.s3.client()

    async def put_part(self, part: Part, data: bytes | bytearray | memoryview) -> None:
        s3 = await self._client()
        checksum = s3_checksum(data, part.crc)
        if part.number == 1 and part.final:
            self._single = True
            await self.backend.call(
                lambda: s3.put_object(Bucket=self.bucket, Key=self.key, Body=PartBody(data),
                                      **checksum),
                op="upload", url=self.url, stats=self.stats,
            )
            return
        await self.prepare()
        resp = await self.backend.call(
            lambda: s3.upload_part(
                Bucket=self.bucket, Key=self.key, UploadId=self._upload_id,
                PartNumber=part.number, Body=PartBody(data), **checksum,
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
        except Exception as exc:  # noqa: BLE001 — best effort; gc collects leftovers
            logger.warning("could not abort the upload of %s after a failed save: %s",
                           self.url, type(exc).__name__)
        await self._remove_quietly()
