"""Google Cloud Storage (``gs://``) through gcsfs.

Shard files go through gcsfs's resumable-upload writer (sequential by protocol, retried
inside gcsfs: the retries are not visible to our loop); ``.metadata`` is created with
``ifGenerationMatch=0`` (fsspec's ``mode="create"``).
"""

from __future__ import annotations

from typing import Any

from dcp_volumes.backends._ranges import RangeAnswer, range_header, read_body
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

    async def _get(self, relative: str, start: int | None, end: int | None) -> bytes:
        return await self._download(relative, start, end, None)

    # ---- reads pinned to a version (backends.versions): the object's generation --------
    conditional_reads = True

    async def _get_pinned(self, relative: str, pin: ObjectVersion, start: int,
                          end: int) -> bytes:
        if pin.tag is None or end <= start:
            return await super()._get_pinned(relative, pin, start, end)
        # a read of that generation: gone (another generation replaced it) is a 404
        try:
            return await self._download(relative, start, end, pin.tag)
        except FileNotFoundError as exc:
            raise changed(self.object_url(relative), pin, None) from exc

    async def _download(self, relative: str, start: int | None, end: int | None,
                        generation: str | None) -> bytes:
        """One GET of bytes ``[start, end)`` (the whole object: both None) through gcsfs's
        session, its answer checked (:mod:`~dcp_volumes.backends._ranges`) before a byte is
        used: gcsfs' ``cat_file`` returns any 2xx body as it is, and retries inside itself
        (hidden from our loop and its counts)."""
        fs, path = self.fs, self.path(relative)
        headers: dict[str, str] = {}
        if start is not None or end is not None:
            start = start or 0
            if end is not None and end <= start:
                return b""
            headers["Range"] = range_header(start, end)
        await fs._set_session()
        async with fs.session.get(fs.url(path, generation=generation),
                                  params=fs._get_params({}), headers=fs._get_headers(headers),
                                  timeout=fs.requests_timeout) as r:
            if r.status >= 400:  # gcsfs' own reading of an error (404: FileNotFoundError)
                from gcsfs.retry import validate_response

                validate_response(r.status, await r.read(), path)
            # a body the client decodes (Content-Encoding) is not the length announced
            encoded = r.headers.get("Content-Encoding", "identity").lower() != "identity"
            answer = RangeAnswer(url=self.object_url(relative), start=start, end=end,
                                 status=r.status, content_range=r.headers.get("Content-Range"),
                                 content_length=None if encoded else r.content_length)
            return await read_body(r.content, answer)
