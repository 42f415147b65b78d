"""Reading the committed save's files from this node's local tier.

Only files the committed manifest in the store names are looked for, at the sizes it names,
and every byte read is checked against the manifest's CRC32C exactly as a store read is
(bytes from local disk are as untrusted as bytes from the store); what fails goes to the
store instead.
"""

from __future__ import annotations

import concurrent.futures
import errno
import logging
import os
import stat
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

from dcp_volumes import _layout, errors
from dcp_volumes._manifest import Manifest
from dcp_volumes.config import LocalTierOptions
from dcp_volumes.tier._layout import descriptors, normal_url, url_key
from dcp_volumes.transfer.download import RangeRequest
from dcp_volumes.transfer.readplan import DirectTarget, Need, check_need, describe, plan_ranges
from dcp_volumes.transfer.serve import Served, serve_local

__all__ = ["LocalFile", "LocalRead", "find_local", "read_local", "read_span", "unusable"]

logger = logging.getLogger(__name__)


# ---- loading ----------------------------------------------------------------------------

@dataclass(frozen=True)
class LocalFile:
    """A shard file of the committed save found in the tier at the size the manifest says."""

    path: str
    size: int


def find_local(options: LocalTierOptions, url: str, manifest: Manifest
               ) -> tuple[dict[str, LocalFile], dict[str, str]]:
    """The committed save's shard files this node's tier holds, by relative path, and those
    a descriptor lists but that cannot be used (with why): missing, a link, not a regular
    file, or of another size than the manifest's. Only files the committed ``manifest``
    names are looked for, in the directory of the id in their name."""
    root = os.path.realpath(options.resolved_directory())
    usable: dict[str, LocalFile] = {}
    rejected: dict[str, str] = {}
    if not os.path.isdir(root):
        return usable, rejected
    base = os.path.join(root, url_key(url))
    listed_by_key: dict[str, dict[str, int]] = {}
    normal = normal_url(url)
    for relative, entry in manifest.files.items():
        key = _layout.save_id_of(relative)
        if key is None:
            continue
        if key not in listed_by_key:
            listed: dict[str, int] = {}
            for d in descriptors(os.path.join(base, key), normal, key):
                listed.update(d.files)
            listed_by_key[key] = listed
        size = listed_by_key[key].get(relative)
        if size is None:
            continue  # not kept on this node
        path = os.path.join(base, key, relative)
        why = unusable(path, entry.size) if size == entry.size else (
            f"its descriptor says {size} bytes, the committed manifest {entry.size}")
        if why is None:
            usable[relative] = LocalFile(path, entry.size)
        else:
            rejected[relative] = why
    return usable, rejected


def unusable(path: str, size: int) -> str | None:
    """Why the file at ``path`` cannot stand for a shard of ``size`` bytes, or None."""
    if os.path.realpath(path) != path:
        return "a symbolic link is on its path"
    try:
        st = os.lstat(path)
    except OSError as exc:
        return f"it cannot be read ({exc.strerror})"
    if not stat.S_ISREG(st.st_mode):
        return "it is not a regular file"
    if st.st_size != size:
        return f"it has {st.st_size} bytes, the committed manifest says {size}"
    return None


@dataclass
class LocalRead:
    """What :func:`read_local` did: bytes used, and the needs the store must serve instead."""

    bytes_used: int = 0
    fallback: list[Need] = field(default_factory=list)


def read_local(needs: list[Need], files: dict[str, LocalFile], *, gap: int, max_size: int,
               url: str, apply: Callable[[Need, memoryview], None],
               direct: Callable[[Need], DirectTarget | None] | None = None,
               commit: Callable[[DirectTarget], None] | None = None) -> LocalRead:
    """Read ``needs`` (all in ``files``) from local disk, checking each against its CRC32C
    exactly as a store read is checked; ``apply`` gets the bytes of each need that passed.
    A file that cannot be opened, changed size, or bytes that fail their checksum are never
    applied: those needs are returned for the store, each logged as a WARNING.

    ``direct``: where it gives a need's :class:`DirectTarget` covering exactly the need's
    bytes (a whole contiguous tensor), they are read straight into the target's memory and
    checked there, saving a copy, and ``commit`` is called with it; a failed check leaves
    them to the store, which overwrites them (the target is the caller's to fill either
    way)."""
    out = LocalRead()
    rest: list[Need] = []
    into: list[tuple[Need, DirectTarget]] = []
    for need in needs:
        target = direct(need) if direct is not None else None
        if target is None or (target.start, target.end) != (need.start, need.end):
            rest.append(need)
        else:
            into.append((need, target))
    for (need, target), served in zip(into, _read_all_into(into, files, url)):
        if served.failed:
            out.fallback.append(need)
            continue
        if commit is not None:
            commit(target)  # here, in order: the planner is not thread-safe
        out.bytes_used += served.nbytes
    served = serve_local(plan_ranges(rest, gap=gap, max_size=max_size),
                         lambda rng: read_span(files[rng.relative], rng.start, rng.end),
                         apply=apply, **_checks(url))
    out.bytes_used += served.nbytes
    out.fallback.extend(served.failed)
    return out


def _checks(url: str) -> dict[str, Any]:
    """How a local read is checked, and what a failure logs: ``serve_local``'s callbacks."""

    def check(need: Need, chunk: memoryview) -> None:
        check_need(need, chunk, url)

    def unreadable(rng: RangeRequest, exc: OSError) -> None:
        _warn_fallback(rng.relative, url, _why(exc), len(rng.items))

    def bad(need: Need, exc: errors.IntegrityError) -> None:
        logger.warning("local copy of shard %s of %s: %s fails its checksum; reading it from "
                       "the store", need.relative, url, describe(need.reads[0]))

    return {"check": check, "unreadable": unreadable, "bad": bad}


def _read_all_into(into: list[tuple[Need, DirectTarget]], files: dict[str, LocalFile],
                   url: str) -> list[Served]:
    """:func:`_read_into` for each, on a few threads: reads and checksums release the GIL,
    so one file's read overlaps another's CRC32C (the targets are disjoint)."""
    workers = min(len(into), _READ_THREADS)
    if workers <= 1:
        return [_read_into(n, files[n.relative], t, url) for n, t in into]
    with concurrent.futures.ThreadPoolExecutor(workers, "dcpv-tier-read") as pool:
        return list(pool.map(lambda nt: _read_into(nt[0], files[nt[0].relative], nt[1], url),
                             into))


def _read_into(need: Need, local: LocalFile, target: DirectTarget, url: str) -> Served:
    """Read ``need``'s bytes from ``local`` straight into ``target`` and check them there."""
    view = target.view.numpy().data

    def read(rng: RangeRequest) -> memoryview:
        _open_checked(local, lambda fd: _preadv_all(fd, view, rng.start))
        return view

    return serve_local([RangeRequest(need.relative, need.start, need.end, [need])], read,
                       apply=_in_place, **_checks(url))


def _in_place(need: Need, chunk: memoryview) -> None:
    """Nothing to apply: the bytes were read into their target (committed by the caller)."""


def _why(exc: OSError) -> str:
    """Why a local file could not be read, as the fallback warning says it."""
    if exc.errno == errno.EIO and str(exc.strerror).startswith("it "):
        return str(exc.strerror)  # ours: it changed / is shorter than expected
    return f"it cannot be read ({exc.strerror})"


def _preadv_all(fd: int, view: memoryview, offset: int) -> None:
    done = 0
    while done < len(view):
        n = os.preadv(fd, [view[done:]], offset + done)
        if n <= 0:
            raise OSError(errno.EIO, "it is shorter than expected")
        done += n


def _warn_fallback(relative: str, url: str, why: str, count: int) -> None:
    logger.warning("local copy of shard %s of %s is not used: %s; reading %d items from the "
                   "store", relative, url, why, count)


_T = TypeVar("_T")
#: threads reading whole tensors from the tier into their targets
_READ_THREADS = max(2, min(4, os.cpu_count() or 1))


def _open_checked(local: LocalFile, use: Callable[[int], _T]) -> _T:
    """``use`` an open descriptor of a local shard file (a regular file, no link, still of
    the size it was found at). Raises ``OSError`` when it is not that."""
    fd = os.open(local.path, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0))
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_size != local.size:
            raise OSError(errno.EIO, f"it changed (now {st.st_size} bytes, expected "
                          f"{local.size})")
        return use(fd)
    finally:
        os.close(fd)


def read_span(local: LocalFile, start: int, end: int) -> bytes:
    """Bytes ``[start, end)`` of a local shard file (a regular file, no link, still of the
    size it was found at). Raises ``OSError`` when they cannot be read in full."""
    data = _open_checked(local, lambda fd: os.pread(fd, end - start, start))
    if len(data) != end - start:
        raise OSError(errno.EIO, "it is shorter than expected")
    return data
