"""S3 (and S3-compatible stores): s3fs for listings, aiobotocore for every upload.

Uploads are multipart with every request carrying the part's CRC32C
(``x-amz-checksum-crc32c``), which lets botocore's SHA-256 payload signing be off: a body
damaged in transit is refused by the store (``BadDigest``, retried). ``.metadata`` is
committed with ``If-None-Match: *`` through the raw client, whose HTTP 412 is visible even
where the store's answer lacks the field s3fs needs.
"""

from __future__ import annotations

import asyncio
import base64
import functools
import io
import logging
import os
from typing import Any, ClassVar

import crc32c

from dcp_volumes import errors
from dcp_volumes.backends.base import Backend, CallStats, StaleUpload, to_epoch
from dcp_volumes.backends.sink import Part, Sink
from dcp_volumes.backends.translate import status_and_code
from dcp_volumes.backends.versions import ObjectVersion, changed

__all__ = ["PartBody", "S3Backend", "S3Sink", "s3_checksum"]

logger = logging.getLogger(__name__)


def s3_checksum(data: bytes | bytearray | memoryview, crc: int | None = None) -> dict[str, str]:
    """The ``ChecksumCRC32C`` argument of an S3 PUT of ``data`` (``crc`` if already known)."""
    value = crc32c.crc32c(data) if crc is None else crc
    return {"ChecksumCRC32C": base64.b64encode(value.to_bytes(4, "big")).decode("ascii")}


class S3Backend(Backend):
    name = "s3"
    extra = "s3"
    object_store = True
    lists_stale_uploads = True
    sends_part_checksums = True
    has_probe: ClassVar[bool] = True

    @classmethod
    def client_options(cls, opts: dict[str, Any]) -> dict[str, Any]:
        config = dict(opts.get("config_kwargs") or {})
        # Our own retry loop is the only one: botocore's would multiply attempts.
        config.setdefault("retries", {"total_max_attempts": 1, "mode": "standard"})
        # Enough pooled connections for every request we put in flight (default 10).
        config.setdefault("max_pool_connections", 64)
        # Every item carries our own end-to-end CRC32C, verified on load; botocore's
        # per-request CRC32 would cost ~a third of the upload CPU on top.
        config.setdefault("request_checksum_calculation", "when_required")
        config.setdefault("response_checksum_validation", "when_required")
        # On http:// endpoints botocore would SHA-256 every request body on the event
        # loop to sign it (~1 CPU-s per GiB, and as much again on the server). Every
        # PUT we make carries a CRC32C header instead (s3_checksum), which the store
        # verifies, as AWS SDKs do by default; headers stay signed.
        s3_config = dict(config.get("s3") or {})
        s3_config.setdefault("payload_signing_enabled", False)
        config["s3"] = s3_config
        return {**opts, "config_kwargs": config}

    @classmethod
    def cli_options(cls, *, endpoint: str | None, anon: bool, url: str) -> dict[str, Any]:
        endpoint = (endpoint or os.environ.get("AWS_ENDPOINT_URL_S3")
                    or os.environ.get("AWS_ENDPOINT_URL"))
        opts: dict[str, Any] = {"endpoint_url": endpoint} if endpoint else {}
        if anon:
            opts["anon"] = True
        return opts

    async def client(self) -> Any:
        """The aiobotocore client s3fs holds."""
        return await self.fs.set_session()

    async def _ping(self) -> Any:
        s3 = await self.client()
        return await s3.head_bucket(Bucket=self.bucket)

    async def _get(self, relative: str, start: int | None, end: int | None) -> bytes:
        # The raw client, not s3fs' cat_file: s3fs retries some errors inside itself, which
        # would hide them from our loop (and from LoadStats.retries) and stretch deadlines.
        bucket, key, _ = self.fs.split_path(self.path(relative))
        kwargs: dict[str, Any] = {}
        if start is not None or end is not None:
            first = start or 0
            if end is not None and end <= first:
                return b""
            kwargs["Range"] = f"bytes={first}-{'' if end is None else end - 1}"
        s3 = await self.client()
        resp = await s3.get_object(Bucket=bucket, Key=key, **kwargs)
        async with resp["Body"] as body:
            return await body.read()  # type: ignore[no-any-return]

    # ---- reads pinned to a version (backends.versions): If-Match on the ETag ----------
    conditional_reads = True

    async def _pin(self, relative: str) -> ObjectVersion:
        bucket, key, _ = self.fs.split_path(self.path(relative))
        s3 = await self.client()
        head = await s3.head_object(Bucket=bucket, Key=key)
        return ObjectVersion(int(head["ContentLength"]), head.get("ETag"))

    async def _get_pinned(self, relative: str, pin: ObjectVersion, start: int,
                          end: int) -> bytes:
        if pin.tag is None or end <= start:
            return await super()._get_pinned(relative, pin, start, end)
        bucket, key, _ = self.fs.split_path(self.path(relative))
        s3 = await self.client()
        try:
            resp = await s3.get_object(Bucket=bucket, Key=key, IfMatch=pin.tag,
                                       Range=f"bytes={start}-{end - 1}")
        except Exception as exc:
            if status_and_code(exc)[0] == 412 or status_and_code(exc)[1] == "PreconditionFailed":
                raise changed(self.object_url(relative), pin, None) from exc
            raise
        async with resp["Body"] as body:
            return await body.read()  # type: ignore[no-any-return]

    async def _put(self, relative: str, data: bytes, *, exclusive: bool) -> None:
        # One PutObject whatever the size (s3fs would go multipart past 2 chunks, where a
        # whole-object checksum is not a valid argument).
        extra: dict[str, Any] = {**s3_checksum(data), "chunksize": max(len(data), 50 << 20)}
        if exclusive:
            extra["mode"] = "create"
        await self.fs_call("pipe_file", self.path(relative), data, **extra)

    async def _commit_once(self, relative: str, data: bytes, *, exclusive: bool,
                           save_id: str) -> None:
        bucket, key, _ = self.fs.split_path(self.path(relative))
        s3 = await self.client()
        kwargs: dict[str, Any] = {"IfNoneMatch": "*"} if exclusive else {}
        # Raw client: SeaweedFS answers a failed If-None-Match without the field s3fs needs to
        # raise FileExistsError; the HTTP 412 is visible here and translated in one place.
        await s3.put_object(Bucket=bucket, Key=key, Body=data, **kwargs, **s3_checksum(data))

    def make_sink(self, relative: str, stats: CallStats, part_size: int) -> Sink:
        return S3Sink(self, relative, stats)

    async def stale_uploads(self, older_than_s: float, now: float) -> list[StaleUpload]:
        bucket, _, key = self.root.partition("/")
        s3 = await self.client()
        out: list[StaleUpload] = []
        kwargs: dict[str, Any] = {"Bucket": bucket, "Prefix": key.rstrip("/") + "/"}
        while True:
            page = await self.call(functools.partial(s3.list_multipart_uploads, **kwargs),
                                   op="list", url=self.url)
            for up in page.get("Uploads", []) or []:
                initiated = to_epoch(up.get("Initiated"))
                if initiated is None or max(0.0, now - initiated) >= older_than_s:
                    out.append(StaleUpload(f"{bucket}/{up['Key']}", up["UploadId"], initiated))
            if not page.get("IsTruncated"):
                return out
            kwargs["KeyMarker"] = page.get("NextKeyMarker", "")
            kwargs["UploadIdMarker"] = page.get("NextUploadIdMarker", "")

    async def abort_upload(self, upload: StaleUpload) -> None:
        bucket, _, key = upload.key.partition("/")
        s3 = await self.client()
        try:
            await self.call(
                lambda: s3.abort_multipart_upload(Bucket=bucket, Key=key,
                                                  UploadId=upload.upload_id),
                op="delete", url=f"{self.scheme}://{upload.key}",
            )
        except errors.ObjectNotFoundError:
            pass  # completed or aborted meanwhile


    #: keys one DeleteObjects request removes (S3's limit)
    delete_batch: ClassVar[int] = 1000

    async def remove(self, relatives: list[str]) -> None:
        """Delete objects with DeleteObjects, :attr:`delete_batch` keys a request (a
        checkpoint's objects in one request, where a DELETE each made one per object);
        missing ones are fine."""
        if not relatives:
            return
        s3 = await self.client()
        keys = [self.path(r).partition("/")[2] for r in relatives]
        n = self.delete_batch
        await asyncio.gather(*(
            self.call(functools.partial(self._delete_batch, s3, keys[i:i + n]), op="delete",
                      url=self.url)
            for i in range(0, len(keys), n)))
        self.fs.invalidate_cache(self.root)

    async def _delete_batch(self, s3: Any, keys: list[str]) -> None:
        """One DeleteObjects request; a key it could not delete raises as its own request
        would have (translated and retried at the choke point: deleting again is harmless)."""
        from botocore.exceptions import ClientError

        out = await s3.delete_objects(Bucket=self.bucket, Delete={
            "Objects": [{"Key": k} for k in keys], "Quiet": True})
        failed = [e for e in out.get("Errors") or [] if e.get("Code") != "NoSuchKey"]
        if failed:
            raise ClientError({"Error": {"Code": failed[0].get("Code"),
                                         "Message": failed[0].get("Message", "")}},
                              "DeleteObjects")


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


class S3Sink(Sink):
    """Multipart upload; every request carries the part's CRC32C, which the store verifies.

    The checksum header is what lets :class:`S3Backend` turn botocore's
    SHA-256 payload signing off on ``http://`` endpoints (see :meth:`S3Backend.client_options`): corruption in
    transit is still refused by the store (``BadDigest``, retried), at a quarter of the CPU.
    """

    def __init__(self, backend: S3Backend, relative: str, stats: CallStats) -> None:
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
