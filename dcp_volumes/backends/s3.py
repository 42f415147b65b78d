"""S3 (and S3-compatible stores): s3fs for listings, aiobotocore for every upload
(:mod:`~dcp_volumes.backends.s3_upload`) and every ranged read.

Uploads are multipart with every request carrying the part's CRC32C
(``x-amz-checksum-crc32c``), which lets botocore's SHA-256 payload signing be off: a body
damaged in transit is refused by the store (``BadDigest``, retried). ``.metadata`` is
committed with ``If-None-Match: *`` through the raw client, whose HTTP 412 is visible even
where the store's answer lacks the field s3fs needs.
"""

from __future__ import annotations

import functools
import logging
import os
from typing import Any, ClassVar

from dcp_volumes import errors
from dcp_volumes.backends import _s3_delete
from dcp_volumes.backends._ranges import RangeAnswer, range_header, read_body, read_into
from dcp_volumes.backends.base import Backend, CallStats, StaleUpload, to_epoch
from dcp_volumes.backends.s3_upload import S3Sink, s3_checksum
from dcp_volumes.backends.sink import Sink
from dcp_volumes.backends.translate import status_and_code
from dcp_volumes.backends.versions import ObjectVersion, changed

__all__ = ["S3Backend"]

logger = logging.getLogger(__name__)


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
        if start is not None or end is not None:
            start = start or 0
            if end is not None and end <= start:
                return b""
        body, answer = await self._answer(relative, start, end, None)
        async with body:
            return await read_body(body.raw_stream.content, answer)

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
        body, answer = await self._answer(relative, start, end, pin)
        async with body:
            return await read_body(body.raw_stream.content, answer)

    async def _get_into(self, relative: str, out: memoryview, start: int,
                        pin: ObjectVersion | None) -> int:
        # Each piece the HTTP client received is copied once, into ``out``: no joined
        # bytes object, no second copy where a caller assembles a large range.
        if not len(out) or (pin is not None and pin.tag is None):
            return await super()._get_into(relative, out, start, pin)
        body, answer = await self._answer(relative, start, start + len(out), pin)
        async with body:
            return await read_into(body.raw_stream.content, answer, out)

    async def _answer(self, relative: str, start: int | None, end: int | None,
                      pin: ObjectVersion | None) -> tuple[Any, RangeAnswer]:
        """The body of a GET of bytes ``[start, end)`` (the whole object: both None) and
        what the store answered (checked by :func:`~dcp_volumes.backends._ranges.read_body`
        before a byte is read); with ``pin``, If-Match its ETag (another version now raises
        :func:`~dcp_volumes.backends.versions.changed`)."""
        bucket, key, _ = self.fs.split_path(self.path(relative))
        kwargs: dict[str, Any] = {}
        if start is not None:
            kwargs["Range"] = range_header(start, end)
        if pin is not None:
            kwargs["IfMatch"] = pin.tag
        s3 = await self.client()
        try:
            resp = await s3.get_object(Bucket=bucket, Key=key, **kwargs)
        except Exception as exc:
            status, code = status_and_code(exc)
            if pin is not None and (status == 412 or code == "PreconditionFailed"):
                raise changed(self.object_url(relative), pin, None) from exc
            raise
        length = resp.get("ContentLength")
        return resp["Body"], RangeAnswer(
            url=self.object_url(relative), start=start, end=end,
            status=int(resp["ResponseMetadata"]["HTTPStatusCode"]),
            content_range=resp.get("ContentRange"),
            content_length=None if length is None else int(length))

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
        checkpoint's objects in one request, where a DELETE each made one per object), and
        the keys XML cannot carry one by one; missing ones are fine, and every answer is
        checked against the keys asked (:mod:`~dcp_volumes.backends._s3_delete`)."""
        if relatives:
            await _s3_delete.remove(self, await self.client(), relatives, batch=self.delete_batch)
