"""Partner replicas on disk: this rank's own copy of a save as sent to its partner
(:class:`OwnCopy`), and a partner's copy arriving into this node's tier
(:class:`TierReplica`). The exchange itself is :mod:`dcp_volumes.tier._partners`.

What a partner offers is untrusted: its rank must be the sender's, its names are shard
paths (never a descriptor's name), its sizes are whole numbers within the tier's budget and
the disk's free space. Nothing here is trusted at read either: a replica is checked against
the committed manifest's sizes and CRC32C like any local copy.
"""

from __future__ import annotations

import logging
import os
import shutil
import stat
import time
from dataclasses import dataclass

from dcp_volumes import _layout, errors
from dcp_volumes.config import LocalTierOptions
from dcp_volumes.tier._descriptor import (
    MAX_FILE_BYTES,
    Descriptor,
    LocalOnlyRef,
    descriptor_name,
    is_descriptor_name,
    read_descriptor,
)
from dcp_volumes.tier._files import remove_empty_dirs, unlink_quietly, write_atomic
from dcp_volumes.tier._layout import is_save_key, is_url_key, normal_url, url_key, walk_saves
from dcp_volumes.tier._retention import retain_quietly

__all__ = ["OwnCopy", "TierReplica", "open_own", "own_copy"]

logger = logging.getLogger(__name__)

_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)


@dataclass(frozen=True)
class OwnCopy:
    """This rank's own files of one save in its tier, as sent to its partner: ``files`` are
    listed in the descriptor, ``extras`` (a local-only save's ``.metadata`` and manifest)
    are not. Sizes are the files' real sizes on disk."""

    url: str
    save_key: str
    rank: int
    files: tuple[tuple[str, int], ...]
    extras: tuple[tuple[str, int], ...] = ()
    local_only: LocalOnlyRef | None = None

    @property
    def nbytes(self) -> int:
        return sum(size for _, size in self.files + self.extras)

    @property
    def stream(self) -> tuple[tuple[str, int], ...]:
        """Every file sent, in order."""
        return self.files + self.extras


def _real_size(path: str) -> int | None:
    """The size of the regular file at ``path`` (no link), or None."""
    try:
        st = os.lstat(path)
    except OSError:
        return None
    return st.st_size if stat.S_ISREG(st.st_mode) else None


def own_copy(options: LocalTierOptions, url: str, rank: int) -> OwnCopy | None:
    """The newest copy of ``url`` this rank kept itself (not a replica), or None (also when
    one of its files is missing, linked or not a regular file)."""
    root = os.path.realpath(options.resolved_directory())
    normal = normal_url(url)
    best: tuple[float, str, Descriptor] | None = None
    for sdir in walk_saves(root, url):
        d = read_descriptor(os.path.join(sdir.path, descriptor_name(rank)), normal,
                            sdir.save_key)
        if d is not None and d.rank == rank and not d.replica and (
                best is None or d.created > best[0]):
            best = (d.created, sdir.path, d)
    if best is None:
        return None
    _, save_dir, d = best
    names = sorted(d.files)
    extras = ([_layout.METADATA, _layout.manifest_name(d.local_only.save_id)]
              if d.local_only is not None else [])
    sized: list[tuple[str, int]] = []
    for name in names + extras:
        size = _real_size(os.path.join(save_dir, name))
        if size is None:
            return None
        sized.append((name, size))
    return OwnCopy(normal, d.save_key, rank, tuple(sized[:len(names)]),
                   tuple(sized[len(names):]), d.local_only)


def open_own(options: LocalTierOptions, copy: OwnCopy, relative: str) -> int:
    """A read-only descriptor of one of ``copy``'s files (no link followed)."""
    path = os.path.join(os.path.realpath(options.resolved_directory()), url_key(copy.url),
                        copy.save_key, _layout.check_relative_path(relative))
    return os.open(path, os.O_RDONLY | _NOFOLLOW)


def offer_problem(copy: object, sender: int) -> str | None:
    """Why a partner's offered copy cannot be accepted from rank ``sender``, or None."""
    if not isinstance(copy, OwnCopy):
        return "it is not a copy"
    if isinstance(copy.rank, bool) or copy.rank != sender:
        return f"it claims rank {copy.rank!r}'s files"
    if not (isinstance(copy.url, str) and is_url_key(url_key(copy.url))
            and isinstance(copy.save_key, str) and is_save_key(copy.save_key)):
        return "its save is not named as the tier names saves"
    extras = ({_layout.METADATA, _layout.manifest_name(copy.local_only.save_id)}
              if isinstance(copy.local_only, LocalOnlyRef) else set())
    if copy.local_only is not None and not extras:
        return "its local-only record is malformed"
    try:
        for relative, size in copy.files:
            _layout.check_relative_path(relative)
            if is_descriptor_name(relative) or relative in extras:
                return f"it names {relative!r}, which is not a shard file"
            if isinstance(size, bool) or not isinstance(size, int) or \
                    not 0 <= size < MAX_FILE_BYTES:
                return f"it claims {size!r} bytes for {relative!r}"
        names = [relative for relative, _ in copy.extras]
        if sorted(names) != sorted(extras) or any(
                isinstance(s, bool) or not isinstance(s, int) or not 0 <= s < MAX_FILE_BYTES
                for _, s in copy.extras):
            return "its commit files are not the save's .metadata and manifest"
    except (TypeError, ValueError, errors.UnsafeCheckpointError) as exc:
        return f"it is malformed ({type(exc).__name__})"
    return None


class TierReplica:
    """A partner rank's files of one save arriving into this node's tier, chunk by chunk.

    Files are written under temporary names and renamed when complete; the descriptor (the
    partner's, marked as a replica held by this rank) is written last, by :meth:`complete`.
    Every method swallows filesystem errors: the first is logged as a WARNING and what
    arrived is removed. ``sender``: the rank the copy came from (its copy must be its own).
    """

    def __init__(self, options: LocalTierOptions, copy: OwnCopy, me: int,
                 sender: int | None = None) -> None:
        self.options = options
        self.copy = copy
        self.me = me
        self.root = os.path.realpath(options.resolved_directory())
        self.written: list[str] = []
        self._fd: int | None = None
        self._tmp = ""
        self._dest = ""
        why = offer_problem(copy, copy.rank if sender is None else sender)
        self.ok = why is None
        self.dir = os.path.join(self.root, url_key(copy.url), copy.save_key) if self.ok else ""
        if why is not None:
            logger.warning("rank %d: a partner replica offered by rank %s is refused: %s",
                           me, sender, why)
            return
        limit = options.max_bytes
        if limit is not None and copy.nbytes > limit:
            logger.warning("rank %d: rank %d's %d bytes exceed LocalTierOptions.max_bytes "
                           "(%d): no partner replica kept", me, copy.rank, copy.nbytes, limit)
            self.ok = False
        elif copy.nbytes > _free_bytes(self.root):
            logger.warning("rank %d: rank %d's %d bytes do not fit in the local tier %s "
                           "(free: %d): no partner replica kept", me, copy.rank, copy.nbytes,
                           self.root, _free_bytes(self.root))
            self.ok = False

    def begin(self, relative: str) -> None:
        if not self.ok:
            return
        try:
            self._dest = os.path.join(self.dir, _layout.check_relative_path(relative))
            os.makedirs(os.path.dirname(self._dest), exist_ok=True)
            self._tmp = f"{self._dest}.tmp-{os.getpid()}"
            self._fd = os.open(self._tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | _NOFOLLOW,
                               0o644)
        except (OSError, errors.UnsafeCheckpointError) as exc:
            self._give_up(exc)

    def write(self, data: memoryview) -> None:
        if not self.ok or self._fd is None:
            return
        try:
            while data:
                data = data[os.write(self._fd, data):]
        except OSError as exc:
            self._give_up(exc)

    def end(self) -> None:
        if not self.ok or self._fd is None:
            return
        try:
            fd, self._fd = self._fd, None
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
            os.replace(self._tmp, self._dest)
            self.written.append(self._dest)
        except OSError as exc:
            self._give_up(exc)

    def complete(self, sender_ok: bool) -> int:
        """Write the partner's descriptor (when its files all arrived and ``sender_ok``),
        then apply retention. Returns the bytes kept."""
        if not (self.ok and sender_ok):
            self.abandon()
            return 0
        c = self.copy
        doc = Descriptor(c.url, c.save_key, c.rank, time.time(), dict(c.files), c.local_only,
                         held_by=self.me)
        try:
            write_atomic(os.path.join(self.dir, descriptor_name(c.rank)), doc.to_json())
        except OSError as exc:
            self._give_up(exc)
            return 0
        retain_quietly(self.options, self.me)
        return c.nbytes

    def abandon(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None
        if self._tmp:
            unlink_quietly(self._tmp)
        extras = {os.path.join(self.dir, name)
                  for name, _ in getattr(self.copy, "extras", ())}
        for path in self.written:
            if path not in extras:  # the save's own commit files may be this rank's too
                unlink_quietly(path)
                remove_empty_dirs(os.path.dirname(path), self.root)
        self.written.clear()
        self.ok = False

    def _give_up(self, exc: BaseException) -> None:
        if self.ok:
            what = getattr(exc, "strerror", None) or type(exc).__name__
            logger.warning("rank %d: keeping rank %d's partner replica in the local tier %s "
                           "failed (%s): that rank's copy is in the store or its own tier "
                           "only", self.me, self.copy.rank, self.root, what)
        self.abandon()


def _free_bytes(directory: str) -> int:
    """Free bytes where the tier lives (its nearest existing parent)."""
    path = directory
    while path and not os.path.isdir(path):
        path = os.path.dirname(path)
    try:
        return shutil.disk_usage(path or ".").free
    except OSError:
        return 0
