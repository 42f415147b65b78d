"""Google Cloud Storage (``gs://``) through gcsfs.

Shard files go through gcsfs's resumable-upload writer (sequential by protocol, retried
inside gcsfs: the retries are not visible to our loop); ``.metadata`` is created with
``ifGenerationMatch=0`` (fsspec's ``mode="create"``).
"""

from __future__ import annotations

from typing import Any

from dcp_volumes.backends.base import Backend, CallStats
from dcp_volumes.backends.sink import Sink, StreamSink

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
