"""Azure Blob Storage (``az://``, ``abfs://``) through adlfs and the async blob SDK.

Shard files are uploaded as staged blocks committed in one ``commit_block_list``;
``.metadata`` is created with ``overwrite=False``. Every SDK call passes
``retry_total=0``: the SDK's own policy waits ~15 s before its first retry, and our choke
point retries instead, with our backoff, and counts the retries.
"""

from __future__ import annotations

import base64
from typing import Any, ClassVar

from dcp_volumes.backends.base import Backend, CallStats
from dcp_volumes.backends.sink import Part, Sink
from dcp_volumes.backends.translate import status_and_code
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
        length = None if end is None else end - (start or 0)
        stream = await self.blob_client(relative).download_blob(offset=start, length=length,
                                                                retry_total=0)
        return await stream.readall()  # type: ignore[no-any-return]

    # ---- reads pinned to a version (backends.versions): If-Match on the ETag ----------
    conditional_reads = True

    async def _get_pinned(self, relative: str, pin: ObjectVersion, start: int,
                          end: int) -> bytes:
        if pin.tag is None or end <= start:
            return await super()._get_pinned(relative, pin, start, end)
        from azure.core import MatchConditions

        try:
            stream = await self.blob_client(relative).download_blob(
                offset=start, length=end - start, etag=pin.tag,
                match_condition=MatchConditions.IfNotModified, retry_total=0)
        except Exception as exc:
            if status_and_code(exc)[0] == 412:
                raise changed(self.object_url(relative), pin, None) from exc
            raise
        return await stream.readall()  # type: ignore[no-any-return]

    async def _put(self, relative: str, data: bytes, *, exclusive: bool) -> None:
        await self.blob_client(relative).upload_blob(data, overwrite=not exclusive,
                                                     retry_total=0)

    def make_sink(self, relative: str, stats: CallStats, part_size: int) -> Sink:
        return AzureSink(self, relative, stats)


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
