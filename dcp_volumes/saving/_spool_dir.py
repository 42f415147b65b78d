"""The spool directory: where spool files are named (whose they are), whether it has room
for a rank's save, and removing the spool files of killed saves."""

from __future__ import annotations

import hashlib
import logging
import os
import re
import shutil
import socket

from dcp_volumes.config import SpoolOptions
from dcp_volumes.errors import SpoolError

__all__ = ["check_free_space", "remove_dead_spools", "spool_directory", "spool_file_name"]

logger = logging.getLogger(__name__)


def spool_directory(options: SpoolOptions, needed: int) -> str:
    """The spool directory of a rank that spools ``needed`` bytes: for a disk spool, cleared
    of dead spools and checked for room (with 1 MiB to spare)."""
    directory = options.resolved_directory()
    if options.mode == "disk":
        remove_dead_spools(directory)
        check_free_space(directory, needed + (1 << 20), options.free_space_margin)
    return directory


def check_free_space(directory: str, needed: int, margin: float) -> None:
    """Raise :class:`SpoolError` unless ``directory`` can hold ``needed × margin`` bytes."""
    try:
        os.makedirs(directory, exist_ok=True)
        read_only = bool(os.statvfs(directory).f_flag & os.ST_RDONLY)
        free = shutil.disk_usage(directory).free
    except OSError as exc:
        raise SpoolError(
            f"spool directory {directory!r} is not usable ({exc.strerror}): set "
            "SpoolOptions(directory=...) or DCP_VOLUMES_SPOOL_DIR to a writable local directory"
        ) from exc
    if read_only or not os.access(directory, os.W_OK):
        why = "on a read-only filesystem" if read_only else "not writable by this process"
        raise SpoolError(
            f"spool directory {directory!r} is {why}: mount it read-write, or set "
            "SpoolOptions(directory=...) or DCP_VOLUMES_SPOOL_DIR to a writable local "
            "directory (or use SpoolOptions(mode='memory'))")
    want = int(needed * margin)
    if free < want:
        raise SpoolError(
            f"spool directory {directory!r} has {free / 2**30:.2f} GiB free but this rank needs "
            f"{want / 2**30:.2f} GiB: free space there, point SpoolOptions(directory=...) or "
            "DCP_VOLUMES_SPOOL_DIR at a larger disk, or use SpoolOptions(mode='memory')"
        )


def _host_tag() -> str:
    """A short tag of this host: spool directories may be shared (NFS), pids are not."""
    return hashlib.sha1(socket.gethostname().encode()).hexdigest()[:8]


def spool_file_name(shard: str) -> str:
    """``dcpv-<host>-<pid>-<shard>``: whose file it is, so a later save can tell it is dead.

    Only the shard's file name counts: a hashed layout's prefix directory (``3f/``) is a
    store-side matter, and the spool directory stays flat."""
    return f"dcpv-{_host_tag()}-{os.getpid()}-{shard.rsplit('/', 1)[-1]}"


_SPOOL_NAME_RE = re.compile(
    r"^dcpv-([0-9a-f]{8})-(\d+)-__\d+_\d+-[0-9a-f]{8}-[0-9a-f]{12}\.distcp$")


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # someone else's live process
    return True


def remove_dead_spools(directory: str) -> int:
    """Remove spool files that killed processes of this host left in ``directory``.

    Only regular files (never links) whose name is exactly a spool file's, made on this
    host by a process that no longer exists, are removed. Returns how many were.
    """
    host, removed = _host_tag(), 0
    try:
        entries = list(os.scandir(directory))
    except OSError:
        return 0
    for entry in entries:
        m = _SPOOL_NAME_RE.match(entry.name)
        if m is None or m.group(1) != host or int(m.group(2)) == os.getpid():
            continue
        try:
            if not entry.is_file(follow_symlinks=False) or _pid_alive(int(m.group(2))):
                continue
            os.unlink(entry.path)
            removed += 1
        except OSError:
            continue  # gone meanwhile, or not ours to remove
    if removed:
        logger.warning("removed %d spool files that killed saves left in %s", removed, directory)
    return removed
