"""Where a load's bytes come from: *sources* that serve byte ranges of a checkpoint's objects.

A source is asked for planned ranges (:class:`~dcp_volumes.transfer.download.RangeRequest`)
and answers each, in any order, with its bytes or with a typed :class:`CannotServe`
(missing, changed, damaged, unreadable) — never with text to parse, and never by raising
for a range it merely cannot serve (a source raises only what no other source could help
with: no credentials, the store unreachable). The serve path (:mod:`dcp_volumes.loading.serve`)
checks and applies what they serve, and hands what one cannot serve to the next.

- :class:`StoreSource`: the object store, through concurrent ranged GETs (a read pinned to
  the object versions a header was read from, where the caller pinned them).
- :class:`LocalTierSource`: this node's local tier (the committed save's files found there
  by :func:`dcp_volumes.tier.find_local`), a regular file of the size found, no link.
- The peer (the cooperative exchange) and a safetensors directory: the bytes another rank
  sent (:mod:`dcp_volumes.loading.cooperative.exchange`), and the store read pinned to the
  versions of the files whose headers were read (:class:`StoreSource` with ``pins``).
"""

from __future__ import annotations

import concurrent.futures
import enum
import os
import stat
import threading
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from dcp_volumes import errors
from dcp_volumes.backends import Backend, CallStats
from dcp_volumes.backends.versions import ObjectVersion
from dcp_volumes.loading.needs import describe
from dcp_volumes.tier import LocalFile
from dcp_volumes.transfer.download import RangeRequest, check_extents, fanout_chunk, fetch_ranges

__all__ = ["CannotServe", "LocalTierSource", "Payload", "Source", "StoreSource", "Unserved",
           "missing_object", "truncated_object"]


class Unserved(enum.Enum):
    """Why a source cannot serve a range."""

    MISSING = "missing"  # the object is not there (or not held by this source)
    CHANGED = "changed"  # the object is not the one planned from (size, version, a link)
    DAMAGED = "damaged"  # its bytes fail their check
    UNREADABLE = "unreadable"  # the source could not read it (an I/O error)


@dataclass(frozen=True)
class CannotServe:
    """A source's typed answer for a range (or a span) it cannot serve.

    ``why`` is for people (a WARNING when another source serves it instead); ``error`` is
    what the load raises when no source can serve it.
    """

    reason: Unserved
    why: str
    error: errors.DCPVolumesError


#: what a source answers for one range
Payload = bytes | bytearray | memoryview | CannotServe


class Source(Protocol):
    """Serves planned byte ranges of a checkpoint's objects (see the module docstring)."""

    #: whether the serve path checks this source's bytes (False only for bytes that were
    #: checked where they were read: a peer's bytes, checked by the rank that read them)
    needs_check: bool

    def serve(self, ranges: Sequence[RangeRequest], stop: threading.Event | None = None
              ) -> Iterator[tuple[RangeRequest, Payload]]:
        """Each of ``ranges`` with its bytes or why not, as they come. A range whose
        ``into`` is set is read into that :class:`~dcp_volumes.loading.apply.DirectTarget`'s
        memory where the source can (the payload is then that memory). ``stop``: set by
        another thread when the work is abandoned: the rest is not served."""
        ...


# ---- the store ----------------------------------------------------------------------------

def _needed_for(span: Any) -> str | None:
    """The read item a span is for, described (None for a span that names none)."""
    reads = getattr(span, "reads", None)
    return describe(reads[0]) if reads else None


def missing_object(url: str, rng: RangeRequest) -> errors.IntegrityError:
    """The error for a range whose object is not in the store."""
    what = _needed_for(rng.items[0]) if rng.items else None
    needed = f" (needed for {what})" if what else ""
    return errors.IntegrityError(
        f"shard {rng.relative} of {url} is missing{needed}: the checkpoint is damaged or was "
        "replaced while loading"
    )


def truncated_object(url: str, rng: RangeRequest, size: int) -> errors.IntegrityError:
    """The error for a range that ends after its object (``size`` bytes) does."""
    last = max(rng.items, key=lambda s: s.end) if rng.items else None
    what = _needed_for(last) if last is not None else None
    needs = (f"{what} needs bytes up to {last.end}" if what and last is not None
             else f"bytes up to {rng.end} are needed")
    return errors.IntegrityError(
        f"shard {rng.relative} of {url} is truncated or its metadata is damaged: {needs}, "
        f"the object has {size}"
    )


class StoreSource:
    """The object store: concurrent ranged GETs with bounded memory.

    Args:
        backend: the checkpoint's store.
        url: the checkpoint's URL, for messages (redacted).
        max_concurrency, chunk_size: GETs in flight, and the size a large range is split in.
        stats: where the requests are counted.
        pins: object versions to read (a read of an object that is no longer that version
            is answered ``CHANGED``); None: whatever is stored.
        sizes: the objects' sizes from the checked manifest (no size lookup for them in
            :meth:`check`); None: one lookup per object.
    """

    needs_check = True

    def __init__(self, backend: Backend, url: str, *, max_concurrency: int, chunk_size: int,
                 stats: CallStats, pins: Mapping[str, ObjectVersion] | None = None,
                 sizes: Mapping[str, int] | None = None) -> None:
        self.backend = backend
        self.url = url
        self.max_concurrency = max_concurrency
        self.chunk_size = chunk_size
        self.stats = stats
        self.pins = pins
        self.sizes = sizes
        #: bytes fetched so far
        self.fetched = 0

    def check(self, ranges: Sequence[RangeRequest]) -> None:
        """Every range against its object's size, before any GET: the manifest's
        (``sizes``), else one size lookup per file.

        Raises:
            IntegrityError: an object is missing (:func:`missing_object`), or shorter than a
                range needs (:func:`truncated_object`).
        """
        if not ranges:
            return
        failed = check_extents(self.backend, list(ranges), self.sizes)
        if failed is not None:
            rng, size = failed
            raise (missing_object(self.url, rng) if size is None
                   else truncated_object(self.url, rng, size))

    def serve(self, ranges: Sequence[RangeRequest], stop: threading.Event | None = None
              ) -> Iterator[tuple[RangeRequest, Payload]]:
        total = sum(r.end - r.start for r in ranges)
        for rng, got in fetch_ranges(
                self.backend, list(ranges), max_concurrency=self.max_concurrency,
                chunk_size=fanout_chunk(total, self.max_concurrency, self.chunk_size),
                stats=self.stats, pins=self.pins):
            if stop is not None and stop.is_set():
                return  # abandoned: the generator cancels the rest
            if isinstance(got, errors.CheckpointChangedError):
                yield rng, CannotServe(Unserved.CHANGED, "it changed", got)
            elif isinstance(got, errors.ObjectNotFoundError):
                yield rng, CannotServe(Unserved.MISSING, "it is missing",
                                       missing_object(self.url, rng))
            else:
                self.fetched += len(got)
                yield rng, got


# ---- the local tier -----------------------------------------------------------------------

#: threads reading whole tensors from the tier into their targets
_READ_THREADS = max(2, min(4, os.cpu_count() or 1))


class LocalTierSource:
    """This node's local tier: the committed save's files found there (``files``, by
    relative path, at the size the committed manifest names). A file that is gone, is no
    longer a regular file of that size, or reads short is not served (``CHANGED``), nor one
    that cannot be read (``UNREADABLE``); a range of a file it does not hold is ``MISSING``.
    Ranges read into their targets (``into``) are read on a few threads: reads release the
    GIL, so one file's read overlaps another's check."""

    needs_check = True

    def __init__(self, files: Mapping[str, LocalFile], url: str) -> None:
        self.files = files
        self.url = url

    def serve(self, ranges: Sequence[RangeRequest], stop: threading.Event | None = None
              ) -> Iterator[tuple[RangeRequest, Payload]]:
        into = [r for r in ranges if r.into is not None]
        rest = [r for r in ranges if r.into is None]
        if len(into) > 1:
            workers = min(len(into), _READ_THREADS)
            with concurrent.futures.ThreadPoolExecutor(workers, "dcpv-tier-read") as pool:
                yield from zip(into, pool.map(self.read, into))
        else:
            yield from ((r, self.read(r)) for r in into)
        for rng in rest:
            if stop is not None and stop.is_set():
                return
            yield rng, self.read(rng)

    def read(self, rng: RangeRequest) -> Payload:
        """The bytes of one range (into its target's memory when ``rng.into`` is set)."""
        local = self.files.get(rng.relative)
        if local is None:
            return self._cannot(rng, Unserved.MISSING, "this node does not hold it")
        try:
            fd = os.open(local.path, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0))
        except OSError as exc:
            return self._cannot(rng, Unserved.UNREADABLE, f"it cannot be read ({exc.strerror})")
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode) or st.st_size != local.size:
                return self._cannot(rng, Unserved.CHANGED, f"it changed (now {st.st_size} "
                                    f"bytes, expected {local.size})")
            view = (rng.into.bytes_view() if rng.into is not None
                    else memoryview(bytearray(rng.end - rng.start)))
            if _pread_all(fd, view, rng.start) < len(view):
                return self._cannot(rng, Unserved.CHANGED, "it is shorter than expected")
            return view
        except OSError as exc:
            return self._cannot(rng, Unserved.UNREADABLE, f"it cannot be read ({exc.strerror})")
        finally:
            os.close(fd)

    def _cannot(self, rng: RangeRequest, reason: Unserved, why: str) -> CannotServe:
        return CannotServe(reason, why, errors.IntegrityError(
            f"the local copy of shard {rng.relative} of {self.url} cannot be used: {why}"))


def _pread_all(fd: int, view: memoryview, offset: int) -> int:
    """Read ``len(view)`` bytes at ``offset`` into ``view``; returns how many were read
    (fewer only at the end of the file)."""
    done = 0
    while done < len(view):
        n = os.preadv(fd, [view[done:]], offset + done)
        if n <= 0:
            break
        done += n
    return done
