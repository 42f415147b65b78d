"""The one serve path: ranges asked of a source -> each span checked -> applied to a target.

Every byte a load (or an export, or the cooperative exchange) uses moves through
:func:`serve`: it asks one :class:`~dcp_volumes.loading.sources.Source` for planned ranges,
checks each span of what comes back against the manifest here (:func:`check_span`: the one
CRC32C check of the load path; a source without checksums is a store read pinned to the
versions its headers were read from), and hands the spans that pass to the target's
``apply`` (the one place bytes go into tensors). What the source cannot serve, or what
fails its check, is never applied: it is returned (for the next source) or, for the last
source, raised.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from dcp_volumes import errors
from dcp_volumes.loading.needs import Span, check_need, describe
from dcp_volumes.loading.sources import CannotServe, Source, Unserved
from dcp_volumes.transfer.download import Memory, RangeRequest

__all__ = ["Served", "Target", "check_span", "serve"]


class Target(Protocol):
    """Where checked bytes go."""

    def apply(self, span: Any, chunk: memoryview, into: Memory | None) -> None:
        """Use the checked bytes of ``span``. ``into``: the range's memory when the source
        read the bytes straight into it (nothing left to copy), else None."""
        ...


@dataclass
class Served:
    """What :func:`serve` did: the bytes applied, and the spans not served (with why)."""

    nbytes: int = 0
    unserved: list[tuple[Any, CannotServe]] = field(default_factory=list)

    @property
    def failed(self) -> list[Any]:
        """The spans not served, for the next source."""
        return [span for span, _ in self.unserved]


def check_span(span: Span, chunk: memoryview, url: str) -> CannotServe | None:
    """The check of a span's bytes: each of its ``parts`` against its length and CRC32C in
    the manifest (:func:`~dcp_volumes.loading.needs.check_need`); None when they pass."""
    for part in span.parts:
        try:
            check_need(part, chunk[part.start - span.start:part.end - span.start], url)
        except errors.IntegrityError as exc:
            what = (describe(part.reads[0]) if part.reads
                    else f"the item at offset {part.item_offset}")
            return CannotServe(Unserved.DAMAGED, f"{what} fails its checksum", exc)
    return None


def serve(source: Source, ranges: Sequence[RangeRequest], target: Target, *, url: str,
          stop: threading.Event | None = None, last: bool = False) -> Served:
    """Ask ``source`` for ``ranges``; check each span (where the source's bytes need it) and
    apply those that pass to ``target``, as they arrive.

    Args:
        last: no other source can serve what this one cannot: raise its error at once.
        stop: set by another thread when the work is abandoned: return at once, leaving
            nothing for another source.

    Raises:
        DCPVolumesError: with ``last``, the error of the first span not served.
    """
    out = Served()
    for rng, got in source.serve(ranges, stop):
        if stop is not None and stop.is_set():
            return Served(out.nbytes)
        for span, chunk in _spans(rng, got):
            failure = (chunk if isinstance(chunk, CannotServe)
                       else check_span(span, chunk, url) if source.needs_check else None)
            if failure is not None:
                if last:
                    raise failure.error
                out.unserved.append((span, failure))
                continue
            assert not isinstance(chunk, CannotServe)
            target.apply(span, chunk, rng.into)
            out.nbytes += len(chunk)
    return out


def _spans(rng: RangeRequest, got: Any) -> Iterator[tuple[Any, memoryview | CannotServe]]:
    """Each span of a range with its bytes (or with why the range was not served)."""
    if isinstance(got, CannotServe):
        for span in rng.items:
            yield span, got
        return
    view = memoryview(got)
    for span in rng.items:
        yield span, view[span.start - rng.start:span.end - rng.start]
