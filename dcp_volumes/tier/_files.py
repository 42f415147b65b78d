"""Small file helpers of the local tier: listings that tolerate a vanished directory,
bounded reads that follow no link, atomic writes, copies, quiet removals. Torch-free."""

from __future__ import annotations

import errno
import os
import shutil
import stat

__all__ = ["copy_file", "is_exdev", "read_bounded", "remove_empty_dirs", "scandir",
           "unlink_quietly", "write_atomic"]

_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)


def scandir(directory: str) -> list[os.DirEntry[str]]:
    try:
        return list(os.scandir(directory))
    except OSError:
        return []


def read_bounded(path: str, limit: int) -> bytes | None:
    """A regular file's bytes (no link, at most ``limit`` of them), or None."""
    try:
        fd = os.open(path, os.O_RDONLY | _NOFOLLOW)
    except OSError:
        return None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_size > limit:
            return None
        chunks = []
        left = st.st_size + 1
        while left > 0:
            chunk = os.read(fd, min(left, 1 << 24))
            if not chunk:
                break
            chunks.append(chunk)
            left -= len(chunk)
        data = b"".join(chunks)
        return data if len(data) == st.st_size else None
    except OSError:
        return None
    finally:
        os.close(fd)


def write_atomic(path: str, data: bytes) -> None:
    """``data`` durably at ``path``, all or nothing (a temporary name, fsync, rename)."""
    tmp = f"{path}.tmp-{os.getpid()}"
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | _NOFOLLOW, 0o644)
        try:
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view):]
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, path)
    except BaseException:
        unlink_quietly(tmp)
        raise


def copy_file(source: str, dest: str) -> None:
    """Copy ``source`` to ``dest`` (no link followed, all or nothing), then remove it."""
    tmp = f"{dest}.tmp-{os.getpid()}"
    try:
        shutil.copyfile(source, tmp, follow_symlinks=False)
        os.replace(tmp, dest)
    except BaseException:
        unlink_quietly(tmp)
        raise
    unlink_quietly(source)


def unlink_quietly(path: str) -> None:
    try:
        os.unlink(path)
    except OSError:
        pass


def remove_empty_dirs(directory: str, root: str) -> None:
    """Remove ``directory`` and its parents up to (not including) ``root`` while empty."""
    directory = os.path.abspath(directory)
    while directory.startswith(root + os.sep):
        try:
            os.rmdir(directory)
        except OSError:
            return
        directory = os.path.dirname(directory)


def is_exdev(exc: OSError) -> bool:
    return exc.errno == errno.EXDEV
