"""Local files (``file://`` or a plain path): parts written with ``pwrite`` in parallel and
``fsync``-ed; ``.metadata`` committed by ``link(2)`` of a fsynced temporary (exclusive) or
``rename(2)`` (overwrite), then the directory is fsynced."""

from __future__ import annotations

import asyncio
import errno
import functools
import os
import shutil
import stat
from typing import Any

from dcp_volumes import errors
from dcp_volumes.backends.base import Backend, CallStats, never_retry
from dcp_volumes.backends.sink import Part, Sink
from dcp_volumes.backends.versions import ObjectVersion, file_version, read_pinned

__all__ = ["LocalBackend", "LocalSink"]


class LocalBackend(Backend):
    name = "local"
    has_directories = True
    local_paths = True

    def normalize_root(self, root: str) -> str:
        return os.path.abspath(root)

    def confined(self, relative: str) -> str:
        """The real path of ``relative``, refusing any that leaves the checkpoint root.

        A shard that is a symbolic link (or sits under a linked directory) pointing outside
        the checkpoint would make a load read, and ``verify`` vouch for, bytes that are not
        part of it.
        """
        root = os.path.realpath(self.root)
        real = os.path.realpath(self.path(relative))
        if real != root and not real.startswith(root.rstrip(os.sep) + os.sep):
            raise errors.UnsafeCheckpointError(
                f"{relative} of {self.url} resolves outside the checkpoint (a symbolic link): "
                "refusing to read it; replace the link with the file itself"
            )
        return real

    # ---- what stands at a name, without following a link (dcp_volumes._complete) --------
    def place(self) -> tuple[str, str, str]:
        return "file", "", os.path.realpath(str(self.root))

    async def entry_kind(self, relative: str, *, stats: CallStats | None = None
                         ) -> str | None:
        """What stands at ``relative``, the entry itself (a link is not followed): None
        (nothing), ``"file"`` (a regular file), or in words what else ("a directory", "a
        FIFO", "a link", ...)."""
        try:
            info = await self.call(lambda: asyncio.to_thread(os.lstat, self.path(relative)),
                                   op="read", url=self.object_url(relative), stats=stats)
        except errors.ObjectNotFoundError:
            return None
        return "file" if stat.S_ISREG(info.st_mode) else _kind(info.st_mode)

    async def remove_entry(self, relative: str) -> None:
        """Remove what stands at ``relative`` unless it is a regular file (gone: fine): a
        link or a FIFO itself, never what a link points to; a directory with everything
        under it, the links in it removed, never followed (``shutil.rmtree``'s walk by open
        directory, which refuses a top that is a link)."""
        path = self.path(relative)

        def _do() -> None:
            try:
                mode = os.lstat(path).st_mode
            except FileNotFoundError:
                return
            if stat.S_ISDIR(mode):
                if not shutil.rmtree.avoids_symlink_attacks:
                    raise errors.UnsafeCheckpointError(
                        f"{relative} of {self.url} is a directory, and on this platform "
                        "removing one could follow a link in it out of the checkpoint: "
                        "remove it by hand")
                shutil.rmtree(path)
            elif not stat.S_ISREG(mode):
                os.unlink(path)  # the entry itself: a link's target is never touched

        await self.call(lambda: asyncio.to_thread(_do), op="delete",
                        url=self.object_url(relative), retry_if=never_retry)

    async def _get(self, relative: str, start: int | None, end: int | None) -> bytes:
        real = self.confined(relative)
        return await asyncio.to_thread(read_regular, real, start, end,
                                       f"{relative} of {self.url}")

    async def info(self, relative: str, *, stats: CallStats | None = None
                   ) -> dict[str, Any] | None:
        if os.path.lexists(self.path(relative)):
            self.confined(relative)
        return await super().info(relative, stats=stats)

    # ---- reads pinned to a version (backends.versions): fstat of the open file ----------
    conditional_reads = True

    async def _pin(self, relative: str) -> ObjectVersion:
        info = os.stat(self.confined(relative))
        if not stat.S_ISREG(info.st_mode):
            raise _not_regular(f"{relative} of {self.url}", _kind(info.st_mode))
        return file_version(info)

    async def _get_pinned(self, relative: str, pin: ObjectVersion, start: int,
                          end: int) -> bytes:
        return await asyncio.to_thread(read_pinned, self.confined(relative), pin, start, end,
                                       self.object_url(relative))

    async def _put(self, relative: str, data: bytes, *, exclusive: bool) -> None:
        os.makedirs(os.path.dirname(self.path(relative)), exist_ok=True)
        await super()._put(relative, data, exclusive=exclusive)

    async def _commit_once(self, relative: str, data: bytes, *, exclusive: bool,
                           save_id: str) -> None:
        final = self.path(relative)
        tmp = self.path(f"{relative}.{save_id}.tmp")

        def _do() -> None:
            os.makedirs(os.path.dirname(final), exist_ok=True)
            with open(tmp, "wb") as f:
                f.write(data)
                f.flush()
                os.fsync(f.fileno())
            try:
                if exclusive:
                    os.link(tmp, final)  # atomic; EEXIST if another save committed
                    os.unlink(tmp)
                else:
                    os.replace(tmp, final)
            except BaseException:
                try:
                    os.unlink(tmp)
                except OSError:
                    pass
                raise
            dfd = os.open(os.path.dirname(final), os.O_RDONLY)
            try:
                os.fsync(dfd)
            finally:
                os.close(dfd)

        await asyncio.to_thread(_do)

    def make_sink(self, relative: str, stats: CallStats, part_size: int) -> Sink:
        return LocalSink(self, relative, stats)

    async def prune_empty_dirs(self, relative: str = "") -> None:
        # Local directories outlive their files; remove the empty ones we leave behind.
        top = self.path(relative) if relative else self.root
        for d in [d for d, _, _ in os.walk(top, topdown=False)]:
            try:
                await self.call(functools.partial(self.fs_call, "rmdir", d), op="delete", url=d)
            except (errors.DCPVolumesError, OSError):
                pass  # not empty (someone wrote into it): leave it


_READ_FLAGS = (os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_NOFOLLOW", 0)
               | getattr(os, "O_CLOEXEC", 0))


def read_regular(path: str, start: int | None, end: int | None, what: str) -> bytes:
    """Bytes ``[start, end)`` of the regular file ``path`` (negative: from its end, as
    fsspec's ``cat_file``).

    Opened without blocking and without following a final link, then checked to be a
    regular file before a byte is read: a FIFO put where a checkpoint file belongs would
    otherwise hang the reader forever, and a device would read without end.

    Raises:
        UnsafeCheckpointError: ``path`` is not a regular file (a FIFO, a socket, a device,
            a directory, a link).
    """
    try:
        fd = os.open(path, _READ_FLAGS)
    except OSError as exc:
        if exc.errno in (errno.ELOOP, errno.EISDIR, errno.ENXIO):
            raise _not_regular(what, "a link or directory") from None
        raise
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise _not_regular(what, _kind(info.st_mode))
        size = info.st_size
        first = 0 if start is None else (max(size + start, 0) if start < 0 else start)
        stop = size if end is None else (max(size + end, 0) if end < 0 else min(end, size))
        data = os.pread(fd, max(stop - first, 0), first)  # one call, but for > 2 GiB
        if len(data) >= stop - first or not data:
            return data
        out = bytearray(data)
        while first + len(out) < stop:
            piece = os.pread(fd, stop - first - len(out), first + len(out))
            if not piece:
                break  # the file shrank meanwhile: the caller checks the length it needs
            out += piece
        return bytes(out)
    finally:
        os.close(fd)


def _kind(mode: int) -> str:
    for test, name in ((stat.S_ISFIFO, "a FIFO"), (stat.S_ISSOCK, "a socket"),
                       (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"),
                       (stat.S_ISDIR, "a directory"), (stat.S_ISLNK, "a link")):
        if test(mode):
            return name
    return "not a regular file"


def _not_regular(what: str, kind: str) -> errors.UnsafeCheckpointError:
    return errors.UnsafeCheckpointError(
        f"{what} is {kind}, not a regular file: refusing to read it (reading a FIFO or "
        "device would hang or never end); replace it with the file itself")


class LocalSink(Sink):
    def __init__(self, backend: Backend, relative: str, stats: CallStats) -> None:
        super().__init__(backend, relative, stats)
        self._fd = -1
        self._lock = asyncio.Lock()

    async def _open(self) -> int:
        async with self._lock:
            if self._fd < 0:
                def _do() -> int:
                    os.makedirs(os.path.dirname(self.path), exist_ok=True)
                    return os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
                self._fd = await self.backend.call(lambda: asyncio.to_thread(_do), op="upload",
                                                   url=self.url, retry_if=never_retry)
            return self._fd

    async def put_part(self, part: Part, data: bytes | bytearray | memoryview) -> None:
        fd = await self._open()

        def _pwrite() -> None:
            view = memoryview(data)
            done = 0
            while done < len(view):
                done += os.pwrite(fd, view[done:], part.offset + done)

        await self.backend.call(lambda: asyncio.to_thread(_pwrite), op="upload", url=self.url,
                                stats=self.stats, retry_if=never_retry)

    async def complete(self, nparts: int) -> None:
        fd = await self._open()

        def _sync_close() -> None:
            os.fsync(fd)
            os.close(fd)

        self._fd = -1
        await self.backend.call(lambda: asyncio.to_thread(_sync_close), op="upload",
                                url=self.url, retry_if=never_retry)

    async def abort(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1
        try:
            os.unlink(self.path)
        except OSError:
            pass
