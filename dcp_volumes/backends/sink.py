"""Sinks: how one shard file becomes durable in a store, part by part.

A backend's :meth:`~dcp_volumes.backends.base.Backend.make_sink` returns one per file; the
uploader (:mod:`dcp_volumes.saving._upload`) feeds it parts as the spool fills them. What a sink
knows of a part is :class:`Part` (where it sits in the object, its CRC32C), defined here: the
store layer does not import the save pipeline's records.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, ClassVar, Protocol, TypeVar

from dcp_volumes.backends.records import CallStats, never_retry

__all__ = ["Part", "Sink", "SinkBackend", "StreamSink"]

logger = logging.getLogger(__name__)

T = TypeVar("T")


@dataclass(frozen=True)
class Part:
    """One contiguous piece of an object, as a sink receives it: numbered from 1, at
    ``offset``, ``length`` bytes, ``final`` for the object's last part, and the CRC32C of
    its bytes (S3 sends it as the part's checksum)."""

    number: int
    offset: int
    length: int
    final: bool
    crc: int


class SinkBackend(Protocol):
    """What a sink uses of the backend that made it (every
    :class:`~dcp_volumes.backends.base.Backend` has it): its paths, its choke point and its
    filesystem. Sinks see no more of the backend, and so do not import it."""

    fs: Any

    def path(self, relative: str) -> str: ...

    def object_url(self, relative: str) -> str: ...

    async def call(self, fn: Callable[[], Awaitable[T]], *, op: str, url: str,
                   stats: CallStats | None = None,
                   retry_if: Callable[[BaseException], bool] = ...) -> T: ...

    async def remove(self, relatives: list[str]) -> None: ...


class Sink:
    """Receives the parts of one object and makes it durable."""

    #: parts must arrive in order (a stream); else they may arrive in any order
    ordered: ClassVar[bool] = False

    def __init__(self, backend: SinkBackend, relative: str, stats: CallStats) -> None:
        self.backend = backend
        self.relative = relative
        self.path = backend.path(relative)
        self.url = backend.object_url(relative)
        self.stats = stats

    async def prepare(self) -> None:
        """Optional early set-up for a file expected to span several parts."""

    async def put_part(self, part: Part, data: bytes | bytearray | memoryview) -> None:
        raise NotImplementedError

    async def complete(self, nparts: int) -> None:
        raise NotImplementedError

    async def abort(self) -> None:
        """Undo whatever was uploaded (best effort, never raises)."""

    async def _remove_quietly(self) -> None:
        try:
            await self.backend.remove([self.relative])
        except Exception as exc:  # noqa: BLE001 — best effort; gc collects leftovers
            logger.warning("could not clean up %s after a failed save: %s", self.url,
                           type(exc).__name__)


class StreamSink(Sink):
    """Writes parts in order through the filesystem's own file object."""

    ordered = True

    def __init__(self, backend: SinkBackend, relative: str, stats: CallStats,
                 part_size: int) -> None:
        super().__init__(backend, relative, stats)
        self._file: Any = None
        self._part_size = part_size

    def open_kwargs(self) -> dict[str, Any]:
        """Extra arguments of ``fs.open`` for this store's writer."""
        return {}

    async def put_part(self, part: Part, data: bytes | bytearray | memoryview) -> None:
        def _write() -> None:
            if self._file is None:
                self._file = self.backend.fs.open(self.path, "wb", **self.open_kwargs())
            self._file.write(bytes(data))

        # The filesystem retries inside its writer; a stream cannot be rewound to retry here.
        await self.backend.call(lambda: asyncio.to_thread(_write), op="upload", url=self.url,
                                stats=self.stats, retry_if=never_retry)

    async def complete(self, nparts: int) -> None:
        f, self._file = self._file, None
        if f is not None:
            await self.backend.call(lambda: asyncio.to_thread(f.close), op="upload",
                                    url=self.url, stats=self.stats, retry_if=never_retry)

    async def abort(self) -> None:
        f, self._file = self._file, None
        try:
            if f is not None:
                discard = getattr(f, "discard", None)
                await asyncio.to_thread(discard if discard else f.close)
        except Exception as exc:  # noqa: BLE001
            logger.warning("could not discard the writer of %s: %s", self.url,
                           type(exc).__name__)
        await self._remove_quietly()
