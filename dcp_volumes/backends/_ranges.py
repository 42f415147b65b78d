"""What the answer to a GET must be before a byte of its body is used.

A store, or a proxy in front of it, may ignore ``Range`` (200 with the whole object), serve
another range than the one asked (its ``Content-Range`` names it), or end a body before the
length its head announced (a connection dropped midway). A plain torch checkpoint has no
checksums, so nothing later would tell those bytes from the right ones: each store's raw read
describes what came back as a :class:`RangeAnswer` and uses its body only as
:meth:`RangeAnswer.expected` allows.

- Another status, another range, another announced length:
  :class:`~dcp_volumes.errors.RangeMismatchError`, not retried (asking again gets the same
  answer). A range that ends at the object's end, earlier than asked, is an honest answer
  (``bytes a-(size-1)/size``): the object is shorter, which the caller's checks report.
- A body that ends early: :class:`~dcp_volumes.errors.ShortBodyError`, retried at the choke
  point (:func:`~dcp_volumes.backends.translate.is_transient`).

Messages name the object, the range asked and what came back (status, ``Content-Range``,
``Content-Length``), never payload bytes.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from dcp_volumes import errors
from dcp_volumes.backends.translate import is_connection_error, redact_url

__all__ = ["RangeAnswer", "asked_range", "check_read", "range_header", "read_body", "read_into"]

_CONTENT_RANGE = re.compile(r"\s*bytes\s+(\d+)-(\d+)/(\d+|\*)\s*", re.IGNORECASE)
_RANGE = re.compile(r"\s*bytes=(\d+)-(\d*)\s*", re.IGNORECASE)


def range_header(start: int, end: int | None) -> str:
    """The ``Range`` value asking for bytes ``[start, end)`` (to the end: ``end=None``)."""
    return f"bytes={start}-{'' if end is None else end - 1}"


def asked_range(value: str | None) -> tuple[int | None, int | None]:
    """``(start, end)`` a ``Range`` value asks for (``end`` exclusive, None: to the end);
    ``(None, None)``: no range (or one of another form: the whole object is what is checked)."""
    m = _RANGE.fullmatch(value or "")
    if m is None:
        return None, None
    return int(m.group(1)), int(m.group(2)) + 1 if m.group(2) else None


def _content_range(value: str | None) -> tuple[int, int, int | None] | None:
    """``(first, last, total)`` of a ``Content-Range`` value (``total`` None for ``*``)."""
    m = _CONTENT_RANGE.fullmatch(value or "")
    if m is None:
        return None
    total = None if m.group(3) == "*" else int(m.group(3))
    return int(m.group(1)), int(m.group(2)), total


@dataclass(frozen=True, kw_only=True)
class RangeAnswer:
    """What came back for a GET of bytes ``[start, end)`` of ``url`` (``start`` and ``end``
    None: the whole object; ``end`` None: to the end), before its body is read."""

    url: str
    start: int | None
    end: int | None
    status: int
    content_range: str | None
    content_length: int | None

    @property
    def asked(self) -> str:
        if self.start is None and self.end is None:
            return "the whole object"
        first = self.start or 0
        return f"bytes {first}-{'' if self.end is None else self.end - 1}"

    def came(self) -> str:
        """The answer in words: status, Content-Range, Content-Length."""
        # a header of an untrusted answer: quoted, and cut to what a range can need
        cr = (f"Content-Range {self.content_range[:80]!r}" if self.content_range
              else "no Content-Range")
        cl = ("no Content-Length" if self.content_length is None
              else f"Content-Length {self.content_length}")
        return f"HTTP {self.status}, {cr}, {cl}"

    def expected(self) -> int | None:
        """The length the body must have (None: a whole object of unannounced length).

        Raises:
            RangeMismatchError: the answer is not the bytes asked for.
        """
        if self.status == 200:
            return self._whole()
        if self.status == 206:
            return self._partial()
        raise self.mismatch(f"HTTP {self.status} is not an answer with a body to a GET")

    def _whole(self) -> int | None:
        """A 200: the whole object, which must be what was asked (from 0 to past its end)."""
        length = self.content_length
        if self.start is None and self.end is None:
            return length
        if (self.start or 0) == 0 and (self.end is None
                                       or (length is not None and self.end >= length)):
            return length
        raise self.mismatch("the store sent the whole object: it, or a proxy in front of it, "
                             "ignores Range")

    def _partial(self) -> int:
        """A 206: its Content-Range must be the range asked, or that range cut at the
        object's end (the object is shorter), and its Content-Length that range's length."""
        parsed = _content_range(self.content_range)
        if parsed is None:
            raise self.mismatch("a partial answer must name its range")
        first, last, total = parsed
        start = self.start or 0
        exact = self.end is not None and last + 1 == self.end and (total is None
                                                                   or total >= self.end)
        at_end = (total is not None and last + 1 == total
                  and (self.end is None or self.end > total))
        if first != start or last < first or not (exact or at_end):
            raise self.mismatch("the store sent another range than the one asked")
        length = last - first + 1
        if self.content_length is not None and self.content_length != length:
            raise self.mismatch("its length is not that of its range")
        return length

    def mismatch(self, why: str) -> errors.RangeMismatchError:
        """The error of this answer, which is not the bytes asked for (``why``)."""
        return errors.RangeMismatchError(
            f"GET of {self.asked} of {redact_url(self.url)} was answered with {self.came()}: "
            f"{why}. Its bytes are not used; a store or proxy that does not honour HTTP Range "
            "cannot serve ranged reads (read from the store directly, or fix the proxy)")

    def short(self, got: int | None, expected: int | None) -> errors.ShortBodyError:
        """The error of a body that ended after ``got`` bytes (None: unknown) of
        ``expected``."""
        of = f" of {expected}" if expected is not None else ""
        ended = f"after {got}{of} bytes" if got is not None else "early"
        return errors.ShortBodyError(
            f"GET of {self.asked} of {redact_url(self.url)} ({self.came()}) ended {ended}: "
            "the connection closed before the body was complete")

    def check_length(self, got: int, expected: int | None) -> None:
        """Raise unless a body of ``got`` bytes is the ``expected`` one."""
        if expected is None or got == expected:
            return
        if got < expected:
            raise self.short(got, expected)
        raise self.mismatch(f"its body had {got} bytes, more than its {expected}")


def check_read(url: str, start: int | None, end: int | None, got: int) -> None:
    """A filesystem's read of bytes ``[start, end)`` that returned ``got`` bytes (no HTTP
    answer to look at): more than asked is a store that ignored the range."""
    if start is None or end is None or got <= end - start:
        return
    raise errors.RangeMismatchError(
        f"GET of bytes {start}-{end - 1} of {redact_url(url)} returned {got} bytes, more "
        f"than the {end - start} asked: the store, or a proxy in front of it, ignores Range. "
        "Its bytes are not used; read from the store directly, or fix the proxy")


async def read_body(content: Any, answer: RangeAnswer) -> bytes:
    """The bytes of an aiohttp body (``content``: its ``StreamReader``) that ``answer``
    announced.

    Raises:
        RangeMismatchError: ``answer`` is not the bytes asked for (nothing is read).
        ShortBodyError: the body ended early (the connection dropped: retried).
    """
    pieces: list[bytes] = []
    await _read(content, answer, pieces.append)
    return b"".join(pieces)


async def read_into(content: Any, answer: RangeAnswer, out: memoryview) -> int:
    """Read an aiohttp body that ``answer`` announced into ``out``, each piece the client
    received copied once (no joined bytes object); returns how many bytes arrived (fewer
    than ``len(out)`` only where the object ends earlier). Raises as :func:`read_body`."""
    expected = answer.expected()
    if expected is not None and expected > len(out):
        raise answer.mismatch(f"it announces {expected} bytes, more than the {len(out)} asked")
    n = 0

    def put(chunk: bytes) -> None:
        nonlocal n
        take = min(len(chunk), len(out) - n)
        out[n:n + take] = memoryview(chunk)[:take]
        n += take
        if take < len(chunk):
            raise answer.mismatch(f"its body had more than the {len(out)} bytes asked")

    return await _read(content, answer, put)


async def _read(content: Any, answer: RangeAnswer, put: Callable[[bytes], object]) -> int:
    """Hand each received piece of the body to ``put``; returns the body's length once it
    is checked against ``answer``."""
    expected = answer.expected()
    n = 0
    try:
        while True:
            # readchunk hands over each received piece as it is (read(n) would join the
            # pieces buffered so far into a new bytes object first: a second copy)
            chunk, _ = await content.readchunk()
            if not chunk:
                break
            put(chunk)
            n += len(chunk)
    except Exception as exc:
        if is_connection_error(exc):
            raise answer.short(n, expected) from exc
        raise
    answer.check_length(n, expected)
    return n
