"""Azure Blob Storage (``az://``, ``abfs://``) through adlfs and the async blob SDK.

Shard files are uploaded as staged blocks committed in one ``commit_block_list``;
``.metadata`` is created with ``overwrite=False``. Every SDK call passes
``retry_total=0``: the SDK's own policy waits ~15 s before its first retry, and our choke
point retries instead, with our backoff, and counts the retries.
"""

from __future__ import annotations

import base64
from typing import Any, ClassVar

from dcp_volumes import errors
from dcp_volumes.backends._ranges import RangeAnswer, asked_range
from dcp_volumes.backends.base import Backend, CallStats
from dcp_volumes.backends.sink import Part, Sink
from dcp_volumes.backends.translate import is_connection_error, status_and_code
from dcp_volumes.backends.versions import ObjectVersion, changed

__all__ = ["AzureBackend", "AzureSink"]


class AzureBackend(Backend):
    name = "azure"
    extra = "azure"
    object_store = True
    has_probe: ClassVar[bool] = True

    @classmethod
    def cli_options(cls, *, endpoint: str | None, anon: bool, url: str) -> dict[str, Any]:
        opts: dict[str, Any] = {"account_url": endpoint} if endpoint else {}
        if anon:
            opts["anon"] = True
        return opts

    def blob_client(self, relative: str) -> Any:
        """An async ``BlobClient`` for an object under the root."""
        container, blob, _ = self.fs.split_path(self.path(relative))
        return self.fs.service_client.get_blob_client(container=container, blob=blob)

    async def _ping(self) -> Any:
        container = self.fs.service_client.get_container_client(self.bucket)
        return await container.get_container_properties(retry_total=0)

    async def _get(self, relative: str, start: int | None, end: int | None) -> bytes:
        return await self._download(relative, start, end)

    # ---- reads pinned to a version (backends.versions): If-Match on the ETag ----------
    conditional_reads = True

    async def _get_pinned(self, relative: str, pin: ObjectVersion, start: int,
                          end: int) -> bytes:
        if pin.tag is None or end <= start:
            return await super()._get_pinned(relative, pin, start, end)
        from azure.core import MatchConditions

        try:
            return await self._download(relative, start, end, etag=pin.tag,
                                        match_condition=MatchConditions.IfNotModified)
        except Exception as exc:
            if status_and_code(exc)[0] == 412:
                raise changed(self.object_url(relative), pin, None) from exc
            raise

    async def _download(self, relative: str, start: int | None, end: int | None,
                        **conditions: Any) -> bytes:
        """Bytes ``[start, end)`` (the whole object: both None) through the SDK's
        downloader, each HTTP answer it got checked (:mod:`~dcp_volumes.backends._ranges`):
        the SDK takes any Content-Range's total as the object's size and reads on."""
        if start is not None or end is not None:
            start = start or 0
            if end is not None and end <= start:
                return b""
        url = self.object_url(relative)
        answers: list[RangeAnswer] = []

        def seen(response: Any) -> None:
            """Each answer of the download (a large one has several) as it arrives: one of
            other bytes stops the download before the SDK reads it (or asks for more)."""
            if 200 <= response.http_response.status_code < 300:
                answer = _answer_of(url, response)
                try:
                    answer.expected()
                except errors.RangeMismatchError:
                    response.http_response.internal_response.close()  # its body: unread
                    raise
                answers.append(answer)

        length = None if end is None else end - (start or 0)
        try:
            stream = await self.blob_client(relative).download_blob(
                offset=start, length=length, retry_total=0, raw_response_hook=seen,
                **conditions)
            data: bytes = await stream.readall()
        except Exception as exc:
            if answers and is_connection_error(exc):
                raise answers[-1].short(None, answers[-1].content_length) from exc
            raise
        # each answer's range starts where it was asked: the body is the sum of theirs
        # (an answer the SDK asked again counts once)
        expected = {answer.start: answer.expected() for answer in answers}
        if answers and None not in expected.values():
            answers[0].check_length(len(data), sum(n or 0 for n in expected.values()))
        return data

    async def _put(self, relative: str, data: bytes, *, exclusive: bool) -> None:
        await self.blob_client(relative).upload_blob(data, overwrite=not exclusive,
                                                     retry_total=0)

    def make_sink(self, relative: str, stats: CallStats, part_size: int) -> Sink:
        return AzureSink(self, relative, stats)


def _answer_of(url: str, response: Any) -> RangeAnswer:
    """One HTTP answer of a download (an azure-core ``PipelineResponse``), against the range
    its own request asked for (the SDK's ``x-ms-range``)."""
    request, answer = response.http_request, response.http_response
    start, end = asked_range(request.headers.get("x-ms-range") or request.headers.get("Range"))
    length = answer.headers.get("Content-Length")
    return RangeAnswer(url=url, start=start, end=end, status=answer.status_code,
                       content_range=answer.headers.get("Content-Range"),
                       content_length=int(length) if length and length.isdigit() else None)


class AzureSink(Sink):
    def __init__(self, backend: AzureBackend, relative: str, stats: CallStats) -> None:
        super().__init__(backend, relative, stats)
        self.azure = backend
        self._single = False

    def _client(self) -> Any:
        return self.azure.blob_client(self.relative)

    @staticmethod
    def _block_id(number: int) -> str:
        return base64.b64encode(f"dcpv-{number:08d}".encode()).decode()

    async def put_part(self, part: Part, data: bytes | bytearray | memoryview) -> None:
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
        await self._remove_quietly()
