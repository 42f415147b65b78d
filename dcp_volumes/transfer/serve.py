"""The one serve path for stored bytes: planned ranges -> fetch from the store, or read from
a local file -> check -> apply.

The reader (direct reads), the local tier, the cooperative owner and ``verify`` all move
their bytes through here; what differs between them is what "check" and "apply" do and
what a failure means, passed in as functions. A range's ``items`` are the caller's spans
(a :class:`~dcp_volumes.transfer.readplan.Need`, a cooperative bundle): each is checked
before it is applied, and a span that fails its check is never applied.

- :func:`check_store` checks every range against its object's size before any GET, with
  :func:`missing_object` / :func:`truncated_object` as the errors.
- :func:`serve_store` fetches the ranges (concurrent ranged GETs, bounded memory) and
  checks and applies each span as its range arrives.
- :func:`serve_local` reads ranges from local files the same way; what cannot be read or
  fails its check is returned, for the store.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from dcp_volumes import errors
from dcp_volumes.backends import Backend, CallStats
from dcp_volumes.transfer.download import RangeRequest, check_extents, fanout_chunk, fetch_ranges
from dcp_volumes.transfer.readplan import check_need, describe

__all__ = ["Served", "check_store", "missing_object", "serve_local", "serve_store",
           "truncated_object"]

#: ``check(span, chunk)``: raises ``IntegrityError`` when the bytes are not the span's
Check = Callable[[Any, memoryview], None]
#: ``apply(span, chunk)``: use the checked bytes of a span
Apply = Callable[[Any, memoryview], None]


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


def check_store(backend: Backend, ranges: list[RangeRequest], url: str,
                sizes: Mapping[str, int] | None = None) -> None:
    """Every range against its object's size, before any GET: the manifest's (``sizes``),
    else one size lookup per file.

    Raises:
        IntegrityError: an object is missing (:func:`missing_object`), or shorter than a
            range needs (:func:`truncated_object`).
    """
    if ranges:
        check_extents(backend, ranges, lambda rng, _exc: missing_object(url, rng),
                      lambda rng, size: truncated_object(url, rng, size), sizes)


def serve_store(
    backend: Backend,
    ranges: list[RangeRequest],
    *,
    url: str,
    apply: Apply | None,
    max_concurrency: int,
    chunk_size: int,
    stats: CallStats,
    check: Check | None = None,
    on_missing: Callable[[RangeRequest, BaseException], BaseException] | None = None,
    stop: threading.Event | None = None,
    progress: Callable[[int, int], None] | None = None,
) -> int:
    """Fetch ``ranges`` from the store; check, then apply, each span as its range arrives.

    Args:
        check: checks a span's bytes (default: :func:`~dcp_volumes.transfer.readplan.
            check_need` against ``url``'s manifest entry, raising ``IntegrityError``).
        apply: gets each span's checked bytes (None: checking is all).
        on_missing: the error for an object deleted while fetching (default:
            :func:`missing_object`).
        stop: set by another thread when the work is abandoned: the rest is not fetched.
        progress: ``progress(bytes_done, bytes_total)`` after each range.

    Returns:
        The bytes fetched.
    """
    if check is None:
        def check(span: Any, chunk: memoryview) -> None:
            check_need(span, chunk, url)
    total = sum(r.end - r.start for r in ranges)
    fetched = 0
    for rng, payload in fetch_ranges(
            backend, ranges, max_concurrency=max_concurrency,
            chunk_size=fanout_chunk(total, max_concurrency, chunk_size),
            stats=stats,
            on_missing=on_missing or (lambda rng, _exc: missing_object(url, rng))):
        if stop is not None and stop.is_set():
            break  # abandoned: the generator cancels the rest
        fetched += len(payload)
        view = memoryview(payload)
        for span in rng.items:
            chunk = view[span.start - rng.start:span.end - rng.start]
            check(span, chunk)
            if apply is not None:
                apply(span, chunk)
        if progress is not None:
            progress(fetched, total)
    return fetched


@dataclass
class Served:
    """What :func:`serve_local` did: the bytes applied, and the spans left to the store."""

    nbytes: int = 0
    failed: list[Any] = field(default_factory=list)


def serve_local(
    ranges: Sequence[RangeRequest],
    read: Callable[[RangeRequest], bytes | bytearray | memoryview],
    *,
    check: Check,
    apply: Apply,
    unreadable: Callable[[RangeRequest, OSError], None],
    bad: Callable[[Any, errors.IntegrityError], None],
    stop: threading.Event | None = None,
) -> Served:
    """Read ``ranges`` from local files (``read(range)``: its bytes, or ``OSError``), check
    each span exactly as a store read is checked, and apply those that pass.

    A range that cannot be read leaves all its spans to the store (``unreadable(range,
    error)`` is told, e.g. to log it); a span that fails its check is never applied and is
    left to the store (``bad(span, error)``). Either callback may raise instead (no store
    to fall back to). ``stop``: once set, return at once, leaving nothing to the store (the
    work was abandoned).
    """
    out = Served()
    for rng in ranges:
        if stop is not None and stop.is_set():
            return Served(out.nbytes)
        try:
            data = read(rng)
        except OSError as exc:
            unreadable(rng, exc)
            out.failed.extend(rng.items)
            continue
        view = memoryview(data)
        for span in rng.items:
            chunk = view[span.start - rng.start:span.end - rng.start]
            try:
                check(span, chunk)
            except errors.IntegrityError as exc:
                bad(span, exc)
                out.failed.append(span)
                continue
            apply(span, chunk)
            out.nbytes += len(chunk)
    return out
