"""Google Cloud Storage (``gs://``) through gcsfs.

Shard files go through gcsfs's resumable-upload writer (sequential by protocol, retried
inside gcsfs: the retries are not visible to our loop); ``.metadata`` is created with
``ifGenerationMatch=0`` (fsspec's ``mode="create"``).
"""

from __future__ import annotations

from typing import Any

from dcp_volumes.backends.base import Backend, CallStats
from dcp_volumes.backends.sink import Sink, StreamSink
from dcp_volumes.backends.versions import ObjectVersion, changed

__all__ = ["GCSBackend"]


class _GCSStreamSink(StreamSink):
    def open_kwargs(self) -> dict[str, Any]:
        return {"block_size": self._part_size}


class GCSBackend(Backend):
    name = "gcs"
    extra = "gcs"
    object_store = True
    retries_visible = False

    @classmethod
    def cli_options(cls, *, endpoint: str | None, anon: bool, url: str) -> dict[str, Any]:
        opts: dict[str, Any] = {"endpoint_url": endpoint} if endpoint else {}
        if anon:
            opts["token"] = "anon"
        return opts

    def make_sink(self, relative: str, stats: CallStats, part_size: int) -> Sink:
        return _GCSStreamSink(self, relative, stats, part_size)

    # ---- reads pinned to a version (backends.versions): the object's generation --------
    conditional_reads = True

    async def _get_pinned(self, relative: str, pin: ObjectVersion, start: int,
                          end: int) -> bytes:
        if pin.tag is None or end <= start:
            return await super()._get_pinned(relative, pin, start, end)
        # a read of that generation: gone (another generation replaced it) is a 404
        try:
            data = await self.fs._cat_file_sequential(self.path(relative), start=start,
                                                      end=end, generation=pin.tag)
        except FileNotFoundError as exc:
            raise changed(self.object_url(relative), pin, None) from exc
        return data  # type: ignore[no-any-return]
