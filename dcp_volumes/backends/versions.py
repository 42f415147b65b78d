"""Reads pinned to one version of an object: what a reader without checksums (safetensors)
relies on so that the bytes it reads are those of the header it planned from.

:meth:`VersionedReads.pin` records an object's :class:`ObjectVersion` (its size, and the
tag the store offers: an S3 or Azure ETag, a GCS generation, a local file's inode and
mtime); :meth:`VersionedReads.cat_pinned` reads a range only if the object is still that
version, through the one choke point (:meth:`~dcp_volumes.backends.base.Backend.call`), and
raises :class:`~dcp_volumes.errors.CheckpointChangedError` otherwise. Each store's module
overrides ``_pin``/``_get_pinned`` with its own conditional read (S3 ``If-Match``, GCS
``ifGenerationMatch``, Azure ``If-Match``, ``fstat`` of the open file); the default here
(memory, other fsspec stores) checks the version before and after the read.
"""

from __future__ import annotations

import os
import stat
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypeVar

from dcp_volumes import errors
from dcp_volumes.backends.records import CallStats
from dcp_volumes.backends.translate import redact_url

T = TypeVar("T")

__all__ = ["ObjectVersion", "VersionedReads", "changed", "file_version", "read_pinned",
           "version_of"]

#: fsspec info keys that identify a stored version, most specific first
_TAG_KEYS = ("generation", "ETag", "etag", "version_id", "created", "mtime")


@dataclass(frozen=True)
class ObjectVersion:
    """One stored version of an object: its size and, where the store offers one, a tag
    (None: the size is all it offers)."""

    size: int
    tag: str | None = None


def changed(url: str, pin: ObjectVersion, now: ObjectVersion | None, *, gone: bool = False
            ) -> errors.CheckpointChangedError:
    """The error for a read of ``url`` whose object is no longer the ``pin`` ned version
    (``now``: what it is now, where known; ``gone``: it no longer exists)."""
    was = f"{pin.size} bytes" + (f", version {pin.tag}" if pin.tag else "")
    is_now = ("it is gone" if gone else "the store has another version now" if now is None
              else f"it now has {now.size} bytes" + (f", version {now.tag}" if now.tag else ""))
    return errors.CheckpointChangedError(
        f"{redact_url(url)} changed while it was being read (read from {was}; {is_now}): "
        "load again once the files are no longer being replaced")


def file_version(st: os.stat_result) -> ObjectVersion:
    """A local file's version: its size, inode and modification time (ns)."""
    return ObjectVersion(st.st_size, f"{st.st_ino}:{st.st_mtime_ns}")


def read_pinned(path: str, pin: ObjectVersion, start: int, end: int, url: str) -> bytes:
    """Bytes ``[start, end)`` of the local file at ``path`` if the open file is still
    version ``pin`` (a regular file, not a link; never blocks on a FIFO)."""
    flags = os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_NONBLOCK", 0)
    fd = os.open(path, flags)
    try:
        st = os.fstat(fd)
        now = file_version(st)
        if not stat.S_ISREG(st.st_mode) or now != pin:
            raise changed(url, pin, now)
        out = bytearray()
        while len(out) < end - start:
            chunk = os.pread(fd, end - start - len(out), start + len(out))
            if not chunk:
                break  # the size was checked: only a concurrent truncation gets here
            out += chunk
        return bytes(out)
    finally:
        os.close(fd)


def version_of(info: dict[str, Any]) -> ObjectVersion:
    """The version an fsspec ``info`` describes."""
    tag = next((info[k] for k in _TAG_KEYS if info.get(k) is not None), None)
    return ObjectVersion(int(info.get("size") or 0), None if tag is None else str(tag))


class VersionedReads:
    """Pinned reads, mixed into :class:`~dcp_volumes.backends.base.Backend`."""

    #: whether the store itself refuses a read of another version (False: checked by the
    #: client around the read — honest within one process, not against a racing writer)
    conditional_reads = False

    if TYPE_CHECKING:  # what it uses of the Backend it is mixed into
        fs: Any

        async def call(self, fn: Callable[[], Awaitable[T]], *, op: str, url: str,
                       stats: CallStats | None = None,
                       retry_if: Callable[[BaseException], bool] = ...) -> T: ...
        def object_url(self, relative: str) -> str: ...
        def path(self, relative: str) -> str: ...
        async def fs_call(self, name: str, *args: Any, **kwargs: Any) -> Any: ...
        async def _get(self, relative: str, start: int | None, end: int | None) -> bytes: ...

    async def pin(self, relative: str, *, stats: CallStats | None = None
                  ) -> ObjectVersion | None:
        """The object's current version, ``None`` when it is absent."""
        try:
            return await self.call(lambda: self._pin(relative), op="read",
                                   url=self.object_url(relative), stats=stats)
        except errors.ObjectNotFoundError:
            return None

    async def cat_pinned(self, relative: str, pin: ObjectVersion, *,
                         start: int, end: int, stats: CallStats | None = None) -> bytes:
        """Bytes ``[start, end)`` of the object if it is still version ``pin``.

        Raises:
            CheckpointChangedError: the object is gone or is another version now.
        """
        return await self.call(lambda: self._get_pinned(relative, pin, start, end),
                               op="download", url=self.object_url(relative), stats=stats)

    async def cat_into(self, relative: str, out: memoryview, *, start: int,
                       pin: ObjectVersion | None = None, stats: CallStats | None = None
                       ) -> int:
        """Read bytes ``[start, start + len(out))`` of the object (version ``pin``, when
        given) into ``out``; returns how many arrived (fewer: the object is shorter).
        Stores that can stream a body fill ``out`` as it arrives, with no other copy.

        Raises:
            CheckpointChangedError: ``pin`` given, and the object is gone or another
                version now.
        """
        return await self.call(lambda: self._get_into(relative, out, start, pin),
                               op="download", url=self.object_url(relative), stats=stats)

    # ---- raw single attempts (overridden per store) ---------------------------------------
    async def _get_into(self, relative: str, out: memoryview, start: int,
                        pin: ObjectVersion | None) -> int:
        end = start + len(out)
        data = await (self._get(relative, start, end) if pin is None
                      else self._get_pinned(relative, pin, start, end))
        n = min(len(data), len(out))
        out[:n] = memoryview(data)[:n]
        return n

    async def _pin(self, relative: str) -> ObjectVersion:
        path = self.path(relative)
        self.fs.invalidate_cache(path)
        return version_of(await self.fs_call("info", path))

    async def _get_pinned(self, relative: str, pin: ObjectVersion, start: int,
                          end: int) -> bytes:
        await self._still(relative, pin)
        data = await self._get(relative, start, end)
        await self._still(relative, pin)  # replaced while it was read
        return data

    async def _still(self, relative: str, pin: ObjectVersion) -> None:
        """Raise :func:`changed` unless the object is version ``pin``."""
        try:
            now: ObjectVersion | None = await self._pin(relative)
        except FileNotFoundError:
            now = None
        if now != pin:
            raise changed(self.object_url(relative), pin, now, gone=now is None)
